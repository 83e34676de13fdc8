"""Memory and time budget of each notebook's TRAIN-CUDA-MECHANISM run on the Qwen2.5-0.5B shape.

Memory comes from the ledger: the steady-update peak (foreach AdamW, the kernel PyTorch picks on
CUDA) of every shape a notebook trains, plus the other models it keeps alive meanwhile. Time is an
estimate: a fixed part (kernel start, imports, Python work: the committed CPU reference run's
seconds for that notebook) plus the training passes it runs times the seconds of one pass. One
pass costs 6 FLOPs per parameter per token plus attention; its seconds come from an assumed FP32
throughput, or, once gpu-check has timed the baseline step on the GPU, from that measurement.

`WORK` says what each notebook trains, counted by reading its cells at this commit (loops, warm-up
and timed steps, candidates): refresh it when a notebook's loops change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from trainmech import ledger, profiles
from trainmech.results import REPO_ROOT

__all__ = [
    "BUDGET_S",
    "MARGIN",
    "ASSUMED_FP32_TFLOPS",
    "GPU_MEMORY_BYTES",
    "STATE_BYTES_PER_PARAM",
    "Work",
    "work",
    "pass_flops",
    "fixed_seconds",
    "notebook_budgets",
    "split",
    "render",
    "seconds_per_flop_from",
]

BUDGET_S = 600.0  # one device command
MARGIN = 1.5  # an estimate must fit with this factor to spare
ASSUMED_FP32_TFLOPS = 25.0  # H200 FP32 without TF32 (PyTorch's default): ~40 % of the 67 TFLOP/s peak
GPU_MEMORY_BYTES = 139 * 2**30
STATE_BYTES_PER_PARAM = {"fp32": 16, "bf16": 8, "fp64": 32}  # weights + grads + AdamW's two moments


@dataclass(frozen=True)
class Work:
    """Training passes (forward, backward, update) a notebook runs at one shape."""

    model: str
    batch: int
    seq: int
    passes: float
    recipe: str = "fp32"  # fp32 / bf16 / fp64 (fp64: the fp32 ledger's bytes doubled)
    note: str = ""


def _w(workload_id: str, passes: float, **kw) -> Work:
    w = profiles.for_mode("TRAIN-CUDA-MECHANISM").workload(workload_id)
    return Work(w.model, w.batch, w.seq, passes, **kw)


def work() -> dict[str, tuple[list[Work], int]]:
    """notebook -> (its training passes by shape, extra models it keeps alive at once)."""
    p = profiles.for_mode("TRAIN-CUDA-MECHANISM")
    wl = p.workloads
    ga = [wid for wid, w in wl.items() if "TRAIN-GRADIENT-ACCUMULATION" in w.experiments]
    splits = lambda wid: len(wl[wid].micro_batches)  # noqa: E731
    updates = wl["default14"].updates
    ckpt, gates_wl = wl["b2s512_default2"], wl["b4s256_gates"]
    timed = 2 * (
        3 + 21
    )  # Task5, Task6: WARMUP_STEPS + TIMED_STEPS on CUDA, for the candidate and the reference beside it
    peaks = (
        3 + 1 + 1 + 3
    )  # remeasure's peaks: warm-up, the allocator probe, the tracked update, the bytes per sequence (x1, x2)
    return {
        "Task0": (
            [
                _w("loop", wl["loop"].updates + 3, note="the loop + 3 single passes"),
                _w("loop", 1, recipe="fp64", note="the float64 copy's pass"),
            ],
            1,
        ),
        "Task1": ([Work(p.default_model, 2, 16, 8, note="small graph probes")], 0),
        "Task2": (
            [_w("b2s32_float64", 12, recipe="fp64", note="hand-written vs autograd, float64 and float32")],
            1,
        ),
        "Task3": (
            [
                _w(
                    wid,
                    1 + 3 * (splits(wid) - 1) + splits(wid) * (3 + 20),
                    note="splits + 3 warm-up + 20 timed each",
                )
                for wid in ga
            ]
            + [_w("default14", 7.5 * updates + 10, note="AMP x3, dynamics x3, continual pretraining")],
            3,
        ),
        "Task4": (
            [
                Work(m, b, s, 2, note="tracked first + steady update")
                for m, pts in ledger.CUDA_POINTS.items()
                for b, s in pts
            ]
            + [
                Work(m, b, s, 2 * 4 / 3, note="checkpointed first + steady (scenarios)")
                for m, pts in ledger.CUDA_POINTS.items()
                for b, s in pts
            ]
            + [
                Work(m, b, s, 1, recipe="bf16", note="bf16 saved-tensor inventory")
                for m, pts in ledger.CUDA_POINTS.items()
                for b, s in pts
            ]
            + [
                Work(p.default_model, 1, 16, 4, note="bytes per parameter, four recipes"),
                Work(p.default_model, 1, 32, 8, note="four AdamW variants, first + steady"),
                Work(p.default_model, 2, 32, 6, note="autocast, two micro-batches, set_to_none=False"),
            ],
            1,
        ),
        "Task5": (
            [
                Work(
                    ckpt.model,
                    ckpt.batch,
                    ckpt.seq,
                    2 + 6 + 24 + 4 + 7 + 2 * peaks,
                    note="baseline trace, tracked steps, 12 scenarios x (2 tracked + 2 probed), in-backward, phase times, "
                    "the baseline's peaks",
                ),
                Work(
                    ckpt.model,
                    ckpt.batch,
                    ckpt.seq,
                    4 * (2 * ckpt.updates + 1 + peaks + timed) * 4 / 3,
                    note="4 checkpoint strategies: teacher-forced traces, counts, peaks, timing (+1/3 recompute)",
                ),
                Work(
                    ckpt.model,
                    ckpt.batch,
                    ckpt.seq,
                    2 * (2 * ckpt.updates + peaks + timed),
                    note="save_on_cpu and offload",
                ),
            ],
            0,
        ),
        "Task6": (
            [
                Work(
                    gates_wl.model,
                    gates_wl.batch,
                    gates_wl.seq,
                    23 * 2 * gates_wl.updates + 5 * (peaks + timed) + peaks + 40,
                    note="~23 teacher-forced gate traces, 5 performance runs, the reference's peaks, FP16 calibrations",
                )
            ],
            1,
        ),
    }


def pass_flops(shape: ledger.ModelShape, batch: int, seq: int) -> float:
    """FLOPs of one forward + backward: 6 per parameter per token, plus the attention scores (3 x 4·b·s²·d per layer)."""
    tokens = batch * seq
    attention = 3 * 4 * batch * seq * seq * shape.num_heads * shape.head_dim * shape.num_layers
    return 6.0 * shape.n_params * tokens + attention


def fixed_seconds() -> dict[str, float]:
    """Per notebook: the committed CPU reference run's seconds (kernel start, imports, Python work)."""
    path = REPO_ROOT / "results" / "cpu-reference" / "run.json"
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
        return {n["notebook"].split("_")[0]: float(n["seconds"]) for n in run["notebooks"]}
    except (OSError, ValueError, KeyError):
        return {}


