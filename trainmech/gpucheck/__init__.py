"""python -m trainmech gpu-check: run every CUDA-only branch once, small, and report.

    python -m trainmech gpu-check --dry-run     # any machine: the plan, the estimates, the 0.5B budget
    python -m trainmech gpu-check               # one CUDA GPU: limits, package branches, notebook cells
    python -m trainmech gpu-check --cpu         # self-test here: limits and package checks on the CPU

In order: (1) the machine's own limits (copy bandwidth, the baseline step's forward / backward
time at the Qwen2.5-0.5B shape, the offload bound they imply), (2) each package branch's check
(`branches.PACKAGE`) on the 2-layer model, (3) each notebook in TRAIN-CUDA-MECHANISM mode with
small workloads (`SMOKE`), every registered cell judged from the executed notebook. The report
goes to `<out>/gpu-check.json` and `<out>/gpu-check.md`; executed notebooks under `<out>/notebooks/`.
Exit status 0 when nothing failed but the failures an open issue expects (`Branch.known`).

Modules: `scan` finds the device-dependent sites, `branches` holds the registry, `checks` and
`strategy_checks` the package checks (`offload_overlap` the offload's overlap claim), `probe` what they run on (`Probe`) and how they fail, `limits`
measures the machine, `budget` predicts the full run, `notebooks` runs the notebook pass, `report`
writes the report, `bundle` keeps the carry bundle's list.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from trainmech.errors import TrainmechError, no_cuda
from trainmech.results import REPO_ROOT

__all__ = [
    "SMALL_PASS_BUDGET_S",
    "LIMITS_ESTIMATE_S",
    "SMOKE_EXTRA_S",
    "FULL_SHAPE",
    "plan_lines",
    "measure_limits",
    "run",
    "build_parser",
    "main",
]

SMALL_PASS_BUDGET_S = 180.0
LIMITS_ESTIMATE_S = 25.0
SMOKE_EXTRA_S = (
    6.0  # per notebook on CUDA beyond its CPU reference seconds: CUDA start, the 0.5B-vocabulary model
)
FULL_SHAPE = ("qwen2.5-0.5b", 2, 512)  # the baseline step whose phases bound the offload (b2s512_default*)


# ----------------------------------------------------------------------------- the plan (dry run)


def plan_lines() -> list[str]:
    """What a CUDA run would do, with its estimates and the full run's budget; executes nothing."""
    from trainmech.gpucheck import branches, budget, scan
    from trainmech.gpucheck.notebooks import SMOKE, SMOKE_MODEL

    sites = scan.by_key(scan.all_sites())
    fixed = budget.fixed_seconds()
    selected = lambda keys: "; ".join(dict.fromkeys(s.text for k in keys for s in sites.get(k, [])))  # noqa: E731
    lines = [
        "gpu-check plan (dry run: nothing executed)",
        "",
        f"1. the machine's limits, measured first (~{LIMITS_ESTIMATE_S:.0f} s)",
        "   copy bandwidth: pinned host <-> cuda, 256 MiB, host->device and device->host alone and both at once "
        "(one stream each), CUDA events",
        f"   baseline step: {FULL_SHAPE[0]} b{FULL_SHAPE[1]} s{FULL_SHAPE[2]} fp32, forward / backward / update, "
        "median of 5 after 2 warm-up",
        f"   offload bound: the ledger's offloadable saved bytes at that shape, {_offload_bytes() / 2**30:.2f} GiB each way, "
        "against those phases",
        "",
    ]
    package = branches.PACKAGE
    lines.append(f"2. package branches ({len(package)}), on {SMOKE_MODEL} b2 s64")
    for b in package:
        lines.append(f"   {b.name:<24} ~{b.seconds:>3.0f} s  CUDA side: {b.cuda_side}")
        lines.append(f"   {'':<24}         covers {', '.join(b.covers)}")
        lines.append(f"   {'':<24}         selected by: {selected(b.covers)}")
    cells = [b for b in branches.registry() if b.check is None]
    lines += [
        "",
        f"3. notebook cells ({len(cells)}): each notebook in TRAIN-CUDA-MECHANISM mode with its small parameters",
    ]
    notebook_s = 0.0
    for task, params in SMOKE.items():
        est = fixed.get(task, 10.0) + SMOKE_EXTRA_S
        notebook_s += est
        lines.append(f"   {task} ~{est:.0f} s  " + " ".join(f"-p {k}={v!r}" for k, v in params.items()))
        for b in branches.notebook_cells(task):
            how = selected(b.covers) or "(no device test in the cell)"
            lines.append(
                f"      {b.name.split(':')[1]:<8} {how}: {b.cuda_side}"
                + (f"  [expected to fail until {b.known}]" if b.known else "")
            )
    package_s = sum(b.seconds for b in package)
    total = LIMITS_ESTIMATE_S + package_s + notebook_s
    lines += [
        "",
        f"small pass: ~{total:.0f} s (limits {LIMITS_ESTIMATE_S:.0f} + package {package_s:.0f} + notebooks {notebook_s:.0f}); "
        f"budget {SMALL_PASS_BUDGET_S:.0f} s"
        + (
            ""
            if total <= SMALL_PASS_BUDGET_S
            else " — over: run with --skip-notebooks, then --only-notebooks in a second command"
        ),
        "",
    ]
    lines.append(
        "4. the full run, python -m trainmech run --mode TRAIN-CUDA-MECHANISM, predicted per notebook:"
    )
    lines += ["   " + line for line in budget.render(budget.notebook_budgets())]
    return lines


