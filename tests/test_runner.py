"""The headless runner (trainmech.runner) on tiny throw-away notebooks.

Most notebooks here write their records with `trainmech.results` alone (a kernel that imports
torch takes seconds), as the real Task notebooks do through their session. Runs execute in real
kernels, so the tests share a few runs through module fixtures and copy their result folders.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from trainmech import results, runfolder, runner
from trainmech.errors import TrainmechError

LABEL = "lbl"
PARAMETERS = 'RUN_MODE = "cpu"\nRUN_LABEL = "local"\nSEED = 0\nFAIL = False'

WRITE = """\
import os
from pathlib import Path
from trainmech import results

def write(semantic_id, workload_id, label=None):
    return results.write_record({{
        "identity": {{"semantic_id": semantic_id, "workload_id": workload_id, "run_label": label or RUN_LABEL,
                      "page": "t", "notebook": {notebook!r}}},
        "workload": {{"model_id": "trainmech/qwen2-tiny", "model_weights": "random-init seed=0",
                      "tokenizer": "test", "input_shape": [1, 2], "effective_batch": {{"sequences": 1}},
                      "dtype": "float32", "seed": SEED}},
        "environment": {{"profile_id": "TRAIN-CPU", "run_mode": RUN_MODE, "python": "3", "torch": "2",
                         "transformers": "5", "accelerate": None, "cuda": None, "gpu": None,
                         "gpu_memory_bytes": None, "device": "cpu"}},
        "conclusion": {{"evidence_level": "cpu-mechanism"}},
    }}, Path(os.environ["TRAINMECH_RESULTS_DIR"]))
"""

RECORDS = {
    "Task0_a": "TRAIN-LOOP__cpu-loop.json",
    "Task1_b": "TRAIN-LOCAL-BACKWARD__cpu-loop.json",
    "Task2_c": "TRAIN-CHECKPOINT__cpu-b2s128.json",
}


def make_notebook(folder: Path, stem: str, cells: list[str], *, parameters: str | None = PARAMETERS) -> Path:
    nb = new_notebook()
    nb.cells.append(new_markdown_cell(f"# {stem}"))
    if parameters is not None:
        nb.cells.append(new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    nb.cells += [new_code_cell(src) for src in cells]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.ipynb"
    nbformat.write(nb, path)
    return path


def writer(stem: str, semantic_id: str, workload_id: str) -> list[str]:
    """Cells that write one record, then fail when FAIL is set."""
    return [WRITE.format(notebook=stem), f'write("{semantic_id}", "{workload_id}")\nprint("seed", SEED)',
            'if FAIL:\n    raise RuntimeError("asked to fail")']


def three_notebooks(folder: Path) -> Path:
    make_notebook(folder, "Task0_a", writer("Task0_a", "TRAIN-LOOP", "cpu-loop"))
    make_notebook(folder, "Task1_b", [*writer("Task1_b", "TRAIN-LOCAL-BACKWARD", "cpu-loop")[:2],
                                      'raise RuntimeError("boom in Task1")', 'print("never reached")'],
                  parameters='RUN_MODE = "cpu"\nRUN_LABEL = "local"\nSEED = 0\nONLY_HERE = 1')
    make_notebook(folder, "Task2_c", writer("Task2_c", "TRAIN-CHECKPOINT", "cpu-b2s128"))
    (folder / "notes.ipynb").write_text("not a Task notebook", encoding="utf-8")  # ignored by discover
    return folder


def run_json(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text(encoding="utf-8"))


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".staging-", ".old-", ".lock-")))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def old_run(folder: Path, *, mode: str = "cpu") -> dict[str, bytes]:
    """An earlier complete run of the label, as a run leaves it; returns its bytes."""
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"run_label": folder.name, "run_mode": mode, "status": "ok", "notebooks": [
        {"notebook": "Task0_a", "status": "ok", "seconds": 1.0, "records": ["TRAIN-LOOP__old.json"], "error": None}]}),
        encoding="utf-8")
    (folder / "TRAIN-LOOP__old.json").write_text('{"old": true}', encoding="utf-8")
    (folder / "REGISTRY.md").write_text("# old\n", encoding="utf-8")
    (folder / "notebooks").mkdir()
    (folder / "notebooks" / "Task0_a.ipynb").write_text("{}", encoding="utf-8")
    return snapshot(folder)


def run(notebooks: Path, root: Path, label: str = LABEL, **kwargs) -> int:
    return runner.run("cpu", label, notebooks_dir=notebooks, results_root=root, progress=False, **kwargs)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One run of three notebooks (ok / failed after writing its record / ok) over an earlier run of the label."""
    base = tmp_path_factory.mktemp("runner")
    notebooks = three_notebooks(base / "notebooks")
    root = base / "results"
    before = old_run(root / LABEL)
    env_before = os.environ.get("TRAINMECH_RESULTS_DIR")
    code = run(notebooks, root, overrides={"SEED": "3", "ONLY_HERE": "2"})
    return code, notebooks, root, env_before, before


