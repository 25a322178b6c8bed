"""Compile once, hand the program over: the live API's ranks get rank 0's compiled program.

``parallelize(model, live_mesh)`` used to capture and compile the whole model on every rank (each
rank paying the whole compile, all at once on the same cores). Now global rank 0 compiles and
saves the program into a private temporary folder (``Program.save``, the format ``autopart run``
loads); every other rank r receives ``plan.json`` and its own ``rank<r>`` files from rank 0 (point
to point, as bytes: nothing is pickled), writes them into its own temporary folder and loads its
rank with the same checked loader ``autopart run`` uses (``load_rank`` / ``load_weights``: the
SHA-256 of every file checked against plan.json, schemas, no code run).

Data enters as rank 0's compile (``compiled_on_rank_zero``: its ``Program``, or the error it
raised, which every rank then raises, naming rank 0); it leaves as this rank's
``(RankProgram, weights, head)``. Every wait has ``timeout_s`` and names the rank and what it
waited for. A compile may take longer than ``timeout_s`` (a deep model: minutes): while it runs,
a thread of rank 0 tells the others every ``BEAT_S`` seconds that it still is, so what
``timeout_s`` bounds is rank 0's silence, not the compile.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopart.errors import AutopartError, wait
from autopart.program.folder import NAMES, ProgramFolder, rank_dir
from autopart.program.format import load_rank, load_weights, read_head

_MAX_FILE = 1 << 40  # a received file's bound: the folder's own checks bound each kind further
BEAT_S = 5.0  # while rank 0 compiles, it tells the other ranks so this often
NOTE_S = 30.0  # the other ranks log that they wait for it so often
_STILL, _DONE, _FAILED = 0, 1, 2  # a beat: compiling, compiled, or the compile raised
log = logging.getLogger("autopart")


def compiled_on_rank_zero(compile_program: Callable[[], Any], timeout_s: float) -> Any:
    """Rank 0 runs ``compile_program()`` and returns its ``Program`` (other ranks: None), every
    rank at once. Meanwhile a thread of rank 0 broadcasts a beat every ``BEAT_S`` seconds, and
    the other ranks wait for each at most ``timeout_s``: a compile may take minutes, but a
    rank 0 that died or hangs outside it is named within ``timeout_s``. When the compile
    raises (or is interrupted), rank 0 raises it and every other rank an ``AutopartError``
    quoting it."""
    rank = dist.get_rank()
    if rank == 0:
        done, failed = threading.Event(), threading.Event()
        beats = _Beats(done, failed, timeout_s)
        beats.start()
        try:
            program = compile_program()
        except BaseException as exc:  # Ctrl-C too: the others hear it failed, and raise
            failed.set()
            done.set()
            beats.join()
            if beats.error is None:
                text = f"{type(exc).__name__}: {exc}".encode()
                _broadcast_bytes(text, rank, "the other ranks to take its compile error", timeout_s)
            raise
        done.set()
        beats.join()
        if beats.error is not None:  # a peer died while rank 0 compiled
            raise beats.error
        return program
    start, code, note = time.monotonic(), _STILL, NOTE_S
    while code == _STILL:
        beat = torch.tensor([-1], dtype=torch.int64, device=_device())
        _wait(dist.broadcast(beat, src=0, async_op=True), rank, "rank 0's compile", timeout_s)
        code = int(beat.item())
        if code == _STILL and time.monotonic() - start >= note:
            log.info("rank %d: rank 0 is still compiling (%.0f s)", rank, note)
            note += NOTE_S
    if code == _FAILED:
        message = _broadcast_bytes(None, rank, "rank 0's compile error", timeout_s)
        raise AutopartError(f"rank {rank}: rank 0 could not compile the model: {message.decode()}")
    return None


class _Beats(threading.Thread):
    """Rank 0's beats: ``_STILL`` every ``BEAT_S`` seconds until ``done``, then ``_DONE`` (or
    ``_FAILED``). A broadcast that fails (a peer died) ends the beats; ``error`` keeps it."""

    def __init__(self, done: threading.Event, failed: threading.Event, timeout_s: float) -> None:
        super().__init__(name="autopart-compile-beats", daemon=True)
        self.done, self.failed, self.timeout_s = done, failed, timeout_s
        self.error: AutopartError | None = None
        self.device = _device()

    def run(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)
        try:
            while True:
                finished = self.done.wait(BEAT_S)
                code = (_FAILED if self.failed.is_set() else _DONE) if finished else _STILL
                beat = torch.tensor([code], dtype=torch.int64, device=self.device)
                work = dist.broadcast(beat, src=0, async_op=True)
                _wait(work, 0, "the other ranks to hear that rank 0 compiles", self.timeout_s)
                if finished:
                    return
        except AutopartError as exc:
            self.error = exc


def hand_over(
    program: Any, timeout_s: float, library_ops: Sequence[str] = ()
) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's program, weights and plan.json head, from global rank 0's ``program``
    (``compiled_on_rank_zero``'s; other ranks pass ``None``). Every rank calls it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory(prefix="autopart-handover-") as tmp:
        folder = Path(tmp)
        if rank == 0:
            program.save(folder)
            for peer in range(1, world):
                _send(_pack(folder, peer), peer, rank, timeout_s)
        else:
            _unpack(_recv(rank, timeout_s), folder, rank)
        head = read_head(folder, rank)
        rp = load_rank(folder, rank, library_ops, head)  # the namespaces its caller trusts
        weights = load_weights(folder, rank, rp, head)
    return rp, weights, head


def _device() -> torch.device | None:
    """NCCL moves device tensors only: the bytes travel through the GPU there."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _wait(work: Any, rank: int, what: str, timeout_s: float) -> None:
    wait(work, rank, f"waiting for {what}", timeout_s)


