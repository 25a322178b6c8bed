"""Starting and stopping ranks (``autopart/runtime/launch.py``), checks before any rank is
spawned (``autopart run``), and copies of a parameter that must agree
(``autopart/runtime/copies.py``). Real torchrun and gloo processes; nothing is mocked."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from autopart import AutopartError, Mesh, parallelize
from autopart.runtime.copies import fingerprint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import nanogpt  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """nanoGPT on dp=2, saved."""
    model, batch = nanogpt.make()
    folder = tmp_path_factory.mktemp("launch") / "prog"
    parallelize(model, Mesh(dp=2), batch, microbatches=2).save(folder)
    return folder


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autopart", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _run_long(folder: Path, **popen: Any) -> subprocess.Popen:
    """``autopart run folder`` for more steps than any test waits for, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "autopart", "run", str(folder), "--steps", "100000"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        **popen,
    )


def _processes_naming(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line names ``marker``."""
    found = []
    for e in os.listdir("/proc"):
        if not e.isdigit() or int(e) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{e}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{e}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(int(e))
    return found


@pytest.mark.multirank
@pytest.mark.parametrize(  # SIGTERM under -m slow: the default run stays under 10 minutes
    "sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGINT]
)
def test_a_signal_to_autopart_run_stops_every_rank(saved: Path, tmp_path: Path, sig) -> None:
    """SIGTERM (or Ctrl-C's SIGINT) to ``autopart run`` stops torchrun and every rank: none is
    alive 5 s after the launcher exits (they used to train on, their parent PID 1), and none
    left a file in /dev/shm. A Ctrl-C ends it as docs/cli.md says, exit 130 and
    ``autopart run: interrupted: ...`` (it was exit 2 and "error: stopped by SIGINT"); a SIGTERM
    is an error (exit 2). Neither prints torchrun's traceback (its SignalException's was)."""
    folder = tmp_path / "prog"
    subprocess.run(["cp", "-r", str(saved), str(folder)], check=True)  # a unique marker
    # as from a terminal: a test runner's worker may ignore SIGINT, and its children with it
    proc = _run_long(
        folder,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    seen = ""
    while "loss" not in seen and time.monotonic() < deadline:  # training has started
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    assert "loss" in seen, seen
    ranks = _processes_naming(str(folder))
    assert len(ranks) >= 3, ranks  # torchrun and two ranks
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    left, until = _processes_naming(str(folder)), time.monotonic() + 5
    while left and time.monotonic() < until:  # ranks still stopping: at most 5 s more
        time.sleep(0.2)
        left = _processes_naming(str(folder))
    assert left == [], seen + out
    last = out.strip().splitlines()[-1]
    if sig == signal.SIGINT:
        assert proc.returncode == 130, out
        assert last == "autopart run: interrupted: the 2 ranks were stopped too", out
    else:
        assert proc.returncode == 2, out
        assert last == "autopart run: error: stopped by SIGTERM: the 2 ranks were stopped too", out
    assert "Traceback" not in out and "SignalException" not in out, out
    mine = [p for p in os.listdir("/dev/shm") if any(f"autopart-{r}-" in p for r in ranks)]
    assert mine == []


def test_ranks_that_failed_are_one_line_of_the_agent_not_torchruns_traceback() -> None:
    """torchrun's ChildFailedError (a traceback through its frames and a box) is one line from
    ``autopart.runtime.agent``: the rank that failed first, its process and how it ended."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from autopart.runtime.agent import failure_line

    killed = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file="<N/A>")
    exc = ChildFailedError("autopart.runtime.run", {1: killed})
    assert failure_line(exc) == "torchrun: rank 1 (process 4242) was killed by SIGKILL"
    other = ProcessFailure(local_rank=0, pid=4241, exitcode=2, error_file="<N/A>")
    other.timestamp = killed.timestamp + 1
    exc = ChildFailedError("autopart.runtime.run", {0: other, 1: killed})
    assert failure_line(exc).endswith("was killed by SIGKILL (1 more rank failed)")


