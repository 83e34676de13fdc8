"""The headless runner (trainmech.runner) on tiny throw-away notebooks: where a run's results go.

Runs execute in real kernels, so the tests share a few runs through module fixtures (each for
--jobs 1 and --jobs 2) and copy their result folders. Faults, refusals and signals: test_runner_faults.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from runner_notebooks import (
    LABEL,
    RECORDS,
    WRITE,
    leftovers,
    make_notebook,
    old_run,
    run,
    run_json,
    snapshot,
    three_notebooks,
    writer,
)

from trainmech import results, runner
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.package


_RUNS: dict = {}  # one run of each kind per --jobs, shared by the tests of this module


def three_notebook_run(tmp_path_factory, jobs: int) -> tuple:
    """A run of three notebooks (ok, with a real session / failed after writing its record / ok) over an
    earlier run of the label: (exit code, notebooks dir, results root, env var before, old label's bytes)."""
    if ("three", jobs) not in _RUNS:
        if "notebooks" not in _RUNS:  # the same notebook files for every run
            _RUNS["notebooks"] = three_notebooks(tmp_path_factory.mktemp("runner-notebooks"))
        notebooks = _RUNS["notebooks"]
        root = tmp_path_factory.mktemp(f"runner-jobs{jobs}") / "results"
        before = old_run(root / LABEL)
        env_before = os.environ.get("TRAINMECH_RESULTS_DIR")
        code = run(notebooks, root, overrides={"SEED": "3", "ONLY_HERE": "2"}, jobs=jobs)
        _RUNS["three", jobs] = code, notebooks, root, env_before, before
    return _RUNS["three", jobs]


def two_ok_run(tmp_path_factory, jobs: int) -> tuple:
    """A run of two notebooks that both succeed, over an earlier run and an earlier partial run of the
    label: (exit code, notebooks dir, results root)."""
    if ("ok", jobs) not in _RUNS:
        base = tmp_path_factory.mktemp(f"runner-ok-jobs{jobs}")
        notebooks = base / "notebooks"
        make_notebook(notebooks, "Task0_a", writer("Task0_a", "TRAIN-LOOP", "cpu-loop"))
        make_notebook(notebooks, "Task2_c", writer("Task2_c", "TRAIN-CHECKPOINT", "cpu-b2s128"))
        root = base / "results"
        old_run(root / LABEL)
        old_run(root / f"{LABEL}.partial")
        _RUNS["ok", jobs] = run(notebooks, root, jobs=jobs), notebooks, root
    return _RUNS["ok", jobs]


@pytest.fixture(scope="module", params=[1, 2], ids=["jobs1", "jobs2"])
def first_run(request, tmp_path_factory):
    return three_notebook_run(tmp_path_factory, request.param)


@pytest.fixture(scope="module", params=[1, 2], ids=["jobs1", "jobs2"])
def ok_run(request, tmp_path_factory):
    return two_ok_run(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def ok_run1(tmp_path_factory):
    """The --jobs 1 run of ok_run, for tests that start from it (--only runs one notebook: jobs do not matter)."""
    return two_ok_run(tmp_path_factory, 1)


# ---------------------------------------------------------------- a run with a failing notebook


def test_failing_notebook_gives_exit_code_1_and_leaves_the_label_as_it_was(first_run):
    code, _, root, _, before = first_run
    assert code == 1
    assert snapshot(root / LABEL) == before  # byte for byte
    assert sorted(p.name for p in root.iterdir()) == [LABEL, f"{LABEL}.partial"]


def test_every_notebook_ran_in_task_order_despite_the_failure(first_run):
    _, _, root, _, _ = first_run
    summary = run_json(root / f"{LABEL}.partial")
    assert [n["notebook"] for n in summary["notebooks"]] == ["Task0_a", "Task1_b", "Task2_c"]
    assert [n["status"] for n in summary["notebooks"]] == ["ok", "failed", "ok"]
    assert summary["status"] == "failed"
    assert (summary["run_label"], summary["run_mode"], summary["profile_id"]) == (LABEL, "cpu", "TRAIN-CPU")
    for n in summary["notebooks"]:
        assert isinstance(n["seconds"], (int, float)) and n["seconds"] > 0
        assert n["records"] == [RECORDS[n["notebook"]]]
    assert (root / f"{LABEL}.partial" / RECORDS["Task2_c"]).is_file()  # Task2 ran after Task1 failed


def test_failed_notebook_keeps_its_record_and_names_the_error_and_cell(first_run):
    _, _, root, _, _ = first_run
    partial = root / f"{LABEL}.partial"
    task1 = run_json(partial)["notebooks"][1]
    assert (partial / RECORDS["Task1_b"]).is_file()  # written before the failure: nothing lost
    error = task1["error"]
    assert error["ename"] == "RuntimeError"
    assert "boom in Task1" in error["evalue"]
    executed = nbformat.read(partial / "notebooks" / "Task1_b.ipynb", as_version=4)
    assert isinstance(error["cell"], int)
    assert "raise RuntimeError" in executed.cells[error["cell"]].source
    assert not executed.cells[error["cell"] + 1].get("outputs")  # execution stopped there
    for n in run_json(partial)["notebooks"]:
        if n["status"] == "ok":
            assert n["error"] is None


def test_executed_copies_carry_the_injected_parameters_and_no_timestamps(first_run):
    _, notebooks, root, _, _ = first_run
    copies = root / f"{LABEL}.partial" / "notebooks"
    assert sorted(p.name for p in copies.iterdir()) == ["Task0_a.ipynb", "Task1_b.ipynb", "Task2_c.ipynb"]
    for stem in RECORDS:
        nb = nbformat.read(copies / f"{stem}.ipynb", as_version=4)
        i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        injected = nb.cells[i + 1]
        assert injected.cell_type == "code"
        assert injected.metadata["tags"] == ["injected-parameters"] and injected.id == "injected-parameters"
        assert "RUN_LABEL = 'lbl'" in injected.source and "RUN_MODE = 'cpu'" in injected.source
        assert "SEED = 3" in injected.source
        assert ("ONLY_HERE = 2" in injected.source) == (stem == "Task1_b")  # only where the cell assigns it
        assert injected.get("execution_count") is not None  # it ran
        assert all("execution" not in c.metadata for c in nb.cells)  # no timestamps: re-runs diff cleanly
        original = nbformat.read(notebooks / f"{stem}.ipynb", as_version=4)
        assert len(nb.cells) == len(original.cells) + 1
        assert "injected-parameters" not in json.dumps(original)  # the source notebook is untouched
    entries = run_json(root / f"{LABEL}.partial")["notebooks"]
    assert [n["parameters"] for n in entries] == [{"SEED": 3}, {"SEED": 3, "ONLY_HERE": 2}, {"SEED": 3}]


def test_records_carry_the_injected_label_and_all_validate(first_run):
    _, _, root, _, _ = first_run
    partial = root / f"{LABEL}.partial"
    records, invalid = results.read_run(partial)
    assert invalid == {}
    assert sorted(r.filename for r in records) == sorted(RECORDS.values())
    for record in records:
        assert record.identity.run_label == LABEL  # the kernel saw RUN_LABEL = 'lbl', not 'local'
        assert record.workload.seed == 3
    env = next(r for r in records if r.identity.notebook == "Task0_a").environment  # a real session's
    assert env.intra_op_threads == 1 and env.cpu_capability and env.cpu and env.torch != "2"


def test_registry_and_provenance_are_written(first_run):
    _, _, root, _, _ = first_run
    partial = root / f"{LABEL}.partial"
    md = (partial / "REGISTRY.md").read_text(encoding="utf-8")
    assert f"`{LABEL}`" in md
    for e in results.experiments():
        assert f"| {e['semantic_id']} / " in md, e["semantic_id"]
    lines = {
        line.split(" / ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| TRAIN-")
    }
    assert "cpu-mechanism (cpu-loop)" in lines["TRAIN-LOOP"]
    assert "cpu-mechanism (cpu-loop)" in lines["TRAIN-LOCAL-BACKWARD"]  # the failed notebook's record counts
    assert "no record" in lines["TRAIN-OFFLOAD"]
    summary = run_json(partial)
    env = summary["environment"]
    assert env["intra_op_threads"] == 1 and env["cpu_capability"] and env["cpu"]
    assert set(env) == {"cpu", "cpu_capability", "blas", "onednn", "intra_op_threads", "numeric_env"}
    task0 = results.read_record(partial / RECORDS["Task0_a"]).environment
    assert {k: getattr(task0, k) for k in env if k != "numeric_env"} == {
        k: v for k, v in env.items() if k != "numeric_env"
    }
    assert summary["jobs"] in (1, 2)
    if sys.platform == "linux":  # peak RSS is read from /proc
        peaks = [n["peak_rss_bytes"] for n in summary["notebooks"]]
        assert all(isinstance(p, int) and p > 10 * 2**20 for p in peaks), peaks
        assert max(peaks) <= summary["peak_rss_sum_bytes"] <= sum(peaks)


def test_no_staging_or_lock_left_and_environment_restored(first_run):
    _, _, root, env_before, _ = first_run
    assert leftovers(root) == []
    assert os.environ.get("TRAINMECH_RESULTS_DIR") == env_before


def test_jobs_1_and_2_give_the_same_records_and_outputs(tmp_path_factory):
    (_, _, one, *_), (_, _, two, *_) = (
        three_notebook_run(tmp_path_factory, 1),
        three_notebook_run(tmp_path_factory, 2),
    )
    one, two = one / f"{LABEL}.partial", two / f"{LABEL}.partial"
    assert run_json(one)["jobs"] == 1 and run_json(two)["jobs"] == 2
    files = sorted(str(p.relative_to(one)) for p in one.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(two)) for p in two.rglob("*") if p.is_file())
    for name in files:  # records, executed notebooks, registry: byte for byte
        if name != "run.json":
            assert (one / name).read_bytes() == (two / name).read_bytes(), name

    def untimed(summary: dict) -> dict:
        drop = {"seconds", "started_at", "jobs", "peak_rss_sum_bytes", "peak_rss_bytes"}
        return {
            k: [untimed(n) for n in v] if k == "notebooks" else v for k, v in summary.items() if k not in drop
        }

    assert untimed(run_json(one)) == untimed(run_json(two))
    assert runner.compare_runs(one, two) == []


def test_relative_paths_are_taken_from_where_the_runner_starts(tmp_path, monkeypatch):
    make_notebook(tmp_path / "nbs", "Task0_a", writer("Task0_a", "TRAIN-LOOP", "cpu-loop"))
    monkeypatch.chdir(tmp_path)  # the kernel itself runs in the notebooks' folder
    assert run(Path("nbs"), Path("res")) == 0
    assert (tmp_path / "res" / LABEL / RECORDS["Task0_a"]).is_file() and not (
        tmp_path / "nbs" / "res"
    ).exists()


# ---------------------------------------------------------------- complete runs replace, --only merges


def test_a_complete_run_replaces_the_label_and_removes_the_partial_one(ok_run):
    code, _, root = ok_run
    assert code == 0
    folder = root / LABEL
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["REGISTRY.md", RECORDS["Task0_a"], RECORDS["Task2_c"], "notebooks", "run.json"]
    )  # the old record is gone
    assert sorted(p.name for p in root.iterdir()) == [LABEL]
    summary = run_json(folder)
    assert summary["status"] == "ok" and summary["only"] is None
    assert [n["notebook"] for n in summary["notebooks"]] == ["Task0_a", "Task2_c"]


