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

3. Saved state. Our `saved` for linear and softmax holds exactly the bytes autograd saves for
   F.linear / torch.softmax (the same tensors); for RMSNorm and SwiGLU autograd keeps more, by
   exactly the tensors our backward recomputes. The measurement itself leaves gradients unchanged,
   finds every saved tensor's consumer node, and sees that a residual add saves nothing.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmech import saved_state, vjp
from trainmech.checks import rel_error

FAST = settings(max_examples=40, deadline=None)
RTOL = {torch.float32: 32 * torch.finfo(torch.float32).eps, torch.bfloat16: 16 * torch.finfo(torch.bfloat16).eps}


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
    pair = type(f"{op}_pair", (torch.autograd.Function,),
                {"forward": staticmethod(pair_forward), "backward": staticmethod(pair_backward)})
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


OPS = ["linear", "linear_nobias", "embedding", "silu", "gelu", "gelu_tanh", "softmax", "cross_entropy",
       "cross_entropy_sum", "rms_norm", "layer_norm", "rope", "attention_gqa_causal", "attention_mha", "swiglu"]


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
    inputs = tuple(t.detach().requires_grad_(True)
                   if isinstance(t, torch.Tensor) and t.is_floating_point() and i not in constants else t
                   for i, t in enumerate(inputs))
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
@given(op=st.sampled_from(OPS), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1),
       B=st.integers(1, 3), T=st.integers(3, 6), C=st.integers(4, 8))
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
# 3. the saved-state measurement


@FAST
@given(seed=st.integers(0, 2**31 - 1), lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
       n_in=st.integers(1, 6), n_out=st.integers(1, 6), with_bias=st.booleans(),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
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
@given(seed=st.integers(0, 2**31 - 1), shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data(),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
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


def test_task2_format_table_aligns_columns():
    text = saved_state.format_table(["op", "bytes"], [["linear", 8192], ["softmax", 128]])
    assert text.splitlines() == ["op       bytes", "-------  -----", "linear   8,192", "softmax    128"]
    assert math.isfinite(RTOL[torch.bfloat16])


def test_task2_measurement_sees_what_our_function_wrapper_saves():
    """Through `as_function`, autograd saves exactly our `saved` tensors: x and the weight for linear."""
    gen = torch.Generator().manual_seed(4)
    x, w = randn(gen, 3, 4).requires_grad_(True), randn(gen, 5, 4).requires_grad_(True)
    with saved_state.record_forward(references=(w,)) as m:
        out = as_function("linear")(x, w, None)
    m.find_consumers(out)
    assert m.saved_bytes == x.nbytes and [r.reference for r in m.saved] == [False, True]
    assert all(r.consumers == ("linear_pairBackward",) for r in m.saved)
