"""Effective updates: the update clock, the WSD schedule, clipping, displacement, resumable state.

An effective update is an attempt whose gradients were finite and whose optimizer step really
wrote the parameters. The `UpdateClock` counts only those; the scheduler, logging and
evaluation read their step from it, so a skipped attempt (an FP16 overflow, a non-finite
gradient) or a micro-batch never moves them. `save_training_state` / `load_training_state`
(trainmech.training_state, re-exported here) write and read everything a resume needs with
safetensors (tensors plus JSON metadata; nothing is pickled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainmech.errors import TrainmechError
from trainmech.training_state import MODEL_FILE, STATE_FILE, load_training_state, save_training_state

__all__ = [
    "SCHEDULE_SHAPES",
    "UpdateClock",
    "logged_steps",
    "all_finite",
    "grads_finite",
    "step_if_finite",
    "wsd_multiplier",
    "wsd_phase",
    "set_lr",
    "clip_coefficient",
    "snapshot",
    "displacement",
    "flat_grads",
    "MODEL_FILE",
    "STATE_FILE",
    "save_training_state",
    "load_training_state",
    "transformers_wsd",
    "replay_schedule",
    "AttemptLog",
    "run_attempts",
    "eval_loss",
    "DynamicsRun",
    "dynamics_run",
    "continued_updates",
]

SCHEDULE_SHAPES = ("linear", "cosine", "1-sqrt")


# ----------------------------------------------------------------------------- the update clock


@dataclass
class UpdateClock:
    """Counts update attempts, effective updates and skipped updates.

    `tick(stepped)` after every attempt; `effective_updates` is the step a scheduler, a logger or
    an evaluation should see.
    """

    effective_updates: int = 0
    skipped_updates: int = 0

    @property
    def attempts(self) -> int:
        return self.effective_updates + self.skipped_updates

    def tick(self, stepped: bool) -> bool:
        """Advance on an effective update, count a skip otherwise; returns stepped."""
        if stepped:
            self.effective_updates += 1
        else:
            self.skipped_updates += 1
        return bool(stepped)

    def state_dict(self) -> dict[str, int]:
        return {"effective_updates": self.effective_updates, "skipped_updates": self.skipped_updates}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.effective_updates = int(state["effective_updates"])
        self.skipped_updates = int(state["skipped_updates"])


def logged_steps(stepped: list[bool]) -> list[int]:
    """The step a log writes after each attempt: the clock's effective updates, a skip adding none."""
    clock, steps = UpdateClock(), []
    for s in stepped:
        clock.tick(s)
        steps.append(clock.effective_updates)
    return steps


def all_finite(tensors) -> torch.Tensor:
    """A 0-dim bool tensor: every element of every tensor is finite. Nothing waits for the device.

    One fused max-|x| reduction per (device, dtype) group (`clip_grad_norm_`'s own
    `get_total_norm` with the inf norm): an inf or a NaN anywhere makes the result non-finite, and
    finite values, unlike a 2-norm's squares, cannot overflow on the way.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.tensor(True)
    return torch.isfinite(torch.nn.utils.get_total_norm(tensors, float("inf")))


def grads_finite(params) -> bool:
    """True when every existing .grad is free of inf and NaN (parameters without .grad are ignored).

    One host sync for all gradients together, not one per parameter.
    """
    return bool(all_finite([p.grad for p in params if p.grad is not None]))


def step_if_finite(optimizer: torch.optim.Optimizer) -> bool:
    """optimizer.step() only when every gradient it would read is finite; returns whether it stepped.

    Without such a guard (or a GradScaler) a single NaN gradient is written into the parameters.
    The decision needs one host sync (`grads_finite`), as GradScaler's own step does.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not grads_finite(params):
        return False
    optimizer.step()
    return True


# ----------------------------------------------------------------------------- the WSD schedule


def _shape(kind: str, progress: float, rising: bool) -> float:
    """The warmup (rising) or decay (falling) curve at progress in [0, 1), as transformers writes it."""
    if kind not in SCHEDULE_SHAPES:
        raise TrainmechError(f"unknown schedule shape {kind!r}; valid: {', '.join(SCHEDULE_SHAPES)}")
    if rising:
        if kind == "linear":
            return progress
        if kind == "cosine":
            return 0.5 * (1.0 - math.cos(math.pi * progress))
        return 1.0 - math.sqrt(1.0 - progress)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))  # half a cosine wave
    return 1.0 - math.sqrt(progress)


