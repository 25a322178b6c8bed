"""The public entry point: ``parallelize(model, mesh, example_inputs=..., ...)``.

With an offline ``autopart.Mesh`` it returns the compiled ``Program`` (every rank's program, to
print, inspect or save). With a live torch ``DeviceMesh`` (under torchrun) it returns the
``Runner`` of the local rank, ready to ``step(input_ids, labels)``.
"""

from __future__ import annotations

from typing import Any

import torch
from rich.progress import Progress
from torch import fx, nn

from autopart.capture import META_INPUT, Captured, capture
from autopart.compiler import run_passes
from autopart.emit import Program, RankProgram, Shard, StageProgram
from autopart.errors import AutopartError
from autopart.passes import PIPELINE
from autopart.passes.data_parallel import buckets
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
    sequence_parallel: bool = False,
    bucket_mb: float = 25.0,
    timeout_s: float = 300.0,
) -> Any:
    """Compile ``model`` for ``mesh``: a ``Program`` offline, the local ``Runner`` if live.

    ``example_inputs`` is ``(input_ids, labels)``, int64 ``(batch, seq)``; not needed when
    ``model`` is already a ``Captured``.
    """
    offline, live = mesh_from(mesh)
    plan = Plan(
        offline, schedule, microbatches, virtual_stages, seq_chunks, sequence_parallel, bucket_mb
    )
    if isinstance(model, Captured):
        captured = model
    elif example_inputs is None:
        raise AutopartError(
            "parallelize needs example_inputs=(input_ids, labels) to capture the model"
        )
    else:
        captured = capture(model, example_inputs)
    program = compile_program(captured, plan)
    if live is None:
        return program
    from autopart.runtime.runner import Runner

    return Runner.from_program(program, live, timeout_s=timeout_s)


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


def compile_program(captured: Captured, plan: Plan, progress: Progress | None = None) -> Program:
    """Run the passes and the schedule generator: one ``RankProgram`` per rank of the mesh."""
    mesh = plan.mesh
    gm, history = run_passes(_copy(captured.graph), plan, PIPELINE)
    inputs = [n.meta[META_INPUT] for n in gm.graph.nodes if n.op == "placeholder"]
    split = {n.meta[META_INPUT].name: n.meta.get(META_SHARD) for n in gm.graph.nodes
             if n.op == "placeholder" and n.meta[META_INPUT].kind == "param"}  # fmt: skip
    ranks = []
    for r in range(mesh.size):
        coords = mesh.coords(r)
        peers = mesh.group("pp", r)
        ranks.append(RankProgram(
            rank=r, coords=coords,
            groups={d: mesh.group(d, r) for d in ("dp", "pp", "tp")},
            stages=[StageProgram(coords["pp"], gm, inputs)],
            actions=generate(plan.schedule, coords["pp"], plan.microbatches, peers, mesh.dp),
            shards=_shards(captured, split, coords["tp"], mesh.tp), buckets=buckets(gm),
        ))  # fmt: skip
    units = {(s, mb, 0) for s in range(mesh.pp) for mb in range(plan.microbatches)}
    for pipeline in mesh.groups("pp"):
        verify({r: ranks[r].actions for r in pipeline}, units)
    return Program(plan, ranks, dict(captured.params), dict(captured.buffers), dict(captured.tied),
                   captured.example_shape, captured.vocab_size, history)  # fmt: skip
