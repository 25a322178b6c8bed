"""Activation memory read off a compiled program's graphs, before anything runs.

``unit_bytes(program, micro_batch, seq)`` gives, for every (stage, chunk) unit of one
micro-batch, two numbers:

- **held**: the bytes the unit keeps from its forward until its backward ends — what autograd
  saves for backward in the stage graph's ops, plus, for each recomputation region, the
  region's inputs instead of what is inside it (non-reentrant checkpointing keeps only those,
  each region its own);
- **transient**: the most bytes one recomputation region saves while its backward reruns it
  (zero without recomputation).

How: each stage graph runs forward, chunk after chunk, on fake tensors (``FakeTensorMode``:
shapes, dtypes and a device, no data, no process group: collectives are custom ops whose fake
kernels give their shapes). The fake tensors claim the device the program will run on, so each
op dispatches as it will there (CPU's SDPA is a fused kernel; on ``meta`` it would be the
unfused math one),
with autograd on and ``saved_tensors_hooks`` that attribute each saved tensor to the node
running. Stage ``s`` takes stage ``s - 1``'s outputs of the same chunk; chunk ``j`` takes chunk
``j - 1``'s K/V prefix, as the runtime hands them over. Parameters and buffers (and views
starting where they start) are not activations; a tensor saved by two ops counts twice — both
as ``runtime.runner.SavedBytes`` counts them, so predicted and measured bytes mean the same.

The simulator (``planning/simulate/``) adds these per-unit bytes up over a rank's schedule:
that is its activation-memory prediction for a captured model (the analytic formula is for
named shapes, which have no graph). The graphs of one tp rank of each pipeline position stand
for all (the other tp and dp ranks run the same shapes).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef

from autopart.graph import kv_dtypes
from autopart.layout import Coords, Mesh
from autopart.lowering import compile_program
from autopart.meta import META_KV_SHAPES
from autopart.program.feeds import chunk_feeds, example_batch, stage_inputs
from autopart.program.format import Program, RankProgram
from autopart.runtime.placement import place
from autopart.runtime.recompute import regions
from autopart.schedule.chunks import chunk_bounds


def unit_bytes(
    program: Program, micro_batch: int, seq: int, device: str | torch.device = "cpu"
) -> dict[tuple[int, int], tuple[int, int]]:
    """(stage, chunk) → (held, transient) bytes of one micro-batch of ``micro_batch`` sequences
    of ``seq`` tokens, the program running on ``device`` (see the module docstring)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return _unit_bytes(program, micro_batch, seq, torch.device(device), mode)


def _unit_bytes(
    program: Program, micro_batch: int, seq: int, device: torch.device, mode: FakeTensorMode
) -> dict[tuple[int, int], tuple[int, int]]:
    plan = program.plan
    ranks = {rp.coords.pp: rp for rp in program.ranks if rp.coords.tp == rp.coords.dp == 0}
    cost = next(iter(ranks.values())).chunk_cost or (1.0, 0.0)
    bounds = chunk_bounds(cost, seq, plan.seq_chunks, plan.seq_split, plan.chunk_multiple)
    compute = plan.compute_dtype
    n_stages = next(iter(ranks.values())).n_stages
    graphs, feeds = {}, {}
    for s in range(n_stages):
        rp = ranks[s % plan.mesh.pp]
        st = next(x for x in rp.stages if x.stage == s)
        graphs[s] = (place(st.graph, device), st.inputs, st.graph.meta.get(META_KV_SHAPES, []))
        feeds[s] = _weights(program, rp, device, mode)
    names = next(iter(ranks.values())).batch_names
    batch = example_batch(micro_batch, seq, names, device)
    seed = torch.tensor(0, device=device)  # dropout masks are drawn, their values not read
    out: dict[tuple[int, int], tuple[int, int]] = {}
    kv: dict[int, list[torch.Tensor]] = {}
    for j, (a, e) in enumerate(bounds):
        acts: list[torch.Tensor] = []
        for s in range(n_stages):
            gm, refs, kv_shapes = graphs[s]
            params, buffers, coords = feeds[s]
            prefix = kv.get(s) or [
                torch.empty(
                    [micro_batch if d == "b" else d for d in shape], dtype=dt, device=device
                )
                for shape, dt in zip(kv_shapes, kv_dtypes(gm), strict=True)
            ]
            prefix = [t.detach().requires_grad_(t.is_floating_point()) for t in prefix]
            data, keys = chunk_feeds(batch, a, e)
            args = stage_inputs(
                refs,
                params=params,
                buffers=buffers,
                data=data,
                keys=keys,
                coords=coords,
                acts=acts,
                prefix=prefix,
                offset=a,
                seed=seed,
                compute=compute,
                device=device,
            )
            probe = _Probe(gm, [*params.values(), *buffers.values()])
            with torch.enable_grad():
                res = list(probe.run(*args))
            out[(s, j)] = probe.totals()
            if kv_shapes:
                res, kv[s] = res[: -len(kv_shapes)], res[-len(kv_shapes) :]
            acts = [
                t.detach().requires_grad_(t.is_floating_point())
                if isinstance(t, torch.Tensor)
                else t
                for t in res
            ]
    return out


