"""Task3 · amp: the dtypes autocast really uses, the scaler's skip and growth, accelerate on CPU."""

from __future__ import annotations

import pytest
import torch

from trainmech import amp, update
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.task3

CPU = torch.device("cpu")


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))


def scaled_attempt(model, opt, scaler, factor=1.0):
    opt.zero_grad(set_to_none=True)
    with amp.autocast(CPU, "fp16"):
        loss = model(torch.ones(4, 8)).float().pow(2).mean() * factor
    scaler.scale(loss).backward()
    return amp.scaled_step(scaler, opt)


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    "precision, expected", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")]
)
def test_activation_dtypes_sees_what_ran(precision, expected):
    model = small_model()
    with amp.activation_dtypes(model, ("Linear",)) as seen, amp.autocast(CPU, precision):
        out = model(torch.ones(2, 8))
    assert seen == {"Linear": {expected}}
    assert str(out.dtype) == f"torch.{expected}"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast casts copies, not weights
    assert all(not m._forward_hooks for m in model.modules())  # the hooks are gone after the block


def test_autocast_refuses_an_unknown_precision():
    with pytest.raises(TrainmechError, match="unknown precision"):
        amp.autocast(CPU, "fp8")


def test_grad_scaler_is_enabled_for_fp16_only():
    assert amp.grad_scaler(CPU, "fp16").is_enabled()
    assert not amp.grad_scaler(CPU, "bf16").is_enabled()
    assert not amp.grad_scaler(CPU, "fp32").is_enabled()


# ---------------------------------------------------------------- skip and growth


def test_overflow_skips_halves_the_scale_and_leaves_state_bitwise_unchanged():
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    assert scaled_attempt(model, opt, scaler)  # one clean update: the optimizer has state now
    theta = update.snapshot(model)
    state = {(i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    assert not scaled_attempt(model, opt, scaler, factor=1e6)  # overflows inside the FP16 backward
    assert scaler.get_scale() == 2.0**7
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), theta))
    assert all(
        torch.equal(opt.state[p][k], state[(i, k)])
        for i, p in enumerate(model.parameters())
        for k in opt.state[p]
    )


def test_scale_grows_after_growth_interval_clean_updates():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    scales = []
    for _ in range(7):
        assert scaled_attempt(model, opt, scaler)
        scales.append(scaler.get_scale())
    assert scales == [2.0**10] * 2 + [2.0**11] * 3 + [2.0**12] * 2


def test_a_skip_resets_the_growth_count():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    outcomes = [scaled_attempt(model, opt, scaler, f) for f in (1.0, float("nan"), 1.0, 1.0)]
    assert outcomes == [True, False, True, True]
    assert scaler.get_scale() == 2.0**10  # 2^10 → (skip) 2^9 → two clean updates → 2^10


def test_disabled_scaler_always_reports_a_step():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = amp.grad_scaler(CPU, "bf16")
    model(torch.ones(2, 8)).sum().backward()
    assert amp.scaled_step(scaler, opt)


def test_underflow_without_scaling():
    """A gradient below FP16's smallest subnormal becomes 0; scaled by 2^16 it survives."""
    x = torch.full((4, 8), 1e-4)
    for scale, survives in ((1.0, False), (2.0**16, True)):
        layer = torch.nn.Linear(8, 8, bias=False)
        with amp.autocast(CPU, "fp16"):
            y = layer(x)  # float16
        (y.float().sum() * 1e-8 * scale).backward()  # dL/dy = 1e-8 · scale, stored in float16
        assert bool((layer.weight.grad != 0).any()) is survives


# ---------------------------------------------------------------- accelerate


def test_accelerate_fp16_on_cpu_silently_runs_fp32():
    acc = amp.fresh_accelerator(mixed_precision="fp16", cpu=True)
    model = acc.prepare(small_model())
    with amp.activation_dtypes(model) as seen:
        model(torch.ones(2, 8))
    assert acc.mixed_precision == "fp16" and not acc.native_amp and acc.scaler is None
    assert seen["Linear"] == {"float32"}
    acc = amp.fresh_accelerator(mixed_precision="bf16", cpu=True)  # a second precision in one process
    model = acc.prepare(small_model())
    with amp.activation_dtypes(model) as seen:
        model(torch.ones(2, 8))
    assert seen["Linear"] == {"bfloat16"}
