"""Task6 guard: the correctness gates (trainmech.gates) over candidates (trainmech.candidates) and their traces
(trainmech.tracing), the noise floor, the decision rules, and the pipeline that judges a candidate through
them (trainmech.gate_report). (The registry rendered from the gates' records is tested in test_results.py.)

Every planted bug must be stopped by the gate meant for it, with every earlier gate passing and no
later gate run; the same candidate without the bug must pass every gate. The gate workload has a
dropout, so a replay that does not restore the RNG state has something to get wrong. The decision
rules are checked at their boundaries on plain numbers, the gates on small hand-made traces.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from contextlib import contextmanager
from dataclasses import replace
from functools import partial

import pytest
import torch

from trainmech import (
    amp,
    candidates,
    checkpointing,
    gate_report,
    gates,
    profiles,
    supervision,
    tracing,
    update,
    workload,
)
from trainmech.errors import TrainmechError
from trainmech.results import REPO_ROOT

pytestmark = pytest.mark.task6

ATTEMPTS, INJECT_AT, PROMPT_ONLY_AT, LR = 8, (2,), (5,), 3e-3


@pytest.fixture(scope="module")
def gw(tiny_profile_model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from threads that spin-wait on a shared machine
    built = tiny_profile_model(seed=0)
    yield candidates.gate_workload(
        built.model,
        rows=4,
        seq=32,
        micro_batches=2,
        attempts=ATTEMPTS,
        inject_at=INJECT_AT,
        lr=LR,
        warmup_updates=2,
        decay_updates=3,
        dropout=0.1,
        prompt_only_at=PROMPT_ONLY_AT,
    )
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(gw):
    return gates.make_reference(gw)


def offload(model):
    return candidates.Offloading(min_bytes=4096)(model)


# ----------------------------------------------------------------------------- planted bugs


def autocast_around_backward(state, window):
    divisors = supervision.denominators([workload.supervised_tokens(mb["labels"]) for mb in window])
    for mb, divisor in zip(window, divisors):
        logits = state.model(
            input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False
        ).logits
        loss = supervision.token_loss_sum(logits, mb["labels"]) / divisor
        with torch.autocast(state.device.type, dtype=torch.float16):  # around backward: does nothing
            state.scaler.scale(loss).backward()
    return 0.0


def mean_per_micro_batch(state, window):
    for mb in window:
        with offload(state.model):
            state.scaler.scale(state.model(**mb, use_cache=False).loss / len(window)).backward()
    return 0.0


def mean_loss_by_token_share(state, window):
    """FP16: each micro-batch's mean token loss, written by hand (masked sum / mask count), weighted by its share of
    the window's supervised tokens: the package's sum wherever a micro-batch supervises a token. On a prompt-only
    one the mean is 0 / 0: NaN in the loss and, through the mask's zeros, in every gradient — which GradScaler
    skips as if it were an overflow."""
    total_tokens, total = sum(window.tokens), 0.0
    for mb, tokens in zip(window, window.tokens):
        with amp.autocast(state.device, state.precision):
            logits = state.model(
                input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False
            ).logits
        labels = mb["labels"][:, 1:]
        mask = labels != workload.IGNORE_INDEX
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        loss = (nll * mask).sum() / mask.sum() * (tokens / total_tokens)
        state.scaler.scale(loss).backward()
        total += loss.detach()
    return total


@contextmanager
def head_in_fp16(model):
    """torch.autocast(float16) around the output head's forward alone."""
    plain = model.lm_head.forward
    model.lm_head.forward = torch.autocast(model.lm_head.weight.device.type, dtype=torch.float16)(plain)
    try:
        yield
    finally:
        del model.lm_head.forward


def autocast_around_the_head_alone(state, window):
    """Claims FP16 (GradScaler on), but only the head runs in it: the decoder layers stay float32."""
    full_precision = dataclasses.replace(state, precision="fp32")  # no autocast around the forward
    return candidates.window_backward(full_precision, window, contexts=(head_in_fp16,))


def fp16_in_the_first_window_only(state, window):
    """Claims FP16, but an FP32 "fallback" fires once the optimizer holds state: autocast in the first window only."""
    precision = "fp32" if state.optimizer.state else state.precision  # the bug: the fallback's condition
    return candidates.window_backward(dataclasses.replace(state, precision=precision), window)


def scheduler_every_attempt(state):
    amp.scaled_step(state.scaler, state.optimizer)
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)


@contextmanager
def clamp_layer_inputs(model, in_place):
    for layer in model.model.layers:
        plain = layer.forward
        clamp = (lambda h: h.clamp_(-1e4, 1e4)) if in_place else (lambda h: h.clamp(-1e4, 1e4))
        layer.forward = lambda h, *a, _plain=plain, _clamp=clamp, **k: _plain(_clamp(h), *a, **k)
    try:
        yield
    finally:
        for layer in model.model.layers:
            layer.__dict__.pop("forward", None)


@contextmanager
def calls_per_forward(model, counted_inside):
    calls = {}
    handles = [model.register_forward_pre_hook(lambda *_: calls.clear())]
    for i, layer in enumerate(model.model.layers):
        count = lambda *_, i=i: calls.__setitem__(i, calls.get(i, 0) + 1)  # noqa: E731
        handles.append(
            layer.mlp.register_forward_pre_hook(count)
            if counted_inside
            else layer.register_forward_pre_hook(count)
        )
        handles.append(
            layer.mlp.register_forward_pre_hook(lambda m, args, i=i: (args[0] / calls[i], *args[1:]))
        )
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def each_layer(model):
    return checkpointing.checkpoint_layers(model.model.layers)


def first_micro_batch_only(state, window):
    return candidates.window_backward(state, window[:1], contexts=(candidates.activation_checkpointing,))


def step_without_guard(state):
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)


def update_without_zero_grad(state):
    if update.step_if_finite(state.optimizer):
        state.scheduler.step()


def raise_adam_eps(state):
    for group in state.optimizer.param_groups:
        group["eps"] = 1e-3
    candidates.effective_update(state)


FP16 = candidates.candidate("fp16", "TRAIN-AMP-BACKWARD", dtype="float16")
FP32 = candidates.candidate(
    "fp32", "TRAIN-AMP-BACKWARD"
)  # the default update: zero_grad, the finiteness guard
CHECKPOINT = candidates.candidate("checkpoint", "TRAIN-CHECKPOINT", candidates.activation_checkpointing)
OFFLOAD = candidates.candidate("offload", "TRAIN-OFFLOAD", offload)
CLAMP = candidates.candidate(
    "checkpoint-clamp", "TRAIN-CHECKPOINT", partial(clamp_layer_inputs, in_place=False), each_layer
)
COUNTED_OUT = candidates.candidate(
    "count-in-pre-hook", "TRAIN-CHECKPOINT", partial(calls_per_forward, counted_inside=False), each_layer
)

# bug -> (gate that must stop it, experiment, dtype, the buggy candidate's parts, the candidate without it)
_BUGS = {
    "fp32-claiming-fp16": (
        "gradients",
        "TRAIN-AMP-BACKWARD",
        "float16",
        {"backward": autocast_around_backward},
        FP16,
    ),
    "mean-per-micro-batch": (
        "gradients",
        "TRAIN-OFFLOAD",
        "float32",
        {"backward": mean_per_micro_batch},
        OFFLOAD,
    ),
    "fp16-on-the-head-alone": (
        "gradients",
        "TRAIN-AMP-BACKWARD",
        "float16",
        {"backward": autocast_around_the_head_alone},
        FP16,
    ),
    "fp16-in-the-first-window-only": (
        "gradients",
        "TRAIN-AMP-BACKWARD",
        "float16",
        {"backward": fp16_in_the_first_window_only},
        FP16,
    ),
    "nan-from-a-prompt-only-micro-batch": (
        "gradients",
        "TRAIN-AMP-BACKWARD",
        "float16",
        {"backward": mean_loss_by_token_share},
        FP16,
    ),
    "scheduler-on-skips": (
        "updates",
        "TRAIN-AMP-BACKWARD",
        "float16",
        {"update": scheduler_every_attempt},
        FP16,
    ),
    "checkpoint-in-place": (
        "gradients",
        "TRAIN-CHECKPOINT",
        "float32",
        {"contexts": (partial(clamp_layer_inputs, in_place=True), each_layer)},
        CLAMP,
    ),
    "outside-state-in-checkpoint": (
        "gradients",
        "TRAIN-CHECKPOINT",
        "float32",
        {"contexts": (partial(calls_per_forward, counted_inside=True), each_layer)},
        COUNTED_OUT,
    ),
    "rng-not-restored": (
        "inputs",
        "TRAIN-CHECKPOINT",
        "float32",
        {"contexts": (partial(candidates.activation_checkpointing, preserve_rng_state=False),)},
        CHECKPOINT,
    ),
    "no-zero-grad": (
        "gradients",
        "TRAIN-AMP-BACKWARD",
        "float32",
        {"update": update_without_zero_grad},
        FP32,
    ),
    "faster-skips-work": (
        "inputs",
        "TRAIN-CHECKPOINT",
        "float32",
        {"backward": first_micro_batch_only},
        CHECKPOINT,
    ),
    "no-finiteness-guard": ("updates", "TRAIN-AMP-BACKWARD", "float32", {"update": step_without_guard}, FP32),
    "recipe-change": ("quality", "TRAIN-AMP-BACKWARD", "float16", {"update": raise_adam_eps}, FP16),
}


def _buggy(name: str, semantic_id: str, dtype: str, parts: dict) -> candidates.Candidate:
    """A candidate from its strategy contexts (the package's backward inside them) or its own backward / update."""
    if "contexts" in parts:
        return candidates.candidate(name, semantic_id, *parts["contexts"], dtype=dtype)
    return candidates.Candidate(name, semantic_id, dtype, **parts)


