"""The ledger beside its peers, on the same configs and the same measurements (`python -m trainmech ledger --benchmark`).

Peers: `accelerate estimate-memory`'s training estimate, called through its Python API on the model
built on the meta device (no weights, no hub: offline), and the model-state formulas DeepSpeed
documents for ZeRO-2 and ZeRO-3 on one GPU (`formulas.deepspeed_zero2_gpu_bytes` / `..._zero3_...`).
Both count model states only; the ledger counts every state at its moment. Each is compared with the
measured peak of the same step: (estimate − measured) / measured, per point and per tool.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmech.ledger.compare import CPU_POINTS, CUDA_POINTS, Comparison, measure_point
from trainmech.ledger.formulas import deepspeed_zero2_gpu_bytes, deepspeed_zero3_gpu_bytes
from trainmech.ledger.shape import ModelShape, model_shape

__all__ = ["TOOLS", "accelerate_estimate", "deepspeed_estimates", "BenchmarkRow", "benchmark"]

TOOLS = ("ledger", "accelerate", "deepspeed-zero2", "deepspeed-zero3")


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


def benchmark(
    points: dict[str, list[tuple[int, int]]] | None = None, *, run_mode: str = "cpu", out=print
) -> list[BenchmarkRow]:
    """Every point measured in this one run (first and steady AdamW update), each tool's error beside the ledger's."""
    from trainmech import profiles, workload

    points = points or (CUDA_POINTS if run_mode != "cpu" else CPU_POINTS)
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
