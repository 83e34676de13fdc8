"""The one exception type the package raises for bad input.

Every refusal is a `TrainmechError` whose message is one sentence: what is wrong and what is
valid. The command line prints that sentence and exits non-zero, without a traceback; a notebook
shows it with the line of the notebook that caused it, without the package's frames.
"""

import argparse
import sys

from trainmech.display import ShortTraceback

__all__ = ["TrainmechError", "OneLineParser", "refuse"]


class TrainmechError(ShortTraceback, ValueError):
    """Bad input to trainmech: a wrong mode, label, profile, record or workload."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with the package's refusal style: a usage error is one `trainmech: error:` line, exit 2."""

    def error(self, message: str):
        sys.exit(refuse(message))


def refuse(error: TrainmechError | str) -> int:
    """Print a refusal as the command line does, one `trainmech: error:` line on stderr; returns exit code 2."""
    print(f"trainmech: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 2
