"""Task5's experiments as result objects, each writing its own record fields.

    run = StrategyRun("hf-checkpoint", "TRAIN-CHECKPOINT", updates, trace, verdict, recompute=count, …)
    run.performance, run.reference_performance = performance.remeasure(plain, baseline, workload, …)
    session.record("TRAIN-CHECKPOINT", f"{workload_id}.{run.name}", candidate=run.name, **common, **run.record_fields())
    session.record("TRAIN-STATE-LEDGER", …, **ledger_fields(book, step, baseline_step, …))

Peaks and times follow the fifth stage of the gates (trainmech.performance.Performance): on CUDA the
allocator's reserved and allocated peaks of a steady update and its forward + backward, medians and
P95 of interleaved timed updates; on a CPU the same step times are recorded (a CPU run's cost, no
GPU evidence, never printed) and the allocator fields are null, the tracked tensor bytes going to
`metrics.cpu_tracked_*` (the storages born in one steady update, as Task6 counts them). TRAIN-STATE-LEDGER's
measured peak is Task4's (`ledger.Comparison`: every tensor alive, parameters and optimizer states included),
under Task4's names: `metrics.tracked_peak_bytes` on any device, `metrics.cpu_tracked_peak_bytes` the same number
where it is the peak measured (a CPU). `record_lines` prints what a record holds and which field is the peak;
`recompute_report` where a checkpointed forward's ops went in the backward; `dispatch_report` what a selective
policy decides on (the dispatched matmul and attention ops).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from trainmech import decision, ledger
from trainmech.checkpointing import RecomputeCount
from trainmech.checks import num
from trainmech.display import format_table
from trainmech.gates import Verdict
from trainmech.ledger.compare import MEASURED_PEAK_WITH
from trainmech.offload import TransferStats
from trainmech.performance import Performance
from trainmech.tracing import Trace

__all__ = [
    "MEASURED_WITH",
    "StrategyRun",
    "ledger_fields",
    "RECORD_FIELDS",
    "PEAK_FIELD",
    "record_lines",
    "timing_table",
    "alive_at",
    "saved_outside_layers",
    "saved_gone_before",
    "saved_at_end_table",
    "recompute_report",
    "dispatch_report",
]

MEASURED_WITH = {
    "cuda": "torch.cuda.max_memory_reserved / max_memory_allocated (one steady update, cache emptied)",
    "cpu": "trainmech.measure.StorageTracker (tensor storages born in one steady update)",
}


@dataclass
class StrategyRun:
    """One strategy of Task5: what gate 2 said about it, and what it costs."""

    name: str
    semantic_id: str  # TRAIN-CHECKPOINT | TRAIN-OFFLOAD
    updates: int
    trace: Trace
    verdict: Verdict  # gate 2 against the baseline's trace
    recompute: RecomputeCount | None = None  # the aten ops of one update's checkpointed regions
    checkpointed_layers: list[int] | None = None
    transfer: list[TransferStats] | None = (
        None  # one per pass it trained with (Offloading.collect), tagged with its attempt
    )
    performance: Performance | None = None
    reference_performance: Performance | None = None
    offload_settings: dict | None = None  # min_bytes, prefetch_groups, … as the strategy ran

    def decision(self) -> tuple[str | None, str]:
        """decision.decide on gate 2's verdict and the paired measurement (None without GPU numbers)."""
        return decision.decide([self.verdict], self.performance, self.reference_performance)

    def record_fields(self, next_step: str) -> dict:
        p, ref, e = self.performance, self.reference_performance, self.verdict.evidence
        on_gpu = p is not None and p.on_gpu
        effective = sum(s and f for s, f in zip(self.trace.stepped, self.trace.finite))
        outcome, reason = self.decision()
        resources = {
            "peak_allocated_bytes": p.peak_allocated_bytes,
            "peak_reserved_bytes": p.peak_reserved_bytes,
            "step_time_median_s": p.step_time_median_s,
            "step_time_p95_s": p.step_time_p95_s,
            "transfer_bytes": None,
            "recompute_count": None,
        }
        metrics = {
            "outcome": outcome,
            "decision_reason": reason,
            "windows_compared": e["windows_compared"],
            "grad_rtol": e["rtol"],
            "measured_with": MEASURED_WITH["cuda" if on_gpu else "cpu"],
            "forward_backward_allocated_bytes": p.forward_backward_allocated_bytes,
            "forward_backward_reserved_bytes": p.forward_backward_reserved_bytes,
            "cuda_context_bytes": p.cuda_context_bytes,
            "cpu_tracked_peak_bytes": None if on_gpu else p.tracked_peak_bytes,
            "cpu_tracked_forward_backward_bytes": None if on_gpu else p.tracked_forward_backward_bytes,
            "baseline_step_time_median_s": ref.step_time_median_s,
            "baseline_peak_reserved_bytes": ref.peak_reserved_bytes,
            "baseline_cpu_tracked_peak_bytes": None if on_gpu else ref.tracked_peak_bytes,
            "timed_updates": p.repeats,
            "warmup_updates": p.warmup,
        }
        if self.recompute is not None:  # counted over one update
            resources["recompute_count"] = self.recompute.recomputed_ops
            metrics |= {
                "checkpointed_layers": self.checkpointed_layers,
                "forward_ops_per_update": self.recompute.forward_ops,
                "saved_ops_per_update": self.recompute.saved_ops,
                "read_from_cache_ops_per_update": self.recompute.read_from_cache_ops,
                "kept_unread_ops_per_update": self.recompute.kept_unread_ops,
                "skipped_ops_per_update": self.recompute.skipped_ops,
            }
        if self.transfer is not None:
            first = self.transfer[0]
            resources["transfer_bytes"] = first.d2h_bytes + first.h2d_bytes
            metrics |= {
                k: getattr(first, k)
                for k in (
                    "d2h_bytes",
                    "h2d_bytes",
                    "packed",
                    "offloaded",
                    "shared",
                    "kept_params",
                    "kept_small",
                    "kept_exempt",
                    "prefetched",
                    "on_demand",
                    "stash_peak_bytes",
                    "host_peak_bytes",
                )
            }
            metrics |= {
                "exposed_transfer_time_s": p.exposed_transfer_time_s,
                "transfer_time_s": p.transfer_time_s,
                **(self.offload_settings or {}),
            }
        return {
            "correctness": {
                "output_max_abs_error": e["loss_abs_error"],
                "grad_max_abs_error": e["grad_max_abs_error"],
                "all_finite": all(self.trace.finite),
                "skipped_updates": len(self.trace.stepped) - effective,
                "effective_updates": effective,
            },
            "resources": resources,
            "conclusion": {
                "decision": None if outcome is None else decision.RECORD_DECISION[outcome],
                "next_step": next_step,
            },
            "metrics": metrics,
        }


