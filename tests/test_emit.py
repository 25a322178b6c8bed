"""parallelize() offline → Program; printing, saving and loading it back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import Case, nanogpt, run_graph

from autopart import api
from autopart.api import parallelize
from autopart.errors import AutopartError
from autopart.layout import Coords, Mesh, Plan
from autopart.meta import META_BUCKET, META_LAYER, META_MODULE, META_PASSES
from autopart.passes import PIPELINE
from autopart.program.format import (
    FORMAT,
    Program,
    RankProgram,
    Shard,
    load_rank,
    load_weights,
    read_head,
)
from autopart.schedule import Action

PASS_NAMES = [p.__name__ for p in PIPELINE]


@pytest.fixture(scope="module")
def model_batch():
    model, batch = nanogpt.make()
    return model.double(), batch


@pytest.fixture(scope="module")
def program(model_batch) -> Program:
    model, batch = model_batch
    return parallelize(model, Mesh(dp=2), example_inputs=batch, microbatches=2, bucket_mb=0.01)


@pytest.fixture(scope="module")
def saved(program: Program, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Program]:
    root = program.save(tmp_path_factory.mktemp("prog") / "p")
    return root, Program.load(root)


def _loss(rp: RankProgram, params: dict, buffers: dict, batch) -> torch.Tensor:
    st = rp.stages[0]
    data = {"input_ids": batch[0], "labels": batch[1]}
    args = [
        params[i.name]
        if i.kind == "param"
        else buffers[i.name]
        if i.kind != "data"
        else data[i.name]
        for i in st.inputs
    ]
    (loss,) = st.graph(*args)
    return loss.detach()


def test_program_layout(program: Program, model_batch) -> None:
    model, _ = model_batch
    # nanoGPT's 64-row position table bounds the sequence (compile's seq_limits)
    assert program.plan == Plan(Mesh(dp=2), "1f1b", microbatches=2, bucket_mb=0.01, max_seq=64)
    assert len(program.ranks) == 2 and program.mesh == Mesh(dp=2)
    assert list(program.params) == [f for f, _ in model.named_parameters()]
    assert program.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert program.example_shape == (8, 32) and program.vocab_size == 96
    assert [h.name for h in program.history] == ["capture", *PASS_NAMES]
    for r, rp in enumerate(program.ranks):
        assert rp.rank == r and rp.coords == Coords(pp=0, dp=r, tp=0)
        assert rp.groups == {"dp": [0, 1], "pp": [r], "tp": [r]}
        assert [str(a) for a in rp.actions] == [
            "F(s0,m0)",
            "B(s0,m0)",
            "F(s0,m1)",
            "B(s0,m1)",
            "DP_REDUCE",
        ]
        assert rp.shards == {f: Shard(tuple(t.shape)) for f, t in program.params.items()}
        assert len(rp.buckets) > 1
        assert sorted(f for b in rp.buckets for f in b) == sorted(program.params)
    assert "Mesh(dp=2, pp=1, tp=1)" in str(program) and "28 parameters" in str(program)
    with pytest.raises(AutopartError, match="rank 2 does not exist"):
        program.rank(2)


def test_rank_str_shows_code_buckets_and_actions(program: Program) -> None:
    rp = program.rank(1)
    text = str(rp)
    assert text.startswith("# rank 1  (pp=0, dp=1, tp=0)")
    assert "## stage 0  (made by: " + " → ".join(["capture", *PASS_NAMES]) + ")" in text
    assert rp.stages[0].graph.code.strip() in text
    assert "torch.ops.aten.scaled_dot_product_attention" in text
    assert "all-reduce over ranks [0, 1]" in text
    for i, bucket in enumerate(rp.buckets):
        assert f"  bucket {i}: {len(bucket)} tensors" in text
        assert ", ".join(bucket) in text
    assert "## actions" in text
    for a in rp.actions:
        assert str(a) in text


def test_summary_prints_a_row_per_rank(program: Program) -> None:
    from rich.console import Console

    console = Console(record=True, width=200)
    program.summary(console)
    out = console.export_text()
    n = sum(t.numel() for t in program.params.values())
    assert out.count(f"{n:,}") == 2


def test_saved_files(saved) -> None:
    root, _ = saved
    head = json.loads((root / "plan.json").read_text())
    assert head["world_size"] == 2 and head["format"] == FORMAT
    assert head["passes"] == ["capture", *PASS_NAMES]
    for r in range(2):
        folder = root / f"rank{r:05d}"
        assert {p.name for p in folder.iterdir()} == {
            "program.json",
            "stage0.pt2",
            "stage0.py",
            "weights.pt",
        }
    assert read_head(root) == head


def test_load_round_trip(program: Program, saved) -> None:
    _, loaded = saved
    assert loaded.plan == program.plan
    assert loaded.tied == program.tied
    assert loaded.example_shape == program.example_shape and loaded.vocab_size == program.vocab_size
    assert len(loaded.ranks) == len(program.ranks)
    for got, want in zip(loaded.ranks, program.ranks, strict=True):
        assert got.rank == want.rank and got.coords == want.coords and got.groups == want.groups
        assert got.actions == want.actions
        assert got.shards == want.shards
        assert got.buckets == want.buckets
        assert [s.stage for s in got.stages] == [s.stage for s in want.stages]
        for gs, ws in zip(got.stages, want.stages, strict=True):
            assert gs.inputs == ws.inputs
            assert gs.graph.code == ws.graph.code
            assert gs.graph.meta[META_PASSES] == PASS_NAMES
            for gn, wn in zip(gs.graph.graph.nodes, ws.graph.graph.nodes, strict=True):
                assert gn.name == wn.name and gn.op == wn.op
                if gn.op != "call_function":
                    continue  # placeholders: see test_loaded_placeholders_keep_module_and_layer
                assert gn.meta.get(META_MODULE) == wn.meta.get(META_MODULE), gn.name
                assert gn.meta.get(META_LAYER) == wn.meta.get(META_LAYER), gn.name
    assert list(loaded.params) == list(program.params)
    for fqn, t in program.params.items():
        assert loaded.params[fqn].shape == t.shape and loaded.params[fqn].dtype == t.dtype
        assert torch.equal(loaded.params[fqn], t.detach()), fqn


def test_loaded_placeholders_keep_module_and_layer(program: Program, saved) -> None:
    _, loaded = saved
    got = loaded.rank(0).stages[0].graph.graph.nodes
    want = program.rank(0).stages[0].graph.graph.nodes
    for gn, wn in zip(got, want, strict=True):
        if gn.op == "placeholder":
            assert gn.meta.get(META_MODULE) == wn.meta.get(META_MODULE), gn.name
            assert gn.meta.get(META_LAYER) == wn.meta.get(META_LAYER), gn.name


def test_loaded_stage_computes_the_same_loss(program: Program, saved, model_batch) -> None:
    _, loaded = saved
    _, batch = model_batch
    want = _loss(program.rank(0), program.params, program.buffers, batch)
    got = _loss(loaded.rank(0), loaded.params, loaded.buffers, batch)
    assert torch.isfinite(want) and want.item() > 0
    assert got.item() == want.item()
    small = nanogpt.batch(nanogpt.GPTConfig(), 2, 16, seed=3)  # the saved graph stays dynamic
    assert torch.allclose(
        _loss(loaded.rank(1), loaded.params, loaded.buffers, small),
        _loss(program.rank(1), program.params, program.buffers, small),
        rtol=1e-12,
        atol=0,
    )


def test_load_rank_and_weights(saved) -> None:
    root, loaded = saved
    rp = load_rank(root, 1)
    assert rp.actions == loaded.rank(1).actions
    assert set(load_weights(root, 1)) == set(loaded.params)
    with pytest.raises(AutopartError) as err:
        load_rank(root, 2)
    assert "no rank 2" in err.value.message and "world_size" in err.value.hint


def test_read_head_errors(tmp_path: Path) -> None:
    with pytest.raises(AutopartError, match="holds no plan.json"):
        read_head(tmp_path)
    with pytest.raises(AutopartError, match="holds no plan.json"):
        Program.load(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(AutopartError, match="has format 99"):
        read_head(tmp_path)


def test_parallelize_a_capture_and_manual_buffers(gpt_manual: Case, tmp_path: Path) -> None:
    prog = parallelize(gpt_manual.captured, Mesh(dp=2), schedule="gpipe")
    assert prog.plan.schedule == "gpipe" and set(prog.buffers) == set(gpt_manual.captured.buffers)
    assert [str(a) for a in prog.rank(0).actions] == ["F(s0,m0)", "B(s0,m0)", "DP_REDUCE"]
    loaded = Program.load(prog.save(tmp_path / "p"))
    assert set(loaded.buffers) == {"transformer.h.0.attn.bias", "transformer.h.1.attn.bias"}
    for k, v in loaded.buffers.items():
        assert torch.equal(v, gpt_manual.captured.buffers[k])
    batch = gpt_manual.batch
    want = _loss(prog.rank(0), prog.params, prog.buffers, batch)
    assert _loss(loaded.rank(0), loaded.params, loaded.buffers, batch).item() == want.item()
    # the shared capture is not changed by compiling it
    assert all(META_BUCKET not in n.meta for n in gpt_manual.captured.placeholders())


class _NoEmbedding(torch.nn.Module):
    """Token ids looked up in a raw parameter: no ``nn.Embedding`` to take a vocabulary from."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(16, 4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx] @ self.table.T


