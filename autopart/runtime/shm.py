"""Shared-memory exchange for the collectives of ranks on one host (CPU tensors).

One job: give every rank of a group what every other rank put in, through memory they all map,
with no socket and no helper thread. The tensor-parallel collectives (``autopart.collectives``)
use it on gloo groups whose ranks share a host and ``/dev/shm``; everything else keeps c10d.

Layout, per rank (the *owner*): a control block of int64 fields (``SEQ``: the last exchange
whose data it has published; ``DONE``: the last exchange it has finished reading; ``GEN``:
which data file is current; ``TOKEN``: a random number checked by the peers at setup; ``ERR``:
1 + the rank whose failure stopped this one (itself, or the one a peer's ``ERR`` names);
``SIZE + h``: bytes and element size of what half ``h`` holds) and a data file of two halves.
Exchange ``k`` uses half ``k % 2``:

1. wait until every peer's ``DONE >= k - 2`` (nobody still reads this half), write the outgoing
   pieces and their size into it, then publish ``SEQ = k``;
2. wait until every peer's ``SEQ >= k``, check that each peer's size is ours (else every rank
   raises: the ranks run different programs), read the pieces addressed to us from each half;
3. after the caller has combined them into fresh tensors, publish ``DONE = k``.

The data is written before ``SEQ`` and read after it; x86-64 keeps stores in order and loads in
order, so a peer that sees ``SEQ = k`` sees the data (other architectures fall back to c10d).
The first data file is made at setup, a probe of ``/dev/shm``: if it cannot be reserved, every
rank of the group falls back to the socket transport, with a warning. A data file grows (a new
generation) when a message does not fit: the owner first waits until every peer has read
everything, and unlinks each file once every peer has mapped it, so ``/dev/shm`` keeps nothing
after the exchange that follows. Each generation's name ends in 62 random bits, published in
the control block (``NAME``) before ``GEN``, so another local user cannot plant the next file;
if one exists anyway the error says so. Files are named ``autopart-PID-*``: a rank killed before
it could unlink its files (torchrun's SIGTERM when another rank failed) leaves them, and the
next setup on the host (``sweep``) unlinks this user's files whose process is gone.

Files are named ``autopart-PID-nNS-*``, NS the inode of the creator's PID namespace: process
ids mean something only inside one namespace, and containers that share ``/dev/shm`` (IPC)
need not share PIDs. ``sweep`` touches only files of its own namespace; files of others are
never its to judge.

A waiting rank spins (yielding the core) for ``SPIN_S``, then sleeps in growing steps up to
0.5 ms; it spins only when the host has a core per local rank. Every wait ends at the
caller's timeout with an ``AutopartError`` naming the rank and the action. Every
``ALIVE_EVERY_S`` (0.25 s) of waiting it also checks that the peers it waits for still run,
so a peer that died outside an exchange, which set no flag, is named long before the timeout.
A peer in this rank's PID namespace is checked by its process id (from its file names): named
within a second, and only by it: a peer whose process exists is alive, also when it is paused
(SIGSTOP, a debugger) and its heartbeat stands still; it is named at the caller's timeout as
"has not answered for T s ... (paused or hung ...)". A peer in another PID namespace is
checked by its heartbeat: each rank's ``BEAT`` field is advanced every ``BEAT_S`` by a small
daemon thread of its group, and such a peer whose beat has not moved for ``STALE_S`` is dead. A rank that fails
inside an exchange (a timeout, a full ``/dev/shm``, a size mismatch) sets ``ERR``, so its peers
fail at once instead of waiting out their timeouts; a peer stopped that way passes the first
failing rank on in its own ``ERR``, so every rank names that one. A failed group refuses further
exchanges.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autopart.errors import AutopartError

SHM_DIR = "/dev/shm"
SEQ, DONE, GEN, TOKEN, ERR, SIZE, _SIZE1, NAME, BEAT = range(9)  # SIZE, SIZE + 1: per half
_CTL_BYTES = 128
_ALIGN = 64
_MIN_CAPACITY = 1 << 20  # bytes per half of a first data file
SPIN_S = 1e-3  # spin this long before sleeping (when every local rank has a core)
ALIVE_EVERY_S = 0.25  # while waiting, check this often that the peers' processes still live
BEAT_S = 0.1  # each rank advances its heartbeat this often
STALE_S = 10.0  # a peer in another PID namespace whose heartbeat stood this long is dead
NAP_S = (20e-6, 5e-4)  # then sleep, doubling from the first to at most the second


class PeerFailed(AutopartError):
    """This rank stopped because global rank ``origin`` failed in an exchange with it."""

    def __init__(self, rank: int, origin: int, what: str) -> None:
        super().__init__(
            f"rank {rank}: rank {origin} failed in an exchange with this one, during {what}",
            hint=f"rank {origin}'s own error says why",
        )
        self.origin = origin


def supported() -> bool:
    """Whether this host can use the shared-memory exchange at all."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:  # reserve the pages now: a full tmpfs fails here, not later with SIGBUS
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError:
        if create:
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def _data_path(prefix: str, gen: int, name: int) -> str:
    return f"{prefix}-{gen}-{name:016x}"