PLANTED = {  # bug -> (the candidate with it, the gate that must stop it, the candidate without it)
    bug: (_buggy(f"b{k}", semantic_id, dtype, parts), gate, fixed)
    for k, (bug, (gate, semantic_id, dtype, parts, fixed)) in enumerate(_BUGS.items(), 1)
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_is_stopped_by_its_gate_and_only_then(gw, reference, bug):
    buggy, gate, _ = PLANTED[bug]
    report = gate_report.judge(buggy, gw, reference, warmup=0, repeats=1)
    k = gates.GATES.index(gate)
    assert report.failed_gate == gate and not report.passed, report.lines()
    assert [v.name for v in report.verdicts] == list(gates.GATES[: k + 1])  # the pipeline stopped there
    assert all(v.passed for v in report.verdicts[:k])  # every earlier gate let it through
    assert report.performance is None and report.outcome == "reject" and report.decision == "reject"
    assert report.reason.startswith(f"{gate} gate failed")
    assert report.record_fields()["conclusion"]["failure"] == f"{gate} gate failed"


def test_the_scheduler_bug_is_told_where_it_left_the_update_clock(gw, reference):
    """Report.off_the_clock (Task6's scheduler cell prints it): the scheduler's steps against the effective updates,
    and the first learning rate off the clock as an effective update and as an attempt of the reference's run, one
    it stepped with exactly that many effective updates before it; a report stopped before gate 3 refuses."""
    report = gate_report.judge(PLANTED["scheduler-on-skips"][0], gw, reference, measure=False)
    evidence, stepped = report.verdict("updates").evidence, reference.trace.stepped
    told = report.off_the_clock(stepped)
    assert told.startswith(
        f"scheduler moved {evidence['scheduler_steps']} times for {evidence['effective_updates']} effective updates"
    )
    first, attempt = map(int, re.search(r"effective update (\d+) .*which is attempt (\d+)", told).groups())
    assert first == evidence["first_lr_mismatch"] and stepped[attempt] and sum(stepped[:attempt]) == first
    assert attempt > first  # the reference skipped an attempt before it
    stopped = gate_report.judge(PLANTED["rng-not-restored"][0], gw, reference, measure=False)
    with pytest.raises(ValueError, match="never reached the updates gate"):
        stopped.off_the_clock(stepped)


@pytest.mark.parametrize("fixed", [FP16, CHECKPOINT, OFFLOAD], ids=lambda c: c.name)
def test_without_the_bug_no_gate_fires(gw, reference, fixed):
    report = gate_report.judge(fixed, gw, reference, warmup=0, repeats=1)
    assert report.failed_gate is None and report.passed, report.lines()  # performance's None is no failure
    assert [v.name for v in report.verdicts] == list(gates.GATES)
    assert [v.passed for v in report.verdicts] == [True] * 4 + [
        None
    ]  # performance is measured, never passed or failed
    assert report.lines()[-2].startswith("  — performance")
    p = report.performance
    assert (
        p.peak_allocated_bytes is None and p.peak_reserved_bytes is None and p.cuda_context_bytes is None
    )  # CPU: unknown, not 0
    assert p.bytes_per_row > 0 and p.tracked_peak_bytes > 0
    assert (
        report.outcome is None and report.evidence_level == "cpu-mechanism"
    )  # nothing to accept from CPU numbers
    assert report.record_fields()["conclusion"]["decision"] is None


@pytest.mark.parametrize("cand", [CHECKPOINT, OFFLOAD], ids=lambda c: c.name)
def test_the_performance_stage_with_the_cpu_allocator_forced_runs_the_allocator_bookkeeping(
    gw, reference, cand
):
    """`_peaks` / `_forward_backward_peak` read the allocator through measure.allocator_window, as on CUDA: here the CPU
    allocator (the profiler's count) stands in, and its peaks agree with the tracked tensor bytes."""
    forced, forced_ref = tracing.remeasure(
        cand, reference.candidate, gw, warmup=1, repeats=1, allocator="cpu-profiler"
    )
    plain, _ = tracing.remeasure(cand, reference.candidate, gw, warmup=1, repeats=1)
    for p in (forced, forced_ref):
        assert abs(p.peak_allocated_bytes / p.tracked_peak_bytes - 1) <= 0.02
        assert abs(p.forward_backward_allocated_bytes / p.tracked_forward_backward_bytes - 1) <= 0.02
        assert p.forward_backward_allocated_bytes <= p.peak_allocated_bytes
        # the CPU allocator reserves nothing beside what it hands out, and there is no CUDA context
        assert (p.peak_reserved_bytes, p.forward_backward_reserved_bytes, p.cuda_context_bytes) == (
            None,
            None,
            None,
        )
        assert not p.on_gpu
    assert (
        abs(forced.bytes_per_row / plain.bytes_per_row - 1) <= 0.05
    )  # the allocator's slope is the tracked one
    if cand is CHECKPOINT:  # a sequence costs less (offload: see the next test)
        assert forced.bytes_per_row < forced_ref.bytes_per_row
    assert all(getattr(plain, k) is None for k in tracing.ALLOCATOR_FIELDS)  # not forced: unknown on a CPU


def test_offload_saves_per_sequence_only_where_its_prefetch_window_leaves_a_layer_on_the_host(gw, reference):
    """Two layers, the last exempt: a 2-layer prefetch window fetches layer 0 back at the loss, before the
    backward's peak, so a sequence costs as much as the reference's; with no window layer 0 comes back after it."""
    per_row = {}
    for window in (2, 0):
        cand = candidates.candidate(
            f"offload-{window}",
            "TRAIN-OFFLOAD",
            candidates.Offloading(min_bytes=4096, prefetch_groups=window),
        )
        ours, ref = tracing.remeasure(cand, reference.candidate, gw, warmup=1, repeats=1)
        per_row[window] = ours.bytes_per_row
    assert per_row[2] == ref.bytes_per_row > per_row[0]


def test_every_planted_bug_has_its_true_twin_and_every_twin_is_judged():
    """The twin claims what the buggy candidate claims (dtype, experiment) and is among the fixed candidates
    the tests below run through the gates."""
    judged = {c.name for c in (FP16, CHECKPOINT, OFFLOAD, CLAMP, COUNTED_OUT, FP32)}
    for bug, (buggy, _, fixed) in PLANTED.items():
        assert (buggy.dtype, buggy.semantic_id) == (fixed.dtype, fixed.semantic_id), bug
        assert fixed.name in judged, bug


@pytest.mark.parametrize("fixed", [CLAMP, COUNTED_OUT, FP32], ids=lambda c: c.name)
def test_the_fixed_variants_pass_the_gates_without_a_measurement(gw, reference, fixed):
    report = gate_report.judge(fixed, gw, reference, measure=False)
    assert [v.passed for v in report.verdicts] == [True] * 4 and report.performance is None and report.passed
    assert "not measured" in report.lines()[-2] and report.stages() == [True] * 4 + ["not measured"]


def test_the_reference_skips_exactly_the_injected_attempts_and_its_noise_floor(reference):
    trace, floor = reference.trace, reference.floor
    assert [not s for s in trace.stepped] == [a in INJECT_AT for a in range(ATTEMPTS)]
    assert trace.scheduler_steps == trace.optimizer_steps == ATTEMPTS - len(INJECT_AT)
    assert all(trace.finite) and trace.error is None and len(trace.weights) == ATTEMPTS
    assert floor.grad_self == 0 and floor.quality_self == 0  # a CPU reruns bitwise
    assert (
        floor.grad_seed > gates.SEED_SEPARATION * gates.GRAD_RTOL["float16"]
    )  # the dropout makes another seed visible, in every window: grad_seed is the smallest window's
    assert gates.movement(trace) > 3 * floor.quality_seed


def test_tolerances_rise_with_the_reference_noise_and_follow_the_training_movement(reference):
    tol = reference.tolerances("float16")
    assert tol.grad_rtol == gates.GRAD_RTOL["float16"] and tol.grad_from == "float16 rounding"
    assert tol.quality_bound == pytest.approx(
        gates.QUALITY_FRACTION["float16"] * gates.movement(reference.trace)
    )
    noisy = gates.NoiseFloor(grad_self=1e-3, grad_seed=0.5, quality_self=1e-2, quality_seed=0.1)
    raised = gates.tolerances("float32", reference.trace, noisy)
    assert (
        raised.grad_rtol == pytest.approx(1e-2)
        and raised.quality_bound == pytest.approx(0.1)
        and "noise" in raised.grad_from
    )


def test_the_float32_tolerance_says_what_applies_on_the_device_that_ran(reference):
    """Bitwise reruns (a CPU): float32's room for reordered sums is named unused; a noisy rerun below the table's
    value (a GPU's atomics): the table's reason; a noisier one: the raised tolerance's."""
    bitwise = gates.NoiseFloor(grad_self=0.0, grad_seed=0.5, quality_self=0.0, quality_seed=0.1)
    atomics = replace(bitwise, grad_self=1e-7)
    assert gates.tolerances("float32", reference.trace, bitwise).grad_from == gates.BITWISE_FLOAT32_FROM
    assert gates.tolerances("float32", reference.trace, atomics).grad_from == gates.GRAD_RTOL_FROM["float32"]
    assert gates.tolerances("float16", reference.trace, bitwise).grad_from == gates.GRAD_RTOL_FROM["float16"]


def test_a_candidate_off_the_reference_trajectory_is_judged_from_the_references_weights(gw, reference):
    """The teacher-forced pass: a recipe change moves the weights, yet gate 2 sees equal gradients."""
    eps = PLANTED["recipe-change"][0]
    free = tracing.run_trace(eps, gw)
    forced = tracing.run_trace(eps, gw, teacher=reference.trace)
    assert not gates.gradients_gate(
        reference.trace, free, "float16"
    ).passed  # its own weights drifted: later windows differ
    assert gates.gradients_gate(reference.trace, forced, "float16").passed
    assert (
        forced.consumed == free.consumed
        and forced.rng == free.rng
        and forced.held_out_loss == free.held_out_loss
    )


def test_an_fp16_candidate_whose_loss_scale_starts_too_high_is_calibrated_not_rejected(gw, reference):
    hot = {
        c: tracing.run_trace(FP16, dataclasses.replace(gw, loss_scale_start=2.0**40, calibrate_loss_scale=c))
        for c in (False, True)
    }
    expected = [gw.expected_lr(k) for k in range(ATTEMPTS)]
    assert not gates.updates_gate(reference.trace, hot[False], "float16", expected_lrs=expected).passed
    verdict = gates.updates_gate(
        reference.trace, hot[True], "float16", expected_lrs=expected[: len(hot[True].lrs)]
    )
    assert verdict.passed and verdict.evidence["loss_scale_halvings"] == hot[True].scale_halvings > 0


def test_an_fp16_candidate_whose_gradscaler_skips_an_update_is_judged_like_for_like(gw, reference):
    """Forced on a CPU: calibration off, a start scale one halving too high. GradScaler skips attempt 0 (the
    reference stepped it); judge holds the candidate to the reference skipping it too and passes it, the skip
    reported by gate 3. Two halvings too high: two skips, more than a quarter of 7 updates: the scale is not
    settled, and gate 3 (not gate 2: the skipped windows' gradients were never used) says so."""
    once, twice = (
        gate_report.judge(
            FP16,
            dataclasses.replace(gw, loss_scale_start=s, calibrate_loss_scale=False),
            reference,
            measure=False,
        )
        for s in (2.0**20, 2.0**21)
    )
    assert once.failed_gate is None, once.lines()
    updates = once.verdict("updates")
    assert updates.evidence["scaler_skips"] == [0] and "GradScaler skipped attempts [0]" in updates.message
    assert once.record_fields()["metrics"]["loss_scale_skips"] == [0]
    assert sum(once.trace.stepped) == sum(reference.trace.stepped) - 1
    assert (
        twice.failed_gate == "updates" and "the loss scale is not settled" in twice.verdict("updates").message
    )
    assert twice.verdict("gradients").passed  # the skipped windows, recomputed where they fit, agree


def test_a_skip_counts_as_an_overflow_only_where_a_lower_scale_makes_the_gradients_fit(gw, reference):
    """GradScaler skips any inf or NaN. The skipped window, recomputed at halved scales, is finite at the first one
    below the overflow and within tolerance: an overflow. The same window with a NaN a bug puts into the backward
    (the loss finite) stays NaN down to scale 1: not forgiven, and gate 2, not a like-for-like rerun, judges it."""
    hot = dataclasses.replace(gw, loss_scale_start=2.0**20, calibrate_loss_scale=False)
    first = tracing.run_trace(FP16, hot, teacher=reference.trace)
    tol = reference.tolerances("float16")
    assert (
        gates.scaler_skips(reference.trace, first) == [0] == gates.overflow_skips(reference.trace, first, tol)
    )
    assert (
        first.rescaled[0][0] == 2.0**19
        and gates.gradients_gate(reference.trace, first, "float16", tol).passed
    )

    attempt = 3

    def poison(module, args, out):  # the bug: a backward that makes NaN of the logits' gradients
        out.register_hook(lambda g: g * float("nan"))

    def backward_nan_in(state, window):
        hook = state.model.lm_head.register_forward_hook(poison) if window is gw.windows[attempt] else None
        try:
            return candidates.window_backward(state, window)
        finally:
            if hook is not None:
                hook.remove()

    buggy = candidates.Candidate("fp16-backward-nan", "TRAIN-AMP-BACKWARD", "float16", backward_nan_in)
    trace = tracing.run_trace(buggy, gw, teacher=reference.trace)
    assert gates.scaler_skips(reference.trace, trace) == [attempt] and not gates.overflow_skips(
        reference.trace, trace, tol
    )
    assert trace.rescaled[attempt][0] == 1.0  # halved all the way down, still NaN
    report = gate_report.judge(buggy, gw, reference, trace=trace, measure=False)
    assert report.failed_gate == "gradients", report.lines()
    assert "still not finite: not an overflow" in report.verdict("gradients").message


def test_a_nan_from_a_prompt_only_micro_batch_is_a_gradient_failure_not_a_scaler_skip(gw, reference):
    """The planted bug's window: the loss itself is NaN (0 / 0), so no scale fixes it; the rest agree."""
    buggy = PLANTED["nan-from-a-prompt-only-micro-batch"][0]
    report = gate_report.judge(buggy, gw, reference, measure=False)
    gradients = report.verdict("gradients")
    assert gradients.evidence["first_bad_window"] == PROMPT_ONLY_AT[0]
    assert "its loss is not finite" in gradients.message
    fine = [e for k, e in zip(gradients.evidence["compared"], gradients.evidence["window_worst"]) if k != 5]
    assert max(fine) <= reference.tolerances("float16").grad_rtol  # every other window agrees


def test_a_candidate_whose_hook_frees_the_gradients_is_judged_by_what_they_accumulated(gw, reference):
    """An optimizer in the backward frees `.grad` in a post-accumulate-grad hook; gate 2 still sees the
    gradient (tracing.GradWatch), not a missing one scored inf."""

    @contextmanager
    def freeing(model):
        handles = [
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            for p in model.parameters()
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    one_window = dataclasses.replace(gw, windows=[candidates.MicroBatches(gw.windows[0][:1])], inject_at=())
    ref = tracing.run_trace(reference.candidate, one_window, keep_weights=True)
    freed = tracing.run_trace(candidates.candidate("frees-grads", "X", freeing), one_window, teacher=ref)
    assert freed.grads[0].keys() == ref.grads[0].keys()
    assert gates.gradients_gate(ref, freed, "float32").passed


def test_an_optimizer_in_the_backward_is_judged_without_stepping_it_twice(tiny_profile_model):
    """optimizers.OptimizerInBackward as a candidate's optimizer: fused AdamW per parameter, the reference foreach
    AdamW (forced on a CPU: the two round differently, so the candidate's weights leave the reference's and every
    later window is also computed from the reference's weights, the in-backward step running again inside that
    pass). `tracing.steps_undone` puts its moments and step counts back: all four gates pass. It cannot skip a
    non-finite window (the update is written in the backward): on the workload with an injected NaN it is wrong."""
    from trainmech.optimizers import OptimizerInBackward

    built = tiny_profile_model(seed=0)
    batch = workload.lm_batch("domain", 2, 32)
    plain = candidates.fixed_batch_workload(built.model, batch, updates=3, foreach=True)
    ref = gates.make_reference(plain, calibrate=False)
    in_backward = lambda params, lr, foreach: OptimizerInBackward(  # noqa: E731
        params, lambda ps: torch.optim.AdamW(ps, lr=lr, fused=True)
    )
    passes = []

    def counted(state, window):
        passes.append(window)
        return candidates.window_backward(state, window)

    cand = candidates.Candidate(
        "adamw-in-backward", "TRAIN-STATE-LEDGER", backward=counted, optimizer=in_backward
    )
    report = gate_report.judge(cand, plain, ref, warmup=1, repeats=1)  # the performance stage too
    assert report.failed_gate is None and report.performance is not None, report.lines()
    assert len(passes) > len(plain.windows)  # second passes from the reference's weights ran
    updates = report.verdict("updates").evidence
    assert updates["optimizer_steps"] == updates["effective_updates"] == 3
    poisoned = dataclasses.replace(plain, inject_at=(1,))
    wrong = gate_report.judge(cand, poisoned, gates.make_reference(poisoned, calibrate=False), measure=False)
    assert wrong.failed_gate == "updates" and wrong.verdict("updates").evidence["non_finite_written"]
    assert all(
        not p._post_accumulate_grad_hooks for p in built.model.parameters()
    )  # every run took its optimizer's hooks off


def test_an_offload_that_raises_lets_go_of_the_host_arena(gw):
    """An exception inside a candidate's offloaded micro-batch (a CUDA OOM, the candidate's own error): the
    strategy context still calls finish(), so the next offload claims the shared host arena."""
    offloading = candidates.Offloading(min_bytes=4096)
    mb = gw.windows[0][0]
    with pytest.raises(RuntimeError, match="out of memory"):
        with offloading(gw.model):
            gw.model(**mb, use_cache=False).loss.sum()
            raise RuntimeError("CUDA out of memory (raised here)")
    with offloading(gw.model):
        loss = gw.model(**mb, use_cache=False).loss
        loss.backward()
    gw.model.zero_grad(set_to_none=True)
    assert len(offloading.collect()) == 1  # only the run that finished is kept


def test_offloading_collects_the_passes_trained_with_tagged_by_attempt_not_the_teachers(gw, reference):
    """A teacher whose weights at attempt 1 differ from the candidate's: run_trace runs a second, undone pass
    per micro-batch there. collect() leaves those out (counted in undone_passes) and tags each pass it returns
    with its attempt, so Task5's per-pass lists hold one entry per micro-batch the candidate trained with."""
    teacher = copy.copy(reference.trace)
    teacher.weights = [dict(w) for w in reference.trace.weights]
    name = next(iter(teacher.weights[1]))
    teacher.weights[1][name] = teacher.weights[1][name] + 1e-3  # off the candidate's own weights at attempt 1
    offloading = candidates.Offloading(min_bytes=4096)
    trace = tracing.run_trace(
        candidates.candidate("offload", "TRAIN-OFFLOAD", offloading), gw, teacher=teacher
    )
    assert trace.error is None
    passes = offloading.collect()
    per_window = [len(w) for w in gw.windows]
    assert offloading.undone_passes == per_window[1]  # attempt 1's teacher passes only
    assert [s.attempt for s in passes] == [a for a, n in enumerate(per_window) for _ in range(n)]


def test_window_transfers_counts_what_one_window_moves_and_leaves_no_gradients(gw):
    """One stat per micro-batch; under checkpointing the offload sees only the layers' inputs (less, but some);
    with every layer inside the prefetch window nothing is fetched on demand; a probe leaves no gradients behind."""
    alone = candidates.window_transfers(gw, candidates.Offloading(min_bytes=4096, prefetch_groups=2))
    inside = candidates.window_transfers(
        gw, candidates.Offloading(min_bytes=4096), candidates.activation_checkpointing
    )
    assert len(alone) == len(gw.windows[0]) == len(inside)
    assert 0 < sum(s.d2h_bytes for s in inside) < sum(s.d2h_bytes for s in alone)
    assert all(s.on_demand == 0 and s.prefetched == s.offloaded > 0 for s in alone)  # 2 layers, window 2
    assert all(p.grad is None for p in gw.model.parameters())


def test_the_loss_scale_calibration_starts_from_the_runs_seed(gw):
    """Its backwards draw the dropout masks: seeded first, the start scale and the run do not depend on what drew
    random numbers before."""
    near_edge = dataclasses.replace(gw, loss_scale_start=2.0**24)
    runs = []
    for before in (1, 2):
        torch.manual_seed(before)
        torch.rand(before)  # other cells drew random numbers
        runs.append(tracing.run_trace(FP16, near_edge, keep_grads=False))
    assert runs[0].loss_scale == runs[1].loss_scale and runs[0].scale_halvings > 0
    assert (
        str(runs[0].losses) == str(runs[1].losses) and runs[0].rng == runs[1].rng
    )  # NaN at the injected one


def test_gradients_gate_holds_every_decoder_layer_linear_to_the_claimed_dtype():
    """float32 only where gates.FLOAT32_LINEARS allows it (the head); every decoder-layer Linear runs the claim."""
    ref, tol = grads_trace({"a": [1.0]}), gates.Tolerances(2e-2, 1.0, "", "")
    layer, head = LINEARS

    def claim(linears):
        return gates.gradients_gate(ref, grads_trace({"a": [1.0]}, linears=linears), "float16", tol)

    assert claim({layer: ["float16"], head: ["float32"]}).passed  # the head kept in full precision
    assert claim({layer: ["float16"], head: ["float16", "float32"]}).passed
    head_alone = claim({layer: ["float32"], head: ["float16"]})  # autocast around the head alone
    assert not head_alone.passed and head_alone.evidence["dtype_mismatches"] == {layer: ["float32"]}
    assert not claim({layer: ["float16", "float32"], head: ["float16"]}).passed  # a layer partly float32
    assert not claim({layer: ["bfloat16"], head: ["float16"]}).passed
    assert not claim({}).passed  # nothing ran
    assert gates.FLOAT32_LINEARS == ("lm_head",)


def test_run_trace_without_gradients_keeps_inputs_and_updates(gw, reference):
    light = tracing.run_trace(reference.candidate, gw, keep_grads=False)
    assert light.grads == [] and light.stepped == reference.trace.stepped
    assert light.consumed == reference.trace.consumed and light.held_out_loss == reference.trace.held_out_loss


def test_the_correctness_gate_runs_gates_1_to_4_up_to_the_first_failure(gw, reference):
    trace = tracing.run_trace(FP32, gw, teacher=reference.trace)
    lrs = [gw.expected_lr(k) for k in range(len(trace.lrs))]
    tol = reference.tolerances("float32")
    verdicts = gates.correctness_gate(reference.trace, trace, "float32", tol, lrs)
    assert [v.name for v in verdicts] == list(gates.GATES[:4]) and all(v.passed for v in verdicts)
    short = gates.correctness_gate(reference.trace, trace, "float16", tol, lrs)
    assert [v.name for v in short] == ["inputs", "gradients"] and not short[-1].passed


def test_splitting_or_reordering_a_window_keeps_the_inputs_digest(tiny_profile_model):
    built = tiny_profile_model(seed=0)
    plain = candidates.gate_workload(
        built.model, rows=4, seq=32, micro_batches=2, attempts=3, inject_at=(), lr=LR
    )  # no dropout
    ref = tracing.run_trace(candidates.Candidate("ref", "X"), plain)

    def four_micro_batches(state, window):
        rows = [
            {k: v[i : i + 1] for k, v in mb.items()} for mb in window for i in range(mb["input_ids"].shape[0])
        ]
        return candidates.window_backward(state, candidates.MicroBatches(rows))

    def reversed_rows(state, window):
        return candidates.window_backward(
            state, candidates.MicroBatches([{k: v.flip(0) for k, v in mb.items()} for mb in window])
        )

    for backward in (four_micro_batches, reversed_rows):
        trace = tracing.run_trace(
            candidates.Candidate("regrouped", "TRAIN-GRADIENT-ACCUMULATION", backward=backward), plain
        )
        assert gates.inputs_gate(ref, trace).passed
        assert gates.gradients_gate(ref, trace).passed  # the window's token count keeps it exact


def test_sequence_digests_cut_packed_rows_at_their_position_restarts():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 0, 0, 0], [8, 9, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    packed = tracing.sequence_digests(ids[:1], mask[:1], torch.tensor([[0, 1, 2, 0, 1, 2]]))
    assert sorted(packed) == sorted(tracing.sequence_digests(ids[1:], mask[1:]))
    assert tracing.sequence_digests(ids[:1], mask[:1]) != packed  # one unpacked row is another sequence


def test_a_candidate_that_draws_random_numbers_changes_the_rng_evidence(gw, reference):
    def noisy(state, window):
        torch.rand(1)  # consumes the generator: the next window starts from another state
        return candidates.window_backward(state, window)

    verdict = gates.inputs_gate(
        reference.trace, tracing.run_trace(candidates.Candidate("rng", "X", backward=noisy), gw)
    )
    assert not verdict.passed and "RNG" in verdict.message


def test_planted_record_fields_say_which_gate_fired(gw, reference):
    buggy, gate, fixed = PLANTED["faster-skips-work"]
    fields = gate_report.planted_record_fields(
        reference,
        {
            "faster": (
                gate,
                gate_report.judge(buggy, gw, reference),
                gate_report.judge(fixed, gw, reference, measure=False),
            )
        },
        "next",
    )
    assert (
        fields["metrics"]["fired_gate"] == {"faster": "inputs"}
        and fields["metrics"]["all_caught_as_expected"]
    )
    assert fields["correctness"]["effective_updates"] == ATTEMPTS - len(INJECT_AT)


# ----------------------------------------------------------------------------- gates on hand-made traces


LINEARS = ("model.layers.0.mlp.up_proj", "lm_head")


def grads_trace(
    values: dict[str, list[float]], dtypes=("float32",), windows=1, linears=None
) -> tracing.Trace:
    """A hand-made trace; `dtypes` ran in every Linear of LINEARS, unless `linears` says per module."""
    grads = {n: torch.tensor(v, dtype=torch.float32) for n, v in values.items()}
    linears = linears or dict.fromkeys(LINEARS, list(dtypes))
    return tracing.Trace(
        "t",
        losses=[1.0] * windows,
        grads=[grads] * windows,
        dtypes=sorted({d for ran in linears.values() for d in ran}),
        linear_dtypes=[linears] * windows,
    )


def test_gradients_gate_at_its_tolerance():
    ref = grads_trace({"a": [1.0, -2.0], "b": [0.5, 0.25]})
    rtol = gates.GRAD_RTOL["float16"]
    at = grads_trace({"a": [1.0, -2.0 + 2.0 * rtol], "b": [0.5, 0.25]}, ["float16"])  # error = rtol x scale 2
    over = grads_trace({"a": [1.0, -2.0 + 2.0 * rtol * 1.01], "b": [0.5, 0.25]}, ["float16"])
    tol = gates.Tolerances(rtol, 1.0, "float16 rounding", "x")
    assert gates.gradients_gate(ref, at, "float16", tol).passed
    verdict = gates.gradients_gate(ref, over, "float16", tol)
    assert not verdict.passed and "worst a" in verdict.message and verdict.evidence["first_bad_window"] == 0


def test_gradients_gate_compares_every_window_but_the_non_finite_ones():
    good = {"a": torch.tensor([1.0, 2.0])}
    ref = tracing.Trace(
        "r",
        losses=[1.0, 1.0, 1.0],
        grads=[good, {"a": torch.tensor([float("nan"), 0.0])}, good],
        linear_dtypes=[{"lm_head": ["float32"]}] * 3,
    )
    late = tracing.Trace(
        "c",
        losses=[1.0, 1.0, 1.0],
        grads=[good, {"a": torch.tensor([9.0, 9.0])}, {"a": torch.tensor([1.0, 2.5])}],
        linear_dtypes=[{"lm_head": ["float32"]}] * 3,
    )
    tol = gates.Tolerances(1e-4, 1.0, "float32 rounding", "x")
    verdict = gates.gradients_gate(ref, late, "float32", tol)
    assert gates.compared_windows(ref, late) == [0, 2]  # the injected window is no evidence
    assert (
        not verdict.passed
        and verdict.message.startswith("attempt 2:")
        and verdict.evidence["window_worst"][0] == 0
    )


def test_gradients_gate_uses_the_floor_for_a_vanishing_gradient():
    ref = grads_trace({"big": [1.0], "tiny": [1e-9]})
    noisy = grads_trace(
        {"big": [1.0], "tiny": [5e-9]}
    )  # 4x off its own scale, but far below 1e-3 of the largest
    assert gates.gradient_errors(ref.grads[0], noisy.grads[0])["tiny"] == pytest.approx(
        4e-9 / gates.GRAD_FLOOR, rel=1e-3
    )
    assert gates.gradients_gate(ref, noisy, "float32", gates.Tolerances(1e-4, 1.0, "", "")).passed


def test_gradients_gate_refuses_another_dtype_and_non_finite_gradients():
    ref = grads_trace({"a": [1.0]})
    tol = gates.Tolerances(1e-4, 1.0, "", "")
    assert "ran other dtypes" in gates.gradients_gate(ref, grads_trace({"a": [1.0]}), "float16", tol).message
    head = replace(
        grads_trace({"a": [1.0]}),
        linear_dtypes=[{"model.layers.0.mlp.up_proj": ["float32"], "lm_head": ["float16"]}],
    )
    said = gates.gradients_gate(
        ref, head, "float16", tol
    )  # the claimed dtype in the head alone: named at the end
    assert said.message.endswith("; float16 ran in lm_head") and said.evidence["claimed_ran_in"] == [
        "lm_head"
    ]
    none = replace(head, linear_dtypes=[{"model.layers.0.mlp.up_proj": ["float32"], "lm_head": ["float32"]}])
    assert gates.gradients_gate(ref, none, "float16", tol).message.endswith("; float16 ran in none of them")
    assert not gates.gradients_gate(ref, grads_trace({"a": [float("nan")]}), "float32", tol).passed
    stopped = replace(grads_trace({"a": [1.0]}), grads=[], error="attempt 0, backward: X")
    assert not gates.gradients_gate(ref, stopped, "float32", tol).passed


def test_quality_gate_at_its_bound():
    ref = tracing.Trace("r", held_out_before=6.0, held_out_loss=5.0)  # training moved it by 1 nat
    bound = gates.QUALITY_FRACTION["float32"]
    assert gates.quality_gate(ref, tracing.Trace("c", held_out_loss=5.0 + bound / 2)).passed
    assert not gates.quality_gate(ref, tracing.Trace("c", held_out_loss=5.0 + 2 * bound)).passed
    assert gates.quality_gate(
        ref, tracing.Trace("c", held_out_loss=5.0 + 2 * bound), "float16"
    ).passed  # wider for 16 bits


def test_quality_gate_prints_a_verdict_and_the_delta_only_when_it_fails():
    """A noise-level |Δ| moves between numeric paths, digits and power of ten alike: within the bound only the
    verdict is printed; over it, the number (a failing gate needs it)."""
    ref = tracing.Trace("r", held_out_before=6.0, held_out_loss=5.0)
    bound = gates.QUALITY_FRACTION["float32"]
    for delta in (bound / 3, bound / 3000):  # two powers of ten, one line
        message = gates.quality_gate(ref, tracing.Trace("c", held_out_loss=5.0 + delta)).message
        assert "|Δ| within the bound 0.0050 nats" in message and "e-" not in message
    assert "|Δ| = 0, within" in gates.quality_gate(ref, tracing.Trace("c", held_out_loss=5.0)).message
    over = gates.quality_gate(ref, tracing.Trace("c", held_out_loss=5.02)).message
    assert "|Δ| = 0.020, over the bound" in over
    assert gates.against_bound(float("nan"), 1.0) == "= nan, over"


def updates_trace(**kw) -> tracing.Trace:
    base = dict(
        stepped=[True, False, True],
        finite=[True, True, True],
        lrs=[1.0, 2.0],
        optimizer_steps=2,
        scheduler_steps=2,
    )
    return tracing.Trace("u", **{**base, **kw})


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({}, None),
        ({"scheduler_steps": 3}, "scheduler moved 3 times"),
        ({"optimizer_steps": 3}, "optimizer counted 3 steps"),
        ({"lrs": [1.0, 2.5]}, "effective update 1 ran at lr"),
        ({"finite": [True, False, False]}, "non-finite value"),
        (
            {
                "stepped": [True, True, True],
                "lrs": [1.0, 2.0, 2.0],
                "optimizer_steps": 3,
                "scheduler_steps": 3,
            },
            "3 effective updates",
        ),
    ],
)
def test_updates_gate_checks_every_clock(change, fragment):
    verdict = gates.updates_gate(updates_trace(), updates_trace(**change), expected_lrs=[1.0, 2.0, 3.0])
    assert verdict.passed is (fragment is None)
    if fragment:
        assert fragment in verdict.message


