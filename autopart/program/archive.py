"""What a saved stage graph (``stageN.pt2``) and a ``weights.pt`` may hold, checked on the
bytes torch will then read.

``torch.export.load`` unpickles constants an archive marks for pickling, reads "opaque"
constants with ``pickle.loads``, falls back to an unpickling ``torch.load`` for example inputs
that the safe loader refuses, hands every symbolic size to ``sympy.sympify`` (an ``eval``) and
resolves call targets by attribute lookup: a crafted archive can run code while it loads, or
when its graph runs. autopart writes stage graphs with every input explicit, so its archives
hold no weights, no constants, no example inputs, no custom objects and no guard code, and call
only ATen ops, autopart's own ops, a few Python operators on sizes and the ops of library
namespaces that the loading user trusts (``program/libraries.py``).

The loader reads each file once into memory and checks those bytes; torch gets the same bytes
(``io.BytesIO``), so nothing can differ between the check and the load:

- ``zip_members``: the zip is in the canonical layout torch writes: members stored (never
  compressed), laid end to end from byte 0 with nothing between or after them but the central
  directory and its end records, no comment, no encryption, no duplicate name and no two names
  that differ only in case (two zip readers could pick different copies), each local header
  naming the same member as the directory;
- ``check_pt2``: only the members of an autopart save, the weights and constants configs exactly
  ``{"config": {}}``, no example inputs, and ``models/model.json`` valid under the allow-list of
  ``graph_json`` (every symbolic size in the grammar of ``symexpr``);
- ``check_weights``: only torch.save's members, and tensor bytes no more than the program's
  parameter and buffer shapes imply;
- ``check_targets`` checks a loaded graph's call targets once more.
"""

from __future__ import annotations

import io
import operator
import re
import struct
import zipfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import fx

# autopart's ops, which loaded graphs call, registered by whatever loads one (a tp program
# loaded after a bare ``import autopart`` was refused as "not a loadable torch.export program")
import autopart.collectives  # noqa: F401 - tp_copy, tp_reduce, ..., vocab_parallel_ce, dropout
import autopart.deferred  # noqa: F401 - weight_gemm
import autopart.scan  # noqa: F401 - linear_scan
from autopart.errors import AutopartError
from autopart.program.graph_json import NAMESPACES, PYTHON_OPS, allowed, check_model
from autopart.program.schema import Invalid, parse_json

# the archive members autopart's own save writes (under one top-level folder)
PT2_MEMBERS = frozenset(
    {
        "archive_format",
        "archive_version",
        ".data/version",
        ".data/serialization_id",
        "byteorder",
        "models/model.json",
        "data/weights/model_weights_config.json",
        "data/constants/model_constants_config.json",
        "data/sample_inputs/model.pt",
    }
)
_EMPTY = ("data/weights/model_weights_config.json", "data/constants/model_constants_config.json")
_SMALL = 4096  # bytes: the most any member but model.json (and a weight) holds
WEIGHTS_META = frozenset(
    {"data.pkl", ".format_version", ".storage_alignment", "byteorder", "version"}
    | {".data/serialization_id", ".data/version"}
)
_STORAGE = re.compile(r"data/[0-9]{1,9}")
_TOP = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_FLAGS_OK = 0x0008 | 0x0800  # data descriptor, UTF-8 names; nothing else (no encryption)
# the Python callables of PYTHON_OPS (for the loaded graph's own check)
_PY_CALLABLES = frozenset(
    getattr(operator if t.startswith("_operator.") else torch, t.split(".", 1)[1])
    for t in PYTHON_OPS
)


def _refuse(path: Path, why: str) -> AutopartError:
    return AutopartError(
        f"{path} is not a file autopart wrote: {why}; it was not loaded",
        hint="loading it could run code from it. Re-save the program with Program.save(), "
        "and keep program folders where only you can write",
    )


