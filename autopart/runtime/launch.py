"""Starting ranks, and stopping them: torchrun launches, forked ranks, and what a rank does
when its launcher goes away.

- ``launch(nproc, argv)``: torchrun on this machine (``autopart run``, ``verify``, ``demo``), as
  ``autopart.runtime.agent`` (torchrun, ending in one line instead of its tracebacks). The
  torchrun agent starts in its own process group and session, with a parent-death signal: a
  SIGTERM or SIGINT to the launching process is forwarded to it (it stops its ranks), and
  whatever is left of the group after a grace period is killed, also when the launcher itself
  fails. If the launcher is killed outright, the agent gets SIGTERM from the kernel. A SIGINT
  then raises ``KeyboardInterrupt("the N ranks were stopped too")`` (the command line prints
  ``autopart CMD: interrupted: ...`` and exits 130), a SIGTERM an ``AutopartError`` ("stopped
  by SIGTERM: ...", exit 2).
- ``rank_setup()``: called first thing in every rank's ``main``. The rank gets SIGTERM when
  the agent that started it dies (``PR_SET_PDEATHSIG``), and on SIGTERM or SIGINT it unlinks its
  shared-memory files and exits at once (exit status 128 + the signal).
- ``launch_forked(nproc, argv)`` and ``fork_ranks``'s helpers ``as_rank`` / ``wait_ranks``:
  ranks forked from this process with torchrun's environment, for tests and ``verify``.

No rank outlives the command that started it (``tests/test_launch.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from autopart.errors import AutopartError
from autopart.process import STARTED, interrupts

GRACE_S = 5.0  # after forwarding a signal, how long the ranks get before the group is killed
_PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for ``sig`` when this process's parent dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def rank_setup(cleanup: Callable[[], None]) -> None:
    """Every rank's first step: SIGTERM when the agent dies, and on SIGTERM / SIGINT run
    ``cleanup`` (unlink shared memory) and exit at once with 128 + the signal. A rank whose
    agent died before this (while it imported torch: the kernel's parent-death signal is only
    for a parent that dies after the request) exits at once too: it slept in the rendezvous
    for 10 minutes, an orphan."""
    _die_with_parent()

    def stop(signum: int, frame: Any) -> None:
        try:
            cleanup()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    pid, parent = STARTED
    if os.getpid() == pid and os.getppid() != parent:  # (a forked rank imported nothing)
        print(
            f"autopart: the launcher (pid {parent}) that started this rank is gone; stopping",
            file=sys.stderr,
        )
        stop(signal.SIGTERM, None)


class _Forward:
    """While in effect, SIGTERM and SIGINT to this process go to the launched process groups
    instead (each ``procs`` member leads its own group); ``received`` is the last one."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs, self.received = procs, 0
        self.old: dict[int, Any] = {}

    def __enter__(self) -> _Forward:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, self._forward)
        return self

    def _forward(self, signum: int, frame: Any) -> None:
        self.stop(signum)

    def stop(self, signum: int) -> None:
        """Send ``signum`` to the launched groups, and remember it."""
        self.received = signum
        _signal_groups(self.procs, signum)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def _signal_groups(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)


