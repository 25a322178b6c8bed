"""The tp collectives' transports on 2 gloo ranks: autopart's shared memory and direct exchange
against gloo's own all-reduce, in a tight loop.

For each size (4 KB, 1 MB, 8 MB of float32) and each transport, 2 torchrun ranks run ``ITERS``
all-reduces of the same tensor after ``WARMUP`` and report the median and 90th percentile of
the slower rank's time per call:

- ``gloo``: ``dist.all_reduce`` (the peer; what DTensor and the c10d path use);
- ``exchange``: autopart's ``isend``/``irecv`` exchange (``AUTOPART_SHM=0``);
- ``shm``: autopart's shared-memory exchange (``autopart/runtime/shm.py``), the default on one host.

The three loops alternate per call so that background load hits them alike. Every result is
checked against the rank-order sum; the script exits 1 on a mismatch. No goal: the figures
explain the tensor-parallel step times (docs/tensor_parallel.md).

    python benchmarks/collectives.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import record, run_workers  # noqa: E402

WARMUP, ITERS = 20, 300
SIZES = {"4 KB": 1 << 10, "1 MB": 1 << 18, "8 MB": 1 << 21}  # float32 elements
TRANSPORTS = ("gloo", "exchange", "shm")


def worker(out: str) -> None:
    import torch.distributed as dist

    from autopart.runtime.comm import Comm

    comm = Comm()  # the runtime context a Runner would own
    dist.init_process_group("gloo")
    me = dist.get_rank()
    groups = {"gloo": dist.new_group([0, 1])}
    os.environ["AUTOPART_SHM"] = "0"
    groups["exchange"] = dist.new_group([0, 1])
    comm.transport(groups["exchange"])  # decided now, without shared memory
    del os.environ["AUTOPART_SHM"]
    groups["shm"] = dist.new_group([0, 1])
    assert comm.transport(groups["shm"]) == "shm", "shared memory unavailable here"
    for name in ("exchange", "shm"):
        comm.bind(name, groups[name])
    res: dict = {}
    for size, numel in SIZES.items():
        x = torch.randn(numel, generator=torch.Generator().manual_seed(me))
        want = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        want += torch.randn(numel, generator=torch.Generator().manual_seed(1))
        times: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
        ok = True
        for i in range(WARMUP + ITERS):
            for name in TRANSPORTS:
                dist.barrier()
                start = time.perf_counter()
                if name == "gloo":
                    y = x.clone()
                    dist.all_reduce(y, group=groups[name])
                else:
                    y = comm.all_reduce(x, name)
                elapsed = time.perf_counter() - start
                ok = ok and torch.allclose(y, want, rtol=1e-6, atol=1e-6)
                if i >= WARMUP:
                    times[name].append(elapsed)
        for name, ts in times.items():  # per call, the slower rank's time
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res.setdefault(size, {})[name] = t.tolist()
        res.setdefault("ok", {})[size] = ok
    if me == 0:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    print(
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, 2 gloo ranks, 1 thread each"
    )
    print(
        f"all-reduce (sum) in a tight loop: median / p90 of {ITERS} calls after {WARMUP}, slower rank"
    )
    res = run_workers(__file__, 2)
    if res is None:
        return 2
    print(f"{'size':>5}  {'gloo':>17}  {'exchange':>17}  {'shm':>17}  {'shm/gloo':>8}")
    for size in SIZES:
        cells, med = [], {}
        for name in TRANSPORTS:
            ts = sorted(res[size][name])
            med[name] = 1e3 * statistics.median(ts)
            cells.append(f"{med[name]:7.3f} / {1e3 * ts[int(0.9 * len(ts))]:6.3f}")
        ratio = med["shm"] / med["gloo"]
        print(f"{size:>5}  {'  '.join(cells)}  {ratio:8.2f}  (ms)")
        record(
            "collectives",
            f"all-reduce {size}, 2 ranks",
            med["shm"],
            med["gloo"],
            "gloo all_reduce",
            "",
            None,
            "ms",
        )
    if not all(res["ok"].values()):
        print(f"MISMATCH against the rank-order sum: {res['ok']}", file=sys.stderr)
        return 1
    print("every result equals the sum of both ranks' tensors")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="RESULT_JSON", help="internal: run as a torchrun rank")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
    else:
        sys.exit(main())
