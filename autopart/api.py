"""The public entry point: ``parallelize(model, mesh, example_inputs=..., ...)``.

With an offline ``autopart.Mesh`` it returns the compiled ``Program`` (every rank's program, to
print, inspect or save). With a live torch ``DeviceMesh`` (under torchrun) it returns the
``Runner`` of the local rank, ready to ``step(input_ids, labels)``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autopart.errors import AutopartError, wait
from autopart.frontend.capture import (
    Batch,
    Captured,
    capture,
    capture_mixed,
    cuda_devices,
    is_hugging_face,
)
from autopart.frontend.loops import fixed_length
from autopart.layout import Plan, mesh_from
from autopart.lowering import compile_program

log = logging.getLogger("autopart")


def parallelize(
    model: nn.Module | Captured,
    mesh: Any,
    example_inputs: Batch | None = None,
    *,
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual_stages: int = 1,
    seq_chunks: int = 1,
    seq_split: str = "balanced",
    sequence_parallel: bool = False,
    recompute: str = "none",
    precision: str | None = None,
    bucket_mb: float = 25.0,
    max_stage_memory_gb: float | None = None,
    timeout_s: float = 300.0,
    compile: bool = False,
    library_ops: Sequence[str] = (),
    attention: str = "sdpa",
    plan: Any = None,
) -> Any:
    """Compile ``model`` for ``mesh``: a ``Program`` offline, the local ``Runner`` if live.

    ``example_inputs`` is ``(input_ids, labels)``, int64 ``(batch, seq)``, or a dict that also
    has ``attention_mask`` (padding) and/or ``position_ids`` (packed documents), which the
    model is then captured with and every step must pass (docs/capture.md); when left out, a
    random batch of the model's vocabulary (``default_example``); not needed when ``model`` is
    already a ``Captured``.

    The plan keywords are ``Plan``'s fields (docs/pipeline.md, docs/seq1f1b.md): ``schedule``
    (``layout.SCHEDULES``: ``"1f1b"``, ``"seq1f1b"``, ``"zb-h1"``, …), ``microbatches`` per
    data-parallel rank, ``virtual_stages`` per pipeline rank (interleaving), ``seq_chunks`` (Seq1F1B
    chunks per micro-batch) cut ``seq_split`` (``"balanced"``: equal work, ``"uniform"``: equal
    length, ``"measured"``), ``sequence_parallel`` (activations between tp regions split along
    the sequence), ``bucket_mb`` (data-parallel gradient buckets, MiB) and
    ``max_stage_memory_gb`` (pipeline cuts that keep each stage under it). ``timeout_s`` bounds
    every distributed wait of a live mesh (the meeting, the model's broadcast, each step's
    collectives). ``compile=True`` (live meshes only; a saved program compiles at run time,
    ``autopart run --compile``) runs each stage graph through ``torch.compile`` (Inductor).
    ``recompute`` is
    ``"none"``, ``"selective"`` (attention cores) or ``"full"`` (every transformer block).
    ``precision="bf16"``: bf16 compute, the model's (float32) parameters as master weights,
    float32 gradients and loss (``capture_mixed``; docs/precision.md). ``library_ops`` names
    library namespaces whose custom ops you trust when capture cannot decompose them to ATen
    (``torch.ops.<namespace>.*``; the program records the library's version, and a loader
    must name it too: docs/capture.md). ``attention="flex"``: each rank runs attention with a
    mask or a score function (sliding windows, ALiBi, soft-capping, sinks) through FlexAttention
    (``autopart/runtime/flex.py``; fused kernels on CUDA with ``compile=True``).

    ``plan=`` takes a whole ``Plan`` (or a planner result, ``planner.search(...).ranked[0]``)
    instead of the plan keywords; ``mesh`` may then be ``None`` (the plan's) or must match it.
    """
    if plan is not None:
        plan = _given_plan(plan, mesh)
        live = None if mesh is None else mesh_from(mesh)[1]
    else:
        offline, live = mesh_from(mesh)
        plan = Plan(
            mesh=offline,
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            seq_chunks=seq_chunks,
            sequence_parallel=sequence_parallel,
            bucket_mb=bucket_mb,
            max_stage_memory_gb=max_stage_memory_gb,
            seq_split=seq_split,
            recompute=recompute,
            precision=precision,
            library_ops=tuple(library_ops),
            attention=attention,
        )
    if compile and live is None:
        raise AutopartError(
            "compile=True compiles the ranks' stage graphs as they run, and this mesh is offline "
            "(it returns a Program to save, not a runner)",
            hint="pass a live DeviceMesh (under torchrun), or save the program and run it with "
            "`autopart run DIR --compile`",
        )
    if live is not None and not isinstance(model, Captured):
        from autopart.runtime.guards import check_current  # lazy: as the Runner below

        check_current(model, "parallelize(model, mesh) again")
        _check_materialized(model)
        broadcast_model(model, timeout_s)  # every rank starts from rank 0's model, as DDP does
        with training_mode(model):  # the training graph; the runner follows the model's mode
            if _world() > 1:  # rank 0 compiles; the others receive their rank's program
                return _compile_once(model, example_inputs, plan, live, timeout_s, compile)
            program = _compile(model, example_inputs, plan)
    else:
        program = _compile(model, example_inputs, plan)
    if live is None:
        return program
    from autopart.runtime.runner import Runner  # lazy: an offline compile imports no runtime

    runner = Runner.from_program(program, live, timeout_s=timeout_s, compile=compile)
    if not isinstance(model, Captured):
        _attach(runner, model)
    return runner


def _check_materialized(model: nn.Module) -> None:
    """The live runner trains real weights, rank 0's handed to every rank: a model built on
    the meta device (torchtitan builds there, shards, then initialises) is refused before
    any collective, naming a tensor, instead of failing on every rank inside the runner with
    torch's "Cannot copy out of meta tensor"."""
    meta = next(
        (
            name
            for name, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta"
        ),
        None,
    )
    if meta is not None:
        raise AutopartError(
            f"the model's {meta} is on the meta device: the live runner trains real weights, "
            "which parallelize broadcasts from rank 0 and hands each rank its slices of",
            hint="materialize and initialise the model before parallelize "
            "(model.to_empty(device='cpu'), then its init, e.g. model.init_weights() or "
            "model.apply(model._init_weights)); only an offline compile, "
            "parallelize(model, autopart.Mesh(...)), takes a model on the meta device",
        )


@contextlib.contextmanager
def training_mode(model: nn.Module) -> Iterator[None]:
    """The live API captures the model in training mode, whatever mode it is in (a Hugging
    Face ``from_pretrained`` model comes in eval mode): the graph then has the model's dropout,
    which the runner's eval graphs take out when the model (followed by the runner) is in eval
    mode. Every module's own mode is put back after."""
    modes = {m: m.training for m in model.modules()}
    model.train()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def _attach(runner: Any, model: nn.Module) -> None:
    """What the live runner takes from the user's module: its state-dict keys (so
    ``full_state_dict()`` gives exactly them), its label convention, and its train/eval mode
    (``Runner.follow``, which also refuses an optimizer over the module's own parameters)."""
    runner.state_keys = list(model.state_dict())
    runner.label_convention = label_convention(model)
    runner.follow(model)


def _compile(model: nn.Module | Captured, example_inputs: Any, plan: Plan) -> Any:
    """Capture (unless given a ``Captured``) and compile: the whole ``Program``. torch's
    random generators are where they were before (the live API compiles on rank 0 only: a
    draw there would put rank 0's generator out of step with the others', which DDP leaves
    alone)."""
    cuda = [] if isinstance(model, Captured) else cuda_devices(model)
    with torch.random.fork_rng(devices=cuda):
        return _compile_forked(model, example_inputs, plan)


def _compile_forked(model: nn.Module | Captured, example_inputs: Any, plan: Plan) -> Any:
    start = time.perf_counter()
    if isinstance(model, Captured):
        captured = model
        if plan.compute_dtype not in (None, captured.dtype):
            raise AutopartError(
                f"precision='bf16' with a model captured in {captured.dtype}",
                hint="pass the model itself, or capture it with "
                "autopart.frontend.capture.capture_mixed(model, example_inputs)",
            )
    else:
        _warn_checkpointing(model, plan)
        log.info("capturing %s with torch.export", type(model).__name__)
        if example_inputs is None:
            captured = _capture_made_up(model, plan)
        else:
            captured = _capture(model, example_inputs, plan)
        nodes = len(captured.graph.graph.nodes)
        log.info("captured %d nodes in %.1f s", nodes, time.perf_counter() - start)
    # refused now, not at the first step: the example batch is taken for the training batch
    plan.check_batch(captured.example_shape[0])
    seq, tp = captured.example_shape[1], plan.mesh.tp
    if plan.sequence_parallel and seq % tp:
        raise AutopartError(
            f"sequence length {seq} is not divisible by tp={tp}, which sequence parallelism needs",
            hint=f"use a sequence length that is a multiple of {tp}, or turn sequence_parallel off",
        )
    program = compile_program(captured, plan)
    log.info(
        "compiled %d rank programs for %s in %.1f s",
        plan.mesh.size,
        plan.mesh,
        time.perf_counter() - start,
    )
    return program


def _capture(model: nn.Module, example_inputs: Any, plan: Plan) -> Captured:
    if plan.compute_dtype is not None:
        return capture_mixed(model, example_inputs, plan.compute_dtype)
    return capture(model, example_inputs)


def _capture_made_up(model: nn.Module, plan: Plan) -> Captured:
    """Capture with ``default_example``'s batch. A model that cannot take that many tokens (a
    table of positions its config does not name) fails to capture, or captures a graph of that
    one length: then with half as many tokens, down to 8, keeping the first capture whose length
    stays symbolic (else the first that captured at all)."""
    ids, labels = default_example(model, plan)
    first: AutopartError | None = None
    fixed: Captured | None = None
    seq = ids.shape[1]
    while seq >= min(8, ids.shape[1]) and not (plan.sequence_parallel and seq % plan.mesh.tp):
        try:
            captured = _capture(model, (ids[:, :seq], labels[:, :seq]), plan)
        except AutopartError as exc:
            first = first or exc
        else:
            if fixed_length(captured.graph) is None:
                return captured
            fixed = fixed or captured
        seq //= 2
    if fixed is not None:
        return fixed
    assert first is not None
    raise AutopartError(
        f"{first.message} (parallelize made the example batch up: {ids.shape[0]} sequences of "
        f"{ids.shape[1]} random tokens, and of fewer down to 8, as no example_inputs were "
        "given)",
        hint=first.hint or "pass example_inputs=(input_ids, labels) like the training batch",
    ) from first


DEFAULT_SEQ = 64  # tokens of the example batch parallelize makes when it is given none
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "block_size", "max_seq_len")