# ----------------------------------------------------------------------------- the decision rules


@pytest.mark.parametrize(
    "update_drop, capacity, ratio, outcome",
    [
        (0.10, 0.0, 1.30, "accept"),  # both limits met exactly
        (0.0999, 0.0, 1.30, "no-gain"),  # the peak falls a little less than required, the step no faster
        (0.10, 0.0, 1.3001, "tune"),  # the step takes a little more than allowed
        (
            0.0,
            0.81,
            1.19,
            "accept",
        ),  # the optimizer step peaks as high, yet a sequence costs far less: capacity
        (0.0, 0.81, 1.5, "tune"),
        (0.0, 0.0, 0.90, "accept"),  # faster by exactly min_speedup at the same peak
        (0.0, 0.0, 0.9001, "no-gain"),
        (-0.0101, 0.0, 0.80, "tune"),  # faster, but a higher peak
        (-0.05, 0.81, 1.0, "tune"),  # less per sequence, but the whole update peaks higher
        (0.0, 0.0, 1.0, "no-gain"),  # correct, neither smaller nor faster: not worth it, not wrong
        (0.0, 0.0, 1.5, "no-gain"),  # slower, no larger: still not worth it
        (-0.2, 0.0, 1.5, "costs-memory"),  # correct, nothing gained, and the whole update peaks higher
        (-0.0101, 0.05, 1.0, "costs-memory"),  # just past the slack, a capacity change below min_peak_drop
        (-0.0099, 0.0, 1.0, "no-gain"),  # within the slack: no higher
    ],
)
def test_decide_measured_at_its_boundaries(update_drop, capacity, ratio, outcome):
    assert gates.decide_measured(update_drop, capacity, ratio) == outcome


