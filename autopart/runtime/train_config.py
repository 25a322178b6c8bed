"""The configuration of ``autopart train``: a TOML file, checked once, before any rank starts.

Every key has a type and a default, and sits in one section. An unknown section or key, a value
of the wrong type, or a value out of range is refused with an ``AutopartError`` naming it, so a
typo never trains with a default. ``--set section.key=value`` on the command line overrides a
value; it is written in TOML syntax (``--set optim.lr=3e-4``).

```toml
out = "train-out"                  # everything the run writes goes here

[model]
spec = "autopart.models.nanogpt:demo"  # file.py:make or module:make -> (model, example batch)

[parallel]                         # the Plan (docs/architecture.md)
dp = 1
tp = 2
pp = 2
schedule = "1f1b"
microbatches = 4
library_ops = []                   # op namespaces of installed libraries you trust, kept as
                                   # custom ops in the program (docs/capture.md)

[data]
text = "corpus.txt"                # bytes as token ids; or tokens = "ids.pt" / "ids.bin"
# or a Hugging Face dataset (the `datasets` library; a hub name, or a builder such as "text"
# or "json" with dataset_files), its `field` joined document by document:
# dataset = "text"; dataset_files = "corpus.txt"; split = "train"; field = "text"
# tokenizer = ""                   # a HF tokenizer name or folder (`transformers`); "": bytes
seq_len = 64
batch_size = 8                     # the global batch, in sequences
val_fraction = 0.05                # the end of the data, never trained on

[optim]                            # AdamW; weight decay on matrices only
lr = 3e-3
min_lr = 3e-4
warmup_steps = 10                  # then cosine down to min_lr at the last step
max_grad_norm = 1.0                # 0: no clipping

[train]
steps = 100

[eval]
every = 25                         # 0: never
batches = 2

[checkpoint]
dir = ""                           # "" : <out>/checkpoints; resume from the newest intact one
every = 50
keep = 3                           # 0: all

[log]
every = 1
jsonl = "metrics.jsonl"            # under <out>
tensorboard = false                # <out>/tensorboard, when tensorboard is installed
peak_tflops = 0.0                  # per rank; > 0 adds an MFU estimate to the metrics
```
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from autopart.errors import AutopartError
from autopart.layout import check_library_names

SECTIONS = ("model", "parallel", "data", "optim", "train", "eval", "checkpoint", "log")


@dataclass
class TrainConfig:
    """One run of ``autopart train``; the field ``section_key`` is TOML's ``[section] key``."""

    out: str = "train-out"
    model_spec: str = "autopart.models.nanogpt:demo"
    parallel_dp: int = 1
    parallel_tp: int = 2
    parallel_pp: int = 2
    parallel_schedule: str = "1f1b"
    parallel_microbatches: int = 4
    parallel_virtual_stages: int = 1
    parallel_seq_chunks: int = 1
    parallel_sequence_parallel: bool = False
    parallel_recompute: str = "none"
    parallel_precision: str = ""
    parallel_compile: bool = False
    parallel_attention: str = "sdpa"
    parallel_library_ops: tuple[str, ...] = ()
    data_text: str = ""
    data_tokens: str = ""
    data_dataset: str = ""
    data_dataset_config: str = ""
    data_dataset_files: str = ""
    data_split: str = "train"
    data_field: str = "text"
    data_tokenizer: str = ""
    data_seq_len: int = 64
    data_batch_size: int = 8
    data_val_fraction: float = 0.05
    optim_lr: float = 3e-3
    optim_min_lr: float = 3e-4
    optim_weight_decay: float = 0.1
    optim_beta1: float = 0.9
    optim_beta2: float = 0.95
    optim_eps: float = 1e-8
    optim_warmup_steps: int = 10
    optim_max_grad_norm: float = 1.0
    train_steps: int = 100
    train_seed: int = 0
    train_timeout: float = 300.0
    train_device: str = ""
    eval_every: int = 25
    eval_batches: int = 2
    checkpoint_dir: str = ""
    checkpoint_every: int = 50
    checkpoint_keep: int = 3
    log_every: int = 1
    log_jsonl: str = "metrics.jsonl"
    log_tensorboard: bool = False
    log_peak_tflops: float = 0.0

    # -- derived paths ---------------------------------------------------------------------

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    @property
    def checkpoints(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else self.out_dir / "checkpoints"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TrainConfig:
        cfg = cls(**doc)
        cfg.parallel_library_ops = tuple(cfg.parallel_library_ops)  # JSON keeps a list
        return cfg


def _field_of(section: str | None, key: str) -> str:
    return key if section is None else f"{section}_{key}"


def _typed(name: str, value: Any, kind: type, where: str) -> Any:
    if kind is tuple:  # a list of names
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise AutopartError(
                f"{where}: {name} = {value!r} is not a list of strings",
                hint='e.g. library_ops = ["mylib"]',
            )
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise AutopartError(
            f"{where}: {name} = {value!r} is a {type(value).__name__}, not a {kind.__name__}",
            hint="see the example in autopart/runtime/train_config.py",
        )
    if isinstance(value, float) and not math.isfinite(
        value
    ):  # TOML has nan and inf; no setting takes them
        raise AutopartError(f"{where}: {name} = {value} must be a finite number")
    return value


def load(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read and check a TOML config; ``overrides`` are ``section.key=value`` strings."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise AutopartError(f"cannot read {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise AutopartError(f"{path} is not valid TOML: {exc}") from exc
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise AutopartError(
                f"--set {item!r}: expected section.key=value", hint="e.g. --set optim.lr=3e-4"
            )
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare string
        *sections, last = key.strip().split(".")
        target = doc
        for s in sections:
            target = target.setdefault(s, {})
        target[last] = parsed
    given = " ".join(f"--set {item}" for item in overrides or [])
    return from_dict(doc, f"{path} ({given})" if given else str(path))


def from_dict(doc: dict[str, Any], where: str = "the config") -> TrainConfig:
    """A checked ``TrainConfig`` from a parsed TOML document."""
    kinds = {f.name: str(f.type) for f in fields(TrainConfig)}  # "int", "float", ... (strings)
    types = {"int": int, "float": float, "bool": bool, "str": str, "tuple[str, ...]": tuple}
    values: dict[str, Any] = {}
    for key, value in doc.items():
        items: list[tuple[str | None, str, Any]]
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise AutopartError(
                    f"{where}: unknown section [{key}]",
                    hint=f"the sections are {', '.join(SECTIONS)}",
                )
            items = [(key, k, v) for k, v in value.items()]
        else:
            items = [(None, key, value)]
        for section, k, v in items:
            name = _field_of(section, k)
            if name not in kinds or (section is None and name != "out"):
                shown = f"[{section}] {k}" if section else k
                known = sorted(
                    f.split("_", 1)[1] for f in kinds if section and f.startswith(section + "_")
                )
                raise AutopartError(
                    f"{where}: unknown key {shown}",
                    hint=f"[{section}] takes {', '.join(known)}" if section else "",
                )
            values[name] = _typed(
                f"[{section}] {k}" if section else k, v, types[kinds[name]], where
            )
    cfg = TrainConfig(**values)
    check(cfg, where)
    return cfg


def check(cfg: TrainConfig, where: str = "the config") -> None:
    """Ranges and combinations; the plan itself is checked when it is compiled."""
    positive = {
        "[parallel] dp": cfg.parallel_dp,
        "[parallel] tp": cfg.parallel_tp,
        "[parallel] pp": cfg.parallel_pp,
        "[parallel] microbatches": cfg.parallel_microbatches,
        "[data] seq_len": cfg.data_seq_len,
        "[data] batch_size": cfg.data_batch_size,
        "[train] steps": cfg.train_steps,
        "[train] timeout": cfg.train_timeout,
        "[eval] batches": cfg.eval_batches,
        "[log] every": cfg.log_every,
    }
    for name, v in positive.items():
        if v <= 0:
            raise AutopartError(f"{where}: {name} = {v} must be positive")
    for name, v in {
        "[optim] warmup_steps": cfg.optim_warmup_steps,
        "[eval] every": cfg.eval_every,
        "[checkpoint] every": cfg.checkpoint_every,
        "[checkpoint] keep": cfg.checkpoint_keep,
        "[optim] max_grad_norm": cfg.optim_max_grad_norm,
        "[optim] weight_decay": cfg.optim_weight_decay,
        "[log] peak_tflops": cfg.log_peak_tflops,
    }.items():
        if v < 0:
            raise AutopartError(f"{where}: {name} = {v} must be 0 or more")
    if not cfg.optim_lr > 0 or not 0 <= cfg.optim_min_lr <= cfg.optim_lr:
        raise AutopartError(
            f"{where}: [optim] lr = {cfg.optim_lr}, min_lr = {cfg.optim_min_lr}: need "
            "0 < lr and 0 <= min_lr <= lr"
        )
    if not (0 <= cfg.optim_beta1 < 1 and 0 <= cfg.optim_beta2 < 1 and cfg.optim_eps > 0):
        raise AutopartError(  # AdamW refused these inside every rank
            f"{where}: [optim] beta1 = {cfg.optim_beta1}, beta2 = {cfg.optim_beta2}, eps = "
            f"{cfg.optim_eps}: need betas in [0, 1) and eps > 0"
        )
    if not 0 <= cfg.data_val_fraction < 1:
        raise AutopartError(
            f"{where}: [data] val_fraction = {cfg.data_val_fraction} must be in [0, 1)"
        )
    if cfg.eval_every and cfg.data_val_fraction == 0:
        raise AutopartError(
            f"{where}: [eval] every = {cfg.eval_every} but [data] val_fraction = 0 leaves "
            "nothing to validate on",
            hint="set val_fraction > 0, or eval.every = 0",
        )
    sources = [k for k in ("text", "tokens", "dataset") if getattr(cfg, f"data_{k}")]
    if len(sources) > 1:
        raise AutopartError(f"{where}: [data] takes one of text, tokens or dataset, not {sources}")
    if cfg.data_tokenizer and cfg.data_tokens:
        raise AutopartError(
            f"{where}: [data] tokenizer applies to text or a dataset, not to token ids",
            hint="drop tokenizer, or give text / dataset",
        )
    if (cfg.data_dataset_config or cfg.data_dataset_files) and not cfg.data_dataset:
        raise AutopartError(f"{where}: [data] dataset_config / dataset_files need a dataset")
    if cfg.parallel_precision not in ("", "bf16"):
        raise AutopartError(
            f"{where}: [parallel] precision = {cfg.parallel_precision!r}: '' or 'bf16'"
        )
    if cfg.parallel_attention not in ("sdpa", "flex"):
        raise AutopartError(
            f"{where}: [parallel] attention = {cfg.parallel_attention!r}: 'sdpa' or 'flex'"
        )
    try:
        check_library_names(cfg.parallel_library_ops)
    except AutopartError as exc:
        raise AutopartError(f"{where}: [parallel] {exc.message}", hint=exc.hint) from None
    if not cfg.model_spec:
        raise AutopartError(f"{where}: [model] spec is empty", hint="file.py:make or module:make")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """The learning rate at ``step`` over ``lr``: linear warmup, then cosine to ``min_lr``,
    which the last step (``train_steps − 1``) trains at (the cosine used to end one step past
    it, so no step trained at ``min_lr``)."""
    if cfg.optim_warmup_steps and step < cfg.optim_warmup_steps:
        return (step + 1) / cfg.optim_warmup_steps
    span = max(1, cfg.train_steps - cfg.optim_warmup_steps - 1)
    done = min(1.0, (step - cfg.optim_warmup_steps) / span)
    low = cfg.optim_min_lr / cfg.optim_lr
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * done))
