"""Throw-away Task notebooks and helpers for the runner tests (test_runner*.py).

Most notebooks write their records with `trainmech.results` alone (a kernel that imports torch
takes seconds); SESSION makes one start a real session, so its records carry the real environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from trainmech import runner

LABEL = "lbl"
PARAMETERS = 'RUN_MODE = "cpu"\nRUN_LABEL = "local"\nSEED = 0\nFAIL = False'

SESSION = """\
from trainmech.session import start
environment = start(RUN_MODE, RUN_LABEL, page="t", notebook={notebook!r}, seed=SEED).environment
"""

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
        "environment": globals().get("environment") or {{"profile_id": "TRAIN-CPU", "run_mode": RUN_MODE,
                         "python": "3", "torch": "2", "transformers": "5", "accelerate": None, "cuda": None,
                         "gpu": None, "gpu_memory_bytes": None, "device": "cpu"}},
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
    return [
        WRITE.format(notebook=stem),
        f'write("{semantic_id}", "{workload_id}")\nprint("seed", SEED)',
        'if FAIL:\n    raise RuntimeError("asked to fail")',
    ]


def three_notebooks(folder: Path) -> Path:
    make_notebook(
        folder, "Task0_a", [SESSION.format(notebook="Task0_a"), *writer("Task0_a", "TRAIN-LOOP", "cpu-loop")]
    )
    make_notebook(
        folder,
        "Task1_b",
        [
            *writer("Task1_b", "TRAIN-LOCAL-BACKWARD", "cpu-loop")[:2],
            'raise RuntimeError("boom in Task1")',
            'print("never reached")',
        ],
        parameters='RUN_MODE = "cpu"\nRUN_LABEL = "local"\nSEED = 0\nONLY_HERE = 1',
    )
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
    (folder / "run.json").write_text(
        json.dumps(
            {
                "run_label": folder.name,
                "run_mode": mode,
                "status": "ok",
                "notebooks": [
                    {
                        "notebook": "Task0_a",
                        "status": "ok",
                        "seconds": 1.0,
                        "records": ["TRAIN-LOOP__old.json"],
                        "error": None,
                    }
                ],
            }
        ),
        encoding="utf-8",
    )
    (folder / "TRAIN-LOOP__old.json").write_text('{"old": true}', encoding="utf-8")
    (folder / "REGISTRY.md").write_text("# old\n", encoding="utf-8")
    (folder / "notebooks").mkdir()
    (folder / "notebooks" / "Task0_a.ipynb").write_text("{}", encoding="utf-8")
    return snapshot(folder)


def run(notebooks: Path, root: Path, label: str = LABEL, **kwargs) -> int:
    """runner.run in CPU mode, quietly, on these notebooks and this results root."""
    return runner.run("cpu", label, notebooks_dir=notebooks, results_root=root, progress=False, **kwargs)


SLEEPER = [
    "import os, time\nfrom pathlib import Path\nPath(MARKER).write_text(str(os.getpid()))\ntime.sleep(600)"
]


def start_cli(cwd: Path, notebooks: str, root: str, *args: str) -> subprocess.Popen:
    """python -m trainmech run … with the runner pointed at a throw-away notebooks folder and results root
    (paths relative to cwd: the kernels run elsewhere, in the notebooks' folder)."""
    code = (
        "import sys; from pathlib import Path; from trainmech import runner, __main__\n"
        "runner.NOTEBOOKS_DIR, runner.RESULTS_ROOT = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "sys.exit(__main__.main(sys.argv[3:]))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, notebooks, root, "run", "--label", LABEL, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 90) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)
    return path.read_text()


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
