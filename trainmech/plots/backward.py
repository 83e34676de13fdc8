"""Task2's figures (local backward), also used by Task6: bytes kept for backward per op and per
sequence length, a layer's activations split, every parameter's gradient error against a reference.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from trainmech.plots.base import figure

__all__ = [
    "saved_bytes_vs_length",
    "grad_errors",
    "saved_bytes_by_op",
    "activation_split",
]


def saved_bytes_vs_length(lengths: list[int], series: dict[str, list[int]]):
    """Task2: bytes one attention op keeps for backward against the sequence length T (log–log),
    one line per implementation; dotted guides show slopes 1 (∝ T) and 2 (∝ T²)."""
    fig, (ax,) = figure(1, 5.2, 3.4)
    for label, values in series.items():
        ax.plot(lengths, values, marker="o", label=label)
    low = 0.5 * min(min(v) for v in series.values())  # guides start below the data, visible beside it
    for power, style in ((1, ":"), (2, "--")):
        ax.plot(
            lengths,
            [low * (t / lengths[0]) ** power for t in lengths],
            style,
            color="gray",
            lw=0.8,
            label="∝ T" if power == 1 else "∝ T²",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length T",
        ylabel="saved bytes (float32)",
        title="attention: what backward keeps",
    )
    ax.set_xticks(lengths, [str(t) for t in lengths])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return fig


def grad_errors(
    names: list[str],
    errors: dict[str, list[float]],
    tolerances: dict[str, float | None],
    *,
    against: str = "autograd",
    floor: float | None = None,
    symbol: str | None = None,
    where: str = "",
):
    """Relative error of every parameter's gradient against a reference (`against`: autograd in Task2, the
    reference run in Task6), one marker series per comparison (log scale, parameters listed top to bottom
    in model order, readable names). A series with a tolerance gets it as a dashed line of its colour, named
    in the legend; one without (a planted bug) is drawn as red crosses, so the gap between a rounding error
    and a wrong formula reads off one axis. `floor`: the errors' scale is at least this share of the largest
    reference gradient of all (Task6's gates.GRAD_FLOOR), and the axis label says so. `symbol`: the reference
    gradient's name in the axis label (default `against`); `where`: which pass the errors are from, for the title."""
    fig, (ax,) = figure(1, 7.6, max(3.6, 0.2 * len(names) + 1.2))
    rows = list(range(len(names)))
    for (label, values), colour in zip(errors.items(), ("tab:blue", "tab:orange", "tab:red")):
        tol = tolerances.get(label)
        ax.plot(
            [max(v, 1e-18) for v in values],
            rows,
            "x" if tol is None else "o",
            ms=5 if tol is None else 4,
            color="tab:red" if tol is None else colour,
            label=label,
        )
        if tol is not None:
            ax.axvline(tol, color=colour, ls="--", lw=0.8, label=f"{label}: tolerance {tol:.0e}")
    ax.set_yticks(rows, names, fontsize=7)
    ax.invert_yaxis()
    ref = symbol or against
    ax.set(
        xscale="log",
        xlabel=(
            f"max|Δ| / max(max|{ref}|, {floor:g} x the largest |{ref}| of all parameters)\n"
            if floor is not None  # a parameter's scale is floored: the label says by what
            else f"max|Δ| / max|{ref}|  "
        )
        + "(dashed: each series' tolerance)",
        title=f"every parameter gradient vs {against}" + (f", {where}" if where else ""),
    )
    fig.legend(loc="outside lower center", ncols=min(len(errors) * 2, 4), fontsize=7, frameon=False)
    ax.grid(alpha=0.3, axis="x")
    return fig


def saved_bytes_by_op(rows: dict[str, tuple[int, int]]):
    """Task2: bytes one op keeps for backward, ours (hand-written saved dict) next to autograd's, per op
    (float32, parameters by reference excluded); each bar labelled with its bytes."""
    fig, (ax,) = figure(1, 8.4, 3.6)
    ops = list(rows)
    xs = range(len(ops))
    for k, (label, colour) in enumerate(
        (("ours (saved dict)", "tab:blue"), ("autograd (measured)", "tab:orange"))
    ):
        bars = ax.bar(
            [x + (k - 0.5) * 0.38 for x in xs], [rows[op][k] for op in ops], 0.38, color=colour, label=label
        )
        ax.bar_label(bars, labels=[f"{rows[op][k]:,}" for op in ops], fontsize=6, rotation=90, padding=2)
    ax.set_xticks(list(xs), ops, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="saved bytes (float32)", title="what each op keeps for backward")
    ax.set_ylim(0, 1.3 * max(max(v) for v in rows.values()))
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    ax.grid(alpha=0.3, axis="y")
    return fig


def activation_split(rows: dict[str, tuple[int, int]]):
    """Task2: a layer's forward activations per implementation, split into the bytes kept for backward
    and the bytes never saved (stacked horizontal bars, each part labelled)."""
    fig, (ax,) = figure(1, 7.6, 0.6 * len(rows) + 1.4)
    names = list(rows)
    kept = [rows[n][0] for n in names]
    never = [rows[n][1] for n in names]
    a = ax.barh(names, kept, color="tab:blue", label="kept for backward")
    b = ax.barh(names, never, left=kept, color="tab:gray", alpha=0.6, label="never saved")
    ax.bar_label(a, labels=[f"{v:,}" for v in kept], label_type="center", fontsize=7, color="white")
    ax.bar_label(b, labels=[f"{v:,}" for v in never], label_type="center", fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="bytes created by the forward (float32)", title="one decoder layer: kept vs never saved")
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    ax.grid(alpha=0.3, axis="x")
    return fig
