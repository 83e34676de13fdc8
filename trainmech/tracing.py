"""What one run of a candidate through the gate workload showed, and what its steps cost.

`run_trace` runs every attempt of the gate workload from the initial weights, in small steps (`_begin`,
then per attempt `_Run.start` and `_Run.attempt`, then `_Run.end`); two small watchers record what the
model really received (`watch_inputs`) and which optimizer steps really ran (`watch_steps`), whatever
the candidate says. Nothing here zeroes the gradients: that is the candidate's update's job, so
forgetting it is a bug the gates can see.

What its steps cost (the fifth stage: `remeasure`, `Performance`, `timing_counts`) lives in
trainmech.performance, re-exported here.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainmech import amp, supervision
from trainmech.candidates import Candidate, GateWorkload, calibrated_scale, traced_pass
from trainmech.checks import dtype_name
from trainmech.performance import (
    ALLOCATOR_FIELDS,
    MIN_TIMED_FOR_P95,
    TIMING_DEFAULTS,
    Performance,
    remeasure,
    timing_counts,
)
from trainmech.workload import supervised_tokens

__all__ = [
    "MIN_TIMED_FOR_P95",
    "TIMING_DEFAULTS",
    "timing_counts",
    "Trace",
    "sequence_digests",
    "window_digest",
    "InputLog",
    "watch_inputs",
    "StepLog",
    "watch_steps",
    "linear_dtypes",
    "steps_undone",
    "all_finite",
    "held_out_loss",
    "run_trace",
    "Performance",
    "ALLOCATOR_FIELDS",
    "remeasure",
]


@dataclass
class Trace:
    """What one run of a candidate through the gate workload showed."""

    candidate: str
    consumed: list[list[str]] = field(
        default_factory=list
    )  # per attempt: a digest per sequence the model received
    handed: list[str] = field(
        default_factory=list
    )  # per attempt: digest of the window handed out (ids, masks, labels)
    rng: list[str] = field(default_factory=list)  # per attempt: digest of the RNG state at its start
    rng_after: str | None = (
        None  # … and after the last attempt (None when the run stopped): its draws count too
    )
    tokens: int = 0  # visible tokens the model received
    losses: list[float] = field(
        default_factory=list
    )  # per attempt that finished its backward: the window's loss
    grads: list[dict[str, torch.Tensor]] = field(
        default_factory=list
    )  # per such attempt: its gradients, unscaled, on the CPU
    #      (with a teacher: computed from the teacher's weights at that attempt)
    weights: list[dict[str, torch.Tensor]] = field(
        default_factory=list
    )  # keep_weights: the parameters at each attempt's start
    dtypes: list[str] = field(default_factory=list)  # what the Linear layers produced, every attempt together
    linear_dtypes: list[dict[str, list[str]]] = field(
        default_factory=list
    )  # per attempt that finished its backward (its own pass and a teacher-forced one alike), per Linear module
    #    (its name in the model): what its outputs were — what gate 2 holds to the claimed dtype, attempt by attempt
    stepped: list[bool] = field(default_factory=list)  # per attempt: optimizer.step() ran
    scaler_backoff: list[bool] = field(
        default_factory=list
    )  # per attempt: FP16's GradScaler lowered its scale (it found an inf / NaN and skipped the step)
    rescaled: dict[int, tuple[float, dict[str, torch.Tensor]]] = field(
        default_factory=dict
    )  # attempt GradScaler skipped, its loss finite, its gradients not: (a lower scale, the same pass's gradients
    #    there, unscaled) — finite at the first lower scale where an overflow fits, never for a bug's NaN or inf
    finite: list[bool] = field(default_factory=list)  # per attempt: every parameter finite afterwards
    lrs: list[float] = field(default_factory=list)  # the learning rate at each optimizer.step()
    attempt_lrs: list[float] = field(default_factory=list)  # the learning rate at the start of each attempt
    optimizer_steps: int = 0  # AdamW's own step count at the end
    scheduler_steps: int = 0
    held_out_before: float | None = None  # held-out token loss of the initial weights
    held_out_loss: float | None = None  # … after every attempt
    loss_scale: float | None = None  # FP16: the calibrated scale the run started from
    scale_halvings: int = (
        0  # FP16: halvings the calibration needed (GradScaler's start-up, not the candidate's skips)
    )
    error: str | None = None  # "attempt k, backward: RuntimeError: ..." when the candidate raised

    @property
    def loss(self) -> float | None:
        """The first window's loss."""
        return self.losses[0] if self.losses else None


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _rng_digest(device: torch.device) -> str:
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
    return _digest(*states)