def zip_members(data: bytes, path: Path) -> tuple[str, dict[str, zipfile.ZipInfo]]:
    """The top-level folder and the members (by name below it) of the zip ``data``, after
    checking that it is in the canonical layout described in the module doc."""
    n = len(data)
    if n < 22 or data[-22:-18] != b"PK\x05\x06":
        raise _refuse(path, "it is not a zip archive ending in its directory (or has a comment)")
    disk, cd_disk, count_here, count, cd_size, cd_offset, comment = struct.unpack(
        "<HHHHIIH", data[-18:]
    )
    if comment or disk or cd_disk or count_here != count:
        raise _refuse(path, "its zip end record has a comment or spans several disks")
    end = n - 22
    if n >= 98 and data[-42:-38] == b"PK\x06\x07":  # zip64: locator, then its end record
        _, z64_at, disks = struct.unpack("<IQI", data[-38:-22])
        if z64_at != n - 98 or disks != 1 or data[z64_at : z64_at + 4] != b"PK\x06\x06":
            raise _refuse(path, "its zip64 end records are not where torch writes them")
        size, _, _, d1, d2, n1, n2, cd_size64, cd_offset64 = struct.unpack(
            "<QHHIIQQQQ", data[z64_at + 4 : z64_at + 56]
        )
        if size != 44 or d1 or d2 or n1 != n2:
            raise _refuse(path, "its zip64 end record is not the plain one torch writes")
        for short, long, sentinel in (
            (count, n2, 0xFFFF),
            (cd_size, cd_size64, 0xFFFFFFFF),
            (cd_offset, cd_offset64, 0xFFFFFFFF),
        ):
            if short not in (long, sentinel):
                raise _refuse(path, "its zip and zip64 end records disagree")
        count, cd_size, cd_offset, end = n2, cd_size64, cd_offset64, z64_at
    if cd_offset + cd_size != end:
        raise _refuse(path, "its zip directory is not directly before its end record")
    try:
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except Exception as exc:  # noqa: BLE001 - whatever Python's reader says of these bytes
        raise _refuse(path, f"its zip directory does not parse ({type(exc).__name__})") from None
    if len(infos) != count:
        raise _refuse(path, f"its zip directory lists {len(infos)} members, its end record {count}")
    names: dict[str, zipfile.ZipInfo] = {}
    folded: set[str] = set()
    for info in infos:
        name = info.filename
        if name in names:
            raise _refuse(path, f"it holds the member {name[:80]!r} twice")
        if name.casefold() in folded:
            raise _refuse(path, f"it holds two members whose names differ only in case ({name!r})")
        names[name] = info
        folded.add(name.casefold())
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise _refuse(path, f"its member {name[:80]!r} is compressed (torch stores members)")
        if info.flag_bits & ~_FLAGS_OK:
            raise _refuse(path, f"its member {name[:80]!r} is encrypted or flagged")
    _check_tiling(data, path, sorted(infos, key=lambda i: i.header_offset), cd_offset)
    tops = {name.split("/", 1)[0] for name in names}
    if len(tops) != 1 or not all("/" in name for name in names):
        raise _refuse(path, f"its members sit under {len(tops)} top-level folders, not one")
    top = tops.pop()
    if not _TOP.fullmatch(top):
        raise _refuse(path, f"its top-level folder is named {top[:80]!r}")
    return top, {name.split("/", 1)[1]: info for name, info in names.items()}


def _check_tiling(data: bytes, path: Path, infos: list[zipfile.ZipInfo], cd_offset: int) -> None:
    """Members laid end to end from byte 0 to the directory, each local header naming the
    member its directory entry names."""
    at = 0
    for info in infos:
        if info.header_offset != at:
            raise _refuse(path, f"its member {info.filename[:80]!r} does not follow the one before")
        head = data[at : at + 30]
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise _refuse(path, f"its member {info.filename[:80]!r} has no local header")
        flags, method, name_len, extra_len = struct.unpack("<2xHH16xHH", head[4:])
        name = data[at + 30 : at + 30 + name_len]
        if name != info.orig_filename.encode("utf-8") or method != info.compress_type:
            raise _refuse(path, f"its member {info.filename[:80]!r} is named otherwise locally")
        at += 30 + name_len + extra_len + info.compress_size
        if flags & 0x0008:  # a data descriptor follows the data: 16 bytes, or 24 for zip64
            if data[at : at + 4] != b"PK\x07\x08":
                raise _refuse(path, f"its member {info.filename[:80]!r} lacks its data descriptor")
            small = struct.unpack("<II", data[at + 8 : at + 16]) if at + 16 <= len(data) else ()
            if small == (info.compress_size, info.file_size):
                at += 16
            elif data[at + 8 : at + 24] == struct.pack("<QQ", info.compress_size, info.file_size):
                at += 24
            else:
                raise _refuse(path, f"the data descriptor of {info.filename[:80]!r} disagrees")
    if at != cd_offset:
        raise _refuse(path, "it holds bytes between its last member and its directory")


