"""Loading a saved program runs no code from it: crafted stage archives (with plan.json's
checksums updated to match, as an attacker would) are refused before torch reads them, and a
marker file their payload would create does not appear."""

from __future__ import annotations

import hashlib
import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import nanogpt
from torch import fx

from autopart import AutopartError, Mesh, parallelize
from autopart.program.archive import check_targets
from autopart.program.format import load_rank


class _Payload:
    """Unpickling this creates ``path``: what a malicious constant would do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    model, batch = nanogpt.make()
    program = parallelize(model, Mesh(dp=2), example_inputs=batch, microbatches=2)
    return program.save(tmp_path_factory.mktemp("prog") / "p")


def _craft(root: Path, tmp: Path, edit) -> Path:
    """A copy of the program whose rank-0 stage archive ``edit(members)`` changed, with its
    SHA-256 in plan.json updated to match."""
    import shutil

    out = tmp / "crafted"
    shutil.copytree(root, out)
    pt2 = out / "rank00000" / "stage0.pt2"
    with zipfile.ZipFile(pt2) as z:
        members = {i.filename: z.read(i.filename) for i in z.infolist()}
    edit(members)
    with zipfile.ZipFile(pt2, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    head = json.loads((out / "plan.json").read_text())
    head["files"]["rank00000/stage0.pt2"] = hashlib.sha256(pt2.read_bytes()).hexdigest()
    (out / "plan.json").write_text(json.dumps(head))
    return out


def test_a_pickled_constant_is_refused_unread(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))

    def plant(members: dict) -> None:
        top = next(iter(members)).split("/")[0]
        members[f"{top}/data/constants/c0.pt"] = payload
        members[f"{top}/data/constants/model_constants_config.json"] = json.dumps(
            {"config": {"c0": {"path_name": "c0.pt", "is_param": False, "use_pickle": True}}}
        ).encode()

    crafted = _craft(saved, tmp_path, plant)
    with pytest.raises(AutopartError) as err:
        load_rank(crafted, 0)
    assert "it holds 'data/constants/c0.pt', which autopart never writes" in err.value.message
    assert "could run code" in err.value.hint
    assert not marker.exists()
    pickle.loads(payload)  # the payload is real: unpickled, it does create the marker
    assert marker.exists()


@pytest.mark.parametrize("target", ["builtins.exec", "os.system", "torch.load"])
def test_an_unknown_call_target_is_refused_unread(saved: Path, tmp_path: Path, target) -> None:
    def retarget(members: dict) -> None:
        name = next(n for n in members if n.endswith("models/model.json"))
        model = json.loads(members[name])
        model["graph_module"]["graph"]["nodes"][0]["target"] = target
        members[name] = json.dumps(model).encode()

    with pytest.raises(AutopartError) as err:
        load_rank(_craft(saved, tmp_path, retarget), 0)
    assert f"a node calls {target!r}, which is not an ATen op" in err.value.message


@pytest.mark.parametrize("what", ["guards", "sample", "extra"])
def test_guard_code_example_inputs_and_foreign_members_are_refused(saved, tmp_path, what) -> None:
    def edit(members: dict) -> None:
        top = next(iter(members)).split("/")[0]
        if what == "guards":
            name = f"{top}/models/model.json"
            model = json.loads(members[name])
            model["guards_code"] = ["__import__('os').system('true')"]
            members[name] = json.dumps(model).encode()
        elif what == "sample":
            members[f"{top}/data/sample_inputs/model.pt"] = pickle.dumps(_Payload(tmp_path / "m"))
        else:
            members[f"{top}/data/weights/w0.pt"] = b"x"

    with pytest.raises(AutopartError) as err:
        load_rank(_craft(saved, tmp_path, edit), 0)
    assert {"guards": "guard code", "sample": "example inputs", "extra": "'data/weights/w0.pt'"}[
        what
    ] in err.value.message
    assert not (tmp_path / "m").exists()


def test_the_saved_archives_pass_and_a_loaded_graph_calls_only_known_ops(saved: Path) -> None:
    rp = load_rank(saved, 0)  # autopart's own archives load
    assert rp.stages
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(print, (x,)))
    with pytest.raises(AutopartError) as err:
        check_targets(fx.GraphModule(torch.nn.Module(), g), Path("stage0.pt2"))
    assert "calls <built-in function print>" in err.value.message


def _with_call(saved: Path, out: Path, target, args: tuple, val) -> Path:
    """The saved program with ``target(*args)`` inserted first in rank 0's stage graph, written
    by autopart's own ``Program.save`` (so every archive check passes): what the probe did."""
    from autopart.program.format import Program

    program = Program.load(saved)
    gm = program.ranks[0].stages[0].graph
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        node = gm.graph.call_function(target, args)
    fake = next(
        n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
    )
    with fake.fake_mode:
        node.meta["val"] = val() if callable(val) else val
    gm.recompile()
    return program.save(out)