@pytest.fixture(scope="module")
def ok_run(tmp_path_factory):
    """A run of two notebooks that both succeed, over an earlier run and an earlier partial run of the label."""
    base = tmp_path_factory.mktemp("runner-ok")
    notebooks = base / "notebooks"
    make_notebook(notebooks, "Task0_a", writer("Task0_a", "TRAIN-LOOP", "cpu-loop"))
    make_notebook(notebooks, "Task2_c", writer("Task2_c", "TRAIN-CHECKPOINT", "cpu-b2s128"))
    root = base / "results"
    old_run(root / LABEL)
    old_run(root / f"{LABEL}.partial")
    code = run(notebooks, root)
    return code, notebooks, root


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
        assert injected.metadata["tags"] == ["injected-parameters"]
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


def test_registry_and_provenance_are_written(first_run):
    _, _, root, _, _ = first_run
    partial = root / f"{LABEL}.partial"
    md = (partial / "REGISTRY.md").read_text(encoding="utf-8")
    assert f"`{LABEL}`" in md
    for e in results.experiments():
        assert f"| {e['semantic_id']} / " in md, e["semantic_id"]
    lines = {line.split(" / ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| TRAIN-")}
    assert "cpu-mechanism (cpu-loop)" in lines["TRAIN-LOOP"]
    assert "cpu-mechanism (cpu-loop)" in lines["TRAIN-LOCAL-BACKWARD"]  # the failed notebook's record counts
    assert "no record" in lines["TRAIN-OFFLOAD"]
    env = run_json(partial)["environment"]
    assert env["intra_op_threads"] == 1 and env["cpu_capability"] and env["cpu"]
    assert set(env) == {"cpu", "cpu_capability", "blas", "onednn", "intra_op_threads", "numeric_env"}


def test_no_staging_or_lock_left_and_environment_restored(first_run):
    _, _, root, env_before, _ = first_run
    assert leftovers(root) == []
    assert os.environ.get("TRAINMECH_RESULTS_DIR") == env_before


# ---------------------------------------------------------------- complete runs replace, --only merges


def test_a_complete_run_replaces_the_label_and_removes_the_partial_one(ok_run):
    code, _, root = ok_run
    assert code == 0
    folder = root / LABEL
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["REGISTRY.md", RECORDS["Task0_a"], RECORDS["Task2_c"], "notebooks", "run.json"])  # the old record is gone
    assert sorted(p.name for p in root.iterdir()) == [LABEL]
    summary = run_json(folder)
    assert summary["status"] == "ok" and summary["only"] is None
    assert [n["notebook"] for n in summary["notebooks"]] == ["Task0_a", "Task2_c"]


def test_only_merges_into_the_label_and_keeps_the_other_notebooks(ok_run, tmp_path):
    _, notebooks, root = ok_run
    copy = tmp_path / "results"
    shutil.copytree(root, copy)
    before = snapshot(copy / LABEL)
    assert run(notebooks, copy, only=["Task0"], overrides={"SEED": "7"}) == 0
    after = snapshot(copy / LABEL)
    for kept in (RECORDS["Task2_c"], "notebooks/Task2_c.ipynb"):
        assert after[kept] == before[kept]  # the other notebook's record and executed copy, byte for byte
    assert json.loads(after[RECORDS["Task0_a"]])["workload"]["seed"] == 7  # this notebook's, replaced
    summary = run_json(copy / LABEL)
    assert summary["only"] == ["Task0_a"] and summary["status"] == "ok"
    assert [(n["notebook"], n["parameters"]) for n in summary["notebooks"]] == [("Task0_a", {"SEED": 7}), ("Task2_c", {})]
    md = (copy / LABEL / "REGISTRY.md").read_text(encoding="utf-8")
    assert "cpu-mechanism (cpu-b2s128)" in next(line for line in md.splitlines() if line.startswith("| TRAIN-CHECKPOINT"))
    assert leftovers(copy) == []


