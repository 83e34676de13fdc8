"""Scenarios of the training-state ledger: which peak a strategy moves, on which update, with which optimizer step.

A memory strategy acts on saved tensors, so it lowers the forward + backward peak; whether the
whole update's peak falls with it depends on what else peaks: on the first update AdamW has no
moments yet, on a steady one a foreach step holds every gradient, both moments and one temporary
per parameter at once. These views re-time the states of a `ledger.Ledger` (nothing is
re-derived) and put the cases side by side:

    book.offloaded(min_bytes)             what ActivationOffload does to the saved tensors' device lifetimes (trainmech.ledger)
    scenario_ledger(…, optimizer=…)       foreach / for-loop / fused step, or the update inside the backward
    book.forward_backward_peak()          the most bytes alive before the optimizer step (trainmech.ledger)
    scenario_matrix(config, b, s, …)      strategy × first / steady update × both peaks, as Scenario rows

`measured(step)` reads the same two peaks off a tracked step (trainmech.measure), so each cell can
be checked on a CPU with the device's choices forced (foreach, the offload's groups).

Written for Task5 while the ledger becomes a package (issue 15); when that package offers the
scenario matrix itself, these views belong there as Ledger methods.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from trainmech import ledger, measure
from trainmech.errors import TrainmechError
from trainmech.ledger import Ledger, phase_of

STRATEGIES = ("baseline", "checkpoint", "offload")
STEPS = ("first", "steady")
# each optimizer step as options of ledger.training_state_lifecycle ("default": the device's own choice)
OPTIMIZER_STEPS = {"default": {}, "foreach": {"optimizer_impl": "foreach"}, "for-loop": {"optimizer_impl": "loop"},
                   "fused": {"optimizer_impl": "fused"}, "in-backward": {"optimizer_in_backward": True}}
UPDATE_TICKS = ("optimizer", "zero_grad")


@dataclass(frozen=True)
class Scenario:
    """One cell of the matrix: a strategy on the first or a steady update, with an optimizer step."""

    strategy: str
    step: str  # "first" | "steady"
    optimizer: str  # one of OPTIMIZER_STEPS; "default": foreach on CUDA, for-loop on a CPU
    forward_backward_bytes: int
    update_bytes: int  # the whole update's peak
    update_tick: str  # where the whole update peaks

    @property
    def update_phase(self) -> str:
        return phase_of(self.update_tick)


def scenario_ledger(config, batch: int, seq: int, *, strategy: str, step: str, optimizer: str = "default",
                    dtype: str = "fp32", device: str = "cuda", attention: str = "auto", min_bytes: int | None = None,
                    prefetch_groups: int = 2, exempt_last: int = 1) -> Ledger:
    """The ledger of one scenario. min_bytes (offload): default a quarter of one hidden state."""
    if strategy not in STRATEGIES or step not in STEPS:
        raise TrainmechError(f"strategy must be one of {', '.join(STRATEGIES)} and step one of {', '.join(STEPS)}, "
                             f"got {strategy!r}, {step!r}")
    if optimizer not in OPTIMIZER_STEPS:
        raise TrainmechError(f"unknown optimizer step {optimizer!r}; valid: {', '.join(OPTIMIZER_STEPS)}")
    book = ledger.training_state_lifecycle(config, batch, seq, dtype=dtype, device=device, first_step=step == "first",
                                           checkpointing="full" if strategy == "checkpoint" else "none", attention=attention,
                                           **OPTIMIZER_STEPS[optimizer])
    if strategy == "offload":
        if min_bytes is None:
            min_bytes = batch * seq * book.shape.hidden_size * ledger.recipe(dtype).activation_bytes // 4
        book = book.offloaded(min_bytes, prefetch_groups=prefetch_groups, exempt_last=exempt_last)
    return book


def scenario_matrix(config, batch: int, seq: int, *, strategies=STRATEGIES, steps=STEPS, optimizers=("default",),
                    **kwargs) -> list[Scenario]:
    """Every (strategy, step, optimizer) scenario's forward + backward peak and whole-update peak."""
    rows = []
    for optimizer in optimizers:
        for step in steps:
            for strategy in strategies:
                book = scenario_ledger(config, batch, seq, strategy=strategy, step=step, optimizer=optimizer, **kwargs)
                peak = book.peak_overlap()
                rows.append(Scenario(strategy, step, optimizer, book.forward_backward_peak().bytes, peak.bytes, peak.tick))
    return rows


