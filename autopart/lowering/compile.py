"""Lowering: a captured graph and a ``Plan`` become one ``RankProgram`` per rank.

``compile_program`` is a sequence of small named steps, each returning plain values:

1. ``apply_passes``      copy the captured graph and run the passes (``autopart.passes.PIPELINE``)
2. ``split_stages``      the stage graphs, each with the list of what feeds its placeholders
3. ``tied_across``       parameters that stages on several pipeline ranks use (``TIE_REDUCE``)
4. ``chunk_costs``       Seq1F1B only: the chunk-boundary cost polynomial, checked on the example
5. ``dry_run``           every stage's forward and backward once on fake tensors of its real
                         input shapes (lowering/dry_run.py): a missing derivative or a shape
                         that does not fit is refused here, naming stage and node
6. ``rank_program``      one rank's stages, shards, actions, buckets and groups
7. ``check_schedules``   every pipeline group's actions pass the static schedule verifier

Before step 1, ``refuse_library_ops`` refuses a captured graph that calls an op outside ATen,
autopart and the library namespaces the plan trusts (``Plan.library_ops``: a library's custom
op capture could not decompose), and ``seq_limits`` sets ``Plan.min_seq`` and ``max_seq``, the
shortest and longest sequence the captured graph fits, and raises ``Plan.seq_block`` to the
multiple of tokens every length must be (found once per capture:
``frontend/shapes.shortest_sequence``, ``longest_sequence`` and ``sequence_multiple``). After
step 1, a graph whose attention rests on masks proven causal by evaluation
(``passes/canonicalize_attention``) lowers ``max_seq`` to the length they were proven at (the
capture example's, at least 4096 tokens): no longer sequence was tried. After step 5,
``refuse_row_mixing`` refuses a plan that splits the batch (dp, micro-batches) for a graph in
which rows of the batch mix (``passes/seq_rules.rows_mixed``).

``split_stages`` also makes each stage graph name no device (``autopart.graph.device_free``): the runtime
places a program on its rank's device (``autopart/runtime/placement.py``).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import fx

from autopart.errors import AutopartError
from autopart.frontend.capture import Captured, InputRef
from autopart.frontend.shapes import (
    PAST_TABLE,
    longest_sequence,
    sequence_multiple,
    shortest_sequence,
)
from autopart.graph import computation_digest, device_free
from autopart.layout import BUILTIN_OPS as BUILTIN
from autopart.layout import Plan
from autopart.lowering.chunks import cost_coefficients
from autopart.lowering.dry_run import dry_run
from autopart.lowering.pass_runner import run_passes
from autopart.meta import (
    META_CUTS,
    META_INPUT,
    META_INPUTS,
    META_MODULE,
    META_PASSES,
    META_PROVEN_SEQ,
    META_SEQ_BLOCK,
    META_SHARD,
    META_UNIT_COSTS,
)
from autopart.passes import PIPELINE
from autopart.passes.data_parallel import buckets
from autopart.passes.pipeline_split import stage_graphs
from autopart.passes.seq_rules import rows_mixed
from autopart.program import libraries
from autopart.program.archive import allowed_call, aten_refusal
from autopart.program.format import PassRecord, Program, RankProgram, Shard, StageProgram
from autopart.schedule import generate, verify
from autopart.schedule.chunks import chunk_lengths
from autopart.schedule.tags import Tags

log = logging.getLogger("autopart")


def compile_program(captured: Captured, plan: Plan) -> Program:
    """Run the passes and the schedule generator: one ``RankProgram`` per rank of the mesh."""
    used = refuse_library_ops(captured.graph, plan.library_ops)
    low, high, step = seq_limits(captured)
    plan = replace(plan, min_seq=low, max_seq=high, seq_block=math.lcm(plan.seq_block, step))
    gm, history = apply_passes(captured, plan)
    proven = gm.meta.get(META_PROVEN_SEQ)  # attention proven causal up to this length only
    if proven is not None and (plan.max_seq is None or proven < plan.max_seq):
        plan = replace(plan, max_seq=proven)
    block = gm.meta.get(META_SEQ_BLOCK, 1)  # a scan's block: chunks are whole blocks
    if plan.chunked and plan.chunk_multiple % block:
        plan = replace(plan, seq_block=math.lcm(plan.seq_block, block))
    stages, inputs = split_stages(gm)
    handed = max(sum(ref.kind == "act" for ref in refs) for refs in inputs)
    Tags.of(plan.mesh.pp, len(stages) // plan.mesh.pp, plan.microbatches, plan.seq_chunks).check(
        handed
    )  # the tensors a stage hands the next fit the pipeline's message tags
    ties = tied_across(inputs, plan.mesh.pp)
    chunk_cost = chunk_costs(captured, plan)
    dry_run(stages, inputs, captured, plan, chunk_cost)
    refuse_row_mixing(captured, plan)  # after the refusals that name a sequence or a stage
    ranks = [
        rank_program(r, captured, plan, stages, inputs, ties, chunk_cost)
        for r in range(plan.mesh.size)
    ]
    model = computation_digest(captured.graph)
    for rp in ranks:
        rp.model = model
    check_schedules(ranks, plan, len(stages))
    program = Program(
        plan,
        ranks,
        dict(captured.params),
        dict(captured.buffers),
        dict(captured.tied),
        captured.example_shape,
        captured.vocab_size,
        history,
        libraries=libraries.record(used),
    )
    program.split = {
        name: gm.meta[key]
        for name, key in (("unit_costs", META_UNIT_COSTS), ("cuts", META_CUTS))
        if key in gm.meta
    }
    return program


def seq_limits(captured: Captured) -> tuple[int | None, int | None, int]:
    """The shortest and the longest sequence the captured graph fits (None: any) and the
    multiple of tokens every length must be (1: any), found once per capture; a limit is
    announced with its reason (a step outside them is then refused)."""
    if captured.seq_limit is None or captured.seq_floor is None or captured.seq_step is None:
        # (capture may have set both: a number computed from the length, kept at its value)
        captured.seq_limit = captured.seq_limit or longest_sequence(
            captured.graph, captured.example_shape
        )
        captured.seq_floor = captured.seq_floor or shortest_sequence(
            captured.graph, captured.example_shape
        )
        fixed = captured.seq_floor[0] is not None
        captured.seq_step = (
            (1, "") if fixed else sequence_multiple(captured.graph, captured.example_shape)
        )
        (high, up), (low, down), (step, between) = (
            captured.seq_limit,
            captured.seq_floor,
            captured.seq_step,
        )
        if low is not None and low == high:
            fits, why = f"exactly {low} tokens", down
        elif low is not None:
            fits, why = f"at least {low} tokens", down
            fits += "" if high is None else f" and at most {high}"
            why += "" if high is None else f"; {up}"
        else:
            fits, why = f"at most {high} tokens", up
        if step > 1:
            fits = f"a multiple of {step} tokens" + ("" if high is None else f", {fits}")
            why = between + ("" if high is None else f"; {why}")
        if low is None and step == 1 and high is not None and PAST_TABLE in up:
            # the model's own table of positions: one device cannot go longer either
            log.info("the model takes sequences of at most %d tokens (%s)", high, up)
        elif low is not None or high is not None or step > 1:
            warnings.warn(
                f"the captured model fits sequences of {fits} ({why}); a step of a length "
                "outside that is refused. If the model itself allows others, capture it with "
                "an example of such a length (torch.export fixed a size the example implied)",
                UserWarning,
                stacklevel=3,
            )
    return captured.seq_floor[0], captured.seq_limit[0], captured.seq_step[0]


def refuse_row_mixing(captured: Captured, plan: Plan) -> None:
    """Refuse a plan that splits the batch (dp, micro-batches) for a graph in which rows of
    the batch mix (``passes/seq_rules.rows_mixed``, proven once per capture): a statistic over
    the batch, a running count or a top-k over the flattened batch·sequence (an expert's
    capacity), an op no rule proves row by row. Each rank would compute on its own rows as if
    they were the batch: trained, and silently off (loss 1.5e-3, gradients 195 % off for a
    Switch-style capacity router under dp=2)."""
    splits = plan.mesh.dp * plan.microbatches
    if splits == 1:
        return
    if captured.rows_mixed is None:
        captured.rows_mixed = [
            (n.name, n.meta.get(META_MODULE) or "<root>", why)
            for n, why in rows_mixed(captured.graph)
        ]
    if captured.rows_mixed:
        name, module, why = captured.rows_mixed[0]
        more = len(captured.rows_mixed) - 1
        by = " and ".join(
            x
            for x in (
                f"dp={plan.mesh.dp}" if plan.mesh.dp > 1 else "",
                f"{plan.microbatches} micro-batches" if plan.microbatches > 1 else "",
            )
            if x
        )
        raise AutopartError(
            f"{by} split the batch into {splits} parts, but node {name} ({module}) mixes rows "
            f"of the batch: {why}"
            + (f" (and {more} more node{'s' if more > 1 else ''})" if more else "")
            + "; each part would be computed as if it were the whole batch",
            hint="train this model with dp=1 and microbatches=1 (tp and pp without "
            "micro-batches keep the batch whole), or compute the statistic per row (per "
            "sequence, or per token: an expert's capacity per sequence, a top-k per token)",
        )


def refuse_library_ops(gm: fx.GraphModule, trusted: Sequence[str] = ()) -> set[str]:
    """Refuse a graph that calls anything but ATen ops, autopart's ops, ops of the library
    namespaces in ``trusted`` (``Plan.library_ops``) and Python operators on sizes: a library's
    custom op (``torch.ops.transformers.*``) that capture could not decompose to ATen and the
    user did not opt in to. A saved program calling it would be refused at load (loading it
    could run the library's code), and the passes have no rule for it. An ATen op is refused
    by the loader's own rule (``archive.aten_refusal``: no op that writes an argument, returns
    nothing, reads a string or touches global state). Returns the trusted namespaces the graph
    calls."""
    namespaces = (*BUILTIN, *trusted)
    used = set()
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        op = n.target
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten":
            why = aten_refusal(op)
            if why is None:
                continue
            raise AutopartError(
                f"node {n.name} ({n.meta.get(META_MODULE) or '<root>'}) calls {op}, which {why}; "
                "a saved program may call only ATen ops without side effects (a folder calling "
                "it would be refused at load: docs/security.md)",
                hint="compute this without the op (its result with a pure op), or move the "
                "side effect out of the model's forward",
            )
        if allowed_call(n, namespaces):
            if isinstance(op, torch._ops.OpOverload) and op.namespace in trusted:
                used.add(op.namespace)
            continue
        name = op.name() if isinstance(op, torch._ops.OpOverload) else getattr(op, "__name__", op)
        space = getattr(op, "namespace", None) or getattr(op, "__module__", "?")
        raise AutopartError(
            f"node {n.name} ({n.meta.get(META_MODULE) or '<root>'}) calls {name}, an op of the "
            f"namespace {space!r} with no ATen decomposition; autopart compiles ATen and its "
            "own ops only (a saved program calling it could not be loaded)",
            hint="register an ATen decomposition for it (torch.library's "
            "CompositeImplicitAutograd kernel, or autopart.frontend.capture."
            "LIBRARY_DECOMPOSITIONS), configure the model to compute it with torch ops, or, if "
            f"you trust the library, opt in: library_ops=({space!r},) (its version is recorded, "
            "and whoever loads the program must name it too)",
        )
    return used


def apply_passes(captured: Captured, plan: Plan) -> tuple[fx.GraphModule, list[PassRecord]]:
    """A copy of the captured graph, transformed by every pass (the capture stays untouched)."""
    return run_passes(captured.for_passes(), plan, PIPELINE)


def split_stages(gm: fx.GraphModule) -> tuple[list[fx.GraphModule], list[list[InputRef]]]:
    """The stage graphs (one when pp = 1) and, per stage, what feeds each placeholder."""
    stages = stage_graphs(gm)
    inputs = [
        st.meta.get(META_INPUTS)
        or [n.meta[META_INPUT] for n in st.graph.nodes if n.op == "placeholder"]
        for st in stages
    ]
    for st, refs in zip(stages, inputs, strict=True):
        device_free(st)
        st.meta[META_PASSES] = gm.meta.get(META_PASSES, [])
        for n, ref in zip((n for n in st.graph.nodes if n.op == "placeholder"), refs, strict=True):
            n.meta[META_INPUT] = ref
    return stages, inputs


def tied_across(inputs: list[list[InputRef]], pp: int) -> dict[str, list[int]]:
    """FQN → the pipeline ranks whose stages use it, for parameters used on several."""
    holders: dict[str, set[int]] = {}
    for k, refs in enumerate(inputs):
        for ref in refs:
            if ref.kind == "param":
                holders.setdefault(ref.name, set()).add(k % pp)
    return {f: sorted(pps) for f, pps in holders.items() if len(pps) > 1}


def chunk_costs(captured: Captured, plan: Plan) -> tuple[float, ...] | None:
    """Seq1F1B's chunk-boundary cost coefficients, refused now if the example sequence cannot
    hold the chunks (not at the first step); ``None`` for other schedules."""
    if not plan.chunked:
        return None
    cost = cost_coefficients(captured)
    seq = captured.example_shape[1]
    chunk_lengths(cost, seq, plan.seq_chunks, plan.seq_split, plan.chunk_multiple)
    return cost


def _shards(captured: Captured, split: dict, tp_index: int, tp: int) -> dict[str, Shard]:
    """Each parameter's slice on a rank with this tp index (whole when not split)."""
    out = {}
    for fqn, t in captured.params.items():
        s = split.get(fqn)
        shape = tuple(t.shape)
        out[fqn] = Shard(shape) if s is None else Shard(shape, s.dim, tp_index, tp, s.strided)
    return out


