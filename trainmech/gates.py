"""Correctness gates: is a candidate training strategy correct, and only then, is it worth adopting.

A candidate is data plus two functions: what it claims (name, the registry experiment it stands
for, the compute dtype) and its training update, split into `backward` (one accumulation window:
forward and backward of every micro-batch, filling .grad) and `update` (write the parameters or
skip, and move the scheduler). The pipeline runs the reference and the candidate through the same
gate workload (`GateWorkload`: initial weights, windows, a held-out batch, attempts that receive a
non-finite sample) and records what happened in a `Trace`. Four gates then judge, in order, and
the pipeline stops at the first that fails; a fifth stage measures and never passes or fails:

    1 inputs       the model consumed the same rows (visible tokens) under the same RNG state
    2 gradients    each parameter's gradient of the first window agrees with the reference's,
                   within the tolerance of the dtype that actually ran, which must be the claimed one
    3 updates      the same number of effective updates, no non-finite value written, and the
                   optimizer's and the scheduler's step counts and learning rates follow the update clock
    4 quality      held-out token loss after the same effective updates, within the dtype's bound
    5 performance  a measurement, not a gate (its verdict's `passed` is None), only after 1-4 passed: step-time median / P95 after warm-up, allocated /
                   reserved peaks (CUDA; None elsewhere), tracked tensor bytes of one window

    reference_trace = gates.run_trace(reference, gw)
    report = gates.judge(candidate, gw, reference_trace, reference_performance)
    report.decision, report.reason     # accept / tune / reject, or None where it cannot be decided

`decide` applies the rules written below (`RULE`): any failed gate rejects; accept / tune need
allocator peaks and step times measured on a GPU, so on a CPU the decision stays None. A report's
`evidence_level` says where it was proven: "cpu-mechanism" on a CPU (gates 1-4 hold there; its
step times and tracked bytes are no GPU evidence), "gpu-measured" on CUDA.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

from trainmech import amp, strategies, supervision
from trainmech.checks import num
from trainmech.errors import TrainmechError
from trainmech.measure import StorageTracker, cuda_peaks, reset_cuda_peaks, time_stats, timed
from trainmech.update import wsd_multiplier
from trainmech.workload import pad_batch, split_micro_batches, supervised_tokens, token_stream

GATES = ("inputs", "gradients", "updates", "quality", "performance")
PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # claimed dtype -> amp precision

# Gate 2: largest |g_candidate - g_reference| of a parameter, relative to that parameter's largest
# reference gradient, by the dtype that ran. float32: bitwise on a CPU; 1e-4 leaves room for GPU
# kernels that reorder sums (atomics). FP16: ~40 unit roundoffs (2^-11); BF16: ~13 (2^-8).
GRAD_RTOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
GRAD_FLOOR = 1e-3  # a parameter's scale is at least GRAD_FLOOR x the largest gradient of all: no noise ratios
# Gate 4: |held-out token loss of candidate - reference| in nats after the same effective updates.
QUALITY_BOUND = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
EVIDENCE_LEVEL = {"cpu": "cpu-mechanism", "cuda": "gpu-measured"}


@dataclass(frozen=True)
class DecisionRule:
    """accept: the allocated peak falls by >= min_peak_drop at a median step <= max_time_ratio x the
    reference's, or the median falls by >= min_speedup at no higher peak. reject: a failed gate, or
    no lower peak and no faster step. tune: a gain that costs too much (e.g. offload's time)."""

    min_peak_drop: float = 0.10
    max_time_ratio: float = 1.25
    min_speedup: float = 0.10


RULE = DecisionRule()


# ----------------------------------------------------------------------------- candidates


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


def accumulate(state: TrainState, window: list[dict], *, contexts=(), normalization: str = "window_tokens") -> float:
    """One accumulation window: each micro-batch's forward and backward inside the strategy contexts
    and autocast of the claimed precision; its summed token loss is divided as `normalization` says
    (supervision.denominators) and scaled by the GradScaler before backward. Fills .grad; returns
    the window loss (unscaled, NaN for a non-finite sample).

    contexts: functions model -> context manager (checkpointing, offloading, ...), entered in order.
    """
    divisors = supervision.denominators([supervised_tokens(mb["labels"]) for mb in window], normalization)
    total = 0.0
    for mb, divisor in zip(window, divisors):
        with ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context(state.model))
            with amp.autocast(state.device, state.precision):
                logits = state.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
            loss = supervision.token_loss_sum(logits, mb["labels"]) / divisor  # float32 or wider
            state.scaler.scale(loss).backward()
        total += loss.item()
    return total