@pytest.fixture
def ok_copy(ok_run1, tmp_path):
    """A copy of ok_run1's results to run into: (notebooks dir, results root, the label's bytes)."""
    _, notebooks, root = ok_run1
    copy = tmp_path / "results"
    shutil.copytree(root, copy)
    return notebooks, copy, snapshot(copy / LABEL)


def test_only_merges_into_the_label_and_keeps_the_other_notebooks(ok_copy):
    notebooks, copy, before = ok_copy
    assert run(notebooks, copy, only=["Task0"], overrides={"SEED": "7"}) == 0
    after = snapshot(copy / LABEL)
    for kept in (RECORDS["Task2_c"], "notebooks/Task2_c.ipynb"):
        assert after[kept] == before[kept]  # the other notebook's record and executed copy, byte for byte
    assert json.loads(after[RECORDS["Task0_a"]])["workload"]["seed"] == 7  # this notebook's, replaced
    summary = run_json(copy / LABEL)
    assert summary["only"] == ["Task0_a"] and summary["status"] == "ok"
    assert [(n["notebook"], n["parameters"]) for n in summary["notebooks"]] == [
        ("Task0_a", {"SEED": 7}),
        ("Task2_c", {}),
    ]
    md = (copy / LABEL / "REGISTRY.md").read_text(encoding="utf-8")
    assert "cpu-mechanism (cpu-b2s128)" in next(
        line for line in md.splitlines() if line.startswith("| TRAIN-CHECKPOINT")
    )
    assert leftovers(copy) == []