def test_parallelize_without_an_example_makes_one(gpt_sdpa: Case) -> None:
    """``parallelize(model, mesh)``: a random batch of one row per micro-batch of every replica
    and at most the model's positions (nanoGPT's block_size), ids below its smallest
    embedding; its program computes on a real batch exactly what the program captured from
    that batch does. Hugging Face labels are the ids; a model with no nn.Embedding is refused
    by name."""
    import hf_gpt2

    model = gpt_sdpa.model
    prog = parallelize(model, Mesh())
    assert prog.example_shape == (1, min(api.DEFAULT_SEQ, model.config.block_size))
    batch = gpt_sdpa.batch
    want, _ = run_graph(gpt_sdpa.captured, batch)  # the summed loss of the real batch's capture
    assert _loss(prog.rank(0), prog.params, prog.buffers, batch).item() == want.item()
    ids, _ = api.default_example(model, Plan(Mesh(dp=2, tp=2), microbatches=2))
    assert ids.shape[0] == 4
    hf, _ = hf_gpt2.make()
    ids, labels = api.default_example(hf, Plan(Mesh(dp=2)))
    assert ids.shape == (2, min(api.DEFAULT_SEQ, hf.config.n_positions))
    assert torch.equal(ids, labels) and int(ids.max()) < hf.config.vocab_size
    with pytest.raises(AutopartError, match="needs example_inputs=.* for _NoEmbedding"):
        parallelize(_NoEmbedding(), Mesh(dp=2))