def test_a_speedup_counts_only_past_the_references_own_timing_spread():
    """min_speedup is the floor; where the reference's P95 lies further above its median, a speedup must clear
    that spread too, or the reference against itself would show it."""
    assert gates.decide_measured(0.0, 0.0, 0.85) == "accept"
    assert gates.decide_measured(0.0, 0.0, 0.85, time_noise=0.2) == "no-gain"
    assert gates.decide_measured(0.0, 0.0, 0.79, time_noise=0.2) == "accept"
    assert gates.decide_measured(0.0, 0.0, 0.85, time_noise=0.05) == "accept"  # a spread below the floor
    assert gates.decide_measured(-0.2, 0.0, 0.85, time_noise=0.2) == "costs-memory"


@pytest.mark.parametrize(
    "update_drop, capacity, ratio, outcome",
    [
        (-0.01, 0.0, 0.80, "accept"),  # faster; the allocated peak 1 % higher is within no_higher_slack
        (-0.005, 0.6, 1.1, "accept"),
        (-0.02, 0.6, 1.1, "tune"),  # beyond the slack: higher
    ],
)
def test_decide_measured_counts_a_rise_within_the_slack_as_no_higher_peak(
    update_drop, capacity, ratio, outcome
):
    assert gates.RULE.no_higher_slack == 0.01
    assert gates.decide_measured(update_drop, capacity, ratio) == outcome


