"""Pipeline parallelism on CPU: autopart 1F1B against torch.distributed.pipelining 1F1B, pp=2.

Model: Hugging Face ``GPT2LMHeadModel`` from a small random config (4 blocks, width 256, 8 heads,
vocabulary 1024, 256 positions, no dropout, tied ``wte``/``lm_head``, float32; no download). Both
sides get the same seeded weights and one global batch of 8 x 128 random tokens with next-token
labels (none ignored), in 4 micro-batches of 2. One step is forward + backward, no optimizer:

1. autopart: ``autopart.parallelize(model, mesh, schedule="1f1b", microbatches=4).step(x, y)`` on
   the unmodified model; the split is autopart's own (cost-balanced);
2. torch: ``pipeline(model, split_spec={"transformer.h.2": SplitPoint.BEGINNING})`` (hand-placed
   at the middle block), ``build_stage`` and ``Schedule1F1B`` with loss_fn = mean cross entropy
   of the micro-batch. If the tracer cannot capture HF GPT-2 this is said, and the manual
   ``PipelineStage`` API is used instead (``Half``: each rank's half of the GPT-2 submodules).
   The tracer unties ``wte``/``lm_head`` across the stages, so the torch step all-reduces that
   gradient itself (autopart does it in its TIE_REDUCE action); the losses are all-reduced too,
   as autopart does, so both steps end with the same results on every rank.

2 gloo ranks under torchrun (launched by this script, OMP_NUM_THREADS=1 each); the two kinds of
step alternate, each after a barrier, so background load hits both alike. 3 warm-up steps, then 10
timed (per step, the slower rank counts); the median is reported with the ratio autopart / torch
(goal <= 1.0). autopart's loss is the mean over every label of the global batch, torch's the
mean of the micro-batch means: equal here (no ignored labels, equal micro-batches). The step-0
losses must agree to 1e-4 (relative) or the script exits 1; it exits 0 otherwise.

Peak saved-activation bytes per rank: autopart's ``runner.peak_saved_bytes`` (its runtime counts
with ``saved_tensors_hooks``). For torch, one extra untimed step runs inside ``LiveSaved``: the
same hooks and rule (numel x element size per saved tensor, parameters excluded, views not
de-duplicated), with each saved tensor wrapped in a ``Box`` whose ``weakref.finalize`` subtracts
its bytes when autograd frees it; the peak of that running sum is reported.

    python benchmarks/pp_vs_pipelining.py            # add --manual to force the manual stages
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

GPT2 = dict(vocab_size=1024, n_positions=256, n_embd=256, n_layer=4, n_head=8, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
BATCH, SEQ, M, P, WARMUP, ITERS, RTOL = 8, 128, 4, 2, 3, 10, 1e-4
SPLIT = "transformer.h.2"
TIED = ("transformer.wte.weight", "lm_head.weight")  # the tied weight in torch's stage 0 / 1


def build() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2))
    tokens = torch.randint(0, GPT2["vocab_size"], (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


class Box:
    __slots__ = ("t", "__weakref__")


class LiveSaved:
    """Running sum and peak of the bytes autograd holds for backward (see the module docstring)."""

    def __init__(self, params) -> None:
        self.params, self.live, self.peak = {p.data_ptr() for p in params}, 0, 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.data_ptr() in self.params:
            return t
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        box = Box()
        box.t = t
        weakref.finalize(box, self.free, n)
        return box

    def free(self, n: int) -> None:
        self.live -= n

    def unpack(self, b):
        return b.t if isinstance(b, Box) else b


class Half(nn.Module):
    """Rank's half of GPT2LMHeadModel for the manual PipelineStage API (same parameter names)."""

    def __init__(self, model: nn.Module, first: bool) -> None:
        super().__init__()
        t, k, self.first = model.transformer, len(model.transformer.h) // 2, first
        self.transformer = nn.Module()
        idx = range(k) if first else range(k, len(t.h))
        self.transformer.h = nn.ModuleDict({str(i): t.h[i] for i in idx})
        if first:
            self.transformer.wte, self.transformer.wpe, self.transformer.drop = t.wte, t.wpe, t.drop
        else:
            self.transformer.ln_f, self.lm_head = t.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        if self.first:
            x = t.drop(t.wte(x) + t.wpe(torch.arange(x.size(1))))
        for block in t.h.values():
            x = block(x)  # no mask given: HF's sdpa attention is then causal
        return x if self.first else self.lm_head(t.ln_f(x))


