"""The ledger beside a measurement: build the model, run tracked steps, pair each with its prediction.

    first, steady = measure_point("qwen2-small", 2, 128)     # a Comparison each: predicted, measured, error
    measured_bytes_per_param("qwen2-tiny", "bf16")          # model-state bytes per parameter, measured

What a record says about a point (`allocated_reserved`, `record_fields`) is `trainmech.ledger.record`; the
scenario matrix measured (`measure_matrix`) is `trainmech.ledger.measured_matrix`; the peers' estimates
beside every CPU point (`benchmark`) are `trainmech.ledger.peers`.

torch and trainmech.measure are imported inside the functions that run a model: the ledger itself imports without them.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from trainmech.errors import TrainmechError
from trainmech.ledger.book import Ledger, training_state_lifecycle
from trainmech.ledger.clock import UPDATES
from trainmech.ledger.inventory import SdpaStack, attention_kernel, kernel_of_ops, sdpa_stack
from trainmech.ledger.recipes import STEP_COUNTER_BYTES, recipe
from trainmech.ledger.shape import model_shape

__all__ = [
    "CPU_POINTS",
    "CUDA_POINTS",
    "MEASURED_PEAK_WITH",
    "CUDA_SLACK_BYTES_PER_LAYER",
    "CUDA_LIFECYCLE_TOLERANCE",
    "clear_blas_workspaces",
    "Comparison",
    "padded_batch",
    "points_table",
    "by_peak_phase",
    "measure_point",
    "measured_bytes_per_param",
    "model_state_bytes_per_param",
]

# How `Comparison.measured_peak` was measured, by device type: what a record's metrics.measured_with says
# wherever it carries that peak (Task4's TRAIN-STATE-LEDGER, and Task5's after a strategy).
MEASURED_PEAK_WITH = {
    "cuda": "torch.cuda.max_memory_allocated minus the allocated bytes outside the step (ledger.Comparison)",
    "cpu": "trainmech.measure.StorageTracker (tensor storages)",
}

CPU_POINTS = {"qwen2-tiny": [(1, 32), (2, 128), (4, 256)], "qwen2-small": [(1, 64), (2, 128), (2, 256)]}
CUDA_POINTS = {"qwen2.5-0.5b": [(2, 512)]}


@dataclass
class Comparison:
    """Predicted and measured peak of one (model, batch, seq, step) point.

    kernel: the SDPA kernel the measured forward dispatched (the prediction uses it); rule_kernel: the
    one the ledger's rule picks for this device (`attention_kernel`) on `stack`, the torch (and on
    CUDA the GPU) the point ran on (`kernel_line`).
    workspace_bytes: what a warm-up forward and backward left allocated (CUDA: the cuBLAS and cuBLASLt
    workspaces, measured; None without a warm-up or off CUDA). history: the CUDA allocator's history of
    the point's steps (`measure_point(memory_history=True)`; empty off CUDA).
    """

    model: str
    batch: int
    seq: int
    step: str  # "first" | "steady"
    predicted: Ledger
    measured: Any  # trainmech.measure.StepMemory
    micro_batch: int = 1
    kernel: str = ""
    rule_kernel: str = ""
    workspace_bytes: int | None = None
    history: Any = field(default=None, repr=False)  # trainmech.measure.MemoryHistory
    stack: SdpaStack | None = None
    measured_peak: int = field(init=False)

    def __post_init__(self):
        # on CUDA the allocator is the machine's own count; elsewhere the tracked tensor bytes
        allocated = self.measured.step_peak_allocated_bytes
        self.measured_peak = allocated if allocated is not None else self.measured.peak_bytes

    @property
    def predicted_peak(self) -> int:
        return self.predicted.peak_overlap().bytes

    @property
    def error(self) -> float:
        """(predicted − measured) / measured."""
        return (self.predicted_peak - self.measured_peak) / self.measured_peak

    @property
    def tracked_peak(self) -> int:
        """The tracked tensor peak on any device (on CUDA `measured_peak` is the allocator's, with its rounding)."""
        return self.measured.peak_bytes

    @property
    def tracked_error(self) -> float:
        """(predicted − tracked) / tracked: the ledger's tensor accounting alone."""
        return (self.predicted_peak - self.tracked_peak) / self.tracked_peak

    @property
    def measured_forward_backward_peak(self) -> int:
        """The measured peak before the update (baseline included): forward, loss and backward events."""
        return self.measured.forward_backward_peak()

    def measured_crossing_lifecycles(self) -> dict[tuple, int]:
        """(category, born phase, released phase) -> bytes of the measured storages that cross a phase boundary."""
        return {k: v for k, v in self.measured.lifecycles().items() if k[1] != k[2]}

    def lifecycle_differences(self, tolerance: tuple[float, int] = (0.0, 0)) -> dict[tuple, tuple[int, int]]:
        """(category, created phase, released phase) -> (ledger bytes, measured bytes), key by key, over the
        states that cross a phase boundary, where the two differ by more than the tolerance: (relative,
        bytes), the larger of the two allowances applies (CPU: none; CUDA: CUDA_LIFECYCLE_TOLERANCE)."""
        ours = self.predicted.crossing_lifecycles()
        theirs = self.measured_crossing_lifecycles()
        relative, floor = tolerance
        out = {}
        for k in ours.keys() | theirs.keys():
            a, b = ours.get(k, 0), theirs.get(k, 0)
            if abs(a - b) > max(floor, relative * max(a, b)):
                out[k] = (a, b)
        return out

    def kernel_line(self) -> str:
        """One line: the SDPA kernel the forward dispatched beside the rule's on the stack it ran on; where
        they differ, the drift named (the rule is out of date for that stack; the prediction used the
        dispatched kernel all the same)."""
        on = self.stack.describe() if self.stack is not None else "stack not recorded"
        line = f"SDPA kernel the forward dispatched: {self.kernel}   (the ledger's rule: {self.rule_kernel}, {on})"
        if self.kernel != self.rule_kernel:
            line += (
                f"\n  drift: ledger.attention_kernel picks {self.rule_kernel} where this stack dispatched "
                f"{self.kernel}; the rule is out of date for it (the prediction above used {self.kernel})"
            )
        return line

    def lifecycle_line(self, tolerance: tuple[float, int] = (0.0, 0)) -> str:
        """One line: the measured crossing groups, their bytes summed over the whole step (they are not
        alive at once, so the sum can exceed the peak), and where the ledger differs beyond the tolerance."""
        theirs = self.measured_crossing_lifecycles()
        return (
            f"{self.step:<7} update: {len(theirs)} measured (category, created, released) groups that cross a "
            f"phase, {sum(theirs.values()):,} bytes over the step; differences: "
            f"{self.lifecycle_differences(tolerance) or 'none'}"
        )


def points_table(points: list[Comparison]) -> str:
    """One row per point: predicted and measured peak, their ratio and error, the predicted peak phase."""
    rows = [
        f"{'model':<14}{'batch':>6}{'seq':>6}  {'update':<8}{'predicted':>14}{'measured':>14}{'ratio':>8}{'error':>9}  peak phase"
    ]
    for c in points:
        rows.append(
            f"{c.model:<14}{c.batch:>6}{c.seq:>6}  {c.step:<8}{c.predicted_peak:>14,}{c.measured_peak:>14,}"
            f"{c.predicted_peak / c.measured_peak:>8.4f}{c.error:>+9.3%}  {c.predicted.peak_overlap().phase}"
        )
    return "\n".join(rows)


def by_peak_phase(points: list[Comparison]) -> dict[str, list[str]]:
    """Measured peak phase -> the points whose measured peak is there ("model bBsS step"), in order."""
    out: dict[str, list[str]] = {}
    for c in points:
        out.setdefault(c.measured.peak_phase, []).append(f"{c.model} b{c.batch}s{c.seq} {c.step}")
    return out


# What a CUDA run's tracked storage bytes may differ from the ledger by, per decoder layer: storage bytes
# are exact on any device (the tracker counts the device's storages only, the host's apart), so the
# allowance is for a scalar a kernel keeps that the inventory does not name, and stays below the smallest
# error the per-layer checks exist for: one int64 element (8 B) of an SDPA kernel's RNG state weighed
# wrong, a missing seed or offset (16-24 B), a logsumexp (4 B × heads × rows). Whole-step quantities get
# it once per layer; the CPU gets none.
CUDA_SLACK_BYTES_PER_LAYER = 4

# What a CUDA run's lifecycles are held to, key by key (relative, bytes): the per-layer slack for each
# (category, created, released) group, which holds at most one layer's phase pair; a wrong category or
# phase moves whole tensors.
CUDA_LIFECYCLE_TOLERANCE = (0.0, CUDA_SLACK_BYTES_PER_LAYER)


def padded_batch(batch: int, seq: int) -> dict:
    """`batch` rows of the domain text, row i shorter by i·seq/(2·batch) tokens, right-padded to seq."""
    from trainmech import workload

    if batch < 2:
        raise TrainmechError("a padded batch needs rows of different lengths: batch >= 2")
    rows = workload.lm_batch("domain", batch, seq)["input_ids"].tolist()
    return workload.pad_batch([row[: seq - i * seq // (2 * batch)] for i, row in enumerate(rows)])


def _optimizer(params, impl: str, in_backward: bool):
    from trainmech import optimizers

    if in_backward:
        return optimizers.OptimizerInBackward(params, lambda ps: optimizers.adamw(ps, impl, lr=1e-4))
    return optimizers.adamw(params, impl, lr=1e-4)


def clear_blas_workspaces() -> bool:
    """Free the cuBLAS and cuBLASLt workspaces this process keeps, one per (handle, stream), so that the
    next matmul on each allocates its own again. torch.cuda.empty_cache() does not free them (they are
    allocated blocks, not cached ones); torch._C._cuda_clearCublasWorkspaces() does. It is private: a
    CUDA build of torch has it (2.11 through 2.13, which torch._inductor.cudagraph_trees calls before a
    graph capture), a CPU build does not, so it is looked up with hasattr. Returns whether it ran."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


def _warm_up(model, data: dict, attention_context, precision) -> int | None:
    """One forward and backward before the measured steps, its gradients dropped (no update: the first
    measured step is still AdamW's first). cuBLAS and cuBLASLt create their workspaces on a handle's first
    matmul on a stream (the backward's device thread has a handle of its own) through the caching
    allocator and keep them: the bytes still allocated after the warm-up that were not before are those
    workspaces, measured (CUDA; None elsewhere). `measure_point` frees the ones an earlier model left
    (`clear_blas_workspaces`) first, or this warm-up would find them there and measure 0. Their size
    depends on the torch version and on CUBLAS_WORKSPACE_CONFIG / CUBLASLT_WORKSPACE_SIZE, so the ledger
    never assumes one."""
    from trainmech import measure

    device = next(model.parameters()).device
    before = measure.cuda_allocated(device)
    with attention_context(), precision():
        loss = model(**data, use_cache=False).loss
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    after = measure.cuda_allocated(device)
    return None if before is None else after - before


def measure_point(
    model: str,
    batch: int,
    seq: int,
    *,
    run_mode: str = "cpu",
    seed: int = 0,
    dtype: str = "fp32",
    attention: str = "auto",
    steps: tuple[str, ...] = UPDATES,
    optimizer_impl: str = "auto",
    optimizer_in_backward: bool = False,
    checkpointing: str = "none",
    padded: bool = False,
    micro_batches: int = 1,
    set_to_none: bool = True,
    allocator: str | None = None,
    warmup: bool | None = None,
    memory_history: bool = False,
    attention_dropout: float = 0.0,
) -> list[Comparison]:
    """Build the profile's model, run tracked steps (the first, then a steady one) and pair each with its prediction.

    dtype: fp32 / bf16 (the model in that dtype) or autocast-bf16 / autocast-fp16 (an fp32 model, the
    forward under torch.autocast). attention other than "auto" forces that SDPA kernel
    (torch.nn.attention.sdpa_kernel); "auto" lets torch choose, and the prediction takes the kernel the
    tracked forward dispatched (`Comparison.kernel`; `rule_kernel` is the ledger's own rule).
    optimizer_impl forces AdamW's loop / foreach / fused; optimizer_in_backward steps each parameter in
    its post-accumulate-grad hook. checkpointing "full": transformers' gradient checkpointing. padded:
    rows of different lengths, hence an attention mask. micro_batches: each step accumulates that many
    micro-batches; the comparisons are its first and last. set_to_none=False: zero_grad keeps the
    gradients as zeros. steps=("first",) stops after the first step. allocator: whose peaks come along
    (trainmech.measure.training_step_memory): CUDA's by default on a GPU, "cpu-profiler" for the CPU
    allocator's, with which a CPU runs the bookkeeping a GPU run relies on. warmup (default: on CUDA): one
    forward and backward first, which measures the cuBLAS workspaces (`_warm_up`; on CUDA after freeing
    the ones this process already kept; None where they cannot be freed). memory_history: record
    the CUDA allocator's history of the measured steps, after the model is built and warmed up, so that
    only the steps' own blocks are in it (`Comparison.history`; empty off CUDA). On CUDA the allocator's
    cache is emptied first: what earlier models left cached does not count in this point's reserved peak.
    attention_dropout: the config's attention dropout, drawn in the train-mode forward (on a CPU SDPA then
    runs its math composite: `attention_kernel`).
    """
    import gc

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainmech import measure, profiles, workload

    if tuple(steps) not in (("first",), UPDATES):
        raise TrainmechError(
            f"steps must be ('first',) or ('first', 'steady'), got {tuple(steps)!r}: a steady step needs a first one before it"
        )
    dtypes = recipe(dtype)
    if dtypes.master_bytes:
        raise TrainmechError(
            f"measure_point runs fp32, bf16 or autocast recipes, not {dtype!r} (paper accounting)"
        )
    profile = profiles.for_mode(run_mode)
    device = torch.device("cuda" if profile.device == "cuda" else "cpu")
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    model_dtype = (
        torch.float32
        if dtypes.autocast or dtypes.weight_bytes == 4
        else torch.bfloat16
        if dtype == "bf16"
        else torch.float16
    )
    autocast = {"autocast-bf16": torch.bfloat16, "autocast-fp16": torch.float16}.get(dtype)
    built = workload.build_model(
        profile.model(model), seed=seed, dtype=model_dtype, device=device, attention_dropout=attention_dropout
    )
    if checkpointing == "full":
        enable = (
            getattr(built.model, "activation_checkpointing_enable", None)
            or built.model.gradient_checkpointing_enable
        )
        enable()
    data = padded_batch(batch, seq) if padded else workload.lm_batch("domain", batch, seq)
    data = {k: t.to(device) for k, t in data.items()}
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }

    def attention_context():
        return sdpa_kernel(backends[attention]) if attention in backends else nullcontext()

    workspace = None
    if device.type == "cuda" if warmup is None else warmup:  # before the optimizer: its hooks must not step
        precision = (lambda: torch.autocast(device.type, dtype=autocast)) if autocast else nullcontext
        cleared = device.type == "cuda" and clear_blas_workspaces()  # an earlier model's: not this warm-up's
        if cleared:
            torch.cuda.empty_cache()
        workspace = _warm_up(built.model, data, attention_context, precision)
        if not cleared:
            workspace = None  # workspaces that could not be freed would be measured as 0: unknown instead
    optimizer = _optimizer(built.model.parameters(), optimizer_impl, optimizer_in_backward)
    shape = model_shape(built.model.config)
    dropout = attention_dropout > 0
    gpu = (torch.cuda.get_device_capability(device), torch.version.cuda) if device.type == "cuda" else ()
    stack = sdpa_stack(*gpu)  # the torch (and on CUDA the GPU) the rule is read for
    rule = attention_kernel(  # the probability itself: cuDNN refuses one off its 1/16 grid
        shape, dtype, device.type, attention, padded=padded, dropout=attention_dropout, stack=stack
    )
    out = []
    recording = (
        measure.cuda_memory_history(device) if memory_history else nullcontext(measure.MemoryHistory())
    )
    try:
        with recording as history:
            for step in steps:
                for k in range(1, micro_batches + 1):
                    with attention_context():
                        measured = measure.training_step_memory(
                            built.model,
                            optimizer,
                            data,
                            grads_at_start=k > 1 or (not set_to_none and step != "first"),
                            update=k == micro_batches,
                            set_to_none=set_to_none,
                            autocast=autocast,
                            allocator=allocator,
                        )
                    if k in (1, micro_batches):
                        seen = _dispatched_kernel(measured, checkpointing)
                        predicted = training_state_lifecycle(
                            shape,
                            batch,
                            seq,
                            dtype=dtype,
                            device=device.type,
                            first_step=step == "first",
                            attention=seen or rule,
                            optimizer_impl=optimizer_impl,
                            optimizer_in_backward=optimizer_in_backward,
                            checkpointing=checkpointing,
                            padded=padded,
                            micro_batches=micro_batches,
                            micro_batch=k,
                            set_to_none=set_to_none,
                            weigh_rng=device.type
                            == "cuda",  # the RNG state of the kernel that ran, weighed here
                            dropout=dropout,
                        )
                        out.append(
                            Comparison(
                                model,
                                batch,
                                seq,
                                step,
                                predicted,
                                measured,
                                k,
                                seen or "unknown",
                                rule,
                                workspace,
                                stack=stack,
                            )
                        )
    finally:
        if optimizer_in_backward:
            optimizer.remove()
    for c in out:
        c.history = history
    return out


def _dispatched_kernel(step, checkpointing: str) -> str | None:
    """The SDPA kernel of the forward whose tensors the backward reads: under checkpointing the recompute
    inside the backward (a reentrant checkpoint runs the first forward without grad, where SDPA may pick
    another kernel, and that forward saves nothing), otherwise the forward's layers."""
    if checkpointing != "none":
        recomputed = kernel_of_ops(a.op for a in step.allocations if a.recomputed)
        if recomputed:
            return recomputed
    return kernel_of_ops(a.op for a in step.allocations if a.born_phase.startswith("forward.layer"))


def measured_bytes_per_param(model: str, dtype: str, *, run_mode: str = "cpu", seed: int = 0) -> int | float:
    """Model-state bytes per parameter measured in a first AdamW update: the weights, every gradient when
    the update starts, and the two moments it creates (AdamW's per-tensor step counters left out)."""
    (point,) = measure_point(model, 1, 16, run_mode=run_mode, seed=seed, dtype=dtype, steps=("first",))
    return model_state_bytes_per_param(
        point.measured, len(point.predicted.shape.parameter_tensors()), point.predicted.shape.n_params
    )


def model_state_bytes_per_param(step: Any, n_tensors: int, n_params: int) -> int | float:
    """Weights + gradients + the two AdamW moments of one tracked first update (a `StepMemory`), per parameter.

    The step counters (`n_tensors` of them, STEP_COUNTER_BYTES each) are subtracted from the optimizer
    states of every device together: on CUDA the foreach and loop implementations keep them on the host,
    where the device count (`by_category`) never had them and `elsewhere_at_end` does.
    """
    gradients = step.by_category(step.phases.index("optimizer"))["gradients"]
    states = (
        step.by_category(len(step.live) - 1)["optimizer_states"] + step.elsewhere_at_end()["optimizer_states"]
    )
    moments = states - STEP_COUNTER_BYTES * n_tensors
    total = step.baseline["parameters"] + gradients + moments
    return total // n_params if total % n_params == 0 else total / n_params