def ledger_fields(
    name: str,
    book: ledger.Ledger,
    step,
    baseline_step,
    baseline_book: ledger.Ledger,
    *,
    model: str,
    min_bytes: int | None,
) -> dict:
    """TRAIN-STATE-LEDGER after a strategy: the ledger's prediction beside the measured step, each field as Task4's
    record defines it (`ledger.record_fields`: the measured peak the allocator's on CUDA, the tracked tensor bytes
    elsewhere; the measured forward + backward peak in tracked bytes; `measured_with` from MEASURED_PEAK_WITH)."""
    measured = ledger.Comparison(model, book.batch, book.seq, "steady", book, step)
    base = ledger.Comparison(model, book.batch, book.seq, "steady", baseline_book, baseline_step)
    pred = book.peak_overlap()
    on_gpu = step.step_peak_allocated_bytes is not None
    return {
        "resources": {
            "peak_allocated_bytes": step.peak_allocated_bytes,
            "peak_reserved_bytes": step.peak_reserved_bytes,
            "transfer_bytes": None,
            "recompute_count": None,
        },
        "conclusion": {"next_step": "Task6: correctness gate, then the GPU re-measurement of this strategy"},
        "metrics": {
            "predicted_peak_bytes": pred.bytes,
            "predicted_peak_phase": pred.phase,
            "predicted_peak_tick": pred.tick,
            "measured_peak_bytes": measured.measured_peak,
            "measured_peak_phase": step.peak_phase,
            "peak_error": measured.error,
            "baseline_measured_peak_bytes": base.measured_peak,
            "peak_change": measured.measured_peak / base.measured_peak - 1,
            "predicted_forward_backward_peak_bytes": book.forward_backward_peak().bytes,
            "measured_forward_backward_peak_bytes": measured.measured_forward_backward_peak,
            "predicted_by_category": pred.by_category,
            "measured_by_category": step.by_category(),
            "checkpointing": book.checkpointing,
            "min_bytes": min_bytes,
            "strategy": name,
            "measured_with": MEASURED_PEAK_WITH["cuda" if on_gpu else "cpu"],
            "tracked_peak_bytes": step.peak_bytes,  # Task4's name: the tracker's count, on any device
            "cpu_tracked_peak_bytes": None if on_gpu else step.peak_bytes,
        },
    }


