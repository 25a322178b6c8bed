"""``autopart simulate``: predict one training iteration of a plan on a GPU cluster, or
(``--measured TRACE``) replay the per-action costs of a run measured here."""

from __future__ import annotations

import argparse
from typing import Any

from autopart.cli.common import MODEL_DEFAULTS, fill_defaults, model_flags, model_shape
from autopart.errors import AutopartError, positive_int
from autopart.schedule.generators import traits

EPILOG = """examples:
  autopart simulate --shape megatron-1t --gpus 3072 --tp 8 --pp 64 --virtual-stages 2 \\
      --schedule interleaved-1f1b --global-batch 3072 --recompute full --attention unfused
  autopart simulate --layers 96 --hidden 12288 --heads 96 --vocab 51200 --seq 2048 \\
      --gpus 1024 --tp 8 --pp 16 --global-batch 1536 --schedule seq1f1b --seq-chunks 4 --json
  autopart simulate --model examples/gpt7b.py:make --seq 4096 --cluster dgx-h100 --gpus 64 \\
      --tp 8 --pp 2 --global-batch 512 --trace sim.json   (then: autopart timeline sim.json)
  autopart simulate --measured run.json --global-batch 16
      (run.json from: autopart run DIR --steps 3 --trace run.json; predicts DIR's layout at 16
      sequences per step from the costs measured there)

model shapes (--shape): gpt3-175b, megatron-1t, gpt-7b. clusters (--cluster): dgx-a100-80gb,
dgx-h100, or a .toml / .json file (see docs/simulate.md).
"""

# Every flag but these has the default None, so that "given" reads "not None": --measured takes
# only these, and the others get their real defaults (DEFAULTS) without it.
WITH_MEASURED = ("measured", "global_batch", "schedule", "json", "trace")
DEFAULTS: dict[str, Any] = {
    **MODEL_DEFAULTS,
    "tp": 1,
    "pp": 1,
    "virtual_stages": 1,
    "micro_batch": 1,
    "schedule": "1f1b",
    "seq_chunks": 1,
    "seq_split": "balanced",
    "recompute": "none",
    "sequence_parallel": False,
    "distributed_optimizer": False,
    "ignore_memory": False,
}  # --attention: None is the cluster's kernel


def add_parser(sub: argparse._SubParsersAction) -> None:
    from autopart.layout import RECOMPUTE, SCHEDULES
    from autopart.planning.cluster import ATTENTION
    from autopart.schedule.chunks import SPLITS

    d = DEFAULTS
    s = sub.add_parser(
        "simulate",
        help="predict one training iteration on a GPU cluster",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --virtual is refused, not taken for --virtual-stages
    )
    model_flags(s, gpus_required=False)
    s.add_argument(
        "--measured",
        metavar="TRACE",
        help="replay the per-action costs of a real run here (the trace of autopart run "
        "DIR --trace TRACE) instead of a model and cluster: predicts that layout with "
        "--global-batch sequences or --schedule (docs/simulate.md, 'Calibration')",
    )
    g = s.add_argument_group("plan (dp = gpus / (tp × pp))")
    g.add_argument("--tp", type=positive_int, help=f"tensor-parallel ranks (default {d['tp']})")
    g.add_argument("--pp", type=positive_int, help=f"pipeline ranks (default {d['pp']})")
    g.add_argument(
        "--virtual-stages",
        type=positive_int,
        help=f"virtual stages per pipeline rank (default {d['virtual_stages']})",
    )
    g.add_argument(
        "--micro-batch",
        type=positive_int,
        help=f"sequences per micro-batch (default {d['micro_batch']})",
    )
    g.add_argument(
        "--global-batch",
        type=positive_int,
        help="sequences per iteration (required, except with --measured: the run's)",
    )
    g.add_argument(
        "--schedule",
        help=f"one of {', '.join(SCHEDULES)} (default {d['schedule']}; with --measured, the run's)",
    )
    g.add_argument(
        "--seq-chunks",
        type=positive_int,
        help=f"Seq1F1B sequence chunks (default {d['seq_chunks']})",
    )
    g.add_argument(
        "--seq-split",
        choices=SPLITS,
        help=f"Seq1F1B chunk boundaries (default {d['seq_split']})",
    )
    g.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        help=f"activation recomputation (default {d['recompute']})",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="Megatron sequence parallelism",
    )
    g.add_argument(
        "--attention",
        choices=ATTENTION,
        help="attention kernel: fused causal (flash) or unfused (Megatron 2021) "
        "(default: the cluster's, flash on the presets)",
    )
    g.add_argument(
        "--distributed-optimizer",
        action="store_true",
        default=None,
        help="shard the optimizer state over dp (Megatron's distributed optimizer)",
    )
    s.add_argument("--trace", metavar="FILE", help="write the simulated pipeline as a Chrome trace")
    s.add_argument(
        "--ignore-memory",
        action="store_true",
        default=None,
        help="predict a plan even when it does not fit the GPUs' memory (default: "
        "refuse it, saying by how much and what would fit)",
    )


