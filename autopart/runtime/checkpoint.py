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

import io
import json
import os
import pickle
import shutil
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from autopart.errors import AutopartError, wait
from autopart.program.format import Shard

FORMAT = 1
INFO = "autopart.json"  # written last, by rank 0: a folder without it is an incomplete checkpoint
_MESHES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


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
    complete on every rank. An existing checkpoint at ``path`` is replaced.
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
        dcp.save(state, checkpoint_id=path)
    except Exception as exc:  # noqa: BLE001 - a storage or peer failure, named
        raise AutopartError(
            f"rank {runner.rank}: saving the checkpoint {path} failed: {exc}",
            hint="check free disk space and that every rank can write there",
        ) from exc
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
        }
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
    path: str | Path, runner: Any, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint saved under any layout into this rank's shards (and ``optimizer``).

    Every rank calls it. Restores ``runner.steps`` (dropout seeds) and, when the checkpoint was
    saved on the same mesh, this rank's torch RNG state. Returns ``{"step", "extra", "seed",
    "mesh", "same_layout"}``.
    """
    _need_dist("load")
    path = Path(path)
    info = read_info(path)
    meta = _metadata(path)
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
    _same_model(path, runner, optimizer, info, meta)
    request: dict[str, Any] = {}
    done: list[Callable[[], None]] = []
    for fqn, p in runner.params.items():
        shard = program.shards[fqn]
        _check_shape(path, rank, fqn, shard, strided.get(fqn), meta)
        want, build = _request(fqn, shard, strided.get(fqn), None, p.dtype, runner)
        request.update(want)
        done.append(lambda p=p, build=build: _copy_into(p, build()))
    if optimizer is not None:
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
                    md = meta[_saved_keys(fqn, strided.get(fqn), name)[0]]
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
        rng = torch.empty(meta[rng_key].size, dtype=torch.uint8)
        request[rng_key] = rng
    try:
        dcp.load(request, checkpoint_id=path, storage_reader=_Reader(path))
    except Exception as exc:  # noqa: BLE001 - a storage or peer failure, named
        raise AutopartError(
            f"rank {rank}: loading the checkpoint {path} failed: {exc}",
            hint="the checkpoint may be damaged, or a peer rank died",
        ) from exc
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

    Needs no process group (``model.load_state_dict(export_state_dict(path))``).
    """
    path = Path(path)
    info = read_info(path)
    meta = _metadata(path)
    full = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in meta.items()
        if _is_model_key(k) and isinstance(md, TensorStorageMetadata)
    }
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(full, checkpoint_id=path, storage_reader=_Reader(path), no_dist=True)
    except Exception as exc:  # noqa: BLE001 - a storage failure, named
        raise AutopartError(
            f"reading the checkpoint {path} failed: {exc}",
            hint="the checkpoint may be damaged or incomplete",
        ) from exc
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
            hint=f"resume with {was}, or load the weights only (optimizer=None)",
        )


def read_info(path: str | Path) -> dict[str, Any]:
    """``autopart.json`` of a complete checkpoint (refuses an incomplete or foreign folder)."""
    path = Path(path)
    f = path / INFO
    if not f.is_file():
        what = (
            "an incomplete checkpoint (its save did not finish)"
            if (path / ".metadata").is_file()
            else "not an autopart checkpoint"
        )
        raise AutopartError(
            f"{path} is {what}: it has no {INFO}",
            hint="point at a folder written by autopart.runtime.checkpoint.save",
        )
    try:
        info = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AutopartError(
            f"{f} is not valid JSON ({exc})", hint="the checkpoint is damaged"
        ) from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise AutopartError(
            f"{f} has format {info.get('format') if isinstance(info, dict) else None}, "
            f"this autopart reads {FORMAT}",
            hint="save the checkpoint again with this version",
        )
    return info


def latest(root: str | Path, runner: Any = None) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (``step00000012`` folders).

    With ``runner`` every rank calls it and gets rank 0's answer, so all ranks load the same one.
    """
    found = _latest(Path(root)) if runner is None or runner.rank == 0 else None
    if runner is None:
        return found
    shared = _all_gather_json(
        None if found is None else str(found), runner, "choosing the checkpoint"
    )
    return None if shared[0] is None else Path(shared[0])


def _latest(root: Path) -> Path | None:
    """The newest checkpoint whose marker reads; a damaged one (an empty or cut ``autopart.json``
    after a power loss, a missing ``.metadata``) is skipped with a warning."""
    if not root.is_dir():
        return None
    done = [
        d
        for d in root.glob("step*")
        if d.is_dir() and d.name[4:].isdigit() and (d / INFO).is_file()
    ]
    for d in sorted(done, key=lambda d: int(d.name[4:]), reverse=True):
        try:
            read_info(d)
            if not (d / ".metadata").is_file():
                raise AutopartError(f"{d} has no .metadata")
            return d
        except AutopartError as exc:
            warnings.warn(f"skipping the damaged checkpoint {d}: {exc.message}", stacklevel=3)
    return None


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
    local = local.detach()
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
        out[name] = runner.buffers[name].detach()
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
                out[key(fqn, state=name)] = v.detach().clone()
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


# -- files and collectives ----------------------------------------------------------------------


class _Reader(FileSystemReader):
    """DCP's file reader, but ``.metadata`` is unpickled with an allow-list of DCP's metadata
    classes (plain DCP runs ``pickle.load`` on it, which could run any code)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        f = Path(self.path) / ".metadata"
        try:
            metadata = _SafeUnpickler(io.BytesIO(f.read_bytes())).load()
        except (
            OSError,
            pickle.UnpicklingError,
            EOFError,
            AttributeError,
            KeyError,
            TypeError,
            ValueError,
        ) as exc:
            raise AutopartError(
                f"{f} is not a readable DCP metadata file: {exc}",
                hint="the checkpoint is damaged, incomplete or not from autopart",
            ) from exc
        if not isinstance(metadata, Metadata):
            raise AutopartError(f"{f} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_ALLOWED = {  # everything DCP's .metadata refers to, and nothing that could run code
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch": {
        "Size",
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
    },
    "torch.serialization": {"_get_layout"},  # a name → torch layout lookup
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def _metadata(path: Path) -> dict[str, Any]:
    if not (path / ".metadata").is_file():
        raise AutopartError(
            f"{path} has no DCP .metadata file", hint="the checkpoint is incomplete"
        )
    return _Reader(path).read_metadata().state_dict_metadata


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
