"""Library custom ops with no ATen decomposition (program/libraries.py, docs/capture.md).

A real library is written here: a package ``autopart_testops`` whose op
``torch.ops.autopart_testops.scaled_silu`` has a fake kernel and a derivative but no
decomposition, installed as a distribution (a ``dist-info`` record, version 1.0). nanoGPT's
MLP activation is replaced by it. Compiling is refused unless the user trusts the namespace;
trusted, the program trains exactly (float64 parity on real gloo ranks, forked and through
torchrun from the saved folder) and records the version; loading it is refused unless the loader
names the namespace too, and when the installed version differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_loader import rehash
from torch import fx, nn

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.parity.verify import Check, launch_forked, verify_many
from autopart.program.format import Program, load_rank

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

LIB = "autopart_testops"
SOURCE = """
import torch


@torch.library.custom_op("autopart_testops::scaled_silu", mutates_args=())
def scaled_silu(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * torch.sigmoid(x) * alpha


@scaled_silu.register_fake
def _(x, alpha):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.alpha = inputs[1]


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    s = torch.sigmoid(x)
    return grad * ctx.alpha * (s + x * s * (1 - s)), None


scaled_silu.register_autograd(_backward, setup_context=_setup)
"""


def _dist_info(site: Path, version: str) -> None:
    for old in site.glob(f"{LIB}-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"{LIB}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {LIB}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{LIB}\n")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory):
    """The library, installed in a folder on sys.path (and PYTHONPATH, for torchrun's ranks)."""
    import os

    site = tmp_path_factory.mktemp("site")
    (site / LIB).mkdir()
    (site / LIB / "__init__.py").write_text(SOURCE)
    _dist_info(site, "1.0")
    sys.path.insert(0, str(site))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), old]))
    try:
        __import__(LIB)
        yield site
    finally:
        sys.path.remove(str(site))
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


