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

Found by the twenty-sixth session (running scans Seq1F1B refused, carries rounded to bf16):

- ``mingru``: minGRU in log space (Heinsen's scan: ``a* + logcumsumexp(log v − a*)`` with
  ``a* = cumsum(log a)``) and ``products``: a running product of gates, a running maximum and
  minimum. Seq1F1B refused them ("a logcumsumexp along the sequence"); each chunk now scans
  [carry; chunk] from the value at the previous chunk's last token. Under tp the scans had no
  sharding rule, so their projections stayed replicated; they split now.
- ``count``: positions read from a running count of the tokens (an integer cumsum) in a bf16
  model: the count was handed to the next chunk rounded to bf16 (754 → 752: loss 1.1e-2 off);
  every carry now travels in its own dtype.
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
from autopart.graph import kv_dtypes
from autopart.meta import META_INPUT
from autopart.models import zoo
from autopart.parity.verify import Check, Report, verify_many
from autopart.planning.memory import unit_bytes

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


class MinGRU(nn.Module):
    """minGRU in log space: h_t = (1 − z_t) h_{t−1} + z_t h̃_t as a log-sum-exp scan."""

    def __init__(self) -> None:
        super().__init__()
        self.zh, self.o = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        k, hidden = self.zh(h).chunk(2, dim=-1)
        log_coeffs, log_z = -F.softplus(k), -F.softplus(-k)
        log_tilde = torch.where(hidden >= 0, torch.log(F.relu(hidden) + 0.5), -F.softplus(-hidden))
        a_star = log_coeffs.cumsum(1)
        log_h = a_star + torch.logcumsumexp(log_z + log_tilde - a_star, dim=1)
        return self.o(log_h.exp())


class Products(nn.Module):
    """A running product of gates, a running maximum and a running minimum (``positions``:
    the maximum's positions read too, which no chunk can know)."""

    def __init__(self, positions: bool = False) -> None:
        super().__init__()
        self.g, self.o = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.positions = positions

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a, b = self.g(h).chunk(2, dim=-1)
        peak = torch.cummax(b, dim=1)
        spread = peak.values - b.cummin(1)[0]
        if self.positions:
            spread = spread + peak.indices.to(h.dtype) / 10
        return self.o(torch.cat([torch.sigmoid(a).cumprod(1), spread], -1))


