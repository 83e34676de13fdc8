"""The questions a peak raises, answered by the ledger side by side.

A memory strategy acts on saved tensors, so it can only lower a peak that sits in the forward or
backward; whether the whole update's peak falls with it depends on what else peaks: on the first
update AdamW has no moments yet, on a steady one a foreach step holds every gradient, both moments
and one temporary per parameter at once. These views re-time the states of a `Ledger` (nothing is
re-derived) and put the cases side by side:

    scenario_ledger(config, b, s, strategy=…, update=…, optimizer_step=…)   one case's Ledger
    scenario_matrix(config, b, s, optimizer_steps=(…))   strategy × first / steady update × optimizer step, as Scenario rows
    offload_assumptions(config, b, s)   one line: what the offload rows assume (threshold, layers, prefetch)
    render_matrix(rows)       one line per strategy: both peaks of the first and the steady update (Task4)
    render_rows(rows, …)      one line per scenario, optionally beside its measurement (Task5)
    variants(config, b, s)    the update's own options on the steady whole-update peak
    precision_changes(config, b, s, dtype=…)   every peak the ledger predicts, one recipe against fp32
    precision_sweep(config, batches, seqs, dtype=…)   the same over a grid of shapes; `matching_shapes` finds
                              the shapes and peaks whose change lies near a quoted one

Measuring the same cells (`measure_matrix`, `measured_peaks`) is
`trainmech.ledger.measured_matrix`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from trainmech.errors import TrainmechError
from trainmech.ledger import allocator
from trainmech.ledger.book import Ledger, Peak, training_state_lifecycle
from trainmech.ledger.clock import UPDATES
from trainmech.ledger.recipes import recipe
from trainmech.ledger.shape import model_shape

__all__ = [
    "STRATEGIES",
    "UPDATES",
    "OPTIMIZER_STEPS",
    "VARIANTS",
    "Scenario",
    "offload_min_bytes",
    "offload_assumptions",
    "scenario_ledger",
    "scenario_matrix",
    "change",
    "drops",
    "worst_peak_error",
    "relation",
    "checkpoint_relations",
    "render_relations",
    "bytes_per_row",
    "render_matrix",
    "render_rows",
    "window_peak",
    "variants",
    "PRECISION_PEAKS",
    "precision_changes",
    "precision_sweep",
    "matching_shapes",
    "render_measured",
]

STRATEGIES = ("baseline", "checkpoint", "offload")
# how the optimizer steps, as options of training_state_lifecycle ("default": the device's own choice); which
# optimizer steps (adamw, sgd, …) is training_state_lifecycle's `optimizer`
OPTIMIZER_STEPS = {
    "default": {},
    "foreach": {"optimizer_impl": "foreach"},
    "for-loop": {"optimizer_impl": "loop"},
    "fused": {"optimizer_impl": "fused"},
    "in-backward": {"optimizer_in_backward": True},
}


@dataclass(frozen=True)
class Scenario:
    """One cell of the matrix: a strategy on the first or a steady update, with an optimizer step, and its ledger."""

    strategy: str
    update: str  # "first" | "steady"
    optimizer_step: str  # one of OPTIMIZER_STEPS; "default": foreach on CUDA, for-loop on a CPU
    book: Ledger

    @cached_property
    def whole(self) -> Peak:
        """The whole update's peak (forward, backward and the optimizer step)."""
        return self.book.peak_overlap()

    @cached_property
    def forward_backward(self) -> Peak:
        """The peak before the optimizer step."""
        return self.book.forward_backward_peak()


def offload_min_bytes(shape, batch: int, seq: int, dtype: str) -> int:
    """Task5's offload rule: a saved tensor of at least a quarter of one hidden state goes to the host."""
    return batch * seq * shape.hidden_size * recipe(dtype).activation_bytes // 4


