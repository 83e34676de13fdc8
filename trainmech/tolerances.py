"""The reference a candidate is held to and the tolerances of the correctness gates (trainmech.gates).

The reference is the FP32 baseline run through the gate workload (`make_reference`), run twice more to
measure its own noise (`noise_floor`): again with the same seed (run-to-run noise: 0 on a CPU, a GPU's
atomics elsewhere) and with the next seed (what a changed RNG does). A tolerance (`tolerances`) starts from
the dtype that ran — `GRAD_RTOL` for gate 2's per-parameter gradient error (`gradient_errors`),
`QUALITY_FRACTION` of the training movement (`movement`) for gate 4's held-out loss — and is raised to
`NOISE_MULTIPLE` x the run-to-run noise where that is larger; it must stay `SEED_SEPARATION` x below what
another seed changes, or an RNG bug would pass.

The gates themselves are trainmech.gates, which re-exports everything here (`gates.GRAD_RTOL`, …).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from trainmech.candidates import Candidate, GateWorkload
from trainmech.tracing import Trace, all_finite, run_trace

__all__ = [
    "GRAD_RTOL",
    "GRAD_RTOL_FROM",
    "BITWISE_FLOAT32_FROM",
    "GRAD_FLOOR",
    "QUALITY_FRACTION",
    "NOISE_MULTIPLE",
    "SEED_SEPARATION",
    "gradient_errors",
    "judged_grads",
    "compared_windows",
    "worst_error",
    "worst_of",
    "movement",
    "NoiseFloor",
    "noise_floor",
    "Tolerances",
    "tolerances",
    "Reference",
    "make_reference",
]

# Gate 2: largest |g_candidate - g_reference| of a parameter, relative to that parameter's largest
# reference gradient, by the dtype that ran. float32: bitwise on a CPU; 1e-4 leaves room for GPU
# kernels that reorder sums (atomics). FP16: ~40 unit roundoffs (2^-11); BF16: ~13 (2^-8).
GRAD_RTOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
GRAD_RTOL_FROM = {  # what each tolerance is sized for (a verdict's `rtol_from`)
    "float32": "float32 with reordered sums (GPU atomics)",
    "float16": "float16 rounding",
    "bfloat16": "bfloat16 rounding",
}
BITWISE_FLOAT32_FROM = "float32: room left for reordered sums, unused here: the reference reran bitwise"
GRAD_FLOOR = 1e-3  # a parameter's scale is at least GRAD_FLOOR x the largest gradient of all: no noise ratios
# Gate 4: |held-out token loss of candidate - reference| after the same effective updates, as a fraction of
# how far training moved the reference's held-out loss: a candidate may not change the training outcome by
# more than this share of what training did. 16-bit rounding accumulates over updates, hence wider bounds.
QUALITY_FRACTION = {"float32": 0.005, "float16": 0.02, "bfloat16": 0.05}
NOISE_MULTIPLE = 10  # a tolerance stands at least this far above the reference's run-to-run noise
SEED_SEPARATION = 3  # … and this far below what another RNG seed changes, or an RNG bug would pass


# ----------------------------------------------------------------------------- the reference and its noise


def gradient_errors(ref: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: max |g_cand - g_ref| / max(max |g_ref|, GRAD_FLOOR x the largest |g_ref|), in float64."""
    top = max(float(g.abs().max()) for g in ref.values())
    out = {}
    for name, g in ref.items():
        if name not in candidate:
            out[name] = float("inf")
            continue
        scale = max(float(g.abs().max()), GRAD_FLOOR * top, torch.finfo(torch.float64).tiny)
        out[name] = float((candidate[name].double() - g.double()).abs().max()) / scale
    return out


def judged_grads(candidate: Trace, k: int) -> dict[str, torch.Tensor]:
    """The gradients gate 2 compares at attempt k: the judged pass's, or — where GradScaler skipped k on a finite
    loss and those were not finite — the same pass recomputed at the lower scale that made them finite
    (`Trace.rescaled`: an overflow fits there, a bug's NaN or inf does not)."""
    return candidate.rescaled[k][1] if k in candidate.rescaled else candidate.grads[k]


def compared_windows(ref: Trace, candidate: Trace) -> list[int]:
    """The attempts whose gradients gate 2 compares: every one the reference finished with finite gradients
    (an injected non-finite sample makes both NaN), as far as the candidate got — those the candidate's
    GradScaler skipped included, by `judged_grads`: a skip is no reason to look away."""
    return [k for k in range(min(len(ref.grads), len(candidate.grads))) if all_finite(ref.grads[k].values())]


def worst_of(values, default: float = float("inf")) -> float:
    """The largest of `values`, NaN where any is NaN (Python's max keeps a NaN only when it comes first);
    `default` where there are none."""
    values = list(values)
    if any(math.isnan(v) for v in values):
        return float("nan")
    return max(values, default=default)


