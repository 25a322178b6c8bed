"""Verification as a feature: parity of a parallel plan with the single-device run.

``verify(spec, dp=2, ...)`` builds the model from its factory, computes the reference loss and
gradients on one device (mean next-token cross entropy over labels != -100), compiles and saves
the program, launches its ranks with torchrun (real gloo processes), runs one step, gathers
every rank's gradient shards back to the model's global parameter names and compares.
Passing means: loss and every gradient within ``rtol`` (float64: 1e-9, float32: 1e-5), where
the error of a tensor is ``max|got − ref| / max|ref|``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from autopart.capture import logits_of
from autopart.emit import Shard
from autopart.errors import AutopartError
from autopart.spec import Factory, build

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Report:
    """Outcome of one parity check."""

    loss: float
    ref_loss: float
    loss_error: float
    grad_error: float
    worst: str  # the global FQN of the worst gradient
    tolerance: float
    errors: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.loss_error <= self.tolerance and self.grad_error <= self.tolerance

    def __str__(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        return (
            f"{verdict}: loss {self.loss:.12g} vs single-device {self.ref_loss:.12g} "
            f"(rel err {self.loss_error:.2e}); worst gradient {self.worst} rel err "
            f"{self.grad_error:.2e}; tolerance {self.tolerance:.0e}; {len(self.errors)} gradients compared"
        )


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    diff = (got.to(ref.dtype) - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


def reference(
    model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-device loss and gradients by the model's global parameter names."""
    input_ids, labels = batch
    model.zero_grad(set_to_none=True)
    logits = logits_of(model(input_ids))
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )
    loss.backward()
    grads = {
        f: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for f, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def gather(dumps: list[dict[str, Any]]) -> dict[str, list[torch.Tensor]]:
    """Every rank's gradient shards → candidate global gradients: one per whole copy (each
    data-parallel replica, each pipeline rank holding a tied weight), tp slices put together."""
    out: dict[str, list[torch.Tensor]] = {}
    pieces: dict[tuple, dict[int, tuple[Shard, torch.Tensor]]] = {}
    for d in dumps:
        c = d.get("coords", {})
        for fqn, grad in d["grads"].items():
            shard = Shard(**{**d["shards"][fqn], "shape": tuple(d["shards"][fqn]["shape"])})
            if grad is None:
                grad = torch.zeros(shard.local(torch.empty(shard.shape, device="meta")).shape)
            if shard.dim is None:
                out.setdefault(fqn, []).append(grad)
            else:
                pieces.setdefault((fqn, c.get("dp"), c.get("pp")), {})[shard.index] = (shard, grad)
    for (fqn, *_), parts in pieces.items():
        shard = parts[0][0]
        if sorted(parts) != list(range(shard.parts)):
            raise AutopartError(
                f"gradient of {fqn}: tp slices {sorted(parts)} of {shard.parts} arrived"
            )
        blocks = [[g.chunk(shard.strided, shard.dim)[j] for _, (_, g) in sorted(parts.items())]
                  for j in range(shard.strided)]  # fmt: skip
        out.setdefault(fqn, []).append(
            torch.cat([torch.cat(b, shard.dim) for b in blocks], shard.dim)
        )
    return out


def verify(
    spec: str | Factory,
    *,
    dp: int = 1,
    pp: int = 1,
    tp: int = 1,
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual_stages: int = 1,
    seq_chunks: int = 1,
    seq_split: str = "balanced",
    sequence_parallel: bool = False,
    max_stage_memory_gb: float | None = None,
    dtype: str = "float64",
    timeout_s: float = 300.0,
    workdir: str | Path | None = None,
    nnodes: int = 1,
    compile: bool = False,
) -> Report:
    """Run one step of the plan on real ranks and compare with one device (see module doc)."""
    import time

    from autopart.api import parallelize
    from autopart.plan import Mesh

    if dtype not in DTYPES:
        raise AutopartError(f"unknown dtype {dtype!r}", hint="use float64 or float32")
    start = time.perf_counter()
    mesh = Mesh(dp=dp, pp=pp, tp=tp)
    model, batch = build(spec)
    model = model.to(DTYPES[dtype])
    ref_loss, ref_grads = reference(model, batch)
    program = parallelize(model, mesh, example_inputs=batch, schedule=schedule, microbatches=microbatches,
                          virtual_stages=virtual_stages, seq_chunks=seq_chunks, seq_split=seq_split,
                          sequence_parallel=sequence_parallel, max_stage_memory_gb=max_stage_memory_gb)  # fmt: skip
    program.plan.check_batch(batch[0].shape[0])
    with tempfile.TemporaryDirectory(prefix="autopart-verify-", dir=workdir) as tmp:
        root = Path(tmp)
        program.save(root / "program")
        torch.save(batch, root / "batch.pt")
        output = launch(mesh.size, ["-m", "autopart.run", str(root / "program"), "--batch", str(root / "batch.pt"),
                        "--steps", "1", "--no-optim", "--dump", str(root / "dump"),
                        "--timeout", str(timeout_s), "--json", *(["--compile"] if compile else [])],
                        timeout_s=timeout_s, nnodes=nnodes)  # fmt: skip
        dumps = [
            torch.load(root / "dump" / f"rank{r:05d}.pt", weights_only=True)
            for r in range(mesh.size)
        ]
    losses = [float(d["loss"]) for d in dumps]
    loss_error = max(abs(v - ref_loss) / abs(ref_loss) for v in losses)
    errors: dict[str, float] = {}
    for fqn, copies in gather(dumps).items():
        if fqn not in ref_grads:
            raise AutopartError(f"rank gradients name {fqn!r}, which the model does not have")
        errors[fqn] = max(rel_error(g, ref_grads[fqn]) for g in copies)
    missing = set(ref_grads) - set(errors)
    if missing:
        raise AutopartError(f"no rank reported a gradient for {sorted(missing)[:3]}")
    worst = max(errors, key=errors.get)
    return Report(losses[0], ref_loss, loss_error, errors[worst], worst, TOLERANCE[DTYPES[dtype]],
                  errors, time.perf_counter() - start, output)  # fmt: skip


def launch(
    nproc: int,
    argv: list[str],
    *,
    timeout_s: float | None = 300.0,
    stream: bool = False,
    nnodes: int = 1,
) -> str:
    """Run ``argv`` on ``nproc`` ranks with torchrun on this machine; returns rank output.

    ``timeout_s`` bounds each distributed wait; the whole launch gets 60 s more (None: no bound).
    ``nnodes > 1`` starts that many torchrun agents (``nproc / nnodes`` ranks each) that meet by
    c10d rendezvous on 127.0.0.1, as separate machines would.
    """
    if nproc % nnodes:
        raise AutopartError(f"{nproc} ranks do not split over {nnodes} nodes",
                            hint="use a node count that divides the world size")  # fmt: skip
    if nnodes == 1:
        where = [["--standalone", f"--nproc-per-node={nproc}"]]
    else:
        port = _free_port()
        where = [[f"--nnodes={nnodes}", f"--nproc-per-node={nproc // nnodes}", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=autopart-{port}"]] * nnodes  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    limit = None if timeout_s is None else timeout_s + 60
    out = None if stream else subprocess.PIPE
    err = None if stream else subprocess.STDOUT
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *w, *argv], env=env,
                              text=True, stdout=out, stderr=err) for w in where]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=limit)[0] or "" for p in procs]
    except subprocess.TimeoutExpired as exc:
        for p in procs:
            p.kill()
        raise AutopartError(f"the {nproc} ranks did not finish within {exc.timeout:.0f} s",
                            hint="a rank hangs; rerun with a smaller --timeout to see which") from exc  # fmt: skip
    proc = subprocess.CompletedProcess(
        "torchrun", max((p.returncode for p in procs), key=abs), "".join(outputs)
    )
    if proc.returncode != 0:
        lines = (proc.stdout or "").strip().splitlines()
        said = list(
            dict.fromkeys(x.strip() for x in lines if "autopart run: error" in x or "hint:" in x)
        )
        tail = "\n".join(said or lines[-25:]) or "(the ranks' output is above)"
        log = None
        if proc.stdout:
            fd, log = tempfile.mkstemp(prefix="autopart-ranks-", suffix=".log")
            with os.fdopen(fd, "w") as f:
                f.write(proc.stdout)
        where = f"\n(full output of every rank: {log})" if log else ""
        raise AutopartError(
            f"torchrun with {nproc} ranks failed (exit {proc.returncode}):\n{tail}{where}"
        )
    return proc.stdout or ""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
