"""What one run of a candidate through the gate workload showed, and what its steps cost.

`run_trace` runs every attempt of the gate workload from the initial weights, in small steps (`_begin`,
then per attempt `_Run.start` and `_Run.attempt`, then `_Run.end`); two small watchers record what the
model really received (`watch_inputs`) and which optimizer steps really ran (`watch_steps`), whatever
the candidate says. Nothing here zeroes the gradients: that is the candidate's update's job, so
forgetting it is a bug the gates can see.

`remeasure` is the fifth stage's measurement: peaks of steady updates measured alone — the allocator's,
read through `measure.allocator_window` (CUDA: allocated and reserved, the cache emptied before, for a
forward + backward and for a whole update, with the memory outside the allocator; a CPU's allocator only
when forced, `allocator="cpu-profiler"`, so a CPU runs that bookkeeping too) and, on any device, the
tracked tensor bytes —, what one more sequence adds to the forward + backward peak of a micro-batch inside an
accumulation window (the capacity slope), then step times with the reference's and the candidate's updates interleaved, so that a
drift of the machine hits both alike.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import math
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainmech import amp, supervision
from trainmech.candidates import Candidate, GateWorkload, MicroBatches, calibrated_scale
from trainmech.checks import dtype_name
from trainmech.display import progress
from trainmech.measure import StorageTracker, allocator_window, time_stats, timed
from trainmech.workload import supervised_tokens

__all__ = [
    "MIN_TIMED_FOR_P95",
    "TIMING_DEFAULTS",
    "timing_counts",
    "Trace",
    "sequence_digests",
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

# The P95 of n samples interpolates at position 0.95 (n - 1) of the sorted samples (measure.percentile): below
# 21 samples it lies between the two largest, so one slow sample moves it; from 21 on it sits at or below the
# second largest (at exactly 21 it is the second largest), so a single outlier no longer sets it.
MIN_TIMED_FOR_P95 = 21
TIMING_DEFAULTS = {  # (untimed warm-up updates, timed updates) when a notebook's parameters leave them None
    "cuda": (3, MIN_TIMED_FOR_P95),  # a few to settle the allocator's cache and the kernels' autotuning
    "cpu": (1, 3),  # a CPU's times are recorded, never evidence: as few as keep the bookkeeping honest
}


def timing_counts(on_cuda: bool, warmup: int | None = None, timed: int | None = None) -> tuple[int, int]:
    """(warm-up, timed) updates: the given ones, else TIMING_DEFAULTS for the device."""
    default = TIMING_DEFAULTS["cuda" if on_cuda else "cpu"]
    return (default[0] if warmup is None else warmup, default[1] if timed is None else timed)


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
    dtypes: list[str] = field(
        default_factory=list
    )  # what the Linear layers produced in the first window, together
    linear_dtypes: dict[str, list[str]] = field(
        default_factory=dict
    )  # … per Linear module (its name in the model): what gate 2 holds to the claimed dtype
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
    cand: Candidate,
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
        loss = cand.backward(state, window)
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


def _handed(window: list[dict], injected: bool) -> str:
    """Digest of the window handed out: ids, masks and labels of every micro-batch, and whether it was poisoned."""
    return _digest(
        *[mb[k] for mb in window for k in ("input_ids", "attention_mask", "labels")], torch.tensor([injected])
    )


def _begin(cand: Candidate, gw: GateWorkload, seed: int) -> Trace:
    """A new trace from the initial weights: their held-out loss and (FP16) the calibrated loss scale, found from
    the run's own seed (the calibration's backwards draw the dropout masks too: seeded, the start scale does not
    depend on what ran before, and a rerun like for like starts where the first run did)."""
    trace = Trace(cand.name)
    gw.model.load_state_dict(gw.initial)
    trace.held_out_before = held_out_loss(gw.model, gw.held_out)
    torch.manual_seed(seed)
    try:
        trace.loss_scale, trace.scale_halvings = calibrated_scale(cand, gw)
    except Exception:  # the candidate's own failure: the traced attempts meet it again and keep it
        trace.loss_scale, trace.scale_halvings = None, 0
    return trace


@dataclass
class _Run:
    """One `run_trace` in progress: the trace it fills and what its attempts share."""

    trace: Trace
    cand: Candidate
    gw: GateWorkload
    state: object  # candidates.TrainState
    inputs: InputLog
    steps: StepLog
    teacher: Trace | None
    watch: GradWatch
    keep_grads: bool = True

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.gw.model.named_parameters())

    def start(self, attempt: int, window: list[dict], keep_weights: bool) -> None:
        """What an attempt starts from: the window handed out, the RNG state, the learning rate (and the weights)."""
        self.inputs.windows.append([])
        self.trace.handed.append(_handed(window, attempt in self.gw.inject_at))
        self.trace.rng.append(_rng_digest(self.gw.device))
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
                judged = _from_weights(self.cand, self.state, window, weights, params, self.watch)
            finally:
                self.inputs.paused = False
        self.watch.forget()
        own = self.cand.backward(self.state, window)
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
        params, device = self.params, self.gw.device
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
                _, grads = _from_weights(self.cand, probe, window, weights, params, self.watch)
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
        rng = _rng_states(self.gw.device)
        try:
            with (
                _nan_logits(self.gw.model, attempt in self.gw.inject_at),
                linear_dtypes(self.gw.model) as dtypes,
            ):
                loss, grads = self.judged_backward(attempt, window)
            trace.losses.append(loss)
            if self.keep_grads:
                trace.grads.append(grads)
            if attempt == 0:
                trace.linear_dtypes = {name: sorted(d) for name, d in dtypes.items()}
                trace.dtypes = sorted(set().union(*dtypes.values()))
            stage, scale = "update", _scale(self.state)
            self.cand.update(self.state)
            backoff = self.state.scaler.is_enabled() and _scale(self.state) < scale
            stage = "backward"  # again, at a lower loss scale
            if (
                backoff
                and self.keep_grads
                and attempt not in self.gw.inject_at
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
        """What the watchers saw, the optimizer's and the scheduler's own counts, the held-out loss at the end."""
        trace, state = self.trace, self.state
        trace.consumed, trace.tokens, trace.lrs = self.inputs.windows, self.inputs.tokens, self.steps.lrs
        counts = [s["step"] for s in state.optimizer.state.values() if "step" in s]
        trace.optimizer_steps = int(counts[0]) if counts else 0
        trace.scheduler_steps = state.scheduler.last_epoch
        if trace.error is None:
            trace.held_out_loss = held_out_loss(self.gw.model, self.gw.held_out)


def run_trace(
    cand: Candidate,
    gw: GateWorkload,
    *,
    seed: int | None = None,
    teacher: Trace | None = None,
    keep_weights: bool = False,
    keep_grads: bool = True,
) -> Trace:
    """Run the candidate through every attempt of the gate workload from the initial weights, watching what
    the model receives, every window's gradients, the first window's dtypes, every optimizer step and the
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
    seed = gw.seed if seed is None else seed
    with gw.running():
        trace = _begin(cand, gw, seed)
        watch = GradWatch(dict(gw.model.named_parameters()))
        try:
            torch.manual_seed(seed)
            state = gw.fresh_state(cand, init_scale=trace.loss_scale)
            try:
                with watch_inputs(gw.model) as inputs, watch_steps(state.optimizer) as steps:
                    run = _Run(trace, cand, gw, state, inputs, steps, teacher, watch, keep_grads)
                    for attempt, window in enumerate(gw.windows):
                        run.start(attempt, window, keep_weights)
                        if not run.attempt(attempt, window):
                            break
                run.end()
            finally:
                state.close()
        finally:
            watch.remove()
    return trace