def _pid_of(prefix: str) -> int | None:
    """The process id in ``.../autopart-PID-...`` (None if the name has another form)."""
    parts = os.path.basename(prefix).split("-")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _namespace_of(prefix: str) -> int | None:
    """The PID namespace in ``.../autopart-PID-nNS-...``; None for a name without one (a file
    of an older autopart, or another form)."""
    parts = os.path.basename(prefix).split("-")
    tag = parts[2] if len(parts) >= 4 else ""
    return int(tag[1:]) if tag.startswith("n") and tag[1:].isdigit() else None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def sweep() -> list[str]:
    """Unlink this user's ``autopart-PID-*`` files, made in this PID namespace, whose process is
    gone (a rank killed before it could clean up); returns what was removed. Files made in
    another namespace are left alone: their PIDs mean nothing here."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    here = pid_namespace()
    for e in entries:
        pid = _pid_of(e.path) if e.name.startswith("autopart-") else None
        if pid is None or pid == os.getpid() or _namespace_of(e.path) not in (None, here):
            continue
        if alive(pid):
            continue
        try:
            if e.stat(follow_symlinks=False).st_uid == os.getuid():
                os.unlink(e.path)
                removed.append(e.path)
        except OSError:
            continue
    return removed


class ShmGroup:
    """The shared-memory exchange of one process group (build with ``ShmGroup.connect``)."""

    def __init__(self, group: Any, prefix: str) -> None:
        self.prefix, self.prefixes = prefix, [prefix]
        self.me, self.n = dist.get_rank(group), dist.get_world_size(group)
        self.rank, self.pid = dist.get_rank(), os.getpid()
        self.ranks = dist.get_process_group_ranks(group)  # group rank -> global rank
        self.timeout_s = 300.0  # set by each exchange
        self.failed = ""  # why an exchange on this group failed, once one has
        self._beat_stop: Any = None  # set to stop the heartbeat thread (``_start_heartbeat``)
        self.k = 0  # exchanges done
        self.ctl_map = _map(prefix + "-ctl", _CTL_BYTES, create=True)
        self.ctl = memoryview(self.ctl_map).cast("q")
        self.ctl[TOKEN] = secrets.randbits(62)
        self.peer_ctl: dict[int, memoryview] = {}
        self.cap = 0  # bytes per half of our data file
        self.data: torch.Tensor | None = None
        self.peer_data: dict[int, tuple[int, torch.Tensor]] = {}  # peer -> (generation, bytes)
        self.pending_unlink: list[tuple[int, str]] = []  # (exchange that must be read, path)
        self.pids: dict[int, int | None] = {}  # peer -> its process id (from its file names)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.n))
        self.spin_s = SPIN_S if local <= (cores or 1) else 0.0

    @classmethod
    def connect(cls, group: Any, wanted: bool = True) -> ShmGroup | None:
        """Set up the exchange on ``group`` (collective: every member calls it, also those that
        do not want it), or None when some member does not want it or cannot map the others'
        memory (another host, no shared ``/dev/shm``)."""
        prefix = f"{SHM_DIR}/autopart-{os.getpid()}-n{pid_namespace()}-{secrets.token_hex(6)}"
        me: ShmGroup | None = None
        info = None
        if wanted:
            sweep()
            try:
                me = cls(group, prefix)
                me._grow(0, 1, "the size probe at setup")  # the first data file, now (peers map
                # it in exchange 1, so it is unlinked in exchange 2)
                info = (prefix, me.ctl[TOKEN])
            except (OSError, AutopartError) as exc:
                warnings.warn(
                    f"rank {dist.get_rank()}: no shared-memory transport ({exc}); "
                    "the tp collectives use the socket transport",
                    stacklevel=2,
                )
                if me is not None:
                    me.close()
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(prefix + "-ctl")
                me = None
        try:
            return cls._agree(group, me, info)
        finally:
            if me is not None:  # every peer has mapped it, or none will use it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(prefix + "-ctl")

    @staticmethod
    def _agree(group: Any, me: ShmGroup | None, info: Any) -> ShmGroup | None:
        infos: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, info, group=group)
        ok = me is not None and all(i is not None for i in infos)
        if ok:
            assert me is not None
            try:
                for peer, (path, token) in enumerate(infos):
                    if peer != me.me:
                        ctl = memoryview(_map(path + "-ctl", _CTL_BYTES, create=False)).cast("q")
                        ok = ok and ctl[TOKEN] == token
                        me.peer_ctl[peer] = ctl
            except OSError:
                ok = False
        oks: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(oks, ok, group=group)
        if not all(oks):
            return None
        assert me is not None
        me.prefixes = [path for path, _ in infos]
        here = pid_namespace()
        me.pids = {  # a process id is only checked in the namespace it belongs to
            peer: _pid_of(path) if _namespace_of(path) == here else None
            for peer, (path, _) in enumerate(infos)
            if peer != me.me
        }
        me._start_heartbeat()
        return me

    def _start_heartbeat(self) -> None:
        """Advance ``BEAT`` every ``BEAT_S`` until ``close``: the liveness peers in other PID
        namespaces can see."""
        import threading

        stop = self._beat_stop = threading.Event()
        ctl = self.ctl

        def beat() -> None:
            while not stop.wait(BEAT_S):
                ctl[BEAT] += 1

        threading.Thread(target=beat, daemon=True, name="autopart-shm-beat").start()

    # -- the exchange ----------------------------------------------------------------------

    def exchange(
        self,
        outgoing: Sequence[torch.Tensor],
        combine: Callable[[list[torch.Tensor]], Any],
        what: str,
        timeout_s: float,
    ) -> Any:
        """Send ``outgoing[i]`` to group rank i; ``combine`` gets, in rank order, what each rank
        sent us (our own entry: ``outgoing[me]``) and must return fresh tensors. ``what`` names
        the collective and the action in errors."""
        if self.failed:
            raise AutopartError(
                f"rank {self.rank}: {what} on a group whose exchange failed before",
                hint=self.failed,
            )
        self.timeout_s = timeout_s
        try:
            return self._exchange(outgoing, combine, what)
        except BaseException as exc:
            self.failed = f"the first failure: {exc}"
            # the peers stop waiting for us; they name the rank that failed first, even when
            # they see our flag before that rank's
            self.ctl[ERR] = 1 + (exc.origin if isinstance(exc, PeerFailed) else self.rank)
            raise

    def _exchange(
        self,
        outgoing: Sequence[torch.Tensor],
        combine: Callable[[list[torch.Tensor]], Any],
        what: str,
    ) -> Any:
        k = self.k = self.k + 1
        same = all(t is outgoing[0] for t in outgoing)
        pieces = [outgoing[0]] if same else list(outgoing)
        nbytes = [t.numel() * t.element_size() for t in pieces]
        offsets, total = [], 0
        for nb in nbytes:
            offsets.append(total)
            total += _aligned(nb)
        sent = sum(nbytes)  # without the alignment padding
        if self.data is None or total > self.cap:
            self._grow(total, k, what)
        self._await(DONE, k - 2, what)
        half = self._half(self.data, self.cap, k)
        for t, off, nb in zip(pieces, offsets, nbytes, strict=True):
            half[off : off + nb].view(t.dtype).view(t.shape).copy_(t)
        size = sent << 8 | outgoing[0].element_size()
        self.ctl[SIZE + k % 2] = size
        self.ctl[SEQ] = k
        self._await(SEQ, k, what)
        self._unlink_read(k - 1)  # a peer at SEQ k is done with k - 1
        for peer, ctl in self.peer_ctl.items():
            if ctl[SIZE + k % 2] != size:
                theirs = ctl[SIZE + k % 2]
                raise AutopartError(
                    f"rank {self.rank}: in {what}, rank {self.ranks[peer]} sent {theirs >> 8} bytes "
                    f"of {theirs & 255}-byte elements where this rank sent {sent} of "
                    f"{size & 255}: the ranks run different programs or shapes",
                    hint="every rank of a group must run the same program on equal shapes",
                )
        mine = outgoing[self.me]
        off = 0 if same else offsets[self.me]
        nb = mine.numel() * mine.element_size()
        got = []
        for peer in range(self.n):
            if peer == self.me:
                got.append(mine)
                continue
            cap, data = self._peer(peer)
            got.append(self._half(data, cap, k)[off : off + nb].view(mine.dtype).view(mine.shape))
        out = combine(got)
        self.ctl[DONE] = k
        return out

    @staticmethod
    def _half(data: torch.Tensor | None, cap: int, k: int) -> torch.Tensor:
        assert data is not None
        return data[(k % 2) * cap : (k % 2 + 1) * cap]

    def _grow(self, need: int, k: int, what: str) -> None:
        self._await(DONE, k - 1, what)  # nobody reads our old file any more
        self._unlink_read(k - 1)
        cap = max(_MIN_CAPACITY, _aligned(need), 2 * self.cap)
        gen, name = self.ctl[GEN] + 1, secrets.randbits(62)  # a name nobody can plant first
        path = _data_path(self.prefix, gen, name)
        try:
            mm = _map(path, 2 * cap, create=True)
        except FileExistsError as exc:
            raise AutopartError(
                f"rank {self.rank}: {path} already exists, made by another process, in {what}",
                hint=f"another user or job writes autopart-* files into {SHM_DIR}; give this job "
                "its own /dev/shm, or set AUTOPART_SHM=0 to use c10d",
            ) from exc
        except OSError as exc:
            raise AutopartError(
                f"rank {self.rank}: cannot reserve {2 * cap / 2**20:.1f} MiB in {SHM_DIR} for {what}: {exc}",
                hint="free space in /dev/shm (docker: --shm-size), or set AUTOPART_SHM=0 to use c10d",
            ) from exc
        self.data = torch.frombuffer(mm, dtype=torch.uint8)
        self.cap = cap
        self.ctl[NAME] = name  # before GEN: a peer that sees the new GEN sees its name
        self.ctl[GEN] = gen
        self.pending_unlink.append((k, path))

    def _peer(self, peer: int) -> tuple[int, torch.Tensor]:
        gen = self.peer_ctl[peer][GEN]
        if peer not in self.peer_data or self.peer_data[peer][0] != gen:
            path = _data_path(self.prefixes[peer], gen, self.peer_ctl[peer][NAME])
            mm = _map(path, 0, create=False)
            self.peer_data[peer] = (gen, torch.frombuffer(mm, dtype=torch.uint8))
        data = self.peer_data[peer][1]
        return data.numel() // 2, data

    def _unlink_read(self, k: int) -> None:
        """Unlink our data files that every peer has read (and so mapped) by exchange ``k``."""
        keep = []
        for since, path in self.pending_unlink:
            if since <= k:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            else:
                keep.append((since, path))
        self.pending_unlink = keep

    def _await(self, field: int, target: int, what: str) -> None:
        if target <= 0:
            return
        peers = list(self.peer_ctl.items())
        start = time.monotonic()
        nap, longest = NAP_S
        checked = start
        beats = {peer: (c[BEAT], start) for peer, c in peers}  # the last beat seen, and when
        while any(c[field] < target for _, c in peers):
            for _, c in peers:
                if c[ERR]:
                    raise PeerFailed(self.rank, c[ERR] - 1, what)
            now = time.monotonic()
            if now - checked > ALIVE_EVERY_S:  # a peer killed outside an exchange sets no ERR
                checked = now
                for peer, c in peers:
                    if c[BEAT] != beats[peer][0]:
                        beats[peer] = (c[BEAT], now)
                    if c[field] < target:
                        self._check_alive(peer, now - beats[peer][1], now - start, what)
            waited = now - start
            if waited < self.spin_s:
                os.sched_yield()
                continue
            late = next((peer for peer, c in peers if c[field] < target), None)
            if waited > self.timeout_s and late is not None:
                raise self._silent(late, now - beats[late][1], what)
            time.sleep(nap)
            nap = min(2 * nap, longest)

    def _check_alive(self, peer: int, quiet_s: float, waited_s: float, what: str) -> None:
        """Raise if ``peer``, whose heartbeat has not moved for ``quiet_s``, is dead: by its
        process where its id means something here (a process that exists but is paused, by
        SIGSTOP or a debugger, is alive: it is named only at the timeout, by ``_silent``), by
        its heartbeat (``STALE_S``) where it ran in another PID namespace."""
        pid = self.pids.get(peer)
        if pid is not None and alive(pid):
            return
        if pid is None and quiet_s <= STALE_S:
            return
        how = f"process {pid}" if pid is not None else f"no heartbeat for {quiet_s:.0f} s"
        raise AutopartError(
            f"rank {self.rank}: rank {self.ranks[peer]} ({how}) died; "
            f"noticed {waited_s:.2f} s into {what}",
            hint=f"rank {self.ranks[peer]}'s log says why it ended",
        )

    def _silent(self, peer: int, quiet_s: float, what: str) -> AutopartError:
        """The timeout of a wait for ``peer``, alive but silent: paused or hung."""
        r, pid = self.ranks[peer], self.pids.get(peer)
        who = f"rank {r} (process {pid})" if pid is not None else f"rank {r}"
        if quiet_s > 2 * ALIVE_EVERY_S + BEAT_S:
            state = f"paused or hung: its heartbeat stopped {quiet_s:.0f} s ago"
        else:
            state = "its heartbeat runs: hung elsewhere, or far behind"
        where = f", or py-spy dump --pid {pid}," if pid is not None else ""
        return AutopartError(
            f"rank {self.rank}: {who} has not answered for {self.timeout_s:.0f} s during "
            f"{what} ({state})",
            hint=f"rank {r} was paused (SIGSTOP, a debugger) or is stuck; its output{where} "
            "says where it is; a longer --timeout waits for it (shared-memory exchange)",
        )

    def close(self) -> None:
        """Unlink what is still linked (the files stay mapped by whoever uses them); only in the
        process that made them (not in a forked child)."""
        if os.getpid() != self.pid:
            return
        if self._beat_stop is not None:
            self._beat_stop.set()
        for _, path in self.pending_unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.pending_unlink = []
