"""The ledger beside a measurement: build the model, run tracked steps, pair each with its prediction.

    first, steady = measure_point("qwen2-small", 2, 128)     # a Comparison each: predicted, measured, error
    allocated_reserved(first, steady)                        # allocated / reserved peaks: the allocator's, the model's
    benchmark()                                              # every CPU point, with the peers' estimates beside
    measure_matrix(model, batch, initial, strategies=…, optimizers=…)   # the scenario matrix's cells, measured

torch and trainmech.measure are imported inside the functions that run a model: the ledger itself imports without them.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from trainmech.display import progress
from trainmech.errors import TrainmechError
from trainmech.ledger import allocator as allocator_model
from trainmech.ledger.book import Ledger, training_state_lifecycle
from trainmech.ledger.clock import UPDATES
from trainmech.ledger.inventory import attention_kernel, kernel_of_ops
from trainmech.ledger.recipes import STEP_COUNTER_BYTES, recipe
from trainmech.ledger.shape import model_shape

__all__ = [
    "CPU_POINTS",
    "CUDA_POINTS",
    "MEASURED_PEAK_WITH",
    "CUDA_SLACK_BYTES_PER_LAYER",
    "CUDA_LIFECYCLE_TOLERANCE",
    "clear_blas_workspaces",
    "Comparison",
    "padded_batch",
    "measure_point",
    "AllocatedReserved",
    "allocated_reserved",
    "record_fields",
    "measured_bytes_per_param",
    "UPDATE_TICKS",
    "measured_peaks",
    "measured_saved_after_forward",
    "Measured",
    "tracked_step",
    "measure_matrix",
]

# How `Comparison.measured_peak` was measured, by device type: what a record's metrics.measured_with says
# wherever it carries that peak (Task4's TRAIN-STATE-LEDGER, and Task5's after a strategy).
MEASURED_PEAK_WITH = {
    "cuda": "torch.cuda.max_memory_allocated minus the allocated bytes outside the step (ledger.Comparison)",
    "cpu": "trainmech.measure.StorageTracker (tensor storages)",
}

CPU_POINTS = {"qwen2-tiny": [(1, 32), (2, 128), (4, 256)], "qwen2-small": [(1, 64), (2, 128), (2, 256)]}
CUDA_POINTS = {"qwen2.5-0.5b": [(2, 512)]}


@dataclass
class Comparison:
    """Predicted and measured peak of one (model, batch, seq, step) point.

    kernel: the SDPA kernel the measured forward dispatched (the prediction uses it); rule_kernel: the
    one the ledger's rule picks for this device (`attention_kernel`), the same on a CPU.
    workspace_bytes: what a warm-up forward and backward left allocated (CUDA: the cuBLAS and cuBLASLt
    workspaces, measured; None without a warm-up or off CUDA). history: the CUDA allocator's history of
    the point's steps (`measure_point(memory_history=True)`; empty off CUDA).
    """

    model: str
    batch: int
    seq: int
    step: str  # "first" | "steady"
    predicted: Ledger
    measured: Any  # trainmech.measure.StepMemory
    micro_batch: int = 1
    kernel: str = ""
    rule_kernel: str = ""
    workspace_bytes: int | None = None
    history: Any = field(default=None, repr=False)  # trainmech.measure.MemoryHistory
    measured_peak: int = field(init=False)

    def __post_init__(self):
        # on CUDA the allocator is the machine's own count; elsewhere the tracked tensor bytes
        allocated = self.measured.step_peak_allocated_bytes
        self.measured_peak = allocated if allocated is not None else self.measured.peak_bytes

    @property
    def predicted_peak(self) -> int:
        return self.predicted.peak_overlap().bytes

    @property
    def error(self) -> float:
        """(predicted − measured) / measured."""
        return (self.predicted_peak - self.measured_peak) / self.measured_peak

    @property
    def tracked_peak(self) -> int:
        """The tracked tensor peak on any device (on CUDA `measured_peak` is the allocator's, with its rounding)."""
        return self.measured.peak_bytes

    @property
    def tracked_error(self) -> float:
        """(predicted − tracked) / tracked: the ledger's tensor accounting alone."""
        return (self.predicted_peak - self.tracked_peak) / self.tracked_peak

    @property
    def measured_forward_backward_peak(self) -> int:
        """The measured peak before the update (baseline included): forward, loss and backward events."""
        return self.measured.forward_backward_peak()

    def measured_crossing_lifecycles(self) -> dict[tuple, int]:
        """(category, born phase, released phase) -> bytes of the measured storages that cross a phase boundary."""
        return {k: v for k, v in self.measured.lifecycles().items() if k[1] != k[2]}

    def lifecycle_differences(self, tolerance: tuple[float, int] = (0.0, 0)) -> dict[tuple, tuple[int, int]]:
        """(category, created phase, released phase) -> (ledger bytes, measured bytes), key by key, over the
        states that cross a phase boundary, where the two differ by more than the tolerance: (relative,
        bytes), the larger of the two allowances applies (CPU: none; CUDA: CUDA_LIFECYCLE_TOLERANCE)."""
        ours = self.predicted.crossing_lifecycles()
        theirs = self.measured_crossing_lifecycles()
        relative, floor = tolerance
        out = {}
        for k in ours.keys() | theirs.keys():
            a, b = ours.get(k, 0), theirs.get(k, 0)
            if abs(a - b) > max(floor, relative * max(a, b)):
                out[k] = (a, b)
        return out

    def lifecycle_line(self, tolerance: tuple[float, int] = (0.0, 0)) -> str:
        """One line: the measured crossing groups, their bytes summed over the whole step (they are not
        alive at once, so the sum can exceed the peak), and where the ledger differs beyond the tolerance."""
        theirs = self.measured_crossing_lifecycles()
        return (
            f"{self.step:<7} update: {len(theirs)} measured (category, created, released) groups that cross a "
            f"phase, {sum(theirs.values()):,} bytes over the step; differences: "
            f"{self.lifecycle_differences(tolerance) or 'none'}"
        )


# What a CUDA run's tracked storage bytes may differ from the ledger by, per decoder layer: storage bytes
# are exact on any device (the tracker counts the device's storages only, the host's apart), so the
# allowance is for a scalar a kernel keeps that the inventory does not name, and stays below the smallest
# error the per-layer checks exist for: one int64 element (8 B) of an SDPA kernel's RNG state weighed
# wrong, a missing seed or offset (16-24 B), a logsumexp (4 B × heads × rows). Whole-step quantities get
# it once per layer; the CPU gets none.
CUDA_SLACK_BYTES_PER_LAYER = 4

# What a CUDA run's lifecycles are held to, key by key (relative, bytes): the per-layer slack for each
# (category, created, released) group, which holds at most one layer's phase pair; a wrong category or
# phase moves whole tensors.
CUDA_LIFECYCLE_TOLERANCE = (0.0, CUDA_SLACK_BYTES_PER_LAYER)


def padded_batch(batch: int, seq: int) -> dict:
    """`batch` rows of the domain text, row i shorter by i·seq/(2·batch) tokens, right-padded to seq."""
    from trainmech import workload

    if batch < 2:
        raise TrainmechError("a padded batch needs rows of different lengths: batch >= 2")
    rows = workload.lm_batch("domain", batch, seq)["input_ids"].tolist()
    return workload.pad_batch([row[: seq - i * seq // (2 * batch)] for i, row in enumerate(rows)])


def _optimizer(params, impl: str, in_backward: bool):
    from trainmech import optimizers

    if in_backward:
        return optimizers.OptimizerInBackward(params, lambda ps: optimizers.adamw(ps, impl, lr=1e-4))
    return optimizers.adamw(params, impl, lr=1e-4)


def clear_blas_workspaces() -> bool:
    """Free the cuBLAS and cuBLASLt workspaces this process keeps, one per (handle, stream), so that the
    next matmul on each allocates its own again. torch.cuda.empty_cache() does not free them (they are
    allocated blocks, not cached ones); torch._C._cuda_clearCublasWorkspaces() does. It is private: a
    CUDA build of torch has it (2.11 through 2.13, which torch._inductor.cudagraph_trees calls before a
    graph capture), a CPU build does not, so it is looked up with hasattr. Returns whether it ran."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


def _warm_up(model, data: dict, attention_context, precision) -> int | None:
    """One forward and backward before the measured steps, its gradients dropped (no update: the first
    measured step is still AdamW's first). cuBLAS and cuBLASLt create their workspaces on a handle's first
    matmul on a stream (the backward's device thread has a handle of its own) through the caching
    allocator and keep them: the bytes still allocated after the warm-up that were not before are those
    workspaces, measured (CUDA; None elsewhere). `measure_point` frees the ones an earlier model left
    (`clear_blas_workspaces`) first, or this warm-up would find them there and measure 0. Their size
    depends on the torch version and on CUBLAS_WORKSPACE_CONFIG / CUBLASLT_WORKSPACE_SIZE, so the ledger
    never assumes one."""
    from trainmech import measure

    device = next(model.parameters()).device
    before = measure.cuda_allocated(device)
    with attention_context(), precision():
        loss = model(**data, use_cache=False).loss
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    after = measure.cuda_allocated(device)
    return None if before is None else after - before


def measure_point(
    model: str,
    batch: int,
    seq: int,
    *,
    run_mode: str = "cpu",
    seed: int = 0,
    dtype: str = "fp32",
    attention: str = "auto",
    steps: tuple[str, ...] = UPDATES,
    optimizer_impl: str = "auto",
    optimizer_in_backward: bool = False,
    checkpointing: str = "none",
    padded: bool = False,
    micro_batches: int = 1,
    set_to_none: bool = True,
    allocator: str | None = None,
    warmup: bool | None = None,
    memory_history: bool = False,
    attention_dropout: float = 0.0,
) -> list[Comparison]:
    """Build the profile's model, run tracked steps (the first, then a steady one) and pair each with its prediction.

    dtype: fp32 / bf16 (the model in that dtype) or autocast-bf16 / autocast-fp16 (an fp32 model, the
    forward under torch.autocast). attention other than "auto" forces that SDPA kernel
    (torch.nn.attention.sdpa_kernel); "auto" lets torch choose, and the prediction takes the kernel the
    tracked forward dispatched (`Comparison.kernel`; `rule_kernel` is the ledger's own rule).
    optimizer_impl forces AdamW's loop / foreach / fused; optimizer_in_backward steps each parameter in
    its post-accumulate-grad hook. checkpointing "full": transformers' gradient checkpointing. padded:
    rows of different lengths, hence an attention mask. micro_batches: each step accumulates that many
    micro-batches; the comparisons are its first and last. set_to_none=False: zero_grad keeps the
    gradients as zeros. steps=("first",) stops after the first step. allocator: whose peaks come along
    (trainmech.measure.training_step_memory): CUDA's by default on a GPU, "cpu-profiler" for the CPU
    allocator's, with which a CPU runs the bookkeeping a GPU run relies on. warmup (default: on CUDA): one
    forward and backward first, which measures the cuBLAS workspaces (`_warm_up`; on CUDA after freeing
    the ones this process already kept; None where they cannot be freed). memory_history: record
    the CUDA allocator's history of the measured steps, after the model is built and warmed up, so that
    only the steps' own blocks are in it (`Comparison.history`; empty off CUDA). On CUDA the allocator's
    cache is emptied first: what earlier models left cached does not count in this point's reserved peak.
    attention_dropout: the config's attention dropout, drawn in the train-mode forward (on a CPU SDPA then
    runs its math composite: `attention_kernel`).
    """
    import gc

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainmech import measure, profiles, workload

    if tuple(steps) not in (("first",), UPDATES):
        raise TrainmechError(
            f"steps must be ('first',) or ('first', 'steady'), got {tuple(steps)!r}: a steady step needs a first one before it"
        )
    dtypes = recipe(dtype)
    if dtypes.master_bytes:
        raise TrainmechError(
            f"measure_point runs fp32, bf16 or autocast recipes, not {dtype!r} (paper accounting)"
        )
    profile = profiles.for_mode(run_mode)
    device = torch.device("cuda" if profile.device == "cuda" else "cpu")
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    model_dtype = (
        torch.float32
        if dtypes.autocast or dtypes.weight_bytes == 4
        else torch.bfloat16
        if dtype == "bf16"
        else torch.float16
    )
    autocast = {"autocast-bf16": torch.bfloat16, "autocast-fp16": torch.float16}.get(dtype)
    built = workload.build_model(
        profile.model(model), seed=seed, dtype=model_dtype, device=device, attention_dropout=attention_dropout
    )
    if checkpointing == "full":
        enable = (
            getattr(built.model, "activation_checkpointing_enable", None)
            or built.model.gradient_checkpointing_enable
        )
        enable()
    data = padded_batch(batch, seq) if padded else workload.lm_batch("domain", batch, seq)
    data = {k: t.to(device) for k, t in data.items()}
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }

    def attention_context():
        return sdpa_kernel(backends[attention]) if attention in backends else nullcontext()

    workspace = None
    if device.type == "cuda" if warmup is None else warmup:  # before the optimizer: its hooks must not step
        precision = (lambda: torch.autocast(device.type, dtype=autocast)) if autocast else nullcontext
        cleared = device.type == "cuda" and clear_blas_workspaces()  # an earlier model's: not this warm-up's
        if cleared:
            torch.cuda.empty_cache()
        workspace = _warm_up(built.model, data, attention_context, precision)
        if not cleared:
            workspace = None  # workspaces that could not be freed would be measured as 0: unknown instead
    optimizer = _optimizer(built.model.parameters(), optimizer_impl, optimizer_in_backward)
    shape = model_shape(built.model.config)
    dropout = attention_dropout > 0
    rule = attention_kernel(shape, dtype, device.type, attention, padded=padded, dropout=dropout)
    out = []
    recording = (
        measure.cuda_memory_history(device) if memory_history else nullcontext(measure.MemoryHistory())
    )
    try:
        with recording as history:
            for step in steps:
                for k in range(1, micro_batches + 1):
                    with attention_context():
                        measured = measure.training_step_memory(
                            built.model,
                            optimizer,
                            data,
                            grads_at_start=k > 1 or (not set_to_none and step != "first"),
                            update=k == micro_batches,
                            set_to_none=set_to_none,
                            autocast=autocast,
                            allocator=allocator,
                        )
                    if k in (1, micro_batches):
                        seen = _dispatched_kernel(measured, checkpointing)
                        predicted = training_state_lifecycle(
                            shape,
                            batch,
                            seq,
                            dtype=dtype,
                            device=device.type,
                            first_step=step == "first",
                            attention=seen or rule,
                            optimizer_impl=optimizer_impl,
                            optimizer_in_backward=optimizer_in_backward,
                            checkpointing=checkpointing,
                            padded=padded,
                            micro_batches=micro_batches,
                            micro_batch=k,
                            set_to_none=set_to_none,
                            weigh_rng=device.type
                            == "cuda",  # the RNG state of the kernel that ran, weighed here
                            dropout=dropout,
                        )
                        out.append(
                            Comparison(
                                model,
                                batch,
                                seq,
                                step,
                                predicted,
                                measured,
                                k,
                                seen or "unknown",
                                rule,
                                workspace,
                            )
                        )
    finally:
        if optimizer_in_backward:
            optimizer.remove()
    for c in out:
        c.history = history
    return out


def _dispatched_kernel(step, checkpointing: str) -> str | None:
    """The SDPA kernel of the forward whose tensors the backward reads: under checkpointing the recompute
    inside the backward (a reentrant checkpoint runs the first forward without grad, where SDPA may pick
    another kernel, and that forward saves nothing), otherwise the forward's layers."""
    if checkpointing != "none":
        recomputed = kernel_of_ops(a.op for a in step.allocations if a.recomputed)
        if recomputed:
            return recomputed
    return kernel_of_ops(a.op for a in step.allocations if a.born_phase.startswith("forward.layer"))


def measured_bytes_per_param(model: str, dtype: str, *, run_mode: str = "cpu", seed: int = 0) -> int | float:
    """Model-state bytes per parameter measured in a first AdamW update: the weights, every gradient when
    the update starts, and the two moments it creates (AdamW's per-tensor step counters left out)."""
    (point,) = measure_point(model, 1, 16, run_mode=run_mode, seed=seed, dtype=dtype, steps=("first",))
    step, shape = point.measured, point.predicted.shape
    gradients = step.by_category(step.phases.index("optimizer"))["gradients"]
    counters = STEP_COUNTER_BYTES * len(
        shape.parameter_tensors()
    )  # state["step"]: the tracker sees it on the host too
    moments = step.by_category(len(step.live) - 1)["optimizer_states"] - counters
    total = step.baseline["parameters"] + gradients + moments
    return total // shape.n_params if total % shape.n_params == 0 else total / shape.n_params


# ----------------------------------------------------------------------------- the scenario matrix, measured


UPDATE_TICKS = ("optimizer", "zero_grad")  # a tracked step's events after its backward


def measured_peaks(step_memory) -> tuple[int, int]:
    """(forward + backward peak, whole-update peak) of a tracked step (trainmech.measure.StepMemory), in
    tracked tensor bytes with the baseline the step started from."""
    base = sum(step_memory.baseline.values())
    before_update = [
        live for live, phase in zip(step_memory.live, step_memory.phases) if phase not in UPDATE_TICKS
    ]
    return base + max(before_update), step_memory.peak_bytes


def measured_saved_after_forward(step_memory) -> int:
    """Saved bytes alive at the last event of a tracked step's forward (the loss included)."""
    last = max(k for k, phase in enumerate(step_memory.phases) if phase.startswith(("forward", "loss")))
    return step_memory.by_category(last)["saved"]


@dataclass(frozen=True)
class Measured:
    """One scenario measured: tracked tensor bytes (any device), and the CUDA allocator's peaks (None elsewhere)."""

    forward_backward_bytes: int
    whole_bytes: int
    forward_backward_allocated: int | None = None
    whole_allocated: int | None = None
    whole_reserved: int | None = None


def tracked_step(model, optimizer, batch: dict, context=None):
    """One tracked training step (trainmech.measure.training_step_memory) inside `context(model)`, if given."""
    from trainmech import measure

    with context(model) if context is not None else nullcontext():
        return measure.training_step_memory(model, optimizer, batch)


def measure_matrix(
    model, batch: dict, initial: dict, *, strategies: dict, optimizers: dict
) -> dict[tuple, Measured]:
    """Each (strategy, update, optimizer): a fresh optimizer from `optimizers[name](params)` on the initial weights,
    then the first update and a steady one, each tracked; on CUDA the same two updates again, untracked, with
    the allocator's peaks read after the backward and after the step. strategies: name -> (model -> context) or None."""
    device = next(model.parameters()).device
    out = {}
    cells = list(product(optimizers.items(), strategies.items()))
    for (opt_name, make), (name, context) in progress(cells, desc="scenarios", unit="scenario"):
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        optimizer = make(model.parameters())
        tracked = [measured_peaks(tracked_step(model, optimizer, batch, context)) for _ in UPDATES]
        getattr(optimizer, "remove", lambda: None)()
        probes = [(None, None, None)] * len(UPDATES)
        if device.type == "cuda":
            model.load_state_dict(initial)
            optimizer = make(model.parameters())
            probes = [_allocator_probe(model, optimizer, batch, context) for _ in UPDATES]
            getattr(optimizer, "remove", lambda: None)()
        for update, (fb, whole), probe in zip(UPDATES, tracked, probes):
            out[(name, update, opt_name)] = Measured(fb, whole, *probe)
    model.load_state_dict(initial)
    return out


def _allocator_probe(model, optimizer, batch: dict, context) -> tuple[int, int, int]:
    """CUDA: (forward + backward allocated peak, whole-update allocated peak, whole-update reserved peak) of one update."""
    import torch

    from trainmech import measure

    device = next(model.parameters()).device
    torch.cuda.empty_cache()
    measure.reset_cuda_peaks(device)
    with context(model) if context is not None else nullcontext():
        model(**batch, use_cache=False).loss.backward()
    forward_backward = measure.cuda_peaks(device)["peak_allocated_bytes"]
    optimizer.step()
    whole = measure.cuda_peaks(device)
    optimizer.zero_grad(set_to_none=True)
    return forward_backward, whole["peak_allocated_bytes"], whole["peak_reserved_bytes"]


@dataclass(frozen=True)
class AllocatedReserved:
    """已分配显存与保留显存 (allocated / reserved memory) of one step: the peaks an allocator counted, beside
    the tracked tensors and the allocator model's prediction of both.

    source: "cuda" (torch.cuda's statistics) or "cpu-profiler" (the CPU allocator under torch.profiler).
    measured_allocated: the allocator's peak over the step minus what was on the device besides the
    baseline (`StepMemory.step_peak_allocated_bytes`); measured_reserved: the CUDA allocator's reserved
    peak (None: the CPU allocator reserves nothing it reports). model: the CUDA caching allocator's
    model (`ledger.allocator.cuda_peaks`) replaying the first update and then this one.
    """

    source: str
    tracked_bytes: int
    measured_allocated: int
    measured_reserved: int | None
    model: Any  # trainmech.ledger.allocator.CudaPeaks

    @property
    def tracked_error(self) -> float:
        """(allocator − tracked) / tracked: what the allocator holds beyond tensor storages (rounding, scratch)."""
        return self.measured_allocated / self.tracked_bytes - 1

    @property
    def allocated_error(self) -> float:
        """(model − measured) / measured of the allocated peak."""
        return self.model.allocated_peak / self.measured_allocated - 1

    @property
    def reserved_error(self) -> float | None:
        """(model − measured) / measured of the reserved peak; None where the allocator reports none."""
        if self.measured_reserved is None:
            return None
        return self.model.reserved_peak / self.measured_reserved - 1

    def lines(self) -> list[str]:
        """The allocated peak beside the tracked tensors; on CUDA the allocator model's two peaks beside it."""
        who = "the CPU allocator, counted by torch.profiler" if self.source == "cpu-profiler" else "CUDA"
        out = [
            f"allocated peak of the update ({who}): {self.measured_allocated:,}   "
            f"tracked tensors {self.tracked_bytes:,} ({self.tracked_error:+.2%})"
        ]
        if self.measured_reserved is None:
            return out + [
                "reserved peak: unknown (this allocator reports none); the allocator model predicts CUDA's "
                "caching allocator, which does not run here"
            ]
        return out + [
            f"allocator model: allocated {self.model.allocated_peak:,} ({self.allocated_error:+.1%}), reserved "
            f"{self.model.reserved_peak:,} ({self.reserved_error:+.1%} of the measured {self.measured_reserved:,}, "
            "whole process)"
        ]


def allocated_reserved(first: Comparison, steady: Comparison) -> AllocatedReserved:
    """The steady update's allocated / reserved peaks (measured with an allocator: CUDA's, or
    allocator="cpu-profiler"), beside its tracked tensor peak and the allocator model's replay of the
    first update and then this one."""
    got = steady.measured
    if got.step_peak_allocated_bytes is None:
        raise TrainmechError(
            "this step was measured without an allocator: measure_point(..., allocator='cpu-profiler') on a CPU, "
            "or on CUDA, where the caching allocator is counted by default"
        )
    return AllocatedReserved(
        "cpu-profiler" if got.peak_reserved_bytes is None else "cuda",
        got.peak_bytes,
        got.step_peak_allocated_bytes,
        got.peak_reserved_bytes,
        allocator_model.cuda_peaks(first.predicted, steady.predicted),
    )


def record_fields(
    point: Comparison, points: list[Comparison], *, worst_error: float, on_cuda: bool, updates=None
) -> dict:
    """The `resources`, `metrics` and `correctness` of a TRAIN-STATE-LEDGER record: one point predicted
    against measured, beside every point of the run (`model/bBsS/step` -> bytes and error).

    resources: the CUDA allocator's peaks of the step itself (allocated: `step_peak_allocated_bytes`,
    what else the process held subtracted; reserved: after `measure_point` emptied the cache), null on a
    CPU. metrics: `measured_*` in the instrument `measured_with` names (the allocator on CUDA, the tracker
    on a CPU), `tracked_*` always the tracker's tensor storages. correctness: whether the loss and every
    gradient of `updates` (default: the point alone) were finite, and how many updates that makes
    effective: an update that ran (optimizer.step()) with a finite loss and finite gradients is effective,
    one that did not run is skipped; a non-finite update that ran is neither (it was applied). On CUDA the
    point must carry the allocator's peaks (refused otherwise)."""

    def key(c: Comparison) -> str:
        return f"{c.model}/b{c.batch}s{c.seq}/{c.step}"

    peak, measured = point.predicted.peak_overlap(), point.measured
    if on_cuda and measured.peak_allocated_bytes is None:
        raise TrainmechError(
            "a CUDA record needs the allocator's peaks: this point was measured without them"
        )
    steps = [c.measured for c in (updates or [point])]
    finite = [m.all_finite for m in steps]
    all_finite = None if None in finite else all(finite)
    stepped = [m.stepped is not False for m in steps]  # None (not recorded): the step is assumed to have run
    forward_backward = measured.forward_backward_allocated_bytes if on_cuda else None
    return {
        "resources": {
            "peak_allocated_bytes": measured.step_peak_allocated_bytes if on_cuda else None,
            "peak_reserved_bytes": measured.peak_reserved_bytes if on_cuda else None,
        },
        "correctness": {
            "all_finite": all_finite,
            "skipped_updates": sum(not ran for ran in stepped),
            "effective_updates": None
            if all_finite is None
            else sum(ran and bool(f) for ran, f in zip(stepped, finite)),
        },
        "metrics": {
            "predicted_peak_bytes": point.predicted_peak,
            "measured_peak_bytes": point.measured_peak,
            "peak_error": point.error,
            "measured_with": MEASURED_PEAK_WITH["cuda" if on_cuda else "cpu"],
            "tracked_peak_bytes": measured.peak_bytes,
            "cpu_tracked_peak_bytes": None if on_cuda else measured.peak_bytes,
            "worst_abs_error_all_points": worst_error,
            "attention_kernel": point.kernel,
            "attention_kernel_rule": point.rule_kernel,
            "optimizer_impl": point.predicted.setup.optimizer_impl,
            "predicted_peak_phase": peak.phase,
            "measured_peak_phase": measured.peak_phase,
            "predicted_forward_backward_peak_bytes": point.predicted.forward_backward_peak().bytes,
            "measured_forward_backward_peak_bytes": forward_backward
            if on_cuda
            else point.measured_forward_backward_peak,
            "tracked_forward_backward_peak_bytes": point.measured_forward_backward_peak,
            "blas_workspace_bytes": point.workspace_bytes,
            "allocated_outside_step_bytes": measured.outside_bytes,
            "predicted_by_category": peak.by_category,
            "measured_by_category": measured.by_category(),
            "points_predicted_bytes": {key(c): c.predicted_peak for c in points},
            "points_measured_bytes": {key(c): c.measured_peak for c in points},
            "points_error": {key(c): c.error for c in points},
        },
    }
