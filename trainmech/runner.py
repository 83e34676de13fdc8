"""Headless execution of the Task notebooks with nbclient.

`run(...)` executes the notebooks, each in its own kernel and `jobs` at once (trainmech.execution),
with RUN_MODE / RUN_LABEL (and any `-p` overrides, see trainmech.parameters) injected after the
cell tagged `parameters`. Everything of one run is built in a staging folder: executed notebooks
under `notebooks/`, the records and check logs (`checks/`) the notebooks write, `run.json` (per
notebook: status, seconds, records, error) and `REGISTRY.md`.

Where it goes at the end:
- every notebook of the run succeeded: it replaces `results/<label>/` as a whole. With `only`,
  the other notebooks' records and executed copies of the label are kept (merged), not dropped.
- a notebook failed or timed out: it goes to `results/<label>.partial/` (replacing an earlier
  partial run) and `results/<label>/` stays as it was.
- SIGINT / SIGTERM: the kernels are killed, the staging folder is removed, nothing else changes,
  and `Interrupted` is raised (the command line exits 130 / 143).
A failing notebook does not stop the others. One run per label at a time (a lock file).

Kernels run the interpreter that runs the runner (ipykernel's own `python3` spec) and import this
checkout's `trainmech` (its root goes first on their PYTHONPATH): no venv, no installed copy and
no `jupyter` command are needed, so a bare Python with the packages on PYTHONPATH will do.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmech import execution, parameters, profiles, results, runfolder
from trainmech.errors import TrainmechError, no_cuda
from trainmech.execution import Interrupted, Job, NotebookResult, Progress, Signals, task_key  # noqa: F401
from trainmech.results import PARTIAL_SUFFIX, REPO_ROOT, RESULTS_ENV

__all__ = [
    "NOTEBOOKS_DIR",
    "RESULTS_ROOT",
    "TASK_RE",
    "MAX_TIMEOUT",
    "discover",
    "inject_parameters",
    "plan_overrides",
    "check_timeout",
    "check_run_label",
    "run",
    "check_destination",
    "records_into",
    "refresh_in_place",
    "TIME_KEY",
    "VARIES",
    "compare_runs",
    "benchmark_jobs",
]

if TYPE_CHECKING:
    pass  # imported where used: it takes seconds, and a refused command needs none of it

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
RESULTS_ROOT = REPO_ROOT / "results"
TASK_RE = re.compile(r"^Task(\d+)_[A-Za-z0-9_]+\.ipynb$")
MAX_TIMEOUT = 7 * 24 * 3600.0


def discover(notebooks_dir: Path = NOTEBOOKS_DIR, only: list[str] | None = None) -> list[Path]:
    """Task notebooks in Task order; `only` keeps those whose name starts with one of its items."""
    found = sorted(
        (p for p in notebooks_dir.glob("Task*.ipynb") if TASK_RE.match(p.name)),
        key=lambda p: (
            int(TASK_RE.match(p.name).group(1)),
            p.name,
        ),  # name breaks ties: glob order is arbitrary
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
    import nbformat

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


def check_timeout(timeout: Any) -> float:
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or not 0 < timeout <= MAX_TIMEOUT
    ):
        raise TrainmechError(
            f"--timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT:.0f}, got {timeout!r}"
        )
    return float(timeout)


def check_run_label(label: Any) -> str:
    results.check_label(label)
    if label.endswith(PARTIAL_SUFFIX):
        raise TrainmechError(
            f"labels ending in {PARTIAL_SUFFIX} name the folders of incomplete runs; choose another --label"
        )
    return label


def run(
    run_mode: str = "cpu",
    run_label: str = "local",
    *,
    only: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    timeout: float = 1200.0,
    jobs: int | None = None,
    notebooks_dir: Path | None = None,
    results_root: Path | None = None,
    progress: bool = True,
    allow_errors: bool = False,
) -> int:
    """Execute the notebooks, `jobs` kernels at once (default: see execution.choose_jobs); returns the exit
    code (0: all ok and results/<label>/ replaced; 1: a notebook failed or timed out and the run is in
    results/<label>.partial/). Bad input: TrainmechError, nothing written. notebooks_dir / results_root
    default to NOTEBOOKS_DIR / RESULTS_ROOT. allow_errors: a notebook goes on past a failing cell
    (gpu-check reads every cell's outcome); it is still "failed", with its first error."""
    profile = profiles.for_mode(run_mode)
    check_run_label(run_label)
    timeout = check_timeout(timeout)
    if profile.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise no_cuda(f"run mode {run_mode}", "use --mode cpu")
    notebooks_dir = Path(notebooks_dir or NOTEBOOKS_DIR).absolute()  # kernels run in the notebooks' folder
    notebooks = discover(notebooks_dir, only)
    if not notebooks:
        raise TrainmechError(f"no Task notebooks found in {notebooks_dir}")
    planned = plan_overrides(notebooks, overrides or {})
    root = Path(results_root or RESULTS_ROOT).absolute()
    execution.choose_jobs(jobs, len(notebooks), profile.device, None)  # refuse a bad --jobs before writing
    check_destination(root, run_label, profile.run_mode, bool(only))  # refuse before writing anything
    signals = Signals()
    with signals.installed(), runfolder.label_lock(root, run_label):
        previous = check_destination(root, run_label, profile.run_mode, bool(only))  # again, under the lock
        staging = root / f".staging-{run_label}-{os.getpid()}"
        try:
            _new_staging(root, run_label, staging)
            plan = _Plan(profile, run_label, notebooks, planned, bool(only), timeout, jobs, root, previous)
            return _run_in(staging, signals, plan, progress=progress, allow_errors=allow_errors)
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
        raise TrainmechError(
            f"results/{label} has no run.json to merge --only into; run every notebook or choose another --label"
        )
    if previous.get("run_mode") != run_mode:
        raise TrainmechError(
            f"results/{label} holds a {previous.get('run_mode')!r} run; --only merges only into a run of the same mode"
        )
    return previous


def _new_staging(root: Path, label: str, staging: Path) -> None:
    runfolder.remove_stale(root, label)
    try:
        runfolder.new_staging(staging)
    except OSError as e:
        raise TrainmechError(f"cannot write into {root} ({e.strerror}); no notebook was run") from None


@dataclass(frozen=True)
class _Plan:
    """What `run` settled before writing anything: the notebooks to execute and where the run goes."""

    profile: profiles.Profile
    run_label: str
    notebooks: list[Path]  # in Task order
    planned: dict[str, dict[str, Any]]  # notebook stem -> its parameter overrides
    only: bool  # a run of some notebooks (--only), merged into the label's last run
    timeout: float  # seconds per cell
    jobs: int | None  # --jobs, None: execution.choose_jobs decides
    root: Path  # the results folder
    previous: dict | None  # with only: the run.json merged into


def _run_in(staging: Path, signals: Signals, plan: _Plan, *, progress: bool, allow_errors: bool) -> int:
    """The run itself, built in staging, then moved to results/<label>/ or results/<label>.partial/."""
    target = plan.root / plan.run_label
    last = plan.previous or _last_summary(target)  # what the label's last run measured: times, memory
    n_jobs, note = execution.choose_jobs(plan.jobs, len(plan.notebooks), plan.profile.device, last)
    order = (
        plan.notebooks
        if n_jobs == 1
        else [
            next(p for p in plan.notebooks if p.stem == stem)
            for stem in execution.longest_first([p.stem for p in plan.notebooks], last)
        ]
    )
    (staging / "notebooks").mkdir()
    work = []
    for path in order:
        records_dir = staging / ".records" / path.stem
        records_dir.mkdir(parents=True)
        params = {"RUN_MODE": plan.profile.run_mode, "RUN_LABEL": plan.run_label, **plan.planned[path.stem]}
        work.append(
            Job(
                path,
                params,
                staging / "notebooks" / path.name,
                records_dir,
                plan.timeout,
                plan.planned[path.stem],
                allow_errors=allow_errors,
            )
        )
    show = Progress(progress, len(work))
    if note:
        show.write(note)
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    outcomes = execution.execute_all(work, n_jobs, show, plan.run_label)
    signals.holding = True  # from here the run is written whole or not at all
    if signals.received:
        raise Interrupted(signals.received)
    complete = all(o.status == "ok" for o in outcomes)
    destination = target if complete else plan.root / f"{plan.run_label}{PARTIAL_SUFFIX}"
    try:
        entries = _assemble(staging, target, plan.previous, outcomes)
        summary = {
            "run_label": plan.run_label,
            "run_mode": plan.profile.run_mode,
            "profile_id": plan.profile.profile_id,
            "started_at": started.isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - t0, 2),
            "status": "ok" if all(e["status"] == "ok" for e in entries) else "failed",
            "only": [p.stem for p in plan.notebooks] if plan.only else None,
            "jobs": n_jobs,
            "peak_rss_sum_bytes": execution.peak_rss_sum(work),
            "python": sys.version.split()[0],
            "environment": _provenance(plan.profile),
            "notebooks": entries,
        }
        runfolder.write_json(staging / "run.json", summary)
        records, invalid = results.read_run(staging, plan.run_label)
        (staging / "REGISTRY.md").write_text(
            results.registry_markdown(records, plan.run_label, invalid), encoding="utf-8"
        )
        if signals.received:
            raise Interrupted(signals.received)
        runfolder.replace_dir(staging, destination)
    except OSError as e:
        raise TrainmechError(
            f"could not write the run's results ({e.strerror or e}: {e.filename}); results/{plan.run_label} is unchanged"
        ) from None
    if complete:
        shutil.rmtree(plan.root / f"{plan.run_label}{PARTIAL_SUFFIX}", ignore_errors=True)  # superseded
    if progress:
        ok = sum(o.status == "ok" for o in outcomes)
        where = (
            f"results in {destination}"
            if complete
            else f"incomplete run kept in {destination}; {target} is unchanged"
        )
        print(f"{ok}/{len(outcomes)} notebooks ok; {where}", file=sys.stderr)
    return 0 if complete else 1


