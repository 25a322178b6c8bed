"""The Hugging Face zoo: causal LMs autopart was not written against, built from small random
configs (nothing downloaded), and the compatibility matrix of plans over them.

``autopart.models.zoo:<arch>`` is a model spec for any architecture in ``ARCHITECTURES`` (``autopart
verify --model autopart.models.zoo:gemma``): a 2-block model, hidden 32, 4 heads (2 K/V heads where
the architecture has grouped queries), vocabulary 96, no dropout, sliding windows and
attention chunks of 8 tokens where the architecture has them (so a 32-token sequence in four
Seq1F1B chunks of 8 trims its K/V prefix to the window), and a 4 × 32 batch of random tokens. ``autopart zoo`` checks every architecture under every plan of ``PLANS`` with
``verify_many`` and writes the table (``docs/compatibility.md``).

Needs ``transformers`` (a test dependency of autopart).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autopart.errors import AutopartError
from autopart.parity.verify import Check, verify_many

VOCAB, BATCH, SEQ = 96, 4, 32
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "use_cache": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
_NO_DROPOUT = (
    "dropout",
    "attention_dropout",
    "hidden_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "activation_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "resid_dropout",
    "embed_dropout",
    "attn_dropout",
)

# multi-head latent attention at the common sizes (K/V heads = query heads)
_MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
}

# model_type → what the common config needs changed (sizes the defaults make large, names the
# config spells its own way), and a line on what the architecture brings
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("learned positions, fused QKV Conv1D, tied embeddings", {}),
    "llama": ("rotary, grouped-query attention, RMSNorm, SwiGLU", {}),
    "mistral": ("Llama with sliding-window attention (8 keys)", {"sliding_window": 8}),
    "qwen2": ("Llama with QKV biases", {}),
    "qwen3": ("per-head RMSNorm on Q and K", {"head_dim": 8}),
    "gemma": ("RMSNorm computed in float32 (1 + w), scaled embeddings, GeGLU", {"head_dim": 8}),
    "gemma2": (
        "logit soft-capping, sandwich norms, alternating local (8 keys) and global attention",
        {"head_dim": 8, "sliding_window": 8},
    ),
    "gemma3_text": (
        "Gemma 3: per-head q/k norms in float32, sliding-window (8 keys) and global layers",
        {"head_dim": 8, "sliding_window": 8},
    ),
    "phi": ("parallel attention + MLP, partial rotary, dense bias", {}),
    "phi3": ("fused QKV and gate-up projections", {}),
    "opt": (
        "learned positions from a running count (cumsum) of the attention mask",
        {"ffn_dim": 64, "word_embed_proj_dim": 32},
    ),
    "bloom": (
        "ALiBi (a per-head bias over key positions) added by baddbmm, heads folded into the batch",
        {},
    ),
    "gptj": (
        "rotary sin/cos gathered from a position table, parallel attention + MLP",
        {"rotary_dim": 8},
    ),
    "gpt_neox": ("fused QKV, partial rotary, parallel residual", {}),
    "falcon": (
        "multi-query attention, parallel attention + MLP, in-place adds",
        {
            "multi_query": True,
            "parallel_attn": True,
            "new_decoder_architecture": False,
            "alibi": False,
        },
    ),
    "mixtral": (
        "mixture of experts, top-2 routing over 4 experts",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2_moe": (
        "mixture of experts with a gated shared expert, top-2 of 4 experts",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "stablelm": ("partial rotary, LayerNorm, QKV biases", {}),
    "starcoder2": ("LayerNorm, biases everywhere, GELU MLP", {}),
    "olmo2": ("RMSNorm on Q and K over all heads, post-norms", {}),
    "cohere": ("parallel attention + MLP, LayerNorm without bias, logit scale", {}),
    "gpt_bigcode": ("multi-query attention with a fused QKV", {"multi_query": True}),
    "granite": ("Llama with embedding, residual, attention and logit multipliers", {}),
    "biogpt": ("learned positions, scaled embeddings, LayerNorm", {}),
    "mpt": ("ALiBi, fused QKV, no biases", {"expansion_ratio": 2}),
    "olmo": ("LayerNorm without parameters, clipped QKV", {}),
    "nemotron": ("LayerNorm1p, squared-ReLU MLP, partial rotary", {"head_dim": 8}),
    "persimmon": ("LayerNorm on Q and K per head, fused QKV, squared ReLU", {}),
    "xglm": ("sinusoidal positions, scaled embeddings, eager attention", {"ffn_dim": 64}),
    "openai-gpt": ("GPT-1: post-norm blocks, attention masked by −1e4 (not −∞)", {}),
    "ctrl": ("sinusoidal positions, a scaled embedding, eager attention", {"dff": 64}),
    "granitemoe": ("mixture of experts with Granite's multipliers", {"num_local_experts": 4}),
    "olmoe": (
        "mixture of experts, 4 experts, Q/K norms",
        {"num_experts": 4, "num_experts_per_tok": 2},
    ),
    "phimoe": ("mixture of experts with sparsemixer routing", {"num_local_experts": 4}),
    "jetmoe": ("mixture of experts in attention and MLP", {"head_dim": 8}),
    "diffllama": ("differential attention with float32 lambdas", {"head_dim": 8}),
    "bitnet": ("ternary-style weights, sub-layer norms", {"head_dim": 8}),
    "cohere2": (
        "Cohere 2: sliding-window (8 keys) and global layers",
        {"head_dim": 8, "sliding_window": 8},
    ),
    "exaone4": (
        "sliding-window layers (8 keys), Q/K norms, post-norms",
        {"head_dim": 8, "sliding_window": 8},
    ),
    "glm4": ("partial rotary (interleaved), sandwich norms, fused gate-up", {"head_dim": 8}),
    "apertus": ("xIELU activation, Q/K norms", {"head_dim": 8}),
    "helium": ("Llama-like with its own RMSNorm", {"head_dim": 8}),
    "smollm3": ("rotary skipped on some layers (NoPE)", {"head_dim": 8}),
    "lfm2": (
        "a short causal depthwise convolution along the sequence in one block, attention in the other",
        {"layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False},
    ),
    "deepseek_v3": (
        "multi-head latent attention (slice assignments into q), routed + shared experts",
        {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
        | {"moe_intermediate_size": 32, "first_k_dense_replace": 1},
    ),
    "minicpm3": ("multi-head latent attention, scaled embeddings and residuals", _MLA),
    "recurrent_gemma": (
        "Griffin: a temporal convolution and a linear recurrence (RG-LRU) along the sequence",
        {"block_types": ["recurrent", "attention"], "lru_width": 32, "attention_window_size": 8},
    ),
    "falcon_h1": (
        "a Mamba-2 mixer (padded causal convolution, chunked scan) beside attention",
        {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8}
        | {"mamba_n_groups": 1, "mamba_chunk_size": 8, "head_dim": 8},
    ),
    "gpt_oss": (
        "attention sinks, sliding-window (8 keys) and global layers, top-2 of 4 experts",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "head_dim": 8},
    ),
    "vaultgemma": ("Gemma with logit soft-capping on every layer", {"head_dim": 8}),
    "llama4_text": (
        "Llama 4: chunked attention (blocks of 8 tokens), NoPE layers, routed + shared experts",
        {"attention_chunk_size": 8, "num_local_experts": 4, "intermediate_size_mlp": 64}
        | {"head_dim": 8},
    ),
    "olmo3": ("sliding-window layers (8 keys), Q/K norms, post-norms", {"sliding_window": 8}),
    "qwen3_moe": (
        "mixture of experts with Q/K norms, top-2 of 4 experts",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8},
    ),
    "glm4_moe": (
        "routed + shared experts (group-limited top-k), partial rotary",
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        | {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "head_dim": 8},
    ),
    "ernie4_5_moe": (
        "mixture of experts with a shared expert and a bias on the routing scores",
        {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "head_dim": 8},
    ),
    "seed_oss": ("Llama-like with QKV biases and an output bias", {"head_dim": 8}),
    "arcee": ("squared-ReLU MLP without a gate", {"head_dim": 8}),
    "ernie4_5": ("interleaved rotary, no biases", {"head_dim": 8}),
    "glm": ("GLM: partial interleaved rotary, fused gate-up", {"head_dim": 8}),
    "flex_olmo": (
        "OLMo-style experts, Q/K norms",
        {"num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
    ),
    "doge": ("dynamic mask attention, a gated MLP", {"head_dim": 8}),
    "jamba": (
        "Mamba layers (a selective scan along the sequence) beside attention, experts",
        {"num_experts": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2}
        | {"mamba_d_state": 8, "mamba_expand": 2},
    ),
    "mamba": ("a pure state-space model: a selective scan, no attention", {"state_size": 8}),
    "nemotron_h": (
        "Mamba-2 heads, attention and MLP layers in a hybrid pattern",
        {"hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 16}
        | {"ssm_state_size": 8, "n_groups": 1, "head_dim": 8, "chunk_size": 8},
    ),
    "mamba2": (
        "a pure Mamba-2 model: padded causal convolution, chunked scan (SSD), gated norm",
        {"num_heads": 4, "head_dim": 16, "state_size": 8, "n_groups": 1, "chunk_size": 8},
    ),
    "bamba": (
        "Mamba-2 layers with one attention layer",
        {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1}
        | {"mamba_chunk_size": 8, "attn_layer_indices": [1]},
    ),
    "granitemoehybrid": (
        "Granite 4: Mamba-2 and attention layers, top-2 of 4 experts and a shared expert",
        {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1}
        | {"mamba_chunk_size": 8, "layer_types": ["mamba", "attention"]}
        | {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "zamba2": (
        "Mamba-2 layers and a shared attention block applied with per-layer LoRA adapters",
        {"mamba_d_state": 8, "mamba_ngroups": 1, "n_mamba_heads": 8, "chunk_size": 8}
        | {"num_mem_blocks": 1, "layers_block_type": ["linear_attention", "hybrid"]}
        | {"use_mem_rope": True, "adapter_rank": 8, "use_mamba_kernels": False},
    ),
    "minimax": (
        "lightning (linear) attention layers beside softmax attention, experts",
        {"num_local_experts": 4, "head_dim": 8},
    ),
    "gpt_neo": (
        "GPT-Neo: local (8 keys) and global layers, masked by where(mask, scores, finfo.min)",
        {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": 8},
    ),
    "gpt_neox_japanese": (
        "q and k folded into the batch for a baddbmm (v not), a bias expanded along the sequence",
        {},
    ),
    "granite_swa": (
        "sinks applied after the softmax (× sigmoid(logsumexp − sink)), sliding-window layers",
        {"sliding_window": 8},
    ),
    "codegen": (
        "fused QKV in model-parallel groups, rotary on 4 of each head's 8 dims",
        {"rotary_dim": 4},
    ),
    "deepseek_v2": (
        "multi-head latent attention, routed + shared experts (DeepSeek-V2)",
        {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
        | {"moe_intermediate_size": 32, "first_k_dense_replace": 1},
    ),
    "bart": (
        "BART's decoder as a causal LM: cross-attention never called (its weights get no gradient)",
        {"decoder_ffn_dim": 64, "decoder_attention_heads": 4, "decoder_layers": 2}
        | {"encoder_ffn_dim": 64, "encoder_attention_heads": 4, "encoder_layers": 1},
    ),
}

# the matrix's columns: name → verify's plan (each needs 2 or 4 ranks)
PLANS: dict[str, dict[str, Any]] = {
    "dp=2": {"dp": 2},
    "tp=2": {"tp": 2},
    "pp=2 1F1B": {"pp": 2, "microbatches": 2},
    "pp=2 Seq1F1B k=2": {"pp": 2, "schedule": "seq1f1b", "seq_chunks": 2, "microbatches": 2},
    "tp=2×pp=2 Seq1F1B k=2": {
        "tp": 2,
        "pp": 2,
        "schedule": "seq1f1b",
        "seq_chunks": 2,
        "microbatches": 2,
    },
    # four chunks of 8 tokens: as long as the zoo's windows, so a K/V prefix is trimmed
    "pp=2 Seq1F1B k=4": {"pp": 2, "schedule": "seq1f1b", "seq_chunks": 4, "microbatches": 2},
}


def batch(vocab: int = VOCAB, size: int = BATCH, seq: int = SEQ):
    """Random next-token data (seed 0): ``input_ids`` and ``labels`` (the last one ignored)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[:, -1] = -100
    return input_ids, labels


