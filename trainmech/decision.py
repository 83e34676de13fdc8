"""The decision rule: is a correct candidate worth adopting? Written down before any GPU measurement.

A failed correctness gate (trainmech.gates) rejects a candidate on any device: it is wrong. A correct one is
judged on what the fifth stage measured beside the reference (trainmech.performance.Performance), on a GPU
only: accept, tune, no-gain (correct, but neither smaller nor faster) or costs-memory (correct, nothing gained,
and the whole update's allocated peak higher). `RULE` holds the thresholds and `DecisionRule` their reasons;
`decide_measured` is the rule on three numbers, `decide` applies it to a candidate's verdicts and measurements.

    outcome, reason = decision.decide(verdicts, perf, reference_perf)   # None without GPU numbers
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainmech.gates import Verdict
    from trainmech.performance import Performance

__all__ = [
    "OUTCOMES",
    "RECORD_DECISION",
    "DecisionRule",
    "RULE",
    "RECOMPUTE_HEADROOM",
    "recompute_ratio",
    "RECOMPUTE_FLOOR",
    "recompute_floor",
    "TIMING_INTERVAL",
    "MIN_TIMING_ROUNDS",
    "TimingInterval",
    "order_statistic_rank",
    "round_ratios",
    "timing_interval",
    "time_ratio_text",
    "timing_spread",
    "RuleInputs",
    "rule_inputs",
    "LedgerBand",
    "block_excess",
    "ledger_inputs",
    "measured_phase",
    "against_ledger",
    "decide_measured",
    "decide",
]

OUTCOMES = ("accept", "tune", "no-gain", "costs-memory", "reject")
RECORD_DECISION = {
    "accept": "accept",
    "tune": "tune",
    "no-gain": "reject",
    "costs-memory": "reject",
    "reject": "reject",
}  # the record's field (accept / tune / reject); `metrics.outcome` keeps the five apart


@dataclass(frozen=True)
class DecisionRule:
    """Written down before any GPU measurement, not fitted to the registry's figures.

    min_peak_drop: a memory gain counts from a tenth on: a tenth less per sequence is the least that adds a
    sequence to a micro-batch of ten. max_time_ratio: what full activation checkpointing is predicted to cost
    (`recompute_ratio`) plus a quarter of it. A step costs about 6·N·T FLOPs in the matmuls with weights (N
    parameters, T tokens: 2·N·T forward, 4·N·T backward), and 12·L·s·A·T in attention's own two (L layers, s tokens
    a sequence, A the attention width). Full-layer recomputation replays each decoder layer's forward, attention and
    norms included, but not the embedding, the final norm, the head, the loss or the optimizer: 2·N_layers·T +
    4·L·s·A·T more (N_layers: the decoder layers' parameters). For Qwen2.5-0.5B, whose tied head holds a quarter of
    N, that is x1.24 at the GPU gate workload's 256 tokens; a quarter of that cost again, x1.30, is left for what a
    replay costs beyond its FLOPs (its memory-bound ops, its kernel launches). A checkpoint slower than that is
    worth tuning. min_speedup: a speed gain counts from a tenth of the time on — or from the uncertainty of the
    measured time ratio, where that is wider (`timing_spread`: half the width of the order-statistic interval of
    the median per-round ratio, of at least TIMING_INTERVAL coverage; infinite below MIN_TIMING_ROUNDS rounds,
    where no speedup counts): a speedup within it is not told apart from no change.

    The whole update's peak is higher where either its allocated or its reserved bytes rose. The allocated peak is
    the bytes its live blocks hold. The reserved peak is the device memory the process holds at most, measured
    after `empty_cache` and a reset with nothing competing: what nvidia-smi shows and another process on the GPU
    cannot have, so a rise of it is a cost. It is not what runs out first: when cudaMalloc fails, the caching
    allocator frees its unused cached segments and retries, and raises OutOfMemoryError only when the request does
    not fit beside the live blocks and the segments they pin. Nor is it the candidate's alone: `empty_cache` keeps
    every segment that holds a live block (parameters, moments, the shared model), the candidate's blocks are
    carved from their free tails too, and the reference's peaks are measured once per workload, at another moment
    of the process. Whether a candidate runs out first is a measurement of its own: its update under a cap at the
    reference's reserved peak (`performance.capped_updates`, gpu-check's check_gates). The memory gain d stays on
    the allocated bytes, and c on the allocated slope.
    no_higher_slack: how far either peak may rise above the reference's and still count as no higher, as a
    fraction of the reference's: a hundredth — a tenth of
    min_peak_drop, so it cannot hide a rise the rule would count as a gain, and above what the allocator's
    block rounding typically adds (a request rounds up to 512 B, and a cached block is handed out unsplit when
    no more than 1 MiB would remain, so a block may hold up to 1 MiB it did not ask for).
    """

    min_peak_drop: float = 0.10
    max_time_ratio: float = 1.30
    min_speedup: float = 0.10
    no_higher_slack: float = 0.01


RULE = DecisionRule()
# max_time_ratio - 1 over the GPU gate workload's recompute_ratio - 1, rounded to 0.01
RECOMPUTE_HEADROOM = 0.25
# A checkpoint's measured time ratio is held to at least 1 + this x its predicted cost (`recompute_floor`): the
# replay's FLOPs are a floor of what it costs, and a measurement at half of them is one that replayed nothing (or
# a workload far from compute-bound, which the page's GPU shapes are not); half leaves room for timing noise.
RECOMPUTE_FLOOR = 0.5


def recompute_ratio(model, seq: int) -> float:
    """The step time full-layer recomputation predicts, compute-bound, against none, at `seq` tokens a sequence:
    1 + (2·N_layers + 4·L·s·A)/(6·N + 12·L·s·A). N: the model's parameters (a tied head counted once), N_layers: its
    decoder layers' (`model.model.layers`), L: their number, A: the attention width (heads x head_dim). Per token a
    forward costs 2·N FLOPs in the matmuls with weights and 4·s·A per layer in attention's two without (Q·Kᵀ and the
    weights times V, the full s x s counted: a causal kernel that skips the masked half does about half); the
    backward twice the forward. The replay adds each decoder layer's forward, both kinds. `model`: a
    Qwen2ForCausalLM, or the name of a TRAIN-CUDA-MECHANISM profile model (built on the meta device: no memory)."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"seq must be a positive number of tokens a sequence, got {seq!r}")
    if isinstance(model, str):
        import torch
        from transformers import Qwen2ForCausalLM

        from trainmech import profiles, workload

        with torch.device("meta"):
            model = Qwen2ForCausalLM(
                workload.qwen2_config(profiles.for_mode("TRAIN-CUDA-MECHANISM").model(model))
            )
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4 * len(model.model.layers) * seq * config.num_attention_heads * head_dim
    total = sum(p.numel() for p in model.parameters())
    layers = sum(p.numel() for p in model.model.layers.parameters())
    return 1 + (2 * layers + attention) / (6 * total + 3 * attention)


