"""Figures for the notebooks: loss curves, lifecycle charts, memory timelines, schedules.

Each function returns a matplotlib Figure and closes it from pyplot's registry, so a notebook
shows it exactly once by making it the cell's last expression. Labels use the glossary's English
names (the code's vocabulary); the notebook's Chinese prose explains the picture.
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt


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
    "view / layout": (("View", "T", "Transpose", "Reshape", "Slice", "Cat", "Alias", "Expand", "Permute",
                       "Select", "Squeeze", "Unsqueeze", "Clone"), "tab:gray"),
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
    fig, (ax,) = _figure(1, min(16.0, max(6.0, depth * (0.62 if labelled else 0.15))), 0.7 * tall + (2.2 if labelled else 1.6))

    by_id = {id(t): name for name, t in (names or {}).items()}
    for a, b in graph.edges(root):
        if a in pos and b in pos:
            hot = highlight is not None and getattr(b, "variable", None) is highlight
            (xa, ya), (xb, yb) = pos[a], pos[b]
            ax.plot([xa, xb], [ya, yb], color="tab:red" if hot else "0.7", lw=1.8 if hot else 0.7, zorder=1)
    for kind, (_, colour) in _KINDS.items():
        members = [n for n in kept if _node_kind(n) == kind]
        if members:
            ax.scatter([pos[n][0] for n in members], [pos[n][1] for n in members], s=40 if labelled else 16,
                       color=colour, label=f"{kind}: {len(members)}", zorder=2)
    for n in kept:
        leaf = getattr(n, "variable", None)
        if labelled or (leaf is not None and leaf is highlight):
            text = by_id.get(id(leaf), "leaf") if leaf is not None else _short_type(n)
            ax.annotate(text, pos[n], xytext=(2, 5), textcoords="offset points", fontsize=7,
                        rotation=30 if labelled else 0, ha="left" if labelled else "right", va="bottom",
                        color="tab:red" if leaf is not None and leaf is highlight else "black")
    ax.set(xlabel="level = longest path from the root's grad_fn (backward runs left to right)", yticks=[],
           title=f"backward graph: {len(kept)} of {len(level)} nodes")
    ax.set_ylim(-tall / 2, tall / 2 + (0.9 if labelled else 0.3))
    ax.set_xlim(-0.5, depth + (1.5 if labelled else 0.5))
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
        ax_w.bar([i + (k - (len(weights) - 1) / 2) * width for i in idx], [w * total for w in ws], width, label=name)
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
    """Left: loss per update attempt for each precision. Right: the FP16 loss scale after each attempt."""
    fig, (ax_loss, ax_scale) = _figure(2)
    for name, ys in losses.items():
        ax_loss.plot(range(len(ys)), [float("nan") if y is None else y for y in ys], marker=".", label=name)
    _mark_skips(ax_loss, skipped)
    ax_loss.set(xlabel="update attempt", ylabel="token loss (nats)", title="loss per attempt")
    ax_loss.legend(fontsize=8)
    ax_scale.step(range(len(loss_scale)), loss_scale, where="post", color="tab:green")
    _mark_skips(ax_scale, skipped)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set(xlabel="update attempt", ylabel="loss_scale", title="GradScaler scale")
    for ax in (ax_loss, ax_scale):
        ax.grid(alpha=0.3)
    return fig


def wsd_clock(lrs: dict[str, list[float]], skipped: list[int], boundaries: dict[str, int] | None = None):
    """Learning rate per update attempt for several ways of stepping a WSD schedule; skips shaded.

    boundaries: phase name -> first effective update of that phase, drawn as dotted lines on the
    clock-driven curve's axis (effective updates, not attempts).
    """
    fig, (ax,) = _figure(1, 8.4, 3.4)
    for name, ys in lrs.items():
        ax.plot(range(len(ys)), ys, marker=".", drawstyle="steps-post", label=name)
    _mark_skips(ax, skipped)
    for name, step in (boundaries or {}).items():
        ax.annotate(name, (step, 0), xytext=(0, 4), textcoords="offset points", fontsize=7, color="0.4")
    ax.set(xlabel="update attempt", ylabel="learning rate", title="WSD schedule against the update clock")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def update_dynamics(runs: dict[str, dict[str, list[float]]]):
    """Four panels over effective updates, one line per run: loss, gradient norm, clip coefficient, ‖Δθ‖.

    runs: name -> {"loss", "grad_norm", "clip_coef", "displacement"} lists of equal length.
    """
    fig, axes = _figure(4, 3.2, 2.8)
    panels = [("loss", "token loss (nats)", "linear"), ("grad_norm", "‖g‖₂ before clipping", "log"),
              ("clip_coef", "clip coefficient", "linear"), ("displacement", "‖Δθ‖₂ per update", "log")]
    for ax, (key, label, scale) in zip(axes, panels):
        for name, series in runs.items():
            ax.plot(range(1, len(series[key]) + 1), series[key], marker=".", label=name)
        ax.set(xlabel="effective update", ylabel=label, yscale=scale)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return fig


def continual_pretrain(before: dict[str, float], after: dict[str, float]):
    """Token loss per evaluation set before and after continued pretraining (grouped bars)."""
    fig, (ax,) = _figure(1, 4.6, 3.0)
    names = list(before)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [before[n] for n in names], 0.4, label="0 updates")
    ax.bar([x + 0.2 for x in xs], [after[n] for n in names], 0.4, label="after domain updates")
    ax.set(xticks=list(xs), xticklabels=names, ylabel="token loss (nats)", title="domain vs retention")
    ax.set_ylim(min(min(before.values()), min(after.values())) * 0.95, None)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fig