def make(arch: str, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A small random model of ``arch`` (a ``model_type`` of ``ARCHITECTURES``, or any other
    causal LM type transformers knows, with the common sizes) and its batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, own = ARCHITECTURES.get(arch, ("", {}))
    torch.manual_seed(0)
    try:
        config = AutoConfig.for_model(arch, **{**COMMON, **own, **overrides})
    except ValueError as exc:
        raise AutopartError(f"transformers has no architecture {arch!r}: {exc}") from exc
    for name in _NO_DROPOUT:
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    return AutoModelForCausalLM.from_config(config).eval(), batch()


def __getattr__(name: str) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]]:
    """``autopart.models.zoo:llama`` and the like: the factory of that architecture."""
    if name in ARCHITECTURES:
        factory = functools.partial(make, name)
        # a partial takes attributes (it has a __dict__), but its stub declares no __name__
        factory.__name__ = name  # type: ignore[attr-defined]
        return factory
    raise AttributeError(name)


Cell = Any  # a verify Report or the AutopartError of that plan


def matrix(
    archs: list[str] | None = None,
    plans: dict[str, dict[str, Any]] | None = None,
    *,
    timeout_s: float = 120.0,
    on_result: Callable[[str, str, str, Cell], None] | None = None,
) -> dict[str, tuple[str, dict[str, Cell]]]:
    """Verify every architecture under every plan: arch → (dtype, plan name → result).

    float64 where the model runs in float64 on one device, else float32 (its tolerance is in
    each report). Each model is captured once; ranks are forked with the program in memory.
    ``on_result(arch, dtype, plan, result)`` hears each cell as it comes."""
    archs = list(ARCHITECTURES) if archs is None else archs
    plans = PLANS if plans is None else plans
    out: dict[str, tuple[str, dict[str, Cell]]] = {}
    for arch in archs:
        spec = f"autopart.models.zoo:{arch}"
        for dtype in ("float64", "float32"):
            checks = {p: Check(spec, **kw) for p, kw in plans.items()}

            def heard(plan: str, result: Cell, dtype: str = dtype, arch: str = arch) -> None:
                if on_result is not None and not _no_reference(result, dtype):
                    on_result(arch, dtype, plan, result)

            cells = verify_many(
                checks, dtype=dtype, timeout_s=timeout_s, via="fork", on_result=heard
            )
            if not all(_no_reference(c, dtype) for c in cells.values()):
                break
        out[arch] = (dtype, cells)
    return out