# What `record_lines` prints of each record, by experiment: where the peak is, what the strategy did, the decision.
RECORD_FIELDS = {
    "TRAIN-CHECKPOINT": (
        "resources.peak_allocated_bytes",
        "metrics.cpu_tracked_peak_bytes",
        "metrics.baseline_cpu_tracked_peak_bytes",
        "resources.recompute_count",
        "conclusion.decision",
        "metrics.outcome",
    ),
    "TRAIN-OFFLOAD": (
        "resources.peak_allocated_bytes",
        "metrics.cpu_tracked_peak_bytes",
        "metrics.baseline_cpu_tracked_peak_bytes",
        "resources.transfer_bytes",
        "metrics.exposed_transfer_time_s",
        "conclusion.decision",
        "metrics.outcome",
    ),
    "TRAIN-STATE-LEDGER": (
        "metrics.predicted_peak_bytes",
        "metrics.measured_peak_bytes",
        "metrics.measured_peak_phase",
        "metrics.cpu_tracked_peak_bytes",
        "metrics.baseline_measured_peak_bytes",
    ),
}
_STRATEGY_PEAK = (
    "the peak: on CUDA resources.peak_allocated_bytes (the allocator, one steady update, everything allocated); "
    "on a CPU metrics.cpu_tracked_peak_bytes: only the tensor storages born in one steady update of Task6's "
    "performance stage, the parameters and optimizer states that lived before not counted — not Task4's count "
    "(TRAIN-STATE-LEDGER below)"
)
PEAK_FIELD = {  # which field holds the peak, and what it counts, by experiment
    "TRAIN-CHECKPOINT": _STRATEGY_PEAK,
    "TRAIN-OFFLOAD": _STRATEGY_PEAK,
    "TRAIN-STATE-LEDGER": (
        "the peak: metrics.measured_peak_bytes, Task4's measurement beside the ledger's prediction: every tensor "
        "alive, parameters and optimizer states included (on a CPU = metrics.cpu_tracked_peak_bytes = "
        "metrics.tracked_peak_bytes)"
    ),
}


def record_lines(records) -> list[str]:
    """Written records as a reader checks them, grouped by experiment: which field holds the peak and what it counts
    (`PEAK_FIELD`), then each record's `RECORD_FIELDS`, one `group.field = value` per line (integers with thousands
    separators, a time with three digits, null as null)."""

    def value(record, path: str):
        group, key = path.split(".")
        part = getattr(record, group)
        return part.get(key) if isinstance(part, dict) else getattr(part, key)

    def shown(v) -> str:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return "null" if v is None else str(v)
        return f"{v:,}" if isinstance(v, int) else num(v)

    lines = []
    for sid in dict.fromkeys(r.identity.semantic_id for r in records):
        lines.append(f"{sid} — {PEAK_FIELD[sid]}")
        for record in (r for r in records if r.identity.semantic_id == sid):
            lines.append(f"  {record.identity.workload_id}")
            lines += [f"    {path} = {shown(value(record, path))}" for path in RECORD_FIELDS[sid]]
    return lines


def timing_table(runs: dict[str, StrategyRun]) -> str:
    """One line per measured strategy (GPU numbers): median and P95 seconds, the median against its paired
    baseline's, reserved and allocated peaks of a steady update and reserved of its forward + backward, and for
    an offload its exposed and total transfer seconds per update."""
    cell = lambda v, fmt: f"{v:{fmt}}" if v is not None else "—"  # noqa: E731
    header = [
        "strategy",
        "median s",
        "P95 s",
        "x median",
        "reserved",
        "allocated",
        "fwd+bwd reserved",
        "exposed s",
        "transfer s",
    ]
    rows = [
        [
            name,
            f"{run.performance.step_time_median_s:.4f}",
            f"{run.performance.step_time_p95_s:.4f}",
            f"{run.performance.step_time_median_s / run.reference_performance.step_time_median_s:.2f}",
            cell(run.performance.peak_reserved_bytes, ","),
            cell(run.performance.peak_allocated_bytes, ","),
            cell(run.performance.forward_backward_reserved_bytes, ","),
            cell(run.performance.exposed_transfer_time_s, ".4f"),
            cell(run.performance.transfer_time_s, ".4f"),
        ]
        for name, run in runs.items()
        if run.performance is not None
    ]
    return format_table(header, rows)


