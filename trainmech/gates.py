"""Correctness gates: is a candidate training strategy correct, and only then, is it worth adopting.

The reference and the candidate run through the same gate workload (trainmech.candidates), each
run recorded in a Trace (trainmech.tracing). Four gates judge, in order, up to the first that
fails; a fifth stage measures and never passes or fails:

    1 inputs       per window, the same multiset of sequences reached the model (re-splitting, reordering or
                   packing keeps it), the same windows were handed out, under the same RNG state
    2 gradients    every window's gradients, computed from the reference's weights at that window, agree
                   with the reference's, parameter by parameter, within the tolerance of the dtype that
                   actually ran, which must be the claimed one in every decoder layer
    3 updates      the same number of effective updates, no non-finite value written, and the optimizer's
                   and the scheduler's step counts and learning rates follow the update clock
    4 quality      held-out token loss after the same effective updates, within a fraction of how far
                   training moved it
    5 performance  a measurement, not a gate (its verdict's `passed` is None), only after 1-4 passed

Here: the reference and its noise floor, the tolerances and the four gates (`correctness_gate` applies
them in order); the decision rule (`DecisionRule`, `RULE`, `decide`) is trainmech.decision, re-exported here. Running a candidate through
all five stages and the report it gives are trainmech.gate_report:

    ref = gates.make_reference(gw)                   # the FP32 baseline's trace, and its noise floor
    report = gate_report.judge(candidate, gw, ref)   # gates 1-4, then the measurement, then `decide`
    report.outcome, report.reason                    # accept / tune / no-gain / costs-memory / reject, or None

Tolerances (`tolerances`) start from the dtype (unit roundoff for gradients, a fraction of the
training movement for quality) and are checked against the reference's own noise: it is run again
(run-to-run noise: a tolerance must stand well above it) and with another seed (a changed RNG: a
tolerance must stay well below it, else an RNG bug would pass). `decide` keeps "wrong" (a failed
gate: reject) apart from "not worth it" (correct, no memory and no time gained: no-gain) and from "costs
memory" (correct, nothing gained, and the whole update's peak higher: costs-memory), and counts a
capacity gain (less memory per sequence of a micro-batch, over its forward + backward) even where the optimizer
step still peaks as high.

FP16's GradScaler may skip an update the reference made (an overflow after the calibrated start): that is
GradScaler doing its job, not the candidate's error — if it is an overflow. GradScaler cannot tell: it skips on
any inf or NaN, a bug's as well. So a skip counts as an overflow only where the window's loss is finite and
its gradients, recomputed at a lower scale where they fit (`tracing.Trace.rescaled`), are finite and within
gate 2's tolerance (`overflow_skips`); gate 2 compares those windows too (`judged_grads`), so a NaN from a bug is
a gradient failure, never a skip. Where every skip is an overflow, `gate_report.judge` holds the candidate to
the reference skipping the same attempts, and gate 3 reports those skips apart from the update clock — up to a
quarter of the reference's effective updates (`MAX_SCALER_SKIP_FRACTION`); more, and the loss scale is not
settled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from trainmech.candidates import Candidate, GateWorkload
from trainmech.checks import num
from trainmech.decision import (
    OUTCOMES,
    RECORD_DECISION,
    RULE,
    DecisionRule,
    decide,
    decide_measured,
    timing_spread,
)
from trainmech.tracing import Trace, run_trace

__all__ = [
    "GATES",
    "GRAD_RTOL",
    "GRAD_RTOL_FROM",
    "FLOAT32_LINEARS",
    "GRAD_FLOOR",
    "QUALITY_FRACTION",
    "NOISE_MULTIPLE",
    "SEED_SEPARATION",
    "MAX_SCALER_SKIP_FRACTION",
    "EVIDENCE_LEVEL",
    "OUTCOMES",
    "RECORD_DECISION",
    "gradient_errors",
    "judged_grads",
    "compared_windows",
    "worst_error",
    "movement",
    "NoiseFloor",
    "noise_floor",
    "Tolerances",
    "tolerances",
    "Reference",
    "make_reference",
    "Verdict",
    "inputs_gate",
    "gradients_gate",
    "updates_gate",
    "quality_gate",
    "against_bound",
    "effective_updates",
    "scaler_skips",
    "overflow_skips",
    "dtype_mismatches",
    "correctness_gate",
    "bitwise_equal",
    "DecisionRule",
    "RULE",
    "timing_spread",
    "decide_measured",
    "decide",
]

GATES = ("inputs", "gradients", "updates", "quality", "performance")

# Gate 2: largest |g_candidate - g_reference| of a parameter, relative to that parameter's largest
# reference gradient, by the dtype that ran. float32: bitwise on a CPU; 1e-4 leaves room for GPU
# kernels that reorder sums (atomics). FP16: ~40 unit roundoffs (2^-11); BF16: ~13 (2^-8).
GRAD_RTOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
GRAD_RTOL_FROM = {  # what each tolerance is sized for (a verdict's `rtol_from`)
    "float32": "float32 with reordered sums (GPU atomics)",
    "float16": "float16 rounding",
    "bfloat16": "bfloat16 rounding",
}
# Gate 2's dtype check: every Linear inside the decoder layers must run the claimed dtype; only these Linear
# modules (by name in the model) may run float32 beside it (a mixed-precision recipe may keep the head in full
# precision). An autocast around the head alone leaves the layers in float32: not the claimed FP16.
FLOAT32_LINEARS = ("lm_head",)
GRAD_FLOOR = 1e-3  # a parameter's scale is at least GRAD_FLOOR x the largest gradient of all: no noise ratios
# Gate 4: |held-out token loss of candidate - reference| after the same effective updates, as a fraction of
# how far training moved the reference's held-out loss: a candidate may not change the training outcome by
# more than this share of what training did. 16-bit rounding accumulates over updates, hence wider bounds.
QUALITY_FRACTION = {"float32": 0.005, "float16": 0.02, "bfloat16": 0.05}
NOISE_MULTIPLE = 10  # a tolerance stands at least this far above the reference's run-to-run noise
SEED_SEPARATION = 3  # … and this far below what another RNG seed changes, or an RNG bug would pass
# Gate 3: GradScaler skips of attempts the reference stepped, as a share of the reference's effective updates,
# that are judged like for like (the reference skipping them too). Each overflow halves the scale, so a correct
# candidate after the calibrated start overflows rarely; losing more than this means the scale is not settled.
MAX_SCALER_SKIP_FRACTION = 0.25
EVIDENCE_LEVEL = {"cpu": "cpu-mechanism", "cuda": "gpu-measured"}


# ----------------------------------------------------------------------------- the reference and its noise


def gradient_errors(ref: dict[str, torch.Tensor], cand: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: max |g_cand - g_ref| / max(max |g_ref|, GRAD_FLOOR x the largest |g_ref|), in float64."""
    top = max(float(g.abs().max()) for g in ref.values())
    out = {}
    for name, g in ref.items():
        if name not in cand:
            out[name] = float("inf")
            continue
        scale = max(float(g.abs().max()), GRAD_FLOOR * top, torch.finfo(torch.float64).tiny)
        out[name] = float((cand[name].double() - g.double()).abs().max()) / scale
    return out


