"""Test-wide settings for every pytest run in this repository (unit tests and nbval alike).

Records written while validating notebooks go to a throw-away folder, never into results/.
When the notebooks ran in this session, their fresh records are compared with the committed
CPU reference at the end (the records regression, `trainmech.drift`): a number that moved
beyond its tolerance fails the run, naming the field, both values and the tolerance.
"""

import os
import tempfile

import pytest

RESULTS_ENV = "TRAINMECH_RESULTS_DIR"


def pytest_configure(config: pytest.Config) -> None:
    # nbval starts its kernels from this process, so they inherit the variable: executing a
    # committed notebook under test never writes into results/. Parallel workers inherit the
    # controller's folder, so all records of one session land together.
    if not os.environ.get(RESULTS_ENV):
        os.environ[RESULTS_ENV] = tempfile.mkdtemp(prefix="trainmech-test-records-")
    config._trainmech_records = os.environ[RESULTS_ENV]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # a parallel worker: the controller compares once, at the end
        return
    from trainmech import drift, results

    fresh = config._trainmech_records
    if not results.record_paths(fresh):
        return  # no notebook ran in this session
    drifts = drift.compare_runs(fresh, require_all=False)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.section("records regression (fresh notebook records vs results/cpu-reference)")
        n = len(results.record_paths(fresh))
        reporter.line(f"{n} record(s) compared; {len(drifts)} drift(s)")
        for d in drifts:
            reporter.line(f"DRIFT {d}", red=True)
    if drifts and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