def wsd_multiplier(
    step: int,
    *,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    min_lr_ratio: float = 0.0,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
) -> float:
    """The Warmup-Stable-Decay learning-rate multiplier at update `step` (0-based, from the clock).

    warmup: [0, W) rises from min_lr_ratio towards 1; stable: [W, W+S) is 1; decay:
    [W+S, W+S+D) falls from 1 towards min_lr_ratio; afterwards min_lr_ratio. The same value
    transformers' `get_wsd_schedule` gives for the same arguments (num_cycles=0.5). Refuses a
    negative step or phase length and an unknown shape.
    """
    if step < 0 or min(warmup_steps, stable_steps, decay_steps) < 0:
        raise TrainmechError(
            f"step and phase lengths must be ≥ 0 (step={step}, warmup={warmup_steps}, "
            f"stable={stable_steps}, decay={decay_steps})"
        )
    for kind in (warmup_type, decay_type):
        _shape(kind, 0.0, True)  # refuses an unknown shape whatever the step
    if step < warmup_steps:
        factor = _shape(warmup_type, float(step) / float(max(1, warmup_steps)), rising=True)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < warmup_steps + stable_steps:
        return 1.0
    if step < warmup_steps + stable_steps + decay_steps:
        progress = float(step - warmup_steps - stable_steps) / float(max(1, decay_steps))
        factor = _shape(decay_type, progress, rising=False)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


def wsd_phase(step: int, *, warmup_steps: int, stable_steps: int, decay_steps: int) -> str:
    """ "warmup", "stable", "decay" or "after" for update `step`."""
    if step < warmup_steps:
        return "warmup"
    if step < warmup_steps + stable_steps:
        return "stable"
    return "decay" if step < warmup_steps + stable_steps + decay_steps else "after"


def set_lr(optimizer: torch.optim.Optimizer, base_lrs: list[float], multiplier: float) -> None:
    """Write base_lr * multiplier into every parameter group (what LambdaLR does, driven by the clock)."""
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = base * multiplier


