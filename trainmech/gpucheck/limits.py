"""The machine's own limits, measured before any strategy is judged.

    bw = copy_bandwidth(device)            # host↔device copies: each way alone, and both at once
    ph = step_phase_times(model, batch, optimizer)   # forward / backward / update seconds of one step
    offload_bound(bw, ph, d2h_bytes, h2d_bytes)      # transfer ActivationOffload's overlap cannot hide
    added_time_floor(bound, baseline_median_s)       # what a timed offload step must add to its baseline

On CUDA the host side is pinned memory and each direction runs on its own stream, timed by CUDA
events. Off CUDA there is no bus: the same functions copy between two host buffers, timed by the
host clock, and say so in `path` — a stand-in that runs the same bookkeeping, not a PCIe figure.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from collections.abc import Callable

import torch

__all__ = [
    "GB",
    "Clock",
    "host_buffer",
    "copy_bandwidth",
    "step_phase_times",
    "OFFLOAD_BOUND_ASSUMES",
    "offload_bound",
    "TIMING_NOISE",
    "added_time_floor",
]

GB = 1e9


class Clock:
    """Marks and intervals on a stream: CUDA events on a CUDA device, the host clock elsewhere
    (where every copy and kernel has finished when the call returns)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def host_buffer(nbytes: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """A host buffer for copies to and from `device`, and whether it is pinned (only where CUDA can pin)."""
    pinned = torch.device(device).type == "cuda"
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned), pinned


def _streams(device: torch.device, n: int) -> list:
    return [torch.cuda.Stream(device) for _ in range(n)] if device.type == "cuda" else [None] * n


def _on(stream, fn: Callable[[], object]) -> None:
    if stream is None:
        fn()
    else:
        with torch.cuda.stream(stream):
            fn()


def _both_at_once(clock: Clock, work: list[tuple[object, Callable[[], object]]]) -> list[float]:
    """Run each (stream, fn) at the same time; seconds each took from the common start.

    CUDA: every stream waits on one start event, so the copies are queued together. Host: one
    thread per copy (a tensor copy releases the GIL), started by one barrier.
    """
    if clock.cuda:
        start = clock.mark()
        ends = []
        for stream, fn in work:
            stream.wait_event(start)
            _on(stream, fn)
            ends.append(clock.mark(stream))
        return [clock.seconds(start, end) for end in ends]
    barrier, seconds = threading.Barrier(len(work) + 1), [0.0] * len(work)

    def run(i, fn):
        barrier.wait()
        t0 = time.perf_counter()
        fn()
        seconds[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=run, args=(i, fn)) for i, (_, fn) in enumerate(work)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    return seconds


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """GB/s (1e9 bytes per second, median of `repeats`) of host→device and device→host copies,
    each way alone and both at once (`both_h2d_gbps`, `both_d2h_gbps`), with what was measured."""
    device = torch.device(device)
    clock = Clock(device)
    host_src, pinned = host_buffer(nbytes, device)
    host_dst, _ = host_buffer(nbytes, device)
    host_src.random_(0, 256)  # touched pages: a fresh buffer may not be backed by memory yet
    host_dst.zero_()
    dev_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d_stream, d2h_stream = _streams(device, 2)
    if clock.cuda:  # the side streams read what the compute stream just wrote
        for stream in (h2d_stream, d2h_stream):
            stream.wait_stream(torch.cuda.current_stream(device))

    def h2d():
        dev_dst.copy_(host_src, non_blocking=pinned)

    def d2h():
        host_dst.copy_(dev_src, non_blocking=pinned)

    def alone(stream, fn) -> float:
        samples = []
        for _ in range(repeats + 1):  # the first is a warm-up
            start = clock.mark(stream)
            _on(stream, fn)
            samples.append(clock.seconds(start, clock.mark(stream)))
        return statistics.median(samples[1:])

    h2d_s, d2h_s = alone(h2d_stream, h2d), alone(d2h_stream, d2h)
    both = [_both_at_once(clock, [(h2d_stream, h2d), (d2h_stream, d2h)]) for _ in range(repeats + 1)][1:]
    both_h2d_s = statistics.median(b[0] for b in both)
    both_d2h_s = statistics.median(b[1] for b in both)
    if clock.cuda:
        torch.cuda.synchronize(device)
    ok = torch.equal(dev_dst.cpu(), host_src) and torch.equal(host_dst, dev_src.cpu())
    path = (
        f"pinned host memory <-> {device} (the bus: PCIe or NVLink-C2C), CUDA events, one stream per direction"
        if pinned
        else "host buffer -> host buffer on the CPU: no accelerator and no bus; memcpy speed, host clock"
    )
    return {
        "path": path,
        "pinned": pinned,
        "bytes": nbytes,
        "repeats": repeats,
        "copies_equal": ok,
        "h2d_gbps": nbytes / h2d_s / GB,
        "d2h_gbps": nbytes / d2h_s / GB,
        "both_h2d_gbps": nbytes / both_h2d_s / GB,
        "both_d2h_gbps": nbytes / both_d2h_s / GB,
    }


