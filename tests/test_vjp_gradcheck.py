"""Task2 guard: our VJP pairs as torch.autograd.Functions (gradcheck), in low precision, and the
saved-state measurement (trainmech.saved_state) that Task2's inventory rests on.

1. gradcheck. Every pair in trainmech.vjp, wrapped by ONE factory (`as_function`) into a
   torch.autograd.Function whose forward keeps `saved`'s tensors with ctx.save_for_backward and
   whose backward is our backward, passes torch.autograd.gradcheck in float64: our gradient
   equals the central finite difference of our own forward (gradcheck's default tolerances).

2. Low precision. For float32 and bfloat16 inputs (drawn in float64, then rounded), each op's
   output and input gradients stay close to the same op run in float64 on the same rounded
   values. Error = max|low - float64| / max|float64| per tensor (checks.rel_error). Tolerances,
   in units of the dtype's machine epsilon: float32 32 eps (3.8e-6), bfloat16 16 eps (0.125).
   Why: every output and gradient here goes through a handful of rounded elementwise steps and
   sums of at most a few dozen terms (bfloat16 attention and RMSNorm compute their softmax /
   normalisation in float32, as HF does), so the error stays within a few eps of the tensor's
   largest value; over ~1300 random draws per op the worst was 8.4 eps (float32, causal
   attention) and 7.1 eps (bfloat16, layer_norm). Shapes keep the problems well conditioned: at
   least 4 channels (with 3, layer_norm's centred and normalised row has one degree of freedom
   left and its gradient is a difference of nearly equal terms) and 3 positions (a causal row
   with one key has an exactly constant softmax); inputs feeding a softmax stay at scale <= 1.

3. Saved state. Through `as_function`, autograd saves exactly our `saved` tensors. The
   measurement itself (trainmech.saved_state) is tested in test_saved_state.py.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmech import saved_state, vjp
from trainmech.checks import rel_error

pytestmark = pytest.mark.task2

FAST = settings(max_examples=40, deadline=None)
RTOL = {
    torch.float32: 32 * torch.finfo(torch.float32).eps,
    torch.bfloat16: 16 * torch.finfo(torch.bfloat16).eps,
}


def as_function(op, **options):
    """Our `<op>_forward` / `<op>_backward` pair as a torch.autograd.Function's `apply`.

    forward: out, saved = <op>_forward(*inputs, **options); the tensors of `saved` go through
    ctx.save_for_backward, its plain options onto ctx. backward: <op>_backward(saved, grad_out),
    one gradient per input (None for integer inputs and constants), as autograd expects.
    """
    forward, backward = getattr(vjp, f"{op}_forward"), getattr(vjp, f"{op}_backward")

    def pair_forward(ctx, *inputs):
        out, saved = forward(*inputs, **options)
        ctx.names = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
        ctx.plain = {k: v for k, v in saved.items() if not isinstance(v, torch.Tensor)}
        ctx.save_for_backward(*(saved[k] for k in ctx.names))
        return out

    def pair_backward(ctx, grad_out):
        saved = dict(zip(ctx.names, ctx.saved_tensors), **ctx.plain)
        return backward(saved, grad_out)

    # a class named after the op, so that its graph node reads e.g. "linear_pairBackward"
    pair = type(
        f"{op}_pair",
        (torch.autograd.Function,),
        {"forward": staticmethod(pair_forward), "backward": staticmethod(pair_backward)},
    )
    return pair.apply


def randn(gen, *shape, scale=1.0, dtype=torch.float64):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def case_inputs(op, gen, B=2, T=3, C=4):
    """(options, inputs, constants) for one op: small float64 inputs; `constants` are the indices
    of float inputs that get no gradient (rope's cos / sin)."""
    r = lambda *shape, scale=1.0: randn(gen, *shape, scale=scale)  # noqa: E731
    if op == "linear":
        return {}, (r(B, T, C), r(C + 1, C), r(C + 1)), ()
    if op == "linear_nobias":
        return {}, (r(T, C), r(C + 1, C), None), ()
    if op == "embedding":
        return {}, (torch.randint(0, C, (B, T), generator=gen), r(C, 3)), ()
    if op in ("silu", "gelu", "gelu_tanh"):
        options = {"approximate": "tanh"} if op == "gelu_tanh" else {}
        return options, (r(B, T, C).clamp(-4, 4),), ()
    if op == "softmax":
        return {"dim": 1}, (r(B, T, C),), ()
    if op in ("cross_entropy", "cross_entropy_sum"):
        targets = torch.randint(0, C, (B * T,), generator=gen)
        targets[::3] = -100  # masked positions
        return {"reduction": "sum" if op.endswith("sum") else "mean"}, (r(B * T, C), targets), ()
    if op == "rms_norm":
        return {"eps": 1e-6}, (r(B, T, C), 1 + r(C, scale=0.3)), ()
    if op == "layer_norm":
        return {}, (r(B, T, C), 1 + r(C, scale=0.3), r(C)), ()
    if op == "rope":
        angles = r(T, 2 * C, scale=3.0)
        return {}, (r(B, 2, T, 2 * C), angles.cos(), angles.sin()), (1, 2)
    if op == "attention_gqa_causal":  # H = 2 * Hkv
        return {"causal": True}, (r(B, 4, T, C), r(B, 2, T, C), r(B, 2, T, C)), ()
    if op == "attention_mha":  # H = Hkv, non-causal, more keys than queries
        return {"causal": False}, (r(B, 2, T, C), r(B, 2, T + 2, C), r(B, 2, T + 2, C)), ()
    if op == "swiglu":
        return {}, (r(B, T, C), r(2 * C, C), r(2 * C, C), r(C, 2 * C)), ()
    raise KeyError(op)


OPS = [
    "linear",
    "linear_nobias",
    "embedding",
    "silu",
    "gelu",
    "gelu_tanh",
    "softmax",
    "cross_entropy",
    "cross_entropy_sum",
    "rms_norm",
    "layer_norm",
    "rope",
    "attention_gqa_causal",
    "attention_mha",
    "swiglu",
]


def pair_name(op):
    """The trainmech.vjp pair a case exercises ('attention_mha' -> 'attention')."""
    for name in ("linear", "gelu", "cross_entropy", "attention"):
        if op.startswith(name):
            return name
    return op


# ----------------------------------------------------------------------------------------------
# 1. gradcheck


@pytest.mark.parametrize("op", OPS)
def test_task2_gradcheck_of_each_pair_as_autograd_function(op):
    gen = torch.Generator().manual_seed(0)
    options, inputs, constants = case_inputs(op, gen)
    inputs = tuple(
        t.detach().requires_grad_(True)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and i not in constants
        else t
        for i, t in enumerate(inputs)
    )
    assert torch.autograd.gradcheck(as_function(pair_name(op), **options), inputs)


def test_task2_function_wrapper_matches_autograd_on_the_torch_op():
    """The wrapper is a drop-in: the same gradients as autograd through torch's own linear."""
    gen = torch.Generator().manual_seed(1)
    x, w, b = randn(gen, 2, 3, 4), randn(gen, 5, 4), randn(gen, 5)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    refs = [t.clone().requires_grad_(True) for t in (x, w, b)]
    as_function("linear")(*leaves).square().sum().backward()
    F.linear(*refs).square().sum().backward()
    for ours, ref in zip(leaves, refs):
        assert rel_error(ours.grad, ref.grad)[1] <= 1e-14


# ----------------------------------------------------------------------------------------------
# 2. low precision against float64


@FAST
@given(
    op=st.sampled_from(OPS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 3),
    T=st.integers(3, 6),
    C=st.integers(4, 8),
)
def test_task2_low_precision_is_close_to_float64(op, dtype, seed, B, T, C):
    gen = torch.Generator().manual_seed(seed)
    options, inputs, _ = case_inputs(op, gen, B, T, C)
    forward, backward = getattr(vjp, f"{pair_name(op)}_forward"), getattr(vjp, f"{pair_name(op)}_backward")
    low = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    exact = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in low]

    out, saved = forward(*low, **options)
    ref_out, ref_saved = forward(*exact, **options)
    grad_out = randn(gen, *ref_out.shape).to(dtype)  # the same rounded upstream gradient for both
    grads, ref_grads = backward(saved, grad_out), backward(ref_saved, grad_out.double())

    assert out.dtype == dtype
    tol = RTOL[dtype]
    assert rel_error(out, ref_out)[1] <= tol, f"{op}[{dtype}] output"
    for i, (g, ref) in enumerate(zip(grads, ref_grads)):
        assert (g is None) == (ref is None)
        if ref is not None:
            assert g.dtype == dtype, f"{op}[{dtype}] d{i} comes back as {g.dtype}"
            assert rel_error(g, ref)[1] <= tol, f"{op}[{dtype}] d{i}: {rel_error(g, ref)[1]:.1e} > {tol:.1e}"


# ----------------------------------------------------------------------------------------------
# 3. the saved-state measurement through our wrapper (the measurement itself: test_saved_state.py)


def test_task2_measurement_sees_what_our_function_wrapper_saves():
    """Through `as_function`, autograd saves exactly our `saved` tensors: x and the weight for linear."""
    gen = torch.Generator().manual_seed(4)
    x, w = randn(gen, 3, 4).requires_grad_(True), randn(gen, 5, 4).requires_grad_(True)
    with saved_state.record_forward(references=(w,)) as m:
        out = as_function("linear")(x, w, None)
    m.find_consumers(out)
    assert m.saved_bytes == x.nbytes and [r.reference for r in m.saved] == [False, True]
    assert all(r.consumers == ("linear_pairBackward",) for r in m.saved)