def worst_error(ref: Trace, candidate: Trace, windows: list[int] | None = None) -> float:
    """The largest per-parameter gradient error over the compared windows (inf where a window is missing)."""
    windows = compared_windows(ref, candidate) if windows is None else windows
    return worst_of(
        worst_of(gradient_errors(ref.grads[k], judged_grads(candidate, k)).values()) for k in windows
    )


def movement(trace: Trace) -> float:
    """How far training moved the held-out loss (nats): the scale gate 4's bound is a fraction of."""
    return abs(trace.held_out_before - trace.held_out_loss)


@dataclass(frozen=True)
class NoiseFloor:
    """The reference against itself: run again (noise) and from another seed (what a changed RNG does)."""

    grad_self: float  # worst per-parameter gradient error over every window, rerun
    grad_seed: float  # another seed: the worst per-parameter gradient error of each window, smallest over the windows
    quality_self: float  # |Δ held-out loss|, rerun
    quality_seed: float  # |Δ held-out loss|, another seed


def noise_floor(reference: Candidate, workload: GateWorkload, ref_trace: Trace) -> NoiseFloor:
    """Run the reference twice more, each window from the reference's own weights: with the workload's seed (its
    run-to-run noise; 0 on a CPU) and with the next seed (dropout draws other masks: the effect an RNG bug has).
    Gate 2 compares every window and an RNG bug may strike in any one of them, so the seed's effect is the
    window where it is smallest: `grad_seed` is the smallest, over the compared windows, of each window's worst."""
    again = run_trace(reference, workload, teacher=ref_trace)
    grad_self, again.grads = worst_error(ref_trace, again), []  # one run's gradients in host memory at a time
    other = run_trace(reference, workload, seed=workload.seed + 1, teacher=ref_trace)
    return NoiseFloor(
        grad_self,
        min(worst_error(ref_trace, other, [k]) for k in compared_windows(ref_trace, other)),
        abs(again.held_out_loss - ref_trace.held_out_loss),
        abs(other.held_out_loss - ref_trace.held_out_loss),
    )


@dataclass(frozen=True)
class Tolerances:
    grad_rtol: float
    quality_bound: float  # nats
    grad_from: str  # GRAD_RTOL_FROM[dtype], BITWISE_FLOAT32_FROM, or "10 x run-to-run noise"
    quality_from: str


def tolerances(dtype: str, ref: Trace, floor: NoiseFloor | None = None) -> Tolerances:
    """Gate 2's and gate 4's tolerances for a dtype: from the dtype, raised to NOISE_MULTIPLE x the reference's
    run-to-run noise where that is larger (a GPU's atomics); quality as a fraction of the training movement.
    `grad_from` says what applies on the device that ran: float32's room for reordered sums is named unused
    where the reference reran bitwise (a CPU)."""
    grad, grad_from = GRAD_RTOL[dtype], GRAD_RTOL_FROM[dtype]
    quality, quality_from = (
        QUALITY_FRACTION[dtype] * movement(ref),
        f"{QUALITY_FRACTION[dtype]:g} x the training movement",
    )
    if floor is not None and NOISE_MULTIPLE * floor.grad_self > grad:
        grad, grad_from = NOISE_MULTIPLE * floor.grad_self, f"{NOISE_MULTIPLE} x run-to-run noise"
    elif (
        floor is not None and floor.grad_self == 0 and dtype == "float32"
    ):  # what applies where the rerun was bitwise
        grad_from = BITWISE_FLOAT32_FROM
    if floor is not None and NOISE_MULTIPLE * floor.quality_self > quality:
        quality, quality_from = NOISE_MULTIPLE * floor.quality_self, f"{NOISE_MULTIPLE} x run-to-run noise"
    return Tolerances(grad, quality, grad_from, quality_from)


@dataclass
class Reference:
    """What every candidate is held to: the reference candidate, its trace, and its noise floor."""

    candidate: Candidate
    trace: Trace
    floor: NoiseFloor | None = None
    peaks: dict = field(
        default_factory=dict
    )  # its peaks on a workload, measured once for every candidate (performance.remeasure)

    def tolerances(self, dtype: str) -> Tolerances:
        return tolerances(dtype, self.trace, self.floor)

    def skipping(self, workload: GateWorkload, attempts: list[int]) -> tuple[GateWorkload, Reference]:
        """The workload with `attempts` skipped too (a non-finite sample there, as at `inject_at`), and the
        reference run on it: what a candidate whose GradScaler skipped those attempts is held to."""
        skipped = dataclasses.replace(workload, inject_at=tuple(sorted({*workload.inject_at, *attempts})))
        trace = run_trace(self.candidate, skipped, keep_weights=True)
        return skipped, Reference(self.candidate, trace, self.floor, self.peaks)


def make_reference(
    workload: GateWorkload, candidate: Candidate | None = None, *, calibrate: bool = True
) -> Reference:
    """The FP32 baseline (no strategy) through the gate workload, and its noise floor (two more runs)."""
    candidate = candidate or Candidate("fp32-baseline", "TRAIN-AMP-BACKWARD")
    trace = run_trace(candidate, workload, keep_weights=True)
    return Reference(candidate, trace, noise_floor(candidate, workload, trace) if calibrate else None)
