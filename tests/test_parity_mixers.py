"""Whole sequence mixers written the way papers' reference code writes them, found by the
twenty-fifth session's probe of linear-attention families: float64 parity on real ranks
against one device, and the one Seq1F1B cannot chunk refused at compile time by name.

- ``running``: an exponential moving average written as ``γ^t · cumsum(γ^−t · x)`` (MEGA's
  EMA, GLA in log space), a running sum of a running sum, and a running sum of a parameter
  table's rows (no batch dim). Under tp = 2 with sequence parallelism and Seq1F1B the cumsum
  reads halves joined from the tp ranks, whose length reads ``2*(s//2)``: it was refused as
  "a cumsum along the sequence" (each half alone passed); the second cumsum of a pair was
  refused the same way (the first one's scan had no shape yet), and the table's crashed the
  chunk pass (``KeyError: 'val'``).
- attention with q and k normalized by ``F.normalize(dim=-1)`` (DeltaNet's, QK-norm):
  ``linalg_vector_norm``'s dims were read from its order argument, so the norm over the head
  dim was refused under Seq1F1B as "a reduction over the sequence" (and under dp on a
  flattened batch·sequence as one over the batch).
- ``fft``: a causal FFT convolution padded to ``2·s`` (Hyena, H3, S4): tp refused it with
  "shapes do not fit at node %fft_rfft … please report" (torch's fake FFT wants a concrete
  length); it trains under tp and SP now, and Seq1F1B refuses it by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity_cases import assert_all_pass, batch
from test_parity_conv import VOCAB, WIDTH, Block
from torch import nn

from autopart import AutopartError, Mesh, parallelize
from autopart.frontend.capture import capture
from autopart.models import zoo
from autopart.parity.verify import Check

pytestmark = pytest.mark.multirank
HEADS = 4


class NormedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=2.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, WIDTH))


class Running(nn.Module):
    """An EMA by cumsum, a running sum of a running sum, and a table's running sum."""

    def __init__(self) -> None:
        super().__init__()
        self.v, self.o = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.decay = nn.Parameter(torch.rand(WIDTH))
        self.table = nn.Parameter(torch.randn(64, WIDTH) * 0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s = h.shape[1]
        pos = torch.arange(s, device=h.device, dtype=h.dtype)[None, :, None]
        gamma = 0.8 + 0.2 * torch.sigmoid(self.decay)
        v = self.v(h)
        ema = gamma**pos * (gamma ** (-pos) * v).cumsum(1)
        twice = v.cumsum(1).cumsum(1) / 100
        return self.o(ema + twice + self.table[:s].cumsum(0))


class FFTConv(nn.Module):
    """A long convolution by FFT, causal by padding to 2·s (Hyena's, H3's, S4's)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(WIDTH, 64) * 0.1)
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s = h.shape[1]
        u, k = h.transpose(1, 2), self.kernel[:, :s]
        y = torch.fft.irfft(torch.fft.rfft(u, n=2 * s) * torch.fft.rfft(k, n=2 * s), n=2 * s)
        return self.o(y[..., :s].transpose(1, 2))


class Toy(nn.Module):
    def __init__(self, mixer: str) -> None:
        super().__init__()
        second = Running() if mixer == "running" else FFTConv()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(NormedAttention()), Block(second)])
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_running():
    torch.manual_seed(0)
    return Toy("running"), zoo.batch(VOCAB, 4, 32)


def make_fft():
    torch.manual_seed(0)
    return Toy("fft"), zoo.batch(VOCAB, 4, 32)


SEQ = {"pp": 2, "schedule": "seq1f1b", "microbatches": 2, "seq_chunks": 2}
CASES = {
    "running tp=2×pp=2 Seq1F1B k=2 SP": Check(make_running, tp=2, sequence_parallel=True, **SEQ),
    "running pp=2 Seq1F1B k=4": Check(make_running, **{**SEQ, "seq_chunks": 4}),
    "fft tp=2 SP": Check(make_fft, tp=2, sequence_parallel=True),
}


def test_whole_mixers_match_one_device() -> None:
    """Loss and every gradient as on one device, to 1e-9."""
    assert_all_pass(batch(CASES))


def test_an_fft_convolution_is_refused_by_seq1f1b_by_name() -> None:
    """The negative control: the FFT convolution reads the whole sequence (its length is the
    FFT's size), so Seq1F1B refuses it at compile time, naming the FFT."""
    model, data = make_fft()
    captured = capture(model.double(), data)
    with pytest.raises(AutopartError) as err:
        parallelize(captured, Mesh(pp=2), schedule="seq1f1b", seq_chunks=2, microbatches=2)
    assert "Seq1F1B cannot chunk node fft_rfft (blocks.1.mixer)" in err.value.message
