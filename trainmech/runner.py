"""Headless execution of the Task notebooks with nbclient.

`run(...)` executes the notebooks, each in its own kernel, with RUN_MODE / RUN_LABEL (and any
`-p` overrides, see trainmech.parameters) injected after the cell tagged `parameters`. Everything
of one run is built in a staging folder: executed notebooks under `notebooks/`, the records the
notebooks write, `run.json` (per notebook: status, seconds, records, error) and `REGISTRY.md`.

Where it goes at the end:
- every notebook of the run succeeded: it replaces `results/<label>/` as a whole. With `only`,
  the other notebooks' records and executed copies of the label are kept (merged), not dropped.
- a notebook failed or timed out: it goes to `results/<label>.partial/` (replacing an earlier
  partial run) and `results/<label>/` stays as it was.
- SIGINT / SIGTERM: the kernels are killed, the staging folder is removed, nothing else changes,
  and `Interrupted` is raised (the command line exits 130 / 143).
A failing notebook does not stop the others. One run per label at a time (a lock file).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import nbformat

from trainmech import parameters, profiles, results, runfolder
from trainmech.errors import TrainmechError
from trainmech.results import PARTIAL_SUFFIX, REPO_ROOT, RESULTS_ENV

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
RESULTS_ROOT = REPO_ROOT / "results"
TASK_RE = re.compile(r"^Task(\d+)_[A-Za-z0-9_]+\.ipynb$")
MAX_TIMEOUT = 7 * 24 * 3600.0
STOP_GRACE = 10.0  # seconds to wait for killed kernels' threads before giving up on them
POLL = 0.1  # seconds between the main thread's looks at deadlines, signals and progress


class Interrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT or SIGTERM; nothing was written. exit_code: 128 + the signal."""

    def __init__(self, signum: int):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(signal.Signals(signum).name)


@dataclass
class NotebookResult:
    notebook: str
    status: str  # "ok" | "failed" | "timeout"
    seconds: float
    records: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)  # the -p overrides it received


@dataclass
class Job:
    """One notebook while it executes in a worker thread; the main thread watches it."""

    path: Path
    params: dict[str, Any]
    out_path: Path
    records_dir: Path
    timeout: float
    overrides: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0
    cell: int | None = None  # index of the cell executing now
    client: Any = None  # the nbclient.NotebookClient, once made
    thread: threading.Thread | None = None
    timed_out: bool = False
    stopped: bool = False
    outcome: tuple[str, dict | None] | None = None

    @property
    def stem(self) -> str:
        return self.path.stem


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


inject_parameters = parameters.inject_parameters  # the runner's public name since the first version


def plan_overrides(notebooks: list[Path], overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{notebook stem: its typed overrides}: each override goes to the notebooks whose parameters
    cell assigns it; refused when no notebook of the run assigns it or a value has the wrong type."""
    texts = {parameters.check_name(k): v if isinstance(v, str) else repr(v) for k, v in overrides.items()}
    defaults = {}
    for path in notebooks:
        try:
            defaults[path.stem] = parameters.notebook_parameters(nbformat.read(path, as_version=4))
        except (TrainmechError, ValueError, OSError):
            defaults[path.stem] = {}  # no usable parameters cell: the notebook fails when it runs
    planned: dict[str, dict[str, Any]] = {stem: {} for stem in defaults}
    for name, text in texts.items():
        takers = [stem for stem, d in defaults.items() if name in d]
        if not takers:
            assigned = sorted({n for d in defaults.values() for n in d} - set(parameters.RESERVED))
            raise TrainmechError(
                f"-p {name}: no notebook of this run assigns {name} in its parameters cell; they assign: "
                f"{', '.join(assigned) or 'nothing'}"
            )
        for stem in takers:
            try:
                planned[stem][name] = parameters.parse_override(name, text, defaults[stem])
            except TrainmechError as e:
                raise TrainmechError(f"{stem}: {e}") from None
    return planned


def _first_error(nb: nbformat.NotebookNode) -> dict[str, Any] | None:
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return {"ename": out.get("ename"), "evalue": str(out.get("evalue"))[:500], "cell": i}
    return None


def _error(e: BaseException, cell: int | None = None) -> dict[str, Any]:
    return {"ename": type(e).__name__, "evalue": str(e)[:500], "cell": cell}


def execute_notebook(job: Job) -> tuple[str, dict | None]:
    """Execute one notebook into job.out_path (in a worker thread); returns (status, error), never raises
    for the notebook's errors. The kernel writes its records into job.records_dir."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    try:
        nb = parameters.inject_parameters(nbformat.read(job.path, as_version=4), job.params)
    except (ValueError, OSError) as e:  # no `parameters` cell (TrainmechError), or not a notebook
        return "failed", _error(e)
    job.client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=None,  # the runner's watch enforces the notebook's time limit as a whole
        record_timing=False,  # no execution timestamps: re-runs diff cleanly
        resources={"metadata": {"path": str(job.path.parent)}},
        on_cell_start=lambda cell, cell_index: setattr(job, "cell", cell_index),
    )
    status, error = "ok", None
    try:
        if job.stopped or job.timed_out:
            raise RuntimeError("stopped before the kernel started")
        # nbclient adds its own SIGINT / SIGTERM handlers only in the main thread: here it cannot
        asyncio.run(job.client.async_execute(env={**os.environ, RESULTS_ENV: str(job.records_dir)}))
    except CellExecutionError as e:
        status, error = "failed", _first_error(nb) or _error(e)
    except Exception as e:  # the kernel died or did not start, a malformed notebook, …: this notebook fails
        status, error = "failed", _error(e, job.cell)
    if job.timed_out:
        limit = f"{job.timeout:g} s"
        status, error = "timeout", {"ename": "Timeout", "evalue": f"the notebook ran past its limit of {limit}", "cell": job.cell}
    if not job.stopped:
        try:
            nbformat.write(nb, job.out_path)
        except OSError as e:
            status, error = "failed", _error(e)
    return status, error


