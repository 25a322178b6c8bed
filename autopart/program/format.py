"""Emit: the compiled ``Program`` — one ``RankProgram`` per rank — and its files.

A ``RankProgram`` is everything one rank runs: its stage graphs (each with the list of what
feeds its placeholders), its schedule actions, the map from its local tensors to the model's
global parameters (``Shard``), its gradient buckets and its process groups.

``Program.save(dir)`` writes, without pickling any code::

    dir/plan.json                 plan, world size, global parameter shapes, tied names
    dir/rank00003/program.json    coords, groups, actions, shards, buckets, stage inputs
    dir/rank00003/stage0.pt2      the stage graph as a torch.export program (all inputs explicit)
    dir/rank00003/stage0.py       the same graph as readable Python
    dir/rank00003/weights.pt      this rank's parameter shards and buffers (tensors only)

Saving into a folder that holds an earlier program first removes that program's files.
``Program.load(dir)`` / ``load_rank(dir, r)`` read them back, running no code from the files:
a graph archive is first checked to hold only what autopart writes (no weights, constants,
example inputs, custom objects or guard code that torch would unpickle or run; only ATen,
autopart and Python size ops as call targets: ``autopart/program/archive.py``), tensors are read with
``torch.load(weights_only=True)``, the rest is JSON. ``plan.json`` lists the SHA-256 of every other file; a file is checked against it before
it is read, so a changed, truncated, missing or swapped-in file (another program's) is refused
with an ``AutopartError`` naming it. Each JSON file's schema (keys and types) is checked too.
The checksums catch damage and mix-ups, not a deliberate attacker who also rewrites
``plan.json``: keep program folders where only you can write.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from autopart.errors import AutopartError
from autopart.frontend.capture import InputRef, layer_of
from autopart.layout import Mesh, Plan
from autopart.lowering.pass_runner import PassRecord
from autopart.meta import (
    META_INPUT,
    META_KV_SHAPES,
    META_LAYER,
    META_MODULE,
    META_PASSES,
    META_RANGES,
    META_RECOMPUTE,
)
from autopart.program.archive import check_pt2, check_targets
from autopart.schedule.ir import Action, table

FORMAT = 2  # 2: tp_gather / tp_scatter_reduce carry their group size
_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}


@dataclass(frozen=True)
class Shard:
    """How a rank's local tensor maps to a global parameter: whole, or one of ``parts`` slices
    along ``dim`` (``strided`` interleaved blocks, as for a fused QKV weight)."""

    shape: tuple[int, ...]  # the global shape
    dim: int | None = None
    index: int = 0
    parts: int = 1
    strided: int = 1

    def local(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return full
        blocks = full.chunk(self.strided, self.dim)
        return torch.cat([b.chunk(self.parts, self.dim)[self.index] for b in blocks], self.dim)


@dataclass
class StageProgram:
    """One stage graph and what feeds each of its placeholders, in order."""

    stage: int
    graph: fx.GraphModule
    inputs: list[InputRef]


@dataclass
class RankProgram:
    """Everything one rank runs."""

    rank: int
    coords: dict[str, int]
    groups: dict[str, list[int]]
    stages: list[StageProgram]
    actions: list[Action]
    shards: dict[str, Shard]
    buckets: list[list[str]] = field(default_factory=list)
    ties: dict[str, list[int]] = field(default_factory=dict)  # FQN → pipeline ranks holding it
    n_stages: int = 1
    chunk_cost: tuple[float, float] | None = None  # Seq1F1B: (c1, c2) for the chunk boundaries
    vocab_size: int | None = None  # token ids and labels are checked against it at every step

    def __str__(self) -> str:
        c = self.coords
        lines = [
            f"# rank {self.rank}  (pp={c['pp']}, dp={c['dp']}, tp={c['tp']})",
            "# groups: " + ", ".join(f"{d}={g}" for d, g in self.groups.items()),
        ]
        for st in self.stages:
            made_by = " → ".join(["capture", *st.graph.meta.get(META_PASSES, [])])
            lines += [f"\n## stage {st.stage}  (made by: {made_by})", st.graph.code.strip()]
        if self.buckets:
            lines.append(
                f"\n## data-parallel gradient buckets (all-reduce over ranks {self.groups['dp']})"
            )
            for i, b in enumerate(self.buckets):
                numel = sum(_numel(self.shards[f].shape) for f in b)
                lines.append(f"  bucket {i}: {len(b)} tensors, {numel:,} elements: {', '.join(b)}")
        lines += ["\n## actions", table({self.rank: self.actions})]
        return "\n".join(lines)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class Program:
    """The compiled program of every rank, plus the global view they share."""

    plan: Plan
    ranks: list[RankProgram]
    params: dict[str, torch.Tensor]  # global FQN → initial value (may be on meta)
    buffers: dict[str, torch.Tensor]
    tied: dict[str, str]
    example_shape: tuple[int, int]
    vocab_size: int
    history: list[PassRecord] = field(default_factory=list)
    split: dict[str, Any] = field(default_factory=dict)  # pipeline: unit_costs, cuts

    @property
    def mesh(self) -> Mesh:
        return self.plan.mesh

    def rank(self, r: int) -> RankProgram:
        if not 0 <= r < len(self.ranks):
            raise AutopartError(
                f"rank {r} does not exist: this program has {len(self.ranks)} ranks"
            )
        return self.ranks[r]

    def __str__(self) -> str:
        return f"Program({self.mesh}, schedule={self.plan.schedule}, microbatches={self.plan.microbatches}, {len(self.params)} parameters)"

    def summary(self, console: Any = None) -> None:
        """Print the per-rank layout as a table."""
        from rich.console import Console  # terminal output: only when asked for
        from rich.table import Table

        t = Table(title=str(self))
        for col in ("rank", "pp", "dp", "tp", "stages", "actions", "local params"):
            t.add_column(col, justify="right")
        for rp in self.ranks:
            n = sum(
                _numel(tuple(s.local(torch.empty(s.shape, device="meta")).shape))
                for s in rp.shards.values()
            )
            t.add_row(
                str(rp.rank),
                *(str(rp.coords[d]) for d in ("pp", "dp", "tp")),
                str([s.stage for s in rp.stages]),
                str(len(rp.actions)),
                f"{n:,}",
            )
        (console or Console()).print(t)

    def save(self, path: str | Path) -> Path:
        """Write ``plan.json`` and one folder per rank (see the module docstring)."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        _clear_old(root)
        head = {
            "format": FORMAT,
            "plan": self.plan.to_json(),
            "world_size": len(self.ranks),
            "example_shape": list(self.example_shape),
            "vocab_size": self.vocab_size,
            "tied": self.tied,
            "params": {
                f: {"shape": list(t.shape), "dtype": str(t.dtype)} for f, t in self.params.items()
            },
            "buffers": sorted(self.buffers),
            "passes": [h.name for h in self.history],
        }
        for rp in self.ranks:
            _save_rank(rp, root / f"rank{rp.rank:05d}", self.params, self.buffers)
        head["files"] = {
            f"rank{rp.rank:05d}/{f.name}": _sha256(f)
            for rp in self.ranks
            for f in sorted((root / f"rank{rp.rank:05d}").iterdir())
            if f.is_file()
        }
        (root / "plan.json").write_text(json.dumps(head, indent=1))
        return root

    @classmethod
    def load(cls, path: str | Path) -> Program:
        root = Path(path)
        head = read_head(root)
        ranks = [load_rank(root, r) for r in range(head["world_size"])]
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for r, rp in enumerate(ranks):
            weights = load_weights(root, r)
            for fqn, shard in rp.shards.items():
                if shard.dim is None and fqn in weights:
                    params.setdefault(fqn, weights[fqn])
            buffers.update({k: v for k, v in weights.items() if k in head["buffers"]})
        for fqn, meta in head["params"].items():
            params.setdefault(
                fqn, torch.empty(meta["shape"], dtype=_DTYPES[meta["dtype"]], device="meta")
            )
        return cls(
            plan=Plan.from_json(head["plan"]),
            ranks=ranks,
            params=params,
            buffers=buffers,
            tied=head["tied"],
            example_shape=tuple(head["example_shape"]),
            vocab_size=head["vocab_size"],
        )