def _last_summary(folder: Path) -> dict | None:
    """The folder's run.json when readable (only to plan the next run), else None."""
    try:
        return runfolder.read_run_json(folder)
    except TrainmechError:
        return None


def _assemble(
    staging: Path, target: Path, previous: dict | None, outcomes: list[NotebookResult]
) -> list[dict]:
    """Move each notebook's records and check log into staging (Task order: a later notebook's file wins, as
    when run one after another); with a previous run to merge into, keep its other notebooks' records,
    executed copies and check logs first.
    Returns run.json's notebook entries in Task order."""
    entries = {o.notebook: asdict(o) for o in outcomes}
    if previous is not None:
        rerun = set(entries)
        dropped = {
            name for n in previous["notebooks"] if n["notebook"] in rerun for name in n.get("records") or []
        }
        for path in results.record_paths(target):
            if path.name not in dropped:
                shutil.copy2(path, staging / path.name)
        for kind, pattern in (("notebooks", "*.ipynb"), ("checks", "*.jsonl")):
            for path in sorted((target / kind).glob(pattern)):
                if path.stem not in rerun:
                    (staging / kind).mkdir(exist_ok=True)
                    shutil.copy2(path, staging / kind / path.name)
        for n in previous["notebooks"]:
            entries.setdefault(n["notebook"], n)
    for o in outcomes:
        own = staging / ".records" / o.notebook
        for name in o.records:
            os.replace(own / name, staging / name)
        for log in sorted((own / "checks").glob("*.jsonl")):  # each check the notebook ran (trainmech.checks)
            (staging / "checks").mkdir(exist_ok=True)
            os.replace(log, staging / "checks" / log.name)
    shutil.rmtree(staging / ".records")
    return [entries[k] for k in sorted(entries, key=task_key)]


