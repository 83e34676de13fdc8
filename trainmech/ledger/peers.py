"""The ledger beside its peers, on the same configs and the same measurements (`python -m trainmech ledger --benchmark`).

Peers: `accelerate estimate-memory`'s training estimate, called through its Python API on the model
built on the meta device (no weights, no hub: offline), and the model-state formulas DeepSpeed
documents for ZeRO-2 and ZeRO-3 on one GPU (`formulas.deepspeed_zero2_gpu_bytes` / `..._zero3_...`).
Both count model states only; the ledger counts every state at its moment. Each is compared with the
measured peak of the same step: (estimate − measured) / measured, per point and per tool.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from trainmech.ledger.compare import CPU_POINTS, CUDA_POINTS, Comparison, measure_point
from trainmech.ledger.formulas import deepspeed_zero2_gpu_bytes, deepspeed_zero3_gpu_bytes
from trainmech.ledger.shape import ModelShape, model_shape

__all__ = [
    "TOOLS",
    "REFERENCE_POINTS",
    "BENCHMARK_POINTS",
    "REPORT_SCHEMA",
    "accelerate_estimate",
    "deepspeed_estimates",
    "BenchmarkRow",
    "benchmark",
    "report",
    "write_report",
    "timed_benchmark",
]

TOOLS = ("ledger", "accelerate", "deepspeed-zero2", "deepspeed-zero3")
# a ~5M-parameter Qwen2 with AdamW in fp32, where activations outweigh the model states that the peers count
REFERENCE_POINTS = {"qwen2-5m": [(4, 128), (8, 256)]}
# the CPU benchmark: Task4's points and the reference ones
BENCHMARK_POINTS = {**CPU_POINTS, **REFERENCE_POINTS}
REPORT_SCHEMA = "trainmech-ledger-peers/1"


def accelerate_estimate(config) -> int:
    """accelerate's "Training using Adam" bytes for a float32 model: its Python API on a meta-device model.

    As `accelerate estimate-memory` does (accelerate.commands.estimate): the model class built from the
    config under `init_empty_weights`, `calculate_maximum_sizes`, then `estimate_training_usage(size,
    "float32")`, whose largest entry is what the command prints. With the installed transformers a
    model built on the meta device is not tied yet, so a tied head is counted twice, as the command does.
    """
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    total, _ = calculate_maximum_sizes(model)
    return int(max(estimate_training_usage(total, "float32").values()))


def deepspeed_estimates(shape: ModelShape) -> dict[str, int]:
    """DeepSpeed's ZeRO-2 and ZeRO-3 model-state bytes on one GPU, from the model's parameter counts (a tied
    head once, the largest layer = the module with most parameters of its own, as DeepSpeed's
    `model_to_params` counts them)."""
    by_module: dict[str, int] = {}
    for name, numel in shape.parameter_tensors():
        by_module[name.rpartition(".")[0]] = by_module.get(name.rpartition(".")[0], 0) + numel
    largest = max(by_module.values())
    return {
        "deepspeed-zero2": deepspeed_zero2_gpu_bytes(shape.n_params),
        "deepspeed-zero3": deepspeed_zero3_gpu_bytes(shape.n_params, largest),
    }


@dataclass
class BenchmarkRow:
    comparison: Comparison
    estimates: dict[str, int]  # tool -> predicted peak bytes

    def error(self, tool: str) -> float:
        return self.estimates[tool] / self.comparison.measured_peak - 1

    def to_json(self) -> dict:
        c = self.comparison
        return {
            "model": c.model,
            "n_params": c.predicted.shape.n_params,
            "batch": c.batch,
            "seq": c.seq,
            "update": c.step,
            "measured_peak_bytes": c.measured_peak,
            "measured_peak_phase": c.measured.peak_phase,
            "ledger_peak_phase": c.predicted.peak_overlap().phase,
            "estimates_bytes": dict(self.estimates),
            "errors": {t: self.error(t) for t in TOOLS},
        }


def benchmark(
    points: dict[str, list[tuple[int, int]]] | None = None, *, run_mode: str = "cpu", out=print
) -> list[BenchmarkRow]:
    """Every point measured in this one run (first and steady AdamW update), each tool's error beside the ledger's.
    points: default BENCHMARK_POINTS on a CPU, CUDA_POINTS in the CUDA mode."""
    from trainmech import profiles, workload

    points = points or (CUDA_POINTS if run_mode != "cpu" else BENCHMARK_POINTS)
    profile = profiles.for_mode(run_mode)
    out(
        f"{'model':<14}{'batch':>6}{'seq':>6}  {'update':<7}{'measured':>14}"
        + "".join(f"{t:>17}" for t in TOOLS)
        + "  peak phase (ledger / measured)"
    )
    rows = []
    for model, shapes in points.items():
        config = workload.qwen2_config(profile.model(model))
        peers = {"accelerate": accelerate_estimate(config), **deepspeed_estimates(model_shape(config))}
        for batch, seq in shapes:
            for c in measure_point(model, batch, seq, run_mode=run_mode):
                row = BenchmarkRow(c, {"ledger": c.predicted_peak, **peers})
                rows.append(row)
                out(
                    f"{model:<14}{batch:>6}{seq:>6}  {c.step:<7}{c.measured_peak:>14,}"
                    + "".join(f"{row.error(t):>+17.1%}" for t in TOOLS)
                    + f"  {c.predicted.peak_overlap().phase} / {c.measured.peak_phase}"
                )
    out(
        f"{len(rows)} points; worst |error| per tool: "
        + ", ".join(f"{t} {max(abs(r.error(t)) for r in rows):.1%}" for t in TOOLS)
    )
    return rows


def report(rows: list[BenchmarkRow], *, seconds: float | None = None) -> dict:
    """The benchmark as one JSON object: tools, points (model -> [[batch, seq], …]), a row per measured
    update, the worst |error| per tool and where it was measured. Timings say how long, never what passed."""
    import torch
    import transformers

    try:
        import accelerate

        accelerate_version = accelerate.__version__
    except ImportError:  # the peer is optional at run time; its column would be missing, not guessed
        accelerate_version = None
    points: dict[str, list[list[int]]] = {}
    for r in rows:
        shape = [r.comparison.batch, r.comparison.seq]
        if shape not in points.setdefault(r.comparison.model, []):
            points[r.comparison.model].append(shape)
    return {
        "schema": REPORT_SCHEMA,
        "command": "python -m trainmech ledger --benchmark",
        "tools": list(TOOLS),
        "points": points,
        "rows": [r.to_json() for r in rows],
        "worst_abs_error": {t: max(abs(r.error(t)) for r in rows) for t in TOOLS},
        "measured_with": "tracked tensor storages, trainmech.measure.StorageTracker, on the CPU",
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate_version,
            "machine": platform.machine(),
        },
        "seconds": None if seconds is None else round(seconds, 1),
    }


def _markdown(data: dict) -> str:
    tools = data["tools"]
    env = data["environment"]
    lines = [
        "# The ledger beside its peers: estimated vs measured peak",
        "",
        f"`{data['command']}` — every point measured in one run ({data['measured_with']}); torch {env['torch']}, "
        f"transformers {env['transformers']}, accelerate {env['accelerate']}, Python {env['python']} "
        f"({env['machine']}); {data['seconds']} s.",
        "",
        "Each cell is (estimate − measured) / measured of the same update's peak. accelerate's `estimate-memory` "
        "(its Python API on a meta-device model) and DeepSpeed's ZeRO-2 / ZeRO-3 formulas count model states "
        "only; the ledger counts every state at its moment.",
        "",
        "| model | parameters | batch | seq | update | measured peak (bytes) | "
        + " | ".join(tools)
        + " | peak phase (ledger / measured) |",
        "|---|---:|---:|---:|---|---:|" + "---:|" * len(tools) + "---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['model']} | {r['n_params']:,} | {r['batch']} | {r['seq']} | {r['update']} | "
            f"{r['measured_peak_bytes']:,} | "
            + " | ".join(f"{r['errors'][t]:+.1%}" for t in tools)
            + f" | {r['ledger_peak_phase']} / {r['measured_peak_phase']} |"
        )
    worst = data["worst_abs_error"]
    lines += [
        "",
        f"{len(data['rows'])} updates; worst |error| per tool: "
        + ", ".join(f"{t} {worst[t]:.1%}" for t in tools)
        + ".",
        "",
    ]
    return "\n".join(lines)


def write_report(rows: list[BenchmarkRow], path: Path | str, *, seconds: float | None = None) -> list[Path]:
    """`path` (Markdown) and the same name with .json beside it; returns both paths."""
    path = Path(path)
    if path.suffix != ".md":
        raise ValueError(f"the benchmark report is a .md file (its .json lands beside it), got {path}")
    data = report(rows, seconds=seconds)
    path.parent.mkdir(parents=True, exist_ok=True)
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    path.write_text(_markdown(data), encoding="utf-8")
    return [path, json_path]


def timed_benchmark(points=None, *, run_mode: str = "cpu", out=print) -> tuple[list[BenchmarkRow], float]:
    """benchmark() and the seconds it took."""
    t0 = time.perf_counter()
    rows = benchmark(points, run_mode=run_mode, out=out)
    return rows, time.perf_counter() - t0
