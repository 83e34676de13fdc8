"""The run session: one notebook's run mode, label, profile, device, seed, environment, records.

    session = trainmech.session.start(RUN_MODE, RUN_LABEL, page="Task0", notebook="Task0_training_loop")

`start` refuses a bad run mode or label and the CUDA mode where CUDA is missing (one sentence
each), seeds every generator, loads the profile, and captures the environment. Records go to
`$TRAINMECH_RESULTS_DIR` when the runner or the tests set it, else to `results/<label>/`.

Process state `start` changes, for the rest of the process (nothing is undone): the global RNGs of
Python, NumPy and torch (every CUDA device too) are seeded; in CPU mode torch runs deterministic
algorithms only (`torch.use_deterministic_algorithms(True)`) on one intra-op thread
(`torch.set_num_threads(CPU_THREADS)`); and, given a notebook, `checks` logs every later check to
`<results>/checks/<notebook>.jsonl` (`checks.log_checks_to`).
"""

from __future__ import annotations

import os
import platform
import random
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainmech import checks, profiles, results, workload
from trainmech.errors import TrainmechError, no_cuda
from trainmech.results import REPO_ROOT, RESULTS_ENV  # noqa: F401  (re-exported: notebooks import them from here)

__all__ = [
    "CPU_THREADS",
    "NUMERIC_ENV",
    "seed_everything",
    "cpu_model",
    "provenance",
    "capture_environment",
    "Session",
    "start",
]

CPU_THREADS = 1  # intra-op threads of a CPU-mode session (see start)
# Variables that pick other CPU kernels, MKL code paths or oneDNN instruction sets (portability.PATHS sets them).
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    import numpy as np  # a dependency

    np.random.seed(seed)


def cpu_model() -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo, macOS sysctl), else the machine's architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model Name", "cpu model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or None


def provenance(intra_op_threads: int | None = None) -> dict[str, Any]:
    """What decides the CPU's numbers: CPU model, the ISA torch dispatches to, BLAS and oneDNN
    versions (from torch.__config__), intra-op threads (default: this process's), numeric-path variables."""
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    mkl = re.search(r"Math Kernel Library Version ([\d.]*\d)", config)
    onednn = re.search(r"(?:MKL-DNN|oneDNN) v([\d.]*\d)", config)
    blas_name = {"open": "openblas"}.get(blas.group(1), blas.group(1)) if blas else None
    return {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": f"mkl {mkl.group(1)}" if blas_name == "mkl" and mkl else blas_name,
        "onednn": onednn.group(1) if onednn else None,
        "intra_op_threads": torch.get_num_threads() if intra_op_threads is None else intra_op_threads,
        "numeric_env": {name: os.environ.get(name) for name in NUMERIC_ENV},
    }


def capture_environment(profile: profiles.Profile, device: torch.device) -> dict[str, Any]:
    """The record's `environment` group: versions actually imported, device and GPU facts, and the
    provenance of CPU numbers (call it after the thread count is set)."""
    import transformers

    try:
        import accelerate

        accelerate_version = accelerate.__version__
    except ImportError:
        accelerate_version = None
    on_cuda = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if on_cuda else None
    return {
        "profile_id": profile.profile_id,
        "run_mode": profile.run_mode,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate_version,
        "cuda": torch.version.cuda if on_cuda else None,
        "gpu": props.name if props else None,
        "gpu_memory_bytes": int(props.total_memory) if props else None,
        "device": str(device),
        **provenance(),
    }