def rank_program(
    r: int,
    captured: Captured,
    plan: Plan,
    stages: list[fx.GraphModule],
    inputs: list[list[InputRef]],
    ties: dict[str, list[int]],
    chunk_cost: tuple[float, ...] | None,
) -> RankProgram:
    """Rank ``r``'s program: stage ``k`` runs on pipeline rank ``k mod pp``."""
    mesh = plan.mesh
    coords = mesh.coords(r)
    mine = [k for k in range(len(stages)) if k % mesh.pp == coords.pp]
    used = {ref.name for k in mine for ref in inputs[k] if ref.kind == "param"}
    if coords.pp == 0:  # parameters no stage reads (an unused module): held, never updated
        read = {ref.name for refs in inputs for ref in refs if ref.kind == "param"}
        used |= set(captured.params) - read
    split = {  # FQN → how tensor parallelism split it (None: replicated)
        n.meta[META_INPUT].name: n.meta.get(META_SHARD)
        for st in stages
        for n in st.graph.nodes
        if n.op == "placeholder" and n.meta[META_INPUT].kind == "param"
    }
    shards = _shards(captured, split, coords.tp, mesh.tp)
    return RankProgram(
        rank=r,
        coords=coords,
        groups={d: mesh.group(d, r) for d in ("dp", "pp", "tp")},
        stages=[StageProgram(k, stages[k], inputs[k]) for k in mine],
        actions=generate(
            plan.schedule,
            coords.pp,
            plan.microbatches,
            mesh.group("pp", r),
            mesh.dp,
            plan.virtual_stages,
            tied=any(f in ties for f in used),
            k=plan.seq_chunks,
        ),
        shards={f: s for f, s in shards.items() if f in used},
        buckets=_rank_buckets([stages[k] for k in mine]),
        ties={f: pps for f, pps in ties.items() if f in used},
        n_stages=len(stages),
        chunk_cost=chunk_cost,
        vocab_size=captured.vocab_size,
        batch_names=captured.batch_names,
        frozen=tuple(
            sorted(f for f in shards if f in used and not captured.params[f].requires_grad)
        ),
    )


def _rank_buckets(stages: list[fx.GraphModule]) -> list[list[str]]:
    """This rank's gradient buckets over all its stages (later stages' gradients come first)."""
    out, seen = [], set()
    for st in reversed(stages):
        for b in buckets(st):
            b = [f for f in b if f not in seen]
            seen.update(b)
            if b:
                out.append(b)
    return out


def check_schedules(ranks: list[RankProgram], plan: Plan, n_stages: int) -> None:
    """Every pipeline group's action lists run every (stage, micro-batch, chunk) unit once,
    in an order that cannot deadlock (``autopart.schedule.verify``)."""
    units = {
        (s, mb, c)
        for s in range(n_stages)
        for mb in range(plan.microbatches)
        for c in range(plan.seq_chunks)
    }
    for pipeline in plan.mesh.groups("pp"):
        verify({r: ranks[r].actions for r in pipeline}, units)
