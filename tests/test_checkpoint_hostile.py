"""Hostile and damaged checkpoints (issue 34): a step folder is untrusted input.

Each of the issue's breaks is one test here, written against the checkpoint as a hostile writer
or a failing disk leaves it: byte entries whose pickle would run code, storage paths outside the
step folder, flipped or cut shard bytes (the newest checkpoint is skipped for the intact one
before it, bitwise), a full disk during a save, float token files and a resumed optimizer whose
state the checkpoint lacks. The fuzz test (``test_mutated_checkpoints_*``) mutates a saved
checkpoint at random: every mutation loads identically or is refused with ``AutopartError``.

Everything in-process runs on a one-rank gloo group and a one-device nanoGPT (float32), saved
once per module; ``autopart run`` end to end runs on 2 forked ranks (pp=2).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import resource
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopart import AutopartError, Mesh, parallelize
from autopart.parity.verify import launch_forked
from autopart.program.format import load_rank, load_weights, read_head
from autopart.runtime import checkpoint, checkpoint_files
from autopart.runtime.run import Batches, make_optimizer
from autopart.runtime.run import main as run_main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))


# -- fixtures and helpers -----------------------------------------------------------------------


@contextlib.contextmanager
def group(tmp: Path) -> Iterator[None]:
    """A one-rank gloo process group in this process, for as long as the block runs."""
    store = tmp / f"store-{uuid.uuid4().hex}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def runner_of(program: Path):
    from autopart.layout import Plan
    from autopart.runtime.runner import Runner, make_groups

    plan = Plan.from_json(read_head(program)["plan"])
    rp = load_rank(program, 0)
    return Runner(rp, plan, load_weights(program, 0), make_groups(plan, 0, rp.ties))


def batch_of(program: Path, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    args = argparse.Namespace(batch_size=None, seq_len=None, seed=0, batch=None, tokens=None)
    return Batches(args, read_head(program))(step)


def snapshot(runner, optim) -> dict:
    params = {f: p.detach().clone() for f, p in runner.named_parameters()}
    states = {
        f: {k: v.clone() for k, v in optim.state[p].items()} for f, p in runner.params.items()
    }
    return {"params": params, "states": states}


def same_as(runner, optim, snap: dict) -> bool:
    if any(not torch.equal(p, snap["params"][f]) for f, p in runner.named_parameters()):
        return False
    for f, p in runner.params.items():
        got, want = optim.state.get(p, {}), snap["states"][f]
        if set(got) != set(want) or any(not torch.equal(got[k], want[k]) for k in want):
            return False
    return True


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import nanogpt

    model, batch = nanogpt.make()
    return parallelize(model, Mesh(), example_inputs=batch).save(
        tmp_path_factory.mktemp("p") / "one"
    )


@pytest.fixture(scope="module")
def saved(program: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Checkpoints of steps 1 and 2 (AdamW) of the one-device program, saved once in this
    process, and the parameters and AdamW state each one holds; tests work on copies."""
    root = tmp_path_factory.mktemp("saved") / "ck"
    snaps = {}
    with group(root.parent):
        runner = runner_of(program)
        optim = make_optimizer(runner, 1e-3)
        for step in (1, 2):
            runner.step(*batch_of(program, step - 1))
            optim.step()
            optim.zero_grad(set_to_none=True)
            checkpoint.save(checkpoint.folder(root, step), runner, optim, step=step)
            snaps[step] = snapshot(runner, optim)
    return {"root": root, "snaps": snaps}


def copy_steps(saved: dict, dst: Path, steps: tuple[int, ...] = (1, 2)) -> Path:
    for s in steps:
        shutil.copytree(checkpoint.folder(saved["root"], s), checkpoint.folder(dst, s))
    return dst


def reseal(step: Path) -> None:
    """What a hostile writer does after editing a step folder: record every file's size and
    SHA-256 in the marker again and re-seal the marker (a no-op for a marker without a file
    list). Symbolic links are listed by their target's bytes."""
    f = step / checkpoint.INFO
    info = json.loads(f.read_text())
    if "files" in info:
        info["files"] = {
            p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in sorted(step.iterdir())
            if p.name != checkpoint.INFO and p.is_file()
        }
        info["sha256"] = checkpoint_files.digest(info)
    f.write_text(json.dumps(info))


def shard_of(step: Path) -> Path:
    return sorted(step.glob("*.distcp"))[0]


def flip(path: Path, n: int = 16) -> None:
    """Flip ``n`` bytes in the middle of the file: inside the largest tensor's data."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


class Evil:
    """A pickle that creates ``path`` when unpickled (a stand-in for any code)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def forge_metadata(step: Path, edit) -> None:
    """Edit DCP's pickled ``.metadata`` (read here with plain pickle: the test's own file)."""
    meta = pickle.loads((step / ".metadata").read_bytes())
    edit(meta)
    (step / ".metadata").write_bytes(pickle.dumps(meta))


