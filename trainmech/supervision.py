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
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from trainmech.checks import num, rel_error
from trainmech.display import format_table
from trainmech.errors import TrainmechError
from trainmech.measure import cuda_allocated, cuda_peaks, reset_cuda_peaks, time_stats, timed
from trainmech.workload import IGNORE_INDEX, split_micro_batches, supervised_tokens, to_device, uneven_batch

__all__ = [
    "NORMALIZATIONS",
    "Window",
    "token_loss_sum",
    "denominators",
    "token_weights",
    "count_tokens",
    "accumulate_gradients",
    "GradientAccumulationResult",
    "gradient_accumulation_experiment",
]

NORMALIZATIONS = ("window_tokens", "micro_mean")


class Window(NamedTuple):
    """What one accumulation window produced: its loss (as the normalisation defines it) and counts."""

    loss: (
        torch.Tensor
    )  # 0-dim float64 on the model's device, detached: the sum of the back-propagated micro-batch losses
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


def denominators(
    micro_tokens: list[int] | tuple[int, ...], normalization: str = "window_tokens"
) -> list[int]:
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


def token_weights(
    micro_tokens: list[int] | tuple[int, ...], normalization: str = "window_tokens"
) -> list[float]:
    """The weight one supervised token of each micro-batch carries in the window's loss."""
    return [1.0 / d for d in denominators(micro_tokens, normalization)]


def count_tokens(micro_batches: list[dict[str, torch.Tensor]]) -> tuple[int, ...]:
    """Supervised tokens of each micro-batch after the causal shift, read with one host sync.

    The counts are reduced on the labels' device and copied to the host together: count them once,
    before a timed window, not once per micro-batch inside it.
    """
    if not micro_batches:
        return ()
    counts = torch.stack(
        [(mb["labels"][:, 1:] != IGNORE_INDEX).sum() for mb in micro_batches]
    )  # (n,) on the device
    return tuple(int(n) for n in counts.tolist())


def accumulate_gradients(
    model: torch.nn.Module,
    accumulation_window: list[dict[str, torch.Tensor]],
    *,
    normalization: str = "window_tokens",
    micro_tokens: list[int] | tuple[int, ...] | None = None,
    autocast: Callable[[], AbstractContextManager] | None = None,
    contexts: tuple[Callable[[torch.nn.Module], AbstractContextManager], ...] = (),
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    forward_kwargs: dict | None = None,
) -> Window:
    """Forward and backward over one accumulation window, adding into every parameter's .grad.

    accumulation_window: its micro-batches, dicts with input_ids, attention_mask, labels
    (B_i, T_i), on the model's device. Each micro-batch's summed token loss is divided by its denominator (see
    `denominators`) before backward, so after the call .grad holds the gradient of the window's
    loss. The caller zeroes .grad at the window's start (as `optimizer.zero_grad()` does).
    A window without any supervised token is refused before any forward: .grad stays as it was.

    Nothing in the loop waits for the device: pass `micro_tokens` (from `count_tokens`, counted
    before a timed region) or they are counted here with one host sync; the window loss stays a
    device tensor. Optional: `autocast()` is entered around each forward and loss (e.g.
    `lambda: amp.autocast(device, "fp16")`); every `context(model)` in `contexts` around each
    micro-batch's forward and backward (checkpointing, offloading); `scale(loss)` is what backward
    runs on (e.g. `scaler.scale`); `forward_kwargs` go to every model call (e.g. use_cache=False).
    The returned loss is the unscaled window loss.
    """
    if micro_tokens is None:
        micro_tokens = count_tokens(accumulation_window)
    micro_tokens = tuple(int(n) for n in micro_tokens)
    divisors = denominators(micro_tokens, normalization)  # refuses before touching .grad
    window_loss = None
    for mb, divisor in zip(accumulation_window, divisors):
        with ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context(model))
            with autocast() if autocast is not None else nullcontext():
                logits = model(
                    input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], **(forward_kwargs or {})
                ).logits
                loss = token_loss_sum(logits, mb["labels"]) / divisor  # (B_i, T_i, V) -> (), float32 or wider
            (
                scale(loss) if scale is not None else loss
            ).backward()  # adds this share into .grad; frees its graph
        share = loss.detach().double()
        window_loss = share if window_loss is None else window_loss + share  # stays on the device
    return Window(window_loss, sum(micro_tokens), micro_tokens)