def check_pt2(data: bytes, path: Path, namespaces: Sequence[str] = NAMESPACES) -> None:
    """Refuse ``data`` (the bytes of ``path``) unless it is a stage graph as autopart writes
    it (see the module doc), calling ops of ``namespaces`` only (ATen and autopart's, and the
    library namespaces the loading user trusts: ``program/libraries.py``). Nothing in it is
    unpickled, evaluated or resolved here."""
    top, members = zip_members(data, path)
    extra = sorted(set(members) - PT2_MEMBERS)
    if extra:
        raise _refuse(
            path,
            f"it holds {extra[0][:80]!r}, which autopart never writes (weights, constants or "
            "objects torch would unpickle)",
        )
    if "models/model.json" not in members or "archive_version" not in members:
        raise _refuse(path, "it has no models/model.json or no archive_version")
    archive = zipfile.ZipFile(io.BytesIO(data))

    def read(name: str) -> bytes:
        try:
            return archive.read(f"{top}/{name}")
        except Exception as exc:  # noqa: BLE001 - e.g. a CRC mismatch
            raise _refuse(path, f"its member {name} does not read back ({exc})") from None

    for name, info in members.items():
        if name != "models/model.json" and info.file_size > _SMALL:
            raise _refuse(path, f"its member {name} is {info.file_size:,} bytes")
    sample = members.get("data/sample_inputs/model.pt")
    if sample is not None and sample.file_size:
        raise _refuse(path, "it holds example inputs, which torch would unpickle")
    for name in _EMPTY:
        if name in members and read(name) != b'{"config": {}}':
            raise _refuse(path, f"{name} lists weights or constants to load")
    for name in members:
        read(name)  # every member's CRC and local header, as Python's reader sees them
    try:
        check_model(parse_json(read("models/model.json")), namespaces)
    except Invalid as exc:
        raise _refuse(path, f"models/model.json: {exc.where or '(top)'} {exc.why}") from None


def check_weights(data: bytes, path: Path, max_tensor_bytes: int, max_tensors: int) -> None:
    """Refuse ``data`` (a ``weights.pt``) unless it is a plain torch.save zip whose tensor
    storages add up to at most ``max_tensor_bytes`` in at most ``max_tensors`` records."""
    _, members = zip_members(data, path)
    storages = 0
    records = 0
    for name, info in members.items():
        if _STORAGE.fullmatch(name):
            storages += info.file_size
            records += 1
        elif name not in WEIGHTS_META:
            raise _refuse(path, f"it holds {name[:80]!r}, which torch.save does not write")
        elif name == "data.pkl":
            if info.file_size > (1 << 16) + 1024 * max_tensors:
                raise _refuse(path, f"its data.pkl is {info.file_size:,} bytes")
        elif info.file_size > _SMALL:
            raise _refuse(path, f"its member {name} is {info.file_size:,} bytes")
    if "data.pkl" not in members:
        raise _refuse(path, "it has no data.pkl")
    if records > max_tensors or storages > max_tensor_bytes:
        raise _refuse(
            path,
            f"it holds {records} tensors of {storages:,} bytes, more than this rank's "
            f"{max_tensors} parameters and buffers need ({max_tensor_bytes:,} bytes)",
        )


# ATen ops that return nothing yet are legitimate in a stage graph: export's checks on sizes
# and metadata (they compute nothing, and fail the step if the check fails)
ATEN_CHECKS = frozenset(
    {
        "_assert_tensor_metadata",
        "_assert_scalar",
        "_assert_async",
        "sym_constrain_range",
        "sym_constrain_range_for_size",
    }
)
# (op, argument): the string arguments of ATen ops that only pick a mode of a pure computation;
# any other string (aten.from_file's filename, the string ops of TorchScript) is refused
ATEN_STRINGS = frozenset(
    {
        ("einsum", "equation"),
        ("gelu", "approximate"),
        ("gelu_backward", "approximate"),
        ("div", "rounding_mode"),
        ("divide", "rounding_mode"),
        ("pad", "mode"),
        ("scatter", "reduce"),
        ("scatter_reduce", "reduce"),
        ("index_reduce", "reduce"),
        ("searchsorted", "side"),
        ("meshgrid", "indexing"),
        ("_assert_scalar", "assert_msg"),
        ("_assert_async", "assert_msg"),
        ("_functional_assert_scalar", "assert_msg"),
        ("_functional_assert_async", "assert_msg"),
        ("linalg_qr", "mode"),
        ("quantile", "interpolation"),
        ("nanquantile", "interpolation"),
        # the Fourier transforms' normalization ("forward", "backward", "ortho")
        *(
            (f"fft_{kind}{dims}", "norm")
            for kind in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
            for dims in ("", "2", "n")
        ),
    }
)
# ATen ops that pass the rules above yet touch global state or memory that no tensor argument
# bounds: sparse and nested layouts (aten does not check their indices by default, so a
# densified one writes where its indices say), a raw storage (set), futures, moving to a GPU
# by name, process-wide caches, test ops
ATEN_DENIED = re.compile(
    r"sparse|nested|_cufft|cudnn_init|^_test_|^set$|^wait$|^cuda$"
    # packed and quantized layouts: kernels that trust their arguments' sizes (a hostile
    # folder's aten._weight_int4pack_mm_for_cpu with a short scales tensor read past it, or
    # killed the rank with SIGSEGV: probe, twenty-third session)
    r"|pack|quantiz|^q_|fbgemm|mkldnn|int_repr"
)
# ATen's internal ops (a leading underscore) are kernels beneath the public API, several of
# which trust their arguments' sizes: a loaded graph may call only these, the ones stage graphs
# hold (collected from the compatibility matrix's 75 architectures under tp, sp, Seq1F1B,
# zero-bubble and recompute plans, and the suite's models), and not the others
ATEN_INTERNAL = frozenset(
    {
        "_assert_async",
        "_assert_scalar",
        "_assert_tensor_metadata",
        "_cdist_forward",
        "_conj",
        "_efficient_attention_forward",
        "_flash_attention_forward",
        "_functional_assert_async",
        "_functional_assert_scalar",
        "_fused_rms_norm",
        "_grouped_mm",
        "_local_scalar_dense",
        "_log_softmax",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training",
        "_neg_view",
        "_reshape_alias",
        "_safe_softmax",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_softmax",
        "_to_copy",
        "_unsafe_index",
        "_unsafe_view",
        "_weight_norm_interface",
    }
)
_STRING = re.compile(r"\bstr\b")