def test_a_failing_only_run_goes_to_partial_with_the_merged_view(ok_run, tmp_path):
    _, notebooks, root = ok_run
    copy = tmp_path / "results"
    shutil.copytree(root, copy)
    before = snapshot(copy / LABEL)
    assert run(notebooks, copy, only=["Task0"], overrides={"FAIL": "True"}) == 1
    assert snapshot(copy / LABEL) == before
    partial = copy / f"{LABEL}.partial"
    assert sorted(n["status"] for n in run_json(partial)["notebooks"]) == ["failed", "ok"]
    assert (partial / RECORDS["Task2_c"]).read_bytes() == before[RECORDS["Task2_c"]]


def test_only_refuses_to_merge_into_another_mode_or_a_folder_without_run_json(tmp_path, ok_run):
    _, notebooks, _ = ok_run
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


# ---------------------------------------------------------------- refusals before anything is written


NOTEBOOKS_FOR_REFUSALS = {
    "Task0_a": 'RUN_MODE = "cpu"\nRUN_LABEL = "local"\nSEED = 0\nLR = 1e-2\nWORKLOAD = None\nSKIP_AT = (2, 9)\n'
               'NAME = "x"\nFLAG = False\nCOMPUTED = 2 ** 10',
    "Task1_b": 'RUN_MODE = "cpu"\nRUN_LABEL = "local"\nSEED = 0',
}


@pytest.fixture(scope="module")
def refusal_notebooks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refusals")
    for stem, params in NOTEBOOKS_FOR_REFUSALS.items():
        make_notebook(folder, stem, ['raise SystemExit("must never run")'], parameters=params)
    return folder


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"only": ["Task9"]}, ["Task9", "Task0", "Task1"]),
        ({"only": ["Task0", "Task7_x"]}, ["Task7_x"]),
        ({"run_mode": "gpu"}, ["gpu", "cpu", "TRAIN-CUDA-MECHANISM"]),
        ({"run_label": "../x"}, ["../x"]),
        ({"run_label": "x" * 250}, ["1 to 100"]),
        ({"run_label": "record.schema.json"}, ["results/record.schema.json", "not a run folder"]),
        ({"run_label": "own"}, ["results/own", "mine.txt"]),
        ({"run_label": "lbl.partial"}, [".partial", "incomplete"]),
        ({"timeout": float("nan")}, ["--timeout", "nan"]),
        ({"timeout": float("inf")}, ["--timeout", "inf"]),
        ({"timeout": -5}, ["--timeout", "-5"]),
        ({"timeout": 0}, ["--timeout"]),
        ({"overrides": {"SEQ": "64"}}, ["SEQ", "no notebook", "SEED", "LR"]),
        ({"overrides": {"class": "1"}}, ["'class'", "NAME=VALUE"]),
        ({"overrides": {"print": "None"}}, ["print", "no notebook"]),
        ({"overrides": {"RUN_LABEL": "other"}}, ["RUN_LABEL", "--label"]),
        ({"overrides": {"RUN_MODE": "cpu"}}, ["RUN_MODE", "--mode"]),
        ({"overrides": {"SEED": "1e999"}}, ["SEED", "inf", "finite"]),
        ({"overrides": {"LR": "1e999"}}, ["LR", "inf", "finite"]),
        ({"overrides": {"SEED": "abc"}}, ["SEED", "not a Python literal", "integer"]),
        ({"overrides": {"SEED": "1.5"}}, ["SEED", "integer"]),
        ({"overrides": {"SEED": "True"}}, ["SEED", "integer"]),
        ({"overrides": {"SEED": "9" * 30}}, ["SEED", "64-bit"]),
        ({"overrides": {"FLAG": "1"}}, ["FLAG", "True or False"]),
        ({"overrides": {"SKIP_AT": "[1, 'a']"}}, ["SKIP_AT", "tuple of integers"]),
        ({"overrides": {"WORKLOAD": "[" * 50 + "]" * 50}}, ["WORKLOAD", "nested deeper"]),
        ({"overrides": {"WORKLOAD": "[" * 600 + "]" * 600}}, ["WORKLOAD", "longer than 1000"]),
        ({"overrides": {"WORKLOAD": "a b"}}, ["WORKLOAD", "not a Python literal"]),
        ({"overrides": {"COMPUTED": "3"}}, ["COMPUTED", "computed"]),
    ],
)
def test_bad_input_is_refused_in_one_line_before_anything_is_written(refusal_notebooks, tmp_path, kwargs, words):
    root = tmp_path / "results"
    root.mkdir()
    (root / "record.schema.json").write_text("{}", encoding="utf-8")
    (root / "own").mkdir()
    (root / "own" / "mine.txt").write_text("keep", encoding="utf-8")
    before = snapshot(root)
    args = {"run_mode": "cpu", "run_label": LABEL, **kwargs}
    with pytest.raises(TrainmechError) as e:
        runner.run(args.pop("run_mode"), args.pop("run_label"), notebooks_dir=refusal_notebooks, results_root=root,
                   progress=False, **args)
    text = str(e.value)
    assert "\n" not in text and len(text) < 400, text
    for w in words:
        assert w in text, (w, text)
    assert snapshot(root) == before and sorted(p.name for p in root.iterdir()) == ["own", "record.schema.json"]


