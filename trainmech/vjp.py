"""Hand-written forward/backward pairs (VJPs) for the ops of a Qwen2 decoder layer and its loss.

Every op is two plain functions over torch tensors, the backward right after its forward:

    out, saved = <op>_forward(*inputs, **options)    # saved: name -> Tensor, plus plain options
    grads = <op>_backward(saved, grad_out)           # one grad per tensor input, in forward's order

`saved` holds exactly what the backward formula reads, nothing more: it IS the op's saved-tensor
inventory (compare it with what autograd keeps; count it with `saved_bytes`). What backward can
rebuild in one cheap elementwise step is recomputed there instead of saved, and says so.
`grad_out` is the upstream gradient: d loss / d out, shaped like `out`.

No torch.autograd here: every gradient is written out by hand. Bad shapes and unknown options
raise ValueError with one sentence saying what is wrong and what is valid.
"""

import math

import torch
from torch.utils._pytree import tree_leaves

__all__ = [
    "IGNORE_INDEX",
    "linear_forward",
    "linear_backward",
    "embedding_forward",
    "embedding_backward",
    "silu_forward",
    "silu_backward",
    "gelu_forward",
    "gelu_backward",
    "softmax_forward",
    "softmax_backward",
    "cross_entropy_forward",
    "cross_entropy_backward",
    "rms_norm_forward",
    "rms_norm_backward",
    "layer_norm_forward",
    "layer_norm_backward",
    "rope_forward",
    "rope_backward",
    "attention_forward",
    "attention_backward",
    "swiglu_forward",
    "swiglu_backward",
    "saved_bytes",
]

IGNORE_INDEX = -100  # a target at this value is not supervised (PyTorch / transformers convention)
GELU_APPROXIMATIONS = ("none", "tanh")
REDUCTIONS = ("mean", "sum")


def _require(condition, message):
    """Raise ValueError(message) unless condition holds: the one refusal mechanism of this module."""
    if not condition:
        raise ValueError(message)


