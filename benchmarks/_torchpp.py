"""Shared by the pipeline benchmarks: the torch.distributed.pipelining side (stage building for
HF GPT-2) and the live saved-activation counter used on it."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one micro-batch (torch pipelining's loss_fn)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


class Box:
    __slots__ = ("t", "__weakref__")


class LiveSaved:
    """Running sum and peak of the bytes autograd holds for backward: ``saved_tensors_hooks``,
    numel × element size per saved tensor, parameters excluded, views not de-duplicated; each
    saved tensor is wrapped in a ``Box`` whose ``weakref.finalize`` subtracts its bytes when
    autograd frees it."""

    def __init__(self, params) -> None:
        self.params, self.live, self.peak = {p.data_ptr() for p in params}, 0, 0
        unpack = lambda b: b.t if isinstance(b, Box) else b  # noqa: E731
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.data_ptr() in self.params:
            return t
        box, n = Box(), t.numel() * t.element_size()
        box.t, self.live = t, self.live + n
        self.peak = max(self.peak, self.live)
        weakref.finalize(box, self.free, n)  # runs when autograd drops the saved tensor
        return box

    def free(self, n: int) -> None:
        self.live -= n


class Half(nn.Module):
    """Rank's half of GPT2LMHeadModel for the manual PipelineStage API (same parameter names)."""

    def __init__(self, model: nn.Module, first: bool) -> None:
        super().__init__()
        t, k, self.first = model.transformer, len(model.transformer.h) // 2, first
        mods = dict(wte=t.wte, wpe=t.wpe, drop=t.drop) if first else dict(ln_f=t.ln_f)
        h = nn.ModuleDict({str(i): t.h[i] for i in (range(k) if first else range(k, len(t.h)))})
        self.transformer = nn.ModuleDict(dict(h=h, **mods))
        self.lm_head = None if first else model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        if self.first:
            x = t.drop(t.wte(x) + t.wpe(torch.arange(x.size(1))))
        for block in t.h.values():
            x = block(x)  # no mask given: HF's sdpa attention is then causal
        return x if self.first else self.lm_head(t.ln_f(x))


def torch_stage(
    model: nn.Module,
    rank: int,
    x_mb: torch.Tensor,
    group,
    manual: bool,
    split: str,
    stages: int = 2,
):
    """This rank's ``PipelineStage`` of HF GPT-2 split at module ``split`` (traced by
    ``pipeline()``; if the tracer fails, or ``manual``, the ``Half`` modules); and how."""
    from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

    note = "--manual given; "
    if not manual:
        try:
            pipe = pipeline(model, mb_args=(x_mb,), split_spec={split: SplitPoint.BEGINNING})
            stage = pipe.build_stage(rank, torch.device("cpu"), group=group)
            return stage, f"pipeline() traced HF GPT-2; split by SplitPoint.BEGINNING at {split}"
        except Exception as exc:  # noqa: BLE001 - any tracer failure: report it, use the fallback
            note = f"pipeline() could NOT trace HF GPT-2 ({type(exc).__name__}: "
            note += f"{str(exc).splitlines()[0][:100]}); "
    stage = PipelineStage(Half(model, rank == 0), rank, stages, torch.device("cpu"), group=group)
    return stage, note + "manual PipelineStage API, Half modules split in the middle"


TIED = ("transformer.wte.weight", "lm_head.weight")  # the tied weight in stage 0 / stage 1


def torch_1f1b(stage, m: int, rank: int, x: torch.Tensor, y: torch.Tensor):
    """``Schedule1F1B`` over ``stage`` as a step function returning the global mean loss (the
    tied ``wte``/``lm_head`` gradient and the loss all-reduced, as autopart's runtime does),
    and the stage's parameters by name."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B

    sched = Schedule1F1B(stage, m, loss_fn=ce)
    params = dict(stage.submod.named_parameters())

    def step() -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x, return_outputs=False)
        else:
            sched.step(target=y, losses=losses, return_outputs=False)
        dist.all_reduce(params[TIED[rank]].grad)  # wte's and lm_head's shares of the tied grad
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.all_reduce(loss)
        return loss

    return step, params
