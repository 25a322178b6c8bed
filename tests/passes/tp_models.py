"""Shared by the tensor-, vocab- and sequence-parallel pass tests: the captured Llama, compiled
graphs (cached: each model × plan runs the pipeline once per session) and graph helpers.

Nothing here mutates a capture; every compiled graph is made from ``copy_graph``.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterable, Iterator

import hf_llama
import pytest
import sympy
import torch
from conftest import Case, _case
from torch import fx

from autopart import collectives
from autopart.frontend.capture import B, S, to_sympy
from autopart.graph import copy_graph
from autopart.layout import Mesh, Plan
from autopart.lowering.pass_runner import run_passes
from autopart.meta import META_INPUT, META_LAYER, META_SHARD
from autopart.passes import PIPELINE
from autopart.passes.tensor_parallel import TPShard
from autopart.program.format import Shard
from autopart.runtime.comm import Comm

aten, ops = torch.ops.aten, torch.ops.autopart
MODELS = ("gpt_sdpa", "gpt_manual", "hf_gpt", "llama")
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@functools.cache
def llama_case() -> Case:
    """HF Llama (8 heads, 4 KV heads, SwiGLU, rotary, RMSNorm) in float64, captured once."""
    return _case(hf_llama.make)


def model_case(request: pytest.FixtureRequest, name: str) -> Case:
    """The case of fixture ``name``: conftest's session captures, or the test module's
    ``llama`` fixture (module-scoped, backed by ``llama_case``)."""
    return request.getfixturevalue(name)


_COMPILED: dict[tuple[str, int, bool], fx.GraphModule] = {}


def compiled(name: str, case: Case, tp: int, sp: bool = False) -> fx.GraphModule:
    """The PIPELINE applied to a copy of ``case``'s capture (cached; read it, don't change it)."""
    key = (name, tp, sp)
    if key not in _COMPILED:
        plan = Plan(Mesh(tp=tp), sequence_parallel=sp)
        _COMPILED[key] = run_passes(copy_graph(case.captured.graph), plan, PIPELINE)[0]
    return _COMPILED[key]


# -- graph helpers ---------------------------------------------------------------------------


def placeholders(gm: fx.GraphModule, kind: str | None = None) -> list[fx.Node]:
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [n for n in nodes if kind is None or n.meta[META_INPUT].kind == kind]


def params(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Parameter placeholders by canonical FQN."""
    return {p.meta[META_INPUT].name: p for p in placeholders(gm, "param")}


def calls(gm: fx.GraphModule, target: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def per_layer(nodes: Iterable[fx.Node]) -> Counter:
    """How many of ``nodes`` each transformer block (``None``: outside blocks) holds."""
    return Counter(n.meta.get(META_LAYER) for n in nodes)


def n_layers(case: Case) -> int:
    return case.captured.n_layers


def pattern(fqn: str) -> str:
    """``transformer.h.3.attn.c_attn.weight`` → ``transformer.h.*.attn.c_attn.weight``."""
    parts = fqn.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts)


def ancestors(n: fx.Node) -> set[fx.Node]:
    out, stack = set(), list(n.all_input_nodes)
    while stack:
        x = stack.pop()
        if x not in out:
            out.add(x)
            stack.extend(x.all_input_nodes)
    return out


def descendants(n: fx.Node) -> set[fx.Node]:
    out, stack = set(), list(n.users)
    while stack:
        x = stack.pop()
        if x not in out:
            out.add(x)
            stack.extend(x.users)
    return out


def through_views(n: fx.Node) -> fx.Node:
    """Back from ``n`` through view/reshape nodes to the value they reshape."""
    while n.op == "call_function" and n.target in VIEWS:
        n = n.args[0]
    return n


def sym(gm: fx.GraphModule, x: object) -> sympy.Expr:
    """A size as a sympy expression in the batch (b) and sequence (s) symbols."""
    return to_sympy(x, gm)


def input_ids_val(gm: fx.GraphModule) -> torch.Tensor:
    (ids,) = [p for p in placeholders(gm, "data") if p.meta[META_INPUT].name == "input_ids"]
    return ids.meta["val"]


def is_bsh(gm: fx.GraphModule, val: torch.Tensor, hidden: int) -> bool:
    """``val`` is (b, s, hidden) with b and s the captured input's symbolic batch and sequence."""
    ids = input_ids_val(gm)
    return (
        val.dim() == 3
        and all(isinstance(d, torch.SymInt) for d in val.shape[:2])
        and sym(gm, val.shape[0]) == sym(gm, ids.shape[0]) == B
        and sym(gm, val.shape[1]) == sym(gm, ids.shape[1]) == S
        and val.shape[2] == hidden
    )


def hidden_size(case: Case) -> int:
    emb = case.captured.params.get("transformer.wte.weight")
    if emb is None:
        emb = case.captured.params["model.embed_tokens.weight"]
    return int(emb.shape[1])


# -- running a compiled graph in one process -------------------------------------------------


@contextlib.contextmanager
def solo_tp() -> Iterator[None]:
    """A runtime context whose "tp" group is None (every collective is the identity), active
    in this process; the previously active one comes back afterwards."""
    saved = collectives.current()
    collectives.activate(Comm({"tp": None}))
    try:
        yield
    finally:
        collectives.activate(saved)


def local_inputs(case: Case, gm: fx.GraphModule, tp: int, tp_index: int = 0) -> list:
    """The graph's positional inputs as tp rank ``tp_index`` would feed them: each split
    parameter's local shard (checked against its placeholder's local shape)."""
    data = {"input_ids": case.batch[0], "labels": case.batch[1]}
    args = []
    for p in placeholders(gm):
        ref = p.meta[META_INPUT]
        if ref.kind == "param":
            full = case.captured.params[ref.name].detach()
            s: TPShard | None = p.meta[META_SHARD]
            t = (
                full
                if s is None
                else Shard(tuple(full.shape), s.dim, tp_index, tp, s.strided).local(full)
            )
            assert tuple(t.shape) == tuple(p.meta["val"].shape), ref.name
            args.append(t)
        elif ref.kind in ("buffer", "constant"):
            args.append(case.captured.buffers[ref.name])
        elif ref.kind == "rank":
            args.append(torch.tensor(tp_index))
        elif ref.kind == "rng":
            args.append(torch.tensor(1234))
        else:
            args.append(data[ref.name])
    return args


def run_local(case: Case, gm: fx.GraphModule, tp: int) -> torch.Tensor:
    with solo_tp(), torch.no_grad():
        out = gm(*local_inputs(case, gm, tp))
    (loss,) = out
    return loss
