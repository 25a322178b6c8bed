"""autopart's compiler passes: each ``name(gm, plan) -> gm``, one file, one invariant.

The order the compiler runs them in is ``PIPELINE`` (see ``autopart.lowering.pass_runner``).
"""

from autopart.passes.canonicalize_attention import canonicalize_attention
from autopart.passes.data_parallel import data_parallel
from autopart.passes.dropout_rng import dropout_rng
from autopart.passes.einsum_products import einsum_products
from autopart.passes.fold_identities import fold_identities
from autopart.passes.pipeline_split import pipeline_split
from autopart.passes.recompute import recompute
from autopart.passes.sequence_chunk import sequence_chunk
from autopart.passes.sequence_parallel import sequence_parallel
from autopart.passes.tensor_parallel import tensor_parallel
from autopart.passes.vocab_parallel import vocab_parallel
from autopart.passes.weight_grad_split import weight_grad_split

PIPELINE = (
    fold_identities,
    einsum_products,
    canonicalize_attention,
    vocab_parallel,
    tensor_parallel,
    sequence_parallel,
    dropout_rng,
    recompute,
    pipeline_split,
    sequence_chunk,
    data_parallel,
    weight_grad_split,
)

__all__ = [
    "PIPELINE",
    "canonicalize_attention",
    "data_parallel",
    "dropout_rng",
    "einsum_products",
    "fold_identities",
    "pipeline_split",
    "recompute",
    "sequence_chunk",
    "sequence_parallel",
    "tensor_parallel",
    "vocab_parallel",
    "weight_grad_split",
]
