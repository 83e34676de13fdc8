"""Reference solutions of the exercises (练习) at the end of the Task notebooks.

Try an exercise first; `trainmech.exercises.check` tells you what is off without reading this.
One function per exercise id (`SOLUTIONS`); the checks never read this module — the tests feed
these functions to them to prove that every check accepts a correct answer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# ============================================================================= Task0


def sgd_momentum_update(theta, grad, buf, *, lr, momentum, weight_decay):
    """torch.optim.SGD(momentum, weight_decay) by hand: returns (theta_new, buf_new); buf is None at first."""
    d = grad + weight_decay * theta  # weight decay enters the gradient first
    buf = d.clone() if buf is None else momentum * buf + d  # the first update starts the buffer at d
    return theta - lr * buf, buf


def adamw_first_update(theta0, grad, *, lr, weight_decay, eps):
    """AdamW's first update: bias-corrected m̂ = g, v̂ = g², so θ₁ = θ₀(1 − ηλ) − η g / (|g| + ε)."""
    return theta0 * (1 - lr * weight_decay) - lr * grad / (grad.abs() + eps)


# ============================================================================= Task1


def residual_vjp(W, x, v):
    """y = x + tanh(W x), upstream v = dL/dy  ->  (dx, dW)."""
    g = torch.tanh(W @ x)  # (n,) the branch's output, what tanh's backward reads
    ubar = v * (1 - g * g)  # (n,) upstream gradient at u = W x
    dx = v + W.T @ ubar  # identity path + branch path: the two gradients add
    dW = torch.outer(ubar, x)  # (n, n) ū xᵀ
    return dx, dW


def tied_embedding_grad(E, ids, G):
    """h = E[ids], z = h Eᵀ, upstream G = dL/dz  ->  dE: the head's share plus the lookup's share."""
    h = E[ids]  # (T, C)
    dE = G.T @ h  # (V, C) the head: z = h Eᵀ, so dE = Gᵀ h
    dE.index_add_(0, ids, G @ E)  # (V, C) the lookup: dh = G E, added into the rows looked up (ids repeat)
    return dE


# ============================================================================= Task2


def rms_norm_backward(saved, grad_out):
    """saved = {x (..., C), weight (C,), rstd (..., 1)}, grad_out (..., C)  ->  (dx, dw)."""
    x, w, rstd = saved["x"], saved["weight"], saved["rstd"]
    C = x.shape[-1]
    n = x * rstd  # (..., C) recomputed
    dw = (grad_out * n).reshape(-1, C).sum(0)  # (C,) summed over every position
    g = grad_out * w  # (..., C) the gradient reaching n
    dx = rstd * (g - n * (g * n).mean(-1, keepdim=True))  # term 1: direct; term 2: through rstd
    return dx, dw


def attention_backward(saved, grad_out):
    """saved = {q (B, H, T, D), k, v (B, Hkv, Tk, D), probs (B, H, T, Tk), scale}  ->  (dq, dk, dv)."""
    q, k, v, P, s = saved["q"], saved["k"], saved["v"], saved["probs"], saved["scale"]
    B, H, T, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv  # query heads per kv head
    qg, Pg = q.reshape(B, Hkv, G, T, D), P.reshape(B, Hkv, G, T, Tk)
    dO = grad_out.reshape(B, Hkv, G, T, D)
    kg, vg = k.unsqueeze(2), v.unsqueeze(2)  # (B, Hkv, 1, Tk, D) shared by the group
    dv = (Pg.transpose(-1, -2) @ dO).sum(2)  # (B, Hkv, Tk, D) O = P V; the group's heads add
    dP = dO @ vg.transpose(-1, -2)  # (B, Hkv, G, T, Tk)
    dS = Pg * (dP - (dP * Pg).sum(-1, keepdim=True)) * s  # softmax backward, then the scale
    dq = (dS @ kg).reshape(B, H, T, D)
    dk = (dS.transpose(-1, -2) @ qg).sum(2)  # (B, Hkv, Tk, D)
    return dq, dk, dv


def cross_entropy_backward(saved, grad_out):
    """saved = {probs (N, V), targets (N,), ignore_index, reduction, n_valid}, grad_out ()  ->  dlogits (N, V)."""
    probs, targets = saved["probs"], saved["targets"]
    valid = targets != saved["ignore_index"]  # (N,)
    onehot = F.one_hot(torch.where(valid, targets, 0), probs.shape[1]).to(probs.dtype)
    scale = grad_out / saved["n_valid"] if saved["reduction"] == "mean" else grad_out
    return torch.where(valid[:, None], probs - onehot, 0) * scale


