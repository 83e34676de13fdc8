"""A whole Qwen2 forward and backward, composed by hand from the pairs in `trainmech.vjp`.

    out, saved = layer_forward(x, params, cos, sin, config)       # one Qwen2DecoderLayer
    dx, dparams = layer_backward(saved, grad_out)
    loss, saved = model_loss_forward(model, input_ids, labels)    # Qwen2ForCausalLM + shifted loss
    grads = model_loss_backward(saved)                            # keyed like model.named_parameters()

    with hf_float64_reference():                                  # the stock modules without their
        ref = causal_lm_loss(model(input_ids).logits, labels)     # float32 islands: a float64 reference

A composed op's `saved` is a dict of its sub-ops' saved dicts (a model's adds a list of layers);
`saved_inventory` flattens it into one row per tensor: which forward states backward consumes.

Numerics follow the installed transformers' Qwen2 modules, with one deliberate difference: HF
computes RMSNorm, the eager softmax and the loss in float32 even when the model is float64, so a
float64 HF model is only float32-accurate there; here float64 stays float64 (lower precisions are
upcast to float32 exactly as HF does). `hf_float64_reference` and `causal_lm_loss` remove those
islands from the real modules, so that they can serve as a float64 reference; FLOAT32_ISLANDS lists
all four (RoPE's float32 angles stay: they are an input both sides share) and `float32_island_gaps`
measures them.

Patched at run time: inside `hf_float64_reference` (and `float32_island_gaps`, which uses it),
transformers' `modeling_qwen2.Qwen2RMSNorm.forward` and `modeling_qwen2.eager_attention_forward`
are replaced process-wide, for every Qwen2 model and thread, until the block exits (also on an
exception). Nothing else here changes state outside its arguments.

Not supported (refused with ValueError): padding masks, sliding-window layers, RoPE types other
than "default", activations other than silu, attention dropout.
"""

import contextlib
import statistics
import time

import torch
from torch.utils._pytree import tree_flatten_with_path

from trainmech import vjp

__all__ = [
    "rope_cos_sin",
    "layer_params",
    "layer_forward",
    "layer_backward",
    "model_loss_forward",
    "model_loss_backward",
    "saved_inventory",
    "FLOAT32_ISLANDS",
    "float32_island_gaps",
    "hf_float64_reference",
    "causal_lm_loss",
    "benchmark",
]

IGNORE_INDEX = vjp.IGNORE_INDEX
_require = vjp._require  # the one refusal of the hand-written backward


def _head_dims(config):
    """(H, Hkv, D) from a Qwen2Config, with HF's fallback head_dim = hidden_size // H."""
    H = config.num_attention_heads
    Hkv = getattr(config, "num_key_value_heads", None) or H
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    return H, Hkv, D


def _rope_parameters(config):
    """(rope_type, rope_theta): transformers 5.x keeps them in config.rope_parameters, 4.x in
    config.rope_theta / config.rope_scaling."""
    rope = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    _require(theta is not None, "rope: the config has neither rope_parameters['rope_theta'] nor rope_theta.")
    return rope_type, float(theta)


def _check_config(config):
    """Refuse the Qwen2 features this hand-written path does not implement."""
    rope_type, _ = _rope_parameters(config)
    _require(
        rope_type == "default", f"only rope_type 'default' is implemented, the config has {rope_type!r}."
    )
    _require(
        getattr(config, "hidden_act", "silu") == "silu",
        f"only hidden_act 'silu' is implemented (SwiGLU), the config has {config.hidden_act!r}.",
    )
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    _require(
        all(t == "full_attention" for t in layer_types),
        f"only full (causal) attention layers are implemented, the config has layer_types={layer_types}.",
    )
    _require(
        not getattr(config, "attention_dropout", 0.0),
        f"attention dropout is not implemented, the config has attention_dropout={config.attention_dropout}.",
    )
    H, Hkv, _ = _head_dims(config)
    _require(H % Hkv == 0, f"num_attention_heads={H} must be a multiple of num_key_value_heads={Hkv}.")


