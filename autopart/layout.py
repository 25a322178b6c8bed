"""Mesh and Plan: the parallel layout, validated once, up front.

A ``Mesh`` is the offline spec ``(dp, pp, tp)``. Ranks are laid out with tp fastest, then dp,
then pp (Megatron's order): ``rank = pp_i·(dp·tp) + dp_i·tp + tp_i``, so a tp group is a run
of neighbouring ranks (one node's fast links) and the pp stages are furthest apart.
A ``Plan`` adds what the compiler needs: the schedule, micro-batches, virtual stages,
sequence chunks. Both are plain, JSON-able data.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass
from typing import Any

from autopart.errors import AutopartError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "seq1f1b", "seq1f1b-interleaved")
DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Mesh:
    """Offline device mesh: data-, pipeline- and tensor-parallel sizes."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutopartError(
                    f"mesh dimension {name}={value!r} must be a positive integer",
                    hint=f"e.g. autopart.Mesh(dp=2, pp=1, tp=1); use {name}=1 to not split on {name}",
                )

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "tp": k}`` of a global rank."""
        if not 0 <= rank < self.size:
            raise AutopartError(f"rank {rank} is outside this mesh of {self.size} ranks ({self})")
        return {
            "pp": rank // (self.dp * self.tp),
            "dp": rank // self.tp % self.dp,
            "tp": rank % self.tp,
        }

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return pp * self.dp * self.tp + dp * self.tp + tp

    def group(self, dim: str, rank: int) -> list[int]:
        """The ranks sharing every coordinate of ``rank`` except ``dim``, in ``dim`` order."""
        c = self.coords(rank)
        return [self.rank_of(**{**c, dim: i}) for i in range(getattr(self, dim))]

    def groups(self, dim: str) -> list[list[int]]:
        """Every ``dim`` group of the mesh, each once."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.size):
            seen.setdefault(tuple(self.group(dim, r)), None)
        return [list(g) for g in seen]

    def check_world(self, world_size: int) -> None:
        if world_size != self.size:
            raise AutopartError(
                f"mesh dp({self.dp}) * pp({self.pp}) * tp({self.tp}) = {self.size} "
                f"!= WORLD_SIZE ({world_size})",
                hint=f"launch {self.size} ranks (torchrun --nproc-per-node {self.size}) "
                "or change the mesh to multiply to the world size",
            )

    def __str__(self) -> str:
        return f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp})"


def mesh_from(mesh: Any) -> tuple[Mesh, Any]:
    """An offline ``Mesh`` from a ``Mesh`` or a live torch ``DeviceMesh`` (returned too)."""
    if isinstance(mesh, Mesh):
        return mesh, None
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None:
        raise AutopartError(
            f"expected an autopart.Mesh or a torch DeviceMesh, got {type(mesh).__name__}",
            hint='autopart.Mesh(dp=2) offline, or init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))',
        )
    unknown = set(names) - set(DIMS)
    if unknown:
        raise AutopartError(
            f"DeviceMesh dim names {names} include {sorted(unknown)}",
            hint=f"name every dim one of {DIMS}",
        )
    sizes = dict(zip(names, mesh.mesh.shape, strict=False))
    offline = Mesh(**{d: int(sizes.get(d, 1)) for d in DIMS})
    order = [d for d in ("pp", "dp", "tp") if d in names]
    if list(names) != order:
        raise AutopartError(
            f"DeviceMesh dims {tuple(names)} are not in autopart's rank order {tuple(order)}",
            hint="autopart lays out ranks pp-major, then dp, then tp (fastest)",
        )
    return offline, mesh


@dataclass(frozen=True)
class Plan:
    """Everything the compiler decides besides the model: validated on construction."""

    mesh: Mesh
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    seq_chunks: int = 1
    sequence_parallel: bool = False
    bucket_mb: float = 25.0  # data-parallel gradient bucket size, MiB
    max_stage_memory_gb: float | None = (
        None  # pipeline: parameters + states + activations per stage
    )
    seq_split: str = "balanced"  # Seq1F1B chunk boundaries: "balanced" or "uniform"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            close = difflib.get_close_matches(self.schedule, SCHEDULES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise AutopartError(
                f"unknown schedule {self.schedule!r}",
                hint=f"{hint}choose one of: {', '.join(SCHEDULES)}",
            )
        for name in ("microbatches", "virtual_stages", "seq_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutopartError(f"{name}={value!r} must be a positive integer")
        if self.bucket_mb <= 0:
            raise AutopartError(f"bucket_mb={self.bucket_mb} must be positive")
        if self.sequence_parallel and self.mesh.tp == 1:
            raise AutopartError(
                "sequence_parallel=True needs tensor parallelism (tp > 1)",
                hint="sequence parallelism splits the activations tp leaves replicated; set tp ≥ 2",
            )
        self._check_chunks()

    def _check_chunks(self) -> None:
        from autopart.schedule.chunks import SPLITS

        if self.seq_split not in SPLITS:
            raise AutopartError(
                f"unknown seq_split {self.seq_split!r}", hint=f"use one of {', '.join(SPLITS)}"
            )
        if self.seq_chunks > 1 and not self.schedule.startswith("seq1f1b"):
            raise AutopartError(
                f"seq_chunks={self.seq_chunks} needs a Seq1F1B schedule, not {self.schedule}",
                hint="use schedule='seq1f1b' (or 'seq1f1b-interleaved' with virtual stages)",
            )

    @property
    def chunk_multiple(self) -> int:
        """Chunk boundaries are multiples of this: 8, and of tp under sequence parallelism."""
        return math.lcm(8, self.mesh.tp) if self.sequence_parallel else 8

    def check_batch(self, batch_size: int) -> int:
        """Micro-batch size for a global batch; refuses a batch that does not split evenly."""
        parts = self.mesh.dp * self.microbatches
        if batch_size % parts:
            raise AutopartError(
                f"batch size {batch_size} is not divisible by dp({self.mesh.dp}) * "
                f"microbatches({self.microbatches}) = {parts}",
                hint=f"use a batch that is a multiple of {parts}, or change dp / microbatches",
            )
        return batch_size // parts

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        return cls(**{**data, "mesh": Mesh(**data["mesh"])})
