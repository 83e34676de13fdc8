"""Task3 · update: the update clock, the WSD schedule and its boundaries, clipping, displacement, resumable state."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmech import update
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.task3

SHAPES = st.sampled_from(update.SCHEDULE_SHAPES)
WSD_KEYS = ("warmup_steps", "stable_steps", "decay_steps", "min_lr_ratio", "warmup_type", "decay_type")


# ---------------------------------------------------------------- the update clock


@given(st.lists(st.booleans(), max_size=40))
def test_clock_advances_only_on_effective_updates(outcomes):
    clock = update.UpdateClock()
    for stepped in outcomes:
        before = clock.effective_updates
        assert clock.tick(stepped) is stepped
        assert clock.effective_updates == before + int(stepped)
    assert clock.effective_updates == sum(outcomes)
    assert clock.skipped_updates == len(outcomes) - sum(outcomes)
    assert clock.attempts == len(outcomes)
    again = update.UpdateClock()
    again.load_state_dict(clock.state_dict())
    assert again == clock


def test_step_if_finite_skips_a_nan_gradient_and_leaves_everything_unchanged():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.tensor([0.5, -0.5])
    assert update.step_if_finite(opt)
    theta, state = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
    w.grad = torch.tensor([float("nan"), 1.0])
    assert not update.step_if_finite(opt)
    assert torch.equal(w.detach(), theta)
    assert all(torch.equal(opt.state[w][k], v) for k, v in state.items())


# ---------------------------------------------------------------- the WSD schedule


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 6), st.integers(0, 6), st.integers(0, 6), st.sampled_from([0.0, 0.1, 0.25]), SHAPES, SHAPES
)
def test_wsd_equals_transformers_at_every_step(warmup, stable, decay, min_lr_ratio, warmup_type, decay_type):
    kw = dict(zip(WSD_KEYS, (warmup, stable, decay, min_lr_ratio, warmup_type, decay_type)))
    steps = warmup + stable + decay + 3
    assert [update.wsd_multiplier(step, **kw) for step in range(steps)] == update.transformers_wsd(
        steps, **kw
    )


@given(st.integers(1, 8), st.integers(1, 8), st.integers(2, 8), st.sampled_from([0.0, 0.1]), SHAPES, SHAPES)
def test_wsd_boundaries(warmup, stable, decay, floor, warmup_type, decay_type):
    kw = dict(zip(WSD_KEYS, (warmup, stable, decay, floor, warmup_type, decay_type)))

    def m(s):
        return update.wsd_multiplier(s, **kw)

    phases = dict(warmup_steps=warmup, stable_steps=stable, decay_steps=decay)
    assert m(0) == floor  # every warmup shape starts at the floor
    assert m(warmup - 1) < 1.0 or warmup == 1 and floor == 1.0
    assert m(warmup) == 1.0 and update.wsd_phase(warmup, **phases) == "stable"
    assert update.wsd_phase(warmup - 1, **phases) == "warmup"
    assert m(warmup + stable - 1) == 1.0 and m(warmup + stable) == 1.0  # decay starts from the top
    assert update.wsd_phase(warmup + stable, **phases) == "decay"
    assert floor < m(warmup + stable + decay - 1) < 1.0
    assert m(warmup + stable + decay) == floor == m(warmup + stable + decay + 10)
    assert update.wsd_phase(warmup + stable + decay, **phases) == "after"
    assert all(m(s) <= m(s + 1) for s in range(warmup))
    assert all(m(s) >= m(s + 1) for s in range(warmup + stable, warmup + stable + decay))


def test_wsd_refuses_bad_arguments():
    with pytest.raises(TrainmechError, match="≥ 0"):
        update.wsd_multiplier(-1, warmup_steps=1, stable_steps=1, decay_steps=1)
    with pytest.raises(TrainmechError, match="unknown schedule shape"):
        update.wsd_multiplier(5, warmup_steps=1, stable_steps=1, decay_steps=1, decay_type="exp")


def test_set_lr_writes_base_times_multiplier():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    update.set_lr(opt, [0.5], 0.25)
    assert opt.param_groups[0]["lr"] == 0.125


# ---------------------------------------------------------------- clipping and displacement


@given(st.floats(0.01, 100.0), st.floats(0.1, 10.0))
def test_clip_coefficient_is_what_clip_grad_norm_applies(scale, max_norm):
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = torch.tensor([3.0, 0.0, 4.0], dtype=torch.float64) * scale
    original = p.grad.clone()
    norm = float(torch.nn.utils.clip_grad_norm_([p], max_norm))
    coef = update.clip_coefficient(norm, max_norm)
    assert coef <= 1.0
    assert torch.allclose(p.grad, original * coef, rtol=1e-12)
    assert (coef < 1.0) == (norm > max_norm - 1e-6)


def test_displacement_is_the_l2_norm_of_the_change():
    model = torch.nn.Linear(2, 2)
    before = update.snapshot(model)
    with torch.no_grad():
        model.weight[0, 0] += 3.0
        model.bias[1] -= 4.0
    assert update.displacement(before, model) == pytest.approx(5.0, rel=1e-6)
    assert update.displacement(update.snapshot(model), model) == 0.0


# ---------------------------------------------------------------- resumable state


def toy_training(model, opt, scaler, clock, position, n):
    """n scaled updates whose data depend on torch's RNG (so the RNG state matters for a resume)."""
    for _ in range(n):
        x = torch.randn(4, 3)
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(x).pow(2).mean()).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        clock.tick(scaler.get_scale() >= before)
        position += 4
    return position


