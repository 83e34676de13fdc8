"""Headless execution of the Task notebooks with nbclient.

`run(...)` executes the notebooks in Task order, each in its own kernel, with RUN_MODE /
RUN_LABEL (and any overrides) injected after the cell tagged `parameters`. Everything of one
run is built in a staging folder and replaces `results/<label>/` as a whole at the end:
executed notebooks under `notebooks/`, the records the notebooks write, `run.json`
(per notebook: status, seconds, records, error) and `REGISTRY.md`. A failing notebook does not
stop the others; an interrupted run leaves the previous results untouched.

Kernels run the interpreter that runs the runner (ipykernel's own `python3` spec) and import this
checkout's `trainmech` (its root goes first on their PYTHONPATH): no venv, no installed copy and
no `jupyter` command are needed, so a bare Python with the packages on PYTHONPATH will do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import nbformat

from trainmech import profiles, results
from trainmech.errors import TrainmechError
from trainmech.results import REPO_ROOT, RESULTS_ENV

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
RESULTS_ROOT = REPO_ROOT / "results"
TASK_RE = re.compile(r"^Task(\d+)_[A-Za-z0-9_]+\.ipynb$")


@dataclass
class NotebookResult:
    notebook: str
    status: str  # "ok" | "failed" | "timeout"
    seconds: float
    records: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None


def discover(notebooks_dir: Path = NOTEBOOKS_DIR, only: list[str] | None = None) -> list[Path]:
    """Task notebooks in Task order; `only` keeps those whose name starts with one of its items."""
    found = sorted(
        (p for p in notebooks_dir.glob("Task*.ipynb") if TASK_RE.match(p.name)),
        key=lambda p: (int(TASK_RE.match(p.name).group(1)), p.name),  # name breaks ties: glob order is arbitrary
    )
    if only:
        wanted = [o.removesuffix(".ipynb") for o in only]
        unknown = [o for o in wanted if not any(p.stem == o or p.stem.startswith(o + "_") for p in found)]
        if unknown:
            raise TrainmechError(
                f"no notebook matches {', '.join(unknown)}; valid: {', '.join(p.stem.split('_')[0] for p in found)}"
            )
        found = [p for p in found if any(p.stem == o or p.stem.startswith(o + "_") for o in wanted)]
    return found


def inject_parameters(nb: nbformat.NotebookNode, params: dict[str, Any]) -> nbformat.NotebookNode:
    """Insert a cell tagged `injected-parameters` right after the `parameters` cell (papermill style)."""
    index = next(
        (i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])),
        None,
    )
    if index is None:
        raise TrainmechError("the notebook has no code cell tagged 'parameters'")
    source = "# Parameters injected by python -m trainmech run\n" + "".join(f"{k} = {v!r}\n" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(index + 1, cell)
    return nb


def _first_error(nb: nbformat.NotebookNode) -> dict[str, Any] | None:
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return {"ename": out.get("ename"), "evalue": str(out.get("evalue"))[:500], "cell": i}
    return None


def execute_notebook(path: Path, out_path: Path, params: dict[str, Any], timeout: float,
                     allow_errors: bool = False) -> tuple[str, dict | None]:
    """Execute one notebook into out_path; returns (status, error). Never raises for the notebook's errors.

    allow_errors: go on after a failing cell (gpu-check reads every cell's outcome); the status is
    still "failed", with the first error.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    try:
        nb = inject_parameters(nbformat.read(path, as_version=4), params)
    except ValueError as e:  # no `parameters` cell (TrainmechError), or not a notebook: this one fails
        return "failed", {"ename": type(e).__name__, "evalue": str(e)[:500], "cell": None}
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=int(timeout),
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(path.parent)}},
    )
    status, error = "ok", None
    try:
        asyncio.run(asyncio.wait_for(client.async_execute(), timeout=timeout))
        if allow_errors and _first_error(nb):
            status, error = "failed", _first_error(nb)
    except CellExecutionError as e:
        status, error = "failed", _first_error(nb) or {"ename": e.ename, "evalue": str(e.evalue)[:500], "cell": None}
    except (CellTimeoutError, asyncio.TimeoutError, TimeoutError):
        status, error = "timeout", {"ename": "Timeout", "evalue": f"the notebook ran past {timeout:.0f} s", "cell": None}
    except DeadKernelError as e:
        status, error = "failed", {"ename": "DeadKernelError", "evalue": str(e)[:500], "cell": None}
    except Exception as e:  # the kernel did not start, a malformed notebook, …: this notebook fails, the run goes on
        status, error = "failed", {"ename": type(e).__name__, "evalue": str(e)[:500], "cell": None}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_path)
    return status, error


