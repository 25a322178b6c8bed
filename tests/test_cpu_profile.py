"""The CPU cluster profile (autopart/planning/cpu_profile.py): its TOML round-trips through
load_cluster, and calibrate() recovers a profile from step times it generated."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopart.layout import Plan
from autopart.planning.cluster import Cluster, load_cluster
from autopart.planning.cpu_profile import CALIBRATED, calibrate, to_toml
from autopart.planning.simulate import GPTShape, simulate

CPU = Cluster(
    name="cpu",
    gpus_per_node=4,
    peak_tflops=0.03,
    hbm_gib=64.0,
    hbm_tbps=0.007,
    nvlink_gbps=0.7,
    ib_nics_per_node=1,
    ib_gbit_per_nic=5.6,
    sms=1,
    mm_efficiency=1.0,
    mm_k_overhead=4.0,
    attn_efficiency=1.0,
    hbm_efficiency=1.0,
    kernel_launch_us=30.0,
    nvlink_latency_us=900.0,
    act_bytes=4.0,
)
SHAPE = GPTShape(4, 256, 8, 512, 256)


def test_toml_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "cpu.toml"
    path.write_text(to_toml(CPU))
    assert load_cluster(path) == CPU


def test_calibrate_recovers_the_profile_that_made_the_times() -> None:
    plans = [
        Plan.from_batch(8, 1, dp=4),
        Plan.from_batch(8, 2, tp=4, sequence_parallel=True),
        Plan.from_batch(8, 1, pp=4, schedule="1f1b"),
        Plan.from_batch(8, 2, tp=2, pp=2, schedule="1f1b"),
    ]
    times = [simulate(SHAPE, CPU, p, record=False).summary["iteration_s"] for p in plans]
    start = dataclasses.replace(
        CPU, peak_tflops=0.06, kernel_launch_us=10.0, nvlink_latency_us=300.0
    )
    got = calibrate(start, SHAPE, list(zip(plans, times, strict=True)))
    for name in CALIBRATED:
        assert getattr(got, name) == pytest.approx(getattr(CPU, name), rel=0.02)
