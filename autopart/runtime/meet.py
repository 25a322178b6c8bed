"""Ranks meet at the job's store before each collective action: a rank that does not come is
named, and no rank is left waiting inside a collective for it.

Why not just the collective. A collective one rank never joins (it sleeps in user code, it
saves a checkpoint alone, it left the loop a step early) blocks the others inside the backend
until the process group's own timeout (gloo: 30 minutes by default); a wait with a timeout
leaves the collective pending, and the process then hangs at exit until that peer leaves; and
ranks in different actions (one in ``evaluate``, one in ``step``) exchange messages of
different sizes, which gloo answers by aborting the process. Meeting first at the store costs
about two store round trips an action and leaves nothing pending when it times out.

How. Every rank counts itself in at the key of the action's number and name (``add``); the
last to come sets the action's ``all`` key, which the others wait for. Each rank also writes
where it is (``at/<rank>``: the action's number and name), so a rank that waits reads where
the others are: one at the same number in another action (``evaluate`` against ``step``,
another model) is refused at once, on every rank that sees it; at the timeout, the ranks that
have not come are named with the last action each reached. The keys of an action are deleted
by the last to come to the next one (every rank has passed the earlier one by then)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from autopart.errors import AutopartError


class Meeting:
    """The meetings of one runner (or one ``parallelize``) on every rank of the job."""

    def __init__(self, store: Any, rank: int, world: int, prefix: str, timeout_s: float) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.prefix, self.timeout_s = prefix, timeout_s
        self.count = 0
        self._previous = ""  # the keys' base of the last action met

    @classmethod
    def of_job(cls, name: str, timeout_s: float) -> Meeting | None:
        """Meetings named ``name`` among every rank of the default process group (None with
        one rank or none). Each rank numbers the meetings of a name it made, so the k-th
        runner of every rank meets under one prefix."""
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        k = store.add(f"autopart/{name}/made/{rank}", 1)
        return cls(store, rank, dist.get_world_size(), f"autopart/{name}/{k}", timeout_s)

    def __call__(self, action: str, detail: str = "") -> None:
        """Wait until every rank has come to this action (same number, name and ``detail``),
        at most ``timeout_s``; refused, naming the ranks, when another rank is in another
        action or does not come."""
        self.count += 1
        n, key = self.count, f"{action} {detail}".strip()
        base = f"{self.prefix}/{n}/{key}"
        try:
            self.store.set(f"{self.prefix}/at/{self.rank}", f"{n}\t{action}\t{detail}")
            if self.store.add(f"{base}/count", 1) == self.world:
                self.store.set(f"{base}/all", "1")
                if self._previous:  # every rank has passed it: it came to this one
                    for suffix in ("count", "all"):
                        self.store.delete_key(f"{self._previous}/{suffix}")
                self._previous = base
                return
        except Exception as exc:  # noqa: BLE001 - a store that is gone: its host rank exited
            raise self._gone(action, exc) from exc
        self._wait(n, action, detail, f"{base}/all")
        self._previous = base

    def _wait(self, n: int, action: str, detail: str, done: str) -> None:
        start, step = time.monotonic(), 0.25
        while True:
            left = self.timeout_s - (time.monotonic() - start)
            try:
                self.store.wait([done], timedelta(seconds=max(0.01, min(step, left))))
                return
            except Exception as exc:  # noqa: BLE001 - the store's timeout or its loss
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise self._gone(action, exc) from exc
            where = self._where()
            other = {r: w for r, w in where.items() if w[0] >= n and w[1:] != (action, detail)}
            if other:
                r, (m, theirs, their_detail) = min(other.items())
                what = theirs if theirs != action else f"{theirs} with another {their_detail}"
                raise AutopartError(
                    f"rank {self.rank}: at {action} (collective action {n}), rank {r} is in "
                    f"{what} (its action {m})"
                    + (f"; this rank's: {detail}" if detail and theirs == action else ""),
                    hint="every rank must make the same collective calls in the same order "
                    "(step, evaluate, logits, full_state_dict, copy_to, grad_norm, checkpoint "
                    "save and load), with the same model",
                )
            if time.monotonic() - start >= self.timeout_s:
                late = {r: w for r, w in where.items() if w[0] < n}
                missing = [r for r in range(self.world) if r not in where]
                said = [f"rank {r} last came to {w[1]} (action {w[0]})" for r, w in late.items()]
                said += [f"rank {r} has come to none yet" for r in missing]
                raise AutopartError(
                    f"rank {self.rank}: waited {self.timeout_s:.0f} s at {action} (collective "
                    f"action {n}) for the other ranks: {'; '.join(said) or 'none is late'}",
                    hint="every rank must make the same collective calls: a rank that left "
                    "the loop early, saves alone or is stuck in its own code keeps the others "
                    "waiting (timeout_s= sets how long)",
                )
            step = min(step * 2, 5.0)

    def _where(self) -> dict[int, tuple[int, str, str]]:
        """Where each rank that has come to any action of these meetings is."""
        out = {}
        for r in range(self.world):
            key = f"{self.prefix}/at/{r}"
            if self.store.check([key]):
                n, action, detail = self.store.get(key).decode().split("\t")
                out[r] = (int(n), action, detail)
        return out

    def _gone(self, action: str, exc: BaseException) -> AutopartError:
        return AutopartError(
            f"rank {self.rank}: the job's store failed at {action}: {exc}",
            hint="the rank that hosts it (rank 0 under torchrun) exited or was stopped; its "
            "own error is in its output",
        )
