"""The questions a peak raises, answered by the ledger side by side.

`scenario_matrix`: for each strategy (baseline, full activation checkpointing, activation offload),
the first update (AdamW creates its states) and a steady one, the peak of the whole update and the
peak of its forward + backward only. A strategy changes saved tensors, so it can only lower a peak
that sits in the forward or backward; when the whole-update peak sits in the optimizer step, the
same strategy changes it by nothing. `variants`: the update's own options on the steady
whole-update peak (AdamW implementations, optimizer-in-backward, zero_grad, accumulation, autocast).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmech.ledger.book import Ledger, Peak, training_state_lifecycle
from trainmech.ledger.recipes import recipe
from trainmech.ledger.shape import model_shape

STRATEGIES = ("baseline", "checkpoint", "offload")
UPDATES = ("first", "steady")


@dataclass(frozen=True)
class Scenario:
    strategy: str
    update: str  # "first" | "steady"
    book: Ledger

    @property
    def whole(self) -> Peak:
        return self.book.peak_overlap()

    @property
    def forward_backward(self) -> Peak:
        return self.book.forward_backward_peak()


def offload_min_bytes(shape, batch: int, seq: int, dtype: str) -> int:
    """Task5's offload rule: a saved tensor of at least a quarter of one hidden state goes to the host."""
    return batch * seq * shape.hidden_size * recipe(dtype).activation_bytes // 4


def scenario_matrix(config, batch: int, seq: int, *, strategies=STRATEGIES, min_bytes: int | None = None,
                    **options) -> list[Scenario]:
    """Every (strategy, update) pair; options go to `training_state_lifecycle` (dtype, device, …)."""
    shape = model_shape(config)
    dtype = options.get("dtype", "fp32")
    min_bytes = min_bytes if min_bytes is not None else offload_min_bytes(shape, batch, seq, dtype)
    out = []
    for strategy in strategies:
        for update in UPDATES:
            book = training_state_lifecycle(shape, batch, seq, first_step=update == "first",
                                            checkpointing="full" if strategy == "checkpoint" else "none", **options)
            out.append(Scenario(strategy, update, book.offloaded(min_bytes) if strategy == "offload" else book))
    return out


def change(rows: list[Scenario], strategy: str, update: str, which: str = "whole") -> float:
    """(strategy − baseline) / baseline of one peak (`whole` or `forward_backward`)."""
    pick = {(r.strategy, r.update): getattr(r, which).bytes for r in rows}
    return pick[(strategy, update)] / pick[("baseline", update)] - 1


def render_matrix(rows: list[Scenario], unit: float = 2**30, unit_name: str = "GiB") -> str:
    """One line per strategy: first-update and steady peaks, forward+backward and whole, with their change and tick."""
    head = (f"{'strategy':<11}{'first: fwd+bwd':>16}{'whole update':>24}{'steady: fwd+bwd':>17}{'whole update':>24}   "
            "whole-update peak tick (first / steady)")
    lines = [head]
    for strategy in dict.fromkeys(r.strategy for r in rows):
        cells, ticks_ = [], []
        for update in UPDATES:
            r = next(x for x in rows if (x.strategy, x.update) == (strategy, update))
            fb, whole = r.forward_backward.bytes, r.whole.bytes
            fb_change = "" if strategy == "baseline" else f"{change(rows, strategy, update, 'forward_backward'):+.1%}"
            whole_change = "" if strategy == "baseline" else f"{change(rows, strategy, update):+.1%}"
            cells += [f"{fb / unit:>9.2f}{fb_change:>7}", f"{whole / unit:>17.2f}{whole_change:>7}"]
            ticks_.append(r.whole.tick)
        lines.append(f"{strategy:<11}" + "".join(cells) + f"   {ticks_[0]} / {ticks_[1]}")
    return "\n".join(lines) + f"\n(peaks in {unit_name}; the changes are against the baseline of the same column)"


def window_peak(config, batch: int, seq: int, micro_batches: int, **options) -> Peak:
    """The peak over a whole accumulation window: its first micro-batch (no .grad yet) or its last (.grad
    alive from the start, then the update); the micro-batches between are never above the last."""
    books = [training_state_lifecycle(config, batch, seq, micro_batches=micro_batches, micro_batch=k, **options)
             for k in sorted({1, micro_batches})]
    return max((b.peak_overlap() for b in books), key=lambda p: p.bytes)


VARIANTS = {
    "AdamW foreach (CUDA's default)": {"optimizer_impl": "foreach"},
    "AdamW for-loop (foreach=False)": {"optimizer_impl": "loop"},
    "AdamW fused=True": {"optimizer_impl": "fused"},
    "optimizer in backward": {"optimizer_in_backward": True},
    "zero_grad(set_to_none=False)": {"set_to_none": False},
    "autocast bf16 (fp32 weights)": {"dtype": "autocast-bf16"},
}


def variants(config, batch: int, seq: int, *, micro_batches: int = 2, **options) -> dict[str, Peak]:
    """The steady whole-update peak under each update option, and under `micro_batches` micro-batches of
    batch / micro_batches sequences (the same effective batch, accumulated)."""
    out = {name: training_state_lifecycle(config, batch, seq, **{**options, **change_}).peak_overlap()
           for name, change_ in VARIANTS.items()}
    if micro_batches > 1 and batch % micro_batches == 0:
        out[f"{micro_batches} micro-batches of {batch // micro_batches}"] = window_peak(
            config, batch // micro_batches, seq, micro_batches, **options)
    return out


def render_measured(points: dict[str, tuple]) -> tuple[str, float]:
    """strategy -> (first, steady) Comparisons: the four peaks predicted and measured (tracked tensor bytes,
    on any device). Returns the table and the worst relative error among them."""
    lines = [f"{'strategy':<11}{'update':<8}{'fwd+bwd: ledger':>16}{'measured':>12}{'whole: ledger':>15}{'measured':>12}  whole-update peak phase"]
    worst = 0.0
    for strategy, pair in points.items():
        for c in pair:
            fb_pred, fb_meas = c.predicted.forward_backward_peak().bytes, c.measured_forward_backward_peak
            worst = max(worst, abs(fb_pred - fb_meas) / fb_meas, abs(c.tracked_error))
            lines.append(f"{strategy:<11}{c.step:<8}{fb_pred:>16,}{fb_meas:>12,}{c.predicted_peak:>15,}{c.tracked_peak:>12,}  "
                         f"{c.predicted.peak_overlap().phase} / {c.measured.peak_phase}")
    return "\n".join(lines), worst