def _offload_bytes() -> int:
    """Saved bytes ActivationOffload moves each way at FULL_SHAPE (Task5's rule: storages of at least a quarter hidden state)."""
    from trainmech import ledger

    model, batch, seq = FULL_SHAPE
    book = ledger.training_state_lifecycle(model, batch, seq, dtype="fp32", device="cuda")
    min_bytes = batch * seq * book.shape.hidden_size * 4 // 4
    return book.offloadable_bytes(min_bytes)


# ----------------------------------------------------------------------------- running


def _environment(device) -> dict:
    from trainmech import profiles, session
    from trainmech.gpucheck import bundle

    mode = "TRAIN-CUDA-MECHANISM" if device.type == "cuda" else "cpu"
    profile = profiles.for_mode(mode)
    env = session.capture_environment(profile, device)
    env["driver"] = _driver_version() if device.type == "cuda" else None
    env["version_problems"] = profiles.version_problems(profile)
    env["bundle_requirement_problems"] = bundle.requirement_problems()
    env["platform"] = platform.platform()
    return env


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def measure_limits(device) -> dict:
    """Bandwidth, the baseline step's phases (CUDA: the full shape; CPU: the tiny model), the offload bound
    and (CUDA) the CUDA context's bytes."""
    import torch

    from trainmech import ledger, profiles, workload
    from trainmech.gpucheck import budget, limits

    cuda = device.type == "cuda"
    mode, (model_name, batch, seq) = (
        ("TRAIN-CUDA-MECHANISM", FULL_SHAPE) if cuda else ("cpu", ("qwen2-tiny", 2, 32))
    )
    bandwidth = limits.copy_bandwidth(device, nbytes=(256 if cuda else 32) << 20, repeats=5 if cuda else 3)
    model = workload.build_model(profiles.for_mode(mode).model(model_name), seed=0, device=device).model
    data = workload.to_device(workload.lm_batch("domain", batch, seq), device)
    phases = limits.step_phase_times(
        model,
        data,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        warmup=2 if cuda else 1,
        repeats=5 if cuda else 2,
    )
    phases["shape"] = f"{model_name} b{batch} s{seq} fp32"
    del model
    gc.collect()
    context = None
    if cuda:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)  # the whole device: what no allocator statistic counts
        context = int(total - free - torch.cuda.memory_reserved(device))
    moved = _offload_bytes() if cuda else 0
    shape = ledger.model_shape(model_name)
    spf = budget.seconds_per_flop_from(phases, shape, batch, seq)
    return {
        "bandwidth": bandwidth,
        "baseline_step": phases,
        "offload_bound": limits.offload_bound(bandwidth, phases, moved, moved) if cuda else None,
        "seconds_per_flop": spf,
        "effective_tflops": 1 / spf / 1e12 if spf else None,
        # device used − reserved after a training step, cache emptied: the CUDA context (driver, loaded kernels,
        # cuBLAS handles) plus any other process on the device; None off CUDA. `ledger --device cuda` shows it.
        "cuda_context_bytes": context,
    }


def _run_one(branch, probe) -> dict:
    """Run one package check with its time and (CUDA) the device memory it used at most."""
    import torch

    from trainmech.gpucheck.branches import result_row, with_expectation
    from trainmech.gpucheck.notebooks import DeviceMemory
    from trainmech.gpucheck.probe import CheckFailed

    gc.collect()
    if probe.cuda:
        torch.cuda.empty_cache()
    row = result_row(branch)
    sampler = DeviceMemory(probe.device, every_s=0.05) if probe.cuda else None
    t0 = time.perf_counter()
    try:
        with sampler if sampler is not None else contextlib.nullcontext():
            reason = branch.check(probe)
        row |= {"status": "ok", "reason": reason}
    except CheckFailed as e:
        row |= {"status": "failed", "reason": str(e)}
    except Exception as e:  # a crash is a finding too: keep its last frames
        row |= {
            "status": "failed",
            "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            "traceback": traceback.format_exc().splitlines()[-8:],
        }
    row["seconds"] = round(time.perf_counter() - t0, 3)
    if sampler is not None:
        row |= sampler.used()
    return with_expectation(row)