def _finite(grads: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads.values())


def judged_grads(cand: Trace, k: int) -> dict[str, torch.Tensor]:
    """The gradients gate 2 compares at attempt k: the judged pass's, or — where GradScaler skipped k on a finite
    loss and those were not finite — the same pass recomputed at the lower scale that made them finite
    (`Trace.rescaled`: an overflow fits there, a bug's NaN or inf does not)."""
    return cand.rescaled[k][1] if k in cand.rescaled else cand.grads[k]


def compared_windows(ref: Trace, cand: Trace) -> list[int]:
    """The attempts whose gradients gate 2 compares: every one the reference finished with finite gradients
    (an injected non-finite sample makes both NaN), as far as the candidate got — those the candidate's
    GradScaler skipped included, by `judged_grads`: a skip is no reason to look away."""
    return [k for k in range(min(len(ref.grads), len(cand.grads))) if _finite(ref.grads[k])]


def worst_error(ref: Trace, cand: Trace, windows: list[int] | None = None) -> float:
    """The largest per-parameter gradient error over the compared windows (inf where a window is missing)."""
    windows = compared_windows(ref, cand) if windows is None else windows
    return max(
        (max(gradient_errors(ref.grads[k], judged_grads(cand, k)).values()) for k in windows),
        default=float("inf"),
    )


