"""The fifth stage's measurement of a candidate beside the reference: what its steady updates hold and cost.

`remeasure` measures peaks of steady updates alone — the allocator's, read through `measure.allocator_window`
(CUDA: allocated and reserved, the cache emptied before, for a forward + backward and for a whole update, with
the memory outside the allocator; a CPU's allocator only when forced, `allocator="cpu-profiler"`, so a CPU runs
that bookkeeping too) and, on any device, the tracked tensor bytes —, what one more sequence adds to the
forward + backward peak of a micro-batch inside an accumulation window (the capacity slope), then step times
with the reference's and the candidate's updates interleaved (ABBA), so that a drift of the machine hits both
alike (transformers' checkpointing switched on outside each timed update, not around each micro-batch in it). `Performance` holds what it found; `timing_counts` the warm-up and timed updates by device. Whether a
measured gain is worth it is trainmech.decision's question, not this module's.
"""

from __future__ import annotations

import gc
import statistics
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from trainmech.candidates import Candidate, GateWorkload, MicroBatches, checkpointing_kept_on
from trainmech.display import progress
from trainmech.measure import StorageTracker, allocator_window, time_stats, timed

__all__ = [
    "MIN_TIMED_FOR_P95",
    "TIMING_DEFAULTS",
    "timing_counts",
    "Performance",
    "ALLOCATOR_FIELDS",
    "remeasure",
    "memory_cap_fraction",
    "memory_capped",
    "CappedRun",
    "capped_updates",
]

# The P95 of n samples interpolates at position 0.95 (n - 1) of the sorted samples (measure.percentile): below
# 21 samples it lies between the two largest, so one slow sample moves it; from 21 on it sits at or below the
# second largest (at exactly 21 it is the second largest), so a single outlier no longer sets it.
MIN_TIMED_FOR_P95 = 21
TIMING_DEFAULTS = {  # (untimed warm-up updates, timed updates) when a notebook's parameters leave them None
    "cuda": (3, MIN_TIMED_FOR_P95),  # a few to settle the allocator's cache and the kernels' autotuning
    "cpu": (1, 3),  # a CPU's times are recorded, never evidence: as few as keep the bookkeeping honest
}


def timing_counts(on_cuda: bool, warmup: int | None = None, timed: int | None = None) -> tuple[int, int]:
    """(warm-up, timed) updates: the given ones, else TIMING_DEFAULTS for the device."""
    default = TIMING_DEFAULTS["cuda" if on_cuda else "cpu"]
    return (default[0] if warmup is None else warmup, default[1] if timed is None else timed)


@dataclass
class Performance:
    """The fifth stage's measurements of one candidate (allocator fields None without an allocator count: unknown,
    not 0; with the CPU allocator forced they hold its peaks above each window's start, reserved and outside None)."""

    device_type: str
    step_time_median_s: float
    step_time_p95_s: float
    peak_allocated_bytes: int | None  # CUDA allocator over one steady update (forward, backward, step)
    peak_reserved_bytes: (
        int | None
    )  # … reserved from the device, the cache emptied first: what the process holds (not what runs out first)
    forward_backward_allocated_bytes: int | None  # the same two over the forward + backward alone
    forward_backward_reserved_bytes: int | None
    cuda_context_bytes: (
        int | None
    )  # device memory in use outside this process's allocator (the CUDA context, others)
    # bytes_per_row: what one more sequence adds to the forward + backward peak of a micro-batch accumulating into
    # a window's gradients (CUDA: allocated; elsewhere tracked): the capacity criterion, what the largest
    # micro-batch that fits hinges on (`_bytes_per_row`)
    bytes_per_row: int
    tracked_peak_bytes: int  # tensor storages born in one steady update, at their peak (any device)
    tracked_forward_backward_bytes: int  # … before the optimizer step
    exposed_transfer_time_s: (
        float | None
    )  # offload, CUDA: the compute stream's waits for copies per update (median)
    transfer_time_s: float | None  # offload, CUDA: copy time per update, both directions (median)
    warmup: int
    repeats: int
    # the timed updates' seconds, round by round (None: not kept); round i of the candidate and of the reference
    # ran side by side, so their ratio is paired (`decision.round_ratios`)
    step_times_s: tuple[float, ...] | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda" and self.peak_reserved_bytes is not None


