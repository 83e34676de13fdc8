"""gpu-check's notebook pass: each Task notebook in TRAIN-CUDA-MECHANISM mode with small workloads.

Every notebook runs in its own kernel through the runner (going on past a failing cell), with the
parameters in SMOKE: the CUDA profile's `smoke-*` workloads on the 2-layer Qwen2.5-0.5B shape and
fewer timed steps. Each registered cell is then judged from the executed notebook: ran without an
error, failed (with the error), or never reached. The whole device's used memory is polled meanwhile.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from trainmech.gpucheck.branches import notebook_cells, result_row, with_expectation
from trainmech.results import PARTIAL_SUFFIX

__all__ = ["NOTEBOOK_TIMEOUT_S", "SMOKE_MODEL", "SMOKE", "DeviceMemory", "run_notebooks"]

NOTEBOOK_TIMEOUT_S = 240.0  # the --timeout default; a small-pass notebook takes ~20 s: a hung one must not eat the device command
SMOKE_MODEL = "qwen2.5-0.5b-2layers"
# Each notebook's parameters for the small pass: the profile's smoke workloads, fewer timed steps.
SMOKE: dict[str, dict] = {
    "Task0": {"WORKLOAD": "smoke-loop"},
    "Task1": {"MODEL": SMOKE_MODEL},
    "Task2": {"WORKLOAD": "smoke-float64"},
    "Task3": {
        "ACCUMULATION_WORKLOADS": ["smoke-accumulation"],
        "WORKLOAD": "smoke-default",
        "TIMED_WINDOWS": 3,
    },
    "Task4": {"WORKLOAD": "smoke-b2s128", "POINTS": {SMOKE_MODEL: [(2, 128)]}},
    "Task5": {
        "CHECKPOINT_WORKLOAD": "smoke-b2s128",
        "OFFLOAD_WORKLOAD": "smoke-b2s128",
        "WARMUP_STEPS": 1,
        "TIMED_STEPS": 3,
    },
    # Task6: 5 timed rounds, the fewest with a 90 % interval of the median time ratio (decision.MIN_TIMING_ROUNDS)
    "Task6": {"WORKLOAD": "smoke-gates", "WARMUP_STEPS": 1, "TIMED_STEPS": 5},
}


class DeviceMemory(threading.Thread):
    """While inside, polls the whole device's used memory (cudaMemGetInfo: every process, reserved
    memory and the CUDA context included) every `every_s` seconds; `used()` gives start and peak."""

    def __init__(self, device, every_s: float = 0.25):
        super().__init__(daemon=True)
        import torch

        self.torch, self.device, self.every_s = torch, device, every_s
        self.stop, self.peak, self.start_used = threading.Event(), 0, 0

    def _now(self) -> int:
        free, total = self.torch.cuda.mem_get_info(self.device)
        return total - free

    def __enter__(self):
        self.start_used = self.peak = self._now()
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()
        self.peak = max(self.peak, self._now())
        return False

    def run(self):
        while not self.stop.wait(self.every_s):
            self.peak = max(self.peak, self._now())

    def used(self) -> dict:
        return {
            "device_memory_used_peak_bytes": self.peak,
            "device_memory_used_at_start_bytes": self.start_used,
        }


def run_notebooks(
    out: Path,
    device,
    only: list[str] | None = None,
    timeout: float = NOTEBOOK_TIMEOUT_S,
    *,
    mode: str = "TRAIN-CUDA-MECHANISM",
    params: dict[str, dict] | None = None,
) -> tuple[list[dict], list[dict]]:
    """Each notebook in `mode` with its parameters (default: SMOKE); (notebook rows, cell rows).

    A CPU test runs the same pass with mode "cpu" and the notebooks' own parameters.
    """
    import contextlib

    import nbformat

    from trainmech import runner

    params = SMOKE if params is None else params
    notebook_rows, cell_rows = [], []
    for path in runner.discover(only=only):
        task = path.stem.split("_")[0]
        label = f"smoke-{task}"
        t0 = time.perf_counter()
        with DeviceMemory(device) if device.type == "cuda" else contextlib.nullcontext() as sampler:
            code = runner.run(
                mode,
                label,
                only=[task],
                overrides=params.get(task, {}),
                timeout=timeout,
                results_root=out / "notebooks",
                progress=False,
                allow_errors=True,
            )
        folder = (
            out / "notebooks" / (label if code == 0 else label + PARTIAL_SUFFIX)
        )  # where a failed run goes
        run = json.loads((folder / "run.json").read_text(encoding="utf-8"))["notebooks"][0]
        executed = nbformat.read(folder / "notebooks" / path.name, as_version=4)
        by_id = {c.get("id"): c for c in executed.cells}
        notebook_rows.append(
            {
                "notebook": task,
                "status": run["status"],
                "seconds": round(time.perf_counter() - t0, 2),
                "error": run["error"],
                "records": run["records"],
                **(
                    sampler.used()
                    if sampler
                    else {"device_memory_used_peak_bytes": None, "device_memory_used_at_start_bytes": None}
                ),
            }
        )
        for b in notebook_cells(task):
            status, reason = _cell_outcome(by_id.get(b.name.split(":")[1]), mode)
            cell_rows.append(with_expectation(result_row(b) | {"status": status, "reason": reason}))
    return notebook_rows, cell_rows


def _cell_outcome(cell, mode: str = "TRAIN-CUDA-MECHANISM") -> tuple[str, str]:
    if cell is None:
        return "failed", "the cell is gone from the notebook"
    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    if errors:
        return (
            "failed",
            f"{errors[0].get('ename')}: {str(errors[0].get('evalue')).splitlines()[0][:300] if errors[0].get('evalue') else ''}",
        )
    if cell.get("execution_count") is None:
        return "not-run", "not reached (the kernel stopped before it)"
    return "ok", f"executed in {mode} mode without an error"
