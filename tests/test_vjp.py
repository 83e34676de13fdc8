"""Task2 guard: every hand-written VJP in trainmech.vjp against torch.autograd, in float64.

Shapes and values are drawn by hypothesis (small shapes, a seed for the values, a value scale);
the reference gradient comes from autograd (trainmech.vjp_check.reference_vjp: the
`(out * grad_out).sum().backward()` trick).
Tolerance: relative error (max|ours - ref| / max|ref|) <= 1e-10 in float64.
"""

import ast
import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmech import vjp
from trainmech.checks import close
from trainmech.vjp_check import reference_vjp

pytestmark = pytest.mark.task2

RTOL = 1e-10
FAST = settings(max_examples=25, deadline=None)

seeds = st.integers(0, 2**31 - 1)
scales = st.sampled_from([1e-2, 1.0, 5.0])
small = st.integers(1, 5)
leads = st.lists(small, min_size=0, max_size=3)  # leading (batch-like) dimensions, 0 to 3 of them


def randn(gen, *shape, scale=1.0):
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def check(name, fn_ours, fn_ref, inputs, options, grad_out=None, gen=None, constants=()):
    """Run our forward/backward and autograd's, compare the output and every input gradient.

    `constants`: indices of float inputs the op treats as constants (rope's cos/sin): grad None.
    """
    out, saved = getattr(vjp, f"{fn_ours}_forward")(*inputs, **options)
    if grad_out is None:
        grad_out = randn(gen, *out.shape)
    grads = getattr(vjp, f"{fn_ours}_backward")(saved, grad_out)
    ref_out, ref_grads = reference_vjp(fn_ref, inputs, grad_out, constants=constants)
    assert isinstance(grads, tuple) and len(grads) == len(inputs)
    close(f"{name}.out", out, ref_out, rtol=RTOL)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        if r is None:
            assert g is None, f"{name}: input {i} has no gradient, expected None"
        else:
            close(f"{name}.d{i}", g, r, rtol=RTOL)
    return saved


def tensor_names(saved):
    return {k for k, v in saved.items() if isinstance(v, torch.Tensor)}


# ----------------------------------------------------------------------------------------------
# one test per op
#
# TAIL: activations get inputs clamped to [-4, 4]. Far in the negative tail GELU's 1 + erf / 1 + tanh
# cancels in torch's formula as in ours, so a tensor holding only such values has a ~1e-6 gradient
# known to ~1e-16 absolute: the relative error would measure the reference's rounding, not the VJP.


@FAST
@given(
    seed=seeds,
    lead=leads,
    n_in=small,
    n_out=small,
    with_bias=st.booleans(),
    scale=scales,
)
def test_task2_linear_matches_autograd(seed, lead, n_in, n_out, with_bias, scale):
    g = torch.Generator().manual_seed(seed)
    x, w = randn(g, *lead, n_in, scale=scale), randn(g, n_out, n_in)
    b = randn(g, n_out) if with_bias else None
    saved = check("linear", "linear", F.linear, (x, w, b), {}, gen=g)
    assert tensor_names(saved) == {"x", "weight"}


@FAST
@given(seed=seeds, V=st.integers(1, 6), C=small, ids_shape=st.lists(small, min_size=1, max_size=3))
def test_task2_embedding_matches_autograd_with_repeated_ids(seed, V, C, ids_shape):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, ids_shape, generator=g)  # few rows, many ids: repeats are the rule
    w = randn(g, V, C)
    saved = check("embedding", "embedding", F.embedding, (ids, w), {}, gen=g)
    assert tensor_names(saved) == {"ids"}


@FAST
@given(seed=seeds, shape=st.lists(small, min_size=1, max_size=3), scale=scales)
def test_task2_silu_matches_autograd(seed, shape, scale):
    g = torch.Generator().manual_seed(seed)
    x = randn(g, *shape, scale=scale).clamp(-4, 4)  # see TAIL
    saved = check("silu", "silu", F.silu, (x,), {}, gen=g)
    assert tensor_names(saved) == {"x"}