def _descendants(pids: list[int]) -> list[int]:
    """Every live process below ``pids`` (the ranks torchrun started in sessions of their
    own), read from /proc; empty where there is no /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, stack = [], list(pids)
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def _reap(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """End whatever is left of the launched agents and their ranks: SIGTERM, ``grace_s`` to
    go, then SIGKILL (ranks included, though they run in sessions of their own)."""
    live = [p for p in procs if p.poll() is None]
    ranks = _descendants([p.pid for p in procs])
    if not live and not ranks:
        return
    _signal_groups(live, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (
        any(p.poll() is None for p in live) or any(_alive(r) for r in ranks)
    ):
        time.sleep(0.05)
    _signal_groups([p for p in live if p.poll() is None], signal.SIGKILL)
    for r in ranks + _descendants([p.pid for p in live]):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(r, signal.SIGKILL)
    for p in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=grace_s)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_ranks(procs: list[Any], limit_s: float) -> int | None:
    """Wait for forked ranks; returns the rank that failed first (None: all exited 0). When
    one fails, the others get 2 s to notice and say why, then are stopped (as torchrun stops
    them); past ``limit_s`` every rank is stopped and this raises. Always joins them."""
    deadline = time.monotonic() + limit_s
    first: int | None = None
    failed_at = 0.0
    try:
        while any(p.exitcode is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise AutopartError(
                    f"the {len(procs)} forked ranks did not finish within {limit_s:.0f} s",
                    hint="a rank hangs",
                )
            if first is None:
                first = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
                failed_at = now
            if first is not None and now - failed_at > 2.0:
                break
            wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.2)
    finally:
        stopped = [p for p in procs if p.exitcode is None]
        for p in stopped:  # where each one was: its stack, into its own output
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGUSR1)
        if stopped:
            wait([p.sentinel for p in stopped], timeout=1.0)
        for p in stopped:
            if p.exitcode is None:
                p.kill()
            p.join()
        for p in procs:
            p.join()
    if first is None:
        first = next((r for r, p in enumerate(procs) if p.exitcode != 0), None)
    return first


def fork_context() -> Any:
    """The multiprocessing context that forks ranks from this process, once its garbage is
    collected and its output flushed. Garbage left to a forked rank is collected there, and a
    cycle holding a gloo group (DTensor keeps one after ``destroy_process_group``) then runs the
    group's destructor, which waits for worker threads that exist only in this process: seen as
    a rank hung in "Garbage-collecting" inside a checkpoint save, its peer timing out."""
    import multiprocessing

    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    return multiprocessing.get_context("fork")


def forked() -> None:
    """First thing in a forked rank: what it inherited is never garbage-collected in it (see
    ``fork_context``)."""
    gc.freeze()


def as_rank(rank: int, world: int, **env: str) -> None:
    """Make a forked process rank ``rank`` of ``world``: torchrun's variables (and ``env``),
    and one core's worth of threads (torchrun's OMP_NUM_THREADS=1). SIGUSR1 makes it print
    every thread's Python stack (``wait_ranks`` sends it to the ranks it stops)."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)  # fd 2: sys.stderr may be none
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        **env,
    )


def launch(
    nproc: int,
    argv: list[str],
    *,
    timeout_s: float | None = 300.0,
    stream: bool = False,
    nnodes: int = 1,
) -> str:
    """Run ``argv`` on ``nproc`` ranks with torchrun on this machine; returns rank output.

    ``timeout_s`` bounds each distributed wait; the whole launch gets 60 s more (None: no bound).
    ``nnodes > 1`` starts that many torchrun agents (``nproc / nnodes`` ranks each) that meet by
    c10d rendezvous on 127.0.0.1, as separate machines would.
    """
    if nproc % nnodes:
        raise AutopartError(
            f"{nproc} ranks do not split over {nnodes} nodes",
            hint="use a node count that divides the world size",
        )
    if nnodes == 1:
        where = [["--standalone", f"--nproc-per-node={nproc}"]]
    else:
        port = _free_port()
        where = [
            [
                f"--nnodes={nnodes}",
                f"--nproc-per-node={nproc // nnodes}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=autopart-{port}",
            ]
        ] * nnodes
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    limit = None if timeout_s is None else timeout_s + 60
    out = None if stream else subprocess.PIPE
    err = None if stream else subprocess.STDOUT
    procs: list[subprocess.Popen] = []
    seen = interrupts()
    try:
        for w in where:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "autopart.runtime.agent", *w, *argv],
                    env=env,
                    text=True,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,  # its own group: signals reach it, not the terminal's
                    preexec_fn=_die_with_parent,
                )
            )
        with _Forward(procs) as fwd:
            if interrupts() > seen:  # a SIGINT while torchrun started, dropped on its way
                fwd.stop(signal.SIGINT)
            try:
                outputs = [p.communicate(timeout=limit)[0] or "" for p in procs]
            except subprocess.TimeoutExpired as exc:
                raise AutopartError(
                    f"the {nproc} ranks did not finish within {exc.timeout:.0f} s",
                    hint="a rank hangs; rerun with a smaller --timeout to see which",
                ) from exc
    finally:
        _reap(procs)  # nothing outlives the launch, whatever ended it
    if fwd.received == signal.SIGINT:  # a Ctrl-C: the command line says "interrupted", 130
        raise KeyboardInterrupt(f"the {nproc} ranks were stopped too")
    if fwd.received:
        name = signal.Signals(fwd.received).name
        raise AutopartError(f"stopped by {name}: the {nproc} ranks were stopped too")
    code = max((p.returncode for p in procs), key=abs)
    output = "".join(outputs)
    if code != 0:
        raise _failed(f"torchrun with {nproc} ranks", code, output)
    return output


