"""The public entry point: ``parallelize(model, mesh, example_inputs=..., ...)``.

With an offline ``autopart.Mesh`` it returns the compiled ``Program`` (every rank's program, to
print, inspect or save). With a live torch ``DeviceMesh`` (under torchrun) it returns the
``Runner`` of the local rank, ready to ``step(input_ids, labels)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from autopart.capture import META_INPUT, Captured, capture
from autopart.chunks import chunk_lengths, cost_coefficients
from autopart.compiler import run_passes
from autopart.emit import Program, RankProgram, Shard, StageProgram
from autopart.errors import AutopartError
from autopart.passes import PIPELINE
from autopart.passes.data_parallel import buckets
from autopart.passes.pipeline_split import stage_graphs
from autopart.passes.tensor_parallel import META_SHARD
from autopart.plan import Plan, mesh_from
from autopart.schedule import generate, verify


def parallelize(
    model: nn.Module | Captured,
    mesh: Any,
    example_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual_stages: int = 1,
    seq_chunks: int = 1,
    seq_split: str = "balanced",
    sequence_parallel: bool = False,
    bucket_mb: float = 25.0,
    max_stage_memory_gb: float | None = None,
    timeout_s: float = 300.0,
    compile: bool = False,
) -> Any:
    """Compile ``model`` for ``mesh``: a ``Program`` offline, the local ``Runner`` if live.

    ``example_inputs`` is ``(input_ids, labels)``, int64 ``(batch, seq)``; not needed when
    ``model`` is already a ``Captured``. ``compile=True`` (live meshes) runs each stage graph
    through ``torch.compile`` (Inductor), as ``autopart run --compile`` does.
    """
    offline, live = mesh_from(mesh)
    plan = Plan(
        offline,
        schedule,
        microbatches,
        virtual_stages,
        seq_chunks,
        sequence_parallel,
        bucket_mb,
        max_stage_memory_gb,
        seq_split,
    )
    if isinstance(model, Captured):
        captured = model
    elif example_inputs is None:
        raise AutopartError(
            "parallelize needs example_inputs=(input_ids, labels) to capture the model"
        )
    else:
        captured = capture(model, example_inputs)
    # refused now, not at the first step: the example batch is taken for the training batch
    plan.check_batch(captured.example_shape[0])
    seq, tp = captured.example_shape[1], plan.mesh.tp
    if plan.sequence_parallel and seq % tp:
        raise AutopartError(
            f"sequence length {seq} is not divisible by tp={tp}, which sequence parallelism needs",
            hint=f"use a sequence length that is a multiple of {tp}, or turn sequence_parallel off",
        )
    program = compile_program(captured, plan)
    if live is None:
        return program
    from autopart.runtime.runner import Runner

    return Runner.from_program(program, live, timeout_s=timeout_s, compile=compile)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new


def _shards(captured: Captured, split: dict, tp_index: int, tp: int) -> dict[str, Shard]:
    """Each parameter's slice on a rank with this tp index (whole when not split)."""
    out = {}
    for fqn, t in captured.params.items():
        s = split.get(fqn)
        shape = tuple(t.shape)
        out[fqn] = Shard(shape) if s is None else Shard(shape, s.dim, tp_index, tp, s.strided)
    return out


def compile_program(captured: Captured, plan: Plan) -> Program:
    """Run the passes and the schedule generator: one ``RankProgram`` per rank of the mesh."""
    mesh = plan.mesh
    gm = _copy(captured.graph)
    gm.meta["autopart.example_shape"] = captured.example_shape
    gm, history = run_passes(gm, plan, PIPELINE)
    stages = stage_graphs(gm)
    inputs = [
        st.meta.get("autopart.inputs")
        or [n.meta[META_INPUT] for n in st.graph.nodes if n.op == "placeholder"]
        for st in stages
    ]
    for st, refs in zip(stages, inputs, strict=True):
        st.meta["autopart.passes"] = gm.meta.get("autopart.passes", [])
        for n, ref in zip((n for n in st.graph.nodes if n.op == "placeholder"), refs, strict=True):
            n.meta[META_INPUT] = ref
    split = {
        n.meta[META_INPUT].name: n.meta.get(META_SHARD)
        for st in stages
        for n in st.graph.nodes
        if n.op == "placeholder" and n.meta[META_INPUT].kind == "param"
    }
    holders: dict[str, set[int]] = {}  # FQN → pipeline ranks whose stages use it
    for k, refs in enumerate(inputs):
        for ref in refs:
            if ref.kind == "param":
                holders.setdefault(ref.name, set()).add(k % mesh.pp)
    ties = {f: sorted(pps) for f, pps in holders.items() if len(pps) > 1}
    chunk_cost = cost_coefficients(captured) if plan.schedule.startswith("seq1f1b") else None
    if chunk_cost is not None:  # refuse chunks the example sequence cannot hold, now, not at run
        chunk_lengths(
            chunk_cost,
            captured.example_shape[1],
            plan.seq_chunks,
            plan.seq_split,
            plan.chunk_multiple,
        )
    ranks = []
    for r in range(mesh.size):
        coords = mesh.coords(r)
        mine = [k for k in range(len(stages)) if k % mesh.pp == coords["pp"]]
        used = {ref.name for k in mine for ref in inputs[k] if ref.kind == "param"}
        shards = _shards(captured, split, coords["tp"], mesh.tp)
        ranks.append(
            RankProgram(
                rank=r,
                coords=coords,
                groups={d: mesh.group(d, r) for d in ("dp", "pp", "tp")},
                stages=[StageProgram(k, stages[k], inputs[k]) for k in mine],
                actions=generate(
                    plan.schedule,
                    coords["pp"],
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
            )
        )
    units = {
        (s, mb, c)
        for s in range(len(stages))
        for mb in range(plan.microbatches)
        for c in range(plan.seq_chunks)
    }
    for pipeline in mesh.groups("pp"):
        verify({r: ranks[r].actions for r in pipeline}, units)
    program = Program(
        plan,
        ranks,
        dict(captured.params),
        dict(captured.buffers),
        dict(captured.tied),
        captured.example_shape,
        captured.vocab_size,
        history,
    )
    program.split = {
        k: gm.meta[f"autopart.{k}"] for k in ("unit_costs", "cuts") if f"autopart.{k}" in gm.meta
    }
    return program


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