def _no_reference(result: Cell, dtype: str) -> bool:
    """The model has no float64 kernels for its one-device reference: retry in float32."""
    return (
        dtype == "float64"
        and isinstance(result, AutopartError)
        and "does not run in float64 on one device" in result.message
    )


def verdict(cell: Cell) -> str:
    """A cell's word: PASS, FAIL or refused (an ``AutopartError`` before or while running)."""
    if isinstance(cell, AutopartError):
        return "refused"
    return "PASS" if cell.ok else "FAIL"


Row = list[str]  # architecture, what it brings, dtype, tolerance, then each plan's verdict or
# "refused: <message>"


def table(results: dict[str, tuple[str, dict[str, Cell]]]) -> str:
    """The compatibility matrix as Markdown: one row per architecture, one column per plan,
    the refusals' messages numbered below it."""
    plans = list(next(iter(results.values()))[1]) if results else list(PLANS)
    rows = [_row(arch, dtype, cells, plans) for arch, (dtype, cells) in results.items()]
    return _render(rows, plans)


def merge(text: str, results: dict[str, tuple[str, dict[str, Cell]]]) -> str:
    """The written matrix ``text`` with the rows of ``results`` run afresh (a new architecture's
    appended), the counts and the numbered refusals redone: ``autopart zoo --update``."""
    plans, rows = _rows(text)
    fresh = {arch: _row(arch, dtype, cells, plans) for arch, (dtype, cells) in results.items()}
    merged = [fresh.pop(r[0], r) for r in rows] + list(fresh.values())
    return _render(merged, plans)


