"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), by global FQN, in any layout.

``save(path, runner, optimizer, step)`` writes one DCP checkpoint from every rank: each rank's
parameter shards as DTensors on a ``("pp", "dp", "tp")`` device mesh (``Shard(dim)`` on tp,
``Replicate`` elsewhere), so DCP records which slice of which global tensor each rank holds and
writes every slice once. ``load(path, runner, optimizer)`` reads the slices this rank needs under
*its* layout, whatever the layout that saved them (tp=2 × pp=2 → pp=4, dp=4, tp=4, one device).
``export_state_dict(path)`` rebuilds the plain single-device state dict of the original model
(no process group needed). A ZeRO-1 optimizer's state is saved by the dp rank that holds it
and loaded by the one that owns it now. See docs/checkpoint.md for the format and the rules.

Keys, all by the model's global FQN:

    transformer.h.0.mlp.c_fc.weight                 a parameter (whole, or Shard(dim) over tp)
    transformer.h.0.attn.c_attn.weight::block1      block 1 of a fused (strided) parameter
    transformer.h.0.attn.bias                       a buffer the graph reads (for export only)
    optim/transformer.h.0.mlp.c_fc.weight/exp_avg   optimizer state, laid out like its parameter
    optim/transformer.h.0.mlp.c_fc.weight/step      a scalar optimizer state
    rng/rank00003                                   rank 3's torch CPU generator state
    autopart.json                                   step, extra, mesh, tied names, fused blocks…
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import warnings
import weakref
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from autopart.errors import AutopartError, wait
from autopart.program.format import Shard

FORMAT = 2
INFO = "autopart.json"  # written last, by rank 0: a folder without it is an incomplete checkpoint
_MESHES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

# What a step folder may hold, by allow-list (see docs/security-checkpoints.md):
_METADATA = ".metadata"  # DCP's own pickled metadata: hashed with the rest, never read
_SHARD = re.compile(r"__(0|[1-9][0-9]{0,8})_(0|[1-9][0-9]{0,8})\.distcp")  # FileSystemWriter's
_STEP = re.compile(r"step([0-9]{1,18})")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RNG = re.compile(r"rng/rank[0-9]{5,9}")
_STATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_BLOCK = re.compile(r"(.+)::block(0|[1-9][0-9]{0,8})")
_DTYPES = MappingProxyType(
    {
        "float64": torch.float64,
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int64": torch.int64,
        "int32": torch.int32,
        "uint8": torch.uint8,
        "bool": torch.bool,
    }
)
_MARKER_KEYS = frozenset(
    {
        "format",
        "step",
        "runner_steps",
        "seed",
        "extra",
        "mesh",
        "plan",
        "tied",
        "strided",
        "buffers",
        "optimizer",
        "tensors",
        "files",
        "sha256",
    }
)
_CHUNK_KEYS = frozenset({"offsets", "sizes", "file", "byte_offset", "byte_length"})
_RECORDS = frozenset(  # the records of one tensor's torch.save zip (under its one folder)
    {
        "data.pkl",
        "data/0",
        "byteorder",
        "version",
        ".format_version",
        ".storage_alignment",
        ".data/serialization_id",
        ".data/version",
    }
)
_BIG = 2**48  # no size, offset or count in a checkpoint is larger
_MAX_DIMS = 16
_MAX_MARKER = 256 << 20  # bytes of autopart.json
_READ = 8 << 20  # bytes per read while hashing
_DAMAGED = (
    "the checkpoint is damaged, or was not written by autopart's save; resume from another step"
)


# -- keys --------------------------------------------------------------------------------------


def key(fqn: str, block: int | None = None, state: str | None = None) -> str:
    """The DCP key of a parameter (``block``: of a fused parameter; ``state``: optimizer)."""
    base = fqn if block is None else f"{fqn}::block{block}"
    return base if state is None else f"optim/{base}/{state}"


def _rng_key(rank: int) -> str:
    return f"rng/rank{rank:05d}"


def _is_model_key(k: str) -> bool:
    return not k.startswith(("optim/", "rng/"))


# -- public API --------------------------------------------------------------------------------


