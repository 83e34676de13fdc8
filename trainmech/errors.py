"""The one exception type the package raises for bad input.

Every refusal is a `TrainmechError` whose message is one sentence: what is wrong and what is
valid. The command line prints that sentence and exits non-zero, without a traceback; a notebook
shows it with the line of the notebook that caused it, without the package's frames.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from trainmech.display import ShortTraceback

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = ["TrainmechError", "OneLineParser", "refuse", "no_cuda", "first_validation_error"]


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


def no_cuda(what: str, instead: str) -> TrainmechError:
    """The one refusal for a CUDA-only path on a machine whose torch sees no GPU (session, runner,
    gpu-check): `what` needs it (e.g. "run mode cuda"), `instead` says what is valid here."""
    import torch

    return TrainmechError(
        f"{what} needs a CUDA GPU, but torch {torch.__version__} sees none on this machine; {instead}"
    )


def first_validation_error(e: ValidationError, whole: str) -> str:
    """pydantic's first error as one line, without its input dump and URL: 'where: what (n error(s) in
    all)'; `where` is the field's dotted path, or `whole` (e.g. "record") for the object itself."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or whole
    return " ".join(f"{where}: {err['msg']} ({len(e.errors())} error(s) in all)".split())
