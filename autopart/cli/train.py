"""``autopart train CONFIG.toml``: train a model with a plan, in the torchtitan mould.

Everything is checked here, once, before any rank starts: the configuration
(``runtime/train_config.py``), the data, and the plan, which is compiled here once and saved to
``OUT/program``. Then torchrun starts ``python -m autopart.runtime.train OUT/train.json`` on
the plan's world size. It resumes from the newest intact checkpoint in the checkpoint folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

EXAMPLE = """examples:
  autopart train train.toml
  autopart train train.toml --set optim.lr=1e-3 --set train.steps=200
  autopart train train.toml --check        compile and check, start nothing

the config (TOML; every key optional, unknown keys refused):
  out = "train-out"
  [model]      spec = "autopart.models.nanogpt:demo"   (file.py:make or module:make)
  [parallel]   dp, tp, pp, schedule, microbatches, virtual_stages, seq_chunks,
               sequence_parallel, recompute, precision ("" or "bf16"), compile,
               attention ("sdpa" or "flex"), library_ops (op namespaces to trust)
  [data]       text = "file.txt" | tokens = "ids.pt" / "ids.bin" | dataset = "name"
               (with dataset_config, dataset_files, split, field); tokenizer ("": bytes
               as ids); seq_len, batch_size (global, sequences), val_fraction
  [optim]      lr, min_lr, weight_decay, beta1, beta2, eps, warmup_steps, max_grad_norm
  [train]      steps, seed, timeout, device
  [eval]       every (0: never), batches
  [checkpoint] dir ("": OUT/checkpoints), every, keep
  [log]        every, jsonl, tensorboard, peak_tflops (per rank: MFU in the metrics)
(docs/train.md has the whole table)
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train",
        help="train with a TOML config: schedule, clipping, eval, checkpoints, metrics",
        description="Compile the plan once, check everything, then train on torchrun ranks.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("config", metavar="CONFIG.toml", help="the run's configuration")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (TOML syntax), e.g. --set optim.lr=3e-4",
    )
    t.add_argument(
        "--check", action="store_true", help="check the config and compile the plan; train nothing"
    )


def main(a: argparse.Namespace) -> int:
    from rich.console import Console

    from autopart.runtime import dirlock, train_config
    from autopart.runtime.launch import launch
    from autopart.runtime.train import MANIFEST

    con = Console(stderr=True)
    cfg = train_config.load(a.config, a.set)
    dirlock.check_free(cfg.checkpoints)  # another run saving there: refused before compiling
    with con.status("checking the data and compiling the plan (once)"):
        world = prepare(cfg)
    manifest = cfg.out_dir / MANIFEST
    if a.check:
        print(f"config and plan are fine: {world} ranks; {manifest}")
        return 0
    print(
        f"launching {world} ranks: torchrun --standalone --nproc-per-node {world} "
        f"-m autopart.runtime.train {manifest}",
        flush=True,
    )
    launch(world, ["-m", "autopart.runtime.train", str(manifest)], stream=True, timeout_s=None)
    return 0


def prepare(cfg: Any) -> int:
    """Read the data, build and compile the model (once), and write ``OUT/``: the program,
    ``tokens.pt`` and ``train.json``; returns the world size."""
    import torch

    from autopart import Mesh, parallelize
    from autopart.errors import AutopartError
    from autopart.frontend.spec import build
    from autopart.runtime.train import MANIFEST, windows

    ids = _read_data(cfg)
    n_val = int(ids.numel() * cfg.data_val_fraction)
    train_ids = ids[: ids.numel() - n_val]
    need = cfg.data_seq_len + 2
    for part, t in (("training", train_ids), ("validation", ids[train_ids.numel() :])):
        if (part == "training" or cfg.eval_every) and t.numel() < need:
            raise AutopartError(
                f"the {part} part of the data holds {t.numel()} tokens, fewer than one "
                f"sequence of {need}",
                hint="use more data, a shorter [data] seq_len, or another val_fraction",
            )
    model, _ = build(cfg.model_spec)
    example = windows(train_ids, cfg.data_batch_size, cfg.data_seq_len, 0)
    mesh = Mesh(dp=cfg.parallel_dp, tp=cfg.parallel_tp, pp=cfg.parallel_pp)
    program = parallelize(
        model,
        mesh,
        example,
        schedule=cfg.parallel_schedule,
        microbatches=cfg.parallel_microbatches,
        virtual_stages=cfg.parallel_virtual_stages,
        seq_chunks=cfg.parallel_seq_chunks,
        sequence_parallel=cfg.parallel_sequence_parallel,
        recompute=cfg.parallel_recompute,
        precision=cfg.parallel_precision or None,
        library_ops=cfg.parallel_library_ops,
        attention=cfg.parallel_attention,
    )
    if int(ids.max()) >= program.vocab_size or int(ids.min()) < 0:
        raise AutopartError(
            f"the data holds token id {int(ids.max())}, outside the model's vocabulary of "
            f"{program.vocab_size}",
            hint="tokenize with the model's tokenizer",
        )
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    program.save(out / "program")
    torch.save(ids.clone(), out / "tokens.pt")
    params = sum(p.numel() for p in program.params.values())
    (out / MANIFEST).write_text(
        json.dumps(
            {
                "config": cfg.to_json(),
                "train_tokens": int(train_ids.numel()),
                # the usual estimate: 6 FLOPs per parameter and token (forward and backward)
                "flops_per_token": 6 * params,
            },
            indent=1,
        )
    )
    return mesh.size


