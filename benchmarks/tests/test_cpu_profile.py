"""The CPU profile (benchmarks/cpu_profile.py): its cluster's TOML round-trips through
load_cluster and the profile through its JSON, calibrate() recovers a profile from step times it
generated (the compute figures from one rank's plans, then what sharing the cores and talking
cost from the ranks' plans), and step_times_alone times real single-rank steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopart.layout import Plan
from autopart.planning.cluster import Cluster, load_cluster
from autopart.planning.simulate import GPTShape

from cpu_profile import CALIBRATED, Profile, calibrate, step_times_alone, to_toml
from shared_cores import SharedCores

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


def test_toml_and_json_round_trip(tmp_path: Path) -> None:
    profile = Profile(CPU, SharedCores(2.0, 0.3))
    path = tmp_path / "cpu.toml"
    path.write_text(to_toml(profile))
    assert load_cluster(path) == CPU
    assert Profile.from_json(profile.to_json()) == profile


def test_calibrate_recovers_the_profile_that_made_the_times() -> None:
    """From one rank's plans (micro-batches, chunks) and 4 ranks' plans on 2 cores together,
    every calibrated figure comes back."""
    true = Profile(
        dataclasses.replace(CPU, mm_weight_gbps=8.0, action_overhead_us=500.0),
        SharedCores(2.0, 0.2),
    )
    alone = [
        Plan.from_batch(8, 8),
        Plan.from_batch(8, 1),
        Plan.from_batch(8, 1, schedule="seq1f1b", seq_chunks=4),
        Plan.from_batch(8, 4, schedule="seq1f1b", seq_chunks=2),
    ]
    ranks = [
        Plan.from_batch(8, 1, dp=4),
        Plan.from_batch(8, 2, tp=4, sequence_parallel=True),
        Plan.from_batch(8, 1, pp=4, schedule="1f1b"),
        Plan.from_batch(8, 2, tp=2, pp=2, schedule="1f1b"),
    ]

    def times(plans):
        return [(p, true.seconds(SHAPE, p)) for p in plans]

    start = Profile.from_json(
        true.to_json()
        | dict(
            peak_tflops=0.06,
            mm_weight_gbps=3.0,
            kernel_launch_us=10.0,
            action_overhead_us=100.0,
            nvlink_latency_us=300.0,
            shared_slowdown=0.0,
        )
    )
    got = calibrate(start, SHAPE, times(alone) + times(ranks)).to_json()
    for name in CALIBRATED:
        assert got[name] == pytest.approx(true.to_json()[name], rel=0.02), name


@pytest.mark.slow  # real timed steps: the laboratory
def test_step_times_alone_times_real_single_rank_steps() -> None:
    from autopart.errors import AutopartError
    from autopart.frontend.capture import capture
    from autopart.models.nanogpt import GPT, GPTConfig, batch

    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=32, dropout=0.0)
    x, y = batch(cfg, batch_size=4, seq_len=32)
    captured = capture(GPT(cfg), (x, y))
    plans = [Plan.from_batch(4, 4), Plan.from_batch(4, 1, schedule="seq1f1b", seq_chunks=2)]
    got = step_times_alone(captured, (x, y), plans, steps=2, warmup=1)
    assert len(got) == 2 and all(0 < t < 10 for t in got)
    with pytest.raises(AutopartError, match="one rank"):
        step_times_alone(captured, (x, y), [Plan.from_batch(4, 1, dp=2)], steps=1)
