"""Figures for the notebooks: loss curves, lifecycle charts, memory timelines, schedules.

Each function returns a matplotlib Figure and closes it from pyplot's registry, so a notebook
shows it exactly once by making it the cell's last expression. Labels use the glossary's English
names (the code's vocabulary); the notebook's Chinese prose explains the picture. Importing this
package configures an installed CJK font for Chinese text (see `trainmech.plots.base`).

One module per Task group, every figure re-exported here as `trainmech.plots.<name>`:
`basics` (Task0–1), `backward` (Task2, and Task6's gradient errors), `updates` (Task3),
`ledger` (Task4), `strategies` (Task5 and Task6's gate matrix).
"""

from trainmech.plots.backward import activation_split, grad_errors, saved_bytes_by_op, saved_bytes_vs_length
from trainmech.plots.basics import grad_fn_graph, training_loop
from trainmech.plots.ledger import (
    CATEGORY_COLOURS,
    lifecycle_chart,
    memory_timeline,
    memory_viz_timeline,
    per_rank_bytes,
)
from trainmech.plots.strategies import gate_matrix, strategy_timelines
from trainmech.plots.updates import (
    continual_pretrain,
    fp16_gradient_range,
    precision_runs,
    token_weights,
    update_dynamics,
    wsd_clock,
)

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