def torch_stage(model: nn.Module, rank: int, x: torch.Tensor, group, manual: bool):
    from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

    note = "--manual given; "
    if not manual:
        try:
            pipe = pipeline(model, mb_args=(x[: BATCH // M],),
                            split_spec={SPLIT: SplitPoint.BEGINNING})  # fmt: skip
            stage = pipe.build_stage(rank, torch.device("cpu"), group=group)
            return stage, f"pipeline() traced HF GPT-2; split by SplitPoint.BEGINNING at {SPLIT}"
        except Exception as exc:  # noqa: BLE001 - any tracer failure: report it, use the fallback
            note = f"pipeline() could NOT trace HF GPT-2 ({type(exc).__name__}: "
            note += f"{str(exc).splitlines()[0][:100]}); "
    stage = PipelineStage(Half(model, rank == 0), rank, P, torch.device("cpu"), group=group)
    return stage, note + "manual PipelineStage API, Half modules split at block 2"


def worker(out: str, manual: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    import autopart

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("pp",))
    rank = dist.get_rank()
    model, (x, y) = build()
    runner = autopart.parallelize(model, mesh, example_inputs=(x, y), schedule="1f1b",
                                  microbatches=M)  # fmt: skip
    tmodel = build()[0]
    canon, seen = {}, {}  # tied names → the first name of the same parameter
    for n, p in tmodel.named_parameters(remove_duplicate=False):
        canon[n] = seen.setdefault(id(p), n)
    stage, how = torch_stage(tmodel, rank, x, mesh.get_group("pp"), manual)
    sched = Schedule1F1B(stage, M, loss_fn=ce)
    tparams = dict(stage.submod.named_parameters())

    def torch_step() -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x, return_outputs=False)
        else:
            sched.step(target=y, losses=losses, return_outputs=False)
        dist.all_reduce(tparams[TIED[rank]].grad)  # wte's and lm_head's shares of the tied grad
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.all_reduce(loss)
        return loss

    runs = {"autopart": (lambda: runner.step(x, y), dict(runner.named_parameters())),
            "torch": (torch_step, tparams)}  # fmt: skip
    loss0, grads0, times = {}, {}, {k: [] for k in runs}
    for i in range(WARMUP + ITERS):
        for name, (step, params) in runs.items():
            for p in params.values():
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            loss = step()
            elapsed = time.perf_counter() - start
            if i == 0:
                loss0[name] = loss.item()
                grads0[name] = {canon.get(n, n): p.grad.clone() for n, p in params.items()
                                if p.grad is not None}  # fmt: skip
            if i >= WARMUP:
                times[name].append(elapsed)
    for p in tparams.values():
        p.grad = None
    saved = LiveSaved(tparams.values())
    with saved.hooks:
        torch_step()
    common = sorted(set(grads0["autopart"]) & set(grads0["torch"]))
    gerr = max((grads0["autopart"][n] - grads0["torch"][n]).norm().item()
               / grads0["torch"][n].norm().clamp(min=1e-30).item() for n in common)  # fmt: skip
    t = torch.tensor([times["autopart"], times["torch"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step, the slower rank's time
    blocks = sorted({int(n.split(".")[2]) for n, _ in runner.named_parameters() if ".h." in n})
    mine = {"rank": rank, "how": how, "loss0": loss0, "grad_err": gerr, "n_common": len(common),
            "saved": {"autopart": runner.peak_saved_bytes, "torch": saved.peak},
            "blocks": blocks, "times": t.tolist()}  # fmt: skip
    every = [None] * P
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


def main(manual: bool) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(P), __file__, "--worker", out, *(["--manual"] if manual else [])]  # fmt: skip
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0 or not os.path.exists(out):
            print(proc.stdout + proc.stderr, file=sys.stderr)
            print(f"torchrun failed (exit {proc.returncode})", file=sys.stderr)
            return 0
        ranks = json.loads(Path(out).read_text())
    params = sum(p.numel() for p in build()[0].parameters())
    ms = {k: 1e3 * statistics.median(ts) for k, ts in zip(("autopart", "torch"), ranks[0]["times"])}
    loss = ranks[-1]["loss0"]
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread/rank "
          "(the cores may be shared with other processes: expect some noise)")  # fmt: skip
    print(f"model: HF GPT2LMHeadModel {GPT2['n_layer']} x {GPT2['n_embd']}, {GPT2['n_head']} heads, "
          f"V={GPT2['vocab_size']}, {params / 1e6:.2f} M params, float32; batch {BATCH} x {SEQ} "
          f"in {M} micro-batches, pp={P}, 1F1B")  # fmt: skip
    print(f"torch.distributed.pipelining: {ranks[0]['how']}")
    split = ", ".join(f"rank {r['rank']} blocks {r['blocks']}" for r in ranks)
    print(f"autopart: automatic split: {split}")
    print(f"timing: median of {ITERS} steps after {WARMUP} warm-up (forward + backward, no "
          "optimizer; per step the slower rank)")  # fmt: skip
    print(f"  autopart 1F1B            {ms['autopart']:8.1f} ms/step   step-0 loss "
          f"{loss['autopart']:.6f}")  # fmt: skip
    print(
        f"  torch Schedule1F1B       {ms['torch']:8.1f} ms/step   step-0 loss {loss['torch']:.6f}"
    )
    ratio = ms["autopart"] / ms["torch"]
    print(f"autopart / torch: {ratio:.3f}  (goal <= 1.0: {'met' if ratio <= 1.0 else 'MISSED'})")
    print("peak saved-activation bytes (saved_tensors_hooks, parameters excluded):")
    for r in ranks:
        a, t = r["saved"]["autopart"], r["saved"]["torch"]
        print(f"  rank {r['rank']}: autopart {a / 2**20:7.2f} MiB   torch {t / 2**20:7.2f} MiB"
              f"   autopart / torch {a / max(t, 1):.3f}")  # fmt: skip
    for r in ranks:
        print(f"  rank {r['rank']}: step-0 gradients of {r['n_common']} common parameters, max "
              f"relative difference {r['grad_err']:.2e}")  # fmt: skip
    if abs(loss["autopart"] - loss["torch"]) > RTOL * abs(loss["torch"]):
        print("LOSS MISMATCH at step 0: autopart vs torch", file=sys.stderr)
        return 1
    print(f"losses agree at step 0 (relative tolerance {RTOL:g})")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="RESULT_JSON", help="internal: run as a torchrun rank")
    ap.add_argument("--manual", action="store_true", help="use the manual PipelineStage API")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.manual)
    else:
        sys.exit(main(args.manual))