def sequence_digests(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> list[str]:
    """One digest per sequence the model may see: per row, the visible tokens (attention_mask 1), cut
    where position_ids restart at 0 (packed rows). Re-splitting, reordering or packing keeps the multiset."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    out = []
    for r, (ids, m) in enumerate(zip(input_ids, mask)):
        visible = m.bool()
        if position_ids is None:
            out.append(_digest(ids[visible]))
            continue
        pos = position_ids[r if position_ids.shape[0] > 1 else 0][visible]
        starts = [0, *[int(k) for k in (pos == 0).nonzero().flatten() if k > 0], int(visible.sum())]
        out += [_digest(ids[visible][a:b]) for a, b in zip(starts, starts[1:]) if b > a]
    return out


@dataclass
class InputLog:
    """What `watch_inputs` saw: the sequences of each window, and the visible tokens."""

    windows: list[list[str]] = field(default_factory=list)
    tokens: int = 0
    paused: bool = False  # while set, forwards are not recorded (a teacher-forced second pass)


@contextmanager
def watch_inputs(model: torch.nn.Module) -> Iterator[InputLog]:
    """A forward pre-hook on the model: the digest of every sequence it really received, per window
    (call `log.windows.append([])` at each window's start)."""
    log = InputLog()

    def seen(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and log.windows and not log.paused:
            mask = kwargs.get("attention_mask")
            log.windows[-1].extend(sequence_digests(ids, mask, kwargs.get("position_ids")))
            log.tokens += int(ids.numel() if mask is None else mask.sum())

    handle = model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        yield log
    finally:
        handle.remove()


@dataclass
class StepLog:
    steps: int = 0  # optimizer.step() calls that really ran
    lrs: list[float] = field(default_factory=list)  # the learning rate each one used


@contextmanager
def watch_steps(optimizer: torch.optim.Optimizer) -> Iterator[StepLog]:
    """An optimizer step pre-hook: how many steps really ran, and at which learning rate."""
    log = StepLog()

    def stepping(opt, *_):
        log.steps += 1
        log.lrs.append(opt.param_groups[0]["lr"])

    handle = optimizer.register_step_pre_hook(stepping)
    try:
        yield log
    finally:
        handle.remove()


@contextmanager
def linear_dtypes(model: torch.nn.Module) -> Iterator[dict[str, set[str]]]:
    """Forward hooks on every nn.Linear: {its name in the model: the dtypes of its outputs} while inside — what
    ran in each one, whatever the candidate claims (an autocast around the head alone shows here)."""
    seen: dict[str, set[str]] = {}

    def hook(name, module, args, out):
        if torch.is_tensor(out):
            seen.setdefault(name, set()).add(dtype_name(out.dtype))

    handles = [
        m.register_forward_hook(partial(hook, name))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextmanager
def steps_undone() -> Iterator[None]:
    """While inside, every optimizer that steps (an optimizer in the backward: its parameters' hooks step it) has
    the state of its parameters copied just before its first step; on exit each is put back as it was. A second
    pass over a window then leaves the candidate's moments and step counts where its own run had them. The copy
    is taken only when something steps: a pass whose backward steps nothing copies nothing."""
    saved: dict[int, tuple[torch.optim.Optimizer, dict]] = {}

    def before_step(opt, args, kwargs):
        if id(opt) not in saved:
            saved[id(opt)] = (
                opt,
                {
                    p: {
                        k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
                        for k, v in opt.state[p].items()
                    }
                    for group in opt.param_groups
                    for p in group["params"]
                },
            )

    handle = register_optimizer_step_pre_hook(before_step)
    try:
        yield
    finally:
        handle.remove()
        for opt, states in saved.values():
            for p, kept in states.items():
                state = opt.state[p]  # the dict itself: an optimizer in the backward shares it with its parts
                state.clear()
                state.update(kept)


@contextmanager
def _nan_logits(model: torch.nn.Module, on: bool):
    """A non-finite sample: every gradient of this window becomes NaN."""
    handle = model.lm_head.register_forward_hook(lambda m, i, out: out * float("nan")) if on else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def all_finite(tensors) -> bool:
    """Every tensor free of inf and NaN, by one fused check (one wait for the device)."""
    tensors = [t for t in tensors if t is not None]
    return not tensors or bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, norm_type=math.inf)))


def held_out_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Mean token loss (nats) over the batch's supervised tokens, in float32, without gradients."""
    model.eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
        loss = supervision.token_loss_sum(logits, batch["labels"]).item() / supervised_tokens(batch["labels"])
    model.train()
    return loss


def _stable_head(e: Exception) -> str:
    said = str(e).strip().splitlines()[0].split(": ")[0][:160] if str(e).strip() else ""
    return f"{type(e).__name__}: {said}"


def _rng_states(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_states(device: torch.device, states: tuple) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def _scale(state) -> float:
    return state.scaler.get_scale() if state.scaler.is_enabled() else 1.0


class GradWatch:
    """Post-accumulate-grad hooks on every parameter, registered before the candidate's own: the gradient each
    parameter last accumulated in a backward, kept even where a hook of the candidate's (an optimizer in the
    backward) frees `.grad` right after. `grads(params, state)` reads `.grad`, or that gradient where `.grad`
    is None; `forget()` starts a new backward."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        self.handles = [
            p.register_post_accumulate_grad_hook(lambda p, n=n: self.seen.__setitem__(n, p.grad))
            for n, p in params.items()
        ]

    def forget(self) -> None:
        self.seen = {}

    def grads(self, params: dict[str, torch.nn.Parameter], state) -> dict[str, torch.Tensor]:
        """Unscaled gradients on the CPU: `.grad`, or what accumulated last where a hook freed `.grad`."""
        out = {}
        for n, p in params.items():
            g = p.grad if p.grad is not None else self.seen.get(n)
            if g is not None:
                out[n] = g.detach().float().cpu() / _scale(state)
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _from_weights(
    candidate: Candidate,
    state,
    window,
    weights: dict[str, torch.Tensor],
    params: dict[str, torch.nn.Parameter],
    watch: GradWatch,
) -> tuple[float, dict[str, torch.Tensor]]:
    """The candidate's backward from `weights` (the teacher's at this attempt), on top of whatever the candidate
    left in .grad, under the current RNG state: (loss, unscaled gradients on the CPU). The candidate's own
    weights, its .grad, the state of any optimizer that stepped inside the backward (`steps_undone`) and the
    RNG state are put back afterwards, so its own run goes on untouched."""
    device = next(iter(params.values())).device
    rng = _rng_states(device)
    own = {n: p.detach().clone() for n, p in params.items()}
    left = {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n])
    watch.forget()
    with steps_undone():
        loss = candidate.backward(state, window)
        grads = watch.grads(params, state)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(own[n])
            p.grad = left[n]
    _set_rng_states(device, rng)
    return float(loss), grads


def _same_weights(params: dict[str, torch.nn.Parameter], weights: dict[str, torch.Tensor]) -> bool:
    """Bitwise the teacher's weights (then the candidate's own pass is the one from them: no second pass)."""
    return all(torch.equal(p.detach().cpu(), weights[n]) for n, p in params.items())


def window_digest(window: list[dict], injected: bool) -> str:
    """Digest of a window handed out: ids, masks and labels of every micro-batch, and whether it was poisoned (gate 1's
    `Trace.handed`; `gate_report` takes it again after a run, of the copy the candidate was handed)."""
    return _digest(
        *[mb[k] for mb in window for k in ("input_ids", "attention_mask", "labels")], torch.tensor([injected])
    )


def _begin(candidate: Candidate, workload: GateWorkload, seed: int) -> Trace:
    """A new trace from the initial weights: their held-out loss and (FP16) the calibrated loss scale, found from
    the run's own seed (the calibration's backwards draw the dropout masks too: seeded, the start scale does not
    depend on what ran before, and a rerun like for like starts where the first run did)."""
    trace = Trace(candidate.name)
    workload.model.load_state_dict(workload.initial)
    trace.held_out_before = held_out_loss(workload.model, workload.held_out)
    torch.manual_seed(seed)
    try:
        with traced_pass(None, own=False):
            trace.loss_scale, trace.scale_halvings = calibrated_scale(candidate, workload)
    except Exception:  # the candidate's own failure: the traced attempts meet it again and keep it
        trace.loss_scale, trace.scale_halvings = None, 0
    return trace


@dataclass
class _Run:
    """One `run_trace` in progress: the trace it fills and what its attempts share."""

    trace: Trace
    candidate: Candidate
    workload: GateWorkload
    state: object  # candidates.TrainState
    inputs: InputLog
    steps: StepLog
    teacher: Trace | None
    watch: GradWatch
    keep_grads: bool = True

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.workload.model.named_parameters())

    def start(self, attempt: int, window: list[dict], keep_weights: bool) -> None:
        """What an attempt starts from: the window handed out, the RNG state, the learning rate (and the weights)."""
        self.inputs.windows.append([])
        self.trace.handed.append(window_digest(window, attempt in self.workload.inject_at))
        self.trace.rng.append(_rng_digest(self.workload.device))
        self.trace.attempt_lrs.append(self.state.optimizer.param_groups[0]["lr"])
        if keep_weights:
            self.trace.weights.append({n: p.detach().to("cpu", copy=True) for n, p in self.params.items()})

    def judged_backward(self, attempt: int, window: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
        """The candidate's backward of the window, and the (loss, gradients) gate 2 judges: its own pass, or, where
        its updates moved it off the teacher's weights, a pass from those weights first (undone afterwards)."""
        params = self.params
        weights = self.teacher.weights[attempt] if self.teacher is not None else None
        forced = weights is not None and not _same_weights(params, weights)
        if forced:
            self.inputs.paused = True  # a second pass over the same window: not another input
            try:
                with traced_pass(attempt, own=False):
                    judged = _from_weights(self.candidate, self.state, window, weights, params, self.watch)
            finally:
                self.inputs.paused = False
        self.watch.forget()
        with traced_pass(attempt, own=True):
            own = self.candidate.backward(self.state, window)
        return judged if forced else (float(own), self.watch.grads(params, self.state))

    def rescaled_backward(
        self, attempt: int, window: list[dict], rng: tuple, scale: float, grads: dict[str, torch.Tensor]
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """GradScaler skipped this attempt, its loss finite, its judged gradients not: the judged pass again — from
        the same weights (the teacher's, else the candidate's, which a skipped step left as they were), under the
        RNG state the attempt started from, on top of what the update left in .grad (nothing, for an update
        that zeroes it) — at scale / 2, / 4, … while the scale stays ≥ 1, up to the first whose gradients are
        finite: (that scale, its unscaled gradients), else (the last scale tried, non-finite ones). An overflow of the
        scaled backward fits at a lower scale; a NaN or inf a bug puts into the backward stays at every one."""
        params, device = self.params, self.workload.device
        weights = (
            self.teacher.weights[attempt]
            if self.teacher is not None and self.teacher.weights
            else {n: p.detach().clone() for n, p in params.items()}
        )
        after = _rng_states(device)
        self.inputs.paused = True
        try:
            while scale >= 2:
                scale /= 2
                probe = dataclasses.replace(
                    self.state, scaler=amp.grad_scaler(device, self.state.precision, init_scale=scale)
                )
                _set_rng_states(device, rng)
                with traced_pass(attempt, own=False):
                    _, grads = _from_weights(self.candidate, probe, window, weights, params, self.watch)
                if all_finite(grads.values()):
                    break
        finally:
            self.inputs.paused = False
            _set_rng_states(device, after)
        return scale, grads

    def attempt(self, attempt: int, window: list[dict]) -> bool:
        """Backward (a poisoned window gets NaN logits), then the candidate's update; where GradScaler skipped the
        step on finite loss and non-finite gradients, the same pass at lower scales (`rescaled_backward`). False
        when the candidate raised: its failure is evidence, kept in `trace.error`, not a crash of the pipeline."""
        trace, stage, before = self.trace, "backward", self.steps.steps
        rng = _rng_states(self.workload.device)
        try:
            with (
                _nan_logits(self.workload.model, attempt in self.workload.inject_at),
                linear_dtypes(self.workload.model) as dtypes,
            ):
                loss, grads = self.judged_backward(attempt, window)
            trace.losses.append(loss)
            if self.keep_grads:
                trace.grads.append(grads)
            trace.linear_dtypes.append({name: sorted(d) for name, d in dtypes.items()})
            trace.dtypes = sorted(set(trace.dtypes).union(*dtypes.values()))
            stage, scale = "update", _scale(self.state)
            self.candidate.update(self.state)
            backoff = self.state.scaler.is_enabled() and _scale(self.state) < scale
            stage = "backward"  # again, at a lower loss scale
            if (
                backoff
                and self.keep_grads
                and attempt not in self.workload.inject_at
                and math.isfinite(loss)
                and not all_finite(grads.values())
            ):
                trace.rescaled[attempt] = self.rescaled_backward(attempt, window, rng, scale, grads)
        except Exception as e:
            trace.error = f"attempt {attempt}, {stage}: {_stable_head(e)}"
            return False
        trace.stepped.append(self.steps.steps > before)
        trace.scaler_backoff.append(backoff)
        trace.finite.append(all_finite(self.params.values()))
        return True

    def end(self) -> None:
        """What the watchers saw, the optimizer's and the scheduler's own counts, the RNG state after the last attempt
        (extra draws there, or draws reordered inside it, change it), the held-out loss at the end."""
        trace, state = self.trace, self.state
        if trace.error is None:
            trace.rng_after = _rng_digest(self.workload.device)
        trace.consumed, trace.tokens, trace.lrs = self.inputs.windows, self.inputs.tokens, self.steps.lrs
        counts = [s["step"] for s in state.optimizer.state.values() if "step" in s]
        trace.optimizer_steps = int(counts[0]) if counts else 0
        trace.scheduler_steps = state.scheduler.last_epoch
        if trace.error is None:
            trace.held_out_loss = held_out_loss(self.workload.model, self.workload.held_out)


def run_trace(
    candidate: Candidate,
    workload: GateWorkload,
    *,
    seed: int | None = None,
    teacher: Trace | None = None,
    keep_weights: bool = False,
    keep_grads: bool = True,
) -> Trace:
    """Run the candidate through every attempt of the gate workload from the initial weights, watching what
    the model receives, every window's gradients, the dtypes every Linear ran in each window, every optimizer step and the
    held-out loss. An exception from the candidate ends the run and is kept in `error`. seed: the RNG seed
    the run starts from (default the workload's; another one gives the reference's seed-to-seed spread).

    teacher: a trace that kept its weights (`keep_weights`, the reference's). Each attempt's recorded loss and
    gradients are then the candidate's backward from the teacher's weights at that attempt — where its own
    updates moved it off them, a second backward whose effects are undone before its own — so a window is
    judged on the same weights as the reference's, whatever the candidate's earlier updates did (gates 3 and 4
    judge those).

    keep_grads=False: the gradients are not kept (a run watched only for its inputs or its updates; on a GPU model
    they are gigabytes per window, in host memory). A parameter whose `.grad` a hook of the candidate's freed in
    the backward (an optimizer in the backward) is judged by the gradient it accumulated (`GradWatch`, registered
    before the candidate's optimizer exists, so its hooks run first); a second pass over a window puts back any
    optimizer state its backward stepped (`steps_undone`)."""
    seed = workload.seed if seed is None else seed
    with workload.running():
        trace = _begin(candidate, workload, seed)
        watch = GradWatch(dict(workload.model.named_parameters()))
        try:
            torch.manual_seed(seed)
            state = workload.fresh_state(candidate, init_scale=trace.loss_scale)
            try:
                with watch_inputs(workload.model) as inputs, watch_steps(state.optimizer) as steps:
                    run = _Run(trace, candidate, workload, state, inputs, steps, teacher, watch, keep_grads)
                    for attempt, window in enumerate(workload.windows):
                        run.start(attempt, window, keep_weights)
                        if not run.attempt(attempt, window):
                            break
                run.end()
            finally:
                state.close()
        finally:
            watch.remove()
    return trace
