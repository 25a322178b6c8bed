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


GPT2 = dict(  # the benchmarks' HF GPT-2 (random weights, no dropout, tied wte / lm_head)
    vocab_size=1024,
    n_embd=256,
    n_layer=4,
    n_head=8,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
)


def gpt2(
    seq: int, batch: int, width: int = 256, positions: int | None = None
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``GPT2`` at ``width`` (heads of 32) with ``positions`` positions (default ``seq``), and
    one seeded batch of ``batch`` × ``seq`` tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = {**GPT2, "n_embd": width, "n_head": width // 32}
    model = GPT2LMHeadModel(GPT2Config(n_positions=positions or seq, **cfg))
    tokens = torch.randint(
        0, GPT2["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def stepper(sched, rank: int, x: torch.Tensor, y: torch.Tensor, tied: list[torch.Tensor]):
    """A torch pipelining schedule as a step function returning the global mean loss: the
    first rank feeds the inputs, the last the targets; the tied ``wte``/``lm_head`` gradient
    shares in ``tied`` and the loss are all-reduced, as autopart's runtime does."""
    import torch.distributed as dist

    def step() -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x, return_outputs=False)
        else:
            sched.step(target=y, losses=losses, return_outputs=False)
        for p in tied:
            dist.all_reduce(p.grad)
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.all_reduce(loss)
        return loss

    return step


def torch_1f1b(stage, m: int, rank: int, x: torch.Tensor, y: torch.Tensor):
    """``Schedule1F1B`` over ``stage`` (``stepper``), and the stage's parameters by name."""
    from torch.distributed.pipelining import Schedule1F1B

    params = dict(stage.submod.named_parameters())
    sched = Schedule1F1B(stage, m, loss_fn=ce)
    return stepper(sched, rank, x, y, [params[TIED[rank]]]), params
