"""Seq1F1B through a state scan over blocks of the sequence, the way Mamba-2's SSD hands its
state from block to block (``seq_rules.StateScan``): the sequence padded to whole blocks of Q
tokens, viewed as ``[b, s/Q, Q, …]``, a quadratic form inside each block and a linear
recurrence across blocks through ``cat([zeros, states])`` and ``exp(segsum(pad(totals)))``.
Cut at whole blocks, with the state after each chunk carried to the next, it chunks exactly
(float64 loss and every gradient); a chunk that forgets the carried state does not; and the
same model with the recurrence broken is refused before any rank runs, naming the node
(negative controls). A block that 8 does not divide raises the plan's chunk multiple."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err, run_model
from test_sequence_chunk import _chunked_exactly, _reference, run_chunks
from torch import nn

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.meta import META_INPUT
from autopart.program.format import Program
from autopart.runtime.runner import Runner
from autopart.schedule.chunks import chunk_lengths

H, HEADS, P, N = 16, 2, 4, 3  # width, heads, head width, state size

SLOW = pytest.mark.slow


def _segsum(x: torch.Tensor, first: int = -1) -> torch.Tensor:
    """[..., T] → [..., T, T]: entry [i, j] = x[j+1] + … + x[i] for j ≤ i, −inf above."""
    t = x.size(-1)
    x = x[..., None].expand(*x.size(), t)
    lower = torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=first)
    x = torch.cumsum(x.masked_fill(~lower, 0), dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), -torch.inf)


class _Scan(nn.Module):
    """Embedding, one SSD-style scan with blocks of ``q`` tokens, a head.

    ``kind``: "ssd" (the state before the first block is zeros, the decays' segment sum over
    [0; totals] below the diagonal); broken: "ones" (the first state is ones: chunks would
    restart from it), "upper" (the segment sum keeps the entries above the diagonal: a block
    sees the states of later blocks), "final" (the state after the last block is added to
    every token: it depends on every chunk), "remainder" (the padding's length is added to the
    output: a chunk's own remainder is not the sequence's)."""

    def __init__(self, kind: str = "ssd", q: int = 4) -> None:
        super().__init__()
        self.kind, self.q = kind, q
        self.emb, self.out = nn.Embedding(50, H), nn.Linear(HEADS * P, 50)
        self.dt = nn.Linear(H, HEADS)
        self.b, self.c = nn.Linear(H, N), nn.Linear(H, N)
        self.v = nn.Linear(H, HEADS * P)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        bsz, s = ids.shape
        h = self.emb(ids)
        a = -F.softplus(self.dt(h))  # [b, s, heads]: each token's log decay
        bb, cc, v = self.b(h), self.c(h), self.v(h).view(bsz, s, HEADS, P)
        pad = (self.q - s % self.q) % self.q

        def blocks(t: torch.Tensor) -> torch.Tensor:  # [b, s, …] → [b, s/q, q, …]
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
            return t.reshape(bsz, -1, self.q, *t.shape[2:])

        a, bb, cc, v = (blocks(t) for t in (a, bb, cc, v))
        a = a.permute(0, 3, 1, 2)  # [b, heads, c, q]
        a_cum = torch.cumsum(a, dim=-1)
        inside = torch.exp(_segsum(a))  # [b, heads, c, q, q]
        scores = torch.einsum("bcln,bcsn->bcls", cc, bb)[..., None] * inside.permute(0, 2, 3, 4, 1)
        y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, v)
        decay = torch.exp(a_cum[:, :, :, -1:] - a_cum)
        states = torch.einsum("bcln,bhcl,bclhp->bchpn", bb, decay, v)
        first = torch.ones_like if self.kind == "ones" else torch.zeros_like
        states = torch.cat([first(states[:, :1]), states], dim=1)
        totals = F.pad(a_cum[:, :, :, -1], (1, 0))
        diagonal = 1 if self.kind == "upper" else -1
        across = torch.exp(_segsum(totals, diagonal)).transpose(1, 3)
        new = torch.einsum("bzch,bzhpn->bchpn", across, states)
        before, after = new[:, :-1], new[:, -1]
        y_off = torch.einsum("bcln,bchpn->bclhp", cc, before)
        y = y_diag + y_off * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
        y = y.reshape(bsz, -1, HEADS * P)
        if pad > 0:
            y = y[:, :s]
        if self.kind == "final":
            y = y + after.sum((-1, -2)).repeat_interleave(P, -1)[:, None]
        if self.kind == "remainder":
            y = y + pad
        return self.out(y)


CUTS = ((8, 8), (4, 4, 8), (12, 4), (4, 4, 4, 4))


def test_a_state_scan_carries_its_state() -> None:
    """Cut at whole blocks (4 tokens), every split gives the whole sequence's loss and
    gradients; the stage gets one carried input per scan, empty for the first chunk, one block
    of state after it; chunks that forget it (each starting from zeros) do not match."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 16))
    captured, gm = _chunked_exactly(_Scan(), ids, CUTS)
    refs = [n.meta[META_INPUT] for n in gm.graph.nodes if n.op == "placeholder"]
    assert [r.kind for r in refs].count("kv") == 1
    ref_loss, ref_grads = _reference(captured, (ids, ids))
    loss, grads = run_chunks(captured, gm, (ids, ids), [8, 8], forget=frozenset({0}))
    worst = max(float((grads[f] - ref_grads[f]).abs().max()) for f in grads)
    assert not torch.allclose(loss, ref_loss, rtol=1e-6) or worst > 1e-3