# -- break 1: byte entries (DCP unpickles them) -------------------------------------------------


def test_a_byte_entry_never_unpickles(program: Path, saved: dict, tmp_path: Path) -> None:
    """The rng entry is declared as byte storage (with a forged size) and points at a pickle in
    the step folder. DCP's byte loading used to run it on every rank; now only tensor entries
    are accepted and nothing in the step folder is ever unpickled."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    step = copy_steps(saved, tmp_path / "ck", (1,)) / "step00000001"
    pwned = tmp_path / "pwned"
    payload = pickle.dumps(Evil(pwned))
    (step / "__0_9.distcp").write_bytes(payload)
    rng = "rng/rank00000"

    def to_bytes(meta) -> None:
        md = BytesStorageMetadata()
        md.size = meta.state_dict_metadata[rng].size  # what autopart's load reads
        meta.state_dict_metadata[rng] = md
        meta.storage_data[MetadataIndex(rng)] = _StorageInfo("__0_9.distcp", 0, len(payload))

    forge_metadata(step, to_bytes)
    info = json.loads((step / checkpoint.INFO).read_text())
    if "tensors" in info:  # the same entry in autopart's own metadata
        info["tensors"][rng] = {"bytes": {"file": "__0_9.distcp", "size": len(payload)}}
        (step / checkpoint.INFO).write_text(json.dumps(info))
    reseal(step)
    with group(tmp_path):
        runner = runner_of(program)
        with pytest.raises(AutopartError) as err:
            checkpoint.load(step, runner, make_optimizer(runner, 1e-3))
    assert not pwned.exists(), "the checkpoint ran code"
    assert str(step / checkpoint.INFO) in err.value.message and rng in err.value.message
    with pytest.raises(AutopartError):
        checkpoint.export_state_dict(step)
    assert not pwned.exists()


# -- break 2: storage paths outside the step folder ----------------------------------------------


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_storage_paths_stay_inside_the_step_folder(where: str, saved: dict, tmp_path: Path) -> None:
    """A shard path that is absolute or climbs out of the step folder, or a shard that is a
    symbolic link, used to be read: here it points at a shard outside the folder with other
    weights (step 2's). Now the path must be the writer's own name, in the folder, and the
    file a regular file."""
    step = copy_steps(saved, tmp_path / "ck", (1,)) / "step00000001"
    shard = shard_of(step)
    outside = tmp_path / "outside.distcp"
    shutil.copy(shard_of(checkpoint.folder(saved["root"], 2)), outside)
    name = {"absolute": str(outside), "dotdot": "../../outside.distcp"}.get(where)
    if where == "symlink":
        shard.unlink()
        shard.symlink_to(outside)
    else:
        forge_metadata(step, lambda meta: _repath(meta, name))
        info = json.loads((step / checkpoint.INFO).read_text())
        for t in info.get("tensors", {}).values():
            for c in t["chunks"]:
                c["file"] = name
        (step / checkpoint.INFO).write_text(json.dumps(info))
    reseal(step)
    with pytest.raises(AutopartError) as err:
        state = checkpoint.export_state_dict(step)
        moved = [k for k, t in state.items() if not torch.equal(t, _step1(saved, k))]
        pytest.fail(f"the shard outside the step folder was read ({len(moved)} other tensors)")
    assert str(step) in err.value.message
    assert ("symbolic link" if where == "symlink" else repr(name)) in err.value.message


def _step1(saved: dict, fqn: str) -> torch.Tensor:
    return saved["snaps"][1]["params"].get(fqn, torch.empty(0))


def _repath(meta, name: str) -> None:
    for idx, sinfo in meta.storage_data.items():
        meta.storage_data[idx] = type(sinfo)(name, sinfo.offset, sinfo.length)


# -- break 3: corruption never resumes silently --------------------------------------------------


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_resumed(
    damage: str, program: Path, saved: dict, tmp_path: Path
) -> None:
    """16 flipped bytes inside a tensor of the newest step used to load silently (other
    weights), and a cut shard gave a raw EOFError on every restart. Now the step fails its
    SHA-256 check: ``load`` refuses it naming the file, and ``latest`` reports it in one line
    and returns the step before, which loads bitwise."""
    root = copy_steps(saved, tmp_path / "ck")
    shard = shard_of(checkpoint.folder(root, 2))
    if damage == "flipped":
        flip(shard)
    else:
        os.truncate(shard, shard.stat().st_size // 2)
    with group(tmp_path):
        runner = runner_of(program)
        optim = make_optimizer(runner, 1e-3)
        with pytest.raises(AutopartError) as err:
            checkpoint.load(checkpoint.folder(root, 2), runner, optim)
        assert str(shard) in err.value.message, err.value.message
        seen: list[str] = []
        found = checkpoint.latest(root, runner, on_skip=seen.append)
        assert found == checkpoint.folder(root, 1)
        assert len(seen) == 1 and "\n" not in seen[0], seen
        assert "step00000002" in seen[0] and shard.name in seen[0], seen
        info = checkpoint.load(found, runner, optim)
    assert info["step"] == 1 and same_as(runner, optim, saved["snaps"][1])
    with pytest.warns(UserWarning, match=f"skipping the damaged checkpoint .*{shard.name}"):
        assert checkpoint.latest(root) == checkpoint.folder(root, 1)


def test_pruning_and_saves_never_reach_through_links_and_a_renamed_step_is_skipped(
    saved: dict, tmp_path: Path
) -> None:
    """A stranger's folder: ``--keep-checkpoints`` removed a ``step-notes`` folder holding a
    marker, and through a link ``step00000000`` -> elsewhere it removed the marker there (then
    a raw ``OSError``); a save into a step folder that is a link removed the target's marker.
    Now pruning removes only real ``stepNNNN`` folders with a real marker, oldest by step, and
    a save refuses a link. A copy of step 2 named ``step00000099`` was resumed as the newest
    (its marker says step 2): it is skipped, naming both steps."""
    root = copy_steps(saved, tmp_path / "ck")
    outside = tmp_path / "outside"
    shutil.copytree(checkpoint.folder(root, 1), outside)
    (root / "step00000000").symlink_to(outside, target_is_directory=True)
    notes = root / "step-notes"
    notes.mkdir()
    (notes / checkpoint.INFO).write_text("{}")
    shutil.copytree(checkpoint.folder(root, 1), root / "step00000003")
    checkpoint.prune(root, 2, current=checkpoint.folder(root, 3))
    left = sorted(p.name for p in root.iterdir())
    assert left == ["step-notes", "step00000000", "step00000002", "step00000003"], left
    assert (outside / checkpoint.INFO).is_file() and (notes / checkpoint.INFO).is_file()
    with pytest.raises(AutopartError, match="is a link; a save does not write"):
        checkpoint._clear(root / "step00000000")
    assert (outside / checkpoint.INFO).is_file()
    shutil.copytree(checkpoint.folder(saved["root"], 2), root / "step00000099")
    shutil.rmtree(root / "step00000003")  # (a copy of step 1: its marker says so too)
    seen: list[str] = []
    assert checkpoint.latest(root, on_skip=seen.append) == checkpoint.folder(root, 2)
    assert len(seen) == 1 and "named for step 99, but its marker records step 2" in seen[0]


def test_a_marker_is_json_only(saved: Path, tmp_path: Path) -> None:
    """A resealed marker with an lr of NaN was accepted (and ``load`` would restore it), as
    were infinities and a repeated key, which plan.json's parser refuses: the marker is parsed
    the same way now."""
    root = copy_steps(saved, tmp_path / "ck", steps=(1,))
    step = checkpoint.folder(root, 1)
    info = json.loads((step / checkpoint.INFO).read_text())
    info["optimizer"]["param_groups"][0]["lr"] = float("nan")
    (step / checkpoint.INFO).write_text(json.dumps(info))
    reseal(step)
    with pytest.raises(AutopartError, match="holds NaN, which is not JSON"):
        checkpoint.read_info(step)


@pytest.mark.parametrize(
    ("entry", "value", "why"),
    [
        ("model", ["1b43"], "model is not a SHA-256 in hex"),
        ("model", "../../etc/passwd", "model is not a SHA-256 in hex"),
        ("state_keys", "lm_head.weight", "state_keys is not a list of names"),
        ("state_keys", [1, 2], "state_keys is not a list of names"),
    ],
)
def test_the_optional_marker_entries_are_checked(
    saved: Path, tmp_path: Path, entry: str, value: object, why: str
) -> None:
    """``model`` (what the model computes) and ``state_keys`` (the export's keys) are read by
    ``load`` and ``export_state_dict``: a resealed marker holding another kind of value there
    is refused by name before anything reads it."""
    root = copy_steps(saved, tmp_path / "ck", steps=(1,))
    step = checkpoint.folder(root, 1)
    info = json.loads((step / checkpoint.INFO).read_text())
    info[entry] = value
    (step / checkpoint.INFO).write_text(json.dumps(info))
    reseal(step)
    with pytest.raises(AutopartError, match=why):
        checkpoint.read_info(step)


def test_a_full_disk_during_a_save_is_one_named_error(program: Path, tmp_path: Path) -> None:
    """A write that fails inside DCP (here: the file-size limit, as a full disk would) used to
    surface as a raw ``CheckpointException`` traceback, a ``BaseException`` that ``except
    Exception`` misses. Now it is an ``AutopartError`` naming the step folder and the cause,
    and the unfinished step is never resumed."""
    step = checkpoint.folder(tmp_path / "ck", 3)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with group(tmp_path):
        runner = runner_of(program)
        optim = make_optimizer(runner, 1e-3)
        runner.step(*batch_of(program, 0))
        optim.step()
        before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, hard))
        try:
            with pytest.raises(AutopartError) as err:
                checkpoint.save(step, runner, optim, step=3)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, before)
    msg = str(err.value)
    assert str(step) in msg and "File too large" in msg and "Traceback" not in msg, msg
    assert checkpoint.latest(tmp_path / "ck") is None


def test_dcp_failures_become_one_line_but_interrupts_stay_interrupts() -> None:
    """DCP gathers every rank's ``BaseException`` into one ``CheckpointException``: an error
    becomes one line naming the first failing rank (autopart's own message first), while
    ``KeyboardInterrupt`` and ``SystemExit`` are raised again as they were."""
    from traceback import StackSummary

    from torch.distributed.checkpoint import CheckpointException

    from autopart.runtime.checkpoint_files import reraise_interrupt, why

    failures = {
        0: (OSError(28, "No space left on device"), StackSummary()),
        1: (AutopartError("ck/step00000002/__1_0.distcp is bad", hint="h"), StackSummary()),
    }
    exc = CheckpointException("write", failures)
    assert why(exc) == "rank 1: ck/step00000002/__1_0.distcp is bad (and 1 more ranks)"
    reraise_interrupt(exc)  # nothing to raise
    assert why(CheckpointException("write", {0: failures[0]})) == (
        "rank 0: OSError: [Errno 28] No space left on device"
    )
    for stop in (KeyboardInterrupt(), SystemExit(3)):
        with pytest.raises(type(stop)):
            reraise_interrupt(CheckpointException("write", {2: (stop, StackSummary())}))


# -- break 4: token files and optimizer state ----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64])
def test_a_token_file_must_hold_integers(dtype: torch.dtype, tmp_path: Path) -> None:
    """Float, bool and complex token files used to be cast to integers and trained on."""
    tokens = torch.randint(0, 2, (500,)).to(dtype)
    path = tmp_path / "tokens.pt"
    torch.save(tokens, path)
    args = argparse.Namespace(batch_size=None, seq_len=None, seed=0, batch=None, tokens=path)
    with pytest.raises(AutopartError) as err:
        Batches(args, {"example_shape": [8, 32], "vocab_size": 96})
    assert str(path) in err.value.message and str(dtype) in err.value.message
    torch.save(tokens.to(torch.int32).abs(), path)  # any integer dtype is token ids
    assert Batches(args, {"example_shape": [8, 32], "vocab_size": 96})(0)[0].dtype == torch.long


@pytest.mark.parametrize(
    ("flag", "name", "data", "said"),
    [
        ("tokens", "odd.bin", b"\x01\x02\x03", "holds 3 bytes: raw uint16 ids are 2 bytes each"),
        ("tokens", "empty.bin", b"", "holds 0 bytes"),
        ("tokens", "garbage.pt", b"PK\x03\x04garbage", "is not a file torch.save wrote"),
        ("tokens", "missing.pt", None, "no such file"),
        ("batch", "garbage.pt", b"not a zip", "is not a file torch.save wrote"),
        ("batch", "missing.pt", None, "no such file"),
    ],
)
def test_an_unreadable_data_file_is_named(
    flag: str, name: str, data: bytes | None, said: str, tmp_path: Path
) -> None:
    """``--tokens`` / ``--batch`` files that are missing, not torch.save's zip or raw ids of an
    odd byte count raised torch's or numpy's raw errors from the launcher."""
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    args = argparse.Namespace(batch_size=None, seq_len=None, seed=0, batch=None, tokens=None)
    setattr(args, flag, path)
    with pytest.raises(AutopartError, match=said) as err:
        Batches(args, {"example_shape": [8, 32], "vocab_size": 96})
    assert f"--{flag} {path}" in err.value.message


def test_an_optimizer_whose_state_the_checkpoint_lacks_is_refused(
    program: Path, saved: dict, tmp_path: Path
) -> None:
    """A checkpoint saved without optimizer state (``--no-optim``) used to resume AdamW with
    fresh moments, silently. Now it is refused unless fresh state is asked for explicitly
    (``fresh_optimizer=True``, ``autopart run --fresh-optimizer``)."""
    step = checkpoint.folder(tmp_path / "ck", 1)
    with group(tmp_path):
        runner = runner_of(program)
        checkpoint.save(step, runner, None, step=1)
        optim = make_optimizer(runner, 1e-3)
        with pytest.raises(AutopartError) as err:
            checkpoint.load(step, runner, optim)
        assert str(step) in err.value.message and "no optimizer state" in err.value.message
        assert "--fresh-optimizer" in str(err.value)
        assert checkpoint.load(step, runner, optim, fresh_optimizer=True)["step"] == 1
        assert not optim.state
        # and a checkpoint with AdamW state, loaded with fresh_optimizer: weights only
        checkpoint.load(checkpoint.folder(saved["root"], 2), runner, optim, fresh_optimizer=True)
        assert not optim.state
        assert all(
            torch.equal(p, saved["snaps"][2]["params"][f]) for f, p in runner.named_parameters()
        )
    assert run_main([str(program), "--fresh-optimizer"]) == 2


def test_the_optimizers_hyperparameters_come_back_as_torch_brings_them_back(
    program: Path, tmp_path: Path
) -> None:
    """``load`` restores each group's ``lr``, ``betas``, … and a scheduler's ``initial_lr``, as
    torch's ``Optimizer.load_state_dict`` does: a resumed run whose scheduler is loaded beside
    it used to step from the fresh optimizer's rate (a cosine schedule then diverged, silently).
    ``hyperparameters=False`` keeps the optimizer's own (``autopart run --lr``, ``autopart
    train``'s TOML). A marker value of another kind than the optimizer holds is refused."""
    step = checkpoint.folder(tmp_path / "ck", 1)
    with group(tmp_path):
        runner = runner_of(program)
        optim = make_optimizer(runner, 1e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=8)
        for _ in range(3):
            sched.step()
        optim.param_groups[0]["betas"] = (0.8, 0.95)
        checkpoint.save(step, runner, optim, step=1, extra={"sched": sched.state_dict()})
        want = {k: v for k, v in optim.param_groups[0].items() if k != "params"}
        fresh = make_optimizer(runner, 5e-3)
        info = checkpoint.load(step, runner, fresh)
        got = fresh.param_groups[0]
        assert {k: got[k] for k in want} == want and got["betas"] == (0.8, 0.95)
        again = torch.optim.lr_scheduler.CosineAnnealingLR(fresh, T_max=8)
        again.load_state_dict(info["extra"]["sched"])
        again.step()
        sched.step()
        assert fresh.param_groups[0]["lr"] == optim.param_groups[0]["lr"]
        own = make_optimizer(runner, 5e-3)
        checkpoint.load(step, runner, own, hyperparameters=False)
        assert own.param_groups[0]["lr"] == 5e-3 and "initial_lr" not in own.param_groups[0]
        marker = step / checkpoint.INFO
        doc = json.loads(marker.read_text())
        doc["optimizer"]["param_groups"][0]["betas"] = "os.system"
        doc["sha256"] = checkpoint_files.digest(doc)
        marker.write_text(json.dumps(doc))
        with pytest.raises(AutopartError, match="'betas' is 'os.system'"):
            checkpoint.load(step, runner, make_optimizer(runner, 5e-3))
        # a parameter's group index out of range, and one rank's extra too many: refused
        base = json.loads(marker.read_text())
        base["optimizer"]["param_groups"][0]["betas"] = [0.9, 0.999]
        for edit, words in (
            (lambda d: d["optimizer"]["group_of"].update({"x.weight": 7}), "optimizer is not"),
            (lambda d: d.update(extra_ranks=[{}, {}]), "extra_ranks is not one object per rank"),
            (lambda d: d.update(extra_ranks="print"), "extra_ranks is not a list"),
        ):
            doc = json.loads(json.dumps(base))  # each edit on its own
            edit(doc)
            doc["sha256"] = checkpoint_files.digest(doc)
            marker.write_text(json.dumps(doc))
            with pytest.raises(AutopartError, match=words):
                checkpoint.load(step, runner, make_optimizer(runner, 5e-3))


# -- end to end: autopart run on 2 ranks ----------------------------------------------------------


@pytest.fixture(scope="module")
def pp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import nanogpt

    model, batch = nanogpt.make()
    return parallelize(model, Mesh(pp=2), example_inputs=batch, microbatches=2).save(
        tmp_path_factory.mktemp("pp2") / "p"
    )


def _run(program: Path, *flags: str) -> str:
    argv = ["-m", "autopart.runtime.run", str(program), "--json", "--timeout", "60", *flags]
    return launch_forked(2, argv, timeout_s=120)


def _params(folder: Path) -> list[dict]:
    return [torch.load(folder / f"rank{r:05d}.pt", weights_only=True) for r in range(2)]


@pytest.mark.multirank
def test_autopart_run_skips_a_damaged_newest_checkpoint_and_ends_bitwise(
    pp2: Path, tmp_path: Path
) -> None:
    """autopart run on 2 ranks: steps 0-3 with a checkpoint after steps 2 and 4. Step 4's
    checkpoint then gets 16 flipped bytes in rank 1's shard (in one copy) or loses half of
    rank 0's shard (in another). Rerunning to step 4 prints one line naming the file and step,
    resumes from step 2 and ends with the uninterrupted run's parameters, bit for bit (the
    damaged step 4 is saved again). With every step damaged the run refuses to start over. A
    --no-optim checkpoint is refused by an AdamW run unless --fresh-optimizer is given."""
    ck = tmp_path / "ck"
    _run(pp2, "--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
         "--dump-params", str(tmp_path / "ref"))  # fmt: skip
    ref = _params(tmp_path / "ref")
    for damage in ("flipped", "truncated"):
        mine = tmp_path / damage
        shutil.copytree(ck, mine)
        shard = checkpoint.folder(mine, 4) / (
            "__1_0.distcp" if damage == "flipped" else "__0_0.distcp"
        )
        if damage == "flipped":
            flip(shard)
        else:
            os.truncate(shard, shard.stat().st_size // 2)
        out = _run(pp2, "--steps", "4", "--checkpoint-dir", str(mine),
                   "--dump-params", str(tmp_path / f"{damage}-params"))  # fmt: skip
        skipped = [x for x in out.splitlines() if "skipping the damaged checkpoint" in x]
        assert len(skipped) == 1 and str(shard) in skipped[0], out
        assert "resumed from step 2" in out, out
        got = _params(tmp_path / f"{damage}-params")
        for a, b in zip(ref, got, strict=True):
            assert set(a) == set(b) and all(torch.equal(a[f], b[f]) for f in a), damage
        assert checkpoint.latest(mine) == checkpoint.folder(mine, 4)  # saved again, intact
    # every step damaged: refused, rather than starting over from step 0 on top of them
    both = tmp_path / "both"
    shutil.copytree(ck, both)
    for s in (2, 4):
        flip(checkpoint.folder(both, s) / "__0_0.distcp")
    with pytest.raises(AutopartError) as err:
        _run(pp2, "--steps", "4", "--checkpoint-dir", str(both))
    assert f"every checkpoint in {both} is damaged (2 skipped)" in str(err.value)
    # --no-optim, then AdamW: refused; with --fresh-optimizer: resumed
    plain = tmp_path / "no-optim"
    _run(pp2, "--steps", "1", "--no-optim", "--checkpoint-dir", str(plain))
    with pytest.raises(AutopartError) as err:
        _run(pp2, "--steps", "2", "--checkpoint-dir", str(plain))
    assert "holds no optimizer state" in str(err.value) and "--fresh-optimizer" in str(err.value)
    out = _run(pp2, "--steps", "2", "--checkpoint-dir", str(plain), "--fresh-optimizer")
    assert "resumed from step 1" in out, out


# -- the fuzz test: mutated checkpoints ---------------------------------------------------------
#
# A mutation changes one thing of a saved step folder: bytes of a file (anywhere, or near a
# chunk record's zip headers), its size, its name, its kind (a symbolic link, a folder), a file
# added, or one entry of the marker (a value of another type or range, a key removed, renamed
# or added). Unsealed, it is what a failing disk does: the load must give back exactly the saved
# state or refuse with AutopartError. Sealed (the marker's file list and seal recomputed, as a
# hostile writer would), the load may give other values, but it still only succeeds or raises
# AutopartError. Pickle payloads (plain, or as a chunk record's data.pkl) replace files too: no
# mutation may run code (the payload would create a file).

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NAMES = [
    "__1_0.distcp",
    "__0_1.distcp",
    "x.distcp",
    ".metadata",
    "autopart.json",
    "../escape.distcp",
    "__0_0.distcp.bak",
]
_NUDGES = [-65, -64, -8, -1, 1, 8, 64, 4096]
_INTS = [0, 1, -1, 2, 7, 96, 2**31, 2**48, 2**63, -(2**63), 2**64, 10**30]


def _json_values() -> st.SearchStrategy:
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(_INTS),
        st.integers(-1000, 10**6),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(["", "float64", "uint8", "bytes", "__0_0.distcp", "/etc/passwd", "a" * 70]),
        st.text(max_size=12),
    )
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=6,
    )


def _paths(node, at=()) -> list[tuple]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


def _at(node, path: tuple):
    for k in path:
        node = node[k]
    return node


def _mutations(ref: dict) -> st.SearchStrategy:
    files = ref["files"]  # name -> size
    hot = ref["hot"]  # byte positions at the chunk records' zip headers
    paths = ref["paths"]
    numbers = ref["numbers"]  # paths of the marker's integers
    deep = [p for p in paths if p[:1] in (("tensors",), ("files",))]
    ops = st.sampled_from(["set", "delete", "rename", "add"])
    shard = st.sampled_from(sorted(f for f in files if f.endswith(".distcp")))
    anyfile = st.sampled_from(sorted(files))
    seal = st.booleans()
    writes = st.lists(
        st.tuples(st.one_of(st.sampled_from(hot), st.integers(0, 2**20)), st.integers(0, 255)),
        min_size=1,
        max_size=16,
    )
    return st.one_of(
        st.tuples(st.just("bytes"), anyfile, writes, seal),
        st.tuples(st.just("bytes"), shard, writes, st.just(True)),
        st.tuples(st.just("size"), anyfile, st.integers(0, 2**20), seal),
        st.tuples(st.just("delete"), anyfile),
        st.tuples(st.just("rename"), anyfile, st.sampled_from(_NAMES), seal),
        st.tuples(
            st.just("symlink"), anyfile, st.sampled_from(["inside", "outside", "/dev/zero"]), seal
        ),
        st.tuples(st.just("folder"), anyfile),
        st.tuples(st.just("extra"), st.sampled_from(["__7_0.distcp", "notes.txt", ".nfs0001"])),
        st.tuples(st.just("json"), st.sampled_from(paths), ops, _json_values(), seal),
        st.tuples(st.just("json"), st.sampled_from(deep), ops, _json_values(), seal),
        st.tuples(st.just("nudge"), st.sampled_from(numbers), st.sampled_from(_NUDGES), seal),
        st.tuples(
            st.just("dtype"),
            st.sampled_from(ref["tensors"]),
            st.sampled_from(["float64", "float32", "float16", "int64", "uint8", "bool"]),
            st.just(True),
        ),
        st.tuples(st.just("payload"), anyfile, st.sampled_from(["pickle", "zip"]), st.just(True)),
    )


def _apply(step: Path, m: tuple, pwned: Path) -> bool:
    """Apply mutation ``m`` to ``step``; returns whether it was sealed afterwards."""
    kind, sealed = m[0], False
    marker = step / checkpoint.INFO
    if kind == "bytes":
        _, name, writes, sealed = m
        f = step / name
        data = bytearray(f.read_bytes())
        for at, value in writes:
            if data:
                data[at % len(data)] = value
        f.write_bytes(bytes(data))
    elif kind == "size":
        _, name, size, sealed = m
        f = step / name
        data = f.read_bytes()
        f.write_bytes(data[:size] if size <= len(data) else data + bytes(size - len(data)))
    elif kind == "delete":
        (step / m[1]).unlink()
    elif kind == "rename":
        _, name, new, sealed = m
        (step / name).rename(step / new)
    elif kind == "symlink":
        _, name, target, sealed = m
        f = step / name
        if target == "outside":
            shutil.copy(f, step.parent / f"outside-{name}")
            target = str(step.parent / f"outside-{name}")
        elif target == "inside":
            shutil.copy(f, step / "copy.bin")
            target = "copy.bin"
        f.unlink()
        f.symlink_to(target)
    elif kind == "folder":
        (step / m[1]).unlink()
        (step / m[1]).mkdir()
    elif kind == "extra":
        (step / m[1]).write_bytes(b"not a checkpoint file")
    elif kind == "json":
        _, path, op, value, sealed = m
        info = json.loads(marker.read_text())
        if path:
            node = info
            for k in path[:-1]:
                node = node[k]
            last = path[-1]
            if op == "set":
                node[last] = value
            elif op == "delete":
                del node[last]
            elif op == "rename" and isinstance(node, dict):
                node[str(value)[:20] if not isinstance(value, str) else value] = node.pop(last)
            elif op == "add" and isinstance(node[last], dict):
                node[last][str(value)[:20]] = value
            elif op == "add" and isinstance(node[last], list):
                node[last].append(value)
        else:
            info = value if op == "set" else info
        marker.write_text(json.dumps(info))
    elif kind in ("nudge", "dtype"):
        _, where, value, sealed = m
        info = json.loads(marker.read_text())
        if kind == "dtype":
            info["tensors"][where]["dtype"] = value
        else:
            _at(info, where[:-1])[where[-1]] += value
        marker.write_text(json.dumps(info))
    elif kind == "payload":
        _, name, how, sealed = m
        evil = pickle.dumps(Evil(pwned))
        if how == "zip":
            import io
            import zipfile

            out = io.BytesIO()
            with zipfile.ZipFile(out, "w") as z:
                z.writestr("archive/data.pkl", evil)
                z.writestr("archive/byteorder", b"little")
                z.writestr("archive/data/0", bytes(64))
            evil = out.getvalue()
        (step / name).write_bytes(evil)
    if sealed and marker.is_file() and not marker.is_symlink():
        # a marker that is no longer a JSON object with a file list has nothing to seal
        with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError, RecursionError):
            reseal(step)
    return sealed


def _outcome(step: Path, runner, optim) -> tuple[dict | None, dict | None, list[str]]:
    """``export_state_dict``, ``load`` and ``latest`` of ``step``: None where refused."""
    try:
        exported = checkpoint.export_state_dict(step)
    except AutopartError:
        exported = None
    try:
        info = checkpoint.load(step, runner, optim)
        loaded = {"info": info, "runner": snapshot(runner, optim), "rng": torch.get_rng_state()}
    except AutopartError:
        loaded = None
    skipped: list[str] = []
    checkpoint.latest(step.parent, on_skip=skipped.append)
    return exported, loaded, skipped


def _fuzz(program: Path, saved: dict, tmp: Path, examples: int) -> None:
    ref_step = checkpoint.folder(saved["root"], 2)
    info = json.loads((ref_step / checkpoint.INFO).read_text())
    hot = sorted(
        {
            c["byte_offset"] + d
            for t in info["tensors"].values()
            for c in t["chunks"]
            for d in (*range(0, 96), *range(c["byte_length"] - 200, c["byte_length"]))
        }
    )
    ref = {
        "files": {p.name: p.stat().st_size for p in ref_step.iterdir()},
        "hot": hot,
        "paths": _paths(info),
        "numbers": [p for p in _paths(info) if p and type(_at(info, p)) is int],
        "tensors": sorted(info["tensors"]),
    }
    pwned = tmp / "pwned"
    counts: dict[str, int] = {}
    with group(tmp):
        runner = runner_of(program)
        optim = make_optimizer(runner, 1e-3)
        want_export, want_load, _ = _outcome(ref_step, runner, optim)
        assert want_export is not None and want_load is not None

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,  # the same examples every run (CI lands or not on the code alone)
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(m=_mutations(ref))
        def one(m: tuple) -> None:
            work = tmp / f"ex{uuid.uuid4().hex}"
            step = checkpoint.folder(work, 2)
            shutil.copytree(ref_step, step)
            try:
                sealed = _apply(step, m, pwned)
                exported, loaded, skipped = _outcome(step, runner, optim)
                assert not pwned.exists(), f"mutation {m} ran code"
                assert all("\n" not in x for x in skipped)
                if not sealed:  # corruption: exactly the saved state, or a refusal
                    if exported is not None:
                        assert set(exported) == set(want_export)
                        assert all(torch.equal(exported[k], want_export[k]) for k in exported)
                    if loaded is not None:
                        assert loaded["info"] == want_load["info"]
                        assert same_as(runner, optim, want_load["runner"])
                        assert torch.equal(loaded["rng"], want_load["rng"])
                how = "loaded" if loaded is not None else "refused"
                key = f"{m[0]}{'+sealed' if sealed else ''} {how}"
                counts[key] = counts.get(key, 0) + 1
            finally:
                shutil.rmtree(work, ignore_errors=True)

        start = time.perf_counter()
        one()
        seconds = time.perf_counter() - start
    total = sum(counts.values())
    print(f"fuzz: {total} mutations in {seconds:.1f} s: {dict(sorted(counts.items()))}")
    assert total >= examples * 0.9, counts  # hypothesis ran (about) as many as asked


def test_mutated_checkpoints_load_identically_or_are_refused(
    program: Path, saved: dict, tmp_path: Path
) -> None:
    """50 random mutations of a saved step (the default suite's share)."""
    _fuzz(program, saved, tmp_path, 50)


@pytest.mark.slow
def test_mutated_checkpoints_load_identically_or_are_refused_500(
    program: Path, saved: dict, tmp_path: Path
) -> None:
    """500 random mutations of a saved step (``-m slow``)."""
    _fuzz(program, saved, tmp_path, 500)


def test_a_directory_named_like_a_checkpoint_file_is_refused_not_removed(tmp_path: Path) -> None:
    """A step folder whose ``autopart.json`` is a directory: saving that step again raised a
    raw ``IsADirectoryError`` (after training, losing the step). It is not a checkpoint's
    file, so the folder is refused as one that is not a checkpoint, and left as it is."""
    from autopart.runtime.checkpoint import INFO, _clear

    step = tmp_path / "step00000002"
    (step / INFO).mkdir(parents=True)
    with pytest.raises(AutopartError, match="exists and is not an autopart checkpoint"):
        _clear(step)
    assert (step / INFO).is_dir()