def differences(text: str, results: dict[str, tuple[str, dict[str, Cell]]]) -> list[str]:
    """Where a fresh run's rows differ from the written matrix ``text`` (dtype, tolerance or a
    cell's verdict and refusal): ``autopart zoo --check``, one line each."""
    plans, rows = _rows(text)
    written = {r[0]: r for r in rows}
    out = []
    for arch, (dtype, cells) in results.items():
        fresh, old = _row(arch, dtype, cells, plans), written.get(arch)
        if old is None:
            out.append(f"{arch}: not in the written matrix")
            continue
        for name, was, now in zip(["", "", "dtype", "tolerance", *plans], old, fresh, strict=True):
            if name and was != now:
                out.append(f"{arch} {name}: written {was!r}, now {now!r}")
    return out


def parse_table(text: str) -> dict[str, dict[str, str]]:
    """A written matrix back to arch → {"dtype", "tolerance", plan: verdict or refusal text}
    (to compare a fresh run with ``docs/compatibility.md``)."""
    plans, rows = _rows(text)
    return {
        row[0]: {"dtype": row[2], "tolerance": row[3], **dict(zip(plans, row[4:], strict=True))}
        for row in rows
    }


def _row(arch: str, dtype: str, cells: dict[str, Cell], plans: list[str]) -> Row:
    tolerance = {
        (c.tolerance, c.precision or dtype)
        for c in cells.values()
        if not isinstance(c, AutopartError)
    }
    tol = ", ".join(
        f"{t:.0e}" + (f" ({d} inside)" if d != dtype else "") for t, d in sorted(tolerance)
    )
    words = [
        f"refused: {str(cells[p].message).splitlines()[0]}"
        if verdict(cells[p]) == "refused"
        else verdict(cells[p])
        for p in plans
    ]
    return [arch, ARCHITECTURES.get(arch, ("",))[0], dtype, tol or "–", *words]


