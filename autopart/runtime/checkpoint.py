"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), by global FQN, in any layout.

``save(path, runner, optimizer, step)`` writes one DCP checkpoint from every rank: each rank's
parameter shards as DTensors on a ``("pp", "dp", "tp")`` device mesh (``Shard(dim)`` on tp,
``Replicate`` elsewhere), so DCP records which slice of which global tensor each rank holds and
writes every slice once. ``load(path, runner, optimizer)`` reads the slices this rank needs under
*its* layout, whatever the layout that saved them (tp=2 × pp=2 → pp=4, dp=4, tp=4, one device).
``export_state_dict(path)`` rebuilds the plain single-device state dict of the original model
(no process group needed). A ZeRO-1 optimizer's state is saved by the dp rank that holds it
and loaded by the one that owns it now. See docs/checkpoint.md for the format and the rules.

A step folder is untrusted input (``checkpoint_files.py``, docs/security-checkpoints.md): the
marker records every chunk and every file's SHA-256 and is sealed; loads check it by
allow-list, hash every file they read before using it, and never unpickle anything.

Keys, all by the model's global FQN:

    transformer.h.0.mlp.c_fc.weight                 a parameter (whole, or Shard(dim) over tp)
    transformer.h.0.attn.c_attn.weight::block1      block 1 of a fused (strided) parameter
    transformer.h.0.attn.bias                       a buffer the graph reads (for export only)
    optim/transformer.h.0.mlp.c_fc.weight/exp_avg   optimizer state, laid out like its parameter
    optim/transformer.h.0.mlp.c_fc.weight/step      a scalar optimizer state
    rng/rank00003                                   rank 3's torch CPU generator state
    autopart.json                                   step, extra, mesh, tied names, fused
                                                    blocks…, every chunk and file, the seal
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from autopart.errors import AutopartError, wait
from autopart.program.format import Shard
from autopart.runtime import checkpoint_files as cf
from autopart.runtime.checkpoint_files import FORMAT, INFO, key
from autopart.runtime.guards import SHARD_STATE, inner_optimizer

_MESHES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
# one optimizer, or several over disjoint parts of the model (Muon for the matrices, AdamW for
# the rest), in an order the save and the load share
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


def _rng_key(rank: int) -> str:
    return f"rng/rank{rank:05d}"


def _is_model_key(k: str) -> bool:
    return not k.startswith(("optim/", "rng/"))


# -- public API --------------------------------------------------------------------------------


