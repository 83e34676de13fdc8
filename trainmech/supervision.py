"""Supervision: which positions enter the loss, how many they are, and what a window divides by.

Two masks travel with a causal-LM batch. `attention_mask` says what the model may *see*;
`labels` (IGNORE_INDEX where not supervised) say which positions enter the *loss*. After the
causal shift, logits[:, t] predict labels[:, t + 1], so the effective supervised tokens of a
batch are `labels[:, 1:] != IGNORE_INDEX` (`workload.supervised_tokens`).

An accumulation window is the list of micro-batches between zeroing the gradients and the next
effective update. Its loss is the mean over every supervised token of the window, so each
micro-batch's *summed* token loss is divided by the window's token count N:

    window_tokens:  loss_i = sum_i / N                  (matches the full batch)
    micro_mean:     loss_i = (sum_i / N_i) / n           (the common bug: a token of a short
                                                          micro-batch weighs more)

The two agree only when every micro-batch supervises the same number of tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F

from trainmech import amp
from trainmech.errors import TrainmechError
from trainmech.workload import IGNORE_INDEX, supervised_tokens

NORMALIZATIONS = ("window_tokens", "micro_mean")


class Window(NamedTuple):
    """What one accumulation window produced: its loss (as the normalisation defines it) and counts."""

    loss: torch.Tensor  # 0-dim float64 on the batch's device, detached: the sum of the back-propagated micro-batch losses
    effective_tokens: int  # supervised tokens of the whole window, after the causal shift
    micro_tokens: tuple[int, ...]  # supervised tokens of each micro-batch


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy after the causal shift, in float32 or wider.

    logits (B, T, V), labels (B, T) with IGNORE_INDEX where not supervised. Returns a 0-dim
    tensor: the sum over supervised positions (0 when there is none), never a mean. Half
    precision logits are upcast to float32 first (as transformers does); float64 stays float64.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    shifted = logits[:, :-1].flatten(0, 1).to(dtype)  # (B*(T-1), V): position t predicts t+1
    targets = labels[:, 1:].flatten()  # (B*(T-1),)
    return F.cross_entropy(shifted, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def denominators(micro_tokens: list[int] | tuple[int, ...], normalization: str = "window_tokens") -> list[int]:
    """What each micro-batch's summed token loss is divided by (exact integers).

    window_tokens: the window's total N for every micro-batch. micro_mean: n * N_i. Refuses an
    unknown normalisation, a window with no supervised token, and (micro_mean) a micro-batch
    with none, whose mean would be 0/0.
    """
    if normalization not in NORMALIZATIONS:
        raise TrainmechError(f"unknown normalization {normalization!r}; valid: {', '.join(NORMALIZATIONS)}")
    if not micro_tokens:
        raise TrainmechError("an accumulation window needs at least one micro-batch")
    total = sum(micro_tokens)
    if total == 0:
        raise TrainmechError(
            "the accumulation window supervises no token (every label after the causal shift is "
            f"IGNORE_INDEX={IGNORE_INDEX}): there is no loss to average. A plain mean would log 0/0 = NaN while every "
            ".grad stays exactly 0, so a finiteness check would let the optimizer step (AdamW still moves the weights "
            "through its momentum and weight decay)"
        )
    if normalization == "window_tokens":
        return [total] * len(micro_tokens)
    empty = [i for i, n in enumerate(micro_tokens) if n == 0]
    if empty:
        raise TrainmechError(
            f"micro-batch {empty[0]} supervises no token: its mean is 0/0 under normalization='micro_mean'"
        )
    return [len(micro_tokens) * n for n in micro_tokens]


def token_weights(micro_tokens: list[int] | tuple[int, ...], normalization: str = "window_tokens") -> list[float]:
    """The weight one supervised token of each micro-batch carries in the window's loss."""
    return [1.0 / d for d in denominators(micro_tokens, normalization)]


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    normalization: str = "window_tokens",
    context: Callable[[], AbstractContextManager] = nullcontext,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    model_kwargs: dict | None = None,
    micro_tokens: tuple[int, ...] | None = None,
) -> Window:
    """Forward and backward over one accumulation window, adding into every parameter's .grad.

    micro_batches: dicts with input_ids, attention_mask, labels (B_i, T_i), on the model's
    device. Each micro-batch's summed token loss is divided by its denominator (see
    `denominators`) before backward, so after the call .grad holds the gradient of the window's
    loss. The caller zeroes .grad at the window's start (as `optimizer.zero_grad()` does).
    A window without any supervised token is refused before any forward: .grad stays as it was.

    A training strategy plugs in without another copy of this loop: `context()` is entered around
    each micro-batch's forward and backward (checkpointing, offload hooks), the forward runs under
    the autocast of `precision` ("fp32" / "bf16" / "fp16", trainmech.amp), `scaler` (a GradScaler)
    scales each loss before its backward, and `model_kwargs` go to every forward (e.g. use_cache=False).
    The window's loss stays a device tensor; with the token counts given (`micro_tokens`, counted once
    for a fixed window) nothing here waits for the device.
    """
    if micro_tokens is None:
        micro_tokens = tuple(supervised_tokens(mb["labels"]) for mb in micro_batches)
    divisors = denominators(micro_tokens, normalization)  # refuses before touching .grad
    device = micro_batches[0]["input_ids"].device
    window_loss = torch.zeros((), dtype=torch.float64, device=device)
    for mb, divisor in zip(micro_batches, divisors):
        with context():
            with amp.autocast(device, precision):
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], **(model_kwargs or {})).logits
            loss = token_loss_sum(logits, mb["labels"]) / divisor  # (B_i, T_i, V) logits -> a float32 scalar
            (loss if scaler is None else scaler.scale(loss)).backward()  # adds this micro-batch's share into .grad
        window_loss += loss.detach()
    return Window(window_loss, sum(micro_tokens), micro_tokens)