def movement(trace: Trace) -> float:
    """How far training moved the held-out loss (nats): the scale gate 4's bound is a fraction of."""
    return abs(trace.held_out_before - trace.held_out_loss)


@dataclass(frozen=True)
class NoiseFloor:
    """The reference against itself: run again (noise) and from another seed (what a changed RNG does)."""

    grad_self: float  # worst per-parameter gradient error over every window, rerun
    grad_seed: float  # worst per-parameter gradient error of the first window, another seed
    quality_self: float  # |Δ held-out loss|, rerun
    quality_seed: float  # |Δ held-out loss|, another seed


def noise_floor(reference: Candidate, gw: GateWorkload, ref_trace: Trace) -> NoiseFloor:
    """Run the reference twice more, each window from the reference's own weights: with the workload's seed (its
    run-to-run noise; 0 on a CPU) and with the next seed (dropout draws other masks: the effect an RNG bug has)."""
    again = run_trace(reference, gw, teacher=ref_trace)
    grad_self, again.grads = worst_error(ref_trace, again), []  # one run's gradients in host memory at a time
    other = run_trace(reference, gw, seed=gw.seed + 1, teacher=ref_trace)
    return NoiseFloor(
        grad_self,
        worst_error(ref_trace, other, [0]),
        abs(again.held_out_loss - ref_trace.held_out_loss),
        abs(other.held_out_loss - ref_trace.held_out_loss),
    )


@dataclass(frozen=True)
class Tolerances:
    grad_rtol: float
    quality_bound: float  # nats
    grad_from: str  # GRAD_RTOL_FROM[dtype], or "10 x run-to-run noise"
    quality_from: str


def tolerances(dtype: str, ref: Trace, floor: NoiseFloor | None = None) -> Tolerances:
    """Gate 2's and gate 4's tolerances for a dtype: from the dtype, raised to NOISE_MULTIPLE x the reference's
    run-to-run noise where that is larger (a GPU's atomics); quality as a fraction of the training movement."""
    grad, grad_from = GRAD_RTOL[dtype], GRAD_RTOL_FROM[dtype]
    quality, quality_from = (
        QUALITY_FRACTION[dtype] * movement(ref),
        f"{QUALITY_FRACTION[dtype]:g} x the training movement",
    )
    if floor is not None and NOISE_MULTIPLE * floor.grad_self > grad:
        grad, grad_from = NOISE_MULTIPLE * floor.grad_self, f"{NOISE_MULTIPLE} x run-to-run noise"
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

    def skipping(self, gw: GateWorkload, attempts: list[int]) -> tuple[GateWorkload, Reference]:
        """The workload with `attempts` skipped too (a non-finite sample there, as at `inject_at`), and the
        reference run on it: what a candidate whose GradScaler skipped those attempts is held to."""
        skipped = dataclasses.replace(gw, inject_at=tuple(sorted({*gw.inject_at, *attempts})))
        trace = run_trace(self.candidate, skipped, keep_weights=True)
        return skipped, Reference(self.candidate, trace, self.floor, self.peaks)