# ----------------------------------------------------------------------------- performance


@dataclass
class Performance:
    """The fifth stage's measurements of one candidate (allocator fields None without an allocator count: unknown,
    not 0; with the CPU allocator forced they hold its peaks above each window's start, reserved and outside None)."""

    device_type: str
    step_time_median_s: float
    step_time_p95_s: float
    peak_allocated_bytes: int | None  # CUDA allocator over one steady update (forward, backward, step)
    peak_reserved_bytes: (
        int | None
    )  # … reserved from the device, the cache emptied first: what an OOM is about
    forward_backward_allocated_bytes: int | None  # the same two over the forward + backward alone
    forward_backward_reserved_bytes: int | None
    cuda_context_bytes: (
        int | None
    )  # device memory in use outside this process's allocator (the CUDA context, others)
    # bytes_per_row: what one more sequence adds to the forward + backward peak of a micro-batch accumulating into
    # a window's gradients (CUDA: allocated; elsewhere tracked): the capacity criterion, what the largest
    # micro-batch that fits hinges on (`_bytes_per_row`)
    bytes_per_row: int
    tracked_peak_bytes: int  # tensor storages born in one steady update, at their peak (any device)
    tracked_forward_backward_bytes: int  # … before the optimizer step
    exposed_transfer_time_s: (
        float | None
    )  # offload, CUDA: the compute stream's waits for copies per update (median)
    transfer_time_s: float | None  # offload, CUDA: copy time per update, both directions (median)
    warmup: int
    repeats: int

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda" and self.peak_reserved_bytes is not None