_HEAD_SCHEMA = {
    "format": int,
    "plan": dict,
    "world_size": int,
    "example_shape": list,
    "vocab_size": int,
    "tied": dict,
    "params": dict,
    "buffers": list,
    "files": dict,
}
_RANK_SCHEMA = {
    "rank": int,
    "coords": dict,
    "groups": dict,
    "stages": list,
    "actions": list,
    "shards": dict,
    "buckets": list,
    "ties": dict,
    "n_stages": int,
}


_OURS = ("program.json", "weights.pt", "stage*.pt2", "stage*.py")


def _clear_old(root: Path) -> None:
    """Remove what an earlier save left in ``root``: its plan.json and its rank folders' files
    (a stale ``weights.pt`` would otherwise be listed, checksummed and trained from). Only
    autopart's own file names are touched; a rank folder left empty is removed."""
    (root / "plan.json").unlink(missing_ok=True)
    for folder in root.glob("rank[0-9][0-9][0-9][0-9][0-9]"):
        if not folder.is_dir():
            continue
        for pattern in _OURS:
            for f in folder.glob(pattern):
                f.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _json(path: Path, schema: dict[str, type]) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AutopartError(
            f"{path} is not a valid autopart JSON file ({exc})",
            hint="the file is damaged or not from Program.save(); re-save the program",
        ) from None
    bad = [
        k for k, t in schema.items() if not isinstance(doc, dict) or not isinstance(doc.get(k), t)
    ]
    if bad:
        raise AutopartError(
            f"{path} does not have autopart's layout: {', '.join(bad)} missing or of the wrong type",
            hint="the file is damaged or from another tool or version; re-save the program",
        )
    return doc