def test_decide_keeps_wrong_and_not_worth_it_apart_and_decides_nothing_from_cpu_numbers(gpu_performance):
    perf = gpu_performance  # conftest's factory: a GPU run's Performance, 7 timed rounds unless given
    passed = [gates.Verdict(g, True, {}, "") for g in gates.GATES[:4]] + [
        gates.Verdict("performance", None, {}, "")
    ]
    cpu = perf(device_type="cpu", allocated=None)  # a CPU run: no allocator peaks
    failed = passed[:1] + [gates.Verdict("gradients", False, {}, "off")]
    assert gates.decide(failed, None, None)[0] == "reject"
    assert gates.decide(failed, perf(), perf())[0] == "reject"  # a faster wrong candidate stays rejected
    assert gates.decide(passed, cpu, cpu)[0] is None
    assert gates.decide(passed, perf(), cpu)[0] is None
    assert gates.decide(passed, perf(median=1.1, allocated=850), perf())[0] == "accept"
    # capacity: the whole update's peak as high, bytes per sequence lower
    assert gates.decide(passed, perf(median=1.1, allocated=1000, per_row=20), perf())[0] == "accept"
    assert gates.decide(passed, perf(median=3.0, allocated=650), perf())[0] == "tune"
    assert gates.decide(passed, perf(median=1.0, allocated=1000), perf())[0] == "no-gain"
    assert gates.decide(passed, perf(median=0.8, allocated=1005), perf())[0] == "accept"  # within the slack
    assert gates.decide(passed, perf(median=0.8, allocated=1020), perf())[0] == "tune"
    assert gates.decide(passed, perf(median=1.0, allocated=1200), perf())[0] == "costs-memory"
    assert gates.RECORD_DECISION["no-gain"] == gates.RECORD_DECISION["costs-memory"] == "reject"
    ref = perf()  # the candidate's rounds: 0.8 of the reference's, or scattered around it
    steady, noisy = (
        perf(median=0.8),
        perf(median=0.8, step_times_s=(0.8, 0.5, 1.1, 0.8, 1.1, 0.5, 0.8)),
    )
    span = gates.timing_interval(steady, ref)
    assert (span.low, span.median, span.high) == pytest.approx((0.8, 0.8, 0.8))
    assert gates.decide(passed, steady, ref)[0] == "accept"
    span = gates.timing_interval(noisy, ref)
    assert span.low < span.median < span.high and span.median == pytest.approx(0.8)
    assert gates.timing_spread(noisy, ref) == pytest.approx((span.high - span.low) / 2)

    outcome, reason = gates.decide(passed, noisy, ref)
    assert gates.timing_spread(noisy, ref) > 0.2 and outcome == "no-gain" and "98.4% interval" in reason
    with pytest.raises(ValueError, match="step times of the same rounds"):
        gates.timing_interval(perf(rounds=2), ref)


@pytest.mark.parametrize("n, k", [(5, 1), (7, 1), (10, 2), (21, 7)])
def test_the_timing_interval_is_the_exact_order_statistic_interval_with_its_real_coverage(
    n, k, gpu_performance
):
    """[x(k), x(n-k+1)] of n sorted per-round ratios holds the true median with probability
    1 - 2·P(Bin(n, 1/2) ≤ k-1), distribution-free: k is the largest whose coverage reaches TIMING_INTERVAL, and
    that coverage is what is reported (checked against the binomial sum and by simulation)."""
    import math
    import random

    perf = gpu_performance  # conftest's factory: a GPU run's Performance, 7 timed rounds unless given

    coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
    nxt = 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    assert coverage >= gates.TIMING_INTERVAL > nxt
    assert gates.order_statistic_rank(n) == (k, pytest.approx(coverage))
    draw = random.Random(1)
    trials, held = 4000, 0
    for _ in range(trials):  # ratios from a skewed distribution whose median is 1: exp(N(0, 1)) ** 3
        times = tuple(math.exp(3 * draw.gauss(0, 1)) for _ in range(n))
        span = gates.timing_interval(perf(step_times_s=times), perf(rounds=n))
        held += span.low <= 1 <= span.high
    assert span.coverage == pytest.approx(coverage) and span.rounds == n
    assert abs(held / trials - coverage) < 4 * math.sqrt(coverage * (1 - coverage) / trials)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_too_few_timed_rounds_give_no_interval_and_no_speedup_counts(n, gpu_performance):
    """Below MIN_TIMING_ROUNDS even [min, max] holds the median with less than 90 % (n = 2: 50 %, 3: 75 %, 4:
    87.5 %): timing_interval refuses in one sentence, the spread is infinite, and decide counts no speedup (a
    memory gain still counts)."""
    perf = gpu_performance  # conftest's factory: a GPU run's Performance, 7 timed rounds unless given
    assert gates.order_statistic_rank(n) is None and n < gates.MIN_TIMING_ROUNDS
    ref, fast = perf(rounds=n), perf(median=0.5, rounds=n)
    with pytest.raises(ValueError, match=f"{n} timed rounds give no interval .* at least 5 rounds"):
        gates.timing_interval(fast, ref)
    passed = [gates.Verdict("gradients", True, {}, "")]
    assert gates.timing_spread(fast, ref) == float("inf")
    outcome, reason = gates.decide(passed, fast, ref)
    assert outcome == "no-gain" and f"{n} rounds, fewer than 5: no 90% interval, no speedup counts" in reason
    assert gates.decide(passed, perf(median=0.5, allocated=850, rounds=n), ref)[0] == "accept"
    assert gates.order_statistic_rank(5) == (1, pytest.approx(1 - 2 / 32))


def test_decide_judges_the_allocated_peak_and_reports_the_reserved_one_beside_it(gpu_performance):
    """A peak is higher where either the allocated or the reserved one rose (an OOM is a failed reservation):
    checkpointing's allocated bytes a little lower than the reference's while, from an emptied cache, it reserves
    more, is a gain that costs memory (tune), not an accept; within the slack the reserved rise is no rise. A rise
    of the allocated peak itself past the slack tunes it too."""
    perf = gpu_performance  # conftest's factory: a GPU run's Performance, 7 timed rounds unless given
    passed = [gates.Verdict(g, True, {}, "") for g in gates.GATES[:4]]
    ref = perf(allocated=10_000, reserved=10_400)
    # reserved +5.8 %, allocated -5 %
    fragmented = perf(median=1.2, allocated=9_500, reserved=11_000, per_row=40)
    outcome, reason = gates.decide(passed, fragmented, ref)
    assert outcome == "tune" and "reserved +5.8%" in reason and "neither peak higher" in reason
    assert "allocated peak -5.0%" in reason
    less_reserved = perf(median=1.2, allocated=9_500, reserved=10_500, per_row=40)
    assert gates.decide(passed, less_reserved, ref)[0] == "accept"
    assert gates.decide_measured(0.0, 0.0, 1.0, reserved_change=0.0101) == "costs-memory"
    assert gates.decide_measured(0.0, 0.0, 1.0, reserved_change=0.01) == "no-gain"
    more_allocated = perf(median=1.2, allocated=10_300, reserved=10_400, per_row=40)
    assert gates.decide(passed, more_allocated, ref)[0] == "tune"