END_OF_FORWARD = "forward.head:lm_head"  # the tick the logits exist: what a micro-batch keeps alive by then grows with it


def bytes_per_row(config, rows: int, seq: int, *, strategy: str, **kwargs) -> int:
    """The ledger's capacity slope: what one more sequence adds to the bytes alive at the end of a micro-batch's
    forward, (alive with 2·rows - with rows) / rows, on a steady update; kwargs as `scenario_ledger`."""
    def alive(b):
        book = scenario_ledger(config, b, seq, strategy=strategy, step="steady", **kwargs)
        return sum(dict(book.live())[END_OF_FORWARD].values())

    return (alive(2 * rows) - alive(rows)) // rows


def measured_saved_after_forward(step_memory) -> int:
    """Saved bytes alive at the last event of a tracked step's forward (the loss included)."""
    last = max(k for k, phase in enumerate(step_memory.phases) if phase.startswith(("forward", "loss")))
    return step_memory.by_category(last)["saved"]


def worst_error(rows: list[Scenario], measured_rows: dict) -> float:
    """The largest |predicted / measured - 1| over both peaks of every row ((strategy, step, optimizer) -> (fwd+bwd, whole))."""
    return max(abs(pred / got - 1) for r in rows
               for pred, got in zip((r.forward_backward_bytes, r.update_bytes), measured_rows[(r.strategy, r.step, r.optimizer)]))


def drops(rows: list[Scenario], strategy: str) -> dict[tuple[str, str, str], float]:
    """(step, optimizer, "fwd+bwd" | "update") -> 1 - the strategy's peak / the baseline's in the same scenario."""
    base = {(r.step, r.optimizer): r for r in rows if r.strategy == "baseline"}
    return {(r.step, r.optimizer, kind): 1 - value / ref
            for r in rows if r.strategy == strategy
            for kind, value, ref in (("fwd+bwd", r.forward_backward_bytes, base[(r.step, r.optimizer)].forward_backward_bytes),
                                     ("update", r.update_bytes, base[(r.step, r.optimizer)].update_bytes))}


def measured(step_memory) -> tuple[int, int]:
    """(forward + backward peak, whole-update peak) of a tracked step (trainmech.measure.StepMemory), in
    tracked tensor bytes with the baseline the step started from."""
    base = sum(step_memory.baseline.values())
    before_update = [live for live, phase in zip(step_memory.live, step_memory.phases) if phase not in UPDATE_TICKS]
    return base + max(before_update), step_memory.peak_bytes


def render(rows: list[Scenario], *, unit: int = 2**30, unit_name: str = "GiB", measured_rows: dict | None = None) -> str:
    """The matrix as text: one line per scenario, each peak with its change against the baseline of the
    same step and optimizer; `measured_rows` ((strategy, step, optimizer) -> (fwd+bwd, whole)) adds columns."""
    base = {(r.step, r.optimizer): r for r in rows if r.strategy == "baseline"}
    head = f"{'strategy':<11}{'update':<8}{'optimizer':<13}{'fwd+bwd peak':>16}{'change':>8}{'update peak':>16}{'change':>8}  peak at"
    lines = [head + ("" if measured_rows is None else f"{'measured fwd+bwd':>19}{'measured update':>17}")]
    for r in rows:
        b = base.get((r.step, r.optimizer))
        change = lambda x, y: f"{x / y - 1:>+8.1%}" if b else f"{'':>8}"  # noqa: E731
        line = (f"{r.strategy:<11}{r.step:<8}{r.optimizer:<13}{r.forward_backward_bytes / unit:>12.2f} {unit_name}"
                f"{change(r.forward_backward_bytes, b.forward_backward_bytes if b else 1)}"
                f"{r.update_bytes / unit:>12.2f} {unit_name}{change(r.update_bytes, b.update_bytes if b else 1)}  {r.update_phase}")
        if measured_rows is not None:
            fb, whole = measured_rows[(r.strategy, r.step, r.optimizer)]
            line += f"{fb / unit:>15.2f} {unit_name}{whole / unit:>13.2f} {unit_name}"
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- measured beside predicted