def recompute_floor(model, seq: int) -> float:
    """The least time ratio a checkpoint that replays every decoder layer is held to on a GPU: 1 + RECOMPUTE_FLOOR
    x (`recompute_ratio` - 1). A checkpoint that replays nothing fails it."""
    return 1 + RECOMPUTE_FLOOR * (recompute_ratio(model, seq) - 1)


TIMING_INTERVAL = 0.90  # the least coverage an interval of the median per-round time ratio must have
MIN_TIMING_ROUNDS = (
    5  # the fewest rounds whose widest order-statistic interval, [min, max], reaches it (1 - 2/2^5)
)


@dataclass(frozen=True)
class TimingInterval:
    """The median per-round time ratio and a distribution-free interval for the true median: [low, high] are the
    k-th smallest and the k-th largest of the n ratios, which hold the median with probability exactly
    `coverage` = 1 - 2·P(Binomial(n, 1/2) ≤ k - 1), whatever the ratios' distribution (rounds independent)."""

    low: float
    median: float
    high: float
    coverage: float
    rounds: int

    @property
    def spread(self) -> float:
        return (self.high - self.low) / 2


def order_statistic_rank(n: int, coverage: float = TIMING_INTERVAL) -> tuple[int, float] | None:
    """(k, its coverage): the largest k whose interval [x(k), x(n-k+1)] of n sorted samples holds their
    distribution's median with probability ≥ `coverage` (1 - 2·P(Bin(n, 1/2) ≤ k - 1)); None where even
    [min, max] falls short (n < MIN_TIMING_ROUNDS at 0.90)."""
    best = None
    for k in range(1, n // 2 + 1):
        reached = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
        if reached < coverage:
            break
        best = (k, reached)
    return best


def round_ratios(perf: Performance, reference: Performance) -> list[float]:
    """The candidate's time over the reference's, round by round (`performance.remeasure` times them in the same
    rounds, ABBA): a slow stretch of the machine hits both sides of a round, so it cancels in the ratio."""
    ours, theirs = perf.step_times_s, reference.step_times_s
    if not ours or not theirs or len(ours) != len(theirs):
        raise ValueError(
            "the paired time ratio needs the step times of the same rounds for both (Performance.step_times_s), "
            f"got {len(ours or ())} and {len(theirs or ())}"
        )
    return [a / b for a, b in zip(ours, theirs, strict=True)]


def timing_interval(perf: Performance, reference: Performance) -> TimingInterval:
    """The median per-round ratio (`round_ratios`) and its order-statistic interval of at least TIMING_INTERVAL
    coverage (`order_statistic_rank`; the coverage it really has comes with it). Fewer than MIN_TIMING_ROUNDS
    rounds have no such interval: refused."""
    ratios = sorted(round_ratios(perf, reference))
    found = order_statistic_rank(len(ratios))
    if found is None:
        raise ValueError(
            f"{len(ratios)} timed rounds give no interval of the median time ratio with {TIMING_INTERVAL:.0%} "
            f"coverage (even [min, max] holds it with 1 - 2/2^{len(ratios)}): time at least {MIN_TIMING_ROUNDS} rounds"
        )
    k, coverage = found
    return TimingInterval(ratios[k - 1], statistics.median(ratios), ratios[-k], coverage, len(ratios))


def time_ratio_text(perf: Performance, reference: Performance) -> str:
    """The time ratio as the rule judges it: the median of the paired per-round ratios and its order-statistic
    interval with the coverage it has (`timing_interval`), not the ratio of the two medians; with fewer than
    MIN_TIMING_ROUNDS rounds, no interval and no speedup counted."""
    ratio = statistics.median(round_ratios(perf, reference))
    if len(perf.step_times_s or ()) < MIN_TIMING_ROUNDS:
        told = (
            f"{len(perf.step_times_s or ())} rounds, fewer than {MIN_TIMING_ROUNDS}: no {TIMING_INTERVAL:.0%} "
            "interval, no speedup counts"
        )
    else:
        span = timing_interval(perf, reference)
        told = f"{span.coverage:.1%} interval x{span.low:.2f} to x{span.high:.2f}"
    return f"time x{ratio:.2f} (median of the rounds' ratios; {told})"


def timing_spread(perf: Performance, reference: Performance) -> float:
    """How uncertain the measured time ratio is: half the width of its interval (`timing_interval`); with fewer
    than MIN_TIMING_ROUNDS rounds unknown, infinite. A speedup no larger than this is not told apart from no change."""
    if len(perf.step_times_s or ()) < MIN_TIMING_ROUNDS:
        round_ratios(perf, reference)  # the rounds must still pair
        return math.inf
    return timing_interval(perf, reference).spread


@dataclass(frozen=True)
class RuleInputs:
    """The numbers `decide_measured` judges, from a candidate's measurements beside the reference's (`rule_inputs`)
    or predicted by the ledger (`ledger_inputs`; no time there: `time_ratio` None, and with the ledger's bytes
    and the bands, (below, above), a measurement of each may lie within, in bytes: `LedgerBand`)."""

    update_drop: float  # d: 1 - the whole update's allocated peak / the reference's
    capacity_gain: float  # c: 1 - the bytes one more sequence adds / the reference's
    time_ratio: float | None = None  # r: the median per-round time ratio (`round_ratios`)
    reserved_change: float | None = (
        None  # the reserved peak / the reference's - 1: a rise of either is a rise
    )
    phase: str | None = None  # the ledger's: where the candidate's whole-update peak sits
    shape: str = ""  # the ledger's: the model and one micro-batch, in words
    saved: LedgerBand | None = None  # the ledger's: the whole update's peak, reference - candidate (bytes)
    saved_per_row: LedgerBand | None = None  # … what one more sequence adds, reference - candidate (bytes)
    update_over_backward: LedgerBand | None = (
        None  # … the candidate's whole-update peak - its forward + backward's
    )


@dataclass(frozen=True)
class LedgerBand:
    """A byte count the ledger predicts, and how far below and above it a measurement may lie (`ledger_inputs`)."""

    bytes: float
    below: float
    above: float

    def holds(self, measured: float) -> bool:
        return self.bytes - self.below <= measured <= self.bytes + self.above

    def words(self, measured: float) -> str:
        low, high = self.bytes - self.below, self.bytes + self.above
        return (
            f"measured {measured:,.0f} B, the ledger {self.bytes:,.0f} B, "
            + ("within" if self.holds(measured) else f"{measured - self.bytes:+,.0f} B apart, outside")
            + f" [{low:,.0f}, {high:,.0f}] B"
        )


def rule_inputs(perf: Performance, reference: Performance) -> RuleInputs:
    """d, c, r (and the reserved peak's change) of a candidate measured on a GPU beside the reference; r is the
    median of the per-round ratios (`round_ratios`)."""
    return RuleInputs(
        1 - perf.peak_allocated_bytes / reference.peak_allocated_bytes,
        1 - perf.bytes_per_row / reference.bytes_per_row,
        statistics.median(round_ratios(perf, reference)),
        perf.peak_reserved_bytes / reference.peak_reserved_bytes - 1,
    )


def block_excess(book, peak) -> int:
    """The most the CUDA allocator's allocated count can exceed the ledger's tensor bytes at `peak` (a tick of
    `book`) on what the step itself allocated: every tensor alive there and born in the step is one block, which
    allocated counts whole — its size rounded up to 512 B, and a cached block handed out unsplit holds what is
    left of it: under 512 B in the small pool, up to 1 MiB in the large one (CUDACachingAllocator's round_size
    and should_split; `ledger.allocator`). What lived before the step (parameters, gradients, moments) is the
    same for a candidate and its reference and cancels. Kernel scratch allocated at that very moment is not
    counted (the ledger has none)."""
    from trainmech.ledger.allocator import BLOCK_ROUND, SMALL_BLOCK, _pieces
    from trainmech.ledger.clock import AFTER, BEFORE

    order = {t: k for k, t in enumerate(book.ticks)}
    at = order[peak.tick]
    excess = 0
    for st in book.states:
        born = st.created != BEFORE and order[st.created] <= at
        if born and (st.released_at == AFTER or order[st.released_at] >= at):
            for n in _pieces(book, st):
                excess += BLOCK_ROUND + (SMALL_BLOCK if n > SMALL_BLOCK else BLOCK_ROUND)
    return excess


def ledger_inputs(spec, strategy: str, *, padded: bool = False, residual_dropout: bool = False) -> RuleInputs:
    """d and c the ledger predicts for `strategy` against the baseline on a CUDA workload `spec`
    (profiles.Workload: model, batch, seq, micro_batches): a steady update with foreach AdamW, one micro-batch
    of it as the second of a window (the gradients already exist); c from the forward + backward peak at 2 and 4 times
    the micro-batch's rows, per added row, as `performance.remeasure` measures it. padded: the batch is
    right-padded (an attention mask: fp32 runs SDPA's efficient kernel on K and V repeated to every head);
    residual_dropout: the MLP outputs are dropped out (the gate workload's), whose masks are kept.

    With them come the ledger's bytes a measurement is held to (`against_ledger`), each a `LedgerBand`: the bytes
    the whole update's peak saves (`saved`), the bytes per sequence it saves (`saved_per_row`), and how far the
    candidate's whole-update peak lies above its forward + backward peak (`update_over_backward`). Each measured
    peak may differ from the ledger's by Task4's byte slack on CUDA, `ledger.device_terms("cuda").step_slack_bytes`
    (the per-layer slack once per decoder layer), either way, and lie above it by the allocator's rounding of the
    blocks alive there (`block_excess`), never below; a difference of two peaks inherits the first's excess above
    and the second's below, a slope over 2 x rows divides them by it (and a byte for the slope's integer division)."""
    from trainmech import ledger  # imported here: the rule itself needs no model shapes

    rows = spec.batch // spec.micro_batches[0]

    def book(name: str, batch_rows: int):
        return ledger.scenario_ledger(
            spec.model,
            batch_rows,
            spec.seq,
            strategy=name,
            update="steady",
            device="cuda",
            micro_batches=2,
            micro_batch=2,
            padded=padded,
            residual_dropout=residual_dropout,
        )  # micro-batch 2 of 2: the window's gradients already exist

    books = {(name, k): book(name, k * rows) for name in ("baseline", strategy) for k in (1, 2, 4)}
    slack = ledger.device_terms("cuda").step_slack_bytes(books["baseline", 1].shape.num_layers)

    def peak(name: str, k: int, whole: bool = False):
        b = books[name, k]
        p = b.peak_overlap() if whole else b.forward_backward_peak()
        return p.bytes, block_excess(b, p)

    def minus(first, second, per: int = 1) -> LedgerBand:  # first - second, each (bytes, excess)
        return LedgerBand(
            (first[0] - second[0]) / per,
            (second[1] + 2 * slack) / per,
            (first[1] + 2 * slack) / per,
        )

    def slope(name: str) -> LedgerBand:  # bytes per added row
        return minus(peak(name, 4), peak(name, 2), 2 * rows)

    theirs, ours = slope("baseline"), slope(strategy)
    if theirs.bytes <= 0:
        raise ValueError(
            f"the ledger's baseline forward + backward peak does not grow with the rows on {spec.model}, "
            f"micro-batch {rows} x {spec.seq} (it sits where no activation is alive, e.g. the tied embedding's "
            "gradient): c is undefined there; choose a workload whose activations set the peak (longer sequences)"
        )
    base_whole, our_whole = peak("baseline", 1, True), peak(strategy, 1, True)
    return RuleInputs(
        1 - our_whole[0] / base_whole[0],
        1 - ours.bytes / theirs.bytes,
        phase=books[strategy, 1].peak_overlap().phase,
        shape=f"{spec.model}, micro-batch {rows} x {spec.seq}" + (", right-padded" if padded else ""),
        saved=minus(base_whole, our_whole),
        saved_per_row=LedgerBand(
            theirs.bytes - ours.bytes, theirs.below + ours.above + 1, theirs.above + ours.below + 1
        ),
        update_over_backward=minus(our_whole, peak(strategy, 1)),
    )


def measured_phase(perf: Performance) -> str:
    """Where a measured whole update peaks, from its two allocator peaks: "optimizer" where the whole update's
    exceeds the forward + backward's, else "backward" (the update adds nothing above the backward's peak)."""
    return "optimizer" if perf.peak_allocated_bytes > perf.forward_backward_allocated_bytes else "backward"


def against_ledger(
    perf: Performance, reference: Performance, predicted: RuleInputs
) -> dict[str, tuple[bool | None, str]]:
    """A GPU measurement of a candidate beside the reference held to the ledger's prediction for the same workload
    (`ledger_inputs`), in bytes: {"update": the bytes the whole update's peak saves, "capacity": the bytes per
    sequence it saves, "phase": where the whole update peaks}, each (holds, in words). The phase compares the
    whole update's peak above the forward + backward's; it is decided only where the ledger's band excludes 0
    (the update adds bytes above the backward whatever the allocator's rounding): otherwise holds is None, the
    phase undecided (printed, not claimed)."""
    out = {}
    for key, name, measured, band in (
        (
            "update",
            "bytes the whole update saves",
            reference.peak_allocated_bytes - perf.peak_allocated_bytes,
            predicted.saved,
        ),
        (
            "capacity",
            "bytes per sequence saved",
            reference.bytes_per_row - perf.bytes_per_row,
            predicted.saved_per_row,
        ),
    ):
        out[key] = (band.holds(measured), f"{name}: {band.words(measured)}")
    gap, band = (
        perf.peak_allocated_bytes - perf.forward_backward_allocated_bytes,
        predicted.update_over_backward,
    )
    decided = band.bytes - band.below > 0
    out["phase"] = (
        band.holds(gap) if decided else None,
        f"the whole update's allocated peak above the forward + backward's: {band.words(gap)}; "
        + (
            f"the ledger: in the {predicted.phase}"
            if decided
            else f"undecided: the ledger's gap lies within its tolerance of 0 (its peak in {predicted.phase})"
        ),
    )
    return out


def decide_measured(
    update_drop: float,
    capacity_gain: float,
    time_ratio: float,
    rule: DecisionRule = RULE,
    time_noise: float = 0.0,
    reserved_change: float | None = None,
) -> str:
    """accept / tune / no-gain / costs-memory from GPU measurements of a correct candidate.

    update_drop = 1 - the allocated peak of a whole steady update / the reference's: what decides whether this
    workload fits. capacity_gain = 1 - what one more sequence adds to the forward + backward peak of a
    micro-batch accumulating into a window's gradients / the reference's (`performance.Performance.bytes_per_row`):
    what the largest micro-batch that fits hinges on, even where the optimizer step peaks as high as before.
    time_ratio = the median per-round time ratio. time_noise: its uncertainty (`timing_spread`; infinite: none
    counts); a speedup counts from max(min_speedup, time_noise) on. reserved_change = the whole update's reserved peak / the reference's - 1:
    the peak is higher where either the allocated or the reserved one rose past no_higher_slack (the reserved
    peak: device memory the process holds, not a sign that it runs out first; see `DecisionRule`).
    accept: no higher peak (update_drop ≥ -rule.no_higher_slack, reserved_change ≤ it), and a memory gain (either ≥ min_peak_drop) at
    ≤ max_time_ratio, or faster. tune: a gain that costs too much (time, or a higher whole-update peak).
    costs-memory: no gain, and the whole update peaks higher. no-gain: neither smaller nor faster, no higher.
    """
    higher = max(-update_drop, -1.0 if reserved_change is None else reserved_change) > rule.no_higher_slack
    memory = max(update_drop, capacity_gain) >= rule.min_peak_drop
    faster = time_ratio <= 1 - max(rule.min_speedup, time_noise)
    if not higher and ((memory and time_ratio <= rule.max_time_ratio) or faster):
        return "accept"
    if memory or faster:
        return "tune"
    return "costs-memory" if higher else "no-gain"


def decide(
    verdicts: list[Verdict],
    perf: Performance | None,
    reference: Performance | None,
    rule: DecisionRule = RULE,
) -> tuple[str | None, str]:
    """(outcome, reason). A failed gate rejects on any device: the candidate is wrong. Otherwise accept / tune /
    no-gain / costs-memory by `decide_measured`, which needs allocator peaks and step times from a GPU: without
    them, None. The reason gives both peaks' changes, the time ratio's interval and the speedup it must show."""
    failed = next((v for v in verdicts if v.failed), None)
    if failed is not None:
        return "reject", f"{failed.name} gate failed: {failed.message}"
    if perf is None or reference is None or not (perf.on_gpu and reference.on_gpu):
        return None, (
            "no gate failed; accept, tune, no-gain or costs-memory needs allocator peaks and step times measured on a GPU "
            "(TRAIN-CUDA-MECHANISM), and this run has none"
        )
    measured = rule_inputs(perf, reference)
    update, capacity, ratio, reserved = (
        measured.update_drop,
        measured.capacity_gain,
        measured.time_ratio,
        measured.reserved_change,
    )
    noise = timing_spread(perf, reference)
    speedup = max(rule.min_speedup, noise)
    return decide_measured(update, capacity, ratio, rule, noise, reserved), (
        f"allocated peak {-update:+.1%}, reserved {reserved:+.1%}, bytes per sequence {-capacity:+.1%}, "
        f"{time_ratio_text(perf, reference)}; "
        f"accept: neither peak higher (≤ +{rule.no_higher_slack:.0%}) and either {-rule.min_peak_drop:+.0%} or "
        f"lower at ≤ x{rule.max_time_ratio:g}"
        + (f", or time ≤ x{1 - speedup:.2f}" if math.isfinite(speedup) else "")
        + "; costs-memory: no gain and a "
        "peak higher; no-gain: neither"
    )