def _rows(text: str) -> tuple[list[str], list[Row]]:
    """A written matrix's plan columns and rows (refusals with their messages)."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| architecture |"))
    columns = [c.strip() for c in lines[head].strip("|").split("|")]
    notes = {}
    for line in lines:
        number, dot, rest = line.partition(". ")
        if dot and number.isdigit():
            notes[number] = rest
    rows = []
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for i in range(4, len(cells)):
            word, _, number = cells[i].partition(" (")
            if word == "refused":
                cells[i] = f"refused: {notes[number.rstrip(')')]}"
        rows.append(cells)
    return columns[4:], rows


def _render(rows: list[Row], plans: list[str]) -> str:
    import torch
    import transformers

    notes: list[str] = []
    body = []
    words = [w for row in rows for w in row[4:]]
    for row in rows:
        out = []
        for word in row[4:]:
            if word.startswith("refused: "):
                text = word.removeprefix("refused: ")
                if text not in notes:
                    notes.append(text)
                word = f"refused ({notes.index(text) + 1})"
            out.append(word)
        body.append(f"| {' | '.join(row[:4])} | " + " | ".join(out) + " |")
    passed = words.count("PASS")
    refused = sum(w.startswith("refused") for w in words)
    failed = len(words) - passed - refused
    lines = [
        "# Compatibility matrix",
        "",
        "Generated by `autopart zoo --write docs/compatibility.md` (`autopart/models/zoo.py`); do not "
        "edit by hand. Each cell is one `verify` check: the model from a small random config "
        f"(2 blocks, hidden 32, 4 heads, vocabulary {VOCAB}, a {BATCH} × {SEQ} batch; nothing "
        "downloaded), one training step of the plan on real gloo ranks forked on one machine, "
        "loss and every gradient compared with the single-device run. **PASS**: all within "
        "the row's tolerance (float64, or float32 for a model without float64 kernels; a model "
        "that computes parts in a lower precision is held to that precision's tolerance). "
        "**refused**: `parallelize` or the plan's ranks stopped with the numbered message, "
        "before any wrong result.",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}: **{passed} of "
        f"{len(words)} cells PASS ({100 * passed / max(len(words), 1):.0f} %)**, "
        f"{refused} refused, {failed} FAIL.",
        "",
        "| architecture | what it brings | dtype | tolerance | " + " | ".join(plans) + " |",
        "|---|---|---|---|" + "---|" * len(plans),
        *body,
        "",
        *(f"{i}. {text}" for i, text in enumerate(notes, 1)),
        "",
    ]
    return "\n".join(lines)
