"""Every metadata key autopart leaves on a graph or a node, spelled once.

Steps hand information forward through ``fx`` metadata: ``node.meta[KEY]`` on nodes and
``gm.meta[KEY]`` on graph modules. Each key is a constant here, with its value type and the
step that writes it; code never spells a key as a literal (``tests/test_meta.py`` checks
that). Keys a pass uses only inside itself still live here, so a reader sees the whole
blackboard in one place.
"""

from __future__ import annotations

from typing import Literal, get_args

# -- on nodes ----------------------------------------------------------------------------------
# capture (autopart/frontend/capture.py)
META_MODULE = "autopart.module"  # str: module path in the user's model ("" for the root)
META_LAYER = "autopart.layer"  # int | None: transformer block index, None outside blocks
META_INPUT = "autopart.input"  # InputRef (placeholders): what feeds this placeholder
# cost (autopart/frontend/cost.py)
META_COST = "autopart.cost"  # Cost: symbolic FLOPs / bytes of a call node
# canonicalize_attention
META_ATTENTION = "autopart.attention"  # str: "causal" on a canonical causal SDPA
META_WINDOW = "autopart.window"  # int | None: a canonical SDPA's sliding window in keys
# True on a canonical SDPA whose mask is a rebuilt function of positions and on that mask's
# nodes; "keys" on its key-length sizes (passes/position_masks.py)
META_MASK_FN = "autopart.mask_fn"
# a general-form attention's nodes (canonicalize_attention._score_function): "qk" (q·kᵀ),
# "mod" (the score function, the softmax and what follows it), "pv" (the product with v)
META_SCORES = "autopart.scores"
# tuple[str, ...]: a causal SDPA whose mask is the batch's (padding: "attention_mask", packed
# documents: "position_ids"), proven to be the document-causal form (Seq1F1B plans only)
META_DATA_MASK = "autopart.data_mask"
# vocab_parallel / tensor_parallel
META_VOCAB_DIMS = "autopart.vocab_dims"  # dict: split dims found by vocab_parallel (transient)
META_SHARD = "autopart.shard"  # TPShard (parameter placeholders): how tp splits it
META_ROLE = "autopart.tp_role"  # "column" | "row" | "vocab": a matmul the tp passes split; "whole": an LM head kept whole
META_TP_SPLIT = "autopart.tp_split"  # int | None: the dim along which tp splits this value
META_GLOBAL_VAL = "autopart.global_val"  # FakeTensor: a split placeholder's unsplit value
# sequence_parallel
META_SEQ = "autopart.seq_split"  # int | None: the dim split along the sequence, or absent
# sequence_chunk
META_SEQ_DIM = "autopart.seq_dim"  # int | None: the dim carrying the sequence (proven per node)
META_SEQ_BLOCK = "autopart.seq_block"  # int: chunk lengths must be multiples of it (a scan's block)
# dropout_rng
META_DROPOUT_SPLIT = "autopart.dropout_split"  # bool: the dropout mask differs per tp rank
# recompute
META_RECOMPUTE = "autopart.recompute"  # int: the recomputation region the node belongs to
# pipeline_split
META_STAGE = "autopart.stage"  # int: the pipeline stage a node runs in
# data_parallel
META_BUCKET = "autopart.dp_bucket"  # list[str]: FQNs reduced together (on a stage's output)

# -- on graph modules ----------------------------------------------------------------------------
# capture
META_BUFFERS = "autopart.buffers"  # dict[str, Tensor]: buffer values, for evaluating masks
META_SYMBOLS = "autopart.symbols"  # dict: export's size symbols → sympy b, s
META_RANGES = "autopart.range_constraints"  # dict: export's range constraints on them
# lowering (autopart/lowering)
META_EXAMPLE_SHAPE = "autopart.example_shape"  # (batch, seq) of the example inputs
# str: why capture kept a length export fixed (its loop over the tokens not rolled up)
META_LOOPS = "autopart.loops"
META_PROVEN_SEQ = "autopart.proven_seq"  # int: the graph's attention rests on proofs by
# evaluation that hold up to this many tokens (canonicalize_attention): compile caps Plan.max_seq
META_PROOFS = "autopart.proofs"  # dict: those proofs by construction (Captured.proofs, shared)
META_PASSES = "autopart.passes"  # list[str]: the passes that made this graph, in order
# pipeline_split
META_STAGES = "autopart.stages"  # list[str]: the parent graph's stage submodule names
META_INPUTS = "autopart.inputs"  # list[InputRef]: what feeds each placeholder of a stage
META_UNIT_COSTS = "autopart.unit_costs"  # list[float]: cost of each cuttable unit
META_CUTS = "autopart.cuts"  # list[int]: the units after which the stages are cut
# sequence_chunk
META_KV = "autopart.kv_outputs"  # int: K/V prefix outputs appended to a stage's outputs
META_KV_SHAPES = "autopart.kv_shapes"  # list: the first chunk's (empty) prefix shapes

KEYS = {k: v for k, v in globals().items() if k.startswith("META_")}

# -- what an InputRef (META_INPUT) names --------------------------------------------------------
# capture: "param", "buffer", "constant" (by FQN or name), "data" (a batch tensor); vocab_parallel:
# "rank" (this rank's index in a group); dropout_rng: "rng" (the seed); pipeline_split: "act" (the
# previous stage's i-th output); sequence_chunk: "offset" (the chunk's first token), "kv" (a K/V
# prefix). program.json stores the kind as this string.
InputRefKind = Literal[
    "param", "buffer", "constant", "data", "rank", "rng", "act", "offset", "kv", "keys"
]
INPUT_KINDS: tuple[InputRefKind, ...] = get_args(InputRefKind)
