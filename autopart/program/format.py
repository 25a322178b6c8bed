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

Saving into a folder that holds an earlier program first removes that program's files, never
anything outside the folder (``program/folder.py``: no symlink is followed, a symlinked rank
folder is refused). ``Program.load(dir)`` / ``load_rank(dir, r)`` / ``load_weights(dir, r)``
read them back treating the folder as hostile (docs/security.md): each file is read once,
through descriptors that follow no link, within a size bound, and its bytes are checked before
anything parses them: the SHA-256 in ``plan.json`` (damage and mix-ups), a deep schema of
``plan.json`` and ``program.json`` (``program/plan_json.py``: types, ranges, names and sizes the
plan implies), and for a graph archive the canonical zip layout and an allow-list of its JSON,
symbolic sizes included (``program/archive.py``, ``graph_json.py``, ``symexpr.py``), before
torch reads those same bytes. Tensors are read with ``torch.load(weights_only=True)`` after the
zip holds no more than the rank's parameter shards and buffers, and checked after against their
shapes and dtypes. Every failure is an ``AutopartError`` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
from collections.abc import Sequence
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
from autopart.layout import Coords, Mesh, Plan
from autopart.meta import (
    META_INPUT,
    META_KV_SHAPES,
    META_LAYER,
    META_MODULE,
    META_PASSES,
    META_RANGES,
    META_RECOMPUTE,
)
from autopart.program import libraries
from autopart.program.archive import check_pt2, check_targets, check_weights
from autopart.program.folder import ProgramFolder, rank_dir
from autopart.program.plan_json import check_head, check_rank
from autopart.program.schema import Invalid, parse_json
from autopart.schedule.ir import Action, table

FORMAT = 3  # 2: tp_gather / tp_scatter_reduce carry their group size; 3: plan.json's digest
# in every program.json, its batch, frozen parameters and tp splits
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
    coords: Coords
    groups: dict[str, list[int]]
    stages: list[StageProgram]
    actions: list[Action]
    shards: dict[str, Shard]
    buckets: list[list[str]] = field(default_factory=list)
    ties: dict[str, list[int]] = field(default_factory=dict)  # FQN → pipeline ranks holding it
    n_stages: int = 1
    chunk_cost: tuple[float, ...] | None = None  # Seq1F1B: (c1, c2, *windows): chunk boundaries
    vocab_size: int | None = None  # token ids and labels are checked against it at every step
    # the batch tensors the program takes (capture's): a step must pass exactly these
    batch_names: tuple[str, ...] = ("input_ids", "labels")
    # parameters the model froze (requires_grad=False): held and read, never trained
    frozen: tuple[str, ...] = ()
    # what the captured graph computes (graph.computation_digest): checkpoints record it
    model: str | None = None

    def __str__(self) -> str:
        c = self.coords
        lines = [
            f"# rank {self.rank}  (pp={c.pp}, dp={c.dp}, tp={c.tp})",
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


@dataclass(frozen=True)
class PassRecord:
    """One pass applied: its name, seconds taken and the graph's code afterwards."""

    name: str
    seconds: float
    code: str


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
    # library op namespaces the graphs call → the library's version (program/libraries.py)
    libraries: dict[str, str] = field(default_factory=dict)

    @property
    def mesh(self) -> Mesh:
        return self.plan.mesh

    @property
    def pipeline_ties(self) -> dict[str, list[int]]:
        """Every parameter held by several pipeline ranks → those ranks, over the whole
        pipeline: what every rank needs to create the same tie groups (``make_groups``), also
        a middle stage that holds none of them. Saved as ``plan.json``'s ``ties``."""
        ties: dict[str, set[int]] = {}
        for rp in self.ranks:
            for fqn, pps in rp.ties.items():
                ties.setdefault(fqn, set()).update(pps)
        return {f: sorted(pps) for f, pps in sorted(ties.items())}

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
                *(str(rp.coords.along(d)) for d in ("pp", "dp", "tp")),
                str([s.stage for s in rp.stages]),
                str(len(rp.actions)),
                f"{n:,}",
            )
        (console or Console()).print(t)

    def save(self, path: str | Path) -> Path:
        """Write ``plan.json`` and one folder per rank (see the module docstring). Nothing is
        written, followed or removed outside ``path``: see ``autopart/program/folder.py``."""
        root = Path(path)
        head: dict[str, Any] = {
            "format": FORMAT,
            "plan": self.plan.to_json(),
            "world_size": len(self.ranks),
            "example_shape": list(self.example_shape),
            "vocab_size": self.vocab_size,
            "tied": self.tied,
            "ties": self.pipeline_ties,
            "chunk_cost": self.ranks[0].chunk_cost,  # every rank splits the sequence alike
            "params": {
                f: {"shape": list(t.shape), "dtype": str(t.dtype), "split": self._split(f)}
                for f, t in self.params.items()
            },
            "buffers": sorted(self.buffers),
            "batch": list(self.ranks[0].batch_names),
            "frozen": sorted({f for rp in self.ranks for f in rp.frozen}),
            "passes": [h.name for h in self.history],
        }
        if self.libraries:
            head["libraries"] = dict(sorted(self.libraries.items()))
        if self.ranks[0].model is not None:
            head["model"] = self.ranks[0].model
        digest = plan_digest(head)
        with ProgramFolder(root, create=True) as folder:
            folder.clear()
            files: dict[str, str] = {}
            for rp in self.ranks:
                files.update(_save_rank(rp, folder, self.params, self.buffers, digest))
            head["files"] = files
            text = json.dumps(head, indent=1).encode()
            folder.write("plan.json", lambda f: f.write(text))
        return root

    def _split(self, fqn: str) -> list[int] | None:
        """``[dim, strided]`` of a parameter tensor parallelism splits (every rank holding it
        splits it alike), or None."""
        splits = {
            (s.dim, s.strided)
            for rp in self.ranks
            if (s := rp.shards.get(fqn)) is not None and s.dim is not None
        }
        if len(splits) > 1:
            raise AutopartError(
                f"internal: the ranks split {fqn} in different ways: {sorted(splits)}",
                hint="this is an autopart bug; please report it",
            )
        return list(splits.pop()) if splits else None

    @classmethod
    def load(cls, path: str | Path, library_ops: Sequence[str] = ()) -> Program:
        """The program saved at ``path``; ``library_ops``: the library namespaces you trust
        it to call (``load_rank``)."""
        root = Path(path)
        head = read_head(root)
        ranks = [load_rank(root, r, library_ops) for r in range(head["world_size"])]
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for r, rp in enumerate(ranks):
            weights = load_weights(root, r, rp)
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
            libraries=dict(head.get("libraries", {})),
        )