def _kill_kernel(job: Job) -> None:
    """SIGKILL the job's kernel (and its process group) if it is running and not yet reaped."""
    km = getattr(job.client, "km", None)
    process = getattr(getattr(km, "provisioner", None), "process", None)
    if process is None or process.poll() is not None:  # not started, or reaped: its pid may be another's now
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)  # jupyter_client starts kernels in a session of their own
    except OSError:
        with contextlib.suppress(OSError):
            process.kill()


class Signals:
    """While installed, SIGINT and SIGTERM raise Interrupted in the main thread; once `holding`,
    they are only noted (for the end of a run, and for the cleanup after the first one)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.holding = False

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum
        if not self.holding:
            self.holding = True
            raise Interrupted(signum)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
            yield self
            return
        previous = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class Progress:
    """One line per notebook as it starts and as it ends (stderr)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.done = enabled, total, 0

    def write(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr, flush=True)

    def started(self, job: Job) -> None:
        self.write(f"{job.stem:<28} started")

    def finished(self, job: Job, result: NotebookResult) -> None:
        self.done += 1
        line = f"{result.notebook:<28} {result.status:<7} {result.seconds:7.1f} s  {len(result.records)} record(s)"
        if result.error:
            evalue = result.error["evalue"].splitlines()[0][:120] if result.error["evalue"] else ""
            line += f"  {result.error['ename']}: {evalue}"
        self.write(f"{line}  [{self.done}/{self.total}]")

    def tick(self, running: list[Job]) -> None:
        pass


def execute_all(jobs: list[Job], n_jobs: int, progress: Progress, label: str) -> list[NotebookResult]:
    """Run the jobs in n_jobs worker threads, in the given order; the calling thread enforces the time
    limits and, on any exception (Interrupted), kills the kernels before it re-raises."""
    pending, running, done = list(jobs), [], queue.Queue()

    def work(job: Job) -> None:
        try:
            job.outcome = execute_notebook(job)
        except BaseException as e:  # noqa: BLE001 - report anything to the main thread
            job.outcome = ("failed", _error(e))
        finally:
            done.put(job)

    out: dict[str, NotebookResult] = {}
    try:
        while pending or running:
            while pending and len(running) < n_jobs:
                job = pending.pop(0)
                job.started = time.monotonic()
                job.thread = threading.Thread(target=work, args=(job,), name=f"trainmech-{job.stem}", daemon=True)
                running.append(job)
                progress.started(job)
                job.thread.start()
            with contextlib.suppress(queue.Empty):
                job = done.get(timeout=POLL)
                running.remove(job)
                out[job.stem] = _result(job, label)
                progress.finished(job, out[job.stem])
            now = time.monotonic()
            for job in running:
                job.timed_out = job.timed_out or now - job.started > job.timeout
                if job.timed_out:
                    _kill_kernel(job)  # again on every look: the kernel may have been starting
            progress.tick(running)
    except BaseException:
        _stop(running)
        raise
    return [out[j.stem] for j in sorted(jobs, key=lambda j: _task_key(j.stem))]