def test_parallelize_refusals(gpt_sdpa: Case) -> None:
    with pytest.raises(AutopartError, match="needs a Seq1F1B schedule"):
        parallelize(gpt_sdpa.captured, Mesh(dp=2), seq_chunks=2)
    with pytest.raises(AutopartError, match="2 transformer blocks"):
        parallelize(
            gpt_sdpa.captured,
            Mesh(pp=2),
            schedule="interleaved-1f1b",
            virtual_stages=2,
            microbatches=2,
        )
    with pytest.raises(AutopartError, match="expected an autopart.Mesh"):
        parallelize(gpt_sdpa.captured, 2)
    with pytest.raises(AutopartError, match="this mesh is offline") as err:  # was ignored
        parallelize(gpt_sdpa.captured, Mesh(dp=2), compile=True)
    assert "autopart run DIR --compile" in (err.value.hint or "")


def test_meta_program_saves_without_weights(tmp_path: Path) -> None:
    cfg = nanogpt.GPTConfig()
    with torch.device("meta"):
        model = nanogpt.GPT(cfg)
    ids, labels = nanogpt.batch(cfg, 4, 8)
    prog = parallelize(model, Mesh(dp=2), example_inputs=(ids.to("meta"), labels.to("meta")))
    root = prog.save(tmp_path / "p")
    assert not (root / "rank00000" / "weights.pt").exists()
    loaded = Program.load(root)
    assert all(t.device.type == "meta" for t in loaded.params.values())
    assert {f: t.shape for f, t in loaded.params.items()} == {
        f: t.shape for f, t in prog.params.items()
    }
    assert loaded.ranks[1].actions == [Action("F"), Action("B"), Action("DP_REDUCE")]


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory) -> tuple:
    """Two saved programs of different models (a program and a 'foreign' one)."""
    import hf_gpt2
    import nanogpt

    root = tmp_path_factory.mktemp("programs")
    for name, make in (("a", nanogpt.make), ("b", hf_gpt2.make)):
        model, batch = make()
        parallelize(model, Mesh(pp=2), example_inputs=batch, microbatches=2).save(root / name)
    return root / "a", root / "b"


def _damaged(src, tmp_path, damage):
    import shutil

    dst = tmp_path / "damaged"
    shutil.copytree(src, dst)
    damage(dst)
    return dst


def _truncate(d):
    f = d / "rank00001" / "stage1.pt2"
    f.write_bytes(f.read_bytes()[:1000])