def _holding(folder: Path) -> subprocess.Popen:
    """Another process that holds the checkpoint folder ``folder`` (``dirlock.claim``)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from autopart.runtime import dirlock; "
            "f = dirlock.claim(sys.argv[1]); print('held', flush=True); time.sleep(300)",
            str(folder),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.multirank
def test_a_checkpoint_folder_another_run_holds_is_refused(saved: Path, tmp_path: Path) -> None:
    """Two runs saving into one --checkpoint-dir at once both exited 0, the second having
    replaced the first's steps. Rank 0 now holds the folder (flock on .autopart.lock) for the
    whole run: the launcher refuses a held folder before any rank starts, and so does rank 0
    itself (a torchrun started by hand), naming the folder and the holder's process. The
    kernel releases the lock with the holder, however it ends: after a kill -9 the folder is
    free again."""
    from autopart.parity.verify import launch_forked
    from autopart.runtime import dirlock

    ck = tmp_path / "ck"
    holder = _holding(ck)
    try:
        want = f"the checkpoint folder {ck} is in use by another run (process {holder.pid} on "
        with pytest.raises(AutopartError) as err:
            dirlock.claim(ck)
        assert want in err.value.message, err.value.message
        r = _cli("run", str(saved), "--steps", "1", "--checkpoint-dir", str(ck))
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"autopart run: error: {want}" in r.stderr and "launching" not in r.stdout
        argv = ["-m", "autopart.runtime.run", str(saved), "--steps", "1", "--checkpoint-dir"]
        with pytest.raises(AutopartError) as err:
            launch_forked(2, [*argv, str(ck)], timeout_s=60)
        assert want in str(err.value), err.value
        assert not any(p.name.startswith("step") for p in ck.iterdir())  # nothing saved
    finally:
        holder.kill()
        holder.wait()
    dirlock.claim(ck).close()  # free again once the holder is gone


def test_a_ctrl_c_while_autopart_run_imports_ends_it_in_one_line(saved: Path) -> None:
    """SIGINT to ``autopart run`` while it still imports torch: exit 130 and "autopart:
    interrupted", no traceback, nothing launched (it printed a KeyboardInterrupt traceback
    through torch's import, and once a dropped one let the launch train every step)."""
    proc = _run_long(
        saved,
        stderr=subprocess.PIPE,
        # as from a terminal: a test runner's worker may ignore SIGINT, and its children with it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(0.4)  # the interpreter is up; torch takes seconds to import
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert err.strip() in ("autopart: interrupted", "autopart run: interrupted"), err
    assert "launching" not in out and _processes_naming(str(saved)) == []


def test_a_sigint_is_counted_and_the_cli_imports_stop_at_once(monkeypatch) -> None:
    """``process.interrupts`` counts every SIGINT, also one whose KeyboardInterrupt C code
    cleared (``launch`` reads it around torchrun's start). While the command line imports
    torch, a SIGINT exits on the spot instead: a KeyboardInterrupt raised inside a callback
    torch's C++ import runs aborted the process (status -6, a C++ ``terminate``) in CI. The
    handler is in place exactly during the imports and the counting one is back after."""
    import types

    import autopart.__main__
    from autopart import process
    from autopart.__main__ import run

    before = process.interrupts()
    # the handler autopart installs at import where Python's own is (a test runner's worker
    # may ignore SIGINT instead)
    old = signal.signal(signal.SIGINT, process.counting)
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert process.interrupts() == before + 1
        during = []
        cli = types.ModuleType("autopart.cli")  # records the handler while it is imported
        cli.__getattr__ = lambda name: during.append(signal.getsignal(signal.SIGINT)) or (lambda: 0)
        monkeypatch.setitem(sys.modules, "autopart.cli", cli)
        assert run() == 0
        assert during and all(h is autopart.__main__._stop_now for h in during), during
        assert signal.getsignal(signal.SIGINT) is process.counting
    finally:
        signal.signal(signal.SIGINT, old)
    stop = (  # the handler itself, in a process of its own: one line, 130, no traceback
        "import os, signal, time\n"
        "from autopart.__main__ import _stop_now\n"
        "signal.signal(signal.SIGINT, _stop_now)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", stop], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert r.returncode == 130 and r.stderr == "autopart: interrupted\n", r


@pytest.mark.multirank
def test_a_world_size_the_mesh_does_not_have_is_refused_before_any_rank(
    saved: Path, tmp_path: Path
) -> None:
    """plan.json saying world_size 8 for a mesh of 2 used to spawn 8 ranks first; the loader's
    schema now refuses it before anything starts, and so is a folder missing a rank's file."""
    folder = tmp_path / "prog"
    subprocess.run(["cp", "-r", str(saved), str(folder)], check=True)
    head = json.loads((folder / "plan.json").read_text())
    head["world_size"] = 8
    (folder / "plan.json").write_text(json.dumps(head))
    r = _cli("run", str(folder), "--steps", "1", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "world_size = 8 is not the mesh's 2" in r.stderr, r.stderr
    assert "launching" not in r.stdout  # nothing was spawned
    # a rank's files missing: every rank's program and files are checked before any starts
    # (a forged plan.json over one rank's files launched every rank it named)
    shutil.rmtree(folder)
    subprocess.run(["cp", "-r", str(saved), str(folder)], check=True)
    (folder / "rank00001" / "weights.pt").unlink()
    r = _cli("run", str(folder), "--steps", "1", timeout=60)
    assert r.returncode == 2 and "launching" not in r.stdout, r.stdout + r.stderr
    assert "rank00001/weights.pt, listed in plan.json, is missing" in r.stderr, r.stderr


@pytest.mark.multirank
def test_a_bad_flag_is_refused_once_before_launch(saved: Path) -> None:
    """A flag the plan cannot take (a batch dp × micro-batches does not divide) is refused by
    the launcher, once, not by every rank after torchrun started."""
    r = _cli("run", str(saved), "--steps", "1", "--batch-size", "3", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("batch size 3 is not divisible") == 1
    assert "launching" not in r.stdout


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--seq-len", "-4"], "argument --seq-len: must be a positive integer, not -4"),
        (["--seq-len", "0"], "argument --seq-len: must be a positive integer, not 0"),
        (["--batch-size", "x"], "argument --batch-size: must be a positive integer, not 'x'"),
        (["--lr", "-1"], "--lr -1.0 must be a finite number ≥ 0"),
        (["--lr", "nan"], "--lr nan must be a finite number ≥ 0"),
    ],
)
def test_counts_and_rates_are_refused_before_launch(
    saved: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    """``--seq-len -4`` reached every rank as a negative tensor size, ``--seq-len 0`` silently
    meant the example's length, and a negative learning rate was AdamW's error in every rank:
    each is refused by the launcher's parser or checks."""
    from autopart.layout import Plan
    from autopart.program.format import read_head
    from autopart.runtime.run import build_parser, check_args

    head = read_head(saved)
    try:
        args = build_parser().parse_args([str(saved), *flags])
    except SystemExit as exc:
        assert exc.code == 2 and said in capsys.readouterr().err
        return
    with pytest.raises(AutopartError, match=re.escape(said)):
        check_args(args, head, Plan.from_json(head["plan"]))


@pytest.mark.parametrize(
    ("flag", "kind", "said"),
    [
        ("--checkpoint-dir", "file", "is a file, not a folder to write"),
        ("--dump", "file", "is a file, not a folder to write"),
        ("--export", "folder", "is a folder, not a file to write"),
        ("--trace", "folder", "is a folder, not a file to write"),
    ],
)
def test_an_output_path_of_the_wrong_kind_is_refused_before_launch(
    saved: Path, tmp_path: Path, flag: str, kind: str, said: str
) -> None:
    """A checkpoint folder that is a file failed inside every rank; an --export path that is a
    folder failed in rank 0 after the whole run."""
    from autopart.layout import Plan
    from autopart.program.format import read_head
    from autopart.runtime.run import build_parser, check_args

    path = tmp_path / "out"
    path.write_text("x") if kind == "file" else path.mkdir()
    extra = [] if flag == "--checkpoint-dir" else ["--checkpoint-dir", str(tmp_path / "ck")]
    args = build_parser().parse_args([str(saved), flag, str(path), *extra])
    head = read_head(saved)
    with pytest.raises(AutopartError, match=f"{flag} {re.escape(str(path))} {said}"):
        check_args(args, head, Plan.from_json(head["plan"]))


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "--model", "examples/nanogpt.py:make", "--timeout", "nan"],
        ["verify", "--model", "examples/nanogpt.py:make", "--timeout", "-5"],
        ["inspect", "--model", "examples/nanogpt.py:make", "--seq-len", "-3"],
        ["demo", "--steps", "-1"],
        ["zoo", "--timeout", "0"],
        ["plan", "--shape", "gpt3-175b", "--gpus", "8", "--global-batch", "8", "--max-tp", "0"],
    ],
    ids=["verify-nan", "verify-negative", "inspect", "demo", "zoo", "plan"],
)
def test_every_command_refuses_a_count_or_timeout_no_run_can_take(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify --timeout nan`` raised a raw ValueError, ``--timeout -5`` failed inside the
    rank, ``inspect --seq-len -3`` printed a table for it, ``demo --steps -1`` compiled and
    launched four ranks that each refused, ``plan --max-tp 0`` silently meant the default:
    the parser refuses each (exit 2), before anything is captured."""
    from autopart.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "must be a positive" in capsys.readouterr().err


# -- copies agree ----------------------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.slow  # suite time (a damaged tied copy is refused by default, below)
def test_replicas_whose_weights_differ_are_refused(saved: Path, tmp_path: Path) -> None:
    """dp replicas whose weights differ (one replica's weights.pt changed in one element, the
    folder's hashes made consistent) used to train apart silently; now the run is refused
    before its first step, naming the parameter. (The live API broadcasts rank 0's model
    instead: tests/test_training_loop.py.)"""
    folder = tmp_path / "prog"
    subprocess.run(["cp", "-r", str(saved), str(folder)], check=True)
    target = folder / "rank00001" / "weights.pt"
    weights = torch.load(target, weights_only=True)
    name = "transformer.h.0.mlp.c_fc.weight"
    weights[name].view(-1)[5] += 1e-3
    torch.save(weights, target)
    head = json.loads((folder / "plan.json").read_text())
    head["files"]["rank00001/weights.pt"] = hashlib.sha256(target.read_bytes()).hexdigest()
    (folder / "plan.json").write_text(json.dumps(head))
    r = _cli("run", str(folder), "--steps", "1", timeout=120)
    assert r.returncode != 0
    assert f"parameter {name} differs between data-parallel replicas" in r.stdout + r.stderr


def test_fingerprints_see_every_bit_and_position() -> None:
    x = torch.randn(1000, dtype=torch.float64)
    same = x.clone()
    assert fingerprint(x) == fingerprint(same)
    flipped = x.clone()
    flipped.view(torch.int64)[17] ^= 1  # the last bit of one element
    assert fingerprint(flipped) != fingerprint(x)
    swapped = x.clone()
    swapped[[3, 4]] = x[[4, 3]]
    assert fingerprint(swapped) != fingerprint(x)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        t = torch.ones(5, dtype=dtype)
        assert fingerprint(t) == fingerprint(t.clone())


@pytest.mark.slow  # suite time: a saved program run by forked ranks (20-24 s)
@pytest.mark.multirank
def test_a_nan_in_one_copy_of_a_tied_weight_is_refused(tmp_path: Path) -> None:
    """A NaN in the last stage's copy of the tied embedding (a damaged weights.pt) used to train
    on with a finite loss; now the run is refused before its first step, naming the weight."""
    model, batch = nanogpt.make_deep()
    program = parallelize(model.double(), Mesh(pp=2), batch, microbatches=2)
    tied = sorted(program.rank(1).ties)
    assert tied, "the deep nanoGPT ties its embedding across the two stages"
    folder = tmp_path / "prog"
    program.save(folder)
    last = folder / "rank00001" / "weights.pt"
    weights = torch.load(last, weights_only=True)
    weights[tied[0]].view(-1)[0] = float("nan")
    torch.save(weights, last)
    head = json.loads((folder / "plan.json").read_text())
    head["files"]["rank00001/weights.pt"] = hashlib.sha256(
        last.read_bytes()
    ).hexdigest()  # a consistent, damaged folder
    (folder / "plan.json").write_text(json.dumps(head))
    r = _cli("run", str(folder), "--steps", "1", timeout=120)
    assert r.returncode != 0
    assert f"parameter {tied[0]} holds NaN or inf" in r.stdout + r.stderr


def test_a_rank_whose_launcher_died_while_it_started_stops(tmp_path: Path) -> None:
    """SIGKILL to torchrun while its ranks still imported torch left both ranks asleep in the
    rendezvous for 10 minutes, orphans: the kernel's parent-death signal, asked for in
    ``rank_setup``, is for a parent that dies after the request. A rank now compares its
    parent with the one it had when autopart was imported, and stops. Here the parent (the
    inner ``python -c``) exits half a second after it started the rank, which takes a second
    before ``rank_setup``."""
    marker = tmp_path / "alive"
    rank = (
        "import autopart, time; time.sleep(1.0); "
        "from autopart.runtime.launch import rank_setup; rank_setup(lambda: None); "
        f"open({str(marker)!r}, 'w').write('still running')"
    )
    parent = (  # the rank imports autopart (its parent still there), then the parent exits
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}]); "
        "time.sleep(0.5)"
    )
    subprocess.run([sys.executable, "-c", parent], check=True, timeout=60, cwd=ROOT)
    deadline = time.monotonic() + 60
    while _processes_naming(str(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_naming(str(marker)) and not marker.exists()


@pytest.mark.parametrize("kind", ["fifo", "hardlink"])
def test_a_lock_that_is_no_plain_file_of_its_own_is_refused(kind: str, tmp_path: Path) -> None:
    """The checkpoint folder's ``.autopart.lock`` as a FIFO gave a raw ``UnsupportedOperation``
    traceback on rank 0 (and the launcher's check skipped it); as a hard link to a file outside
    the folder, that file was truncated and overwritten with the process id. Both are refused,
    by the launcher's check and by the claim, and nothing is written."""
    from autopart.runtime import dirlock

    ck = tmp_path / "ck"
    ck.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me\n")
    if kind == "fifo":
        os.mkfifo(ck / ".autopart.lock")
    else:
        os.link(outside, ck / ".autopart.lock")
    for check in (dirlock.check_free, dirlock.claim):
        with pytest.raises(AutopartError) as err:
            check(ck)
        why = "not a regular file" if kind == "fifo" else "a hard link"
        assert f"lock {ck / '.autopart.lock'} is {why}" in err.value.message
    assert outside.read_text() == "keep me\n"
