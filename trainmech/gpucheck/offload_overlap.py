"""gpu-check's claim that the activation offload's copies overlap compute (used by strategy_checks.check_offload).

Two measurements of one offload: a step profiled with torch.profiler (on a GPU, copies on the side streams against
kernels on the compute stream, `trainmech.offload.overlap.trace_intervals`, and the compute stream's waits for
the copies against the copies' time), and a step whose compute stream is kept busy right after each D2H copy is
queued (torch.cuda._sleep), its copies' events against the stalls'. `overlap_problems` judges both against the
thresholds below; it is pure arithmetic, so before it judges a GPU's intervals it must pass on intervals whose
overlap is known, and fail on serial ones (`arithmetic_self_check`, run on every device). A CPU copies in line
with its work (`HostStreams`): its intervals are printed, not judged.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from trainmech.gpucheck.probe import Probe, forward_backward, require
from trainmech.offload.overlap import Overlap, overlap

__all__ = [
    "HIDDEN_SHARE_OF_BUSY",
    "kernel_floor",
    "HIDDEN_BEHIND_STALL_FRACTION",
    "D2H_WAIT_FRACTION",
    "exposed_ceiling",
    "measured_bound",
    "overlap_problems",
    "arithmetic_self_check",
    "sleep_rate",
    "stalling",
    "profiled_step",
    "overlap_claims",
]

# First guesses, not yet measured on a GPU (gpu-check prints them beside what it found). The profiled step: the
# side-stream copy time that runs during kernels, at least this share of the share of the step the compute stream
# was busy (`kernel_floor`: a small model leaves a GPU idle between launches, and a copy that overlaps compute
# lands under kernels about as often as the compute stream is busy; a copy the compute stream waits for before it
# goes on lands under none). The stalled step, the compute stream kept busy right after each D2H copy is queued
# for twice the longest D2H copy of an earlier step: at least this share of the D2H copy time runs during the
# stalls, and the compute stream's D2H waits stay under this share of it.
HIDDEN_SHARE_OF_BUSY = 0.5
HIDDEN_BEHIND_STALL_FRACTION = 0.5
D2H_WAIT_FRACTION = 0.05


def exposed_ceiling(bound: dict) -> tuple[float, float]:
    """(floor, ceiling) of exposed / transfer, Task5's rule: the floor is the share no overlap can hide at the
    measured bandwidth (`limits.offload_bound`), the ceiling (1 + floor) / 2: at least half of the rest hidden."""
    floor = bound["exposed_transfer_bound_s"] / (bound["d2h_s"] + bound["h2d_s"])
    return floor, (1 + floor) / 2


def measured_bound(probe: Probe, model, batch, d2h_bytes: int, h2d_bytes: int) -> dict:
    """`limits.offload_bound` for the probe's step: its copy bandwidth and phase times, measured here."""
    from trainmech.gpucheck import limits

    bandwidth = limits.copy_bandwidth(probe.device, nbytes=64 << 20, repeats=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # step_phase_times puts the weights back anyway
    phases = limits.step_phase_times(model, batch, optimizer, warmup=1, repeats=3)
    return limits.offload_bound(bandwidth, phases, d2h_bytes, h2d_bytes)


def kernel_floor(copies: list, compute: list) -> float:
    """The least share of the side-stream copy time that must run during kernels: HIDDEN_SHARE_OF_BUSY times the
    share of the traced span (first start to last end, copies and compute) the compute stream was busy."""
    spans = [*copies, *compute]
    span = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
    return HIDDEN_SHARE_OF_BUSY * overlap([], compute).compute_s / span if span > 0 else 0.0


def _share(fraction: float | None) -> str:
    return "no copy" if fraction is None else f"{fraction:.0%}"


def overlap_problems(
    kernels: Overlap,
    floor: float,
    exposed_s: float,
    transfer_s: float,
    ceiling: float,
    stalled: Overlap,
    d2h_wait_s: float,
) -> list[str]:
    """What fails of the overlap claim (empty: it holds). `kernels`: the profiled step's side-stream copies
    against its kernels; `exposed_s` / `transfer_s`: its compute stream's waits for copies, and the copies' time;
    `floor`: the least share of the copies under kernels (`kernel_floor`); `stalled`: the stalled step's D2H copies against its stalls, `d2h_wait_s` its compute stream's D2H waits."""
    problems = []
    if kernels.hidden_fraction is None or not kernels.hidden_fraction > 0 or kernels.hidden_fraction < floor:
        problems.append(
            f"profiled step: {_share(kernels.hidden_fraction)} of {kernels.copy_s * 1e6:.1f} us of side-stream "
            f"copies ran during kernels (floor {floor:.0%}: {HIDDEN_SHARE_OF_BUSY:.0%} of the compute stream's busy "
            "share, a first guess)"
        )
    if not transfer_s > 0 or exposed_s / transfer_s > ceiling:
        problems.append(
            f"profiled step: exposed {exposed_s * 1e6:.1f} of {transfer_s * 1e6:.1f} us of copies, above "
            f"{ceiling:.0%} ((1 + floor) / 2 at the measured bandwidth)"
        )
    if stalled.hidden_fraction is None or stalled.hidden_fraction < HIDDEN_BEHIND_STALL_FRACTION:
        problems.append(
            f"stalled step: {_share(stalled.hidden_fraction)} of the D2H copies' {stalled.copy_s * 1e6:.1f} us "
            f"ran during the stalls (floor {HIDDEN_BEHIND_STALL_FRACTION:.0%}, a first guess)"
        )
    if d2h_wait_s > D2H_WAIT_FRACTION * stalled.copy_s:
        problems.append(
            f"stalled step: the compute stream waited {d2h_wait_s * 1e6:.1f} us for D2H copies of "
            f"{stalled.copy_s * 1e6:.1f} us (ceiling {D2H_WAIT_FRACTION:.0%} of it, a first guess)"
        )
    return problems


def arithmetic_self_check() -> str:
    """`overlap` and `overlap_problems` on intervals whose overlap is known (seconds on one clock): a copy
    [1, 3] against compute [0, 2] is half hidden; copies inside the compute pass every threshold; copies between
    the compute, waited for in full, fail every one. Raises if the arithmetic or a threshold does not tell them apart."""
    half = overlap([(1.0, 3.0)], [(0.0, 2.0)])
    require(
        (half.copy_s, half.compute_s, half.hidden_s, half.hidden_fraction) == (2.0, 2.0, 1.0, 0.5),
        f"overlap arithmetic: a copy [1, 3] against compute [0, 2] gave {half}, not 1 s of 2 hidden",
    )
    compute = [(0.0, 4.0), (5.0, 9.0)]
    hidden = overlap([(1.0, 2.0), (6.0, 8.0)], compute)  # every copy inside the compute
    serial = overlap([(4.0, 5.0), (9.0, 10.0)], compute)  # every copy between it
    busy = kernel_floor([(1.0, 2.0), (6.0, 8.0)], compute)  # compute busy 8 of 9 s: a floor of 4/9
    require(
        abs(busy - HIDDEN_SHARE_OF_BUSY * 8 / 9) < 1e-12,
        f"kernel floor {busy}, not {HIDDEN_SHARE_OF_BUSY} of 8/9",
    )
    passes = overlap_problems(hidden, busy, 0.0, hidden.copy_s, 0.6, hidden, 0.0)
    fails = overlap_problems(serial, busy, serial.copy_s, serial.copy_s, 0.6, serial, serial.copy_s)
    require(not passes, f"copies inside the compute were refused: {'; '.join(passes)}")
    require(len(fails) == 4, f"serial copies passed {4 - len(fails)} of the 4 thresholds: {'; '.join(fails)}")
    return "the overlap arithmetic and its thresholds tell hidden copies from serial ones on known intervals"


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


def overlap_claims(probe: Probe, profiled, trace: dict, stalled, stalls: list, origin, bound: dict) -> str:
    """Did the copies run while the compute stream worked? From the profiled step's trace (kernels against copies
    on the side streams) and its waits against `bound`'s ceiling, and from the stalled step's events (D2H copies
    against the stalls). On a CPU only the arithmetic is judged, on known intervals; the host's are printed."""
    from trainmech.offload.overlap import trace_intervals

    checked = arithmetic_self_check()
    s = stalled.copies.streams
    behind = overlap(
        stalled.copies.intervals(origin, "d2h"),
        [(s.seconds(origin, a), s.seconds(origin, b)) for a, b in stalls],
    )
    floor, ceiling = exposed_ceiling(bound)
    if not probe.cuda:  # the host copies in line with its work: its intervals say nothing about overlap
        return (
            f"{checked}; on this CPU (copies in line, printed, not judged) {_share(behind.hidden_fraction)} of the "
            f"D2H copy time ran during the host's stalls; exposed / transfer ceiling {ceiling:.0%} (floor {floor:.0%})"
        )
    st, wait = profiled.stats, stalled.stats.d2h_wait_s
    copies, compute = trace_intervals(trace)
    seen = overlap(copies, compute)
    floor_k = kernel_floor(copies, compute)
    problems = overlap_problems(
        seen, floor_k, st.exposed_transfer_time_s, st.transfer_time_s, ceiling, behind, wait
    )
    require(not problems, "; ".join(problems))
    return (
        f"{checked}; profiled step: {_share(seen.hidden_fraction)} of {seen.copy_s * 1e6:.1f} us of side-stream "
        f"copies during kernels (floor {floor_k:.0%}), exposed "
        f"{st.exposed_transfer_time_s / st.transfer_time_s:.0%} of the copy time (ceiling {ceiling:.0%}, floor "
        f"{floor:.0%} at the measured bandwidth); stalled step: {_share(behind.hidden_fraction)} of the D2H copy "
        f"time behind the stalls (floor {HIDDEN_BEHIND_STALL_FRACTION:.0%}), D2H waits {wait * 1e6:.1f} us "
        f"(ceiling {D2H_WAIT_FRACTION:.0%} of the copy time); the kernel and stall floors and the wait ceiling are "
        "first guesses"
    )