@FAST
@given(
    seed=seeds,
    shape=st.lists(small, min_size=1, max_size=3),
    scale=scales,
    approximate=st.sampled_from(["none", "tanh"]),
)
def test_task2_gelu_matches_autograd_none_and_tanh(seed, shape, scale, approximate):
    g = torch.Generator().manual_seed(seed)
    x = randn(g, *shape, scale=scale).clamp(-4, 4)  # see TAIL
    saved = check(
        f"gelu[{approximate}]",
        "gelu",
        lambda x: F.gelu(x, approximate=approximate),
        (x,),
        {"approximate": approximate},
        gen=g,
    )
    assert tensor_names(saved) == {"x"}


@FAST
@given(seed=seeds, shape=st.lists(small, min_size=1, max_size=3), scale=scales, data=st.data())
def test_task2_softmax_matches_autograd(seed, shape, scale, data):
    g = torch.Generator().manual_seed(seed)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    saved = check(
        "softmax",
        "softmax",
        lambda x: torch.softmax(x, dim),
        (randn(g, *shape, scale=scale),),
        {"dim": dim},
        gen=g,
    )
    assert tensor_names(saved) == {"y"}


@FAST
@given(
    seed=seeds,
    N=st.integers(1, 8),
    V=st.integers(2, 7),
    scale=scales,
    reduction=st.sampled_from(["mean", "sum"]),
    ignore_index=st.sampled_from([-100, -1, 0]),
    masked_fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
)
def test_task2_cross_entropy_matches_autograd_masked(
    seed, N, V, scale, reduction, ignore_index, masked_fraction
):
    g = torch.Generator().manual_seed(seed)
    logits = randn(g, N, V, scale=scale)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < masked_fraction] = ignore_index
    if reduction == "mean" and not (targets != ignore_index).any():
        targets[0] = (ignore_index + 1) % V  # the mean needs one valid target (the refusal is tested below)
    grad_out = randn(g)  # a scalar upstream gradient, not just 1
    saved = check(
        f"cross_entropy[{reduction}]",
        "cross_entropy",
        lambda z, t: F.cross_entropy(z, t, ignore_index=ignore_index, reduction=reduction),
        (logits, targets),
        {"ignore_index": ignore_index, "reduction": reduction},
        grad_out=grad_out,
    )
    assert tensor_names(saved) == {"probs", "targets"}


@FAST
# C >= 2: with one channel the normalised output is constant, its true gradient is 0 and only rounding noise is left
@given(seed=seeds, lead=leads, C=st.integers(2, 8), scale=scales, eps=st.sampled_from([1e-6, 1e-5, 0.1]))
def test_task2_rms_norm_matches_autograd(seed, lead, C, scale, eps):
    g = torch.Generator().manual_seed(seed)
    x, w = randn(g, *lead, C, scale=scale), 1 + randn(g, C, scale=0.5)
    saved = check(
        "rms_norm", "rms_norm", lambda x, w: F.rms_norm(x, (C,), w, eps), (x, w), {"eps": eps}, gen=g
    )
    assert tensor_names(saved) == {"x", "weight", "rstd"}


@FAST
# C >= 3: with C <= 2 the centred, normalised row is (nearly) constant, its true gradient is ~0 and only
# rounding noise is left to compare
@given(seed=seeds, lead=leads, C=st.integers(3, 8), scale=scales, with_bias=st.booleans())
def test_task2_layer_norm_matches_autograd(seed, lead, C, scale, with_bias):
    g = torch.Generator().manual_seed(seed)
    x, w = randn(g, *lead, C, scale=scale), 1 + randn(g, C, scale=0.5)
    b = randn(g, C) if with_bias else None
    saved = check(
        "layer_norm", "layer_norm", lambda x, w, b: F.layer_norm(x, (C,), w, b, 1e-5), (x, w, b), {}, gen=g
    )
    assert tensor_names(saved) == {"x", "weight", "mean", "rstd"}


