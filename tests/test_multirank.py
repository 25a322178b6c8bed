"""Real gloo ranks, the ways users start them: torchrun (``autopart run``, ``autopart verify``
with saved programs, check after check in one launch per world size, several torchrun agents),
the live ``DeviceMesh`` API, the tp collectives as executed, ZeRO-1 and the pipeline trace.

Tests of what torchrun itself does launch torchrun; the others fork their ranks with torchrun's
environment (``launch_forked``). Nothing is mocked. The parity matrices: tests/test_parity*.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from parity_cases import GPT2, LONG, NANO, ROOT, SEQ

from autopart import AutopartError, Mesh, parallelize, verify
from autopart.cli import main as cli
from autopart.parity.verify import Report, launch_forked

pytestmark = pytest.mark.multirank
sys.path.insert(0, str(ROOT / "examples"))


def test_world_size_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    import nanogpt

    model, batch = nanogpt.make()
    parallelize(model, Mesh(dp=2), example_inputs=batch).save(tmp_path / "p")
    for world in (1, 4):  # 4: every rank refuses before it connects (one rank's exit used to
        # break the others' connect: a raw "connectFullMesh failed" traceback, sometimes)
        with pytest.raises(AutopartError) as err:
            launch_forked(
                world,
                [
                    "-m",
                    "autopart.runtime.run",
                    str(tmp_path / "p"),
                    "--steps",
                    "1",
                    "--timeout",
                    "20",
                ],
                timeout_s=30,
            )
        text = str(err.value)
        assert f"dp(2) * pp(1) * tp(1) = 2 != WORLD_SIZE ({world})" in text, text
        assert "Traceback" not in text and "connectFullMesh" not in text, text


def test_live_device_mesh_api() -> None:
    out = launch_forked(2, [str(ROOT / "tests" / "live_script.py")], timeout_s=120)
    verdicts = re.findall(r"rank (\d): .*?, (OK|MISMATCH)", out)  # ranks may share a line
    assert sorted(verdicts) == [("0", "OK"), ("1", "OK")], out


def test_rank_zero_compiles_for_longer_than_the_timeout_and_its_errors_reach_every_rank() -> None:
    """The live API compiles on rank 0; the others used to wait for it at most ``timeout_s``
    (300 s by default; a 32-layer Llama compiles in about 2 minutes here), and an error on
    rank 0 had no test. Now rank 0 beats while it compiles: a compile three times the timeout
    trains every rank exactly, and rank 0's error is every rank's, quoted."""
    out = launch_forked(2, [str(ROOT / "tests" / "handover_script.py")], timeout_s=120)
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(rows) == 2, out
    for r in rows:
        assert "does not compile here" in r["failed"], r
        if r["rank"] == 1:
            assert r["failed"].startswith("rank 1: rank 0 could not compile the model"), r
        assert r["waited"][0] >= 9.0, r  # three times the 3 s timeout, waited out
        assert max(r["errs"]) <= 1e-9, r


@pytest.mark.slow  # suite time (the live dp mesh runs by default)
def test_live_pipeline_mesh_with_a_tied_embedding_on_four_ranks() -> None:
    """pp=4 on a live DeviceMesh: the middle stages hold no tied parameter but must create the
    tie's process group with the others (they used to skip it, and every rank hung). A tp=4
    runner of the same model, built first in the same processes, still matches after it (the
    graphs' tp group was bound by name process-wide, so the last runner built won)."""
    out = launch_forked(4, [str(ROOT / "tests" / "live_script.py"), "pp"], timeout_s=120)
    verdicts = re.findall(r"rank (\d): .*?, (OK|MISMATCH)", out)
    assert sorted(verdicts) == [(str(r), "OK") for r in range(4)], out


@pytest.mark.slow  # suite time (tests/test_launch.py and the checkpoint tests run `autopart run`)
def test_cli_run_launches_ranks_and_trains(tmp_path: Path) -> None:
    import nanogpt

    model, batch = nanogpt.make()
    parallelize(model, Mesh(dp=2), example_inputs=batch, microbatches=2).save(tmp_path / "p")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autopart",
            "run",
            str(tmp_path / "p"),
            "--steps",
            "4",
            "--json",
            "--lr",
            "1e-2",
            "--batch-size",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)