def rope_cos_sin(config, seq_len, dtype=torch.float32, device=None):
    """cos, sin: (T, D) for positions 0..T-1, computed exactly as Qwen2RotaryEmbedding does.

    Like HF, the angles are computed in float32 whatever the model dtype, then cast to `dtype`
    (so a float64 model still gets float32-rounded cos/sin: they are inputs, not gradients).
    Refuses RoPE types other than "default".
    """
    rope_type, theta = _rope_parameters(config)
    _require(
        rope_type == "default", f"rope_cos_sin: only rope_type 'default' is implemented, got {rope_type!r}."
    )
    _, _, D = _head_dims(config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float, device=device) / D))  # (D/2,)
    positions = torch.arange(seq_len, device=device).float()  # (T,)
    freqs = positions[:, None] * inv_freq[None, :]  # (T, D/2) angle of position t in frequency pair i
    emb = torch.cat(
        (freqs, freqs), dim=-1
    )  # (T, D) both halves share the angles (rotate_half pairs i, i+D/2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def layer_params(layer):
    """{name: tensor} of an HF Qwen2DecoderLayer, detached (names as in layer.named_parameters())."""
    return {name: p.detach() for name, p in layer.named_parameters()}


# ----------------------------------------------------------------------------------------------
# one decoder layer


def layer_forward(x, params, cos, sin, config):
    """One Qwen2DecoderLayer: x + attn(norm(x)), then + mlp(norm(.)); causal, grouped-query.

    x: (B, T, C); params: {name: tensor} named like the HF layer's parameters
    ('self_attn.q_proj.weight', 'self_attn.q_proj.bias', …, 'mlp.down_proj.weight',
    'input_layernorm.weight', 'post_attention_layernorm.weight'); cos, sin: (T, D) from
    `rope_cos_sin`; config: a Qwen2Config.  Returns out: (B, T, C) and saved, a dict of the
    sub-ops' saved dicts (see `saved_inventory`).
    """
    _check_config(config)
    _require(x.dim() == 3, f"layer_forward: x must be (B, T, C), got shape {tuple(x.shape)}.")
    B, T, C = x.shape
    H, Hkv, D = _head_dims(config)
    eps = config.rms_norm_eps
    p = params
    h, s_ln1 = vjp.rms_norm_forward(x, p["input_layernorm.weight"], eps=eps)  # (B, T, C)
    q, s_q = vjp.linear_forward(h, p["self_attn.q_proj.weight"], p["self_attn.q_proj.bias"])  # (B, T, H*D)
    k, s_k = vjp.linear_forward(h, p["self_attn.k_proj.weight"], p["self_attn.k_proj.bias"])  # (B, T, Hkv*D)
    v, s_v = vjp.linear_forward(h, p["self_attn.v_proj.weight"], p["self_attn.v_proj.bias"])  # (B, T, Hkv*D)
    q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D) heads become a batch dim
    k = k.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
    v = v.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
    q, s_qr = vjp.rope_forward(q, cos, sin)  # (B, H, T, D)
    k, s_kr = vjp.rope_forward(k, cos, sin)  # (B, Hkv, T, D)
    a, s_attn = vjp.attention_forward(q, k, v, causal=True, scale=D**-0.5)  # (B, H, T, D)
    a = a.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D) heads back side by side
    o, s_o = vjp.linear_forward(a, p["self_attn.o_proj.weight"])  # (B, T, C) o_proj has no bias
    x1 = x + o  # (B, T, C) residual 1
    h2, s_ln2 = vjp.rms_norm_forward(x1, p["post_attention_layernorm.weight"], eps=eps)  # (B, T, C)
    m, s_mlp = vjp.swiglu_forward(
        h2, p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"], p["mlp.down_proj.weight"]
    )  # (B, T, C)
    out = x1 + m  # (B, T, C) residual 2
    saved = {
        "input_layernorm": s_ln1,
        "self_attn.q_proj": s_q,
        "self_attn.k_proj": s_k,
        "self_attn.v_proj": s_v,
        "self_attn.q_rope": s_qr,
        "self_attn.k_rope": s_kr,
        "self_attn.attention": s_attn,
        "self_attn.o_proj": s_o,
        "post_attention_layernorm": s_ln2,
        "mlp": s_mlp,
    }
    return out, saved