@pytest.mark.parametrize(
    "name, text, value",
    [("SEED", "5", 5), ("LR", "1", 1.0), ("LR", "3e-4", 3e-4), ("WORKLOAD", "cpu-seq32", "cpu-seq32"),
     ("WORKLOAD", "None", None), ("WORKLOAD", "{'qwen2-tiny': [(1, 32)]}", {"qwen2-tiny": [(1, 32)]}),
     ("SKIP_AT", "[3, 5]", (3, 5)), ("SKIP_AT", "4,", (4,)), ("NAME", "1", "1"), ("NAME", "'y z'", "y z"),
     ("FLAG", "True", True)],
)
def test_overrides_take_values_of_the_defaults_type(refusal_notebooks, name, text, value):
    planned = runner.plan_overrides(runner.discover(refusal_notebooks), {name: text})
    assert planned["Task0_a"] == {name: value} and type(planned["Task0_a"][name]) is type(value)
    assert planned["Task1_b"] == ({name: value} if name == "SEED" else {})


def test_cuda_mode_is_refused_without_cuda(refusal_notebooks, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TrainmechError, match="CUDA"):
        runner.run("TRAIN-CUDA-MECHANISM", LABEL, notebooks_dir=refusal_notebooks, results_root=tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


def test_empty_notebooks_folder_is_refused(tmp_path):
    (tmp_path / "nb").mkdir()
    with pytest.raises(TrainmechError, match="no Task notebooks"):
        runner.run("cpu", LABEL, notebooks_dir=tmp_path / "nb", results_root=tmp_path / "r", progress=False)


def test_a_held_label_is_refused_and_other_labels_are_not(refusal_notebooks, tmp_path):
    root = tmp_path / "results"
    root.mkdir()
    with runfolder.label_lock(root, LABEL):
        with pytest.raises(TrainmechError) as e:
            run(refusal_notebooks, root)
        assert f"another run of label '{LABEL}' is in progress (pid {os.getpid()})" in str(e.value)
        assert sorted(p.name for p in root.iterdir()) == [f".lock-{LABEL}"]
        with runfolder.label_lock(root, "other"):
            pass
    assert list(root.iterdir()) == []


def test_the_lock_is_held_across_processes(tmp_path):
    root = tmp_path / "results"
    code = ("import sys, time; from pathlib import Path; from trainmech import runfolder\n"
            "with runfolder.label_lock(Path(sys.argv[1]), 'lbl'):\n    print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TrainmechError, match=f"pid {holder.pid}"):
            with runfolder.label_lock(root, "lbl"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with runfolder.label_lock(root, "lbl"):  # the lock of a dead process is free
        pass


def test_stale_staging_of_dead_processes_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    root = tmp_path / "results"
    for name in (f".staging-{LABEL}-{dead_pid}", f".old-{LABEL}-{dead_pid}", f".staging-{LABEL}-{os.getppid()}",
                 f".staging-{LABEL}-1-{dead_pid}", f".staging-other-{dead_pid}"):
        (root / name).mkdir(parents=True)
        (root / name / "x").write_text("x", encoding="utf-8")
    removed = runfolder.remove_stale(root, LABEL)
    assert sorted(removed) == sorted([f".staging-{LABEL}-{dead_pid}", f".old-{LABEL}-{dead_pid}"])
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [f".staging-{LABEL}-{os.getppid()}", f".staging-{LABEL}-1-{dead_pid}", f".staging-other-{dead_pid}"])


def test_replace_dir_swaps_whole_folders_and_rolls_back(tmp_path, monkeypatch):
    target, staging = tmp_path / "lbl", tmp_path / ".staging-lbl-1"
    for folder, text in ((target, "old"), (staging, "new")):
        folder.mkdir()
        (folder / "f").write_text(text, encoding="utf-8")
    real_rename = Path.rename

    def failing(self, dest):
        if self == staging:
            raise OSError(errno.ENOSPC, "No space left on device", str(dest))
        return real_rename(self, dest)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError):
        runfolder.replace_dir(staging, target)
    assert (target / "f").read_text(encoding="utf-8") == "old"  # put back
    monkeypatch.setattr(Path, "rename", real_rename)
    for _ in range(50):  # repeated swaps never leave a half or a set-aside folder
        runfolder.replace_dir(staging, target)
        staging.mkdir()
        (staging / "f").write_text("again", encoding="utf-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging-lbl-1", "lbl"]


# ---------------------------------------------------------------- per-notebook failures stay per-notebook


def test_bad_parameters_cells_and_invalid_records_fail_only_their_notebook(tmp_path):
    notebooks = tmp_path / "notebooks"
    make_notebook(notebooks, "Task0_noparams", ["print(1)"], parameters=None)
    make_notebook(notebooks, "Task1_badrecord", [
        WRITE.format(notebook="Task1_badrecord"),
        'write("TRAIN-LOOP", "cpu-loop")\n'
        'd = Path(os.environ["TRAINMECH_RESULTS_DIR"])\n'
        '(d / "TRAIN-CHECKPOINT__bad.json").write_bytes(b"\\xff\\xfe")\n'
        '(d / "TRAIN-OFFLOAD__deep.json").write_text("[" * 100000 + "]" * 100000)',
    ])
    make_notebook(notebooks, "Task2_otherlabel", [WRITE.format(notebook="Task2_otherlabel"), 'write("TRAIN-OFFLOAD", "x", "other")'])
    make_notebook(notebooks, "Task3_fine", [WRITE.format(notebook="Task3_fine"), 'write("TRAIN-AMP-BACKWARD", "cpu")'])
    root = tmp_path / "results"
    assert run(notebooks, root) == 1
    partial = root / f"{LABEL}.partial"
    noparams, badrecord, otherlabel, fine = run_json(partial)["notebooks"]
    assert noparams["status"] == "failed" and "parameters" in noparams["error"]["evalue"] and noparams["records"] == []
    assert badrecord["status"] == "failed" and badrecord["error"]["ename"] == "InvalidRecord"
    assert "TRAIN-CHECKPOINT__bad.json is not UTF-8" in badrecord["error"]["evalue"]
    assert badrecord["records"] == ["TRAIN-CHECKPOINT__bad.json", "TRAIN-LOOP__cpu-loop.json", "TRAIN-OFFLOAD__deep.json"]
    assert otherlabel["status"] == "failed" and "belongs to run 'other'" in otherlabel["error"]["evalue"]
    assert fine["status"] == "ok"
    md = (partial / "REGISTRY.md").read_text(encoding="utf-8")  # valid records count, invalid ones are listed
    assert "cpu-mechanism (cpu-loop)" in next(line for line in md.splitlines() if line.startswith("| TRAIN-LOOP"))
    assert "no record" in next(line for line in md.splitlines() if line.startswith("| TRAIN-CHECKPOINT"))
    assert "`TRAIN-OFFLOAD__deep.json`: record TRAIN-OFFLOAD__deep.json is not readable JSON (nested too deeply)" in md
    assert "`TRAIN-OFFLOAD__x.json`" in md and (partial / "TRAIN-CHECKPOINT__bad.json").read_bytes() == b"\xff\xfe"
    assert leftovers(root) == [] and not (root / LABEL).exists()


def test_a_timeout_is_reported_as_timeout_and_the_others_still_run(tmp_path):
    notebooks = tmp_path / "notebooks"
    make_notebook(notebooks, "Task0_slow", ["print('start')", "import time\ntime.sleep(600)", "print('never')"])
    make_notebook(notebooks, "Task1_quick", ["print('quick')"])
    root = tmp_path / "results"
    t0 = time.monotonic()
    assert run(notebooks, root, timeout=15) == 1
    assert time.monotonic() - t0 < 60
    slow, quick = run_json(root / f"{LABEL}.partial")["notebooks"]
    assert slow["status"] == "timeout"
    assert slow["error"] == {"ename": "Timeout", "evalue": "the notebook ran past its limit of 15 s", "cell": 4}
    assert 15 <= slow["seconds"] < 40
    assert quick["status"] == "ok"
    executed = nbformat.read(root / f"{LABEL}.partial" / "notebooks" / "Task0_slow.ipynb", as_version=4)
    assert executed.cells[3].outputs[0]["text"] == "start\n" and not executed.cells[5].get("outputs")


def test_a_filesystem_error_at_the_end_is_one_line_and_keeps_the_old_results(ok_run, tmp_path, monkeypatch):
    _, notebooks, root = ok_run
    copy = tmp_path / "results"
    shutil.copytree(root, copy)
    before = snapshot(copy / LABEL)

    def disk_full(staging, target):
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    monkeypatch.setattr(runfolder, "replace_dir", disk_full)
    with pytest.raises(TrainmechError) as e:
        run(notebooks, copy, only=["Task0"])
    assert str(e.value) == (f"could not write the run's results (No space left on device: {copy / LABEL}); "
                            f"results/{LABEL} is unchanged")
    assert snapshot(copy / LABEL) == before
    assert leftovers(copy) == [] and sorted(p.name for p in copy.iterdir()) == [LABEL]


def test_an_unwritable_results_folder_is_refused_before_any_notebook_runs(refusal_notebooks, tmp_path, monkeypatch):
    def read_only(root, label):
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(runfolder, "new_staging", read_only)
    with pytest.raises(TrainmechError, match=r"cannot write into .* \(Read-only file system\); no notebook was run"):
        run(refusal_notebooks, tmp_path / "results")
    assert leftovers(tmp_path / "results") == []


# ---------------------------------------------------------------- interruption: a real process, real signals


SLEEPER = ["import os, time\nfrom pathlib import Path\nPath(MARKER).write_text(str(os.getpid()))\ntime.sleep(600)"]


def start_cli(cwd: Path, notebooks: str, root: str, *args: str) -> subprocess.Popen:
    """python -m trainmech run … with the runner pointed at a throw-away notebooks folder and results root
    (paths relative to cwd: the kernels run elsewhere, in the notebooks' folder)."""
    code = ("import sys; from pathlib import Path; from trainmech import runner, __main__\n"
            "runner.NOTEBOOKS_DIR, runner.RESULTS_ROOT = Path(sys.argv[1]), Path(sys.argv[2])\n"
            "sys.exit(__main__.main(sys.argv[3:]))")
    return subprocess.Popen([sys.executable, "-c", code, notebooks, root, "run", "--label", LABEL, *args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 90) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)
    return path.read_text()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_notebook_stops_the_run_and_changes_nothing(tmp_path, signum, code):
    notebooks = tmp_path / "notebooks"
    marker = tmp_path / "kernel.pid"
    make_notebook(notebooks, "Task0_a", writer("Task0_a", "TRAIN-LOOP", "cpu-loop"))
    make_notebook(notebooks, "Task1_sleep", SLEEPER, parameters=f'RUN_MODE = "cpu"\nRUN_LABEL = "local"\nMARKER = {str(marker)!r}')
    make_notebook(notebooks, "Task2_c", writer("Task2_c", "TRAIN-CHECKPOINT", "cpu-b2s128"))
    root = tmp_path / "results"
    before = old_run(root / LABEL)
    process = start_cli(tmp_path, "notebooks", "results")
    kernel = int(wait_for(marker, process))
    t0 = time.monotonic()
    process.send_signal(signum)
    out, err = process.communicate(timeout=30)
    assert process.returncode == code, err
    assert time.monotonic() - t0 < 15  # promptly: not after the sleeping cell, not after the next notebook
    assert err.splitlines()[-1] == f"trainmech: interrupted ({signal.Signals(signum).name}); results/ is unchanged"
    assert "Traceback" not in err and "Task2_c" not in err  # the next notebook never started
    assert re.search(r"^Task0_a +ok .* 1 record\(s\)", err, re.M), err  # it ran, and wrote into the staging run
    assert snapshot(root / LABEL) == before
    assert sorted(p.name for p in root.iterdir()) == [LABEL]  # no staging, no partial, no lock
    for _ in range(50):  # the kernel was killed, not left running
        if not running(kernel):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"kernel {kernel} still runs")


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for a parent that never reaps it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
