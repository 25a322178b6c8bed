"""Mesh and Plan: layout arithmetic and the up-front refusals."""

from __future__ import annotations

import json

import pytest

from autopart.errors import AutopartError
from autopart.layout import SCHEDULES, Mesh, Plan, mesh_from


@pytest.mark.parametrize(
    "dims",
    [{"dp": 0}, {"pp": -1}, {"tp": 0}, {"dp": 2.0}, {"pp": "2"}, {"tp": True}, {"dp": None}],
    ids=["dp0", "pp-neg", "tp0", "float", "str", "bool", "none"],
)
def test_mesh_rejects_bad_dims(dims: dict) -> None:
    ((name, value),) = dims.items()
    with pytest.raises(AutopartError) as err:
        Mesh(**dims)
    assert f"{name}={value!r} must be a positive integer" in str(err.value)


def test_mesh_layout_tp_fastest_then_dp_then_pp() -> None:
    mesh = Mesh(dp=2, pp=2, tp=2)
    assert mesh.size == 8
    coords = [mesh.coords(r) for r in range(8)]
    assert [(c.pp, c.dp, c.tp) for c in coords] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    for r, c in enumerate(coords):
        assert mesh.rank_of(**c.as_dict()) == r
    assert mesh.rank_of(pp=1, dp=0, tp=1) == 5
    assert mesh.group("tp", 5) == [4, 5]
    assert mesh.group("dp", 5) == [5, 7]
    assert mesh.group("pp", 5) == [1, 5]
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for dim in ("dp", "pp", "tp"):  # every rank in exactly one group of each dim
        flat = sorted(r for g in mesh.groups(dim) for r in g)
        assert flat == list(range(8))


def test_mesh_uneven_sizes() -> None:
    mesh = Mesh(dp=3, pp=2, tp=1)
    assert mesh.groups("dp") == [[0, 1, 2], [3, 4, 5]]
    assert mesh.groups("pp") == [[0, 3], [1, 4], [2, 5]]
    assert mesh.groups("tp") == [[r] for r in range(6)]
    assert str(mesh) == "Mesh(dp=3, pp=2, tp=1)"


@pytest.mark.parametrize("rank", [-1, 8])
def test_mesh_coords_out_of_range(rank: int) -> None:
    with pytest.raises(AutopartError, match=f"rank {rank} is outside this mesh of 8 ranks"):
        Mesh(dp=2, pp=2, tp=2).coords(rank)


def test_check_world() -> None:
    Mesh(dp=2).check_world(2)
    with pytest.raises(AutopartError) as err:
        Mesh(dp=2).check_world(4)
    assert "dp(2) * pp(1) * tp(1) = 2 != WORLD_SIZE (4)" in str(err.value)
    assert "--nproc-per-node 2" in err.value.hint


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("1f1 b", "1f1b"), ("gpip", "gpipe"), ("1f1f", "1f1b"), ("1F1B", "1f1b"), ("ZB-H1", "zb-h1")],
)
def test_unknown_schedule_suggests(typo: str, meant: str) -> None:
    with pytest.raises(AutopartError) as err:
        Plan(Mesh(dp=2), schedule=typo)
    assert f"unknown schedule {typo!r}" in err.value.message
    assert f"did you mean {meant!r}" in err.value.hint
    for name in SCHEDULES:
        assert name in err.value.hint


def test_unknown_schedule_without_close_match() -> None:
    with pytest.raises(AutopartError) as err:
        Plan(Mesh(), schedule="zigzag")
    assert "did you mean" not in str(err.value) and "choose one of" in err.value.hint


def test_interleaving_without_pipeline_parallelism_is_refused() -> None:
    """pp=1 with virtual stages: every rank's stages sent activations to themselves, and each
    rank died in gloo's isend ("Pair is not connected"), a raw error after launch (plan
    probe, seventeenth session)."""
    for schedule in ("interleaved-1f1b", "seq1f1b-interleaved"):
        with pytest.raises(AutopartError, match=r"needs pipeline parallelism \(pp ≥ 2\)"):
            Plan(Mesh(dp=2), schedule=schedule, virtual_stages=2, microbatches=2)