def hf_style_rope(x, cos, sin):
    """The HF formula, written independently: x*cos + rotate_half(x)*sin, cos broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    c, s = (cos, sin) if cos.dim() == 2 else (cos.unsqueeze(1), sin.unsqueeze(1))
    return x * c + rotated * s


@FAST
@given(
    seed=seeds,
    B=small,
    H=small,
    T=small,
    half=st.integers(1, 4),
    cs_rank=st.sampled_from([2, 3]),
    cs_batch_one=st.booleans(),
)
def test_task2_rope_matches_autograd(seed, B, H, T, half, cs_rank, cs_batch_one):
    g = torch.Generator().manual_seed(seed)
    D = 2 * half
    x = randn(g, B, H, T, D)
    angles = randn(g, T, D, scale=3.0)
    cos, sin = angles.cos(), angles.sin()
    if cs_rank == 3:  # HF passes (B, T, D), usually with B = 1
        cos, sin = (cos[None], sin[None]) if cs_batch_one else (cos.expand(B, T, D), sin.expand(B, T, D))
    saved = check("rope", "rope", hf_style_rope, (x, cos, sin), {}, gen=g, constants=(1, 2))
    assert tensor_names(saved) == {"cos", "sin"}  # rope is linear in x: x itself is not needed


def sdpa_reference(q, k, v, causal, scale):
    """torch's own attention on kv heads repeated as HF repeat_kv does (head h reads kv h // G)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


@FAST
# T >= 2: with a single key softmax is constant, dq = dk = 0 exactly and a relative error is meaningless.
# q, k scale <= 1: a saturated softmax has gradients far below its inputs' rounding (cancellation), so
# "relative to the gradient's scale" would measure conditioning, not the formula.
@given(
    seed=seeds,
    B=st.integers(1, 3),
    heads=st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3), (3, 1), (1, 1)]),
    T=st.integers(2, 6),
    D=st.integers(1, 6),
    causal=st.booleans(),
    custom_scale=st.booleans(),
    extra_keys=st.integers(0, 3),
    scale=st.sampled_from([1e-2, 0.3, 1.0]),
)
def test_task2_attention_matches_autograd_grouped_query(
    seed, B, heads, T, D, causal, custom_scale, extra_keys, scale
):
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    S = T if causal else T + extra_keys  # non-causal may attend to a different number of keys
    q, k, v = randn(g, B, H, T, D, scale=scale), randn(g, B, Hkv, S, D, scale=scale), randn(g, B, Hkv, S, D)
    attn_scale = 0.37 if custom_scale else None
    saved = check(
        f"attention[H={H},Hkv={Hkv},causal={causal}]",
        "attention",
        lambda q, k, v: sdpa_reference(q, k, v, causal, attn_scale),
        (q, k, v),
        {"causal": causal, "scale": attn_scale},
        gen=g,
    )
    assert tensor_names(saved) == {"q", "k", "v", "probs"}
    assert saved["probs"].shape == (B, H, T, S)


@FAST
@given(
    seed=seeds,
    lead=st.lists(small, min_size=0, max_size=2),
    C=st.integers(1, 6),
    I=st.integers(1, 8),
    scale=scales,
)
def test_task2_swiglu_matches_autograd(seed, lead, C, I, scale):
    g = torch.Generator().manual_seed(seed)
    x = randn(g, *lead, C, scale=scale)
    wg, wu, wd = randn(g, I, C), randn(g, I, C), randn(g, C, I)
    saved = check(
        "swiglu",
        "swiglu",
        lambda x, a, b, c: F.linear(F.silu(F.linear(x, a)) * F.linear(x, b), c),
        (x, wg, wu, wd),
        {},
        gen=g,
    )
    assert tensor_names(saved) == {"x", "w_gate", "w_up", "w_down", "gate", "up"}


def test_task2_causal_attention_ignores_the_future():
    """Changing the last key/value must not move any earlier output or the grads of earlier queries."""
    g = torch.Generator().manual_seed(0)
    q, k, v = randn(g, 1, 2, 5, 4), randn(g, 1, 1, 5, 4), randn(g, 1, 1, 5, 4)
    out1, _ = vjp.attention_forward(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 3.0
    v2[:, :, -1] -= 2.0
    out2, _ = vjp.attention_forward(q, k2, v2)
    assert torch.equal(out1[:, :, :-1], out2[:, :, :-1])


# ----------------------------------------------------------------------------------------------
# refusals: one clear ValueError each


def test_task2_gelu_refuses_unknown_approximation():
    with pytest.raises(ValueError, match="'none', 'tanh'"):
        vjp.gelu_forward(torch.zeros(3), approximate="erf")


def test_task2_attention_refuses_heads_not_multiple_of_kv_heads():
    q, kv = torch.zeros(1, 3, 4, 2), torch.zeros(1, 2, 4, 2)
    with pytest.raises(ValueError, match="multiple"):
        vjp.attention_forward(q, kv, kv)


def test_task2_attention_refuses_causal_with_unequal_lengths():
    with pytest.raises(ValueError, match="causal"):
        vjp.attention_forward(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))