def test_rule_inputs_are_what_decide_judges_and_the_ledger_predicts_them_for_the_gpu_shape(gpu_performance):
    perf = gpu_performance  # conftest's factory: a GPU run's Performance, 7 timed rounds unless given
    measured = gates.rule_inputs(
        perf(median=1.2, allocated=9_500, reserved=11_000, per_row=40),
        perf(allocated=10_000, reserved=10_400),
    )
    assert measured.update_drop == pytest.approx(0.05) and measured.capacity_gain == pytest.approx(0.6)
    assert measured.time_ratio == pytest.approx(1.2) and measured.reserved_change == pytest.approx(
        11_000 / 10_400 - 1
    )
    spec = profiles.for_mode("TRAIN-CUDA-MECHANISM").workload("b4s256_gates")
    predicted = gates.ledger_inputs(
        spec, "checkpoint"
    )  # the whole update peaks in the optimizer step: d small, c large
    assert (
        predicted.phase == "optimizer"
        and predicted.update_drop < gates.RULE.min_peak_drop <= predicted.capacity_gain
    )
    assert predicted.time_ratio is None and spec.model in predicted.shape
    assert (
        gates.ledger_inputs(spec, "baseline").update_drop
        == 0
        == gates.ledger_inputs(spec, "baseline").capacity_gain
    )


def test_the_planted_bugs_are_numbered_once_across_the_page_and_its_table():
    """Task6 names each planted bug "埋入错误 N" in the order the page plants it, and its summary table numbers its
    rows the same way: as many rows as headings, numbered from 1 in order."""
    twin = (REPO_ROOT / "notebooks" / "text" / "Task6_gates_evidence.md").read_text(encoding="utf-8")
    numbers = [int(n) for n in re.findall(r"\*\*埋入错误 (\d+)：", twin)]
    table = twin[twin.index("PLANTED = {") : twin.index("\n}\n", twin.index("PLANTED = {"))]
    rows = re.findall(r'^    "[^"\n]+": \("(?:inputs|gradients|updates|quality)"', table, flags=re.M)
    assert numbers == list(range(1, len(rows) + 1)) and len(rows) > 0


def test_the_gradient_error_figure_names_the_floor_of_its_scale():
    from trainmech import plots

    fig = plots.grad_errors(
        ["a", "b"],
        {"x": [1e-6, 1e-5]},
        {"x": 1e-4},
        against="the reference run",
        floor=gates.GRAD_FLOOR,
        symbol="g_ref",
        where="attempt 0",
    )
    assert f"{gates.GRAD_FLOOR:g} x the largest |g_ref|" in fig.axes[0].get_xlabel()
    assert fig.axes[0].get_title().endswith("attempt 0")
    assert "max(" not in plots.grad_errors(["a"], {"x": [1e-6]}, {"x": 1e-4}).axes[0].get_xlabel()


def test_timing_counts_default_by_device_and_keep_what_is_given():
    assert tracing.timing_counts(True) == tracing.TIMING_DEFAULTS["cuda"] == (3, tracing.MIN_TIMED_FOR_P95)
    assert tracing.timing_counts(False) == tracing.TIMING_DEFAULTS["cpu"]
    assert tracing.timing_counts(True, 0, 5) == (0, 5)


def test_a_candidate_refuses_an_unknown_dtype():
    with pytest.raises(TrainmechError, match="candidate x: unknown dtype 'float8'; valid: "):
        candidates.Candidate("x", "X", "float8")


def test_the_profiles_carry_the_gate_workload_in_both_modes():
    for profile_id in ("TRAIN-CPU", "TRAIN-CUDA-MECHANISM"):
        p = profiles.load(profile_id)
        wid = next(w for w, spec in p.workloads.items() if "TRAIN-CORRECTNESS-GATE" in spec.experiments)
        spec = p.workloads[wid]
        assert spec.micro_batches == [2] and spec.batch % 2 == 0 and spec.updates > max(INJECT_AT) + 1
        assert spec.experiments == ["TRAIN-CORRECTNESS-GATE", "TRAIN-MEMORY-STRATEGY"]


def test_the_smoke_gates_shape_is_one_where_the_ledger_predicts_a_checkpoint_gain():
    """gpu-check's Task6 pass and check_gates claim that checkpointing lowers the forward + backward peak and the
    bytes per sequence: the ledger must predict both on that shape. At 64 tokens on the tied 2-layer Qwen2.5 the
    tied embedding's gradient sets the peak, the baseline slope is 0 and ledger_inputs refuses it."""
    spec = profiles.for_mode("TRAIN-CUDA-MECHANISM").workload("smoke-gates")
    predicted = gates.ledger_inputs(
        spec, "checkpoint", padded=True, residual_dropout=True
    )  # as the gates run it
    assert predicted.update_drop > 0 and predicted.capacity_gain >= gates.RULE.min_peak_drop
    with pytest.raises(ValueError, match="does not grow with the rows"):
        gates.ledger_inputs(spec.model_copy(update={"seq": 64}), "checkpoint")


def test_worst_of_is_nan_when_any_value_is_nan_wherever_it_sits():
    """Python's max keeps a NaN only when it comes first: a NaN gradient error in a later parameter would vanish."""
    nan = float("nan")
    errors = gates.gradient_errors(
        {"a": torch.ones(3), "b": torch.ones(3)}, {"a": torch.ones(3), "b": torch.tensor([1.0, nan, 1.0])}
    )
    assert (
        errors["a"] == 0.0 and math.isnan(errors["b"]) and max(errors.values()) == 0.0
    )  # what max alone does
    assert math.isnan(gates.worst_of(errors.values())) and math.isnan(gates.worst_of([0.0, 1.0, nan]))
    assert gates.worst_of([0.5, 2.0]) == 2.0 and gates.worst_of([]) == float("inf")


def test_a_candidate_that_edits_its_windows_in_place_fails_its_own_inputs_gate_and_spares_the_next(
    gw, reference
):
    def mask_a_label(state, window):  # in place, on the windows it was handed
        for mb in window:
            labels = mb["labels"]
            at = (labels != workload.IGNORE_INDEX).nonzero()[:1]
            labels[at[:, 0], at[:, 1]] = workload.IGNORE_INDEX
        return candidates.window_backward(state, window)

    bad = gate_report.judge(
        candidates.Candidate("mutates-labels", "TRAIN-CHECKPOINT", backward=mask_a_label),
        gw,
        reference,
        measure=False,
    )
    assert bad.failed_gate == "inputs" and "handed out differ" in bad.verdict("inputs").message
    after = gate_report.judge(
        candidates.candidate("checkpoint", "TRAIN-CHECKPOINT", candidates.activation_checkpointing),
        gw,
        reference,
        measure=False,
    )
    assert after.failed_gate is None


def test_gradients_gate_holds_the_claimed_dtype_in_every_attempt_not_the_first_alone():
    """A candidate that runs FP16 in the first window and FP32 after it: its later gradients sit well inside the FP16
    tolerance, so only the dtype of every attempt (own and teacher-forced passes alike) stops it, where it changes."""
    layer, head = LINEARS
    fp16 = {layer: ["float16"], head: ["float32"]}
    ref, tol = grads_trace({"a": [1.0]}, windows=3), gates.Tolerances(2e-2, 1.0, "", "")
    late = replace(
        grads_trace({"a": [1.0]}, windows=3),
        linear_dtypes=[fp16, {layer: ["float32"], head: ["float32"]}, fp16],
    )
    said = gates.gradients_gate(ref, late, "float16", tol)
    assert not said.passed and said.message.startswith("attempt 1: claims float16")
    assert said.evidence["dtype_attempt"] == 1 and said.evidence["dtype_mismatches"] == {layer: ["float32"]}
    assert gates.gradients_gate(ref, replace(late, linear_dtypes=[fp16] * 3), "float16", tol).passed


def test_a_run_records_the_linear_dtypes_of_every_attempt_and_gate_2_stops_fp16_in_the_first_window_only(
    gw, reference
):
    buggy, _, _ = PLANTED["fp16-in-the-first-window-only"]
    trace = tracing.run_trace(buggy, gw, teacher=reference.trace)
    layer = "model.layers.0.mlp.up_proj"
    assert len(trace.linear_dtypes) == len(trace.grads) == ATTEMPTS
    assert [ran[layer] for ran in trace.linear_dtypes] == [["float16"]] + [["float32"]] * (ATTEMPTS - 1)
    fp16 = gate_report.judge(FP16, gw, reference, measure=False).trace
    assert (
        all(ran[layer] == ["float16"] for ran in fp16.linear_dtypes) and len(fp16.linear_dtypes) == ATTEMPTS
    )
    verdict = gates.gradients_gate(reference.trace, trace, "float16", reference.tolerances("float16"))
    assert not verdict.passed and verdict.evidence["dtype_attempt"] == 1
    first_only = replace(trace, linear_dtypes=trace.linear_dtypes[:1])  # what a check of window 0 alone saw
    assert gates.gradients_gate(
        reference.trace, first_only, "float16", reference.tolerances("float16")
    ).passed


def test_the_in_place_clamp_is_stopped_by_autograds_version_check_in_the_first_backward(gw, reference):
    """Gate 2 says "no gradients" for any exception in the backward: what stopped this one must be the version
    counter's error, in attempt 0's backward; the out-of-place clamp gives the reference's bits on a CPU."""
    buggy, _, fixed = PLANTED["checkpoint-in-place"]
    raised = tracing.run_trace(buggy, gw, teacher=reference.trace)
    assert gates.stopped_at(raised) == (0, "backward") and "modified by an inplace operation" in raised.error
    assert gates.stopped_at(reference.trace) is None
    assert gates.stopped_at(replace(raised, error="attempt 3, update: RuntimeError: x")) == (3, "update")
    assert gates.bitwise_equal(reference.trace, tracing.run_trace(fixed, gw, teacher=reference.trace))


def test_bitwise_equal_holds_through_the_injected_windows_nan_and_sees_one_bit():
    nan = float("nan")
    ref = tracing.Trace("r", losses=[1.0, nan], grads=[{"a": torch.ones(2)}, {"a": torch.tensor([nan, 1.0])}])
    same = replace(ref, losses=list(ref.losses), grads=[{"a": g["a"].clone()} for g in ref.grads])
    assert gates.bitwise_equal(ref, same)
    one_ulp_up = torch.nextafter(torch.ones(2), torch.full((2,), 2.0))
    assert not gates.bitwise_equal(ref, replace(same, grads=[{"a": one_ulp_up}, same.grads[1]]))
    assert not gates.bitwise_equal(ref, replace(same, losses=[1.0, 0.0]))


def test_the_fixed_fp16_twin_steps_at_the_references_learning_rates_and_the_scheduler_bug_does_not(
    gw, reference
):
    """What Task6's scheduler cell claims of the twin, beyond its updates verdict: the same learning rate at each
    effective update as the reference, no GradScaler skip of an update the reference made; the bug departs."""
    fixed = gate_report.judge(FP16, gw, reference, measure=False).trace
    assert fixed.lrs == reference.trace.lrs and gates.scaler_skips(reference.trace, fixed) == []
    buggy, _, _ = PLANTED["scheduler-on-skips"]
    moved = tracing.run_trace(buggy, gw, keep_grads=False)
    assert moved.lrs != reference.trace.lrs[: len(moved.lrs)] and len(moved.lrs) == len(reference.trace.lrs)