# ============================================================================= Task3


def streaming_window(model, micro_batches):
    """One pass over the window: backward each micro-batch's summed token loss, count N on the way, divide .grad once."""
    N, total = 0, 0.0
    for mb in micro_batches:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits  # (B_i, T_i, V)
        token_losses = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(),
            mb["labels"][:, 1:].flatten(),
            ignore_index=-100,
            reduction="sum",
        )
        token_losses.backward()  # adds S_i's gradient into .grad
        N += int((mb["labels"][:, 1:] != -100).sum())  # after the causal shift
        total += token_losses.item()
    with torch.no_grad():
        for p in model.parameters():  # a tied weight appears once: divided once
            if p.grad is not None:
                p.grad.div_(N)
    return total / N


def scheduled_lrs(stepped, base_lr, wsd):
    """The LR of each attempt read from the update clock, and the step logged after each attempt."""
    from trainmech.update import wsd_multiplier

    effective, lrs, logged = 0, [], []
    for s in stepped:
        lrs.append(base_lr * wsd_multiplier(effective, **wsd))  # read before the attempt
        effective += bool(s)  # only an effective update moves the clock
        logged.append(effective)
    return lrs, logged


# ============================================================================= Task4


def layer_saved_bytes(cfg, batch, seq):
    """Bytes one Qwen2 decoder layer keeps for its backward: fp32, CPU (SDPA's flash kernel)."""
    b, s, h, inner = batch, seq, cfg.hidden_size, cfg.intermediate_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = h // heads
    norm = 3 * b * s * h + b * s  # input (fp32), normed, output; rsqrt per row
    attention = (
        b * s * heads * d + 2 * b * s * kv * d + b * s * heads * d + b * heads * s
    )  # q, k, v, out, logsumexp
    mlp = 4 * b * s * inner  # gate, up, silu(gate), silu(gate) * up
    return 4 * (2 * norm + attention + mlp)


def gradient_lifecycle(model):
    """{(created phase, released phase): bytes} of the gradients in one training step."""
    out = {}
    for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
        if name.startswith("model.layers."):
            created = "backward.layer." + name.split(".")[2]
        elif name.startswith("model.embed_tokens"):
            created = "backward.embed"  # tied: the head's share waits there for the lookup's
        else:
            created = "backward.head"  # the final norm (and an untied lm_head)
        key = (created, "zero_grad")  # read by the update, released by zero_grad(set_to_none=True)
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out


def predict_peak(cfg, batch, seq):
    """(peak phase, bytes by category) of a steady fp32 AdamW update on the CPU: the largest of three moments."""
    b, s, h, v, n_layers = batch, seq, cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    tied, d = cfg.tie_word_embeddings, h // cfg.num_attention_heads
    sizes = []  # parameter tensors in named_parameters() order
    q, kv, inner = h, cfg.num_key_value_heads * d, cfg.intermediate_size
    per_layer = [q * h, q, kv * h, kv, kv * h, kv, h * q, inner * h, inner * h, h * inner, h, h]
    sizes = [v * h] + per_layer * n_layers + [h] + ([] if tied else [v * h])
    n = sum(sizes)
    params, grads, moments = 4 * n, 4 * n, 8 * n + 4 * len(sizes)  # + one fp32 step counter per tensor
    saved = n_layers * layer_saved_bytes(cfg, b, s) + 2 * s * d * 4  # every layer, and RoPE's cos / sin
    saved += 4 * (3 * b * s * h + b * s) + 4 * b * s * v + 4  # final norm, log-softmax, the loss
    at = {
        "backward.loss": {
            "parameters": params,
            "optimizer_states": moments,
            "saved": saved,
            "upstream_grads": 2 * 4 * b * s * v + 4,
        },  # NLL grad and dlogits (fp32), the seed
        "optimizer": {
            "parameters": params,
            "gradients": grads,
            "optimizer_states": moments,
            "workspace": 4 * max(p + 2 * c for p, c in zip([0] + sizes, sizes)),
        },  # the loop's sqrt temporaries
    }
    if tied:  # the head's and the lookup's shares of the tied gradient, and their sum
        at["backward.embed"] = {
            "parameters": params,
            "gradients": grads,
            "optimizer_states": moments,
            "saved": 4,
            "upstream_grads": 2 * 4 * v * h + 4,
        }
    phase = max(at, key=lambda p: sum(at[p].values()))
    return phase, at[phase]


