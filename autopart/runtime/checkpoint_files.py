"""A checkpoint's step folder as untrusted input (see docs/security-checkpoints.md).

``autopart.json``, the marker that ``checkpoint.save`` writes last, lists what a step holds:
every tensor's dtype, size and chunks (each chunk's file and byte range) and every file's size and
SHA-256, sealed with the SHA-256 of the marker itself. Here it is checked by allow-list
(``check_marker``), the files against it (``regular``, ``check_digest``), and DCP reads the
step through ``Reader``: metadata from the marker (DCP's pickled ``.metadata`` is never read),
shards by the writer's names inside the folder, not through links, only after their SHA-256 is
checked, each chunk parsed from its ``torch.save`` zip without unpickling. Every failure is an
``AutopartError`` naming the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from autopart.errors import AutopartError
from autopart.program.schema import Invalid, parse_json

FORMAT = 2
INFO = "autopart.json"  # written last, by rank 0: a folder without it is an incomplete checkpoint

# What a step folder may hold, by allow-list (see docs/security-checkpoints.md):
METADATA = ".metadata"  # DCP's own pickled metadata: hashed with the rest, never read
_SHARD = re.compile(r"__(0|[1-9][0-9]{0,8})_(0|[1-9][0-9]{0,8})\.distcp")  # FileSystemWriter's
STEP = re.compile(r"step([0-9]{1,18})")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RNG = re.compile(r"rng/rank[0-9]{5,9}")
_STATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_BLOCK = re.compile(r"(.+)::block(0|[1-9][0-9]{0,8})")
DTYPES = MappingProxyType(
    {
        "float64": torch.float64,
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int64": torch.int64,
        "int32": torch.int32,
        "uint8": torch.uint8,
        "bool": torch.bool,
    }
)
_MARKER_KEYS = frozenset(
    {
        "format",
        "step",
        "runner_steps",
        "seed",
        "extra",
        "mesh",
        "plan",
        "tied",
        "strided",
        "buffers",
        "optimizer",
        "tensors",
        "files",
        "sha256",
    }
)
_CHUNK_KEYS = frozenset({"offsets", "sizes", "file", "byte_offset", "byte_length"})
_RECORDS = frozenset(  # the records of one tensor's torch.save zip (under its one folder)
    {
        "data.pkl",
        "data/0",
        "byteorder",
        "version",
        ".format_version",
        ".storage_alignment",
        ".data/serialization_id",
        ".data/version",
    }
)
_BIG = 2**48  # no size, offset or count in a checkpoint is larger
_MAX_DIMS = 16
_MAX_MARKER = 256 << 20  # bytes of autopart.json
_READ = 8 << 20  # bytes per read while hashing
DAMAGED = (
    "the checkpoint is damaged, or was not written by autopart's save; resume from another step"
)


# -- keys -------------------------------------------------------------------------------------


def key(fqn: str, block: int | None = None, state: str | None = None) -> str:
    """The DCP key of a parameter (``block``: of a fused parameter; ``state``: optimizer)."""
    base = fqn if block is None else f"{fqn}::block{block}"
    return base if state is None else f"optim/{base}/{state}"


# -- the marker: what a step holds, sealed ------------------------------------------------------


def check_dtypes(state: dict[str, Any], rank: int) -> None:
    names = {v: k for k, v in DTYPES.items()}
    for k, v in state.items():
        if v.dtype not in names:
            raise AutopartError(
                f"rank {rank}: checkpoint entry {k} is {v.dtype}; checkpoints hold "
                f"{', '.join(DTYPES)}",
                hint="keep parameters, buffers and optimizer state in one of these dtypes",
            )


def tensors_json(written: Metadata, path: Path) -> dict[str, Any]:
    """The marker's ``tensors``: every entry's dtype, global size and chunks, each chunk with
    its file and byte range, from the metadata that ``dcp.save`` returned."""
    names = {v: k for k, v in DTYPES.items()}
    out: dict[str, Any] = {}
    for k, md in written.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise AutopartError(f"checkpoint {path}: DCP wrote {k} as {type(md).__name__}")
        chunks = []
        for c in md.chunks:
            where = written.storage_data[MetadataIndex(k, c.offsets)]
            if where.transform_descriptors:
                raise AutopartError(f"checkpoint {path}: DCP transformed {k} on write")
            chunks.append(
                {
                    "offsets": list(c.offsets),
                    "sizes": list(c.sizes),
                    "file": where.relative_path,
                    "byte_offset": where.offset,
                    "byte_length": where.length,
                }
            )
        out[k] = {"dtype": names[md.properties.dtype], "size": list(md.size), "chunks": chunks}
    return out


def own_files(path: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of the files this rank's ``dcp.save`` wrote (``__{rank}_N.distcp``;
    rank 0 also DCP's ``.metadata``), read back once they are complete."""
    names = [METADATA] if rank == 0 else []
    for e in path.iterdir():
        m = _SHARD.fullmatch(e.name)
        if m and int(m[1]) == rank:
            names.append(e.name)
    out = {}
    for name in sorted(names):
        fd, size = _open_regular(path / name)
        digest = hashlib.sha256()
        with os.fdopen(fd, "rb") as f:
            while block := f.read(_READ):
                digest.update(block)
        out[name] = {"size": size, "sha256": digest.hexdigest()}
    return out


