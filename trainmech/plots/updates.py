"""Task3's figures (effective updates): token weights, precision runs, FP16's range, the WSD clock,
update dynamics, continued pretraining.
"""

from __future__ import annotations

from matplotlib.ticker import MaxNLocator

from trainmech.plots.base import figure

__all__ = [
    "token_weights",
    "precision_runs",
    "fp16_gradient_range",
    "wsd_clock",
    "update_dynamics",
    "continual_pretrain",
]


def token_weights(micro_tokens: list[int], weights: dict[str, list[float]]):
    """Left: supervised tokens per micro-batch. Right: one token's weight per micro-batch × the window's N.

    weights: normalization name -> per-micro-batch token weight (`supervision.token_weights`);
    scaled by N so the full batch's weight is 1 and a bar above 1 means the token counts extra.
    """
    fig, (ax_n, ax_w) = figure(2)
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
    fig, (ax_loss, ax_delta, ax_scale) = figure(3, 3.6)
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
    fig, (ax,) = figure(1, 7.6, 3.4)
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
    fig, (ax,) = figure(1, 8.4, 3.6)
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
    fig, axes = figure(4, 3.2, 2.8)
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
    fig, (ax,) = figure(1, 4.6, 3.0)
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