def layer_backward(saved, grad_out):
    """grad_out: (B, T, C)  ->  (dx (B, T, C), dparams {name: grad} keyed like layer_forward's params)."""
    B, T, C = grad_out.shape
    _, H, _, D = saved["self_attn.attention"]["q"].shape
    Hkv = saved["self_attn.attention"]["k"].shape[1]
    # residual 2: out = x1 + mlp(norm(x1)) -> x1 gets grad_out directly plus the MLP path
    dh2, dw_gate, dw_up, dw_down = vjp.swiglu_backward(saved["mlp"], grad_out)  # (B, T, C)
    dx1_mlp, dw_ln2 = vjp.rms_norm_backward(saved["post_attention_layernorm"], dh2)  # (B, T, C)
    dx1 = grad_out + dx1_mlp  # (B, T, C)
    # residual 1: x1 = x + o_proj(attn(norm(x))) -> x gets dx1 directly plus the attention path
    da, dw_o, _ = vjp.linear_backward(saved["self_attn.o_proj"], dx1)  # (B, T, H*D)
    da = da.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
    dq, dk, dv = vjp.attention_backward(saved["self_attn.attention"], da)  # (B, H, T, D), (B, Hkv, T, D) x2
    dq, _, _ = vjp.rope_backward(saved["self_attn.q_rope"], dq)  # (B, H, T, D)
    dk, _, _ = vjp.rope_backward(saved["self_attn.k_rope"], dk)  # (B, Hkv, T, D)
    dq = dq.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
    dk = dk.transpose(1, 2).reshape(B, T, Hkv * D)  # (B, T, Hkv*D)
    dv = dv.transpose(1, 2).reshape(B, T, Hkv * D)  # (B, T, Hkv*D)
    dh_q, dw_q, db_q = vjp.linear_backward(saved["self_attn.q_proj"], dq)  # (B, T, C)
    dh_k, dw_k, db_k = vjp.linear_backward(saved["self_attn.k_proj"], dk)  # (B, T, C)
    dh_v, dw_v, db_v = vjp.linear_backward(saved["self_attn.v_proj"], dv)  # (B, T, C)
    dh = dh_q + dh_k + dh_v  # (B, T, C) the normalised x feeds three projections: grads add
    dx_attn, dw_ln1 = vjp.rms_norm_backward(saved["input_layernorm"], dh)  # (B, T, C)
    dx = dx1 + dx_attn  # (B, T, C)
    dparams = {
        "self_attn.q_proj.weight": dw_q,
        "self_attn.q_proj.bias": db_q,
        "self_attn.k_proj.weight": dw_k,
        "self_attn.k_proj.bias": db_k,
        "self_attn.v_proj.weight": dw_v,
        "self_attn.v_proj.bias": db_v,
        "self_attn.o_proj.weight": dw_o,
        "mlp.gate_proj.weight": dw_gate,
        "mlp.up_proj.weight": dw_up,
        "mlp.down_proj.weight": dw_down,
        "input_layernorm.weight": dw_ln1,
        "post_attention_layernorm.weight": dw_ln2,
    }
    return dx, dparams


# ----------------------------------------------------------------------------------------------
# the whole model and its loss