def digest(info: dict[str, Any]) -> str:
    """The marker's seal: SHA-256 of its canonical JSON without ``sha256`` itself."""
    body = {k: v for k, v in info.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def read_marker(f: Path) -> Any:
    path = f.parent
    if not os.path.lexists(f):
        what = (
            "an incomplete checkpoint (its save did not finish)"
            if os.path.lexists(path / METADATA)
            else "not an autopart checkpoint"
        )
        raise AutopartError(
            f"{path} is {what}: it has no {INFO}",
            hint="point at a folder written by autopart.runtime.checkpoint.save",
        )
    fd, size = _open_regular(f)
    with os.fdopen(fd, "rb") as stream:
        if size > _MAX_MARKER:
            raise AutopartError(f"{f} holds {size} bytes, more than a marker's", hint=DAMAGED)
        data = stream.read(_MAX_MARKER + 1)
    try:  # JSON only, as plan.json: no NaN or infinity (an lr of NaN), no duplicate key
        return parse_json(data.decode("utf-8"), INFO)
    except Invalid as exc:
        raise AutopartError(f"{f} is not valid JSON: {exc}", hint=DAMAGED) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise AutopartError(
            f"{f} is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})", hint=DAMAGED
        ) from None


def _is_int(v: Any, lo: int = 0, hi: int = _BIG) -> bool:
    return type(v) is int and lo <= v <= hi


def _ints(v: Any, n: int | None = None) -> bool:
    return (
        isinstance(v, list)
        and len(v) <= _MAX_DIMS
        and (n is None or len(v) == n)
        and all(_is_int(x) for x in v)
    )


def _numel(sizes: list[int]) -> int:
    out = 1
    for d in sizes:
        out *= d
    return out


def _one_optimizer(o: Any) -> bool:
    """One optimizer's entry of the marker: ``{class, param_groups}`` and, since parameters
    map to groups by name, ``group_of`` (``{name: index into param_groups}``)."""
    if not isinstance(o, dict) or set(o) - {"group_of"} != {"class", "param_groups"}:
        return False
    if not isinstance(o["class"], str) or not isinstance(o["param_groups"], list):
        return False
    of = o.get("group_of", {})
    return isinstance(of, dict) and all(
        isinstance(k, str) and _is_int(v, 0, len(o["param_groups"]) - 1) for k, v in of.items()
    )


def check_marker(info: Any, f: Path) -> None:
    """Allow-list every entry of the marker ``f``: raises an ``AutopartError`` naming the entry
    unless the marker is exactly what ``save`` writes (its seal first: a marker whose bytes
    changed after the save is refused before anything in it is used)."""

    def need(ok: bool, where: str, what: str) -> None:
        if not ok:
            raise AutopartError(f"{f}: {where} is not {what}", hint=DAMAGED)

    need(isinstance(info, dict), "the marker", "a JSON object")
    if info.get("format") != FORMAT:
        got = info.get("format")
        raise AutopartError(
            f"{f} has format {got if _is_int(got) else repr(got)[:40]}, this autopart reads "
            f"{FORMAT}",
            hint="save the checkpoint again with this version (format 2 records every file's "
            "SHA-256)",
        )
    # extra_ranks, state_keys, model: optional
    unexpected = sorted(set(info) - _MARKER_KEYS - {"extra_ranks", "state_keys", "model"})
    absent = sorted(_MARKER_KEYS - set(info))
    need(not unexpected and not absent, f"its set of entries ({unexpected or absent})", "save's")
    need(
        isinstance(info["sha256"], str) and _SHA256.fullmatch(info["sha256"]) is not None,
        "sha256",
        "a seal",
    )
    if info["sha256"] != digest(info):
        raise AutopartError(
            f"{f} does not match its own SHA-256 seal: its bytes changed after the save",
            hint=DAMAGED,
        )
    need(_is_int(info["step"]), "step", "a count")
    need(_is_int(info["runner_steps"]), "runner_steps", "a count")
    need(_is_int(info["seed"], -(2**63), 2**63 - 1), "seed", "a 64-bit integer")
    need(isinstance(info["extra"], dict), "extra", "an object")
    ranks = info.get("extra_ranks")
    need(
        ranks is None or (isinstance(ranks, list) and all(isinstance(e, dict) for e in ranks)),
        "extra_ranks",
        "a list of objects, one per rank",
    )
    need(isinstance(info["plan"], dict), "plan", "an object")
    mesh = info["mesh"]
    need(
        isinstance(mesh, dict)
        and set(mesh) == {"pp", "dp", "tp"}
        and all(_is_int(v, 1, 2**20) for v in mesh.values()),
        "mesh",
        "{pp, dp, tp}",
    )
    world = mesh["pp"] * mesh["dp"] * mesh["tp"]
    need(ranks is None or len(ranks) == world, "extra_ranks", f"one object per rank ({world})")
    tied = info["tied"]
    need(
        isinstance(tied, dict) and all(isinstance(v, str) for v in tied.values()),
        "tied",
        "{alias: name}",
    )
    names = lambda v: isinstance(v, list) and all(isinstance(b, str) for b in v)  # noqa: E731
    need(names(info["buffers"]), "buffers", "a list of names")
    sha256 = lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v) is not None  # noqa: E731
    for entry, ok, what in (
        ("model", sha256, "a SHA-256 in hex"),
        ("state_keys", names, "a list of names"),
    ):
        need(info.get(entry) is None or ok(info[entry]), entry, what)  # optional entries
    strided = info["strided"]
    need(isinstance(strided, dict), "strided", "an object")
    for fqn, v in strided.items():
        need(
            _ints(v, 2) and v[0] < _MAX_DIMS and 2 <= v[1] <= 2**20 and "::block" not in fqn,
            f"strided → {fqn!r}",
            "[dim, blocks]",
        )
    opt = info["optimizer"]
    several = isinstance(opt, list) and 2 <= len(opt) <= 64
    need(
        opt is None or all(_one_optimizer(o) for o in (opt if several else [opt])),
        "optimizer",
        "null, {class, param_groups, group_of} or a list of 2 to 64 of them",
    )
    files = info["files"]
    need(isinstance(files, dict) and METADATA in files, "files", "a list of the step's files")
    for name, e in files.items():
        need(
            name == METADATA or _SHARD.fullmatch(name) is not None,
            f"files → {name!r}",
            "a name DCP's writer gives (__R_N.distcp or .metadata) inside the step folder",
        )
        need(
            isinstance(e, dict)
            and set(e) == {"size", "sha256"}
            and _is_int(e["size"])
            and isinstance(e["sha256"], str)
            and _SHA256.fullmatch(e["sha256"]) is not None,
            f"files → {name!r}",
            "{size, sha256}",
        )
    tensors = info["tensors"]
    need(isinstance(tensors, dict), "tensors", "an object")
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for k, t in tensors.items():
        _check_tensor(k, t, files, strided, need, ranges)
    for name, spans in ranges.items():  # no two records share bytes: bounded by the files
        spans.sort()
        for (a0, a1, ka), (b0, _, kb) in zip(spans, spans[1:], strict=False):
            need(b0 >= a1, f"tensors → {kb!r}", f"apart from {ka!r} in {name} (bytes {a0}-{a1})")
    for k in tensors:  # fused parameters: every block of each one that is there
        fqn, j, state = _parse_key(k)
        if j is not None:
            dim, n = strided[fqn]
            first = tensors.get(key(fqn, 0, state))
            for i in range(n):
                other = tensors.get(key(fqn, i, state))
                need(
                    other is not None
                    and first is not None
                    and other["dtype"] == first["dtype"]
                    and other["size"] == first["size"]
                    and dim < len(first["size"]),
                    f"tensors → {key(fqn, i, state)!r}",
                    f"block {i} of {n} of {fqn} along dim {dim}, like block 0",
                )