def _edit_actions(d):
    f = d / "rank00000" / "program.json"
    f.write_text(f.read_text().replace('"F"', '"B"', 1))


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (_truncate, "stage1.pt2 does not match its checksum"),
        (_edit_actions, "program.json does not match its checksum"),
        ("foreign-weights", "weights.pt does not match its checksum"),
        ("garbage-plan", "plan.json is not a valid autopart JSON file"),
        ("foreign-plan", "does not have autopart's layout: files missing"),
        ("missing-file", "stage0.pt2 is missing"),
    ],
    ids=[
        "truncated-graph",
        "edited-actions",
        "foreign-weights",
        "garbage-plan",
        "old-plan",
        "missing-file",
    ],
)
def test_damaged_program_folders_are_refused(saved_pair, tmp_path, damage, needle) -> None:
    import json
    import shutil

    from autopart.program.format import load_rank, load_weights

    good, foreign = saved_pair
    if damage == "foreign-weights":
        damage = lambda d: shutil.copy(foreign / "rank00000" / "weights.pt", d / "rank00000")  # noqa: E731
    elif damage == "garbage-plan":
        damage = lambda d: (d / "plan.json").write_bytes(b"\x00\x01not json")  # noqa: E731
    elif damage == "foreign-plan":  # a plan.json without checksums (e.g. written by hand)

        def damage(d):
            head = json.loads((d / "plan.json").read_text())
            del head["files"]
            (d / "plan.json").write_text(json.dumps(head))

    elif damage == "missing-file":
        damage = lambda d: (d / "rank00000" / "stage0.pt2").unlink()  # noqa: E731
    folder = _damaged(good, tmp_path, damage)
    with pytest.raises(AutopartError) as err:
        for r in (0, 1):
            load_rank(folder, r)
            load_weights(folder, r)
    assert needle in err.value.message, err.value.message
    assert err.value.hint
    load_rank(good, 0), load_weights(good, 1)  # the undamaged original still loads


def test_a_pass_that_breaks_on_a_model_refuses_the_plan_naming_the_pass(model_batch) -> None:
    """A pass's own bug on a model (JetMoE's data-dependent expert sizes once broke the
    pipeline cost model with a sympy TypeError) refuses the plan with an AutopartError naming
    the pass, instead of a raw traceback."""
    from autopart.frontend.capture import capture
    from autopart.lowering.pass_runner import run_passes

    def broken(gm, plan):
        raise TypeError("Cannot convert expression to float")

    model, batch = model_batch
    gm = capture(model, batch).graph
    with pytest.raises(AutopartError) as err:
        run_passes(gm, Plan(Mesh()), [*PIPELINE[:1], broken])
    assert err.value.message == (
        "pass 2 (broken) failed on this model: TypeError: Cannot convert expression to float"
    )
    assert "bug in autopart" in err.value.hint and isinstance(err.value.__cause__, TypeError)


def test_saving_over_an_older_program_leaves_none_of_its_files(model_batch, tmp_path) -> None:
    """A program saved from a meta model into a folder that held a 4-rank program with weights:
    the old weights.pt and rank folders are gone, so nothing trains from stale weights."""
    model, batch = model_batch
    old = parallelize(model, Mesh(dp=4), example_inputs=batch)
    root = old.save(tmp_path / "p")
    assert (root / "rank00003" / "weights.pt").exists()
    with torch.device("meta"):
        meta_model, _ = nanogpt.make()
    new = parallelize(meta_model, Mesh(dp=2), example_inputs=batch)
    new.save(root)
    assert not (root / "rank00000" / "weights.pt").exists()
    assert not (root / "rank00002").exists() and not (root / "rank00003").exists()
    head = read_head(root)
    assert not [f for f in head["files"] if f.endswith("weights.pt")]
    assert load_weights(root, 0) == {}


@pytest.mark.parametrize("plan", [{"mesh": Mesh(dp=3)}, {"mesh": Mesh(), "microbatches": 3}])
def test_a_batch_that_does_not_split_is_refused_by_parallelize(model_batch, plan) -> None:
    """Refused when compiling, not at the first step (the example batch is the batch size)."""
    model, batch = model_batch  # 8 sequences
    with pytest.raises(AutopartError) as err:
        parallelize(model, plan.pop("mesh"), example_inputs=batch, **plan)
    assert "batch size 8 is not divisible by" in err.value.message and "= 3" in err.value.message


def test_a_sequence_sequence_parallelism_cannot_split_is_refused_by_parallelize() -> None:
    model, (ids, labels) = nanogpt.make()
    with pytest.raises(AutopartError) as err:
        parallelize(
            model, Mesh(tp=4), example_inputs=(ids[:, :30], labels[:, :30]), sequence_parallel=True
        )
    assert "sequence length 30 is not divisible by tp=4" in err.value.message


def test_every_recompute_mode_compiles(gpt_sdpa: Case) -> None:
    """Every plan the planner may propose compiles: recomputation is the recompute pass, whose
    regions the program carries (one per block for full, one per attention for selective)."""
    from autopart.lowering import compile_program
    from autopart.runtime.recompute import regions

    blocks = gpt_sdpa.captured.n_layers
    for rc, count in (("none", 0), ("selective", blocks), ("full", blocks)):
        program = compile_program(gpt_sdpa.captured, Plan(Mesh(), recompute=rc))
        assert "recompute" in [h.name for h in program.history]
        assert len(regions(program.rank(0).stages[0].graph)) == count, rc