def test_the_calibrated_loss_scale_is_the_largest_that_fits_and_a_power_of_two_below_the_start(gw):
    """From 2**40 the calibration halves to the largest scale at which every clean window's gradients are finite: it
    is 2**(40 - halvings), and from twice it at least one clean window overflows again (the same seed each time)."""
    hot = dataclasses.replace(gw, loss_scale_start=2.0**40)
    torch.manual_seed(gw.seed)
    scale, halvings = candidates.calibrated_scale(FP16, hot)
    assert halvings > 0 and scale == 2.0 ** (40 - halvings)
    torch.manual_seed(gw.seed)
    again, more = candidates.calibrated_scale(FP16, dataclasses.replace(gw, loss_scale_start=2 * scale))
    assert more >= 1 and again == scale
    torch.manual_seed(gw.seed)
    assert candidates.calibrated_scale(FP16, dataclasses.replace(gw, loss_scale_start=scale)) == (scale, 0)


def test_a_random_draw_in_the_last_attempt_alone_changes_the_rng_state_after_it(gw, reference):
    """Digests at each attempt's start never see the last attempt's own draws: the one after it does."""
    updates = []

    def draws_in_the_last_update(state):
        updates.append(1)
        if len(updates) == ATTEMPTS:
            torch.rand(1)  # the bug: one extra draw, after every digest taken at an attempt's start
        candidates.effective_update(state)

    late = tracing.run_trace(
        candidates.Candidate("draws-last", "TRAIN-AMP-BACKWARD", update=draws_in_the_last_update),
        gw,
        keep_grads=False,
    )
    assert late.rng == reference.trace.rng and late.rng_after != reference.trace.rng_after
    verdict = gates.inputs_gate(reference.trace, late)
    assert not verdict.passed and verdict.message == (
        f"the RNG state after the last attempt ({ATTEMPTS - 1}) differs from the reference's"
    )
    assert reference.trace.rng_after is not None and len(reference.trace.rng) == ATTEMPTS
    assert gates.inputs_gate(reference.trace, replace(late, rng_after=reference.trace.rng_after)).passed
    stopped = replace(late, rng_after=None, error="attempt 7, update: RuntimeError: x")
    assert gates.inputs_gate(reference.trace, stopped).passed  # a run that stopped has no state after its end


def test_each_layer_keeps_the_layer_pre_hooks_outside_and_only_it_puts_an_instance_forward_inside(
    gw, reference
):
    """Planted bugs 5 and 6 use the page's own each_layer (checkpoint_layers): the layer's forward pre-hooks stay
    outside the checkpoint (once per layer, the MLP's twice), as under transformers' checkpointing; the in-place
    clamp, an instance forward, is inside each_layer's checkpoint and outside transformers' (it fires only there)."""
    n = gw.model.config.num_hidden_layers
    for contexts in ((each_layer,), (candidates.activation_checkpointing,)):
        layers, mlps = candidates.hook_calls(gw, *contexts)
        assert layers == dict.fromkeys(range(n), 1) and mlps == dict.fromkeys(range(n), 2)
    with checkpointing.count_calls(gw.model.model.layers) as plain:  # no checkpoint: the MLP once
        candidates.hook_calls(gw)
    assert plain == dict.fromkeys(range(n), 1)
    in_place = partial(clamp_layer_inputs, in_place=True)
    ours = gate_report.judge(
        candidates.candidate("clamp-each-layer", "TRAIN-CHECKPOINT", in_place, each_layer),
        gw,
        reference,
        measure=False,
    )
    theirs = gate_report.judge(
        candidates.candidate("clamp-hf", "TRAIN-CHECKPOINT", in_place, candidates.activation_checkpointing),
        gw,
        reference,
        measure=False,
    )
    assert ours.failed_gate == "gradients" and theirs.passed


def test_the_ledger_keeps_one_residual_dropout_mask_per_layer_and_a_padded_batch_changes_the_prediction(
    tiny_profile_model,
):
    """The gate workload's MLP-output dropout keeps one mask of the MLP output's dtype per layer (measured: the
    saved storages of the tiny model with and without `candidates.residual_dropout`); the right-padded gate batch
    moves fp32 SDPA off the math kernel, so the prediction the GPU run is held to must say padded=True."""
    from trainmech import ledger

    base = ledger.training_state_lifecycle("qwen2.5-0.5b", 2, 256, device="cuda", padded=True)
    dropped = ledger.training_state_lifecycle(
        "qwen2.5-0.5b", 2, 256, device="cuda", padded=True, residual_dropout=True
    )
    extra = sum(t.nbytes for t in dropped.layer_saved()) - sum(t.nbytes for t in base.layer_saved())
    assert extra == 2 * 256 * 896 * 4 and dropped.options()["residual_dropout"]
    fp16 = ledger.training_state_lifecycle(
        "qwen2.5-0.5b", 2, 256, dtype="autocast-fp16", device="cuda", residual_dropout=True
    )
    assert {t.name: t.nbytes for t in fp16.layer_saved()}["mlp.residual_dropout_mask"] == 2 * 256 * 896 * 2
    model = tiny_profile_model(seed=0).model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))

    def saved_bytes(context) -> int:
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with context, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(storages.values())

    from contextlib import nullcontext

    measured = saved_bytes(candidates.residual_dropout(model, 0.1)) - saved_bytes(nullcontext())
    assert measured == model.config.num_hidden_layers * 2 * 8 * model.config.hidden_size * 4
    spec = profiles.for_mode("TRAIN-CUDA-MECHANISM").workload("b4s256_gates")
    plain, as_run = (
        gates.ledger_inputs(spec, "checkpoint"),
        gates.ledger_inputs(spec, "checkpoint", padded=True, residual_dropout=True),
    )
    assert as_run.capacity_gain < plain.capacity_gain and "right-padded" in as_run.shape


def _as_measured(gpu_performance, saved, per_row_saved, gap, ref_peak=10**10, ref_per_row=10**9):
    """(candidate, reference) Performances as a GPU run would fill them: the candidate's whole-update peak `saved`
    bytes below the reference's, its bytes per sequence `per_row_saved` below, and `gap` bytes above its own
    forward + backward peak."""
    ref = gpu_performance(allocated=ref_peak, per_row=ref_per_row, forward_backward_allocated_bytes=ref_peak)
    peak = round(ref_peak - saved)
    cand = gpu_performance(
        allocated=peak,
        per_row=round(ref_per_row - per_row_saved),
        forward_backward_allocated_bytes=peak - round(gap),
    )
    return cand, ref


@pytest.mark.parametrize("workload", ["smoke-gates", "b4s256_gates"])
def test_a_gpu_measurement_is_held_to_the_ledgers_bytes_and_a_checkpoint_that_saves_too_little_fails(
    workload, gpu_performance
):
    """against_ledger holds the bytes a checkpoint saves (whole-update peak, bytes per sequence) to the ledger's,
    within Task4's CUDA byte slack plus the allocator's block rounding (never below the ledger by more than the
    slack and the other side's rounding). A measurement at the ledger's bytes holds; a checkpoint that saves
    nothing, or a quarter of the predicted bytes per sequence, fails. On both GPU workloads."""
    from trainmech import ledger

    spec = profiles.for_mode("TRAIN-CUDA-MECHANISM").workload(workload)
    predicted = gates.ledger_inputs(spec, "checkpoint", padded=True, residual_dropout=True)
    slack = ledger.device_terms("cuda").step_slack_bytes(24 if workload == "b4s256_gates" else 2)
    saved, per_row, gap = predicted.saved, predicted.saved_per_row, predicted.update_over_backward
    assert min(saved.below, saved.above) >= 2 * slack  # the slack is inside every band
    failed = lambda *m: {  # noqa: E731
        k
        for k, (ok, _) in gates.against_ledger(*_as_measured(gpu_performance, *m), predicted).items()
        if ok is False
    }
    assert failed(saved.bytes, per_row.bytes, gap.bytes) == set()
    assert (
        failed(saved.bytes + saved.above, per_row.bytes - per_row.below, gap.bytes) == set()
    )  # at the edges
    assert failed(0, 0, gap.bytes) == {"update", "capacity"}  # saves nothing
    assert failed(saved.bytes, per_row.bytes / 4, gap.bytes) == {"capacity"}  # a quarter per sequence
    assert failed(saved.bytes - saved.below - 1, per_row.bytes, gap.bytes) == {"update"}
    words = gates.against_ledger(*_as_measured(gpu_performance, 0, 0, gap.bytes), predicted)["capacity"][1]
    assert "bytes per sequence saved: measured 0 B" in words and "outside" in words


def test_the_peak_phase_is_decided_only_where_the_ledgers_gap_clears_its_tolerance(gpu_performance):
    """The whole update's peak above the forward + backward's, in bytes. b4s256_gates: the ledger puts it a
    foreach temporary above the backward's, beyond the band, so the phase is claimed and an update that adds
    nothing above the backward (gap 0, or a gap an eighth of the ledger's) fails. smoke-gates: both peaks at the
    same tick (gap 0), so the phase is undecided (None, printed) whatever the measurement."""
    mech = profiles.for_mode("TRAIN-CUDA-MECHANISM")
    full, smoke = (
        gates.ledger_inputs(mech.workload(w), "checkpoint", padded=True, residual_dropout=True)
        for w in ("b4s256_gates", "smoke-gates")
    )
    gap = full.update_over_backward
    assert full.phase == "optimizer" and gap.bytes - gap.below > 0
    phase = lambda pred, g: gates.against_ledger(  # noqa: E731
        *_as_measured(gpu_performance, pred.saved.bytes, pred.saved_per_row.bytes, g), pred
    )["phase"]
    assert (
        phase(full, gap.bytes)[0] is True
        and phase(full, 0)[0] is False
        and phase(full, gap.bytes / 8)[0] is False
    )
    assert "the ledger: in the optimizer" in phase(full, gap.bytes)[1]
    band = smoke.update_over_backward
    assert band.bytes == 0 and band.below > 0
    for g in (0, band.above, 10**9):
        holds, words = phase(smoke, g)
        assert holds is None and "undecided" in words
    assert gates.measured_phase(_as_measured(gpu_performance, 0, 0, 1)[0]) == "optimizer"
    assert gates.measured_phase(_as_measured(gpu_performance, 0, 0, 0)[0]) == "backward"


