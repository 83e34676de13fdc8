"""The headless runner (trainmech.runner) on tiny throw-away notebooks.

Each notebook starts a session and writes a small record, as the real Task notebooks do. A run
executes them in Task order in real kernels, so these tests keep to few notebooks: one run of
three (ok / failed after writing its record / ok) shared by most tests, plus small reruns.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from trainmech import results, runner
from trainmech.errors import TrainmechError

LABEL = "lbl"
PARAMETERS = 'RUN_MODE = "cpu"\nRUN_LABEL = "local"'

START = """\
from trainmech.session import start
from trainmech import results
s = start(RUN_MODE, RUN_LABEL, page="t", notebook={notebook!r})

def write(semantic_id, workload_id):
    return results.write_record({{
        "identity": {{"semantic_id": semantic_id, "workload_id": workload_id, "run_label": s.run_label,
                      "page": "t", "notebook": s.notebook}},
        "workload": {{"model_id": "trainmech/qwen2-tiny", "model_weights": "random-init seed=0",
                      "tokenizer": "test", "input_shape": [1, 2], "effective_batch": {{"sequences": 1}},
                      "dtype": "float32", "seed": s.seed}},
        "environment": s.environment,
        "conclusion": {{"evidence_level": s.profile.evidence_level}},
    }}, s.results_dir)
"""

RECORDS = {
    "Task0_a": "TRAIN-LOOP__cpu-loop.json",
    "Task1_b": "TRAIN-LOCAL-BACKWARD__cpu-loop.json",
    "Task2_c": "TRAIN-CHECKPOINT__cpu-b2s128.json",
}


def make_notebook(folder: Path, stem: str, cells: list[str], *, parameters: bool = True) -> Path:
    nb = new_notebook()
    nb.cells.append(new_markdown_cell(f"# {stem}"))
    if parameters:
        nb.cells.append(new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]}))
    nb.cells += [new_code_cell(src) for src in cells]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.ipynb"
    nbformat.write(nb, path)
    return path


def three_notebooks(folder: Path) -> Path:
    make_notebook(folder, "Task0_a", [START.format(notebook="Task0_a"), 'write("TRAIN-LOOP", "cpu-loop")'])
    make_notebook(
        folder,
        "Task1_b",
        [
            START.format(notebook="Task1_b"),
            'write("TRAIN-LOCAL-BACKWARD", "cpu-loop")',
            'raise RuntimeError("boom in Task1")',
            'print("never reached")',
        ],
    )
    make_notebook(folder, "Task2_c", [START.format(notebook="Task2_c"), 'write("TRAIN-CHECKPOINT", "cpu-b2s128")'])
    (folder / "notes.ipynb").write_text("not a Task notebook", encoding="utf-8")  # ignored by discover
    return folder


def run_json(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text(encoding="utf-8"))


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".staging-", ".old-")))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One run of the three notebooks: (exit code, notebooks dir, results root, the env var before)."""
    base = tmp_path_factory.mktemp("runner")
    notebooks = three_notebooks(base / "notebooks")
    root = base / "results"
    env_before = os.environ.get("TRAINMECH_RESULTS_DIR")
    code = runner.run("cpu", LABEL, notebooks_dir=notebooks, results_root=root, progress=False)
    return code, notebooks, root, env_before


# ---------------------------------------------------------------- one run with a failing notebook


def test_failing_notebook_gives_exit_code_1(first_run):
    code, *_ = first_run
    assert code == 1


def test_every_notebook_ran_in_task_order_despite_the_failure(first_run):
    _, _, root, _ = first_run
    summary = run_json(root / LABEL)
    assert [n["notebook"] for n in summary["notebooks"]] == ["Task0_a", "Task1_b", "Task2_c"]
    assert [n["status"] for n in summary["notebooks"]] == ["ok", "failed", "ok"]
    assert summary["status"] == "failed"
    assert (summary["run_label"], summary["run_mode"], summary["profile_id"]) == (LABEL, "cpu", "TRAIN-CPU")
    for n in summary["notebooks"]:
        assert isinstance(n["seconds"], (int, float)) and n["seconds"] > 0
        assert n["records"] == [RECORDS[n["notebook"]]]
    assert (root / LABEL / RECORDS["Task2_c"]).is_file()  # Task2 ran after Task1 failed