def _provenance(profile: profiles.Profile) -> dict[str, Any]:
    """run.json's environment: the CPU and kernels the notebooks' numbers came from (session.provenance)."""
    from trainmech import session

    threads = session.CPU_THREADS if profile.device == "cpu" else None  # CPU-mode kernels run one thread
    return session.provenance(threads)


@contextlib.contextmanager
def records_into(folder: str | Path):
    """While inside, kernels started here by nbclient itself (refresh, portability) get the runner's
    kernel environment (execution.kernel_env): records into folder, this checkout's trainmech."""
    env = execution.kernel_env(Path(folder))
    with execution.environ_set({name: env[name] for name in (RESULTS_ENV, "PYTHONPATH")}):
        yield


def refresh_in_place(paths: list[Path], timeout: float = 1200.0) -> list[tuple[str, str, dict | None]]:
    """Re-execute notebooks with their own default parameters and write the outputs back.

    This is how the committed notebooks get the outputs of a CPU run that nbval compares
    against. Records go to a throw-away folder, never into results/. A notebook that fails is
    left unchanged on disk.
    """
    import nbformat

    outcomes = []
    with tempfile.TemporaryDirectory(prefix="trainmech-refresh-") as scratch, records_into(scratch):
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            client = execution.notebook_client(nb, path, timeout=int(timeout))
            try:
                client.execute()
            except Exception as e:  # keep the committed copy when the run fails
                outcomes.append(
                    (
                        path.stem,
                        "failed",
                        execution.first_error(nb) or {"ename": type(e).__name__, "evalue": str(e)[:500]},
                    )
                )
                continue
            nbformat.write(execution.merge_streams(nb), path)  # the same stream chunks as a run's copy
            outcomes.append((path.stem, "ok", None))
    return outcomes