@contextlib.contextmanager
def records_into(folder: str | Path):
    """While inside, kernels started here write their records into folder (RESULTS_ENV) and import
    this checkout's trainmech (REPO_ROOT first on PYTHONPATH), whether or not a venv installed it."""
    paths = [str(REPO_ROOT), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT))]
    previous = {name: os.environ.get(name) for name in (RESULTS_ENV, "PYTHONPATH")}
    os.environ[RESULTS_ENV] = str(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def refresh_in_place(paths: list[Path], timeout: float = 1200.0) -> list[tuple[str, str, dict | None]]:
    """Re-execute notebooks with their own default parameters and write the outputs back.

    This is how the committed notebooks get the outputs of a CPU run that nbval compares
    against. Records go to a throw-away folder, never into results/. A notebook that fails is
    left unchanged on disk.
    """
    import tempfile

    from nbclient import NotebookClient

    outcomes = []
    with tempfile.TemporaryDirectory(prefix="trainmech-refresh-") as scratch, records_into(scratch):
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            client = NotebookClient(
                nb, timeout=int(timeout), kernel_name="python3", record_timing=False,
                resources={"metadata": {"path": str(path.parent)}},
            )
            try:
                client.execute()
            except Exception as e:  # keep the committed copy when the run fails
                outcomes.append((path.stem, "failed", _first_error(nb) or {"ename": type(e).__name__, "evalue": str(e)[:500]}))
                continue
            nbformat.write(nb, path)
            outcomes.append((path.stem, "ok", None))
    return outcomes


def _replace_dir(staging: Path, target: Path) -> None:
    """Swap staging into target as a whole: the old folder is moved aside, then removed."""
    old = target.with_name(f".old-{target.name}-{os.getpid()}")
    if target.exists():
        target.rename(old)
    try:
        staging.rename(target)
    except OSError:
        if old.exists():
            old.rename(target)  # put the previous results back: never half of each
        raise
    shutil.rmtree(old, ignore_errors=True)


def run(
    run_mode: str = "cpu",
    run_label: str = "local",
    *,
    only: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    timeout: float = 1200.0,
    notebooks_dir: Path = NOTEBOOKS_DIR,
    results_root: Path = RESULTS_ROOT,
    progress: bool = True,
    allow_errors: bool = False,
) -> int:
    """Execute the notebooks and replace results/<label>/; returns the exit code (0 ok, 1 a notebook failed).

    allow_errors: a notebook goes on past a failing cell (see `execute_notebook`)."""
    profile = profiles.for_mode(run_mode)
    results.check_label(run_label)
    if profile.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TrainmechError(f"run mode {run_mode} needs a CUDA GPU and this machine has none; use --mode cpu")
    notebooks = discover(notebooks_dir, only)
    if not notebooks:
        raise TrainmechError(f"no Task notebooks found in {notebooks_dir}")

    results_root.mkdir(parents=True, exist_ok=True)
    staging = results_root / f".staging-{run_label}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    params = {"RUN_MODE": run_mode, "RUN_LABEL": run_label, **(overrides or {})}
    started, t_run = datetime.now(timezone.utc), time.perf_counter()
    outcomes: list[NotebookResult] = []
    try:
        with records_into(staging):  # the kernels inherit it: records land in staging
            from tqdm import tqdm

            bar = tqdm(notebooks, desc="notebooks", unit="nb", disable=not progress, file=sys.stderr)
            for path in bar:
                bar.set_postfix_str(path.stem)
                before = {p: p.stat().st_mtime_ns for p in results.record_paths(staging)}
                t0 = time.perf_counter()
                status, error = execute_notebook(path, staging / "notebooks" / path.name, params, timeout, allow_errors)
                seconds = round(time.perf_counter() - t0, 2)
                # new files, and files an earlier notebook wrote that this one replaced
                written = [p for p in results.record_paths(staging) if before.get(p) != p.stat().st_mtime_ns]
                for rec in written:
                    try:
                        results.read_record(rec)
                    except TrainmechError as e:
                        if status == "ok":
                            status, error = "failed", {"ename": "InvalidRecord", "evalue": str(e), "cell": None}
                outcome = NotebookResult(path.stem, status, seconds, [p.name for p in written], error)
                outcomes.append(outcome)
                line = f"{path.stem:<28} {status:<7} {seconds:7.1f} s  {len(written)} record(s)"
                if error:
                    line += f"  {error['ename']}: {error['evalue'].splitlines()[0][:120] if error['evalue'] else ''}"
                if progress:
                    bar.write(line, file=sys.stderr)
            bar.close()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # interrupted: keep the previous results whole
        raise

    failed = [o for o in outcomes if o.status != "ok"]
    summary = {
        "run_label": run_label,
        "run_mode": run_mode,
        "profile_id": profile.profile_id,
        "started_at": started.isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t_run, 2),
        "status": "failed" if failed else "ok",
        "python": sys.version.split()[0],
        "notebooks": [asdict(o) for o in outcomes],
    }
    (staging / "run.json").write_text(json.dumps(summary, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    records = [results.read_record(p) for p in results.record_paths(staging) if _valid(p)]
    (staging / "REGISTRY.md").write_text(results.registry_markdown(records, run_label), encoding="utf-8")
    _replace_dir(staging, results_root / run_label)
    if progress:
        print(
            f"{len(outcomes) - len(failed)}/{len(outcomes)} notebooks ok; results in {results_root / run_label}",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _valid(path: Path) -> bool:
    try:
        results.read_record(path)
        return True
    except TrainmechError:
        return False