def test_a_failing_only_run_goes_to_partial_with_the_merged_view(ok_copy):
    notebooks, copy, before = ok_copy
    assert run(notebooks, copy, only=["Task0"], overrides={"FAIL": "True"}) == 1
    assert snapshot(copy / LABEL) == before
    partial = copy / f"{LABEL}.partial"
    assert sorted(n["status"] for n in run_json(partial)["notebooks"]) == ["failed", "ok"]
    assert (partial / RECORDS["Task2_c"]).read_bytes() == before[RECORDS["Task2_c"]]


def test_only_refuses_to_merge_into_another_mode_or_a_folder_without_run_json(tmp_path, ok_run1):
    _, notebooks, _ = ok_run1
    root = tmp_path / "results"
    before = old_run(root / LABEL, mode="TRAIN-CUDA-MECHANISM")
    with pytest.raises(TrainmechError, match="holds a 'TRAIN-CUDA-MECHANISM' run"):
        run(notebooks, root, only=["Task0"])
    (root / LABEL / "run.json").unlink()
    with pytest.raises(TrainmechError, match="no run.json to merge"):
        run(notebooks, root, only=["Task0"])
    (root / LABEL / "run.json").write_bytes(b"\xff\xfe")
    with pytest.raises(TrainmechError, match=f"run summary results/{LABEL}/run.json is not UTF-8"):
        run(notebooks, root, only=["Task0"])
    del before["run.json"]
    assert {k: v for k, v in snapshot(root / LABEL).items() if k != "run.json"} == before
    assert leftovers(root) == []


