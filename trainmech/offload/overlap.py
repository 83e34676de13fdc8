"""Did the copies run while the compute stream worked? Interval arithmetic over one clock.

On a GPU the offload's copies run on their own streams; a copy costs the step nothing only for the
time the compute stream had work of its own meanwhile. Given the copies' and the compute stream's
busy intervals, (start, end) in seconds on one clock, `overlap` returns the copy time, the part of
it the compute stream was busy too (hidden) and the rest (alone). The intervals come from CUDA
events (`CudaCopies.intervals`, and events around work queued on the compute stream) or from a
torch.profiler trace (`trace_intervals`: kernels and device copies, each with its stream).

Pure Python, the same on every device: its tests, and gpu-check before it judges a GPU's intervals
(`gpucheck.offload_overlap.arithmetic_self_check`), feed it intervals whose overlap is known.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from trainmech.errors import TrainmechError

__all__ = ["Interval", "union", "covered", "Overlap", "overlap", "trace_intervals"]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged into disjoint ones, in order (a pair that only touches stays two)."""
    spans = sorted(intervals)
    for start, end in spans:
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise TrainmechError(
                f"an interval must be (start, end) with finite start <= end, got ({start}, {end})"
            )
    out: list[Interval] = []
    for start, end in spans:
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of the time inside both union(a) and union(b)."""
    a, b = union(a), union(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class Overlap:
    """Copy time split by what the compute stream did meanwhile (seconds)."""

    copy_s: float  # time at least one copy ran (copies on two side streams at once count once)
    compute_s: float  # time the compute stream was busy
    hidden_s: float  # of copy_s, the time the compute stream was busy too

    @property
    def alone_s(self) -> float:
        """Copy time with the compute stream idle: copies no compute covered."""
        return self.copy_s - self.hidden_s

    @property
    def hidden_fraction(self) -> float | None:
        return self.hidden_s / self.copy_s if self.copy_s else None


def overlap(copies: Iterable[Interval], compute: Iterable[Interval]) -> Overlap:
    """How much of the copies' time the compute stream was busy too."""
    copies, compute = union(copies), union(compute)
    length = lambda spans: sum(e - s for s, e in spans)  # noqa: E731
    return Overlap(length(copies), length(compute), covered(copies, compute))


def trace_intervals(trace: dict) -> tuple[list[Interval], list[Interval]]:
    """(side-stream copies, compute) in seconds, from a torch.profiler trace (`export_chrome_trace`'s JSON).

    Compute: every kernel, and every device copy or memset on a stream that ran a kernel (the compute
    stream: a copy queued there, as save_on_cpu's, is compute-stream time, not a side copy). Copies: every
    device copy on a stream that ran no kernel."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]

    def stream(e) -> object:
        return e.get("args", {}).get("stream", e.get("tid"))

    computing = {stream(e) for e in device if e["cat"] == "kernel"}
    if not computing:
        raise TrainmechError(
            "the profiler trace holds no CUDA kernel: profile a step on a GPU with "
            "torch.profiler.ProfilerActivity.CUDA among the activities"
        )
    span = lambda e: (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)  # noqa: E731  (microseconds in the trace)
    copies = [span(e) for e in device if e["cat"] == "gpu_memcpy" and stream(e) not in computing]
    compute = [span(e) for e in device if stream(e) in computing]
    return copies, compute