MAX_JSON = 1 << 26  # bytes of plan.json or a program.json (64 MiB)
MAX_PT2 = 1 << 30  # bytes of one stage archive (1 GiB; a 70B model's stage is ~50 MB)
_RESAVE = "the file is damaged or from another tool or version; re-save the program"


def _parse(data: bytes, path: Path) -> Any:
    try:
        return parse_json(data)
    except Invalid as exc:
        raise AutopartError(
            f"{path} is not a valid autopart JSON file ({exc.why})",
            hint="the file is damaged or not from Program.save(); re-save the program",
        ) from None


def _head(folder: ProgramFolder) -> tuple[dict[str, Any], Plan]:
    """``plan.json``, checked against its schema, and its ``Plan``."""
    path = folder.root / "plan.json"
    if not folder.exists("plan.json"):
        inner = folder.root / "program"  # autopart demo and train save the program there
        near = not inner.is_symlink() and (inner / "plan.json").is_file()
        raise AutopartError(
            f"{folder.root} holds no plan.json",
            hint=f"did you mean {inner}/? (it holds one)"
            if near
            else "point at a folder written by Program.save()",
        )
    doc = _parse(folder.read("plan.json", MAX_JSON), path)
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt != FORMAT or isinstance(fmt, bool):
        raise AutopartError(
            f"{path} has format {fmt!r}, this autopart reads {FORMAT}",
            hint="re-run parallelize(...).save() with this version",
        )
    try:
        plan = check_head(doc)
    except Invalid as exc:
        raise _layout(path, exc) from None
    return doc, plan


def _layout(path: Path, exc: Invalid) -> AutopartError:
    return AutopartError(
        f"{path} does not have autopart's layout: {exc.where or '(top level)'} {exc.why}",
        hint=_RESAVE,
    )