def save(
    path: str | Path,
    runner: Any,
    optimizer: torch.optim.Optimizer | None = None,
    step: int = 0,
    extra: dict[str, Any] | None = None,
    *,
    tied: dict[str, str] | None = None,
) -> Path:
    """Write a checkpoint of ``runner`` (and ``optimizer``'s state) to ``path``; every rank calls it.

    ``step`` is the data position (steps done), ``extra`` any JSON-able dict (returned by
    ``load``), ``tied`` the model's tied aliases ``{alias: canonical FQN}`` (``plan.json``'s
    ``tied``) so that ``export_state_dict`` can give them back. Returns once the checkpoint is
    complete on every rank. An existing checkpoint at ``path`` is replaced. The marker
    (``autopart.json``, written last) records every tensor's chunks and every file's size and
    SHA-256, and is sealed with its own SHA-256.
    """
    _need_dist("save")
    path = Path(path)
    rng = torch.get_rng_state()  # first: nothing below may draw from the generator before it
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise AutopartError(
            f"rank {runner.rank}: checkpoint extra is not JSON-able: {exc}",
            hint="pass plain numbers, strings, lists and dicts",
        ) from None
    _mesh(runner)  # collective the first time: every rank, whatever it holds
    state = _model_state(runner)
    if optimizer is not None:
        state.update(_optim_state(runner, optimizer))
    state[_rng_key(runner.rank)] = rng
    _check_dtypes(state, runner.rank)
    mine = {
        "strided": {
            f: [s.dim, s.strided] for f, s in runner.program.shards.items() if s.strided > 1
        },
        "buffers": sorted(_buffer_names(runner)),
    }
    if runner.rank == 0:
        _clear(path)
    every = _all_gather_json(mine, runner, "checkpoint layout exchange")  # also: path is clear
    try:
        written = dcp.save(state, storage_writer=_Writer(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
        raise AutopartError(
            f"rank {runner.rank}: saving the checkpoint {path} (step {step}) failed: {_why(exc)}",
            hint="check free disk space and that every rank can write there; the unfinished "
            "step has no marker and is never resumed",
        ) from exc
    files = _all_gather_json(_own_files(path, runner.rank), runner, "checkpoint file digests")
    if runner.rank == 0:
        info = {
            "format": FORMAT,
            "step": int(step),
            "runner_steps": int(runner.steps),
            "seed": int(runner.seed),
            "extra": extra or {},
            "mesh": {d: getattr(runner.plan.mesh, d) for d in ("pp", "dp", "tp")},
            "plan": runner.plan.to_json(),
            "tied": dict(tied or {}),
            "strided": {f: v for m in every for f, v in m["strided"].items()},
            "buffers": sorted({b for m in every for b in m["buffers"]}),
            "optimizer": _optim_info(optimizer),
            "tensors": _tensors_json(written, path),
            "files": {n: e for m in files for n, e in sorted(m.items())},
        }
        info["sha256"] = _digest(info)
        _check_marker(info, path / INFO)  # what this save writes, the load accepts
        tmp = path / f".{INFO}.tmp"
        with open(tmp, "w") as f:  # DCP has fsynced its files (sync_files); the marker last
            f.write(json.dumps(info, indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / INFO)  # atomic: the checkpoint is complete from here on
        _fsync_dir(path)
    _barrier(runner, "the end of the checkpoint save")
    return path


def load(
    path: str | Path,
    runner: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    fresh_optimizer: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint saved under any layout into this rank's shards (and ``optimizer``).

    Every rank calls it. Restores ``runner.steps`` (dropout seeds) and, when the checkpoint was
    saved on the same mesh, this rank's torch RNG state. Every file a rank reads is checked
    against the SHA-256 in the marker first. An optimizer whose state the checkpoint lacks
    (saved without one) is refused unless ``fresh_optimizer``; with ``fresh_optimizer`` the
    optimizer's state is never loaded (it starts afresh). Returns ``{"step", "extra", "seed",
    "mesh", "same_layout"}``.
    """
    _need_dist("load")
    path = Path(path)
    info = read_info(path)
    reader = _Reader(path, info)
    meta = reader.state
    _mesh(runner)  # collective the first time: every rank, whatever it holds
    rank, program = runner.rank, runner.program
    mesh_now = {d: getattr(runner.plan.mesh, d) for d in ("pp", "dp", "tp")}
    strided = {f: tuple(v) for f, v in info["strided"].items()}
    missing = [
        f for f in runner.params if not all(k in meta for k in _saved_keys(f, strided.get(f)))
    ]
    if missing:
        have = sorted({k.split("::")[0] for k in meta if _is_model_key(k)})
        raise AutopartError(
            f"rank {rank}: checkpoint {path} has no entry for {len(missing)} of this rank's "
            f"{len(runner.params)} parameters: {', '.join(missing[:5])}"
            + (" …" if len(missing) > 5 else ""),
            hint=f"it was saved from a different model (it holds e.g. {', '.join(have[:3])}); "
            "load a checkpoint of this model",
        )
    use_optim = optimizer is not None and not fresh_optimizer
    _same_model(path, runner, optimizer if use_optim else None, info, meta)
    if use_optim and info["optimizer"] is None:
        raise AutopartError(
            f"rank {rank}: checkpoint {path} (step {info['step']}) holds no optimizer state (it "
            f"was saved without an optimizer, e.g. by --no-optim); resuming "
            f"{type(_holder(optimizer)[0]).__name__} from it would silently start its state "
            "from zero",
            hint="ask for fresh optimizer state explicitly (autopart run --fresh-optimizer, "
            "load(..., fresh_optimizer=True)), or resume with --no-optim",
        )
    request: dict[str, Any] = {}
    done: list[Callable[[], None]] = []
    for fqn, p in runner.params.items():
        shard = program.shards[fqn]
        _check_shape(path, rank, fqn, shard, strided.get(fqn), meta)
        want, build = _request(fqn, shard, strided.get(fqn), None, p.dtype, runner)
        request.update(want)
        done.append(lambda p=p, build=build: _copy_into(p, build()))
    if use_optim:
        states = _saved_states(meta)
        holder, owned = _holder(optimizer)
        for fqn, p in runner.params.items():
            names = states.get(fqn, []) if owned is None or id(p) in owned else []
            builds = {}
            for name in names:
                scalar = meta.get(key(fqn, state=name))
                if scalar is not None and len(scalar.size) == 0:
                    t = torch.empty((), dtype=scalar.properties.dtype)
                    request[key(fqn, state=name)] = t
                    builds[name] = lambda t=t: t
                else:
                    keys = _saved_keys(fqn, strided.get(fqn), name)
                    if not all(k in meta for k in keys):
                        raise AutopartError(
                            f"rank {rank}: {path / INFO}: optimizer state {name!r} of {fqn} "
                            f"is neither a scalar nor saved like its parameter ({keys[0]})",
                            hint=_DAMAGED,
                        )
                    md = meta[keys[0]]
                    want, build = _request(
                        fqn,
                        program.shards[fqn],
                        strided.get(fqn),
                        name,
                        md.properties.dtype,
                        runner,
                    )
                    request.update(want)
                    builds[name] = build
            if builds:
                done.append(
                    lambda p=p, b=builds: holder.state.__setitem__(
                        p, {n: f() for n, f in b.items()}
                    )
                )
    rng_key = _rng_key(rank)
    same = info["mesh"] == mesh_now and rng_key in meta
    if same:
        now = torch.get_rng_state()
        if tuple(meta[rng_key].size) != tuple(now.shape):
            raise AutopartError(
                f"rank {rank}: {path / INFO}: {rng_key} holds {tuple(meta[rng_key].size)} "
                f"bytes, but this torch's generator state is {tuple(now.shape)}",
                hint=_DAMAGED,
            )
        rng = torch.empty_like(now)
        request[rng_key] = rng
    _dcp_load(request, reader, f"rank {rank}: ")
    for f in done:
        f()
    if same:
        torch.set_rng_state(rng)
    runner.steps = int(info["runner_steps"])
    return {
        "step": int(info["step"]),
        "extra": info["extra"],
        "seed": int(info["seed"]),
        "mesh": info["mesh"],
        "same_layout": same,
    }


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The single-device state dict of a checkpoint: full tensors by the model's FQNs, tied
    aliases included (sharing the canonical tensor), plus the buffers the graph reads.

    Needs no process group (``model.load_state_dict(export_state_dict(path))``). Every file it
    reads is checked against the SHA-256 in the marker first.
    """
    path = Path(path)
    info = read_info(path)
    reader = _Reader(path, info)
    full = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in reader.state.items()
        if _is_model_key(k)
    }
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        _dcp_load(full, reader, "", no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for k, t in full.items():
        fqn, sep, _ = k.partition("::block")
        if not sep:
            out[fqn] = t
        elif fqn not in out:
            dim, n = info["strided"][fqn]
            out[fqn] = torch.cat([full[key(fqn, j)] for j in range(n)], dim)
    for alias, canonical in info["tied"].items():
        if canonical in out:
            out[alias] = out[canonical]
    return out


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical FQN}`` of a model's tied parameters (what ``save(tied=...)`` takes;
    the same map as ``Captured.tied`` and ``plan.json``'s ``tied``)."""
    first: dict[int, str] = {}
    out = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(p), fqn)
        if canonical != fqn:
            out[fqn] = canonical
    return out


def _same_model(
    path: Path, runner: Any, optimizer: Any, info: dict[str, Any], meta: dict[str, Any]
) -> None:
    """Refuse a checkpoint of another model (parameters this model does not have: a deeper
    model of the same width would otherwise load into a shallower one, its extra blocks
    ignored; other tied weights) or another optimizer, naming the difference. Collective."""
    ours = set().union(*_all_gather_json(sorted(runner.params), runner, "checkpoint model check"))
    saved = {k.split("::")[0] for k in meta if _is_model_key(k)} - set(info.get("buffers", []))
    extra = sorted(saved - ours)
    if extra:
        raise AutopartError(
            f"rank {runner.rank}: checkpoint {path} is of another model: it holds "
            f"{len(extra)} parameters this model does not have: {', '.join(extra[:4])}"
            + (" …" if len(extra) > 4 else ""),
            hint="load a checkpoint saved from this model (same architecture and depth)",
        )
    was = (info.get("optimizer") or {}).get("class")
    now = None if optimizer is None else type(_holder(optimizer)[0]).__name__
    if was not in (None, "ZeroRedundancyOptimizer") and now is not None and was != now:
        raise AutopartError(
            f"rank {runner.rank}: checkpoint {path} holds {was} state, the optimizer now is {now}",
            hint=f"resume with {was}, or start the optimizer afresh (fresh_optimizer=True, "
            "autopart run --fresh-optimizer)",
        )


def read_info(path: str | Path) -> dict[str, Any]:
    """``autopart.json`` of a complete checkpoint, checked: its own SHA-256 seal, every entry
    (allow-listed names, types and ranges; tensor chunks that tile each tensor; shard names of
    the writer's form inside the folder) and every listed file (a regular file of the recorded
    size). Refuses an incomplete, foreign or damaged folder with an ``AutopartError`` naming
    the file. The files' SHA-256 are checked by ``verify``, ``latest`` and on every read."""
    path = Path(path)
    f = path / INFO
    info = _read_marker(f)
    _check_marker(info, f)
    for name, entry in info["files"].items():
        _regular(path / name, entry["size"])
    return info


def verify(path: str | Path) -> dict[str, Any]:
    """``read_info``, then the SHA-256 of every file of the step against the marker's; returns
    the marker. Raises an ``AutopartError`` naming the first file that differs."""
    path = Path(path)
    info = read_info(path)
    for name, entry in sorted(info["files"].items()):
        _check_digest(path / name, entry)
    return info


def latest(
    root: str | Path, runner: Any = None, *, on_skip: Callable[[str], None] | None = None
) -> Path | None:
    """The newest intact checkpoint under ``root`` (``step00000012`` folders): complete (it has
    its marker) and verified (``verify``: every file's size and SHA-256 match the marker's).

    A newer step that fails is reported in one line naming the step and the file (``on_skip``;
    default: a ``UserWarning``) and skipped for the one before. A folder without a marker (an
    unfinished save) is skipped silently. With ``runner`` every rank calls it: rank 0 lists the
    steps, the ranks share the hashing (each file is read by one rank), rank 0 reports, and all
    get the same answer.
    """
    report = on_skip if on_skip is not None else _warn
    root = Path(root)
    if runner is None:
        for d in _steps(root):
            problem = _problem(d, 0, 1)
            if problem is None:
                return d
            report(_skipping(d, problem))
        return None
    listed = [str(d) for d in _steps(root)] if runner.rank == 0 else None
    listed = _all_gather_json(listed, runner, "listing the checkpoints")[0]
    world = dist.get_world_size()
    for d in map(Path, listed):
        problems = _all_gather_json(
            _problem(d, runner.rank, world), runner, f"verifying the checkpoint {d}"
        )
        problem = next((p for p in problems if p is not None), None)
        if problem is None:
            return d
        if runner.rank == 0:
            report(_skipping(d, problem))
    return None


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


def _steps(root: Path) -> list[Path]:
    """The step folders under ``root`` that have a marker, newest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP.fullmatch(d.name)
        if m and d.is_dir() and os.path.lexists(d / INFO):
            found.append((int(m[1]), d))
    return [d for _, d in sorted(found, reverse=True)]


def _problem(step: Path, rank: int, world: int) -> str | None:
    """Why ``step`` cannot be resumed, as far as this rank's share of its files shows."""
    try:
        info = read_info(step)
        for name in sorted(info["files"])[rank::world]:
            _check_digest(step / name, info["files"][name])
    except AutopartError as exc:
        return exc.message
    return None


def _skipping(step: Path, problem: str) -> str:
    m = _STEP.fullmatch(step.name)
    which = f" (step {int(m[1])})" if m else ""
    return f"skipping the damaged checkpoint {step}{which}: {' '.join(problem.split())}"


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def folder(root: str | Path, step: int) -> Path:
    """Where ``autopart.runtime.run`` keeps the checkpoint of ``step`` under ``root``."""
    return Path(root) / f"step{step:08d}"


# -- what each rank saves -----------------------------------------------------------------------


def _mesh(runner: Any) -> Any:
    """The ("pp", "dp", "tp") DeviceMesh of the runner's plan (made once; all ranks call it)."""
    mesh = _MESHES.get(runner)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        m = runner.plan.mesh
        mesh = init_device_mesh("cpu", (m.pp, m.dp, m.tp), mesh_dim_names=("pp", "dp", "tp"))
        _MESHES[runner] = mesh
    return mesh


def _dtensor(local: torch.Tensor, runner: Any, dim: int, shape: tuple[int, ...]) -> Any:
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    mesh = _mesh(runner)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local,
        mesh,
        [Replicate(), Replicate(), DShard(dim)],
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


def _direct(shard: Shard, runner: Any) -> bool:
    """Whether the shard is DTensor Shard(dim) over this mesh's tp dim (it always is when the
    program was compiled for this mesh)."""
    return shard.index == runner.program.coords["tp"] and shard.parts == runner.plan.mesh.tp


def _pieces(
    fqn: str, shard: Shard, local: torch.Tensor, runner: Any, state: str | None = None
) -> dict[str, Any]:
    """The DCP entries of one local tensor laid out like parameter ``fqn``."""
    local = local.detach().contiguous()  # the load reads every record as a contiguous tensor
    if shard.dim is None:
        return {key(fqn, state=state): local}
    if not _direct(shard, runner):
        raise AutopartError(
            f"rank {runner.rank}: {fqn} is slice {shard.index} of {shard.parts}, "
            f"but this rank's tp index is {runner.program.coords['tp']} of {runner.plan.mesh.tp}",
            hint="save from the runner of the program compiled for this mesh",
        )
    if shard.strided == 1:
        return {key(fqn, state=state): _dtensor(local.contiguous(), runner, shard.dim, shard.shape)}
    block = _block_shape(shard.shape, shard.dim, shard.strided)
    return {
        key(fqn, j, state): _dtensor(piece.contiguous(), runner, shard.dim, block)
        for j, piece in enumerate(local.chunk(shard.strided, shard.dim))
    }


def _model_state(runner: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, p in runner.params.items():
        out.update(_pieces(fqn, runner.program.shards[fqn], p, runner))
    for name in _buffer_names(runner):
        out[name] = runner.buffers[name].detach().contiguous()
    return out


def _buffer_names(runner: Any) -> set[str]:
    """The model buffers this rank's stages read (lifted constants are not model state)."""
    return {
        i.name
        for st in runner.program.stages
        for i in st.inputs
        if i.kind == "buffer" and i.name in runner.buffers
    }


def _optim_state(runner: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    known = {id(p) for g in optimizer.param_groups for p in g["params"]}
    holder, _ = _holder(optimizer)
    for fqn, p in runner.params.items():
        if id(p) not in known:
            raise AutopartError(
                f"rank {runner.rank}: the optimizer does not hold parameter {fqn}",
                hint="build the optimizer from runner.parameters()",
            )
        for name, v in holder.state.get(p, {}).items():
            if not isinstance(v, torch.Tensor):
                raise AutopartError(
                    f"rank {runner.rank}: optimizer state {name!r} of {fqn} is a "
                    f"{type(v).__name__}, not a tensor",
                    hint="checkpoints hold tensor states (AdamW, Adam, SGD momentum)",
                )
            if v.dim() == 0:
                out[key(fqn, state=name)] = v.detach().clone().contiguous()
            elif v.shape == p.shape:
                out.update(_pieces(fqn, runner.program.shards[fqn], v, runner, name))
            else:
                raise AutopartError(
                    f"rank {runner.rank}: optimizer state {name!r} of {fqn} has "
                    f"shape {tuple(v.shape)}, neither a scalar nor the parameter's "
                    f"{tuple(p.shape)}",
                    hint="checkpoints hold element-wise states (AdamW, Adam, SGD momentum)",
                )
    return out


def _optim_info(optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    if optimizer is None:
        return None

    def plain(v: Any) -> bool:
        if isinstance(v, (list, tuple)):
            return all(isinstance(x, (int, float)) for x in v)
        return v is None or isinstance(v, (int, float, bool, str))

    groups = [
        {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in g.items()
            if k != "params" and plain(v)
        }
        for g in optimizer.param_groups
    ]
    return {
        "class": type(_holder(optimizer)[0]).__name__,
        "param_groups": groups,
    }  # ZeRO: its inner


def _holder(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, set[int] | None]:
    """The optimizer whose ``state`` holds this rank's optimizer state, and the ids of the
    parameters whose state it holds (None: all). A ZeRO-1 optimizer keeps the state of its
    partition only, in its local optimizer: each dp rank saves the states it owns, and on load
    asks for the states of the parameters it owns now (the partition may have changed)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optim, {id(p) for g in optimizer.optim.param_groups for p in g["params"]}
    return optimizer, None


# -- what each rank loads -----------------------------------------------------------------------


def _saved_keys(fqn: str, saved: tuple[int, int] | None, state: str | None = None) -> list[str]:
    if saved is None:
        return [key(fqn, state=state)]
    return [key(fqn, j, state) for j in range(saved[1])]


def _saved_states(meta: dict[str, Any]) -> dict[str, list[str]]:
    """FQN → the optimizer state names the checkpoint holds for it."""
    out: dict[str, set[str]] = {}
    for k in meta:
        if k.startswith("optim/"):
            base, _, name = k[len("optim/") :].rpartition("/")
            out.setdefault(base.partition("::block")[0], set()).add(name)
    return {f: sorted(v) for f, v in out.items()}


def _block_shape(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    return tuple(d // n if i == dim else d for i, d in enumerate(shape))


def _check_shape(
    path: Path,
    rank: int,
    fqn: str,
    shard: Shard,
    saved: tuple[int, int] | None,
    meta: dict[str, Any],
) -> None:
    if saved is None:
        got = tuple(meta[key(fqn)].size)
    else:
        dim, n = saved
        blocks = [tuple(meta[key(fqn, j)].size) for j in range(n)]
        got = tuple(d * n if i == dim else d for i, d in enumerate(blocks[0]))
    if got != tuple(shard.shape):
        raise AutopartError(
            f"rank {rank}: {fqn} has shape {got} in checkpoint {path}, but "
            f"{tuple(shard.shape)} in this model",
            hint="the checkpoint comes from a model of another size",
        )


def _request(
    fqn: str,
    shard: Shard,
    saved: tuple[int, int] | None,
    state: str | None,
    dtype: torch.dtype,
    runner: Any,
) -> tuple[dict[str, Any], Callable[[], torch.Tensor]]:
    """What to ask DCP for to rebuild this rank's local tensor of ``fqn`` (or of its optimizer
    ``state``), and how to rebuild it. DCP reads just the local slice when the saved and the
    current layouts split the same way (whole or fused blocks); otherwise this rank reads the
    full tensor and cuts its slice (``Shard.local``)."""
    local = shard.local(torch.empty(shard.shape, device="meta"))
    direct = shard.dim is not None and _direct(shard, runner)
    if saved is None:  # saved whole (possibly split over tp)
        if shard.dim is None:
            t = torch.empty(shard.shape, dtype=dtype)
            return {key(fqn, state=state): t}, lambda: t
        if shard.strided == 1 and direct:
            t = torch.empty(local.shape, dtype=dtype)
            return {key(fqn, state=state): _dtensor(t, runner, shard.dim, shard.shape)}, lambda: t
        full = torch.empty(shard.shape, dtype=dtype)
        return {key(fqn, state=state): full}, lambda: shard.local(full)
    dim, n = saved
    block = _block_shape(shard.shape, dim, n)
    if shard.dim == dim and shard.strided == n and direct:
        one = torch.empty(block, device="meta").chunk(shard.parts, dim)[shard.index].shape
        pieces = [torch.empty(one, dtype=dtype) for _ in range(n)]
        want = {key(fqn, j, state): _dtensor(t, runner, dim, block) for j, t in enumerate(pieces)}
        return want, lambda: torch.cat(pieces, dim)
    blocks = [torch.empty(block, dtype=dtype) for _ in range(n)]
    want = {key(fqn, j, state): t for j, t in enumerate(blocks)}
    return want, lambda: shard.local(torch.cat(blocks, dim)).contiguous()


def _copy_into(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_(value)


# -- the marker: what a step holds, sealed ------------------------------------------------------


def _check_dtypes(state: dict[str, Any], rank: int) -> None:
    names = {v: k for k, v in _DTYPES.items()}
    for k, v in state.items():
        if v.dtype not in names:
            raise AutopartError(
                f"rank {rank}: checkpoint entry {k} is {v.dtype}; checkpoints hold "
                f"{', '.join(_DTYPES)}",
                hint="keep parameters, buffers and optimizer state in one of these dtypes",
            )


def _tensors_json(written: Metadata, path: Path) -> dict[str, Any]:
    """The marker's ``tensors``: every entry's dtype, global size and chunks, each chunk with
    its file and byte range, from the metadata that ``dcp.save`` returned."""
    names = {v: k for k, v in _DTYPES.items()}
    out: dict[str, Any] = {}
    for k, md in written.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise AutopartError(f"checkpoint {path}: DCP wrote {k} as {type(md).__name__}")
        chunks = []
        for c in md.chunks:
            where = written.storage_data[MetadataIndex(k, c.offsets)]
            if where.transform_descriptors:
                raise AutopartError(f"checkpoint {path}: DCP transformed {k} on write")
            chunks.append(
                {
                    "offsets": list(c.offsets),
                    "sizes": list(c.sizes),
                    "file": where.relative_path,
                    "byte_offset": where.offset,
                    "byte_length": where.length,
                }
            )
        out[k] = {"dtype": names[md.properties.dtype], "size": list(md.size), "chunks": chunks}
    return out


def _own_files(path: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of the files this rank's ``dcp.save`` wrote (``__{rank}_N.distcp``;
    rank 0 also DCP's ``.metadata``), read back once they are complete."""
    names = [_METADATA] if rank == 0 else []
    for e in path.iterdir():
        m = _SHARD.fullmatch(e.name)
        if m and int(m[1]) == rank:
            names.append(e.name)
    out = {}
    for name in sorted(names):
        fd, size = _open_regular(path / name)
        digest = hashlib.sha256()
        with os.fdopen(fd, "rb") as f:
            while block := f.read(_READ):
                digest.update(block)
        out[name] = {"size": size, "sha256": digest.hexdigest()}
    return out


def _digest(info: dict[str, Any]) -> str:
    """The marker's seal: SHA-256 of its canonical JSON without ``sha256`` itself."""
    body = {k: v for k, v in info.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_marker(f: Path) -> Any:
    path = f.parent
    if not os.path.lexists(f):
        what = (
            "an incomplete checkpoint (its save did not finish)"
            if os.path.lexists(path / _METADATA)
            else "not an autopart checkpoint"
        )
        raise AutopartError(
            f"{path} is {what}: it has no {INFO}",
            hint="point at a folder written by autopart.runtime.checkpoint.save",
        )
    fd, size = _open_regular(f)
    with os.fdopen(fd, "rb") as stream:
        if size > _MAX_MARKER:
            raise AutopartError(f"{f} holds {size} bytes, more than a marker's", hint=_DAMAGED)
        data = stream.read(_MAX_MARKER + 1)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise AutopartError(
            f"{f} is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})", hint=_DAMAGED
        ) from None


def _is_int(v: Any, lo: int = 0, hi: int = _BIG) -> bool:
    return type(v) is int and lo <= v <= hi


def _ints(v: Any, n: int | None = None) -> bool:
    return (
        isinstance(v, list)
        and len(v) <= _MAX_DIMS
        and (n is None or len(v) == n)
        and all(_is_int(x) for x in v)
    )


def _numel(sizes: list[int]) -> int:
    out = 1
    for d in sizes:
        out *= d
    return out


def _check_marker(info: Any, f: Path) -> None:
    """Allow-list every entry of the marker ``f``: raises an ``AutopartError`` naming the entry
    unless the marker is exactly what ``save`` writes (its seal first: a marker whose bytes
    changed after the save is refused before anything in it is used)."""

    def need(ok: bool, where: str, what: str) -> None:
        if not ok:
            raise AutopartError(f"{f}: {where} is not {what}", hint=_DAMAGED)

    need(isinstance(info, dict), "the marker", "a JSON object")
    if info.get("format") != FORMAT:
        got = info.get("format")
        raise AutopartError(
            f"{f} has format {got if _is_int(got) else repr(got)[:40]}, this autopart reads "
            f"{FORMAT}",
            hint="save the checkpoint again with this version (format 2 records every file's "
            "SHA-256)",
        )
    unexpected, absent = sorted(set(info) - _MARKER_KEYS), sorted(_MARKER_KEYS - set(info))
    need(not unexpected and not absent, f"its set of entries ({unexpected or absent})", "save's")
    need(isinstance(info["sha256"], str) and _SHA256.fullmatch(info["sha256"]), "sha256", "a seal")
    if info["sha256"] != _digest(info):
        raise AutopartError(
            f"{f} does not match its own SHA-256 seal: its bytes changed after the save",
            hint=_DAMAGED,
        )
    need(_is_int(info["step"]), "step", "a count")
    need(_is_int(info["runner_steps"]), "runner_steps", "a count")
    need(_is_int(info["seed"], -(2**63), 2**63 - 1), "seed", "a 64-bit integer")
    need(isinstance(info["extra"], dict), "extra", "an object")
    need(isinstance(info["plan"], dict), "plan", "an object")
    mesh = info["mesh"]
    need(
        isinstance(mesh, dict)
        and set(mesh) == {"pp", "dp", "tp"}
        and all(_is_int(v, 1, 2**20) for v in mesh.values()),
        "mesh",
        "{pp, dp, tp}",
    )
    tied = info["tied"]
    need(
        isinstance(tied, dict) and all(isinstance(v, str) for v in tied.values()),
        "tied",
        "{alias: name}",
    )
    need(
        isinstance(info["buffers"], list) and all(isinstance(b, str) for b in info["buffers"]),
        "buffers",
        "a list of names",
    )
    strided = info["strided"]
    need(isinstance(strided, dict), "strided", "an object")
    for fqn, v in strided.items():
        need(
            _ints(v, 2) and v[0] < _MAX_DIMS and 2 <= v[1] <= 2**20 and "::block" not in fqn,
            f"strided → {fqn!r}",
            "[dim, blocks]",
        )
    opt = info["optimizer"]
    need(
        opt is None
        or (
            isinstance(opt, dict)
            and set(opt) == {"class", "param_groups"}
            and isinstance(opt["class"], str)
            and isinstance(opt["param_groups"], list)
        ),
        "optimizer",
        "null or {class, param_groups}",
    )
    files = info["files"]
    need(isinstance(files, dict) and _METADATA in files, "files", "a list of the step's files")
    for name, e in files.items():
        need(
            name == _METADATA or _SHARD.fullmatch(name) is not None,
            f"files → {name!r}",
            "a name DCP's writer gives (__R_N.distcp or .metadata) inside the step folder",
        )
        need(
            isinstance(e, dict)
            and set(e) == {"size", "sha256"}
            and _is_int(e["size"])
            and isinstance(e["sha256"], str)
            and _SHA256.fullmatch(e["sha256"]) is not None,
            f"files → {name!r}",
            "{size, sha256}",
        )
    tensors = info["tensors"]
    need(isinstance(tensors, dict), "tensors", "an object")
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for k, t in tensors.items():
        _check_tensor(k, t, files, strided, need, ranges)
    for name, spans in ranges.items():  # no two records share bytes: bounded by the files
        spans.sort()
        for (a0, a1, ka), (b0, _, kb) in zip(spans, spans[1:], strict=False):
            need(b0 >= a1, f"tensors → {kb!r}", f"apart from {ka!r} in {name} (bytes {a0}-{a1})")
    for k in tensors:  # fused parameters: every block of each one that is there
        fqn, j, state = _parse_key(k)
        if j is not None:
            dim, n = strided[fqn]
            first = tensors.get(key(fqn, 0, state))
            for i in range(n):
                other = tensors.get(key(fqn, i, state))
                need(
                    other is not None
                    and first is not None
                    and other["dtype"] == first["dtype"]
                    and other["size"] == first["size"]
                    and dim < len(first["size"]),
                    f"tensors → {key(fqn, i, state)!r}",
                    f"block {i} of {n} of {fqn} along dim {dim}, like block 0",
                )


def _parse_key(k: str) -> tuple[str, int | None, str | None]:
    """``(fqn, block, state)`` of a checkpoint key (``key``'s inverse; rng keys: ``(k, None,
    None)``)."""
    base, state = k, None
    if k.startswith("optim/"):
        base, _, state = k[len("optim/") :].rpartition("/")
    m = _BLOCK.fullmatch(base)
    return (m[1], int(m[2]), state) if m else (base, None, state)


def _check_tensor(
    k: Any,
    t: Any,
    files: dict[str, Any],
    strided: dict[str, Any],
    need: Callable[[bool, str, str], None],
    ranges: dict[str, list[tuple[int, int, str]]],
) -> None:
    where = f"tensors → {k!r}"
    need(isinstance(k, str) and 0 < len(k) <= 1024 and k.isprintable(), where, "a name")
    fqn, block, state = _parse_key(k)
    need(bool(fqn) and "::block" not in fqn, where, "a parameter, state or rng name")
    if k.startswith("rng/"):
        need(_RNG.fullmatch(k) is not None, where, "rng/rankNNNNN")
    if state is not None:
        need(_STATE_NAME.fullmatch(state) is not None, where, "optim/<name>/<state>")
    if block is not None:
        need(fqn in strided and block < strided[fqn][1], where, "a block of a fused parameter")
    need(
        isinstance(t, dict) and set(t) == {"dtype", "size", "chunks"},
        where,
        "{dtype, size, chunks}",
    )
    need(isinstance(t["dtype"], str) and t["dtype"] in _DTYPES, f"{where} → dtype", "allowed")
    size = t["size"]
    need(_ints(size), f"{where} → size", "a list of sizes")
    if k.startswith("rng/"):
        need(t["dtype"] == "uint8" and len(size) == 1, where, "a generator state")
    chunks = t["chunks"]
    need(isinstance(chunks, list) and 0 < len(chunks) <= 2**16, f"{where} → chunks", "a list")
    itemsize = torch.empty((), dtype=_DTYPES[t["dtype"]]).element_size()
    boxes = []
    for i, c in enumerate(chunks):
        at = f"{where} → chunk {i}"
        need(isinstance(c, dict) and set(c) == set(_CHUNK_KEYS), at, "a chunk")
        offsets, sizes, name = c["offsets"], c["sizes"], c["file"]
        need(
            _ints(offsets, len(size))
            and _ints(sizes, len(size))
            and all(o + n <= d for o, n, d in zip(offsets, sizes, size, strict=True)),
            at,
            f"a slice of {size}",
        )
        need(
            isinstance(name, str) and _SHARD.fullmatch(name) is not None and name in files,
            f"{at} → file {name!r}" if isinstance(name, str) else f"{at} → file",
            "a listed shard of the step folder (a name of DCP's writer, no path)",
        )
        first, length = c["byte_offset"], c["byte_length"]
        need(
            _is_int(first) and _is_int(length) and first + length <= files[name]["size"],
            at,
            f"a byte range of {name}",
        )
        need(_numel(sizes) * itemsize <= length, at, f"large enough for its {_numel(sizes)} items")
        ranges.setdefault(name, []).append((first, first + length, k))
        boxes.append((offsets, sizes))
    total = sum(_numel(s) for _, s in boxes)
    need(total == _numel(size), f"{where} → chunks", f"a tiling of {size} ({total} items)")
    for a in range(len(boxes)):  # disjoint: with the count above, they tile the tensor
        for b in range(a + 1, len(boxes)):
            (oa, sa), (ob, sb) = boxes[a], boxes[b]
            overlap = all(
                x < y + m and y < x + n for x, n, y, m in zip(oa, sa, ob, sb, strict=True)
            )
            need(not overlap or _numel(sa) * _numel(sb) == 0, f"{where} → chunks", "disjoint")


# -- files --------------------------------------------------------------------------------------


def _open_regular(f: Path) -> tuple[int, int]:
    """``(fd, size)`` of ``f`` opened for reading, if it is a regular file and not a symbolic
    link (O_NOFOLLOW: checked by the open itself, not before it)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(f, flags)
    except FileNotFoundError:
        raise AutopartError(f"{f} is missing (the marker lists it)", hint=_DAMAGED) from None
    except OSError as exc:
        what = "a symbolic link" if os.path.islink(f) else f"unreadable ({exc.strerror})"
        raise AutopartError(f"{f} is {what}, not a checkpoint file", hint=_DAMAGED) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise AutopartError(f"{f} is not a regular file", hint=_DAMAGED)
    return fd, st.st_size


def _regular(f: Path, size: int) -> None:
    """``f`` is a regular file (no symbolic link) of ``size`` bytes."""
    try:
        st = os.lstat(f)
    except FileNotFoundError:
        raise AutopartError(f"{f} is missing (the marker lists it)", hint=_DAMAGED) from None
    except OSError as exc:
        raise AutopartError(f"{f} is unreadable ({exc.strerror})", hint=_DAMAGED) from None
    if stat.S_ISLNK(st.st_mode):
        raise AutopartError(f"{f} is a symbolic link, not a checkpoint file", hint=_DAMAGED)
    if not stat.S_ISREG(st.st_mode):
        raise AutopartError(f"{f} is not a regular file", hint=_DAMAGED)
    if st.st_size != size:
        raise AutopartError(
            f"{f} holds {st.st_size} bytes, the marker records {size} (cut short or changed "
            "after the save)",
            hint=_DAMAGED,
        )


def _read_checked(f: Path, entry: dict[str, Any], keep: bool) -> bytearray | None:
    """Read ``f`` and check its size and SHA-256 against the marker's ``entry``; returns its
    bytes when ``keep`` (what a load then parses: the bytes that were checked)."""
    fd, size = _open_regular(f)
    with os.fdopen(fd, "rb", buffering=0) as stream:
        if size != entry["size"]:
            raise AutopartError(
                f"{f} holds {size} bytes, the marker records {entry['size']} (cut short or "
                "changed after the save)",
                hint=_DAMAGED,
            )
        digest = hashlib.sha256()
        data = bytearray(size) if keep else bytearray(min(size, _READ))
        view, done = memoryview(data), 0
        while done < size:
            part = view[done:] if keep else view[: min(_READ, size - done)]
            n = stream.readinto(part)
            if not n:
                break
            digest.update(part[:n])
            done = done + n
        if done != size or stream.read(1):
            raise AutopartError(f"{f} changed size while it was read", hint=_DAMAGED)
    got = digest.hexdigest()
    if got != entry["sha256"]:
        raise AutopartError(
            f"{f} has SHA-256 {got[:16]}…, the marker records {entry['sha256'][:16]}… (its "
            "bytes changed after the save)",
            hint=_DAMAGED,
        )
    return data if keep else None


def _check_digest(f: Path, entry: dict[str, Any]) -> None:
    _read_checked(f, entry, keep=False)


class _Slice(io.RawIOBase):
    """A read-only, seekable file over a memoryview (zipfile reads a record in place)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.view))[whence]
        if base + pos < 0:
            raise ValueError("negative seek position")
        self.pos = base + pos
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        b[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n


def _tensor(blob: memoryview, dtype: torch.dtype, sizes: list[int], where: str) -> torch.Tensor:
    """The tensor of one chunk record: DCP writes each chunk with ``torch.save``, a zip whose
    ``data/0`` record holds the raw storage, and autopart's save makes every chunk contiguous.
    This reads that record as ``dtype`` in ``sizes`` (its length and CRC checked) and never
    unpickles the zip's ``data.pkl``."""
    nbytes = _numel(sizes) * torch.empty((), dtype=dtype).element_size()
    try:
        with zipfile.ZipFile(_Slice(blob)) as z:
            records = z.infolist()
            names = [r.filename for r in records]
            top = names[0].partition("/")[0] if names else ""
            inner = [n[len(top) + 1 :] if n.startswith(f"{top}/") else n for n in names]
            if (
                len(set(names)) != len(names)
                or not set(inner) <= _RECORDS
                or "data/0" not in inner
                or "byteorder" not in inner
            ):
                raise AutopartError(
                    f"{where} holds the records {names[:8]}, not one tensor's", hint=_DAMAGED
                )
            if z.read(f"{top}/byteorder") != b"little":
                raise AutopartError(f"{where} is not little-endian", hint=_DAMAGED)
            rec = z.getinfo(f"{top}/data/0")
    except AutopartError:
        raise
    except Exception as exc:  # noqa: BLE001 - zipfile's errors on hostile bytes are many
        raise AutopartError(
            f"{where} is not a readable tensor record ({type(exc).__name__}: {str(exc)[:200]})",
            hint=_DAMAGED,
        ) from None
    if rec.compress_type != zipfile.ZIP_STORED or rec.file_size != nbytes:
        raise AutopartError(
            f"{where}: its data record holds {rec.file_size} bytes (compression "
            f"{rec.compress_type}), not the {nbytes} of a {dtype} chunk of {sizes}",
            hint=_DAMAGED,
        )
    head = blob[rec.header_offset : rec.header_offset + 30]
    start = rec.header_offset + 30
    if len(head) == 30 and bytes(head[:4]) == b"PK\x03\x04":
        start += int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    raw = blob[start : start + nbytes]
    if len(head) < 30 or bytes(head[:4]) != b"PK\x03\x04" or len(raw) != nbytes:
        raise AutopartError(f"{where}: its data record is cut short", hint=_DAMAGED)
    if zipfile.crc32(raw) != rec.CRC:
        raise AutopartError(f"{where}: its data record fails its CRC", hint=_DAMAGED)
    if nbytes == 0:
        return torch.empty(sizes, dtype=dtype)
    out = torch.frombuffer(bytearray(raw), dtype=dtype).view(sizes)
    if dtype == torch.bool and bool(out.view(torch.uint8).gt(1).any()):
        raise AutopartError(f"{where}: a bool record holds bytes other than 0 and 1", hint=_DAMAGED)
    return out


class _Writer(FileSystemWriter):
    """DCP's file writer (its defaults), but a failed write is reported as the ``OSError``
    (``[Errno 28] No space left on device``) rather than as what ``torch.save``'s zip writer
    turns it into (``RuntimeError: ... unexpected pos 704 vs 598``)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except RuntimeError as exc:
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from exc
            raise


class _Planner(DefaultLoadPlanner):
    """DCP's default load planner, but a byte entry is refused: DCP would unpickle it
    (``torch.load(weights_only=False)``). The reader's metadata holds tensors only, so this is
    a second wall, not the first."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise AutopartError(
            f"checkpoint entry {read_item.dest_index.fqn} is bytes; checkpoints hold tensors only",
            hint=_DAMAGED,
        )


class _Reader(StorageReader):
    """DCP's storage reader for a step whose marker ``read_info`` has checked.

    Its metadata comes from the marker (DCP's pickled ``.metadata`` is never read), it reads a
    shard only by a name of the writer's form inside the step folder, without following links,
    and only after checking the bytes against the marker's size and SHA-256, and it parses each
    chunk without unpickling (``_tensor``). Nothing in the step folder is unpickled."""

    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        super().__init__()
        self.path, self.files = path, info["files"]
        self.state: dict[str, TensorStorageMetadata] = {}
        self.chunks: dict[tuple[str, tuple[int, ...]], tuple[dict[str, Any], torch.dtype]] = {}
        for k, t in info["tensors"].items():
            dtype = _DTYPES[t["dtype"]]
            chunks = []
            for c in t["chunks"]:
                chunks.append(
                    ChunkStorageMetadata(
                        offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])
                    )
                )
                self.chunks[(k, tuple(c["offsets"]))] = (c, dtype)
            self.state[k] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=torch.Size(t["size"]), chunks=chunks
            )

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return Metadata(
            state_dict_metadata=dict(self.state), storage_data={}, storage_meta=StorageMeta()
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            index = item.storage_index
            found = self.chunks.get((index.fqn, tuple(index.offset or ())))
            if item.type != LoadItemType.TENSOR or found is None:
                raise AutopartError(
                    f"{self.path / INFO}: DCP asked for {index.fqn} at {index.offset}, which "
                    "the marker does not hold as a tensor chunk",
                    hint=_DAMAGED,
                )
            by_file.setdefault(found[0]["file"], []).append((item, *found))
        for name in sorted(by_file):
            f = self.path / name
            data = _read_checked(f, self.files[name], keep=True)
            view = memoryview(data)
            for item, c, dtype in by_file[name]:
                first = c["byte_offset"]
                where = f"{f} (bytes {first}-{first + c['byte_length']}: {item.storage_index.fqn})"
                t = _tensor(view[first : first + c["byte_length"]], dtype, c["sizes"], where)
                for d, (o, n) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    t = t.narrow(d, o, n)
                target = planner.resolve_tensor(item).detach()
                if target.size() != t.size():
                    raise AutopartError(f"{where}: {tuple(t.size())} is not {tuple(target.size())}")
                target.copy_(t)
                planner.commit_tensor(item, target)
            del view, data
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _dcp_load(state: dict[str, Any], reader: _Reader, who: str, no_dist: bool = False) -> None:
    try:
        dcp.load(state, storage_reader=reader, planner=_Planner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
        raise AutopartError(
            f"{who}loading the checkpoint {reader.path} failed: {_why(exc)}",
            hint="the step is damaged (resume from the one before it), or a peer rank died",
        ) from exc


def _why(exc: BaseException) -> str:
    """One line for a failure inside DCP: the first failing rank's own error (an
    ``AutopartError``'s message first) when DCP gathered them into a ``CheckpointException``."""
    if isinstance(exc, CheckpointException):
        failures = sorted(exc.failures.items())
        ours = [(r, e) for r, (e, _) in failures if isinstance(e, AutopartError)]
        rank, first = (ours or [(r, e) for r, (e, _) in failures] or [(None, exc)])[0]
        more = f" (and {len(failures) - 1} more ranks)" if len(failures) > 1 else ""
        text = _why(first) if first is not exc else "CheckpointException"
        return (f"rank {rank}: " if rank is not None else "") + text + more
    if isinstance(exc.__context__, OSError) and not isinstance(exc, OSError):
        exc = exc.__context__  # torch.save's zip writer hides a failed write (ENOSPC) this way
    text = exc.message if isinstance(exc, AutopartError) else f"{type(exc).__name__}: {exc}"
    lines = text.strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# -- files and collectives ----------------------------------------------------------------------


def _clear(path: Path) -> None:
    """Make ``path`` an empty folder; refuses to remove anything that is not a checkpoint."""
    if path.exists():
        entries = list(path.iterdir()) if path.is_dir() else [path]
        ours = all(
            e.name in (INFO, f".{INFO}.tmp", ".metadata") or e.suffix == ".distcp" for e in entries
        )
        if not path.is_dir() or not ours:
            raise AutopartError(
                f"{path} exists and is not an autopart checkpoint; not overwriting it",
                hint="save the checkpoint to a new or empty folder",
            )
        (path / INFO).unlink(missing_ok=True)  # first: a half-replaced checkpoint is never complete
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _need_dist(what: str) -> None:
    if not dist.is_initialized():
        raise AutopartError(
            f"checkpoint {what} needs the runner's process group",
            hint="call it on every rank under torchrun (export_state_dict needs none)",
        )


def _wait(work: Any, runner: Any, what: str) -> None:
    wait(work, runner.rank, what, runner.timeout_s)


def _barrier(runner: Any, what: str) -> None:
    _wait(dist.barrier(async_op=True), runner, f"barrier at {what}")


def _all_gather_json(obj: Any, runner: Any, what: str) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order (all-gathers with the runner's timeout)."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    world = dist.get_world_size()
    size = torch.tensor([data.numel()])
    sizes = [torch.zeros_like(size) for _ in range(world)]
    _wait(dist.all_gather(sizes, size, async_op=True), runner, f"{what} (sizes)")
    most = int(max(s.item() for s in sizes))
    padded = torch.zeros(most, dtype=torch.uint8)
    padded[: data.numel()] = data
    got = [torch.zeros(most, dtype=torch.uint8) for _ in range(world)]
    _wait(dist.all_gather(got, padded, async_op=True), runner, what)
    return [json.loads(bytes(g[: int(s.item())].tolist())) for g, s in zip(got, sizes, strict=True)]
