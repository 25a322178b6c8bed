"""Seq1F1B under a sliding window: the K/V prefix a chunk keeps, trimmed to the window, against
the full prefix.

Model (``--model``): HF ``MistralForCausalLM`` (SDPA with a window mask), ``Gemma2ForCausalLM``
(soft-capped scores, eager attention: autopart's general form, ``position_masks.score_window``)
or ``GptOssForCausalLM`` (a sink column per head, top-2 of 4 experts), each from a small random
config (4 blocks, width 256, 8 heads, 4 K/V heads, vocabulary 1024, float32; nothing
downloaded) with every layer within a sliding window of ``--window`` keys (default 64), one sequence of ``--seq`` tokens (default 1024 = 16 windows) cut into ``--chunks``
uniform chunks (default 4). autopart compiles it for one rank, ``schedule="seq1f1b"``; the
stage graph then runs chunk by chunk twice, on the same weights and tokens:

- **trimmed**: each chunk's K/V prefix is what the chunk before handed on, the last W − 1
  positions of every windowed layer (what autopart's runtime does);
- **full prefix**: each chunk gets every earlier token's K and V (what Seq1F1B without the trim
  keeps: the same graph takes any prefix length, the window mask aligned lower-right).

Per chunk it prints the bytes autograd saves for backward (``saved_tensors_hooks``, parameters
excluded, each storage once) and the prefix bytes fed in, for both runs and their ratio; the
two runs' losses must agree to 1e-6 (relative) and the chunks' loss must equal the unchunked
model's, or it exits 1.

    python benchmarks/seq1f1b_window.py [--seq 1024] [--window 64] [--chunks 4] [--model mistral]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F

from autopart.meta import META_KV, META_KV_SHAPES

MODELS = ("mistral", "gemma2", "gpt_oss")


def build(seq: int, window: int, model: str = "mistral") -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``model``'s HF class from a small random config, every layer within ``window`` keys:
    "mistral" (SDPA with a window mask), "gemma2" (soft-capped scores, eager: the general form
    of ``canonicalize_attention``), "gpt_oss" (a sink column per head, top-2 of 4 experts)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": seq,
        "sliding_window": window,
        "use_cache": False,
    }
    if model == "mistral":
        cfg: Any = transformers.MistralConfig(**common, attn_implementation="sdpa")
        cls: Any = transformers.MistralForCausalLM
    elif model == "gemma2":
        layers = ["sliding_attention"] * 4
        cfg = transformers.Gemma2Config(**common, head_dim=32, layer_types=layers)
        cfg._attn_implementation = "eager"
        cls = transformers.Gemma2ForCausalLM
    else:
        layers = ["sliding_attention"] * 4
        cfg = transformers.GptOssConfig(
            **common, head_dim=32, layer_types=layers, num_local_experts=4, num_experts_per_tok=2
        )
        cfg._attn_implementation = "eager"
        cls = transformers.GptOssForCausalLM
    torch.manual_seed(0)
    net = cls(cfg).eval()
    ids = torch.randint(0, 1024, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    return net, ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def untrimmed(gm: Any) -> Any:
    """A copy of a chunk graph that hands on its whole [prefix; chunk] K/V: each trim (a slice
    of the concatenated K or V from −(W − 1) to the end, the graph's last outputs) starts at 0."""
    from autopart.graph import copy_graph

    out = copy_graph(gm)
    out.meta.update(gm.meta)
    outputs = next(n for n in out.graph.nodes if n.op == "output").args[0]
    for n in outputs[-gm.meta[META_KV] :]:
        if n.target == torch.ops.aten.slice.Tensor and n.args[1] == -2:
            n.args = (n.args[0], -2, 0, *n.args[3:])
    out.recompile()
    return out


def chunk_inputs(
    inputs: Any,
    params: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
    ids: torch.Tensor,
    labels: torch.Tensor,
    bounds: tuple[int, int],
    prefix: list[torch.Tensor],
) -> list[Any]:
    """The one-rank stage's arguments for the chunk of tokens ``bounds`` = [a, e), fed
    ``prefix`` (what the runtime's ``stage_inputs`` gives it)."""
    from autopart.layout import Coords
    from autopart.program.feeds import chunk_feeds, stage_inputs

    a, e = bounds
    data, keys = chunk_feeds({"input_ids": ids, "labels": labels}, a, e)
    return stage_inputs(
        inputs,
        params=params,
        buffers={k: v for k, v in weights.items() if k not in params},
        data=data,
        keys=keys,
        coords=Coords(pp=0, dp=0, tp=0),
        acts=[],
        prefix=prefix,
        offset=a,
        seed=torch.tensor(0),
        compute=None,
        device=torch.device("cpu"),
    )


def run_chunks(
    program: Any, gm: Any, ids: torch.Tensor, labels: torch.Tensor
) -> tuple[float, list[dict[str, int]]]:
    """Forward every chunk of the one-rank program's stage, run as ``gm`` (no backward: the
    bytes saved for it are what is measured); the summed loss and, per chunk, saved and prefix
    bytes."""
    from autopart.runtime.runner import local_weights
    from autopart.schedule.chunks import chunk_bounds

    rp = program.rank(0)
    (st,) = rp.stages
    weights = local_weights(program, rp)
    params = {f: t.detach().requires_grad_() for f, t in weights.items() if f in rp.shards}
    skip = {t.untyped_storage().data_ptr() for t in params.values()}
    n_kv = gm.meta[META_KV]
    plan = program.plan
    cost = rp.chunk_cost or (1.0, 0.0)
    bounds = chunk_bounds(cost, ids.shape[1], plan.seq_chunks, plan.seq_split, plan.chunk_multiple)
    shapes = gm.meta[META_KV_SHAPES]
    prefix = [torch.zeros([1 if d == "b" else d for d in s]) for s in shapes]
    total, rows = 0.0, []
    for a, e in bounds:
        seen: set[int] = set()
        saved = [0]

        def pack(t: torch.Tensor, seen: set[int] = seen, saved: list[int] = saved) -> Any:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in skip and ptr not in seen:
                seen.add(ptr)
                saved[0] += t.untyped_storage().nbytes()
            return t

        args = chunk_inputs(st.inputs, params, weights, ids, labels, (a, e), prefix)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = gm(*args)
        total += float(out[0])
        rows.append({"tokens": e - a, "saved": saved[0], "prefix": sum(t.nbytes for t in prefix)})
        prefix = [t.detach() for t in out[-n_kv:]]
    return total, rows


def measure(seq: int, window: int, chunks: int, model: str = "mistral") -> dict[str, Any]:
    """Both runs on one model: the unchunked loss, each run's loss and per-chunk rows."""
    import autopart

    model, ids, labels = build(seq, window, model)
    with torch.no_grad():
        logits = model(ids).logits
    want = float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
    program = autopart.parallelize(
        model, autopart.Mesh(), (ids, labels), schedule="seq1f1b", seq_chunks=chunks
    )
    (st,) = program.rank(0).stages
    trimmed, rows_t = run_chunks(program, st.graph, ids, labels)
    full, rows_f = run_chunks(program, untrimmed(st.graph), ids, labels)
    return {
        "want": want,
        "trimmed": trimmed,
        "full": full,
        "rows_t": rows_t,
        "rows_f": rows_f,
        "split": program.plan.seq_split,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=1024, help="tokens (default 1024)")
    ap.add_argument("--window", type=int, default=64, help="sliding window (default 64)")
    ap.add_argument("--chunks", type=int, default=4, help="Seq1F1B chunks (default 4)")
    ap.add_argument("--model", choices=MODELS, default="mistral", help="(default mistral)")
    a = ap.parse_args(argv)
    m = measure(a.seq, a.window, a.chunks, a.model)
    want, trimmed, full, rows_t, rows_f = (
        m[k] for k in ("want", "trimmed", "full", "rows_t", "rows_f")
    )
    print(
        f"{a.model}, 4 blocks, width 256, window {a.window}, seq {a.seq}, "
        f"Seq1F1B k={a.chunks} ({m['split']} chunks), float32, one rank"
    )
    print(f"loss (summed): unchunked {want:.6f}, trimmed {trimmed:.6f}, full prefix {full:.6f}")
    print("chunk  tokens   saved MiB: trimmed   full prefix   ratio |  prefix KiB: trimmed   full")
    for j, (t, f) in enumerate(zip(rows_t, rows_f, strict=True)):
        print(
            f"{j:>5}  {t['tokens']:>6}  {t['saved'] / 2**20:>18.2f}  {f['saved'] / 2**20:>12.2f}"
            f"  {t['saved'] / f['saved']:>6.3f} |  {t['prefix'] / 2**10:>17.1f}  "
            f"{f['prefix'] / 2**10:>5.1f}"
        )
    sum_t, sum_f = sum(r["saved"] for r in rows_t), sum(r["saved"] for r in rows_f)
    print(
        f"all chunks: {sum_t / 2**20:.2f} MiB against {sum_f / 2**20:.2f} MiB, ratio {sum_t / sum_f:.3f}"
    )
    ok = abs(trimmed - full) <= 1e-6 * abs(full) and abs(trimmed - want) <= 1e-5 * abs(want)
    if not ok:
        print("the losses differ: FAIL", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