def step_on_effective(state: TrainState) -> None:
    """The update: GradScaler's step under FP16 (it skips on inf / NaN), else a step only when every
    gradient is finite; the scheduler moves only when the optimizer really stepped."""
    params = [p for group in state.optimizer.param_groups for p in group["params"]]
    if state.scaler.is_enabled():
        stepped = amp.scaled_step(state.scaler, state.optimizer)
    elif all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None):
        state.optimizer.step()
        stepped = True
    else:
        stepped = False
    if stepped:
        state.scheduler.step()


@dataclass(frozen=True)
class Candidate:
    name: str
    semantic_id: str  # the registry experiment it stands for, e.g. TRAIN-CHECKPOINT
    dtype: str = "float32"  # the compute dtype it claims: float32 / float16 / bfloat16
    backward: Callable[[TrainState, list[dict]], float] = accumulate
    update: Callable[[TrainState], None] = step_on_effective

    def __post_init__(self):
        if self.dtype not in PRECISION:
            raise TrainmechError(f"candidate {self.name}: unknown dtype {self.dtype!r}; valid: {', '.join(PRECISION)}")


def candidate(name: str, semantic_id: str, *contexts, dtype: str = "float32", **kwargs) -> Candidate:
    """A candidate whose backward is `accumulate` inside the given strategy contexts."""
    return Candidate(name, semantic_id, dtype, partial(accumulate, contexts=contexts), **kwargs)


def checkpointing(model: torch.nn.Module):
    """transformers' own activation checkpointing (strategies.hf_checkpointing)."""
    return strategies.hf_checkpointing(model)


@contextmanager
def offloading(model: torch.nn.Module, *, min_bytes: int = 1 << 20,
               prefetch_bytes: int = 64 << 20) -> Iterator[strategies.ActivationOffload]:
    """Activation offload (strategies.ActivationOffload) over one forward + backward; parameters stay."""
    device = next(model.parameters()).device
    hooks = strategies.ActivationOffload(device, keep=model.parameters(), min_bytes=min_bytes, prefetch_bytes=prefetch_bytes)
    with hooks:
        yield hooks
    hooks.finish()


# ----------------------------------------------------------------------------- the gate workload


