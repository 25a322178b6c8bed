"""Mesh and Plan: the parallel layout, one type for the compiler, the simulator and the planner,
validated once, on construction, with the arithmetic in its messages.

A ``Mesh`` is the offline spec ``(dp, pp, tp)``. Ranks are laid out with tp fastest, then dp,
then pp (Megatron's order): ``rank = pp_i·(dp·tp) + dp_i·tp + tp_i``, so a tp group is a run
of neighbouring ranks (one node's fast links) and the pp stages are furthest apart.
A ``Plan`` adds how one step runs: the schedule, micro-batches (and their size), virtual
stages, sequence chunks and the memory savers. Both are plain, JSON-able data.

The compiler runs every plan the planner can propose: ``recompute`` is the recompute pass
(``passes/recompute.py``, checkpointed by the runtime); ``distributed_optimizer`` is ZeRO-1,
which the runtime applies (``autopart run --zero``).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from autopart.errors import AutopartError
from autopart.schedule.chunks import SPLITS, fewer_chunks
from autopart.schedule.generators import GENERATORS, check_schedule, traits
from autopart.schedule.tags import Tags

SCHEDULES = tuple(GENERATORS)
DIMS = ("dp", "pp", "tp")
RECOMPUTE = ("none", "selective", "full")
ATTENTIONS = ("sdpa", "flex")  # how a rank runs masked and score-function attention
PRECISIONS = (None, "bf16")  # None: compute in the model's own dtype


@dataclass(frozen=True)
class Coords:
    """A rank's place in the mesh: its pipeline, data- and tensor-parallel index."""

    pp: int
    dp: int
    tp: int

    def along(self, dim: str) -> int:
        """The index along ``dim`` ("dp", "pp" or "tp")."""
        if dim not in DIMS:
            raise KeyError(dim)
        return int(getattr(self, dim))

    def as_dict(self) -> dict[str, int]:
        """``{"pp": i, "dp": j, "tp": k}``, as program.json stores them."""
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}


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

    def coords(self, rank: int) -> Coords:
        """The coordinates (pp, dp, tp) of a global rank."""
        if not 0 <= rank < self.size:
            raise AutopartError(f"rank {rank} is outside this mesh of {self.size} ranks ({self})")
        return Coords(
            pp=rank // (self.dp * self.tp),
            dp=rank // self.tp % self.dp,
            tp=rank % self.tp,
        )

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return pp * self.dp * self.tp + dp * self.tp + tp

    def group(self, dim: str, rank: int) -> list[int]:
        """The ranks sharing every coordinate of ``rank`` except ``dim``, in ``dim`` order."""
        c = self.coords(rank).as_dict()
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


