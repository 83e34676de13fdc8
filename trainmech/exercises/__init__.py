"""Exercises (练习) at the end of every Task notebook, with instant checks.

    import trainmech.exercises
    trainmech.exercises.check("task2.rms_norm_backward", rms_norm_backward)

A check runs the learner's function on several inputs (float64, deliberately non-trivial: weights
off their init, repeated ids, unequal micro-batches, skipped updates) and compares it with what the
notebook compares against: autograd, the framework (torch.optim, transformers' scheduler), or a
measurement (the Task4 storage tracker). It answers in Chinese, one line per input that passed.
Three outcomes:

    unfilled stub (it raises NotImplementedError)  ->  prints "未完成：…" (fixed text), returns None
    correct                                        ->  prints "✓ …" lines and "通过", returns PASSED
    wrong                                          ->  prints which tensor / update / byte count is
                                                       off and by how much, names a known mistake it
                                                       matches, then raises checks.ClaimFailed

PASSED is truthy and displays nothing, so a passing check cell shows no `Out[n]`. A wrong answer
still raises (Run All stops there), but the notebook shows only the one-line summary under the
printed diagnosis, not the frames of this package. When the learner's function itself raises,
the diagnosis quotes the line of their code that raised. A function that modifies a tensor it
was given (in place) is wrong even when it returns the right values: the caller's tensors change.

Checks always run on the CPU, whatever RUN_MODE the notebook ran in, and never move the
notebook's random state (torch.random.fork_rng). Reference solutions are in trainmech.solutions;
a check never reads them.

Registration at import: importing this package imports task0 … task6, and each of them adds its
checks to `EXERCISES` (through `harness._exercise`), in notebook order. The checks' machinery
lives in `harness`, which the Task modules import; nothing else is registered or changed.
"""

from trainmech.exercises.harness import EXERCISES, PASSED, check

__all__ = ["check", "EXERCISES", "PASSED"]

# Each registers its checks into EXERCISES, in notebook order.
from trainmech.exercises import task0, task1, task2, task3, task4, task5, task6  # noqa: E402, F401