def read_head(root: Path) -> dict[str, Any]:
    f = Path(root) / "plan.json"
    if not f.exists():
        raise AutopartError(
            f"{root} holds no plan.json", hint="point at a folder written by Program.save()"
        )
    fmt = _json(f, {})
    if fmt.get("format") != FORMAT:
        raise AutopartError(
            f"{f} has format {fmt.get('format')}, this autopart reads {FORMAT}",
            hint="re-run parallelize(...).save() with this version",
        )
    return _json(f, _HEAD_SCHEMA)


def checked(root: str | Path, rel: str, head: dict[str, Any] | None = None) -> Path:
    """``root/rel`` after checking it against the SHA-256 recorded in ``plan.json``."""
    root = Path(root)
    want = (head or read_head(root))["files"].get(rel)
    path = root / rel
    if want is None:
        raise AutopartError(
            f"{path} is not listed in {root / 'plan.json'}",
            hint="the program folder is incomplete or mixed up; re-save the program",
        )
    if not path.is_file():
        raise AutopartError(
            f"{path} is missing", hint="re-save the program, or copy the whole folder"
        )
    if _sha256(path) != want:
        raise AutopartError(
            f"{path} does not match its checksum in plan.json: it was changed, truncated, or "
            "comes from another program",
            hint="re-save the program with Program.save(); never edit or mix program folders",
        )
    return path


def _to_exported(graph: fx.GraphModule) -> ExportedProgram:
    """Wrap a functional stage graph (every input a placeholder) as an ExportedProgram."""
    ph = [n for n in graph.graph.nodes if n.op == "placeholder"]
    outs = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    sig = ExportGraphSignature(
        input_specs=[
            InputSpec(InputKind.USER_INPUT, TensorArgument(name=n.name), target=None) for n in ph
        ],
        output_specs=[
            OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(name=o.name), target=None)
            for o in outs
        ],
    )
    in_spec = pytree.tree_flatten((tuple(range(len(ph))), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(len(outs))))[1]
    call = ModuleCallEntry(
        "", ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec)
    )
    for n in graph.graph.nodes:
        custom = n.meta.setdefault("custom", {})
        custom[META_MODULE], custom[META_LAYER] = (
            n.meta.get(META_MODULE, ""),
            n.meta.get(META_LAYER),
        )
        if META_RECOMPUTE in n.meta:
            custom[META_RECOMPUTE] = n.meta[META_RECOMPUTE]
    ep = ExportedProgram(
        root=graph,
        graph=graph.graph,
        graph_signature=sig,
        state_dict={},
        range_constraints=graph.meta.get(META_RANGES, {}),
        module_call_graph=[call],
        constants={},
        verifiers=None,
    )
    # torch derives Python guard code from the graph's shape asserts and would compile it in
    # ``ep.module()``; the runtime checks shapes itself, and a loaded archive carrying code is
    # refused (autopart/program/archive.py), so none is written
    ep._guards_code = []
    return ep


