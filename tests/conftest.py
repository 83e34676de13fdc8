"""Test-wide settings: records written while validating notebooks go to a throw-away folder."""

import os
import tempfile

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # nbval starts its kernels from this process, so they inherit the variable: executing a
    # committed notebook under test never writes into results/.
    scratch = tempfile.mkdtemp(prefix="trainmech-test-records-")
    os.environ["TRAINMECH_RESULTS_DIR"] = scratch