def _parse_key(k: str) -> tuple[str, int | None, str | None]:
    """``(fqn, block, state)`` of a checkpoint key (``key``'s inverse; rng keys: ``(k, None,
    None)``)."""
    base, state = k, None
    if k.startswith("optim/"):
        base, _, state = k[len("optim/") :].rpartition("/")
    m = _BLOCK.fullmatch(base)
    return (m[1], int(m[2]), state) if m else (base, None, state)


def _check_tensor(
    k: Any,
    t: Any,
    files: dict[str, Any],
    strided: dict[str, Any],
    need: Callable[[bool, str, str], None],
    ranges: dict[str, list[tuple[int, int, str]]],
) -> None:
    where = f"tensors → {k!r}"
    need(isinstance(k, str) and 0 < len(k) <= 1024 and k.isprintable(), where, "a name")
    fqn, block, state = _parse_key(k)
    need(bool(fqn) and "::block" not in fqn, where, "a parameter, state or rng name")
    if k.startswith("rng/"):
        need(_RNG.fullmatch(k) is not None, where, "rng/rankNNNNN")
    if state is not None:
        need(_STATE_NAME.fullmatch(state) is not None, where, "optim/<name>/<state>")
    if block is not None:
        need(fqn in strided and block < strided[fqn][1], where, "a block of a fused parameter")
    need(
        isinstance(t, dict) and set(t) == {"dtype", "size", "chunks"},
        where,
        "{dtype, size, chunks}",
    )
    need(isinstance(t["dtype"], str) and t["dtype"] in DTYPES, f"{where} → dtype", "allowed")
    size = t["size"]
    need(_ints(size), f"{where} → size", "a list of sizes")
    if k.startswith("rng/"):
        need(t["dtype"] == "uint8" and len(size) == 1, where, "a generator state")
    chunks = t["chunks"]
    need(isinstance(chunks, list) and 0 < len(chunks) <= 2**16, f"{where} → chunks", "a list")
    itemsize = torch.empty((), dtype=DTYPES[t["dtype"]]).element_size()
    boxes = []
    for i, c in enumerate(chunks):
        at = f"{where} → chunk {i}"
        need(isinstance(c, dict) and set(c) == set(_CHUNK_KEYS), at, "a chunk")
        offsets, sizes, name = c["offsets"], c["sizes"], c["file"]
        need(
            _ints(offsets, len(size))
            and _ints(sizes, len(size))
            and all(o + n <= d for o, n, d in zip(offsets, sizes, size, strict=True)),
            at,
            f"a slice of {size}",
        )
        need(
            isinstance(name, str) and _SHARD.fullmatch(name) is not None and name in files,
            f"{at} → file {name!r}" if isinstance(name, str) else f"{at} → file",
            "a listed shard of the step folder (a name of DCP's writer, no path)",
        )
        first, length = c["byte_offset"], c["byte_length"]
        need(
            _is_int(first) and _is_int(length) and first + length <= files[name]["size"],
            at,
            f"a byte range of {name}",
        )
        need(_numel(sizes) * itemsize <= length, at, f"large enough for its {_numel(sizes)} items")
        ranges.setdefault(name, []).append((first, first + length, k))
        boxes.append((offsets, sizes))
    need(_is_grid(boxes, size), f"{where} → chunks", f"a grid of slices that tiles {size}")