def fresh(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2), update.UpdateClock()


def run_with_checkpoint(folder, first, total):
    """`total` updates, a checkpoint written after `first`; returns (fields, what was saved, final parameters)."""
    model, opt, scaler, clock = fresh()
    torch.manual_seed(123)
    random.seed(7)
    np.random.seed(7)
    position = toy_training(model, opt, scaler, clock, 0, first)
    fields = update.save_training_state(
        folder, model=model, optimizer=opt, scaler=scaler, clock=clock, data_position=position
    )
    saved = {
        "clock": update.UpdateClock(**clock.state_dict()),
        "position": position,
        "scaler": scaler.state_dict(),
        "params": update.snapshot(model),
        "python": random.random(),
        "numpy": np.random.rand(),
    }
    toy_training(model, opt, scaler, clock, position, total - first)  # saving read the state only
    return fields, saved, update.snapshot(model)


def test_checkpoint_round_trip_and_bitwise_resume(tmp_path):
    fields, saved, uninterrupted = run_with_checkpoint(tmp_path, 3, 6)
    assert set(fields) == {"model", "optimizer", "scaler", "update_clock", "rng", "data_position"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [update.MODEL_FILE, update.STATE_FILE]

    model, opt, scaler, _ = fresh(seed=99)  # a different process: other weights, other RNG
    random.seed(0)
    clock, position = update.load_training_state(tmp_path, model=model, optimizer=opt, scaler=scaler)
    assert (clock, position) == (saved["clock"], saved["position"]) and position == 12
    assert scaler.state_dict() == saved["scaler"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved["params"]))
    assert random.random() == saved["python"] and np.random.rand() == saved["numpy"]
    toy_training(model, opt, scaler, clock, position, 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), uninterrupted))
    assert clock.attempts == 6


def test_resume_without_the_rng_state_diverges(tmp_path):
    _, saved, uninterrupted = run_with_checkpoint(tmp_path, 2, 4)
    model, opt, scaler, _ = fresh(seed=5)
    clock, position = update.load_training_state(
        tmp_path, model=model, optimizer=opt, scaler=scaler, restore_rng=False
    )
    toy_training(model, opt, scaler, clock, position, 2)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), uninterrupted))