def _check_spans_world(mesh: Any) -> None:
    """A live mesh must hold every rank of the job: a sub-mesh (torchtitan's
    ``world_mesh["tp"]``) would leave the ranks outside it as separate jobs, whose other dims
    nothing reduces over (each rank checks its own mesh: all refuse alike, before any
    collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world, size = dist.get_world_size(), int(mesh.mesh.numel())
    if size != world:
        names = tuple(mesh.mesh_dim_names)
        raise AutopartError(
            f"the DeviceMesh {dict(zip(names, mesh.mesh.shape, strict=False))} holds {size} of "
            f"the job's {world} ranks (a sub-mesh, such as world_mesh[{names[0]!r}]?): "
            "autopart parallelizes over every rank, and the ranks outside it would train "
            "separate models",
            hint="pass the whole mesh, every dim named one of dp/pp/tp: "
            'init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) for 4 ranks',
        )


def mesh_from(mesh: Any) -> tuple[Mesh, Any]:
    """An offline ``Mesh`` from a ``Mesh`` or a live torch ``DeviceMesh`` (returned too)."""
    if isinstance(mesh, Mesh):
        return mesh, None
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None and hasattr(mesh, "mesh_dim_names"):
        raise AutopartError(
            "the DeviceMesh has no dim names: autopart reads each dim's role (dp, pp, tp) "
            "from its name",
            hint='init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)): name every dim one '
            f"of {DIMS}",
        )
    if names is None:
        raise AutopartError(
            f"expected an autopart.Mesh or a torch DeviceMesh, got {type(mesh).__name__}",
            hint='autopart.Mesh(dp=2) offline, or init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))',
        )
    _check_spans_world(mesh)
    sizes = dict(zip(names, mesh.mesh.shape, strict=False))
    # a dim of one rank is no parallelism, whatever its name (torchtitan's "cp" of size 1)
    unknown = sorted({n for n in names if n not in DIMS and sizes[n] > 1})
    if unknown:
        torchtitan = {"dp_shard", "dp_replicate"} & set(unknown)
        raise AutopartError(
            f"DeviceMesh dim names {names} include {unknown}",
            hint=f"name every dim of more than one rank one of {DIMS}"
            + (
                "; torchtitan's data-parallel dims flatten into one: "
                "world_mesh['dp_replicate', 'dp_shard']._flatten('dp'), then pass the mesh "
                "whose dims are named dp/tp/pp"
                if torchtitan
                else ""
            ),
        )
    offline = Mesh(**{d: int(sizes.get(d, 1)) for d in DIMS})
    order = [d for d in ("pp", "dp", "tp") if d in names]
    if [n for n in names if n in DIMS] != order:
        raise AutopartError(
            f"DeviceMesh dims {tuple(names)} are not in autopart's rank order {tuple(order)}",
            hint="autopart lays out ranks pp-major, then dp, then tp (fastest)",
        )
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if ranks != list(range(len(ranks))):  # the groups are the mesh's; the layout autopart's
        raise AutopartError(
            f"the DeviceMesh lays out ranks {ranks}, not 0 … {len(ranks) - 1} in order: its "
            "groups would not be the ones autopart assigns each rank's slices and stages by",
            hint='init_device_mesh("cpu", sizes, mesh_dim_names=...) over the whole world '
            "lays them out in order",
        )
    return offline, mesh


def _flag(
    default: Any,
    help: str,
    choices: Callable[[], Sequence[str]] | None = None,
    strict: bool = True,
) -> Any:
    """A ``Plan`` field that is also a command-line flag (``cli/common.plan_flags`` makes
    ``--field-name`` from it: its type, default, help and choices; ``strict=False``: the
    choices are listed but ``Plan`` refuses a wrong one, with its suggestion)."""
    meta = {"help": help, "choices": choices, "strict": strict}
    return field(default=default, metadata={"cli": meta})


BUILTIN_OPS = ("aten", "autopart")  # op namespaces every program may call
LIBRARY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")  # a library namespace: an import name


def check_library_names(names: Iterable[str]) -> tuple[str, ...]:
    """The library namespaces a user trusts (``Plan.library_ops``), sorted; ``AutopartError``
    for one that is not a plain import name or is ATen or autopart's own."""
    if isinstance(names, str):
        names = [names]
    out = set()
    for name in names:
        if not isinstance(name, str) or not LIBRARY_NAME.fullmatch(name) or name in BUILTIN_OPS:
            raise AutopartError(
                f"library_ops: {name!r} is not a library namespace",
                hint="name the namespace of the ops (torch.ops.<namespace>.<op>), which is the "
                "import name of the library's package, e.g. library_ops=('mylib',)",
            )
        out.add(name)
    return tuple(sorted(out))


