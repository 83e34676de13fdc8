"""Test-wide settings for every pytest run in this repository (unit tests and nbval alike).

Records written while validating notebooks go to a throw-away folder, never into results/.
"""

import os
import tempfile

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # nbval starts its kernels from this process, so they inherit the variable: executing a
    # committed notebook under test never writes into results/.
    scratch = tempfile.mkdtemp(prefix="trainmech-test-records-")
    os.environ["TRAINMECH_RESULTS_DIR"] = scratch