@dataclass
class Session:
    run_mode: str
    run_label: str
    page: str
    notebook: str
    profile: profiles.Profile
    device: torch.device
    seed: int
    environment: dict[str, Any]
    results_dir: Path
    written: list[Path] = field(default_factory=list)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def workload(self, workload_id: str) -> profiles.WorkloadSpec:
        return self.profile.workload(workload_id)

    def workload_for(
        self, semantic_id: str, workload_id: str | None = None
    ) -> tuple[str, profiles.WorkloadSpec]:
        """(id, workload): the given one, or the profile's first workload serving semantic_id."""
        if workload_id is not None:
            return workload_id, self.profile.workload(workload_id)
        for wid, w in self.profile.workloads.items():
            if semantic_id in w.experiments:
                return wid, w
        raise TrainmechError(f"profile {self.profile.profile_id} has no workload for {semantic_id}")

    def summary(self) -> str:
        """One line a notebook prints: mode, profile, device, seed (nothing version-dependent)."""
        return f"run_mode={self.run_mode}  profile={self.profile.profile_id}  device={self.device.type}  seed={self.seed}"

    def build_model(
        self, model: str | None = None, *, dtype: torch.dtype = torch.float32, **kwargs
    ) -> workload.BuiltModel:
        """The profile's model (default: the profile's default model) on this session's device."""
        return workload.build_model(
            self.profile.model(model), seed=self.seed, dtype=dtype, device=self.device, **kwargs
        )

    def record(
        self,
        semantic_id: str,
        workload_id: str,
        *,
        built: workload.BuiltModel,
        input_shape: list[int],
        effective_batch: dict[str, int | None],
        dtype: str,
        update_count: int | None = None,
        candidate: str | None = None,
        correctness: dict[str, Any] | None = None,
        resources: dict[str, Any] | None = None,
        conclusion: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> results.Record:
        """Validate and write one result record; returns it. Unknown values stay None (null)."""
        conclusion = {"evidence_level": self.profile.evidence_level, **(conclusion or {})}
        record = results.validate(
            {
                "identity": {
                    "semantic_id": semantic_id,
                    "workload_id": workload_id,
                    "run_label": self.run_label,
                    "page": _registry_page(semantic_id, self.page),
                    "notebook": self.notebook,
                    "candidate": candidate,
                },
                "workload": {
                    "model_id": built.model_id,
                    "model_commit": built.model_commit,
                    "model_weights": built.model_weights,
                    "tokenizer": workload.tokenizer_identity(),
                    "input_shape": list(input_shape),
                    "effective_batch": effective_batch,
                    "update_count": update_count,
                    "dtype": dtype,
                    "seed": self.seed,
                },
                "environment": self.environment,
                "correctness": correctness or {},
                "resources": resources or {},
                "conclusion": conclusion,
                "metrics": metrics or {},
            }
        )
        self.written.append(results.write_record(record, self.results_dir))
        return record


def _registry_page(semantic_id: str, fallback: str) -> str:
    for e in results.experiments():
        if e["semantic_id"] == semantic_id:
            return e["page"]
    return fallback


def start(
    run_mode: str = "cpu",
    run_label: str = "local",
    page: str = "",
    *,
    notebook: str | None = None,
    seed: int = 0,
    results_dir: str | os.PathLike | None = None,
) -> Session:
    """Validate the run parameters and open a session; refuses bad input with one sentence."""
    profiles.check_mode(run_mode)
    results.check_label(run_label)
    profile = profiles.for_mode(run_mode)
    if profile.device == "cuda" and not torch.cuda.is_available():
        raise no_cuda(f"run mode {run_mode}", "use RUN_MODE = 'cpu' here")
    device = (
        torch.device("cuda", torch.cuda.current_device()) if profile.device == "cuda" else torch.device("cpu")
    )
    seed_everything(seed)
    if device.type == "cpu":
        # CPU mode is the reference run: same inputs, same outputs, bit for bit, on any machine.
        # One intra-op thread makes float reductions independent of the core count (and the small
        # CPU models gain nothing from more threads).
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(CPU_THREADS)
    if results_dir is None:
        results_dir = os.environ.get(RESULTS_ENV) or REPO_ROOT / "results" / run_label
    if notebook is not None:
        # Each check of this notebook, with the value and limit it compared, beside the records:
        # `python -m trainmech portability` reads these logs to measure margins across machines.
        checks.log_checks_to(Path(results_dir) / "checks" / f"{notebook}.jsonl")
    return Session(
        run_mode=run_mode,
        run_label=run_label,
        page=page,
        notebook=notebook or page,
        profile=profile,
        device=device,
        seed=seed,
        environment=capture_environment(profile, device),
        results_dir=Path(results_dir),
    )