def _stop(running: list[Job]) -> None:
    """Kill the running kernels and give their threads a moment to end."""
    for job in running:
        job.stopped = True
    deadline = time.monotonic() + STOP_GRACE
    while any(j.thread and j.thread.is_alive() for j in running) and time.monotonic() < deadline:
        for job in running:
            _kill_kernel(job)
        time.sleep(POLL)


def _result(job: Job, label: str) -> NotebookResult:
    """The notebook's result: its outcome, its records (each validated: an invalid one fails it)."""
    status, error = job.outcome or ("failed", None)
    seconds = round(time.monotonic() - job.started, 2)
    names = [p.name for p in results.record_paths(job.records_dir)]
    _, invalid = results.read_run(job.records_dir, label)
    if invalid and status == "ok":
        name, reason = next(iter(sorted(invalid.items())))
        status, error = "failed", {"ename": "InvalidRecord", "evalue": reason, "cell": None}
    return NotebookResult(job.stem, status, seconds, names, error, job.overrides)


def _task_key(stem: str) -> tuple[int, str]:
    m = re.match(r"^Task(\d+)", stem)
    return (int(m.group(1)) if m else 10**9, stem)


def check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or not 0 < timeout <= MAX_TIMEOUT:
        raise TrainmechError(f"--timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT:.0f}, got {timeout!r}")
    return float(timeout)


def check_run_label(label: Any) -> str:
    results.check_label(label)
    if label.endswith(PARTIAL_SUFFIX):
        raise TrainmechError(f"labels ending in {PARTIAL_SUFFIX} name the folders of incomplete runs; choose another --label")
    return label


def run(
    run_mode: str = "cpu",
    run_label: str = "local",
    *,
    only: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    timeout: float = 1200.0,
    notebooks_dir: Path | None = None,
    results_root: Path | None = None,
    progress: bool = True,
) -> int:
    """Execute the notebooks; returns the exit code (0: all ok and results/<label>/ replaced; 1: a notebook
    failed or timed out and the run is in results/<label>.partial/). Bad input: TrainmechError, nothing written.
    notebooks_dir / results_root default to NOTEBOOKS_DIR / RESULTS_ROOT."""
    profile = profiles.for_mode(run_mode)
    check_run_label(run_label)
    timeout = check_timeout(timeout)
    if profile.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TrainmechError(f"run mode {run_mode} needs a CUDA GPU and this machine has none; use --mode cpu")
    notebooks_dir = Path(notebooks_dir or NOTEBOOKS_DIR).absolute()  # kernels run in the notebooks' folder
    notebooks = discover(notebooks_dir, only)
    if not notebooks:
        raise TrainmechError(f"no Task notebooks found in {notebooks_dir}")
    planned = plan_overrides(notebooks, overrides or {})
    root = Path(results_root or RESULTS_ROOT).absolute()
    check_destination(root, run_label, profile.run_mode, bool(only))  # refuse before writing anything
    signals = Signals()
    with signals.installed(), runfolder.label_lock(root, run_label):
        previous = check_destination(root, run_label, profile.run_mode, bool(only))  # again, under the lock
        staging = _new_staging(root, run_label)
        try:
            return _run_in(staging, signals, profile, run_label, notebooks, planned, only, timeout, root, previous, progress)
        except BaseException:
            signals.holding = True  # a second Ctrl-C must not cut the cleanup short
            shutil.rmtree(staging, ignore_errors=True)
            raise


def check_destination(root: Path, label: str, run_mode: str, merge: bool) -> dict | None:
    """Refuse a label whose folder a run may not replace; with merge (--only), the run.json merged into."""
    target = root / label
    runfolder.check_target(target)
    if not merge or not target.is_dir():
        return None
    previous = runfolder.read_run_json(target)
    if previous is None:
        raise TrainmechError(f"results/{label} has no run.json to merge --only into; run every notebook or choose another --label")
    if previous.get("run_mode") != run_mode:
        raise TrainmechError(f"results/{label} holds a {previous.get('run_mode')!r} run; --only merges only into a run of the same mode")
    return previous