def notebook_budgets(seconds_per_flop: float | None = None, how: str | None = None) -> list[dict]:
    """One row per notebook: peak bytes (ledger), estimated seconds, and how both were reached.

    seconds_per_flop: from a measured step (gpu-check), else 1 / ASSUMED_FP32_TFLOPS.
    """
    spf = seconds_per_flop or 1.0 / (ASSUMED_FP32_TFLOPS * 1e12)
    how = how or f"assumed {ASSUMED_FP32_TFLOPS:g} TFLOP/s FP32"
    fixed = fixed_seconds()
    rows = []
    for notebook, (items, extra_models) in work().items():
        peak, seconds, shapes = 0, fixed.get(notebook, 10.0), []
        for item in items:
            shape = ledger.model_shape(item.model)
            recipe = "fp32" if item.recipe == "fp64" else item.recipe
            book = ledger.training_state_lifecycle(shape, item.batch, item.seq, dtype=recipe, device="cuda")
            bytes_ = book.peak_overlap().bytes * (2 if item.recipe == "fp64" else 1)
            peak = max(peak, bytes_)
            seconds += (
                item.passes
                * pass_flops(shape, item.batch, item.seq)
                * spf
                * (2 if item.recipe == "fp64" else 1)
            )
            shapes.append(f"b{item.batch}s{item.seq} {item.recipe} x{item.passes:g}")
        n = ledger.model_shape(profiles.for_mode("TRAIN-CUDA-MECHANISM").default_model).n_params
        peak += extra_models * n * STATE_BYTES_PER_PARAM["fp32"]
        rows.append(
            {
                "notebook": notebook,
                "peak_bytes": peak,
                "seconds": seconds,
                "extra_models": extra_models,
                "passes": shapes,
                "time_from": how,
            }
        )
    return rows


def split(rows: list[dict], budget_s: float = BUDGET_S, margin: float = MARGIN) -> list[list[str]]:
    """Notebooks in Task order grouped into as few commands as fit `budget_s / margin` each."""
    groups, current, used = [], [], 0.0
    for row in rows:
        need = row["seconds"]
        if current and used + need > budget_s / margin:
            groups.append(current)
            current, used = [], 0.0
        current.append(row["notebook"])
        used += need
    return groups + ([current] if current else [])


def render(rows: list[dict]) -> list[str]:
    """The budget table and the verdict: one command, or how to split the run."""
    lines = [f"{'notebook':<8} {'ledger peak':>12} {'est. time':>10}  passes on the Qwen2.5-0.5B shape"]
    for r in rows:
        lines.append(
            f"{r['notebook']:<8} {r['peak_bytes'] / 2**30:>8.1f} GiB {r['seconds']:>8.0f} s  {'; '.join(r['passes'])}"
            + (f"; +{r['extra_models']} model(s) kept" if r["extra_models"] else "")
        )
    total = sum(r["seconds"] for r in rows)
    top = max(r["peak_bytes"] for r in rows)
    groups = split(rows)
    lines.append(
        f"{'total':<8} {top / 2**30:>8.1f} GiB {total:>8.0f} s  (time from {rows[0]['time_from']}; "
        f"memory: of {GPU_MEMORY_BYTES / 2**30:.0f} GiB)"
    )
    if len(groups) == 1:
        lines.append(
            f"verdict: the full run fits one {BUDGET_S / 60:.0f}-minute command with x{MARGIN:g} to spare"
        )
    else:
        lines.append(
            f"verdict: split the run into {len(groups)} commands: "
            + " | ".join("--only " + " ".join(g) for g in groups)
        )
    if top > GPU_MEMORY_BYTES:
        lines.append("warning: a notebook's predicted peak exceeds the GPU's memory")
    return lines


def seconds_per_flop_from(phases: dict, shape: ledger.ModelShape, batch: int, seq: int) -> float:
    """A measured step's seconds per FLOP of forward + backward (the update's own time spread over them)."""
    return phases["step_s"] / pass_flops(shape, batch, seq)
