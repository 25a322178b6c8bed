"""Parity checks on live ranks: one step of a program, its loss and gradients dumped.

``autopart verify`` runs its checks one of two ways, both on real gloo processes:

- **saved** (``python -m autopart.parity.checks MANIFEST`` under torchrun): the ranks stay up
  and take check after check from a JSON manifest, loading each saved program folder as
  ``autopart run`` does. One launch serves every check of one world size.
- **forked** (``fork_ranks``): the process that compiled a ``Program`` forks its ranks, which
  inherit the program in memory and meet through a ``FileStore``; nothing is saved, loaded or
  imported again.

Either way each rank calls ``run_check``: its process groups, a ``Runner``, one step on the
check's batch, then ``dump`` (loss, local gradients, shard map) into ``DIR/rankNNNNN.pt``. Every
distributed wait has the check's timeout, and a rank that fails says which rank and why.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from autopart import collectives
from autopart.errors import AutopartError
from autopart.frontend.capture import batch_fields
from autopart.layout import Plan
from autopart.program.format import Program, RankProgram, load_rank, load_weights, read_head
from autopart.runtime.launch import as_rank, fork_context, forked, rank_setup, wait_ranks
from autopart.runtime.placement import backend_for, pick_device
from autopart.runtime.run import dump
from autopart.runtime.runner import Runner, join_torchrun, local_weights, make_groups


def run_check(
    rp: RankProgram,
    plan: Plan,
    weights: dict[str, torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor],
    folder: Path,
    *,
    timeout_s: float,
    seed: int = 0,
    compile: bool = False,
    device: str = "cpu",
    ties: dict[str, list[int]] | None = None,
) -> None:
    """One step of this rank's program on ``batch``, dumped to ``folder``; the check's process
    groups are destroyed afterwards, so that the next check starts from a bare world.
    ``ties``: the whole pipeline's (``Program.pipeline_ties``; default this rank's).
    ``device="meta"`` is the dry run (``autopart/runtime/placement.py``)."""
    # the seed autopart run uses (attention dropout inside SDPA draws from torch's generator)
    torch.manual_seed((seed * 1_000_003 + rp.rank) % 2**63)
    groups = make_groups(plan, rp.rank, rp.ties if ties is None else ties)
    runner = Runner(
        rp, plan, weights, groups, timeout_s=timeout_s, seed=seed, compile=compile, device=device
    )
    f = batch_fields(batch)
    loss = runner.step(f["input_ids"], f["labels"], f.get("attention_mask"), f.get("position_ids"))
    dump(runner, loss, folder)
    runner.comm.set_action("the end of the check")
    dist.barrier()  # every rank done with every collective before its groups go away
    runner.comm.release(list({id(g): g for g in groups.values() if g is not None}.values()))


# -- saved programs, one torchrun launch ---------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m autopart.parity.checks MANIFEST`` (under torchrun): run every check the
    manifest lists, in order. The manifest is JSON: ``{"timeout": s, "compile": bool, "device",
    "checks": [{"name", "program", "batch", "dump", "library_ops"}, ...]}``; every program has this world size."""
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m autopart.parity.checks MANIFEST (under torchrun)", file=sys.stderr)
        return 2
    rank_setup(collectives.close)  # stopped with its launcher, shared memory cleaned up
    manifest = json.loads(Path(args[0]).read_text())
    timeout_s = float(manifest["timeout"])
    dev = pick_device(manifest.get("device", "cpu"))
    device = str(dev)
    rank, world = join_torchrun(timeout_s, backend_for(dev))
    current = "(setup)"
    try:
        for check in manifest["checks"]:
            current = check["name"]
            root = Path(check["program"])
            head = read_head(root)
            plan = Plan.from_json(head["plan"])
            plan.mesh.check_world(world)
            batch = torch.load(check["batch"], weights_only=True)  # {name: tensor}
            program = load_rank(root, rank, check.get("library_ops", ()))
            run_check(
                program,
                plan,
                load_weights(root, rank, program),
                batch,
                Path(check["dump"]),
                timeout_s=timeout_s,
                compile=manifest["compile"],
                device=device,
                ties=head.get("ties", program.ties),
            )
    except AutopartError as exc:
        print(f"autopart run: error: check {current}: {exc}", file=sys.stderr, flush=True)
        return 2
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- in-memory programs, forked ranks -------------------------------------------------------


def fork_ranks(
    program: Program,
    batch: tuple[torch.Tensor, torch.Tensor],
    folder: Path,
    *,
    timeout_s: float,
    device: str = "cpu",
) -> None:
    """Run one step of ``program`` on ``program.mesh.size`` ranks forked from this process
    (real processes, gloo over TCP on this host) and dump each rank into ``folder``; on
    ``device`` ("meta": the dry run, every tensor shape-only).

    The ranks inherit the compiled program. A rank that fails writes why to
    ``folder/rankNNNNN.err`` and exits; the others are stopped then, and the error names the
    failing rank. The whole run gets ``timeout_s + 60`` s.
    """
    if dist.is_initialized():
        raise AutopartError(
            "cannot fork ranks from a process that has joined a process group",
            hint="verify in-memory from a plain process, or use saved programs",
        )
    folder.mkdir(parents=True, exist_ok=True)
    world = program.mesh.size
    store = folder / "store"
    ctx = fork_context()
    procs = [
        ctx.Process(
            target=_forked_rank,
            args=(program, r, world, store, batch, folder, timeout_s, device),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    first = wait_ranks(procs, timeout_s + 60)
    if first is not None:
        # ranks that failed within one poll of each other: the one that wrote its error first
        # (a peer that died is noticed after it dies: its error is the cause)
        written = [
            (f.stat().st_mtime_ns, r) for r in range(world) if (f := _err(folder, r)).exists()
        ]
        first = min(written)[1] if written else first
        err = _err(folder, first)
        why = err.read_text().strip() if err.exists() else f"exit code {procs[first].exitcode}"
        raise AutopartError(f"rank {first} of {world} forked ranks failed: {why}")


def _err(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank:05d}.err"


def _forked_rank(
    program: Program,
    rank: int,
    world: int,
    store: Path,
    batch: tuple[torch.Tensor, torch.Tensor],
    folder: Path,
    timeout_s: float,
    device: str,
) -> None:
    forked()
    code = 1
    try:
        as_rank(rank, world)
        dist.init_process_group(
            backend_for(pick_device(device)),
            store=dist.FileStore(str(store), world),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        rp = program.rank(rank)
        weights = local_weights(program, rp)
        run_check(
            rp,
            program.plan,
            weights,
            batch,
            folder,
            timeout_s=timeout_s,
            device=device,
            ties=program.pipeline_ties,
        )
        dist.destroy_process_group()
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        what = str(exc) if isinstance(exc, AutopartError) else traceback.format_exc(limit=8)
        _err(folder, rank).write_text(f"{type(exc).__name__}: {what}")
    finally:
        collectives.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no atexit, no pytest teardown in the child


if __name__ == "__main__":
    code = main()
    collectives.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as autopart.runtime.run: skip the teardown where gloo's threads may abort
