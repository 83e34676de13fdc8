"""The registry of CUDA-only branches: what each covers, what only CUDA runs there, and its check.

A `Branch` names the sites it covers (`scan` keys: `measure.cuda_peaks`, `Task5:timing-table`), says
what only CUDA runs there and what chooses it, and either carries a `check` (package code) or is
run by the notebook pass (a notebook cell). The package checks live in trainmech.gpucheck.checks and
trainmech.gpucheck.strategy_checks; each takes a `Probe` (trainmech.gpucheck.probe) and runs on any
device: on a GPU it takes the CUDA side, on a CPU the same logic with the CPU side chosen, so the
CPU tests run every check before a GPU ever does. A check returns its one-line reason, or raises.

To add a branch: write it, run `pytest tests/test_gpucheck.py` (it names the uncovered site), then
add its key to a Branch's `covers` here — with a check that reaches it, or, for a notebook cell, a
line in NOTEBOOK_CELLS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainmech.gpucheck.checks import (
    check_distributed_spawn,
    check_distributed_torchrun,
    check_ledger_on_device,
    check_memory_history,
    check_rng_resume,
    check_scenarios,
    check_session,
    check_step_memory,
    check_timing_and_peaks,
)
from trainmech.gpucheck.probe import Probe
from trainmech.gpucheck.strategy_checks import (
    check_gates,
    check_offload,
    check_save_on_cpu,
    check_strategy_records,
)

__all__ = [
    "Branch",
    "PACKAGE",
    "NOT_BRANCHES",
    "NOTEBOOK_CELLS",
    "KERNEL_CHOICE_CELLS",
    "registry",
    "covered",
    "notebook_cells",
    "result_row",
    "with_expectation",
    "repo_path",
]


@dataclass(frozen=True)
class Branch:
    name: str
    covers: tuple[str, ...]  # scan keys
    cuda_side: str  # what runs only on CUDA, and what chooses it
    check: Callable[[Probe], str] | None = None  # None: a notebook cell, run by the notebook pass
    seconds: float = 2.0  # estimated on one H200 (small sizes)
    known: str | None = None  # an open issue whose fix this branch waits for

    @property
    def notebook(self) -> str | None:
        return self.covers[0].split(":")[0] if self.check is None else None


PACKAGE = [
    Branch(
        "session",
        ("session.start", "session.capture_environment", "session.Session.on_cuda", "runner.run"),
        "profile.device == 'cuda' picks cuda:<current>; the environment reads the GPU's name, memory and CUDA version; "
        "versions checked against the profile",
        check_session,
        2,
    ),
    Branch(
        "measure.timing",
        (
            "measure.timed",
            "measure.cuda_peaks",
            "measure.reset_cuda_peaks",
            "measure.cuda_allocated",
            "measure.allocator_window",
        ),
        "CUDA synchronises around timings and reads the caching allocator's statistics (the CPU: the profiler's)",
        check_timing_and_peaks,
        1,
    ),
    Branch(
        "measure.step_memory",
        ("measure.training_step_memory",),
        "the allocator's peak over a tracked step beside the tracked tensor peak (CPU: the profiler's allocator, forced)",
        check_step_memory,
        4,
    ),
    Branch(
        "measure.history",
        ("memory_history.cuda_memory_history",),
        "torch.cuda.memory._record_memory_history(stacks='python') around a tracked step; the snapshot's blocks "
        "labelled by the tracker (CPU: the tracker's own history)",
        check_memory_history,
        2,
    ),
    Branch(
        "ledger.cuda",
        (
            "ledger.inventory.attention_kernel",
            "ledger.inventory.rng_state_saved",
            "ledger.inventory._rng_outputs",
            "ledger.inventory.attention_saved",
            "ledger.states._state_bytes_per_tensor",
            "ledger.book.training_state_lifecycle",
            "ledger.compare.measure_point",
            "ledger.record.record_fields",
            "ledger.peers.benchmark",
            "ledger.cli.render",
        ),
        "kernel choice: the ledger predicts with the SDPA kernel the forward dispatched (cuDNN, flash, efficient or math; "
        "its rule on the stack, ledger.SdpaStack: cuDNN for 16-bit where the stack puts it first, else flash; fp32 GQA math "
        "before torch EFFICIENT_GQA_SINCE, efficient when padded; held to the dispatched kernel where the profile pins "
        "torch, DeviceTerms.torch_pinned, else a drift line); the cuDNN and flash kernels' RNG seed and offset (dropout or not), "
        "weighed "
        "by running the fused op on the GPU; foreach AdamW temporaries and AdamW's step counters on the host on CUDA; "
        "the warm-up's cuBLAS workspaces; lifecycles key by key within CUDA_LIFECYCLE_TOLERANCE; the allocator model's "
        "peaks beside the allocator's own, within Task4's DeviceTerms.allocator_model_tolerance and "
        "reserved_model_tolerance; bf16 forced math with and without dropout (fp32 upcasts, the bool dropout mask) "
        "against the math inventory",
        check_ledger_on_device,
        8,
    ),
    Branch(
        "offload",
        (
            "offload.hooks.ActivationOffload.__init__",
            "offload.copies.host_arena",
            "offload.copies.side_streams",
            "offload.copies.CudaStreams.compute",
            "offload.copies.CudaStreams.mark",
            "offload.copies.CudaStreams.copy",
            "offload.copies.CudaStreams.synchronize",
        ),
        "CudaCopies on CUDA streams: pinned host arena, cached D2H / H2D side streams, held sources released at a D2H "
        "event, CUDA events for copy and wait times read after the step, the hooks never synchronising (sync debug "
        "mode 'error'); side-stream copies overlapping kernels in a profiled step, D2H copies hidden behind a stalled "
        "compute stream (offload_overlap: the exposed share under (1 + floor) / 2 of the bound measured on the probe, "
        "the other thresholds first guesses); on a CPU the same bookkeeping over HostStreams, its order checked, and "
        "the overlap arithmetic checked on known intervals",
        check_offload,
        4,
    ),
    Branch(
        "offload.save_on_cpu",
        (
            "offload.save_on_cpu.CountingSaveOnCpu.__init__",
            "offload.save_on_cpu.CountingSaveOnCpu._mark",
            "offload.save_on_cpu.CountingSaveOnCpu.pack",
            "offload.save_on_cpu.CountingSaveOnCpu.unpack",
            "offload.save_on_cpu.CountingSaveOnCpu.read_times",
            "offload.save_on_cpu.check_host_copy",
        ),
        "torch's save_on_cpu with pinned memory, timed by CUDA events read after the step: every copy on the compute "
        "stream, so its exposed transfer time is its transfer time",
        check_save_on_cpu,
        3,
    ),
    Branch(
        "gates.cuda",
        (
            "tracing._rng_digest",
            "tracing._rng_states",
            "tracing._set_rng_states",
            "performance.Performance.on_gpu",
            "performance._allocator",
            "performance._emptied_cache",
            "performance._allocator_peaks",
            "performance.memory_capped",
            "performance._capped_update",
            "decision.decide",
            "gate_report.performance_verdict",
            "gate_report.Report.record_fields",
            "gate_report.strategy_table",
        ),
        "the CUDA RNG in the inputs gate and the teacher-forced pass; empty_cache, reserved / allocated peaks through "
        "measure.allocator_window, the CUDA context and the bytes per sequence in the performance stage; accept / tune / "
        "no-gain / costs-memory; the checkpoint runs under a cap at the reference's reserved peak (set_per_process_"
        "memory_fraction) (CPU: the same allocator bookkeeping with the CPU allocator forced)",
        check_gates,
        8,
    ),
    Branch(
        "scenarios.measured",
        ("ledger.measured_matrix.measure_matrix", "ledger.measured_matrix._allocator_probe"),
        "the scenario matrix measured with the allocator's peaks after the backward and after the step (CPU: tracked bytes)",
        check_scenarios,
        5,
    ),
    Branch(
        "strategy_records",
        ("strategy_records.StrategyRun.record_fields", "strategy_records.ledger_fields"),
        "Task5's records take the allocator's peaks on CUDA, the tracked bytes elsewhere",
        check_strategy_records,
        5,
    ),
    Branch(
        "distributed.torchrun",
        ("rank_update._wrap", "distributed.main", "rank_update.CommCounter.__new__._Mode.__torch_dispatch__"),
        "trainmech.distributed under torchrun with NCCL: the model on the rank's GPU, DDP device_ids, a cuda DeviceMesh",
        check_distributed_torchrun,
        20,
    ),
    Branch(
        "distributed.spawn",
        ("distributed.start_method_for",),
        "after CUDA was used in this process the workers are spawned, not forked (CPU: spawn forced)",
        check_distributed_spawn,
        25,
    ),
    Branch(
        "update.rng",
        ("training_state._rng_state", "training_state._set_rng_state"),
        "the CUDA generator's state saved into and restored from the checkpoint",
        check_rng_resume,
        2,
    ),
]

# Not branches, though the scan sees a device string there: why each is no CUDA path.
NOT_BRANCHES = {
    "measure._cpu_allocator_events": "filters the CPU profiler's events to CPU ones; nothing runs on CUDA",
    "execution.choose_jobs": "decides how many notebooks run at once (one in the CUDA mode); nothing runs on CUDA, "
    "tests/test_runner_faults.py covers both sides on a CPU",
    "runner._provenance": "names run.json's intra-op thread count (CPU kernels pin one); nothing runs on CUDA",
    "ledger.cli.main": "the calculator's --device is a paper choice (cuda works on any machine): it reads the CUDA "
    "context from a gpu-check report; tests/test_task4_ledger.py runs both sides",
    "performance.timing_counts": "picks the default warm-up and timed update counts for the device; nothing runs on "
    "CUDA, tests/test_task6_gates.py covers both sides",
    "ledger.terms.DeviceTerms.on_cuda": "names the device of a DeviceTerms; the terms are values (points, slack, "
    "tolerances) and the same cells run with either: tests/test_task4_ledger.py runs Task4's calls with CUDA's terms and "
    "choices forced on a CPU",
    "ledger.allocator.cuda_context": "reads a gpu-check report's mode (a report of a GPU run or a CPU self-test); "
    "nothing runs on CUDA, tests/test_task4_ledger.py reads both kinds",
}

# Notebook cells whose CUDA side only a CUDA-mode run executes (the notebook pass runs them).
NOTEBOOK_CELLS = {
    "Task0:shifted-cross-entropy": "the random model's loss ≈ ln V claim is checked on CPU only",
    "Task2:sdpa-identity": "SDPA's saved rows identified by storage on CPU only (a CUDA kernel may keep RNG state, padded lse)",
    "Task2:layer-bytes-identity": "the exact HF-vs-ours saved-bytes identity asserted on CPU only",
    "Task2:model-bytes": "the whole-model saved-bytes identity asserted on CPU only",
    "Task3:imports-setup": "3 warm-up + 20 timed windows on CUDA (1 + 3 on CPU)",
    "Task3:accelerate-accumulate": "accelerate's Accelerator(cpu=False): it prepares the model on the GPU",
    "Task3:record-accumulation": "frees comparison copies, prints allocated / reserved peaks and the accumulation deltas",
    "Task3:accelerate-precision": "accelerate's fp16 really runs float16 Linear layers on CUDA (float32 on CPU)",
    "Task3:record-amp": "prints FP16 vs FP32 peak and median",
    "Task3:trainer-count": "TrainingArguments(use_cpu=False): the Trainer counts num_items_in_batch on the GPU",
    "Task3:resume-check": "resume within 1e-2 relative on CUDA (atomics), bitwise on CPU",
    "Task4:imports-setup": "TERMS = ledger.device_terms('cuda'): ledger.CUDA_POINTS instead of the CPU points; SLACK = "
    "ledger.CUDA_SLACK_BYTES_PER_LAYER bytes per layer instead of byte for byte",
    "Task4:lifecycle-vs-measured": "lifecycles key by key within TERMS.lifecycle_tolerance (CUDA: ledger.CUDA_LIFECYCLE_TOLERANCE) "
    "instead of byte for byte",
    "Task4:bytes-by-phase": "per-phase maxima within TERMS.step_slack_bytes(layers) bytes (CUDA: SLACK once per layer, "
    "CPU byte for byte)",
    "Task4:peak-composition": "the peak's composition by category within TERMS.step_slack_bytes(layers) bytes per category "
    "(CUDA: SLACK once per layer, CPU byte for byte)",
    "Task4:memory-history": "the history's peak plus the tracked parameters claimed equal to the tracked peak where "
    "TERMS.exact_points (CPU: the tracker's own history); on CUDA the allocator's history is drawn and its baseline "
    "and unexplained blocks printed",
    "Task4:baseline-peaks": "the byte-for-byte claim over every point is made where TERMS.exact_points (CPU only; CUDA: "
    "within 5 %, the count of exact points printed)",
    "Task4:cuda-allocator-peaks": "one path: ledger.allocator_pair keeps the CUDA-measured pair (the caching allocator counted), "
    "ledger.allocated_reserved replays CUDA's allocator model (PYTORCH_CUDA_ALLOC_CONF checked) and the model's allocated peak "
    "is claimed within TERMS.allocator_model_tolerance of torch.cuda's, its reserved peak within "
    "TERMS.reserved_model_tolerance of torch.cuda's (CUDA only: the CPU allocator reports none), and nearer torch.cuda's allocated peak "
    "than the tracked tensors are (TERMS.allocator_rounds, CUDA only); the warm-up's cuBLAS workspaces claimed > 0 "
    "(TERMS.blas_workspace_measured); the allocator history printed (CPU: the profiler's allocator, and the tracked "
    "tensors within 1 %)",
    "Task4:record-state-ledger": "the record's fields from ledger.record_fields(on_cuda=TERMS.on_cuda): the step's own "
    "allocator peaks, the allocator's forward+backward peak",
    "Task4:multi-device-run": "section 8 runs on the CPU with the GPU machine's torch: the exact held-bytes, bitwise and "
    "collective checks tuned on the CPU profile's torch are printed there, not claimed (EXACT = TERMS.exact_engines, False)",
    "Task5:imports-setup": "3 warm-up + 21 timed updates on CUDA (1 + 3 on CPU)",
    "Task5:protocol": "gate 2 against the baseline everywhere; the bitwise claim on CPU only, for strategies that keep "
    "every tensor's layout",
    "Task5:baseline-ledger": "the saved bytes at the baseline peak: their exact sum claimed on CPU, only the every-layer "
    "lower bound on CUDA",
    "Task5:dropout-rng": "RNG-preserving replay within gates.GRAD_RTOL instead of bitwise",
    "Task5:overlapped-offload": "copy and exposed transfer times from CUDA events; the stash and inventory claims are "
    "CPU-only",
    "Task5:strategy-peaks": "ledger-vs-measured peak claims are CPU-only",
    "Task5:saved-at-forward-end": "saved-bytes claims are CPU-only",
    "Task5:peak-composition": "peak phase and composition claims are CPU-only",
    "Task5:scenario-matrix": "the scenario matrix with the allocator's peaks on CUDA, checkpoint's two relations (fwd+bwd vs the baseline, whole update vs fwd+bwd) held to the ledger's for the workload within no_higher_slack; the 1 % claim on tracked bytes and the CPU shape's phases CPU-only",
    "Task5:scenario-gpu": "the allocator's whole-update peaks of the rows the ledger puts at the optimizer step within 1 % "
    "of each other, the other rows above them (CUDA only; on CPU the rows are printed)",
    "Task5:in-backward": "optimizer-in-backward within 1e-5 of AdamW on CUDA, bitwise on CPU",
    "Task5:save-on-cpu-estimate": "the save_on_cpu byte estimate against what it moved, claimed on CPU only",
    "Task5:transfer-measured": "this machine's copy bandwidth and phase times, measured: the bound the timing table is held "
    "to",
    "Task5:timing-table": "the timing table, decisions from allocated peaks (reserved beside them), bytes per sequence and "
    "medians; the exposed fraction "
    "(per-copy CUDA events) and the step ratio against the measured bound",
    "Task5:peak-reconcile": "save_on_cpu's tracked peak above the baseline's and the custom hooks' below it is claimed on "
    "CPU only (there its host copies are tracked storages born in the update; on CUDA they are host memory); so is each "
    "candidate's difference between Task4's and Task6's peaks (the logits Task6's step holds)",
    "Task6:checkpoint-passes": "forward + backward equal to the whole update's tracked peak is claimed on CPU only",
    "Task6:inplace-clamp": "the out-of-place clamp bitwise equal to the reference is claimed on CPU only (a GPU's "
    "atomics may reorder sums: there gate 2's tolerance judges it)",
    "Task6:scheduler-every-attempt": "no GradScaler skip of an update the reference made is claimed on CPU only (a GPU "
    "run may overflow after the calibrated start); the fp16 twin's learning rates, update by update, everywhere",
    "Task6:imports-setup": "3 warm-up + 21 timed steps on CUDA; one CPU thread only on CPU",
    "Task6:gradient-errors-figure": "the FP16 margin claim is CPU-only; on CUDA the margin is printed as unverified (the "
    "float16 tolerance's first GPU calibration)",
    "Task6:noise-floor": "the bitwise reference rerun is claimed on CPU only; on CUDA the 16-bit tolerance is marked "
    "not yet calibrated on a GPU",
    "Task6:strategy-table": "the exact moved layer inputs, fp16's per-sequence drop beyond its tracked drop and "
    "checkpoint+fp16's tracked bytes below both are claimed on CPU only, the tracked-bytes identity of "
    "checkpoint+offload on CPU only and only where the prefetch window covers every layer",
    "Task6:quality-gate-adam-eps": "the float32 candidates' held-out loss bitwise equal to the reference's is claimed on "
    "CPU only (a GPU's atomics may reorder sums: there the quality table reads within), and so is every quality "
    "bound narrower than another seed's held-out difference",
    "Task6:performance-against-ledger": "the checkpoint candidate's measured savings (whole-update peak, bytes per sequence) and "
    "peak phase against the ledger's bytes for this run's workload (padded, residual dropout) within Task4's CUDA byte "
    "slack plus the allocator's block rounding (the phase only where decided), its time ratio at least "
    "recompute_floor, and, with 5 or more rounds, the time ratio's interval half-width at most min_speedup (CPU: the "
    "predictions alone, no claim)",
    "Task6:run-registries": "the records this page wrote, each with a record of the same experiment and workload in the "
    "CPU reference, is claimed on CPU only (a CUDA run's workloads are the GPU ones)",
    "Task6:outcomes": "the offload's per-sequence bytes equal the reference's on CPU only and only where the prefetch "
    "window covers every moved layer (the layer count is printed)",
}

# Kernel choices with no device test in the cell: the SDPA kernel follows the device and dtype
# (fp32 grouped-query attention runs the math kernel on CUDA). Listed so gpu-check runs and reports
# them; an issue named is one whose fix they wait for.
KERNEL_CHOICE_CELLS = {
    "Task4:layer-saved-inventory": (
        "the inventory of the kernel ledger.attention_kernel's rule picks for this device with no GPU seen (CUDA fp32 "
        "GQA: math before torch EFFICIENT_GQA_SINCE, efficient from it), printed as the rule's",
        None,
    ),
    "Task4:measure-first-steady": (
        "the kernel the forward dispatched beside the rule's on the stack it ran on (Comparison.kernel_line), claimed "
        "equal only where TERMS.torch_pinned (CPU); on CUDA a rule out of date for the GPU's stack is a drift line, not "
        "a failure; per-layer saved bytes "
        "against the dispatched kernel's inventory within SLACK = ledger.CUDA_SLACK_BYTES_PER_LAYER bytes per layer",
        None,
    ),
    "Task4:calculator-json": (
        "the calculator's rule (--device cuda, no --attention; it sees no GPU) printed beside the kernel section 1's "
        "forward dispatched, then the calculator asked again with --attention <that kernel> and its peak bytes and "
        "tick claimed equal to the measured steady update's prediction (the rule's own choice claimed only where "
        "TERMS.torch_pinned, CPU)",
        None,
    ),
    "Task4:bf16-layer-saved": (
        "bf16 per-layer saved bytes against the dispatched kernel's inventory within SLACK = ledger.CUDA_SLACK_BYTES_PER_LAYER bytes per layer; its SDPA term "
        "carries the RNG seed and offset the dispatched kernel keeps on this GPU, weighed there (cuDNN and flash keep "
        "them on the device, dropout or not; ledger.rng_state_saved)",
        None,
    ),
    "Task5:layer-saved-inventory": (
        "the layer inventory follows the ledger's kernel for the device (books['baseline'].attention); the measured "
        "saved bytes equal to the inventory plus the saved tensors outside the layers claimed on CPU only",
        None,
    ),
    "Task5:selective-dispatch": (
        "the matmul and attention ops a grad-enabled forward dispatched against checkpointing.expected_matmul_ops "
        "(7 projections per layer and the attention of the kernel the forward dispatched, "
        "checkpointing.dispatched_kernel: one fused SDPA op, or two bmm with the math kernel; ledger.attention_kernel's "
        "rule printed beside it, required equal on CPU only), and the selective checkpoint's saved outputs against them",
        None,
    ),
}


def registry() -> list[Branch]:
    """Every branch: package checks first, then the notebook cells in Task order."""
    cells = [Branch(key, (key,), text) for key, text in NOTEBOOK_CELLS.items()]
    cells += [
        Branch(key, (key,), f"kernel choice: {text}", known=issue)
        for key, (text, issue) in KERNEL_CHOICE_CELLS.items()
    ]
    order = lambda b: (int(b.name[4:].split(":")[0]), b.name)  # noqa: E731  (Task4:layer-saved-inventory -> 4)
    return PACKAGE + sorted(cells, key=order)


def covered() -> set[str]:
    return {key for b in registry() for key in b.covers} | set(NOT_BRANCHES)


def notebook_cells(notebook: str) -> list[Branch]:
    return [b for b in registry() if b.notebook == notebook]


def result_row(branch: Branch) -> dict:
    """The report row of a branch before it runs."""
    return {
        "name": branch.name,
        "covers": list(branch.covers),
        "cuda_side": branch.cuda_side,
        "known": branch.known,
        "seconds": None,
        "device_memory_used_peak_bytes": None,
        "device_memory_used_at_start_bytes": None,
    }


def with_expectation(row: dict) -> dict:
    """A failure its `known` issue expects becomes "expected"; a pass there says the fix may have landed."""
    if row.get("known") and row["status"] == "failed":
        row["status"] = "expected"
        row["reason"] = f"expected until {row['known']}: {row['reason']}"
    elif row.get("known") and row["status"] == "ok":
        row["reason"] += f" (passes: {row['known']} may have fixed it)"
    return row


def repo_path(key: str) -> Path:
    """The file a registry key lives in (for messages): a module, or a module of a subpackage (offload.copies…)."""
    from trainmech.gpucheck.scan import NOTEBOOKS_DIR, PACKAGE_DIR

    if ":" in key:
        task = key.split(":")[0]
        return next(NOTEBOOKS_DIR.glob(f"{task}_*.ipynb"), NOTEBOOKS_DIR / f"{task}.ipynb")
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        candidate = PACKAGE_DIR.joinpath(*parts[:n]).with_suffix(".py")
        if candidate.is_file():
            return candidate
    return PACKAGE_DIR / (parts[0] + ".py")
