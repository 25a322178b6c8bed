"""Flag groups more than one subcommand takes, and the helpers that read them back.

- ``plan_flags`` / ``plan_kwargs``: the compiler's plan (verify, inspect): dp, tp, pp,
  schedule, micro-batches, virtual stages, sequence chunks, sequence parallelism.
- ``model_flags`` / ``model_shape``: a GPT shape and a cluster (simulate, plan).
- ``fill_defaults``: flags whose argparse default is ``None`` (so that "given" reads "not
  None") get their real defaults here, in one call.

The values are checked by the domain objects they build (``Plan``, ``Mesh``, ``Cluster``,
``resolve_shape``), not here.
"""

from __future__ import annotations

import argparse
from typing import Any

SPEC_HELP = "path/to/file.py:make or module:make"
DEFAULT_CLUSTER = "dgx-a100-80gb"
MODEL_DEFAULTS: dict[str, Any] = {"cluster": DEFAULT_CLUSTER, "untied": False}


def spec_flag(p: argparse.ArgumentParser) -> None:
    """``--model SPEC`` (required): the model factory to capture."""
    p.add_argument("--model", required=True, metavar="SPEC", help=SPEC_HELP)


def plan_flags(p: argparse.ArgumentParser) -> None:
    from autopart.layout import RECOMPUTE, SCHEDULES
    from autopart.schedule.chunks import SPLITS

    g = p.add_argument_group("plan")
    g.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline ranks (default 1)")
    g.add_argument(
        "--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)"
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="micro-batches per data-parallel rank (default 1)",
    )
    g.add_argument(
        "--virtual-stages", type=int, default=1, help="virtual stages per rank (interleaving)"
    )
    g.add_argument(
        "--seq-chunks", type=int, default=1, help="Seq1F1B sequence chunks per micro-batch"
    )
    g.add_argument(
        "--seq-split",
        choices=SPLITS,
        default=SPLITS[0],
        help="Seq1F1B chunk boundaries: equal work (default) or equal length",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split activations between tp regions along the sequence",
    )
    g.add_argument(
        "--max-stage-memory-gb",
        type=float,
        default=None,
        help="pipeline cuts keep each stage's weights, gradients, Adam states and "
        "in-flight activations under this many GiB",
    )
    g.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="none",
        help="activation recomputation: none (default), selective (attention cores) or full "
        "(every transformer block keeps only its input)",
    )


def plan_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The ``plan_flags`` besides the mesh, as ``parallelize`` / ``Plan`` keywords."""
    return dict(
        schedule=a.schedule,
        microbatches=a.microbatches,
        virtual_stages=a.virtual_stages,
        seq_chunks=a.seq_chunks,
        seq_split=a.seq_split,
        sequence_parallel=a.sequence_parallel,
        max_stage_memory_gb=a.max_stage_memory_gb,
        recompute=a.recompute,
    )


def model_flags(p: argparse.ArgumentParser, gpus_required: bool = True) -> None:
    """The model (``--model``, ``--shape`` or the shape flags), the cluster and ``--json``.
    ``--cluster`` and ``--untied`` default to ``None``: ``fill_defaults(a, MODEL_DEFAULTS)``."""
    g = p.add_argument_group("model (one of --model, --shape, or the shape flags)")
    g.add_argument(
        "--model", metavar="SPEC", help="capture path/to/file.py:make and read its shape"
    )
    g.add_argument("--shape", metavar="NAME", help="a named shape: gpt3-175b, megatron-1t, gpt-7b")
    for name, text in (
        ("layers", "transformer blocks"),
        ("hidden", "model width"),
        ("heads", "attention heads"),
        ("vocab", "vocabulary size"),
    ):
        g.add_argument(f"--{name}", type=int, help=text)
    g.add_argument("--seq", type=int, help="sequence length (default with --model: the example's)")
    g.add_argument("--kv-heads", type=int, help="K/V heads (default: --heads)")
    g.add_argument("--ffn", type=int, help="MLP width (default 4 × hidden)")
    g.add_argument(
        "--untied",
        action="store_true",
        default=None,
        help="the LM head does not share the embedding",
    )
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--cluster",
        default=None,
        help=f"{DEFAULT_CLUSTER} (default), dgx-h100, or a .toml / .json file",
    )
    c.add_argument("--gpus", type=int, required=gpus_required, help="GPUs in all")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def fill_defaults(a: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Give every flag of ``defaults`` left at ``None`` (not given) its real default."""
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)


def model_shape(a: argparse.Namespace, captured: bool = False):
    """The ``GPTShape`` of the ``model_flags`` (``resolve_model`` checks the combination);
    ``captured=True``: (shape, the captured model or None)."""
    from autopart.planning.simulate import resolve_model

    out = resolve_model(
        a.model,
        a.shape,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        vocab=a.vocab,
        seq=a.seq,
        kv_heads=a.kv_heads,
        ffn=a.ffn,
        tied=not a.untied,
    )
    return out if captured else out[0]