def _index(book: ledger.Ledger) -> dict[str, int]:
    return {t: k for k, t in enumerate(book.ticks)} | {ledger.BEFORE: -1, ledger.AFTER: len(book.ticks)}


def alive_at(book: ledger.Ledger, tick: str, category: str) -> dict[str, int]:
    """The ledger's states of one category alive at `tick`: name -> bytes, in the ledger's order."""
    index = _index(book)
    at = index[tick]
    return {
        st.name: st.nbytes
        for st in book.states
        if st.category == category and index[st.created] <= at <= index[st.released_at]
    }


def saved_outside_layers(book: ledger.Ledger, tick: str) -> dict[str, int]:
    """The ledger's saved states alive at `tick` that no decoder layer holds (RoPE's cos / sin, the final norm,
    the loss's log-softmax, …): name -> bytes, in the ledger's order."""
    return {name: n for name, n in alive_at(book, tick, "saved").items() if not name.startswith("layer.")}


def saved_gone_before(book: ledger.Ledger, tick: str) -> dict[str, int]:
    """The ledger's saved states still alive once the forward is over (after its last tick, "loss") but released
    before `tick`: name -> bytes (what the backward frees before it reaches `tick`)."""
    index = _index(book)
    last, at = index["loss"], index[tick]
    return {
        st.name: st.nbytes
        for st in book.states
        if st.category == "saved" and index[st.created] <= last < index[st.released_at] < at
    }


def saved_at_end_table(books: dict[str, ledger.Ledger], saved: dict[str, int]) -> str:
    """Saved bytes at the forward's end, per strategy (`saved`: name -> measured, the baseline's among them): the
    ledger's prediction ("—" where `books` has no ledger for it), the measurement, and what it dropped or moved
    against the baseline's."""
    rows = [
        [name, books[name].saved_after_forward() if name in books else "—", got, saved["baseline"] - got]
        for name, got in saved.items()
    ]
    return format_table(["saved at forward end", "predicted", "measured", "dropped / moved"], rows)


FETCHED = " (fetched back)"  # the suffix ledger.Ledger.offloaded gives the device copy an H2D brings back


def fetched_back(book: ledger.Ledger, tick: str) -> tuple[dict[int, str], int]:
    """In the offload ledger (`Ledger.offloaded`): each offloaded layer -> the tick its copies are fetched back
    at (the earliest, in layer order); and the bytes of fetched-back copies alive at `tick`."""
    index, fetched = _index(book), {}
    for st in book.states:
        if st.name.endswith(FETCHED) and st.name.startswith("layer."):
            layer = int(st.name.split(".")[1])
            fetched[layer] = min(fetched.get(layer, st.created), st.created, key=index.__getitem__)
    alive = sum(n for name, n in alive_at(book, tick, "saved").items() if name.endswith(FETCHED))
    return dict(sorted(fetched.items())), alive


def recompute_report(counts: dict[str, RecomputeCount]) -> str:
    """Task5's printout of recompute counts: per strategy, where the forward's ops went in the backward (kept,
    read from the cache, kept unread, recomputed, skipped by the early stop); the skipped ops by name; what the
    last strategy recomputed by name."""
    header = [
        "per update",
        "forward ops",
        "kept",
        "read from cache",
        "kept, unread",
        "recomputed",
        "skipped (early stop)",
    ]
    rows = [
        [
            name,
            c.forward_ops,
            c.saved_ops,
            c.read_from_cache_ops,
            c.kept_unread_ops,
            c.recomputed_ops,
            c.skipped_ops,
        ]
        for name, c in counts.items()
    ]
    last = list(counts)[-1]
    return "\n".join(
        [
            format_table(header, rows),
            f"skipped by the early stop, by op: { {n: dict(sorted(c.skipped_by_op.items())) for n, c in counts.items()} }",
            f"recomputed by op ({last}, per update): {dict(sorted(counts[last].recomputed_by_op.items()))}",
        ]
    )


def dispatch_report(
    dispatched: Counter, expected: Counter, *, rule: str, ran: str | None, device: str
) -> str:
    """Task5's printout of what a selective policy decides on: the attention kernel (the ledger's rule beside the
    one dispatched), the matmul and attention ops a plain forward dispatched, beside those expected by name."""
    return "\n".join(
        [
            f"attention kernel: the ledger's rule says {rule}; the plain forward dispatched {ran}",
            f"matmul and attention ops one plain forward dispatches in the layers: {dict(sorted(dispatched.items()))}",
            f"expected by name ({ran or rule} attention on {device}): {dict(sorted(expected.items()))}",
        ]
    )
