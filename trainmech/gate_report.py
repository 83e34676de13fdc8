"""Judging a candidate: run it, apply the gates, measure, decide, and report what came of it.

`judge` runs a candidate through the gate workload beside the reference (trainmech.gates holds the
reference, its noise floor, the four gates and the decision rule): gates 1-4 in order up to the first
that fails, then, only if all four passed, the fifth stage's paired measurement (`performance_verdict`:
a measurement, never a pass or a fail), then `decision.decide`. Its `Report` is what a notebook prints
(`lines`; `stages` for the gate matrix) and records (`record_fields`); `planted_record_fields` is the
record of the planted bugs, `strategy_table` the quality-capacity-time table of the candidates that
reached the performance stage.

    reference = gates.make_reference(workload)
    report = gate_report.judge(candidate, workload, reference)
    print("\n".join(report.lines()))                 # one line per stage: ✓ ✗ — · ○
    session.record(..., **report.record_fields(next_step))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainmech.candidates import Candidate, GateWorkload, MicroBatches
from trainmech.checks import num
from trainmech.decision import RECORD_DECISION, decide, time_ratio_text
from trainmech.display import format_table
from trainmech.gates import (
    EVIDENCE_LEVEL,
    GATES,
    GRAD_RTOL,
    MAX_SCALER_SKIP_FRACTION,
    QUALITY_FRACTION,
    Reference,
    Tolerances,
    Verdict,
    against_bound,
    correctness_gate,
    effective_updates,
    movement,
    overflow_skips,
    scaler_skips,
)
from trainmech.performance import Performance, remeasure
from trainmech.tracing import Trace, run_trace, window_digest

__all__ = [
    "Report",
    "performance_verdict",
    "judge",
    "planted_record_fields",
    "strategy_table",
]


def _power_of_two(x: float) -> str:
    """2**k for a power of two (a GradScaler scale), else the number."""
    k = math.log2(x) if x > 0 else 0.5
    return f"2**{int(k)}" if k == int(k) else f"{x:g}"


@dataclass
class Report:
    """What `judge` found: the verdicts up to the first failure, the paired measurement, the outcome and why."""

    candidate: Candidate
    verdicts: list[Verdict]
    performance: Performance | None
    reference_performance: Performance | None
    outcome: str | None  # accept / tune / no-gain / costs-memory / reject, or None (no GPU numbers)
    reason: str
    evidence_level: str
    trace: Trace
    tolerances: Tolerances

    @property
    def decision(self) -> str | None:
        """The record's decision field: accept / tune / reject (no-gain and costs-memory are rejects without a failure)."""
        return None if self.outcome is None else RECORD_DECISION[self.outcome]

    @property
    def failed_gate(self) -> str | None:
        return next((v.name for v in self.verdicts if v.failed), None)

    @property
    def passed(self) -> bool:
        """Gates 1-4 all ran and passed (the performance stage, where it ran, measures: it has no pass or fail)."""
        verdicts = [self.verdict(name) for name in GATES[:4]]
        return all(v is not None and v.passed is True for v in verdicts)

    def verdict(self, name: str) -> Verdict | None:
        return next((v for v in self.verdicts if v.name == name), None)

    def off_the_clock(self, reference_stepped: list[bool]) -> str:
        """Gate 3's scheduler evidence in words: the scheduler's steps against the effective updates, and where the
        learning rate first left the update clock, as an effective update and as an attempt of the reference's run
        (`reference_stepped`: whether each attempt stepped; attempts count the skipped ones too)."""
        if self.verdict("updates") is None:
            raise ValueError(
                f"{self.candidate.name} never reached the updates gate: no scheduler evidence to tell"
            )
        e = self.verdict("updates").evidence
        told = (
            f"scheduler moved {e['scheduler_steps']} times for {e['effective_updates']} effective updates; "
        )
        first = e["first_lr_mismatch"]
        if first is None:
            return told + "every learning rate on the clock"
        attempt = [a for a, stepped in enumerate(reference_stepped) if stepped][first]
        return told + (
            f"first learning rate off the clock at effective update {first} (counted from 0), "
            f"which is attempt {attempt} on the figure's axis (attempts count the skipped one too)"
        )

    def lines(self) -> list[str]:
        """The report as printed lines: one per stage, ✓ passed, ✗ failed, — measured (performance), · not run
        (an earlier gate failed), ○ not measured (a check of the gates only); FP16: the loss scale's start."""
        c = self.candidate
        out = [f"{c.name}  ({c.semantic_id}, claims {c.dtype})"]
        if self.trace.loss_scale is not None:
            out.append(
                f"  loss scale: starts at {_power_of_two(self.trace.loss_scale)}, after {self.trace.scale_halvings} "
                "halvings of the calibration (not counted as skips)"
            )
        for name in GATES:
            v = self.verdict(name)
            if v is None and self.failed_gate is None:
                mark, text = "○", "not measured: this run checks the gates only"
            elif v is None:
                mark, text = "·", "not run: an earlier gate failed"
            else:
                mark, text = {True: "✓", False: "✗", None: "—"}[v.passed], v.message
            out.append(f"  {mark} {name:<12} {text}")
        out.append(f"  outcome: {self.outcome or 'null'}  ({self.evidence_level})")
        return out

    def stages(self) -> list[bool | str | None]:
        """Per stage of GATES, for the gate matrix: True / False (passed / failed), "measured" (performance),
        None (not run: an earlier gate failed), "not measured" (a check of the gates only)."""
        out = []
        for name in GATES:
            v = self.verdict(name)
            if v is None:
                out.append("not measured" if self.failed_gate is None else None)
            else:
                out.append("measured" if v.passed is None else v.passed)
        return out

    @property
    def record_dtype(self) -> str:
        """The record's dtype: float32, or the claimed 16-bit dtype under autocast."""
        return "float32" if self.candidate.dtype == "float32" else f"{self.candidate.dtype}-autocast"

    def record_fields(self, next_step: str | None = None) -> dict:
        """correctness / resources / conclusion / metrics for `Session.record` (the gates' evidence, the measurement)."""
        g, u, q = (
            self.verdict(n).evidence if self.verdict(n) else {} for n in ("gradients", "updates", "quality")
        )
        p = self.performance
        resources = (
            {}
            if p is None
            else {
                k: getattr(p, k)
                for k in (
                    "peak_allocated_bytes",
                    "peak_reserved_bytes",
                    "step_time_median_s",
                    "step_time_p95_s",
                )
            }
        )
        metrics = {
            "gates": {v.name: v.passed for v in self.verdicts},
            "outcome": self.outcome,
            "decision_reason": self.reason,
            "grad_rtol": self.tolerances.grad_rtol,
            "grad_rtol_from": self.tolerances.grad_from,
            "quality_bound": self.tolerances.quality_bound,
            "quality_bound_from": self.tolerances.quality_from,
            "loss_scale_halvings": self.trace.scale_halvings,
            "loss_scale_skips": u.get("scaler_skips"),
        }
        if g.get("worst"):
            metrics |= {
                "worst_parameter": next(iter(g["worst"])),
                "worst_parameter_rel_error": max(g["worst"].values()),
                "windows_compared": g["windows_compared"],
            }
        if q:
            metrics |= {
                "held_out_loss": q["held_out_loss"],
                "reference_held_out_loss": q["reference_held_out_loss"],
            }
        if p is not None:
            ref = self.reference_performance
            metrics |= {
                k: getattr(p, k)
                for k in (
                    "forward_backward_allocated_bytes",
                    "forward_backward_reserved_bytes",
                    "bytes_per_row",
                    "cuda_context_bytes",
                    "exposed_transfer_time_s",
                    "transfer_time_s",
                    "warmup",
                    "repeats",
                )
            }
            metrics |= {
                "cpu_tracked_peak_bytes": None if p.on_gpu else p.tracked_peak_bytes,
                "cpu_tracked_forward_backward_bytes": None if p.on_gpu else p.tracked_forward_backward_bytes,
                "reference_step_time_median_s": ref.step_time_median_s,
                "reference_peak_reserved_bytes": ref.peak_reserved_bytes,
                "reference_bytes_per_row": ref.bytes_per_row,
                "reference_tracked_peak_bytes": ref.tracked_peak_bytes,
            }
        return {
            "correctness": {
                "output_max_abs_error": g.get("loss_abs_error"),
                "grad_max_abs_error": g.get("grad_max_abs_error"),
                "all_finite": None if not u else not u["non_finite_written"],
                "skipped_updates": u.get("skipped_updates"),
                "effective_updates": u.get("effective_updates"),
            },
            "resources": resources,
            "conclusion": {
                "decision": self.decision,
                "evidence_level": self.evidence_level,
                "next_step": next_step,
                "failure": f"{self.failed_gate} gate failed" if self.failed_gate else None,
            },
            "metrics": metrics,
        }