@pytest.mark.parametrize("seq", [8, 64])
def test_recompute_ratio_is_the_flop_count_of_a_replayed_layer_attention_included(tiny_profile_model, seq):
    """recompute_ratio against torch's FLOP counter on the tiny model's forward (eager attention, so the counter
    sees Q·Kᵀ and the weights times V as matmuls): 1 + the decoder layers' forward FLOPs / 3 x the model's (the
    backward twice the forward). It holds at both lengths; without attention's s-dependent term it would be off
    at 64 tokens. Qwen2.5-0.5B at the GPU gate workload's 256 tokens: x1.24."""
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_profile_model(seed=0, attn_implementation="eager").model
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.zeros(2, seq, dtype=torch.long))
    counts = counter.get_flop_counts()
    total = sum(counts["Global"].values())
    layers = sum(
        sum(by_op.values())
        for name, by_op in counts.items()
        if re.fullmatch(r"Qwen2ForCausalLM\.model\.layers\.\d+", name)
    )
    counted = 1 + layers / (3 * total)
    assert gates.recompute_ratio(model, seq) == pytest.approx(counted, rel=1e-3)
    n = sum(p.numel() for p in model.parameters())
    seq_free = 1 + 2 * sum(p.numel() for p in model.model.layers.parameters()) / (6 * n)
    assert (abs(seq_free - counted) > 1e-3 * counted) == (seq == 64)
    assert round(gates.recompute_ratio("qwen2.5-0.5b", 256), 2) == 1.24
    # the measured floor on a GPU: a checkpoint that replays nothing (time ratio 1) falls below it
    floor = gates.recompute_floor(model, seq)
    assert 1 < floor < gates.recompute_ratio(model, seq)
    assert floor == pytest.approx(1 + gates.RECOMPUTE_FLOOR * (gates.recompute_ratio(model, seq) - 1))
    with pytest.raises(ValueError, match="seq must be a positive number of tokens a sequence, got 0"):
        gates.recompute_ratio(model, 0)


def test_checkpointing_kept_on_switches_transformers_checkpointing_once_outside_the_micro_batches(gw):
    """remeasure times a checkpoint candidate with the switch already on (checkpointing_kept_on), so turning it on
    and off around each micro-batch is not in the timed update: inside, the candidate's micro-batches leave it on
    and still replay each layer (its MLP twice); the gradients are bitwise those of the per-micro-batch switch."""
    from contextlib import nullcontext

    model, n = gw.model, gw.model.config.num_hidden_layers
    probe = candidates.candidate("probe", "TRAIN-CHECKPOINT", candidates.activation_checkpointing)
    switched = []

    def grads(kept: bool):
        with gw.running(), checkpointing.count_calls([layer.mlp for layer in model.model.layers]) as mlps:
            state = gw.fresh_state(probe)
            try:
                context = candidates.checkpointing_kept_on(probe, model) if kept else nullcontext()
                with context:
                    torch.manual_seed(0)  # the same dropout masks in both runs
                    probe.backward(state, gw.windows[0])
                    switched.append(model.model.layers[0].gradient_checkpointing)
                return {k: p.grad.clone() for k, p in model.named_parameters()}, dict(mlps)
            finally:
                state.close()
                model.zero_grad(set_to_none=True)

    (plain, plain_calls), (kept, kept_calls) = grads(False), grads(True)
    assert switched == [False, True] and not model.model.layers[0].gradient_checkpointing
    assert plain_calls == kept_calls == dict.fromkeys(range(n), 2 * 2)  # two micro-batches, each replayed
    assert all(torch.equal(plain[k], kept[k]) for k in plain)
    fp32 = candidates.candidate("fp32", "TRAIN-AMP-BACKWARD")
    with candidates.checkpointing_kept_on(fp32, model):
        assert not model.model.layers[0].gradient_checkpointing


# The decision rule as a table, written from DecisionRule's and decide_measured's docstrings, not from their code:
# (a peak higher than the slack allows, a memory gain, within the time budget, faster) -> outcome. "faster" lies
# within the time budget, so the four rows with faster and not within it cannot occur.
RULE_TABLE = {
    # higher  gain   in time faster
    (False, True, True, False): "accept",  # smaller at an affordable cost
    (False, True, True, True): "accept",
    (False, False, True, True): "accept",  # faster, no higher
    (False, True, False, False): "tune",  # smaller, but too slow
    (False, False, True, False): "no-gain",
    (False, False, False, False): "no-gain",
    (True, True, True, False): "tune",  # a gain, but the whole update peaks higher
    (True, True, True, True): "tune",
    (True, False, True, True): "tune",
    (True, True, False, False): "tune",
    (True, False, True, False): "costs-memory",
    (True, False, False, False): "costs-memory",
}


def test_the_performance_stage_reports_the_time_ratio_the_rule_judges(gpu_performance):
    """Rounds where the ratio of the two medians (x2) is not the median of the paired per-round ratios (x1): the
    stage's message says the latter with its order-statistic interval and that interval's real coverage, as decide
    does; with fewer rounds than an interval needs, it says so instead of printing one."""
    ref = gpu_performance(1.0, step_times_s=(1.0, 1.0, 1.0, 2.0, 2.0))
    ours = gpu_performance(2.0, step_times_s=(2.0, 2.0, 1.0, 2.0, 2.0))
    span = gates.timing_interval(ours, ref)
    assert span.median == 1.0 and ours.step_time_median_s / ref.step_time_median_s == 2.0
    message = gate_report.performance_verdict(ours, ref).message
    assert message.startswith(
        f"time x1.00 (median of the rounds' ratios; {span.coverage:.1%} interval x{span.low:.2f} to x{span.high:.2f})"
    )
    assert "time x1.00 (median of the rounds' ratios" in gates.decide([], ours, ref)[1]
    few = gate_report.performance_verdict(
        gpu_performance(2.0, step_times_s=(2.0, 1.0, 2.0)), gpu_performance(1.0, step_times_s=(1.0, 1.0, 2.0))
    ).message
    assert f"3 rounds, fewer than {gates.MIN_TIMING_ROUNDS}" in few and "interval x" not in few


def test_the_rule_table_by_hand_agrees_with_decide_on_performance_records_at_every_row(gpu_performance):
    """Performance records reaching every row of RULE_TABLE, each condition read off the raw numbers by hand (peaks
    scaled, not ratios; the time from the rounds, its noise from a candidate whose rounds scatter): decide agrees
    on every one. This ran on a GPU only inside gpu-check (C8); the rule needs no GPU to be checked."""
    import itertools
    import statistics

    rule, passed = gates.RULE, [gates.Verdict("gradients", True, {}, "")]
    ref = gpu_performance(1.0, allocated=1000, per_row=100)
    scatter = (1.0, 0.6, 1.4, 1.0, 1.4, 0.6, 1.0)  # the candidate's rounds spread around its median
    rows = set()
    for allocated, reserved, per_row, median, spread in itertools.product(
        (1000, 1005, 850, 1030), (None, 1030), (100, 85), (1.0, 0.8, 1.2, 1.5), (False, True)
    ):
        times = tuple(median * s for s in scatter) if spread else (median,) * 7
        p = gpu_performance(
            median,
            allocated=allocated,
            per_row=per_row,
            peak_reserved_bytes=allocated if reserved is None else reserved,
            step_times_s=times,
        )
        ratios = [a / b for a, b in zip(times, ref.step_times_s, strict=True)]
        noise = gates.timing_spread(p, ref)
        assert (noise > rule.min_speedup) == spread
        case = (
            max(p.peak_allocated_bytes, p.peak_reserved_bytes) > 1000 * (1 + rule.no_higher_slack),
            p.peak_allocated_bytes <= 1000 * (1 - rule.min_peak_drop)
            or p.bytes_per_row <= 100 * (1 - rule.min_peak_drop),
            statistics.median(ratios) <= rule.max_time_ratio,
            statistics.median(ratios) <= 1 - max(rule.min_speedup, noise),
        )
        assert RULE_TABLE.get(case) == gates.decide(passed, p, ref)[0], case
        rows.add(case)
    assert rows == set(RULE_TABLE)  # every row reached, and no case without one


def test_the_fp16_range_check_passes_the_cpu_model_and_names_bfloat16_where_a_linear_overflows(gw):
    """fp16_range watches every nn.Linear under float16 autocast (CPU autocast runs float16 too). The tiny
    random-init model stays far inside 65504; the same windows with one projection's weights scaled up overflow it,
    and the message names the projection and the remedy. The pretrained Qwen2.5 weights are not here (offline):
    the GPU run prints the same check before its gates."""
    from trainmech import fp16_range

    found = fp16_range.fp16_range(gw, weights="random-init seed=0")
    linears = sum(isinstance(m, torch.nn.Linear) for m in gw.model.modules())
    assert found.fits and found.linears == linears and 0 < found.largest < fp16_range.FP16_MAX
    assert f"every one of {linears} nn.Linear outputs stays finite" in found.message()
    # what it can show, said where it runs: on a random init nothing about the pretrained weights
    assert not found.pretrained and "no evidence about the pretrained Qwen2.5 weights" in found.message()
    loaded = dataclasses.replace(found, weights="pretrained /weights/qwen2.5-0.5b")
    assert loaded.pretrained and "no evidence" not in loaded.message() and "later windows" in loaded.message()
    rng = torch.get_rng_state()
    name = "model.layers.0.mlp.down_proj"
    hot = dataclasses.replace(
        gw, initial={**gw.initial, f"{name}.weight": gw.initial[f"{name}.weight"] * 1e6}
    )
    try:
        blown = fp16_range.fp16_range(hot)
    finally:
        gw.model.load_state_dict(gw.initial)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG left as it was
    assert (
        not blown.fits and blown.module == name and "bfloat16" in blown.message() and name in blown.message()
    )


def test_the_capped_run_says_who_runs_out_first_and_says_nothing_where_the_reference_runs_out_too():
    """performance.capped_updates (gpu-check, CUDA) caps the reserved bytes at the reference's reserved peak plus
    the slack: the candidate runs out first only where it raised and the reference under the same cap did not. The
    cap's fraction of the device, and a cap off the device refused in one sentence."""
    from trainmech import performance

    run = lambda ref, cand: performance.CappedRun(1010, 1000, ref, cand)  # noqa: E731
    assert run(True, False).runs_out_first is True and run(True, True).runs_out_first is False
    assert run(False, False).runs_out_first is None and run(False, True).runs_out_first is None
    assert "the reference ran, the candidate ran out of memory" in run(True, False).words()
    assert "a cap of 1,010 B reserved (the reference's reserved peak 1,000 B" in run(True, True).words()
    assert performance.memory_cap_fraction(1 << 30, 4 << 30) == 0.25
    for cap in (0, (4 << 30) + 1):
        with pytest.raises(
            ValueError, match="a memory cap must lie between 1 B and the device's 4,294,967,296 B"
        ):
            performance.memory_cap_fraction(cap, 4 << 30)
