"""Correctness gates: is a candidate training strategy correct, and only then, is it worth adopting.

The reference and the candidate run through the same gate workload (trainmech.candidates), each
run recorded in a Trace (trainmech.tracing). Four gates judge, in order, up to the first that
fails; a fifth stage measures and never passes or fails:

    1 inputs       per window, the same multiset of sequences reached the model (re-splitting, reordering or
                   packing keeps it), the same windows were handed out, under the same RNG state (at every
                   attempt's start and after the last one)
    2 gradients    every window's gradients, computed from the reference's weights at that window, agree
                   with the reference's, parameter by parameter, within the tolerance of the dtype that
                   actually ran, which must be the claimed one in every decoder layer, in every window
    3 updates      the same number of effective updates, no non-finite value written, and the optimizer's
                   and the scheduler's step counts and learning rates follow the update clock
    4 quality      held-out token loss after the same effective updates, within a fraction of how far
                   training moved it
    5 performance  a measurement, not a gate (its verdict's `passed` is None), only after 1-4 passed

Here: the four gates (`correctness_gate` applies them in order). The reference, its noise floor and the
tolerances are trainmech.tolerances; the decision rule (`DecisionRule`, `RULE`, `decide`) is
trainmech.decision; both re-exported here. Running a candidate through all five stages and the report it
gives are trainmech.gate_report:

    reference = gates.make_reference(workload)                 # the FP32 baseline's trace, and its noise floor
    report = gate_report.judge(candidate, workload, reference)  # gates 1-4, then the measurement, then `decide`
    report.outcome, report.reason                              # accept / tune / no-gain / costs-memory / reject, or None

Tolerances (`tolerances`, trainmech.tolerances) start from the dtype (unit roundoff for gradients, a fraction of the
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

import math
import struct
from dataclasses import dataclass

import torch

from trainmech import decision as _decision
from trainmech import tolerances as _tolerances
from trainmech.checks import num
from trainmech.decision import *  # noqa: F403  re-exported: gates.decide, gates.RULE, …
from trainmech.tolerances import *  # noqa: F403  re-exported: gates.GRAD_RTOL, gates.make_reference, …
from trainmech.tolerances import (
    Tolerances,
    compared_windows,
    gradient_errors,
    judged_grads,
    movement,
    tolerances,
    worst_of,
)
from trainmech.tracing import Trace, all_finite

__all__ = [
    "GATES",
    "FLOAT32_LINEARS",
    "MAX_SCALER_SKIP_FRACTION",
    "EVIDENCE_LEVEL",
    "Verdict",
    "inputs_gate",
    "gradients_gate",
    "updates_gate",
    "quality_gate",
    "against_bound",
    "effective_updates",
    "scaler_skips",
    "overflow_skips",
    "stopped_at",
    "dtype_mismatches",
    "first_dtype_mismatch",
    "correctness_gate",
    "bitwise_equal",
    *_decision.__all__,  # the decision rule, re-exported: gates.decide, gates.RULE, …
    *_tolerances.__all__,
]

GATES = ("inputs", "gradients", "updates", "quality", "performance")

# Gate 2's dtype check: every Linear inside the decoder layers must run the claimed dtype; only these Linear
# modules (by name in the model) may run float32 beside it (a mixed-precision recipe may keep the head in full
# precision). An autocast around the head alone leaves the layers in float32: not the claimed FP16.
FLOAT32_LINEARS = ("lm_head",)
# Gate 3: GradScaler skips of attempts the reference stepped, as a share of the reference's effective updates,
# that are judged like for like (the reference skipping them too). Each overflow halves the scale, so a correct
# candidate after the calibrated start overflows rarely; losing more than this means the scale is not settled.
MAX_SCALER_SKIP_FRACTION = 0.25
EVIDENCE_LEVEL = {"cpu": "cpu-mechanism", "cuda": "gpu-measured"}


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


def stopped_at(trace: Trace) -> tuple[int, str] | None:
    """(attempt, stage) where the candidate's exception ended the run ("backward" or "update"), or None."""
    if not trace.error:
        return None
    head = trace.error.split(":")[0]  # "attempt 3, backward"
    attempt, stage = head.removeprefix("attempt ").split(", ")
    return int(attempt), stage


