"""Figures for the notebooks: loss curves, lifecycle charts, memory timelines, schedules.

Each function returns a matplotlib Figure and closes it from pyplot's registry, so a notebook
shows it exactly once by making it the cell's last expression. Labels use the glossary's English
names (the code's vocabulary); the notebook's Chinese prose explains the picture. Importing this
module configures an installed CJK font for Chinese text (trainmech.fonts; `fonts.label(zh, en)`
falls back to English where the machine has none, so a figure never shows empty boxes).
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from trainmech import fonts

__all__ = [
    "training_loop",
    "grad_fn_graph",
    "token_weights",
    "precision_runs",
    "fp16_gradient_range",
    "wsd_clock",
    "update_dynamics",
    "continual_pretrain",
    "CATEGORY_COLOURS",
    "lifecycle_chart",
    "memory_timeline",
    "memory_viz_timeline",
    "per_rank_bytes",
    "strategy_timelines",
    "saved_bytes_vs_length",
    "grad_errors",
    "saved_bytes_by_op",
    "activation_split",
    "gate_matrix",
]

fonts.configure()


def _figure(ncols: int, width: float = 4.2, height: float = 3.0):
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), layout="constrained")
    plt.close(fig)
    return fig, (axes if ncols > 1 else [axes])


def training_loop(losses: list[float], displacements: list[float], held_out: list[float] | None = None):
    """Left: loss per effective update (0 = before any update). Right: ‖Δθ‖ of each update."""
    fig, (ax_loss, ax_move) = _figure(2)
    ax_loss.plot(range(len(losses)), losses, marker="o", label="training batch")
    if held_out is not None:
        ax_loss.plot(range(len(held_out)), held_out, marker="s", label="held-out batch")
        ax_loss.legend()
    ax_loss.set(xlabel="effective updates", ylabel="token loss (nats)", title="loss")
    ax_move.bar(range(1, len(displacements) + 1), displacements)
    ax_move.set(xlabel="update", ylabel="‖θ_after − θ_before‖₂", title="parameter displacement")
    for ax in (ax_loss, ax_move):
        ax.grid(alpha=0.3)
    return fig


_KINDS = {  # node kind -> (words in the node's type name, colour); the first matching kind wins
    "leaf (AccumulateGrad)": (("AccumulateGrad",), "tab:green"),
    "loss": (("NllLoss", "LogSoftmax", "Softmax"), "tab:red"),
    "attention": (("SDPA", "Attention"), "tab:purple"),
    "matmul / lookup": (("Mm", "Addmm", "Bmm", "Matmul", "Linear", "Embedding"), "tab:blue"),
    "view / layout": (
        (
            "View",
            "T",
            "Transpose",
            "Reshape",
            "Slice",
            "Cat",
            "Alias",
            "Expand",
            "Permute",
            "Select",
            "Squeeze",
            "Unsqueeze",
            "Clone",
        ),
        "tab:gray",
    ),
    "elementwise / reduction": ((), "tab:orange"),
}


def _short_type(node) -> str:
    """MmBackward0 -> Mm; the CPU flash-attention backward -> SDPA."""
    name = re.sub(r"Backward\d*$", "", type(node).__name__)
    return "SDPA" if "ScaledDotProduct" in name else name


def _node_kind(node) -> str:
    short = _short_type(node)
    for kind, (words, _) in _KINDS.items():
        if any(short == w or (len(w) > 2 and w in short) for w in words):
            return kind
    return "elementwise / reduction"


def grad_fn_graph(root, *, max_nodes: int | None = None, names: dict | None = None, highlight=None):
    """The backward graph of root: one marker per grad_fn node, from root (left) to the leaves.

    x = the node's level (longest path from root.grad_fn, see `graph.levels`), so every edge
    points right; colour = the kind of operation. max_nodes keeps the nodes nearest the root;
    with at most 40 nodes each is labelled by its type, a leaf by its name in `names` (a dict
    name -> tensor). `highlight`, a leaf tensor, draws the edges into it in red: one per use.
    Refuses a root without grad_fn (ValueError).
    """
    from trainmech import graph

    if root.grad_fn is None:
        raise ValueError("root has no grad_fn: it is a leaf, or was computed without autograd")
    level = graph.levels(root)
    order = {node: i for i, node in enumerate(graph.nodes(root))}
    kept = sorted(level, key=lambda n: (level[n], order[n]))[: max_nodes or len(level)]
    count: dict[int, int] = {}
    for node in kept:
        count[level[node]] = count.get(level[node], 0) + 1
    seen: dict[int, int] = {}
    pos = {}
    for node in kept:  # the nodes of one level, stacked around y = 0
        k = seen[level[node]] = seen.get(level[node], -1) + 1
        pos[node] = (level[node], k - (count[level[node]] - 1) / 2)
    labelled = len(kept) <= 40
    depth, tall = max(count) + 1, max(count.values())
    width = min(16.0, max(6.0, depth * (0.62 if labelled else 0.15)))
    fig, (ax,) = _figure(1, width, 0.7 * tall + (2.2 if labelled else 1.6))
    inches_per_level = width / (depth + 3)

    by_id = {id(t): name for name, t in (names or {}).items()}
    hot_edges = []
    for a, b in graph.edges(root):
        if a in pos and b in pos:
            if highlight is not None and getattr(b, "variable", None) is highlight:
                hot_edges.append((a, b))  # drawn last, on top of every node and edge
                continue
            (xa, ya), (xb, yb) = pos[a], pos[b]
            ax.plot([xa, xb], [ya, yb], color="0.7", lw=0.7, zorder=1)
    for kind, (_, colour) in _KINDS.items():
        members = [n for n in kept if _node_kind(n) == kind]
        if members:
            ax.scatter(
                [pos[n][0] for n in members],
                [pos[n][1] for n in members],
                s=40 if labelled else 16,
                color=colour,
                label=f"{kind}: {len(members)}",
                zorder=2,
            )
    for (
        a,
        b,
    ) in hot_edges:  # one arc per use of the highlighted leaf, bowing above the graph so none hides another
        span = max(pos[b][0] - pos[a][0], 1) * inches_per_level  # the edge's length on the figure, inches
        bow = -min(4.0, max(0.08, 0.7 / span))  # a short edge bows relatively more: about 0.3 inch high
        ax.annotate(
            "",
            xy=pos[b],
            xytext=pos[a],
            zorder=4,
            annotation_clip=False,
            arrowprops=dict(
                arrowstyle="-|>",
                color="tab:red",
                lw=1.8,
                shrinkA=3,
                shrinkB=3,
                connectionstyle=f"arc3,rad={bow:.3f}",
            ),
        )
        ax.annotate(
            _short_type(a),
            pos[a],
            xytext=(0, -9),
            textcoords="offset points",
            fontsize=7,
            ha="center",
            va="top",
            color="tab:red",
            zorder=4,
        )
    for n in kept:
        leaf = getattr(n, "variable", None)
        if labelled or (leaf is not None and leaf is highlight):
            text = by_id.get(id(leaf), "leaf") if leaf is not None else _short_type(n)
            below = (
                labelled and pos[n][1] < 0
            )  # labels of the lower rows hang below them: no label crosses another
            lifted = not labelled  # the highlighted leaf's name sits above the arcs that point at it
            ax.annotate(
                text,
                pos[n],
                xytext=(2, -6 if below else 22 if lifted else 5),
                textcoords="offset points",
                fontsize=7,
                rotation=-35 if below else (35 if labelled else 0),
                rotation_mode="anchor",
                ha="left" if labelled else "right",
                va="top" if below else "bottom",
                color="tab:red" if leaf is not None and leaf is highlight else "black",
            )
    ax.set(
        xlabel="level = longest path from the root's grad_fn (backward runs left to right)",
        yticks=[],
        title=f"backward graph: {len(kept)} of {len(level)} nodes",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-tall / 2 - (1.2 if labelled else 0.3), tall / 2 + (1.2 if labelled else 0.8))
    ax.set_xlim(-0.5, depth + (2.5 if labelled else 0.5))
    ax.spines[["left", "right", "top"]].set_visible(False)
    fig.legend(loc="outside lower center", ncols=3, fontsize=7, frameon=False)
    return fig


# ----------------------------------------------------------------------------- Task3: effective updates


def token_weights(micro_tokens: list[int], weights: dict[str, list[float]]):
    """Left: supervised tokens per micro-batch. Right: one token's weight per micro-batch × the window's N.

    weights: normalization name -> per-micro-batch token weight (`supervision.token_weights`);
    scaled by N so the full batch's weight is 1 and a bar above 1 means the token counts extra.
    """
    fig, (ax_n, ax_w) = _figure(2)
    idx = list(range(len(micro_tokens)))
    ax_n.bar(idx, micro_tokens, color="tab:gray")
    ax_n.set(xlabel="micro-batch", ylabel="effective_tokens", title="supervised tokens", xticks=idx)
    total, width = sum(micro_tokens), 0.8 / max(1, len(weights))
    for k, (name, ws) in enumerate(weights.items()):
        ax_w.bar(
            [i + (k - (len(weights) - 1) / 2) * width for i in idx],
            [w * total for w in ws],
            width,
            label=name,
        )
    ax_w.axhline(1.0, color="black", lw=0.8, ls="--")
    ax_w.set(xlabel="micro-batch", ylabel="token weight × N", title="weight of one token", xticks=idx)
    ax_w.legend(fontsize=8)
    for ax in (ax_n, ax_w):
        ax.grid(alpha=0.3, axis="y")
    return fig


def _mark_skips(ax, skipped: list[int]) -> None:
    for i, a in enumerate(skipped):
        ax.axvspan(a - 0.4, a + 0.4, color="tab:red", alpha=0.15, label="skipped attempt" if i == 0 else None)


def precision_runs(losses: dict[str, list[float | None]], loss_scale: list[float], skipped: list[int]):
    """Left: the FP32 loss per update attempt. Middle: every other precision's loss minus FP32's (a delta
    plotted as a delta: on one loss axis the curves coincide). Right: the FP16 loss scale after each attempt."""
    fig, (ax_loss, ax_delta, ax_scale) = _figure(3, 3.6)
    reference = losses["fp32"]
    nan = float("nan")
    ax_loss.plot(
        range(len(reference)), [nan if y is None else y for y in reference], marker=".", color="tab:blue"
    )
    ax_loss.set(xlabel="update attempt", ylabel="FP32 token loss (nats)", title="loss per attempt")
    for name, ys in losses.items():
        if name != "fp32":
            ax_delta.plot(
                range(len(ys)),
                [nan if y is None or r is None else y - r for y, r in zip(ys, reference)],
                marker=".",
                label=f"{name} − fp32",
            )
    ax_delta.axhline(0.0, color="black", lw=0.8)
    ax_delta.set(xlabel="update attempt", ylabel="loss − FP32 loss (nats)", title="difference from FP32")
    ax_delta.legend(fontsize=7, loc="best")
    ax_scale.step(range(len(loss_scale)), loss_scale, where="post", color="tab:green")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set(xlabel="update attempt", ylabel="loss_scale", title="GradScaler scale")
    for ax in (ax_loss, ax_delta, ax_scale):
        _mark_skips(ax, skipped)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    return fig


def fp16_gradient_range(grads, *, scale: float, label: str):
    """Histogram of log2 |g| for the nonzero elements of `grads`, unscaled and × scale, against FP16's range.

    Shaded: below the smallest subnormal 2^-24 (rounds to 0), the subnormals [2^-24, 2^-14) (fewer
    mantissa bits), above the largest finite 65504 (overflows to inf).
    """
    import math

    import torch

    g = grads.detach().abs().double()
    g = g[g > 0]
    fig, (ax,) = _figure(1, 7.6, 3.4)
    shifted = math.log2(scale)
    lo, hi = math.floor(float(g.min().log2())), math.ceil(float(g.max().log2()) + shifted)
    bins = [lo - 1 + k * 0.5 for k in range(int(2 * (hi - lo + 3)))]
    # One float64 array per histogram: matplotlib reshapes a Python list element by element (seconds
    # for the ~10^6 gradient elements of a small model), an array at once; the values are the same.
    log2 = torch.log2(g).cpu().numpy()
    ax.hist(log2, bins=bins, alpha=0.6, label=label)
    ax.hist(log2 + shifted, bins=bins, alpha=0.6, label=f"{label} × loss_scale 2^{shifted:g}")
    ax.axvspan(bins[0], -24, color="tab:red", alpha=0.12, label="FP16: rounds to 0 (< 2^-24)")
    ax.axvspan(-24, -14, color="tab:orange", alpha=0.12, label="FP16: subnormal [2^-24, 2^-14)")
    ax.axvspan(
        math.log2(65504), max(bins[-1], 17), color="tab:purple", alpha=0.12, label="FP16: overflow (> 65504)"
    )
    ax.set(
        xlabel="log2 |gradient element|",
        ylabel="elements",
        title="gradient magnitudes against the FP16 range",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    ax.grid(alpha=0.3, axis="y")
    return fig


def wsd_clock(lrs: dict[str, list[float]], skipped: list[int]):
    """Learning rate per update attempt for several ways of stepping a WSD schedule; skips shaded.

    Later lines are drawn thinner, so a line that coincides with an earlier one stays visible on it.
    """
    fig, (ax,) = _figure(1, 8.4, 3.6)
    for i, (name, ys) in enumerate(lrs.items()):
        ax.plot(
            range(len(ys)), ys, marker=".", drawstyle="steps-post", lw=max(1.0, 4.0 - 1.2 * i), label=name
        )
    _mark_skips(ax, skipped)
    ax.set(xlabel="update attempt", ylabel="learning rate", title="WSD schedule against the update clock")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return fig


def update_dynamics(runs: dict[str, dict[str, list[float]]]):
    """Four panels over effective updates, one line per run: loss, gradient norm, clip coefficient, ‖Δθ‖.

    runs: name -> {"loss", "grad_norm", "clip_coef", "displacement"} lists of equal length.
    """
    fig, axes = _figure(4, 3.2, 2.8)
    panels = [
        ("loss", "token loss (nats)", "linear"),
        ("grad_norm", "‖g‖₂ before clipping", "log"),
        ("clip_coef", "clip coefficient", "linear"),
        ("displacement", "‖Δθ‖₂ per update", "log"),
    ]
    for ax, (key, label, scale) in zip(axes, panels):
        for name, series in runs.items():
            ax.plot(range(1, len(series[key]) + 1), series[key], marker=".", label=name)
        ax.set(xlabel="effective update", ylabel=label, yscale=scale)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside lower center",
        ncols=len(runs),
        fontsize=7,
        frameon=False,
    )
    return fig


def continual_pretrain(before: dict[str, float], after: dict[str, float]):
    """The change of token loss per evaluation set after continued pretraining: Δ = after − before, from 0.

    A delta drawn as a delta: the bars start at 0, below it the loss fell; each bar is labelled
    with its value, so no legend is needed.
    """
    fig, (ax,) = _figure(1, 4.6, 3.0)
    names = list(before)
    deltas = [after[n] - before[n] for n in names]
    bars = ax.bar(range(len(names)), deltas, 0.5, color=["tab:blue" if d < 0 else "tab:red" for d in deltas])
    ax.bar_label(bars, labels=[f"{d:+.2f}" for d in deltas], fontsize=8, padding=2)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set(
        xticks=list(range(len(names))),
        xticklabels=names,
        ylabel="Δ token loss (nats): after − before",
        title="continued pretraining: change per set",
    )
    low, high = min(0.0, *deltas), max(0.0, *deltas)
    ax.set_ylim(low - 0.2 * (high - low or 1), high + 0.2 * (high - low or 1))
    ax.grid(alpha=0.3, axis="y")
    return fig


# ----------------------------------------------------------------------------- Task4: the state ledger

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
    fig, (ax,) = _figure(1, 9.0, 0.9 + 0.24 * len(rows))
    for y, (_label, category, nbytes, created, consumed, released) in enumerate(rows):
        start, end = x[created] - 0.4, x[released] + 0.4
        ax.barh(y, end - start, left=start, height=0.7, color=CATEGORY_COLOURS[category], alpha=0.85)
        if consumed in x and consumed != released:
            ax.plot(x[consumed], y, "o", color="black", ms=3)
        ax.annotate(
            f"{nbytes / 2**10:,.0f} KiB",
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


def memory_timeline(
    live: list[int], phases: list[str], baseline: int, predicted: list[tuple[str, dict[str, int]]]
):
    """Top: measured live bytes after every allocation event, the ledger's phase maxima, the peaks marked.
    Bottom: the ledger's composition by category at every tick (stacked), the peak tick outlined.

    live, phases: a measured step (trainmech.measure.StepMemory.live / .phases; baseline = bytes
    alive before it); predicted: trainmech.ledger.Ledger.live().
    """
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9.0, 6.2), layout="constrained")
    plt.close(fig)
    mib = 2**20
    ys = [(baseline + v) / mib for v in live]
    top.plot(range(len(ys)), ys, lw=0.9, color="black", label="measured (tracked storages)")
    starts = {}
    for k, p in enumerate(phases):
        starts.setdefault(p, k)
    bounds = sorted(starts.items(), key=lambda kv: kv[1]) + [("end", len(phases))]
    by_phase: dict[str, float] = {}
    for tick, row in predicted:
        p = tick.split(":")[0]
        by_phase[p] = max(by_phase.get(p, 0.0), sum(row.values()) / mib)
    for (p, a), (_, b) in zip(bounds, bounds[1:]):
        top.axvline(a, color="0.85", lw=0.6)
        if p in by_phase:
            top.hlines(
                by_phase[p], a, b, colors="tab:green", lw=2, label="ledger, phase maximum" if a == 0 else None
            )
        top.annotate(
            p.replace("forward.", "f.").replace("backward.", "b."),
            ((a + b) / 2, 0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 2),
            textcoords="offset points",
            rotation=90,
            fontsize=6,
            ha="center",
            va="bottom",
            color="0.35",
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
    ticks_ = [t for t, _ in predicted]
    bottom_ = [0.0] * len(ticks_)
    for category, colour in CATEGORY_COLOURS.items():
        vals = [row[category] / mib for _, row in predicted]
        bottom.bar(range(len(ticks_)), vals, bottom=bottom_, color=colour, width=0.85, label=category)
        bottom_ = [a + b for a, b in zip(bottom_, vals)]
    peak = max(range(len(ticks_)), key=bottom_.__getitem__)
    bottom.bar(
        peak,
        bottom_[peak],
        width=0.95,
        fill=False,
        edgecolor="tab:red",
        lw=1.5,
        label=f"peak overlap: {ticks_[peak]}",
    )
    bottom.set_xticks(
        range(len(ticks_)),
        [t.replace("forward.", "f.").replace("backward.", "b.") for t in ticks_],
        rotation=75,
        ha="right",
        fontsize=6,
    )
    bottom.set(ylabel="bytes (MiB)", title="ledger: what is alive at each moment")
    bottom.set_ylim(0, max(bottom_) * 1.35)  # headroom: the legend sits above the tallest bar
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
    fig, (ax,) = _figure(1, 9.0, 3.6)
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
            label=name,
        )
    bottom.set(ylabel="held after the update (KiB)", xlabel="ZeRO stage (PyTorch's engine) × world size N")
    bottom.set_xticks(list(xs), [f"stage {r.stage}\nN={r.world_size}" for r in rows], fontsize=7)
    bottom.legend(fontsize=7, ncols=3, loc="upper right")
    bottom.set_ylim(0, max(r.held["optimizer_states"] for r in rows) / kib * 1.4)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    return fig


# ----------------------------------------------------------------------------- Task5: strategies


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
    fig, axes = _figure(len(runs), 3.6, 3.2)
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
        Patch(color=c, alpha=0.2, label=p)
        for p, c in (
            ("forward + loss", "tab:blue"),
            ("backward", "tab:orange"),
            ("update + zero_grad", "tab:gray"),
        )
    ]
    fig.legend(handles=shades, loc="outside lower center", ncols=3, fontsize=7, frameon=False)
    return fig


def saved_bytes_vs_length(lengths: list[int], series: dict[str, list[int]]):
    """Task2: bytes one attention op keeps for backward against the sequence length T (log–log),
    one line per implementation; dotted guides show slopes 1 (∝ T) and 2 (∝ T²)."""
    fig, (ax,) = _figure(1, 5.2, 3.4)
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
):
    """Relative error of every parameter's gradient against a reference (`against`: autograd in Task2, the
    reference run in Task6), one marker series per comparison (log scale, parameters listed top to bottom
    in model order, readable names). A series with a tolerance gets it as a dashed line of its colour, named
    in the legend; one without (a planted bug) is drawn as red crosses, so the gap between a rounding error
    and a wrong formula reads off one axis."""
    fig, (ax,) = _figure(1, 7.6, max(3.6, 0.2 * len(names) + 1.2))
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
    ax.set(
        xscale="log",
        xlabel=f"max|Δ| / max|{against}|  (dashed: each series' tolerance)",
        title=f"every parameter gradient vs {against}",
    )
    fig.legend(loc="outside lower center", ncols=min(len(errors) * 2, 4), fontsize=7, frameon=False)
    ax.grid(alpha=0.3, axis="x")
    return fig


def saved_bytes_by_op(rows: dict[str, tuple[int, int]]):
    """Task2: bytes one op keeps for backward, ours (hand-written saved dict) next to autograd's, per op
    (float32, parameters by reference excluded); each bar labelled with its bytes."""
    fig, (ax,) = _figure(1, 8.4, 3.6)
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
    fig, (ax,) = _figure(1, 7.6, 0.6 * len(rows) + 1.4)
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


# ----------------------------------------------------------------------------- Task6: correctness gates


def gate_matrix(rows: dict[str, list[bool | str | None]], gates: list[str]):
    """Candidates × stages: ✓ passed (green), ✗ failed (red), — "measured" (blue: the performance stage, no
    pass / fail), · not run because an earlier gate failed (grey), ○ "not measured" (white: a check of the
    gates only, the performance stage left out on purpose)."""
    from matplotlib.patches import Rectangle

    fig, (ax,) = _figure(1, 1.1 * len(gates) + 3.4, 0.36 * len(rows) + 0.9)
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
                color="dimgray" if passed in (None, "not measured") else "white",
                fontsize=10,
            )
    ax.set(xlim=(0, len(gates)), ylim=(len(rows), 0))
    ax.set_xticks([j + 0.5 for j in range(len(gates))], gates)
    ax.set_yticks([i + 0.5 for i in range(len(rows))], list(rows), fontsize=8)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return fig