def plan_digest(head: dict[str, Any]) -> str:
    """The SHA-256 of ``plan.json``'s content but its file list, which every ``program.json``
    records: plan.json holds the other files' checksums and so is covered by none of them;
    this covers it (an edited, damaged or swapped plan.json is refused by every rank)."""
    body = {k: v for k, v in head.items() if k != "files"}
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def read_head(root: str | Path, rank: int = 0) -> dict[str, Any]:
    """``plan.json`` of a program folder, after checking every field of it (types, ranges,
    names, the plan itself) and its digest in ``rank``'s ``program.json`` (a live hand-over's
    folder holds one rank's): an ``AutopartError`` names the file and the field otherwise."""
    with ProgramFolder(root) as folder:
        head, _ = _head(folder)
        rel = f"{rank_dir(rank)}/program.json"
        doc = _parse(_checked(folder, head, rel, MAX_JSON), folder.root / rel)
        _check_digest(doc, head, folder.root, rank)
        return head


def check_ranks(root: str | Path, head: dict[str, Any]) -> None:
    """Before any rank starts (``autopart run``): every rank's ``program.json`` is there, matches
    its checksum and ``head``'s digest, and every file ``head`` lists is a regular file (a
    plan.json of 16 ranks over one rank's files launched 16 ranks, each refusing alone)."""
    with ProgramFolder(root) as folder:
        for rank in range(head["world_size"]):
            rel = f"{rank_dir(rank)}/program.json"
            doc = _parse(_checked(folder, head, rel, MAX_JSON), folder.root / rel)
            _check_digest(doc, head, folder.root, rank)
        for rel in sorted(head["files"]):
            if not folder.regular(rel):
                raise AutopartError(
                    f"{folder.root / rel}, listed in plan.json, is missing or not a regular file",
                    hint="copy the whole program folder, or re-save it with Program.save()",
                )


def _check_digest(doc: Any, head: dict[str, Any], root: Path, rank: int) -> None:
    """Refuse a plan.json that is not the one ``rank``'s program.json (``doc``) was saved with."""
    if not isinstance(doc, dict) or doc.get("plan_digest") != plan_digest(head):
        raise AutopartError(
            f"{root / 'plan.json'} is not the plan.json rank {rank}'s program.json was saved "
            "with (its digest differs): it was edited, damaged, or comes from another program",
            hint="re-save the program with Program.save(); never edit or mix program folders",
        )


def _checked(folder: ProgramFolder, head: dict[str, Any], rel: str, limit: int) -> bytes:
    """The bytes of ``rel``, read once, after checking them against their SHA-256 in
    ``plan.json``. The checksums catch damage and mix-ups; the checks of what the bytes hold
    (schemas, archives) are what stand against a crafted folder."""
    path = folder.root / rel
    want = head["files"].get(rel)
    if want is None:
        raise AutopartError(
            f"{path} is not listed in {folder.root / 'plan.json'}",
            hint="the program folder is incomplete or mixed up; re-save the program",
        )
    data = folder.read(rel, limit, sha256=want)
    if hashlib.sha256(data).hexdigest() != want:
        raise AutopartError(
            f"{path} does not match its checksum in plan.json: it was changed, truncated, or "
            "comes from another program",
            hint="re-save the program with Program.save(); never edit or mix program folders",
        )
    return data


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
    rp: RankProgram,
    folder: ProgramFolder,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    digest: str,
) -> dict[str, str]:
    """Write one rank's files; return their SHA-256 by name. ``digest``: ``plan_digest`` of
    the plan.json they belong to."""
    d = rank_dir(rp.rank)
    files: dict[str, str] = {}
    stages = []
    for st in rp.stages:
        archive = io.BytesIO()  # torch.export.save seeks in what it writes
        torch.export.save(_to_exported(st.graph), archive)
        data = archive.getvalue()
        files[f"{d}/stage{st.stage}.pt2"] = folder.write_bytes(f"{d}/stage{st.stage}.pt2", data)
        code = st.graph.code.encode()
        files[f"{d}/stage{st.stage}.py"] = folder.write_bytes(f"{d}/stage{st.stage}.py", code)
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
        "coords": rp.coords.as_dict(),
        "groups": rp.groups,
        "stages": stages,
        "actions": [a.to_json() for a in rp.actions],
        "shards": {f: asdict(s) for f, s in rp.shards.items()},
        "buckets": rp.buckets,
        "ties": rp.ties,
        "n_stages": rp.n_stages,
        "chunk_cost": rp.chunk_cost,
        "vocab_size": rp.vocab_size,
        "batch": list(rp.batch_names),
        "frozen": list(rp.frozen),
        "plan_digest": digest,
    }
    text = json.dumps(doc, indent=1).encode()
    files[f"{d}/program.json"] = folder.write(f"{d}/program.json", lambda f: f.write(text))
    real = {f: t for f, t in params.items() if t.device.type != "meta" and f in rp.shards}
    if real:
        local = {f: rp.shards[f].local(t.detach()).contiguous().clone() for f, t in real.items()}
        used = {i.name for st in rp.stages for i in st.inputs if i.kind in ("buffer", "constant")}
        local.update(
            {k: v.detach().clone() for k, v in buffers.items() if k in used and v is not None}
        )
        files[f"{d}/weights.pt"] = folder.write(f"{d}/weights.pt", lambda f: torch.save(local, f))
    return dict(sorted(files.items()))


