"""Run under torchrun (3 ranks) by tests/test_multirank.py: autopart's collectives against the
data every rank can regenerate, through each transport (``collectives.transport``): shared
memory, the direct exchange (when one rank cannot open the others' shared-memory files, and
with ``AUTOPART_SHM=0``) and gloo's own collectives (also ``EXCHANGE_MAX = 1``). A peer that never
arrives at a shared-memory exchange makes it time out with a named error; ranks that send
different sizes, and a rank that cannot reserve shared memory, make every rank fail at once;
ranks that disagree about shared memory all fall back to the exchange. Shapes grow past the first shared-memory file and shrink again, and
every case repeats, so both halves and a new file generation are used. Prints one JSON line on
rank 0: per transport, each check and the transport the group actually got.
"""

import glob
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from autopart import collectives
from autopart.errors import AutopartError
from autopart.runtime import comm as comm_module
from autopart.runtime import shm
from autopart.runtime.comm import Comm

COMM = Comm()  # this script's runtime context (a Runner owns one)
collectives.activate(COMM)

SHAPES = ((6, 5, 4), (96, 1024, 3), (6, 5, 4))  # the middle one (2.3 MB) outgrows 1 MB halves


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(rank), dtype=dtype)


def check(n: int, me: int, shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    every = [data(r, shape, dtype) for r in range(n)]
    ordered = every[0].clone()
    for t in every[1:]:
        ordered += t  # the rank-order sum, as the exchange computes it
    mine = data(me, shape, dtype)
    summed = collectives._all_reduce(mine, "t")
    gathered = collectives._all_gather(mine, 1, "t")
    scattered = collectives._reduce_scatter(mine, 0, "t")
    results = [torch.empty_like(summed) for _ in range(n)]
    dist.all_gather(results, summed)  # plain gloo: compare the ranks' results
    rtol = 1e-14 if dtype == torch.float64 else 1e-6
    return {
        "sum_close": torch.allclose(summed, sum(every), rtol=rtol, atol=1e-6),
        "sum_is_rank_order": torch.equal(summed, ordered),
        "ranks_bitwise_equal": all(torch.equal(r, results[0]) for r in results),
        "gather_exact": torch.equal(gathered, torch.cat(every, 1)),
        "scatter_close": torch.allclose(scattered, ordered.chunk(n, 0)[me], rtol=rtol, atol=1e-6),
        "input_untouched": torch.equal(mine, data(me, shape, dtype)),
    }


def run_path(n: int, me: int) -> dict:
    group = dist.new_group(list(range(n)))
    COMM.bind("t", group)
    empty = collectives._all_reduce(torch.zeros(0, 3), "t")  # a first message of no bytes
    out: dict = {"empty_ok": empty.shape == (0, 3)}
    for _repeat in range(3):
        for shape in SHAPES:
            for dtype in (torch.float64, torch.float32):
                for k, v in check(n, me, shape, dtype).items():
                    out[k] = out.get(k, True) and v
    out["transport"] = COMM.transport(group)
    return out


def unseen(map_file):
    def mapped(path: str, size: int, create: bool):
        if not create:
            raise FileNotFoundError(path)
        return map_file(path, size, create)

    return mapped


def peer_never_arrives(n: int, me: int) -> str:
    """Rank 0 all-reduces alone on a connected group: the error it gets (others: "")."""
    group = dist.new_group(list(range(n)))
    COMM.bind("t", group)
    assert COMM.transport(group) == "shm"  # connects on every rank
    COMM.set_action("the lonely step", timeout_s=1.0)
    message = ""
    if me == 0:
        try:
            collectives._all_reduce(data(me, (4,), torch.float64), "t")
        except AutopartError as exc:
            message = str(exc)
    COMM.set_action("(checks)", timeout_s=60.0)
    return message


def failures(n: int, me: int) -> dict:
    """What each rank raises (its message, or "") when the ranks disagree or one rank fails."""
    out = {}

    def attempt(name: str, op) -> None:
        try:
            op()
            out[name] = ""
        except AutopartError as exc:
            out[name] = str(exc)

    mapping = shm._map
    COMM.set_action("the failing step", timeout_s=60.0)
    COMM.bind("t", dist.new_group(list(range(n))))
    attempt("mismatch", lambda: collectives._all_reduce(torch.ones(4 if me == 0 else 8), "t"))
    attempt("after_failure", lambda: collectives._all_reduce(torch.ones(4), "t"))
    COMM.bind("t", dist.new_group(list(range(n))))
    collectives._all_reduce(torch.ones(4), "t")  # connected, first file made
    if me == 1:  # its next file cannot be reserved (a full /dev/shm)
        shm._map = full(shm._map)
    if me == 2:  # arrives after rank 0 has failed too: it must still name rank 1, the first
        time.sleep(0.5)
    attempt("full", lambda: collectives._all_reduce(torch.ones(1 << 19), "t"))
    attempt("uneven", lambda: collectives._reduce_scatter(torch.ones(n + 1, 2), 0, "t", n))
    # a graph compiled for another group size: its gather is refused before any data moves
    attempt("resized", lambda: collectives.tp_gather(torch.ones(2), 0, "t", n + 1))
    COMM.set_action("(checks)", timeout_s=60.0)
    shm._map = mapping
    return out


def full(map_file):
    def mapped(path: str, size: int, create: bool):
        if create:
            raise OSError(28, "No space left on device")
        return map_file(path, size, create)

    return mapped


def main() -> int:
    dist.init_process_group("gloo")
    n, me = dist.get_world_size(), dist.get_rank()
    out = {"shm": run_path(n, me)}  # its files are unlinked once every peer has mapped them
    out["shm"]["dev_shm_clean"] = not glob.glob(f"/dev/shm/autopart-{os.getpid()}-*")
    out["timeout"] = peer_never_arrives(n, me)
    out["failures"] = failures(n, me)
    mapping = shm._map
    if me == 1:  # rank 1 cannot see the others' files (another host, another /dev/shm)
        shm._map = unseen(mapping)
    out["unshared"] = run_path(n, me)  # so no rank uses shared memory
    shm._map = mapping
    if me == 1:  # rank 1 does not want shared memory; the others do
        os.environ["AUTOPART_SHM"] = "0"
    out["disagree"] = run_path(n, me)  # all fall back together
    os.environ["AUTOPART_SHM"] = "0"
    out["exchange"] = run_path(n, me)
    comm_module.EXCHANGE_MAX = 1
    out["gloo"] = run_path(n, me)
    every: list = [None] * n
    dist.all_gather_object(every, out["failures"])
    out["failures"] = every
    if me == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