def aten_refusal(op: torch._ops.OpOverload) -> str | None:
    """Why the ATen op ``op`` may not run in a loaded program, or None when it may: it writes
    none of its arguments (no mutable alias annotation), returns a value (but for the checks
    of ``ATEN_CHECKS``), takes no string but a mode of ``ATEN_STRINGS`` and is not one of
    ``ATEN_DENIED`` (docs/security.md). Every op autopart's stage graphs call passes."""
    schema = op._schema
    name = op._opname
    if schema.is_mutable:
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        return f"writes {', '.join(written) or 'an argument'} in place"
    if not schema.returns and name not in ATEN_CHECKS:
        return "returns nothing (an op run for a side effect: printing, saving, seeding)"
    for a in schema.arguments:
        if _STRING.search(str(a.type)) and (name, a.name) not in ATEN_STRINGS:
            return f"takes the string argument {a.name!r} (a file name or code to interpret)"
    if ATEN_DENIED.search(name):
        return (
            "touches global state or raw memory (sparse, nested, packed, quantized, storage or "
            "cache ops)"
        )
    if name.startswith("_") and not name.startswith("__") and name not in ATEN_INTERNAL:
        return (
            "is one of ATen's internal kernels, not among those autopart's stage graphs call "
            "(archive.ATEN_INTERNAL)"
        )
    return None


def call_refusal(n: fx.Node, namespaces: Sequence[str] = NAMESPACES) -> str | None:
    """Why ``n`` may not be in a saved stage graph, or None when it may: it calls an op of
    ``namespaces`` (ATen and autopart's by default; an ATen op only if ``aten_refusal`` passes
    it) or a Python operator on sizes. ``compile_program`` refuses the same calls in a captured
    graph (``refuse_library_ops``) before it saves one, and the loader after torch read it."""
    target = n.target
    if n.op != "call_function":
        return f"is a {n.op} node, which a stage graph autopart wrote never holds"
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace not in namespaces:
            return (
                f"calls an op of the namespace {target.namespace!r}, which this load does not trust"
            )
        if target.namespace == "aten":
            why = aten_refusal(target)
            return None if why is None else f"calls {target}, which {why}"
        return None
    if target in _PY_CALLABLES:
        return None
    return f"calls {target!r}, which is no ATen op, autopart op or Python operator on sizes"


def allowed_call(n: fx.Node, namespaces: Sequence[str] = NAMESPACES) -> bool:
    """``n`` may be in a saved stage graph (``call_refusal`` finds nothing against it)."""
    return call_refusal(n, namespaces) is None


def check_targets(
    graph: fx.GraphModule, where: Path, namespaces: Sequence[str] = NAMESPACES
) -> None:
    """Every call in a loaded stage graph passes ``call_refusal``: an op of ``namespaces`` (an
    ATen op without side effects) or a Python size op."""
    for n in graph.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        why = call_refusal(n, namespaces)
        if why is not None:
            raise AutopartError(
                f"{where}: node {n.name} {why}; a stage graph autopart wrote never does, and "
                "the program was not run",
                hint="re-save the program with Program.save() from a model autopart compiled; "
                "a folder holding this was not written by autopart (keep program folders where "
                "only you can write)",
            )


__all__ = [
    "PT2_MEMBERS",
    "allowed",
    "ATEN_CHECKS",
    "ATEN_DENIED",
    "ATEN_STRINGS",
    "allowed_call",
    "aten_refusal",
    "call_refusal",
    "check_pt2",
    "check_targets",
    "check_weights",
    "zip_members",
]