def _one_update(candidate: Candidate, state, window) -> None:
    candidate.backward(state, window)
    candidate.update(state)


ALLOCATOR_FIELDS = (
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "forward_backward_allocated_bytes",
    "forward_backward_reserved_bytes",
    "cuda_context_bytes",
)


def _allocator(device: torch.device, allocator: str | None) -> str | None:
    """The allocator whose count is read: as asked, else CUDA's on a GPU, else none (a CPU's is read only when forced)."""
    return allocator or ("cuda" if device.type == "cuda" else None)


def _emptied_cache(device: torch.device) -> int:
    """CUDA: the caching allocator's cache handed back (cyclic garbage collected first, so its tensors go back
    too); returns the device memory in use outside this process's allocator (the CUDA context, other processes)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def _allocator_peaks(candidate: Candidate, state, window, device: torch.device, source: str) -> dict:
    """The allocator's peaks over steady updates of one window, allocated and reserved: over a forward + backward,
    and over a whole update (one more, measured alone). CUDA: the cache emptied before each (segments
    that hold a live block stay), so the reserved peak is what the update reserves from there, cached free blocks
    included (the allocator would free those and retry before running out: `capped_updates` tests that), and the
    memory outside the allocator beside them.
    "cpu-profiler": the CPU allocator through the profiler, peaks above the window's start (it cannot see what
    lived before); reserved and outside memory None."""
    cuda = source == "cuda"
    outside = _emptied_cache(device) if cuda else None
    with allocator_window(device, source) as fb:
        candidate.backward(state, window)
    candidate.update(state)
    if cuda:
        _emptied_cache(device)
    with allocator_window(device, source) as whole:
        _one_update(candidate, state, window)
    return {
        "peak_allocated_bytes": whole.peak_bytes,
        "peak_reserved_bytes": whole.peak_reserved_bytes,
        "forward_backward_allocated_bytes": fb.peak_bytes,
        "forward_backward_reserved_bytes": fb.peak_reserved_bytes,
        "cuda_context_bytes": outside,
    }


def _tracked_peaks(candidate: Candidate, state, window) -> dict:
    """The tracked tensor storages born in one steady update, at their peak: before the optimizer step and over it."""
    tracker = StorageTracker("backward")
    with tracker:
        candidate.backward(state, window)
        forward_backward = max(tracker.live, default=0)
        tracker.phase = "update"
        candidate.update(state)
    return {
        "tracked_peak_bytes": max(tracker.live, default=0),
        "tracked_forward_backward_bytes": forward_backward,
    }


def _peaks(
    candidate: Candidate, workload: GateWorkload, warmup: int, init_scale: float | None, allocator=None
) -> dict:
    """Steady updates measured alone, after `warmup` untimed ones: the allocator's peaks (`_allocator_peaks`; None
    without an allocator count), the tracked tensor bytes, and the capacity slope (`_bytes_per_row`)."""
    state = workload.fresh_state(candidate, init_scale=init_scale)
    clean = workload.clean
    for i in range(max(warmup, 1)):  # at least one: the optimizer's moments exist, as in every later update
        _one_update(candidate, state, clean[i % len(clean)])
    window = clean[max(warmup, 1) % len(clean)]
    source = _allocator(workload.device, allocator)
    out = dict.fromkeys(ALLOCATOR_FIELDS)
    try:
        if source:
            out |= _allocator_peaks(candidate, state, window, workload.device, source)
        out |= _tracked_peaks(candidate, state, window)
        out["bytes_per_row"] = _bytes_per_row(candidate, state, window[0], workload.device, source)
    finally:
        state.close()
    return out


def _accumulating_peak(
    candidate: Candidate, state, micro_batch: dict, device: torch.device, source: str | None
) -> int:
    """The peak of one micro-batch's forward + backward above what lived before, accumulating into gradients
    that are already alive: the allocator's (its window around the backward), without an allocator the tracked
    tensor bytes born in it. Everything the micro-batch's rows hold at some moment counts: the saved tensors,
    the logits, the loss's log-softmax and their gradients, a replayed layer, an offload's fetched copies."""
    if source:
        with allocator_window(device, source) as window:
            candidate.backward(state, MicroBatches([micro_batch]))
        return window.peak_above_start
    with StorageTracker("backward") as tracker:
        candidate.backward(state, MicroBatches([micro_batch]))
    return max(tracker.live, default=0)


def _bytes_per_row(
    candidate: Candidate, state, micro_batch: dict, device: torch.device, source: str | None
) -> int:
    """The capacity slope: what one more sequence adds to the peak of a micro-batch that accumulates into a
    window's gradients (every micro-batch after the first), measured between the micro-batch's rows twice and
    four times over: (peak with 4x the rows - with 2x) / (2 x rows). The gradients exist first, so the peak sits
    where the rows' own bytes are largest, not at a step that only creates the gradients; the values do not
    matter (nothing is updated, the gradients are dropped after)."""
    rows = int(micro_batch["input_ids"].shape[0])
    times = lambda k: {key: torch.cat([v] * k) for key, v in micro_batch.items()}  # noqa: E731
    candidate.backward(
        state, MicroBatches([micro_batch])
    )  # the gradients are alive from here on, as in a window
    peaks = [_accumulating_peak(candidate, state, times(k), device, source) for k in (2, 4)]
    state.optimizer.zero_grad(set_to_none=True)
    return (peaks[1] - peaks[0]) // (2 * rows)


def _transfer(candidate: Candidate, attempts: int) -> tuple[float | None, float | None]:
    """Median per update of the offload strategies' exposed transfer and copy times (None off CUDA / without offload)."""
    runs = [
        s for strategy in candidate.strategies if hasattr(strategy, "collect") for s in strategy.collect()
    ]
    if not runs or runs[0].exposed_transfer_time_s is None or attempts == 0:
        return None, None
    per = len(runs) // attempts  # instances per update (one per micro-batch)
    chunks = [runs[k * per : (k + 1) * per] for k in range(attempts)]
    return (
        statistics.median(sum(s.exposed_transfer_time_s for s in c) for c in chunks),
        statistics.median(sum(s.transfer_time_s for s in c) for c in chunks),
    )


