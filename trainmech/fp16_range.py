"""Does this model's forward stay inside float16's range? Checked before any float16 candidate is judged.

Under float16 autocast every nn.Linear puts out float16, whose largest finite value is 65504. A forward that leaves
that range makes the loss inf or NaN whatever the loss scale (GradScaler scales the backward, not the forward), and
the gradients gate would reject a correct float16 candidate for it. Pretrained weights trained in bfloat16 can do
that (Qwen2 / Qwen2.5); the remedy is bfloat16, float32's range at 16 bits.

    found = fp16_range.fp16_range(gate_workload)   # every Linear's max |output| in the gate windows' forwards
    print(found.message()); found.fits
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainmech import amp
from trainmech.tracing import _rng_states, _set_rng_states

if TYPE_CHECKING:
    from trainmech.candidates import GateWorkload

__all__ = ["FP16_MAX", "Fp16Range", "fp16_range"]

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504: the largest finite float16


@dataclass(frozen=True)
class Fp16Range:
    """What every nn.Linear put out in the gate windows' forwards under float16 autocast (`fp16_range`)."""

    largest: float  # max |output| over every Linear and every forward (inf: one overflowed)
    module: str  # the Linear where it was
    linears: int  # how many Linear modules were watched
    weights: str | None = (
        None  # the weights checked, as workload.BuiltModel.model_weights names them (None: unnamed)
    )

    @property
    def fits(self) -> bool:
        return self.largest < FP16_MAX

    @property
    def pretrained(self) -> bool:
        """The weights checked are pretrained ones (`workload.build_model` found them locally), not a random init."""
        return (self.weights or "").startswith("pretrained")

    def _what_it_shows(self) -> str:
        if self.weights is None:
            return "the weights checked are not named, so this says nothing about which weights those were"
        if self.pretrained:
            return f"on the initial {self.weights} weights (the updated weights of later windows are not checked)"
        return (
            f"on {self.weights} weights: they stay in range, which is no evidence about the pretrained Qwen2.5 "
            "weights (trained in bfloat16; this run did not load them), the case this check exists for"
        )

    def message(self) -> str:
        if self.fits:
            return (
                f"every one of {self.linears} nn.Linear outputs stays finite and below float16's largest finite "
                f"{FP16_MAX:g} under float16 autocast, in every forward of the gate windows, "
                + self._what_it_shows()
            )
        return (
            f"under float16 autocast {self.module} puts out |x| = {self.largest:g}, beyond float16's largest finite "
            f"{FP16_MAX:g}: the forward itself overflows, and no loss scale fixes that, so gate 2 would reject a "
            "correct float16 candidate for it; run the 16-bit candidates in bfloat16 (dtype='bfloat16', "
            "float32's range) with these weights"
        )


def fp16_range(workload: GateWorkload, weights: str | None = None) -> Fp16Range:
    """Every forward of the workload's windows (training mode, its dropout, no gradients) from the initial weights
    under float16 autocast, every nn.Linear's output watched: the largest |output| and where. A forward that leaves
    float16's range makes the loss non-finite whatever the loss scale; pretrained weights trained in bfloat16 can do
    that (Qwen2 / Qwen2.5), random ones rarely. weights: what the model's weights are (`BuiltModel.model_weights`,
    "random-init seed=N" or "pretrained <path>"): the message says what the check shows on them — on a random init,
    nothing about the pretrained weights. The global RNG is left as it was."""
    model = workload.model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    largest = {name: 0.0 for name in linears}

    def watch(name):
        def hook(module, inputs, out):
            seen = float(out.detach().abs().max())  # NaN where the float16 output holds one: out of range too
            largest[name] = max(largest[name], seen if math.isfinite(seen) else math.inf)

        return hook

    handles = [m.register_forward_hook(watch(name)) for name, m in linears.items()]
    rng = _rng_states(workload.device)  # the dropout's draws here must not move the runs' RNG
    try:
        with workload.running(), torch.no_grad():
            model.load_state_dict(workload.initial)
            model.train()
            for window in workload.windows:
                for micro_batch in window:
                    with amp.autocast(workload.device, "fp16"):
                        model(**micro_batch, use_cache=False)
    finally:
        _set_rng_states(workload.device, rng)
        for h in handles:
            h.remove()
    worst = max(largest, key=lambda name: largest[name])
    return Fp16Range(largest[worst], worst, len(linears), weights)
