"""Run under torchrun (3 ranks) by tests/test_multirank.py: autopart's collectives against the
data every rank can regenerate, through the direct exchange (gloo groups of <= 4 ranks) and
through gloo's own collectives (``EXCHANGE_MAX = 1``). Prints one JSON line per path on rank 0.
"""

import json
import sys

import torch
import torch.distributed as dist

from autopart import collectives


def data(rank: int) -> torch.Tensor:
    return torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)


def check(n: int, me: int) -> dict:
    every = [data(r) for r in range(n)]
    ordered = every[0].clone()
    for t in every[1:]:
        ordered += t  # the rank-order sum, as the exchange computes it
    mine = data(me)
    summed = collectives._all_reduce(mine, "t")
    gathered = collectives._all_gather(mine, 1, "t")
    scattered = collectives._reduce_scatter(mine, 0, "t")
    results = [torch.empty_like(summed) for _ in range(n)]
    dist.all_gather(results, summed)  # plain gloo: compare the ranks' results
    return {
        "sum_close": torch.allclose(summed, sum(every), rtol=1e-14, atol=0),
        "sum_is_rank_order": torch.equal(summed, ordered),
        "ranks_bitwise_equal": all(torch.equal(r, results[0]) for r in results),
        "gather_exact": torch.equal(gathered, torch.cat(every, 1)),
        "scatter_close": torch.allclose(scattered, ordered.chunk(n, 0)[me], rtol=1e-14, atol=0),
        "input_untouched": torch.equal(mine, data(me)),
    }


def main() -> int:
    dist.init_process_group("gloo")
    n, me = dist.get_world_size(), dist.get_rank()
    collectives.bind("t", dist.new_group(list(range(n))))
    out = {"exchange": check(n, me)}
    collectives.EXCHANGE_MAX = 1
    out["gloo"] = check(n, me)
    if me == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