def _is_grid(boxes: list[tuple[list[int], list[int]]], size: list[int]) -> bool:
    """Whether the chunks ``(offsets, sizes)`` are exactly the cells of a grid over ``size``:
    along every dim their intervals partition ``[0, size)``, and every combination of intervals
    is one chunk, once. This is what DCP writes for autopart's layouts (whole tensors and
    ``Shard(dim)`` slices), and it implies that the chunks tile the tensor: each element is read
    from exactly one chunk. O(n log n) in the number of chunks."""
    cells = {(tuple(o), tuple(n)) for o, n in boxes}
    if len(cells) != len(boxes):
        return False
    count = 1
    for d, extent in enumerate(size):
        spans = sorted({(o[d], n[d]) for o, n in boxes})
        end = 0
        for start, n in spans:
            if start != end:
                return False
            end = start + n
        if end != extent:
            return False
        count *= len(spans)
    return count == len(boxes)


# -- files --------------------------------------------------------------------------------------


def _open_regular(f: Path) -> tuple[int, int]:
    """``(fd, size)`` of ``f`` opened for reading, if it is a regular file and not a symbolic
    link (O_NOFOLLOW: checked by the open itself, not before it)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(f, flags)
    except FileNotFoundError:
        raise AutopartError(f"{f} is missing (the marker lists it)", hint=DAMAGED) from None
    except OSError as exc:
        what = "a symbolic link" if os.path.islink(f) else f"unreadable ({exc.strerror})"
        raise AutopartError(f"{f} is {what}, not a checkpoint file", hint=DAMAGED) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise AutopartError(f"{f} is not a regular file", hint=DAMAGED)
    return fd, st.st_size


def regular(f: Path, size: int) -> None:
    """``f`` is a regular file (no symbolic link) of ``size`` bytes."""
    try:
        st = os.lstat(f)
    except FileNotFoundError:
        raise AutopartError(f"{f} is missing (the marker lists it)", hint=DAMAGED) from None
    except OSError as exc:
        raise AutopartError(f"{f} is unreadable ({exc.strerror})", hint=DAMAGED) from None
    if stat.S_ISLNK(st.st_mode):
        raise AutopartError(f"{f} is a symbolic link, not a checkpoint file", hint=DAMAGED)
    if not stat.S_ISREG(st.st_mode):
        raise AutopartError(f"{f} is not a regular file", hint=DAMAGED)
    if st.st_size != size:
        raise AutopartError(
            f"{f} holds {st.st_size} bytes, the marker records {size} (cut short or changed "
            "after the save)",
            hint=DAMAGED,
        )


def _read_checked(
    f: Path, entry: dict[str, Any], ranges: Sequence[tuple[int, int]] = ()
) -> list[bytearray]:
    """Read ``f`` once, checking its size and SHA-256 against the marker's ``entry``, and keep
    the bytes of each of the disjoint byte ``ranges`` as they go by: a load parses exactly the
    bytes that were checked, and holds only the chunks it needs, not the whole file."""
    fd, size = _open_regular(f)
    kept = [bytearray(end - start) for start, end in ranges]
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    with os.fdopen(fd, "rb", buffering=0) as stream:
        if size != entry["size"]:
            raise AutopartError(
                f"{f} holds {size} bytes, the marker records {entry['size']} (cut short or "
                "changed after the save)",
                hint=DAMAGED,
            )
        digest = hashlib.sha256()
        block = memoryview(bytearray(min(size, _READ)))
        pos, first = 0, 0  # bytes read; the first range not yet passed
        while pos < size:
            n = stream.readinto(block[: min(_READ, size - pos)])
            if not n:
                break
            part, end = block[:n], pos + n
            digest.update(part)
            j = first
            while j < len(order) and ranges[order[j]][0] < end:
                start, stop = ranges[order[j]]
                lo, hi = max(start, pos), min(stop, end)
                if lo < hi:
                    kept[order[j]][lo - start : hi - start] = part[lo - pos : hi - pos]
                j += 1
            while first < len(order) and ranges[order[first]][1] <= end:
                first += 1
            pos = end
        if pos != size or stream.read(1):
            raise AutopartError(f"{f} changed size while it was read", hint=DAMAGED)
    got = digest.hexdigest()
    if got != entry["sha256"]:
        raise AutopartError(
            f"{f} has SHA-256 {got[:16]}…, the marker records {entry['sha256'][:16]}… (its "
            "bytes changed after the save)",
            hint=DAMAGED,
        )
    return kept


def check_digest(f: Path, entry: dict[str, Any]) -> None:
    _read_checked(f, entry)


class _Slice(io.RawIOBase):
    """A read-only, seekable file over a memoryview (zipfile reads a record in place)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.view))[whence]
        if base + pos < 0:
            raise ValueError("negative seek position")
        self.pos = base + pos
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        b[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n


def _tensor(blob: memoryview, dtype: torch.dtype, sizes: list[int], where: str) -> torch.Tensor:
    """The tensor of one chunk record: DCP writes each chunk with ``torch.save``, a zip whose
    ``data/0`` record holds the raw storage, and autopart's save makes every chunk contiguous.
    This reads that record as ``dtype`` in ``sizes`` (its length and CRC checked) and never
    unpickles the zip's ``data.pkl``."""
    nbytes = _numel(sizes) * torch.empty((), dtype=dtype).element_size()
    try:
        with zipfile.ZipFile(_Slice(blob)) as z:
            records = z.infolist()
            names = [r.filename for r in records]
            top = names[0].partition("/")[0] if names else ""
            inner = [n[len(top) + 1 :] if n.startswith(f"{top}/") else n for n in names]
            if (
                len(set(names)) != len(names)
                or not set(inner) <= _RECORDS
                or "data/0" not in inner
                or "byteorder" not in inner
            ):
                raise AutopartError(
                    f"{where} holds the records {names[:8]}, not one tensor's", hint=DAMAGED
                )
            if z.read(f"{top}/byteorder") != b"little":
                raise AutopartError(f"{where} is not little-endian", hint=DAMAGED)
            rec = z.getinfo(f"{top}/data/0")
    except AutopartError:
        raise
    except Exception as exc:  # noqa: BLE001 - zipfile's errors on hostile bytes are many
        raise AutopartError(
            f"{where} is not a readable tensor record ({type(exc).__name__}: {str(exc)[:200]})",
            hint=DAMAGED,
        ) from None
    if rec.compress_type != zipfile.ZIP_STORED or rec.file_size != nbytes:
        raise AutopartError(
            f"{where}: its data record holds {rec.file_size} bytes (compression "
            f"{rec.compress_type}), not the {nbytes} of a {dtype} chunk of {sizes}",
            hint=DAMAGED,
        )
    head = blob[rec.header_offset : rec.header_offset + 30]
    start = rec.header_offset + 30
    if len(head) == 30 and bytes(head[:4]) == b"PK\x03\x04":
        start += int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    raw = blob[start : start + nbytes]
    if len(head) < 30 or bytes(head[:4]) != b"PK\x03\x04" or len(raw) != nbytes:
        raise AutopartError(f"{where}: its data record is cut short", hint=DAMAGED)
    if zlib.crc32(raw) != rec.CRC:
        raise AutopartError(f"{where}: its data record fails its CRC", hint=DAMAGED)
    if nbytes == 0:
        return torch.empty(sizes, dtype=dtype)
    out = torch.frombuffer(bytearray(raw), dtype=dtype).view(sizes)
    if dtype == torch.bool and bool(out.view(torch.uint8).gt(1).any()):
        raise AutopartError(f"{where}: a bool record holds bytes other than 0 and 1", hint=DAMAGED)
    return out


class Writer(FileSystemWriter):
    """DCP's file writer (its defaults), but a failed write is reported as the ``OSError``
    (``[Errno 28] No space left on device``) rather than as what ``torch.save``'s zip writer
    turns it into (``RuntimeError: ... unexpected pos 704 vs 598``)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except RuntimeError as exc:
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from exc
            raise


class Planner(DefaultLoadPlanner):
    """DCP's default load planner, but a byte entry is refused: DCP would unpickle it
    (``torch.load(weights_only=False)``). The reader's metadata holds tensors only, so this is
    a second wall, not the first."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise AutopartError(
            f"checkpoint entry {read_item.dest_index.fqn} is bytes; checkpoints hold tensors only",
            hint=DAMAGED,
        )


