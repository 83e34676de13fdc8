"""The scenario matrix measured: each (strategy, update, optimizer) cell run and tracked on a real model.

    measure_matrix(model, batch, initial, strategies=…, optimizers=…)   (strategy, update, optimizer) -> Measured
    measured_peaks(step_memory)     (forward + backward peak, whole-update peak) of one tracked step
    peak_pairs(measured, allocator=…)   each cell's two peaks, the CUDA allocator's or tracked tensor bytes
    matrix_heading(spec, recipe, device, allocator=…)   the line above the matrix: workload and instrument

The paper side of the same matrix is `trainmech.ledger.scenarios`. torch and trainmech.measure are imported
inside the functions that run a model: the ledger itself imports without them.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from itertools import product

from trainmech.display import progress
from trainmech.ledger.clock import UPDATES

__all__ = [
    "UPDATE_TICKS",
    "measured_peaks",
    "measured_saved_after_forward",
    "Measured",
    "tracked_step",
    "measure_matrix",
    "peak_pairs",
    "matrix_heading",
]

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


def peak_pairs(measured: dict[tuple, Measured], *, allocator: bool) -> dict[tuple, tuple[int, int]]:
    """(strategy, update, optimizer) -> (forward + backward peak, whole-update peak): the CUDA allocator's when
    `allocator`, else tracked tensor bytes (the form `scenarios.worst_peak_error` and `render_rows` read)."""
    return {
        k: (m.forward_backward_allocated, m.whole_allocated)
        if allocator
        else (m.forward_backward_bytes, m.whole_bytes)
        for k, m in measured.items()
    }


def matrix_heading(spec, recipe: str, device: str, *, allocator: bool) -> str:
    """The line above a measured matrix: the workload (`spec`: a profile's workload, with .model, .batch and .seq),
    and which instrument the measured columns come from."""
    instrument = "CUDA allocator" if allocator else "tracked tensor bytes"
    return f"{spec.model}, batch {spec.batch} x seq {spec.seq}, {recipe} on {device}: the ledger, and measured ({instrument})"


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