# ----------------------------------------------------------------------------- clipping, displacement


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor clip_grad_norm_ multiplies every gradient by: min(1, max_norm / (total_norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """Detached copies of every distinct parameter, in their own dtype and device: θ before an update."""
    return [p.detach().clone() for p in model.parameters()]


def displacement(before: list[torch.Tensor], model: torch.nn.Module) -> float:
    """‖θ_now − θ_before‖₂ over all parameters, accumulated in float64, for `before` from `snapshot`.

    The per-parameter sums stay on the device; one host sync reads the total.
    """
    squares = [(p.detach().double() - b.double()).pow(2).sum() for p, b in zip(model.parameters(), before)]
    return math.sqrt(float(torch.stack(squares).sum()))


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's .grad as one vector, in model.parameters() order (a tied weight counts once)."""
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# ----------------------------------------------------------------------------- Task3's runs


def transformers_wsd(steps: int, **wsd) -> list[float]:
    """The multipliers transformers' `get_wsd_schedule` (a LambdaLR) gives over `steps` scheduler steps.

    wsd: warmup_steps, stable_steps, decay_steps and optionally min_lr_ratio, warmup_type,
    decay_type, as `wsd_multiplier` takes them. The reference `wsd_multiplier` is checked against.
    """
    return replay_schedule([True] * steps, lambda stepped: 1, 1.0, **wsd)


def replay_schedule(stepped: list[bool], steps_after, base_lr: float, **wsd) -> list[float]:
    """The LR each attempt reads from a transformers WSD scheduler stepped `steps_after(stepped)` times after it.

    stepped: whether each attempt was an effective update. The scheduler steps after the optimizer
    (the order PyTorch expects); the optimizer has nothing to update.
    """
    import transformers

    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    sched = transformers.get_wsd_schedule(
        dummy,
        num_warmup_steps=wsd["warmup_steps"],
        num_stable_steps=wsd["stable_steps"],
        num_decay_steps=wsd["decay_steps"],
        warmup_type=wsd.get("warmup_type", "linear"),
        decay_type=wsd.get("decay_type", "cosine"),
        min_lr_ratio=wsd.get("min_lr_ratio", 0.0),
    )
    lrs = []
    for s in stepped:
        lrs.append(dummy.param_groups[0]["lr"])
        for _ in range(steps_after(s)):
            dummy.step()
            sched.step()
    return lrs


@dataclass
class AttemptLog:
    """What a run of update attempts produced, one entry per attempt (loss None where non-finite)."""

    loss: list[float | None]
    stepped: list[bool]
    lr: list[float]
    scale: list[float]
    seconds: list[float]
    clock: UpdateClock
    peaks: dict[str, int | None]
    base_allocated_bytes: int | None
    optimizer_steps: set[int]
    finite_params: bool

    def step_times(self, warmup: int) -> dict[str, float]:
        """Median / P95 of the effective attempts after the first `warmup` of them (skips are not updates)."""
        from trainmech.measure import time_stats

        return time_stats([s for s, ok in zip(self.seconds, self.stepped) if ok][warmup:])

    def metrics(self, prefix: str, warmup: int) -> dict[str, float | int | None]:
        """The run's summary under `prefix_…` keys, for a record's metrics."""
        stats = self.step_times(warmup)
        return {
            f"{prefix}_final_loss": [x for x in self.loss if x is not None][-1],
            f"{prefix}_step_time_median_s": stats["step_time_median_s"],
            f"{prefix}_step_time_p95_s": stats["step_time_p95_s"],
            f"{prefix}_peak_allocated_bytes": self.peaks["peak_allocated_bytes"],
            f"{prefix}_peak_reserved_bytes": self.peaks["peak_reserved_bytes"],
            f"{prefix}_base_allocated_bytes": self.base_allocated_bytes,
        }


def run_attempts(
    attempt,
    batches,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    base_lr: float,
    wsd: dict,
    device: torch.device,
) -> AttemptLog:
    """One update attempt per batch; the learning rate comes from the update clock, which ticks after each.

    attempt(a, batch) -> (loss tensor, stepped) is the timed part: zero_grad, forward, backward and
    the step or skip. Everything read from the device (the loss, the scale) is read after the timing.
    """
    from trainmech.measure import cuda_allocated, cuda_peaks, reset_cuda_peaks, timed

    clock = UpdateClock()
    log = AttemptLog([], [], [], [], [], clock, {}, cuda_allocated(device), set(), False)
    reset_cuda_peaks(device)
    for a, batch in enumerate(batches):
        set_lr(optimizer, [base_lr], wsd_multiplier(clock.effective_updates, **wsd))
        log.lr.append(optimizer.param_groups[0]["lr"])
        (loss, stepped), seconds = timed(lambda a=a, batch=batch: attempt(a, batch), device)
        clock.tick(stepped)
        value = float(loss)
        log.loss.append(value if math.isfinite(value) else None)
        log.stepped.append(bool(stepped))
        log.scale.append(scaler.get_scale())
        log.seconds.append(seconds)
    log.peaks = cuda_peaks(device)
    log.optimizer_steps = {int(optimizer.state[p]["step"]) for p in model.parameters()}
    log.finite_params = bool(all_finite([p.detach() for p in model.parameters()]))
    return log


def eval_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """The model's own mean token loss on batch in eval mode, without a graph (train mode restored)."""
    model.eval()
    with torch.no_grad():
        value = model(**batch).loss.item()
    model.train()
    return value


@dataclass
class DynamicsRun:
    """One training run's series over its updates, and the held-out loss after it."""

    loss: list[float]
    grad_norm: list[float]  # before clipping
    clipped_norm: list[float]  # measured after clip_grad_norm_, in float64
    clip_coef: list[float]
    displacement: list[float]
    finite: list[bool]
    seconds: list[float]
    eval_after: float
    peaks: dict[str, int | None]

    def series(self) -> dict[str, list[float]]:
        return {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "clip_coef": self.clip_coef,
            "displacement": self.displacement,
        }


def dynamics_run(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches,
    *,
    max_norm: float,
    eval_batch: dict[str, torch.Tensor],
    device: torch.device,
) -> DynamicsRun:
    """One update per batch: zero_grad, forward, backward, clip_grad_norm_(max_norm), step (the timed part).

    Around it, untimed: θ before the update, the clipped gradient's norm (AdamW's step leaves .grad
    as it was) and ‖Δθ‖ after it; at the end the held-out loss on eval_batch.
    """
    from trainmech.measure import cuda_peaks, reset_cuda_peaks, timed

    run = DynamicsRun([], [], [], [], [], [], [], float("nan"), {})
    reset_cuda_peaks(device)
    for batch in batches:
        before = snapshot(model)

        def step_once(batch=batch):
            optimizer.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            return loss.detach(), norm

        (loss, norm), seconds = timed(step_once, device)
        run.loss.append(float(loss))
        run.grad_norm.append(float(norm))
        run.clipped_norm.append(
            float(flat_grads(model).double().norm())
        )  # float64: a float32 sum of ~10^6 squares drifts
        run.clip_coef.append(clip_coefficient(run.grad_norm[-1], max_norm))
        run.displacement.append(displacement(before, model))
        run.finite.append(
            all(math.isfinite(v) for v in (run.loss[-1], run.grad_norm[-1], run.displacement[-1]))
        )
        run.seconds.append(seconds)
    run.eval_after = eval_loss(model, eval_batch)
    run.peaks = cuda_peaks(device)
    return run


def continued_updates(
    model,
    optimizer,
    scaler,
    clock,
    data_position: int,
    n: int,
    *,
    batch_at,
    precision: str,
    window: int,
    stride: int,
    device: torch.device,
    log: dict,
) -> int:
    """n full-sequence updates; each window starts at a random offset in [0, window) past data_position.

    batch_at(offset) -> a batch on the device. The offset is drawn from torch's global RNG, so the
    RNG state is part of the data path (what a checkpoint must restore). Appends each offset and
    the step time to log["offsets"], log["seconds"]; returns the data position after the n updates.
    """
    from trainmech import amp
    from trainmech.measure import timed

    for _ in range(n):
        offset = data_position + int(torch.randint(0, window, ()))
        batch = batch_at(offset)

        def step_once(batch=batch):
            optimizer.zero_grad(set_to_none=True)
            with amp.autocast(device, precision):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            return clock.tick(amp.scaled_step(scaler, optimizer))

        _, seconds = timed(step_once, device)
        log["offsets"].append(offset)
        log["seconds"].append(seconds)
        data_position += stride
    return data_position