def remeasure(
    candidate: Candidate,
    reference: Candidate,
    workload: GateWorkload,
    *,
    warmup: int,
    repeats: int,
    init_scale: float | None = None,
    reference_peaks: dict | None = None,
    allocator: str | None = None,
) -> tuple[Performance, Performance]:
    """(candidate's, reference's) performance on the gate workload's clean windows.

    Peaks: each alone (`_peaks`). Times: both trained side by side on the same model (values do not
    matter for timing, only the work), `warmup` untimed updates each, then `repeats` rounds of one
    timed update each, the order alternating (ABBA), so a slow stretch of the machine hits both.
    init_scale: the candidate's calibrated loss scale (FP16, from its trace). reference_peaks: a dict that keeps
    the reference's peaks between calls (they do not change from one candidate to the next), filled on first use.
    allocator: whose peaks fill the allocator fields: None — CUDA's on a GPU, none elsewhere (null, unknown);
    "cpu-profiler" — the CPU allocator, so a CPU runs the same bookkeeping (peaks above each window's start).
    """
    with workload.running():
        scales = {id(candidate): init_scale, id(reference): None}
        known = reference_peaks if reference_peaks is not None else {}
        if (workload_key := (id(workload), warmup, allocator)) not in known:
            known[workload_key] = _peaks(reference, workload, warmup, None, allocator)
        peaks = {
            id(candidate): _peaks(candidate, workload, warmup, init_scale, allocator),
            id(reference): known[workload_key],
        }
        states = {id(c): workload.fresh_state(c, init_scale=scales[id(c)]) for c in (candidate, reference)}
        clean = workload.clean
        order = [(candidate, reference), (reference, candidate)]
        try:
            for i in range(warmup):
                for c in (candidate, reference):
                    _one_update(c, states[id(c)], clean[i % len(clean)])
            for c in (candidate, reference):
                _transfer(c, 0)  # forget the warm-up's offload runs
            seconds = {id(candidate): [], id(reference): []}
            for i in progress(
                range(repeats), desc=f"timing {candidate.name} beside {reference.name}", unit="round"
            ):
                for c in order[i % 2]:
                    window = clean[(warmup + i) % len(clean)]
                    with checkpointing_kept_on(c, workload.model):  # switched on outside the timed update
                        seconds[id(c)].append(
                            timed(partial(_one_update, c, states[id(c)], window), workload.device)[1]
                        )
        finally:
            for c in (candidate, reference):
                states[id(c)].optimizer.zero_grad(set_to_none=True)
                states[id(c)].close()
    out = []
    for c in (candidate, reference):
        exposed, transfer = _transfer(c, repeats)
        out.append(
            Performance(
                workload.device.type,
                **time_stats(seconds[id(c)]),
                **peaks[id(c)],
                exposed_transfer_time_s=exposed,
                transfer_time_s=transfer,
                warmup=warmup,
                repeats=repeats,
                step_times_s=tuple(seconds[id(c)]),
            )
        )
    return out[0], out[1]