def default_example(model: nn.Module, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """The example batch ``parallelize`` captures with when it is given none: one row per
    micro-batch of every dp replica (``plan.micro_batch`` rows where set), ``DEFAULT_SEQ``
    tokens or the fewer positions the model's config (or the model) says it takes
    (``max_position_embeddings``, ``n_positions``, ``block_size``, ...), random ids below the
    smallest ``nn.Embedding``'s rows (any embedding's valid index, the token table's
    included), and labels as the model takes them. The graph keeps batch and length
    symbolic, so steps of other shapes run; a model whose graph depends on the example's
    length (a scan's block, a table) warns as with any example (docs/capture.md), and one
    that cannot take that many tokens is captured with fewer (``_capture_made_up``)."""
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if not rows:
        raise AutopartError(
            f"parallelize needs example_inputs=(input_ids, labels) for {type(model).__name__}: "
            "it has no nn.Embedding to take token ids from",
            hint="pass example_inputs=(input_ids, labels), int64 (batch, seq) tensors of a "
            "batch like the training one",
        )
    seq = DEFAULT_SEQ
    for holder in (getattr(model, "config", None), model):
        for name in _POSITIONS:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
                seq = min(seq, value)
    batch = plan.mesh.dp * plan.microbatches * (plan.micro_batch or 1)
    if plan.sequence_parallel:
        seq -= seq % plan.mesh.tp
    ids = torch.randint(0, min(rows), (batch, seq), generator=torch.Generator().manual_seed(0))
    if label_convention(model) == "hf":
        return ids, ids.clone()
    return ids, ids.roll(-1, 1)


def _warn_checkpointing(model: nn.Module, plan: Plan) -> None:
    """Hugging Face's ``gradient_checkpointing_enable()`` is inlined by capture: it would
    recompute nothing. Say so, and what does (autopart's recomputation pass)."""
    if getattr(model, "is_gradient_checkpointing", False) and plan.recompute == "none":
        warnings.warn(
            "the model has Hugging Face gradient checkpointing on, which capture inlines: it "
            "recomputes nothing here, and every activation is kept. Pass recompute='full' to "
            "parallelize for the same (every transformer block recomputed in its backward), or "
            "recompute='selective' (attention cores only)",
            stacklevel=3,
        )


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _compile_once(
    model: nn.Module, example_inputs: Any, plan: Plan, live: Any, timeout_s: float, compile: bool
) -> Any:
    """Global rank 0 compiles the program; every rank gets its own rank's part from it
    (``runtime/handover.py``) instead of compiling the whole model itself."""
    # lazy: an offline compile imports no runtime (tests/test_layers.py)
    from autopart.runtime.handover import compiled_on_rank_zero, hand_over
    from autopart.runtime.runner import Runner

    # every rank raises rank 0's compile error (named), not only rank 0
    program = compiled_on_rank_zero(lambda: _compile(model, example_inputs, plan), timeout_s)
    rp, weights, head = hand_over(program, timeout_s, plan.library_ops)
    runner = Runner.from_rank(
        rp, Plan.from_json(head["plan"]), weights, head, live, timeout_s=timeout_s, compile=compile
    )
    _attach(runner, model)
    return runner


def label_convention(model: nn.Module) -> str:
    """How the model's users pass labels: "hf" for Hugging Face models (unshifted, the model
    shifts them), "shifted" for the rest (``labels[:, t]`` is the target of position t)."""
    return "hf" if is_hugging_face(model) else "shifted"


def _given_plan(plan: Any, mesh: Any) -> Plan:
    """The ``Plan`` of ``plan=`` (a planner's ``Ranked`` holds one), checked against ``mesh``."""
    plan = getattr(plan, "plan", plan)
    if not isinstance(plan, Plan):
        raise AutopartError(
            f"plan= takes an autopart Plan or a planner result, not {type(plan).__name__}",
            hint="autopart.Plan(autopart.Mesh(tp=2, pp=2), schedule='1f1b', ...), or "
            "autopart.planning.planner.search(...).ranked[0]",
        )
    if mesh is not None:
        offline, _ = mesh_from(mesh)
        if offline != plan.mesh:
            raise AutopartError(
                f"the mesh {offline} is not the plan's {plan.mesh}",
                hint="pass mesh=None to use the plan's mesh, or a mesh of the plan's shape",
            )
    return plan


def model_digest(model: nn.Module) -> str:
    """The model's tensors as a broadcast sends them: their count, their values and a digest
    of their names, shapes and dtypes in order (a rank that built another model differs)."""
    import hashlib

    tensors = [
        (name, tuple(t.shape), str(t.dtype))
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    ]
    digest = hashlib.sha256(repr(tensors).encode()).hexdigest()[:12]
    values = sum(math.prod(shape) for _, shape, _ in tensors)
    return f"model ({len(tensors)} tensors, {values:,} values, layout {digest})"


def broadcast_model(model: nn.Module, timeout_s: float = 300.0) -> None:
    """Give every rank global rank 0's parameters and buffers (in place, as DDP does when it
    wraps a model), so that the result does not depend on the seed each rank built its model
    with. A model on the meta device has no data and is left alone."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from autopart.runtime.meet import Meeting  # lazy: an offline compile imports no runtime

    meet = Meeting.of_job("parallelize", timeout_s)
    if meet is not None:  # the same model's tensors, in order, or refused before the first
        meet("parallelize", model_digest(model))
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "meta":
                continue
            # NCCL moves device tensors only: a CPU model's tensors go through the GPU
            moved = t.data.to(device) if nccl and t.device.type != "cuda" else t.data
            work = dist.broadcast(moved, src=0, async_op=True)
            wait(work, dist.get_rank(), "broadcasting the model from rank 0", timeout_s)
            if moved is not t.data:
                t.data.copy_(moved)
