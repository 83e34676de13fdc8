"""The ledger beside a measurement: build the model, run tracked steps, pair each with its prediction.

    first, steady = measure_point("qwen2-small", 2, 128)     # a Comparison each: predicted, measured, error
    allocator_peaks(first, steady)                           # the allocator model beside an allocator's own peaks
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
from trainmech.ledger.recipes import recipe
from trainmech.ledger.shape import model_shape

__all__ = [
    "CPU_POINTS",
    "CUDA_POINTS",
    "STEPS",
    "MEASURED_PEAK_WITH",
    "Comparison",
    "padded_batch",
    "measure_point",
    "AllocatorPeaks",
    "allocator_peaks",
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
STEPS = ("first", "steady")


@dataclass
class Comparison:
    """Predicted and measured peak of one (model, batch, seq, step) point."""

    model: str
    batch: int
    seq: int
    step: str  # "first" | "steady"
    predicted: Ledger
    measured: Any  # trainmech.measure.StepMemory
    micro_batch: int = 1
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

    def lifecycle_differences(self) -> dict[tuple, tuple[int, int]]:
        """(category, created phase, released phase) -> (ledger bytes, measured bytes) where they differ,
        over the states that cross a phase boundary."""
        ours = self.predicted.crossing_lifecycles()
        theirs = self.measured_crossing_lifecycles()
        return {
            k: (ours.get(k, 0), theirs.get(k, 0))
            for k in ours.keys() | theirs.keys()
            if ours.get(k, 0) != theirs.get(k, 0)
        }

    def lifecycle_bytes_error(self) -> float:
        """|ledger − measured| / measured of the bytes of every state that crosses a phase boundary: what
        a CUDA run is held to, where kernels keep a few bytes of their own (padded rows, host-side RNG state)."""
        ours = sum(self.predicted.crossing_lifecycles().values())
        theirs = sum(self.measured_crossing_lifecycles().values())
        return abs(ours - theirs) / theirs

    def lifecycle_line(self) -> str:
        """One line: the measured crossing groups and their bytes, and where the ledger differs."""
        theirs = self.measured_crossing_lifecycles()
        return (
            f"{self.step:<7} update: {len(theirs)} measured lifecycle groups, {sum(theirs.values()):,} bytes; "
            f"differences: {self.lifecycle_differences() or 'none'}"
        )


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


def measure_point(
    model: str,
    batch: int,
    seq: int,
    *,
    run_mode: str = "cpu",
    seed: int = 0,
    dtype: str = "fp32",
    attention: str = "auto",
    steps: tuple[str, ...] = STEPS,
    optimizer_impl: str = "auto",
    optimizer_in_backward: bool = False,
    checkpointing: str = "none",
    padded: bool = False,
    micro_batches: int = 1,
    set_to_none: bool = True,
    allocator: str | None = None,
) -> list[Comparison]:
    """Build the profile's model, run tracked steps (the first, then a steady one) and pair each with its prediction.

    dtype: fp32 / bf16 (the model in that dtype) or autocast-bf16 / autocast-fp16 (an fp32 model, the
    forward under torch.autocast). attention other than "auto" forces that SDPA kernel
    (torch.nn.attention.sdpa_kernel). optimizer_impl forces AdamW's loop / foreach / fused;
    optimizer_in_backward steps each parameter in its post-accumulate-grad hook. checkpointing "full":
    transformers' gradient checkpointing. padded: rows of different lengths, hence an attention mask.
    micro_batches: each step accumulates that many micro-batches; the comparisons are its first and last.
    set_to_none=False: zero_grad keeps the gradients as zeros. steps=("first",) stops after the first step.
    allocator: whose peaks come along (trainmech.measure.training_step_memory): CUDA's by default on a GPU,
    "cpu-profiler" for the CPU allocator's, with which a CPU runs the bookkeeping a GPU run relies on.
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainmech import measure, profiles, workload

    if tuple(steps) not in (("first",), STEPS):
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
    model_dtype = (
        torch.float32
        if dtypes.autocast or dtypes.weight_bytes == 4
        else torch.bfloat16
        if dtype == "bf16"
        else torch.float16
    )
    autocast = {"autocast-bf16": torch.bfloat16, "autocast-fp16": torch.float16}.get(dtype)
    built = workload.build_model(profile.model(model), seed=seed, dtype=model_dtype, device=device)
    if checkpointing == "full":
        enable = (
            getattr(built.model, "activation_checkpointing_enable", None)
            or built.model.gradient_checkpointing_enable
        )
        enable()
    data = padded_batch(batch, seq) if padded else workload.lm_batch("domain", batch, seq)
    data = {k: t.to(device) for k, t in data.items()}
    optimizer = _optimizer(built.model.parameters(), optimizer_impl, optimizer_in_backward)
    shape = model_shape(built.model.config)
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    out = []
    try:
        for step in steps:
            for k in range(1, micro_batches + 1):
                with sdpa_kernel(backends[attention]) if attention in backends else nullcontext():
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
                    predicted = training_state_lifecycle(
                        shape,
                        batch,
                        seq,
                        dtype=dtype,
                        device=device.type,
                        first_step=step == "first",
                        attention=attention,
                        optimizer_impl=optimizer_impl,
                        optimizer_in_backward=optimizer_in_backward,
                        checkpointing=checkpointing,
                        padded=padded,
                        micro_batches=micro_batches,
                        micro_batch=k,
                        set_to_none=set_to_none,
                    )
                    out.append(Comparison(model, batch, seq, step, predicted, measured, k))
    finally:
        if optimizer_in_backward:
            optimizer.remove()
    return out


