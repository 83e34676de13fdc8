"""Task0 and Task1's figures: the training loop's loss and displacement, the backward graph of a loss."""

from __future__ import annotations

import re

from matplotlib.ticker import MaxNLocator

from trainmech.plots.base import figure

__all__ = [
    "training_loop",
    "grad_fn_graph",
]


def training_loop(losses: list[float], displacements: list[float], held_out: list[float] | None = None):
    """Left: loss per effective update (0 = before any update). Right: ‖Δθ‖ of each update."""
    fig, (ax_loss, ax_move) = figure(2)
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
    fig, (ax,) = figure(1, width, 0.7 * tall + (2.2 if labelled else 1.6))
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
