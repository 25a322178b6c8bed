"""Flag groups more than one subcommand takes, and the helpers that read them back.

- ``plan_flags`` / ``plan_kwargs``: the compiler's plan (verify, inspect): dp, tp, pp,
  schedule, micro-batches, virtual stages, sequence chunks, sequence parallelism.
- ``model_flags`` / ``model_shape``: a GPT shape and a cluster (simulate, plan).
- ``fill_defaults``: flags whose argparse default is ``None`` (so that "given" reads "not
  None") get their real defaults here, in one call.

Counts (ranks, sizes, micro-batches, chunks) are whole numbers ≥ 1 when parsed
(``errors.positive_int``); everything else is checked by the domain objects they build
(``Plan``, ``Mesh``, ``Cluster``, ``resolve_shape``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from autopart.errors import positive_int

SPEC_HELP = "path/to/file.py:make or module:make"
DEFAULT_CLUSTER = "dgx-a100-80gb"
MODEL_DEFAULTS: dict[str, Any] = {"cluster": DEFAULT_CLUSTER, "untied": False}


def spec_flag(p: argparse.ArgumentParser) -> None:
    """``--model SPEC`` (required): the model factory to capture."""
    p.add_argument("--model", required=True, metavar="SPEC", help=SPEC_HELP)


def plan_flags(p: argparse.ArgumentParser) -> None:
    """The mesh flags, then one flag per ``Plan`` field marked as one (``layout._flag``): its
    name, type, default, help and choices come from the field."""
    from autopart.layout import Plan

    g = p.add_argument_group("plan")
    for d, what in (("dp", "data-parallel"), ("tp", "tensor-parallel"), ("pp", "pipeline")):
        g.add_argument(f"--{d}", type=positive_int, default=1, help=f"{what} ranks (default 1)")
    for f in dataclasses.fields(Plan):
        spec = f.metadata.get("cli")
        if spec is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            g.add_argument(flag, action="store_true", help=spec["help"])
            continue
        if f.type == "tuple[str, ...]":  # repeated: --flag A --flag B
            g.add_argument(flag, action="append", default=[], metavar="NAME", help=spec["help"])
            continue
        choices = list(spec["choices"]()) if spec["choices"] else None
        default = f.default
        text = spec["help"]
        if choices is not None:
            text += f": one of {', '.join(choices)}"
        if default is not None:
            text += f" (default {default})"
        strict = choices if spec["strict"] else None
        g.add_argument(
            flag, type=_FLAG_TYPES[str(f.type)], choices=strict, default=default, help=text
        )


_FLAG_TYPES: dict[str, Any] = {
    "int": positive_int,
    "str": str,
    "float": float,
    "float | None": float,
}


def plan_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The ``plan_flags`` besides the mesh, as ``parallelize`` / ``Plan`` keywords."""
    from autopart.layout import Plan

    return {f.name: getattr(a, f.name) for f in dataclasses.fields(Plan) if "cli" in f.metadata}


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
        g.add_argument(f"--{name}", type=positive_int, help=text)
    g.add_argument(
        "--seq", type=positive_int, help="sequence length (default with --model: the example's)"
    )
    g.add_argument("--kv-heads", type=positive_int, help="K/V heads (default: --heads)")
    g.add_argument("--ffn", type=positive_int, help="MLP width (default 4 × hidden)")
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
    c.add_argument(
        "--gpus",
        type=positive_int,
        required=gpus_required,
        help="GPUs in all" + ("" if gpus_required else " (required unless --measured)"),
    )
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
