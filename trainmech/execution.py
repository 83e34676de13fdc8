"""Executing notebooks in kernels, several at once, under the runner's watch.

    jobs = [Job(path, params, out_path, records_dir, timeout), …]
    results = execute_all(jobs, n_jobs, Progress(True, len(jobs)), label)

Each notebook runs in a worker thread with its own event loop and kernel (nbclient). nbclient
installs SIGINT / SIGTERM handlers only when it runs in the main thread, so here the main thread
keeps the signals: it watches every job's time limit, shows what runs, reads each kernel's peak
RSS, and on an exception (Interrupted) kills every kernel before it re-raises.
`choose_jobs` and `longest_first` decide how many at once and in which order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from trainmech import parameters, results
from trainmech.errors import TrainmechError
from trainmech.results import REPO_ROOT, RESULTS_ENV

__all__ = [
    "STOP_GRACE",
    "POLL",
    "GiB",
    "DEFAULT_KERNEL_BYTES",
    "MEMORY_SHARE",
    "Interrupted",
    "NotebookResult",
    "Job",
    "first_error",
    "notebook_client",
    "execute_notebook",
    "kernel_env",
    "environ_set",
    "merge_streams",
    "Signals",
    "Progress",
    "execute_all",
    "task_key",
    "peak_rss_sum",
    "longest_first",
    "usable_cores",
    "available_memory",
    "choose_jobs",
]

if TYPE_CHECKING:
    import nbformat  # imported where used: it takes seconds

STOP_GRACE = 10.0  # seconds to wait for killed kernels' threads before giving up on them
POLL = 0.1  # seconds between the main thread's looks at deadlines, signals and progress
GiB = 1 << 30
DEFAULT_KERNEL_BYTES = 2 * GiB  # a kernel's peak RSS before any run measured one (CPU mode: about 0.5 GiB)
MEMORY_SHARE = 0.8  # of the available memory that kernels may fill


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
    peak_rss_bytes: int | None = None  # the kernel's peak resident memory (Linux; else null)


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
    ended: float = 0.0
    cell: int | None = None  # index of the cell executing now
    cells: int = 0
    peak_rss: int | None = None
    client: Any = None  # the nbclient.NotebookClient, once made
    thread: threading.Thread | None = None
    timed_out: bool = False
    stopped: bool = False
    outcome: tuple[str, dict | None] | None = None
    allow_errors: bool = False  # go on past a failing cell (the notebook still fails, with its first error)

    @property
    def stem(self) -> str:
        return self.path.stem


def first_error(nb: nbformat.NotebookNode) -> dict[str, Any] | None:
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return {"ename": out.get("ename"), "evalue": str(out.get("evalue"))[:500], "cell": i}
    return None


def _error(e: BaseException, cell: int | None = None) -> dict[str, Any]:
    return {"ename": type(e).__name__, "evalue": str(e)[:500], "cell": cell}


def notebook_client(nb: Any, path: Path, **options: Any) -> Any:
    """The nbclient client every headless execution uses (runner, refresh, portability): the
    notebook runs from its own folder with no execution timestamps, and its kernel talks over
    encrypted sockets (CurveZMQ), as the project's .jupyter/ settings give JupyterLab's kernels.

    A kernel whose cells all ran without an error is killed at the end (nbclient's "immediate"
    shutdown, as nbval does): by then it has written all it writes (records and check logs are
    closed as they are written, outputs arrive before each cell's reply), and the interpreter's
    own teardown with torch loaded costs about a second of CPU per notebook. After a cell error
    the kernel shuts down gracefully, so that finalizers of what the notebook left behind (a
    temporary folder whose cleanup cell it never reached) still run."""
    from nbclient import NotebookClient
    from traitlets.config import Config

    chained = options.pop("on_cell_error", None)
    client = NotebookClient(
        nb,
        config=Config({"KernelManager": {"transport_encryption": "auto"}}),
        kernel_name="python3",
        record_timing=False,  # no execution timestamps: re-runs diff cleanly
        resources={"metadata": {"path": str(Path(path).parent)}},
        shutdown_kernel="immediate",
        **options,
    )

    def on_cell_error(**hook: Any) -> Any:
        client.shutdown_kernel = "graceful"
        return chained(**hook) if chained is not None else None

    client.on_cell_error = on_cell_error
    return client


def execute_notebook(job: Job) -> tuple[str, dict | None]:
    """Execute one notebook into job.out_path (in a worker thread); returns (status, error), never raises
    for the notebook's errors. The kernel writes its records into job.records_dir."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    try:
        nb = parameters.inject_parameters(nbformat.read(job.path, as_version=4), job.params)
    except (ValueError, OSError) as e:  # no `parameters` cell (TrainmechError), or not a notebook
        return "failed", _error(e)
    job.cells = len(nb.cells)

    def cell_started(cell: Any, cell_index: int) -> None:
        job.cell = cell_index
        _read_peak_rss(job)

    job.client = notebook_client(
        nb,
        job.path,
        timeout=None,  # the runner's watch enforces the notebook's time limit as a whole
        on_cell_start=cell_started,
        on_cell_complete=lambda cell, cell_index: _read_peak_rss(job),
        allow_errors=job.allow_errors,
    )
    status, error = "ok", None
    try:
        if job.stopped or job.timed_out:
            raise RuntimeError("stopped before the kernel started")
        # nbclient adds its own SIGINT / SIGTERM handlers only in the main thread: here it cannot
        asyncio.run(job.client.async_execute(env=kernel_env(job.records_dir)))
        if job.allow_errors and first_error(nb):
            status, error = "failed", first_error(nb)
    except CellExecutionError as e:
        status, error = "failed", first_error(nb) or _error(e)
    except Exception as e:  # the kernel died or did not start, a malformed notebook, …: this notebook fails
        status, error = "failed", _error(e, job.cell)
    if job.timed_out:
        limit = f"{job.timeout:g} s"
        status, error = (
            "timeout",
            {"ename": "Timeout", "evalue": f"the notebook ran past its limit of {limit}", "cell": job.cell},
        )
    if not job.stopped:
        try:
            nbformat.write(merge_streams(nb), job.out_path)
        except OSError as e:
            status, error = "failed", _error(e)
    return status, error


def kernel_env(records_dir: Path) -> dict[str, str]:
    """The environment of a kernel the runner starts: its records go to records_dir (RESULTS_ENV), and it
    imports this checkout's trainmech (REPO_ROOT first on PYTHONPATH), whether or not a venv installed it."""
    paths = [
        str(REPO_ROOT),
        *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)),
    ]
    return {**os.environ, RESULTS_ENV: str(records_dir), "PYTHONPATH": os.pathsep.join(paths)}