def main(a: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from rich.console import Console

    from autopart.layout import Mesh, Plan
    from autopart.planning.cluster import load_cluster
    from autopart.planning.simulate import print_summary, simulate

    if a.measured is not None:
        return measured(a)
    for flag, value in (("--gpus", a.gpus), ("--global-batch", a.global_batch)):
        if value is None:
            raise AutopartError(
                f"simulate needs {flag}", hint="or --measured TRACE to replay a run measured here"
            )
    fill_defaults(a, DEFAULTS)
    mesh = Mesh(tp=a.tp, pp=a.pp)  # positive sizes, before they divide --gpus
    if a.gpus % (mesh.tp * mesh.pp):
        raise AutopartError(
            f"--gpus {a.gpus} is not divisible by tp × pp = {mesh.tp * mesh.pp}",
            hint="dp = gpus / (tp × pp) must be a whole number",
        )
    plan = Plan.from_batch(
        a.global_batch,
        a.micro_batch,
        tp=a.tp,
        pp=a.pp,
        dp=a.gpus // (a.tp * a.pp),
        virtual_stages=a.virtual_stages,
        schedule=a.schedule,
        seq_chunks=a.seq_chunks,
        seq_split=a.seq_split,
        recompute=a.recompute,
        sequence_parallel=a.sequence_parallel,
        distributed_optimizer=a.distributed_optimizer,
    )
    cluster = load_cluster(a.cluster)
    if a.attention is not None:
        cluster = replace(cluster, attention=a.attention)
    shape, captured = model_shape(a, captured=True)
    memory = None
    if captured is not None:  # a captured model: its activations read off the compiled graphs
        from autopart.planning.memory import graph_memory

        memory = graph_memory(captured, plan, shape.seq)
    sim = simulate(
        shape,
        cluster,
        plan,
        record=bool(a.trace),
        extrapolate=False if a.trace else None,
        memory=memory,
    )
    if not sim.summary.fits and not a.ignore_memory:
        _does_not_fit(shape, sim)
    if a.trace:
        with open(a.trace, "w") as f:
            json.dump({"traceEvents": sim.chrome_trace()}, f)
    if a.json:
        print(json.dumps(sim.summary.to_json()))
    else:
        con = Console()
        con.print(sim.shape.describe())
        print_summary(sim.summary, con)
        if a.trace:
            con.print(f"wrote {a.trace} (draw it: autopart timeline {a.trace})")
    return 0


def _does_not_fit(shape, sim) -> None:
    """Refuse a simulated plan over the cluster's memory: by how much, and what would fit."""
    from autopart.planning.cluster import GIB
    from autopart.planning.planner import fitting_alternatives

    mem = sim.summary.memory
    over = mem.total - mem.usable
    fits = fitting_alternatives(shape, sim.cluster, sim.plan)
    hint = (
        "these fit: "
        + "; ".join(f"{alt.describe()} needs {need / GIB:.1f} GiB" for alt, need in fits)
        + "."
        if fits
        else "no single change of layout fits; more GPUs or a smaller model may."
    )
    raise AutopartError(
        f"{sim.plan.describe()} does not fit: rank {mem.rank} needs {mem.total:.1f} GiB "
        f"per GPU ({mem.parameters:.1f} parameters, {mem.gradients:.1f} gradients, "
        f"{mem.optimizer:.1f} optimizer state, {mem.activations:.1f} activations), "
        f"{over:.1f} GiB over the {mem.usable:.1f} usable on {sim.cluster.name}",
        hint=f"{hint} autopart plan searches every layout; --ignore-memory prints the "
        "prediction anyway",
    )


def measured(a: argparse.Namespace) -> int:
    """``simulate --measured TRACE``: the measured layout, predicted from its own action costs."""
    import json

    from rich.console import Console

    from autopart.planning.calibrate import load, predict, print_prediction

    given = [
        name
        for name, value in vars(a).items()
        if value is not None and name not in (*WITH_MEASURED, "command")
    ]
    if given:
        raise AutopartError(
            f"--{given[0].replace('_', '-')} does not go with --measured: the model, cluster "
            "and layout are the measured run's",
            hint="--measured takes --global-batch, --schedule, --json and --trace",
        )
    m = load(a.measured)
    mb = None
    if a.global_batch is not None:  # sequences → micro-batches of the measured size
        per = m.dp * m.microbatch_size
        if not per:
            raise AutopartError(
                f"{a.measured} does not record the micro-batch size",
                hint="re-measure with this version of autopart run",
            )
        if a.global_batch % per:
            raise AutopartError(
                f"--global-batch {a.global_batch} is not a whole number of "
                f"micro-batches of {m.microbatch_size} sequences on {m.dp} dp ranks",
                hint=f"use a multiple of {per} (the run measured {per * m.microbatches})",
            )
        mb = a.global_batch // per
    name = a.schedule or m.schedule
    # predict() does not check the schedule's rules (schedule.check_schedule): say it in
    # --global-batch terms here
    if traits(name).interleaved and m.pp > 1 and (mb or m.microbatches) % m.pp:
        per_round = m.dp * m.microbatch_size * m.pp
        raise AutopartError(
            f"{name} needs a multiple of pp={m.pp} micro-batches; --global-batch "
            f"{a.global_batch} gives {mb}",
            hint=f"use a multiple of {per_round} for --global-batch",
        )
    pred = predict(m, microbatches=mb, schedule=a.schedule, record=bool(a.trace))
    if a.trace:
        from autopart.planning.simulate import to_chrome_trace

        with open(a.trace, "w") as f:
            json.dump({"traceEvents": to_chrome_trace(pred.timeline.events)}, f)
    if a.json:
        print(json.dumps(pred.summary.to_json()))
    else:
        con = Console()
        print_prediction(pred.summary, con)
        if a.trace:
            con.print(f"wrote {a.trace} (draw it: autopart timeline {a.trace})")
    return 0