def model_loss_forward(model, input_ids, labels, attention_mask=None):
    """The loss of a transformers Qwen2ForCausalLM, by hand: embedding -> layers -> norm -> lm_head
    -> shifted cross-entropy (position t predicts labels[t+1]; ignore_index -100; mean over valid).

    model: a Qwen2ForCausalLM (parameters are read, never modified; no autograd graph is built);
    input_ids, labels: (B, T) integers.  Returns loss: () and saved (see `saved_inventory`).
    With tie_word_embeddings the lm_head reuses model.embed_tokens.weight (its grad gets both uses).
    Refuses: a padding attention_mask (right-pad and set those labels to -100 instead: with causal
    attention, padding at the end never reaches earlier positions), labels not shaped like
    input_ids, no valid label after the shift, and the config features `_check_config` refuses.
    """
    config = model.config
    _check_config(config)
    _require(
        attention_mask is None or bool((attention_mask == 1).all()),
        "model_loss_forward: padding masks are not supported; right-pad and set those labels to -100.",
    )
    _require(
        input_ids.dim() == 2, f"model_loss_forward: input_ids must be (B, T), got {tuple(input_ids.shape)}."
    )
    _require(
        labels.shape == input_ids.shape,
        f"model_loss_forward: labels must be shaped like input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}.",
    )
    B, T = input_ids.shape
    names = [name for name, _ in model.named_parameters()]
    params = {name: p.detach() for name, p in model.named_parameters()}
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    w_emb = params["model.embed_tokens.weight"]  # (V, C)
    w_head = w_emb if tied else params["lm_head.weight"]  # (V, C) the same tensor when tied
    x, s_emb = vjp.embedding_forward(input_ids, w_emb)  # (B, T, C)
    cos, sin = rope_cos_sin(config, T, dtype=x.dtype, device=x.device)  # (T, D) each
    layer_saved = []
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        lp = {n[len(prefix) :]: t for n, t in params.items() if n.startswith(prefix)}
        x, s = layer_forward(x, lp, cos, sin, config)  # (B, T, C)
        layer_saved.append(s)
    h, s_norm = vjp.rms_norm_forward(x, params["model.norm.weight"], eps=config.rms_norm_eps)  # (B, T, C)
    logits, s_head = vjp.linear_forward(h, w_head)  # (B, T, V)
    V = logits.shape[-1]
    pad = torch.full((B, 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)  # (B, 1)
    targets = torch.cat(
        (labels[:, 1:], pad), dim=1
    )  # (B, T) shift as HF: the last position has no next token
    ce_logits = logits.reshape(B * T, V).to(
        torch.promote_types(logits.dtype, torch.float32)
    )  # (B*T, V) HF upcasts to float32
    loss, s_ce = vjp.cross_entropy_forward(
        ce_logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="mean"
    )
    saved = {
        "model.embed_tokens": s_emb,
        "model.layers": layer_saved,
        "model.norm": s_norm,
        "lm_head": s_head,
        "loss": s_ce,
        "tied": tied,
        "param_names": names,
    }
    return loss, saved


def model_loss_backward(saved, grad_loss=1.0):
    """d loss / d every parameter: {name: grad}, keyed and ordered exactly like model.named_parameters().

    With tied embeddings named_parameters lists the shared weight once, as
    'model.embed_tokens.weight', and its grad is the embedding use plus the lm_head use.
    """
    s_ce, s_head = saved["loss"], saved["lm_head"]
    upstream_grad = torch.as_tensor(
        grad_loss, dtype=s_ce["probs"].dtype, device=s_ce["probs"].device
    )  # () d L / d loss
    dlogits, _ = vjp.cross_entropy_backward(s_ce, upstream_grad)  # (B*T, V)
    B, T, _ = s_head["x"].shape
    logits_dtype = torch.promote_types(s_head["x"].dtype, s_head["weight"].dtype)
    dlogits = dlogits.reshape(B, T, -1).to(logits_dtype)  # (B, T, V)
    dh, dw_head, _ = vjp.linear_backward(s_head, dlogits)  # (B, T, C), (V, C)
    dx, dw_norm = vjp.rms_norm_backward(saved["model.norm"], dh)  # (B, T, C)
    grads = {"model.norm.weight": dw_norm}
    for i in reversed(range(len(saved["model.layers"]))):
        dx, dparams = layer_backward(saved["model.layers"][i], dx)  # (B, T, C)
        grads.update({f"model.layers.{i}.{name}": grad for name, grad in dparams.items()})
    _, dw_emb = vjp.embedding_backward(saved["model.embed_tokens"], dx)  # (V, C)
    if saved["tied"]:
        grads["model.embed_tokens.weight"] = dw_emb + dw_head  # (V, C) one tensor, two uses: grads add
    else:
        grads["model.embed_tokens.weight"] = dw_emb
        grads["lm_head.weight"] = dw_head
    return {name: grads[name] for name in saved["param_names"]}


# ----------------------------------------------------------------------------------------------
# what was saved


def _key_name(key) -> str:
    """One step of a pytree key path: a dict's key, a list's index."""
    return str(key.key if hasattr(key, "key") else key.idx)


def saved_inventory(saved, prefix=""):
    """One row (name, shape, dtype, nbytes) per tensor in a (possibly composed) saved dict.

    Names are dotted paths, e.g. 'self_attn.attention.probs' or 'model.layers.0.mlp.gate'.
    A tensor saved again under another name (the same memory) is listed with the name
    '<name> (= <first name>)' and nbytes 0, so sum(nbytes) == vjp.saved_bytes(saved).
    Weights are listed too: they are references to parameters, not new memory
    (use vjp.saved_bytes(saved, exclude=model.parameters()) for activations only).
    """
    rows, first = [], {}
    for keys, node in tree_flatten_with_path(saved)[0]:  # dicts by key, lists by index, in order
        if not isinstance(node, torch.Tensor):
            continue
        path = ".".join([prefix] * bool(prefix) + [_key_name(k) for k in keys])  # 'mlp.gate', 'layers.0.x'
        key = (node.data_ptr(), node.nbytes)
        if key in first:
            rows.append((f"{path} (= {first[key]})", tuple(node.shape), node.dtype, 0))
        else:
            first[key] = path
            rows.append((path, tuple(node.shape), node.dtype, node.nbytes))
    return rows


# ----------------------------------------------------------------------------------------------
# the real modules as a float64 reference


FLOAT32_ISLANDS = {  # where transformers' Qwen2 computes in float32 even when the model is float64
    "Qwen2RMSNorm": "hidden_states.to(torch.float32)",
    "eager_attention_forward": "softmax(attn_weights, dtype=torch.float32)  (eager attention only; SDPA keeps the dtype)",
    "ForCausalLMLoss": "logits.float()  (the labels= loss)",
    "Qwen2RotaryEmbedding": "cos / sin from float32 angles  (an input: identical on both sides of a comparison)",
}
_PATCHABLE = ("Qwen2RMSNorm", "eager_attention_forward")


@contextlib.contextmanager
def hf_float64_reference(islands=_PATCHABLE):
    """Inside the block, transformers' Qwen2RMSNorm and eager attention keep float64 in float64.

    The stock modules compute in float32 even in a float64 model (FLOAT32_ISLANDS): RMSNorm converts
    its input with `hidden_states.to(torch.float32)` and eager attention runs
    `softmax(..., dtype=torch.float32)` (SDPA keeps the input dtype already). Inside the block the
    islands named in `islands` (default: both) compute in promote_types(dtype, float32), so float64
    stays float64 while float32 / bfloat16 / float16 models compute exactly as stock. The loss's
    `logits.float()` is not in a module: compute the loss with `causal_lm_loss` on the model's
    logits. RoPE's float32 angles stay: `rope_cos_sin` reproduces them, so both sides of a
    comparison read the same cos / sin. The patches are undone on exit, also after an exception.
    """
    from torch import nn
    from transformers.models.qwen2 import modeling_qwen2

    unknown = set(islands) - set(_PATCHABLE)
    _require(not unknown, f"hf_float64_reference: can remove only {_PATCHABLE}, not {sorted(unknown)}.")

    def rms_norm_keep_float64(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.promote_types(dtype, torch.float32))  # stock: .to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def eager_keep_float64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key = modeling_qwen2.repeat_kv(key, module.num_key_value_groups)
        value = modeling_qwen2.repeat_kv(value, module.num_key_value_groups)
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        compute = torch.promote_types(query.dtype, torch.float32)  # stock: dtype=torch.float32
        weights = nn.functional.softmax(weights, dim=-1, dtype=compute).to(query.dtype)
        weights = nn.functional.dropout(weights, p=dropout, training=module.training)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    stock_norm, stock_eager = modeling_qwen2.Qwen2RMSNorm.forward, modeling_qwen2.eager_attention_forward
    if "Qwen2RMSNorm" in islands:
        modeling_qwen2.Qwen2RMSNorm.forward = rms_norm_keep_float64
    if "eager_attention_forward" in islands:
        modeling_qwen2.eager_attention_forward = eager_keep_float64
    try:
        yield
    finally:
        modeling_qwen2.Qwen2RMSNorm.forward = stock_norm
        modeling_qwen2.eager_attention_forward = stock_eager


def _rel_gap(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(torch.finfo(torch.float64).tiny))


@torch.no_grad()
def float32_island_gaps(model, input_ids, labels):
    """{island: relative change of a float64 model's output it causes}, one entry per FLOAT32_ISLANDS.

    model: a float64 Qwen2ForCausalLM; input_ids, labels: (B, T). Each gap compares the stock
    computation with the same one in float64: RMSNorm and eager attention with and without their
    island (hf_float64_reference, eager attention switched on for its own entry), the loss of
    `labels=` against `causal_lm_loss` on the float64 logits, HF's RoPE cos / sin against angles
    computed in float64. A gap at float32's rounding level (≈ 1e-8) is the island; 0 would mean
    there is none. Refuses a model that is not float64.
    """
    _require(
        next(model.parameters()).dtype == torch.float64, "float32_island_gaps: the model must be float64."
    )
    config, gaps = model.config, {}
    stock = model(input_ids=input_ids, labels=labels)
    with hf_float64_reference(islands=("Qwen2RMSNorm",)):
        gaps["Qwen2RMSNorm"] = _rel_gap(stock.logits, model(input_ids=input_ids).logits)
    attention = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        with hf_float64_reference(islands=("Qwen2RMSNorm",)):
            eager_stock = model(input_ids=input_ids).logits
        with hf_float64_reference():
            gaps["eager_attention_forward"] = _rel_gap(eager_stock, model(input_ids=input_ids).logits)
    finally:
        config._attn_implementation = attention
    gaps["ForCausalLMLoss"] = _rel_gap(stock.loss, causal_lm_loss(stock.logits, labels))
    T = input_ids.shape[1]
    positions = torch.arange(T, device=input_ids.device)[None]  # (1, T)
    probe = torch.zeros((), dtype=torch.float64, device=input_ids.device)
    hf_cos, _ = model.model.rotary_emb(probe, positions)  # (1, T, D) in the probe's dtype
    _, theta = _rope_parameters(config)
    _, _, D = _head_dims(config)
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, D, 2, dtype=torch.float64, device=probe.device) / D)
    )  # (D/2,) float64
    angles = positions[0, :, None].double() * inv_freq[None, :]  # (T, D/2)
    gaps["Qwen2RotaryEmbedding"] = _rel_gap(hf_cos[0], torch.cat((angles, angles), dim=-1).cos())
    return gaps


