"""The mixed-precision harness: autocast per precision, the dtypes actually used, the scaled update.

Flags say what was asked for; forward hooks say what ran. `activation_dtypes` records the dtype
of every output a module kind produced, which is how a notebook tells FP16 from a silent FP32.
`scaled_step` runs GradScaler's update and reports whether the optimizer really stepped: the
scaler backs the scale off exactly when it found an inf or NaN, and only then skips the step.
`fresh_accelerator` resets accelerate's process-wide state (AcceleratorState, GradientState) before
it builds an Accelerator: an Accelerator made earlier in the process no longer holds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from trainmech.checks import dtype_name
from trainmech.errors import TrainmechError

__all__ = [
    "PRECISIONS",
    "compute_dtype",
    "precision_of",
    "autocast",
    "activation_dtypes",
    "grad_scaler",
    "scaled_step",
    "fresh_accelerator",
]

# precision -> the dtype autocast runs in (None: no autocast, FP32 throughout); the one table of precisions
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> str:
    """The compute dtype a precision runs in, by name: "fp32" → "float32", "bf16" → "bfloat16"."""
    return dtype_name(PRECISIONS[precision] or torch.float32)


def precision_of(dtype: str) -> str:
    """The precision whose compute dtype is `dtype` ("float32", "bfloat16", "float16"); the inverse of compute_dtype."""
    for precision in PRECISIONS:
        if compute_dtype(precision) == dtype:
            return precision
    raise TrainmechError(f"unknown dtype {dtype!r}; valid: {', '.join(map(compute_dtype, PRECISIONS))}")


def autocast(device: torch.device, precision: str):
    """torch.autocast for "bf16" / "fp16" on the device's type; a no-op context for "fp32"."""
    if precision not in PRECISIONS:
        raise TrainmechError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _kind(module: torch.nn.Module) -> str:
    return type(module).__name__


@contextmanager
def activation_dtypes(
    model: torch.nn.Module, kinds: tuple[str, ...] = ("Linear",)
) -> Iterator[dict[str, set[str]]]:
    """Within the block, collect {module class name: dtypes of its outputs} for modules of `kinds`.

    kinds are class names (e.g. "Linear", "Qwen2RMSNorm", "Embedding"). The hooks are removed on
    exit. What is seen is what ran, whatever a flag claimed.
    """
    seen: dict[str, set[str]] = defaultdict(set)

    def hook(module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(out):
            seen[_kind(module)].add(dtype_name(out.dtype))

    handles = [m.register_forward_hook(hook) for m in model.modules() if _kind(m) in kinds]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def grad_scaler(device: torch.device, precision: str, **kwargs) -> torch.amp.GradScaler:
    """A GradScaler on the device's type, enabled only for "fp16" (BF16 keeps FP32's exponent range)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16", **kwargs)


def scaled_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """scaler.step + scaler.update; True when the optimizer stepped, False when it was skipped.

    GradScaler skips the step exactly when the unscaled gradients hold an inf or NaN, and then
    multiplies the scale by backoff_factor (< 1); a clean step keeps or grows the scale. So a
    smaller scale after update() is the skip.
    """
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return not (scaler.is_enabled() and scaler.get_scale() < before)


def fresh_accelerator(**kwargs):
    """An `accelerate.Accelerator` built from a clean process-wide state.

    Accelerate keeps one state per process and refuses a second Accelerator with another
    mixed_precision; a notebook that compares several needs the reset accelerate's own tests use.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(**kwargs)