def performance_verdict(perf: Performance, reference: Performance) -> Verdict:
    """Stage 5 measures; it is no gate (passed None): whether a measured gain is worth it is `decide`'s job."""
    evidence = {
        k: getattr(perf, k)
        for k in (
            "step_time_median_s",
            "step_time_p95_s",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "forward_backward_reserved_bytes",
            "bytes_per_row",
            "tracked_peak_bytes",
            "warmup",
            "repeats",
        )
    }
    if perf.on_gpu and reference.on_gpu:
        message = (
            f"{time_ratio_text(perf, reference)}, allocated peak "
            f"{perf.peak_allocated_bytes / reference.peak_allocated_bytes - 1:+.1%} (reserved "
            f"{perf.peak_reserved_bytes / reference.peak_reserved_bytes - 1:+.1%}), bytes per sequence "
            f"{perf.bytes_per_row / reference.bytes_per_row - 1:+.1%} vs the reference"
        )
    else:
        message = (
            f"measured on {perf.device_type}: CPU step times recorded, no GPU evidence; allocator peaks null; "
            f"tracked tensor bytes of one update: forward + backward {perf.tracked_forward_backward_bytes:,}, "
            f"whole update {perf.tracked_peak_bytes:,}"
        )
    return Verdict("performance", None, evidence, message)


