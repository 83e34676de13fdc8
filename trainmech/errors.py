"""The one exception type the package raises for bad input.

Every refusal is a `TrainmechError` whose message is one sentence: what is wrong and what is
valid. The command line prints that sentence and exits non-zero, without a traceback; a notebook
shows it with the line of the notebook that caused it, without the package's frames.
"""

import argparse
import sys

from trainmech.display import ShortTraceback

__all__ = ["TrainmechError", "OneLineParser"]


class TrainmechError(ShortTraceback, ValueError):
    """Bad input to trainmech: a wrong mode, label, profile, record or workload."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with the package's refusal style: a usage error is one `trainmech: error:` line, exit 2."""

    def error(self, message: str):
        print(f"trainmech: error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)
