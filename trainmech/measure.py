"""Measurements: step-time statistics (median / P95) and memory peaks.

Times are wall-clock seconds from `time.perf_counter`, with CUDA synchronised around each
sample when the work runs on a GPU. On a CPU a time is a behaviour check at most: it is written
into records and run.json, never printed into a notebook's compared outputs.

Memory: one tracked training step (`training_step_memory` -> `StepMemory`) and the allocators' own
running totals (`allocator_window`). The tracker itself lives in `trainmech.storage_tracker`, the
memory histories in `trainmech.memory_history`; their public names are re-exported here.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _disable_current_modes

from trainmech import memory_history, storage_tracker
from trainmech.errors import TrainmechError
from trainmech.memory_history import (  # noqa: F401  re-exported: the notebooks write measure.<name>
    ALLOCATOR_ONLY,
    FINITENESS_CHECK,
    HistoryBlock,
    MemoryHistory,
    cuda_memory_history,
    history_from_tracker,
    step_history,
)
from trainmech.storage_tracker import (  # noqa: F401  re-exported
    FORWARD_PHASES,
    MEMORY_CATEGORIES,
    REBUILDS,
    Allocation,
    StorageTracker,
    born_as,
    phase_hooks,
)

__all__ = [
    "percentile",
    "time_stats",
    "timed",
    "cuda_peaks",
    "reset_cuda_peaks",
    "cuda_allocated",
    "StepMemory",
    "training_step_memory",
    "ALLOCATORS",
    "AllocatorWindow",
    "allocator_window",
    "allocator_peak_cpu",
    *storage_tracker.__all__,  # re-exported
    *memory_history.__all__,
]


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_stats(samples: list[float]) -> dict[str, float]:
    """{"step_time_median_s", "step_time_p95_s"} of per-step seconds (the record's field names)."""
    return {"step_time_median_s": statistics.median(samples), "step_time_p95_s": percentile(samples, 95)}


def timed(fn: Callable[[], object], device: torch.device | None = None) -> tuple[object, float]:
    """Run fn once; return (its result, seconds). Synchronises CUDA before and after."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def cuda_peaks(device: torch.device) -> dict[str, int | None]:
    """Peak allocated / reserved bytes since the last reset; None (unknown) off CUDA."""
    if device.type != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }


def reset_cuda_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def cuda_allocated(device: torch.device) -> int | None:
    """Bytes held by live tensors right now (the base an incremental peak is measured from); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


@dataclass
class StepMemory:
    """Live bytes over one tracked training step, and what they were.

    `baseline`: bytes alive before the step, by category (parameters; optimizer states after the
    first step). `live[k]`: tracked bytes after event k, baseline excluded. On CUDA the allocator's
    own peaks come along; off CUDA they are None (unknown, not zero). `device`: the device type whose
    storages these counts are (None: every storage); the storages elsewhere (the host, on a CUDA step)
    are in `elsewhere` and `baseline_elsewhere`, outside every count above (`elsewhere_at_end`).
    """

    baseline: dict[str, int]
    allocations: list[Allocation]
    live: list[int]
    phases: list[str]
    peak_allocated_bytes: int | None = None  # torch.cuda.max_memory_allocated over the step
    peak_reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved over the step
    outside_bytes: int | None = (
        None  # CUDA: allocated bytes at the start that are not baseline (batch, other tensors)
    )
    forward_backward_allocated_bytes: int | None = (
        None  # CUDA: the allocator's peak up to the end of the backward, minus outside_bytes
    )
    all_finite: bool | None = (
        None  # the loss and every gradient after the backward finite; None: no gradient left to check
    )
    device: str | None = None  # the device type counted; None: every storage
    elsewhere: list[Allocation] = field(default_factory=list)  # storages on another device (no events)
    baseline_elsewhere: dict[str, int] = field(default_factory=dict)  # their baseline, by category
    stepped: bool | None = None  # the update ran: counted from what ran (`_stepped`); None: not recorded

    def elsewhere_at_end(self) -> dict[str, int]:
        """Bytes on another device than the counted one when the step ended, by category (baseline
        included): what a device-memory count leaves out (AdamW's host-side step counters on CUDA)."""
        out = {c: self.baseline_elsewhere.get(c, 0) for c in MEMORY_CATEGORIES}
        for a in self.elsewhere:
            if a.died is None:
                out[self.category(a)] += a.nbytes
        return out

    @property
    def step_peak_allocated_bytes(self) -> int | None:
        """The allocator's peak minus what was on the device besides the baseline: comparable to peak_bytes."""
        if self.peak_allocated_bytes is None or self.outside_bytes is None:
            return None
        return self.peak_allocated_bytes - self.outside_bytes

    @staticmethod
    def category(a: Allocation) -> str:
        """The ledger's categories, from what the tracker saw.

        By tag first (gradients, optimizer states, an update's workspace). Born in the forward: saved
        if the backward releases it, an unsaved activation if the forward does. Re-created in the
        backward inside `born_as` (a checkpoint's replay, an offload's copy back): saved, or an unsaved
        activation if released before that rebuild ended. Born in the backward otherwise: a saved
        tensor if autograd was recording (a checkpoint rebuilding its forward), else an upstream
        gradient (every tensor the backward computes is some op's input gradient, the loss's seed
        dL/dL included). Born in the update or zero_grad: workspace.
        """
        if a.tag:
            return a.tag
        if a.born_phase.startswith(FORWARD_PHASES):
            released_in_forward = a.died_phase is not None and a.died_phase.startswith(FORWARD_PHASES)
            return "unsaved_activations" if released_in_forward else "saved"
        if a.born_phase.endswith(REBUILDS):
            return "unsaved_activations" if a.died_phase == a.born_phase else "saved"
        if a.born_phase.startswith("backward"):
            return "saved" if a.recomputed else "upstream_grads"
        return "workspace"

    @property
    def peak_event(self) -> int:
        return max(range(len(self.live)), key=self.live.__getitem__)

    @property
    def peak_bytes(self) -> int:
        """Baseline plus the most tracked bytes alive at any event."""
        return sum(self.baseline.values()) + self.live[self.peak_event]

    @property
    def peak_phase(self) -> str:
        return self.phases[self.peak_event]

    def by_category(self, event: int | None = None) -> dict[str, int]:
        """Bytes alive right after `event` (default: the peak), by category, baseline included."""
        k = self.peak_event if event is None else event
        out = {c: self.baseline.get(c, 0) for c in MEMORY_CATEGORIES}
        for a in self.allocations:
            if a.born <= k and (a.died is None or a.died > k):
                out[self.category(a)] += a.nbytes
        return out

    def saved_at_end_of(self, phase: str) -> int:
        """Saved-tensor bytes alive right after the last event of a phase."""
        return self.by_category(max(k for k, p in enumerate(self.phases) if p == phase))["saved"]

    def saved_added_per_layer(self, n_layers: int) -> list[int]:
        """Saved bytes each decoder layer's forward added (its own and the next layer's input)."""
        ends = ["forward.embed"] + [f"forward.layer.{i}" for i in range(n_layers)]
        return [self.saved_at_end_of(b) - self.saved_at_end_of(a) for a, b in zip(ends, ends[1:])]

    def forward_backward_peak(self) -> int:
        """The most bytes alive (baseline included) before the update: forward, loss and backward events."""
        base = sum(self.baseline.values())
        return base + max(
            live
            for live, phase in zip(self.live, self.phases)
            if phase.startswith((*FORWARD_PHASES, "backward"))
        )

    def by_phase(self) -> dict[str, int]:
        """Most bytes alive (baseline included) during each phase, counting what it started with."""
        base, out, before = sum(self.baseline.values()), {}, 0
        for live, phase in zip(self.live, self.phases):
            out[phase] = max(out.get(phase, base + before), base + live)
            before = live
        return out

    def lifecycles(self) -> dict[tuple[str, str, str | None], int]:
        """(category, born phase, released phase or None) -> bytes: who lives from when to when."""
        out: dict[tuple[str, str, str | None], int] = {}
        for a in self.allocations:
            key = (self.category(a), a.born_phase, a.died_phase)
            out[key] = out.get(key, 0) + a.nbytes
        return out


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def _distinct_bytes(tensors, device: str | None = None) -> int:
    """Bytes of the distinct storages of these tensors: on `device` (a device type), or every one (None)."""
    seen = {}
    for t in tensors:
        if device is None or t.device.type == device:
            seen[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _elsewhere_bytes(tensors, device: str) -> int:
    """Bytes of the distinct storages of these tensors that are not on `device`."""
    return _distinct_bytes(tensors) - _distinct_bytes(tensors, device)


def training_step_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict,
    *,
    allocator: str | None = None,
    grads_at_start: bool = False,
    update: bool = True,
    set_to_none: bool = True,
    autocast: torch.dtype | None = None,
) -> StepMemory:
    """Track one training step of a transformers causal LM and return its StepMemory.

    The step: loss = model(**batch, use_cache=False).loss (under torch.autocast(dtype=autocast) when
    given); loss.backward(); then, with update, optimizer.step(); optimizer.zero_grad(set_to_none).
    Gradients must be None when it starts, unless grads_at_start: then every gradient must exist (an
    earlier micro-batch wrote it, or zero_grad(set_to_none=False) kept it) and counts in the baseline.
    Every p.grad is tagged "gradients" after the backward, every optimizer state tensor
    "optimizer_states" after the update. An optimizer with a `watch(tracker)` method (an update that
    runs inside the backward, `trainmech.optimizers.OptimizerInBackward`) tags its own. The counts are
    the storages on the model's device; the others (the host, on a CUDA step) are kept apart
    (`StepMemory.elsewhere_at_end`). The allocator's peaks are read as well: on CUDA by default;
    `allocator="cpu-profiler"` reads the CPU allocator's instead (see `allocator_window`), so the same
    bookkeeping runs on a CPU. The forward+backward allocator peak is read before the finiteness check,
    which makes one scalar per gradient (`_finite`) and no tracked storage.
    """
    params = list(model.parameters())
    have = [p.grad is not None for p in params]
    if grads_at_start and not all(have):
        raise TrainmechError(
            "grads_at_start needs every p.grad to exist (an earlier micro-batch, or zero_grad(set_to_none=False))"
        )
    if not grads_at_start and any(have):
        raise TrainmechError(
            "training_step_memory needs p.grad = None before the step (zero_grad(set_to_none=True))"
        )
    device = params[0].device
    before = {
        "parameters": params,
        "optimizer_states": _state_tensors(optimizer),
        "gradients": [p.grad for p in params] if grads_at_start else [],
    }
    baseline = {category: _distinct_bytes(tensors, device.type) for category, tensors in before.items()}
    baseline_elsewhere = {
        category: _elsewhere_bytes(tensors, device.type) for category, tensors in before.items()
    }
    if allocator is None:
        allocator = "cuda" if device.type == "cuda" else None
    window = (
        allocator_window(device, allocator, assume_start_bytes=sum(baseline.values()))
        if allocator
        else contextlib.nullcontext(None)
    )
    tracker = StorageTracker(device=device.type)
    handles = phase_hooks(model, tracker)
    if hasattr(optimizer, "watch"):
        handles.append(optimizer.watch(tracker))
    calls: list[int] = []  # optimizer.step() calls that returned (its step hooks ran)
    handles.append(optimizer.register_step_post_hook(lambda *_: calls.append(1)))
    counted_before = _step_counts(optimizer)
    precision = (
        torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    )
    try:
        with window as seen, tracker:
            with precision:
                loss = model(**batch, use_cache=False).loss
            tracker.phase = "backward.loss"
            loss.backward()
            loss_value = float(loss.detach())  # a view and a Python number: no storage for the tracker
            del loss
            forward_backward = cuda_peaks(device)["peak_allocated_bytes"] if allocator == "cuda" else None
            grads = [p.grad for p in params if p.grad is not None]
            tracker.tag(grads, "gradients")
            finite = _finite(loss_value, grads)
            del grads  # zero_grad must be able to release them
            if update:
                tracker.phase = "optimizer"
                optimizer.step()
                tracker.tag(_state_tensors(optimizer), "optimizer_states")
                tracker.phase = "zero_grad"
                optimizer.zero_grad(set_to_none=set_to_none)
    finally:
        for h in handles:
            h.remove()
    apart = {
        "device": device.type,
        "elsewhere": tracker.elsewhere,
        "baseline_elsewhere": baseline_elsewhere,
        "stepped": _stepped(optimizer, counted_before, calls),
    }
    if seen is None:
        return StepMemory(
            baseline, tracker.allocations, tracker.live, tracker.phases, all_finite=finite, **apart
        )
    outside = seen.start_bytes - sum(baseline.values())  # what else was allocated: the batch, other tensors
    return StepMemory(
        baseline,
        tracker.allocations,
        tracker.live,
        tracker.phases,
        seen.peak_bytes,
        seen.peak_reserved_bytes,
        outside,
        None if forward_backward is None else forward_backward - outside,
        finite,
        **apart,
    )


def _step_counts(optimizer: torch.optim.Optimizer) -> dict[int, float]:
    """id(parameter) -> its state["step"] (AdamW's, Adam's: the updates each parameter has taken)."""
    out = {}
    for p, state in optimizer.state.items():
        step = state.get("step") if isinstance(state, dict) else None
        if step is not None:
            out[id(p)] = float(step)
    return out


def _stepped(optimizer: torch.optim.Optimizer, before: dict[int, float], calls: list[int]) -> bool:
    """Whether this step updated the parameters, from what ran: an optimizer that counts its updates per
    parameter (state["step"]) stepped when every counted parameter's count moved on (inside the backward
    too: `OptimizerInBackward`); one that keeps no count, when its step() returned (a step post-hook).
    A skipped step (a GradScaler that found an inf, a step never called) leaves both unmoved."""
    after = _step_counts(optimizer)
    if after:
        return all(count > before.get(key, 0.0) for key, count in after.items())
    return bool(calls)


def _finite(loss: float, grads: list[torch.Tensor]) -> bool | None:
    """The loss and every gradient finite; None when no gradient is left to check (an update inside the
    backward consumed them). The gradients' inf-norm, max |g| (`torch.nn.utils.get_total_norm`, fused per
    device and dtype on CUDA): one scalar per gradient, no temporary of a gradient's size, and an inf or a
    NaN anywhere makes it non-finite. It runs outside every dispatch mode, so no tracked storage; on CUDA
    its scalars are in the allocator's history, after the backward's peak was read (`_history_from_snapshot`
    names them by the Python frame that made them)."""
    if not grads:
        return None
    with _disable_current_modes():
        return math.isfinite(loss) and bool(
            torch.isfinite(torch.nn.utils.get_total_norm(grads, float("inf")))
        )


# ----------------------------------------------------------------------------- memory: the allocator's own count
#
# Two allocators keep a running total of the bytes they handed out: CUDA's caching allocator
# (torch.cuda statistics, always on) and, while torch.profiler records memory, the CPU allocator
# (its memory events carry the running total). `allocator_window` reads either with the same
# bookkeeping, so a CPU test runs the arithmetic a GPU run relies on.

ALLOCATORS = ("cuda", "cpu-profiler")


@dataclass
class AllocatorWindow:
    """What an allocator reported over a block (bytes). Filled when the block exits.

    start_bytes: held when the block began; peak_bytes: the most held inside it; peak_reserved_bytes:
    the most reserved from the device (CUDA: segments cached by the allocator; None on the CPU).
    The CPU allocator is counted only while the profiler records, so there start_bytes is the
    baseline the caller states (`assume_start_bytes`): what lived before is outside its view.
    """

    source: str
    start_bytes: int = 0
    peak_bytes: int = 0
    peak_reserved_bytes: int | None = None

    @property
    def peak_above_start(self) -> int:
        return self.peak_bytes - self.start_bytes


@contextmanager
def allocator_window(device: torch.device, source: str | None = None, *, assume_start_bytes: int = 0):
    """Yield an AllocatorWindow that holds the allocator's start and peak bytes once the block ends.

    source: "cuda" (the default on a CUDA device) or "cpu-profiler" (the default elsewhere);
    refuses a source the device cannot give. The profiler's start/stop lines on stderr are
    silenced for the duration.
    """
    device = torch.device(device)
    source = source or ("cuda" if device.type == "cuda" else "cpu-profiler")
    if source not in ALLOCATORS:
        raise TrainmechError(f"unknown allocator {source!r}; valid: {', '.join(ALLOCATORS)}")
    if (source == "cuda") != (device.type == "cuda"):
        raise TrainmechError(f"allocator {source!r} cannot count memory on a {device.type} device")
    window = AllocatorWindow(source)
    if source == "cuda":
        reset_cuda_peaks(device)
        window.start_bytes = cuda_allocated(device)
        yield window
        peaks = cuda_peaks(device)
        window.peak_bytes, window.peak_reserved_bytes = (
            peaks["peak_allocated_bytes"],
            peaks["peak_reserved_bytes"],
        )
        return
    with _cpu_allocator_events() as totals:
        yield window
    window.start_bytes = assume_start_bytes
    window.peak_bytes = assume_start_bytes + _running_peak(totals)


@contextmanager
def _cpu_allocator_events():
    """Record the CPU allocator's memory events; yields a list filled on exit with
    (time ns, total before the event, total after it)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    events: list[tuple[int, int, int]] = []
    sys.stderr.flush()
    saved_fd, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield events
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.close(null)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            f = node.extra_fields
            events.append((node.start_time_ns, f.total_allocated - f.alloc_size, f.total_allocated))


def _running_peak(events: list[tuple[int, int, int]]) -> int:
    """The most the running total rose above where it stood at the first event."""
    if not events:
        return 0
    events.sort()
    return max(total for _, _, total in events) - events[0][1]


def allocator_peak_cpu(fn: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator handed out while fn ran (torch.profiler's memory events).

    Counts every allocation, kernel-internal scratch included, relative to the start of fn.
    """
    with allocator_window(torch.device("cpu"), "cpu-profiler") as window:
        fn()
    return window.peak_above_start
