"""Figures for the notebooks: loss curves, lifecycle charts, memory timelines, schedules.

Each function returns a matplotlib Figure and closes it from pyplot's registry, so a notebook
shows it exactly once by making it the cell's last expression. Labels use the glossary's English
names (the code's vocabulary); the notebook's Chinese prose explains the picture. Importing this
package configures an installed CJK font for Chinese text (see `trainmech.plots.base`).

One module per Task group, every figure re-exported here as `trainmech.plots.<name>`:
`basics` (Task0–1), `backward` (Task2, and Task6's gradient errors), `updates` (Task3),
`ledger` (Task4), `strategies` (Task5 and Task6's gate matrix).
"""

from trainmech.plots import backward, basics, ledger, strategies, updates
from trainmech.plots.backward import *  # noqa: F403  every figure re-exported: plots.<name>
from trainmech.plots.basics import *  # noqa: F403
from trainmech.plots.ledger import *  # noqa: F403
from trainmech.plots.strategies import *  # noqa: F403
from trainmech.plots.updates import *  # noqa: F403

__all__ = [*basics.__all__, *backward.__all__, *updates.__all__, *ledger.__all__, *strategies.__all__]