@dataclass(frozen=True)
class Measured:
    """One scenario measured: tracked tensor bytes (any device), and the CUDA allocator's peaks (None elsewhere)."""

    forward_backward_bytes: int
    update_bytes: int
    forward_backward_allocated: int | None = None
    update_allocated: int | None = None
    update_reserved: int | None = None


def tracked_step(model, optimizer, batch: dict, context=None) -> measure.StepMemory:
    """One tracked training step (trainmech.measure.training_step_memory) inside `context(model)`, if given."""
    with context(model) if context is not None else nullcontext():
        return measure.training_step_memory(model, optimizer, batch)


def measure_matrix(model, batch: dict, initial: dict, *, strategies: dict, optimizers: dict) -> dict[tuple, Measured]:
    """Each (strategy, step, optimizer): a fresh optimizer from `optimizers[name](params)` on the initial weights,
    then the first update and a steady one, each tracked; on CUDA the same two updates again, untracked, with
    the allocator's peaks read after the backward and after the step. strategies: name -> (model -> context) or None."""
    device = next(model.parameters()).device
    out = {}
    for opt_name, make in optimizers.items():
        for name, context in strategies.items():
            model.load_state_dict(initial)
            model.zero_grad(set_to_none=True)
            optimizer = make(model.parameters())
            tracked = [measured(tracked_step(model, optimizer, batch, context)) for _ in STEPS]
            getattr(optimizer, "remove", lambda: None)()
            probes = [(None, None, None)] * len(STEPS)
            if device.type == "cuda":
                model.load_state_dict(initial)
                optimizer = make(model.parameters())
                probes = [_allocator_probe(model, optimizer, batch, context) for _ in STEPS]
                getattr(optimizer, "remove", lambda: None)()
            for step, (fb, whole), probe in zip(STEPS, tracked, probes):
                out[(name, step, opt_name)] = Measured(fb, whole, *probe)
    model.load_state_dict(initial)
    return out


def _allocator_probe(model, optimizer, batch: dict, context) -> tuple[int, int, int]:
    """CUDA: (forward + backward allocated peak, whole-update allocated peak, whole-update reserved peak) of one update."""
    device = next(model.parameters()).device
    torch.cuda.empty_cache()
    measure.reset_cuda_peaks(device)
    with context(model) if context is not None else nullcontext():
        model(**batch, use_cache=False).loss.backward()
    forward_backward = measure.cuda_peaks(device)["peak_allocated_bytes"]
    optimizer.step()
    whole = measure.cuda_peaks(device)
    optimizer.zero_grad(set_to_none=True)
    return forward_backward, whole["peak_allocated_bytes"], whole["peak_reserved_bytes"]


# ----------------------------------------------------------------------------- compute or transfer: the numbers

# Nominal figures from the vendors' datasheets (not measured here): a link's bandwidth per direction
# (GB/s, 1e9 bytes) and the FP32 non-tensor-core rate (TFLOP/s) — PyTorch's FP32 matmuls use it unless
# TF32 is allowed. PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b coding.
NOMINAL = {
    "RTX 5070 Ti (PCIe 5.0 x16)": {"link_gbps": 63.0, "fp32_tflops": 43.9},
    "H200 SXM (PCIe 5.0 x16)": {"link_gbps": 63.0, "fp32_tflops": 67.0},
    "GH200 (NVLink-C2C)": {"link_gbps": 450.0, "fp32_tflops": 67.0},
}


def step_flops(book: Ledger, *, recompute: bool = False) -> dict[str, float]:
    """FLOPs of one training step from the model's shape: 2 per parameter and token forward (the tied head
    counted as a matmul), twice that backward, plus attention's two s×s matmuls per layer; a full recompute
    adds one forward of the decoder layers."""
    shape, tokens = book.shape, book.batch * book.seq
    matmul = shape.n_params + (shape.vocab_size * shape.hidden_size if shape.tie_word_embeddings else 0)
    matmul -= shape.vocab_size * shape.hidden_size  # the embedding lookup is no matmul
    attention = 2 * 2 * book.batch * book.seq ** 2 * shape.num_heads * shape.head_dim * shape.num_layers
    forward = 2 * matmul * tokens + attention
    layers = forward - 2 * shape.vocab_size * shape.hidden_size * tokens  # without the head
    return {"forward": forward, "backward": 2 * forward, "recompute": layers if recompute else 0.0}