def fsdp_held_bytes(model, world_size, rank):
    """Bytes one rank holds after an FSDP2 AdamW update (fp32): padded shards of parameters and gradients,
    the moments of its own rows and one step counter per tensor."""
    padded = own = tensors = 0
    for p in model.parameters():  # a tied weight is listed once
        rows, per_row = p.shape[0], p.numel() // p.shape[0]
        chunk = -(-rows // world_size)  # every rank stores ceil(rows / N) rows ...
        padded += chunk * per_row
        own += max(0, min(chunk, rows - rank * chunk)) * per_row  # ... of which these are its own
        tensors += 1
    return {"parameters": 4 * padded, "gradients": 4 * padded, "optimizer_states": 8 * own + 4 * tensors}


# ============================================================================= Task5


def make_offload_hooks(keep):
    """(pack, unpack): parameters stay in place; every other saved tensor is copied to the host and back."""
    kept = {p.untyped_storage().data_ptr() for p in keep}

    def pack(t):
        if t.untyped_storage().data_ptr() in kept:
            return t.detach()  # resident anyway
        return t.device, t.to("cpu", copy=True)  # copy=True: on a CPU .to("cpu") would return t itself

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device)

    return pack, unpack


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)  # the only saved tensor
        return fn(x)  # grad mode is off here: fn saves nothing

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(True)
            out = ctx.fn(x_)  # the recomputation
        torch.autograd.backward(out, grad_out)  # fills x_.grad and the parameters' .grad
        return None, x_.grad


def my_checkpoint(fn, x):
    """fn(x), keeping only x for the backward and recomputing fn there."""
    return _Checkpoint.apply(fn, x)


# ============================================================================= Task6


def gradient_gate(reference, candidate, rtol):
    """(passed, errors): e_p = max|g_c − g_r| / max(max|g_r|, 1e-3 · largest |g_r|); inf when missing."""
    top = max(float(g.abs().max()) for g in reference.values())
    errors = {}
    for name, g in reference.items():
        if name not in candidate:
            errors[name] = math.inf
            continue
        scale = max(float(g.abs().max()), 1e-3 * top, torch.finfo(torch.float64).tiny)
        errors[name] = float((candidate[name].double() - g.double()).abs().max()) / scale
    return all(e <= rtol for e in errors.values()), errors  # NaN <= rtol is False


def update_gate(reference, candidate, expected_lrs):
    """(passed, message) from two tracing.Trace: effective updates, finiteness, optimizer and scheduler on the clock."""
    effective = sum(s and f for s, f in zip(candidate.stepped, candidate.finite))
    want = sum(s and f for s, f in zip(reference.stepped, reference.finite))
    mismatch = next((k for k, (a, b) in enumerate(zip(candidate.lrs, expected_lrs)) if a != b), None)
    problems = [
        (candidate.error is not None, f"the run stopped: {candidate.error}"),
        (not all(candidate.finite), "a non-finite value was written into the parameters"),
        (effective != want, f"{effective} effective updates, the reference made {want}"),
        (
            candidate.optimizer_steps != effective,
            f"the optimizer counted {candidate.optimizer_steps} steps for {effective} effective updates",
        ),
        (
            candidate.scheduler_steps != effective,
            f"the scheduler moved {candidate.scheduler_steps} times for {effective} effective updates",
        ),
        (mismatch is not None, f"effective update {mismatch} did not run at the clock's learning rate"),
    ]
    for failed, message in problems:
        if failed:
            return False, message
    return True, f"{effective} effective updates; optimizer, scheduler and learning rate follow the clock"


SOLUTIONS = {
    "task0.sgd_momentum_update": sgd_momentum_update,
    "task0.adamw_first_update": adamw_first_update,
    "task1.residual_vjp": residual_vjp,
    "task1.tied_embedding_grad": tied_embedding_grad,
    "task2.rms_norm_backward": rms_norm_backward,
    "task2.attention_backward": attention_backward,
    "task2.cross_entropy_backward": cross_entropy_backward,
    "task3.streaming_window": streaming_window,
    "task3.scheduled_lrs": scheduled_lrs,
    "task4.layer_saved_bytes": layer_saved_bytes,
    "task4.gradient_lifecycle": gradient_lifecycle,
    "task4.predict_peak": predict_peak,
    "task4.fsdp_held_bytes": fsdp_held_bytes,
    "task5.offload_hooks": make_offload_hooks,
    "task5.checkpoint": my_checkpoint,
    "task6.gradient_gate": gradient_gate,
    "task6.update_gate": update_gate,
}

__all__ = ["SOLUTIONS", *(f.__name__ for f in SOLUTIONS.values())]  # one function per exercise