def test_task2_cross_entropy_refuses_mean_over_zero_targets():
    targets = torch.full((4,), -100)
    with pytest.raises(ValueError, match="mean"):
        vjp.cross_entropy_forward(torch.zeros(4, 3), targets)
    loss, saved = vjp.cross_entropy_forward(
        torch.zeros(4, 3), targets, reduction="sum"
    )  # a sum of nothing is 0
    assert loss.item() == 0.0 and not vjp.cross_entropy_backward(saved, torch.tensor(1.0))[0].any()


def test_task2_cross_entropy_refuses_unknown_reduction():
    with pytest.raises(ValueError, match="'mean', 'sum'"):
        vjp.cross_entropy_forward(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), reduction="avg")


def test_task2_cross_entropy_refuses_target_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        vjp.cross_entropy_forward(torch.zeros(2, 3), torch.tensor([0, 3]))


@pytest.mark.parametrize(
    "call",
    [
        lambda: vjp.linear_forward(torch.zeros(2, 3), torch.zeros(4, 5)),
        lambda: vjp.rms_norm_forward(torch.zeros(2, 3), torch.zeros(4)),
        lambda: vjp.rope_forward(torch.zeros(1, 1, 2, 3), torch.zeros(2, 3), torch.zeros(2, 3)),
        lambda: vjp.rope_forward(torch.zeros(1, 1, 2, 4), torch.zeros(3, 4), torch.zeros(3, 4)),
        lambda: vjp.swiglu_forward(
            torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(5, 3), torch.zeros(3, 4)
        ),
        lambda: vjp.embedding_forward(torch.tensor([0, 7]), torch.zeros(5, 2)),
    ],
)
def test_task2_bad_shapes_are_refused(call):
    with pytest.raises(ValueError):
        call()


# ----------------------------------------------------------------------------------------------
# helpers: saved_bytes; module hygiene (checks.close is tested in test_output_policy.py)


def test_task2_saved_bytes_counts_each_memory_once():
    x, w = torch.zeros(4, 3), torch.zeros(5, 3)
    _, saved = vjp.linear_forward(x, w)
    assert vjp.saved_bytes(saved) == x.nbytes + w.nbytes
    assert vjp.saved_bytes(saved, exclude=[w]) == x.nbytes  # weights are references to parameters
    assert vjp.saved_bytes({"a": saved, "b": [saved]}) == x.nbytes + w.nbytes  # shared tensors count once
    _, saved = vjp.cross_entropy_forward(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
    assert vjp.saved_bytes(saved) == 4 * 3 * 4 + 4 * 8  # probs (float32) + targets (int64); options are free


def test_task2_vjp_uses_no_autograd():
    """The whole point is doing it by hand: no .backward(), torch.autograd or requires_grad in vjp.py."""
    tree = ast.parse(inspect.getsource(vjp))
    attrs = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not attrs & {"autograd", "backward", "requires_grad", "requires_grad_", "grad"}


def test_task2_importing_vjp_imports_no_other_trainmech_module():
    code = (
        "import sys, trainmech; before = set(sys.modules); import trainmech.vjp; "
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('trainmech')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['trainmech.vjp']"


def test_task2_float32_backward_is_close_to_float64():
    """Sanity for the notebooks' float32 runs: the same formulas lose only float32 rounding."""
    g = torch.Generator().manual_seed(1)
    q, k, v = randn(g, 2, 4, 6, 8), randn(g, 2, 2, 6, 8), randn(g, 2, 2, 6, 8)
    dout = randn(g, 2, 4, 6, 8)
    _, s64 = vjp.attention_forward(q, k, v)
    _, s32 = vjp.attention_forward(q.float(), k.float(), v.float())
    for name, a, b in zip(
        "qkv", vjp.attention_backward(s32, dout.float()), vjp.attention_backward(s64, dout)
    ):
        close(f"attention.d{name}[f32]", a, b, rtol=1e-5)
    assert 2 * vjp.saved_bytes(s32) == vjp.saved_bytes(
        s64
    )  # the same tensors (q, k, v, probs), half the bytes