@contextlib.contextmanager
def environ_set(variables: dict[str, str], unset: tuple[str, ...] = ()):
    """While inside, `os.environ` has `variables` set and the names in `unset` removed (a kernel started
    inside inherits them); on exit every one of those names is back as it was, set or not."""
    names = (*unset, *variables)
    saved = {k: os.environ.get(k) for k in names}
    for k in unset:
        os.environ.pop(k, None)
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def merge_streams(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Join consecutive stream outputs of the same name: how the kernel's prints arrive in chunks
    depends on timing, the text they make does not."""
    for cell in nb.cells:
        merged = []
        for out in cell.get("outputs", []):
            if (
                merged
                and out.get("output_type") == "stream"
                and merged[-1].get("output_type") == "stream"
                and merged[-1].get("name") == out.get("name")
            ):
                merged[-1]["text"] += out["text"]
            else:
                merged.append(out)
        if "outputs" in cell:
            cell.outputs = merged
    return nb


def _kernel_process(job: Job) -> Any:
    """The job's kernel process (subprocess.Popen) while it runs and is not yet reaped, else None:
    once reaped, its pid may already belong to another process."""
    km = getattr(job.client, "km", None)
    process = getattr(getattr(km, "provisioner", None), "process", None)
    return process if process is not None and process.poll() is None else None


def _kill_kernel(job: Job) -> None:
    """SIGKILL the job's kernel and its process group (jupyter_client starts kernels in a session of their own)."""
    process = _kernel_process(job)
    if process is None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        with contextlib.suppress(OSError):
            process.kill()


def _read_peak_rss(job: Job) -> None:
    """Keep the kernel's peak resident set size (VmHWM, Linux); elsewhere it stays None."""
    process = _kernel_process(job)
    if process is None:
        return
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{process.pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    job.peak_rss = max(job.peak_rss or 0, int(line.split()[1]) * 1024)
                    return


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
    """A line per notebook as it starts and as it ends; on a terminal, a status line below them that
    names every running notebook with its cell and seconds."""

    def __init__(self, enabled: bool, total: int, stream: TextIO | None = None, live: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled, self.total, self.done = enabled, total, 0
        self.live = enabled and (self.stream.isatty() if live is None else live)
        self._last = 0.0

    def write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\r\033[K" if self.live else "") + text + "\n")
            self.stream.flush()

    def started(self, job: Job) -> None:
        self.write(f"{job.stem:<28} started")

    def finished(self, job: Job, result: NotebookResult) -> None:
        self.done += 1
        line = f"{result.notebook:<28} {result.status:<7} {result.seconds:7.1f} s  {len(result.records)} record(s)"
        if result.error:
            evalue = result.error["evalue"].splitlines()[0][:120] if result.error["evalue"] else ""
            line += f"  {result.error['ename']}: {evalue}"
        self.write(f"{line}  [{self.done}/{self.total}]")

    def status(self, running: list[Job], now: float) -> str:
        parts = [
            f"{j.stem.split('_')[0]} cell {j.cell if j.cell is not None else '-'}/{j.cells or '?'} "
            f"{now - j.started:.0f}s"
            for j in running
        ]
        return f"[{self.done}/{self.total} done] running: " + " · ".join(parts)

    def tick(self, running: list[Job]) -> None:
        now = time.monotonic()
        if not self.live or not running or now - self._last < 0.5:
            return
        self._last = now
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write("\r\033[K" + self.status(running, now)[:width])
        self.stream.flush()


def execute_all(jobs: list[Job], n_jobs: int, progress: Progress, label: str) -> list[NotebookResult]:
    """Run the jobs, n_jobs at once, starting them in the given order; returns their results in Task
    order. The calling thread enforces the time limits and, on any exception (Interrupted), kills
    the kernels before it re-raises."""
    pending, running, done = list(jobs), [], queue.Queue()

    def work(job: Job) -> None:
        try:
            job.outcome = execute_notebook(job)
        except BaseException as e:  # noqa: BLE001 - report anything to the main thread
            job.outcome = ("failed", _error(e))
        finally:
            job.ended = time.monotonic()
            done.put(job)

    out: dict[str, NotebookResult] = {}
    try:
        while pending or running:
            while pending and len(running) < n_jobs:
                job = pending.pop(0)
                job.started = time.monotonic()
                job.thread = threading.Thread(
                    target=work, args=(job,), name=f"trainmech-{job.stem}", daemon=True
                )
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
                _read_peak_rss(job)
                job.timed_out = job.timed_out or now - job.started > job.timeout
                if job.timed_out:
                    _kill_kernel(job)  # again on every look: the kernel may have been starting
            progress.tick(running)
    except BaseException:
        _stop(running)
        raise
    return [out[j.stem] for j in sorted(jobs, key=lambda j: task_key(j.stem))]


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
    names = [p.name for p in results.record_paths(job.records_dir)]
    _, invalid = results.read_run(job.records_dir, label)
    if invalid and status == "ok":
        name, reason = next(iter(sorted(invalid.items())))
        status, error = "failed", {"ename": "InvalidRecord", "evalue": reason, "cell": None}
    seconds = round(job.ended - job.started, 2)
    return NotebookResult(job.stem, status, seconds, names, error, job.overrides, job.peak_rss)


def task_key(stem: str) -> tuple[int, str]:
    m = re.match(r"^Task(\d+)", stem)
    return (int(m.group(1)) if m else 10**9, stem)


def peak_rss_sum(jobs: list[Job]) -> int | None:
    """The most resident memory the concurrently running kernels held together: at each moment, the
    sum of the peak RSS of the kernels running then (an upper bound); None when none was measured."""
    if not any(j.peak_rss for j in jobs):
        return None
    events = sorted(
        [(j.started, 1, j.peak_rss or 0) for j in jobs] + [(j.ended, 0, -(j.peak_rss or 0)) for j in jobs]
    )
    total = best = 0
    for _, _, change in events:  # at equal times an end (0) comes before a start (1)
        total += change
        best = max(best, total)
    return best


def longest_first(stems: list[str], previous: dict | None) -> list[str]:
    """The order to start notebooks in: by the seconds each took in the previous run, longest first
    (a notebook without a previous time first of all: it may be the longest); Task order breaks ties."""
    seconds = {}
    for n in (previous or {}).get("notebooks", []):
        s = n.get("seconds") if isinstance(n, dict) else None
        if isinstance(s, (int, float)) and not isinstance(s, bool) and s >= 0:
            seconds[n["notebook"]] = s
    return sorted(stems, key=lambda s: (-seconds.get(s, float("inf")), task_key(s)))


def usable_cores() -> int:
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def available_memory() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil or no answer: no memory cap
        return None


def choose_jobs(
    requested: int | None, n_notebooks: int, device: str, previous: dict | None
) -> tuple[int, str | None]:
    """(kernels at once, a note when memory lowered the number). Default: the usable cores (1 on CUDA:
    one GPU, and its memory peaks and step times are the evidence). Then lowered so that the kernels
    fit in MEMORY_SHARE of the available memory, each counted at the largest peak RSS of the label's
    previous run (DEFAULT_KERNEL_BYTES before any run measured one)."""
    if requested is not None and (
        isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
    ):
        raise TrainmechError(f"--jobs must be a positive integer, got {requested!r}")
    if device == "cuda" and requested not in (None, 1):
        raise TrainmechError(
            "--jobs above 1 would run notebooks side by side on one GPU and distort the memory "
            "peaks and step times they measure; use --jobs 1 in TRAIN-CUDA-MECHANISM mode"
        )
    wanted = min(requested or (1 if device == "cuda" else usable_cores()), max(n_notebooks, 1))
    peaks = [n.get("peak_rss_bytes") for n in (previous or {}).get("notebooks", []) if isinstance(n, dict)]
    per_kernel = max(
        (p for p in peaks if isinstance(p, int) and not isinstance(p, bool) and p > 0),
        default=DEFAULT_KERNEL_BYTES,
    )
    free = available_memory()
    if free is None or wanted == 1:
        return wanted, None
    fits = max(1, int(free * MEMORY_SHARE // per_kernel))
    if fits >= wanted:
        return wanted, None
    return fits, (
        f"{wanted} kernels at once lowered to {fits}: {free / GiB:.1f} GiB of memory is available and a kernel "
        f"may take {per_kernel / GiB:.1f} GiB"
    )
