"""Schedule IR: a per-rank list of actions. The runtime only interprets it.

Kinds: ``F``/``B`` run the forward/backward of (stage, micro-batch, chunk); in a zero-bubble
schedule (``zb-h1``, ``seq1f1b-zb``) ``B`` computes only the input gradients and ``W`` the same
unit's weight gradients, later; ``SEND_F``/``RECV_F``
move a stage's output activation to the next stage, ``SEND_B``/``RECV_B`` move the gradient
back; ``DP_REDUCE`` waits for this rank's data-parallel gradient all-reduces (launched bucket by
bucket during the last backward). Actions print as ``F(s0,m1)`` and serialize to JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Kind = Literal["F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "DP_REDUCE", "TIE_REDUCE"]
KINDS: tuple[str, ...] = (
    "F",
    "B",
    "W",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "DP_REDUCE",
    "TIE_REDUCE",
)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule."""

    kind: Kind
    stage: int = 0
    mb: int = 0
    chunk: int = 0
    peer: int | None = None  # the other rank of a SEND/RECV

    def __str__(self) -> str:
        if self.kind in ("DP_REDUCE", "TIE_REDUCE"):
            return self.kind
        where = f"s{self.stage},m{self.mb}" + (f",c{self.chunk}" if self.chunk else "")
        to = (
            ""
            if self.peer is None
            else (f"→r{self.peer}" if "SEND" in self.kind else f"←r{self.peer}")
        )
        return f"{self.kind}({where}){to}"

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v or k == "kind"}
        if self.peer is not None:
            out["peer"] = self.peer  # rank 0 is a peer too
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Action:
        if data.get("kind") not in KINDS:
            raise ValueError(f"unknown action kind {data.get('kind')!r}")
        return cls(**data)


def table(actions_by_rank: dict[int, list[Action]]) -> str:
    """Actions as a text table: one column per rank, one row per step."""
    ranks = sorted(actions_by_rank)
    rows = max((len(a) for a in actions_by_rank.values()), default=0)
    cells = [
        [str(actions_by_rank[r][i]) if i < len(actions_by_rank[r]) else "" for r in ranks]
        for i in range(rows)
    ]
    width = max([len(c) for row in cells for c in row] + [8])
    head = "step  " + "".join(f"rank {r}".ljust(width + 2) for r in ranks)
    body = [f"{i:>4}  " + "".join(c.ljust(width + 2) for c in row) for i, row in enumerate(cells)]
    return "\n".join([head, *body])