def load_rank(
    root: str | Path,
    rank: int,
    library_ops: Sequence[str] = (),
    head: dict[str, Any] | None = None,
) -> RankProgram:
    """Read one rank's program (graphs, actions, shards) from a saved folder. Every file is
    checked before it is used (module doc); any failure is an ``AutopartError`` naming it.
    ``library_ops``: the library namespaces the caller trusts the program to call (it is
    refused if it calls another; each one it calls is imported and its version checked:
    ``program/libraries.py``). ``head``: the ``read_head`` this rank already read, so that
    ``plan.json`` is read once and every file is checked against that one (a folder swapped
    between two reads gave a rank one program's plan and another's actions: a raw
    ``IndexError``)."""
    # a stage graph need not use every symbol of the model (labels' dims): not worth a warning
    logging.getLogger("torch._export.serde.serialize").setLevel(logging.ERROR)
    with ProgramFolder(root) as folder:
        head, plan = _head(folder) if head is None else (head, Plan.from_json(head["plan"]))
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.mesh.size:
            raise AutopartError(
                f"{folder.root}: the saved program has no rank {rank!r} (its world_size is "
                f"{head['world_size']})",
                hint="launch as many ranks as plan.json's world_size",
            )
        namespaces = libraries.trusted(head.get("libraries", {}), library_ops, folder.root)
        rel = f"{rank_dir(rank)}/program.json"
        doc = _parse(_checked(folder, head, rel, MAX_JSON), folder.root / rel)
        try:
            check_rank(doc, head, plan, rank)
        except Invalid as exc:
            raise _layout(folder.root / rel, exc) from None
        _check_digest(doc, head, folder.root, rank)
        stages = [
            _load_stage(folder, head, rank, st, f"stages[{i}]", namespaces)
            for i, st in enumerate(doc["stages"])
        ]
        _check_buckets(doc, stages, plan.mesh.dp, folder.root / rel)
    return RankProgram(
        rank=doc["rank"],
        coords=Coords(**doc["coords"]),
        groups=doc["groups"],
        stages=stages,
        actions=[Action.from_json(a) for a in doc["actions"]],
        shards={f: Shard(**{**s, "shape": tuple(s["shape"])}) for f, s in doc["shards"].items()},
        buckets=doc["buckets"],
        ties=doc["ties"],
        n_stages=doc["n_stages"],
        chunk_cost=tuple(doc["chunk_cost"]) if doc.get("chunk_cost") else None,
        vocab_size=head["vocab_size"],
        batch_names=tuple(head["batch"]),
        frozen=tuple(f for f in head["frozen"] if f in doc["shards"]),
        model=head.get("model"),
    )


def _check_buckets(
    doc: dict[str, Any], stages: list[StageProgram], dp: int, program_json: Path
) -> None:
    """With dp > 1, the buckets are exactly the parameters the rank's stage graphs read
    (``data_parallel``'s invariant): one left out would not be reduced over the replicas, and
    one no graph reads keeps a gradient of None, as on one device."""
    if dp == 1:
        return
    read = {
        n.meta[META_INPUT].name
        for st in stages
        for n in st.graph.graph.nodes
        if n.op == "placeholder" and n.meta[META_INPUT].kind == "param" and n.users
    }
    bucketed = {f for b in doc["buckets"] for f in b}
    if bucketed != read:
        odd = sorted(read ^ bucketed)[0]
        raise _layout(
            program_json,
            Invalid(
                "buckets",
                f"{'leave out' if odd in read else 'hold'} {odd!r}, which the stage graphs "
                f"{'read' if odd in read else 'never read'} (they must be exactly the "
                "parameters read)",
            ),
        )


def _named_for(placeholder: str, fqn: str) -> bool:
    """Whether a parameter placeholder is named for ``fqn`` as capture names it (torch.export's
    lower-case name with ``_`` for every other character, ``_N`` added where two collide), so
    that a ``program.json`` cannot feed a stage another parameter of the same shape."""
    name = re.sub(r"[^0-9a-z_]", "_", fqn.lower())
    return (
        placeholder == name or re.fullmatch(re.escape(name) + r"_[0-9]+", placeholder) is not None
    )


