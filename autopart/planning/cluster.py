"""Clusters for the simulator and the planner: GPUs, their memory and the links between them.

A ``Cluster`` is plain data. Two presets ship (``PRESETS``): ``dgx-a100-80gb`` and ``dgx-h100``,
with the datasheet figures the issue names (peak dense bf16 TFLOP/s, HBM size and bandwidth,
NVLink bandwidth per direction per GPU, InfiniBand NICs per node and their line rate). The
efficiencies and latencies are assumptions, not measurements: docs/simulate.md says where each
comes from. A TOML or JSON file may define a cluster, in full or as changes to a preset::

    base = "dgx-a100-80gb"      # optional: start from a preset
    name = "my-a100s"
    mm_efficiency = 0.7

    cluster = load_cluster("dgx-h100")          # a preset
    cluster = load_cluster("clusters/mine.toml")  # a file
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from autopart.errors import AutopartError

GIB = 2**30


ATTENTION = ("flash", "unfused")


# fields that may be 0 (every other number must be positive)
LOW_OK = ("action_overhead_us", "mm_weight_gbps")


@dataclass(frozen=True)
class Cluster:
    """One kind of node, repeated; every GPU has the same links.

    Bandwidths are per direction. ``ib_gbit_per_nic`` is a NIC's line rate in Gb/s (bits); the
    simulator gives each GPU ``ib_nics_per_node / gpus_per_node`` NICs (one each on a DGX).
    """

    name: str
    gpus_per_node: int
    peak_tflops: float  # dense bf16 tensor-core peak per GPU
    hbm_gib: float  # memory per GPU
    hbm_tbps: float  # HBM bandwidth, TB/s
    nvlink_gbps: float  # NVLink bandwidth per GPU per direction, GB/s
    ib_nics_per_node: int
    ib_gbit_per_nic: float  # Gb/s per NIC per direction
    sms: int  # streaming multiprocessors (wave quantization of matmuls)
    mm_efficiency: float = 0.75  # share of peak a large bf16 matmul reaches (one full wave)
    mm_k_overhead: float = 64.0  # a tile's fixed cost, in steps of its inner dimension
    # the rate (GB/s) at which a GEMM reads its weight operand on top of its math, once per call
    # (a CPU GEMM packs the weight from memory each call: a Seq1F1B chunk's GEMMs pay it once
    # per chunk); 0: hidden behind the math, as on GPUs
    mm_weight_gbps: float = 0.0
    attn_efficiency: float = 0.55  # share of peak a fused (flash) attention forward reaches
    hbm_efficiency: float = 0.85  # share of HBM bandwidth a memory-bound kernel reaches
    kernel_launch_us: float = 3.0  # fixed cost per kernel
    # fixed cost of each forward or backward action of the runtime (its scheduling and autograd
    # call), beyond its kernels; 0 on GPUs (hidden behind queued kernels), measured on CPUs
    action_overhead_us: float = 0.0
    nvlink_efficiency: float = 0.80  # NCCL bus bandwidth / NVLink bandwidth
    ib_efficiency: float = 0.85  # NCCL bus bandwidth / InfiniBand line rate
    nvlink_latency_us: float = 3.0  # per ring step (alpha)
    ib_latency_us: float = 8.0  # per ring step (alpha)
    usable_memory_fraction: float = 0.90  # the rest: CUDA context, NCCL buffers, fragmentation
    # the software: the attention kernel it runs, "flash" (fused, causal blocks skipped) or
    # "unfused" (scores materialized, softmax fused: Megatron as it ran in 2021)
    attention: str = "flash"
    act_bytes: float = 2.0  # bytes per activation element the software computes in (bf16: 2)
    # the gradient reduction over dp: its bytes per parameter (4: fp32 main grads, 2: bf16),
    # and whether it overlaps the backward (buckets launched as they fill) or waits for the
    # whole backward to end (Megatron-LM 2021)
    grad_bytes: float = 4.0
    grad_overlap: bool = True
    # pipeline hand-over without sequence parallelism: every tp rank sends the whole activation
    # (autopart's runtime), or 1/tp of it followed by an all-gather over NVLink (Megatron's
    # scatter-gather optimization)
    p2p_scatter_gather: bool = False
    # tensor-parallel backward collectives overlapped with the GEMMs that do not need them
    # (Megatron-LM's asynchronous all-reduce, 2022 on); autopart's runtime does not
    tp_overlap: bool = False
    # tensor-parallel collectives as a ring (NCCL: 2(n − 1) steps an all-reduce, n − 1 an
    # all-gather or reduce-scatter) or as one direct exchange, every rank reading every other's
    # piece (autopart's gloo groups of up to 4 ranks: ``autopart.collectives``): one step each
    tp_exchange: bool = False
    # a pipeline send returns at once (autopart's isend) or blocks its rank until delivered
    # (Megatron-LM 2021-2022's send/receive pairs on the critical path)
    p2p_overlap: bool = True
    # with the distributed optimizer, gradients are reduce-scattered (Megatron-LM) or
    # all-reduced and then each dp rank steps its shard (autopart: torch's
    # ZeroRedundancyOptimizer over the runner's all-reduced gradients)
    grad_reduce_scatter: bool = False
    # a rank whose pipeline receive has not arrived runs deferred weight-gradient work (a
    # zero-bubble schedule's W) meanwhile: autopart's runtime on CPU ranks; on GPUs a receive
    # is ordered on the stream and the schedule's order stands
    fill_waits: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise AutopartError(
                f"cluster {self.name!r}: unknown attention {self.attention!r}",
                hint=f"use one of {', '.join(ATTENTION)}",
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "attention":
                continue
            if isinstance(f.default, bool):
                if not isinstance(value, bool):
                    raise AutopartError(f"cluster {self.name!r}: {f.name} must be true or false")
                continue
            if f.name == "name":
                if not isinstance(value, str) or not value:
                    raise AutopartError("a cluster needs a non-empty name")
                continue
            low_ok = f.name in LOW_OK and value == 0
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (value <= 0 and not low_ok)
            ):
                raise AutopartError(
                    f"cluster {self.name!r}: {f.name}={value!r} must be a positive number"
                )
        for name in (
            "mm_efficiency",
            "attn_efficiency",
            "hbm_efficiency",
            "nvlink_efficiency",
            "ib_efficiency",
            "usable_memory_fraction",
        ):
            if getattr(self, name) > 1:
                raise AutopartError(
                    f"cluster {self.name!r}: {name}={getattr(self, name)} is above 1"
                )

    @property
    def ib_gbps_per_gpu(self) -> float:
        """InfiniBand bandwidth per GPU per direction, GB/s (bytes)."""
        return self.ib_nics_per_node * self.ib_gbit_per_nic / 8 / self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return self.hbm_gib * GIB * self.usable_memory_fraction

    def link(self, span: int, stride: int = 1) -> tuple[str, float, float]:
        """(name, bytes/s, alpha seconds) of a ring over a group of ranks ``stride`` apart that
        spans ``span`` consecutive ranks: NVLink when it fits in one node; otherwise InfiniBand,
        where a ring's data crosses each node boundary once per channel, so the group's
        members in a node (``gpus_per_node // stride``) pool their NICs (NCCL runs one channel
        per NIC), up to the NVLink bandwidth."""
        nv = self.nvlink_gbps * 1e9 * self.nvlink_efficiency
        if span <= self.gpus_per_node:
            return ("nvlink", nv, self.nvlink_latency_us * 1e-6)
        members = max(1, self.gpus_per_node // stride)
        ib = self.ib_gbps_per_gpu * 1e9 * self.ib_efficiency * members
        return ("ib", min(ib, nv), self.ib_latency_us * 1e-6)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, Cluster] = {
    "dgx-a100-80gb": Cluster(
        name="dgx-a100-80gb",
        gpus_per_node=8,
        peak_tflops=312.0,
        hbm_gib=80.0,
        hbm_tbps=2.0,
        nvlink_gbps=300.0,
        ib_nics_per_node=8,
        ib_gbit_per_nic=200.0,
        sms=108,
        # fitted on Korthikanti et al. 2022's iteration times (benchmarks/published.py)
        mm_efficiency=0.76,
        hbm_efficiency=0.67,
    ),
    "dgx-h100": Cluster(
        name="dgx-h100",
        gpus_per_node=8,
        peak_tflops=989.0,
        hbm_gib=80.0,
        hbm_tbps=3.35,
        nvlink_gbps=450.0,
        ib_nics_per_node=8,
        ib_gbit_per_nic=400.0,
        sms=132,
        mm_efficiency=0.70,
        attn_efficiency=0.45,
    ),
}

_FIELDS = frozenset(f.name for f in fields(Cluster))


def cluster_from_dict(data: dict[str, Any], source: str = "cluster") -> Cluster:
    """A ``Cluster`` from a mapping: every field, or ``base = PRESET`` plus the changes."""
    data = dict(data)
    base = data.pop("base", None)
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(_FIELDS), n=1)
        raise AutopartError(
            f"{source}: unknown key {unknown[0]!r}",
            hint=(f"did you mean {close[0]!r}? " if close else "")
            + f"keys: base, {', '.join(f.name for f in fields(Cluster))}",
        )
    if base is not None:
        start = preset(str(base)).to_json()
        start.update(data)
        data = start
    missing = [
        f.name for f in fields(Cluster) if f.name not in data and f.default is dataclasses.MISSING
    ]
    if missing:
        raise AutopartError(
            f"{source}: missing {', '.join(missing)}",
            hint=f'give them, or start from a preset: base = "{next(iter(PRESETS))}"',
        )
    try:
        return Cluster(**data)
    except TypeError as exc:
        raise AutopartError(f"{source}: {exc}") from exc


def preset(name: str) -> Cluster:
    """A shipped cluster by name; an unknown name gets a did-you-mean hint."""
    if name in PRESETS:
        return PRESETS[name]
    close = [p for p in PRESETS if p.startswith(name.lower())] or difflib.get_close_matches(
        name.lower(), list(PRESETS), n=1, cutoff=0.4
    )
    raise AutopartError(
        f"unknown cluster {name!r}",
        hint=(f"did you mean {close[0]!r}? " if close else "")
        + f"presets: {', '.join(PRESETS)}; or a .toml / .json file",
    )


def load_cluster(spec: str | Path | Cluster) -> Cluster:
    """A preset name, a ``.toml`` / ``.json`` file, or a ``Cluster`` (returned as is)."""
    if isinstance(spec, Cluster):
        return spec
    text = str(spec)
    path = Path(text)
    if text in PRESETS or path.suffix.lower() not in (".toml", ".json"):
        return preset(text)
    if not path.exists():
        raise AutopartError(
            f"cluster file {path} does not exist", hint=f"or use a preset: {', '.join(PRESETS)}"
        )
    raw = path.read_bytes()
    try:
        data = tomllib.loads(raw.decode()) if path.suffix.lower() == ".toml" else json.loads(raw)
    except (
        ValueError,
        RecursionError,
    ) as exc:  # bad TOML/JSON/UTF-8, a 5000-digit integer, nesting
        raise AutopartError(f"cannot read cluster file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise AutopartError(f"cluster file {path} must hold one table / object")
    data.setdefault("name", path.stem)
    return cluster_from_dict(data, str(path))


__all__ = ["ATTENTION", "GIB", "PRESETS", "Cluster", "cluster_from_dict", "load_cluster", "preset"]