# ----------------------------------------------------------------------------- Task3's experiment


@dataclass
class GradientAccumulationResult:
    """One gradient-accumulation workload: every split against the full batch, and the timed windows.

    rows: (micro-batches, normalization) -> (gradient rel error, |loss error|, tokens per micro-batch).
    stats: micro-batches -> step-time median / P95, CUDA peaks and the allocated base (None off CUDA).
    """

    workload_id: str
    workload: object
    built: object
    input_shape: list[int]
    effective_tokens: int
    rows: dict[tuple[int, str], tuple[float, float, tuple[int, ...]]]
    stats: dict[int, dict[str, float | int | None]]
    timed_windows: int
    grad_max_abs_error: float  # largest |g_window_tokens - g_full| over the splits

    def errors(self, normalization: str) -> list[float]:
        return [rel for (_, norm), (rel, _, _) in self.rows.items() if norm == normalization]

    def table(self) -> str:
        """The splits as a table: window_tokens as a verdict (≤ 1e-6, ≤ 1e-5), micro_mean with 2 digits."""
        rows = []
        for (n, norm), (rel, dloss, tokens) in self.rows.items():
            if norm != "window_tokens":
                rows.append([n, list(tokens), norm, num(rel, 2), num(dloss, 1)])
            elif rel <= 1e-6 and dloss <= 1e-5:
                rows.append([n, list(tokens), norm, "≤ 1e-6", "≤ 1e-5"])
            else:
                rows.append([n, list(tokens), norm, f"{rel:.1e}", f"{dloss:.1e}"])
        head = (
            f"{self.workload_id}: effective batch = {self.workload.batch} sequences, {self.effective_tokens} "
            "supervised tokens, whatever the split"
        )
        header = ["micro-batches", "supervised tokens each", "normalization", "grad rel error", "loss Δ"]
        return head + "\n" + format_table(header, rows)

    def peak_lines(self, reference: str) -> str:
        """CUDA: peaks and times per split next to the registry's reference; CPU: one sentence."""
        if self.stats[1]["peak_allocated_bytes"] is None:
            return "  peaks: not measured on CPU (null in the record); step times: in the record only"
        gib, lines = 2**30, []
        for n, s in self.stats.items():
            lines.append(
                f"  {n} micro-batch(es): peak allocated {s['peak_allocated_bytes'] / gib:.2f} GiB "
                f"(+{(s['peak_allocated_bytes'] - s['base_allocated_bytes']) / gib:.2f} over the base), reserved "
                f"{s['peak_reserved_bytes'] / gib:.2f} GiB, median {s['step_time_median_s'] * 1e3:.1f} ms, "
                f"P95 {s['step_time_p95_s'] * 1e3:.1f} ms"
            )
        top, full = self.stats[max(self.stats)], self.stats[1]
        lines.append(
            f"  ours: peak {100 * (top['peak_allocated_bytes'] / full['peak_allocated_bytes'] - 1):+.1f}%, median "
            f"{100 * (top['step_time_median_s'] / full['step_time_median_s'] - 1):+.1f}% ({max(self.stats)} "
            f"micro-batches vs full); registry: {reference}"
        )
        return "\n".join(lines)

    def record_fields(self) -> dict:
        """Keyword arguments of `Session.record` for TRAIN-GRADIENT-ACCUMULATION (the largest split is the candidate)."""
        top = max(self.stats)
        window_tokens = [(rel, d) for (_, norm), (rel, d, _) in self.rows.items() if norm == "window_tokens"]
        metrics = {f"grad_rel_error_mb{n}_{norm}": rel for (n, norm), (rel, _, _) in self.rows.items()}
        metrics |= {f"loss_abs_error_mb{n}_{norm}": d for (n, norm), (_, d, _) in self.rows.items()}
        metrics |= {
            f"micro_tokens_mb{n}": list(t)
            for (n, norm), (_, _, t) in self.rows.items()
            if norm == "window_tokens"
        }
        for n, s in self.stats.items():
            metrics |= {f"{k}_mb{n}": v for k, v in s.items()}
        return dict(
            built=self.built,
            input_shape=self.input_shape,
            candidate=f"micro_batches={top}",
            effective_batch={"sequences": self.workload.batch, "supervised_tokens": self.effective_tokens},
            dtype="float32",
            update_count=self.workload.updates,
            correctness={
                "output_max_abs_error": max(d for _, d in window_tokens),
                "grad_max_abs_error": self.grad_max_abs_error,
                "all_finite": True,
                "skipped_updates": 0,
                "effective_updates": self.workload.updates,
            },
            resources={k: v for k, v in self.stats[top].items() if k != "base_allocated_bytes"},
            conclusion={
                "next_step": "compare peak and step time of full batch vs micro-batches on TRAIN-CUDA-MECHANISM"
            },
            metrics={**metrics, "timed_windows": self.timed_windows, "normalization": "window_tokens"},
        )


