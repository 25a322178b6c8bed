"""The runtime: one ``Runner`` per rank interprets its ``RankProgram``'s actions.

``step(input_ids, labels)`` takes the **global** batch (the same tensors on every rank, as
from a shared seed or data loader), keeps this rank's data-parallel slice, cuts it into the
plan's micro-batches, runs the actions (forward, backward, gradient reduction) and returns the
loss of the whole global batch: summed cross entropy divided by the global count of labels that
are not -100. Gradients land on ``parameters()`` (local shards), summed over data-parallel ranks,
so they equal the single-device gradients of that mean loss; any gradient already there before
the step is kept and added to.

Data-parallel reduction: buckets (from the data_parallel pass) are flattened and all-reduced
asynchronously, launched in bucket order as soon as the last micro-batch's backward has produced
every gradient of the bucket, and awaited at ``DP_REDUCE``. Every wait has a timeout whose error
names the rank, the action and the group.
"""

from __future__ import annotations

import contextlib
import operator
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autopart import collectives
from autopart.errors import AutopartError, NotAModuleError, first_line, wait
from autopart.frontend.capture import check_extra, label_layout
from autopart.graph import copy_graph, kv_dtypes
from autopart.layout import Plan
from autopart.meta import META_INPUT, META_KV_SHAPES
from autopart.program.feeds import chunk_feeds, stage_inputs
from autopart.program.format import Program, RankProgram
from autopart.runtime import flex, norms, p2p, staging, state
from autopart.runtime.comm import Comm
from autopart.runtime.copies import check_copies
from autopart.runtime.guards import (
    Logits,
    RankSlice,
    StepLoss,
    check_frozen,
    check_grad_hooks,
    check_hooks,
    check_layout,
    check_step_context,
    check_untouched,
    follow_module,
    guard_optimizer_state,
    guard_optimizers,
    mark_sharded,
    module_hooks,
    module_layout,
    original_state_dict,
    sharded_reason,
)
from autopart.runtime.meet import Meeting
from autopart.runtime.placement import backend_for, device_checked, pick_device, place
from autopart.runtime.recompute import checkpointed
from autopart.runtime.timeline import TraceEvent, chrome_event
from autopart.schedule.chunks import chunk_bounds, fit_coefficients, windows_of
from autopart.schedule.ir import Action

COMPILE_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "autopart" / "inductor"
)


class SavedBytes:
    """Bytes of tensors autograd saves for backward, per live (stage, micro-batch, chunk), counted
    with ``saved_tensors_hooks`` (a checkpointed recomputation region's inputs are among them:
    checkpointing saves them through an autograd function); parameters and buffers (and views
    starting where they do) are not activations and are left out. ``peak`` is the most held
    at once."""

    def __init__(self) -> None:
        self.live: dict[tuple[int, int, int], int] = {}
        self.peak = 0
        self._params: set[int] = set()

    def watch(self, unit: tuple[int, int, int]):
        def pack(t: torch.Tensor) -> torch.Tensor:
            self._count(unit, t)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def _count(self, unit: tuple[int, int, int], t: torch.Tensor) -> None:
        if not isinstance(t, torch.nn.Parameter) and t.data_ptr() not in self._params:
            self.live[unit] = self.live.get(unit, 0) + t.numel() * t.element_size()
            self.peak = max(self.peak, sum(self.live.values()))

    def release(self, unit: Any) -> None:
        self.live.pop(unit, None)

    def hold(self, key: Any, nbytes: int) -> None:
        """``nbytes`` more held under ``key`` until ``release(key)`` (a split backward's
        deferred weight-gradient inputs, from B to W)."""
        self.live[key] = self.live.get(key, 0) + nbytes
        self.peak = max(self.peak, sum(self.live.values()))

    def reset(self, params: Sequence[torch.Tensor]) -> None:
        """A new step; ``params``: the parameters and buffers, never counted."""
        self.live, self.peak = {}, 0
        self._params = {p.data_ptr() for p in params}


def init_distributed(timeout_s: float = 300.0, backend: str = "gloo") -> tuple[int, int]:
    """Join the torchrun job (``backend``: NCCL for CUDA ranks, gloo otherwise, see
    ``placement.backend_for``); returns (rank, world size)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise AutopartError(
                "no distributed job found (RANK is not set)",
                hint="launch with torchrun --nproc-per-node N ..., or use autopart verify",
            )
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def join_torchrun(timeout_s: float, backend: str = "gloo") -> tuple[int, int]:
    """``init_distributed``, but a job torchrun restarted (``--max-restarts``) keeps its keys
    apart from the failed attempt's: torchrun's workers share the agent's store across attempts,
    where gloo could find a dead rank's address (pytorch/pytorch#135712)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if attempt != "0" and shared and not dist.is_initialized():
        env = os.environ
        world = int(env["WORLD_SIZE"])
        store = dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"autopart/attempt{attempt}", store),
            rank=int(env["RANK"]),
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    return init_distributed(timeout_s, backend)


def local_weights(program: Program, rp: RankProgram) -> dict[str, torch.Tensor]:
    """A rank's parameter shards and the buffers, cut from an in-memory ``Program``."""
    weights = {f: rp.shards[f].local(t) for f, t in program.params.items() if f in rp.shards}
    weights.update(program.buffers)
    return weights


def make_groups(plan: Plan, rank: int, ties: dict[str, list[int]] | None = None) -> dict[Any, Any]:
    """Create every process group of the mesh, and one per set of pipeline ranks sharing a tied
    parameter. Every rank must call it, in the same order, with the ties of the *whole*
    pipeline (``Program.pipeline_ties``, ``plan.json``'s ``ties``): a middle stage that holds
    no tied parameter creates the tie groups all the same, or the ranks' group creations stop
    pairing up and every rank hangs at the next one."""
    mesh = plan.mesh
    mine: dict[Any, Any] = {}  # "dp" / "pp" / "tp" → group, ("tie", pipeline ranks) → group
    for dim in ("dp", "pp", "tp"):
        for ranks in mesh.groups(dim):
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[dim] = group
    for pps in sorted({tuple(v) for v in (ties or {}).values()}):
        for dp_i in range(mesh.dp):
            for tp_i in range(mesh.tp):
                ranks = [mesh.rank_of(pp=j, dp=dp_i, tp=tp_i) for j in pps]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[("tie", pps)] = group
    return mine


MEASURE_STEPS = 3  # seq_split="measured": steps whose chunk times refit the boundaries


@dataclass
class RunnerStats:
    """``Runner.stats``, counted per step (reset at each): gradient buckets, how many were
    launched while the backward ran, weight-gradient GEMMs the W actions ran and, of those,
    the ones run while a receive had not arrived (zero-bubble schedules)."""

    buckets: int
    launched_during_backward: int = 0
    deferred_gemms: int = 0
    filled_gemms: int = 0


@dataclass
class _Step:
    """What one ``Runner.step`` works on, made fresh for each step (nothing of it outlives it)."""

    mbs: list[dict[str, torch.Tensor]]  # this rank's micro-batches, by batch tensor name
    count: torch.Tensor  # labels ≠ −100 in the global batch
    bounds: list[tuple[int, int]]  # [start, end) of each sequence chunk
    arm_at: dict[int, list[tuple[int, nn.Parameter]]]  # action index → buckets to arm
    recvs: list[tuple[int, Action]]  # the receives, for prefetching the next one
    live: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    losses: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    kv: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # next prefix
    kv_grads: dict[tuple[int, int, int], list[torch.Tensor]] = field(default_factory=dict)
    ready: list[set[int]] = field(default_factory=list)  # per bucket: parameters final
    pending: list[tuple[int, torch.Tensor, Any]] = field(default_factory=list)  # all-reduces
    next_bucket: int = 0  # the first bucket not yet launched
    seed: torch.Tensor | None = None  # the running forward's dropout seed
    # seq_split="measured": this rank's forward seconds per chunk (None: not measuring)
    chunk_time: list[float] | None = None


_CASTS = (
    torch.ops.aten._to_copy.default,
    torch.ops.aten.to.dtype,
    torch.ops.prims.convert_element_type.default,
)


def _tp_partial_params(program: RankProgram) -> list[str]:
    """FQNs of the parameters that reach a ``tp_all_reduce_grad`` (directly or through a dtype
    cast) in this rank's stage graphs, sorted (every tp rank the same). Empty, so nothing is
    deferred, if any ``tp_all_reduce_grad`` reads something else: its gradient must be reduced
    where it is."""
    op = torch.ops.autopart.tp_all_reduce_grad.default
    out: set[str] = set()
    for st in program.stages:
        for n in st.graph.graph.nodes:
            if n.op != "call_function" or n.target != op:
                continue
            src = n.args[0]
            while src.op == "call_function" and src.target in _CASTS:
                src = src.args[0]
            ref = src.meta.get(META_INPUT) if src.op == "placeholder" else None
            if ref is None or ref.kind != "param":
                return []
            out.add(ref.name)
    return sorted(out)


