"""Dtype recipes: how many bytes each state takes per element.

Three families. Pure: the whole model in one dtype (fp32, bf16, fp16), AdamW's moments follow the
weights. torch.autocast: weights, gradients and moments stay fp32; matmuls and SDPA run in 16 bits
on 16-bit copies of their inputs and weights, which the backward keeps (the `autocast-*` recipes;
Task3's AMP). Mixed, as the ZeRO paper counts it: 16-bit weights and gradients, an fp32 master
copy and fp32 moments in the optimizer (K = 12 bytes per parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmech.errors import TrainmechError

__all__ = [
    "FP32_BYTES",
    "INDEX_BYTES",
    "STEP_COUNTER_BYTES",
    "Recipe",
    "RECIPES",
    "recipe",
    "recipe_for_dtype",
]

FP32_BYTES = 4  # tensors that stay fp32 whatever the recipe: norm statistics, the loss, its log-softmax
INDEX_BYTES = 8  # int64: position ids, labels
STEP_COUNTER_BYTES = 4  # AdamW's state["step"]: one fp32 scalar per parameter tensor, never sharded


@dataclass(frozen=True)
class Recipe:
    """Bytes per element of each state."""

    name: str
    weight_bytes: int
    grad_bytes: int
    activation_bytes: int  # what matmuls and SDPA produce (16 bits under autocast)
    moment_bytes: int  # each AdamW moment
    master_bytes: int  # an fp32 copy of the weights kept by the optimizer (0: none)
    autocast: bool = False  # torch.autocast: fp32 weights, 16-bit copies per use
    measured: bool = False  # compared with a measurement in this project (Task4 on CPU)

    @property
    def sixteen_bit(self) -> bool:
        return self.activation_bytes < FP32_BYTES

    @property
    def model_state_bytes_per_param(self) -> int:
        """Weights + gradients + master copy + two AdamW moments."""
        return self.weight_bytes + self.grad_bytes + self.master_bytes + 2 * self.moment_bytes


RECIPES = {
    "fp32": Recipe("fp32", 4, 4, 4, 4, 0, measured=True),
    "bf16": Recipe("bf16", 2, 2, 2, 2, 0, measured=True),
    "fp16": Recipe("fp16", 2, 2, 2, 2, 0),
    "autocast-bf16": Recipe("autocast-bf16", 4, 4, 2, 4, 0, autocast=True, measured=True),
    "autocast-fp16": Recipe("autocast-fp16", 4, 4, 2, 4, 0, autocast=True, measured=True),
    "mixed-bf16": Recipe("mixed-bf16", 2, 2, 2, 4, 4),  # ZeRO's accounting
    "mixed-fp16": Recipe("mixed-fp16", 2, 2, 2, 4, 4),
}


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise TrainmechError(f"unknown dtype recipe {name!r}; valid: {', '.join(RECIPES)}")
    return RECIPES[name]


RECIPE_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def recipe_for_dtype(dtype: str) -> str:
    """The recipe of a model trained in one dtype throughout (a profile workload's `dtype`)."""
    if dtype not in RECIPE_OF_DTYPE:
        raise TrainmechError(f"no ledger recipe for dtype {dtype!r}; valid: {', '.join(RECIPE_OF_DTYPE)}")
    return RECIPE_OF_DTYPE[dtype]