def _pack(folder: Path, peer: int) -> bytes:
    """plan.json and ``peer``'s files as one blob: a JSON index (names, sizes), then the bytes."""
    names = ["plan.json"] + sorted(
        f"{rank_dir(peer)}/{p.name}" for p in (folder / rank_dir(peer)).iterdir()
    )
    blobs = [(folder / n).read_bytes() for n in names]
    index = json.dumps([[n, len(b)] for n, b in zip(names, blobs, strict=True)]).encode()
    return len(index).to_bytes(8, "little") + index + b"".join(blobs)


def _unpack(data: bytes, folder: Path, rank: int) -> None:
    """Write the blob's files into ``folder``: only plan.json and this rank's own files."""
    try:
        size = int.from_bytes(data[:8], "little")
        index = json.loads(data[8 : 8 + size])
        pos = 8 + size
        with ProgramFolder(folder) as out:
            for name, n in index:
                ok = isinstance(name, str) and (
                    name == "plan.json" or name.startswith(rank_dir(rank) + "/")
                )
                if not (
                    ok and NAMES.fullmatch(name) and isinstance(n, int) and 0 <= n <= _MAX_FILE
                ):
                    raise ValueError(f"unexpected entry {name!r}")
                chunk = data[pos : pos + n]
                out.write_bytes(name, chunk)
                pos += n
        if pos != len(data):
            raise ValueError("trailing bytes")
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        raise AutopartError(
            f"rank {rank}: the program received from rank 0 is malformed: {exc}"
        ) from exc


def _send(data: bytes, peer: int, rank: int, timeout_s: float) -> None:
    device = _device()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    what = f"rank {peer} to receive its program"
    _wait(dist.isend(size, dst=peer), rank, what, timeout_s)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device or "cpu")
    _wait(dist.isend(payload, dst=peer), rank, what, timeout_s)


def _recv(rank: int, timeout_s: float) -> bytes:
    device = _device()
    size = torch.zeros(1, dtype=torch.int64, device=device)
    # rank 0 compiles the whole model first: the first message waits for that
    _wait(dist.irecv(size, src=0), rank, "rank 0's compiled program", timeout_s)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _wait(dist.irecv(payload, src=0), rank, "rank 0's compiled program", timeout_s)
    return payload.cpu().numpy().tobytes()


def _broadcast_bytes(data: bytes | None, rank: int, what: str, timeout_s: float) -> bytes:
    device = _device()
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    _wait(dist.broadcast(size, src=0, async_op=True), rank, what, timeout_s)
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device or "cpu")
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _wait(dist.broadcast(buf, src=0, async_op=True), rank, what, timeout_s)
    return buf.cpu().numpy().tobytes()