def measured_bytes_per_param(model: str, dtype: str, *, run_mode: str = "cpu", seed: int = 0) -> int | float:
    """Model-state bytes per parameter measured in a first AdamW update: the weights, every gradient when
    the update starts, and the two moments it creates (AdamW's per-tensor step counters left out)."""
    (point,) = measure_point(model, 1, 16, run_mode=run_mode, seed=seed, dtype=dtype, steps=("first",))
    step, shape = point.measured, point.predicted.shape
    gradients = step.by_category(step.phases.index("optimizer"))["gradients"]
    counters = 4 * len(shape.parameter_tensors())  # state["step"]: the tracker sees it on the host too
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
        tracked = [measured_peaks(tracked_step(model, optimizer, batch, context)) for _ in STEPS]
        getattr(optimizer, "remove", lambda: None)()
        probes = [(None, None, None)] * len(STEPS)
        if device.type == "cuda":
            model.load_state_dict(initial)
            optimizer = make(model.parameters())
            probes = [_allocator_probe(model, optimizer, batch, context) for _ in STEPS]
            getattr(optimizer, "remove", lambda: None)()
        for update, (fb, whole), probe in zip(STEPS, tracked, probes):
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
class AllocatorPeaks:
    """One step's peaks as an allocator counted them, beside the tracked tensors and the allocator model.

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
        out = [
            f"allocated peak of the update ({self.source}): measured {self.measured_allocated:,}   "
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


def allocator_peaks(first: Comparison, steady: Comparison) -> AllocatorPeaks:
    """The steady update's allocator peaks (measured with an allocator: CUDA's, or allocator="cpu-profiler"),
    beside its tracked tensor peak and the allocator model's replay of the first update and then this one."""
    got = steady.measured
    if got.step_peak_allocated_bytes is None:
        raise TrainmechError(
            "this step was measured without an allocator: measure_point(..., allocator='cpu-profiler') on a CPU, "
            "or on CUDA, where the caching allocator is counted by default"
        )
    return AllocatorPeaks(
        "cpu-profiler" if got.peak_reserved_bytes is None else "cuda",
        got.peak_bytes,
        got.step_peak_allocated_bytes,
        got.peak_reserved_bytes,
        allocator_model.cuda_peaks(first.predicted, steady.predicted),
    )


def record_fields(
    point: Comparison, points: list[Comparison], *, worst_error: float, kernel: str, on_cuda: bool
) -> dict:
    """The `resources` and `metrics` of a TRAIN-STATE-LEDGER record: one point predicted against measured,
    beside every point of the run (`model/bBsS/step` -> bytes and error). CPU: the CUDA allocator's
    fields are null and the peak is the tracked tensor storages'. On CUDA the point must carry the
    allocator's peaks (refused otherwise: a CUDA record with a null peak would say nothing)."""

    def key(c: Comparison) -> str:
        return f"{c.model}/b{c.batch}s{c.seq}/{c.step}"

    peak, measured = point.predicted.peak_overlap(), point.measured
    if on_cuda and measured.peak_allocated_bytes is None:
        raise TrainmechError(
            "a CUDA record needs the allocator's peaks: this point was measured without them"
        )
    return {
        "resources": {
            "peak_allocated_bytes": measured.peak_allocated_bytes if on_cuda else None,
            "peak_reserved_bytes": measured.peak_reserved_bytes if on_cuda else None,
        },
        "metrics": {
            "predicted_peak_bytes": point.predicted_peak,
            "measured_peak_bytes": point.measured_peak,
            "cpu_tracked_peak_bytes": None if on_cuda else measured.peak_bytes,
            "peak_error": point.error,
            "worst_abs_error_all_points": worst_error,
            "attention_kernel": kernel,
            "optimizer_impl": point.predicted.setup.optimizer_impl,
            "predicted_peak_phase": peak.phase,
            "measured_peak_phase": measured.peak_phase,
            "predicted_forward_backward_peak_bytes": point.predicted.forward_backward_peak().bytes,
            "measured_forward_backward_peak_bytes": point.measured_forward_backward_peak,
            "predicted_by_category": peak.by_category,
            "measured_by_category": measured.by_category(),
            "measured_with": MEASURED_PEAK_WITH["cuda" if on_cuda else "cpu"],
            "points_predicted_bytes": {key(c): c.predicted_peak for c in points},
            "points_measured_bytes": {key(c): c.measured_peak for c in points},
            "points_error": {key(c): c.error for c in points},
        },
    }