def make_reference(
    gw: GateWorkload, candidate: Candidate | None = None, *, calibrate: bool = True
) -> Reference:
    """The FP32 baseline (no strategy) through the gate workload, and its noise floor (two more runs)."""
    candidate = candidate or Candidate("fp32-baseline", "TRAIN-AMP-BACKWARD")
    trace = run_trace(candidate, gw, keep_weights=True)
    return Reference(candidate, trace, noise_floor(candidate, gw, trace) if calibrate else None)


# ----------------------------------------------------------------------------- the gates
#
# Each gate is a pure function (reference trace, candidate trace, claimed dtype, tolerances) -> Verdict.


@dataclass
class Verdict:
    name: str
    passed: bool | None  # None: a measurement, not a pass / fail judgement (the performance stage)
    evidence: dict
    message: str

    @property
    def failed(self) -> bool:
        return self.passed is False


def _stopped(trace: Trace) -> tuple[int, str] | None:
    """(attempt, stage) where the candidate's exception ended the run, or None."""
    if not trace.error:
        return None
    head = trace.error.split(":")[0]  # "attempt 3, backward"
    attempt, stage = head.removeprefix("attempt ").split(", ")
    return int(attempt), stage


def inputs_gate(
    ref: Trace, cand: Trace, claimed_dtype: str = "float32", tol: Tolerances | None = None
) -> Verdict:
    """Gate 1: the same windows handed out, the same multiset of sequences consumed per window, the same RNG states."""
    n = len(cand.consumed)
    evidence = {
        "attempts": n,
        "sequences_consumed": sum(map(len, cand.consumed)),
        "sequences_expected": sum(map(len, ref.consumed[:n])),
        "tokens_consumed": cand.tokens,
    }
    if cand.handed != ref.handed[:n]:
        return Verdict("inputs", False, evidence, "the windows handed out differ from the reference's")
    stopped = _stopped(cand)

    def same(a: int) -> bool:  # a run the candidate's exception ended consumed only part of its last window
        got, want = sorted(cand.consumed[a]), sorted(ref.consumed[a])
        if stopped and a == n - 1:
            return all(got.count(d) <= want.count(d) for d in set(got))
        return got == want

    differ = next((a for a in range(n) if not same(a)), None)
    if differ is not None:
        evidence["first_difference"] = differ
        got, want = len(cand.consumed[differ]), len(ref.consumed[differ])
        return Verdict(
            "inputs",
            False,
            evidence,
            f"attempt {differ}: the model received {got} of the reference's {want} sequences, or other ones",
        )
    if cand.rng != ref.rng[:n]:
        return Verdict(
            "inputs", False, evidence, "the RNG state at a window's start differs from the reference's"
        )
    if stopped:  # gate 2 or 3 judges the exception itself
        return Verdict(
            "inputs",
            True,
            evidence,
            f"identical as far as the run went ({evidence['sequences_consumed']} "
            f"sequences; it stopped at attempt {stopped[0]}, {stopped[1]})",
        )
    return Verdict(
        "inputs",
        True,
        evidence,
        f"{n} windows, {evidence['sequences_consumed']} sequences as multisets, RNG states equal",
    )


def dtype_mismatches(cand: Trace, claimed_dtype: str) -> dict[str, list[str]]:
    """The Linear modules whose outputs in the first window were not what the claim allows: every one must run
    the claimed dtype, alone; those named in FLOAT32_LINEARS may run float32 instead (or beside it)."""
    allowed = lambda name: {claimed_dtype} | ({"float32"} if name in FLOAT32_LINEARS else set())  # noqa: E731
    return {
        name: ran
        for name, ran in cand.linear_dtypes.items()
        if not set(ran) <= allowed(name) or (name not in FLOAT32_LINEARS and claimed_dtype not in ran)
    }