def _failed(what: str, code: int | None, output: str, where: Sequence[str] = ()) -> AutopartError:
    """The error of ranks that exited with ``code``: their error and hint lines (else the last
    25 lines), ``where`` the stopped ranks were, and where the whole output is kept."""
    lines = output.strip().splitlines()
    said = list(
        dict.fromkeys(x.strip() for x in lines if "autopart run: error" in x or "hint:" in x)
    )
    tail = "\n".join([*(said or lines[-25:]), *where]) or "(the ranks' output is above)"
    log = None
    if output:
        fd, log = tempfile.mkstemp(prefix="autopart-ranks-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(output)
    where = f"\n(full output of every rank: {log})" if log else ""
    return AutopartError(f"{what} failed (exit {code}):\n{tail}{where}")


def launch_forked(nproc: int, argv: list[str], *, timeout_s: float = 300.0) -> str:
    """``launch``'s counterpart without torchrun: ``nproc`` ranks forked from this process run
    ``argv`` (``["-m", module, ...]`` or ``[script.py, ...]``) as ``__main__``, with the
    environment torchrun would give them (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...). Real
    processes and real gloo groups, minus the start-up: no interpreter, torch or autopart import
    per rank. Returns the ranks' output (rank order); a failing rank stops the others, and the
    error quotes it as ``launch`` does. For what torchrun itself does (restarts, several
    agents), use ``launch``."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise AutopartError("cannot fork ranks from a process that has joined a process group")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="autopart-forked-") as tmp:
        logs = [Path(tmp) / f"rank{r:05d}.log" for r in range(nproc)]
        ctx = fork_context()
        procs = [
            ctx.Process(target=_forked_main, args=(r, nproc, port, argv, logs[r]), daemon=True)
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        first = wait_ranks(procs, timeout_s + 60)
        texts = [f.read_text(errors="replace") if f.exists() else "" for f in logs]
        # ranks that failed between two polls of wait_ranks: the first to fail by the clock
        # (each wrote when; a peer's failure follows, as a barrier's that lost it)
        when = {
            r: float(m.read_text()) for r in range(nproc) if (m := _failed_mark(logs[r])).exists()
        }
    if first is not None and when:
        first = min(when, key=when.__getitem__)
    if first is not None:  # the exit code of the rank that failed first
        where = [f"rank {r} was stopped in {at}" for r, t in enumerate(texts) if (at := _at(t))]
        raise _failed(f"{nproc} forked ranks", procs[first].exitcode, "".join(texts), where)
    return "".join(texts)


def _at(output: str) -> str | None:
    """Where a rank stopped by ``wait_ranks`` was: the innermost frames of the main thread's
    stack that faulthandler printed (None: it printed none)."""
    lines = output.splitlines()
    head = next((i for i, x in enumerate(lines) if x.startswith("Current thread")), None)
    if head is None:
        return None
    frames = []
    for x in lines[head + 1 :]:
        if not x.startswith("  File "):
            break
        frames.append(x.strip())
    return " ← ".join(f.removeprefix("File ") for f in frames[:4]) or None


def _forked_main(rank: int, nproc: int, port: int, argv: list[str], log: Path) -> None:
    """One forked rank: output to ``log``, torchrun's environment, ``argv`` run as __main__."""
    forked()
    import runpy
    import traceback
    import warnings

    code = 1
    out = open(log, "w", buffering=1)  # noqa: SIM115 - kept open until os._exit
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    try:
        as_rank(
            rank,
            nproc,
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_RESTART_COUNT="0",
        )
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed, as a rank's traceback would be
        traceback.print_exc()
    finally:
        if code != 0:  # when it failed, for launch_forked to tell which rank failed first
            _failed_mark(log).write_text(repr(time.monotonic()))
        out.flush()
        os._exit(code)


def _failed_mark(log: Path) -> Path:
    """Where a forked rank that failed writes when (``time.monotonic``, one clock for all)."""
    return log.with_suffix(".failed")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