def _new_staging(root: Path, label: str) -> Path:
    runfolder.remove_stale(root, label)
    try:
        return runfolder.new_staging(root, label)
    except OSError as e:
        raise TrainmechError(f"cannot write into {root} ({e.strerror}); no notebook was run") from None


def _run_in(staging, signals, profile, run_label, notebooks, planned, only, timeout, root, previous, progress) -> int:
    """The run itself, built in staging, then moved to results/<label>/ or results/<label>.partial/."""
    target = root / run_label
    (staging / "notebooks").mkdir()
    jobs = []
    for path in notebooks:
        records_dir = staging / ".records" / path.stem
        records_dir.mkdir(parents=True)
        params = {"RUN_MODE": profile.run_mode, "RUN_LABEL": run_label, **planned[path.stem]}
        jobs.append(Job(path, params, staging / "notebooks" / path.name, records_dir, timeout, planned[path.stem]))
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    outcomes = execute_all(jobs, 1, Progress(progress, len(jobs)), run_label)
    signals.holding = True  # from here the run is written whole or not at all
    if signals.received:
        raise Interrupted(signals.received)
    complete = all(o.status == "ok" for o in outcomes)
    destination = target if complete else root / f"{run_label}{PARTIAL_SUFFIX}"
    try:
        entries = _assemble(staging, target, previous, outcomes)
        summary = {
            "run_label": run_label,
            "run_mode": profile.run_mode,
            "profile_id": profile.profile_id,
            "started_at": started.isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - t0, 2),
            "status": "ok" if all(e["status"] == "ok" for e in entries) else "failed",
            "only": [p.stem for p in notebooks] if only else None,
            "python": sys.version.split()[0],
            "environment": _provenance(profile),
            "notebooks": entries,
        }
        runfolder.write_json(staging / "run.json", summary)
        records, invalid = results.read_run(staging, run_label)
        (staging / "REGISTRY.md").write_text(results.registry_markdown(records, run_label, invalid), encoding="utf-8")
        if signals.received:
            raise Interrupted(signals.received)
        runfolder.replace_dir(staging, destination)
    except OSError as e:
        raise TrainmechError(
            f"could not write the run's results ({e.strerror or e}: {e.filename}); results/{run_label} is unchanged"
        ) from None
    if complete:
        shutil.rmtree(root / f"{run_label}{PARTIAL_SUFFIX}", ignore_errors=True)  # superseded
    if progress:
        ok = sum(o.status == "ok" for o in outcomes)
        where = f"results in {destination}" if complete else f"incomplete run kept in {destination}; {target} is unchanged"
        print(f"{ok}/{len(outcomes)} notebooks ok; {where}", file=sys.stderr)
    return 0 if complete else 1


def _assemble(staging: Path, target: Path, previous: dict | None, outcomes: list[NotebookResult]) -> list[dict]:
    """Move each notebook's records into staging (Task order: a later notebook's file wins, as when run one
    after another); with a previous run to merge into, keep its other notebooks' records and copies first.
    Returns run.json's notebook entries in Task order."""
    entries = {o.notebook: asdict(o) for o in outcomes}
    if previous is not None:
        rerun = set(entries)
        dropped = {name for n in previous["notebooks"] if n["notebook"] in rerun for name in n.get("records") or []}
        for path in results.record_paths(target):
            if path.name not in dropped:
                shutil.copy2(path, staging / path.name)
        for path in sorted((target / "notebooks").glob("*.ipynb")):
            if path.stem not in rerun:
                shutil.copy2(path, staging / "notebooks" / path.name)
        for n in previous["notebooks"]:
            entries.setdefault(n["notebook"], n)
    for o in outcomes:
        for name in o.records:
            os.replace(staging / ".records" / o.notebook / name, staging / name)
    shutil.rmtree(staging / ".records")
    return [entries[k] for k in sorted(entries, key=_task_key)]


def _provenance(profile: profiles.Profile) -> dict[str, Any]:
    """run.json's environment: the CPU and kernels the notebooks' numbers came from (session.provenance)."""
    from trainmech import session

    threads = session.CPU_THREADS if profile.device == "cpu" else None  # CPU-mode kernels run one thread
    return session.provenance(threads)


@contextlib.contextmanager
def records_into(folder: str | Path):
    """While inside, RESULTS_ENV points at folder: kernels started here write their records there."""
    previous = os.environ.get(RESULTS_ENV)
    os.environ[RESULTS_ENV] = str(folder)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RESULTS_ENV, None)
        else:
            os.environ[RESULTS_ENV] = previous


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
