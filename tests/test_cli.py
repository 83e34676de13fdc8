"""The command line (python -m trainmech): refusals are one line without a traceback; help works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.package

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINMECH_RESULTS_DIR": str(tmp_path / "records")}
    return subprocess.run(
        [sys.executable, "-m", "trainmech", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def results_listing() -> list[str]:
    return sorted(p.name for p in (REPO / "results").iterdir())


def assert_one_line_error(out: subprocess.CompletedProcess, *words: str) -> str:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("trainmech: error: "), lines[0]
    for w in words:
        assert w in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["run", "--mode", "bogus"], ["bogus", "cpu", "TRAIN-CUDA-MECHANISM"]),
        (["run", "--label", "../x"], ["../x"]),
    ],
    ids=["mode", "label"],
)
def test_run_refuses_bad_arguments_in_one_line(tmp_path, args, words):
    before = results_listing()
    out = cli(*args, tmp_path=tmp_path)
    assert out.returncode == 2
    assert_one_line_error(out, *words)
    assert results_listing() == before  # nothing written into the committed results/


@pytest.mark.parametrize(
    "args, words",
    [
        (["run", "--label", ".hidden"], [".hidden"]),
        (["run", "--only", "Task99"], ["Task99", "Task0"]),
        (["run", "-p", "no-equals-sign"], ["NAME=VALUE"]),
        (["registry", "--label", "../x"], ["../x"]),
        (["run", "--label", "record.schema.json"], ["results/record.schema.json", "not a run folder"]),
        (["run", "--label", "x" * 250], ["1 to 100"]),
        (["run", "--label", "cpu-reference.partial"], [".partial"]),
        (["run", "--timeout", "nan"], ["--timeout", "nan"]),
        (["run", "--timeout", "inf"], ["--timeout", "inf"]),
        (["run", "--timeout", "-5"], ["--timeout", "-5"]),
        (["run", "--timeout", "abc"], ["--timeout", "abc"]),
        (["run", "-p", "SEQ=64", "--only", "Task0"], ["SEQ", "no notebook", "SEED"]),
        (["run", "-p", "class=1"], ["'class'"]),
        (["run", "-p", "print=None"], ["print", "no notebook"]),
        (["run", "-p", "RUN_LABEL=other"], ["RUN_LABEL", "--label"]),
        (["run", "-p", "SEED=1e999"], ["SEED", "finite"]),
        (["run", "-p", "SEED=abc"], ["SEED", "integer"]),
        (["run", "-p", "SEED=1", "-p", "SEED=2"], ["SEED", "twice"]),
        (["run", "-p", "SEED=" + "[" * 5000], ["SEED", "longer than 1000"]),
        (["run", "--jobs", "0"], ["--jobs", "positive"]),
        (["run", "--jobs", "two"], ["--jobs", "'two'"]),
    ],
    ids=[
        "label-dot",
        "only",
        "param",
        "registry-label",
        "label-schema-file",
        "label-long",
        "label-partial",
        "timeout-nan",
        "timeout-inf",
        "timeout-negative",
        "timeout-word",
        "param-unknown",
        "param-keyword",
        "param-builtin",
        "param-run-label",
        "param-inf",
        "param-word",
        "param-twice",
        "param-huge",
        "jobs-zero",
        "jobs-word",
    ],
)
def test_main_refuses_bad_arguments_in_one_line(capsys, args, words):
    """The same path in-process (fast): main() returns 2 and prints one `trainmech: error:` line."""
    from trainmech.__main__ import main

    before = results_listing()
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainmech: error: "), captured.err
    for w in words:
        assert w in lines[0]
    assert results_listing() == before


def test_run_refuses_cuda_mode_without_cuda_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the CUDA mode would run")
    before = results_listing()
    out = cli("run", "--mode", "TRAIN-CUDA-MECHANISM", "--label", "gpu-test", tmp_path=tmp_path)
    line = assert_one_line_error(out, "CUDA")
    assert "cpu" in line
    assert results_listing() == before


def test_help_lists_the_commands(tmp_path):
    out = cli("--help", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    for word in ("run", "registry", "lint", "--label", "TRAIN-CUDA-MECHANISM"):
        assert word in out.stdout, word
    assert out.stderr == ""


def test_run_help_describes_its_options(tmp_path):
    out = cli("run", "--help", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m trainmech run")
    for word in (
        "--mode",
        "--label",
        "--only",
        "cpu",
        "TRAIN-CUDA-MECHANISM",
        "--timeout",
        "--jobs",
        "--benchmark-jobs",
        ".partial",
        "merges",
        "Ctrl-C",
        "130 / 143",
    ):
        assert word in out.stdout, word


def test_no_command_prints_help_and_exits_2(tmp_path):
    out = cli(tmp_path=tmp_path)
    assert out.returncode == 2
    assert "run" in out.stdout and "registry" in out.stdout and "lint" in out.stdout


def test_registry_refuses_an_unknown_label_in_one_line(tmp_path):
    out = cli("registry", "--label", "missing", tmp_path=tmp_path)
    assert out.returncode == 2
    assert out.stdout == ""
    assert_one_line_error(out, "missing")


def test_unknown_command_is_an_argparse_error(tmp_path):
    out = cli("fly", tmp_path=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "invalid choice" in out.stderr


def test_registry_without_a_results_folder_is_one_line(capsys, monkeypatch, tmp_path):
    from trainmech import runner
    from trainmech.__main__ import main

    monkeypatch.setattr(runner, "RESULTS_ROOT", tmp_path / "absent")
    assert main(["registry", "--label", "cpu-reference"]) == 2
    err = capsys.readouterr().err
    assert err == "trainmech: error: no run labelled 'cpu-reference' under results/; present: none\n"


def test_registry_lists_invalid_records_and_exits_1(capsys, monkeypatch, tmp_path):
    from trainmech import runner
    from trainmech.__main__ import main

    run = tmp_path / "mine"
    shutil.copytree(REPO / "results" / "cpu-reference", run, ignore=shutil.ignore_patterns("notebooks"))
    for path in run.glob("*__*.json"):  # the committed records, relabelled as this run's
        path.write_text(
            path.read_text(encoding="utf-8").replace('"cpu-reference"', '"mine"'), encoding="utf-8"
        )
    (run / "TRAIN-LOOP__cpu-loop.json").write_bytes(b"[" * 100_000)
    monkeypatch.setattr(runner, "RESULTS_ROOT", tmp_path)
    assert main(["registry", "--label", "mine"]) == 1
    out = capsys.readouterr().out
    assert "| TRAIN-LOOP / " in out and "no record" in out.split("| TRAIN-LOOP / ")[1].splitlines()[0]
    assert (
        "cpu-mechanism" in out.split("| TRAIN-CHECKPOINT / ")[1].splitlines()[0]
    )  # the valid records still count
    assert out.rstrip().endswith(
        "`TRAIN-LOOP__cpu-loop.json`: record TRAIN-LOOP__cpu-loop.json is not readable JSON (nested too deeply)"
    )


def test_refuse_prints_one_line_and_returns_2(capsys):
    from trainmech.errors import TrainmechError, refuse

    assert refuse(TrainmechError("no run labelled 'x'\n  under results/")) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "trainmech: error: no run labelled 'x' under results/\n")