def _not_an_overflow(cand: Trace, k: int) -> str:
    """Why a window GradScaler skipped is no overflow (for gate 2's message), or "" where it did not skip."""
    if not (k < len(cand.scaler_backoff) and cand.scaler_backoff[k]):
        return ""
    if not math.isfinite(cand.losses[k]):
        return (
            " (GradScaler skipped it, but its loss is not finite: no loss scale fixes a forward's NaN or inf)"
        )
    if k in cand.rescaled:
        scale, grads = cand.rescaled[k]
        state = "finite but off the reference's" if _finite(grads) else "still not finite"
        return f" (GradScaler skipped it; recomputed at loss scale {scale:g} its gradients are {state}: not an overflow)"
    return " (GradScaler skipped it)"


def gradients_gate(
    ref: Trace, cand: Trace, claimed_dtype: str = "float32", tol: Tolerances | None = None
) -> Verdict:
    """Gate 2: the claimed dtype ran in every decoder-layer Linear (only FLOAT32_LINEARS, e.g. the head, may run
    float32 beside or instead of it: an autocast around the head alone is no FP16 candidate); in every compared
    window — a window GradScaler skipped by its gradients at a scale where they fit (`judged_grads`) — every
    parameter's gradient within the claimed dtype's tolerance."""
    tol = tol or tolerances(claimed_dtype, ref)
    stopped = _stopped(cand)
    if not cand.grads:
        return Verdict("gradients", False, {"error": cand.error}, f"no gradients: {cand.error}")
    ran = cand.dtypes
    evidence = {
        "claimed_dtype": claimed_dtype,
        "ran": "/".join(ran),
        "rtol": tol.grad_rtol,
        "rtol_from": tol.grad_from,
    }
    off = dtype_mismatches(cand, claimed_dtype)
    evidence["dtype_mismatches"] = off
    if off or not cand.linear_dtypes:
        first = next(iter(off), None)
        where = (
            f"{len(off)} of {len(cand.linear_dtypes)} Linear modules ran other dtypes (first: {first}, "
            f"{'/'.join(off[first])})"
            if off
            else "no Linear module ran"
        )
        return Verdict("gradients", False, evidence, f"claims {claimed_dtype}, but {where}")
    windows = compared_windows(ref, cand)
    if not windows:
        return Verdict("gradients", False, evidence, "no window to compare: the reference has no finite one")
    per_window = {k: gradient_errors(ref.grads[k], judged_grads(cand, k)) for k in windows}
    bound = lambda k: tol.grad_rtol  # noqa: E731
    first = per_window.get(0, {})
    everywhere = {
        n: max(e[n] for e in per_window.values()) for n in ref.grads[0]
    }  # each parameter's worst window
    worst = sorted(everywhere, key=lambda n: (-everywhere[n], n))[:3]
    bad_windows = [
        k for k, e in per_window.items() if not all(v <= bound(k) for v in e.values())
    ]  # NaN and inf fail
    evidence |= {
        "errors": first,
        "errors_all_windows": everywhere,
        "worst": {n: everywhere[n] for n in worst},
        "windows_compared": len(windows),
        "compared": windows,  # the attempts whose gradients were compared, in order
        "window_worst": [max(per_window[k].values()) for k in windows],  # … the worst error of each
        "first_bad_window": bad_windows[0] if bad_windows else None,
        "rescaled": {k: cand.rescaled[k][0] for k in windows if k in cand.rescaled},  # attempt -> loss scale
        "parameters": len(everywhere),
        "loss_abs_error": max(abs(cand.losses[k] - ref.losses[k]) for k in windows),
        "grad_max_abs_error": max(
            float((judged_grads(cand, k)[n] - g).abs().max())
            for k in windows
            for n, g in ref.grads[k].items()
            if n in judged_grads(cand, k)
        ),
    }
    if stopped and stopped[1] == "backward":
        return Verdict(
            "gradients", False, evidence, f"no gradients from attempt {stopped[0]} on: {cand.error}"
        )
    if bad_windows:
        k = bad_windows[0]
        name = max(per_window[k], key=lambda n: (per_window[k][n], n))
        over = sum(not v <= bound(k) for v in per_window[k].values())
        return Verdict(
            "gradients",
            False,
            evidence,
            f"window {k}: {over} of {len(everywhere)} parameters over {bound(k):.0e}; "
            f"worst {name} at {per_window[k][name]:.1e}{_not_an_overflow(cand, k)}",
        )
    return Verdict(
        "gradients",
        True,
        evidence,
        f"{len(windows)} windows, all {len(everywhere)} parameters within "
        f"{tol.grad_rtol:.0e} ({claimed_dtype})",
    )