def _own_copy_run(candidate: Candidate, workload: GateWorkload, teacher: Trace) -> Trace:
    """run_trace on a copy of the windows, and gate 1's digests taken of that copy after the run: a candidate that
    edits its windows in place (a label masked) fails its own inputs gate, and the shared windows stay intact for
    the candidates judged after it."""
    own = dataclasses.replace(
        workload,
        windows=[MicroBatches([{k: v.clone() for k, v in mb.items()} for mb in w]) for w in workload.windows],
    )
    trace = run_trace(candidate, own, teacher=teacher)
    trace.handed = [window_digest(own.windows[k], k in own.inject_at) for k in range(len(trace.handed))]
    return trace


def judge(
    candidate: Candidate,
    workload: GateWorkload,
    ref: Reference,
    *,
    warmup: int = 1,
    repeats: int = 3,
    trace: Trace | None = None,
    measure: bool = True,
) -> Report:
    """Run the candidate (each window's gradients also from the reference's weights: `run_trace(teacher=…)`), apply
    the correctness gate (gates 1-4 in order up to the first failure), measure performance (paired with the
    reference's, interleaved) only if all four passed (and `measure`: a check of the gates alone skips it), and
    decide. Where the candidate's GradScaler skipped attempts the reference stepped, every one of them an overflow
    (`gates.overflow_skips`: its loss finite, its gradients at a lower scale finite and within tolerance) and at
    most MAX_SCALER_SKIP_FRACTION of the reference's effective updates, both are run again with those attempts
    skipped, and the gates compare those runs: like for like, the skips reported by gate 3. A skip that is no
    overflow (a bug's NaN) is not forgiven: the first run is judged, and gate 2 fails that window."""
    trace = trace or _own_copy_run(candidate, workload, ref.trace)
    tol = ref.tolerances(candidate.dtype)
    skips, judged_ref = scaler_skips(ref.trace, trace), ref
    forgiven = skips and overflow_skips(ref.trace, trace, tol) == skips
    if forgiven and len(skips) <= MAX_SCALER_SKIP_FRACTION * effective_updates(ref.trace):
        trace.grads = []  # the first run's gradients are not judged
        skipped, judged_ref = ref.skipping(workload, skips)
        trace = run_trace(candidate, skipped, teacher=judged_ref.trace)
    expected_lrs = [workload.expected_lr(k) for k in range(len(trace.lrs))]
    matched = skips if judged_ref is not ref else []  # unmatched, gate 3 finds (and counts) the skips itself
    verdicts = correctness_gate(judged_ref.trace, trace, candidate.dtype, tol, expected_lrs, matched)
    perf = ref_perf = None
    if measure and not any(v.failed for v in verdicts):
        perf, ref_perf = remeasure(
            candidate,
            ref.candidate,
            workload,
            warmup=warmup,
            repeats=repeats,
            init_scale=trace.loss_scale,
            reference_peaks=ref.peaks,
        )
        verdicts.append(performance_verdict(perf, ref_perf))
    outcome, reason = decide(verdicts, perf, ref_perf)
    trace.grads = []  # kept only as long as gate 2 needs them (a GPU model's gradients are gigabytes per window)
    trace.rescaled = {k: (scale, {}) for k, (scale, _) in trace.rescaled.items()}  # … the scales stay
    return Report(
        candidate,
        verdicts,
        perf,
        ref_perf,
        outcome,
        reason,
        EVIDENCE_LEVEL.get(workload.device.type, "not-measured"),
        trace,
        tol,
    )


