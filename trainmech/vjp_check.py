"""Autograd as the reference for a hand-written VJP, and the comparison against it.

One reference, used by Task2's notebook, the exercises' checks and the tests alike:

    out, grads = reference_vjp(fn, inputs, grad_out)   # autograd's fn(*inputs) and VJP, nothing else
    run = autograd_vjp(fn, inputs, grad_out, references=(weight,))
    run.out, run.grads          # the same, plus what autograd saved for that backward:
    run.saved, run.saved_bytes  # SavedStorage rows (trainmech.saved_state) and their new bytes
    compare_vjp("linear", y, (dx, dW, db), run, rtol=1e-10)   # one `close` line per tensor

The trick: the gradient of the scalar <fn(*inputs), grad_out> with respect to each input IS the
VJP grad_out^T J, so one `(out * grad_out).sum().backward()` gives every input's gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from trainmech.checks import ClaimFailed, close
from trainmech.saved_state import ForwardRecord, SavedStorage, record_forward

__all__ = ["reference_vjp", "AutogradVJP", "autograd_vjp", "compare_vjp"]


def _vjp(fn, inputs, grad_out, constants, record: ForwardRecord | None):
    """fn(*inputs) under autograd (its forward inside `record` when given), then the VJP trick.

    Float inputs become leaves that share the caller's memory (so a record recognises `references`,
    e.g. the weights); inputs at the indices in `constants` (rope's cos / sin) get no gradient.
    """
    leaves = [
        t.detach().requires_grad_(True)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and i not in constants
        else t
        for i, t in enumerate(inputs)
    ]
    with record if record is not None else contextlib.nullcontext():
        out = fn(*leaves)
    if record is not None:
        record.find_consumers(out)  # before backward frees what the nodes saved
    (out * grad_out).sum().backward()
    grads = tuple(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves)
    return out.detach(), grads


def reference_vjp(fn, inputs, grad_out, *, constants=()) -> tuple[torch.Tensor, tuple]:
    """(fn(*inputs), one gradient per input) from autograd; None for non-float inputs and `constants`."""
    return _vjp(fn, inputs, grad_out, constants, None)


@dataclass
class AutogradVJP:
    out: torch.Tensor
    grads: tuple[torch.Tensor | None, ...]  # one per input; None for integer / None / constant inputs
    saved: list[SavedStorage]
    saved_bytes: int  # references excluded


def autograd_vjp(fn, inputs, grad_out, *, constants=(), references=()) -> AutogradVJP:
    """`reference_vjp` with the forward recorded: what autograd saved for this backward, and its bytes."""
    m = record_forward(references=references)
    out, grads = _vjp(fn, inputs, grad_out, constants, m)
    return AutogradVJP(out, grads, m.saved, m.saved_bytes)


def compare_vjp(
    name: str, out: torch.Tensor, grads, run: AutogradVJP, *, rtol: float, input_names=None
) -> tuple[float, float]:
    """One `close` line for the output and for each input gradient (ours vs autograd's); raises on
    a mismatch or where one side has a gradient and the other has not. Returns (max |Δ| of the
    output, max |Δ| over the gradients)."""
    input_names = input_names or [f"d{i}" for i in range(len(run.grads))]
    out_err = close(f"{name}.out", out, run.out, rtol=rtol)
    grad_err = 0.0
    for label, ours, ref in zip(input_names, grads, run.grads):
        if (ours is None) != (ref is None):
            raise ClaimFailed(f"{name}.{label}: one side has a gradient, the other has none")
        if ref is not None:
            grad_err = max(grad_err, close(f"{name}.{label}", ours, ref, rtol=rtol))
    return out_err, grad_err