def effective_updates(trace: Trace) -> int:
    """Attempts that stepped and wrote only finite values: the update clock's count."""
    return sum(s and f for s, f in zip(trace.stepped, trace.finite))


def scaler_skips(ref: Trace, cand: Trace) -> list[int]:
    """Attempts the reference stepped where the candidate's GradScaler lowered its scale and skipped the step."""
    return [
        a
        for a, (stepped, backoff) in enumerate(zip(cand.stepped, cand.scaler_backoff))
        if backoff and not stepped and a < len(ref.stepped) and ref.stepped[a]
    ]


def overflow_skips(ref: Trace, cand: Trace, tol: Tolerances) -> list[int]:
    """The scaler skips that are overflows of the scaled backward, GradScaler doing its job: the window's loss
    finite, and its gradients (`judged_grads`: at a lower scale where they fit) finite and within gate 2's
    tolerance of the reference's. A NaN or inf from a bug — a zero-token divide, a forward overflowing FP16 —
    stays at every scale: such a skip is not forgiven, gate 2 fails it."""
    return [
        k
        for k in scaler_skips(ref, cand)
        if k < min(len(cand.grads), len(ref.grads))
        and math.isfinite(cand.losses[k])
        and _finite(judged_grads(cand, k))
        and max(gradient_errors(ref.grads[k], judged_grads(cand, k)).values()) <= tol.grad_rtol
    ]


def updates_gate(
    ref: Trace,
    cand: Trace,
    claimed_dtype: str = "float32",
    tol: Tolerances | None = None,
    expected_lrs: list[float] | None = None,
    skipped_by_scaler: list[int] = (),
) -> Verdict:
    """Gate 3: effective updates as many as the reference's, nothing non-finite written, and the
    optimizer, the scheduler and the learning rates following the update clock.

    skipped_by_scaler: attempts the candidate's GradScaler skipped where the reference (before
    `gate_report.judge` held the candidate to a reference skipping them too) stepped: reported apart; more
    than MAX_SCALER_SKIP_FRACTION of the reference's effective updates fail. Without it, any found here count."""
    effective, want = effective_updates(cand), effective_updates(ref)
    overflowed = list(skipped_by_scaler) or scaler_skips(ref, cand)
    lrs = expected_lrs if expected_lrs is not None else ref.lrs
    evidence = {
        "attempts": len(cand.stepped),
        "effective_updates": effective,
        "expected_effective_updates": want,
        "skipped_updates": len(cand.stepped) - effective,
        "non_finite_written": not all(cand.finite),
        "optimizer_steps": cand.optimizer_steps,
        "scheduler_steps": cand.scheduler_steps,
        "loss_scale_halvings": cand.scale_halvings,
        "scaler_skips": overflowed,
    }
    too_many = len(overflowed) > MAX_SCALER_SKIP_FRACTION * (want + len(skipped_by_scaler))
    mismatch = next((k for k, (a, b) in enumerate(zip(cand.lrs, lrs)) if a != b), None)
    evidence["first_lr_mismatch"] = mismatch
    off_clock = (
        ""
        if mismatch is None
        else f"effective update {mismatch} ran at lr {cand.lrs[mismatch]:.3e}, the clock says {lrs[mismatch]:.3e}"
    )
    checks = [  # the first that holds is the verdict's message
        (cand.error is not None, f"the run stopped: {cand.error}"),
        (evidence["non_finite_written"], "a non-finite value was written into the parameters"),
        (
            too_many,
            f"GradScaler skipped {len(overflowed)} attempts the reference stepped ({overflowed}): more than "
            f"{MAX_SCALER_SKIP_FRACTION:.0%} of its effective updates, the loss scale is not settled",
        ),
        (effective != want, f"{effective} effective updates, the reference made {want}"),
        (
            cand.optimizer_steps != effective,
            f"the optimizer counted {cand.optimizer_steps} steps for {effective} effective updates",
        ),
        (
            cand.scheduler_steps != effective,
            f"the scheduler moved {cand.scheduler_steps} times for {effective} effective updates",
        ),
        (mismatch is not None, off_clock),
    ]
    problem = next((message for failed, message in checks if failed), None)
    if problem:
        return Verdict("updates", False, evidence, problem)
    skipped = evidence["skipped_updates"]
    apart = (
        f" (GradScaler skipped attempts {overflowed}, the reference skipped them too)" if overflowed else ""
    )
    return Verdict(
        "updates",
        True,
        evidence,
        f"{effective} effective + {skipped} skipped; optimizer, scheduler and lr follow the clock{apart}",
    )


