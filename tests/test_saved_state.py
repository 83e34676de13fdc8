"""Task2's saved-state measurement (trainmech.saved_state) and its table.

Our `saved` for linear and softmax holds exactly the bytes autograd saves for F.linear /
torch.softmax (the same tensors); for RMSNorm and SwiGLU autograd keeps more, by exactly the tensors
our backward recomputes. The measurement itself leaves gradients unchanged, finds every saved
tensor's consumer node, and sees that a residual add saves nothing. (That autograd saves exactly our
`saved` through the gradcheck wrapper is in test_vjp_gradcheck.py.)
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmech import saved_state, vjp

pytestmark = pytest.mark.task2

FAST = settings(max_examples=40, deadline=None)


def randn(gen, *shape, scale=1.0, dtype=torch.float64):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    n_in=st.integers(1, 6),
    n_out=st.integers(1, 6),
    with_bias=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
)
def test_task2_linear_saves_what_autograd_saves(seed, lead, n_in, n_out, with_bias, dtype):
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, *lead, n_in, dtype=dtype), randn(gen, n_out, n_in, dtype=dtype)
    b = randn(gen, n_out, dtype=dtype) if with_bias else None
    y, saved = vjp.linear_forward(x, w, b)
    run = saved_state.autograd_vjp(F.linear, (x, w, b), torch.ones_like(y), references=(w,))
    assert saved_state.storage_bytes(saved, references=(w,)) == run.saved_bytes == x.nbytes
    assert saved_state.storage_bytes(saved) == vjp.saved_bytes(saved)  # both count each memory once
    assert [s.reference for s in run.saved].count(True) == 1  # the weight, saved by reference


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    data=st.data(),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
)
def test_task2_softmax_saves_what_autograd_saves(seed, shape, data, dtype):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = randn(torch.Generator().manual_seed(seed), *shape, dtype=dtype)
    y, saved = vjp.softmax_forward(x, dim=dim)
    run = saved_state.autograd_vjp(lambda t: torch.softmax(t, dim), (x,), torch.ones_like(y))
    assert saved_state.storage_bytes(saved) == run.saved_bytes == y.nbytes  # the output, on both sides
    assert [s.consumers for s in run.saved] == [("SoftmaxBackward0",)]


def test_task2_rms_norm_and_swiglu_autograd_keeps_what_we_recompute():
    """Where the two sides differ, they differ by exactly the tensors our backward rebuilds."""
    gen = torch.Generator().manual_seed(2)
    B, T, C, I = 2, 5, 8, 12
    x, w = randn(gen, B, T, C, dtype=torch.float32), 1 + randn(gen, C, scale=0.3, dtype=torch.float32)
    y, saved = vjp.rms_norm_forward(x, w)
    hf_formula = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # noqa: E731
    run = saved_state.autograd_vjp(hf_formula, (x, w), torch.ones_like(y), references=(w,))
    assert run.saved_bytes - saved_state.storage_bytes(saved, references=(w,)) == x.nbytes  # n = x * rstd

    wg, wu, wd = (randn(gen, *s, dtype=torch.float32) for s in ((I, C), (I, C), (C, I)))
    y, saved = vjp.swiglu_forward(x, wg, wu, wd)
    mlp = lambda x, a, b, c: F.linear(F.silu(F.linear(x, a)) * F.linear(x, b), c)  # noqa: E731
    run = saved_state.autograd_vjp(mlp, (x, wg, wu, wd), torch.ones_like(y), references=(wg, wu, wd))
    ours = saved_state.storage_bytes(saved, references=(wg, wu, wd))
    assert run.saved_bytes - ours == 2 * B * T * I * 4  # silu(gate) and silu(gate) * up, float32


def test_task2_measurement_leaves_gradients_unchanged_and_names_consumers():
    gen = torch.Generator().manual_seed(3)
    x, w = randn(gen, 4, 6), randn(gen, 6, 6)
    grads = []
    for measured in (False, True):
        leaf, weight = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with saved_state.record_forward(references=(weight,)) as m:
            out = torch.tanh(leaf @ weight.T) + leaf  # a residual add on top
        if measured:
            m.find_consumers(out)
        out.square().sum().backward()
        grads.append((leaf.grad, weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    consumers = {c for row in m.saved for c in row.consumers}
    assert "TanhBackward0" in consumers and not any("Add" in c for c in consumers)  # the add saves nothing
    assert m.saved_bytes == x.nbytes + x.nbytes  # x for the matmul, tanh's output; w by reference
    ops = [a.op for a in m.activations]
    assert ops == ["mm", "tanh", "add"] and [a.saved for a in m.activations] == [False, True, False]


def test_task2_measurement_names_modules_and_our_functions():
    lin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.SiLU())
    x = torch.randn(2, 3)
    with saved_state.record_forward(root=lin, references=lin.parameters()) as m:
        lin(x)
    assert [(a.where, a.op) for a in m.activations] == [("0", "addmm"), ("1", "silu")]
    with saved_state.record_forward() as m:
        _, saved = vjp.silu_forward(x)
    assert {a.where for a in m.activations} == {"silu_forward"}
    assert not any(a.saved for a in m.activations_saved_by(saved))  # silu keeps its input, made before