class Runner:
    """Executes one rank's program; holds its parameter shards and gradient buckets."""

    def __init__(
        self,
        program: RankProgram,
        plan: Plan,
        weights: dict[str, torch.Tensor],
        groups: dict[Any, Any],
        *,
        timeout_s: float = 300.0,
        seed: int = 0,
        compile: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        self.program, self.plan, self.groups, self.timeout_s = program, plan, groups, timeout_s
        # a zero-bubble schedule: B defers the weight gradients to the unit's W
        self._split = any(a.kind == "W" for a in program.actions)
        # where this rank computes (placement.pick_device); "meta" is the dry run: no data
        self.device = pick_device(device)
        self.dry = self.device.type == "meta"
        self.rank = program.rank
        # every collective call meets the other ranks at the store first (runtime/meet.py)
        self._meeting = None if self.dry else Meeting.of_job("runner", timeout_s)
        if plan.attention == "flex" and not self.dry:  # before any step: a device torch refuses
            flex.check_supported(self.device, self.rank)
        self.seed, self.steps = (
            seed,
            0,
        )  # dropout masks: a function of (seed, step, micro-batch, dp rank)
        missing = [f for f in program.shards if f not in weights]
        if missing:
            raise AutopartError(
                f"rank {self.rank}: no weights for {len(missing)} parameters (e.g. {missing[0]})",
                hint="save the program from a model with real (not meta) weights",
            )
        self.params: dict[str, nn.Parameter] = {}
        for fqn in program.shards:
            t = weights[fqn]
            if isinstance(t, nn.Parameter) and t.device == self.device:
                self.params[fqn] = t
            else:  # a frozen parameter of the model stays frozen (a loaded one: the program says)
                frozen = fqn in program.frozen or (
                    isinstance(t, nn.Parameter) and not t.requires_grad
                )
                self.params[fqn] = nn.Parameter(t.detach().to(self.device), not frozen)
        # precision="bf16": parameters (masters) enter the graph cast, inside autograd, so their
        # gradients come back, and add up over micro-batches, in the masters' dtype
        self._compute = plan.compute_dtype
        self.buffers = {k: v.to(self.device) for k, v in weights.items() if k not in program.shards}
        # a frozen parameter (no gradient: ERNIE 4.5's routing-score bias) has nothing to reduce
        self._buckets = [
            [self.params[f] for f in b if self.params[f].requires_grad] for b in program.buckets
        ]
        # parameters whose gradient is a tp rank's partial (sequence-parallel norms, position
        # tables: tp_all_reduce_grad): all-reduced once per step, after the backwards
        self._tp_partial = _tp_partial_params(program) if groups.get("tp") is not None else []
        self.n_stages = program.n_stages
        # the model's names: tied alias → canonical FQN, and (live API) its state-dict keys
        self.tied: dict[str, str] = {}
        self.state_keys: list[str] | None = None
        # how ``step`` reads labels when not told: "shifted" (autopart's), or "hf" (Hugging
        # Face causal LMs: unshifted, shifted inside; the live API sets it from the model)
        self.label_convention = "shifted"
        # the live API's model (``follow``): its train/eval mode is the runner's
        self._model: weakref.ref[nn.Module] | None = None
        self._module_frozen: frozenset[str] = frozenset()  # its frozen parameters then
        # whether the runner's weights moved away from the module's since they were last the
        # same (``moved``): an optimizer stepped, or a parameter's version counter
        self._moved = False
        self._warned_sum = False  # step warned that gradients of several steps add up
        self._copies: list[nn.Parameter] = []  # those of this rank's parameters not the module's
        self._versions: list[int] = []
        # the module's parameters the runner does not train itself, and their version counters
        # when the two last agreed: a change in place to one is refused (``guards.check_untouched``)
        self._module_params: list[tuple[str, nn.Parameter]] = []
        self._module_layout: list[tuple[str, int, torch.dtype]] = []
        self._module_hooks: list[tuple[str, int, int]] = []
        self._module_versions: list[int] = []
        # torch's norm clipping over parameters() is refused where it would be wrong (tp, pp),
        # and clip_grads_with_norm_ takes only a whole-model norm grad_norm gave since the step
        self.global_norms: list[float] = []  # cleared in place at every step
        reason = sharded_reason(plan.mesh.tp, plan.mesh.pp)
        mark_sharded(self, list(self.params.values()), reason, self.global_norms)
        self._unsynced: str | None = None  # inside no_sync(): dp reduction skipped
        self._logits_run: dict[bool, dict[int, Any]] = {}  # logits(): by mode, on first use
        self._carried = False  # gradients of no_sync() steps are on the parameters
        self._ties = [(f, groups[("tie", tuple(pps))]) for f, pps in sorted(program.ties.items())]
        # set to [] to record each step's actions as TraceEvents; keeps the last step
        self.timeline: list[TraceEvent] | None = None
        self._saved = SavedBytes()
        self._s: _Step | None = None  # the running step's state (None between steps): _step
        # Seq1F1B: each stage's empty first-chunk K/V prefix shapes ("b": the micro-batch size)
        self._kv_shapes = {st.stage: st.graph.meta.get(META_KV_SHAPES, []) for st in program.stages}
        # seq_split="measured": chunk-cost coefficients fitted to measured forward times
        self.chunk_cost = program.chunk_cost
        self._bounds: dict[int, list[tuple[int, int]]] = {}  # sequence length → chunk bounds
        self._n_kv = {stage: len(v) for stage, v in self._kv_shapes.items()}
        self._kv_dtypes = {st.stage: kv_dtypes(st.graph) for st in program.stages}
        # compile=True: each stage graph through torch.compile (Inductor; collectives stay graph
        # nodes). Sequence chunks differ in length, so Seq1F1B compiles with dynamic shapes.
        if compile:  # a persistent cache: a second run reuses the first one's kernels
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(COMPILE_CACHE))
        self._compile = compile
        # attention="flex": per stage, the attention nodes lowered to FlexAttention and the ones
        # left as they are, with why (runtime/flex.py)
        self.attention_lowered: dict[int, flex.Lowered] = {}
        self._run = self._runs({st.stage: st.graph for st in program.stages})
        self._train_run = self._run
        self._eval_run: dict[int, Any] | None = None  # eval(): graphs without dropout
        self.training = True
        self._p2p = p2p.Channel(
            self.rank,
            timeout_s,
            p2p.Tags(program.n_stages, plan.microbatches, plan.seq_chunks),
            self.device,
        )
        if self._split and not self.dry:  # a receive not yet arrived runs deferred W work
            self._p2p.filler = self._fill
        self._tp_group = groups.get("tp")
        # this runner's runtime context: its groups, actions and timeouts, transports and
        # deferred weight gradients; active whenever it runs (``_activate``)
        self.comm = Comm({"tp": self._tp_group}, timeout_s)
        self.comm.set_action("(setup)")
        # a step whose global loss is NaN or ±inf raises instead of returning it (all ranks
        # alike: the loss is reduced first), so no optimizer steps on its gradients
        self.stop_on_nonfinite = True
        # every step compares its batch over the ranks that must pass the same rows
        # (_check_same_batch); False skips the check (a few small all-reduces a step)
        self.check_batches = True
        if not self.dry and dist.is_initialized():  # every copy of a parameter starts equal
            check_copies(
                self.params,
                {f for f, sh in program.shards.items() if sh.dim is None},
                groups,
                self._ties,
                program.groups,
                timeout_s,
            )
        # per step: buckets reduced, and how many of them were launched while backward ran
        self.stats = RunnerStats(buckets=len(self._buckets))

    @classmethod
    def from_program(
        cls,
        program: Program,
        mesh: Any = None,
        *,
        timeout_s: float = 300.0,
        compile: bool = False,
        device: torch.device | str | None = None,
    ) -> Runner:
        """The local rank's runner of a compiled program (joins the distributed job)."""
        rank, world = init_distributed(timeout_s, backend_for(pick_device(device)))
        program.mesh.check_world(world)
        rp = program.rank(rank)
        head = {"ties": program.pipeline_ties, "tied": program.tied}
        return cls.from_rank(
            rp,
            program.plan,
            local_weights(program, rp),
            head,
            mesh,
            timeout_s=timeout_s,
            compile=compile,
            device=device,
        )

    @classmethod
    def from_rank(
        cls,
        rp: RankProgram,
        plan: Plan,
        weights: dict[str, torch.Tensor],
        head: dict[str, Any],
        mesh: Any = None,
        *,
        timeout_s: float = 300.0,
        compile: bool = False,
        device: torch.device | str | None = None,
    ) -> Runner:
        """The runner of one rank's program, its weights and ``head`` (plan.json's ``ties``, the
        whole pipeline's, and ``tied``): a folder's (``load_rank``, ``load_weights``,
        ``read_head``: the live API's ranks after the hand-over from rank 0) or a ``Program``'s
        (``from_program``)."""
        device = pick_device(device)
        rank, world = init_distributed(timeout_s, backend_for(device))
        plan.mesh.check_world(world)
        if rank != rp.rank:
            raise AutopartError(f"rank {rank} was handed rank {rp.rank}'s program")
        groups = _groups_of(plan, rank, mesh, head.get("ties", rp.ties))
        runner = cls(rp, plan, weights, groups, timeout_s=timeout_s, compile=compile, device=device)
        runner.tied = dict(head["tied"])
        return runner

    # -- what users call -------------------------------------------------------------------

    @property
    def peak_saved_bytes(self) -> int:
        """Most bytes autograd held for backward at once during the last step (this rank)."""
        return self._saved.peak

    def chrome_trace(self, pid: int | None = None) -> list[dict[str, Any]]:
        """The recorded ``timeline`` as Chrome/Perfetto trace events (one row per rank)."""
        pid = self.rank if pid is None else pid
        return [chrome_event(ev.action, ev.start, ev.end, pid) for ev in self.timeline or []]

    def busy_fraction(self) -> float:
        """Share of the last recorded step this rank spent in forward and backward compute
        (F, B and a zero-bubble schedule's W)."""
        if not self.timeline:
            return 0.0
        span = max(ev.end for ev in self.timeline) - min(ev.start for ev in self.timeline)
        busy = sum(ev.dur for ev in self.timeline if ev.action.kind in ("F", "B", "W"))
        return busy / span if span > 0 else 0.0

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameter shards, for a torch optimizer (under tp, one that updates
        entry by entry: ``guards.check_elementwise``). Under tp or pp,
        ``torch.nn.utils.clip_grad_norm_`` over them is refused (each rank would clip by its
        own shards' norm): ``clip_grad_norm_`` is the global one (``runtime/guards.py``)."""
        return iter(list(self.params.values()))

    def follow(self, model: nn.Module) -> None:
        """The module this runner was made from (the live API's ``parallelize``): the runner
        takes its train/eval mode at every call, and ``train()`` / ``eval()`` set it too, as
        with a DDP-wrapped module; an optimizer stepping over the module's own parameters
        (which never get a gradient here) is refused."""
        self._model = weakref.ref(model)
        own = {id(p) for p in model.parameters()}
        self._module_frozen = frozenset(
            name for name, p in model.named_parameters() if not p.requires_grad
        )
        # (a one-rank program's whole parameters may be the module's own objects: those never
        # leave the module behind)
        self._copies = [p for p in self.params.values() if id(p) not in own]
        self.mark_module()
        guard_optimizers(self, model)
        guard_optimizer_state(self)
        follow_module(self, model)

    def moved(self) -> bool:
        """Have this rank's copies of the module's weights changed since they were the module's
        (an optimizer step over them, a load, an in-place change), so that it is behind?"""
        return self._moved or [p._version for p in self._copies] != self._versions

    def mark_current(self) -> None:
        """The module and the runner hold the same weights (``follow``, ``copy_to``)."""
        self._moved = False
        self._versions = [p._version for p in self._copies]

    def mark_module(self) -> None:
        """The module's own parameters hold what the runner was given (``follow``, a load
        through the module): a later change to one in place, a parameter replaced (an untied
        head) or cast (``model.half()``) is refused at the next call."""
        model = self._followed()
        if model is not None:
            mine = {id(p) for p in self.params.values()}
            self._module_params = [(n, p) for n, p in model.named_parameters() if id(p) not in mine]
            self._module_layout = module_layout(model)
            self._module_hooks = module_hooks(model)
        self._module_versions = [p._version for _, p in self._module_params]

    def mark_moved(self) -> None:
        """The runner's weights changed in a way no version counter shows (a load, a fused
        optimizer)."""
        self._moved = bool(self._copies)

    def optimizer_stepped(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer stepped (``guards.guard_optimizer_state``'s hook): over any of this rank's
        copies, the module is behind (a fused optimizer changes no version counter)."""
        mine = {id(p) for p in self._copies}
        if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
            self._moved = True

    def _followed(self) -> nn.Module | None:
        """The module this runner follows (``follow``), while it lives."""
        return self._model() if self._model is not None else None

    def _begin(self, call: str, *, needs_grad: bool) -> None:
        """Before ``step`` / ``evaluate`` / ``logits``: refuse the contexts they cannot run in
        (``guards.check_step_context``), and take the followed module's mode if it was switched
        since (``model.eval()``)."""
        check_step_context(call, self.device, needs_grad=needs_grad)
        model = self._followed()
        if model is not None:
            check_untouched(self._module_params, self._module_versions, call)
            check_layout(model, self._module_layout, call)
            check_hooks(model, self._module_hooks, call)
        if needs_grad:
            check_grad_hooks(self.params, self.plan, call)
        if model is not None and needs_grad:
            check_frozen(model, self._module_frozen)
        if model is not None and model.training != self.training:
            self.train(model.training)

    def _meet(self, action: str) -> None:
        """Wait for every rank to come to this collective call (``runtime/meet.py``): a rank
        in another call, or one that does not come within ``timeout_s``, is named."""
        if self._meeting is not None:
            if not dist.is_initialized():
                raise AutopartError(
                    f"rank {self.rank}: runner.{action} after the process group was destroyed: "
                    "this runner's collectives have no group left",
                    hint="call destroy_process_group() after the last collective call (the "
                    "end of training); a runner made before it cannot be used after it",
                )
            self._meeting.timeout_s = self.timeout_s
            self._meeting(action)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(global FQN, local shard) pairs."""
        return iter(self.params.items())

    def check_reduced(self, what: str) -> None:
        """Refuse ``what`` (reading or applying the gradients) while the gradients of steps
        inside ``no_sync()`` are on the parameters, not yet reduced over dp: each replica would
        use its own (its norm and its update differ from the others')."""
        if (
            self._carried
            and self.plan.mesh.dp > 1
            and any(p.grad is not None for p in self.params.values())
        ):
            raise AutopartError(
                f"rank {self.rank}: {what} on gradients of steps inside runner.no_sync(), not "
                "reduced over the dp replicas yet: each replica would use its own, and the "
                "replicas' weights would drift apart",
                hint="take the last step of an accumulation outside no_sync(): it reduces the "
                "summed gradients once",
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``: this rank's gradients set to None (or to zeros)."""
        self._carried = False  # nothing left to reduce
        for p in self.params.values():
            if p.grad is not None and set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AutopartError(
            "a Runner is not called like the model: runner.step(input_ids, labels) runs the "
            "forward and the backward together and returns the loss (no loss.backward())",
            hint="loss = runner.step(input_ids, labels); runner.evaluate(...) for a loss "
            "without gradients; runner.logits(input_ids) for the logits",
        )

    def __getattr__(self, name: str) -> Any:
        """Reached only for a name the runner lacks. An ``nn.Module`` attribute is named as such
        (torch's ``get_state_dict(runner, optimizer)`` and Hugging Face's
        ``get_parameter_names(runner, ...)`` read ``named_children``; they raised a bare
        ``AttributeError``): the runner is not a module, and the message says what to use."""
        if name.startswith("__") or not hasattr(nn.Module, name):
            raise AttributeError(f"'Runner' object has no attribute {name!r}")
        raise NotAModuleError(
            f"a Runner is not an nn.Module: it has no {name} (it runs this rank's compiled "
            "stages of the model; the model's modules are the module's own)",
            hint="parameters by the model's names: runner.named_parameters(); the whole "
            "model's state: runner.full_state_dict() (and autopart.checkpoint for sharded "
            "checkpoints, instead of torch.distributed.checkpoint.state_dict); the modules "
            "(to choose parameters by module type): model.named_modules() of the model "
            "parallelize was given, whose parameter names runner.named_parameters() keeps",
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: a runner holds this rank's process groups, shards and compiled graphs, which
        neither ``copy.deepcopy`` (``AveragedModel(runner)``) nor a pickle can carry."""
        raise AutopartError(
            "a Runner cannot be copied or pickled (copy.deepcopy, AveragedModel(runner), "
            "torch.save(runner)): it holds this rank's process groups and shards",
            hint="copy its weights instead: runner.full_state_dict() (a collective) or this "
            "rank's runner.state_dict(); for an average of the weights (EMA, SWA), keep one of "
            "runner.parameters() in tensors of your own, updated after each optimizer step",
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, keyed by the model's global FQNs: its tp slices
        and its stages only, so not the whole model unless tp = pp = 1 (rank 0's is not the
        model's, as it is under DDP). The whole model: ``full_state_dict()``; sharded
        checkpoints: ``autopart.checkpoint``. A tp slice is a ``guards.RankSlice``: a plain
        tensor that ``torch.distributed.checkpoint`` refuses (it would save one rank's slice as
        every rank's)."""
        sharded = {f for f, s in self.program.shards.items() if s.dim is not None and s.parts > 1}
        return {
            **{f: RankSlice.of(p) if f in sharded else p.detach() for f, p in self.params.items()},
            **self.buffers,
        }

    def _activate(self) -> None:
        """Make this runner's context the one the graph's collectives use (another runner in
        this process may have run since)."""
        collectives.activate(self.comm)

    def train(self, mode: bool = True) -> Runner:
        """Training mode (the default): dropout on. ``train(False)`` is ``eval()``."""
        self.training = mode
        model = self._followed()
        if model is not None and model.training != mode:
            model.train(mode)
        if mode:
            self._run = self._train_run
        else:
            if self._eval_run is None:  # built on first use
                self._eval_run = self._runs(
                    {st.stage: without_dropout(st.graph) for st in self.program.stages}
                )
            self._run = self._eval_run
        return self

    def eval(self) -> Runner:
        """Evaluation mode: every dropout of the model off (``step`` and ``evaluate`` run
        stage graphs with their dropout taken out), as ``nn.Module.eval()``."""
        return self.train(False)

    def evaluate(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        shifted: bool | None = None,
        num_tokens: int | None = None,
        local: bool = False,
        **extra: Any,
    ) -> torch.Tensor:
        """The global mean loss of a batch, forward only: no gradient is computed or touched,
        and no activation is kept for a backward. Dropout follows the mode (call ``eval()``
        first, as with a torch module). The batch, ``shifted``, ``num_tokens`` and ``local``
        as for ``step``. Collective: call it on every rank."""
        self._begin("evaluate", needs_grad=False)
        labels = self._batch_args("evaluate", input_ids, labels, extra)
        num_tokens = self._whole_tokens(num_tokens)
        self._activate()
        labels = self._shift(input_ids, labels, shifted)
        fields = self._fields(input_ids, labels, attention_mask, position_ids)
        self._check_same_batch("evaluate", fields, local, num_tokens)
        fields, _ = self._pad_rows(fields, local)
        fields, _ = self._pad_length(fields)
        mbs = self._microbatches(fields, local)
        self._p2p.reset()
        actions = [a for a in self.program.actions if a.kind in ("F", "SEND_F", "RECV_F")]
        s = self._s = _Step(
            mbs=mbs,
            count=self._count(labels, num_tokens, local),
            bounds=self._chunk_bounds(fields["input_ids"].shape[1]),
            arm_at={},
            recvs=[(i, a) for i, a in enumerate(actions) if a.kind == "RECV_F"],
        )
        try:
            with torch.no_grad():
                for i, action in enumerate(actions):
                    self.comm.set_action(f"{action} (evaluate) on rank {self.rank}")
                    self._act(i, action)
                self._p2p.wait_sends()
            losses = s.losses
        finally:
            self._s = None
        loss = (
            torch.stack(list(losses.values())).sum()
            if losses
            else torch.zeros((), dtype=self._dtype, device=self.device)
        )
        return self._reduce_loss(loss)

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        local: bool = False,
        **extra: Any,
    ) -> torch.Tensor:
        """The model's full-vocabulary logits ``(batch, seq, vocab)`` for ``input_ids`` (the
        global batch, or with ``local=True`` this rank's dp share), on every rank, as the
        model would return them: for sampling, or any use beyond the loss. ``attention_mask``
        and ``position_ids`` as for ``step`` (exactly those the program was captured with).
        Forward only; dropout follows the mode (``eval()`` first). Collective: call it on
        every rank. A batch's ``labels`` (``runner.logits(**batch)``) are ignored."""
        self._begin("logits", needs_grad=False)
        extra.pop("labels", None)
        self._batch_args("logits", input_ids, None, extra)
        key = self.training
        if key not in self._logits_run:  # the loss cut off each last stage, once per mode
            self._logits_run[key] = self._runs(
                {
                    st.stage: logits_graph(st.graph if self.training else without_dropout(st.graph))
                    for st in self.program.stages
                }
            )
        if not isinstance(input_ids, torch.Tensor):
            raise AutopartError("input_ids must be a tensor")
        dummy = torch.zeros_like(input_ids)  # labels feed no node once the loss is cut off
        self._activate()
        fields = self._fields(input_ids, dummy, attention_mask, position_ids)
        self._check_same_batch("logits", fields, local)
        fields, rows = self._pad_rows(fields, local)
        fields, length = self._pad_length(fields)
        mbs = self._microbatches(fields, local)
        self._p2p.reset()
        actions = [a for a in self.program.actions if a.kind in ("F", "SEND_F", "RECV_F")]
        s = self._s = _Step(
            mbs=mbs,
            count=torch.ones((), dtype=self._dtype, device=self.device),
            bounds=self._chunk_bounds(fields["input_ids"].shape[1]),
            arm_at={},
            recvs=[(i, a) for i, a in enumerate(actions) if a.kind == "RECV_F"],
        )
        saved, self._run = self._run, self._logits_run[key]
        try:
            with torch.no_grad():
                for i, action in enumerate(actions):
                    self.comm.set_action(f"{action} (logits) on rank {self.rank}")
                    self._act(i, action)
                self._p2p.wait_sends()
            pieces = s.losses
        finally:
            self._run, self._s = saved, None
        out = self._gather_logits(pieces, mbs, fields["input_ids"].shape[1])[:, :length]
        group = self.groups.get("dp")
        if local or group is None:
            return Logits.of(out[:rows])  # its backward() names what logits computes
        host = out.cpu() if out.device.type != "cpu" and dist.get_backend(group) == "gloo" else out
        parts = [torch.empty_like(host) for _ in range(self.plan.mesh.dp)]
        work = dist.all_gather(parts, host.contiguous(), group=group, async_op=True)
        self._wait(work, "gathering the logits of every dp replica's rows")
        return Logits.of(torch.cat(parts, dim=0).to(out.device)[:rows])

    def _gather_logits(
        self, pieces: dict[tuple[int, int], torch.Tensor], mbs: list, seq: int
    ) -> torch.Tensor:
        """This replica's logits from the last stage's (micro-batch, chunk) pieces, put back
        together over tp (vocabulary slices) and sent from the last pipeline stage to the
        others (dp replicas each hold their own rows)."""
        n_chunks = len(self._chunk_bounds(seq))
        out = None
        if self.program.coords.pp == self.plan.mesh.pp - 1:
            out = torch.cat(
                [
                    torch.cat(
                        [
                            pieces[(j, c)].reshape(
                                mb["input_ids"].shape[0], -1, pieces[(j, c)].shape[-1]
                            )
                            for c in range(n_chunks)
                        ],
                        dim=1,
                    )
                    for j, mb in enumerate(mbs)
                ],
                dim=0,
            )  # (rows, seq, vocab / tp), or the whole vocabulary when tp does not divide it
            if self.plan.mesh.tp > 1 and out.shape[-1] != self.program.vocab_size:
                out = self.comm.all_gather(out.contiguous(), 2, "tp")
        group = self.groups.get("pp")
        if group is not None:  # the last stage sends them to the others of its pipeline
            src = self.program.groups["pp"][-1]
            head = torch.zeros(2, dtype=torch.int64)
            if out is not None:
                head[0], head[1] = out.shape[-1], p2p._DTYPES.index(out.dtype)
            self._broadcast(head, src, group, "the logits' shape")
            if out is None:
                rows = sum(mb["input_ids"].shape[0] for mb in mbs)
                shape = (rows, seq, int(head[0]))
                out = torch.empty(shape, dtype=p2p._DTYPES[int(head[1])], device=self.device)
            self._broadcast(out, src, group, "the logits")
        assert out is not None  # without a pp group, this rank is the last stage
        return out[..., : self.program.vocab_size]

    def _broadcast(self, t: torch.Tensor, src: int, group: Any, what: str) -> None:
        """Broadcast ``t`` in place from global rank ``src`` (through a host copy on gloo)."""
        host = t.cpu() if t.device.type != "cpu" and dist.get_backend(group) == "gloo" else t
        work = dist.broadcast(host, src=src, group=group, async_op=True)
        self._wait(work, f"broadcasting {what} from rank {src}")
        if host is not t:
            t.copy_(host)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside leave their gradients unreduced over dp (as DDP's ``no_sync``): for
        gradient accumulation, only the first ``step`` after it all-reduces, the sum of all."""
        self._unsynced = self._unsynced or "no_sync"
        try:
            yield
        finally:
            self._unsynced = None

    def _shift(self, input_ids: torch.Tensor, labels: torch.Tensor, shifted: bool | None) -> Any:
        """Labels as the graph takes them (``labels[i, t]``: the target of position t)."""
        self._check_ids(input_ids, labels)
        if shifted is None:
            shifted = self.label_convention != "hf"
            _check_convention(input_ids, labels, self.label_convention)
        if shifted:
            return labels
        pad = torch.full_like(labels[:, :1], -100)
        return torch.cat([labels[:, 1:], pad], dim=1)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (which share of the global batch is its own)."""
        return self.program.coords.dp

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas (shares of the global batch)."""
        return self.plan.mesh.dp

    def _whole_tokens(self, num_tokens: Any) -> int | None:
        """``num_tokens`` as an ``int`` (None stays None); anything but a whole number ≥ 1 is
        refused."""
        if num_tokens is None:
            return None
        try:
            n = int(num_tokens)
            whole = not isinstance(num_tokens, bool) and n == num_tokens and n >= 1
        except (TypeError, ValueError, RuntimeError):
            whole = False
        if not whole:
            raise AutopartError(
                f"rank {self.rank}: num_tokens {num_tokens!r} must be a whole number of labels, "
                "at least 1"
            )
        return n

    def _count(self, labels: torch.Tensor, num_tokens: int | None, local: bool) -> torch.Tensor:
        """What the losses are divided by: the global batch's labels ≠ -100 (``local``: this
        share's, summed over dp), or ``num_tokens``."""
        n = (labels != -100).sum().to(self._dtype).to(self.device)
        group = self.groups.get("dp")
        if local and group is not None and not self.dry:
            self._wait(staging.all_reduce(n, group), "adding up the dp shares' labels")
        if num_tokens is None:
            if not self.dry and int(n) == 0:  # every rank has the same count: all refuse
                raise AutopartError(
                    f"rank {self.rank}: every label of the global batch is -100, so its mean "
                    "loss is over no label (one device's cross entropy gives nan)",
                    hint="skip batches that are all padding; within gradient accumulation, "
                    "num_tokens= (the labels of all the accumulated batches) makes such a "
                    "batch add nothing",
                )
            return n
        if not self.dry and int(num_tokens) < int(n):
            raise AutopartError(
                f"rank {self.rank}: num_tokens={int(num_tokens)} is fewer than this step's own "
                f"{int(n)} labels != -100 (over the global batch, every dp replica's share "
                "included): the mean would be taken over too few labels",
                hint="num_tokens is the labels != -100 of all the batches accumulated into one "
                "optimizer step, over every dp replica (with local=True, all-reduce each "
                "replica's count over dp first)",
            )
        return torch.tensor(float(num_tokens), dtype=self._dtype, device=self.device)

    def _reduce_carried(self, kept: dict[str, torch.Tensor | None]) -> None:
        """All-reduce over dp the gradients that ``no_sync()`` steps left on this rank (one flat
        message), before they join this step's reduced ones."""
        group = self.groups.get("dp")
        carried = {f: g for f, g in kept.items() if g is not None}
        if group is None or not carried or self.dry:
            return
        flat = torch.cat([g.reshape(-1) for g in carried.values()])
        self._wait(staging.all_reduce(flat, group), "the all-reduce of no_sync() gradients")
        offset = 0
        for f, g in carried.items():
            n = g.numel()
            kept[f] = flat[offset : offset + n].view_as(g)
            offset += n

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank (CPU tensors): tp slices put together,
        every stage's parameters, tied aliases and buffers, under the model's own names; from
        the live API exactly the keys of ``model.state_dict()``, so it loads strictly into the
        original model (a buffer no graph reads, such as a causal mask Seq1F1B replaced by
        positions, is the module's own). Collective: call it on every rank."""
        self._meet("full_state_dict")
        full, buffers = state.gather_full(
            self.params, self.buffers, self.program.shards, self.program.coords
        )
        model = self._followed()
        if model is not None:  # buffers no graph reads (a mask Seq1F1B replaced): the module's
            for name, b in model.named_buffers(remove_duplicate=False):
                if name not in buffers and name in (self.state_keys or ()):
                    buffers[name] = b.detach().cpu().clone()
        return state.model_state(full, buffers, self.tied, self.state_keys)

    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a whole-model state dict (``full_state_dict()``, or the model's own
        ``state_dict()``): each rank copies in its slices. Local: no collective."""
        state.load_local(sd, self.params, self.buffers, self.program.shards, self.tied)
        self.mark_moved()

    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True
    ) -> state.Loaded:
        """``nn.Module.load_state_dict`` for the whole model: ``state_dict`` is the model's
        (``model.state_dict()``, ``full_state_dict()``, a checkpoint of the module), and each
        rank copies in its own slices of it. A rank's ``state_dict()`` holds only its slices
        and stages: under tp its tensors are refused (whose slices they are cannot be told),
        under pp another stage's lack this rank's keys. ``strict``: every parameter of this
        rank must be there, and (live API) no key the model does not have. Returns torch's
        ``(missing_keys, unexpected_keys)``. Local: no collective."""
        known = (
            None
            if self.state_keys is None
            else {*self.state_keys, *self.params, *self.buffers}  # + non-persistent buffers
        )
        unexpected = [k for k in state_dict if known is not None and k not in known]
        if strict and unexpected:
            raise AutopartError(
                f"the state dict has {len(unexpected)} keys the model does not have "
                f"(e.g. {unexpected[0]})",
                hint="load a state dict of this model, or pass strict=False",
            )
        missing = state.load_local(
            state_dict, self.params, self.buffers, self.program.shards, self.tied, strict
        )
        self.mark_moved()
        return state.Loaded(missing, unexpected)

    def copy_to(self, model: nn.Module) -> None:
        """Write the trained weights into ``model`` (the user's module), so that
        ``model.save_pretrained()`` or ``torch.save(model.state_dict())`` saves them.
        Collective: call it on every rank. The module this runner follows then loads the
        runner from them too (``guards.follow_module``), and is current again."""
        sd = self.full_state_dict()
        own = original_state_dict(model)
        missing = [k for k in own if k not in sd]
        if missing:
            raise AutopartError(
                f"the trained state has no {missing[0]} of the model passed to copy_to",
                hint="pass the model this runner was made from",
            )
        model.load_state_dict({k: sd[k] for k in own}, strict=True)

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The norm of the whole model's gradients, each parameter counted once over tp
        slices, pipeline stages, tied copies and dp replicas: the same number on every rank,
        equal to one device's (``runtime/norms.py``). Collective: call it on every rank."""
        self.check_reduced("runner.grad_norm() / clip_grad_norm_()")
        self._meet("grad_norm")
        split = {f: s.dim is not None for f, s in self.program.shards.items()}
        norm = norms.global_norm(
            self.params,
            split,
            self.program.ties,
            self.program.coords,
            self.groups,
            norm_type,
            self.timeout_s,
        )
        self.global_norms.append(norm)
        return norm

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """``torch.nn.utils.clip_grad_norm_`` for the whole parallel model: scale every local
        gradient by ``max_norm / (norm + 1e-6)`` when below 1, with the global ``grad_norm``,
        so that every rank clips by the same factor. Returns the norm before clipping.
        Collective: call it on every rank."""
        norm = self.grad_norm(norm_type)
        norms.clip_(self.params, norm, max_norm)
        return norm

    def step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        shifted: bool | None = None,
        num_tokens: int | None = None,
        local: bool = False,
        **extra: Any,
    ) -> torch.Tensor:
        """One forward + backward over the global batch; returns its mean loss.

        ``local=True``: this rank passes only its data-parallel share (``dp_size`` ranks each
        load their own rows, e.g. with ``DistributedSampler(num_replicas=runner.dp_size,
        rank=runner.dp_rank)``; the ranks of one dp replica pass the same rows). The loss is
        still the mean over the whole global batch: the label counts are summed over dp.

        ``labels`` follow the model: a Hugging Face causal LM's are unshifted, as HF takes them
        (``labels = input_ids``, shifted inside); other models' are already shifted
        (``labels[i, t]`` is the target of ``input_ids[i, t]``). ``shifted=True`` / ``False``
        says which explicitly (``label_convention`` is the default). -100 is ignored.
        ``attention_mask`` ((batch, seq), 1 = a real token, 0 = padding; int64 or bool) and
        ``position_ids`` ((batch, seq) int64: each token's position in its document) are the
        optional batch tensors: pass exactly those the program was captured with (its
        ``batch_names``); they are split with the ids, over dp and micro-batches.
        ``num_tokens``: the number of labels the loss is averaged over, for gradient
        accumulation over several calls (the labels ≠ -100 of all of them: the sum of the
        calls' gradients is then the big batch's); default: this batch's.
        Inside ``no_sync()`` the gradients are not reduced over dp until a later ``step``
        outside it."""
        # the graphs' collectives find their group by name, process-wide: bind ours again, in
        # case another runner in this process (another plan) bound the name since
        self._begin("step", needs_grad=True)
        labels = self._batch_args("step", input_ids, labels, extra)
        self.global_norms.clear()  # the gradients change: norms computed before are not theirs
        num_tokens = self._whole_tokens(num_tokens)
        self._activate()
        labels = self._shift(input_ids, labels, shifted)
        fields = self._fields(input_ids, labels, attention_mask, position_ids)
        self._check_same_batch("step", fields, local, num_tokens, pads=False)
        mbs = self._microbatches(fields, local)
        kept = {f: p.grad for f, p in self.params.items()}
        if (
            num_tokens is None
            and not self._warned_sum
            and any(g is not None and bool(g.count_nonzero()) for g in kept.values())
        ):  # (zeroed with set_to_none=False: nothing is added to)
            self._warned_sum = True  # once per runner (every rank takes this path alike)
            if self.rank == 0:
                warnings.warn(
                    "runner.step added its gradients to those already on the parameters "
                    "(accumulation without num_tokens): each step's is the gradient of its own "
                    "batch's mean loss, so K steps add up to about K times the gradient of the "
                    "mean over the K batches. For that mean, pass num_tokens= to every step "
                    "(the labels != -100 of all K batches); zero the gradients between "
                    "optimizer steps if they should not add up",
                    stacklevel=2,
                )
        for p in self.params.values():
            p.grad = None
        self.steps += 1
        self._saved.reset([*self.params.values(), *self.buffers.values()])
        if self.timeline is not None:
            self.timeline = []  # keep the last step's only
        self._p2p.reset()
        self.stats.launched_during_backward = 0
        self.stats.deferred_gemms = 0  # weight-gradient GEMMs the W actions ran
        self.stats.filled_gemms = 0
        actions = self.program.actions
        self.comm.defer_grad_reduce = bool(self._tp_partial)
        s = self._s = _Step(
            mbs=mbs,
            count=self._count(labels, num_tokens, local),
            bounds=self._chunk_bounds(input_ids.shape[1]),
            arm_at={} if self._unsynced is not None else self._final_backwards(),
            recvs=[(i, a) for i, a in enumerate(actions) if a.kind in ("RECV_F", "RECV_B")],
            ready=[set() for _ in self._buckets],
            chunk_time=[0.0] * self.plan.seq_chunks if self._measuring() else None,
        )
        try:
            for i, action in enumerate(actions):
                self.comm.set_action(f"{action} on rank {self.rank}")
                self._record(action, start=True)
                self._act(i, action)
                self._record(action, start=False)
            self._p2p.wait_sends()
            if self._tp_partial:
                self.comm.defer_grad_reduce = False
                grads = [g for f in self._tp_partial if (g := self.params[f].grad) is not None]
                self.comm.set_action(f"the sequence-parallel gradients on rank {self.rank}")
                self.comm.reduce_grads(grads, "tp")
            if s.chunk_time is not None:
                self._refit_chunks(s)
            losses = s.losses
        finally:
            self.comm.defer_grad_reduce = False
            self._s = None  # the step's activations, prefixes and buckets go with it
            if self._split:
                self.comm.weights.clear()  # a failed step's deferred gradients go with it
        loss = (
            torch.stack(list(losses.values())).sum()
            if losses
            else torch.zeros((), dtype=self._dtype, device=self.device)
        )
        loss = self._reduce_loss(loss)  # the global mean: the same on every rank
        if self.stop_on_nonfinite and not self.dry and not bool(torch.isfinite(loss)):
            for f, p in self.params.items():  # the gradients as they were before this step
                p.grad = kept[f]
            raise AutopartError(
                f"rank {self.rank}: step {self.steps}: the loss is {float(loss)}, not finite; "
                "this step's gradients were dropped, so no optimizer steps on them",
                hint="look at the batch of this step and the learning rate; a loss that "
                "overflows in low precision needs a loss scale",
            )
        if self._unsynced is None and self._carried:  # earlier no_sync() steps' gradients
            self._reduce_carried(kept)
        self._carried = self._unsynced is not None
        for f, p in self.params.items():
            if (g := kept[f]) is not None:
                p.grad = g if p.grad is None else p.grad + g
        return StepLoss.of(loss)  # detached: its backward() names what step did

    # -- one handler per action kind (the schedule's IR, autopart/schedule/ir.py) --------------

    def _prefetch_after(self, i: int) -> None:
        """Overlap the next hand-over's transfer with the compute of action ``i``."""
        nxt = next((a for j, a in self._step.recvs if j > i), None)
        if nxt is not None:
            self._p2p.prefetch(_peer(nxt), *_sender(nxt), nxt.kind == "RECV_B")

    def _on_forward(self, i: int, action: Action, unit: tuple[int, int, int]) -> None:
        self._prefetch_after(i)
        times = self._step.chunk_time  # measuring: this rank's forward seconds per chunk
        start = self._clock() if times is not None else 0.0
        with self._saved.watch(unit):
            self._forward(action, self._step.live.setdefault(unit, {}), self._step.mbs[action.mb])
        if times is not None:
            times[action.chunk] += self._clock() - start

    def _on_backward(self, i: int, action: Action, unit: tuple[int, int, int]) -> None:
        self._prefetch_after(i)
        live = self._step.live
        hooks = self._arm_buckets(self._step.arm_at.get(i, []))
        if self._split:  # the weight gradients wait for this unit's W
            self.comm.weights.collecting = unit
        try:
            self._backward(action, live[unit])
        finally:
            self.comm.weights.collecting = None
        if self._split:  # what the deferred GEMMs keep (inputs, output gradients) until W
            self._saved.hold(("W", *unit), self.comm.weights.held_bytes(unit))
        self._saved.release(unit)
        for h in hooks:
            h.remove()
        if "grads_out" not in live[unit]:
            del live[unit]  # this unit's activations are freed

    def _on_weight(self, i: int, action: Action, unit: tuple[int, int, int]) -> None:
        """A split backward's second half: the unit's deferred weight gradients."""
        self.stats.deferred_gemms += self.comm.weights.run(unit)
        self._saved.release(("W", *unit))
        for b, p in self._step.arm_at.get(i, []):  # their gradients are final now
            self._bucket_ready(b, p)

    def _fill(self) -> bool:
        """Work while waiting (zero-bubble schedules, ``p2p.Channel.filler``): one deferred
        weight-gradient GEMM of the oldest unit whose ``B`` has run, so the wait for a
        neighbour that runs late is spent on work the schedule's ``W`` would do later; recorded
        as a piece of that unit's ``W``. False when no such GEMM is left."""
        start = time.time()
        unit = self.comm.weights.run_one()
        if unit is None:
            return False
        self.stats.deferred_gemms += 1
        self.stats.filled_gemms += 1
        if self.comm.weights.done(unit):
            self._saved.release(("W", *unit))
        if self.timeline is not None:  # the receive's own event starts after its last piece
            self._t0 = time.time()
            self.timeline.append(TraceEvent(Action("W", *unit), start, self._t0))
        return True

    def _on_send_f(self, i: int, action: Action, unit: tuple[int, int, int]) -> None:
        self._p2p.send(self._step.live[unit]["outputs"], _peer(action), *unit, backward=False)

    def _on_recv_f(self, i: int, action: Action, unit: tuple[int, int, int]) -> None:
        n = sum(r.kind == "act" for r in self._stage(action.stage).inputs)
        got = self._p2p.recv(n, _peer(action), *_sender(action), False, str(action))
        self._step.live.setdefault(unit, {})["acts"] = [
            t.requires_grad_() if t.is_floating_point() else t for t in got
        ]

    def _on_send_b(self, i: int, action: Action, unit: tuple[int, int, int]) -> None:
        live = self._step.live
        self._p2p.send(live[unit].pop("grads_out"), _peer(action), *unit, backward=True)
        del live[unit]

    def _on_recv_b(self, i: int, action: Action, unit: tuple[int, int, int]) -> None:
        live = self._step.live
        n = sum(t.is_floating_point() for t in live[unit]["outputs"])
        live[unit]["grads_in"] = self._p2p.recv(
            n, _peer(action), *_sender(action), True, str(action)
        )

    def _on_dp_reduce(self, i: int, action: Action, unit: tuple[int, int, int]) -> None:
        if self._unsynced is None:  # inside no_sync(): reduced by a later step
            self._finish_buckets(action)

    def _on_tie_reduce(self, i: int, action: Action, unit: tuple[int, int, int]) -> None:
        self._tie_reduce(action)

    def _act(self, i: int, action: Action) -> None:
        """Run one action; an op failing inside it (out of memory, a kernel's error) is an
        ``AutopartError`` naming the rank and the action, not a raw traceback in every rank."""
        try:
            self._HANDLERS[action.kind](self, i, action, (action.stage, action.mb, action.chunk))
        except AutopartError:
            raise
        except (RuntimeError, MemoryError) as exc:
            memory = isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
                "allocate" in str(exc)
            )
            raise AutopartError(
                f"rank {self.rank}: {action} failed: {type(exc).__name__}: {first_line(exc)}",
                hint="out of memory: lower the micro-batch (more microbatches), recompute, or "
                "spread the model over more pipeline stages"
                if memory
                else "the stage's graph failed on this rank's inputs; autopart verify runs "
                "the same plan against one device",
            ) from exc

    _HANDLERS: dict[str, Callable[..., None]] = {
        "F": _on_forward,
        "B": _on_backward,
        "W": _on_weight,
        "SEND_F": _on_send_f,
        "RECV_F": _on_recv_f,
        "SEND_B": _on_send_b,
        "RECV_B": _on_recv_b,
        "DP_REDUCE": _on_dp_reduce,
        "TIE_REDUCE": _on_tie_reduce,
    }

    def _clock(self) -> float:
        """Seconds, after the device's queued kernels have run (CUDA launches asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _measuring(self) -> bool:
        """seq_split="measured": this step's chunk times refit the boundaries."""
        p = self.plan
        return (
            p.seq_split == "measured" and p.seq_chunks > 1 and not self.dry
        ) and self.steps <= MEASURE_STEPS

    def _refit_chunks(self, s: _Step) -> None:
        """seq_split="measured": every rank adds up its forward seconds per chunk (all of its
        stages and micro-batches; backward has the same two terms, about twice as large); the
        sums over all ranks, one per chunk, fit the coefficients the next steps balance with
        (the same on every rank: the same sums)."""
        t = torch.tensor(s.chunk_time, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            work = staging.all_reduce(t)
            self._wait(work, f"step {self.steps}: adding up the chunks' measured forward times")
        windows = windows_of(self.chunk_cost or ())  # the graph's windows: kept
        samples = [(a, e, float(x)) for (a, e), x in zip(s.bounds, t, strict=True)]
        fit = fit_coefficients(samples, windows)
        if fit is not None:
            self.chunk_cost, self._bounds = fit, {}

    def _check_split_length(self, seq_len: int) -> None:
        """Sequence parallelism cuts the sequence into tp equal parts (each Seq1F1B chunk too:
        its boundaries are multiples of tp, so the last chunk fits when the length does)."""
        tp = self.plan.mesh.tp
        if self.plan.sequence_parallel and seq_len % tp:
            raise AutopartError(
                f"rank {self.rank}: sequence length {seq_len} is not divisible by tp={tp}, "
                "which sequence parallelism needs",
                hint=f"use a sequence length that is a multiple of {tp}, or turn sequence_parallel off",
            )

    def _chunk_bounds(self, seq_len: int) -> list[tuple[int, int]]:
        """[start, end) of each Seq1F1B sequence chunk (one chunk: the whole sequence)."""
        if seq_len not in self._bounds:  # solved once per length, not at every step
            p = self.plan
            if p.max_seq is not None and seq_len > p.max_seq:
                raise AutopartError(
                    f"rank {self.rank}: a sequence of {seq_len} tokens is longer than the "
                    f"program's graphs fit ({p.max_seq} tokens, found when it was compiled: "
                    "the model slices a table of positions, export fixed a size that the "
                    "capture example's length implied or a number computed from it, or its "
                    "attention masks were proven causal by evaluating them up to that length)",
                    hint=f"train at most {p.max_seq} tokens, or capture the model with an "
                    f"example of {seq_len} tokens",
                )
            if p.min_seq is not None and seq_len < p.min_seq:
                raise AutopartError(
                    f"rank {self.rank}: a sequence of {seq_len} tokens is shorter than the "
                    f"program's graphs fit ({p.min_seq} tokens, found when it was compiled: "
                    "export fixed a size that the capture example's length implied, or a "
                    "number computed from it)",
                    hint=f"train at least {p.min_seq} tokens; if the model itself takes "
                    f"{seq_len}, capture it with an example of {seq_len} tokens",
                )
            if seq_len % p.seq_block:
                raise AutopartError(
                    f"rank {self.rank}: a sequence of {seq_len} tokens is not a multiple of "
                    f"{p.seq_block} tokens, which the program's graphs need (found when it was "
                    "compiled: a scan's blocks Seq1F1B cuts at, or pieces the model cuts the "
                    "sequence into)",
                    hint=f"use a sequence length that is a multiple of {p.seq_block}",
                )
            self._check_split_length(seq_len)
            try:
                self._bounds[seq_len] = chunk_bounds(
                    self.chunk_cost or (1.0, 0.0),
                    seq_len,
                    p.seq_chunks,
                    p.seq_split,
                    p.chunk_multiple,
                )
            except AutopartError as exc:
                raise AutopartError(f"rank {self.rank}: {exc.message}", hint=exc.hint) from None
        return self._bounds[seq_len]

    def _forward(self, action: Action, unit: dict[str, Any], mb: dict[str, torch.Tensor]) -> None:
        count, losses = self._step.count, self._step.losses
        self._step.seed = self._seed_for(action.mb, action.chunk)
        a, e = self._step.bounds[action.chunk]
        n_kv = self._n_kv[action.stage]
        prefix = []
        if n_kv:  # K/V of this micro-batch's earlier chunks: leaves, whose gradients go back
            before = self._step.kv.pop((action.stage, action.mb), None)
            if before is None:
                b = mb["input_ids"].shape[0]
                before = [
                    torch.zeros([b if d == "b" else d for d in shape], dtype=dt, device=self.device)
                    for shape, dt in zip(
                        self._kv_shapes[action.stage], self._kv_dtypes[action.stage], strict=True
                    )
                ]
            # (an integer carry, a running count of a padded mask, has no gradient)
            prefix = [t.detach().requires_grad_(t.is_floating_point()) for t in before]
            unit["prefix"] = prefix
        args = self._args(action.stage, mb, a, e, acts=unit.get("acts", []), prefix=prefix)
        try:
            out = list(self._run[action.stage](*args))
        except IndexError as exc:  # a kernel's bounds check: say where and the likely cause
            raise AutopartError(
                f"rank {self.rank}: {action}: an index out of range in the model: {exc}",
                hint="is the sequence longer than the model's position table "
                f"({e - a} tokens in this chunk, offset {a})? Use sequences no longer "
                "than the model's maximum length",
            ) from exc
        if n_kv:
            out, kv = out[:-n_kv], out[-n_kv:]
            if action.chunk < self.plan.seq_chunks - 1:  # the last chunk's K/V has no reader
                self._step.kv[(action.stage, action.mb)] = kv
                unit["kv_out"] = kv
        if action.stage == self.n_stages - 1:
            losses[(action.mb, action.chunk)] = out[0] / count
        else:
            unit["outputs"] = out

    def _backward(self, action: Action, unit: dict[str, Any]) -> None:
        losses = self._step.losses
        key = (action.mb, action.chunk)
        if action.stage == self.n_stages - 1:
            outs, grads = [losses[key]], [torch.ones_like(losses[key])]
            losses[key] = losses[key].detach()
        else:
            floating = [t for t in unit["outputs"] if t.is_floating_point()]
            pairs = [
                (t, g) for t, g in zip(floating, unit["grads_in"], strict=True) if t.requires_grad
            ]
            outs, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if "kv_out" in unit:  # what the later chunks' attention sent back to this chunk's K/V
            back = self._step.kv_grads.pop((action.stage, action.mb, action.chunk))
            carried = [
                (t, g) for t, g in zip(unit.pop("kv_out"), back, strict=True) if t.requires_grad
            ]
            outs, grads = outs + [t for t, _ in carried], grads + [g for _, g in carried]
        torch.autograd.backward(outs, grad_tensors=grads)
        if "prefix" in unit and action.chunk > 0:
            self._step.kv_grads[(action.stage, action.mb, action.chunk - 1)] = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in unit.pop("prefix")
            ]
        unit.pop("prefix", None)
        if action.stage > 0:
            acts = [t for t in unit.get("acts", []) if t.is_floating_point()]
            unit["grads_out"] = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in acts
            ]
        unit.pop("outputs", None)

    def _tie_reduce(self, action: Action) -> None:
        """Sum the gradient of each parameter held by several pipeline ranks (tied weights). A
        frozen one keeps no gradient (None, as on one device: a zero would let weight decay
        move it)."""
        for fqn, group in self._ties:
            p = self.params[fqn]
            if not p.requires_grad:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if self.dry:
                p.grad = grad
                continue
            work = staging.all_reduce(grad, group)
            self._wait(work, f"{action} (gradient of tied {fqn})")
            p.grad = grad

    def _record(self, action: Action, start: bool) -> None:
        if self.timeline is not None:
            if start:
                self._t0 = time.time()
            else:
                self.timeline.append(TraceEvent(action, self._t0, time.time()))

    # -- internals -------------------------------------------------------------------------

    def _seed_for(self, mb: int, chunk: int = 0) -> torch.Tensor:
        """Dropout seed of this step, micro-batch, chunk and dp rank (tp ranks share it)."""
        dp_i = self.program.coords.dp
        base = ((self.seed * 1_000_003 + self.steps) * 10_007 + mb) * 4_099 + dp_i
        return torch.tensor(base + chunk * 1_000_000_007, device=self.device)

    @property
    def _dtype(self) -> torch.dtype:
        return next(iter(self.params.values())).dtype

    def _fields(
        self,
        input_ids: Any,
        labels: Any,
        attention_mask: Any = None,
        position_ids: Any = None,
    ) -> dict[str, torch.Tensor]:
        """The batch by name, on this rank's device: exactly the tensors the program was
        captured with (``RankProgram.batch_names``), else refused on every rank alike, before
        any collective; an ``attention_mask`` becomes int64 (checked 0/1), ``position_ids``
        are checked ≥ 0."""
        names = self.program.batch_names
        if (
            _no_padding(attention_mask)
            and "attention_mask" not in names
            and attention_mask.shape == getattr(input_ids, "shape", None)
        ):
            # a collator's mask of a batch with no padding: the model computes as without one
            attention_mask = None
        given = {"attention_mask": attention_mask, "position_ids": position_ids}
        for name, t in given.items():
            if (t is None) == (name in names):
                has = "was captured with" if name in names else "was captured without"
                raise AutopartError(
                    f"rank {self.rank}: this program {has} {name}, but the batch "
                    + ("has none" if t is None else "has one"),
                    hint="pass exactly the batch tensors the program was captured with: "
                    + ", ".join(names)
                    + " (capture again, with an example that has them, to train on others)",
                )
        self._check_ids(input_ids, labels)
        # any integer dtype (a tokenizer's int32) is taken as the int64 the graphs index with
        fields = {"input_ids": input_ids.long(), "labels": labels.long()}
        for name, t in given.items():
            if t is not None:
                try:
                    fields[name] = check_extra(name, t, tuple(input_ids.shape))
                except AutopartError as exc:
                    raise AutopartError(f"rank {self.rank}: {exc.message}", hint=exc.hint) from None
        # plain tensors: ids drawn from ``logits`` (greedy decoding) keep its ``Logits`` class,
        # whose per-op dispatch the graphs need not pay
        return {k: t.as_subclass(torch.Tensor).to(self.device) for k, t in fields.items()}

    def _check_same_batch(
        self,
        call: str,
        fields: dict[str, torch.Tensor],
        local: bool,
        num_tokens: int | None = None,
        pads: bool = True,
    ) -> None:
        """The ranks that must pass the same rows do: every rank the global batch, or with
        ``local`` the ranks of one dp replica its share (equal over the tp and the pp groups
        is equal over the replica). A sampler over the whole world (each rank its own rows, as
        under DDP) would otherwise give tp peers different tokens, which their collectives
        then add up: a wrong model, silently. ``num_tokens`` must be the same on every rank.
        One small all-reduce over the whole mesh, before any compute, of every rank's
        fingerprint: every rank checks every group, so all of them refuse alike (a check per
        group left the ranks of the groups that agreed waiting for the others, until the
        timeout). A batch whose rows do not split into this rank's micro-batches (``pads``:
        ``evaluate`` and ``logits`` pad a global batch) is refused on every rank, naming it."""
        # the call's first collective: the ranks meet first (after every local refusal, so a
        # rank refused alone is named by the others, not waited for inside a collective)
        self._meet(call)
        mesh = self.plan.mesh
        if self.dry or not self.check_batches or mesh.size < 2:
            return
        given = -1 if num_tokens is None else int(num_tokens)
        n = int(fields["input_ids"].shape[0])
        uneven = -1
        if local or not pads:
            try:
                self.plan.check_batch(n * (mesh.dp if local else 1))
            except AutopartError:
                uneven = n
        tail = torch.tensor([given, uneven], device=self.device)
        mine = torch.cat([_fingerprint(fields), tail, _weights_sample(self.params, self.device)])
        table = torch.zeros(mesh.size, mine.numel(), dtype=torch.int64, device=self.device)
        table[self.rank] = mine
        self._wait(staging.all_reduce(table, None), "comparing the batch over every rank")
        every = table.tolist()  # per rank: the batch's fingerprint, given, uneven, weights
        weights = [row[-1] for row in every]
        for ranks in mesh.groups("dp") if mesh.dp > 1 else []:
            differ = [r for r in ranks[1:] if weights[r] != weights[ranks[0]]]
            if differ:
                raise AutopartError(
                    f"rank {self.rank}: the weights of rank {differ[0]} differ from those of rank "
                    f"{ranks[0]}, its data-parallel replica (sampled as this call began): a rank "
                    "skipped optimizer.step() or zero_grad(), stepped with other settings, or "
                    "loaded other weights",
                    hint="every rank must make the same optimizer steps on the same gradients; "
                    "replicas that drift apart stay apart (DDP does not check this)",
                )
        rows = [row[:-2] for row in every]  # the batch's fingerprint and given
        for r, bad in enumerate(row[-2] for row in every):
            if bad >= 0:
                parts = mesh.dp * self.plan.microbatches
                raise AutopartError(
                    f"rank {self.rank}: {'this rank' if r == self.rank else f'rank {r}'} passed "
                    + (
                        f"a dp share of {bad} rows (local=True), which does not split into "
                        f"microbatches({self.plan.microbatches})"
                        if local
                        else f"a batch of {bad} rows, which does not split into dp("
                        f"{mesh.dp}) × microbatches({self.plan.microbatches}) = {parts}"
                    ),
                    hint="every rank's batch must split into the plan's micro-batches "
                    + (f"(a multiple of {self.plan.microbatches} rows a share)" if local else "")
                    + "; drop the last uneven batch (drop_last=True) or change microbatches",
                )
        if len({tuple(r) for r in rows}) == 1:
            return  # every rank passed the same (the common case)
        share = "its dp replica's share" if local else "the global batch"
        for d in ("tp", "pp", "dp"):
            for ranks in mesh.groups(d):
                first = ranks[0]
                for r in ranks[1:]:
                    batch_differs = rows[r][:-1] != rows[first][:-1]
                    if batch_differs and (d != "dp" or not local):
                        raise AutopartError(
                            f"rank {self.rank}: rank {r} passed another batch than rank "
                            f"{first}, though the ranks of the {d} group {ranks} must all pass "
                            f"{share}",
                            hint="a sampler per dp replica, not per rank, with local=True: "
                            "DistributedSampler(dataset, num_replicas=runner.dp_size, "
                            "rank=runner.dp_rank); or the same global batch on every rank",
                        )
                    if rows[r][-1] != rows[first][-1]:
                        a, b = (rows[x][-1] for x in (r, first))
                        raise AutopartError(
                            f"rank {self.rank}: rank {r} passed num_tokens="
                            f"{'None' if a < 0 else a}, rank {first} "
                            f"{'None' if b < 0 else b}, though every rank averages the same "
                            "loss",
                            hint="num_tokens is the labels != -100 of all the batches "
                            "accumulated into one optimizer step, over every dp replica: the "
                            "same number on every rank",
                        )

    def _batch_args(self, what: str, input_ids: Any, labels: Any, extra: dict[str, Any]) -> Any:
        """``labels``, once what a data loader's habits pass beyond the batch tensors is refused
        (on every rank alike, before any collective; each raised Python's bare ``TypeError``):
        the batch dict as one argument (``runner.step(batch)``), keys the program does not take
        (a tokenizer's ``token_type_ids``, nanoGPT's ``targets=``), and no labels."""
        takes = ", ".join(self.program.batch_names)
        if isinstance(input_ids, Mapping):
            raise AutopartError(
                f"rank {self.rank}: runner.{what} takes the batch's tensors, not the batch "
                f"dict ({', '.join(map(str, input_ids))})",
                hint=f"runner.{what}(**batch); the program takes {takes}",
            )
        if extra:
            keys = sorted(extra)
            hint = (
                "pass the targets as labels=: this model's labels are "
                + (
                    "unshifted (labels = input_ids; the model shifts them)"
                    if self.label_convention == "hf"
                    else "the next tokens (labels[:, t] is the target of input_ids[:, t])"
                )
                if "targets" in extra
                else "drop them from the batch (batch.pop(name)); the program computes the "
                f"model as captured, from {takes} only (docs/capture.md)"
            )
            raise AutopartError(
                f"rank {self.rank}: runner.{what} got {', '.join(keys)}, which it does not "
                f"take: the program takes {takes}",
                hint=hint,
            )
        if labels is None and what != "logits":
            raise AutopartError(
                f"rank {self.rank}: runner.{what} needs labels",
                hint="labels = input_ids for a Hugging Face model (it shifts them), the next "
                "tokens otherwise; runner.logits(input_ids) needs none",
            )
        return labels

    def _check_ids(self, input_ids: Any, labels: Any) -> None:
        """Refuse ids or labels that are not integer (batch, seq) tensors of one shape."""
        for name, t in (("input_ids", input_ids), ("labels", labels)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise AutopartError(
                    f"rank {self.rank}: {name} must be a (batch, seq) tensor, got "
                    + (f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__)
                )
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise AutopartError(
                    f"rank {self.rank}: {name} are {t.dtype}; token ids are integers",
                    hint="pass the tokenizer's ids as int64 (torch.long); int32 is taken too",
                )
        if input_ids.shape != labels.shape:
            raise AutopartError(
                f"rank {self.rank}: input_ids {tuple(input_ids.shape)} and labels "
                f"{tuple(labels.shape)} must both be (batch, seq)"
            )

    def _pad_rows(
        self, fields: dict[str, torch.Tensor], local: bool
    ) -> tuple[dict[str, torch.Tensor], int]:
        """A global batch of ``evaluate`` / ``logits`` whose rows dp × micro-batches do not
        divide (a short last validation batch, one prompt), made whole with copies of its last
        row (labels -100: they count in no loss), and its own row count. Exact: a plan that
        splits the batch keeps rows apart (``refuse_row_mixing``), so the copies change no
        other row; ``logits`` cuts them off again. A step is not padded."""
        rows = int(fields["input_ids"].shape[0])
        parts = self.plan.mesh.dp * self.plan.microbatches
        want = -(-rows // parts) * parts
        if self.plan.micro_batch is not None and rows < parts * self.plan.micro_batch:
            want = parts * self.plan.micro_batch
        if local or want == rows:
            return fields, rows
        out = {}
        for k, t in fields.items():
            filler = t[-1:].expand(want - rows, *t.shape[1:])
            out[k] = torch.cat([t, torch.full_like(filler, -100) if k == "labels" else filler])
        return out, rows

    def _pad_length(self, fields: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """A sequence of ``evaluate`` / ``logits`` that the Seq1F1B program cannot cut (a prompt
        shorter than its chunks, or not a multiple of a scan's blocks) made as long as the
        least length it cuts, with copies of its last column (labels -100: they count in no
        loss), and its own length. Exact: a Seq1F1B program is proven causal (``sequence_chunk``
        refuses any value at a position that reads a later one), so what comes after the end
        changes nothing before it; ``logits`` cuts it off again. Without sequence chunks, or
        past the longest sequence the graphs fit, a length is refused as ``step`` refuses it;
        a step is not padded."""
        seq = int(fields["input_ids"].shape[1])
        p = self.plan
        try:
            self._chunk_bounds(seq)
            return fields, seq
        except AutopartError as exc:
            if p.seq_chunks <= 1 or (p.max_seq is not None and seq > p.max_seq):
                raise
            refused = exc
        step = p.seq_block
        length = -(-max(seq, p.min_seq or 0, 1) // step) * step
        limit = length + 2 * p.seq_chunks * p.chunk_multiple * step
        if p.max_seq is not None:
            limit = min(limit, p.max_seq)
        while length <= limit:
            try:
                self._chunk_bounds(length)
                break
            except AutopartError:
                length += step
        else:
            raise refused
        out = {}
        for k, t in fields.items():
            filler = t[:, -1:].expand(-1, length - seq)
            out[k] = torch.cat([t, torch.full_like(filler, -100) if k == "labels" else filler], 1)
        return out, seq

    def _microbatches(
        self, fields: dict[str, torch.Tensor], local: bool = False
    ) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the (global, or ``local``: this replica's) batch
        ``fields``: every batch tensor cut alike, by rows."""
        input_ids, labels = fields["input_ids"], fields["labels"]
        if input_ids.shape != labels.shape or input_ids.dim() != 2:
            raise AutopartError(
                f"rank {self.rank}: input_ids {tuple(input_ids.shape)} and labels "
                f"{tuple(labels.shape)} must both be (batch, seq)"
            )
        rows = input_ids.shape[0] * (self.plan.mesh.dp if local else 1)  # the global batch
        mb = self.plan.check_batch(rows)
        self._check_split_length(int(input_ids.shape[1]))
        dp_i, m = self.program.coords.dp, self.plan.microbatches
        start = 0 if local else dp_i * m * mb
        if not self.dry:  # no values to look at in the dry run
            self._check_tokens(input_ids, labels)
        return [
            {k: t[start + j * mb : start + (j + 1) * mb] for k, t in fields.items()}
            for j in range(m)
        ]

    def _check_tokens(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Refuse ids outside [0, V) and labels outside [0, V) ∪ {-100}: a vocabulary-parallel
        embedding would zero such an id and train on, silently wrong; one device would fail deep
        in a kernel. Every rank checks the whole global batch (one comparison per token), so all
        refuse together, naming the first bad value, and none waits on another in a collective."""
        vocab = self.program.vocab_size
        if vocab is None:
            return
        for name, t, ok in (
            ("input_ids", input_ids, lambda x: (x >= 0) & (x < vocab)),
            ("labels", labels, lambda x: ((x >= 0) & (x < vocab)) | (x == -100)),
        ):
            bad = ~ok(t)
            if bool(bad.any()):
                i, j = (int(x) for x in bad.nonzero()[0])
                raise AutopartError(
                    f"rank {self.rank}: {name}[{i}, {j}] = {int(t[i, j])} is outside the "
                    f"vocabulary of {vocab} tokens"
                    + (" (or -100, ignored)" if name == "labels" else ""),
                    hint="check the tokenizer and the data: ids and labels must be < the model's "
                    "vocabulary size",
                )

    def _runs(self, graphs: dict[int, fx.GraphModule]) -> dict[int, Any]:
        """Stage graphs as this rank runs them: attention lowered to FlexAttention when the plan
        says so, on its device, recomputation regions checkpointed, checked on the dry run,
        through ``torch.compile`` when asked."""
        if self.plan.attention == "flex" and not self.dry:  # its own copy (runtime/flex.py)
            # FlexAttention's Triton kernels take head dims of 16 and more
            least = 16 if self._compile and self.device.type == "cuda" else 1
            lowered = {k: _flex_lowered(g, least) for k, g in graphs.items()}
            graphs = {k: g for k, (g, _) in lowered.items()}
            if not self.attention_lowered:  # the step's graphs (built first), not a variant's
                self.attention_lowered = {k: report for k, (_, report) in lowered.items()}
        placed = {k: checkpointed(place(g, self.device)) for k, g in graphs.items()}
        runs: dict[int, nn.Module] = dict(placed)
        if self.dry:  # the dry run refuses any value a node computes on another device
            runs = {k: device_checked(g, self.device) for k, g in placed.items()}
        if not self._compile:
            return runs
        dynamic = self.plan.seq_chunks > 1 or None  # chunks differ in length
        return {k: torch.compile(g, dynamic=dynamic) for k, g in runs.items()}

    @property
    def _step(self) -> _Step:
        """The running step's state (``step``, ``evaluate`` and ``logits`` set it)."""
        assert self._s is not None, "no step is running"
        return self._s

    def _stage(self, stage: int):
        return next(s for s in self.program.stages if s.stage == stage)

    def _args(
        self,
        stage: int,
        mb: dict[str, torch.Tensor],
        a: int,
        e: int,
        acts: Sequence[torch.Tensor] = (),
        prefix: Sequence[torch.Tensor] = (),
    ) -> list[torch.Tensor]:
        data, keys = chunk_feeds(mb, a, e)
        return stage_inputs(
            self._stage(stage).inputs,
            params=self.params,
            buffers=self.buffers,
            data=data,
            keys=keys,
            coords=self.program.coords,
            acts=acts,
            prefix=prefix,
            offset=a,
            seed=self._step.seed,
            compute=self._compute,
            device=self.device,
        )

    def _final_backwards(self) -> dict[int, list[tuple[int, nn.Parameter]]]:
        """(bucket, parameter) pairs to watch at each B action: the last backward, in this rank's
        action list, of any stage that uses the parameter (its gradient is final after it)."""
        last = "W" if self._split else "B"  # a split backward finishes the weights at W
        last_b = {a.stage: i for i, a in enumerate(self.program.actions) if a.kind == last}
        users: dict[str, list[int]] = {}
        for st in self.program.stages:
            for ref in st.inputs:
                if ref.kind == "param":
                    users.setdefault(ref.name, []).append(st.stage)
        arm: dict[int, list[tuple[int, nn.Parameter]]] = {}
        for b, fqns in enumerate(self.program.buckets):
            for fqn in fqns:
                ends = [last_b[s] for s in users.get(fqn, []) if s in last_b]
                if ends and self.params[fqn].requires_grad:
                    arm.setdefault(max(ends), []).append((b, self.params[fqn]))
        return arm

    def _arm_buckets(self, watch: list[tuple[int, nn.Parameter]]) -> list[Any]:
        """Hooks that launch each bucket's all-reduce, in bucket order, once all its gradients
        are final; armed only for the backward that finishes each parameter's gradient."""
        return [
            p.register_post_accumulate_grad_hook(lambda p, b=b: self._bucket_ready(b, p))
            for b, p in watch
        ]

    def _bucket_ready(self, b: int, p: nn.Parameter) -> None:
        """Parameter ``p`` of bucket ``b`` has its final gradient: launch every bucket, in
        order, whose gradients are all final."""
        self._step.ready[b].add(id(p))
        while self._step.next_bucket < len(self._buckets) and len(
            self._step.ready[self._step.next_bucket]
        ) == len(self._buckets[self._step.next_bucket]):
            self._launch(self._step.next_bucket)
            self.stats.launched_during_backward += 1
            self._step.next_bucket += 1

    def _launch(self, i: int) -> None:
        bucket = self._buckets[i]
        if not bucket:  # only frozen parameters
            return
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]
        )
        work = None if self.dry else staging.all_reduce(flat, self.groups["dp"])
        self._step.pending.append((i, flat, work))

    def _finish_buckets(self, action: Action) -> None:
        for i in range(self._step.next_bucket, len(self._buckets)):
            self._launch(i)  # buckets whose parameters got no gradient this step
        self._step.next_bucket = len(self._buckets)
        for i, flat, work in self._step.pending:
            if work is not None:
                self._wait(
                    work,
                    f"{action} (all-reduce of gradient bucket {i} over dp ranks "
                    f"{self.program.groups['dp']})",
                )
            offset = 0
            for p in self._buckets[i]:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
        self._step.pending = []

    def _wait(self, work: Any, what: str) -> None:
        wait(work, self.rank, what, self.timeout_s)

    def _reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.dry:
            return loss
        if self.groups.get("pp") is not None:  # only the last stage holds the loss
            work = staging.all_reduce(loss, self.groups["pp"])
            self._wait(work, f"loss all-reduce over pp ranks {self.program.groups['pp']}")
        if self.groups.get("dp") is not None:
            work = staging.all_reduce(loss, self.groups["dp"])
            self._wait(work, f"loss all-reduce over dp ranks {self.program.groups['dp']}")
        return loss


def _peer(a: Action) -> int:
    """The other rank of a send or receive (the schedule names one for each)."""
    assert a.peer is not None, f"{a} names no peer"
    return a.peer


def _sender(recv: Action) -> tuple[int, int, int]:
    """(sending stage, micro-batch, chunk) of a receive: messages are tagged by the sender."""
    return (recv.stage - 1 if recv.kind == "RECV_F" else recv.stage + 1), recv.mb, recv.chunk


def _groups_of(plan: Plan, rank: int, live_mesh: Any, ties: dict[str, list[int]]) -> dict[str, Any]:
    if live_mesh is None or ties:
        return make_groups(plan, rank, ties)
    names = live_mesh.mesh_dim_names
    return {
        d: (live_mesh.get_group(d) if d in names and getattr(plan.mesh, d) > 1 else None)
        for d in ("dp", "pp", "tp")
    }


def _flex_lowered(graph: fx.GraphModule, least: int) -> tuple[fx.GraphModule, flex.Lowered]:
    """A copy of a stage graph with its attention through FlexAttention (``runtime/flex.py``;
    head dims of ``least`` and more), and what was lowered."""
    graph = copy_graph(graph)
    return graph, flex.lower_attention(graph, least)


def without_dropout(graph: fx.GraphModule) -> fx.GraphModule:
    """A copy of a stage graph with every dropout taken out: autopart's explicit dropout and
    ``aten.dropout`` become their input, and attention's ``dropout_p`` becomes 0 (eval mode)."""
    g = copy_graph(graph)
    aten = torch.ops.aten
    for n in list(g.graph.nodes):
        if n.target in (torch.ops.autopart.dropout.default, aten.dropout.default):
            n.replace_all_uses_with(n.args[0])
            g.graph.erase_node(n)
        elif n.target == aten.scaled_dot_product_attention.default:
            if len(n.args) > 4:
                n.args = (*n.args[:4], 0.0, *n.args[5:])
            elif "dropout_p" in n.kwargs:
                n.kwargs = {**n.kwargs, "dropout_p": 0.0}
    g.recompile()
    return g


_PRIME = 2_147_483_647  # 2^31 − 1: every term of a fingerprint's sum stays below 2^62


def _weights_sample(params: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """One int64 that differs, but for a chance of about 2^-31, between two ranks holding the
    same parameters with other values at their first elements (the bits of each parameter's
    first element, position-weighted): the dp replicas of a rank hold the same bits, so two
    that differ have drifted apart (a skipped ``optimizer.step()``)."""
    firsts = [p.detach().reshape(-1)[:1] for p in params.values() if p.numel()]
    if not firsts or device.type == "meta":
        return torch.zeros(1, dtype=torch.int64, device=device)
    bits = torch.cat([f.to(device=device, dtype=torch.float64) for f in firsts]).view(torch.int64)
    return _digest(bits).view(1)


def _digest(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the int64 values of ``t`` (flat) mod ``_PRIME``."""
    w = (torch.arange(t.numel(), device=t.device) * 2_654_435_761 + 97) % _PRIME + 1
    return ((t % _PRIME) * w % _PRIME).sum()


def _fingerprint(fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """A few int64 numbers that differ, but for a chance of about 2^-31, between two batches
    that differ: each tensor's shape and a position-weighted sum of its values mod a prime."""
    out = []
    for name in sorted(fields):
        t = fields[name].long().flatten()
        out += [torch.tensor(list(fields[name].shape), device=t.device), _digest(t).view(1)]
    return torch.cat(out)


def _check_convention(input_ids: torch.Tensor, labels: torch.Tensor, convention: str) -> None:
    """Refuse labels that plainly follow the other convention: silently, either would train
    the model to predict the wrong token (its input, or the token after next). Labels that
    read both ways (one token repeated along each row) are left alone."""
    layout = label_layout(input_ids, labels)  # "both": a token repeated along every row
    if convention == "hf":
        if layout == "shifted":
            raise AutopartError(
                "these labels are already shifted (labels[:, t] == input_ids[:, t + 1]), but "
                "this Hugging Face model takes labels as HF does: unshifted (labels = "
                "input_ids), shifted inside",
                hint="pass labels=input_ids (with -100 where ignored), or step(..., "
                "shifted=True) to keep pre-shifted labels",
            )
    elif layout == "unshifted":
        raise AutopartError(
            "labels equal input_ids: this model's labels are the next tokens "
            "(labels[:, t] == input_ids[:, t + 1]), so it would learn to copy its input",
            hint="shift them (labels = input_ids[:, 1:], then -100 at the end), or pass "
            "step(..., shifted=False) to have autopart shift them",
        )


def _no_padding(mask: Any) -> bool:
    """Is ``mask`` an attention mask of a batch without padding: a (batch, seq) tensor of ones
    (or True), as a collator adds to every batch?"""
    return (
        isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and not mask.is_floating_point()
        and bool((mask == 1).all())
    )


def logits_graph(graph: fx.GraphModule) -> fx.GraphModule:
    """A copy of a stage graph that returns the logits the loss would read instead of the
    loss (``(tokens, vocab / tp)``, flattened as the loss takes them); a stage without the
    loss is returned as it is."""
    losses = (
        torch.ops.aten.cross_entropy_loss.default,
        torch.ops.autopart.vocab_parallel_ce.default,
    )
    ce = next((n for n in graph.graph.nodes if n.target in losses), None)
    if ce is None:
        return graph
    g = copy_graph(graph)
    ce = next(n for n in g.graph.nodes if n.target in losses)
    logits = ce.args[0]
    out = next(n for n in g.graph.nodes if n.op == "output")
    (values,) = out.args
    values = values if isinstance(values, (tuple, list)) else (values,)
    first = values[0]
    if first is not ce and not (first.target is operator.getitem and first.args[0] is ce):
        raise AutopartError(
            "the last stage's first output is not its loss",
            hint="please report this with the model",
        )
    out.args = ((logits, *values[1:]),)
    for n in reversed(list(g.graph.nodes)):  # the loss and what only it read
        if n.op == "call_function" and not n.users and n is not out:
            g.graph.erase_node(n)
    g.recompile()
    return g