def inputs_gate(
    ref: Trace, candidate: Trace, claimed_dtype: str = "float32", tol: Tolerances | None = None
) -> Verdict:
    """Gate 1: the same windows handed out, the same multiset of sequences consumed per window, the same RNG states at
    every attempt's start and after the last one."""
    n = len(candidate.consumed)
    evidence = {
        "attempts": n,
        "sequences_consumed": sum(map(len, candidate.consumed)),
        "sequences_expected": sum(map(len, ref.consumed[:n])),
        "tokens_consumed": candidate.tokens,
    }
    if candidate.handed != ref.handed[:n]:
        return Verdict("inputs", False, evidence, "the windows handed out differ from the reference's")
    stopped = stopped_at(candidate)

    def same(a: int) -> bool:  # a run the candidate's exception ended consumed only part of its last window
        got, want = sorted(candidate.consumed[a]), sorted(ref.consumed[a])
        if stopped and a == n - 1:
            return all(got.count(d) <= want.count(d) for d in set(got))
        return got == want

    differ = next((a for a in range(n) if not same(a)), None)
    if differ is not None:
        evidence["first_difference"] = differ
        got, want = len(candidate.consumed[differ]), len(ref.consumed[differ])
        return Verdict(
            "inputs",
            False,
            evidence,
            f"attempt {differ}: the model received {got} of the reference's {want} sequences (or different ones)",
        )
    differ = next((a for a, (got, want) in enumerate(zip(candidate.rng, ref.rng)) if got != want), None)
    if differ is not None or len(candidate.rng) > len(ref.rng):
        at = differ if differ is not None else len(ref.rng)
        return Verdict(
            "inputs",
            False,
            evidence,
            f"attempt {at}: the RNG state at its start differs from the reference's",
        )
    if candidate.rng_after is not None and candidate.rng_after != ref.rng_after:
        return Verdict(
            "inputs",
            False,
            evidence,
            f"the RNG state after the last attempt ({n - 1}) differs from the reference's",
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


def dtype_mismatches(linears: dict[str, list[str]], claimed_dtype: str) -> dict[str, list[str]]:
    """The Linear modules of one attempt (`Trace.linear_dtypes[a]`) whose outputs were not what the claim allows:
    every one must run the claimed dtype, alone; those named in FLOAT32_LINEARS may run float32 instead (or beside it)."""
    allowed = lambda name: {claimed_dtype} | ({"float32"} if name in FLOAT32_LINEARS else set())  # noqa: E731
    return {
        name: ran
        for name, ran in linears.items()
        if not set(ran) <= allowed(name) or (name not in FLOAT32_LINEARS and claimed_dtype not in ran)
    }


def first_dtype_mismatch(candidate: Trace, claimed_dtype: str) -> tuple[int, dict[str, list[str]]] | None:
    """(the first attempt where a Linear module ran off the claim or none ran, its `dtype_mismatches`), or None: the
    claim is held in every attempt, own and teacher-forced passes alike, so a candidate that runs the claimed dtype
    in the first window and another one later is caught where it changes."""
    for attempt, linears in enumerate(candidate.linear_dtypes or [{}]):
        off = dtype_mismatches(linears, claimed_dtype)
        if off or not linears:
            return attempt, off
    return None


def _not_an_overflow(candidate: Trace, k: int) -> str:
    """Why a window GradScaler skipped is no overflow (for gate 2's message), or "" where it did not skip."""
    if not (k < len(candidate.scaler_backoff) and candidate.scaler_backoff[k]):
        return ""
    if not math.isfinite(candidate.losses[k]):
        return (
            " (GradScaler skipped it, but its loss is not finite: no loss scale fixes a forward's NaN or inf)"
        )
    if k in candidate.rescaled:
        scale, grads = candidate.rescaled[k]
        state = "finite but off the reference's" if all_finite(grads.values()) else "still not finite"
        return f" (GradScaler skipped it; recomputed at loss scale {scale:g} its gradients are {state}: not an overflow)"
    return " (GradScaler skipped it)"


def gradients_gate(
    ref: Trace, candidate: Trace, claimed_dtype: str = "float32", tol: Tolerances | None = None
) -> Verdict:
    """Gate 2: the claimed dtype ran in every decoder-layer Linear, in every attempt (only FLOAT32_LINEARS, e.g. the
    head, may run float32 beside or instead of it: an autocast around the head alone is no FP16 candidate, nor one
    that runs FP16 in the first window and FP32 after it); in every compared
    window — a window GradScaler skipped by its gradients at a scale where they fit (`judged_grads`) — every
    parameter's gradient within the claimed dtype's tolerance."""
    tol = tol or tolerances(claimed_dtype, ref)
    stopped = stopped_at(candidate)
    if not candidate.grads:
        return Verdict("gradients", False, {"error": candidate.error}, f"no gradients: {candidate.error}")
    ran = candidate.dtypes
    evidence = {
        "claimed_dtype": claimed_dtype,
        "ran": "/".join(ran),
        "rtol": tol.grad_rtol,
        "rtol_from": tol.grad_from,
    }
    mismatch = first_dtype_mismatch(candidate, claimed_dtype)
    evidence["dtype_attempt"], evidence["dtype_mismatches"] = mismatch or (None, {})
    if mismatch:
        attempt, off = mismatch
        linears = candidate.linear_dtypes[attempt] if candidate.linear_dtypes else {}
        first = next(iter(off), None)
        where = (
            f"{len(off)} of {len(linears)} Linear modules ran other dtypes (first: {first}, {'/'.join(off[first])})"
            if off
            else "no Linear module ran"
        )
        claimed_in = [n for n, ran_as in linears.items() if claimed_dtype in ran_as]
        evidence["claimed_ran_in"] = claimed_in
        named = ", ".join(claimed_in[:3]) + (
            f" and {len(claimed_in) - 3} more" if len(claimed_in) > 3 else ""
        )
        where += f"; {claimed_dtype} ran in {named or 'none of them'}"  # what tells two such candidates apart
        return Verdict(
            "gradients", False, evidence, f"attempt {attempt}: claims {claimed_dtype}, but {where}"
        )
    windows = compared_windows(ref, candidate)
    if not windows:
        return Verdict("gradients", False, evidence, "no window to compare: the reference has no finite one")
    per_window = {k: gradient_errors(ref.grads[k], judged_grads(candidate, k)) for k in windows}
    bound = lambda k: tol.grad_rtol  # noqa: E731
    first = per_window.get(0, {})
    everywhere = {
        n: worst_of(e[n] for e in per_window.values()) for n in ref.grads[0]
    }  # each parameter's worst window (NaN if any window's is)
    worst = sorted(everywhere, key=lambda n: (not math.isnan(everywhere[n]), -everywhere[n], n))[
        :3
    ]  # NaN first
    bad_windows = [
        k for k, e in per_window.items() if not all(v <= bound(k) for v in e.values())
    ]  # NaN and inf fail
    evidence |= {
        "errors": first,
        "errors_all_windows": everywhere,
        "worst": {n: everywhere[n] for n in worst},
        "windows_compared": len(windows),
        "compared": windows,  # the attempts whose gradients were compared, in order
        "window_worst": [worst_of(per_window[k].values()) for k in windows],  # … the worst error of each
        "first_bad_window": bad_windows[0] if bad_windows else None,
        "rescaled": {
            k: candidate.rescaled[k][0] for k in windows if k in candidate.rescaled
        },  # attempt -> loss scale
        "parameters": len(everywhere),
        "loss_abs_error": max(abs(candidate.losses[k] - ref.losses[k]) for k in windows),
        "grad_max_abs_error": max(
            float((judged_grads(candidate, k)[n] - g).abs().max())
            for k in windows
            for n, g in ref.grads[k].items()
            if n in judged_grads(candidate, k)
        ),
    }
    if stopped and stopped[1] == "backward":
        return Verdict(
            "gradients", False, evidence, f"no gradients from attempt {stopped[0]} on: {candidate.error}"
        )
    if bad_windows:
        k = bad_windows[0]
        name = max(per_window[k], key=lambda n: (per_window[k][n], n))
        over = sum(not v <= bound(k) for v in per_window[k].values())
        return Verdict(
            "gradients",
            False,
            evidence,
            f"attempt {k}: {over} of {len(everywhere)} parameters over {bound(k):.0e}; "
            f"worst {name} at {per_window[k][name]:.1e}{_not_an_overflow(candidate, k)}",
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


def scaler_skips(ref: Trace, candidate: Trace) -> list[int]:
    """Attempts the reference stepped where the candidate's GradScaler lowered its scale and skipped the step."""
    return [
        a
        for a, (stepped, backoff) in enumerate(zip(candidate.stepped, candidate.scaler_backoff))
        if backoff and not stepped and a < len(ref.stepped) and ref.stepped[a]
    ]


def overflow_skips(ref: Trace, candidate: Trace, tol: Tolerances) -> list[int]:
    """The scaler skips that are overflows of the scaled backward, GradScaler doing its job: the window's loss
    finite, and its gradients (`judged_grads`: at a lower scale where they fit) finite and within gate 2's
    tolerance of the reference's. A NaN or inf from a bug — a zero-token divide, a forward overflowing FP16 —
    stays at every scale: such a skip is not forgiven, gate 2 fails it."""
    return [
        k
        for k in scaler_skips(ref, candidate)
        if k < min(len(candidate.grads), len(ref.grads))
        and math.isfinite(candidate.losses[k])
        and all_finite(judged_grads(candidate, k).values())
        and max(gradient_errors(ref.grads[k], judged_grads(candidate, k)).values()) <= tol.grad_rtol
    ]


def updates_gate(
    ref: Trace,
    candidate: Trace,
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
    effective, want = effective_updates(candidate), effective_updates(ref)
    overflowed = list(skipped_by_scaler) or scaler_skips(ref, candidate)
    lrs = expected_lrs if expected_lrs is not None else ref.lrs
    evidence = {
        "attempts": len(candidate.stepped),
        "effective_updates": effective,
        "expected_effective_updates": want,
        "skipped_updates": len(candidate.stepped) - effective,
        "non_finite_written": not all(candidate.finite),
        "optimizer_steps": candidate.optimizer_steps,
        "scheduler_steps": candidate.scheduler_steps,
        "loss_scale_halvings": candidate.scale_halvings,
        "scaler_skips": overflowed,
    }
    # the reference's effective updates before it was held to the candidate's skips
    ref_effective = want + len(skipped_by_scaler)
    too_many = len(overflowed) > MAX_SCALER_SKIP_FRACTION * ref_effective
    mismatch = next((k for k, (a, b) in enumerate(zip(candidate.lrs, lrs)) if a != b), None)
    evidence["first_lr_mismatch"] = mismatch
    off_clock = (
        ""
        if mismatch is None
        else f"effective update {mismatch} ran at lr {candidate.lrs[mismatch]:.3e}, the clock says {lrs[mismatch]:.3e}"
    )
    checks = [  # the first that holds is the verdict's message
        (candidate.error is not None, f"the run stopped: {candidate.error}"),
        (evidence["non_finite_written"], "a non-finite value was written into the parameters"),
        (
            too_many,
            f"GradScaler skipped {len(overflowed)} attempts the reference stepped ({overflowed}): more than "
            f"{MAX_SCALER_SKIP_FRACTION:.0%} of the reference's {ref_effective} effective updates, the loss scale is not settled",
        ),
        (effective != want, f"{effective} effective updates, the reference made {want}"),
        (
            candidate.optimizer_steps != effective,
            f"the optimizer counted {candidate.optimizer_steps} steps for {effective} effective updates",
        ),
        (
            candidate.scheduler_steps != effective,
            f"the scheduler moved {candidate.scheduler_steps} times for {effective} effective updates",
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
    ref: Trace, candidate: Trace, claimed_dtype: str = "float32", tol: Tolerances | None = None
) -> Verdict:
    """Gate 4: held-out token loss after the same effective updates within the bound (a fraction of the
    reference's training movement)."""
    tol = tol or tolerances(claimed_dtype, ref)
    delta = abs(candidate.held_out_loss - ref.held_out_loss)
    evidence = {
        "held_out_loss": candidate.held_out_loss,
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
        f"held-out loss {num(candidate.held_out_loss)} vs {num(ref.held_out_loss)}: "
        f"|Δ| {against_bound(delta, tol.quality_bound)} the bound "
        f"{num(tol.quality_bound, 2)} nats ({tol.quality_from})",
    )


def correctness_gate(
    ref: Trace,
    candidate: Trace,
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
        verdicts.append(gate(ref, candidate, claimed_dtype, tol, **extra))
        if not verdicts[-1].passed:
            break
    return verdicts


def _same_bits(a, b) -> bool:
    """Bit for bit: two tensors (dtype, shape and bytes) or two Python floats; a NaN equals the same NaN."""
    if not torch.is_tensor(a):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def bitwise_equal(ref: Trace, candidate: Trace) -> bool:
    """Every window's loss and every gradient tensor bitwise equal to the reference's (over the candidate's
    windows, which may be fewer), the injected window's NaN included: what a strategy that changes no arithmetic
    (recompute the same ops, fetch back the same bits) must give on a CPU."""
    n = len(candidate.grads)
    return (
        candidate.error is None
        and 0 < n <= len(ref.grads)
        and len(candidate.losses) >= n
        and all(_same_bits(a, b) for a, b in zip(candidate.losses[:n], ref.losses))
        and all(
            a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
            for a, b in zip(candidate.grads, ref.grads)
        )
    )
