"""What every figure module shares: the CJK font set up once, and one way to make a figure.

Importing `trainmech.plots` (any of its modules) configures an installed CJK font for Chinese text
(trainmech.fonts; `fonts.label(zh, en)` falls back to English where the machine has none, so a
figure never shows empty boxes). That is matplotlib's global rcParams, set here, once.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from trainmech import fonts

__all__ = ["figure"]

fonts.configure()  # hidden state: matplotlib's global font settings, on import


def figure(ncols: int, width: float = 4.2, height: float = 3.0):
    """A constrained-layout figure of `ncols` panels side by side, already closed in pyplot's registry
    (a notebook shows it once, as the cell's last expression); returns (fig, list of axes)."""
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), layout="constrained")
    plt.close(fig)
    return fig, (axes if ncols > 1 else [axes])