def _compute_dtype(dtype):
    """float16/bfloat16 -> float32; float32 and float64 stay as they are (never downcast)."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------------------------
# linear: y = x @ W^T + b


def linear_forward(x, weight, bias=None):
    """y = x @ weight.T + bias, the nn.Linear convention.

    x: (..., in), weight: (out, in), bias: (out,) or None  ->  y: (..., out).
    Saves x and weight (bias is not needed: its gradient is just the summed upstream gradient).
    Refuses a weight that is not 2-D, or x / bias whose size does not match the weight.
    """
    _require(weight.dim() == 2, f"linear: weight must be 2-D (out, in), got shape {tuple(weight.shape)}.")
    _require(
        x.shape[-1] == weight.shape[1],
        f"linear: x has {x.shape[-1]} input features but weight expects {weight.shape[1]} (weight is (out, in)).",
    )
    _require(
        bias is None or tuple(bias.shape) == (weight.shape[0],),
        f"linear: bias must have shape ({weight.shape[0]},), got {None if bias is None else tuple(bias.shape)}.",
    )
    y = x @ weight.T  # (..., out)
    if bias is not None:
        y = y + bias  # (..., out) bias broadcast over every leading position
    saved = {"x": x, "weight": weight, "has_bias": bias is not None}
    return y, saved


def linear_backward(saved, grad_out):
    """grad_out: (..., out)  ->  (dx (..., in), dweight (out, in), dbias (out,) or None)."""
    x, weight = saved["x"], saved["weight"]
    x2 = x.reshape(-1, x.shape[-1])  # (N, in) all leading dims are just more rows
    g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (N, out)
    dx = grad_out @ weight  # (..., in) y = x W^T, so dx = dy W
    dweight = g2.T @ x2  # (out, in) each row of x touches every output unit: sum of outer products
    dbias = g2.sum(0) if saved["has_bias"] else None  # (out,) bias is added to every row: sum the rows
    return dx, dweight, dbias


# ----------------------------------------------------------------------------------------------
# embedding: y = weight[ids]


def embedding_forward(ids, weight):
    """y = weight[ids], a row lookup.

    ids: integer tensor of any shape (...), weight: (V, C)  ->  y: (..., C).
    Saves ids and the number of rows V (the gradient is a scatter of grad_out into V rows).
    Refuses non-integer ids, ids outside [0, V), and a weight that is not 2-D.
    """
    _require(
        not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool,
        f"embedding: ids must be an integer tensor, got {ids.dtype}.",
    )
    _require(weight.dim() == 2, f"embedding: weight must be 2-D (V, C), got shape {tuple(weight.shape)}.")
    V = weight.shape[0]
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < V):
        raise ValueError(
            f"embedding: ids must lie in [0, {V}), got values in [{int(ids.min())}, {int(ids.max())}]."
        )
    y = weight[ids]  # (..., C)
    saved = {"ids": ids, "num_embeddings": V}
    return y, saved


def embedding_backward(saved, grad_out):
    """grad_out: (..., C)  ->  (None, dweight (V, C)); a row used k times receives the sum of k grads."""
    ids = saved["ids"]
    C = grad_out.shape[-1]
    dweight = grad_out.new_zeros((saved["num_embeddings"], C))  # (V, C) rows never looked up get zero
    dweight.index_add_(0, ids.reshape(-1), grad_out.reshape(-1, C))  # (V, C) add, not assign: ids repeat
    return None, dweight


# ----------------------------------------------------------------------------------------------
# silu: y = x * sigmoid(x)


def silu_forward(x):
    """y = x * sigmoid(x), elementwise.  x: any shape -> y: same shape.  Saves x."""
    y = x * torch.sigmoid(x)  # (...)
    return y, {"x": x}


def silu_backward(saved, grad_out):
    """dy/dx = s + x s (1 - s) with s = sigmoid(x); returns (dx,)."""
    x = saved["x"]
    s = torch.sigmoid(x)  # (...) recomputed: one elementwise op, cheaper than saving it
    dx = grad_out * (s * (1 + x * (1 - s)))  # (...) term 1: s (the gate); term 2: x s'(x), s' = s(1-s)
    return (dx,)


# ----------------------------------------------------------------------------------------------
# gelu: y = x * Phi(x)   (exact), or its tanh approximation


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


def gelu_forward(x, approximate="none"):
    """GELU, as torch.nn.functional.gelu.  x: any shape -> y: same shape.  Saves x and `approximate`.

    "none": y = x * Phi(x), Phi the standard normal CDF;
    "tanh": y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    Refuses any other `approximate`.
    """
    _require(
        approximate in GELU_APPROXIMATIONS,
        f"gelu: approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}.",
    )
    if approximate == "none":
        y = x * 0.5 * (1 + torch.erf(x / math.sqrt(2.0)))  # (...) x * Phi(x)
    else:
        u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x**3)  # (...)
        y = 0.5 * x * (1 + torch.tanh(u))  # (...)
    return y, {"x": x, "approximate": approximate}


def gelu_backward(saved, grad_out):
    """Returns (dx,)."""
    x = saved["x"]
    if saved["approximate"] == "none":
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2.0)))  # (...) Phi(x)
        pdf = torch.exp(-0.5 * x**2) / math.sqrt(2 * math.pi)  # (...) phi(x) = Phi'(x)
        dx = grad_out * (cdf + x * pdf)  # (...) term 1: Phi(x); term 2: x phi(x) (product rule)
    else:
        u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x**3)  # (...)
        t = torch.tanh(u)  # (...)
        du = _SQRT_2_OVER_PI * (1 + 3 * _GELU_TANH_C * x**2)  # (...) du/dx
        dx = grad_out * (
            0.5 * (1 + t) + 0.5 * x * (1 - t**2) * du
        )  # (...) term 1: gate; term 2: through tanh
    return (dx,)


# ----------------------------------------------------------------------------------------------
# softmax: y = exp(x) / sum(exp(x))


def softmax_forward(x, dim=-1):
    """Softmax along `dim`.  x: any shape -> y: same shape.  Saves the output y (and dim), not x.

    Entries equal to -inf get probability 0 (that is how attention masks future positions).
    """
    _require(
        -x.dim() <= dim < max(x.dim(), 1), f"softmax: dim must be in [{-x.dim()}, {x.dim()}), got {dim}."
    )
    m = x.amax(dim, keepdim=True)  # (..., 1, ...) subtract the max so exp never overflows
    e = torch.exp(x - m)  # (...)
    y = e / e.sum(dim, keepdim=True)  # (...)
    return y, {"y": y, "dim": dim}


def softmax_backward(saved, grad_out):
    """dx = y * (dy - sum(dy * y)): the Jacobian diag(y) - y y^T applied to dy.  Returns (dx,)."""
    y, dim = saved["y"], saved["dim"]
    dot = (grad_out * y).sum(dim, keepdim=True)  # (..., 1, ...) term 2 weight: y . dy
    dx = y * (grad_out - dot)  # (...) term 1: y dy (diagonal); term 2: -y (y . dy) (normalisation)
    return (dx,)


# ----------------------------------------------------------------------------------------------
# cross_entropy: loss = -log softmax(logits)[target], averaged over the targets that count


def cross_entropy_forward(logits, targets, ignore_index=IGNORE_INDEX, reduction="mean"):
    """Cross-entropy of logits against class targets, as torch.nn.functional.cross_entropy.

    logits: (N, V), targets: (N,) integer class ids  ->  loss: () scalar.
    reduction "mean": sum over targets != ignore_index, divided by their number; "sum": just the sum.
    Saves the softmax probabilities (N, V), the targets, and the plain options incl. the number of
    valid targets. Refuses: logits not 2-D, targets not (N,), an unknown reduction, a valid target
    outside [0, V), and a "mean" with zero valid targets (0/0 would be NaN).
    """
    _require(
        reduction in REDUCTIONS, f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}."
    )
    _require(logits.dim() == 2, f"cross_entropy: logits must be 2-D (N, V), got shape {tuple(logits.shape)}.")
    N, V = logits.shape
    _require(
        tuple(targets.shape) == (N,),
        f"cross_entropy: targets must have shape ({N},) to match logits (N, V), got {tuple(targets.shape)}.",
    )
    _require(
        not targets.is_floating_point(),
        f"cross_entropy: targets must be integer class ids, got {targets.dtype}.",
    )
    valid = targets != ignore_index  # (N,) which rows count
    n_valid = int(valid.sum())
    _require(
        reduction == "sum" or n_valid > 0,
        f"cross_entropy: reduction='mean' needs at least one target != ignore_index={ignore_index}, "
        f"but all {N} are ignored; the mean over zero targets is undefined.",
    )
    safe = torch.where(valid, targets, 0)  # (N,) ignored rows point at class 0; masked out below
    _require(
        n_valid == 0 or (int(safe[valid].min()) >= 0 and int(safe[valid].max()) < V),
        f"cross_entropy: targets must lie in [0, {V}) or equal ignore_index={ignore_index}.",
    )
    shifted = logits - logits.amax(-1, keepdim=True)  # (N, V) max is 0: exp never overflows
    log_z = torch.log(torch.exp(shifted).sum(-1, keepdim=True))  # (N, 1) log of the normaliser
    logp = shifted - log_z  # (N, V) log-softmax
    probs = torch.exp(logp)  # (N, V) softmax, saved for backward
    picked = logp.gather(1, safe[:, None])[:, 0]  # (N,) log-probability of the target class
    losses = torch.where(valid, -picked, 0)  # (N,) -log p[target]; 0 where ignored
    loss = losses.sum() / n_valid if reduction == "mean" else losses.sum()  # ()
    saved = {"probs": probs, "targets": targets}  # (N, V), (N,)
    saved |= {"ignore_index": ignore_index, "reduction": reduction, "n_valid": n_valid}  # plain options
    return loss, saved


def cross_entropy_backward(saved, grad_out):
    """grad_out: () scalar  ->  (dlogits (N, V), None).  dlogits = (softmax - onehot) * scale."""
    probs, targets = saved["probs"], saved["targets"]
    valid = targets != saved["ignore_index"]  # (N,)
    safe = torch.where(valid, targets, 0)  # (N,)
    onehot = torch.nn.functional.one_hot(safe, probs.shape[1]).to(probs.dtype)  # (N, V)
    scale = grad_out / saved["n_valid"] if saved["reduction"] == "mean" else grad_out  # () each row's weight
    # term 1: d lse / d logits = softmax; term 2: d(-logit[target]) = -onehot; ignored rows get 0
    dlogits = torch.where(valid[:, None], probs - onehot, 0) * scale  # (N, V)
    return dlogits, None


# ----------------------------------------------------------------------------------------------
# rms_norm: y = weight * x / sqrt(mean(x^2) + eps)   (Qwen2RMSNorm)


def rms_norm_forward(x, weight, eps=1e-6):
    """RMSNorm over the last dim, with Qwen2RMSNorm's casts.

    x: (..., C), weight: (C,)  ->  y: (..., C).
    Like HF: float16/bfloat16 input is normalised in float32, cast back to the input dtype, THEN
    scaled by weight. Unlike HF (which always computes in float32), float64 stays float64.
    Saves x, weight and rstd = 1/sqrt(mean(x^2) + eps), shape (..., 1), in the compute dtype.
    Refuses a weight that is not (C,).
    """
    _require(
        tuple(weight.shape) == (x.shape[-1],),
        f"rms_norm: weight must have shape ({x.shape[-1]},) to match x's last dim, got {tuple(weight.shape)}.",
    )
    h = x.to(_compute_dtype(x.dtype))  # (..., C)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) 1 / rms of each row
    n = (h * rstd).to(x.dtype)  # (..., C) normalised, back in the input dtype before the weight (HF order)
    y = weight * n  # (..., C)
    return y, {"x": x, "weight": weight, "rstd": rstd}


def rms_norm_backward(saved, grad_out):
    """grad_out: (..., C)  ->  (dx (..., C), dweight (C,))."""
    x, weight, rstd = saved["x"], saved["weight"], saved["rstd"]
    C = x.shape[-1]
    n = x.to(rstd.dtype) * rstd  # (..., C) recomputed normalised x, in the compute dtype
    dweight = (
        (grad_out * n.to(x.dtype)).reshape(-1, C).sum(0).to(weight.dtype)
    )  # (C,) weight scales each channel
    dn = (grad_out * weight).to(rstd.dtype)  # (..., C) gradient reaching the normalised x
    dot = (dn * n).mean(-1, keepdim=True)  # (..., 1) how much dn points along n
    dh = rstd * (dn - n * dot)  # (..., C) term 1: rstd dn (direct); term 2: -rstd n mean(dn n) (through rstd)
    dx = dh.to(x.dtype)  # (..., C)
    return dx, dweight


# ----------------------------------------------------------------------------------------------
# layer_norm: y = weight * (x - mean) / sqrt(var + eps) + bias


def layer_norm_forward(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim, as torch.nn.functional.layer_norm (biased variance).

    x: (..., C), weight: (C,), bias: (C,) or None  ->  y: (..., C).
    Saves x, weight, mean (..., 1) and rstd (..., 1); the normalised x is recomputed in backward.
    Refuses weight / bias that are not (C,).
    """
    C = x.shape[-1]
    _require(
        tuple(weight.shape) == (C,), f"layer_norm: weight must have shape ({C},), got {tuple(weight.shape)}."
    )
    _require(
        bias is None or tuple(bias.shape) == (C,),
        f"layer_norm: bias must have shape ({C},) or be None, got {None if bias is None else tuple(bias.shape)}.",
    )
    mean = x.mean(-1, keepdim=True)  # (..., 1)
    xc = x - mean  # (..., C)
    var = (xc**2).mean(-1, keepdim=True)  # (..., 1) biased variance
    rstd = (var + eps) ** -0.5  # (..., 1)
    norm = xc * rstd  # (..., C)
    y = norm * weight  # (..., C)
    if bias is not None:
        y = y + bias  # (..., C)
    saved = {"x": x, "weight": weight, "mean": mean, "rstd": rstd, "has_bias": bias is not None}
    return y, saved