def step_phase_times(
    model: torch.nn.Module,
    batch: dict,
    optimizer: torch.optim.Optimizer,
    *,
    warmup: int = 2,
    repeats: int = 5,
) -> dict:
    """Median seconds of one training step's forward (with the loss), backward and update.

    On CUDA the marks are events on the compute stream, read after the loop: no host
    synchronisation inside a step. The steps are real optimizer steps; the model's weights and buffers and the
    optimizer's state are put back afterwards (from host copies taken before), so a caller's `model` is not left
    trained.
    """
    device = next(model.parameters()).device
    clock = Clock(device)
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    try:
        marks = _phase_marks(model, batch, optimizer, clock, warmup, repeats)
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)
    phases = {"forward_s": [], "backward_s": [], "update_s": []}
    for a, b, c, d in marks:
        phases["forward_s"].append(clock.seconds(a, b))
        phases["backward_s"].append(clock.seconds(b, c))
        phases["update_s"].append(clock.seconds(c, d))
    out = {k: statistics.median(v) for k, v in phases.items()}
    tokens = int(batch["input_ids"].numel())
    return {
        **out,
        "step_s": sum(out.values()),
        "tokens": tokens,
        "warmup": warmup,
        "repeats": repeats,
        "timer": "CUDA events on the compute stream" if clock.cuda else "host clock (CPU: synchronous)",
    }


def _phase_marks(model, batch, optimizer, clock, warmup: int, repeats: int) -> list:
    """step_phase_times' loop: clock marks around forward, backward and update of each timed step."""
    marks = []
    for k in range(warmup + repeats):
        optimizer.zero_grad(set_to_none=True)
        a = clock.mark()
        loss = model(**batch, use_cache=False).loss
        b = clock.mark()
        loss.backward()
        c = clock.mark()
        optimizer.step()
        d = clock.mark()
        del loss
        if k >= warmup:
            marks.append((a, b, c, d))
    return marks


# What offload_bound's windows stand on: they hold for this project's ActivationOffload, not for every offload.
OFFLOAD_BOUND_ASSUMES = (
    "ActivationOffload's schedule: the compute stream waits for every D2H when the backward starts "
    "(OffloadBook.start_backward), so D2H hides behind the forward only, and H2D, issued in the backward, "
    "behind the backward only (an offload that let D2H run on into the backward would hide more); each "
    "direction at its rate measured alone (one large pinned copy on an idle stream: the offload's many "
    "per-storage copies are smaller and share the device memory's bandwidth with the compute, which this "
    "leaves out, as it does for the exposed share); the baseline's phase times, with nothing for the hooks' own "
    "work (Python pack/unpack, views rebuilt, the compute stream's waits issued): a lower bound, that "
    "work only adds to it. Copies queued on the compute stream (save_on_cpu) hide behind nothing: serial"
)


def offload_bound(bandwidth: dict, phases: dict, d2h_bytes: int, h2d_bytes: int) -> dict:
    """The transfer ActivationOffload cannot hide (`OFFLOAD_BOUND_ASSUMES`, returned as `assumes`): D2H runs
    under the forward, H2D under the backward, each at the measured speed of its direction alone; what
    outlasts its phase is exposed whatever the overlap, and the two add (the compute stream waits for the
    D2H backlog before the backward's first H2D can be used). step_ratio_bound is against the phase-timed
    step (a plain forward, backward and update): a timed step that does more work (its own loss, a
    finiteness check) has a larger denominator and a lower ratio for the same exposed time, so a timed
    median is held to `added_time_floor`, not to this ratio."""
    d2h_s = d2h_bytes / (bandwidth["d2h_gbps"] * GB)
    h2d_s = h2d_bytes / (bandwidth["h2d_gbps"] * GB)
    exposed = max(0.0, d2h_s - phases["forward_s"]) + max(0.0, h2d_s - phases["backward_s"])
    return {
        "d2h_bytes": d2h_bytes,
        "h2d_bytes": h2d_bytes,
        "d2h_s": d2h_s,
        "h2d_s": h2d_s,
        "forward_s": phases["forward_s"],
        "backward_s": phases["backward_s"],
        "exposed_transfer_bound_s": exposed,
        "step_ratio_bound": (phases["step_s"] + exposed) / phases["step_s"],
        "serial_ratio_bound": (phases["step_s"] + d2h_s + h2d_s) / phases["step_s"],
        "assumes": OFFLOAD_BOUND_ASSUMES,
    }


# Timing noise allowed below the exposed-transfer bound, as a share of the baseline's median step.
TIMING_NOISE = 0.05


def added_time_floor(bound: dict, baseline_median_s: float, noise: float = TIMING_NOISE) -> float:
    """The least an offload's median step may lie above its baseline's median when both are timed by the
    same loop (`tracing.remeasure`): the exposed transfer `offload_bound` cannot hide, less `noise` of the
    baseline's step. Added time, not a ratio: whatever extra work both timed steps do beyond the phase-timed
    step cancels in the difference, while in a ratio it would sit in the denominator only and pull a
    correct offload below `step_ratio_bound`."""
    return bound["exposed_transfer_bound_s"] - noise * baseline_median_s