def _save_rank(
    rp: RankProgram, folder: Path, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stages = []
    for st in rp.stages:
        torch.export.save(_to_exported(st.graph), folder / f"stage{st.stage}.pt2")
        (folder / f"stage{st.stage}.py").write_text(st.graph.code)
        stages.append(
            {
                "stage": st.stage,
                "file": f"stage{st.stage}.pt2",
                "passes": st.graph.meta.get(META_PASSES, []),
                "inputs": [[i.kind, i.name] for i in st.inputs],
                "kv_shapes": st.graph.meta.get(META_KV_SHAPES, []),
            }
        )
    doc = {
        "rank": rp.rank,
        "coords": rp.coords,
        "groups": rp.groups,
        "stages": stages,
        "actions": [a.to_json() for a in rp.actions],
        "shards": {f: asdict(s) for f, s in rp.shards.items()},
        "buckets": rp.buckets,
        "ties": rp.ties,
        "n_stages": rp.n_stages,
        "chunk_cost": rp.chunk_cost,
        "vocab_size": rp.vocab_size,
    }
    (folder / "program.json").write_text(json.dumps(doc, indent=1))
    real = {f: t for f, t in params.items() if t.device.type != "meta" and f in rp.shards}
    if real:
        local = {f: rp.shards[f].local(t.detach()).contiguous().clone() for f, t in real.items()}
        used = {i.name for st in rp.stages for i in st.inputs if i.kind in ("buffer", "constant")}
        local.update(
            {k: v.detach().clone() for k, v in buffers.items() if k in used and v is not None}
        )
        torch.save(local, folder / "weights.pt")


def load_rank(root: str | Path, rank: int) -> RankProgram:
    """Read one rank's program (graphs, actions, shards) from a saved folder."""
    # a stage graph need not use every symbol of the model (labels' dims): not worth a warning
    logging.getLogger("torch._export.serde.serialize").setLevel(logging.ERROR)
    folder = Path(root) / f"rank{rank:05d}"
    if not (folder / "program.json").exists():
        raise AutopartError(
            f"{folder} is missing: the saved program has no rank {rank}",
            hint="launch as many ranks as plan.json's world_size",
        )
    head = read_head(Path(root))
    doc = _json(checked(root, f"rank{rank:05d}/program.json", head), _RANK_SCHEMA)
    stages = []
    for st in doc["stages"]:
        pt2 = checked(root, f"rank{rank:05d}/{st['file']}", head)
        check_pt2(pt2)  # nothing torch would unpickle or call beyond known ops
        try:
            graph = torch.export.load(pt2).graph_module
        except Exception as exc:  # noqa: BLE001 - whatever torch says, name the file
            raise AutopartError(
                f"{pt2} is not a loadable torch.export program: {type(exc).__name__}",
                hint="re-save the program with this autopart and torch version",
            ) from exc
        check_targets(graph, pt2)
        graph.meta[META_PASSES] = st["passes"]
        graph.meta[META_KV_SHAPES] = st.get("kv_shapes", [])
        inputs = [InputRef(k, n) for k, n in st["inputs"]]
        for n in graph.graph.nodes:
            custom = n.meta.get("custom") or {}
            n.meta[META_MODULE], n.meta[META_LAYER] = (
                custom.get(META_MODULE, ""),
                custom.get(META_LAYER),
            )
            if custom.get(META_RECOMPUTE) is not None:
                n.meta[META_RECOMPUTE] = int(custom[META_RECOMPUTE])
        for n, ref in zip(
            (n for n in graph.graph.nodes if n.op == "placeholder"), inputs, strict=True
        ):
            n.meta[META_INPUT] = ref
            if ref.kind == "param":
                n.meta[META_MODULE] = ref.name.rpartition(".")[0]
                n.meta[META_LAYER] = layer_of(ref.name)
        stages.append(StageProgram(st["stage"], graph, inputs))
    return RankProgram(
        rank=doc["rank"],
        coords=doc["coords"],
        groups=doc["groups"],
        stages=stages,
        actions=[Action.from_json(a) for a in doc["actions"]],
        shards={f: Shard(**{**s, "shape": tuple(s["shape"])}) for f, s in doc["shards"].items()},
        buckets=doc["buckets"],
        ties=doc.get("ties", {}),
        n_stages=doc.get("n_stages", 1),
        chunk_cost=tuple(doc["chunk_cost"]) if doc.get("chunk_cost") else None,
        vocab_size=doc.get("vocab_size") if isinstance(doc.get("vocab_size"), int) else None,
    )


def load_weights(root: str | Path, rank: int) -> dict[str, torch.Tensor]:
    """This rank's saved parameter shards and buffers (empty if the model was on meta)."""
    rel = f"rank{rank:05d}/weights.pt"
    head = read_head(Path(root))
    if rel not in head["files"]:
        return {}
    return torch.load(checked(root, rel, head), weights_only=True)