def _one_update(cand: Candidate, state, window) -> None:
    cand.backward(state, window)
    cand.update(state)


ALLOCATOR_FIELDS = (
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "forward_backward_allocated_bytes",
    "forward_backward_reserved_bytes",
    "cuda_context_bytes",
)


def _allocator(device: torch.device, allocator: str | None) -> str | None:
    """The allocator whose count is read: as asked, else CUDA's on a GPU, else none (a CPU's is read only when forced)."""
    return allocator or ("cuda" if device.type == "cuda" else None)


def _emptied_cache(device: torch.device) -> int:
    """CUDA: the caching allocator's cache handed back (cyclic garbage collected first, so its tensors go back
    too); returns the device memory in use outside this process's allocator (the CUDA context, other processes)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def _allocator_peaks(cand: Candidate, state, window, device: torch.device, source: str) -> dict:
    """The allocator's peaks over steady updates of one window, allocated and reserved: over a forward + backward,
    and over a whole update (one more, measured alone). CUDA: the cache emptied before each, so the reserved
    peak is what the update needs from an empty cache, and the memory outside the allocator beside them.
    "cpu-profiler": the CPU allocator through the profiler, peaks above the window's start (it cannot see what
    lived before); reserved and outside memory None."""
    cuda = source == "cuda"
    outside = _emptied_cache(device) if cuda else None
    with allocator_window(device, source) as fb:
        cand.backward(state, window)
    cand.update(state)
    if cuda:
        _emptied_cache(device)
    with allocator_window(device, source) as whole:
        _one_update(cand, state, window)
    return {
        "peak_allocated_bytes": whole.peak_bytes,
        "peak_reserved_bytes": whole.peak_reserved_bytes,
        "forward_backward_allocated_bytes": fb.peak_bytes,
        "forward_backward_reserved_bytes": fb.peak_reserved_bytes,
        "cuda_context_bytes": outside,
    }


def _tracked_peaks(cand: Candidate, state, window) -> dict:
    """The tracked tensor storages born in one steady update, at their peak: before the optimizer step and over it."""
    tracker = StorageTracker("backward")
    with tracker:
        cand.backward(state, window)
        forward_backward = max(tracker.live, default=0)
        tracker.phase = "update"
        cand.update(state)
    return {
        "tracked_peak_bytes": max(tracker.live, default=0),
        "tracked_forward_backward_bytes": forward_backward,
    }


def _peaks(cand: Candidate, gw: GateWorkload, warmup: int, init_scale: float | None, allocator=None) -> dict:
    """Steady updates measured alone, after `warmup` untimed ones: the allocator's peaks (`_allocator_peaks`; None
    without an allocator count), the tracked tensor bytes, and the capacity slope (`_bytes_per_row`)."""
    state = gw.fresh_state(cand, init_scale=init_scale)
    clean = gw.clean
    for i in range(max(warmup, 1)):  # at least one: the optimizer's moments exist, as in every later update
        _one_update(cand, state, clean[i % len(clean)])
    window = clean[max(warmup, 1) % len(clean)]
    source = _allocator(gw.device, allocator)
    out = dict.fromkeys(ALLOCATOR_FIELDS)
    try:
        if source:
            out |= _allocator_peaks(cand, state, window, gw.device, source)
        out |= _tracked_peaks(cand, state, window)
        out["bytes_per_row"] = _bytes_per_row(cand, state, window[0], gw.device, source)
    finally:
        state.close()
    return out


def _accumulating_peak(
    cand: Candidate, state, micro_batch: dict, device: torch.device, source: str | None
) -> int:
    """The peak of one micro-batch's forward + backward above what lived before, accumulating into gradients
    that are already alive: the allocator's (its window around the backward), without an allocator the tracked
    tensor bytes born in it. Everything the micro-batch's rows hold at some moment counts: the saved tensors,
    the logits, the loss's log-softmax and their gradients, a replayed layer, an offload's fetched copies."""
    if source:
        with allocator_window(device, source) as window:
            cand.backward(state, MicroBatches([micro_batch]))
        return window.peak_above_start
    with StorageTracker("backward") as tracker:
        cand.backward(state, MicroBatches([micro_batch]))
    return max(tracker.live, default=0)


def _bytes_per_row(
    cand: Candidate, state, micro_batch: dict, device: torch.device, source: str | None
) -> int:
    """The capacity slope: what one more sequence adds to the peak of a micro-batch that accumulates into a
    window's gradients (every micro-batch after the first), measured between the micro-batch's rows twice and
    four times over: (peak with 4x the rows - with 2x) / (2 x rows). The gradients exist first, so the peak sits
    where the rows' own bytes are largest, not at a step that only creates the gradients; the values do not
    matter (nothing is updated, the gradients are dropped after)."""
    rows = int(micro_batch["input_ids"].shape[0])
    times = lambda k: {key: torch.cat([v] * k) for key, v in micro_batch.items()}  # noqa: E731
    cand.backward(state, MicroBatches([micro_batch]))  # the gradients are alive from here on, as in a window
    peaks = [_accumulating_peak(cand, state, times(k), device, source) for k in (2, 4)]
    state.optimizer.zero_grad(set_to_none=True)
    return (peaks[1] - peaks[0]) // (2 * rows)


def _transfer(cand: Candidate, attempts: int) -> tuple[float | None, float | None]:
    """Median per update of the offload strategies' exposed transfer and copy times (None off CUDA / without offload)."""
    runs = [s for strategy in cand.strategies if hasattr(strategy, "collect") for s in strategy.collect()]
    if not runs or runs[0].exposed_transfer_time_s is None or attempts == 0:
        return None, None
    per = len(runs) // attempts  # instances per update (one per micro-batch)
    chunks = [runs[k * per : (k + 1) * per] for k in range(attempts)]
    return (
        statistics.median(sum(s.exposed_transfer_time_s for s in c) for c in chunks),
        statistics.median(sum(s.transfer_time_s for s in c) for c in chunks),
    )


