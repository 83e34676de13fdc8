"""What a gpu-check package check runs on, and how it reports.

A check takes a `Probe` (a device, the profile that goes with it, a small model and batch) and runs
on any device: on a GPU it takes the CUDA side, on a CPU the same logic with the CPU side chosen. It
returns its one-line reason, or raises `CheckFailed` (through `require`) with its finding. The checks
that compare a strategy's gradients with the baseline's share `forward_backward` and `same_gradients`
(bitwise on a CPU, within 1e-4 of each gradient's scale on CUDA).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from trainmech import profiles, workload

__all__ = [
    "CheckFailed",
    "require",
    "Probe",
    "forward_backward",
    "same_gradients",
]


class CheckFailed(AssertionError):
    """A check's finding, in one line."""


def require(condition: bool, reason: str) -> None:
    """Raise CheckFailed with `reason` unless `condition` holds."""
    if not condition:
        raise CheckFailed(reason)


@dataclass(frozen=True)
class Probe:
    """What a check runs on: a device, the profile that goes with it, and a small model and batch."""

    device: torch.device
    mode: str
    model_name: str
    batch: int
    seq: int

    @classmethod
    def for_device(cls, device: torch.device | str) -> Probe:
        """CUDA: the Qwen2.5-0.5B shape with 2 layers, b2 s64. CPU: the tiny CPU model, b2 s32."""
        device = torch.device(device)
        if device.type == "cuda":
            return cls(device, "TRAIN-CUDA-MECHANISM", "qwen2.5-0.5b-2layers", 2, 64)
        return cls(device, "cpu", "qwen2-tiny", 2, 32)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def model(self, **kwargs) -> torch.nn.Module:
        spec = profiles.for_mode(self.mode).model(self.model_name)
        return workload.build_model(spec, seed=0, device=self.device, **kwargs).model

    def lm_batch(self, batch: int | None = None, seq: int | None = None) -> dict[str, torch.Tensor]:
        data = workload.lm_batch("domain", batch or self.batch, seq or self.seq)
        return {k: v.to(self.device) for k, v in data.items()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst_rel(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((ours[n] - g).abs().max()) / max(float(g.abs().max()), 1e-30) for n, g in ref.items())


def forward_backward(model, batch, hooks=None) -> dict[str, torch.Tensor]:
    """One forward and backward of the batch (under `hooks`, a context, if given); the gradients it left."""
    model.zero_grad(set_to_none=True)
    with hooks if hooks is not None else nullcontext():
        model(**batch, use_cache=False).loss.backward()
    return _grads(model)


def same_gradients(probe: Probe, ours, ref) -> tuple[bool, str]:
    """(equal, how): bitwise on a CPU; within 1e-4 of each gradient's scale on CUDA (atomics reorder sums)."""
    if not probe.cuda:
        return all(torch.equal(ours[n], g) for n, g in ref.items()), "bitwise"
    worst = _worst_rel(ours, ref)
    return worst <= 1e-4, f"worst relative error {worst:.1e}"