def memory_cap_fraction(cap_bytes: int, total_bytes: int) -> float:
    """The fraction of a device of `total_bytes` that caps the caching allocator's reserved bytes at `cap_bytes`
    (torch.cuda.set_per_process_memory_fraction: a request that would reserve past it raises OutOfMemoryError,
    after the allocator freed its unused cached segments and retried)."""
    if not 0 < cap_bytes <= total_bytes:
        raise ValueError(
            f"a memory cap must lie between 1 B and the device's {total_bytes:,} B, got {cap_bytes:,} B"
        )
    return cap_bytes / total_bytes


@contextmanager
def memory_capped(device: torch.device, cap_bytes: int):
    """CUDA: inside, this process's caching allocator may reserve at most `cap_bytes` on `device`; the whole
    device again after."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(memory_cap_fraction(cap_bytes, total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


@dataclass(frozen=True)
class CappedRun:
    """A candidate's steady update and the reference's, each run under the same cap on the reserved bytes: the
    reference's reserved peak measured just before, in the same process state, plus `slack` of it."""

    cap_bytes: int
    reference_reserved_bytes: int
    reference_ran: (
        bool  # False: it raised OutOfMemoryError under a cap above its own peak (the cap says nothing)
    )
    candidate_ran: bool

    @property
    def runs_out_first(self) -> bool | None:
        """True where the candidate ran out and the reference did not; None where the reference ran out too."""
        return (not self.candidate_ran) if self.reference_ran else None

    def words(self) -> str:
        said = lambda ran: "ran" if ran else "ran out of memory"  # noqa: E731
        return (
            f"under a cap of {self.cap_bytes:,} B reserved (the reference's reserved peak {self.reference_reserved_bytes:,} B "
            f"plus the slack): the reference {said(self.reference_ran)}, the candidate {said(self.candidate_ran)}"
        )


def _capped_update(
    candidate: Candidate, workload: GateWorkload, warmup: int, init_scale, cap: int | None
) -> tuple[bool, int]:
    """(ran, reserved peak) of one steady update after `warmup` ones, the cache emptied before it; under `cap`
    reserved bytes when given (False: it raised OutOfMemoryError there)."""
    state = workload.fresh_state(candidate, init_scale=init_scale)
    clean = workload.clean
    try:
        for i in range(max(warmup, 1)):
            _one_update(candidate, state, clean[i % len(clean)])
        _emptied_cache(workload.device)
        torch.cuda.reset_peak_memory_stats(workload.device)
        try:
            with memory_capped(workload.device, cap) if cap is not None else nullcontext():
                _one_update(candidate, state, clean[max(warmup, 1) % len(clean)])
        except torch.cuda.OutOfMemoryError:
            return False, int(torch.cuda.max_memory_reserved(workload.device))
        return True, int(torch.cuda.max_memory_reserved(workload.device))
    finally:
        state.optimizer.zero_grad(set_to_none=True)
        state.close()
        _emptied_cache(workload.device)


def capped_updates(
    candidate: Candidate,
    reference: Candidate,
    workload: GateWorkload,
    *,
    slack: float,
    warmup: int = 1,
    init_scale: float | None = None,
) -> CappedRun:
    """CUDA: does the candidate run out of memory before the reference? The reference's steady update measured
    uncapped (its reserved peak, in this process's state now), then the reference and the candidate each run
    under a cap of that peak plus `slack` of it. A reserved peak is not what runs out: under the cap the
    allocator frees its unused cached segments and retries before it raises."""
    with workload.running():
        _, reserved = _capped_update(reference, workload, warmup, None, None)
        cap = round(reserved * (1 + slack))
        reference_ran, _ = _capped_update(reference, workload, warmup, None, cap)
        candidate_ran, _ = _capped_update(candidate, workload, warmup, init_scale, cap)
    return CappedRun(cap, reserved, reference_ran, candidate_ran)
