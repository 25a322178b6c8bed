"""``python -m benchmarks gpu``: the CUDA path on one GPU, checked and timed in one command.

1. **Checks**: ``tests/test_gpu.py`` in one pytest process: single-rank programs on ``cuda:0``
   (float64 and bf16 parity, recompute, an Inductor/Triton-compiled program) and ranks sharing
   the GPU over gloo with host staging (dp, tp + SP, pp 1F1B, Seq1F1B, ZB-H1, recompute).
2. **Throughput**: one training step (forward, backward, fused AdamW) of a Hugging Face Llama of
   about 1B parameters (Llama 3.2 1B's shape, random weights) in bf16 with float32 master
   weights, three ways, each in its own process: eager PyTorch under autocast,
   ``torch.compile`` of the same model and loss, and autopart's single-rank program compiled
   (``compile=True``, ``precision="bf16"``). Printed: tokens/s, model TFLOP/s, MFU against the
   card's dense bf16 peak, peak memory, and autopart's ratios to both peers. ``--long`` adds a
   longer sequence cut into Seq1F1B chunks against ``torch.compile`` at the same length.

The FLOPs are the model's, by the PaLM/torchtitan convention: 6 per parameter a matmul reads
per token (the LM head included, embedding lookups not) plus 12·layers·hidden·seq per token for
attention's two products, causal masking not subtracted. MFU divides by the card's datasheet
dense bf16 rate; the measured rate of a large bf16 matmul is printed beside it.

Everything lands in one JSON file (``--out``, written after every phase, so a run that is cut
short keeps what it measured). ``--size tiny`` runs the same code on a tiny model: what the CPU
tests run (``tests/test_gpu.py::test_gpu_benchmark_runs_on_cpu``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# dense bf16 tensor-core peaks by the vendors' datasheets (FLOP/s), by device-name fragment;
# the first fragment found in the name wins
PEAKS = [
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("H800", 989.4e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
]

SIZES: dict[str, dict[str, Any]] = {
    # Llama 3.2 1B's shape: 1.24B parameters (tied embeddings)
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    ),
}
MODES = ("eager", "torch.compile", "autopart")


def peak_flops(name: str) -> float | None:
    """The card's dense bf16 peak (FLOP/s) from its name, or None for a card not listed."""
    return next((f for frag, f in PEAKS if frag in name), None)


def flops_per_token(cfg: dict[str, Any], seq: int) -> float:
    """Training FLOPs per token (module docstring's convention)."""
    d, ff, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    matmul_params = layers * (2 * d * d + 2 * d * kv + 3 * d * ff) + d * cfg["vocab_size"]
    return 6.0 * matmul_params + 12.0 * layers * d * seq


# -- one mode, in its own process ------------------------------------------------------------