# ----------------------------------------------------------------------------- --jobs 1 beside --jobs N

TIME_KEY = re.compile(
    r"(time|wait).*_s(_|$)"
)  # record fields holding seconds: step_time_median_s, h2d_wait_s, …
VARIES = [
    (re.compile(r"\d+(\.\d+)?\s?(s|ms|µs|秒)\b"), "<TIME>"),
    (re.compile(r"0x[0-9a-fA-F]{6,}"), "<ADDRESS>"),
]
# ^ what honestly varies in printed outputs: the sanitizers of tests/nbval_sanitize.cfg


def _without_times(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<TIME>" if TIME_KEY.search(k) else _without_times(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


def _outputs(path: Path) -> list[str]:
    """Every output of an executed notebook as text, with times and addresses masked."""
    import nbformat

    texts = []
    for cell in nbformat.read(path, as_version=4).cells:
        for out in cell.get("outputs", []):
            text = json.dumps(out, sort_keys=True, ensure_ascii=False)
            for pattern, mask in VARIES:
                text = pattern.sub(mask, text)
            texts.append(text)
    return texts


def compare_runs(a: Path, b: Path) -> list[str]:
    """How two run folders differ apart from times: record files (fields holding seconds masked) and the
    executed notebooks' outputs (times and addresses masked). Empty: they agree."""
    out = []
    names = sorted({p.name for p in results.record_paths(a)} | {p.name for p in results.record_paths(b)})
    for name in names:
        pa, pb = a / name, b / name
        if not (pa.exists() and pb.exists()):
            out.append(f"{name}: only in {(a if pa.exists() else b).name}")
        elif _without_times(json.loads(pa.read_text(encoding="utf-8"))) != _without_times(
            json.loads(pb.read_text(encoding="utf-8"))
        ):
            out.append(f"{name}: differs beyond its times")
    for pa in sorted((a / "notebooks").glob("*.ipynb")):
        pb = b / "notebooks" / pa.name
        if not pb.exists():
            out.append(f"notebooks/{pa.name}: only in {a.name}")
        elif _outputs(pa) != _outputs(pb):
            n = sum(x != y for x, y in zip(_outputs(pa), _outputs(pb))) + abs(
                len(_outputs(pa)) - len(_outputs(pb))
            )
            out.append(f"notebooks/{pa.name}: {n} output(s) differ beyond times")
    return out


def benchmark_jobs(
    jobs: int = 2, *, notebooks_dir: Path | None = None, timeout: float = 1200.0, out=print
) -> float:
    """Run every notebook in CPU mode with --jobs 1, then with --jobs N, into a throw-away results folder;
    print both wall times, their ratio and whether records and outputs agree apart from times. Returns the ratio."""
    seconds, folders = {}, {}
    with tempfile.TemporaryDirectory(prefix="trainmech-benchmark-") as scratch:
        for n in (1, jobs):
            root = Path(scratch) / f"jobs-{n}"
            t0 = time.perf_counter()
            code = run(
                "cpu",
                "benchmark",
                jobs=n,
                timeout=timeout,
                notebooks_dir=notebooks_dir,
                results_root=root,
                progress=False,
            )
            seconds[n] = time.perf_counter() - t0
            folders[n] = root / ("benchmark" if code == 0 else f"benchmark{PARTIAL_SUFFIX}")
            summary = json.loads((folders[n] / "run.json").read_text(encoding="utf-8"))
            peak = summary.get("peak_rss_sum_bytes")
            out(
                f"--jobs {summary['jobs']}: {seconds[n]:7.1f} s  {'all notebooks ok' if code == 0 else 'a notebook failed'}"
                + (f"; kernels' peak RSS together {peak / 2**30:.2f} GiB" if peak else "")
            )
        ratio = seconds[1] / seconds[jobs]
        out(f"ratio (--jobs 1 time / --jobs {jobs} time): {ratio:.2f}")
        differences = compare_runs(folders[1], folders[jobs])
        out(
            "records and executed outputs: identical apart from times"
            if not differences
            else "records and executed outputs differ beyond times:\n  " + "\n  ".join(differences)
        )
    return ratio