@pytest.mark.parametrize(
    "case",
    [
        ("from_file", "takes the string argument 'filename'"),
        ("print", "returns nothing"),
    ],
)
def test_an_aten_op_with_side_effects_is_refused_at_load(saved: Path, tmp_path: Path, case):
    """Any ATen op passed the loader (issue: the probe's aten.from_file read /etc/passwd and
    created files at the first step); one that returns nothing or takes a string is refused
    before the graph runs, naming file and node (an op writing an argument cannot be saved:
    torch.export's verifier refuses it; the rules are tested op by op below)."""
    kind, why = case
    victim = tmp_path / "victim"
    aten = torch.ops.aten
    target, args, val = {
        "from_file": (aten.from_file.default, (str(victim), True, 16), None),
        "print": (aten._print.default, ("HOSTILE",), None),
    }[kind]
    if kind == "from_file":
        val = lambda: torch.empty(16, dtype=torch.float32)  # noqa: E731
    saved_with = _with_call(saved, tmp_path / "p", target, args, val)
    with pytest.raises(AutopartError) as err:
        load_rank(saved_with, 0)
    msg = err.value.message
    assert msg.startswith(f"{saved_with / 'rank00000' / 'stage0.pt2'}: node ")
    assert f"calls {target}, which {why}" in msg and "was not run" in msg
    assert not victim.exists()


@pytest.mark.parametrize(
    "op",
    [
        "mm.default",
        "einsum.default",
        "gelu.default",
        "div.Tensor_mode",
        "_assert_tensor_metadata.default",
        "_assert_scalar.default",
        "sym_constrain_range_for_size.default",
        "scaled_dot_product_attention.default",
        "_to_copy.default",
        "pad.default",
    ],
)
def test_the_aten_ops_programs_use_are_allowed(op: str) -> None:
    from autopart.program.archive import aten_refusal

    packet, overload = op.split(".")
    assert aten_refusal(getattr(getattr(torch.ops.aten, packet), overload)) is None


@pytest.mark.parametrize(
    "op",
    [
        "from_file.default",
        "_print.default",
        "save.default",
        "manual_seed.default",
        "set_grad_enabled.default",
        "warn.default",
        "copy_.default",
        "index_put_.default",
        "add.out",
        "set.source_Storage",
        "sparse_coo_tensor.indices",
        "_nested_view_from_buffer.default",
        "_cufft_set_plan_cache_max_size.default",
        "get_autocast_dtype.default",
        # kernels that trust their arguments' sizes: a hostile graph's short scales tensor was
        # read past its end, or killed the rank (SIGSEGV); internal ops are an allow-list now
        "_weight_int4pack_mm_for_cpu.default",
        "_weight_int8pack_mm.default",
        "_dyn_quant_matmul_4bit.default",
        "_embedding_bag.default",
        "quantize_per_tensor.default",
    ],
)
def test_side_effecting_aten_ops_are_refused(op: str) -> None:
    from autopart.program.archive import aten_refusal

    packet, overload = op.split(".")
    assert aten_refusal(getattr(getattr(torch.ops.aten, packet), overload)) is not None