def save(
    path: str | Path,
    runner: Any,
    optimizer: Optimizers | None = None,
    step: int = 0,
    extra: dict[str, Any] | None = None,
    *,
    tied: dict[str, str] | None = None,
) -> Path:
    """Write a checkpoint of ``runner`` (and ``optimizer``'s state) to ``path``; every rank calls it.

    ``optimizer``: one, or a list of several over disjoint parts of the model (each trained
    parameter in exactly one), loaded back by a list of the same classes in the same order.

    ``step`` is the data position (steps done), ``extra`` any JSON-able dict (returned by
    ``load``: to each rank its own when the layout is the same, else rank 0's), ``tied`` the model's tied aliases ``{alias: canonical FQN}`` (``plan.json``'s
    ``tied``) so that ``export_state_dict`` can give them back. Returns once the checkpoint is
    complete on every rank. An existing checkpoint at ``path`` is replaced. The marker
    (``autopart.json``, written last) records every tensor's chunks and every file's size and
    SHA-256, and is sealed with its own SHA-256.
    """
    _need_dist("save")
    path = Path(path)
    rng = torch.get_rng_state()  # first: nothing below may draw from the generator before it
    try:  # NaN and infinities too: the marker's reader refuses them (told every rank below)
        json.dumps(extra, allow_nan=False)
        extra_error = None
    except (TypeError, ValueError) as exc:
        extra_error = f"rank {runner.rank}: checkpoint extra is not JSON-able: {exc}"
    _mesh(runner)  # collective the first time: every rank, whatever it holds
    state = _model_state(runner)
    opts = _optimizers(optimizer, runner.rank)
    if opts:
        state.update(_optim_state(runner, opts))
    state[_rng_key(runner.rank)] = rng
    cf.check_dtypes(state, runner.rank)
    mine = {
        "strided": {
            f: [s.dim, s.strided] for f, s in runner.program.shards.items() if s.strided > 1
        },
        "buffers": sorted(_buffer_names(runner)),
        "groups": [_groups_held(runner, o) for o in opts],
        "classes": _classes(opts),
        "extra": {} if extra_error else extra or {},
        "extra_error": extra_error,
    }
    if runner.rank == 0:
        _clear(path)
    every = _all_gather_json(mine, runner, "checkpoint layout exchange")  # also: path is clear
    _same_everywhere(every, path)  # every rank refuses alike, before anything is written
    optim = _optim_info(opts, [m["groups"] for m in every], path)
    try:
        written = dcp.save(state, storage_writer=cf.Writer(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
        cf.reraise_interrupt(exc)
        raise AutopartError(
            f"rank {runner.rank}: saving the checkpoint {path} (step {step}) failed: {cf.why(exc)}",
            hint="check free disk space and that every rank can write there; the unfinished "
            "step has no marker and is never resumed",
        ) from exc
    files = _all_gather_json(cf.own_files(path, runner.rank), runner, "checkpoint file digests")
    if runner.rank == 0:
        info = {
            "format": FORMAT,
            "step": int(step),
            "runner_steps": int(runner.steps),
            "seed": int(runner.seed),
            "extra": extra or {},
            "mesh": {d: getattr(runner.plan.mesh, d) for d in ("pp", "dp", "tp")},
            **_extra_ranks([m["extra"] for m in every]),
            "plan": runner.plan.to_json(),
            "tied": dict(tied or {}),
            "strided": {f: v for m in every for f, v in m["strided"].items()},
            "buffers": sorted({b for m in every for b in m["buffers"]}),
            # what the model computes (graph.computation_digest): load refuses another model
            **({"model": runner.program.model} if runner.program.model else {}),
            # the keys of the module's state_dict() (live API): export drops the graph's
            # non-persistent buffers (RoPE's inv_freq), so it loads strictly
            **(
                {"state_keys": sorted(runner.state_keys)}
                if getattr(runner, "state_keys", None) is not None
                else {}
            ),
            "optimizer": optim,
            "tensors": cf.tensors_json(written, path),
            "files": {n: e for m in files for n, e in sorted(m.items())},
        }
        info["sha256"] = cf.digest(info)
        cf.check_marker(info, path / INFO)  # what this save writes, the load accepts
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
    optimizer: Optimizers | None = None,
    *,
    fresh_optimizer: bool = False,
    hyperparameters: bool = True,
    other_model: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint saved under any layout into this rank's shards (and ``optimizer``).

    Every rank calls it. Restores ``runner.steps`` (dropout seeds) and, when the checkpoint was
    saved on the same mesh, this rank's torch RNG state. Every file a rank reads is checked
    against the SHA-256 in the marker first. An optimizer whose state the checkpoint lacks
    (saved without one) is refused unless ``fresh_optimizer``; with ``fresh_optimizer`` the
    optimizer's state is never loaded (it starts afresh). ``hyperparameters``: each parameter
    group's saved ``lr``, ``betas``, ``weight_decay``, … (and a scheduler's ``initial_lr``) are
    restored too, as torch's ``Optimizer.load_state_dict`` does, so a scheduler loaded beside
    it goes on from the saved rate. A checkpoint of a model whose parameters have these names
    and shapes but which computes otherwise (another head count, norm epsilon, activation or
    dropout; the digest of its captured graph differs) is refused unless ``other_model``.
    Returns ``{"step", "extra", "seed", "mesh", "same_layout"}``.
    """
    _need_dist("load")
    path = Path(path)
    info = read_info(path)
    reader = cf.Reader(path, info)
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
    opts = [] if fresh_optimizer else _optimizers(optimizer, rank)  # those whose state loads
    _same_model(path, runner, opts, info, meta, other_model)
    if opts and info["optimizer"] is None:
        raise AutopartError(
            f"rank {rank}: checkpoint {path} (step {info['step']}) holds no optimizer state (it "
            f"was saved without an optimizer, e.g. by --no-optim); resuming "
            f"{' and '.join(_classes(opts))} from it would silently start its state "
            "from zero",
            hint="ask for fresh optimizer state explicitly (autopart run --fresh-optimizer, "
            "load(..., fresh_optimizer=True)), or resume with --no-optim",
        )
    request: dict[str, Any] = {}
    copies: list[tuple[torch.nn.Parameter, Callable[[], torch.Tensor]]] = []  # after the load
    states: list[tuple[Any, torch.nn.Parameter, dict[str, Callable[[], torch.Tensor]]]] = []
    for fqn, p in runner.params.items():
        shard = program.shards[fqn]
        _check_shape(path, rank, fqn, shard, strided.get(fqn), meta)
        want, build = _request(fqn, shard, strided.get(fqn), None, p.dtype, runner)
        request.update(want)
        copies.append((p, build))
    if opts:
        saved_states = _saved_states(meta)
        owners = _owners(runner, opts)
        holders = [_holder(o) for o in opts]
        for fqn, p in runner.params.items():
            if id(p) not in owners:
                continue  # in no optimizer (frozen): no state
            holder, owned = holders[owners[id(p)]]
            names = saved_states.get(fqn, []) if owned is None or id(p) in owned else []
            builds: dict[str, Callable[[], torch.Tensor]] = {}
            for name in names:
                scalar = meta.get(key(fqn, state=name))
                if scalar is not None and len(scalar.size) == 0:
                    t = torch.empty((), dtype=scalar.properties.dtype)
                    request[key(fqn, state=name)] = t
                    builds[name] = _loaded(t)
                else:
                    keys = _saved_keys(fqn, strided.get(fqn), name)
                    if not all(k in meta for k in keys):
                        raise AutopartError(
                            f"rank {rank}: {path / INFO}: optimizer state {name!r} of {fqn} "
                            f"is neither a scalar nor saved like its parameter ({keys[0]})",
                            hint=cf.DAMAGED,
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
                states.append((holder, p, builds))
    rng_key = _rng_key(rank)
    same = info["mesh"] == mesh_now and rng_key in meta
    if same:
        now = torch.get_rng_state()
        if tuple(meta[rng_key].size) != tuple(now.shape):
            raise AutopartError(
                f"rank {rank}: {path / INFO}: {rng_key} holds {tuple(meta[rng_key].size)} "
                f"bytes, but this torch's generator state is {tuple(now.shape)}",
                hint=cf.DAMAGED,
            )
        rng = torch.empty_like(now)
        request[rng_key] = rng
    cf.dcp_load(request, reader, f"rank {rank}: ")
    for p, build in copies:
        _copy_into(p, build())
    for holder, p, builds in states:
        holder.state[p] = {n: f() for n, f in builds.items()}
    if opts and hyperparameters:
        refused: list[str] | None = None
        try:
            for opt, was in zip(opts, _saved_optimizers(info), strict=True):
                _restore_groups(path, runner, opt, was)
        except AutopartError as exc:
            refused = [exc.message, exc.hint or ""]
        said = _all_gather_json(refused, runner, "optimizer hyperparameters check")
        first = next((r for r in said if r), None)  # every rank refuses alike: none goes on
        if first:
            raise AutopartError(first[0], hint=first[1] or None)
    if same:
        torch.set_rng_state(rng)
    runner.steps = int(info["runner_steps"])
    extra = info["extra"]
    if info.get("extra_ranks") is not None:  # the ranks saved different ones
        if info["mesh"] == mesh_now:
            extra = info["extra_ranks"][rank]
        elif rank == 0:
            warnings.warn(
                f"checkpoint {path}: each rank saved its own extra (under "
                f"{_layout(info['mesh'])}); under this layout every rank gets rank 0's",
                stacklevel=2,
            )
    return {
        "step": int(info["step"]),
        "extra": extra,
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
    reader = cf.Reader(path, info)
    full = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in reader.state.items()
        if _is_model_key(k)
    }
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        cf.dcp_load(full, reader, "", no_dist=True)
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
    keys = info.get("state_keys")
    if keys is not None:  # a buffer the module does not save (persistent=False) is not its key
        keep = set(keys)
        out = {k: t for k, t in out.items() if k in keep or k not in set(info["buffers"])}
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
    path: Path,
    runner: Any,
    optimizers: list[torch.optim.Optimizer],
    info: dict[str, Any],
    meta: dict[str, Any],
    other_model: bool = False,
) -> None:
    """Refuse a checkpoint of another model (parameters this model does not have: a deeper
    model of the same width would otherwise load into a shallower one, its extra blocks
    ignored; other tied weights; unless ``other_model``, the same parameters in a graph that
    computes otherwise) or another optimizer, naming the difference. Collective."""
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
    saved_model, model = info.get("model"), runner.program.model
    if saved_model and model and saved_model != model and not other_model:
        raise AutopartError(
            f"rank {runner.rank}: checkpoint {path} was saved from a model that computes "
            "otherwise: its parameters have this model's names and shapes, but the captured "
            f"graphs differ (model {saved_model[:12]} there, {model[:12]} here): another "
            "head count, norm epsilon, activation or dropout rate, or another version of the "
            "model's code or of autopart, torch or transformers capturing it",
            hint="load it into the model it was saved from; if this one is meant to differ "
            "(fine-tuning with another dropout rate, an upgrade that captures the same model "
            "otherwise), pass other_model=True (autopart run --other-model)",
        )
    then, now = [o.get("class") for o in _saved_optimizers(info)], _classes(optimizers)
    if then and now and len(then) != len(now):
        raise AutopartError(
            f"rank {runner.rank}: checkpoint {path} holds the state of {len(then)} "
            f"optimizer(s) ({', '.join(map(str, then))}), this run has {len(now)} "
            f"({', '.join(now)})",
            hint="pass the optimizers it was saved with, in the same order, or start them "
            "afresh (fresh_optimizer=True, autopart run --fresh-optimizer)",
        )
    for was, cls in zip(then, now, strict=True) if then and now else []:
        if was not in (None, "ZeroRedundancyOptimizer") and was != cls:
            raise AutopartError(
                f"rank {runner.rank}: checkpoint {path} holds {was} state, the optimizer now "
                f"is {cls}",
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
    info = cf.read_marker(f)
    cf.check_marker(info, f)
    for name, entry in info["files"].items():
        cf.regular(path / name, entry["size"])
    return info


def verify(path: str | Path) -> dict[str, Any]:
    """``read_info``, then the SHA-256 of every file of the step against the marker's; returns
    the marker. Raises an ``AutopartError`` naming the first file that differs."""
    path = Path(path)
    info = read_info(path)
    for name, entry in sorted(info["files"].items()):
        cf.check_digest(path / name, entry)
    return info


def latest(
    root: str | Path, runner: Any = None, *, on_skip: Callable[[str], None] | None = None
) -> Path | None:
    """The newest intact checkpoint under ``root`` (``step00000012`` folders): complete (it has
    its marker) and verified (``verify``: every file's size and SHA-256 match the marker's).

    A newer step that fails is reported in one line naming the step and the file (``on_skip``;
    default: a ``UserWarning``) and skipped for the one before. A folder without a marker (an
    unfinished save) is skipped silently. With ``runner`` every rank calls it: rank 0 lists the
    steps, the ranks share the hashing (each file is read by one rank), and all get the same
    answer and the same ``on_skip`` calls (the default warning: on rank 0 only).
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
        if on_skip is not None or runner.rank == 0:
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
        m = cf.STEP.fullmatch(d.name)
        if m and d.is_dir() and os.path.lexists(d / INFO):
            found.append((int(m[1]), d))
    return [d for _, d in sorted(found, reverse=True)]


def _problem(step: Path, rank: int, world: int) -> str | None:
    """Why ``step`` cannot be resumed, as far as this rank's share of its files shows."""
    try:
        info = read_info(step)
        named = cf.STEP.fullmatch(step.name)
        if named and int(named[1]) != info["step"]:  # a copy under a newer step's name
            return (
                f"its folder is named for step {int(named[1])}, but its marker records step "
                f"{info['step']}"
            )
        for name in sorted(info["files"])[rank::world]:
            cf.check_digest(step / name, info["files"][name])
    except AutopartError as exc:
        return exc.message
    return None


def prune(root: str | Path, keep: int, current: Path | None = None) -> None:
    """Remove the oldest complete checkpoints under ``root`` beyond the newest ``keep``
    (``--keep-checkpoints``), never ``current``. Only what a save makes is removed: a folder
    named ``step`` and digits (by its step, not its name's order), itself a directory and not
    a link, with its marker a file and not a link; links are never followed (a link in the
    folder pointed outside it, and removing its marker removed the target's)."""
    ours = [
        d
        for d in _steps(Path(root))
        if not d.is_symlink() and (d / INFO).is_file() and not (d / INFO).is_symlink()
    ]
    for old in ours[keep:]:
        if current is not None and old == current:
            continue
        try:
            (old / INFO).unlink()  # first: never a half-deleted complete one
            shutil.rmtree(old)
        except OSError as exc:
            raise AutopartError(
                f"could not remove the old checkpoint {old}: {exc.strerror or exc}",
                hint="check the folder's permissions, or keep every checkpoint (no "
                "--keep-checkpoints)",
            ) from None


def _skipping(step: Path, problem: str) -> str:
    m = cf.STEP.fullmatch(step.name)
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
    return shard.index == runner.program.coords.tp and shard.parts == runner.plan.mesh.tp


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
            f"but this rank's tp index is {runner.program.coords.tp} of {runner.plan.mesh.tp}",
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


def _optim_state(runner: Any, opts: list[torch.optim.Optimizer]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    owners = _owners(runner, opts)
    holders = [_holder(o)[0] for o in opts]
    for fqn, p in runner.params.items():
        if id(p) not in owners and not p.requires_grad:
            continue  # frozen, left out of the optimizer (over the trainable parameters only)
        if id(p) not in owners:
            raise AutopartError(
                f"rank {runner.rank}: the optimizer does not hold parameter {fqn}, which "
                "trains: a checkpoint saves the state of the optimizers over every trained "
                "parameter",
                hint="build the optimizer from runner.parameters() (or from those that "
                "require a gradient), or pass every optimizer of the run as a list "
                "(Muon for the matrices and AdamW for the rest)",
            )
        for name, v in holders[owners[id(p)]].state.get(p, {}).items():
            if name == SHARD_STATE:  # the live runner's own tag (guards.py): the files say it
                continue
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


def _optim_info(
    opts: list[torch.optim.Optimizer], held: list[list[list[Any]]], path: Path
) -> dict[str, Any] | list[Any] | None:
    """The marker's ``optimizer``: null, one optimizer's ``{class, param_groups, group_of}``,
    or a list of them (several optimizers, in their order). ``held``: every rank's
    ``_groups_held`` of each optimizer. The ranks' groups differ (a pipeline stage's hold its
    own layers), so the marker keeps each distinct group's hyperparameters once
    (``param_groups``) and which of them each parameter trained with (``group_of``)."""
    infos = []
    for i, optimizer in enumerate(opts):
        settings: list[dict[str, Any]] = []
        seen: dict[str, int] = {}
        group_of: dict[str, int] = {}
        for rank, per_rank in enumerate(held):
            for group, fqns in per_rank[i]:
                k = seen.setdefault(json.dumps(group, sort_keys=True), len(settings))
                if k == len(settings):
                    settings.append(group)
                for fqn in fqns:
                    if group_of.setdefault(fqn, k) != k:
                        raise AutopartError(
                            f"checkpoint {path}: {fqn} trains with {settings[group_of[fqn]]} "
                            f"on one rank and {group} on rank {rank}",
                            hint="give every rank the same hyperparameters for a parameter "
                            "(build the optimizer's groups the same way on every rank)",
                        )
        infinite = next((g for g in settings if not _finite(g)), None)
        if infinite is not None:
            raise AutopartError(
                f"checkpoint {path}: an optimizer group holds a NaN or infinite "
                f"hyperparameter ({infinite})",
                hint="give its groups finite values before saving",
            )
        holder = type(_holder(optimizer)[0]).__name__  # ZeRO: its inner
        infos.append({"class": holder, "param_groups": settings, "group_of": group_of})
    return None if not infos else infos[0] if len(infos) == 1 else infos


def _same_everywhere(every: list[dict[str, Any]], path: Path) -> None:
    """Refuse, on every rank alike, a save whose ranks passed optimizers of other classes or
    counts, or an ``extra`` that is not JSON (NaN included: the marker's reader refuses it)."""
    bad = next((m["extra_error"] for m in every if m["extra_error"]), None)
    if bad:
        raise AutopartError(bad, hint="pass plain numbers, strings, lists and dicts")
    for rank, m in enumerate(every):
        if m["classes"] != every[0]["classes"]:
            raise AutopartError(
                f"checkpoint {path}: rank 0 passes the optimizers {every[0]['classes'] or 'none'}"
                f", rank {rank} {m['classes'] or 'none'}",
                hint="pass every rank the same optimizers, in the same order (each over the "
                "parameters that rank holds)",
            )


def _extra_ranks(extras: list[dict[str, Any]]) -> dict[str, Any]:
    """The marker's ``extra_ranks`` (every rank's ``extra``, in rank order) when the ranks'
    differ (a data loader's position per dp rank, a scheduler over a stage's own groups);
    nothing when they agree (``extra`` is then every rank's)."""
    first = json.dumps(extras[0], sort_keys=True)
    same = all(json.dumps(e, sort_keys=True) == first for e in extras)
    return {} if same else {"extra_ranks": extras}


def _layout(mesh: dict[str, int]) -> str:
    return " × ".join(f"{d}={mesh[d]}" for d in ("dp", "tp", "pp") if mesh[d] > 1) or "one rank"


def _finite(group: dict[str, Any]) -> bool:
    try:
        json.dumps(group, allow_nan=False)
        return True
    except ValueError:
        return False


def _groups_held(runner: Any, optimizer: torch.optim.Optimizer) -> list[list[Any]]:
    """This rank's groups of ``optimizer``: [JSON-able hyperparameters, [its parameters' FQNs]]
    each. A one-element tensor (a tensor learning rate) is recorded as its number."""

    def value(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point():
            return float(v.item())
        return list(v) if isinstance(v, tuple) else v

    def plain(v: Any) -> bool:
        if isinstance(v, (list, tuple)):
            return all(isinstance(x, (int, float)) for x in v)
        return v is None or isinstance(v, (int, float, bool, str))

    names = {id(p): fqn for fqn, p in runner.params.items()}
    return [
        [
            {k: value(v) for k, v in g.items() if k != "params" and plain(value(v))},
            [names[id(p)] for p in g["params"] if id(p) in names],
        ]
        for g in optimizer.param_groups
    ]


def _saved_optimizers(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The marker's optimizers as a list (none, one or several)."""
    saved = info.get("optimizer")
    return [] if saved is None else [saved] if isinstance(saved, dict) else list(saved)


def _restore_groups(path: Path, runner: Any, optimizer: torch.optim.Optimizer, was: Any) -> None:
    """Put each parameter group's saved hyperparameters back, as torch's
    ``Optimizer.load_state_dict`` does: a group takes those its parameters trained with
    (``group_of``), whatever the layout now; a group none of whose parameters were saved (new,
    or frozen then) keeps its own; one whose parameters trained with different ones is
    refused. A marker without ``group_of`` (an older save) maps groups by position."""
    rank, groups, saved = runner.rank, optimizer.param_groups, was["param_groups"]
    if "group_of" not in was:
        if len(saved) != len(groups):
            raise AutopartError(
                f"rank {rank}: checkpoint {path} holds {len(saved)} optimizer parameter "
                f"groups, this optimizer {len(groups)}",
                hint=_GROUPS_HINT,
            )
        chosen = list(enumerate(saved))
    else:
        names = {id(p): fqn for fqn, p in runner.params.items()}
        chosen = []
        for i, group in enumerate(groups):
            fqns = [names[id(p)] for p in group["params"] if names.get(id(p)) in was["group_of"]]
            which = {was["group_of"][f]: f for f in fqns}
            if len(which) > 1:
                (a, fa), (b, fb) = list(which.items())[:2]
                raise AutopartError(
                    f"rank {rank}: optimizer parameter group {i} holds {fa} and {fb}, which "
                    f"checkpoint {path} trained with different hyperparameters ({saved[a]} and "
                    f"{saved[b]})",
                    hint=_GROUPS_HINT,
                )
            if which:
                chosen.append((i, saved[next(iter(which))]))
    for i, was_group in chosen:
        _restore_group(path, rank, groups[i], i, was_group)
    state = _holder(optimizer)[0].state
    for i, group in enumerate(groups):  # a flag that needs state the checkpoint lacks: torch
        lacking = [  # would fail at the next step with a raw KeyError
            p for p in group["params"] if state.get(p) and "max_exp_avg_sq" not in state[p]
        ]
        if group.get("amsgrad") is True and lacking:
            raise AutopartError(
                f"rank {rank}: {path / INFO}: optimizer parameter group {i} sets amsgrad, but "
                "the state loaded for it holds no max_exp_avg_sq",
                hint=cf.DAMAGED + ", or load with hyperparameters=False",
            )


def _restore_group(path: Path, rank: int, group: dict[str, Any], i: int, was: Any) -> None:
    """One group's saved hyperparameters back. The marker is a file: a value must be of the
    kind the optimizer holds there (a flag for a flag, a number for a number, as many numbers
    for ``betas``); a key the group lacks only as a number or a flag (a scheduler's
    ``initial_lr``; ZeRO's groups added by ``add_param_group`` hold only ``lr`` until a step)."""
    if not isinstance(was, dict):
        raise AutopartError(
            f"rank {rank}: {path / INFO}: optimizer parameter group {i} is not an object",
            hint=cf.DAMAGED,
        )
    for k, v in was.items():
        now = group.get(k)
        if k == "params" or k in _IMPLEMENTATION:
            continue
        if isinstance(now, torch.Tensor) and now.dim() == 0 and _number(v):
            now.fill_(float(v))  # a tensor learning rate keeps its tensor
        elif _same_kind(now, v) or (k not in group and (_number(v) or isinstance(v, bool))):
            group[k] = tuple(v) if isinstance(now, tuple) else v
        else:
            raise AutopartError(
                f"rank {rank}: {path / INFO}: optimizer parameter group {i}'s {k!r} is "
                f"{v!r}, where this optimizer holds {now!r}",
                hint=cf.DAMAGED + ", or load with hyperparameters=False",
            )


_GROUPS_HINT = (
    "build the optimizer's groups as when it was saved, or load with hyperparameters=False "
    "(this optimizer's own hyperparameters, the saved state)"
)
# group entries that choose how torch computes a step, not what it computes: this run's own
_IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same_kind(now: Any, v: Any) -> bool:
    """Is the saved ``v`` the kind of value the optimizer holds now (``now``)?"""
    if isinstance(now, bool) or isinstance(v, bool):
        return isinstance(now, bool) and isinstance(v, bool)
    if now is None or isinstance(now, str):
        return type(v) is type(now)
    if _number(now):
        return _number(v)
    if isinstance(now, (list, tuple)):
        return (
            isinstance(v, list)
            and len(v) == len(now)
            and all(_number(x) for x in v)
            and all(_number(x) for x in now)
        )
    return False


def _optimizers(optimizer: Optimizers | None, rank: int) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list: none, one, or several."""
    if optimizer is None:
        return []
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise AutopartError(
            f"rank {rank}: optimizer must be a torch optimizer or a list of them, got "
            f"{type(optimizer).__name__}",
            hint="pass the optimizer (or every optimizer of the run, as a list)",
        )
    return opts


def _classes(opts: list[torch.optim.Optimizer]) -> list[str]:
    return [type(_holder(o)[0]).__name__ for o in opts]


def _owners(runner: Any, opts: list[torch.optim.Optimizer]) -> dict[int, int]:
    """id(parameter) → the index of the optimizer that holds it; a parameter in two refused
    (whose state would the checkpoint keep?)."""
    owners: dict[int, int] = {}
    for i, opt in enumerate(opts):
        for group in opt.param_groups:
            for p in group["params"]:
                if owners.setdefault(id(p), i) != i:
                    fqn = next((f for f, q in runner.params.items() if q is p), "a parameter")
                    raise AutopartError(
                        f"rank {runner.rank}: {fqn} is in optimizers {owners[id(p)]} and {i} "
                        f"({type(opts[owners[id(p)]]).__name__} and {type(opt).__name__})",
                        hint="give each parameter to one optimizer",
                    )
    return owners


def _holder(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, set[int] | None]:
    """The optimizer whose ``state`` holds this rank's optimizer state, and the ids of the
    parameters whose state it holds (None: all). A ZeRO-1 optimizer keeps the state of its
    partition only, in its local optimizer: each dp rank saves the states it owns, and on load
    asks for the states of the parameters it owns now (the partition may have changed)."""
    inner = inner_optimizer(optimizer)
    if inner is optimizer:
        return optimizer, None
    return inner, {id(p) for g in inner.param_groups for p in g["params"]}


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


def _loaded(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The build of a tensor DCP loads in place: ``t`` itself."""
    return lambda: t


def _copy_into(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_(value)


# -- files and collectives ----------------------------------------------------------------------


def _clear(path: Path) -> None:
    """Make ``path`` an empty folder; refuses to remove anything that is not a checkpoint."""
    if path.is_symlink():  # its marker and files would be removed where the link points
        raise AutopartError(
            f"{path} is a link; a save does not write or remove anything through it",
            hint="save the checkpoint to a new or empty folder that is not a link",
        )
    if path.exists():
        entries = list(path.iterdir()) if path.is_dir() else [path]
        ours = all(  # plain files of a checkpoint's names (a folder named autopart.json: not)
            e.is_file()
            and not e.is_symlink()
            and (e.name in (INFO, f".{INFO}.tmp", ".metadata") or e.suffix == ".distcp")
            for e in entries
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
