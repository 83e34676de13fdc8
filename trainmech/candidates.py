"""What the correctness gates judge: a candidate training strategy, the state it acts on, the gate workload.

A candidate is data plus two functions: what it claims (name, the registry experiment it stands
for, the compute dtype) and its training update, split into `backward` (one accumulation window:
forward and backward of every micro-batch, filling .grad) and `update` (write the parameters or
skip, move the scheduler, zero the gradients). The defaults are the package's own step —
`supervision.accumulate_gradients` and `update.step_if_finite` (or GradScaler's step under FP16) —
so a candidate differs from the reference only in what it says it changes: strategy contexts
around each micro-batch (activation checkpointing, offload), or the dtype.

    offload = candidate("offload", "TRAIN-OFFLOAD", Offloading(min_bytes=…))
    workload = gate_workload(model, rows=4, seq=32, micro_batches=2, attempts=8, inject_at=(2,), dropout=0.1,
                             prompt_only_at=(5,))

The gate workload fixes what every candidate is judged on: the initial weights, the windows
(rows of unequal length and supervision, so a per-micro-batch mean cannot hide, and micro-batches
that supervise no token at all), a held-out batch, attempts that receive a non-finite sample, a
WSD schedule, the optimizer's kernel (foreach, as on CUDA, on every device) and a residual dropout
drawn in float32 from the global RNG.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial

import torch

from trainmech import amp, checkpointing, supervision, update
from trainmech.errors import TrainmechError
from trainmech.offload import activation_offload
from trainmech.update import wsd_multiplier
from trainmech.workload import (
    IGNORE_INDEX,
    lm_batch,
    split_micro_batches,
    supervised_tokens,
    to_device,
    uneven_batch,
)

__all__ = [
    "MAX_SCALE_HALVINGS",
    "TrainState",
    "MicroBatches",
    "window_backward",
    "effective_update",
    "Candidate",
    "candidate",
    "activation_checkpointing",
    "checkpointing_kept_on",
    "TRACED_PASS",
    "traced_pass",
    "Offloading",
    "residual_dropout",
    "GateWorkload",
    "gate_workload",
    "fixed_batch_workload",
    "calibrated_scale",
    "window_transfers",
    "hook_calls",
]

MAX_SCALE_HALVINGS = 40  # FP16 loss-scale calibration gives up below 2**16 / 2**40


@dataclass
class TrainState:
    """What a candidate's functions act on; built fresh from the initial weights for every run."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    precision: str  # "fp32" / "bf16" / "fp16": what the candidate claims

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def close(self) -> None:
        """Take off what the optimizer hooked onto the parameters (an optimizer in the backward: its hooks would
        step it in every later backward of the same model); a plain optimizer has nothing to take off."""
        remove = getattr(self.optimizer, "remove", None)
        if remove is not None:
            remove()