def remeasure(
    cand: Candidate,
    reference: Candidate,
    gw: GateWorkload,
    *,
    warmup: int,
    repeats: int,
    init_scale: float | None = None,
    reference_peaks: dict | None = None,
    allocator: str | None = None,
) -> tuple[Performance, Performance]:
    """(candidate's, reference's) performance on the gate workload's clean windows.

    Peaks: each alone (`_peaks`). Times: both trained side by side on the same model (values do not
    matter for timing, only the work), `warmup` untimed updates each, then `repeats` rounds of one
    timed update each, the order alternating (ABBA), so a slow stretch of the machine hits both.
    init_scale: the candidate's calibrated loss scale (FP16, from its trace). reference_peaks: a dict that keeps
    the reference's peaks between calls (they do not change from one candidate to the next), filled on first use.
    allocator: whose peaks fill the allocator fields: None — CUDA's on a GPU, none elsewhere (null, unknown);
    "cpu-profiler" — the CPU allocator, so a CPU runs the same bookkeeping (peaks above each window's start).
    """
    with gw.running():
        scales = {id(cand): init_scale, id(reference): None}
        known = reference_peaks if reference_peaks is not None else {}
        if (gw_key := (id(gw), warmup, allocator)) not in known:
            known[gw_key] = _peaks(reference, gw, warmup, None, allocator)
        peaks = {id(cand): _peaks(cand, gw, warmup, init_scale, allocator), id(reference): known[gw_key]}
        states = {id(c): gw.fresh_state(c, init_scale=scales[id(c)]) for c in (cand, reference)}
        clean = gw.clean
        order = [(cand, reference), (reference, cand)]
        try:
            for i in range(warmup):
                for c in (cand, reference):
                    _one_update(c, states[id(c)], clean[i % len(clean)])
            for c in (cand, reference):
                _transfer(c, 0)  # forget the warm-up's offload runs
            seconds = {id(cand): [], id(reference): []}
            for i in progress(
                range(repeats), desc=f"timing {cand.name} beside {reference.name}", unit="round"
            ):
                for c in order[i % 2]:
                    window = clean[(warmup + i) % len(clean)]
                    seconds[id(c)].append(timed(partial(_one_update, c, states[id(c)], window), gw.device)[1])
        finally:
            for c in (cand, reference):
                states[id(c)].optimizer.zero_grad(set_to_none=True)
                states[id(c)].close()
    out = []
    for c in (cand, reference):
        exposed, transfer = _transfer(c, repeats)
        out.append(
            Performance(
                gw.device.type,
                **time_stats(seconds[id(c)]),
                **peaks[id(c)],
                exposed_transfer_time_s=exposed,
                transfer_time_s=transfer,
                warmup=warmup,
                repeats=repeats,
            )
        )
    return out[0], out[1]