def layer_norm_backward(saved, grad_out):
    """grad_out: (..., C)  ->  (dx (..., C), dweight (C,), dbias (C,) or None)."""
    x, weight, mean, rstd = saved["x"], saved["weight"], saved["mean"], saved["rstd"]
    C = x.shape[-1]
    norm = (x - mean) * rstd  # (..., C) recomputed
    g2 = grad_out.reshape(-1, C)  # (N, C)
    dbias = g2.sum(0) if saved["has_bias"] else None  # (C,)
    dweight = (g2 * norm.reshape(-1, C)).sum(0)  # (C,)
    dnorm = grad_out * weight  # (..., C)
    dx = dnorm - dnorm.mean(-1, keepdim=True)  # (..., C) term 1: direct; term 2: through the mean
    dx = dx - norm * (dnorm * norm).mean(-1, keepdim=True)  # (..., C) term 3: through rstd
    dx = dx * rstd  # (..., C)
    return dx, dweight, dbias


# ----------------------------------------------------------------------------------------------
# rope: y = x * cos + rotate_half(x) * sin   (HF convention: the two halves of D are paired)


def _rotate_half(x):
    """(x1, x2) -> (-x2, x1) on the last dim, as HF rotate_half."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (..., D)


def rope_forward(x, cos, sin):
    """Rotary position embedding, HF `apply_rotary_pos_emb` convention.

    x: (B, H, T, D); cos, sin: (T, D) or (B, T, D) as HF passes them (B may be 1)  ->  y: (B, H, T, D).
    y is linear in x, so backward needs only cos and sin: saves cos and sin, not x.
    (cos/sin are shared by q, k and every layer: a ledger should count that memory once.)
    Refuses x that is not 4-D, an odd D, and cos/sin whose shape does not fit x.
    """
    _require(x.dim() == 4, f"rope: x must be 4-D (B, H, T, D), got shape {tuple(x.shape)}.")
    B, H, T, D = x.shape
    _require(D % 2 == 0, f"rope: head dim D must be even to pair its two halves, got {D}.")
    _require(
        cos.shape == sin.shape,
        f"rope: cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}.",
    )
    _require(
        tuple(cos.shape) == (T, D)
        or (cos.dim() == 3 and cos.shape[0] in (1, B) and tuple(cos.shape[1:]) == (T, D)),
        f"rope: cos/sin must be ({T}, {D}) or (B, {T}, {D}) to match x {tuple(x.shape)}, got {tuple(cos.shape)}.",
    )
    c = cos if cos.dim() == 2 else cos.unsqueeze(1)  # (T, D) or (B, 1, T, D): broadcast over heads
    s = sin if sin.dim() == 2 else sin.unsqueeze(1)  # same
    y = x * c + _rotate_half(x) * s  # (B, H, T, D)
    return y, {"cos": cos, "sin": sin}


def rope_backward(saved, grad_out):
    """dx = dy cos + R^T (dy sin), and R^T = -R for rotate_half R.  Returns (dx, None, None)."""
    cos, sin = saved["cos"], saved["sin"]
    c = cos if cos.dim() == 2 else cos.unsqueeze(1)  # (T, D) or (B, 1, T, D)
    s = sin if sin.dim() == 2 else sin.unsqueeze(1)
    dx = grad_out * c - _rotate_half(
        grad_out * s
    )  # (B, H, T, D) term 1: x*cos path; term 2: rotated path, transposed
    return dx, None, None


# ----------------------------------------------------------------------------------------------
# attention: out = softmax(q k^T * scale + causal mask) v, grouped-query


def attention_forward(q, k, v, causal=True, scale=None):
    """Scaled dot-product attention with grouped-query heads, as HF eager attention + repeat_kv.

    q: (B, H, T, D), k and v: (B, Hkv, S, D) with H % Hkv == 0; query head h reads kv head
    h // (H // Hkv). causal=True masks key s > query t (needs S == T). scale defaults to D**-0.5.
    Returns out: (B, H, T, D).
    Saves q, k, v and the softmax probabilities P (B, H, T, S) (not the logsumexp: P is the simplest
    to teach, and what eager attention keeps; flash attention keeps the logsumexp instead).
    Like HF eager, a float16/bfloat16 softmax runs in float32 and P is cast back to q's dtype.
    Refuses: non-4-D inputs, k/v shapes that differ or do not match q's B and D, H % Hkv != 0,
    causal with S != T.
    """
    _require(
        q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
        f"attention: q, k, v must be 4-D (B, H, T, D), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.",
    )
    _require(
        k.shape == v.shape,
        f"attention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.",
    )
    B, H, T, D = q.shape
    _, Hkv, S, _ = k.shape
    _require(
        k.shape[0] == B and k.shape[3] == D,
        f"attention: k/v must be (B={B}, Hkv, S, D={D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}.",
    )
    _require(
        H % Hkv == 0,
        f"attention: the number of query heads H={H} must be a multiple of the kv heads Hkv={Hkv} (grouped-query).",
    )
    _require(not causal or S == T, f"attention: causal=True needs as many keys as queries, got T={T}, S={S}.")
    G = H // Hkv  # query heads per kv head
    scale = D**-0.5 if scale is None else scale
    qg = q.reshape(B, Hkv, G, T, D)  # (B, Hkv, G, T, D) head h = kv * G + g, as repeat_kv
    kg = k.unsqueeze(2)  # (B, Hkv, 1, S, D) one kv head serves its G query heads (no copy)
    vg = v.unsqueeze(2)  # (B, Hkv, 1, S, D)
    scores = (qg @ kg.transpose(-1, -2)) * scale  # (B, Hkv, G, T, S)
    if causal:
        future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1)  # (T, S) key after query
        scores = scores.masked_fill(future, float("-inf"))  # (B, Hkv, G, T, S) softmax gives them 0
    probs, _ = softmax_forward(scores.to(_compute_dtype(q.dtype)), dim=-1)  # (B, Hkv, G, T, S)
    probs = probs.to(q.dtype)  # (B, Hkv, G, T, S) HF eager casts P back before P @ V
    out = (probs @ vg).reshape(B, H, T, D)  # (B, H, T, D)
    saved = {"q": q, "k": k, "v": v, "probs": probs.reshape(B, H, T, S), "scale": scale, "causal": causal}
    return out, saved


def attention_backward(saved, grad_out):
    """grad_out: (B, H, T, D)  ->  (dq (B, H, T, D), dk (B, Hkv, S, D), dv (B, Hkv, S, D)).

    dk and dv are summed over the G query heads that share each kv head (repeat_kv's backward).
    """
    q, k, v, probs, scale = saved["q"], saved["k"], saved["v"], saved["probs"], saved["scale"]
    B, H, T, D = q.shape
    _, Hkv, S, _ = k.shape
    G = H // Hkv
    qg = q.reshape(B, Hkv, G, T, D)  # (B, Hkv, G, T, D)
    kg = k.unsqueeze(2)  # (B, Hkv, 1, S, D)
    vg = v.unsqueeze(2)  # (B, Hkv, 1, S, D)
    pg = probs.reshape(B, Hkv, G, T, S)  # (B, Hkv, G, T, S)
    dout = grad_out.reshape(B, Hkv, G, T, D)  # (B, Hkv, G, T, D)
    dv = (pg.transpose(-1, -2) @ dout).sum(2)  # (B, Hkv, S, D) out = P V; sum over the group's G heads
    dprobs = dout @ vg.transpose(-1, -2)  # (B, Hkv, G, T, S)
    cd = _compute_dtype(q.dtype)
    (dscores,) = softmax_backward(
        {"y": pg.to(cd), "dim": -1}, dprobs.to(cd)
    )  # (B, Hkv, G, T, S) masked: P=0 -> 0
    dscores = dscores.to(q.dtype) * scale  # (B, Hkv, G, T, S) scores = q k^T * scale
    dq = (dscores @ kg).reshape(B, H, T, D)  # (B, H, T, D)
    dk = (dscores.transpose(-1, -2) @ qg).sum(2)  # (B, Hkv, S, D) sum over the group's G heads
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# swiglu: y = down(silu(gate(x)) * up(x))   (Qwen2MLP)


def swiglu_forward(x, w_gate, w_up, w_down):
    """The Qwen2 MLP: y = (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T, no biases.

    x: (..., C), w_gate and w_up: (I, C), w_down: (C, I)  ->  y: (..., C).
    Saves x, the three weights, and the two projections gate = x w_gate^T and up = x w_up^T
    (..., I). silu(gate) and the product h = silu(gate) * up are recomputed in backward (one
    elementwise op each) instead of saved; autograd, by contrast, keeps both.
    Refuses weights whose shapes do not chain (..., C) -> (..., I) -> (..., C).
    """
    C = x.shape[-1]
    _require(
        w_gate.dim() == 2 and w_gate.shape[1] == C and w_up.shape == w_gate.shape,
        f"swiglu: w_gate and w_up must both be (I, {C}), got {tuple(w_gate.shape)} and {tuple(w_up.shape)}.",
    )
    I = w_gate.shape[0]
    _require(tuple(w_down.shape) == (C, I), f"swiglu: w_down must be ({C}, {I}), got {tuple(w_down.shape)}.")
    gate, _ = linear_forward(x, w_gate)  # (..., I)
    up, _ = linear_forward(x, w_up)  # (..., I)
    act, _ = silu_forward(gate)  # (..., I)
    y, _ = linear_forward(act * up, w_down)  # (..., C)
    saved = {"x": x, "w_gate": w_gate, "w_up": w_up, "w_down": w_down, "gate": gate, "up": up}
    return y, saved


def swiglu_backward(saved, grad_out):
    """grad_out: (..., C)  ->  (dx (..., C), dw_gate (I, C), dw_up (I, C), dw_down (C, I))."""
    x, gate, up = saved["x"], saved["gate"], saved["up"]
    act = gate * torch.sigmoid(gate)  # (..., I) recomputed silu(gate)
    h = act * up  # (..., I) recomputed input of down
    dh, dw_down, _ = linear_backward(
        {"x": h, "weight": saved["w_down"], "has_bias": False}, grad_out
    )  # (..., I)
    dact = dh * up  # (..., I) h = act * up: each factor's grad is dh times the other
    dup = dh * act  # (..., I)
    (dgate,) = silu_backward({"x": gate}, dact)  # (..., I)
    dx_g, dw_gate, _ = linear_backward(
        {"x": x, "weight": saved["w_gate"], "has_bias": False}, dgate
    )  # (..., C)
    dx_u, dw_up, _ = linear_backward({"x": x, "weight": saved["w_up"], "has_bias": False}, dup)  # (..., C)
    dx = dx_g + dx_u  # (..., C) x feeds two branches: their gradients add
    return dx, dw_gate, dw_up, dw_down


# ----------------------------------------------------------------------------------------------
# helpers: how many bytes a saved dict holds; one comparison line per tensor


def saved_bytes(saved, *, exclude=()):
    """Bytes of the tensors in `saved` (a saved dict, or nested dicts/lists of them).

    A tensor saved under several names (the same memory: same data_ptr and nbytes, e.g. the
    normalised x read by q_proj, k_proj and v_proj) is counted once. Tensors sharing memory with
    one in `exclude` (e.g. model.parameters(): weights are referenced, not copied) are not counted.
    Plain options (ints, strings) cost nothing here.
    """
    seen = {(t.data_ptr(), t.nbytes) for t in exclude}
    total = 0
    # tree_leaves, not saved_state.flat_tensors: this module imports no other trainmech module
    for t in tree_leaves(saved):  # every leaf of the dict / list nest; options are leaves too
        if not isinstance(t, torch.Tensor):
            continue
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total