def _weights(
    program: Program, rp: RankProgram, device: torch.device, mode: FakeTensorMode
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Coords]:
    """A rank's parameter shards and the buffers, fake, on ``device``."""
    params: dict[str, torch.Tensor] = {}
    for fqn, shard in rp.shards.items():
        full = program.params[fqn]
        with unset_fake_temporarily():
            shape = shard.local(torch.empty(full.shape, device="meta")).shape
        params[fqn] = torch.nn.Parameter(torch.empty(shape, dtype=full.dtype, device=device))
    buffers = {k: mode.from_tensor(v).to(device) for k, v in program.buffers.items()}
    return params, buffers, rp.coords


class _Probe(fx.Interpreter):
    """Runs a stage graph, recording what autograd saves per node, and each recomputation
    region's tensor inputs."""

    def __init__(self, gm: fx.GraphModule, weights: list[torch.Tensor]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self._weights = {(StorageWeakRef(w.untyped_storage()), w.storage_offset()) for w in weights}
        nodes = list(gm.graph.nodes)
        self._region: dict[fx.Node, int] = {}
        for r, (first, last) in enumerate(regions(gm)):
            for n in nodes[first : last + 1]:
                if n.op not in ("placeholder", "output"):
                    self._region[n] = r
        self.saved: dict[fx.Node, int] = {}

    def _activation(self, t: torch.Tensor) -> bool:
        key = (StorageWeakRef(t.untyped_storage()), t.storage_offset())
        return not isinstance(t, torch.nn.Parameter) and key not in self._weights

    def run_node(self, n: fx.Node) -> Any:
        def pack(t: torch.Tensor) -> torch.Tensor:
            if self._activation(t):
                self.saved[n] = self.saved.get(n, 0) + t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return super().run_node(n)

    def totals(self) -> tuple[int, int]:
        """(held, transient) bytes of this forward (see the module docstring)."""
        held = sum(b for n, b in self.saved.items() if n not in self._region)
        inside: dict[int, int] = {}
        for n, b in self.saved.items():
            if n in self._region:
                inside[self._region[n]] = inside.get(self._region[n], 0) + b
        kept: set[tuple[fx.Node, int]] = set()  # (input, region): checkpoint saves each once
        for n, r in self._region.items():
            for x in n.all_input_nodes:
                v = self.env.get(x)
                if self._region.get(x) == r or (x, r) in kept or not isinstance(v, torch.Tensor):
                    continue
                kept.add((x, r))
                if self._activation(v):
                    held += v.numel() * v.element_size()
        return held, max(inside.values(), default=0)


def graph_memory(
    captured: Any, plan: Any, seq: int | None = None
) -> dict[tuple[int, int], tuple[int, int]]:
    """``unit_bytes`` of ``plan`` compiled for a captured model (one dp replica: activations do
    not depend on dp), micro-batches of ``plan.micro_batch`` sequences (1 when unset) of ``seq``
    tokens (the example's when unset)."""
    one = replace(plan, mesh=Mesh(pp=plan.mesh.pp, tp=plan.mesh.tp))
    program = compile_program(captured, one)
    return unit_bytes(program, plan.micro_batch or 1, seq or captured.example_shape[1])
