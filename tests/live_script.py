"""Run under torchrun by tests/test_multirank.py: the live API, parallelize(model, DeviceMesh).

Every rank compiles the model for the live mesh, runs one step on the global batch, and
compares its gradients and loss with the single-device run computed in the same process.
Exits 0 only on parity; prints one line per rank. ``pp`` as the argument: a pipeline mesh over
every rank, with the 8-block nanoGPT whose tied embedding lives on the first and last stage only
(a middle stage holds no tied parameter, yet creates the same process groups), and beside it a
tp runner of the same model in the same process (each runner binds its own groups) and a
Seq1F1B runner of the manual-attention nanoGPT, made with no example batch, whose whole state
dict holds the mask buffer no graph reads.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import nanogpt  # noqa: E402

import autopart  # noqa: E402
from autopart.parity.verify import reference, rel_error  # noqa: E402


def main() -> int:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pp = sys.argv[1:] == ["pp"]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp" if pp else "dp",))
    model, batch = nanogpt.make_deep() if pp else nanogpt.make()
    model = model.double()
    ref_loss, ref_grads = reference(model, batch)
    if pp:  # a second runner of another mesh in the same process, built first
        tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        tp_runner = autopart.parallelize(model, tp_mesh, example_inputs=batch)
        # Seq1F1B replaces the manual attention's mask buffer by positions: no graph reads it,
        # and full_state_dict() used to refuse for want of it; it is the module's own
        manual, _ = nanogpt.make(attention="manual", n_layer=8)
        k_runner = autopart.parallelize(
            manual, mesh, schedule="seq1f1b", seq_chunks=2, microbatches=4
        )
        full = k_runner.full_state_dict()
        own = manual.state_dict()
        assert sorted(full) == sorted(own), sorted(set(own) ^ set(full))
        assert all(torch.equal(full[k], own[k]) for k in own)
    runner = autopart.parallelize(model, mesh, example_inputs=batch, microbatches=4, bucket_mb=0.01)
    loss = runner.step(*batch)
    errs = {f: rel_error(p.grad, ref_grads[f]) for f, p in runner.named_parameters()}
    worst = max(errs, key=errs.get)
    loss_err = abs(float(loss) - ref_loss) / abs(ref_loss)
    stats = runner.stats  # 0.01 MiB buckets: several, each launched as backward produced it
    if pp:  # each stage holds its own parameters; together, all of them
        # the tp runner steps after the pp runner bound the process's collective groups: it
        # must still use its own (it used to run on the pp runner's, and fail)
        tp_loss = float(tp_runner.step(*batch))
        loss_err = max(loss_err, abs(tp_loss - ref_loss) / abs(ref_loss))
        got: list = [None] * world
        dist.all_gather_object(got, sorted(errs))
        complete = {f for names in got for f in names} == set(ref_grads)
        overlap = True
    else:
        complete = set(errs) == set(ref_grads)
        overlap = stats.buckets > 2 and stats.launched_during_backward == stats.buckets
    ok = loss_err <= 1e-9 and errs[worst] <= 1e-9 and complete and overlap
    opt = torch.optim.SGD(runner.parameters(), lr=0.1)
    opt.step()  # the user's optimizer steps the local shards
    keys = set(runner.state_dict())
    sys.stdout.write(
        f"rank {dist.get_rank()}: loss err {loss_err:.2e}, worst {worst} {errs[worst]:.2e}, "
        f"state_dict keys {len(keys)}, buckets {stats}, {'OK' if ok else 'MISMATCH'}\n"
    )  # one write per line: the two ranks share stdout
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown (see autopart/runtime/run.py)
