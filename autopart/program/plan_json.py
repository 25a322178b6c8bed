"""The schemas of ``plan.json`` and ``rankNNNNN/program.json``, with their cross-checks.

``check_head`` and ``check_rank`` raise ``Invalid`` (the JSON path and what is wrong) for any
document ``Program.save`` would not write: a missing, extra or mistyped field, a number out of
its range, a name that is not one of the plan's, a size the plan does not imply. The loader
turns it into an ``AutopartError`` naming the file (``schema.refusal``). Bounds:

- the mesh, world size, micro-batches, stages and chunks are positive and below generous
  limits (``MAX_*``), and ``world_size`` is the mesh's size;
- a parameter has at most 16 dims and ``MAX_NUMEL`` elements; shards, buckets, ties and stage
  inputs name only the plan's parameters and buffers; a shard's shape is its parameter's;
- a rank's coordinates and groups are those the mesh gives that rank; its stages are the ones
  its pipeline coordinate runs; each stage's file is ``stage{k}.pt2``; its actions refer to its
  own stages, the plan's micro-batches and chunks, and ranks of the world, and are exactly the
  list the plan's schedule generates for that rank (``schedule.generate``: a dropped, added or
  reordered action would deadlock or skip work); its gradient buckets hold every shard once when
  dp > 1 and none when dp = 1; its ties are plan.json's ties of its shards; its ``chunk_cost``
  is set exactly for a Seq1F1B plan and equals plan.json's; its vocabulary, batch names and
  frozen parameters are plan.json's (of its shards); it records plan.json's digest
  (``format.plan_digest``), which the loader compares;
- a shard is whole (index 0 of 1 part, not strided) or the rank's tp slice (index = its tp
  coordinate, parts = tp) along the ``split`` plan.json gives the parameter, ``[dim,
  strided]``, whose size it divides into ``parts × strided`` blocks; a tied alias (``tied``) is
  no parameter or buffer of its own;
- a K/V prefix shape (a causal convolution's carry is one too) has an empty sequence dim (a
  0), at most one ``"b"`` (the batch) and at most ``MAX_KV_ROW`` elements per sequence, so the
  zeros the runtime makes from it are empty.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

from autopart.frontend.capture import DATA_NAMES
from autopart.layout import LIBRARY_NAME, Mesh, Plan
from autopart.meta import INPUT_KINDS
from autopart.program import libraries
from autopart.program.folder import NAMES
from autopart.program.schema import (
    DOTTED,
    Invalid,
    Spec,
    boolean,
    dict_of,
    integer,
    list_of,
    nullable,
    number,
    obj,
    one_of,
    string,
)
from autopart.schedule.generators import generate
from autopart.schedule.ir import KINDS

MAX_WORLD = 1 << 16
MAX_DIM = 1 << 40
MAX_NUMEL = 1 << 44  # elements of one parameter (16 T: far beyond any model)
MAX_KV_ROW = 1 << 24  # elements of one sequence position of one K/V prefix
MAX_STAGES = 1 << 12
DTYPES = ("torch.float64", "torch.float32", "torch.bfloat16", "torch.float16")

_FQN = string(DOTTED, 1024)
_SHA256 = string(re.compile(r"[0-9a-f]{64}"))
_TEXT = string(max_len=256)
_MAX_WINDOWS = 64  # distinct sliding-window sizes in one model


def _chunk_cost(value: Any, where: str) -> None:
    """Seq1F1B: ``[c1, c2]``, then ``W, f`` per window size (``autopart.schedule.chunks``): W a
    whole number of keys, f a share of c2 in [0, 1], the shares summing to at most 1."""
    list_of(number(-1e300, 1e300), 2 + 2 * _MAX_WINDOWS, 2)(value, where)
    windows = value[2:]
    if len(windows) % 2:
        raise Invalid(where, "must be [c1, c2] then (window, share) pairs")
    for i in range(0, len(windows), 2):
        w, f = windows[i], windows[i + 1]
        if w != int(w) or not 1 <= w <= MAX_DIM:
            raise Invalid(f"{where}[{i + 2}]", f"= {w} is not a window of keys")
        if not 0 <= f <= 1:
            raise Invalid(f"{where}[{i + 3}]", f"= {f} is not a share in [0, 1]")
    if sum(windows[1::2]) > 1 + 1e-9:
        raise Invalid(where, "its windows' shares add up to more than 1")


_CHUNK_COST = nullable(_chunk_cost)
_LIBRARY = string(LIBRARY_NAME)

PLAN_FIELDS: dict[str, Spec] = {
    "mesh": obj({d: integer(1, MAX_WORLD) for d in ("dp", "pp", "tp")}),
    "schedule": _TEXT,
    "microbatches": integer(1, 1 << 16),
    "virtual_stages": integer(1, MAX_STAGES),
    "seq_chunks": integer(1, 1 << 12),
    "sequence_parallel": boolean,
    "bucket_mb": number(0, 1 << 30),
    "max_stage_memory_gb": nullable(number(0, 1 << 30)),
    "seq_split": _TEXT,
    "recompute": _TEXT,
    "distributed_optimizer": boolean,
    "micro_batch": nullable(integer(1, 1 << 20)),
    "precision": nullable(_TEXT),
}

HEAD = obj(
    {
        "format": integer(),
        "plan": obj(
            PLAN_FIELDS,
            {
                "seq_block": integer(1, 1 << 20),
                "library_ops": list_of(_LIBRARY, 64),
                "max_seq": nullable(integer(1, 1 << 31)),
                "min_seq": nullable(integer(1, 1 << 31)),
                "attention": _TEXT,
            },
        ),
        "world_size": integer(1, MAX_WORLD),
        "example_shape": list_of(integer(1, 1 << 31), 2, 2),
        "vocab_size": integer(1, 1 << 31),
        "tied": dict_of(_FQN, key=_FQN),
        "params": dict_of(
            obj(
                {
                    "shape": list_of(integer(0, MAX_DIM), 16),
                    "dtype": one_of(*DTYPES),
                    "split": nullable(list_of(integer(0, 1 << 20), 2, 2)),
                }
            ),
            key=_FQN,
        ),
        "buffers": list_of(_FQN),
        "batch": list_of(one_of(*DATA_NAMES), len(DATA_NAMES), 2),
        "frozen": list_of(_FQN),
        "files": dict_of(_SHA256, key=string(NAMES)),
    },
    {
        "passes": list_of(_TEXT, 1024),
        "ties": dict_of(list_of(integer(0, MAX_STAGES)), key=_FQN),
        "chunk_cost": _CHUNK_COST,
        "libraries": dict_of(string(libraries.VERSION), key=_LIBRARY, max_len=64),
        "model": _SHA256,
    },
)


def check_head(doc: Any) -> Plan:
    """Check a parsed ``plan.json``; return its ``Plan``."""
    HEAD(doc, "")
    try:
        plan = Plan.from_json(doc["plan"])
    except Exception as exc:  # noqa: BLE001 - Plan's own checks (AutopartError) and the rest
        raise Invalid("plan", f"is not a valid plan: {getattr(exc, 'message', exc)}") from None
    if plan.mesh.size != doc["world_size"]:
        raise Invalid("world_size", f"= {doc['world_size']} is not the mesh's {plan.mesh.size}")
    for fqn, meta in doc["params"].items():
        if math.prod(meta["shape"]) > MAX_NUMEL:
            raise Invalid(f"params.{fqn}.shape", f"has more than {MAX_NUMEL:,} elements")
        if meta["split"] is not None:
            dim, strided = meta["split"]
            if dim >= len(meta["shape"]) or strided < 1 or plan.mesh.tp == 1:
                raise Invalid(f"params.{fqn}.split", f"= {meta['split']} is no tp split of it")
            if meta["shape"][dim] % (plan.mesh.tp * strided):
                raise Invalid(
                    f"params.{fqn}.split", f"does not cut dim {dim} into tp × {strided} blocks"
                )
    batch = doc["batch"]
    if batch[:2] != list(DATA_NAMES[:2]) or batch != [n for n in DATA_NAMES if n in batch]:
        raise Invalid("batch", f"= {batch} is not input_ids, labels and optional tensors in order")
    if len(set(doc["frozen"])) != len(doc["frozen"]) or not set(doc["frozen"]) <= set(
        doc["params"]
    ):
        raise Invalid("frozen", "repeats a name or names no parameter of params")
    for alias, canonical in doc["tied"].items():
        if canonical not in doc["params"]:
            raise Invalid(f"tied.{alias}", f"= {canonical!r} is not a parameter of params")
        if alias in doc["params"] or alias in doc["buffers"]:
            raise Invalid(f"tied.{alias}", "is a parameter or buffer of its own, not an alias")
    for fqn, pps in doc.get("ties", {}).items():
        if fqn not in doc["params"]:
            raise Invalid(f"ties.{fqn}", "names no parameter of params")
        if pps != sorted(set(pps)) or len(pps) < 2 or pps[-1] >= plan.mesh.pp:
            raise Invalid(f"ties.{fqn}", f"= {pps} is not a set of at least 2 pipeline ranks")
    if len(set(doc["buffers"])) != len(doc["buffers"]):
        raise Invalid("buffers", "repeats a name")
    for rel in doc["files"]:
        if rel != "plan.json" and int(rel[4:9]) >= doc["world_size"]:
            raise Invalid(f"files.{rel}", "is the file of a rank beyond world_size")
        if rel == "plan.json":
            raise Invalid("files.plan.json", "lists plan.json itself")
    return plan


def _input(value: Any, where: str) -> None:
    list_of(string(max_len=1024), 2, 2)(value, where)
    one_of(*INPUT_KINDS)(value[0], f"{where}[0]")


def _kv_dim(value: Any, where: str) -> None:
    if value != "b":
        integer(0, 1 << 31)(value, where)


_STAGE = obj(
    {
        "stage": integer(0, MAX_STAGES),
        "file": string(re.compile(r"stage[0-9]{1,6}\.pt2")),
        "passes": list_of(_TEXT, 1024),
        "inputs": list_of(_input),
        "kv_shapes": list_of(list_of(_kv_dim, 8, 1)),
    }
)
_ACTION = obj(
    {"kind": one_of(*KINDS)},
    {
        "stage": integer(0, MAX_STAGES),
        "mb": integer(0, 1 << 16),
        "chunk": integer(0, 1 << 12),
        "peer": integer(0, MAX_WORLD),
    },
)
_SHARD = obj(
    {
        "shape": list_of(integer(0, MAX_DIM), 16),
        "dim": nullable(integer(0, 15)),
        "index": integer(0, MAX_WORLD),
        "parts": integer(1, MAX_WORLD),
        "strided": integer(1, 1 << 10),
    }
)
RANK = obj(
    {
        "rank": integer(0, MAX_WORLD),
        "coords": obj({d: integer(0, MAX_WORLD) for d in ("pp", "dp", "tp")}),
        "groups": obj({d: list_of(integer(0, MAX_WORLD), MAX_WORLD) for d in ("dp", "pp", "tp")}),
        "stages": list_of(_STAGE, MAX_STAGES, 1),
        "actions": list_of(_ACTION),
        "shards": dict_of(_SHARD, key=_FQN),
        "buckets": list_of(list_of(_FQN)),
        "ties": dict_of(list_of(integer(0, MAX_WORLD), MAX_WORLD), key=_FQN),
        "n_stages": integer(1, MAX_STAGES),
        "vocab_size": integer(1, 1 << 31),
        "batch": list_of(one_of(*DATA_NAMES), len(DATA_NAMES), 2),
        "frozen": list_of(_FQN),
        "plan_digest": _SHA256,
    },
    {"chunk_cost": _CHUNK_COST},
)


def check_rank(doc: Any, head: dict[str, Any], plan: Plan, rank: int) -> None:
    """Check a parsed ``program.json`` of ``rank`` against its ``plan.json`` (``head``)."""
    RANK(doc, "")
    mesh: Mesh = plan.mesh
    if doc["rank"] != rank:
        raise Invalid("rank", f"= {doc['rank']}, but this is the folder of rank {rank}")
    if doc["coords"] != mesh.coords(rank).as_dict():
        raise Invalid("coords", f"are not rank {rank}'s coordinates in {mesh}")
    for d in ("dp", "pp", "tp"):
        if doc["groups"][d] != mesh.group(d, rank):
            raise Invalid(f"groups.{d}", f"is not rank {rank}'s {d} group in {mesh}")
    n_stages = mesh.pp * plan.virtual_stages
    if doc["n_stages"] != n_stages:
        raise Invalid("n_stages", f"= {doc['n_stages']}, not pp × virtual_stages = {n_stages}")
    cost = doc.get("chunk_cost")
    if (cost is not None) != plan.chunked:  # Seq1F1B's chunk boundaries, no other schedule's
        raise Invalid("chunk_cost", f"= {cost} does not fit a {plan.schedule!r} plan")
    if cost != head.get("chunk_cost", cost):
        raise Invalid("chunk_cost", "differs from plan.json's (every rank splits alike)")
    for key in ("vocab_size", "batch"):
        if doc[key] != head[key]:
            raise Invalid(key, f"= {doc[key]} differs from plan.json's {head[key]}")
    params, buffers = head["params"], set(head["buffers"])
    for fqn, shard in doc["shards"].items():
        where = f"shards.{fqn}"
        if fqn not in params:
            raise Invalid(where, "names no parameter of plan.json")
        if shard["shape"] != params[fqn]["shape"]:
            raise Invalid(f"{where}.shape", "differs from the parameter's shape in plan.json")
        if shard["dim"] is not None and shard["dim"] >= len(shard["shape"]):
            raise Invalid(f"{where}.dim", f"= {shard['dim']} is not a dim of the parameter")
        split = params[fqn]["split"]
        got = [shard["dim"], shard["strided"]] if shard["dim"] is not None else None
        slot = (doc["coords"]["tp"], mesh.tp) if split else (0, 1)
        whole = split is None and shard["strided"] != 1
        if got != split or (shard["index"], shard["parts"]) != slot or whole:
            raise Invalid(
                where,
                f"= {shard} is not rank {rank}'s slice of the split plan.json gives it ({split})",
            )
    frozen = sorted(f for f in head["frozen"] if f in doc["shards"])
    if sorted(doc["frozen"]) != frozen:
        raise Invalid("frozen", f"= {doc['frozen']} are not plan.json's of this rank's shards")
    seen: set[str] = set()
    for i, bucket in enumerate(doc["buckets"]):
        for fqn in bucket:
            if fqn not in doc["shards"] or fqn in seen:
                raise Invalid(
                    f"buckets[{i}]", f"names {fqn!r}, which is not a shard of this rank or is twice"
                )
            seen.add(fqn)
    if mesh.dp == 1 and seen:  # data_parallel's invariant (the rest: format.load_rank)
        raise Invalid(
            "buckets", "are not empty (dp = 1: no gradient is reduced over data-parallel replicas)"
        )
    for fqn, pps in doc["ties"].items():
        if fqn not in doc["shards"] or any(p >= mesh.pp for p in pps):
            raise Invalid(f"ties.{fqn}", "is not a shard of this rank tied over pipeline ranks")
    if "ties" in head:  # the whole pipeline's ties (plan.json): this rank's are its shards' ones
        tied = {f: pps for f, pps in head["ties"].items() if f in doc["shards"]}
        if doc["ties"] != tied:
            raise Invalid("ties", f"= {doc['ties']} are not plan.json's ties of this rank's shards")
    mine = [k for k in range(n_stages) if k % mesh.pp == doc["coords"]["pp"]]
    stages = [st["stage"] for st in doc["stages"]]
    if stages != mine:
        raise Invalid(
            "stages", f"are {stages}, but pipeline rank {doc['coords']['pp']} runs {mine}"
        )
    for i, st in enumerate(doc["stages"]):
        _check_stage(st, f"stages[{i}]", doc, buffers)
    _check_actions(doc["actions"], plan, set(stages))
    want = generate(
        plan.schedule,
        doc["coords"]["pp"],
        plan.microbatches,
        doc["groups"]["pp"],
        mesh.dp,
        plan.virtual_stages,
        tied=bool(doc["ties"]),
        k=plan.seq_chunks,
    )
    for i, (got, a) in enumerate(itertools.zip_longest(doc["actions"], want)):
        if a is None or got != a.to_json():
            raise Invalid(
                f"actions[{i}]",
                f"= {got} is not {a and a.to_json()}: the actions are those plan.json's "
                f"{plan.schedule!r} schedule gives pipeline rank {doc['coords']['pp']}",
            )


def _check_stage(st: dict[str, Any], where: str, doc: dict[str, Any], buffers: set[str]) -> None:
    if st["file"] != f"stage{st['stage']}.pt2":
        raise Invalid(f"{where}.file", f"= {st['file']!r} is not stage{st['stage']}.pt2")
    kv = 0
    for j, (kind, name) in enumerate(st["inputs"]):
        at = f"{where}.inputs[{j}]"
        ok = _input_ok(kind, name, kv, doc["shards"], buffers)
        if kind in ("data", "keys"):  # a batch tensor the program's batch has
            ok = ok and name in doc.get("batch", DATA_NAMES[:2])
        if not ok:
            raise Invalid(at, f"is a {kind} input named {name[:80]!r}, which this program lacks")
        kv += kind == "kv"
    if len(st["kv_shapes"]) != kv:
        raise Invalid(f"{where}.kv_shapes", f"has {len(st['kv_shapes'])} shapes for {kv} inputs")
    for j, shape in enumerate(st["kv_shapes"]):
        at = f"{where}.kv_shapes[{j}]"
        sizes = [d for d in shape if d != "b"]
        if shape.count("b") > 1 or sizes.count(0) != 1:
            raise Invalid(at, f"= {shape} is not an empty prefix (one 0, at most one 'b')")
        row = math.prod(d for d in sizes if d)
        if row > MAX_KV_ROW:
            raise Invalid(at, f"= {shape} has {row:,} elements per token (at most {MAX_KV_ROW:,})")


def _input_ok(kind: str, name: str, kv: int, shards: dict, buffers: set[str]) -> bool:
    """Whether a stage input names something this program has (``kv``: the K/V inputs before
    it, so that they are numbered 0, 1, ... in order)."""
    if kind == "param":
        return name in shards
    if kind in ("buffer", "constant"):
        return name in buffers
    if kind == "data":
        return name in DATA_NAMES
    if kind == "keys":  # Seq1F1B: the key columns of an optional batch tensor
        return name in DATA_NAMES[2:]
    if kind == "rank":
        return name in ("dp", "pp", "tp")
    if kind == "rng":
        return re.fullmatch(r"[a-z_]{1,32}", name) is not None
    if kind == "act":
        return re.fullmatch(r"[0-9]{1,5}", name) is not None
    if kind == "offset":
        return name == ""
    return name == str(kv)  # "kv"


def _check_actions(actions: list[dict[str, Any]], plan: Plan, stages: set[int]) -> None:
    units = len(stages) * plan.microbatches * plan.seq_chunks
    if len(actions) < units:  # every (stage, micro-batch, chunk) has its forward: checked
        # before the schedule is generated, whose size the file then bounds (a forged plan of
        # 65536 micro-batches × 4096 chunks generated 24 GB of actions before any refusal)
        raise Invalid(
            "actions",
            f"has {len(actions)} actions for this rank's {units:,} (stage, micro-batch, chunk) "
            "forwards",
        )
    limit = 7 * units + 2
    if len(actions) > limit:
        raise Invalid("actions", f"has {len(actions)} actions, more than this plan's {limit}")
    for i, a in enumerate(actions):
        where = f"actions[{i}]"
        if a.get("stage", 0) not in stages and a["kind"] not in ("DP_REDUCE", "TIE_REDUCE"):
            raise Invalid(f"{where}.stage", f"= {a.get('stage', 0)} is not a stage of this rank")
        if a.get("mb", 0) >= plan.microbatches:
            raise Invalid(f"{where}.mb", f"= {a['mb']} ≥ microbatches ({plan.microbatches})")
        if a.get("chunk", 0) >= plan.seq_chunks:
            raise Invalid(f"{where}.chunk", f"= {a['chunk']} ≥ seq_chunks ({plan.seq_chunks})")
        if a.get("peer", 0) >= plan.mesh.size:
            raise Invalid(f"{where}.peer", f"= {a['peer']} is not a rank of the world")
        if ("peer" in a) != ("SEND" in a["kind"] or "RECV" in a["kind"]):
            raise Invalid(where, f"is a {a['kind']} with{'' if 'peer' in a else 'out'} a peer")
