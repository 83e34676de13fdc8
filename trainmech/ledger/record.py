"""What a TRAIN-STATE-LEDGER record says about one measured point: its allocator peaks beside the
allocator model's, and the record's `resources`, `correctness` and `metrics` fields.

    allocated_reserved(first, steady)      allocated / reserved peaks: the allocator's, the model's
    record_fields(point, points, …)        the record's fields, counted from what ran
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainmech.errors import TrainmechError
from trainmech.ledger import allocator as allocator_model
from trainmech.ledger.compare import MEASURED_PEAK_WITH, Comparison

__all__ = ["AllocatedReserved", "allocated_reserved", "record_fields"]


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
    def model_beats_tracked(self) -> bool:
        """The model's allocated peak is nearer the allocator's than the tracked tensors are: its rounding
        and block splitting explain part of what the allocator holds beyond the tensors (a model that
        returned the unrounded tensor peak would tie, not win)."""
        measured = self.measured_allocated
        return abs(self.model.allocated_peak - measured) < abs(measured - self.tracked_bytes)

    @property
    def reserved_error(self) -> float | None:
        """(model − measured) / measured of the reserved peak; None where the allocator reports none."""
        if self.measured_reserved is None:
            return None
        return self.model.reserved_peak / self.measured_reserved - 1

    def lines(self) -> list[str]:
        """The allocated peak beside the tracked tensors and the allocator model's allocated peak beside it
        (every allocator); the reserved peak beside the model's where the allocator reports one (CUDA)."""
        who = "the CPU allocator, counted by torch.profiler" if self.source == "cpu-profiler" else "CUDA"
        measured, model = self.measured_allocated, self.model
        out = [
            f"allocated peak of the update ({who}): {measured:,}   "
            f"tracked tensors {self.tracked_bytes:,} ({self.tracked_error:+.2%})",
            f"allocator model (CUDA's caching allocator, blocks rounded to {allocator_model.BLOCK_ROUND} B): "
            f"allocated peak {model.allocated_peak:,}, {model.allocated_peak - measured:+,} B "
            f"({self.allocated_error:+.2%}) beside the measured {measured:,}",
        ]
        if self.measured_reserved is None:
            return out + [
                f"reserved peak: unknown (this allocator reports none); the model's {model.reserved_peak:,} is "
                "CUDA's caching allocator's, which does not run here"
            ]
        return out + [
            f"allocator model: reserved peak {model.reserved_peak:,} ({self.reserved_error:+.2%} of the measured "
            f"{self.measured_reserved:,}, whole process)"
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
        # one path on every allocator: the model replays CUDA's rules, which this configuration may change
        allocator_model.cuda_peaks(first.predicted, steady.predicted, alloc_conf=_alloc_conf()),
    )


def _alloc_conf() -> str | None:
    """This process's CUDA allocator configuration (torch reads PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF)."""
    import os

    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")


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
    effective: an update that ran (`StepMemory.stepped`, counted from what ran: every parameter's AdamW step
    count moved on, or a step post-hook fired) with a finite loss and finite gradients is effective, one
    that did not run is skipped; a non-finite update that ran is neither (it was applied). On CUDA the
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
