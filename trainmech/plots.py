"""Figures for the notebooks: loss curves, lifecycle charts, memory timelines, schedules.

Each function returns a matplotlib Figure and closes it from pyplot's registry, so a notebook
shows it exactly once by making it the cell's last expression. Labels use the glossary's English
names (the code's vocabulary); the notebook's Chinese prose explains the picture.
"""

from __future__ import annotations

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