def gradient_accumulation_experiment(
    session, workload_id: str, *, lr: float, warmup: int, timed_windows: int
) -> GradientAccumulationResult:
    """The full batch against 2..n micro-batches under both normalizations, then timed AdamW updates.

    On a fresh model of the workload: the uneven batch's full-batch gradient is the reference for
    every split and normalization; then each split (1 = the full batch) runs `warmup` untimed and
    `timed_windows` timed updates (zero_grad, `accumulate_gradients`, step) with CUDA peaks over the
    timed ones. Token counts are taken before the timed region: it holds no host sync.
    """
    w = session.workload(workload_id)
    built = session.build_model(w.model)
    model, device = built.model, session.device
    batch = to_device(uneven_batch(w.batch, w.seq), device)
    model.zero_grad(set_to_none=True)
    reference = model(**batch)
    reference.loss.backward()
    g_ref, loss_ref = torch.cat([p.grad.flatten() for p in model.parameters()]), reference.loss.item()
    rows, grad_err = {}, 0.0
    for n in [k for k in w.micro_batches if k > 1]:
        micro = split_micro_batches(batch, n)
        for norm in NORMALIZATIONS:
            model.zero_grad(set_to_none=True)
            window = accumulate_gradients(model, micro, normalization=norm)
            diff, rel = rel_error(torch.cat([p.grad.flatten() for p in model.parameters()]), g_ref)
            rows[(n, norm)] = (rel, abs(float(window.loss) - loss_ref), window.micro_tokens)
            if norm == "window_tokens":
                grad_err = max(grad_err, diff)
    optimizer, stats = torch.optim.AdamW(model.parameters(), lr=lr), {}
    for n in w.micro_batches:
        micro = split_micro_batches(batch, n)
        tokens = count_tokens(micro)  # counted here, outside the timed update

        def one_update(micro=micro, tokens=tokens):
            optimizer.zero_grad(set_to_none=True)
            accumulate_gradients(model, micro, micro_tokens=tokens)
            optimizer.step()

        for _ in range(warmup):
            one_update()
        base = cuda_allocated(device)
        reset_cuda_peaks(device)
        seconds = [timed(one_update, device)[1] for _ in range(timed_windows)]
        stats[n] = {**time_stats(seconds), **cuda_peaks(device), "base_allocated_bytes": base}
    return GradientAccumulationResult(
        workload_id,
        w,
        built,
        list(batch["input_ids"].shape),
        supervised_tokens(batch["labels"]),
        rows,
        stats,
        timed_windows,
        grad_err,
    )
