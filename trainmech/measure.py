"""Measurements: step-time statistics (median / P95) and memory peaks.

Times are wall-clock seconds from `time.perf_counter`, with CUDA synchronised around each
sample when the work runs on a GPU. On a CPU a time is a behaviour check at most: it is written
into records and run.json, never printed into a notebook's compared outputs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not samples:
        raise ValueError("percentile of no samples")
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