def run(
    out: Path,
    *,
    cpu: bool = False,
    skip_notebooks: bool = False,
    only_notebooks: bool = False,
    only: list[str] | None = None,
    timeout: float | None = None,
) -> int:
    """The whole check; writes the report and returns the exit status."""
    import torch

    from trainmech.gpucheck import branches, budget
    from trainmech.gpucheck import report as report_file
    from trainmech.gpucheck.notebooks import NOTEBOOK_TIMEOUT_S, SMOKE, run_notebooks
    from trainmech.gpucheck.probe import Probe

    if not cpu and not torch.cuda.is_available():
        raise no_cuda("gpu-check", "use --dry-run for the plan or --cpu for a self-test")
    device = torch.device("cuda", torch.cuda.current_device()) if not cpu else torch.device("cpu")
    out.mkdir(parents=True, exist_ok=True)
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    report = {
        "schema": "trainmech-gpu-check/1",
        "started_at": started.isoformat(timespec="seconds"),
        "mode": "cuda" if not cpu else "cpu-self-test (no GPU evidence)",
        "environment": _environment(device),
    }
    say = lambda text: print(f"gpu-check: {text}", file=sys.stderr, flush=True)  # noqa: E731
    rows: list[dict] = []
    if not only_notebooks:
        say("measuring the machine's limits")
        report["limits"] = measure_limits(device)
        spf = report["limits"]["seconds_per_flop"] if not cpu else None
        report["budget"] = budget.notebook_budgets(
            spf, f"the measured baseline step ({report['limits']['baseline_step']['shape']})" if spf else None
        )
        report["budget_lines"] = budget.render(report["budget"])
        probe = Probe.for_device(device)
        for b in branches.PACKAGE:
            say(f"branch {b.name}")
            rows.append(_run_one(b, probe))
            say(f"  {rows[-1]['status']}: {rows[-1]['reason']}")
    if not cpu and not skip_notebooks:
        only = only or list(SMOKE)
        say(f"notebooks in TRAIN-CUDA-MECHANISM mode: {' '.join(only)}")
        gc.collect()
        torch.cuda.empty_cache()  # the kernels get the memory the checks above had cached
        report["notebooks"], cells = run_notebooks(out, device, only, timeout or NOTEBOOK_TIMEOUT_S)
        rows += cells
    report["branches"] = rows
    report["seconds"] = round(time.perf_counter() - t0, 2)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "failed", "expected", "not-run")}
    report["summary"] = counts
    report_file.write(out, report)
    say(
        f"{counts['ok']} ok, {counts['failed']} failed, {counts['expected']} expected failures, {counts['not-run']} not run "
        f"in {report['seconds']:.0f} s; report in {out}"
    )
    return 1 if counts["failed"] or counts["not-run"] else 0


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainmech gpu-check",
        description="Run every CUDA-only branch of the package and the notebooks once at small sizes, after measuring the "
        "machine's copy bandwidth and the baseline step's compute time; write gpu-check.json and gpu-check.md.",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan, the estimates and the full run's budget; run nothing",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="report folder (default results/gpu-check; with --cpu results/gpu-check-cpu, not committed)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="self-test on the CPU: limits and package checks, no notebooks, no GPU evidence",
    )
    parser.add_argument("--skip-notebooks", action="store_true", help="limits and package branches only")
    parser.add_argument(
        "--only-notebooks",
        nargs="*",
        metavar="TaskN",
        help="the notebook pass only (all, or these notebooks)",
    )
    parser.add_argument(
        "--timeout", type=float, help="seconds one notebook of the small pass may run (default 240)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.dry_run:
            print("\n".join(plan_lines()))
            return 0
        only = args.only_notebooks or None
        out = args.out or REPO_ROOT / "results" / ("gpu-check-cpu" if args.cpu else "gpu-check")
        return run(
            out,
            cpu=args.cpu,
            skip_notebooks=args.skip_notebooks,
            only_notebooks=args.only_notebooks is not None,
            only=only,
            timeout=args.timeout,
        )
    except TrainmechError as e:
        print(f"trainmech: error: {e}", file=sys.stderr)
        return 2
