"""Property: whatever is done to a saved program folder, loading it either gives the same
program or fails with an ``AutopartError``; never another exception, never code from the folder
run, never a file outside it read.

Hypothesis mutates one saved program (2 ranks, pp=2 Seq1F1B: K/V shapes, peers, weights,
symbolic sizes) per example: JSON values and types anywhere in plan.json, program.json and a
stage's model.json (with code, path and import payloads among the values), symbolic-size
strings, zip members (duplicated, renamed, added, dropped, compressed, reordered, with bytes
around them), files replaced by links, folders, FIFOs or nothing, raw bytes flipped or cut.
Most mutations update plan.json's checksums to match, as an attacker would; none updates the
digest of plan.json that every program.json records, so one edit of plan.json must be refused
(a forger who reseals it meets each field's own check instead: ``test_loader``).

A folder that still loads must load *identically* (every stage's code, inputs and K/V shapes,
the actions, shards, buckets, ties, the plan and the weights' names, shapes and dtypes), except
for mutations that only change a value the format leaves free, which are listed in ``FREE``
(tensor values, an op's numeric argument, a node's stack trace...): those must load a program
that saves and loads again to itself.

50 examples run in the default suite, 500 under ``-m slow``. Each example copies the folder;
``torch.export.load`` of bytes it has already read is answered from a memo (its
earlier result, the same object: the loader only sets metadata on it, from the example's own
program.json, before the example reads it), since torch's load is a function of the bytes.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loader import small_program

from autopart import AutopartError
from autopart.program.format import Program

MARKER = "@MARKER@"  # replaced by the example's marker path in every payload


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


PAYLOADS = [
    f"__import__('pathlib').Path('{MARKER}').touch()",
    f"Symbol('s1') if __import__('pathlib').Path('{MARKER}').touch() else Integer(1)",
    "Symbol('s1', positive=True, integer=True).__class__",
    "Add(Symbol('s70', positive=True, integer=True), Integer(99999999999999999999999))",
    "../../outside.pt2",
    "/etc/passwd",
    "rank00000/../plan.json",
    "builtins.exec",
    "torch.ops.aten.__class__.__init__",
    "torch.load",
    json.dumps({"__enum__": 1, "fqn": "fuzz_marker_module:E", "name": "A"}),
    "Symbol('s70', positive=True, integer=True)",
    "torch.ops.aten.add.Tensor",
    "b",
    "",
]

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2, 2**31, 2**63, 10**13])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(PAYLOADS)
)
JSON_VALUES = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)

# mutations after which a successful load may differ from the original: values the format
# leaves free to change (a weight, a number an op takes, a stack trace) rather than structure
FREE = {"flip-weights", "json-model", "json-expr"}


# ---- walking and editing JSON ----------------------------------------------------------------


def _paths(doc: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*at, i))
    return out


def _expr_paths(doc: Any, at: tuple = ()) -> list[tuple]:
    return [p for p in _paths(doc, at) if p and p[-1] == "expr_str"]


def _edit(doc: Any, path: tuple, op: str, value: Any) -> Any:
    if not path:
        return value if op == "set" else doc
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if op == "set":
        parent[key] = value
    elif op == "delete":
        del parent[key]
    elif op == "add" and isinstance(parent, dict):
        parent[f"{key}_extra"] = value
    elif op == "add" and isinstance(parent, list):
        parent.insert(key, value)
    return doc


def _subst(value: Any, marker: str) -> Any:
    if isinstance(value, str):
        return value.replace(MARKER, marker)
    if isinstance(value, list):
        return [_subst(v, marker) for v in value]
    if isinstance(value, dict):
        return {k: _subst(v, marker) for k, v in value.items()}
    return value


def _members(pt2: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(pt2) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _write(pt2: Path, members: list[tuple[str, bytes]], deflate: set[int] = frozenset()) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zipfile.ZipFile(pt2, "w") as z:
            for i, (name, data) in enumerate(members):
                z.writestr(name, data, zipfile.ZIP_DEFLATED if i in deflate else 0)


def _rehash(root: Path) -> None:
    plan = root / "plan.json"
    if plan.is_symlink() or not plan.is_file():
        return  # replaced by a mutation (a FIFO would block this read)
    try:
        head = json.loads(plan.read_text())
    except ValueError:
        return
    if not isinstance(head, dict) or not isinstance(head.get("files"), dict):
        return
    for rel in head["files"]:
        f = root / str(rel)
        if f.is_file() and not f.is_symlink():
            head["files"][rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    (root / "plan.json").write_text(json.dumps(head))


# ---- the mutations ---------------------------------------------------------------------------

FILES = [
    "plan.json",
    "rank00000/program.json",
    "rank00001/program.json",
    "rank00000/stage0.pt2",
    "rank00001/stage1.pt2",
    "rank00000/weights.pt",
    "rank00001/weights.pt",
]


def mutate(root: Path, data: st.DataObject, marker: str) -> str:
    """Apply one drawn mutation to the folder ``root``; return its kind."""
    kind = data.draw(
        st.sampled_from(
            [
                "json-plan",
                "json-program",
                "json-model",
                "json-expr",
                "zip",
                "fs",
                "flip",
                "flip-weights",
                "cut",
            ]
        ),
        label="kind",
    )
    rel = data.draw(st.sampled_from(FILES), label="file")
    if kind in ("json-plan", "json-program"):
        rel = "plan.json" if kind == "json-plan" else data.draw(st.sampled_from(FILES[1:3]))
        doc = json.loads((root / rel).read_text())
        path = data.draw(st.sampled_from(_paths(doc)), label="path")
        op = data.draw(st.sampled_from(["set", "set", "delete", "add"]), label="op")
        doc = _edit(doc, path, op, _subst(data.draw(JSON_VALUES, label="value"), marker))
        (root / rel).write_text(json.dumps(doc))
    elif kind in ("json-model", "json-expr"):
        rel = data.draw(st.sampled_from(FILES[3:5]), label="stage")
        members = _members(root / rel)
        i = next(i for i, (n, _) in enumerate(members) if n.endswith("models/model.json"))
        doc = json.loads(members[i][1])
        if kind == "json-expr":
            path = data.draw(st.sampled_from(_expr_paths(doc)), label="expr")
            value = _subst(data.draw(st.sampled_from(PAYLOADS) | st.text(max_size=30)), marker)
            doc = _edit(doc, path, "set", value)
        else:
            path = data.draw(st.sampled_from(_paths(doc)), label="path")
            op = data.draw(st.sampled_from(["set", "set", "delete", "add"]), label="op")
            doc = _edit(doc, path, op, _subst(data.draw(JSON_VALUES, label="value"), marker))
        members[i] = (members[i][0], json.dumps(doc).encode())
        _write(root / rel, members)
    elif kind == "zip":
        rel = data.draw(st.sampled_from(FILES[3:]), label="archive")
        _zip_mutation(root / rel, data, marker)
    elif kind == "fs":
        _fs_mutation(root, data)
    elif kind in ("flip", "flip-weights"):
        if kind == "flip-weights":  # inside a storage: only a weight's value changes
            rel = data.draw(st.sampled_from(FILES[5:]), label="weights")
        raw = bytearray((root / rel).read_bytes())
        lo = _storage_start(raw) if kind == "flip-weights" else 0
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            at = data.draw(st.integers(lo, len(raw) - 1), label="at")
            raw[at] ^= data.draw(st.integers(1, 255), label="xor")
        (root / rel).write_bytes(bytes(raw))
    else:  # cut
        raw = (root / rel).read_bytes()
        (root / rel).write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="cut")])
    if data.draw(st.integers(0, 9), label="rehash") > 0:  # 90%: as an attacker would
        _rehash(root)
    return kind


def _storage_start(raw: bytearray) -> int:
    """The offset of the first tensor storage's bytes in a torch.save zip."""
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and "pkl" not in i.filename)
    name_len, extra_len = (
        int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    return info.header_offset + 30 + name_len + extra_len


def _zip_mutation(path: Path, data: st.DataObject, marker: str) -> None:
    members = _members(path)
    top = members[0][0].split("/")[0]
    op = data.draw(
        st.sampled_from(
            ["duplicate", "rename", "add", "drop", "deflate", "reorder", "prefix", "suffix"]
        ),
        label="zip-op",
    )
    i = data.draw(st.integers(0, len(members) - 1), label="member")
    pickled = pickle.dumps(_Payload(marker))
    deflate: set[int] = set()
    if op == "duplicate":
        members.insert(i, (members[i][0], pickled))
    elif op == "rename":
        name = data.draw(
            st.sampled_from(
                [
                    members[i][0].upper(),
                    f"{top}/../{members[i][0]}",
                    f"/{members[i][0]}",
                    f"other/{members[i][0].split('/', 1)[1]}",
                    f"{top}/data/constants/c0.pt",
                    "version",
                ]
            ),
            label="name",
        )
        members[i] = (name, members[i][1])
    elif op == "add":
        name = data.draw(
            st.sampled_from(
                [
                    f"{top}/data/constants/c0.pt",
                    f"{top}/data/weights/w.pt",
                    f"{top}/extra",
                    "version",
                ]
            ),
            label="name",
        )
        members.append((name, pickled))
    elif op == "drop":
        members.pop(i)
    elif op == "deflate":
        deflate = {i}
    elif op == "reorder":
        members = members[i:] + members[:i]
    _write(path, members, deflate)
    if op in ("prefix", "suffix"):
        raw = path.read_bytes()
        junk = data.draw(st.binary(min_size=1, max_size=64), label="junk")
        path.write_bytes(junk + raw if op == "prefix" else raw + junk)


def _fs_mutation(root: Path, data: st.DataObject) -> None:
    rel = data.draw(st.sampled_from([*FILES, "rank00000", "rank00001"]), label="fs-file")
    op = data.draw(st.sampled_from(["symlink", "dir", "fifo", "delete"]), label="fs-op")
    f = root / rel
    outside = root.parent / f"outside-{rel.replace('/', '-')}"
    if op == "symlink":  # to a copy of itself outside the folder: even its checksum matches
        shutil.move(f, outside)
        f.symlink_to(outside, target_is_directory=outside.is_dir())
    elif f.is_dir():
        shutil.rmtree(f)
        if op == "fifo":
            os.mkfifo(f)
    else:
        f.unlink()
        if op == "dir":
            f.mkdir()
        elif op == "fifo":
            os.mkfifo(f)


# ---- the property ----------------------------------------------------------------------------


def fingerprint(program: Program) -> Any:
    """What a loaded program is, to the runtime (and the weights' names, shapes, dtypes)."""
    ranks = []
    for rp in program.ranks:
        stages = [
            (s.stage, s.inputs, s.graph.code, s.graph.meta.get("autopart.kv_shapes"))
            for s in rp.stages
        ]
        ranks.append(
            (rp.rank, rp.coords, rp.groups, rp.actions, rp.shards, rp.buckets, rp.ties)
            + (rp.n_stages, rp.chunk_cost, rp.vocab_size, rp.batch_names, rp.frozen, stages)
        )
    tensors = {
        k: (tuple(t.shape), t.dtype) for k, t in {**program.params, **program.buffers}.items()
    }
    return (program.plan, program.tied, program.example_shape, program.vocab_size, tensors, ranks)


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = small_program().save(tmp_path_factory.mktemp("fuzz") / "base")
    memo: dict[str, Any] = {}
    real_load = torch.export.load

    def memo_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        raw = f.getvalue() if isinstance(f, io.BytesIO) else None
        key = hashlib.sha256(raw).hexdigest() if raw is not None else None
        if key is None or key not in memo:
            ep = real_load(f, *args, **kwargs)
            if key is None:
                return ep
            memo[key] = ep
        return memo[key]

    with mock.patch.object(torch.export, "load", memo_load):
        want = fingerprint(Program.load(root))
    return {
        "root": root,
        "want": want,
        "load": memo_load,
        "work": tmp_path_factory.mktemp("examples"),
        "count": itertools.count(),
        "outcomes": {},
    }


def check_one(base: dict[str, Any], data: st.DataObject) -> None:
    n = next(base["count"])
    where = base["work"] / f"e{n}"
    root = where / "p"
    shutil.copytree(base["root"], root)
    marker = where / "pwned"
    kind = mutate(root, data, str(marker))
    outcome = "refused"
    with mock.patch.object(torch.export, "load", base["load"]):
        try:
            got = Program.load(root)
        except AutopartError:
            got = None
        finally:
            assert not marker.exists(), f"a payload ran ({kind})"
            assert not (where.parent / "fuzz_marker_module.py").exists()
        if got is not None:
            outcome = "same"
            if fingerprint(got) != base["want"]:
                assert kind in FREE, f"{kind}: the folder loaded as another program"
                outcome = "free"
                again = Program.load(got.save(where / "again"))
                assert fingerprint(again) == fingerprint(got), "it does not save and load again"
    key = (kind, outcome)
    base["outcomes"][key] = base["outcomes"].get(key, 0) + 1
    shutil.rmtree(where, ignore_errors=True)


_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(max_examples=50, **_SETTINGS)
@given(data=st.data())
def test_a_mutated_folder_loads_the_same_or_is_refused(fuzz_base, data) -> None:
    check_one(fuzz_base, data)


@pytest.mark.slow
@settings(max_examples=500, **_SETTINGS)
@given(data=st.data())
def test_a_mutated_folder_loads_the_same_or_is_refused_500(fuzz_base, data) -> None:
    check_one(fuzz_base, data)


def test_outcomes_are_reported(fuzz_base, capsys) -> None:
    """Not a check: prints how the examples above ended (run with -s to see it)."""
    with capsys.disabled():
        counts = sorted(fuzz_base["outcomes"].items())
        print("\nfuzz outcomes (kind, outcome): count:", counts)