def against_bound(delta: float, bound: float) -> str:
    """A noise-level |Δ| as a verdict against its bound: "= 0, within" when exactly 0, "within" when inside (its
    digits, which another machine's rounding moves, and even its power of ten, are not shown), and the number
    itself only when over ("= 0.019, over": a failing gate needs it). NaN is over."""
    if delta == 0:
        return "= 0, within"
    return "within" if delta <= bound else f"= {num(delta, 2)}, over"


def quality_gate(
    ref: Trace, cand: Trace, claimed_dtype: str = "float32", tol: Tolerances | None = None
) -> Verdict:
    """Gate 4: held-out token loss after the same effective updates within the bound (a fraction of the
    reference's training movement)."""
    tol = tol or tolerances(claimed_dtype, ref)
    delta = abs(cand.held_out_loss - ref.held_out_loss)
    evidence = {
        "held_out_loss": cand.held_out_loss,
        "reference_held_out_loss": ref.held_out_loss,
        "delta": delta,
        "bound": tol.quality_bound,
        "bound_from": tol.quality_from,
        "movement": movement(ref),
    }
    passed = delta <= tol.quality_bound
    return Verdict(
        "quality",
        passed,
        evidence,
        f"held-out loss {num(cand.held_out_loss)} vs {num(ref.held_out_loss)}: "
        f"|Δ| {against_bound(delta, tol.quality_bound)} the bound "
        f"{num(tol.quality_bound, 2)} nats ({tol.quality_from})",
    )


def correctness_gate(
    ref: Trace,
    cand: Trace,
    claimed_dtype: str,
    tol: Tolerances,
    expected_lrs: list[float],
    skipped_by_scaler: list[int] = (),
) -> list[Verdict]:
    """The glossary's correctness gate: gates 1-4 in order (inputs, gradients, updates, quality), up to the
    first that fails. A candidate that passes all four is correct; only then is it worth measuring."""
    verdicts = []
    for gate in (inputs_gate, gradients_gate, updates_gate, quality_gate):
        extra = (
            {"expected_lrs": expected_lrs, "skipped_by_scaler": skipped_by_scaler}
            if gate is updates_gate
            else {}
        )
        verdicts.append(gate(ref, cand, claimed_dtype, tol, **extra))
        if not verdicts[-1].passed:
            break
    return verdicts


def bitwise_equal(ref: Trace, cand: Trace) -> bool:
    """Every window's loss and every gradient tensor bitwise equal to the reference's (over the candidate's
    windows, which may be fewer): what a strategy that changes no arithmetic (recompute the same ops, fetch
    back the same bits) must give on a CPU."""
    n = len(cand.grads)
    return (
        cand.error is None
        and 0 < n <= len(ref.grads)
        and cand.losses == ref.losses[:n]
        and all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            for a, b in zip(cand.grads, ref.grads)
        )
    )