class Count(nn.Module):
    """Positions from a running count of the tokens: ``table[cumsum(41 · (ids % 7)) % 64]``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(64, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table((41 * (ids % 7)).cumsum(1) % 64)


MIXERS = {
    "running": Running,
    "fft": FFTConv,
    "mingru": MinGRU,
    "products": Products,
    "positions": lambda: Products(positions=True),
}


class Toy(nn.Module):
    def __init__(self, mixer: str) -> None:
        super().__init__()
        second = MIXERS[mixer]()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(NormedAttention()), Block(second)])
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Counted(Toy):
    """``Toy("running")`` whose embedding adds ``Count``'s positions."""

    def __init__(self) -> None:
        super().__init__("running")
        self.count = Count()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.count(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make(mixer: str):
    torch.manual_seed(0)
    return Toy(mixer), zoo.batch(VOCAB, 4, 32)


def make_running():
    return make("running")


def make_fft():
    return make("fft")


SEQ = {"pp": 2, "schedule": "seq1f1b", "microbatches": 2, "seq_chunks": 2}
CASES = {
    "running tp=2×pp=2 Seq1F1B k=2 SP": Check(make_running, tp=2, sequence_parallel=True, **SEQ),
    "running pp=2 Seq1F1B k=4": Check(make_running, **{**SEQ, "seq_chunks": 4}),
    "fft tp=2 SP": Check(make_fft, tp=2, sequence_parallel=True),
}


def make_mingru():
    return make("mingru")


def make_products():
    return make("products")


def make_counted():
    torch.manual_seed(0)
    return Counted(), zoo.batch(VOCAB, 4, 32)


SCANS = {
    "mingru tp=2×pp=2 Seq1F1B k=2 SP": Check(make_mingru, tp=2, sequence_parallel=True, **SEQ),
    "products pp=2 Seq1F1B k=4": Check(make_products, **{**SEQ, "seq_chunks": 4}),
}
SCANS_SLOW = {
    "mingru pp=2 Seq1F1B k=4 uniform": Check(
        make_mingru, **{**SEQ, "seq_chunks": 4, "seq_split": "uniform"}
    ),
    "products tp=2 SP": Check(make_products, tp=2, sequence_parallel=True),
    "products dp=2": Check(make_products, dp=2, microbatches=2),
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


def test_running_scans_are_carried_across_chunks() -> None:
    """logcumsumexp, cumprod, cummax and cummin along the sequence under Seq1F1B (and tp with
    SP), loss and every gradient as on one device to 1e-9."""
    assert_all_pass(batch(SCANS))


@pytest.mark.slow
def test_running_scans_under_more_plans() -> None:
    assert_all_pass(batch(SCANS_SLOW))


def test_the_positions_of_a_running_maximum_are_refused_by_name() -> None:
    """The negative control: a cummax's values chunk, its positions count from the scan's
    first token, so Seq1F1B refuses the model that reads them, naming the cummax."""
    model, data = make("positions")
    captured = capture(model.double(), data)
    with pytest.raises(AutopartError) as err:
        parallelize(captured, Mesh(pp=2), schedule="seq1f1b", seq_chunks=2, microbatches=2)
    assert "Seq1F1B cannot chunk node cummax (blocks.1.mixer): the positions" in err.value.message


def test_a_carry_travels_in_its_own_dtype() -> None:
    """bf16 compute: the running count's carry is an int64 (it was cast to bf16: 754 → 752,
    the loss 1.1e-2 off), the running sums' float carries bf16 as computed; and the loss
    and gradients match one device's bf16 run within its own tolerance."""
    model, data = make_counted()
    program = parallelize(
        model,
        Mesh(pp=2),
        example_inputs=data,
        precision="bf16",
        schedule="seq1f1b",
        microbatches=2,
        seq_chunks=2,
    )
    kinds = {
        n.name: n.meta["val"].dtype
        for st in program.ranks[0].stages
        for n in st.graph.graph.nodes
        if n.op == "placeholder" and n.meta[META_INPUT].kind == "kv"
    }
    assert kinds["recurrence_state_0"] == torch.int64, kinds
    assert kv_dtypes(program.ranks[0].stages[0].graph) == list(kinds.values())
    # the memory probe gave every prefix a gradient: an integer's is refused (a traceback)
    assert all(held > 0 for held, _ in unit_bytes(program, 2, 32).values())
    (report,) = verify_many(
        [Check(make_counted, **{**SEQ, "seq_split": "uniform"})],
        dtype="bfloat16",
        timeout_s=120,
        via="fork",
    ).values()
    assert isinstance(report, Report) and report.ok, str(report)
    assert report.loss_error < 1e-4, str(report)


class Float32Keys(nn.Module):
    """Attention computed in float32 inside a float64 model (GPT-J's keys and queries)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = (
            t.view(b, s, HEADS, WIDTH // HEADS).transpose(1, 2)
            for t in self.qkv(h).float().split(WIDTH, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).to(h.dtype)
        return self.proj(y.transpose(1, 2).reshape(b, s, WIDTH))


def test_float32_keys_in_a_float64_model_compile_for_seq1f1b() -> None:
    """The compile-time dry run made every K/V prefix in the model's dtype while the program's
    keys are float32: GPT-J's three Seq1F1B cells were refused ("Expected query, key, and value
    to have the same dtype"). The prefixes are float32 now, as the runtime feeds them."""
    MIXERS["f32-keys"] = Float32Keys
    try:
        model, data = make("f32-keys")
    finally:
        del MIXERS["f32-keys"]
    program = parallelize(
        capture(model.double(), data), Mesh(pp=2), schedule="seq1f1b", seq_chunks=2, microbatches=2
    )
    dtypes = [d for rp in program.ranks for st in rp.stages for d in kv_dtypes(st.graph)]
    assert torch.float32 in dtypes and torch.float64 in dtypes, dtypes