@pytest.mark.parametrize(
    ("kwargs", "needle", "hint"),
    [
        ({"seq_chunks": 2}, "seq_chunks=2 needs a Seq1F1B schedule, not 1f1b", "seq1f1b"),
        ({"seq_chunks": 2, "schedule": "interleaved-1f1b"}, "needs a Seq1F1B schedule", "seq1f1b"),
        (
            {"schedule": "seq1f1b", "seq_split": "even"},
            "unknown seq_split 'even'",
            "balanced, uniform",
        ),
    ],
    ids=["chunks-without-seq1f1b", "chunks-with-interleaved", "unknown-split"],
)
def test_sequence_chunk_plans_refused(kwargs: dict, needle: str, hint: str) -> None:
    with pytest.raises(AutopartError) as err:
        Plan(Mesh(pp=2), **kwargs)
    assert needle in err.value.message and hint in err.value.hint


def test_chunk_multiple() -> None:
    assert Plan(Mesh(pp=2), schedule="seq1f1b", seq_chunks=2).chunk_multiple == 8
    sp = Plan(Mesh(pp=2, tp=4), schedule="seq1f1b", seq_chunks=2, sequence_parallel=True)
    assert sp.chunk_multiple == 8
    sp3 = Plan(Mesh(pp=2, tp=3), schedule="seq1f1b", seq_chunks=2, sequence_parallel=True)
    assert sp3.chunk_multiple == 24 and Plan.from_json(sp3.to_json()) == sp3


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"microbatches": 0}, "microbatches=0 must be a positive integer"),
        ({"microbatches": 1.5}, "microbatches=1.5 must be a positive integer"),
        ({"seq_chunks": False}, "seq_chunks=False must be a positive integer"),
        ({"bucket_mb": 0}, "bucket_mb=0 must be a positive number"),
        ({"bucket_mb": -1.0}, "bucket_mb=-1.0 must be a positive number"),
        ({"bucket_mb": float("nan")}, "bucket_mb=nan must be a positive number"),
        ({"max_stage_memory_gb": float("nan")}, "max_stage_memory_gb=nan must be a positive"),
        ({"max_stage_memory_gb": -5.0}, "max_stage_memory_gb=-5.0 must be a positive"),
    ],
)
def test_plan_rejects_bad_numbers(kwargs: dict, needle: str) -> None:
    with pytest.raises(AutopartError, match="must be"):
        Plan(Mesh(dp=2), **kwargs)
    with pytest.raises(AutopartError) as err:
        Plan(Mesh(dp=2), **kwargs)
    assert needle in str(err.value)


def test_supported_plans() -> None:
    for schedule in ("1f1b", "gpipe"):
        plan = Plan(Mesh(dp=4), schedule=schedule, microbatches=3, bucket_mb=0.5)
        assert plan.schedule == schedule and plan.microbatches == 3


def test_check_batch() -> None:
    plan = Plan(Mesh(dp=2), microbatches=3)
    assert plan.check_batch(12) == 2
    assert plan.check_batch(6) == 1
    with pytest.raises(AutopartError) as err:
        plan.check_batch(8)
    assert "batch size 8 is not divisible by dp(2) * microbatches(3) = 6" in err.value.message
    assert "multiple of 6" in err.value.hint
    with pytest.raises(AutopartError, match="dp\\(4\\) \\* microbatches\\(1\\) = 4"):
        Plan(Mesh(dp=4)).check_batch(2)


def test_plan_json_round_trip() -> None:
    plan = Plan(Mesh(dp=4), schedule="gpipe", microbatches=2, bucket_mb=1.5)
    data = json.loads(json.dumps(plan.to_json()))
    assert data["mesh"] == {"dp": 4, "pp": 1, "tp": 1}
    back = Plan.from_json(data)
    assert back == plan and isinstance(back.mesh, Mesh)
    assert Plan.from_json(Plan(Mesh()).to_json()) == Plan(Mesh())


class _FakeDeviceMesh:
    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...]) -> None:
        import torch

        self.mesh_dim_names = names
        self.mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)