def causal_lm_loss(logits, labels):
    """HF's causal-LM loss in the logits' own dtype (HF's `labels=` path upcasts to float32 only):
    position t predicts labels[t + 1]; labels -100 are ignored; the mean over the rest.

    logits: (B, T, V), labels: (B, T)  ->  loss: ().
    """
    V = logits.shape[-1]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )


# ----------------------------------------------------------------------------------------------
# benchmark: python -m trainmech.vjp_qwen2 --benchmark


def benchmark(
    model="qwen2-small", batch=2, seq=128, repeats=30, warmup=5, seed=0, attn_implementation="sdpa"
):
    """Time one decoder layer's backward, by hand (layer_backward) and by autograd (the real HF
    layer, `out.backward(grad_out)`), on the CPU, in float32, interleaved in one run.

    `model` is a model of the TRAIN-CPU profile. Each repeat runs both forwards untimed and times
    the two backwards, alternating which goes first. Before timing, a correctness gate: dx and
    every parameter gradient within 1e-4 (relative) of autograd's. Returns a dict of medians (s)
    and the ratio by hand / autograd; prints them with the fastest repeat of each beside.
    """
    from trainmech import profiles, workload
    from trainmech.checks import rel_error

    spec = profiles.load("TRAIN-CPU").model(model)
    built = workload.build_model(spec, seed=seed, attn_implementation=attn_implementation)
    layer, config = built.model.model.layers[0], built.model.config
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, config.hidden_size, generator=gen)  # (B, T, C)
    grad_out = torch.randn(batch, seq, config.hidden_size, generator=gen)  # (B, T, C) upstream gradient
    cos, sin = rope_cos_sin(config, seq)
    params = layer_params(layer)
    mask = (
        None if attn_implementation == "sdpa" else torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    )

    def by_hand():
        _, saved = layer_forward(x, params, cos, sin, config)
        start = time.perf_counter()
        grads = layer_backward(saved, grad_out)
        return time.perf_counter() - start, grads

    def by_autograd():
        layer.zero_grad(set_to_none=True)
        x_leaf = x.clone().requires_grad_(True)
        out = layer(x_leaf, attention_mask=mask, position_embeddings=(cos[None], sin[None]))
        start = time.perf_counter()
        out.backward(grad_out)
        seconds = time.perf_counter() - start
        return seconds, (x_leaf.grad, {name: p.grad for name, p in layer.named_parameters()})

    _, (dx, dparams) = by_hand()
    _, (ref_dx, ref_dparams) = by_autograd()
    worst = max(rel_error(dx, ref_dx)[1], *(rel_error(dparams[n], ref_dparams[n])[1] for n in ref_dparams))
    if not worst <= 1e-4:
        raise RuntimeError(
            f"correctness gate failed: relative gradient error {worst:.1e} > 1e-4; timing skipped"
        )

    times = {"by_hand": [], "autograd": []}
    for i in range(warmup + repeats):
        pair = [("by_hand", by_hand), ("autograd", by_autograd)]
        for name, fn in pair if i % 2 == 0 else pair[::-1]:
            seconds, _ = fn()
            if i >= warmup:
                times[name].append(seconds)
    result = {name: statistics.median(ts) for name, ts in times.items()}
    result["ratio"] = result["by_hand"] / result["autograd"]
    fastest = {
        name: min(ts) for name, ts in times.items()
    }  # the least disturbed repeat: robust on a busy machine
    print(
        f"one Qwen2 decoder layer backward: {spec.model_id} (hidden {config.hidden_size}, heads "
        f"{config.num_attention_heads}/{config.num_key_value_heads}, intermediate {config.intermediate_size}), "
        f"batch {batch} x seq {seq}, float32, CPU, {torch.get_num_threads()} threads, attention {attn_implementation}"
    )
    print(
        f"correctness gate: dx and {len(ref_dparams)} parameter grads within 1e-4 of autograd (worst {worst:.1e})"
    )
    print(f"{repeats} interleaved repeats after {warmup} warm-up; forwards untimed")
    print(
        f"  by hand  (layer_backward)     median {result['by_hand'] * 1e3:8.3f} ms   fastest {fastest['by_hand'] * 1e3:8.3f} ms"
    )
    print(
        f"  autograd (HF layer .backward) median {result['autograd'] * 1e3:8.3f} ms   fastest {fastest['autograd'] * 1e3:8.3f} ms"
    )
    print(
        f"  ratio by hand / autograd      median {result['ratio']:.2f}   fastest {fastest['by_hand'] / fastest['autograd']:.2f}"
    )
    return result


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m trainmech.vjp_qwen2",
        description="Hand-written Qwen2 backward: benchmark against autograd.",
    )
    parser.add_argument(
        "--benchmark", action="store_true", help="time one layer's backward, by hand vs autograd"
    )
    parser.add_argument(
        "--model", default="qwen2-small", help="a TRAIN-CPU profile model (default qwen2-small)"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="the HF layer's attention")
    args = parser.parse_args()
    if not args.benchmark:
        parser.error("nothing to do: pass --benchmark")
    benchmark(args.model, args.batch, args.seq, args.repeats, args.warmup, attn_implementation=args.attn)