def _load_stage(
    folder: ProgramFolder,
    head: dict[str, Any],
    rank: int,
    st: dict[str, Any],
    where: str,
    namespaces: Sequence[str],
) -> StageProgram:
    """One stage graph: its archive checked (``archive.check_pt2``) on the bytes torch then
    reads, its call targets checked again, its inputs and K/V shapes matched to the graph."""
    rel = f"{rank_dir(rank)}/{st['file']}"
    pt2 = folder.root / rel
    data = _checked(folder, head, rel, MAX_PT2)
    check_pt2(
        data, pt2, namespaces
    )  # nothing torch would unpickle, evaluate or call beyond known ops
    try:
        ep = torch.export.load(io.BytesIO(data))
        graph = ep.graph_module
    except Exception as exc:  # noqa: BLE001 - whatever torch says, name the file
        raise AutopartError(
            f"{pt2} is not a loadable torch.export program: {type(exc).__name__}",
            hint="re-save the program with this autopart and torch version",
        ) from exc
    check_targets(graph, pt2, namespaces)
    program_json = folder.root / rank_dir(rank) / "program.json"
    inputs = [InputRef(k, n) for k, n in st["inputs"]]
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise _layout(
            program_json,
            Invalid(
                f"{where}.inputs",
                f"lists {len(inputs)} inputs for {len(placeholders)} placeholders of {st['file']}",
            ),
        )
    for j, (node, ref) in enumerate(zip(placeholders, inputs, strict=True)):
        if ref.kind == "param" and not _named_for(node.name, ref.name):
            raise _layout(
                program_json,
                Invalid(
                    f"{where}.inputs[{j}]",
                    f"names parameter {ref.name!r}, but placeholder {node.name} of {st['file']} "
                    "is another parameter's",
                ),
            )
    kv = [n for n, ref in zip(placeholders, inputs, strict=True) if ref.kind == "kv"]
    for j, (node, shape) in enumerate(zip(kv, st["kv_shapes"], strict=True)):
        if not _kv_matches(node, shape):
            raise _layout(
                program_json,
                Invalid(
                    f"{where}.kv_shapes[{j}]",
                    f"= {shape} is not the shape of {node.name} in {st['file']}",
                ),
            )
    graph.meta[META_PASSES] = st["passes"]
    graph.meta[META_KV_SHAPES] = st["kv_shapes"]
    graph.meta[META_RANGES] = dict(ep.range_constraints)  # so that a loaded program saves again
    for n in graph.graph.nodes:
        custom = n.meta.get("custom") or {}
        n.meta[META_MODULE], n.meta[META_LAYER] = (
            custom.get(META_MODULE, ""),
            custom.get(META_LAYER),
        )
        if custom.get(META_RECOMPUTE) is not None:
            n.meta[META_RECOMPUTE] = int(custom[META_RECOMPUTE])
    for n, ref in zip(placeholders, inputs, strict=True):
        n.meta[META_INPUT] = ref
        if ref.kind == "param":
            n.meta[META_MODULE] = ref.name.rpartition(".")[0]
            n.meta[META_LAYER] = layer_of(ref.name)
    return StageProgram(st["stage"], graph, inputs)