def planted_record_fields(
    reference: Reference, planted: dict[str, tuple[str, Report, Report]], next_step: str
) -> dict:
    """TRAIN-CORRECTNESS-GATE: every planted bug -> (the gate meant to stop it, the buggy candidate's report,
    the report of the same candidate without the bug), with the reference and its noise floor."""
    ref, floor = reference.trace, reference.floor
    effective = effective_updates(ref)
    return {
        "correctness": {
            "all_finite": all(ref.finite),
            "skipped_updates": len(ref.stepped) - effective,
            "effective_updates": effective,
        },
        "conclusion": {"next_step": next_step},
        "metrics": {
            "expected_gate": {bug: gate for bug, (gate, _, _) in planted.items()},
            "fired_gate": {bug: buggy.failed_gate for bug, (_, buggy, _) in planted.items()},
            "fixed_candidate": {bug: fixed.candidate.name for bug, (_, _, fixed) in planted.items()},
            "fixed_passes_all_gates": {
                fixed.candidate.name: fixed.passed for _, _, fixed in planted.values()
            },
            "all_caught_as_expected": all(buggy.failed_gate == gate for gate, buggy, _ in planted.values()),
            "grad_rtol": dict(GRAD_RTOL),
            "quality_fraction": dict(QUALITY_FRACTION),
            "training_movement": movement(ref),
            "noise_grad_self": None if floor is None else floor.grad_self,
            "noise_grad_seed": None if floor is None else floor.grad_seed,
            "noise_quality_self": None if floor is None else floor.quality_self,
            "noise_quality_seed": None if floor is None else floor.quality_seed,
        },
    }


def strategy_table(reference: Performance, reports: dict[str, Report]) -> str:
    """The quality-capacity-time table of TRAIN-MEMORY-STRATEGY: one line per candidate that reached the
    performance stage. Quality: |Δ| of the held-out loss against the reference, as a verdict beside its bound. Capacity:
    the tracked tensor bytes of one steady update at their peak (before the optimizer step, and over the whole
    update), the bytes per sequence (what one more sequence adds to a micro-batch's forward + backward peak),
    on a GPU the allocator's reserved and allocated peaks of the whole update. Time: the median against the
    reference's and the P95, GPU only. CPU: the GPU columns null."""
    cell = lambda v, fmt: "null" if v is None else format(v, fmt)  # noqa: E731
    change = lambda v, ref: f"{v / ref - 1:+.0%}"  # noqa: E731
    gpu = reference.on_gpu
    header = [
        "candidate",
        "|Δ held-out|",
        "bound",
        "tracked fwd+bwd",
        "Δ fwd+bwd",
        "tracked update",
        "Δ update",
        "B/sequence",
        "Δ B/seq",
        "peak reserved",
        "peak allocated",
        "median x",
        "P95 s",
        "outcome",
    ]

    def row(name, p, delta, bound, ratio, outcome, changes=True):
        ref = reference
        return [
            name,
            delta,
            bound,
            p.tracked_forward_backward_bytes,
            change(p.tracked_forward_backward_bytes, ref.tracked_forward_backward_bytes) if changes else "",
            p.tracked_peak_bytes,
            change(p.tracked_peak_bytes, ref.tracked_peak_bytes) if changes else "",
            p.bytes_per_row,
            change(p.bytes_per_row, ref.bytes_per_row) if changes else "",
            cell(p.peak_reserved_bytes, ","),
            cell(p.peak_allocated_bytes, ","),
            cell(ratio, ".2f"),
            cell(p.step_time_p95_s if gpu else None, ".4f"),
            outcome,
        ]

    rows = [row("fp32-baseline", reference, "", "", 1.0 if gpu else None, "", changes=False)]
    for name, r in reports.items():
        p, q = r.performance, r.verdict("quality").evidence
        ratio = p.step_time_median_s / r.reference_performance.step_time_median_s if gpu else None
        rows.append(
            row(
                name, p, against_bound(q["delta"], q["bound"]), num(q["bound"], 2), ratio, r.outcome or "null"
            )
        )
    return format_table(header, rows)
