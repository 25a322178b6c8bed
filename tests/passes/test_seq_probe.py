"""sequence_chunk's allow-list against sequence mixers it was not written for: each of these
constructs, put after a causal attention in both blocks of a toy model, is refused when
compiling (pp=2, Seq1F1B k=2), naming a node of its block; the same model without it chunks
exactly (``test_sequence_chunk._assert_chunks_exactly``). None of them is chunkable as written,
so each proof must fail: a construct that compiled here would be run wrong or crash in the
ranks. (Written as a probe of 40 constructs; the causal convolutions, the running counts and
the rolled-up scans that do chunk are tested in test_sequence_chunk.py and test_seq_scan.py.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_sequence_chunk import _assert_chunks_exactly
from torch import nn

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import capture

S = 16  # the example's sequence length

Mix = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _steps(s: int) -> torch.Tensor:
    return torch.arange(1, s + 1, dtype=torch.float64).view(1, s, 1)


MIXES: dict[str, Mix] = {
    "roll": lambda m, x: x.roll(1, dims=1),
    # a token shift written as a pad chunks (TOKEN_SHIFTS); these pads are no token shift
    "a pad looking one token ahead": lambda m, x: F.pad(x, (0, 0, -1, 1)),
    "a pad by 1 cut by 2, padded back": lambda m, x: F.pad(F.pad(x, (0, 0, 1, -2)), (0, 0, 0, 1)),
    "a shift filled with ones": lambda m, x: F.pad(x, (0, 0, 1, -1), value=1.0),
    "a shift along the sequence and the features": lambda m, x: F.pad(x, (1, -1, 1, -1)),
    "a shift by a cat of ones": lambda m, x: torch.cat([torch.ones_like(x[:, :1]), x[:, :-1]], 1),
    "a shift by a cat of the last token": lambda m, x: torch.cat([x[:, -1:], x[:, :-1]], 1),
    "the next token": lambda m, x: torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1),
    "a difference": lambda m, x: torch.diff(x, dim=1, prepend=torch.zeros_like(x[:, :1])),
    "an FFT convolution": lambda m, x: torch.fft.irfft(
        torch.fft.rfft(x, n=2 * x.shape[1], dim=1) ** 2, n=2 * x.shape[1], dim=1
    )[:, : x.shape[1]],
    "a causal average pool": lambda m, x: F.avg_pool1d(
        F.pad(x.transpose(1, 2), (2, 0)), 3, 1
    ).transpose(1, 2),
    "a windowed unfold": lambda m, x: F.pad(x, (0, 0, 2, 0)).unfold(1, 3, 1).mean(-1),
    # each token twice in place chunks (REPEATS); cut or folded otherwise, tokens meet
    "tokens repeated in place, cut to the first s": lambda m, x: x.repeat_interleave(2, dim=1)[
        :, : x.shape[1]
    ],
    "tokens repeated in place, viewed as halves": lambda m, x: (
        x.repeat_interleave(2, dim=1).view(x.shape[0], 2, x.shape[1], 16).sum(1)
    ),
    "tokens repeated flat": lambda m, x: x.repeat_interleave(2)[: x.numel()].view_as(x),
    # a running maximum chunks (RUNNING_SUMS); the positions it returns count from its start
    "the positions of a running maximum": lambda m, x: x.cummax(1).indices.to(x.dtype) / 16,
    "a sort": lambda m, x: x.sort(1).values,
    "a top-k": lambda m, x: x.topk(2, dim=1).values.mean(1, keepdim=True).expand_as(x),
    "the first token": lambda m, x: x[:, :1].expand_as(x),
    "the last token": lambda m, x: x[:, -1:].expand_as(x),
    "a lower-triangular mixing matrix": lambda m, x: (
        torch.tril(m.w[: x.shape[1], : x.shape[1]]) @ x
    ),
    "a full mixing matrix": lambda m, x: m.w[: x.shape[1], : x.shape[1]] @ x,
    "an averaging einsum": lambda m, x: (
        torch.einsum("ts,bsh->bth", torch.tril(torch.ones_like(m.w[: x.shape[1], : x.shape[1]])), x)
        / _steps(x.shape[1])
    ),
    "unnormalized causal linear attention": lambda m, x: (
        (x @ x.transpose(1, 2)).masked_fill(
            torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1), 0.0
        )
        @ x
        / 16
    ),
    "linear attention without a mask": lambda m, x: (x @ x.transpose(1, 2)) @ x / 16,
    "token pairs folded into the hidden dim": lambda m, x: (
        x.reshape(x.shape[0], x.shape[1] // 2, -1).flip(-1).reshape(x.shape)
    ),
    "the sequence cut in halves": lambda m, x: (
        x.reshape(x.shape[0], 2, x.shape[1] // 2, -1).flip(1).reshape(x.shape)
    ),
    "every other token repeated": lambda m, x: x[:, ::2].repeat_interleave(2, 1),
    "a nearest upsampling": lambda m, x: (
        F.interpolate(x.transpose(1, 2), scale_factor=0.5).repeat_interleave(2, -1).transpose(1, 2)
    ),
    "a gather in reverse": lambda m, x: x.gather(
        1, torch.arange(x.shape[1] - 1, -1, -1).view(1, -1, 1).expand_as(x)
    ),
    "an index_select in reverse": lambda m, x: x.index_select(
        1, torch.arange(x.shape[1] - 1, -1, -1)
    ),
    "an index of the previous token": lambda m, x: x[:, (torch.arange(x.shape[1]) - 1).clamp(0)],
    "a standard deviation over the sequence": lambda m, x: x / x.std(1, keepdim=True),
    "a variance over the sequence (unbiased flag)": lambda m, x: (
        x / (x.var(1, unbiased=False, keepdim=True) + 1)
    ),
    "a softmax over the sequence": lambda m, x: torch.softmax(x, dim=1),
    "a normalization over the sequence": lambda m, x: F.normalize(x, dim=1),
    "a group norm over the sequence": lambda m, x: F.group_norm(x.transpose(1, 2), 4).transpose(
        1, 2
    ),
    "a vector norm over the sequence": lambda m, x: x / torch.linalg.vector_norm(x, 2, 1, True),
    "a layer norm over the sequence": lambda m, x: F.layer_norm(
        x.transpose(1, 2), (x.shape[1],)
    ).transpose(1, 2),
    "the first half of the positions": lambda m, x: torch.where(
        (torch.arange(x.shape[1]) < x.shape[1] // 2).view(1, -1, 1), x, -x
    ),
    "positions divided by the length": lambda m, x: (
        x * torch.arange(x.shape[1]).view(1, -1, 1) / x.shape[1]
    ),
    # running counts over a dim of 2·s (the twenty-second session's probe: taken for c·(t + 1),
    # shifted by the chunk's offset, and trained silently wrong, loss 7e-2 off)
    "a running count of 2·s folded and summed": lambda m, x: (
        x * x.new_ones(2 * x.shape[1]).cumsum(0).view(2, -1).sum(0).view(1, -1, 1) / 64
    ),
    "the second half of a running count of 2·s": lambda m, x: (
        x * x.new_ones(2 * x.shape[1]).cumsum(0).view(2, -1)[1].view(1, -1, 1) / 64
    ),
    "tokens copied twice over a running count": lambda m, x: (
        (
            x.unsqueeze(1).expand(-1, 2, -1, -1).reshape(x.shape[0], -1, x.shape[2])
            / x.new_ones(x.shape[0], 2 * x.shape[1], 1).cumsum(1)
        )
        .reshape(x.shape[0], 2, x.shape[1], x.shape[2])
        .sum(1)
    ),
}


class _Block(nn.Module):
    def __init__(self, mix: Mix | None) -> None:
        super().__init__()
        self.mix = mix
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)
        if mix is not None:  # a mixing matrix some constructs read
            self.w = nn.Parameter(torch.randn(32, 32) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))
        return x if self.mix is None else x + 0.5 * self.mix(self, x)


class _Probe(nn.Module):
    def __init__(self, mix: Mix | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)
        self.blocks = nn.ModuleList([_Block(mix), _Block(mix)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# the default run's cross-section (one of each kind of refusal); the rest run under -m slow
DEFAULT = {
    "roll",
    "a pad looking one token ahead",
    "a shift filled with ones",
    "the next token",
    "an FFT convolution",
    "the positions of a running maximum",
    "a sort",
    "the first token",
    "a lower-triangular mixing matrix",
    "unnormalized causal linear attention",
    "the sequence cut in halves",
    "an index of the previous token",
    "a layer norm over the sequence",
    "a vector norm over the sequence",
    "a variance over the sequence (unbiased flag)",
    "a running count of 2·s folded and summed",
}


@pytest.mark.parametrize(
    "name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in MIXES]
)
def test_an_unseen_sequence_mixer_is_refused_when_compiling(name: str) -> None:
    ids = torch.randint(0, 50, (4, S), generator=torch.Generator().manual_seed(0))
    captured = capture(_Probe(MIXES[name]).double(), (ids, ids))
    with pytest.raises(AutopartError) as err:
        parallelize(captured, Mesh(pp=2), schedule="seq1f1b", seq_chunks=2, microbatches=2)
    message = err.value.message
    assert "Seq1F1B cannot chunk node" in message, message
    assert "(blocks.0)" in message or "(<root>)" in message, message
    assert "1f1b" in (err.value.hint or ""), err.value.hint


def test_the_probe_without_a_mixer_chunks_exactly() -> None:
    """The control: the same two blocks, attention only, compile and chunk exactly."""
    ids = torch.randint(0, 50, (2, S), generator=torch.Generator().manual_seed(0))
    _assert_chunks_exactly(_Probe(None), ids)
    captured = capture(_Probe(None).double(), (ids, ids))
    parallelize(captured, Mesh(pp=2), schedule="seq1f1b", seq_chunks=2, microbatches=2)


# reductions over the features only: position-wise, so they chunk (``aten.var.dim`` and
# ``aten.std.dim``, the overloads of an ``unbiased=`` flag, were refused as having no sequence
# rule: the seventeenth session's tp probe)
FEATURE_REDUCTIONS: dict[str, Mix] = {
    "var(-1, unbiased=False)": lambda m, x: x / (x.var(-1, unbiased=False, keepdim=True) + 1),
    "std(-1, unbiased=True)": lambda m, x: x / (torch.std(x, -1, True, keepdim=True) + 1),
    "var_mean(-1, unbiased=True)": lambda m, x: torch.var_mean(x, -1, True, keepdim=True)[0] * x,
    "nansum(-1)": lambda m, x: x * torch.nansum(x, -1, keepdim=True) / 16,
    # linalg_vector_norm's dims come after its order: they were read as the order (a norm
    # over the features refused as one over the sequence; the twenty-fifth session's probe)
    "normalize(-1)": lambda m, x: F.normalize(x, dim=-1),
    "group_norm of (b·s, d)": lambda m, x: F.group_norm(x.reshape(-1, 16), 4).view_as(x),
    "vector_norm(x, 1, -1)": lambda m, x: x / (torch.linalg.vector_norm(x, 1, -1, True) + 1),
}


@pytest.mark.parametrize("name", list(FEATURE_REDUCTIONS))
def test_a_reduction_over_the_features_chunks_exactly(name: str) -> None:
    ids = torch.randint(0, 50, (2, S), generator=torch.Generator().manual_seed(0))
    model = _Probe(FEATURE_REDUCTIONS[name])
    for block in model.blocks:
        del block.w  # (read by none of these: no gradient to compare)
    _assert_chunks_exactly(model, ids)


def _linear_attention(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Causal linear attention written with cumsums (a running sum of φ(k)vᵀ and of φ(k))."""
    phi = F.elu(x) + 1
    kv = torch.cumsum(phi.unsqueeze(-1) * x.unsqueeze(-2), dim=1)
    num = (phi.unsqueeze(-2) @ kv).squeeze(-2)
    return num / (phi * torch.cumsum(phi, dim=1)).sum(-1, keepdim=True)