class MicroBatches(list):
    """The micro-batches of one accumulation window, with their supervised token counts counted once
    (what a window's backward is handed; `supervision.Window` is what accumulating it produced)."""

    def __init__(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        super().__init__(micro_batches)
        self.tokens = tuple(supervised_tokens(mb["labels"]) for mb in micro_batches)


# ----------------------------------------------------------------------------- the package's step


def window_backward(
    state: TrainState, window: list[dict], *, contexts=(), normalization: str = "window_tokens"
) -> torch.Tensor:
    """One accumulation window by `supervision.accumulate_gradients`: the strategy contexts (functions
    model -> context manager, entered in order) around each micro-batch, the claimed precision's
    autocast around the forward, GradScaler's scaling before the backward. Returns the window's loss
    (unscaled, a device tensor: nothing here waits for the device)."""
    device = state.device
    return supervision.accumulate_gradients(
        state.model,
        list(window),
        normalization=normalization,
        micro_tokens=getattr(window, "tokens", None),
        autocast=lambda: amp.autocast(device, state.precision),
        contexts=tuple(contexts),
        scale=state.scaler.scale if state.scaler.is_enabled() else None,
        forward_kwargs={"use_cache": False},
    ).loss


def effective_update(state: TrainState) -> bool:
    """The update: GradScaler's step under FP16 (it skips on inf / NaN), else `update.step_if_finite`;
    the scheduler moves only when the optimizer really stepped; the window's gradients are then zeroed
    either way (a skipped window is dropped). Returns whether it stepped."""
    if state.scaler.is_enabled():
        stepped = amp.scaled_step(state.scaler, state.optimizer)
    else:
        stepped = update.step_if_finite(state.optimizer)
    if stepped:
        state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    return stepped


@dataclass(frozen=True)
class Candidate:
    name: str
    semantic_id: str  # the registry experiment it stands for, e.g. TRAIN-CHECKPOINT
    dtype: str = "float32"  # the compute dtype it claims: float32 / float16 / bfloat16
    backward: Callable[[TrainState, list[dict]], object] = window_backward
    update: Callable[[TrainState], object] = effective_update
    strategies: tuple = ()  # the strategy contexts inside `backward`, when built by `candidate` (their stats are read there)
    # make_optimizer(params, lr=…, foreach=…) -> a torch.optim.Optimizer (an optimizers.OptimizerInBackward, say);
    # None: the workload's AdamW
    optimizer: Callable[..., torch.optim.Optimizer] | None = None

    def __post_init__(self):
        try:
            amp.precision_of(self.dtype)
        except TrainmechError as e:
            raise TrainmechError(f"candidate {self.name}: {e}") from None

    @property
    def precision(self) -> str:
        return amp.precision_of(self.dtype)


def candidate(name: str, semantic_id: str, *contexts, dtype: str = "float32", **kwargs) -> Candidate:
    """A candidate whose backward is `window_backward` inside the given strategy contexts."""
    return Candidate(
        name, semantic_id, dtype, partial(window_backward, contexts=contexts), strategies=contexts, **kwargs
    )


# ----------------------------------------------------------------------------- strategy contexts


@contextmanager
def activation_checkpointing(model: torch.nn.Module, **checkpoint_kwargs) -> Iterator[None]:
    """transformers' own activation checkpointing (checkpointing.hf_checkpointing) around one micro-batch; left as
    it is where `checkpointing_kept_on` already turned it on with the same arguments (a timed update)."""
    if getattr(model, "_kept_checkpointing", None) == checkpoint_kwargs:
        yield
        return
    with checkpointing.hf_checkpointing(model, **checkpoint_kwargs):
        yield


@contextmanager
def checkpointing_kept_on(candidate: Candidate, model: torch.nn.Module) -> Iterator[None]:
    """transformers' checkpointing turned on once for all of a candidate's micro-batches inside (for each of its
    strategies that is `activation_checkpointing`), so that switching it on and off around each micro-batch stays
    outside a timed update (`performance.remeasure`); nothing for a candidate without it."""
    kept = [
        getattr(s, "keywords", {})
        for s in candidate.strategies
        if getattr(s, "func", s) is activation_checkpointing
    ]
    if not kept:
        yield
        return
    with checkpointing.hf_checkpointing(model, **kept[0]):
        model._kept_checkpointing = kept[0]
        try:
            yield
        finally:
            del model._kept_checkpointing


# The pass `tracing.run_trace` is running, while it runs one: (attempt, own). own is False for a pass whose effects
# it undoes (a backward from the teacher's weights, the same window at a lower loss scale, the loss-scale
# calibration, whose attempt is None). None outside run_trace. `Offloading` tags its runs with it.
TRACED_PASS: ContextVar[tuple[int | None, bool] | None] = ContextVar("traced_pass", default=None)


@contextmanager
def traced_pass(attempt: int | None, own: bool) -> Iterator[None]:
    """Inside, TRACED_PASS says which pass runs (tracing sets it around each backward it runs)."""
    token = TRACED_PASS.set((attempt, own))
    try:
        yield
    finally:
        TRACED_PASS.reset(token)


class Offloading:
    """Activation offload as a strategy context: one set of saved-tensor hooks per micro-batch,
    `offload.activation_offload(model, **offload_kwargs)` unless `hooks` (model -> hooks) says otherwise.

    Every instance is kept (`runs`, with the TRACED_PASS it ran in) until `collect()`: its bytes right
    away, its CUDA copy and wait times once the timed steps are over (reading them waits for the device).
    """

    def __init__(self, hooks: Callable[[torch.nn.Module], object] | None = None, **offload_kwargs) -> None:
        self.make = hooks or (lambda model: activation_offload(model, **offload_kwargs))
        self.runs: list = []
        self.undone_passes = 0  # runs collect() left out: passes run_trace undid (see TRACED_PASS)

    @contextmanager
    def __call__(self, model: torch.nn.Module) -> Iterator[object]:
        """One instance around one micro-batch; `finish()` even when the block raised (a CUDA OOM, the candidate's
        own error): the shared host arena is let go, so the next instance can claim it. Only a run that
        finished is kept for `collect()`."""
        hooks, tag = self.make(model), TRACED_PASS.get()
        try:
            with hooks:
                yield hooks
        finally:
            hooks.finish()
        self.runs.append((tag, hooks))

    def collect(self) -> list:
        """The TransferStats of every run since the last collect, times filled in (CUDA), and forget them. Each
        carries the run_trace attempt it ran in (`attempt`; None outside run_trace). The passes run_trace undoes
        (TRACED_PASS's own False: from a teacher's weights, at a lower loss scale, calibrating it) are left out and
        counted in `undone_passes`: what is returned are the passes the candidate trained with, one per micro-batch."""
        out = []
        for tag, hooks in self.runs:
            if tag is not None and not tag[1]:
                self.undone_passes += 1
                continue
            stats = hooks.read_times()
            stats.attempt = None if tag is None else tag[0]
            out.append(stats)
        self.runs = []
        return out


# ----------------------------------------------------------------------------- the gate workload


@contextmanager
def residual_dropout(model: torch.nn.Module, p: float) -> Iterator[None]:
    """While inside, each decoder layer's MLP output is dropped with probability p in training mode.

    The mask is drawn in float32 from the device's global generator, so a float16 and a float32 run
    draw the same mask (Qwen2's attention_dropout draws inside the SDPA kernel, whose random stream
    differs between kernels and dtypes on a GPU), and a replay that does not restore the RNG state
    draws another one. It sits inside the decoder layer, so activation checkpointing replays it.
    """
    if not 0 <= p < 1:
        raise TrainmechError(f"dropout must lie in [0, 1), got {p}")

    def drop(module, inputs, out):
        if not module.training or p == 0:
            return out
        keep = torch.rand(out.shape, dtype=torch.float32, device=out.device) >= p
        return out * keep.to(out.dtype) / (1 - p)

    handles = [layer.mlp.register_forward_hook(drop) for layer in model.model.layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class GateWorkload:
    """The fixed inputs every candidate is judged on: same weights, windows, held-out batch, schedule."""

    model: torch.nn.Module
    initial: dict[str, torch.Tensor]  # state_dict copy on the CPU
    windows: list[MicroBatches]  # one accumulation window per update attempt
    held_out: dict[str, torch.Tensor]
    inject_at: tuple[int, ...] = ()  # attempts whose logits are made NaN: a non-finite sample
    lr: float = 1e-3
    schedule: dict = field(default_factory=dict)  # wsd_multiplier keywords
    seed: int = 0
    dropout: float = 0.0  # residual dropout after each MLP (`residual_dropout`)
    foreach: bool | None = True  # AdamW's kernel, forced (None: PyTorch's default for the device)
    loss_scale_start: float = 2.0**16  # FP16: GradScaler's init_scale before the calibration
    calibrate_loss_scale: bool = (
        True  # FP16: find the start scale before the traced attempts (`calibrated_scale`)
    )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def clean(self) -> list[MicroBatches]:
        """The windows of attempts without an injected sample (for timing)."""
        return [w for a, w in enumerate(self.windows) if a not in self.inject_at]

    def expected_lr(self, k: int) -> float:
        """The learning rate of effective update k (0-based) by the update clock."""
        return self.lr * wsd_multiplier(k, **self.schedule)

    def running(self):
        """The context every run of a candidate on this workload is made in (the residual dropout)."""
        return residual_dropout(self.model, self.dropout) if self.dropout else nullcontext()

    def fresh_state(self, candidate: Candidate, *, init_scale: float | None = None) -> TrainState:
        """The initial weights, no gradients, a new optimizer (AdamW, or the candidate's `optimizer`), scheduler and
        GradScaler (init_scale: a calibrated one). `TrainState.close()` takes an optimizer's hooks off again."""
        self.model.load_state_dict(self.initial)
        self.model.zero_grad(set_to_none=True)
        self.model.train()
        make = candidate.optimizer or (lambda params, **kw: torch.optim.AdamW(params, **kw))
        optimizer = make(self.model.parameters(), lr=self.lr, foreach=self.foreach)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: wsd_multiplier(k, **self.schedule))
        scaler_kwargs = {} if init_scale is None else {"init_scale": init_scale}
        return TrainState(
            self.model,
            optimizer,
            scheduler,
            amp.grad_scaler(self.device, candidate.precision, **scaler_kwargs),
            candidate.precision,
        )


def gate_workload(
    model,
    *,
    rows: int,
    seq: int,
    micro_batches: int,
    attempts: int,
    inject_at=(),
    lr=1e-3,
    warmup_updates: int = 1,
    decay_updates: int = 1,
    min_lr_ratio: float = 0.1,
    seed: int = 0,
    dropout: float = 0.0,
    foreach: bool | None = True,
    prompt_only_at=(),
) -> GateWorkload:
    """Windows of `workload.uneven_batch` rows from successive stretches of the domain text, split into
    micro-batches; a held-out batch of the same shape from the general text; a WSD schedule over
    the effective updates (attempts minus injected ones). prompt_only_at: attempts whose last micro-batch
    supervises no token (its labels all IGNORE_INDEX, as a prompt-only stretch of a response-only corpus): a
    correct update weighs it by its zero tokens; a mean over its own tokens is 0 / 0."""
    device = next(model.parameters()).device

    def micro_batches_of(a: int) -> list[dict]:
        parts = split_micro_batches(uneven_batch(rows, seq, offset=a * rows * seq), micro_batches)
        if a in prompt_only_at:
            parts[-1] = {**parts[-1], "labels": torch.full_like(parts[-1]["labels"], IGNORE_INDEX)}
        return [to_device(mb, device) for mb in parts]

    if micro_batches < 2 and prompt_only_at:
        raise TrainmechError("a prompt-only micro-batch needs a window of at least two micro-batches")
    windows = [MicroBatches(micro_batches_of(a)) for a in range(attempts)]
    effective = attempts - len(set(inject_at))
    stable = effective - warmup_updates - decay_updates
    if stable < 0:
        raise TrainmechError(
            f"{effective} effective updates cannot hold warmup {warmup_updates} + decay {decay_updates}"
        )
    schedule = dict(
        warmup_steps=warmup_updates, stable_steps=stable, decay_steps=decay_updates, min_lr_ratio=min_lr_ratio
    )
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return GateWorkload(
        model,
        initial,
        windows,
        to_device(uneven_batch(rows, seq, "general"), device),
        tuple(inject_at),
        lr,
        schedule,
        seed,
        dropout,
        foreach,
    )


def fixed_batch_workload(
    model,
    batch: dict[str, torch.Tensor],
    *,
    updates: int,
    lr: float = 1e-3,
    seed: int = 0,
    foreach: bool | None = None,
) -> GateWorkload:
    """`updates` windows of one full batch each, a constant learning rate, no injected sample, no dropout,
    AdamW's kernel the device's default: a memory strategy's experiment (Task5) run through the gates."""
    device = next(model.parameters()).device
    rows, seq = batch["input_ids"].shape
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    schedule = dict(warmup_steps=0, stable_steps=updates, decay_steps=0)
    return GateWorkload(
        model,
        initial,
        [MicroBatches([to_device(batch, device)]) for _ in range(updates)],
        to_device(lm_batch("general", rows, seq), device),
        (),
        lr,
        schedule,
        seed,
        0.0,
        foreach,
    )


# ----------------------------------------------------------------------------- FP16: the loss scale's start


def calibrated_scale(candidate: Candidate, workload: GateWorkload) -> tuple[float | None, int]:
    """FP16: the largest loss scale, halving from `workload.loss_scale_start` (GradScaler's 2**16) as GradScaler does on an
    inf / NaN, at which every clean window's gradients from the initial weights are finite — before the traced
    attempts and without any update; (scale, halvings). A window whose loss itself is not finite is passed over:
    no scale fixes a forward's NaN (the traced attempts meet it). Other dtypes: (None, 0). With the calibration off
    (`workload.calibrate_loss_scale`), (the start scale, 0): GradScaler then finds it by skipping updates.

    A correct FP16 candidate may otherwise skip its first updates while the scale comes down, and be rejected for
    updates it did not make; the halvings are reported beside the gates instead. Every clean window, not the first
    alone: a scale at the first window's overflow edge would make later windows overflow and skip.
    """
    if candidate.precision != "fp16":
        return None, 0
    if not workload.calibrate_loss_scale:
        return workload.loss_scale_start, 0
    state = workload.fresh_state(candidate, init_scale=workload.loss_scale_start)
    try:
        halvings, windows = 0, list(workload.clean)
        while windows and halvings <= MAX_SCALE_HALVINGS:
            loss = candidate.backward(state, windows[0])
            state.scaler.unscale_(state.optimizer)
            before = state.scaler.get_scale()
            state.scaler.update()  # halves the scale when unscale_ found an inf or NaN
            state.optimizer.zero_grad(set_to_none=True)
            if state.scaler.get_scale() >= before or not torch.isfinite(torch.as_tensor(loss)).all():
                windows.pop(
                    0
                )  # finite at this scale (or a forward's NaN, which no scale fixes): the next window
                if state.scaler.get_scale() < before:
                    state.scaler.update(before)  # … without the halving a non-finite loss caused
            else:
                halvings += 1
        if windows:
            raise TrainmechError(
                f"candidate {candidate.name}: no loss scale down to 2**{16 - MAX_SCALE_HALVINGS} gives finite gradients"
            )
        return state.scaler.get_scale(), halvings
    finally:
        state.close()


# ----------------------------------------------------------------------------- offload: what one window moves


def window_transfers(workload: GateWorkload, offloading: Offloading, *contexts) -> list:
    """A probe, no update: one forward + backward of the workload's first window from the initial weights, the
    offload hooks inside `contexts` (activation_checkpointing: what the offload still sees under checkpointing);
    the TransferStats of each micro-batch (bytes each way, storages fetched ahead or on demand)."""
    probe = candidate("probe", "TRAIN-OFFLOAD", *contexts, offloading)
    with workload.running():
        state = workload.fresh_state(probe)
        try:
            probe.backward(state, workload.windows[0])
        finally:
            state.close()
            workload.model.zero_grad(set_to_none=True)
    return offloading.collect()


def hook_calls(workload: GateWorkload, *contexts) -> tuple[dict[int, int], dict[int, int]]:
    """A probe, no update: one forward + backward of the first micro-batch of the workload's first window from the
    initial weights inside `contexts` (a checkpointing); how often each decoder layer's forward pre-hooks ran, and
    each layer's MLP's, by layer index. A checkpoint that replays the layer calls its MLP again; a pre-hook of the
    layer itself runs again only if the checkpoint wraps the layer's __call__, not its forward."""
    model = workload.model
    probe = candidate("probe", "TRAIN-CHECKPOINT", *contexts)
    with (
        workload.running(),
        checkpointing.count_calls(model.model.layers) as layers,
        checkpointing.count_calls([layer.mlp for layer in model.model.layers]) as mlps,
    ):
        state = workload.fresh_state(probe)
        try:
            probe.backward(state, MicroBatches(workload.windows[0][:1]))
        finally:
            state.close()
            model.zero_grad(set_to_none=True)
    return dict(sorted(layers.items())), dict(sorted(mlps.items()))
