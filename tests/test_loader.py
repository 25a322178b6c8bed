"""Program folders are hostile (issue 34): each break an adversarial review found, as a crafted
folder whose plan.json checksums were updated to match (as an attacker would). Each test fails
on the loader before this round and passes now: the folder is refused with an ``AutopartError``
naming the file and the field, a payload's marker file never appears, files outside the folder
are never read, changed or removed."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import sympy
import torch

from autopart import AutopartError, Mesh, parallelize
from autopart.models import nanogpt
from autopart.program.format import Program, load_rank, load_weights, plan_digest, read_head
from autopart.program.graph_json import _embedded
from autopart.program.schema import DENSE_FROM, Invalid, parse_json


class _Payload:
    """Unpickling this creates ``path``: what a malicious pickle would do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def small_program() -> Program:
    """A 2-block GPT of width 8 on pp=2 with Seq1F1B (2 chunks): two ranks, K/V prefix inputs,
    weights, symbolic sizes, in a few seconds."""
    model, (ids, labels) = nanogpt.make(n_layer=2, n_embd=8, n_head=2, block_size=16)
    return parallelize(
        model,
        Mesh(pp=2),
        example_inputs=(ids[:2, :16], labels[:2, :16]),
        schedule="seq1f1b",
        seq_chunks=2,
        microbatches=2,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_program().save(tmp_path_factory.mktemp("prog") / "p")


# ---- crafting, as an attacker who can write the folder ---------------------------------------


def copy_program(src: Path, tmp: Path, name: str = "crafted") -> Path:
    out = tmp / name
    shutil.copytree(src, out, symlinks=True)
    return out


def rehash(root: Path) -> None:
    """Update every checksum to the files as they are now, as an attacker who knows the format
    would: plan.json's digest in every program.json, then plan.json's checksums."""
    head = json.loads((root / "plan.json").read_text())
    for f in sorted(root.glob("rank*/program.json")):
        doc = json.loads(f.read_text())
        if isinstance(doc, dict) and "plan_digest" in doc:
            f.write_text(json.dumps({**doc, "plan_digest": plan_digest(head)}))
    for rel in head["files"]:
        f = root / rel
        if f.is_file():
            head["files"][rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    (root / "plan.json").write_text(json.dumps(head))


def edit_json(root: Path, rel: str, edit: Callable[[dict], object]) -> None:
    f = root / rel
    doc = json.loads(f.read_text())
    edit(doc)
    f.write_text(json.dumps(doc))
    rehash(root)


def read_members(pt2: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(pt2) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def write_members(pt2: Path, members: list[tuple[str, bytes]], compress: int = 0) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of a duplicate name: that is the point
        with zipfile.ZipFile(pt2, "w", compression=compress) as z:
            for name, data in members:
                z.writestr(name, data)


def edit_model(root: Path, edit: Callable[[dict], object], rel="rank00000/stage0.pt2") -> None:
    """Change rank 0's stage graph JSON (``models/model.json``) and fix the checksums."""
    pt2 = root / rel
    members = read_members(pt2)
    i = next(i for i, (n, _) in enumerate(members) if n.endswith("/models/model.json"))
    model = json.loads(members[i][1])
    edit(model)
    members[i] = (members[i][0], json.dumps(model).encode())
    write_members(pt2, members)
    rehash(root)


def load_all(root: Path) -> Program:
    return Program.load(root)


# ---- 1. code runs on load --------------------------------------------------------------------


def _code(marker: Path) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).touch() or Symbol('s1', integer=True)"


@pytest.mark.parametrize("where", ["sym_int_values", "tensor_values"])
def test_python_in_a_symbolic_size_never_runs(saved: Path, tmp_path: Path, where: str) -> None:
    """Break 1a: torch hands ``expr_str`` to sympy.sympify, which evaluates it as Python."""
    marker = tmp_path / "pwned"
    payload = _code(marker)

    def plant(model: dict) -> None:
        graph = model["graph_module"]["graph"]
        if where == "sym_int_values":
            entry = next(iter(graph["sym_int_values"].values()))
            entry["as_expr"]["expr_str"] = payload
        else:
            sizes = next(
                t["sizes"]
                for t in graph["tensor_values"].values()
                if any("as_expr" in s for s in t["sizes"])
            )
            next(s for s in sizes if "as_expr" in s)["as_expr"]["expr_str"] = payload

    crafted = copy_program(saved, tmp_path)
    edit_model(crafted, plant)
    try:
        with pytest.raises(AutopartError) as err:
            load_all(crafted)
    finally:
        assert not marker.exists(), "the payload ran"
    assert "symbolic size" in err.value.message and "stage0.pt2" in err.value.message
    assert "expr_str" in err.value.message and "could run code" in err.value.hint
    assert not marker.exists()
    sympy.sympify(payload)  # the payload is real: evaluated, it does create the marker
    assert marker.exists()


def test_a_duplicate_zip_member_is_refused_unread(saved: Path, tmp_path: Path) -> None:
    """Break 1b: a pickle first, the original (empty) example inputs last. Python's zipfile
    reads the last copy, torch's reader the first, which its safe loader refuses and its
    fallback unpickles."""
    marker = tmp_path / "pwned"
    crafted = copy_program(saved, tmp_path)
    pt2 = crafted / "rank00000" / "stage0.pt2"
    members = read_members(pt2)
    i = next(i for i, (n, _) in enumerate(members) if n.endswith("sample_inputs/model.pt"))
    members.insert(i, (members[i][0], pickle.dumps(_Payload(marker))))
    write_members(pt2, members)
    rehash(crafted)
    try:
        with pytest.raises(AutopartError) as err:
            load_all(crafted)
    finally:
        assert not marker.exists(), "the payload ran"
    assert "/data/sample_inputs/model.pt' twice" in err.value.message


def test_case_colliding_zip_members_are_refused(saved: Path, tmp_path: Path) -> None:
    crafted = copy_program(saved, tmp_path)
    pt2 = crafted / "rank00000" / "stage0.pt2"
    members = read_members(pt2)
    top = members[0][0].split("/")[0]
    members.append((f"{top}/MODELS/model.json", b"{}"))
    write_members(pt2, members)
    rehash(crafted)
    with pytest.raises(AutopartError, match="differ only in case"):
        load_rank(crafted, 0)


def test_a_pytree_context_never_imports_a_module(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found on the way: torch parses a call signature's pytree contexts with a JSON hook that
    imports any module an ``"__enum__"`` object names; the old check read only the types."""
    marker = tmp_path / "pwned"
    (tmp_path / "autopart_evil_mod.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def plant(model: dict) -> None:
        sig = model["graph_module"]["module_call_graph"][0]["signature"]
        proto, spec = json.loads(sig["in_spec"])
        spec["context"] = json.dumps({"__enum__": 1, "fqn": "autopart_evil_mod:E", "name": "A"})
        sig["in_spec"] = json.dumps([proto, spec])

    crafted = copy_program(saved, tmp_path)
    edit_model(crafted, plant)
    try:
        with pytest.raises(AutopartError) as err:
            load_all(crafted)
    finally:
        assert not marker.exists() and "autopart_evil_mod" not in sys.modules, "it was imported"
    assert "in_spec" in err.value.message and "must be 'null'" in err.value.message


@pytest.mark.parametrize(
    "expr",
    [
        "Symbol('s1', integer=True).__class__",
        "Symbol('s1')[0]",
        "(lambda: 1)()",
        "[Integer(i) for i in range(3)]",
        "eval('1')",
        "Add(Symbol('s1'), 1 + 1)",
        "Symbol('__import__')",
        "Symbol('s1', **{'integer': True})",
        "Integer('1')",
        "Symbol('s1', evaluate=True)",
    ],
)
def test_the_symbolic_size_grammar_refuses_anything_but_constructors(expr: str) -> None:
    from autopart.program.symexpr import BadExpression, check_expression

    with pytest.raises(BadExpression):
        check_expression(expr)


def test_the_symbolic_size_grammar_accepts_what_torch_writes() -> None:
    from autopart.program.symexpr import check_expression

    s = "Symbol('s70', positive=True, integer=True)"
    for expr in (
        s,
        f"Add({s}, Integer(-1))",
        f"FloorDiv(Mul(Integer(3), {s}), Integer(2))",
        f"Max(Integer(1), Pow({s}, Integer(2)), Min({s}, Integer(4)))",
        f"Eq(Mod({s}, Integer(8)), Integer(0))",
    ):
        check_expression(expr)
        assert sympy.srepr(sympy.sympify(expr, locals=_torch_functions())) is not None


def _torch_functions() -> dict:
    from torch.utils._sympy.functions import FloorDiv, Mod

    return {"FloorDiv": FloorDiv, "Mod": Mod}


# ---- 2. files outside the folder -------------------------------------------------------------


def test_a_stage_file_outside_the_folder_is_never_read(saved: Path, tmp_path: Path) -> None:
    """Break 2a: ``stages[0].file = "../../x.pt2"`` in program.json, listed in plan.json."""
    crafted = copy_program(saved, tmp_path / "deep")
    outside = crafted.parent / "x.pt2"  # rank00000/../../x.pt2
    shutil.copy(crafted / "rank00000" / "stage0.pt2", outside)
    edit_json(
        crafted, "rank00000/program.json", lambda d: d["stages"][0].update(file="../../x.pt2")
    )
    head = json.loads((crafted / "plan.json").read_text())
    head["files"]["rank00000/../../x.pt2"] = hashlib.sha256(outside.read_bytes()).hexdigest()
    (crafted / "plan.json").write_text(json.dumps(head))
    with pytest.raises(AutopartError) as err:
        load_rank(crafted, 0)
    assert "plan.json" in err.value.message and "../../x.pt2" in err.value.message
    # with plan.json left alone, program.json's own field is refused
    head["files"].pop("rank00000/../../x.pt2")
    (crafted / "plan.json").write_text(json.dumps(head))
    with pytest.raises(AutopartError) as err:
        load_rank(crafted, 0)
    assert "program.json" in err.value.message and "stages[0].file" in err.value.message


@pytest.mark.parametrize(
    "link", ["rank00000/weights.pt", "rank00000/stage0.pt2", "plan.json", "rank00000"]
)
def test_a_symlink_in_the_folder_is_never_followed(saved: Path, tmp_path: Path, link: str) -> None:
    """Break 2b: a symlinked ``weights.pt`` (or graph, plan, rank folder) pointing at a copy of
    the real file outside the folder, so that even its checksum matches."""
    crafted = copy_program(saved, tmp_path)
    target = tmp_path / "elsewhere"
    shutil.move(crafted / link, target)
    (crafted / link).symlink_to(target, target_is_directory=target.is_dir())
    with pytest.raises(AutopartError) as err:
        load_all(crafted)
        load_weights(crafted, 0)
    assert "is a symbolic link" in err.value.message and link in err.value.message


def test_a_fifo_in_the_folder_is_refused_without_blocking(saved: Path, tmp_path: Path) -> None:
    crafted = copy_program(saved, tmp_path)
    (crafted / "rank00000" / "weights.pt").unlink()
    os.mkfifo(crafted / "rank00000" / "weights.pt")
    with pytest.raises(AutopartError, match="is not a regular file"):
        load_weights(crafted, 0)


def test_save_never_follows_a_symlinked_rank_folder(saved: Path, tmp_path: Path) -> None:
    """Break 2c: saving into a folder whose ``rank00003`` is a symlink deleted the files of
    the folder it points to (they have autopart's names)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("program.json", "weights.pt", "stage0.pt2", "stage0.py"):
        (victim / name).write_text(f"precious {name}")
    root = tmp_path / "out"
    root.mkdir()
    (root / "rank00003").symlink_to(victim, target_is_directory=True)
    program = Program.load(saved)
    try:
        with pytest.raises(AutopartError) as err:
            program.save(root)
    finally:
        kept = sorted(p.name for p in victim.iterdir())
        assert kept == ["program.json", "stage0.pt2", "stage0.py", "weights.pt"], kept
        assert all(p.read_text() == f"precious {p.name}" for p in victim.iterdir())
    assert "rank00003 is a symbolic link" in err.value.message


def test_save_replaces_a_symlinked_file_without_writing_through_it(
    saved: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim.pt"
    victim.write_text("precious")
    root = copy_program(saved, tmp_path, "out")
    (root / "rank00000" / "weights.pt").unlink()
    (root / "rank00000" / "weights.pt").symlink_to(victim)
    (root / "plan.json").unlink()
    (root / "plan.json").symlink_to(victim)
    Program.load(saved).save(root)
    assert victim.read_text() == "precious"
    assert not (root / "rank00000" / "weights.pt").is_symlink()
    assert not (root / "plan.json").is_symlink()
    assert load_weights(root, 0).keys() == load_weights(saved, 0).keys()


def test_a_folder_reached_through_a_link_still_loads(saved: Path, tmp_path: Path) -> None:
    """The folder you name may be a link (you chose it); only what is inside is never
    followed."""
    (tmp_path / "via").symlink_to(saved, target_is_directory=True)
    assert load_rank(tmp_path / "via", 1).actions == load_rank(saved, 1).actions


# ---- 3. malformed JSON, sizes ----------------------------------------------------------------

_WRONG_TYPES = {
    "stages-of-ints": ("rank00000/program.json", lambda d: d.update(stages=[1]), "stages[0]"),
    "shard-int": (
        "rank00000/program.json",
        lambda d: d["shards"].update({next(iter(d["shards"])): 5}),
        "shards.",
    ),
    "action-int": ("rank00000/program.json", lambda d: d.update(actions=[5]), "actions[0]"),
    "inputs-string": (
        "rank00000/program.json",
        lambda d: d["stages"][0].update(inputs="xy"),
        "stages[0].inputs",
    ),
    "input-pair-ints": (
        "rank00000/program.json",
        lambda d: d["stages"][0]["inputs"].__setitem__(0, [1, 2]),
        "stages[0].inputs[0]",
    ),
    "coords-list": ("rank00000/program.json", lambda d: d.update(coords=[]), "coords"),
    "chunk-cost-strings": (
        "rank00000/program.json",
        lambda d: d.update(chunk_cost=["a", "b"]),
        "chunk_cost[0]",
    ),
    "chunk-cost-odd-window": (
        "rank00000/program.json",
        lambda d: d.update(chunk_cost=[1.0, 2.0, 8.0]),
        "(window, share) pairs",
    ),
    "chunk-cost-window-shares": (
        "rank00000/program.json",
        lambda d: d.update(chunk_cost=[1.0, 2.0, 8.0, 0.75, 16.0, 0.5]),
        "add up to more than 1",
    ),
    "chunk-cost-window-fraction": (
        "rank00000/program.json",
        lambda d: d.update(chunk_cost=[1.0, 2.0, 8.5, 0.5]),
        "chunk_cost[2]",
    ),
    "kv-shape-float": (
        "rank00000/program.json",
        lambda d: d["stages"][0]["kv_shapes"].__setitem__(0, ["b", 2.5, 0, 4]),
        "stages[0].kv_shapes[0][1]",
    ),
    "params-int": ("plan.json", lambda d: d.update(params={"x": 1}), "params.x"),
    "plan-mesh-int": ("plan.json", lambda d: d["plan"].update(mesh=1), "plan.mesh"),
    "plan-seq-block-zero": ("plan.json", lambda d: d["plan"].update(seq_block=0), "plan.seq_block"),
    "tied-list": ("plan.json", lambda d: d.update(tied=[]), "tied"),
    "param-shape-strings": (
        "plan.json",
        lambda d: d["params"][next(iter(d["params"]))].update(shape=["a"]),
        ".shape[0]",
    ),
}


@pytest.mark.parametrize(
    ("number", "said"),
    [("9" * 5000, "holds an integer of 5000 digits"), ("1e999", "holds 1e999, beyond a float")],
)
def test_numbers_past_pythons_parser_are_refused(
    saved: Path, tmp_path: Path, number: str, said: str
) -> None:
    """An integer of 5000 digits raised Python's raw ValueError (past 4300 digits) from
    plan.json; one of a JSON string torch's archive holds (a node's annotations) too; 1e999
    was read as an infinity."""
    crafted = copy_program(saved, tmp_path)
    text = (crafted / "plan.json").read_text()
    (crafted / "plan.json").write_text(text.replace('"world_size": 2', f'"world_size": {number}'))
    with pytest.raises(AutopartError, match=said):
        read_head(crafted)
    with pytest.raises(Invalid, match=said):
        _embedded(f'{{"module": {number}}}', "nodes[3].meta.custom")


def test_json_denser_than_autopart_writes_is_refused_before_parsing(
    saved: Path, tmp_path: Path
) -> None:
    """Empty objects cost 3 bytes of JSON and about 70 bytes of Python: 256 MiB of
    ``[{},…]`` in a checkpoint marker or an archive's model.json took 7 GB before any check
    refused it (stranger probe, sixteenth session). The commas are counted first."""
    many = "[" + "{}," * (DENSE_FROM + 1) + "{}]"
    with pytest.raises(Invalid, match="denser than anything autopart writes"):
        parse_json(many, "marker")
    crafted = copy_program(saved, tmp_path)
    text = (crafted / "plan.json").read_text()
    (crafted / "plan.json").write_text(text.replace('"tied"', f'"padding": {many}, "tied"', 1))
    with pytest.raises(AutopartError, match="denser than anything autopart writes"):
        read_head(crafted)
    spread = "[" + "0, " * (DENSE_FROM + 1) + "0]"  # as many values, 3 bytes each: parsed
    assert len(parse_json(spread.replace(", ", ",        "), "x")) == DENSE_FROM + 2


@pytest.mark.parametrize("case", list(_WRONG_TYPES))
def test_json_of_the_wrong_types_is_refused_by_field(saved: Path, tmp_path: Path, case) -> None:
    """Break 3: program JSON of the wrong types raised a raw TypeError / AttributeError."""
    rel, edit, field = _WRONG_TYPES[case]
    crafted = copy_program(saved, tmp_path)
    edit_json(crafted, rel, edit)
    if rel == "plan.json":  # edit_json re-hashed the others; plan.json holds no own checksum
        pass
    with pytest.raises(AutopartError) as err:
        load_all(crafted)
    assert rel in err.value.message and field in err.value.message, err.value.message
    assert err.value.hint


@pytest.mark.parametrize(
    "edit",
    [
        lambda a: a.pop(2),  # found by the fuzz test in CI: one F dropped, every field valid
        lambda a: a.insert(0, a[0]),
        lambda a: a.__setitem__(slice(0, 2), a[1::-1]),
        lambda a: a.append({"kind": "DP_REDUCE", "stage": 0, "mb": 0, "chunk": 0}),
    ],
    ids=["dropped", "repeated", "swapped", "extra-reduce"],
)
def test_actions_must_be_the_plans_schedule(saved: Path, tmp_path: Path, edit) -> None:
    """Actions that are each well-formed but are not the list the plan's schedule generates
    (a dropped forward would skip work or hang the peer) are refused at load."""
    crafted = copy_program(saved, tmp_path)
    edit_json(crafted, "rank00000/program.json", lambda d: edit(d["actions"]))
    with pytest.raises(AutopartError, match=r"actions\[\d+\] = .* schedule gives pipeline rank 0"):
        load_rank(crafted, 0)


@pytest.mark.parametrize(
    ("edit", "said"),
    [  # the first found by a random fuzz run: a tie dropped, the folder loaded untied
        (lambda d: d["ties"].__setitem__("transformer.wte.weight", []), "not plan.json's ties"),
        (lambda d: d["ties"].clear(), "not plan.json's ties"),
        (lambda d: d["buckets"].append([next(iter(d["shards"]))]), "are not empty"),
        # and the chunk-boundary coefficients, which every rank must share (found the same way)
        (lambda d: d.__setitem__("chunk_cost", None), "does not fit a 'seq1f1b' plan"),
        (lambda d: d["chunk_cost"].__setitem__(0, 2.5), "differs from plan.json's"),
    ],
    ids=["tie-emptied", "ties-dropped", "bucket-at-dp1", "no-chunk-cost", "other-chunk-cost"],
)
def test_ties_buckets_and_chunk_costs_must_be_the_plans(
    saved: Path, tmp_path: Path, edit, said: str
) -> None:
    """A rank's ties are plan.json's ties of its shards, and its buckets hold every shard once
    (dp > 1) or none (dp = 1): a dropped tie would train the copies apart, a dropped bucket
    leave a gradient unreduced."""
    crafted = copy_program(saved, tmp_path)
    edit_json(crafted, "rank00000/program.json", edit)
    with pytest.raises(AutopartError, match=said):
        load_rank(crafted, 0)


@pytest.mark.parametrize(
    "edit",
    [  # found by CI's fuzz run: plan.json without the LM head's alias loaded as an untied model
        lambda d: d["tied"].clear(),
        lambda d: d["tied"].update({"lm_head.weight": "transformer.wpe.weight"}),
        # found by editing each field of plan.json in turn: each loaded as another program
        lambda d: d["plan"].update(seq_block=2),
        lambda d: d["plan"].update(bucket_mb=50.0),
        lambda d: d["plan"].update(distributed_optimizer=True),
        lambda d: d.update(example_shape=[3, 16]),
        lambda d: d["plan"].pop("max_seq"),
    ],
    ids=["alias-dropped", "alias-moved", "seq-block", "bucket-mb", "zero", "example", "max-seq"],
)
def test_an_edited_plan_json_is_refused_by_every_rank(saved: Path, tmp_path: Path, edit) -> None:
    """plan.json holds the other files' checksums, so none covers it: every program.json
    records its digest instead. A plan.json edited in a field no other file repeats (the tied
    aliases ``full_state_dict`` gives back, the sequence block the runner checks lengths
    against, the defaults ``autopart run`` takes), with every file checksum updated, is
    refused by the launcher's ``read_head`` and by each rank."""
    crafted = copy_program(saved, tmp_path)
    head = json.loads((crafted / "plan.json").read_text())
    assert head["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    edit(head)
    (crafted / "plan.json").write_text(json.dumps(head))
    for load in (read_head, lambda root: load_rank(root, 1)):
        with pytest.raises(AutopartError, match="its digest differs"):
            load(crafted)
    rehash(crafted)  # the edit alone, resealed: each field still passes its own checks
    read_head(crafted)


@pytest.mark.parametrize(
    ("rel", "edit", "said"),
    [
        ("plan.json", lambda d: d["tied"].update({"transformer.h.0.ln_1.bias": "x"}), "not a"),
        (
            "plan.json",
            lambda d: d["tied"].update({"transformer.wpe.weight": "transformer.wte.weight"}),
            "own",
        ),
        # found by editing each field of program.json in turn: each loaded as another program
        (
            "rank00000/program.json",
            lambda d: d["shards"]["transformer.wpe.weight"].update(strided=2),
            "slice",
        ),
        ("rank00000/program.json", lambda d: d.pop("vocab_size"), "vocab_size"),
        ("rank00000/program.json", lambda d: d.update(vocab_size=97), "vocab_size"),
        (
            "rank00000/program.json",
            lambda d: d["frozen"].append("transformer.wpe.weight"),
            "frozen",
        ),
        (
            "rank00000/program.json",
            lambda d: d.update(batch=["input_ids", "labels", "position_ids"]),
            "batch",
        ),
        (
            "plan.json",
            lambda d: d["params"]["transformer.wpe.weight"].update(split=[0, 1]),
            "split",
        ),
    ],
    ids=[
        "alias-of-nothing",
        "alias-of-a-parameter",
        "strided",
        "no-vocab",
        "vocab",
        "frozen",
        "batch",
        "split",
    ],
)
def test_what_a_rank_repeats_must_be_plan_jsons(
    saved: Path, tmp_path: Path, rel: str, edit, said: str
) -> None:
    """Tied aliases name a parameter and are none themselves; a rank's vocabulary, batch
    names, frozen parameters and each shard's slice are what plan.json gives (resealed)."""
    crafted = copy_program(saved, tmp_path)
    edit_json(crafted, rel, edit)
    with pytest.raises(AutopartError, match=said):
        load_rank(crafted, 0)


def test_buckets_must_be_exactly_the_parameters_read(tmp_path: Path) -> None:
    """dp = 2, with a module the forward never uses: its parameter is held but in no bucket (its
    gradient stays None, as on one device) and the folder loads. A bucket that leaves out a
    parameter the graph reads (it would not be reduced over the replicas), or that holds the
    unused one, is refused naming it."""
    model, (ids, labels) = nanogpt.make(n_layer=2, n_embd=8, n_head=2, block_size=16)
    model.unused = torch.nn.Linear(4, 4)
    saved = parallelize(model, Mesh(dp=2), example_inputs=(ids[:2, :16], labels[:2, :16]))
    saved = saved.save(tmp_path / "p")
    rank = load_rank(saved, 0)
    assert "unused.weight" in rank.shards
    assert all("unused.weight" not in b for b in rank.buckets)
    read = next(f for b in rank.buckets for f in b)
    dropped = copy_program(saved, tmp_path, "dropped")
    edit_json(dropped, "rank00000/program.json", lambda d: d["buckets"][0].remove(read))
    with pytest.raises(AutopartError, match=f"leave out '{re.escape(read)}'"):
        load_rank(dropped, 0)
    held = copy_program(saved, tmp_path, "held")
    edit_json(held, "rank00000/program.json", lambda d: d["buckets"][0].append("unused.weight"))
    with pytest.raises(AutopartError, match="hold 'unused.weight', which the stage graphs never"):
        load_rank(held, 0)


@pytest.mark.parametrize("kind", [None, 0, 3, True])
def test_an_argument_kind_torch_would_guess_is_refused(saved: Path, tmp_path: Path, kind) -> None:
    """An input's ``kind`` (1 positional, 2 keyword) left to torch's guess from the op schema
    loaded another graph than was saved (a random fuzz run); only 1 and 2 are read."""
    crafted = copy_program(saved, tmp_path)

    def plant(model: dict) -> None:
        node = next(n for n in model["graph_module"]["graph"]["nodes"] if n["inputs"])
        node["inputs"][0]["kind"] = kind

    edit_model(crafted, plant)
    with pytest.raises(AutopartError, match=r"inputs\[0\]\.kind = .* is not one of \[1, 2\]"):
        load_rank(crafted, 0)


def test_a_stage_input_naming_another_parameter_is_refused(saved: Path, tmp_path: Path) -> None:
    """One flipped byte (``ln_1`` → ``ln_2``, a random fuzz run) fed a stage the wrong weight of
    the same shape; a parameter input must name the placeholder it feeds."""

    def swap(doc: dict) -> None:
        inputs = doc["stages"][0]["inputs"]
        j = inputs.index(["param", "transformer.h.0.ln_1.weight"])
        inputs[j] = ["param", "transformer.h.0.ln_2.weight"]

    crafted = copy_program(saved, tmp_path)
    edit_json(crafted, "rank00000/program.json", swap)
    with pytest.raises(AutopartError, match=r"placeholder transformer_h_0_ln_1_weight .* another"):
        load_rank(crafted, 0)


def test_a_huge_kv_shape_is_refused(saved: Path, tmp_path: Path) -> None:
    """Break 3: a declared K/V prefix of 1e13 elements was accepted (the runtime would then
    allocate it as zeros for the first chunk)."""
    crafted = copy_program(saved, tmp_path)
    edit_json(
        crafted,
        "rank00000/program.json",
        lambda d: d["stages"][0]["kv_shapes"].__setitem__(0, ["b", 100000, 100000, 1000]),
    )
    with pytest.raises(AutopartError) as err:
        load_rank(crafted, 0)
    assert "kv_shapes[0]" in err.value.message and "not an empty prefix" in err.value.message


def test_a_schedule_larger_than_the_actions_is_refused_before_it_is_generated(
    saved: Path, tmp_path: Path
) -> None:
    """A stranger's plan.json of 65536 micro-batches (every digest and checksum updated)
    made the loader generate the schedule it claims, 24 GB of actions, before comparing it
    with the rank's: killed by the kernel (a raw ``MemoryError`` under a memory limit). The
    rank's actions must hold one forward per (stage, micro-batch, chunk) first, so the file
    bounds what is generated."""
    crafted = copy_program(saved, tmp_path)
    edit_json(crafted, "plan.json", lambda d: d["plan"].__setitem__("microbatches", 65536))
    with pytest.raises(AutopartError, match=r"for this rank's [\d,]+ \(stage, micro-batch"):
        load_rank(crafted, 0)


def test_a_rank_checks_every_file_against_the_plan_json_it_read_first(
    saved: Path, tmp_path: Path
) -> None:
    """A rank read plan.json up to three times: a folder swapped for another genuine program
    between the reads gave it one program's plan and the other's actions (a raw
    ``IndexError`` in the runner). It reads plan.json once and checks every other file
    against that one: a file of the other program fails its checksum."""
    head = read_head(saved)
    other = copy_program(saved, tmp_path, "other")  # valid, with another schedule's actions
    edit_json(other, "rank00000/program.json", lambda d: d.__setitem__("buckets", d["buckets"]))
    edit_json(other, "plan.json", lambda d: d["plan"].__setitem__("bucket_mb", 1.0))
    assert read_head(other) != head
    with pytest.raises(AutopartError, match="does not match its checksum in plan.json"):
        load_rank(other, 0, head=head)
    with pytest.raises(AutopartError, match="does not match its checksum in plan.json"):
        load_weights(other, 0, head=head)


def test_a_kv_shape_must_match_its_placeholder(saved: Path, tmp_path: Path) -> None:
    crafted = copy_program(saved, tmp_path)
    edit_json(
        crafted,
        "rank00000/program.json",
        lambda d: d["stages"][0]["kv_shapes"][0].__setitem__(1, 7),
    )
    with pytest.raises(AutopartError, match=r"kv_shapes\[0\] = \['b', 7, 0, 4\] is not the shape"):
        load_rank(crafted, 0)


def test_a_weights_bomb_is_refused_before_it_inflates(saved: Path, tmp_path: Path) -> None:
    """Break 3: a 262 KB weights.pt that inflates to 256 MiB was accepted. Now its deflated
    member is refused from the zip directory alone (torch.save stores members), and so is a
    stored one out of proportion to the parameter shapes."""
    crafted = copy_program(saved, tmp_path)
    name = "transformer.wte.weight"
    buf = io.BytesIO()
    torch.save({name: torch.zeros(1 << 26)}, buf)  # 256 MiB of float32 zeros
    bomb = crafted / "rank00000" / "weights.pt"
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        write_members(bomb, [(i.filename, z.read(i)) for i in z.infolist()], zipfile.ZIP_DEFLATED)
    assert bomb.stat().st_size < 300_000
    rehash(crafted)
    with pytest.raises(AutopartError) as err:
        load_weights(crafted, 0)
    assert "is compressed" in err.value.message and "weights.pt" in err.value.message
    bomb.write_bytes(buf.getvalue())  # the same, stored: 256 MiB for a 2 KB rank
    rehash(crafted)
    with pytest.raises(AutopartError, match="more than the .* this program can need"):
        load_weights(crafted, 0)


def test_a_large_file_failing_its_checksum_is_never_read_whole(tmp_path: Path) -> None:
    """A sparse 12 GiB ``weights.pt`` under a forged parameter shape was read into memory
    before its checksum failed (a raw ``MemoryError``). A file of more than ``HASH_FIRST``
    bytes is hashed in blocks first: here a sparse 512 MiB file with another checksum is
    refused while the process's peak memory grows by a small part of that."""
    (tmp_path / "rank00000").mkdir()
    with open(tmp_path / "rank00000" / "weights.pt", "wb") as f:
        f.truncate(1 << 29)  # sparse: no disk
    code = (
        "import resource, sys\n"
        "from autopart.errors import AutopartError\n"
        "from autopart.program.folder import ProgramFolder\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        f"    ProgramFolder({str(tmp_path)!r}).read('rank00000/weights.pt', 1 << 30, '0' * 64)\n"
        "except AutopartError as exc:\n"
        "    assert 'does not match its checksum' in exc.message, exc.message\n"
        "    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
        "    sys.exit(0 if grown < (128 << 10) else f'peak memory grew by {grown} KiB')\n"
        "sys.exit('read without a refusal')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_weights_must_be_the_ranks_own_tensors(saved: Path, tmp_path: Path) -> None:
    crafted = copy_program(saved, tmp_path)
    weights = load_weights(saved, 0)
    name = next(iter(weights))
    wrong = weights[name].view(torch.int32)  # same bytes, another dtype
    torch.save({**weights, name: wrong}, crafted / "rank00000" / "weights.pt")
    rehash(crafted)
    with pytest.raises(AutopartError, match=f"{name} is .* but the program needs"):
        load_weights(crafted, 0)


def test_the_saved_program_still_loads_and_round_trips(saved: Path, tmp_path: Path) -> None:
    program = Program.load(saved)
    again = Program.load(program.save(tmp_path / "again"))
    assert [rp.actions for rp in again.ranks] == [rp.actions for rp in program.ranks]
    assert [[s.graph.code for s in rp.stages] for rp in again.ranks] == [
        [s.graph.code for s in rp.stages] for rp in program.ranks
    ]
    assert read_head(saved)["files"].keys() == read_head(tmp_path / "again")["files"].keys()
    for name, t in program.params.items():
        assert torch.equal(again.params[name], t), name


def test_a_frozen_parameter_is_recorded_and_checked(tmp_path: Path) -> None:
    """A parameter the model froze (``requires_grad=False``) is named in its rank's
    ``program.json``, so a loaded program (``autopart run``, the live API's hand-over) keeps it
    frozen: it used to come back trainable. A crafted entry plan.json does not list is
    refused."""
    model, (ids, labels) = nanogpt.make(n_layer=2, n_embd=8, n_head=2, block_size=16)
    model.transformer.ln_f.weight.requires_grad_(False)
    saved = parallelize(model, Mesh(pp=2), example_inputs=(ids[:2, :16], labels[:2, :16]))
    saved = saved.save(tmp_path / "p")
    assert load_rank(saved, 1).frozen == ("transformer.ln_f.weight",)
    assert load_rank(saved, 0).frozen == ()
    crafted = copy_program(saved, tmp_path, "crafted")
    edit_json(crafted, "rank00000/program.json", lambda d: d["frozen"].append("nope.weight"))
    with pytest.raises(AutopartError, match=r"frozen = \['nope.weight'\] are not plan.json's"):
        load_rank(crafted, 0)


def test_a_tp_program_loads_after_a_bare_import_autopart(tmp_path: Path) -> None:
    """autopart's collectives (``torch.ops.autopart.tp_reduce``, ...) were registered only by
    importing ``autopart.collectives``: a valid tp=2 folder loaded in a fresh process after
    ``import autopart`` was refused as "not a loadable torch.export program". The loader now
    registers autopart's ops itself."""
    model, (ids, labels) = nanogpt.make(n_layer=1, n_embd=8, n_head=2, block_size=16)
    program = parallelize(model, Mesh(tp=2), example_inputs=(ids[:2, :16], labels[:2, :16]))
    root = program.save(tmp_path / "tp2")
    assert any(
        n.target == torch.ops.autopart.tp_reduce.default
        for n in program.ranks[0].stages[0].graph.graph.nodes
    )
    code = (
        "import sys, autopart\n"
        "from autopart.program.format import Program, load_rank\n"
        "p = Program.load(sys.argv[1])\n"
        "r = load_rank(sys.argv[1], 1)\n"
        "print(len(p.ranks), r.rank)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "1"]


@pytest.mark.parametrize("how", ["same", "overlap", "larger", "self_overlap"])
def test_weights_sharing_a_storage_are_refused(saved: Path, tmp_path: Path, how: str) -> None:
    """A weights.pt whose entries shared one storage (one tensor twice, or views overlapping in
    a larger one) was accepted, and training then kept them tied though nothing declared a tie
    (the probe's s_alias). Each tensor must own a storage of exactly its size."""
    crafted = copy_program(saved, tmp_path)
    weights = load_weights(saved, 0)
    a = max(weights, key=lambda n: weights[n].numel())
    b = next(n for n, t in weights.items() if n != a and 0 < t.numel() < weights[a].numel())
    if how == "same":
        a, b = next(
            (m, n)
            for m in weights
            for n in weights
            if m < n and weights[m].shape == weights[n].shape
        )
        weights[b] = weights[a]
    elif how == "overlap":
        flat = weights[a].flatten().clone()
        weights[a] = flat.view(weights[a].shape)
        weights[b] = flat[1 : 1 + weights[b].numel()].view(weights[b].shape)
    elif how == "larger":  # one element more, within the bytes a dropped tensor frees
        del weights[b]
        weights[a] = torch.cat([weights[a].flatten(), weights[a].flatten()[:1]])[1:].view(
            weights[a].shape
        )
    else:
        row = weights[a].flatten()[: weights[a].shape[-1]].clone()
        weights[a] = row.expand(weights[a].shape)  # every row the same bytes
    torch.save(weights, crafted / "rank00000" / "weights.pt")
    rehash(crafted)
    with pytest.raises(AutopartError) as err:
        load_weights(crafted, 0)
    msg = err.value.message
    assert msg.startswith(f"{crafted / 'rank00000' / 'weights.pt'}: ")
    if how in ("same", "overlap"):
        assert f"{b} and {a} share one storage" in msg or f"{a} and {b} share one storage" in msg
    elif how == "larger":
        assert f"{a} is a view" in msg
    else:
        assert a in msg and "own storage" in err.value.hint


def test_a_parameter_entry_is_loaded_as_a_plain_tensor(saved: Path, tmp_path: Path) -> None:
    """A weights.pt entry saved as ``nn.Parameter(requires_grad=False)``, with an attribute set
    on it, loaded as that Parameter: the runner took it as frozen (plan.json's frozen list
    empty) and trained around it silently, and on one dp replica only the gradient buckets
    differed in size (gloo aborted the process). What trains is plan.json's to say: every
    entry loads as a plain tensor, with no attribute of the file's."""
    crafted = copy_program(saved, tmp_path)
    weights = load_weights(saved, 0)
    name = next(iter(weights))
    frozen = torch.nn.Parameter(weights[name].clone(), requires_grad=False)
    frozen.planted = "from the file"  # type: ignore[attr-defined]
    torch.save({**weights, name: frozen}, crafted / "rank00000" / "weights.pt")
    rehash(crafted)
    got = load_weights(crafted, 0)[name]
    assert type(got) is torch.Tensor and not hasattr(got, "planted")
    assert torch.equal(got, weights[name])
    assert load_rank(crafted, 0).frozen == ()
