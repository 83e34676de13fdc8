"""Task4's figures (the state ledger): lifecycle chart, memory timelines, per-rank bytes; one colour per
memory category.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from trainmech.plots.base import figure

__all__ = [
    "CATEGORY_COLOURS",
    "lifecycle_chart",
    "memory_timeline",
    "memory_viz_timeline",
    "per_rank_bytes",
]


CATEGORY_COLOURS = {
    "parameters": "tab:gray",
    "gradients": "tab:red",
    "optimizer_states": "tab:purple",
    "unsaved_activations": "tab:olive",
    "saved": "tab:blue",
    "upstream_grads": "tab:cyan",
    "workspace": "tab:orange",
}


def lifecycle_chart(rows, phases: list[str]):
    """States × phases: a bar from the phase a state is created in to the phase it is released in.

    rows: (label, category, nbytes, created, last_consumed, released) with phase names, "before" or
    "after"; phases: the step's phases in order. A black dot marks where a state is last consumed when
    that is not where it is released (gradients: the update, although zero_grad releases them); a state
    released where it is last consumed gets no dot. Colour = category.
    """
    x = {p: i for i, p in enumerate(phases)} | {"before": -0.6, "after": len(phases) - 0.4}
    fig, (ax,) = figure(1, 9.0, 0.9 + 0.24 * len(rows))
    for y, (_label, category, nbytes, created, consumed, released) in enumerate(rows):
        start, end = x[created] - 0.4, x[released] + 0.4
        ax.barh(y, end - start, left=start, height=0.7, color=CATEGORY_COLOURS[category], alpha=0.85)
        if consumed in x and consumed != released:
            ax.plot(x[consumed], y, "o", color="black", ms=3)
        ax.annotate(
            f"{nbytes / 2**10:,.0f} KiB" if nbytes >= 2**10 else f"{nbytes} B",  # 4 B is not "0 KiB"
            (end, y),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=6,
            color="0.3",
        )
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xticks(range(len(phases)), phases, rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.8, len(phases) + 0.8)
    ax.grid(alpha=0.3, axis="x")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=colour, label=category) for category, colour in CATEGORY_COLOURS.items()]
    handles.append(Line2D([], [], marker="o", color="black", ms=3, ls="", label="last consumed"))
    ax.legend(handles=handles, fontsize=7, ncols=4, loc="lower left")
    ax.set_title("training-state lifecycle: created → released, over one step")
    return fig


def _spread(centres: list[float], gap: float) -> list[float]:
    """Label positions at least `gap` apart: each run of crowded labels is spaced evenly around the mean
    of its own centres, the others stay on their centres. centres: ascending."""

    def positions(run):
        mean = sum(run) / len(run)
        return [mean + (i - (len(run) - 1) / 2) * gap for i in range(len(run))]

    runs = [[c] for c in centres]
    i = 0
    while i < len(runs) - 1:
        if positions(runs[i + 1])[0] - positions(runs[i])[-1] < gap:
            runs[i : i + 2] = [runs[i] + runs[i + 1]]
            i = max(i - 1, 0)  # a wider run may now crowd the one before it
        else:
            i += 1
    return [x for run in runs for x in positions(run)]


def memory_timeline(measured, book):
    """Top: measured live bytes after every allocation event, the ledger's phase maxima, the peaks marked.
    Bottom: the ledger's composition by category at every tick (stacked), the peak tick outlined.

    measured: a trainmech.measure.StepMemory (its live bytes per event, their phases, and the bytes
    alive before the step); book: the trainmech.ledger.Ledger of the same step, whose `live()` and
    `by_phase()` (the phase maxima) are drawn as the ledger computes them.
    """
    live, phases, baseline = measured.live, measured.phases, sum(measured.baseline.values())
    predicted, phase_maxima = book.live(), book.by_phase()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9.0, 6.2), layout="constrained")
    plt.close(fig)
    mib = 2**20
    ys = [(baseline + v) / mib for v in live]
    top.plot(range(len(ys)), ys, lw=0.9, color="black", label="measured (tracked storages)")
    starts = {}
    for k, p in enumerate(phases):
        starts.setdefault(p, k)
    bounds = sorted(starts.items(), key=lambda kv: kv[1]) + [("end", len(phases))]
    spans = list(zip(bounds, bounds[1:]))
    centres = [(a + b) / 2 for (_, a), (_, b) in spans]
    # rotated 7.5-pt names need about 2% of the axis apart: short phases (f.head, loss, b.loss) are spread
    placed = _spread(centres, 0.02 * len(phases))
    for ((p, a), (_, b)), centre, x in zip(spans, centres, placed):
        top.axvline(a, color="0.85", lw=0.6)
        if p in phase_maxima:
            top.hlines(
                phase_maxima[p] / mib,
                a,
                b,
                colors="tab:green",
                lw=2,
                label="ledger, phase maximum" if a == 0 else None,
            )
        moved = abs(x - centre) > 1e-9
        top.annotate(
            p.replace("forward.", "f.").replace("backward.", "b."),
            (centre, 0),
            xycoords=("data", "axes fraction"),
            xytext=(x, 0.07 if moved else 0.01),
            textcoords=("data", "axes fraction"),
            rotation=90,
            fontsize=7.5,
            ha="center",
            va="bottom",
            color="0.35",
            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.6"} if moved else None,
        )
    k = max(range(len(ys)), key=ys.__getitem__)
    top.plot(k, ys[k], "*", color="tab:red", ms=12, label=f"measured peak: {ys[k]:,.2f} MiB ({phases[k]})")
    top.set(
        ylabel="live bytes (MiB)",
        xlabel="allocation / release event",
        title="live bytes over one training step",
    )
    top.legend(fontsize=7, loc="upper right")
    top.grid(alpha=0.3, axis="y")
    tick_names = [t for t, _ in predicted]
    stacked = [0.0] * len(tick_names)
    for category, colour in CATEGORY_COLOURS.items():
        vals = [row[category] / mib for _, row in predicted]
        bottom.bar(range(len(tick_names)), vals, bottom=stacked, color=colour, width=0.85, label=category)
        stacked = [a + b for a, b in zip(stacked, vals)]
    peak = max(range(len(tick_names)), key=stacked.__getitem__)
    bottom.bar(
        peak,
        stacked[peak],
        width=0.95,
        fill=False,
        edgecolor="tab:red",
        lw=1.5,
        label=f"peak overlap: {tick_names[peak]}",
    )
    bottom.set_xticks(
        range(len(tick_names)),
        [t.replace("forward.", "f.").replace("backward.", "b.") for t in tick_names],
        rotation=75,
        ha="right",
        fontsize=7,
    )
    bottom.set(ylabel="bytes (MiB)", title="ledger: what is alive at each moment")
    bottom.set_ylim(0, max(stacked) * 1.35)  # headroom: the legend sits above the tallest bar
    bottom.legend(fontsize=7, ncols=4, loc="upper left")
    bottom.grid(alpha=0.3, axis="y")
    return fig


def memory_viz_timeline(history, *, columns: int = 300, min_share: float = 0.004, title: str = ""):
    """PyTorch memory_viz's "active memory timeline" for one history (trainmech.measure.MemoryHistory):
    every live allocation a band, stacked in birth order, so a freed block lets the younger ones drop.

    Colour = the state category (grey: an allocator block no tensor state matches). Blocks below
    min_share of the peak are pooled into one light band on top (memory_viz shows them one by one), so
    the stack's top is every live block. x: the history's alloc/free events; y: live bytes above what
    was alive before the history began.
    """
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    mib, n = 2**20, max(history.events, 1)
    xs = sorted({round(k * (n - 1) / max(columns - 1, 1)) for k in range(columns)} | {n - 1})
    alive_at = lambda b, t: b.born <= t and (b.died is None or b.died > t)  # noqa: E731
    totals = [sum(b.nbytes for b in history.blocks if alive_at(b, t)) for t in xs]
    floor = min_share * max(totals + [1])
    big = [b for b in history.blocks if b.nbytes >= floor]
    polys, colours = [], []
    offsets = {id(b): [None] * len(xs) for b in big}
    stacked = [0] * len(xs)  # the big blocks' height at each column
    for j, t in enumerate(xs):
        for b in big:  # birth order: older blocks below
            if alive_at(b, t):
                offsets[id(b)][j] = stacked[j]
                stacked[j] += b.nbytes
    for b in big:
        pts = [(xs[j], o) for j, o in enumerate(offsets[id(b)]) if o is not None]
        if not pts:
            continue
        top = [(x, (o + b.nbytes) / mib) for x, o in pts]
        polys.append(top + [(x, o / mib) for x, o in reversed(pts)])
        colours.append(CATEGORY_COLOURS.get(b.category, "0.6"))
    pooled = [(x, h / mib, t / mib) for x, h, t in zip(xs, stacked, totals)]
    polys.append([(x, t) for x, _, t in pooled] + [(x, h) for x, h, _ in reversed(pooled)])
    colours.append("0.85")
    fig, (ax,) = figure(1, 9.0, 3.6)
    ax.add_collection(PolyCollection(polys, facecolors=colours, edgecolors="none", alpha=0.9))
    ax.plot(xs, [t / mib for t in totals], color="black", lw=0.8, label="all live blocks")
    present = [c for c in CATEGORY_COLOURS if any(b.category == c for b in big)]
    handles = [Patch(color=CATEGORY_COLOURS[c], label=c) for c in present]
    if any(b.category == "allocator only" for b in big):
        handles.append(Patch(color="0.6", label="allocator only"))
    handles.append(Patch(color="0.85", label=f"blocks under {min_share:.1%} of the peak, pooled"))
    ax.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=7, ncols=3, loc="upper left")
    ax.set_xlim(0, n)
    ax.set_ylim(0, max(totals) / mib * 1.35)  # headroom for the legend
    ax.set(
        xlabel=f"allocation / release event ({history.source})",
        ylabel="live bytes above the start (MiB)",
        title=title or "active memory timeline (memory_viz style)",
    )
    ax.grid(alpha=0.3, axis="y")
    return fig


def per_rank_bytes(reports, books):
    """Rank 0's tracked peak for each (ZeRO stage, world size): measured composition stacked by category, the
    ledger's predicted peak as a black dash; below, the model-state bytes the rank holds after the update.

    reports: trainmech.distributed.RankReport list; books: (stage, N, rank) -> the ledger's per-rank book.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = [r for r in reports if r.rank == 0]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9.0, 5.6), layout="constrained", sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    plt.close(fig)
    kib = 2**10
    xs = range(len(rows))
    base = [0.0] * len(rows)
    for category, colour in CATEGORY_COLOURS.items():
        vals = [r.peak_by_category[category] / kib for r in rows]
        top.bar(xs, vals, bottom=base, color=colour, width=0.7)
        base = [a + b for a, b in zip(base, vals)]
    top.scatter(
        xs,
        [books[(r.stage, r.world_size, 0)].peak_overlap().bytes / kib for r in rows],
        marker="_",
        s=500,
        color="black",
        zorder=3,
    )
    top.set(
        ylabel="peak, rank 0 (KiB)",
        title="per-rank peak of one update: measured (bars) and the ledger (dash)",
    )
    top.set_ylim(0, max(base) * 1.45)
    handles = [Patch(color=c, label=k) for k, c in CATEGORY_COLOURS.items()]
    handles.append(Line2D([], [], marker="_", ms=14, ls="", color="black", label="ledger's predicted peak"))
    top.legend(handles=handles, fontsize=7, ncols=4, loc="upper right")
    held = ("parameters", "gradients", "optimizer_states")
    width = 0.25
    for k, name in enumerate(held):
        bottom.bar(
            [x + (k - 1) * width for x in xs],
            [r.held[name] / kib for r in rows],
            width,
            color=CATEGORY_COLOURS[name],
            label=name + (" (when the step starts)" if name == "gradients" else " (after the step)"),
        )
    bottom.set(ylabel="held by rank 0 (KiB)", xlabel="ZeRO stage (PyTorch's engine) × world size N")
    bottom.set_xticks(list(xs), [f"stage {r.stage}\nN={r.world_size}" for r in rows], fontsize=7)
    bottom.legend(fontsize=7, ncols=3, loc="upper right")
    bottom.set_ylim(0, max(r.held["optimizer_states"] for r in rows) / kib * 1.4)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    return fig