@pytest.mark.parametrize(
    ("kind", "node", "why"),
    [
        ("ones", "einsum", "the state before the first block is not zeros"),
        pytest.param(  # suite time: each kind captures its own model (8-10 s)
            "upper", "einsum", "masks are not the triangles below the diagonal", marks=SLOW
        ),
        pytest.param("final", "select", "the state after a scan's last block read", marks=SLOW),
        ("remainder", "add", "the sequence length used as a value"),
    ],
)
def test_scans_that_mix_chunks_are_refused(kind: str, node: str, why: str) -> None:
    """Negative controls: a first state that is not zeros, decays from later blocks, the final
    state read, the padding's length used as a value: refused at compile time, naming the node
    and what it does."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 16))
    with pytest.raises(AutopartError) as err:
        parallelize(capture(_Scan(kind).double(), (ids, ids)), Mesh(), schedule="seq1f1b")
    message = err.value.message
    assert f"cannot chunk node {node}" in message and why in message, message


@SLOW  # suite time: two compiles and a save (16-28 s)
def test_a_block_8_does_not_divide_sets_the_chunk_multiple(tmp_path) -> None:
    """Blocks of 16 tokens: the program's plan records ``seq_block=16`` (kept through
    plan.json), so every chunk boundary is a multiple of 16 (the balanced split of 64 tokens
    in 3 would otherwise cut at multiples of 8). The runtime's step matches the model; a
    sequence that is not whole blocks is refused at the step, naming the rank."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 64))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    model = _Scan(q=16).double()
    program = parallelize(capture(model, (ids, labels)), Mesh(), schedule="seq1f1b", seq_chunks=3)
    rp = program.rank(0)
    weights = {f: rp.shards[f].local(t.detach().clone()) for f, t in program.params.items()}
    runner = Runner(rp, program.plan, {**weights, **program.buffers}, {})
    want, _ = run_model(model, (ids, labels))
    assert rel_err(runner.step(ids, labels), want / (labels != -100).sum()) <= 1e-12
    with pytest.raises(AutopartError) as err:
        runner.step(ids[:, :40], labels[:, :40])
    assert "rank 0" in err.value.message and "not a multiple of 16 tokens" in err.value.message
    assert program.plan.seq_block == 16 and program.plan.chunk_multiple == 16
    assert Program.load(program.save(tmp_path / "p")).plan.seq_block == 16
    lengths = chunk_lengths(
        program.ranks[0].chunk_cost, 64, 3, "balanced", program.plan.chunk_multiple
    )
    assert sum(lengths) == 64 and all(n % 16 == 0 for n in lengths), lengths
    assert any(n % 16 for n in chunk_lengths(program.ranks[0].chunk_cost, 64, 3, "balanced", 8))


@pytest.mark.slow  # suite time (13 s: capture also tries to roll the fixed length up)
def test_an_example_shorter_than_two_blocks_is_named() -> None:
    """Blocks of 32 tokens captured at 16: export fixes the scan at one block, and the refusal
    says so (with the length to capture at) instead of naming a node deep inside the scan."""
    ids = torch.randint(0, 50, (2, 16))
    with pytest.raises(AutopartError) as err:
        parallelize(capture(_Scan(q=32).double(), (ids, ids)), Mesh(), schedule="seq1f1b")
    assert "blocks of 32 tokens and the example sequence has 16" in err.value.message
    assert "at least 64 tokens" in err.value.hint


class _Blocks(nn.Module):
    """Tokens mixed inside blocks of 16 only (a running sum within each block, ``[b, s/16, 16,
    H]`` and back), no scan: chunks must still be whole blocks. Broken: "across" (a running sum
    along the blocks: a scan no rule carries from chunk to chunk), "front" (the padding to
    whole blocks put before the tokens), "summed" (an einsum summing over the sequence)."""

    def __init__(self, kind: str = "inside") -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.out = nn.Embedding(50, H), nn.Linear(H, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids)
        if self.kind == "front":
            x = F.pad(x, (0, 0, (16 - s % 16) % 16, 0))
        x = x.view(b, -1, 16, H).cumsum(1 if self.kind == "across" else 2)
        x = x.reshape(b, -1, H)[:, -s:] if self.kind == "front" else x.view(b, s, H)
        if self.kind == "summed":
            x = x + torch.einsum("bsh->bh", x)[:, None]
        return self.out(x)


def test_tokens_mixed_inside_blocks_make_chunks_whole_blocks() -> None:
    """A view into blocks of 16 raises the chunk multiple to 16 by itself (8 would cut a block
    in two), and whole-block chunks are exact."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 64))
    program = parallelize(capture(_Blocks().double(), (ids, ids)), Mesh(), schedule="seq1f1b")
    assert program.plan.seq_block == 16
    _chunked_exactly(_Blocks(), ids, ((16, 48), (32, 16, 16)))


@pytest.mark.parametrize(
    ("kind", "node", "why"),
    [
        ("across", "cumsum", "a cumsum along the sequence"),
        ("front", "pad", "the sequence length used as a value"),
        ("summed", "einsum", "a product summing over the sequence"),
    ],
)
def test_blocks_that_mix_chunks_are_refused(kind: str, node: str, why: str) -> None:
    """Negative controls for blocks: a running sum across the blocks, the padding to whole
    blocks before the tokens, an einsum summing over the sequence: refused, naming the node."""
    ids = torch.randint(0, 50, (2, 64))
    with pytest.raises(AutopartError) as err:
        parallelize(capture(_Blocks(kind).double(), (ids, ids)), Mesh(), schedule="seq1f1b")
    message = err.value.message
    assert f"cannot chunk node {node}" in message and why in message, message