def test_failed_notebook_keeps_its_record_and_names_the_error_and_cell(first_run):
    _, _, root, _ = first_run
    task1 = run_json(root / LABEL)["notebooks"][1]
    assert (root / LABEL / RECORDS["Task1_b"]).is_file()  # written before the failure: nothing lost
    error = task1["error"]
    assert error["ename"] == "RuntimeError"
    assert "boom in Task1" in error["evalue"]
    executed = nbformat.read(root / LABEL / "notebooks" / "Task1_b.ipynb", as_version=4)
    assert isinstance(error["cell"], int)
    assert "raise RuntimeError" in executed.cells[error["cell"]].source
    assert not executed.cells[error["cell"] + 1].get("outputs")  # execution stopped there
    for n in run_json(root / LABEL)["notebooks"]:
        if n["status"] == "ok":
            assert n["error"] is None


def test_executed_copies_carry_the_injected_parameters_after_the_parameters_cell(first_run):
    _, notebooks, root, _ = first_run
    copies = root / LABEL / "notebooks"
    assert sorted(p.name for p in copies.iterdir()) == ["Task0_a.ipynb", "Task1_b.ipynb", "Task2_c.ipynb"]
    for stem in RECORDS:
        nb = nbformat.read(copies / f"{stem}.ipynb", as_version=4)
        i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        injected = nb.cells[i + 1]
        assert injected.cell_type == "code"
        assert injected.metadata["tags"] == ["injected-parameters"]
        assert "RUN_LABEL = 'lbl'" in injected.source and "RUN_MODE = 'cpu'" in injected.source
        assert injected.get("execution_count") is not None  # it ran
        original = nbformat.read(notebooks / f"{stem}.ipynb", as_version=4)
        assert len(nb.cells) == len(original.cells) + 1
        assert "injected-parameters" not in json.dumps(original)  # the source notebook is untouched


def test_records_carry_the_injected_label_and_all_validate(first_run):
    _, _, root, _ = first_run
    paths = results.record_paths(root / LABEL)
    assert sorted(p.name for p in paths) == sorted(RECORDS.values())
    for path in paths:
        record = results.read_record(path)
        assert record.identity.run_label == LABEL  # the kernel saw RUN_LABEL = 'lbl', not 'local'
        assert record.environment.run_mode == "cpu"
        assert record.conclusion.evidence_level == "cpu-mechanism"


def test_registry_is_written_with_every_experiment(first_run):
    _, _, root, _ = first_run
    md = (root / LABEL / "REGISTRY.md").read_text(encoding="utf-8")
    assert f"`{LABEL}`" in md
    for e in results.experiments():
        assert f"| {e['semantic_id']} / " in md, e["semantic_id"]
    lines = {line.split(" / ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| TRAIN-")}
    assert "cpu-mechanism (cpu-loop)" in lines["TRAIN-LOOP"]
    assert "cpu-mechanism (cpu-loop)" in lines["TRAIN-LOCAL-BACKWARD"]  # the failed notebook's record counts
    assert "no record" in lines["TRAIN-OFFLOAD"]


def test_no_staging_left_and_environment_restored(first_run):
    _, _, root, env_before = first_run
    assert leftovers(root) == []
    assert sorted(p.name for p in root.iterdir()) == [LABEL]
    assert os.environ.get("TRAINMECH_RESULTS_DIR") == env_before


# ---------------------------------------------------------------- replacing and interrupting