class Act(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.autopart_testops.scaled_silu(x, 1.5)


def make():
    import nanogpt

    __import__(LIB)  # as a model's own module imports the library it calls

    model, batch = nanogpt.make()
    for block in model.transformer.h:
        block.mlp.gelu = Act()
    return model, batch


def test_a_library_op_is_refused_unless_trusted(site: Path) -> None:
    """Without the opt-in, compile refuses the op before the passes, naming the node, the op,
    its namespace and the opt-in. With it, Seq1F1B still refuses the op (no sequence rule
    proves it position-wise). A namespace that is ATen's, or not a plain name, is refused."""
    model, batch = make()
    with pytest.raises(AutopartError) as err:
        parallelize(model, Mesh(dp=2), example_inputs=batch)
    message = str(err.value)
    assert "autopart_testops::scaled_silu" in message and "transformer.h.0.mlp" in message
    assert "library_ops=('autopart_testops',)" in message, message
    with pytest.raises(AutopartError, match="scaled_silu has no sequence rule"):
        parallelize(
            model,
            Mesh(pp=2),
            example_inputs=batch,
            schedule="seq1f1b",
            seq_chunks=2,
            microbatches=2,
            library_ops=(LIB,),
        )
    for bad in ("aten", "a.b", "", "../x"):
        with pytest.raises(AutopartError, match="is not a library namespace"):
            parallelize(model, Mesh(dp=2), example_inputs=batch, library_ops=(bad,))


@pytest.mark.multirank
def test_a_trusted_library_op_trains_exactly_in_memory(site: Path) -> None:
    """Trusted at compile time, dp=2 matches one device in float64 (forked ranks, the program
    in memory); the slow twin adds pp and tp, torchrun ranks and autopart run."""
    results = verify_many(
        {"dp": Check(make, dp=2, microbatches=2, library_ops=(LIB,))}, via="fork", timeout_s=120
    )
    assert results["dp"].ok, results["dp"]


def test_a_saved_library_program_loads_only_when_named(site: Path, tmp_path: Path) -> None:
    """The saved plan.json records {namespace: version}; loading without naming the namespace
    is refused, naming it loads, and another installed version is refused."""
    model, batch = make()
    folder = parallelize(
        model, Mesh(pp=2), example_inputs=batch, microbatches=2, library_ops=(LIB,)
    ).save(tmp_path / "p")
    head = json.loads((folder / "plan.json").read_text())
    assert head["libraries"] == {LIB: "1.0"} and head["plan"]["library_ops"] == [LIB]
    with pytest.raises(AutopartError) as err:
        load_rank(folder, 0)
    assert f"calls ops of the library '{LIB}' (version 1.0" in str(err.value)
    assert f"--library-ops {LIB}" in str(err.value)
    assert len(Program.load(folder, library_ops=[LIB]).ranks) == 2
    _dist_info(site, "1.1")  # another version installed
    try:
        with pytest.raises(AutopartError, match=f"compiled against {LIB} 1.0, and {LIB} 1.1"):
            load_rank(folder, 1, [LIB])
    finally:
        _dist_info(site, "1.0")


@pytest.mark.slow  # three plans twice (forked, torchrun) and autopart run: about 40 s
@pytest.mark.multirank
def test_a_trusted_library_op_trains_exactly_and_runs_from_its_folder(
    site: Path, tmp_path: Path
) -> None:
    """Trusted at compile time: dp=2, pp=2 and tp=2 match one device in float64, with the
    program in memory (forked ranks) and saved (torchrun ranks loading it, naming the
    namespace); autopart run with --library-ops trains from the saved folder, and autopart
    train with [parallel] library_ops (refused without it)."""
    trust = {"library_ops": (LIB,)}
    checks = {
        "dp": Check(make, dp=2, microbatches=2, **trust),
        "pp": Check(make, pp=2, microbatches=2, **trust),
        "tp": Check(make, tp=2, **trust),  # no tp rule for the op: its MLP stays replicated
    }
    for via in ("fork", "torchrun"):
        results = verify_many(checks, via=via, timeout_s=120)
        for name, report in results.items():
            assert not isinstance(report, AutopartError), f"{via} {name}: {report}"
            assert report.ok, f"{via} {name}: {report}"
    model, batch = make()
    folder = parallelize(model, Mesh(pp=2), example_inputs=batch, microbatches=2, **trust).save(
        tmp_path / "p"
    )
    out = launch_forked(
        2,
        ["-m", "autopart.runtime.run", str(folder), "--json", "--steps", "2", "--library-ops", LIB],
        timeout_s=120,
    )
    losses = [json.loads(x)["loss"] for x in out.splitlines() if x.startswith('{"step"')]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), out
    # autopart train: the config's [parallel] library_ops is the trust (and without it, refused)
    spec = f"{Path(__file__).resolve()}:make"
    config, ids = tmp_path / "train.toml", tmp_path / "ids.pt"
    torch.save(torch.randint(0, 96, (2000,)), ids)  # nanoGPT's vocabulary of 96
    for trusted in (False, True):
        config.write_text(
            f'out = "{tmp_path / "run"}"\n[model]\nspec = "{spec}"\n'
            f"[parallel]\ntp = 1\npp = 2\nmicrobatches = 2\n"
            f"library_ops = {json.dumps([LIB] if trusted else [])}\n"
            f'[data]\ntokens = "{ids}"\nseq_len = 16\nbatch_size = 4\n'
            "[train]\nsteps = 2\n[eval]\nevery = 0\n"
        )
        p = subprocess.run(
            [sys.executable, "-m", "autopart", "train", str(config)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        if not trusted:
            assert p.returncode == 2 and f"library_ops=('{LIB}',)" in p.stderr, p.stderr
            continue
        assert p.returncode == 0, p.stdout + p.stderr
        rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == [1, 2]


def test_a_stage_graph_calling_an_untrusted_namespace_is_refused(
    site: Path, tmp_path: Path
) -> None:
    """A crafted plan.json that drops its libraries entry does not make the graphs' library
    calls loadable: the archive check refuses the op of a namespace the load does not trust,
    before torch reads the archive; so does naming another namespace in the entry."""
    model, batch = make()
    folder = parallelize(model, Mesh(), example_inputs=batch, library_ops=(LIB,)).save(
        tmp_path / "p"
    )
    head = json.loads((folder / "plan.json").read_text())
    (folder / "plan.json").write_text(
        json.dumps({k: v for k, v in head.items() if k != "libraries"})
    )
    rehash(folder)  # plan.json's digest in each program.json too: a forger's folder
    with pytest.raises(AutopartError) as err:
        load_rank(folder, 0, [LIB])
    assert f"calls 'torch.ops.{LIB}.scaled_silu.default', an op of none of the namespaces" in str(
        err.value
    ), err.value
    (folder / "plan.json").write_text(json.dumps({**head, "libraries": {"other": "1.0"}}))
    rehash(folder)
    with pytest.raises(AutopartError, match="no installed distribution provides a package named"):
        load_rank(folder, 0, [LIB, "other"])


@pytest.mark.parametrize(
    "target, args, why",
    [
        (torch.ops.aten.from_file.default, ("/etc/passwd", False, 8), "takes the string"),
        (torch.ops.aten._print.default, ("hi",), "returns nothing"),
        (torch.ops.aten.copy_.default, (), "writes self in place"),
    ],
)
def test_compile_refuses_an_aten_op_the_loader_refuses(target, args, why) -> None:
    """Compile applies the loader's rule on ATen ops (archive.aten_refusal) to the captured
    graph: a program it saved would be refused at load, so it is refused here, naming the
    node; the ATen ops of a real graph pass (the tests above compile nanoGPT)."""
    from autopart.lowering.compile import refuse_library_ops

    g = fx.Graph()
    x = g.placeholder("x")
    g.call_function(target, args or (x, x))
    g.output(x)
    with pytest.raises(AutopartError) as err:
        refuse_library_ops(fx.GraphModule(nn.Module(), g))
    assert f"calls {target}, which {why}" in err.value.message
    assert "docs/security.md" in err.value.message