# ---------------------------------------------------------------- per-notebook failures stay per-notebook


def test_bad_parameters_cells_and_invalid_records_fail_only_their_notebook(tmp_path):
    notebooks = tmp_path / "notebooks"
    make_notebook(notebooks, "Task0_noparams", ["print(1)"], parameters=None)
    make_notebook(
        notebooks,
        "Task1_badrecord",
        [
            WRITE.format(notebook="Task1_badrecord"),
            'write("TRAIN-LOOP", "cpu-loop")\n'
            'd = Path(os.environ["TRAINMECH_RESULTS_DIR"])\n'
            '(d / "TRAIN-CHECKPOINT__bad.json").write_bytes(b"\\xff\\xfe")\n'
            '(d / "TRAIN-OFFLOAD__deep.json").write_text("[" * 100000 + "]" * 100000)',
        ],
    )
    make_notebook(
        notebooks,
        "Task2_otherlabel",
        [WRITE.format(notebook="Task2_otherlabel"), 'write("TRAIN-OFFLOAD", "x", "other")'],
    )
    make_notebook(
        notebooks, "Task3_fine", [WRITE.format(notebook="Task3_fine"), 'write("TRAIN-AMP-BACKWARD", "cpu")']
    )
    root = tmp_path / "results"
    assert run(notebooks, root) == 1
    partial = root / f"{LABEL}.partial"
    noparams, badrecord, otherlabel, fine = run_json(partial)["notebooks"]
    assert (
        noparams["status"] == "failed"
        and "parameters" in noparams["error"]["evalue"]
        and noparams["records"] == []
    )
    assert badrecord["status"] == "failed" and badrecord["error"]["ename"] == "InvalidRecord"
    assert "TRAIN-CHECKPOINT__bad.json is not UTF-8" in badrecord["error"]["evalue"]
    assert badrecord["records"] == [
        "TRAIN-CHECKPOINT__bad.json",
        "TRAIN-LOOP__cpu-loop.json",
        "TRAIN-OFFLOAD__deep.json",
    ]
    assert otherlabel["status"] == "failed" and "belongs to run 'other'" in otherlabel["error"]["evalue"]
    assert fine["status"] == "ok"
    md = (partial / "REGISTRY.md").read_text(encoding="utf-8")  # valid records count, invalid ones are listed
    assert "cpu-mechanism (cpu-loop)" in next(
        line for line in md.splitlines() if line.startswith("| TRAIN-LOOP")
    )
    assert "no record" in next(line for line in md.splitlines() if line.startswith("| TRAIN-CHECKPOINT"))
    assert (
        "`TRAIN-OFFLOAD__deep.json`: record TRAIN-OFFLOAD__deep.json is not readable JSON (nested too deeply)"
        in md
    )
    assert (
        "`TRAIN-OFFLOAD__x.json`" in md
        and (partial / "TRAIN-CHECKPOINT__bad.json").read_bytes() == b"\xff\xfe"
    )
    assert leftovers(root) == [] and not (root / LABEL).exists()


