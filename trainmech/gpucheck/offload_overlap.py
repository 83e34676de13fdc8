"""gpu-check's claim that the activation offload's copies overlap compute (used by strategy_checks.check_offload).

Two measurements of one offload, each run on any device: a step profiled with torch.profiler (on a GPU, copies on
the side streams against kernels on the compute stream, `trainmech.offload.overlap.trace_intervals`), and a step
whose compute stream is kept busy right after each D2H copy is queued (torch.cuda._sleep on a GPU, the host
sleeping on a CPU), its copies' events against the stalls'. A GPU must show copies hidden; a CPU, which copies in
line with its work, must show none, and its trace (no kernel) is refused.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from trainmech.gpucheck.probe import Probe, forward_backward, require

__all__ = [
    "HIDDEN_BEHIND_STALL_FRACTION",
    "D2H_WAIT_FRACTION",
    "sleep_rate",
    "stalling",
    "profiled_step",
    "overlap_claims",
]

# First guesses, not yet measured on a GPU (gpu-check prints them beside what it found): with the compute stream
# kept busy right after each D2H copy is queued, for twice the longest D2H copy of an earlier step, at least this
# share of the D2H copy time must run while the compute stream is busy, and the compute stream's D2H waits must
# stay under this share of the D2H copy time.
HIDDEN_BEHIND_STALL_FRACTION = 0.5
D2H_WAIT_FRACTION = 0.05


def sleep_rate() -> float:
    """Cycles per second of torch.cuda._sleep on this GPU, timed by events (once, outside every step)."""
    cycles, rates = 10_000_000, []
    for _ in range(2):  # the first may carry the launch's start-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / (start.elapsed_time(end) / 1e3))
    return rates[-1]


def stalling(hooks, seconds: float, rate: float | None) -> list[tuple]:
    """Keep the compute stream busy for about `seconds` right after each D2H copy is queued (a stand-in for the
    compute a copy can hide behind): CUDA, torch.cuda._sleep queued on it (the host does not wait); HostStreams,
    the host sleeps. Returns the list the (start, end) events of each stall go to."""
    copies, stalls = hooks.copies, []
    backend, to_host = copies.streams, copies.to_host

    def then_stall(entry, storage) -> None:
        to_host(entry, storage)
        begin = backend.mark(backend.compute())
        if rate is None:
            time.sleep(seconds)
        else:
            torch.cuda._sleep(int(seconds * rate))
        stalls.append((begin, backend.mark(backend.compute())))

    copies.to_host = then_stall
    return stalls


def profiled_step(model, batch, hooks, cuda: bool) -> dict:
    """One forward + backward under `hooks` inside torch.profiler (CUDA activity on a GPU): its trace as JSON."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        forward_backward(model, batch, hooks)
        hooks.finish()
        if cuda:
            torch.cuda.synchronize()  # every device event of the step is in the trace
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text(encoding="utf-8"))


def overlap_claims(probe: Probe, profiled, trace: dict, stalled, stalls: list, origin) -> str:
    """Did the copies run while the compute stream worked? From the profiled step's trace (kernels against copies
    on the side streams) and from the stalled step's events (D2H copies against the stalls)."""
    from trainmech.errors import TrainmechError
    from trainmech.offload.overlap import overlap, trace_intervals

    s = stalled.copies.streams
    behind = overlap(
        stalled.copies.intervals(origin, "d2h"),
        [(s.seconds(origin, a), s.seconds(origin, b)) for a, b in stalls],
    )
    st, wait = profiled.stats, stalled.stats.d2h_wait_s
    if not probe.cuda:  # the host copies in line with its work: nothing hides, and no trace has a kernel
        require(
            behind.copy_s > 0 and behind.compute_s > 0 and behind.hidden_s == 0,
            f"on a CPU every copy runs in line, yet {behind.hidden_s * 1e3:.3f} ms of the D2H copies' "
            f"{behind.copy_s * 1e3:.3f} ms ran during the host's stalls",
        )
        try:
            trace_intervals(trace)
        except TrainmechError as refused:
            return f"no copy ran during the stalls (a CPU copies in line); a CPU trace refused: {refused}"
        require(False, "trace_intervals read copies and kernels from a CPU-only profiler trace")
    copies, compute = trace_intervals(trace)
    seen = overlap(copies, compute)
    require(
        copies and seen.hidden_s > 0 and st.exposed_transfer_time_s < st.transfer_time_s,
        f"profiled step: {len(copies)} side-stream copies, {seen.hidden_s * 1e6:.1f} of {seen.copy_s * 1e6:.1f} us "
        f"during kernels; exposed {st.exposed_transfer_time_s * 1e6:.1f} of {st.transfer_time_s * 1e6:.1f} us",
    )
    hidden = (
        "no D2H copy" if behind.hidden_fraction is None else f"{behind.hidden_fraction:.0%}"
    )  # None: nothing copied
    require(
        behind.copy_s > 0
        and behind.hidden_fraction >= HIDDEN_BEHIND_STALL_FRACTION
        and wait <= D2H_WAIT_FRACTION * behind.copy_s,
        f"stalled step: {hidden} of the D2H copies' {behind.copy_s * 1e6:.1f} us ran during "
        f"the stalls (first-guess floor {HIDDEN_BEHIND_STALL_FRACTION:.0%}), the compute stream waited "
        f"{wait * 1e6:.1f} us for them (first-guess ceiling {D2H_WAIT_FRACTION:.0%} of it)",
    )
    return (
        f"profiled step: {seen.hidden_s * 1e6:.1f} of {seen.copy_s * 1e6:.1f} us of side-stream copies during "
        f"kernels, exposed {st.exposed_transfer_time_s * 1e6:.1f} of {st.transfer_time_s * 1e6:.1f} us; stalled step: "
        f"{behind.hidden_fraction:.0%} of the D2H copy time behind the stalls (floor {HIDDEN_BEHIND_STALL_FRACTION:.0%}, "
        f"a first guess), D2H waits {wait * 1e6:.1f} us (ceiling {D2H_WAIT_FRACTION:.0%} of the copy time, a first guess)"
    )