def test_rerun_replaces_the_label_folder_as_a_whole(first_run, tmp_path):
    _, notebooks, root, _ = first_run
    copy = tmp_path / "results"
    shutil.copytree(root, copy)
    (copy / LABEL / "stale.txt").write_text("from the earlier run", encoding="utf-8")
    (copy / "other").mkdir()  # another label is left alone
    code = runner.run("cpu", LABEL, only=["Task0"], notebooks_dir=notebooks, results_root=copy, progress=False)
    assert code == 0
    folder = copy / LABEL
    assert sorted(p.name for p in folder.iterdir()) == ["REGISTRY.md", RECORDS["Task0_a"], "notebooks", "run.json"]
    assert [p.name for p in (folder / "notebooks").iterdir()] == ["Task0_a.ipynb"]
    summary = run_json(folder)
    assert summary["status"] == "ok"
    assert [n["notebook"] for n in summary["notebooks"]] == ["Task0_a"]
    assert "no record" in next(line for line in (folder / "REGISTRY.md").read_text(encoding="utf-8").splitlines()
                               if line.startswith("| TRAIN-LOCAL-BACKWARD"))
    assert leftovers(copy) == []
    assert (copy / "other").is_dir()


def test_interrupted_run_keeps_the_previous_results_whole(first_run, tmp_path, monkeypatch):
    _, notebooks, root, _ = first_run
    copy = tmp_path / "results"
    shutil.copytree(root, copy)
    before = snapshot(copy / LABEL)
    env_before = os.environ.get("TRAINMECH_RESULTS_DIR")
    calls = []

    def interrupted(path, out_path, params, timeout, *_):
        calls.append(path.name)
        staging = Path(os.environ["TRAINMECH_RESULTS_DIR"])
        (staging / "TRAIN-LOOP__half.json").write_text("{", encoding="utf-8")  # a half-done run
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "execute_notebook", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run("cpu", LABEL, notebooks_dir=notebooks, results_root=copy, progress=False)
    assert calls == ["Task0_a.ipynb"]
    assert snapshot(copy / LABEL) == before
    assert leftovers(copy) == []
    assert os.environ.get("TRAINMECH_RESULTS_DIR") == env_before


# ---------------------------------------------------------------- refusals before anything is written


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"only": ["Task9"]}, ["Task9", "Task0", "Task1", "Task2"]),
        ({"only": ["Task0", "Task7_x"]}, ["Task7_x"]),
        ({"run_mode": "gpu"}, ["gpu", "cpu", "TRAIN-CUDA-MECHANISM"]),
        ({"run_label": "../x"}, ["../x"]),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(first_run, tmp_path, kwargs, words):
    _, notebooks, _, _ = first_run
    root = tmp_path / "results"
    args = {"run_mode": "cpu", "run_label": LABEL, **kwargs}
    with pytest.raises(TrainmechError) as e:
        runner.run(args.pop("run_mode"), args.pop("run_label"), notebooks_dir=notebooks, results_root=root,
                   progress=False, **args)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)
    assert not root.exists() or not any(root.iterdir())


