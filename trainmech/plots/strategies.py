"""Task5 and Task6's figures: one measured step per memory strategy, and the gates' verdict matrix."""

from __future__ import annotations

from trainmech.plots.base import figure

__all__ = [
    "strategy_timelines",
    "gate_matrix",
]


_PHASE_SHADES = (
    ("forward", "tab:blue"),
    ("loss", "tab:blue"),
    ("backward", "tab:orange"),
    ("optimizer", "tab:gray"),
    ("zero_grad", "tab:gray"),
)


def strategy_timelines(
    runs: dict[str, tuple[list[int], list[str], int]], predicted_peaks: dict[str, int | None]
):
    """One panel per strategy, side by side on one byte scale: measured live bytes over one training step.

    runs: name -> (live, phases, baseline) of a trainmech.measure.StepMemory (live bytes after each
    event, the phase of each event, bytes alive before the step). predicted_peaks: name -> the
    ledger's peak (a dashed line), or None where the ledger has no prediction. The background
    shades forward / backward / update; a star marks the measured peak.
    """
    fig, axes = figure(len(runs), 3.6, 3.2)
    mib = 2**20
    top = max((base + max(live)) / mib for live, _, base in runs.values())
    for ax, (name, (live, phases, base)) in zip(axes, runs.items()):
        ys = [(base + v) / mib for v in live]
        start = 0
        for k in range(1, len(phases) + 1):  # shade runs of events of one kind of phase
            if k == len(phases) or phases[k].split(".")[0] != phases[start].split(".")[0]:
                colour = next((c for p, c in _PHASE_SHADES if phases[start].startswith(p)), "white")
                ax.axvspan(start, k, color=colour, alpha=0.08, lw=0)
                start = k
        ax.plot(range(len(ys)), ys, lw=0.9, color="black")
        k = max(range(len(ys)), key=ys.__getitem__)
        ax.plot(k, ys[k], "*", color="tab:red", ms=10, label=f"measured {ys[k]:,.1f} MiB")
        if predicted_peaks.get(name) is not None:
            ax.axhline(
                predicted_peaks[name] / mib,
                color="tab:blue",
                ls="--",
                lw=1,
                label=f"ledger {predicted_peaks[name] / mib:,.1f} MiB",
            )
        ax.set(title=name, xlabel="allocation / release event", ylim=(0, top * 1.12))
        ax.legend(fontsize=7, loc="lower right")  # the peaks sit high; the lower right stays clear
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("live bytes (MiB)")
    from matplotlib.patches import Patch

    shades = [
        Patch(color=c, alpha=0.3, label=p)
        for p, c in (
            ("forward + loss", "tab:blue"),
            ("backward", "tab:orange"),
            ("update + zero_grad", "tab:gray"),
        )
    ]
    fig.legend(
        handles=shades, loc="outside lower center", ncols=3, fontsize=9, frameon=False, handlelength=2.5
    )
    return fig


def gate_matrix(rows: dict[str, list[bool | str | None]], gates: list[str], breaks: tuple[int, ...] = ()):
    """Candidates × stages: ✓ passed (green), ✗ failed (red), — "measured" (blue: the performance stage, no
    pass / fail), · not run because an earlier gate failed (grey), ○ "not measured" (white: a check of the
    gates only, the performance stage left out on purpose). `breaks`: row indices a rule is drawn above
    (Task6: the planted bugs above, their twins and the real candidates below)."""
    from matplotlib.patches import Rectangle

    fig, (ax,) = figure(1, 1.1 * len(gates) + 3.4, 0.36 * len(rows) + 0.9)
    style = {
        True: ("tab:green", "✓"),
        False: ("tab:red", "✗"),
        "measured": ("tab:blue", "—"),
        None: ("lightgray", "·"),
        "not measured": ("whitesmoke", "○"),
    }
    for i, cells in enumerate(rows.values()):
        for j, passed in enumerate(cells):
            colour, mark = style[passed]
            ax.add_patch(Rectangle((j + 0.03, i + 0.05), 0.94, 0.9, color=colour, alpha=0.85))
            ax.text(
                j + 0.5,
                i + 0.5,
                mark,
                ha="center",
                va="center",
                color="black" if passed in (None, "not measured") else "white",
                fontsize=16 if passed is None else 10,  # a dot at 10 points is lost in the grey
                fontweight="bold" if passed is None else "normal",
            )
    for row in breaks:
        ax.axhline(row, color="black", lw=1.5)
    ax.set(xlim=(0, len(gates)), ylim=(len(rows), 0))
    ax.set_xticks([j + 0.5 for j in range(len(gates))], gates)
    ax.set_yticks([i + 0.5 for i in range(len(rows))], list(rows), fontsize=8)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return fig