def test_mesh_from() -> None:
    mesh = Mesh(dp=2)
    assert mesh_from(mesh) == (mesh, None)
    live = _FakeDeviceMesh(("dp",), (4,))
    assert mesh_from(live) == (Mesh(dp=4), live)
    assert mesh_from(_FakeDeviceMesh(("pp", "dp"), (2, 3)))[0] == Mesh(dp=3, pp=2)
    with pytest.raises(AutopartError, match="not in autopart's rank order"):
        mesh_from(_FakeDeviceMesh(("dp", "pp"), (2, 2)))
    permuted = _FakeDeviceMesh(("dp", "tp"), (2, 2))
    permuted.mesh = permuted.mesh.t().contiguous()  # ranks [[0, 2], [1, 3]]: not autopart's
    with pytest.raises(AutopartError, match=r"lays out ranks \[0, 2, 1, 3\], not 0 … 3"):
        mesh_from(permuted)
    with pytest.raises(AutopartError, match="include \\['cp'\\]"):
        mesh_from(_FakeDeviceMesh(("cp",), (2,)))
    # a dim of one rank is no parallelism, whatever its name (torchtitan's "cp")
    assert mesh_from(_FakeDeviceMesh(("cp", "dp", "tp"), (1, 2, 2)))[0] == Mesh(dp=2, tp=2)
    assert mesh_from(_FakeDeviceMesh(("dp", "cp", "tp"), (2, 1, 2)))[0] == Mesh(dp=2, tp=2)
    with pytest.raises(AutopartError, match="include \\['dp_shard'\\]") as err:
        mesh_from(_FakeDeviceMesh(("dp_shard", "tp"), (2, 2)))
    assert "_flatten('dp')" in (err.value.hint or "")
    with pytest.raises(AutopartError, match="expected an autopart.Mesh"):
        mesh_from((2, 1, 1))


def test_one_plan_for_the_planner_and_the_compiler() -> None:
    """The simulator's plans are Plans: from a global batch, with the arithmetic in refusals."""
    plan = Plan.from_batch(64, 2, tp=2, pp=2, dp=4, schedule="interleaved-1f1b", virtual_stages=2)
    assert (plan.microbatches, plan.micro_batch, plan.global_batch, plan.gpus) == (8, 2, 64, 16)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.describe().startswith("tp=2 pp=2 dp=4 v=2 b=2 m=8 interleaved-1f1b")
    with pytest.raises(AutopartError, match=r"global batch 30 is not divisible by dp\(4\) × "):
        Plan.from_batch(30, 2, dp=4)
    with pytest.raises(AutopartError, match="divisible by pp: 3 % 2 = 1"):
        Plan.from_batch(6, 2, pp=2, schedule="interleaved-1f1b", virtual_stages=2)
    # a change keeps the global batch: half the micro-batch doubles the micro-batches
    half = plan.changed(micro_batch=1)
    assert (half.microbatches, half.global_batch) == (16, 64)
    wider = plan.changed(tp=4, dp=2)
    assert (wider.mesh, wider.microbatches) == (Mesh(dp=2, pp=2, tp=4), 16)
    assert plan.changed(recompute="full").recompute == "full"
    with pytest.raises(AutopartError, match="unknown recompute 'some'"):
        plan.changed(recompute="some")


def test_plan_checks_a_model_shape() -> None:
    plan = Plan.from_batch(8, tp=4, pp=2, schedule="seq1f1b", seq_chunks=4)
    plan.check_model(layers=4, heads=8, kv_heads=4, ffn=64, seq=64)
    plan.check_model(layers=4, heads=8, kv_heads=2, ffn=64, seq=64)  # replicated KV heads
    plan.check_model(layers=4, heads=8, kv_heads=1, ffn=64, seq=64)
    with pytest.raises(AutopartError, match=r"tp=4 neither divides the kv heads \(6\)"):
        plan.check_model(layers=4, heads=12, kv_heads=6, ffn=64, seq=64)
    with pytest.raises(AutopartError, match=r"pp\(2\) × virtual stages\(1\) = 2 > 1 layers"):
        plan.check_model(layers=1, heads=8, kv_heads=4, ffn=64, seq=64)
    with pytest.raises(AutopartError, match="cannot be cut into 4 chunks of at least 8"):
        plan.check_model(layers=4, heads=8, kv_heads=4, ffn=64, seq=24)


def test_a_batch_that_contradicts_the_micro_batch_is_refused() -> None:
    plan = Plan(Mesh(dp=2), microbatches=2, micro_batch=2)
    assert plan.check_batch(8) == 2
    with pytest.raises(AutopartError, match=r"micro_batch\(2\) = 8"):
        plan.check_batch(4)