def _ellipsis_linear_attention(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The same, written with ellipsis einsums as performer-pytorch writes it (an ellipsis was
    "unproven": refused under Seq1F1B, and under dp as mixing the batch's rows)."""
    phi = F.elu(x) + 1
    norm = torch.einsum("...nd,...nd->...n", phi, phi.cumsum(-2))
    context = torch.einsum("...nd,...ne->...nde", phi, x).cumsum(-3)
    return torch.einsum("...nde,...nd,...n->...ne", context, phi, 1 / norm)


RUNNING_SUMS: dict[str, Mix] = {
    "a running mean": lambda m, x: x.cumsum(1) / _steps(x.shape[1]),
    "linear attention with cumsums": _linear_attention,
    "linear attention with ellipsis einsums": _ellipsis_linear_attention,
    # the second cumsum of a pair was refused (the first's scan had no shape yet), and a
    # table's running sum crashed the chunk pass (the twenty-fifth session's probe)
    "a running sum of a running sum": lambda m, x: x.cumsum(1).cumsum(1) / 16,
    "a running sum of a table's rows": lambda m, x: m.w[: x.shape[1], :16].cumsum(0),
    # scans of another associative step, carried since the twenty-sixth session (they were
    # in MIXES, refused as "a cummax / logcumsumexp / cumprod along the sequence")
    "a running maximum": lambda m, x: x.cummax(1).values,
    "a running minimum": lambda m, x: torch.cummin(x, 1)[0],
    "a running log-sum-exp": lambda m, x: x.logcumsumexp(1) / 4,
    "a running product": lambda m, x: torch.sigmoid(x).cumprod(1),
    # a scan of a scan, and of a table's rows: the chunk pass read the value of a node it had
    # just made (KeyError: 'val', the twenty-sixth session's probe)
    "a running product of a running product": lambda m, x: torch.sigmoid(x).cumprod(1).cumprod(1),
    "a running log-sum-exp of a running maximum": lambda m, x: (
        torch.logcumsumexp(x.cummax(1).values, 1) / 8
    ),
    "a running product of a table's rows": lambda m, x: torch.sigmoid(
        m.w[: x.shape[1], :16]
    ).cumprod(0),
    # each token's row k times in place (transformers' batched_mm experts under dp: refused as
    # "a repeat along the batch", the twenty-sixth session's survey), then folded back per token
    "tokens repeated in place and folded back": lambda m, x: (
        x.repeat_interleave(3, dim=1).view(x.shape[0], x.shape[1], 3, 16).softmax(2).sum(2)
    ),
    "rows of (b·s, h) repeated in place and folded back": lambda m, x: torch.tanh(
        x.reshape(-1, 16).repeat_interleave(2, dim=0)
    ).view(*x.shape[:2], 2, 16)[:, :, 1],
}


# token shifts (RWKV's time shift): the output at t is the input at t − p, zeros before
TOKEN_SHIFTS: dict[str, Mix] = {
    "token shift by a pad": lambda m, x: F.pad(x, (0, 0, 1, -1)),
    "RWKV's ZeroPad2d": lambda m, x: nn.ZeroPad2d((0, 0, 1, -1))(x),
    "a shift by 3, mixed in": lambda m, x: x + (F.pad(x, (0, 0, 3, -3)) - x) * m.w[0, :16],
    "a shift of (b, h, s)": lambda m, x: F.pad(x.transpose(1, 2), (2, -2)).transpose(1, 2),
    "a shift of a shift": lambda m, x: F.pad(F.pad(x, (0, 0, 1, -1)), (0, 0, 1, -1)) * 2,
    # written as a cat of zeros and the tokens before (``sequence_chunk.shifts_as_pads``)
    "token shift by a cat": lambda m, x: torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1),
    "a shift by 2 by a cat of new_zeros": lambda m, x: torch.cat(
        [x.new_zeros(x.shape[0], 2, x.shape[2]), x[:, :-2]], dim=1
    ),
    "a shift by a cat of a zero full": lambda m, x: torch.cat(
        [torch.full((x.shape[0], 1, x.shape[2]), 0.0, dtype=x.dtype), x[:, :-1]], dim=1
    ),
}


SHIFTS_DEFAULT = {"RWKV's ZeroPad2d", "a shift of a shift", "token shift by a cat"}


@pytest.mark.parametrize(
    "name",
    [n if n in SHIFTS_DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in TOKEN_SHIFTS],
)
def test_a_token_shift_carries_the_inputs_it_shifts_out(name: str) -> None:
    """A zero pad by p before the sequence and −p after it (RWKV's time shift) was refused as
    "a pad along the sequence"; the chunk pass now hands each chunk the previous chunk's last
    p inputs in place of the zeros (``seq_rules.TokenShift``): exact at cuts of 6 + 10 and of
    1 + 1 + 4 + 10 (chunks shorter than a shift of 2 or 3), and one carry per shift. The pads
    that are no token shift (looking ahead, filled with ones, cut by another amount, along the
    features too) stay refused in ``MIXES``. A shift written as a cat of zeros and the tokens
    before is rewritten as the pad it equals (``sequence_chunk.shifts_as_pads``); a cat of
    ones, or of the last token (a roll), stays refused. Three forms run by default, the rest
    under ``-m slow``."""
    ids = torch.randint(0, 50, (2, S), generator=torch.Generator().manual_seed(0))
    model = _Probe(TOKEN_SHIFTS[name])
    if "mixed" not in name:
        for block in model.blocks:
            del block.w
    gm = _assert_chunks_exactly(model, ids, ((6, 10), (1, 1, 4, 10)))
    carries = [n for n in gm.graph.nodes if n.name.startswith("shift_carry")]
    assert len(carries) == (4 if "a shift of a shift" in name else 2), carries


@pytest.mark.parametrize("name", list(RUNNING_SUMS))
def test_a_running_sum_chunks_exactly(name: str) -> None:
    """A running mean, ``x.cumsum(1) / (1 … s)``, and causal linear attention written with
    cumsums were refused with the other scans; a cumsum along the sequence is a carried
    recurrence now (``sequence_chunk.running_sums``), and a running max, min, log-sum-exp or
    product continues from the previous chunk's last value (``seq_rules.CarriedScan``): the
    probe's two blocks chunk exactly at two cuts (float carries, with their gradients)."""
    ids = torch.randint(0, 50, (2, S), generator=torch.Generator().manual_seed(0))
    model = _Probe(RUNNING_SUMS[name])
    for block in model.blocks:  # the mixing matrix other constructs read: unused here
        if "table" not in name:
            del block.w
    _assert_chunks_exactly(model, ids, ((6, 10), (3, 5, 8)))
