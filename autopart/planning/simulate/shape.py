"""The model the simulator costs: ``GPTShape`` (a GPT's sizes), the named shapes, a captured
model's shape read off its graph, and the command line's model (``resolve_model``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from autopart.errors import AutopartError
from autopart.meta import META_LAYER


@dataclass(frozen=True)
class GPTShape:
    """A GPT: pre-norm blocks of attention (``heads`` query heads, ``kv_heads`` K/V heads) and a
    two-matrix MLP of width ``ffn`` (default 4·hidden), learned positions, LayerNorms with bias,
    and (``tied``) an LM head sharing the token embedding. ``seq`` is the training length."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    tied: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutopartError(f"model {f}={value!r} must be a positive integer")
        if self.hidden % self.heads:
            raise AutopartError(
                f"hidden {self.hidden} is not divisible by heads {self.heads}",
                hint="the head width is hidden / heads",
            )
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise AutopartError(f"kv_heads={self.kv_heads} must divide heads={self.heads}")
        if self.ffn is not None and self.ffn < 1:
            raise AutopartError(f"ffn={self.ffn} must be positive")

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv heads × head width."""
        return self.kv * self.head_dim

    def kv_dim_on(self, tp: int) -> float:
        """Width of K (and of V) one of ``tp`` ranks computes: its share of the heads, or all of
        them when there are too few to share out (replicated, as ``tensor_parallel`` does)."""
        return self.kv_dim / tp if self.kv % tp == 0 else self.kv_dim

    @property
    def ffn_width(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def layer_matmul_params(self) -> int:
        h = self.hidden
        return h * (h + 2 * self.kv_dim) + h * h + 2 * h * self.ffn_width

    @property
    def layer_params(self) -> int:
        """Matmul weights, their biases and two LayerNorms (weight and bias)."""
        h = self.hidden
        return self.layer_matmul_params + (h + 2 * self.kv_dim) + h + self.ffn_width + h + 4 * h

    @property
    def params(self) -> int:
        h = self.hidden
        head = 0 if self.tied else self.vocab * h
        return self.layers * self.layer_params + self.vocab * h + self.seq * h + 2 * h + head

    def count(self) -> str:
        """The parameter count in the unit that shows it: "175.0 B", "124.4 M", "85.3 k"."""
        n = self.params
        for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
            if n >= size:
                return f"{n / size:.1f} {unit}"
        return str(n)

    def describe(self) -> str:
        kv = f", {self.kv_heads} kv heads" if self.kv_heads not in (None, self.heads) else ""
        return (
            f"{self.name + ': ' if self.name else ''}{self.count()} parameters, "
            f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads{kv}, "
            f"ffn {self.ffn_width}, vocabulary {self.vocab}, sequence {self.seq}"
        )


SHAPES: dict[str, GPTShape] = {
    # Brown et al. 2020, Table 2.1 (GPT-3 175B), vocabulary of GPT-2's BPE
    "gpt3-175b": GPTShape(96, 12288, 96, 50257, 2048, name="gpt3-175b"),
    # Narayanan et al. 2021 (Megatron-LM, SC21), Table 1, the 1T row
    "megatron-1t": GPTShape(128, 25600, 160, 51200, 2048, name="megatron-1t"),
    # the 7B-shaped GPT of examples/gpt7b.py
    "gpt-7b": GPTShape(32, 4096, 32, 50304, 2048, name="gpt-7b"),
}


def shape_from_captured(captured: Any, seq: int | None = None) -> GPTShape:
    """The ``GPTShape`` of a captured GPT (``autopart.capture``), read from its graph.

    Layers: the transformer blocks; vocabulary and hidden: the largest embedding table;
    heads (and kv heads): the first attention's query and key; ffn: solved from block 0's matmul
    FLOPs per token, so a gated MLP counts as the two-matrix MLP with the same FLOPs.
    """
    import sympy

    # lazy (tests/test_layers.py): the simulator imports no torch until a captured model needs it
    from autopart.frontend.capture import B, S
    from autopart.frontend.cost import analyze

    gm = captured.graph
    groups = analyze(captured)
    blocks = [g for g in groups if g.layer is not None]
    if not blocks:
        raise AutopartError(
            "the captured model has no transformer blocks (autopart.layer)",
            hint="simulate a GPT: blocks under a ModuleList, e.g. transformer.h.0",
        )
    vocab = hidden = 0
    heads = kv_heads = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if name.startswith("embedding") and node.args and hasattr(node.args[0], "meta"):
            weight = node.args[0].meta.get("val")
            if weight is not None and weight.dim() == 2 and int(weight.shape[0]) > vocab:
                vocab, hidden = int(weight.shape[0]), int(weight.shape[1])
        if not heads and node.meta.get(META_LAYER) is not None:
            if "scaled_dot_product" in name:
                q = node.args[0].meta["val"]
                heads = int(q.shape[-3])
                kv_heads = _kv_heads(node, heads, int(q.shape[-1]))
            elif name.startswith(("matmul", "bmm")) and node.meta["val"].dim() == 4:
                q, k = node.args[0].meta["val"], node.args[1].meta["val"]
                if str(k.shape[-1]) == str(q.shape[-2]):  # q @ kᵀ: (b, h, s, d) @ (b, h, d, s)
                    heads = kv_heads = int(q.shape[-3])
    if not vocab or not heads:
        raise AutopartError(
            "could not read the embedding table or the attention heads",
            hint="give the shape instead: --layers --hidden --heads --vocab --seq",
        )
    c1 = sympy.Poly(sympy.expand(blocks[0].cost.mm_flops.subs(B, 1)), S).coeff_monomial(S)
    d = hidden // heads
    attn = hidden * (hidden + 2 * kv_heads * d) + hidden * hidden
    ffn = max(1, round((float(c1) / 2 - attn) / (2 * hidden)))
    return GPTShape(
        layers=len({g.layer for g in blocks}),
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        seq=seq or captured.example_shape[1],
        kv_heads=kv_heads,
        ffn=ffn,
        tied=bool(captured.tied),
        name="captured",
    )


_PROJECTIONS = ("linear", "addmm", "mm", "matmul")


def _kv_heads(sdpa: Any, heads: int, d: int) -> int:
    """K/V heads of an attention: the width of the projection its keys come from (the graph
    may repeat grouped K/V heads before SDPA, so the key's own head count can overstate it)."""
    q_src, k_src = _projection(sdpa.args[0]), _projection(sdpa.args[1])
    if k_src is None:
        return int(sdpa.args[1].meta["val"].shape[-3])
    width = int(k_src.meta["val"].shape[-1])
    if k_src is q_src:  # fused QKV: width = h + 2·kv·d
        return max(1, (width - heads * d) // (2 * d))
    return max(1, width // d)


def _projection(node: Any, depth: int = 12) -> Any:
    """The nearest matmul with a 2-D weight above ``node`` (breadth first), or None."""
    frontier, seen = [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n in seen or not hasattr(n, "op"):
                continue
            seen.add(n)
            name = getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else ""
            if name.split(".")[0] in _PROJECTIONS and any(
                a.op == "placeholder" and getattr(a.meta.get("val"), "dim", lambda: 0)() == 2
                for a in n.all_input_nodes
            ):
                return n
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return None


def resolve_shape(model: str | None = None, shape: str | None = None, **flags: Any) -> GPTShape:
    """The model of a command line: a SPEC to capture, a named shape, or the shape flags
    (``resolve_model``'s keywords)."""
    return resolve_model(model, shape, **flags)[0]


def resolve_model(
    model: str | None = None,
    shape: str | None = None,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    vocab: int | None = None,
    seq: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    tied: bool = True,
) -> tuple[GPTShape, Any]:
    """``resolve_shape``, and the captured model when ``model`` (a SPEC) names one, else None."""
    given = [x is not None for x in (layers, hidden, heads, vocab)]
    if sum(x is not None for x in (model, shape)) + (any(given) or 0) > 1:
        raise AutopartError("give one model: --model SPEC, --shape NAME or the shape flags")
    if model is not None:
        # lazy (tests/test_layers.py): only a model SPEC needs torch
        from autopart.frontend.capture import capture
        from autopart.frontend.spec import build

        net, batch = build(model)
        captured = capture(net, batch)
        return shape_from_captured(captured, seq), captured
    if shape is not None:
        if shape not in SHAPES:
            import difflib

            close = difflib.get_close_matches(shape, list(SHAPES), n=1)
            raise AutopartError(
                f"unknown model shape {shape!r}",
                hint=(f"did you mean {close[0]!r}? " if close else "")
                + f"shapes: {', '.join(SHAPES)}",
            )
        base = SHAPES[shape]
        return (base if seq is None else GPTShape(**{**asdict(base), "seq": seq})), None
    if not all(given) or seq is None:
        missing = [
            f"--{n}"
            for n, x in zip(
                ("layers", "hidden", "heads", "vocab", "seq"),
                (*given, seq is not None),
                strict=True,
            )
            if not x
        ]
        raise AutopartError(
            f"the model shape needs {', '.join(missing)}",
            hint="or --model SPEC (captured) or --shape megatron-1t",
        )
    # all(given): each flag is set (a 0 goes on to GPTShape's own checks, as before)
    assert layers is not None and hidden is not None and heads is not None and vocab is not None
    return GPTShape(layers, hidden, heads, vocab, seq, kv_heads=kv_heads, ffn=ffn, tied=tied), None