def mixed_batch(rows: int, seq: int, part: str = "domain", offset: int = 0) -> dict[str, torch.Tensor]:
    """rows x seq tokens whose rows differ in length (padding) and in where supervision starts
    (response-only), so micro-batches supervise unequal token counts: a per-micro-batch mean cannot hide."""
    pattern = [(seq, 0), (seq * 3 // 8, seq // 4), (seq * 7 // 8, seq * 5 // 8), (seq // 2, 1)]  # (length, supervised from)
    stream, sequences, starts = token_stream(part), [], []
    for i in range(rows):
        length, start = pattern[i % len(pattern)]
        sequences.append([stream[(offset + t) % len(stream)] for t in range(length)])
        starts.append(start)
        offset += length
    return pad_batch(sequences, supervise_from=starts)


@dataclass
class GateWorkload:
    """The fixed inputs every candidate is judged on: same weights, windows, held-out batch, schedule."""

    model: torch.nn.Module
    initial: dict[str, torch.Tensor]  # state_dict copy on the CPU
    windows: list[list[dict]]  # one accumulation window (its micro-batches) per update attempt
    held_out: dict[str, torch.Tensor]
    inject_at: tuple[int, ...] = ()  # attempts whose logits are made NaN: a non-finite sample
    lr: float = 1e-3
    schedule: dict = field(default_factory=dict)  # wsd_multiplier keywords
    seed: int = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def expected_lr(self, k: int) -> float:
        """The learning rate of effective update k (0-based) by the update clock."""
        return self.lr * wsd_multiplier(k, **self.schedule)

    def fresh_state(self, cand: Candidate) -> TrainState:
        self.model.load_state_dict(self.initial)
        self.model.zero_grad(set_to_none=True)
        self.model.train()
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: wsd_multiplier(k, **self.schedule))
        precision = PRECISION[cand.dtype]
        return TrainState(self.model, optimizer, scheduler, amp.grad_scaler(self.device, precision), precision)


def gate_workload(model, *, rows: int, seq: int, micro_batches: int, attempts: int, inject_at=(), lr=1e-3,
                  warmup_updates: int = 1, decay_updates: int = 1, min_lr_ratio: float = 0.1, seed: int = 0) -> GateWorkload:
    """Windows of `mixed_batch` rows from successive stretches of the domain text, split into
    micro-batches; a held-out batch of the same shape from the general text; a WSD schedule over
    the effective updates (attempts minus injected ones)."""
    device = next(model.parameters()).device
    on = lambda b: {k: v.to(device) for k, v in b.items()}  # noqa: E731
    windows = [[on(mb) for mb in split_micro_batches(mixed_batch(rows, seq, offset=a * rows * seq), micro_batches)]
               for a in range(attempts)]
    effective = attempts - len(set(inject_at))
    stable = effective - warmup_updates - decay_updates
    if stable < 0:
        raise TrainmechError(f"{effective} effective updates cannot hold warmup {warmup_updates} + decay {decay_updates}")
    schedule = dict(warmup_steps=warmup_updates, stable_steps=stable, decay_steps=decay_updates, min_lr_ratio=min_lr_ratio)
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return GateWorkload(model, initial, windows, on(mixed_batch(rows, seq, "general")), tuple(inject_at), lr, schedule, seed)


# ----------------------------------------------------------------------------- traces


@dataclass
class Trace:
    """What one run of a candidate through the gate workload showed."""

    candidate: str
    consumed: list[list[str]] = field(default_factory=list)  # per attempt: a digest per row the model received
    handed: list[str] = field(default_factory=list)  # per attempt: digest of the window handed out (ids, masks, labels)
    rng: list[str] = field(default_factory=list)  # per attempt: digest of the RNG state at its start
    tokens: int = 0  # visible tokens the model received
    loss: float | None = None  # the first window's loss
    grads: dict[str, torch.Tensor] | None = None  # the first window's gradients, unscaled, on the CPU
    dtypes: list[str] = field(default_factory=list)  # what the Linear layers produced in the first window
    stepped: list[bool] = field(default_factory=list)  # per attempt: optimizer.step() ran
    finite: list[bool] = field(default_factory=list)  # per attempt: every parameter finite afterwards
    lrs: list[float] = field(default_factory=list)  # the learning rate at each optimizer.step()
    attempt_lrs: list[float] = field(default_factory=list)  # the learning rate at the start of each attempt
    optimizer_steps: int = 0  # AdamW's own step count at the end
    scheduler_steps: int = 0
    held_out_loss: float | None = None
    error: str | None = None  # "attempt k, backward: RuntimeError: ..." when the candidate raised


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _rng_digest(device: torch.device) -> str:
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
    return _digest(*states)


def _row_digests(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[str]:
    """One digest per row: the tokens the model may see (attention_mask 1), so re-splitting rows keeps them."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    return [_digest(ids[m.bool()]) for ids, m in zip(input_ids, mask)]


def _nan_logits(module, inputs, output):
    return output * float("nan")  # a non-finite sample: every gradient of this window becomes NaN


def held_out_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Mean token loss (nats) over the batch's supervised tokens, in float32, without gradients."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        loss = supervision.token_loss_sum(logits, batch["labels"]).item() / supervised_tokens(batch["labels"])
    model.train()
    return loss


def run_trace(cand: Candidate, gw: GateWorkload) -> Trace:
    """Run the candidate through every attempt of the gate workload from the initial weights, watching
    what the model receives, the first window's gradients and dtypes, every optimizer step and the
    held-out loss. An exception from the candidate ends the run and is kept in `error`."""
    torch.manual_seed(gw.seed)
    state, trace = gw.fresh_state(cand), Trace(cand.name)
    model, params = gw.model, dict(gw.model.named_parameters())

    steps = 0  # optimizer.step() calls that ran, whatever the candidate says

    def seen(module, args, kwargs):  # the model's own forward: what it really received
        ids, mask = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask")
        if ids is not None:
            trace.consumed[-1].extend(_row_digests(ids, mask))
            trace.tokens += int(ids.numel() if mask is None else mask.sum())

    def stepping(optimizer, *_):
        nonlocal steps
        steps += 1
        trace.lrs.append(optimizer.param_groups[0]["lr"])

    hooks = [model.register_forward_pre_hook(seen, with_kwargs=True), state.optimizer.register_step_pre_hook(stepping)]
    try:
        for attempt, window in enumerate(gw.windows):
            state.optimizer.zero_grad(set_to_none=True)
            trace.consumed.append([])
            trace.handed.append(_digest(*[mb[k] for mb in window for k in ("input_ids", "attention_mask", "labels")],
                                        torch.tensor([attempt in gw.inject_at])))
            trace.rng.append(_rng_digest(gw.device))
            trace.attempt_lrs.append(state.optimizer.param_groups[0]["lr"])
            stage = "backward"
            nan = model.lm_head.register_forward_hook(_nan_logits) if attempt in gw.inject_at else None
            try:
                with amp.activation_dtypes(model, ("Linear",)) as dtypes:
                    loss = cand.backward(state, window)
                if attempt == 0:
                    scale = state.scaler.get_scale() if state.scaler.is_enabled() else 1.0
                    trace.loss, trace.dtypes = loss, sorted(dtypes.get("Linear", ()))
                    trace.grads = {n: p.grad.detach().float().cpu() / scale for n, p in params.items() if p.grad is not None}
                stage, before = "update", steps
                cand.update(state)
            except Exception as e:  # the candidate's own failure is evidence, not a crash of the pipeline
                said = str(e).strip().splitlines()[0].split(": ")[0][:160] if str(e).strip() else ""  # the stable head
                trace.error = f"attempt {attempt}, {stage}: {type(e).__name__}: {said}"
                return trace
            finally:
                if nan is not None:
                    nan.remove()
            trace.stepped.append(steps > before)
            trace.finite.append(all(bool(torch.isfinite(p).all()) for p in params.values()))
    finally:
        for h in hooks:
            h.remove()
    states = [s["step"] for s in state.optimizer.state.values() if "step" in s]
    trace.optimizer_steps = int(states[0]) if states else 0
    trace.scheduler_steps = state.scheduler.last_epoch
    trace.held_out_loss = held_out_loss(model, gw.held_out)
    return trace


# ----------------------------------------------------------------------------- the gates
#
# Each gate is a pure function (reference trace, candidate trace, claimed dtype) -> Verdict.


@dataclass
class Verdict:
    name: str
    passed: bool | None  # None: a measurement, not a pass / fail judgement (the performance stage)
    evidence: dict
    message: str

    @property
    def failed(self) -> bool:
        return self.passed is False


def inputs_gate(ref: Trace, cand: Trace, claimed_dtype: str = "float32") -> Verdict:
    """Gate 1: the same windows handed out, the same rows consumed by the model, the same RNG states."""
    n = len(cand.consumed)
    evidence = {"attempts": n, "rows_consumed": sum(map(len, cand.consumed)),
                "rows_expected": sum(map(len, ref.consumed[:n])), "tokens_consumed": cand.tokens}
    if cand.handed != ref.handed[:n]:
        return Verdict("inputs", False, evidence, "the windows handed out differ from the reference's")

    def same(a: int) -> bool:  # a run the candidate's exception ended consumed only a prefix of its last window
        want = ref.consumed[a][: len(cand.consumed[a])] if cand.error and a == n - 1 else ref.consumed[a]
        return cand.consumed[a] == want

    differ = next((a for a in range(n) if not same(a)), None)
    if differ is not None:
        evidence["first_difference"] = differ
        got, want = len(cand.consumed[differ]), len(ref.consumed[differ])
        return Verdict("inputs", False, evidence, f"attempt {differ}: the model received {got} of the reference's {want} rows")
    if cand.rng != ref.rng[:n]:
        return Verdict("inputs", False, evidence, "the RNG state at a window's start differs from the reference's")
    if cand.error:  # gate 2 or 3 judges the exception itself
        stopped = cand.error.split(":")[0]
        return Verdict("inputs", True, evidence, f"identical as far as the run went ({evidence['rows_consumed']} rows; it stopped at {stopped})")
    return Verdict("inputs", True, evidence, f"{n} windows, {evidence['rows_consumed']} rows, RNG states equal")


def gradient_errors(ref: dict[str, torch.Tensor], cand: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: max |g_cand - g_ref| / max(max |g_ref|, GRAD_FLOOR x the largest |g_ref|), in float64."""
    top = max(float(g.abs().max()) for g in ref.values())
    out = {}
    for name, g in ref.items():
        if name not in cand:
            out[name] = float("inf")
            continue
        scale = max(float(g.abs().max()), GRAD_FLOOR * top, torch.finfo(torch.float64).tiny)
        out[name] = float((cand[name].double() - g.double()).abs().max()) / scale
    return out


def gradients_gate(ref: Trace, cand: Trace, claimed_dtype: str = "float32") -> Verdict:
    """Gate 2: the dtype that ran is the claimed one; every parameter's gradient within its tolerance."""
    if cand.grads is None:
        return Verdict("gradients", False, {"error": cand.error}, f"no gradients: {cand.error}")
    ran = cand.dtypes
    evidence = {"claimed_dtype": claimed_dtype, "ran": "/".join(ran)}
    if ran != [claimed_dtype]:
        return Verdict("gradients", False, evidence, f"claims {claimed_dtype}, but the Linear layers ran {'/'.join(ran) or 'nothing'}")
    rtol = GRAD_RTOL[claimed_dtype]
    errors = gradient_errors(ref.grads, cand.grads)
    worst = sorted(errors, key=lambda n: (-errors[n], n))[:3]
    bad = [n for n in errors if not errors[n] <= rtol]  # NaN and inf fail
    evidence |= {"rtol": rtol, "errors": errors, "worst": {n: errors[n] for n in worst},
                 "over_tolerance": len(bad), "parameters": len(errors), "loss_abs_error": abs(cand.loss - ref.loss),
                 "grad_max_abs_error": max(float((cand.grads[n] - g).abs().max()) for n, g in ref.grads.items() if n in cand.grads)}
    if bad:
        return Verdict("gradients", False, evidence,
                       f"{len(bad)} of {len(errors)} parameters over {rtol:.0e}; worst {worst[0]} at {errors[worst[0]]:.1e}")
    return Verdict("gradients", True, evidence, f"all {len(errors)} parameters within {rtol:.0e} ({claimed_dtype})")


def updates_gate(ref: Trace, cand: Trace, claimed_dtype: str = "float32", expected_lrs: list[float] | None = None) -> Verdict:
    """Gate 3: effective updates as many as the reference's, nothing non-finite written, and the
    optimizer, the scheduler and the learning rates following the update clock."""
    effective = sum(s and f for s, f in zip(cand.stepped, cand.finite))
    want = sum(s and f for s, f in zip(ref.stepped, ref.finite))
    lrs = expected_lrs if expected_lrs is not None else ref.lrs
    evidence = {"attempts": len(cand.stepped), "effective_updates": effective, "expected_effective_updates": want,
                "skipped_updates": len(cand.stepped) - effective, "non_finite_written": not all(cand.finite),
                "optimizer_steps": cand.optimizer_steps, "scheduler_steps": cand.scheduler_steps}
    mismatch = next((k for k, (a, b) in enumerate(zip(cand.lrs, lrs)) if a != b), None)
    evidence["first_lr_mismatch"] = mismatch
    off_clock = "" if mismatch is None else f"effective update {mismatch} ran at lr {cand.lrs[mismatch]:.3e}, the clock says {lrs[mismatch]:.3e}"
    checks = [  # the first that holds is the verdict's message
        (cand.error is not None, f"the run stopped: {cand.error}"),
        (evidence["non_finite_written"], "a non-finite value was written into the parameters"),
        (effective != want, f"{effective} effective updates, the reference made {want}"),
        (cand.optimizer_steps != effective, f"the optimizer counted {cand.optimizer_steps} steps for {effective} effective updates"),
        (cand.scheduler_steps != effective, f"the scheduler moved {cand.scheduler_steps} times for {effective} effective updates"),
        (mismatch is not None, off_clock),
    ]
    problem = next((message for failed, message in checks if failed), None)
    if problem:
        return Verdict("updates", False, evidence, problem)
    skipped = evidence["skipped_updates"]
    return Verdict("updates", True, evidence, f"{effective} effective + {skipped} skipped; optimizer, scheduler and lr follow the clock")


def quality_gate(ref: Trace, cand: Trace, claimed_dtype: str = "float32") -> Verdict:
    """Gate 4: held-out token loss after the same effective updates within the dtype's bound."""
    bound = QUALITY_BOUND[claimed_dtype]
    delta = abs(cand.held_out_loss - ref.held_out_loss)
    evidence = {"held_out_loss": cand.held_out_loss, "reference_held_out_loss": ref.held_out_loss, "delta": delta, "bound": bound}
    passed = delta <= bound
    return Verdict("quality", passed, evidence, f"held-out loss {num(cand.held_out_loss)} vs {num(ref.held_out_loss)}: "
                   f"|Δ| {'≤' if passed else '>'} {bound:g} nats")


# ----------------------------------------------------------------------------- performance and decision


@dataclass
class Performance:
    device_type: str
    step_time_median_s: float
    step_time_p95_s: float
    peak_allocated_bytes: int | None  # CUDA allocator peaks over the timed updates; None elsewhere
    peak_reserved_bytes: int | None
    tracked_peak_bytes: int  # tensor storages born in one window's forward + backward, at their peak
    warmup: int
    repeats: int

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda" and self.peak_allocated_bytes is not None


def measure(cand: Candidate, gw: GateWorkload, *, warmup: int, repeats: int) -> Performance:
    """Time `repeats` update attempts after `warmup` untimed ones (no injected sample), read the
    CUDA peaks over the timed ones, then track one window's tensor storages."""
    state = gw.fresh_state(cand)
    clean = [w for a, w in enumerate(gw.windows) if a not in gw.inject_at]

    def attempt(i):
        state.optimizer.zero_grad(set_to_none=True)
        cand.backward(state, clean[i % len(clean)])
        cand.update(state)

    for i in range(warmup):
        attempt(i)
    gc.collect()
    if gw.device.type == "cuda":
        torch.cuda.empty_cache()
    reset_cuda_peaks(gw.device)
    seconds = [timed(partial(attempt, warmup + i), gw.device)[1] for i in range(repeats)]
    peaks = cuda_peaks(gw.device)
    state.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    tracker = StorageTracker()
    with tracker:
        cand.backward(state, clean[0])
    state.optimizer.zero_grad(set_to_none=True)
    return Performance(gw.device.type, **time_stats(seconds), **peaks, tracked_peak_bytes=max(tracker.live, default=0),
                       warmup=warmup, repeats=repeats)


def decide_measured(peak_drop: float, time_ratio: float, rule: DecisionRule = RULE) -> str:
    """accept / tune / reject from GPU measurements: peak_drop = 1 - peak / reference peak (allocated),
    time_ratio = median step / reference median step."""
    if (peak_drop >= rule.min_peak_drop and time_ratio <= rule.max_time_ratio) or (
        time_ratio <= 1 - rule.min_speedup and peak_drop >= 0
    ):
        return "accept"
    if peak_drop <= 0 and time_ratio >= 1:
        return "reject"
    return "tune"


def decide(verdicts: list[Verdict], perf: Performance | None, reference: Performance | None,
           rule: DecisionRule = RULE) -> tuple[str | None, str]:
    """(decision, reason). A failed gate rejects on any device. Otherwise accept / tune / reject by
    `decide_measured`, which needs allocator peaks and step times from a GPU: without them, None."""
    failed = next((v for v in verdicts if v.failed), None)
    if failed is not None:
        return "reject", f"{failed.name} gate failed: {failed.message}"
    if perf is None or reference is None or not (perf.on_gpu and reference.on_gpu):
        return None, ("gates 1-4 passed; accept or tune needs allocated peaks and step times measured on a GPU "
                      "(TRAIN-CUDA-MECHANISM), and this run has none")
    drop = 1 - perf.peak_allocated_bytes / reference.peak_allocated_bytes
    ratio = perf.step_time_median_s / reference.step_time_median_s
    return decide_measured(drop, ratio, rule), (
        f"allocated peak {-drop:+.1%}, median x{ratio:.2f} (accept: peak {-rule.min_peak_drop:+.0%} or lower at "
        f"≤ x{rule.max_time_ratio:g}, or median ≤ x{1 - rule.min_speedup:g} at no higher peak; reject: neither lower nor faster)")


# ----------------------------------------------------------------------------- the pipeline


@dataclass
class Report:
    candidate: Candidate
    verdicts: list[Verdict]
    performance: Performance | None
    decision: str | None
    reason: str
    evidence_level: str
    trace: Trace

    @property
    def failed_gate(self) -> str | None:
        return next((v.name for v in self.verdicts if v.failed), None)

    def verdict(self, name: str) -> Verdict | None:
        return next((v for v in self.verdicts if v.name == name), None)

    def lines(self) -> list[str]:
        """The report as printed lines: one per stage, ✓ passed, ✗ failed, — measured (performance), · not run."""
        c = self.candidate
        out = [f"{c.name}  ({c.semantic_id}, claims {c.dtype})"]
        for name in GATES:
            v = self.verdict(name)
            if v is None:
                mark, text = "·", "not run: an earlier gate failed"
            else:
                mark, text = {True: "✓", False: "✗", None: "—"}[v.passed], v.message
            out.append(f"  {mark} {name:<12} {text}")
        out.append(f"  decision: {self.decision or 'null'}  ({self.evidence_level})")
        return out


def performance_verdict(perf: Performance, reference: Performance | None) -> Verdict:
    """Stage 5 measures; it is no gate (passed None): whether a measured gain is worth it is `decide`'s job."""
    evidence = {k: getattr(perf, k) for k in ("step_time_median_s", "step_time_p95_s", "peak_allocated_bytes",
                                              "peak_reserved_bytes", "tracked_peak_bytes", "warmup", "repeats")}
    if perf.on_gpu and reference is not None and reference.on_gpu:
        message = (f"median x{perf.step_time_median_s / reference.step_time_median_s:.2f}, allocated peak "
                   f"{perf.peak_allocated_bytes / reference.peak_allocated_bytes - 1:+.1%} vs the reference")
    else:
        message = (f"measured on {perf.device_type}: CPU step times recorded, no GPU evidence; allocator peaks null; "
                   f"tracked tensor bytes of one window {perf.tracked_peak_bytes:,}")
    return Verdict("performance", None, evidence, message)


def judge(cand: Candidate, gw: GateWorkload, reference: Trace, reference_performance: Performance | None = None,
          *, warmup: int = 1, repeats: int = 3, trace: Trace | None = None) -> Report:
    """Run the candidate, apply gates 1-4 in order up to the first failure, measure performance only
    if all four passed, and decide."""
    trace = trace or run_trace(cand, gw)
    verdicts = []
    for gate in (inputs_gate, gradients_gate, updates_gate, quality_gate):
        kwargs = {"expected_lrs": [gw.expected_lr(k) for k in range(len(trace.lrs))]} if gate is updates_gate else {}
        verdicts.append(gate(reference, trace, cand.dtype, **kwargs))
        if not verdicts[-1].passed:
            break
    perf = None
    if not any(v.failed for v in verdicts):
        perf = measure(cand, gw, warmup=warmup, repeats=repeats)
        verdicts.append(performance_verdict(perf, reference_performance))
    decision, reason = decide(verdicts, perf, reference_performance)
    trace.grads = None  # kept only as long as gate 2 needs them (a GPU model's gradients are gigabytes)
    return Report(cand, verdicts, perf, decision, reason, EVIDENCE_LEVEL.get(gw.device.type, "not-measured"), trace)
