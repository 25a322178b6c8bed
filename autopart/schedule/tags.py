"""Pipeline message tags: how a point-to-point message between neighbouring stages is numbered
(``runtime/p2p.py``), sized by the plan so that every rank packs alike from the plan alone, and
checked when the plan is made and when the program is compiled, never first at a step."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from autopart.errors import AutopartError

TAG_BITS = 31  # c10d's message tags are C ints: 31 bits of a nonnegative one


def _width(count: int) -> int:
    """Bits that number ``count`` values (0 … count − 1)."""
    return max(count - 1, 0).bit_length()


@dataclass(frozen=True)
class Tags:
    """How a message's tag packs (sending stage, micro-batch, sequence chunk, direction,
    tensor index, header/payload), each field as wide as the plan needs and the tensor index
    taking the bits left of ``TAG_BITS``, so that every rank packs alike from the plan alone.
    (Fixed fields allowed fewer than 64 stages and 16 chunks: an interleaved pp=32 × v=4
    plan compiled, then failed at its first step.)"""

    stages: int
    microbatches: int
    chunks: int

    @cached_property
    def widths(self) -> tuple[int, int, int, int, int, int]:
        """Bits of (stage, micro-batch, chunk, direction, tensor index, header/payload): found
        once, read by every ``tag`` (one per tensor sent or received)."""
        fixed = (_width(self.stages), _width(self.microbatches), _width(self.chunks), 1)
        return (*fixed, TAG_BITS - sum(fixed) - 1, 1)

    @property
    def index_bits(self) -> int:
        return self.widths[4]

    def check(self, tensors: int) -> None:
        """Refuse a program whose hand-overs of ``tensors`` tensors do not fit the tags."""
        if self.index_bits < 0 or tensors > 1 << self.index_bits:
            raise AutopartError(
                f"pipeline message tags ({TAG_BITS} bits) cannot number {self.stages} stages, "
                f"{self.microbatches} micro-batches, {self.chunks} sequence chunks and "
                f"{tensors} tensors per hand-over",
                hint="use fewer micro-batches, sequence chunks or (virtual) stages",
            )

    def tag(self, stage: int, mb: int, chunk: int, backward: bool, index: int, part: int) -> int:
        if not (stage < self.stages and mb < self.microbatches and chunk < self.chunks) or (
            index >= 1 << self.index_bits
        ):
            raise AutopartError(
                f"a pipeline message (stage {stage}, micro-batch {mb}, chunk {chunk}, tensor "
                f"{index}) is outside the plan's tags ({self.stages} stages, "
                f"{self.microbatches} micro-batches, {self.chunks} chunks, "
                f"{1 << self.index_bits} tensors)",
                hint="this is a bug in autopart; please report it with the plan",
            )
        out = 0
        for value, bits in zip(
            (stage, mb, chunk, int(backward), index, part), self.widths, strict=True
        ):
            out = (out << bits) | value
        return out

    @classmethod
    def of(cls, pp: int, virtual_stages: int, microbatches: int, seq_chunks: int) -> Tags:
        """The tags of a plan's pipeline (``pp × virtual_stages`` stages), refused when they
        cannot number one tensor per hand-over."""
        tags = cls(pp * virtual_stages, microbatches, max(seq_chunks, 1))
        tags.check(1)
        return tags
