"""The headless runner under bad input and faults: refusals before anything is written, the label's
lock, stale staging, filesystem errors, timeouts and real signals sent to a real process; and how
--jobs is chosen, ordered and shown.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from runner_notebooks import (
    LABEL,
    SLEEPER,
    leftovers,
    make_notebook,
    old_run,
    run,
    run_json,
    running,
    snapshot,
    start_cli,
    wait_for,
    writer,
)

from trainmech import execution, runfolder, runner
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.package


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
def test_bad_input_is_refused_in_one_line_before_anything_is_written(
    refusal_notebooks, tmp_path, kwargs, words
):
    root = tmp_path / "results"
    root.mkdir()
    (root / "record.schema.json").write_text("{}", encoding="utf-8")
    (root / "own").mkdir()
    (root / "own" / "mine.txt").write_text("keep", encoding="utf-8")
    before = snapshot(root)
    args = {"run_mode": "cpu", "run_label": LABEL, **kwargs}
    with pytest.raises(TrainmechError) as e:
        runner.run(
            args.pop("run_mode"),
            args.pop("run_label"),
            notebooks_dir=refusal_notebooks,
            results_root=root,
            progress=False,
            **args,
        )
    text = str(e.value)
    assert "\n" not in text and len(text) < 400, text
    for w in words:
        assert w in text, (w, text)
    assert snapshot(root) == before and sorted(p.name for p in root.iterdir()) == [
        "own",
        "record.schema.json",
    ]


@pytest.mark.parametrize(
    "name, text, value",
    [
        ("SEED", "5", 5),
        ("LR", "1", 1.0),
        ("LR", "3e-4", 3e-4),
        ("WORKLOAD", "cpu-seq32", "cpu-seq32"),
        ("WORKLOAD", "None", None),
        ("WORKLOAD", "{'qwen2-tiny': [(1, 32)]}", {"qwen2-tiny": [(1, 32)]}),
        ("SKIP_AT", "[3, 5]", (3, 5)),
        ("SKIP_AT", "4,", (4,)),
        ("NAME", "1", "1"),
        ("NAME", "'y z'", "y z"),
        ("FLAG", "True", True),
    ],
)
def test_overrides_take_values_of_the_defaults_type(refusal_notebooks, name, text, value):
    planned = runner.plan_overrides(runner.discover(refusal_notebooks), {name: text})
    assert planned["Task0_a"] == {name: value} and type(planned["Task0_a"][name]) is type(value)
    assert planned["Task1_b"] == ({name: value} if name == "SEED" else {})


def test_cuda_mode_is_refused_without_cuda(refusal_notebooks, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TrainmechError, match="CUDA"):
        runner.run(
            "TRAIN-CUDA-MECHANISM",
            LABEL,
            notebooks_dir=refusal_notebooks,
            results_root=tmp_path / "r",
            progress=False,
        )
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
    code = (
        "import sys, time; from pathlib import Path; from trainmech import runfolder\n"
        "with runfolder.label_lock(Path(sys.argv[1]), 'lbl'):\n    print('held', flush=True); time.sleep(60)"
    )
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
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    root = tmp_path / "results"
    for name in (
        f".staging-{LABEL}-{dead_pid}",
        f".old-{LABEL}-{dead_pid}",
        f".staging-{LABEL}-{os.getppid()}",
        f".staging-{LABEL}-1-{dead_pid}",
        f".staging-other-{dead_pid}",
    ):
        (root / name).mkdir(parents=True)
        (root / name / "x").write_text("x", encoding="utf-8")
    removed = runfolder.remove_stale(root, LABEL)
    assert sorted(removed) == sorted([f".staging-{LABEL}-{dead_pid}", f".old-{LABEL}-{dead_pid}"])
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [f".staging-{LABEL}-{os.getppid()}", f".staging-{LABEL}-1-{dead_pid}", f".staging-other-{dead_pid}"]
    )


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


JOBS = pytest.mark.parametrize("jobs", [1, 2], ids=["jobs1", "jobs2"])


LIMIT = 6  # seconds a notebook may run in the timeout test: its kernel starts and reaches the sleeping cell well within


@JOBS
def test_a_timeout_is_reported_as_timeout_and_the_others_still_run(tmp_path, jobs):
    notebooks = tmp_path / "notebooks"
    make_notebook(
        notebooks, "Task0_slow", ["print('start')", "import time\ntime.sleep(600)", "print('never')"]
    )
    make_notebook(notebooks, "Task1_quick", ["print('quick')"])
    root = tmp_path / "results"
    t0 = time.monotonic()
    assert run(notebooks, root, timeout=LIMIT, jobs=jobs) == 1
    assert time.monotonic() - t0 < 60
    summary = run_json(root / f"{LABEL}.partial")
    slow, quick = summary["notebooks"]
    assert summary["jobs"] == jobs
    assert slow["status"] == "timeout"
    assert slow["error"] == {
        "ename": "Timeout",
        "evalue": f"the notebook ran past its limit of {LIMIT} s",
        "cell": 4,
    }
    assert LIMIT <= slow["seconds"] < LIMIT + 30
    assert quick["status"] == "ok"
    executed = nbformat.read(root / f"{LABEL}.partial" / "notebooks" / "Task0_slow.ipynb", as_version=4)
    assert executed.cells[3].outputs[0]["text"] == "start\n" and not executed.cells[5].get("outputs")
    assert leftovers(root) == [] and not (root / LABEL).exists()


def test_a_filesystem_error_at_the_end_is_one_line_and_keeps_the_old_results(tmp_path, monkeypatch):
    notebooks = tmp_path / "notebooks"
    make_notebook(notebooks, "Task0_a", writer("Task0_a", "TRAIN-LOOP", "cpu-loop"))
    root = tmp_path / "results"
    before = old_run(root / LABEL)

    def disk_full(staging, target):
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    monkeypatch.setattr(runfolder, "replace_dir", disk_full)
    with pytest.raises(TrainmechError) as e:
        run(notebooks, root)
    assert str(e.value) == (
        f"could not write the run's results (No space left on device: {root / LABEL}); "
        f"results/{LABEL} is unchanged"
    )
    assert snapshot(root / LABEL) == before
    assert leftovers(root) == [] and sorted(p.name for p in root.iterdir()) == [LABEL]


def test_an_unwritable_results_folder_is_refused_before_any_notebook_runs(
    refusal_notebooks, tmp_path, monkeypatch
):
    def read_only(staging):
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(runfolder, "new_staging", read_only)
    with pytest.raises(
        TrainmechError, match=r"cannot write into .* \(Read-only file system\); no notebook was run"
    ):
        run(refusal_notebooks, tmp_path / "results")
    assert leftovers(tmp_path / "results") == []


# ---------------------------------------------------------------- interruption: a real process, real signals


@JOBS
@pytest.mark.parametrize(
    "signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_a_signal_mid_notebook_stops_the_run_and_changes_nothing(tmp_path, signum, code, jobs):
    notebooks = tmp_path / "notebooks"
    markers = [tmp_path / f"kernel{i}.pid" for i in range(2)]
    for i, marker in enumerate(
        markers
    ):  # two notebooks that sleep; with --jobs 2 both run when the signal comes
        make_notebook(
            notebooks,
            f"Task{i}_sleep",
            SLEEPER,
            parameters=f'RUN_MODE = "cpu"\nRUN_LABEL = "local"\nMARKER = {str(marker)!r}',
        )
    make_notebook(notebooks, "Task2_c", writer("Task2_c", "TRAIN-CHECKPOINT", "cpu-b2s128"))
    root = tmp_path / "results"
    before = old_run(root / LABEL)
    process = start_cli(tmp_path, "notebooks", "results", "--jobs", str(jobs))
    kernels = [int(wait_for(marker, process)) for marker in markers[:jobs]]
    t0 = time.monotonic()
    process.send_signal(signum)
    out, err = process.communicate(timeout=30)
    assert process.returncode == code, err
    assert time.monotonic() - t0 < 15  # promptly: not after the sleeping cell, not after the next notebook
    assert (
        err.splitlines()[-1]
        == f"trainmech: interrupted ({signal.Signals(signum).name}); results/ is unchanged"
    )
    assert "Traceback" not in err and "Task2_c" not in err  # the next notebook never started
    assert snapshot(root / LABEL) == before
    assert sorted(p.name for p in root.iterdir()) == [LABEL]  # no staging, no partial, no lock
    deadline = time.monotonic() + 5
    while any(running(k) for k in kernels) and time.monotonic() < deadline:  # the kernels were killed
        time.sleep(0.1)
    assert not [k for k in kernels if running(k)]


# ---------------------------------------------------------------- how --jobs is chosen, ordered and shown


def test_jobs_default_to_the_cores_and_are_capped_by_memory(monkeypatch):
    monkeypatch.setattr(execution, "usable_cores", lambda: 8)
    monkeypatch.setattr(execution, "available_memory", lambda: 64 * execution.GiB)
    assert execution.choose_jobs(None, 7, "cpu", None) == (7, None)  # no more than notebooks
    assert execution.choose_jobs(None, 20, "cpu", None) == (8, None)
    assert execution.choose_jobs(3, 20, "cpu", None) == (3, None)
    assert execution.choose_jobs(None, 7, "cuda", None) == (1, None)  # one GPU
    previous = {
        "notebooks": [{"notebook": "Task3_x", "peak_rss_bytes": 16 * execution.GiB}, {"notebook": "Task0_y"}]
    }
    n, note = execution.choose_jobs(None, 7, "cpu", previous)  # 0.8 * 64 GiB holds 3 kernels of 16 GiB
    assert (
        n == 3
        and note
        == "7 kernels at once lowered to 3: 64.0 GiB of memory is available and a kernel may take 16.0 GiB"
    )
    monkeypatch.setattr(execution, "available_memory", lambda: 1 * execution.GiB)
    assert execution.choose_jobs(4, 7, "cpu", None)[0] == 1  # never below one
    monkeypatch.setattr(execution, "available_memory", lambda: None)
    assert execution.choose_jobs(4, 7, "cpu", previous) == (4, None)


@pytest.mark.parametrize(
    "jobs, mode, words",
    [(0, "cpu", "positive"), (-1, "cpu", "positive"), (2, "TRAIN-CUDA-MECHANISM", "one GPU")],
)
def test_bad_jobs_are_refused(jobs, mode, words, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(TrainmechError, match=words):
        execution.choose_jobs(jobs, 7, "cuda" if mode != "cpu" else "cpu", None)


def test_longest_first_uses_the_last_run_times():
    stems = ["Task0_a", "Task1_b", "Task2_c", "Task3_d"]
    previous = {
        "notebooks": [
            {"notebook": "Task0_a", "seconds": 7.0},
            {"notebook": "Task1_b", "seconds": 17.0},
            {"notebook": "Task2_c", "seconds": "x"},
            {"notebook": "Task3_d", "seconds": 7.0},
        ]
    }
    assert execution.longest_first(stems, previous) == ["Task2_c", "Task1_b", "Task0_a", "Task3_d"]
    assert execution.longest_first(stems, None) == stems


def test_peak_rss_sum_counts_the_kernels_running_together():
    def job(start, end, peak):
        j = execution.Job(Path("x.ipynb"), {}, Path("o"), Path("r"), 1.0)
        j.started, j.ended, j.peak_rss = start, end, peak
        return j

    assert execution.peak_rss_sum([job(0, 10, 5), job(0, 4, 3), job(4, 9, 4), job(9, 12, 1)]) == 9  # 5 + 4
    assert execution.peak_rss_sum([job(0, 1, None)]) is None


def test_progress_names_every_running_notebook():
    import io

    stream = io.StringIO()
    show = execution.Progress(True, 7, stream=stream, live=True)
    jobs = [
        execution.Job(Path(f"{stem}.ipynb"), {}, Path("o"), Path("r"), 1.0) for stem in ("Task3_a", "Task6_b")
    ]
    jobs[0].cell, jobs[0].cells = 12, 60
    jobs[0].started = jobs[1].started = time.monotonic() - 5
    show.tick(jobs)
    assert "[0/7 done] running: Task3 cell 12/60 5s · Task6 cell -/? 5s" in stream.getvalue()
    show.write("Task3_a ok")
    assert stream.getvalue().endswith("\r\033[KTask3_a ok\n")


def test_benchmark_runs_both_and_compares(tmp_path):
    notebooks = tmp_path / "notebooks"
    make_notebook(notebooks, "Task0_a", writer("Task0_a", "TRAIN-LOOP", "cpu-loop"))
    make_notebook(
        notebooks, "Task1_b", writer("Task1_b", "TRAIN-CHECKPOINT", "cpu") + ["print('took 1.25 s')"]
    )
    lines = []
    ratio = runner.benchmark_jobs(2, notebooks_dir=notebooks, out=lines.append)
    assert ratio > 0 and len(lines) == 4
    assert lines[0].startswith("--jobs 1: ") and lines[1].startswith("--jobs 2: ")
    assert lines[2].startswith("ratio (--jobs 1 time / --jobs 2 time): ")
    assert lines[3] == "records and executed outputs: identical apart from times"


def test_executed_copies_join_the_chunks_of_a_print():
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    nb = new_notebook(
        cells=[
            new_code_cell(
                "x",
                outputs=[
                    new_output("stream", name="stdout", text="a\n"),
                    new_output("stream", name="stdout", text="b\n"),
                    new_output("stream", name="stderr", text="w\n"),
                    new_output("stream", name="stdout", text="c\n"),
                    new_output("display_data", data={"text/plain": "fig"}),
                    new_output("stream", name="stdout", text="d\n"),
                ],
            )
        ]
    )
    outputs = execution.merge_streams(nb).cells[0].outputs
    assert [(o.output_type, o.get("text")) for o in outputs] == [
        ("stream", "a\nb\n"),
        ("stream", "w\n"),
        ("stream", "c\n"),
        ("display_data", None),
        ("stream", "d\n"),
    ]