def _model(size: str, seq: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **SIZES[size],
        max_position_embeddings=max(seq, 2048),
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _batch(vocab: int, batch: int, seq: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # labels: the next token


def worker(a: argparse.Namespace) -> dict[str, Any]:
    """Time ``a.mode`` on this process's device; the figures as a dict."""
    import torch
    import torch.nn.functional as F

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    ids, labels = _batch(SIZES[a.size]["vocab_size"], a.batch, a.seq)
    model = _model(a.size, a.seq)
    n_params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    if a.mode == "autopart":
        import autopart
        from autopart.runtime.runner import Runner, local_weights

        plan: dict[str, Any] = {"precision": "bf16"}
        if a.chunks > 1:
            plan.update(schedule="seq1f1b", seq_chunks=a.chunks)
        program = autopart.parallelize(model, autopart.Mesh(), (ids, labels), **plan)
        rp = program.rank(0)
        runner = Runner(
            rp, program.plan, local_weights(program, rp), {}, compile=a.compile, device=dev
        )
        del model, program
        params = list(runner.parameters())

        def step() -> Any:
            return runner.step(ids, labels)
    else:
        model = model.to(dev)
        params = list(model.parameters())
        autocast = cuda and a.precision == "bf16"

        def loss_of(x: Any, y: Any) -> Any:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(x).logits
            return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

        fn = torch.compile(loss_of) if a.mode == "torch.compile" else loss_of
        ids, labels = ids.to(dev), labels.to(dev)

        def step() -> Any:
            loss = fn(ids, labels)
            loss.backward()
            return loss

    prepare_s = time.perf_counter() - start
    print(f"{a.mode}: prepared in {prepare_s:.1f} s", file=sys.stderr, flush=True)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    losses, times = [], []
    for i in range(a.warmup + a.steps):
        if i == a.warmup and cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        sync()
        t = time.perf_counter()
        loss = step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        print(f"{a.mode}: step {i} {times[-1]:.3f} s", file=sys.stderr, flush=True)
    profile = _profile(lambda: (step(), opt.step(), opt.zero_grad(set_to_none=True), sync()))
    timed = sorted(times[a.warmup :])
    step_s = timed[len(timed) // 2]  # the median step
    tokens = a.batch * a.seq
    flops = flops_per_token(SIZES[a.size], a.seq) * tokens
    return {
        "mode": a.mode,
        "seq": a.seq,
        "batch": a.batch,
        "chunks": a.chunks,
        "params": n_params,
        "prepare_s": prepare_s,
        "first_step_s": times[0],
        "step_s": step_s,
        "step_s_min": timed[0],
        "step_s_max": timed[-1],
        "tokens_per_s": tokens / step_s,
        "tflops": flops / step_s / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
        "losses": losses,
        **(profile if cuda else {}),
    }


def _profile(one_step: Any) -> dict[str, Any]:
    """One more step under torch.profiler: the table of the ops and kernels that took the most
    GPU time, to say where a step's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {}
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one_step()
        events = prof.key_averages()
        table = events.table(
            sort_by="self_device_time_total", row_limit=30, max_name_column_width=70
        )
        return {"profile": table}
    except Exception as exc:  # noqa: BLE001 - the figures stand without it
        return {"profile": f"profiler failed: {type(exc).__name__}: {exc}"}


# -- the driver ------------------------------------------------------------------------------


def _run_mode(a: argparse.Namespace, mode: str, seq: int, batch: int, chunks: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return _run_mode_in(a, mode, seq, batch, chunks, Path(tmp) / "result.json")


def _run_mode_in(
    a: argparse.Namespace, mode: str, seq: int, batch: int, chunks: int, with_out: Path
) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        mode,
        "--json",
        str(with_out),
        "--size",
        a.size,
        "--seq",
        str(seq),
        "--batch",
        str(batch),
        "--chunks",
        str(chunks),
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        "--device",
        a.device,
    ]
    if not a.no_compile:
        cmd.append("--compile")
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.mode_timeout)
    if proc.returncode != 0 or not with_out.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"mode": mode, "seq": seq, "error": f"exit {proc.returncode}", "output": tail}
    out = json.loads(with_out.read_text())
    out["wall_s"] = time.perf_counter() - t
    return out


def _checks(a: argparse.Namespace) -> dict[str, Any]:
    """tests/test_gpu.py in one pytest process; per-test outcomes from its JUnit XML."""
    junit = Path(a.out).with_suffix(".junit.xml")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(ROOT / "tests" / "test_gpu.py"),
        "-n",
        "0",
        "-m",
        "",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=a.checks_timeout, cwd=ROOT
        )
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        output = f"timed out after {a.checks_timeout} s\n{exc.stdout or ''}"
    cases: dict[str, Any] = {}
    if junit.exists():
        for tc in ET.parse(junit).getroot().iter("testcase"):
            bad = next((c for c in tc if c.tag in ("failure", "error", "skipped")), None)
            cases[tc.get("name", "?")] = {
                "outcome": "passed" if bad is None else bad.tag,
                "s": float(tc.get("time", 0)),
                "message": None if bad is None else (bad.get("message") or "")[:2000],
            }
    return {"wall_s": time.perf_counter() - t, "cases": cases, "output": output[-6000:]}


def _device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "device": device}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            name=p.name,
            memory_gib=p.total_memory / 2**30,
            capability=f"{p.major}.{p.minor}",
            peak_bf16_tflops=(peak_flops(p.name) or 0) / 1e12 or None,
        )
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            x @ x
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            x @ x
        torch.cuda.synchronize()
        info["matmul_bf16_tflops"] = 10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12
    return info


def _summary(res: dict[str, Any]) -> list[str]:
    lines = []
    info = res["device"]
    peak = (info.get("peak_bf16_tflops") or 0) * 1e12
    lines.append(
        f"{info.get('name', info['device'])}: torch {info['torch']}, "
        f"transformers {info.get('transformers')}, peak bf16 "
        f"{info.get('peak_bf16_tflops') or '?'} TFLOP/s, measured 8192^3 matmul "
        f"{info.get('matmul_bf16_tflops', float('nan')):.0f} TFLOP/s"
    )
    checks = res.get("checks")
    if checks:
        cases = checks["cases"]
        by = {o: sum(c["outcome"] == o for c in cases.values()) for o in ("passed", "failure")}
        by["error"] = sum(c["outcome"] == "error" for c in cases.values())
        by["skipped"] = sum(c["outcome"] == "skipped" for c in cases.values())
        lines.append(f"checks ({checks['wall_s']:.0f} s): {by}")
        for name, c in cases.items():
            if c["outcome"] not in ("passed", "skipped"):
                lines.append(f"  {c['outcome']}: {name}: {(c['message'] or '')[:300]}")
    for key, runs in res.get("throughput", {}).items():
        lines.append(f"throughput, {key}:")
        lines.append(
            f"  {'mode':14} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
            f"{'peak GiB':>9} {'prep s':>7} {'1st step s':>10}  loss0"
        )
        for r in runs.values():
            if "error" in r:
                lines.append(f"  {r['mode']:14} FAILED: {r['error']}")
                continue
            mfu = f"{r['tflops'] * 1e12 / peak:.1%}" if peak else "?"
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
            lines.append(
                f"  {r['mode']:14} {r['step_s']:8.4f} {r['tokens_per_s']:10.0f} "
                f"{r['tflops']:8.1f} {mfu:>6} {mem:>9} {r['prepare_s']:7.1f} "
                f"{r['first_step_s']:10.1f}  {r['losses'][0]:.4f}"
            )
        ours = runs.get("autopart", {})
        for peer in ("torch.compile", "eager"):
            theirs = runs.get(peer, {})
            if "step_s" in ours and "step_s" in theirs:
                lines.append(
                    f"  autopart / {peer}: step time {ours['step_s'] / theirs['step_s']:.3f}"
                    + (
                        f", peak memory {ours['peak_mem_gib'] / theirs['peak_mem_gib']:.3f}"
                        if ours.get("peak_mem_gib") and theirs.get("peak_mem_gib")
                        else ""
                    )
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks gpu", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--out", default="gpu-results.json", help="the JSON file to write")
    ap.add_argument("--size", choices=list(SIZES), default="1b", help="the model (default 1b)")
    ap.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument(
        "--long",
        type=int,
        default=0,
        metavar="SEQ",
        help="also time SEQ tokens (batch 1) with Seq1F1B chunks (--chunks) against torch.compile",
    )
    ap.add_argument("--chunks", type=int, default=4, help="Seq1F1B chunks for --long")
    ap.add_argument("--no-checks", action="store_true", help="skip tests/test_gpu.py")
    ap.add_argument("--no-main", action="store_true", help="skip the --seq run (with --long)")
    ap.add_argument("--no-compile", action="store_true", help="autopart without compile=True")
    ap.add_argument("--device", default="cuda", help="where to run (default cuda)")
    ap.add_argument("--checks-timeout", type=float, default=300, help="seconds for the checks")
    ap.add_argument("--mode-timeout", type=float, default=300, help="seconds for each mode")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.mode = a.worker
        if a.mode == "eager":
            a.compile = False
        Path(a.json).write_text(json.dumps(worker(a)))
        return 0
    a.chunks_long = a.chunks
    res: dict[str, Any] = {"device": _device_info(a.device), "argv": sys.argv[1:]}
    out = Path(a.out)

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    save()
    if not a.no_checks:
        print("checks: tests/test_gpu.py ...", flush=True)
        res["checks"] = _checks(a)
        save()
    res["throughput"] = {}
    runs: list[tuple[str, int, int, int, tuple[str, ...]]] = []
    if not a.no_main:
        runs.append((f"seq {a.seq} x batch {a.batch}", a.seq, a.batch, 1, tuple(a.modes)))
    if a.long:
        runs.append(
            (
                f"seq {a.long} x batch 1, Seq1F1B {a.chunks} chunks",
                a.long,
                1,
                a.chunks,
                ("torch.compile", "autopart"),
            )
        )
    for key, seq, batch, chunks, modes in runs:
        res["throughput"][key] = {}
        for mode in modes:
            print(f"throughput: {key}: {mode} ...", flush=True)
            try:
                r = _run_mode(a, mode, seq, batch, chunks if mode == "autopart" else 1)
            except subprocess.TimeoutExpired as exc:  # what it printed says how far it got
                err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
                r = {"mode": mode, "error": f"timed out after {a.mode_timeout} s"}
                r["output"] = err[-3000:]
            res["throughput"][key][mode] = r
            save()
    lines = _summary(res)
    print("\n".join(lines))
    failed = [
        n
        for n, c in (res.get("checks") or {}).get("cases", {}).items()
        if c["outcome"] in ("failure", "error")
    ]
    errors = [r for t in res["throughput"].values() for r in t.values() if "error" in r]
    for r in errors:
        print(f"--- {r['mode']} failed:\n{r.get('output', '')}", file=sys.stderr)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