def _read_data(cfg: Any) -> Any:
    """The token ids: a text file (bytes, or a tokenizer's ids), a token file, a Hugging Face
    dataset's text field (documents joined by the tokenizer's end-of-text id, or a newline),
    or the demo corpus."""
    import torch

    from autopart.cli.demo import corpus
    from autopart.errors import AutopartError
    from autopart.runtime.run import _read_tokens

    if cfg.data_tokens:
        return _read_tokens(Path(cfg.data_tokens), "[data] tokens")
    if cfg.data_text:
        path = Path(cfg.data_text)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise AutopartError(f"cannot read [data] text {path}: {exc}") from exc
        if cfg.data_tokenizer:
            return _tokenize([raw.decode("utf-8", errors="replace")], cfg.data_tokenizer)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    if cfg.data_dataset:
        return _tokenize(_dataset_texts(cfg), cfg.data_tokenizer)
    return corpus()


def _dataset_texts(cfg: Any) -> list[str]:
    """The ``field`` of every row of ``[data] dataset`` (``datasets.load_dataset``)."""
    from autopart.errors import AutopartError

    try:
        import datasets
    except ImportError:
        raise AutopartError(
            f"[data] dataset = {cfg.data_dataset!r} needs the `datasets` library",
            hint="pip install datasets (or: pip install 'autopart[data]')",
        ) from None
    files = cfg.data_dataset_files or None
    try:
        ds = datasets.load_dataset(
            cfg.data_dataset,
            cfg.data_dataset_config or None,
            split=cfg.data_split,
            data_files=files,
        )
    except Exception as exc:  # noqa: BLE001 - the library's many failures, named once
        raise AutopartError(
            f"[data] dataset = {cfg.data_dataset!r} (split {cfg.data_split!r}) could not be "
            f"loaded: {type(exc).__name__}: {exc}"
        ) from exc
    if cfg.data_field not in ds.column_names:
        raise AutopartError(
            f"[data] field = {cfg.data_field!r} is not a column of {cfg.data_dataset!r}",
            hint=f"its columns: {ds.column_names}",
        )
    texts = [t for t in ds[cfg.data_field] if isinstance(t, str) and t]
    if not texts:
        raise AutopartError(
            f"[data] dataset {cfg.data_dataset!r} holds no text in {cfg.data_field!r}"
        )
    return texts


def _tokenize(texts: list[str], tokenizer: str) -> Any:
    """Token ids of ``texts``, documents joined by the end-of-text id (a tokenizer's) or a
    newline (bytes, when ``tokenizer`` is empty)."""
    import torch

    from autopart.errors import AutopartError

    if not tokenizer:
        raw = "\n".join(texts).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as exc:  # noqa: BLE001 - a missing library or tokenizer, named
        raise AutopartError(
            f"[data] tokenizer = {tokenizer!r} could not be loaded: {type(exc).__name__}: {exc}",
            hint="a Hugging Face tokenizer name or a folder saved with save_pretrained "
            "(needs `transformers`)",
        ) from exc
    sep = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids: list[int] = []
    for t in texts:
        ids += tok(t, add_special_tokens=False)["input_ids"] + sep
    return torch.tensor(ids, dtype=torch.int64)