def test_cli_verify_pass_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["verify", "--model", NANO, "--dp", "2", "--microbatches", "2", "--in-memory"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert cli(["verify", "--model", NANO, "--dp", "3"]) == 2  # batch 8 not divisible by 3
    assert "not divisible by dp(3) * microbatches(1) = 3" in capsys.readouterr().err
    assert cli(["verify", "--model", NANO, "--seq-chunks", "2"]) == 2  # chunks need seq1f1b
    assert "needs a Seq1F1B schedule" in capsys.readouterr().err
    assert cli(["verify", "--model", NANO, "--schedule", "1f1f"]) == 2
    assert "did you mean '1f1b'" in capsys.readouterr().err


@pytest.mark.slow  # suite time (tests/test_plan_emit.py runs verify through torchrun)
def test_cli_verify_several_plans_in_one_launch_per_world_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--plans: saved programs, one torchrun launch per world size (2 and 4) taking check after
    check; a refused plan is an ERROR line, the others still run."""
    plans = "pp=2,seq1f1b,k=2,m=2; dp=3; dp=2,tp=2,m=2,sp"
    assert cli(["verify", "--model", NANO, "--plans", plans, "--timeout", "60"]) == 2
    out = capsys.readouterr().out
    for plan in ("pp=2,seq1f1b,m=2,k=2", "dp=2,tp=2,1f1b,m=2,sp"):
        assert f"PASS {plan}: loss rel err" in out, out
    assert "ERROR dp=3,1f1b: batch size 8 is not divisible by dp(3)" in out, out
    assert "2 of 3 plans pass, 0 fail, 1 errors" in out, out


@pytest.mark.slow  # suite time
def test_saved_checks_go_on_after_a_failing_one(tmp_path: Path) -> None:
    """In one torchrun launch the ranks load and run saved programs one after another; when one
    fails (here a damaged file), it is reported with the ranks' error and the checks after it
    run in a new launch."""
    from autopart.parity.verify import _launch_checks, _prepare

    model = _prepare(NANO, "float64")
    ready, folders = {}, {}
    for name, mesh in (("first", Mesh(dp=2)), ("damaged", Mesh(pp=2)), ("last", Mesh(tp=2))):
        program = parallelize(model.captured, mesh)
        folders[name] = tmp_path / name
        program.save(folders[name] / "program")
        torch.save(model.batch, folders[name] / "batch.pt")
        ready[name] = (program, model, 0.0)
    (folders["damaged"] / "program" / "rank00001" / "program.json").write_text("{}")
    results: dict[str, Report | AutopartError] = {}
    _launch_checks(2, list(ready), folders, ready, "float64", 60, 1, False, results.__setitem__)
    assert list(results) == ["first", "damaged", "last"]
    assert results["first"].ok and results["last"].ok, results
    assert isinstance(results["damaged"], AutopartError)
    assert "check damaged" in str(results["damaged"]) and "checksum" in str(results["damaged"])


@pytest.mark.slow  # suite time (four compiles on two ranks)
def test_tensor_parallel_collectives_as_run() -> None:
    """One tp=2 step of the 2-block nanoGPT (b=8, s=32, h=32, V=96), collectives as executed."""
    out = launch_forked(2, [str(ROOT / "tests" / "tp_count_script.py")], timeout_s=120)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    runs = {d["sp"]: [(k, tuple(s)) for k, s in d["calls"]] for d in lines if "sp" in d}
    bsh, bs = (8, 32, 32), (8 * 32,)
    plain = runs[False]
    # forward: 2 all-reduces per block + the vocab embedding; backward: 2 per block + the LM head
    assert plain.count(("all_reduce", bsh)) == 2 * 2 + 1 + 2 * 2 + 1
    # the vocab-parallel loss moves only [b·s] tensors: max, sum of exp, target logit, gathered
    # in one collective
    assert plain.count(("all_gather", (1, 3, *bs))) == 1
    assert len(plain) == 11, plain
    sp = runs[True]
    assert sp.count(("reduce_scatter", bsh)) == 5 + 5  # forward g's, backward of the gathers
    assert sp.count(("all_gather", (8, 16, 32))) == 5 + 5  # forward f's, backward of the scatters
    assert ("all_reduce", bsh) not in sp
    # the partial gradients of the norms and the position table (tp_all_reduce_grad): summed
    # over the step's backwards, then all-reduced once, as one message
    assert [k for k, _ in sp].count("all_reduce") == 1, sp
    assert sp.count(("all_gather", (1, 3, *bs))) == 1
    drop = next(d for d in lines if "dropout_split" in d)
    # per block: attention probabilities split over heads; embedding/residual dropouts replicated
    assert drop["dropout_split"].count(True) == 2 and drop["dropout_split"].count(False) == 5
    assert drop["replicated_grads_equal"] and all(drop["replicated_grads_equal"])


def test_collectives_on_every_transport() -> None:
    """3 ranks: through shared memory and the direct exchange, the sum is the rank-order sum,
    bitwise the same on every rank; gathers are exact and reduce-scatters keep each rank's
    slice on all three transports; shared memory leaves no file in /dev/shm, falls back to the
    exchange where one rank cannot map the others' files or does not want shared memory, times
    out naming the rank and action, and fails on every rank at once when one rank fails."""
    out = launch_forked(3, [str(ROOT / "tests" / "collectives_script.py")], timeout_s=180)
    res = next(json.loads(x) for x in out.splitlines() if x.startswith("{"))
    paths = (
        ("shm", "shm"),
        ("unshared", "exchange"),
        ("disagree", "exchange"),
        ("exchange", "exchange"),
        ("gloo", "c10d"),
    )
    for path, transport in paths:
        assert res[path].pop("transport") == transport, res[path]
    assert all(res["shm"].values()), res["shm"]
    assert all(res["unshared"].values()), res["unshared"]
    assert all(res["disagree"].values()), res["disagree"]
    for rank, f in enumerate(res["failures"]):  # each rank fails at once, saying why
        assert "sent 16 bytes of 4-byte elements where this rank sent 32" in f["mismatch"] or (
            rank == 0
            and "sent 32 bytes of 4-byte elements where this rank sent 16" in f["mismatch"]
        ), f["mismatch"]
        assert "on a group whose exchange failed before" in f["after_failure"], f
        # the peers' error names rank 1's failure: they did not wait out their timeout
        want = "cannot reserve 4.0 MiB" if rank == 1 else "rank 1 failed in an exchange"
        assert want in f["full"], f["full"]
        assert "does not split into 3 equal parts" in f["uneven"], f["uneven"]
        assert "compiled for 4 ranks, but this process bound t to a group of 3" in f["resized"]
    # the silent peer is named: alive, its heartbeat running, it never came to the exchange
    assert re.match(
        r"rank 0: rank [12] \(process \d+\) has not answered for 1 s during all-reduce over t "
        r"of \(4,\)",
        res["timeout"],
    ), res["timeout"]
    assert "its heartbeat runs" in res["timeout"], res["timeout"]
    assert "during the lonely step" in res["timeout"], res["timeout"]
    assert all(res["exchange"].values()), res["exchange"]
    assert all(v for k, v in res["gloo"].items() if k != "sum_is_rank_order"), res["gloo"]


@pytest.mark.slow  # suite time
def test_two_torchrun_agents_meet_by_c10d_rendezvous() -> None:
    """Multi-node: two torchrun agents (2 ranks each) run one tp × pp Seq1F1B program together."""
    kwargs = {**SEQ, "tp": 2, "pp": 2, "seq_chunks": 2, "microbatches": 2}
    report = verify(GPT2, dtype="float64", timeout_s=120, nnodes=2, **kwargs)
    assert report.ok, str(report)


def test_pipeline_trace_and_saved_bytes(tmp_path: Path) -> None:
    import nanogpt

    model, batch = nanogpt.make()
    parallelize(model, Mesh(pp=2), example_inputs=batch, microbatches=4).save(tmp_path / "p")
    out = launch_forked(
        2,
        [
            "-m",
            "autopart.runtime.run",
            str(tmp_path / "p"),
            "--steps",
            "2",
            "--json",
            "--trace",
            str(tmp_path / "trace.json"),
        ],
        timeout_s=120,
    )
    ranks = [json.loads(x) for x in out.splitlines() if x.startswith('{"rank"')]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(0 < r["busy_fraction"] <= 1 and r["peak_saved_bytes"] > 0 for r in ranks)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert (
        sum(e["cat"] == "F" for e in events) == 2 * 4 and sum(e["cat"] == "B" for e in events) == 8
    )
    # the header autopart simulate --measured reads: the real run's costs replayed
    from autopart.planning.calibrate import load, predict

    measured = load(tmp_path / "trace.json")
    assert (measured.pp, measured.microbatches, measured.schedule) == (2, 4, "1f1b")
    assert set(measured.compute) == {(k, s, 0) for k in "FB" for s in (0, 1)}
    assert all(t > 0 for t in measured.compute.values()) and measured.step_s > 0
    assert measured.microbatch_tokens == batch[0].numel() // 4
    four, eight = predict(measured).summary, predict(measured, microbatches=8).summary
    per_rank = [4 * (measured.compute["F", s, 0] + measured.compute["B", s, 0]) for s in (0, 1)]
    assert four.breakdown.compute_s == pytest.approx(sum(per_rank) / 2)  # mean over ranks
    assert eight.iteration_s > four.iteration_s


def test_zero1_matches_the_unsharded_optimizer(tmp_path: Path) -> None:
    """ZeRO-1 (AdamW state sharded over dp=2, × pp=2) ends 4 steps with the same parameters."""
    import hf_gpt2

    model, batch = hf_gpt2.make(n_layer=2)
    prog = parallelize(model.double(), Mesh(dp=2, pp=2), example_inputs=batch, microbatches=2)
    prog.save(tmp_path / "p")
    finals = {}
    for zero in (False, True):
        out = tmp_path / ("zero" if zero else "plain")
        launch_forked(
            4,
            [
                "-m",
                "autopart.runtime.run",
                str(tmp_path / "p"),
                "--steps",
                "4",
                "--json",
                "--dump-params",
                str(out),
                *(["--zero"] if zero else []),
            ],
            timeout_s=120,
        )
        finals[zero] = [torch.load(out / f"rank{r:05d}.pt", weights_only=True) for r in range(4)]
    for r, (plain, zero) in enumerate(zip(finals[False], finals[True], strict=True)):
        assert plain.keys() == zero.keys() == prog.rank(r).shards.keys()
        for fqn in plain:
            start = prog.rank(r).shards[fqn].local(prog.params[fqn].detach())
            assert not torch.equal(plain[fqn], start), fqn  # the optimizer did move it
            assert (zero[fqn] - plain[fqn]).abs().max() <= 1e-12 * plain[fqn].abs().max(), fqn


@pytest.mark.slow
def test_compiled_ranks_match_one_device_in_float32() -> None:
    """compile=True: tp=2 × pp=2 Seq1F1B on HF GPT-2 through torch.compile, float32 parity."""
    kwargs = {**SEQ, "tp": 2, "pp": 2, "seq_chunks": 2, "microbatches": 2}
    report = verify(LONG["hf_gpt2"], dtype="float32", compile=True, timeout_s=600, **kwargs)
    assert report.ok, str(report)


@pytest.mark.slow
def test_compiled_checkpointed_ranks_match_one_device_in_float32() -> None:
    """compile=True with full recomputation: torch.compile traces each checkpointed region
    (torch.utils.checkpoint as a higher-order op); pp=2 Seq1F1B on nanoGPT, float32 parity."""
    kwargs = {**SEQ, "pp": 2, "seq_chunks": 2, "microbatches": 2, "recompute": "full"}
    report = verify(LONG["nanogpt"], dtype="float32", compile=True, timeout_s=600, **kwargs)
    assert report.ok, str(report)


def test_forked_ranks_never_collect_what_they_inherited(tmp_path: Path) -> None:
    """launch_forked collects this process's garbage before forking, and each rank freezes
    what it inherited: a rank collecting an inherited cycle that holds a gloo group hung in the
    collector (4 of 4 runs of the checkpoint tests after in-process DTensor tests; 0 of 3
    since). Checked here as that invariant: garbage made just before the launch is gone, and
    every rank starts with the inherited objects frozen."""
    import gc

    script = tmp_path / "gc.py"
    script.write_text("import gc\nprint('frozen', gc.get_freeze_count() > 1000, flush=True)\n")
    gc.disable()
    try:
        cycle: list = []
        cycle.append(cycle)
        alive = weakref.ref(cycle_holder := Holder(cycle))
        del cycle, cycle_holder
        out = launch_forked(2, [str(script)], timeout_s=60)
    finally:
        gc.enable()
    assert out.count("frozen True") == 2, out
    assert alive() is None


class Holder:
    """A weakly referable object kept alive only by a cycle."""

    def __init__(self, cycle: list) -> None:
        self.cycle = cycle
        cycle.append(self)


def test_a_failing_forked_rank_stops_the_others_and_says_why(tmp_path: Path) -> None:
    """launch_forked: rank 1 fails while rank 0 waits for it in a barrier (which then fails
    too), or while rank 0 is busy where it cannot notice (a sleep). Either way rank 0 is not
    left to its 100 s timeout, the error quotes rank 1's message, and a rank that had to be
    stopped is named with where it was (its stack, printed by faulthandler on SIGUSR1)."""
    for rank0 in ("dist.barrier()", "time.sleep(100)"):
        script = tmp_path / "fails.py"
        script.write_text(
            "import os, sys, time, datetime\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=100))\n"
            "if dist.get_rank() == 1:\n"
            "    print('autopart run: error: rank 1 gave up', file=sys.stderr, flush=True)\n"
            "    sys.exit(3)\n"
            f"{rank0}\n"
        )
        start = time.monotonic()
        with pytest.raises(AutopartError) as err:
            launch_forked(2, [str(script)], timeout_s=100)
        message = err.value.message
        assert "2 forked ranks failed (exit 3):" in message and "rank 1 gave up" in message
        assert time.monotonic() - start < 60, message
        stopped = f'rank 0 was stopped in "{script}", line 7' in message
        assert stopped == (rank0 == "time.sleep(100)"), message


@pytest.mark.slow  # 8 ranks through three paths; the pp=2 tie runs by default
@pytest.mark.multirank
def test_a_pp4_tie_creates_the_same_groups_on_every_path(tmp_path) -> None:
    """The deep nanoGPT on pp=4 ties its embedding across stages 0 and 3: the middle ranks
    hold no tied parameter, yet must create the tie groups too. The saved path (two checks in
    one torchrun launch: the second check's groups pair up only if the first's did; the ranks
    used to pass only their own ties) and the forked verifier now take the whole pipeline's
    ties (``Program.pipeline_ties``, saved in plan.json); the live path is the test above."""
    from parity_cases import NANO_DEEP

    from autopart import Mesh, parallelize
    from autopart.frontend.spec import build
    from autopart.parity.verify import Check, verify_many

    model, batch = build(NANO_DEEP)
    program = parallelize(model, Mesh(pp=4), batch, microbatches=4)
    assert program.pipeline_ties and all(v == [0, 3] for v in program.pipeline_ties.values())
    assert not program.rank(1).ties  # a middle stage holds none of them
    program.save(tmp_path / "p")
    head = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert head["ties"] == program.pipeline_ties
    checks = {
        "1f1b": Check(NANO_DEEP, pp=4, microbatches=4),
        "gpipe": Check(NANO_DEEP, pp=4, microbatches=4, schedule="gpipe"),
    }
    for via in ("torchrun", "fork"):
        for name, report in verify_many(checks, timeout_s=120, via=via).items():
            assert not isinstance(report, Exception) and report.ok, (via, name, str(report))


@pytest.mark.multirank
def test_ranks_out_of_step_are_refused_naming_each_other() -> None:
    """tests/out_of_step_script.py on 2 ranks: calls that differ (evaluate against step, a
    full_state_dict on rank 0 alone, another model, a share that does not split, a skipped
    optimizer step, a destroyed group) are refused on the ranks that wait, naming the other rank and where it is, after
    ``timeout_s`` at most and with nothing left pending (they aborted, hung, or overwrote a
    model silently)."""
    start = time.monotonic()
    out = launch_forked(2, [str(ROOT / "tests" / "out_of_step_script.py")], timeout_s=150)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith('{"rank"')]
    assert sorted(d["rank"] for d in lines) == [0, 1], out
    for d in lines:
        me, other = d["rank"], 1 - d["rank"]
        calls = ("step", "evaluate")
        assert (
            f"at {calls[me]} (collective action 1), rank {other} is in {calls[other]}"
            in d["step_vs_evaluate"]
        ), d
        assert f"rank {other} is in parallelize with another model" in d["models"], d
        assert "43,296 values" in d["models"] and "30,592 values" in d["models"], d
        who = "this rank" if me == 1 else "rank 1"
        assert f"{who} passed a dp share of 3 rows (local=True)" in d["share"], d
        assert "the weights of rank 1 differ from those of rank 0" in d["drift"], d
        assert "after the process group was destroyed" in d["destroyed"], d
    (rank0,) = [d for d in lines if d["rank"] == 0]
    assert "waited 3 s at full_state_dict" in rank0["alone"], rank0
    assert "rank 1 last came to step (action 1)" in rank0["alone"], rank0
    assert 2.5 < rank0["alone_s"] < 20, rank0  # its own timeout, not gloo's 30 minutes
    assert time.monotonic() - start < 150