def test_load_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    model, opt, scaler, _ = fresh()
    with pytest.raises(TrainmechError, match="not a training checkpoint"):
        update.load_training_state(tmp_path, model=model, optimizer=opt, scaler=scaler)


# ---------------------------------------------------------------- one host sync; Task3's runs


def test_all_finite_sees_inf_and_nan_anywhere_and_never_overflows_on_finite_values():
    ok = [torch.full((3,), 3e38), torch.ones(2, dtype=torch.float16) * 60000]  # huge but finite
    assert bool(update.all_finite(ok))
    for bad in (float("inf"), float("-inf"), float("nan")):
        assert not bool(update.all_finite([torch.ones(4), torch.tensor([1.0, bad])]))
    assert bool(update.all_finite([]))


def test_grads_finite_ignores_parameters_without_grad():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    a.grad = torch.ones(2)
    assert update.grads_finite([a, b])
    b.grad = torch.tensor([0.0, float("nan")])
    assert not update.grads_finite([a, b])


def test_flat_grads_counts_a_tied_weight_once():
    lin = torch.nn.Linear(3, 3, bias=False)
    model = torch.nn.ModuleDict({"a": lin, "b": lin})
    lin.weight.grad = torch.ones(3, 3)
    assert update.flat_grads(model).shape == (9,)


def test_replay_on_effective_updates_reads_the_clock():
    wsd = dict(warmup_steps=2, stable_steps=3, decay_steps=3, min_lr_ratio=0.1)
    stepped = [True, False, True, True, False, True, True, True, True]
    read_at = [0, 1, 1, 2, 3, 3, 4, 5, 6]  # by hand: the effective updates before each attempt
    expected = [1e-3 * update.wsd_multiplier(k, **wsd) for k in read_at]
    assert update.replay_schedule(stepped, int, 1e-3, **wsd) == expected
    assert update.logged_steps(stepped) == [1, 1, 2, 3, 3, 4, 5, 6, 7]  # … and after it


def _tiny_lm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7))


def test_run_attempts_skips_the_injected_attempt_and_reads_lr_from_the_clock():
    model = _tiny_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batches = [torch.arange(5) % 7 for _ in range(6)]
    wsd = dict(warmup_steps=1, stable_steps=2, decay_steps=2)

    def attempt(a, ids):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(ids[:-1]), ids[1:]) * (float("nan") if a == 2 else 1.0)
        loss.backward()
        return loss.detach(), update.step_if_finite(opt)

    log = update.run_attempts(
        attempt,
        batches,
        model=model,
        optimizer=opt,
        scaler=scaler,
        base_lr=1e-3,
        wsd=wsd,
        device=torch.device("cpu"),
    )
    assert log.stepped == [True, True, False, True, True, True] and log.loss[2] is None
    assert log.clock.state_dict() == {
        "effective_updates": 5,
        "skipped_updates": 1,
    } and log.optimizer_steps == {5}
    assert log.lr[3] == log.lr[2] == 1e-3 * update.wsd_multiplier(2, **wsd)
    assert log.finite_params and set(log.step_times(0)) == {"step_time_median_s", "step_time_p95_s"}


def test_dynamics_run_measures_the_clipped_norm_and_displacement():
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _tiny_lm()

        def forward(self, input_ids):
            logits = self.net(input_ids)
            from types import SimpleNamespace

            return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits[:-1], input_ids[1:]))

    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"input_ids": torch.arange(6) % 7}
    run = update.dynamics_run(
        model, opt, [batch] * 3, max_norm=0.01, eval_batch=batch, device=torch.device("cpu")
    )
    assert all(g > 0.01 for g in run.grad_norm) and max(run.clipped_norm) <= 0.01 * (1 + 1e-5)
    assert run.displacement[0] == pytest.approx(0.1 * run.clipped_norm[0], rel=1e-5)
    assert (
        all(run.finite)
        and model.training
        and set(run.series()) == {"loss", "grad_norm", "clip_coef", "displacement"}
    )