@dataclass(frozen=True)
class Plan:
    """Everything that decides how a step runs besides the model: validated on construction."""

    mesh: Mesh
    schedule: str = _flag("1f1b", "the pipeline schedule", choices=lambda: SCHEDULES, strict=False)
    microbatches: int = _flag(1, "micro-batches per data-parallel rank")
    virtual_stages: int = _flag(1, "virtual stages per rank (interleaving)")
    seq_chunks: int = _flag(1, "Seq1F1B sequence chunks per micro-batch")
    sequence_parallel: bool = _flag(
        False, "split activations between tp regions along the sequence"
    )
    bucket_mb: float = 25.0  # data-parallel gradient bucket size, MiB
    max_stage_memory_gb: float | None = _flag(  # pipeline: parameters + states + activations
        None,
        "pipeline cuts keep each stage's weights, gradients, Adam states and in-flight "
        "activations under this many GiB",
    )
    seq_split: str = _flag(  # Seq1F1B chunk boundaries: "balanced" or "uniform"
        "balanced",
        "Seq1F1B chunk boundaries: equal work (balanced), equal length (uniform) or the "
        "measured chunk times (measured)",
        choices=lambda: SPLITS,
    )
    recompute: str = _flag(  # activation recomputation: "none", "selective" or "full"
        "none",
        "activation recomputation: selective (attention cores) or full (every transformer "
        "block keeps only its input)",
        choices=lambda: RECOMPUTE,
    )
    attention: str = _flag(  # how each rank runs attention (runtime/flex.py)
        "sdpa",
        "how ranks run attention with a mask or a score function: sdpa (the captured ATen "
        "ops) or flex (FlexAttention, lowered by each rank; its fused kernels need CUDA and "
        "--compile)",
        choices=lambda: ATTENTIONS,
    )
    distributed_optimizer: bool = False  # optimizer state sharded over dp (ZeRO-1)
    micro_batch: int | None = None  # sequences per micro-batch (None: what the batch gives)
    # every sequence, and under Seq1F1B every chunk, is a multiple of this many tokens: the
    # block a model's scan hands its state on by (Mamba-2's SSD, Seq1F1B only), or the pieces a
    # model cuts the sequence into (frontend/shapes.sequence_multiple); compile sets it
    seq_block: int = 1
    # the longest sequence the program's graphs fit (None: any); compile sets it from the
    # captured graph (frontend/shapes.longest_sequence) and a step with a longer one is refused
    max_seq: int | None = None
    # the shortest (None: any): a graph whose length export fixed fits that length only
    # (frontend/shapes.shortest_sequence), and a step with a shorter one is refused
    min_seq: int | None = None
    precision: str | None = None  # "bf16": bf16 compute, fp32 master weights and gradients
    # library op namespaces the user trusts: their ops (torch.ops.<ns>.*) that capture cannot
    # decompose to ATen stay in the program, which records the library's version
    # (program/libraries.py); a loader imports them only when its user names them too
    library_ops: tuple[str, ...] = _flag(
        (),
        "a library whose custom ops (torch.ops.NAME.*, no ATen decomposition) you trust the "
        "program to call; its version is recorded, and loading the program needs it named "
        "again (repeat for several)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "library_ops", check_library_names(self.library_ops))
        if self.schedule not in SCHEDULES:
            close = [self.schedule.lower()] if self.schedule.lower() in SCHEDULES else []
            close = close or difflib.get_close_matches(self.schedule, SCHEDULES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise AutopartError(
                f"unknown schedule {self.schedule!r}",
                hint=f"{hint}choose one of: {', '.join(SCHEDULES)}",
            )
        for name in (
            "microbatches",
            "virtual_stages",
            "seq_chunks",
            "micro_batch",
            "seq_block",
            "max_seq",
            "min_seq",
        ):
            value = getattr(self, name)
            if name in ("micro_batch", "max_seq", "min_seq") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutopartError(f"{name}={value!r} must be a positive integer")
        if self.min_seq is not None and self.max_seq is not None and self.min_seq > self.max_seq:
            raise AutopartError(
                f"min_seq={self.min_seq} is more than max_seq={self.max_seq}: no sequence fits"
            )
        if not self.bucket_mb > 0 or not math.isfinite(self.bucket_mb):
            raise AutopartError(f"bucket_mb={self.bucket_mb} must be a positive number")
        gb = self.max_stage_memory_gb
        if gb is not None and (not gb > 0 or not math.isfinite(gb)):
            raise AutopartError(
                f"max_stage_memory_gb={gb} must be a positive number of GiB",
                hint="leave it unset for no memory limit",
            )
        if self.sequence_parallel and self.mesh.tp == 1:
            raise AutopartError(
                "sequence_parallel=True needs tensor parallelism (tp > 1)",
                hint="sequence parallelism splits the activations tp leaves replicated; set tp ≥ 2",
            )
        if self.precision not in PRECISIONS:
            raise AutopartError(
                f"unknown precision {self.precision!r}",
                hint='use "bf16" (bf16 compute, fp32 masters) or leave it unset (the model\'s dtype)',
            )
        if self.recompute not in RECOMPUTE:
            raise AutopartError(
                f"unknown recompute {self.recompute!r}", hint=f"use one of {', '.join(RECOMPUTE)}"
            )
        if self.attention not in ATTENTIONS:
            raise AutopartError(
                f"unknown attention {self.attention!r}", hint=f"use one of {', '.join(ATTENTIONS)}"
            )
        if self.seq_split not in SPLITS:
            raise AutopartError(
                f"unknown seq_split {self.seq_split!r}", hint=f"use one of {', '.join(SPLITS)}"
            )
        check_schedule(
            self.schedule, self.mesh.pp, self.microbatches, self.virtual_stages, self.seq_chunks
        )
        if self.mesh.pp > 1:  # the pipeline's messages can be numbered (schedule/tags.py)
            Tags.of(self.mesh.pp, self.virtual_stages, self.microbatches, self.seq_chunks)

    @property
    def interleaved(self) -> bool:
        """Several virtual stages per pipeline rank (``schedule/generators.TRAITS``)."""
        return traits(self.schedule).interleaved

    @property
    def chunked(self) -> bool:
        """A Seq1F1B schedule: micro-batches cut into sequence chunks."""
        return traits(self.schedule).chunked

    @property
    def split_backward(self) -> bool:
        """A zero-bubble schedule: each backward split into B and W."""
        return traits(self.schedule).split_backward

    @property
    def compute_dtype(self) -> Any:
        """The ``torch.dtype`` the program computes in under ``precision`` (None: the model's
        own dtype)."""
        import torch

        if self.precision is None:
            return None
        return {"bf16": torch.bfloat16}.get(self.precision)

    @classmethod
    def from_batch(
        cls,
        global_batch: int,
        micro_batch: int = 1,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        **rest: Any,
    ) -> Plan:
        """The plan that runs ``global_batch`` sequences a step as dp × micro-batches of
        ``micro_batch`` sequences (the planner's and the simulator's way to say it)."""
        for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutopartError(f"{name}={value!r} must be a positive integer")
        mesh = Mesh(dp=dp, pp=pp, tp=tp)
        parts = mesh.dp * micro_batch
        if global_batch % parts:
            raise AutopartError(
                f"global batch {global_batch} is not divisible by dp({dp}) × "
                f"micro-batch({micro_batch}) = {parts}",
                hint=f"use a global batch that is a multiple of {parts}",
            )
        return cls(mesh, microbatches=global_batch // parts, micro_batch=micro_batch, **rest)

    @classmethod
    def of(cls, dp: int = 1, pp: int = 1, tp: int = 1, **fields: Any) -> Plan:
        """The plan with these mesh sizes and fields: ``Plan.of(pp=2, microbatches=4)``."""
        return cls(Mesh(dp=dp, pp=pp, tp=tp), **fields)

    def keywords(self) -> dict[str, Any]:
        """The plan as ``Plan.of``'s keywords (``Plan.of(**plan.keywords()) == plan``)."""
        fields = asdict(self)
        return {**fields.pop("mesh"), **fields}

    def changed(self, **changes: Any) -> Plan:
        """This plan with some fields (or ``tp``/``pp``/``dp``) changed, same global batch."""
        dims = {d: changes.pop(d) for d in DIMS if d in changes}
        if dims or "micro_batch" in changes:
            fields = {k: v for k, v in asdict(self).items() if k not in ("mesh", "microbatches")}
            fields.update(changes)
            sizes = {d: getattr(self.mesh, d) for d in DIMS} | dims
            return Plan.from_batch(
                self.global_batch, fields.pop("micro_batch") or 1, **sizes, **fields
            )
        return replace(self, **changes)

    # -- the mesh's sizes and what follows from them ------------------------------------------

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def dp(self) -> int:
        return self.mesh.dp

    @property
    def gpus(self) -> int:
        return self.mesh.size

    @property
    def global_batch(self) -> int:
        """Sequences per step: dp × micro-batches × micro-batch size (1 when not set)."""
        return self.mesh.dp * self.microbatches * (self.micro_batch or 1)

    @property
    def chunk_multiple(self) -> int:
        """Chunk boundaries are multiples of this: 8, a scan's block (``seq_block``), and tp
        under sequence parallelism."""
        return math.lcm(8, self.seq_block, self.mesh.tp if self.sequence_parallel else 1)

    def check_batch(self, batch_size: int) -> int:
        """Micro-batch size for a global batch; refuses a batch that does not split evenly."""
        parts = self.mesh.dp * self.microbatches
        if batch_size % parts:
            raise AutopartError(
                f"batch size {batch_size} is not divisible by dp({self.mesh.dp}) * "
                f"microbatches({self.microbatches}) = {parts}",
                hint=f"use a batch that is a multiple of {parts}, or change dp / microbatches",
            )
        if self.micro_batch is not None and batch_size != parts * self.micro_batch:
            raise AutopartError(
                f"batch size {batch_size} is not dp({self.mesh.dp}) * microbatches"
                f"({self.microbatches}) * micro_batch({self.micro_batch}) = "
                f"{parts * self.micro_batch}",
                hint="leave micro_batch unset to take it from the batch",
            )
        return batch_size // parts

    def check_model(self, layers: int, heads: int, kv_heads: int, ffn: int, seq: int) -> None:
        """Refuse a plan this GPT shape cannot run: tp must divide the heads and the FFN, and
        divide the KV heads or be a multiple of them (then they are replicated); every stage
        needs a block, every sequence chunk at least ``chunk_multiple`` tokens."""
        for what, n in (("heads", heads), ("ffn", ffn)):
            if n % self.tp:
                raise AutopartError(
                    f"tp={self.tp} does not divide the {what} ({n})",
                    hint=f"use a tp that divides {n}",
                )
        if kv_heads % self.tp and self.tp % kv_heads:
            raise AutopartError(
                f"tp={self.tp} neither divides the kv heads ({kv_heads}) nor is a multiple of them",
                hint=f"use a tp that divides {kv_heads} or a multiple of it",
            )
        if self.pp * self.virtual_stages > layers:
            raise AutopartError(
                f"pp({self.pp}) × virtual stages({self.virtual_stages}) = "
                f"{self.pp * self.virtual_stages} > {layers} layers",
                hint="every stage needs at least one transformer block",
            )
        if self.seq_chunks * self.chunk_multiple > seq:
            raise AutopartError(
                f"a sequence of {seq} tokens cannot be cut into {self.seq_chunks} chunks "
                f"of at least {self.chunk_multiple}",
                hint=fewer_chunks(seq // self.chunk_multiple),
            )

    def describe(self) -> str:
        """One line: ``tp=8 pp=4 dp=2 b=1 m=16 1f1b recompute=none SP``."""
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.virtual_stages > 1:
            parts.append(f"v={self.virtual_stages}")
        if self.micro_batch is not None:
            parts.append(f"b={self.micro_batch}")
        parts += [f"m={self.microbatches}", self.schedule]
        if self.seq_chunks > 1:
            parts.append(f"k={self.seq_chunks}")
        parts.append(f"recompute={self.recompute}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.distributed_optimizer:
            parts.append("dist-opt")
        if self.precision:
            parts.append(self.precision)
        if self.attention != "sdpa":
            parts.append(f"attention={self.attention}")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        return cls(**{**data, "mesh": Mesh(**data["mesh"])})