# ---------------------------------------------------------------- kernels on a bare Python (the GPU machine)


def test_kernels_run_this_interpreter_and_import_this_checkout_and_go_on_past_errors(tmp_path, monkeypatch):
    """No venv, no installed copy: the kernel is the runner's own interpreter and finds trainmech
    through the PYTHONPATH the runner gives it; allow_errors runs every cell and still fails the notebook."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    cells = [
        "import sys, trainmech\nprint(sys.executable)\nprint(trainmech.__file__)",
        'raise RuntimeError("first")',
        'print("after the error")',
    ]
    notebooks = tmp_path / "notebooks"
    make_notebook(notebooks, "Task0_probe", cells)
    code = runner.run(
        "cpu", LABEL, notebooks_dir=notebooks, results_root=tmp_path / "r", progress=False, allow_errors=True
    )
    partial = tmp_path / "r" / f"{LABEL}.partial"  # a failed notebook: the run is kept beside the label
    nb = nbformat.read(partial / "notebooks" / "Task0_probe.ipynb", as_version=4)
    executable, package = nb.cells[-3].outputs[0]["text"].split()
    assert Path(executable).resolve() == Path(sys.executable).resolve()
    assert Path(package).resolve() == (runner.REPO_ROOT / "trainmech" / "__init__.py").resolve()
    assert nb.cells[-1].outputs[0]["text"] == "after the error\n"
    assert code == 1 and run_json(partial)["notebooks"][0]["error"]["evalue"] == "first"
    assert "PYTHONPATH" not in os.environ


def test_a_clean_kernel_is_killed_at_the_end_and_a_failed_one_shut_down_gracefully(tmp_path):
    """After its last cell a kernel has written all it writes, so it is killed (the interpreter's teardown
    would only cost time); after a cell error it shuts down gracefully, so its exit handlers and finalizers
    still run (a temporary folder whose cleanup cell the notebook never reached)."""
    at_exit = "import atexit, pathlib\natexit.register(pathlib.Path({!r}).touch)"
    notebooks = tmp_path / "notebooks"
    make_notebook(notebooks, "Task0_clean", [at_exit.format(str(tmp_path / "clean-exited"))])
    make_notebook(
        notebooks,
        "Task1_fails",
        [at_exit.format(str(tmp_path / "failed-exited")), 'raise RuntimeError("boom")'],
    )
    assert run(notebooks, tmp_path / "results", jobs=2) == 1
    statuses = [n["status"] for n in run_json(tmp_path / "results" / f"{LABEL}.partial")["notebooks"]]
    assert statuses == ["ok", "failed"]
    assert (tmp_path / "failed-exited").exists() and not (tmp_path / "clean-exited").exists()


def test_a_run_keeps_each_notebooks_check_log(tmp_path):
    """Sessions log every check to <results>/checks/<notebook>.jsonl (trainmech.checks); a run keeps them
    beside the records, and --only keeps the other notebooks' logs."""
    notebooks = tmp_path / "notebooks"
    for stem in ("Task0_a", "Task1_b"):
        make_notebook(
            notebooks,
            stem,
            [
                "import os\nfrom pathlib import Path\n"
                "log = Path(os.environ['TRAINMECH_RESULTS_DIR']) / 'checks' / f'{NOTEBOOK}.jsonl'\n"
                "log.parent.mkdir(exist_ok=True)\nlog.write_text(f'{{\"seed\": {SEED}}}\\n')"
            ],
            parameters=f'RUN_MODE = "cpu"\nRUN_LABEL = "local"\nSEED = 0\nNOTEBOOK = {stem!r}',
        )
    root = tmp_path / "results"
    assert run(notebooks, root) == 0
    assert sorted(p.name for p in (root / LABEL / "checks").iterdir()) == ["Task0_a.jsonl", "Task1_b.jsonl"]
    assert run(notebooks, root, only=["Task1"], overrides={"SEED": "4"}) == 0
    logs = root / LABEL / "checks"
    assert (logs / "Task0_a.jsonl").read_text() == '{"seed": 0}\n' and (
        logs / "Task1_b.jsonl"
    ).read_text() == '{"seed": 4}\n'
