"""Compile once, hand the program over: the live API's ranks get rank 0's compiled program.

``parallelize(model, live_mesh)`` used to capture and compile the whole model on every rank (each
rank paying the whole compile, all at once on the same cores). Now global rank 0 compiles and
saves the program into a private temporary folder (``Program.save``, the format ``autopart run``
loads); every other rank r receives ``plan.json`` and its own ``rank<r>`` files from rank 0 (point
to point, as bytes: nothing is pickled), writes them into its own temporary folder and loads its
rank with the same checked loader ``autopart run`` uses (``load_rank`` / ``load_weights``: the
SHA-256 of every file checked against plan.json, schemas, no code run).

Data enters as rank 0's ``Program`` (or the ``AutopartError`` its compile raised, which every
rank then raises, naming rank 0); it leaves as this rank's ``(RankProgram, weights, head)``.
Every wait has ``timeout_s`` and names the rank and what it waited for.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopart.errors import AutopartError, wait
from autopart.program.folder import NAMES, ProgramFolder, rank_dir
from autopart.program.format import load_rank, load_weights, read_head

_MAX_FILE = 1 << 40  # a received file's bound: the folder's own checks bound each kind further


def hand_over(
    program: Any, error: BaseException | None, timeout_s: float, library_ops: Sequence[str] = ()
) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's program, weights and plan.json head, from global rank 0's ``program``.

    Every rank calls it; on rank 0 ``program`` is the compiled ``Program`` (or ``error`` the
    failure to compile it: rank 0 raises it, every other rank an ``AutopartError`` with its
    message); other ranks pass ``None``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    status = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    _wait(dist.broadcast(status, src=0, async_op=True), rank, "rank 0's compile", timeout_s)
    if int(status.item()):
        text = f"{type(error).__name__}: {error}" if error is not None else ""
        message = _broadcast_bytes(
            text.encode() if rank == 0 else None, rank, "rank 0's compile error", timeout_s
        )
        if rank == 0:
            assert error is not None
            raise error
        raise AutopartError(f"rank {rank}: rank 0 could not compile the model: {message.decode()}")
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