class Reader(StorageReader):
    """DCP's storage reader for a step whose marker ``read_info`` has checked.

    Its metadata comes from the marker (DCP's pickled ``.metadata`` is never read), it reads a
    shard only by a name of the writer's form inside the step folder, without following links,
    and only after checking the bytes against the marker's size and SHA-256, and it parses each
    chunk without unpickling (``_tensor``). Nothing in the step folder is unpickled."""

    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        super().__init__()
        self.path, self.files = path, info["files"]
        self.state: dict[str, TensorStorageMetadata] = {}
        self.chunks: dict[tuple[str, tuple[int, ...]], tuple[dict[str, Any], torch.dtype]] = {}
        for k, t in info["tensors"].items():
            dtype = DTYPES[t["dtype"]]
            chunks = []
            for c in t["chunks"]:
                chunks.append(
                    ChunkStorageMetadata(
                        offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])
                    )
                )
                self.chunks[(k, tuple(c["offsets"]))] = (c, dtype)
            self.state[k] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=torch.Size(t["size"]), chunks=chunks
            )

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return Metadata(
            state_dict_metadata=dict(self.state), storage_data={}, storage_meta=StorageMeta()
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            index = item.storage_index
            found = self.chunks.get((index.fqn, tuple(index.offset or ())))
            if item.type != LoadItemType.TENSOR or found is None:
                raise AutopartError(
                    f"{self.path / INFO}: DCP asked for {index.fqn} at {index.offset}, which "
                    "the marker does not hold as a tensor chunk",
                    hint=DAMAGED,
                )
            by_file.setdefault(found[0]["file"], []).append((item, *found))
        for name in sorted(by_file):
            f = self.path / name
            spans = sorted(
                {
                    (c["byte_offset"], c["byte_offset"] + c["byte_length"])
                    for _, c, _ in by_file[name]
                }
            )
            kept = dict(zip(spans, _read_checked(f, self.files[name], spans), strict=True))
            parsed: dict[tuple[int, int], torch.Tensor] = {}
            for item, c, dtype in by_file[name]:
                span = (c["byte_offset"], c["byte_offset"] + c["byte_length"])
                where = f"{f} (bytes {span[0]}-{span[1]}: {item.storage_index.fqn})"
                if span not in parsed:
                    parsed[span] = _tensor(memoryview(kept.pop(span)), dtype, c["sizes"], where)
                t = parsed[span]
                for d, (o, n) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    t = t.narrow(d, o, n)
                target = planner.resolve_tensor(item).detach()
                if target.size() != t.size():
                    raise AutopartError(f"{where}: {tuple(t.size())} is not {tuple(target.size())}")
                target.copy_(t)
                planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def dcp_load(state: dict[str, Any], reader: Reader, who: str, no_dist: bool = False) -> None:
    try:
        dcp.load(state, storage_reader=reader, planner=Planner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
        reraise_interrupt(exc)
        raise AutopartError(
            f"{who}loading the checkpoint {reader.path} failed: {why(exc)}",
            hint="the step is damaged (resume from the one before it), or a peer rank died",
        ) from exc


def reraise_interrupt(exc: BaseException) -> None:
    """DCP wraps every ``BaseException`` of a rank into its ``CheckpointException``, Ctrl-C's
    ``KeyboardInterrupt`` and ``SystemExit`` included: those are raised again as they were,
    never turned into an ``AutopartError``."""
    if isinstance(exc, CheckpointException):
        for _, (inner, _) in sorted(exc.failures.items()):
            if not isinstance(inner, Exception):
                raise inner from exc


def why(exc: BaseException) -> str:
    """One line for a failure inside DCP: the first failing rank's own error (an
    ``AutopartError``'s message first) when DCP gathered them into a ``CheckpointException``."""
    if isinstance(exc, CheckpointException):
        failures = sorted(exc.failures.items())
        ours: list[tuple[int | None, BaseException]] = [
            (r, e) for r, (e, _) in failures if isinstance(e, AutopartError)
        ]
        rank, first = (ours or [(r, e) for r, (e, _) in failures] or [(None, exc)])[0]
        more = f" (and {len(failures) - 1} more ranks)" if len(failures) > 1 else ""
        text = why(first) if first is not exc else "CheckpointException"
        return (f"rank {rank}: " if rank is not None else "") + text + more
    if isinstance(exc.__context__, OSError) and not isinstance(exc, OSError):
        exc = exc.__context__  # torch.save's zip writer hides a failed write (ENOSPC) this way
    text = exc.message if isinstance(exc, AutopartError) else f"{type(exc).__name__}: {exc}"
    lines = text.strip().splitlines()
    return lines[0] if lines else type(exc).__name__