def _kv_matches(node: fx.Node, shape: list[int | str]) -> bool:
    """A K/V prefix placeholder's shape is the declared one: symbolic where it says "b" (the
    batch) or 0 (the prefix length), those numbers elsewhere."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != len(shape):
        return False
    for want, got in zip(shape, val.shape, strict=True):
        symbolic = isinstance(got, torch.SymInt)
        if (want in ("b", 0)) != symbolic or (not symbolic and got != want):
            return False
    return True


def _expected_weights(
    program: RankProgram, head: dict[str, Any], path: Path
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor this rank's ``weights.pt`` may hold: its parameter shards (shape from the
    ``Shard``, dtype from plan.json) and the buffers its stages read (shape and dtype of their
    placeholders)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for fqn, shard in program.shards.items():
        meta = head["params"].get(fqn)
        if meta is None:
            raise AutopartError(f"{path}: {fqn} is not a parameter of plan.json", hint=_RESAVE)
        try:
            local = shard.local(torch.empty(shard.shape, device="meta"))
        except (IndexError, RuntimeError, ValueError) as exc:
            raise AutopartError(
                f"{path}: the shard of {fqn} does not cut its shape {list(shard.shape)} "
                f"({type(exc).__name__})",
                hint=_RESAVE,
            ) from None
        out[fqn] = (tuple(local.shape), _DTYPES[meta["dtype"]])
    for st in program.stages:
        nodes = [n for n in st.graph.graph.nodes if n.op == "placeholder"]
        for node, ref in zip(nodes, st.inputs, strict=True):
            if ref.kind not in ("buffer", "constant"):
                continue
            val = node.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
            if shape is None or not all(type(d) is int for d in shape):
                raise AutopartError(
                    f"{path}: the buffer {ref.name} has no fixed shape in stage {st.stage}",
                    hint=_RESAVE,
                )
            if out.setdefault(ref.name, (shape, val.dtype)) != (shape, val.dtype):
                raise AutopartError(
                    f"{path}: the stages disagree on the shape of buffer {ref.name}", hint=_RESAVE
                )
    return out


def load_weights(
    root: str | Path,
    rank: int,
    program: RankProgram | None = None,
    head: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's saved parameter shards and buffers (empty if the model was on meta).

    ``program`` is the rank's ``load_rank`` result (read again when not given): the file may
    hold only its parameter shards and buffers, of their shapes and dtypes, so its size is
    bounded before it is read and its contents after (``archive.check_weights``). ``head``:
    the ``plan.json`` already read (``load_rank``'s)."""
    with ProgramFolder(root) as folder:
        if head is None:
            head, _ = _head(folder)
        rel = f"{rank_dir(rank)}/weights.pt"
        if rel not in head["files"]:
            return {}
        path = folder.root / rel
        if program is None:
            program = load_rank(root, rank, head=head)
        if program.rank != rank:
            raise AutopartError(
                f"load_weights: the program given is rank {program.rank}, not {rank}"
            )
        expected = _expected_weights(program, head, path)
        nbytes = sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in expected.values()
        )
        data = _checked(folder, head, rel, nbytes + (1 << 20) + 2048 * len(expected))
    check_weights(data, path, nbytes, len(expected))
    try:
        weights = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - whatever torch says, name the file
        raise AutopartError(
            f"{path} is not a loadable weights file: {type(exc).__name__}", hint=_RESAVE
        ) from exc
    del data
    if not isinstance(weights, dict):
        raise AutopartError(f"{path} holds a {type(weights).__name__}, not a dict", hint=_RESAVE)
    for name, t in weights.items():
        want = expected.get(name) if isinstance(name, str) else None
        if want is None:
            raise AutopartError(
                f"{path} holds {str(name)[:80]!r}, which is no parameter shard or buffer of "
                f"rank {rank}",
                hint=_RESAVE,
            )
        if not isinstance(t, torch.Tensor) or (tuple(t.shape), t.dtype) != want:
            got = (list(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise AutopartError(
                f"{path}: {name} is {got}, but the program needs {list(want[0])} {want[1]}",
                hint=_RESAVE,
            )
    _check_own_storage(weights, path)
    # plain tensors: what trains (plan.json's frozen list) and anything else about a parameter
    # is the program's to say, not the file's (an nn.Parameter saved with requires_grad=False
    # froze it, silently; attributes set on it came along)
    return {name: torch.Tensor(t.detach()) for name, t in weights.items()}


def _check_own_storage(weights: dict[str, torch.Tensor], path: Path) -> None:
    """Every tensor of a ``weights.pt`` in a storage of its own, exactly its size, its
    elements distinct: ``Program.save`` writes clones. Two entries sharing bytes (or views into
    one larger storage) would train as one tied tensor that the program does not declare."""
    owners: dict[int, str] = {}
    for name, t in weights.items():
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() in owners:
            raise AutopartError(
                f"{path}: {name} and {owners[storage.data_ptr()]} share one storage (training "
                "would tie them, which the program does not declare); they were not loaded",
                hint=_RESAVE + " (it saves each tensor in its own storage)",
            )
        owners[storage.data_ptr()] = name
        need = t.numel() * t.element_size()
        if (
            t.storage_offset()
            or storage.nbytes() != need
            or (t.numel() and not torch.ops.aten.is_non_overlapping_and_dense(t))
        ):
            raise AutopartError(
                f"{path}: {name} is a view (offset {t.storage_offset()}, strides "
                f"{list(t.stride())}) into a storage of {storage.nbytes():,} bytes, not a tensor "
                f"of its own {need:,} bytes; it was not loaded",
                hint=_RESAVE + " (it saves each tensor in its own storage)",
            )