def test_cuda_mode_is_refused_without_cuda(first_run, tmp_path, monkeypatch):
    import torch

    _, notebooks, _, _ = first_run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TrainmechError, match="CUDA"):
        runner.run("TRAIN-CUDA-MECHANISM", LABEL, notebooks_dir=notebooks, results_root=tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


def test_empty_notebooks_folder_is_refused(tmp_path):
    (tmp_path / "nb").mkdir()
    with pytest.raises(TrainmechError, match="no Task notebooks"):
        runner.run("cpu", LABEL, notebooks_dir=tmp_path / "nb", results_root=tmp_path / "r", progress=False)


def test_discover_orders_by_task_number_and_filters(tmp_path):
    for stem in ("Task10_j", "Task2_c", "Task1_b", "Task1_bb"):
        make_notebook(tmp_path, stem, [])
    (tmp_path / "Task3-bad-name.ipynb").write_text("{}", encoding="utf-8")
    assert [p.stem for p in runner.discover(tmp_path)] == ["Task1_b", "Task1_bb", "Task2_c", "Task10_j"]
    assert [p.stem for p in runner.discover(tmp_path, ["Task1"])] == ["Task1_b", "Task1_bb"]
    assert [p.stem for p in runner.discover(tmp_path, ["Task1_bb.ipynb", "Task10"])] == ["Task1_bb", "Task10_j"]


def test_inject_parameters_places_the_cell_after_the_parameters_cell(tmp_path):
    path = make_notebook(tmp_path, "Task0_x", ["x = 1"])
    nb = runner.inject_parameters(nbformat.read(path, as_version=4), {"RUN_LABEL": "a", "SEQ": 64})
    assert [c.metadata.get("tags", []) for c in nb.cells[1:3]] == [["parameters"], ["injected-parameters"]]
    assert "RUN_LABEL = 'a'\nSEQ = 64\n" in nb.cells[2].source
    with pytest.raises(TrainmechError, match="parameters"):
        runner.inject_parameters(nbformat.read(make_notebook(tmp_path, "Task1_y", ["x = 1"], parameters=False),
                                               as_version=4), {})


# ---------------------------------------------------------------- per-notebook failures stay per-notebook


def test_missing_parameters_cell_and_malformed_record_fail_only_their_notebook(tmp_path):
    notebooks = tmp_path / "notebooks"
    make_notebook(notebooks, "Task0_noparams", [START.format(notebook="Task0_noparams")], parameters=False)
    make_notebook(
        notebooks,
        "Task1_badrecord",
        [
            START.format(notebook="Task1_badrecord"),
            'write("TRAIN-LOOP", "cpu-loop")\n'
            '(s.results_dir / "TRAIN-CHECKPOINT__bad.json").write_text(\'{"identity": {}}\', encoding="utf-8")',
        ],
    )
    root = tmp_path / "results"
    code = runner.run("cpu", LABEL, notebooks_dir=notebooks, results_root=root, progress=False)
    assert code == 1
    summary = run_json(root / LABEL)
    noparams, badrecord = summary["notebooks"]
    assert noparams["notebook"] == "Task0_noparams" and noparams["status"] == "failed"
    assert "parameters" in noparams["error"]["evalue"]
    assert noparams["records"] == []
    assert badrecord["status"] == "failed"
    assert badrecord["error"]["ename"] == "InvalidRecord"
    assert "TRAIN-CHECKPOINT__bad.json" in badrecord["error"]["evalue"]
    assert sorted(badrecord["records"]) == ["TRAIN-CHECKPOINT__bad.json", "TRAIN-LOOP__cpu-loop.json"]
    md = (root / LABEL / "REGISTRY.md").read_text(encoding="utf-8")  # the valid record still counts
    assert "cpu-mechanism (cpu-loop)" in next(line for line in md.splitlines() if line.startswith("| TRAIN-LOOP"))
    assert "no record" in next(line for line in md.splitlines() if line.startswith("| TRAIN-CHECKPOINT"))
    assert leftovers(root) == []


# ---------------------------------------------------------------- kernels on a bare Python (the GPU machine)


def test_kernels_run_this_interpreter_and_import_this_checkout_and_go_on_past_errors(tmp_path, monkeypatch):
    """No venv, no installed copy: the kernel is the runner's own interpreter and finds trainmech
    through the PYTHONPATH the runner gives it; allow_errors runs every cell and still fails the notebook."""
    import sys

    monkeypatch.delenv("PYTHONPATH", raising=False)
    cells = ["import sys, trainmech\nprint(sys.executable)\nprint(trainmech.__file__)",
             'raise RuntimeError("first")', 'print("after the error")']
    notebooks = tmp_path / "notebooks"
    make_notebook(notebooks, "Task0_probe", cells)
    code = runner.run("cpu", LABEL, notebooks_dir=notebooks, results_root=tmp_path / "r", progress=False, allow_errors=True)
    nb = nbformat.read(tmp_path / "r" / LABEL / "notebooks" / "Task0_probe.ipynb", as_version=4)
    executable, package = nb.cells[-3].outputs[0]["text"].split()
    assert Path(executable).resolve() == Path(sys.executable).resolve()
    assert Path(package).resolve() == (runner.REPO_ROOT / "trainmech" / "__init__.py").resolve()
    assert nb.cells[-1].outputs[0]["text"] == "after the error\n"
    assert code == 1 and run_json(tmp_path / "r" / LABEL)["notebooks"][0]["error"]["evalue"] == "first"
    assert "PYTHONPATH" not in os.environ
