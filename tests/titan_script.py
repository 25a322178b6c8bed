"""Run on 2 forked ranks by tests/test_checkpoint.py: torchtitan's and a data loader's habits
around the live runner, as a user of FSDP2 or the HF Trainer would write them.

- ``torch.distributed.checkpoint`` over ``runner.state_dict()``: under tp a rank's state dict
  holds its slices under the whole parameters' names, so DCP used to save one rank's slice as
  every rank's and load it into both, silently (a query weight 158 % off after a round trip).
  Both directions are refused, naming ``autopart.checkpoint``; the slices stay plain tensors
  for everything else. Under pp (whole parameters, other names per stage) it is exact.
- torch's ``get_model_state_dict(runner)`` reads module attributes the runner lacks: named.
- Meshes: a size-1 dim of another name (torchtitan's ``cp``) is no parallelism, and is
  accepted; a sub-mesh of the world (``world_mesh["tp"]``) is refused on every rank (ranks
  inside it used to wait in the model broadcast); a model on the meta device is refused.
- Batches: a batch dict passed whole, keys the program does not take (``token_type_ids``,
  ``targets=``) and no labels are refused by name (bare ``TypeError``s before); a collator's
  all-ones ``attention_mask`` is taken as no mask, exactly.

Prints one JSON line per rank.
"""

import io
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

import autopart
from autopart.models import nanogpt


def refused(fn) -> str:
    """The text of DCP's error (every rank's, gathered by DCP), or "" when ``fn`` ran."""
    try:
        fn()
    except CheckpointException as exc:
        return str(exc)
    return ""


def autopart_error(fn) -> str:
    """The text of ``fn``'s ``AutopartError``, or "" when it ran."""
    try:
        fn()
    except autopart.AutopartError as exc:
        return str(exc)
    return ""


def main(root: Path) -> dict:
    rank = dist.get_rank()
    model, batch = nanogpt.make()
    model = model.double()
    out: dict = {"rank": rank}

    world = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    out["submesh"] = autopart_error(lambda: autopart.parallelize(model, world["tp"], batch))
    meta_model = nanogpt.make()[0].to("meta")
    out["meta"] = autopart_error(lambda: autopart.parallelize(meta_model, world, batch))

    # torchtitan's mesh names: a context-parallel dim of one rank is no parallelism; a
    # vocabulary tp does not divide (97) stays whole, and the logits are the model's
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("cp", "tp"))
    odd, odd_batch = nanogpt.make(vocab_size=97)
    odd = odd.double()
    with torch.no_grad():
        want = odd(odd_batch[0])
    tp = autopart.parallelize(odd, mesh, odd_batch)
    got = tp.logits(odd_batch[0])
    out["logits_97"] = tuple(got.shape) == tuple(want.shape) and bool(
        torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    )
    # and with sequence parallelism around it (tp_split / tp_join): the same logits and loss
    sp = autopart.parallelize(odd, mesh, odd_batch, sequence_parallel=True)
    out["logits_97_sp"] = bool(
        torch.allclose(sp.logits(odd_batch[0]), want, rtol=1e-12, atol=1e-12)
    )
    out["loss_97_sp"] = float(sp.evaluate(*odd_batch))
    out["not_a_module"] = autopart_error(lambda: get_model_state_dict(tp))
    out["hasattr"] = hasattr(tp, "named_children")

    ids, labels = odd_batch
    loss = float(tp.evaluate(ids, labels))
    out["loss_97_sp"] = abs(out["loss_97_sp"] - loss) <= 1e-12 * abs(loss)
    ones = torch.ones_like(ids)
    out["ones_mask"] = (
        float(tp.evaluate(**{"input_ids": ids, "labels": labels, "attention_mask": ones})) == loss
    )
    out["batch_dict"] = autopart_error(lambda: tp.step({"input_ids": ids, "labels": labels}))
    out["extra_key"] = autopart_error(lambda: tp.step(ids, labels, token_type_ids=ones * 0))
    out["targets"] = autopart_error(lambda: tp.step(ids, targets=labels))
    out["no_labels"] = autopart_error(lambda: tp.step(ids))
    out["logits_labels"] = tuple(tp.logits(ids, labels=labels).shape) == (*ids.shape, 97)

    sd = tp.state_dict()
    slices = [k for k, v in sd.items() if isinstance(v, autopart.runtime.guards.RankSlice)]
    out["slices"] = len(slices)
    # everything else sees plain tensors: a pickle, weights_only, arithmetic, the print
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    out["plain"] = (
        all(type(v) is torch.Tensor and torch.equal(v, sd[k]) for k, v in back.items())
        and type(sd[slices[0]] * 2) is torch.Tensor
        and "RankSlice" not in repr(sd[slices[0]])
    )
    out["save"] = refused(lambda: dcp.save({"model": tp.state_dict()}, checkpoint_id=root / "tp"))
    # a checkpoint of the slices as plain tensors (what the save used to write) is refused too
    plain = {k: v.as_subclass(torch.Tensor) for k, v in sd.items()}
    dcp.save({"model": plain}, checkpoint_id=root / "plain")
    out["load"] = refused(
        lambda: dcp.load({"model": tp.state_dict()}, checkpoint_id=root / "plain")
    )

    pp = autopart.parallelize(
        model, init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)), batch, microbatches=2
    )
    opt = torch.optim.AdamW(pp.parameters(), lr=1e-2)
    pp.step(*batch)
    opt.step()
    before = {k: v.clone() for k, v in pp.state_dict().items()}
    dcp.save({"model": pp.state_dict()}, checkpoint_id=root / "pp")
    with torch.no_grad():
        for p in pp.parameters():
            p.add_(1.0)
    dcp.load({"model": pp.state_dict()}, checkpoint_id=root / "pp")
    out["pp_round_trip"] = all(torch.equal(v, before[k]) for k, v in pp.state_dict().items())
    return out


if __name__ == "__main__":
    dist.init_process_group("gloo")
    result = main(Path(sys.argv[1]))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