def offload_assumptions(config, batch: int, seq: int, **options) -> str:
    """One line: what an offload row assumes on paper (`scenario_ledger`'s and `Ledger.offloaded`'s
    defaults, read from their signatures); options go to `training_state_lifecycle` (dtype, device, …)."""
    import inspect

    defaults = {
        name: p.default
        for f in (Ledger.offloaded, scenario_ledger)
        for name, p in inspect.signature(f).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    shape = model_shape(config)
    min_bytes = offload_min_bytes(shape, batch, seq, options.get("dtype", "fp32"))
    moved = training_state_lifecycle(shape, batch, seq, **options).offloadable_bytes(
        min_bytes, exempt_last=defaults["exempt_last"]
    )
    return (
        f"offload on paper: every saved tensor of >= {min_bytes:,} B (a quarter of one hidden state) that layers "
        f"0..{shape.num_layers - 1 - defaults['exempt_last']} keep goes to the host (the last "
        f"{defaults['exempt_last']} layer keeps its own), {moved / 2**30:.2f} GiB each way; layer j's stay on the "
        f"device through layer j+{defaults['stash_groups']}'s forward and come back when the backward reaches layer "
        f"j+{defaults['prefetch_groups']}; device bytes only (the host copies are not counted)"
    )


def scenario_ledger(
    config,
    batch: int,
    seq: int,
    *,
    strategy: str,
    update: str,
    optimizer_step: str = "default",
    min_bytes: int | None = None,
    prefetch_groups: int = 2,
    exempt_last: int = 1,
    **options,
) -> Ledger:
    """The ledger of one scenario; options go to `training_state_lifecycle` (dtype, device, attention, …).
    min_bytes (offload): default `offload_min_bytes`."""
    if strategy not in STRATEGIES or update not in UPDATES:
        raise TrainmechError(
            f"strategy must be one of {', '.join(STRATEGIES)} and update one of {', '.join(UPDATES)}, "
            f"got {strategy!r}, {update!r}"
        )
    if optimizer_step not in OPTIMIZER_STEPS:
        raise TrainmechError(
            f"unknown optimizer step {optimizer_step!r}; valid: {', '.join(OPTIMIZER_STEPS)}"
        )
    shape = model_shape(config)
    book = training_state_lifecycle(
        shape,
        batch,
        seq,
        first_step=update == "first",
        checkpointing="full" if strategy == "checkpoint" else "none",
        **{**options, **OPTIMIZER_STEPS[optimizer_step]},
    )
    if strategy == "offload":
        if min_bytes is None:
            min_bytes = offload_min_bytes(shape, batch, seq, options.get("dtype", "fp32"))
        book = book.offloaded(min_bytes, prefetch_groups=prefetch_groups, exempt_last=exempt_last)
    return book


def scenario_matrix(
    config,
    batch: int,
    seq: int,
    *,
    strategies=STRATEGIES,
    updates=UPDATES,
    optimizer_steps=("default",),
    **options,
) -> list[Scenario]:
    """Every (optimizer step, update, strategy) scenario, in that nesting; options as `scenario_ledger`."""
    shape = model_shape(config)
    return [
        Scenario(
            strategy,
            update,
            step,
            scenario_ledger(
                shape, batch, seq, strategy=strategy, update=update, optimizer_step=step, **options
            ),
        )
        for step in optimizer_steps
        for update in updates
        for strategy in strategies
    ]


def _peak_bytes(row: Scenario, which: str) -> int:
    return getattr(row, which).bytes


def _ratio(rows: list[Scenario], strategy: str, update: str, which: str, optimizer_step: str) -> float:
    """strategy / baseline of one peak (`whole` or `forward_backward`) in the same update and optimizer step."""
    pick = {(r.strategy, r.update, r.optimizer_step): _peak_bytes(r, which) for r in rows}
    return pick[(strategy, update, optimizer_step)] / pick[("baseline", update, optimizer_step)]


def change(
    rows: list[Scenario], strategy: str, update: str, which: str = "whole", optimizer_step: str = "default"
) -> float:
    """(strategy − baseline) / baseline of one peak (`whole` or `forward_backward`) in the same update and optimizer step."""
    return _ratio(rows, strategy, update, which, optimizer_step) - 1


def drops(rows: list[Scenario], strategy: str) -> dict[tuple[str, str, str], float]:
    """(update, optimizer step, "fwd+bwd" | "update") -> 1 - the strategy's peak / the baseline's in the same scenario."""
    return {
        (r.update, r.optimizer_step, kind): 1 - _ratio(rows, strategy, r.update, which, r.optimizer_step)
        for r in rows
        if r.strategy == strategy
        for kind, which in (("fwd+bwd", "forward_backward"), ("update", "whole"))
    }


def worst_peak_error(rows: list[Scenario], measured_rows: dict) -> float:
    """The largest |predicted / measured - 1| over both peaks of every row
    (measured_rows: (strategy, update, optimizer step) -> (fwd+bwd, whole))."""
    return max(
        abs(pred / got - 1)
        for r in rows
        for pred, got in zip(
            (r.forward_backward.bytes, r.whole.bytes), measured_rows[(r.strategy, r.update, r.optimizer_step)]
        )
    )


def relation(a: float, b: float, margin: float = 1.0) -> str:
    """How `a` stands to `b`: "<" or ">" when it is beyond `margin` (a ratio, 1 = exact) on that side, else "=" (within
    the margin: a difference the allocator's rounding could make)."""
    if a * margin < b:
        return "<"
    if a > margin * b:
        return ">"
    return "="


def checkpoint_relations(
    rows: list[Scenario], measured_rows: dict, margin: float = 1.0
) -> dict[str, tuple[str, str]]:
    """For a steady foreach update, (predicted, measured) relations of checkpoint's forward + backward peak to the
    baseline's ("fwd+bwd") and of checkpoint's whole-update peak to its own forward + backward peak ("update"):
    the ledger's from `rows`, the measurement's from `measured_rows` (as in `worst_peak_error`), each by `relation`."""
    led = {
        r.strategy: (r.forward_backward.bytes, r.whole.bytes)
        for r in rows
        if (r.update, r.optimizer_step) == ("steady", "foreach")
    }
    got = {s: measured_rows[(s, "steady", "foreach")] for s in ("baseline", "checkpoint")}
    pairs = {
        "fwd+bwd": lambda p: (p["checkpoint"][0], p["baseline"][0]),
        "update": lambda p: (p["checkpoint"][1], p["checkpoint"][0]),
    }
    return {
        name: (relation(*pick(led), margin=margin), relation(*pick(got), margin=margin))
        for name, pick in pairs.items()
    }


def render_relations(relations: dict[str, tuple[str, str]]) -> str:
    """One line for `checkpoint_relations`: each relation, the ledger's then the measurement's."""
    return (
        "foreach steady update, checkpoint's fwd+bwd peak vs the baseline's, its whole-update peak vs its fwd+bwd "
        "peak (ledger, measured): " + ", ".join(f"{k} {p} {m}" for k, (p, m) in relations.items())
    )


END_OF_FORWARD = (
    "forward.head:lm_head"  # the tick the logits exist: what a micro-batch keeps alive by then grows with it
)


def bytes_per_row(config, rows: int, seq: int, *, strategy: str, **options) -> int:
    """The ledger's capacity slope: what one more sequence adds to the bytes alive at the end of a micro-batch's
    forward, (alive with 2·rows - with rows) / rows, on a steady update; options as `scenario_ledger`."""

    def alive(b):
        book = scenario_ledger(config, b, seq, strategy=strategy, update="steady", **options)
        return sum(dict(book.live())[END_OF_FORWARD].values())

    return (alive(2 * rows) - alive(rows)) // rows


def render_matrix(rows: list[Scenario], unit: float = 2**30, unit_name: str = "GiB") -> str:
    """One line per strategy (and optimizer step, when there are several): first-update and steady peaks,
    forward+backward and whole, with their change against the baseline and the whole-update peak's tick."""
    head = (
        f"{'strategy':<11}{'first: fwd+bwd':>16}{'whole update':>24}{'steady: fwd+bwd':>17}{'whole update':>24}   "
        "whole-update peak tick (first / steady)"
    )
    several = len({r.optimizer_step for r in rows}) > 1
    lines = [head]
    for strategy, step in dict.fromkeys((r.strategy, r.optimizer_step) for r in rows):
        cells, ticks = [], []
        for update in UPDATES:
            r = next(x for x in rows if (x.strategy, x.update, x.optimizer_step) == (strategy, update, step))
            changes = [
                "" if strategy == "baseline" else f"{change(rows, strategy, update, which, step):+.1%}"
                for which in ("forward_backward", "whole")
            ]
            cells += [
                f"{r.forward_backward.bytes / unit:>9.2f}{changes[0]:>7}",
                f"{r.whole.bytes / unit:>17.2f}{changes[1]:>7}",
            ]
            ticks.append(r.whole.tick)
        label = f"{strategy} ({step})" if several else strategy
        lines.append(f"{label:<11}" + "".join(cells) + f"   {ticks[0]} / {ticks[1]}")
    return (
        "\n".join(lines)
        + f"\n(peaks in {unit_name}; the changes are against the baseline of the same column)"
    )


def render_rows(
    rows: list[Scenario], *, unit: int = 2**30, unit_name: str = "GiB", measured_rows: dict | None = None
) -> str:
    """One line per scenario, each peak with its change against the baseline of the same update and optimizer step;
    `measured_rows` ((strategy, update, optimizer step) -> (fwd+bwd, whole)) adds the measured columns."""
    base = {(r.update, r.optimizer_step): r for r in rows if r.strategy == "baseline"}
    head = f"{'strategy':<11}{'update':<8}{'optimizer':<13}{'fwd+bwd peak':>16}{'fwd+bwd change':>16}{'update peak':>16}{'update change':>15}  peak at"
    lines = [head + ("" if measured_rows is None else f"{'measured fwd+bwd':>19}{'measured update':>17}")]
    for r in rows:
        b = base.get((r.update, r.optimizer_step))
        cells = []
        for which, width in (("forward_backward", 16), ("whole", 15)):
            value = _peak_bytes(r, which)
            cells.append(
                f"{value / unit:>12.2f} {unit_name}"
                + (f"{value / _peak_bytes(b, which) - 1:>+{width}.1%}" if b else f"{'':>{width}}")
            )
        line = f"{r.strategy:<11}{r.update:<8}{r.optimizer_step:<13}{cells[0]}{cells[1]}  {r.whole.phase}"
        if measured_rows is not None:
            fb, whole = measured_rows[(r.strategy, r.update, r.optimizer_step)]
            line += f"{fb / unit:>15.2f} {unit_name}{whole / unit:>13.2f} {unit_name}"
        lines.append(line)
    return "\n".join(lines)


def window_peak(config, batch: int, seq: int, micro_batches: int, **options) -> Peak:
    """The peak over a whole accumulation window: its first micro-batch (no .grad yet) or its last (.grad
    alive from the start, then the update); the micro-batches between are never above the last."""
    books = [
        training_state_lifecycle(config, batch, seq, micro_batches=micro_batches, micro_batch=k, **options)
        for k in sorted({1, micro_batches})
    ]
    return max((b.peak_overlap() for b in books), key=lambda p: p.bytes)


VARIANTS = {
    "AdamW foreach (CUDA's default)": {"optimizer_impl": "foreach"},
    "AdamW for-loop (foreach=False)": {"optimizer_impl": "loop"},
    "AdamW fused=True": {"optimizer_impl": "fused"},
    "optimizer in backward": {"optimizer_in_backward": True},
    "zero_grad(set_to_none=False)": {"set_to_none": False},
    "autocast bf16 (fp32 weights)": {"dtype": "autocast-bf16"},
    # the memory-efficient kernel in fp32 (no s×s), as it runs on a torch that refuses enable_gqa for it (K and
    # V repeated to every head first) and on one that accepts it (K and V at kv_heads)
    "fp32, memory-efficient SDPA, K/V repeated": {"attention": "efficient", "repeat_kv": True},
    "fp32, memory-efficient SDPA, K/V at kv_heads": {"attention": "efficient", "repeat_kv": False},
}


def variants(config, batch: int, seq: int, *, micro_batches: int = 2, **options) -> dict[str, Peak]:
    """The steady whole-update peak under each update option, under `micro_batches` micro-batches of
    batch / micro_batches sequences (the same effective batch, accumulated), and of one plain update of
    that micro-batch alone (what the window adds to it: the gradients the first micro-batch leaves)."""
    out = {
        name: training_state_lifecycle(config, batch, seq, **{**options, **option}).peak_overlap()
        for name, option in VARIANTS.items()
    }
    if micro_batches > 1 and batch % micro_batches == 0:
        small = batch // micro_batches
        out[f"{micro_batches} micro-batches of {small}"] = window_peak(
            config, small, seq, micro_batches, **options
        )
        out[f"one update of {small} (no window)"] = training_state_lifecycle(
            config, small, seq, **options
        ).peak_overlap()
    return out


PRECISION_PEAKS = (
    "first update, forward+backward (tensors)",
    "first update, whole update (tensors)",
    "steady update, forward+backward (tensors)",
    "steady update, whole update (tensors)",
    "a run of updates, whole update (tensors)",
    "a run of updates, allocated (allocator model)",
    "a run of updates, reserved (allocator model)",
)


def _precision_peaks(config, batch: int, seq: int, dtype: str, options: dict) -> dict[str, int]:
    first = training_state_lifecycle(config, batch, seq, dtype=dtype, first_step=True, **options)
    steady = training_state_lifecycle(config, batch, seq, dtype=dtype, **options)
    replayed = allocator.cuda_peaks(
        first, steady
    )  # the caching allocator over a first update, then a steady one
    values = (
        first.forward_backward_peak().bytes,
        first.peak_overlap().bytes,
        steady.forward_backward_peak().bytes,
        steady.peak_overlap().bytes,
        max(first.peak_overlap().bytes, steady.peak_overlap().bytes),
        replayed.allocated_peak,
        replayed.reserved_peak,
    )
    return dict(zip(PRECISION_PEAKS, values))


def precision_changes(
    config, batch: int, seq: int, *, dtype: str, reference: str = "fp32", **options
) -> dict[str, float]:
    """(dtype − reference) / reference of every peak the ledger predicts for this workload (PRECISION_PEAKS):
    the forward+backward and whole-update tensor peaks of the first and of a steady update, the most over a
    run of updates, and the allocator model's allocated and reserved peaks over a first and a steady update
    (CUDA's caching allocator; reserved is the process's, cumulative). options: as training_state_lifecycle."""
    ours, theirs = (_precision_peaks(config, batch, seq, d, options) for d in (dtype, reference))
    return {name: ours[name] / theirs[name] - 1 for name in PRECISION_PEAKS}


def precision_sweep(
    config, batches, seqs, *, dtype: str, reference: str = "fp32", **options
) -> dict[tuple[int, int], dict[str, float]]:
    """(batch, seq) -> `precision_changes` of that shape, for every shape of the grid batches × seqs: on
    which shape, and in which peak, a quoted change of `dtype` against `reference` could have been seen."""
    if not batches or not seqs:
        raise TrainmechError("precision_sweep needs at least one batch and one seq")
    return {
        (b, s): precision_changes(config, b, s, dtype=dtype, reference=reference, **options)
        for b in batches
        for s in seqs
    }


def matching_shapes(
    sweep: dict[tuple[int, int], dict[str, float]], target: float, within: float
) -> list[tuple[int, int, str, float]]:
    """(batch, seq, peak, change) of every sweep entry whose change lies within `within` of `target` (both
    fractions: -0.107 is -10.7 %; within 0.01 is one percentage point), in the sweep's order."""
    if within < 0:
        raise TrainmechError(f"within must be >= 0, got {within}")
    return [
        (b, s, peak, change)
        for (b, s), changes in sweep.items()
        for peak, change in changes.items()
        if abs(change - target) <= within
    ]


def render_measured(points: dict[str, tuple]) -> tuple[str, int]:
    """strategy -> (first, steady) Comparisons: the four peaks predicted and measured (tracked tensor bytes,
    on any device). Returns the table and the largest |predicted − measured| among them, in bytes."""
    lines = [
        f"{'strategy':<11}{'update':<8}{'fwd+bwd: ledger':>16}{'measured':>12}{'whole: ledger':>15}{'measured':>12}  whole-update peak phase (ledger / measured)"
    ]
    worst = 0
    for strategy, pair in points.items():
        for c in pair:
            fb_pred, fb_meas = c.predicted.forward_backward_peak().bytes, c.measured_forward_backward_peak
            worst = max(worst, abs(fb_pred - fb_meas), abs(c.predicted_peak - c.tracked_peak))
            lines.append(
                f"{strategy:<11}{c.step:<8}{fb_pred:>16,}{fb_meas:>12,}{c.predicted_peak:>15,}{c.tracked_peak:>12,}  "
                f"{c.predicted.peak_overlap().phase} / {c.measured.peak_phase}"
            )
    return "\n".join(lines), worst
