"""The one exception type the package raises for bad input.

Every refusal is a `TrainmechError` whose message is one sentence: what is wrong and what is
valid. The command line prints that sentence and exits non-zero, without a traceback.
"""


class TrainmechError(ValueError):
    """Bad input to trainmech: a wrong mode, label, profile, record or workload."""
