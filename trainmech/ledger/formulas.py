"""Published memory formulas, each with its source, beside the ledger (which counts instead of assuming).

zero_bytes_per_device       model-state bytes per device under ZeRO stages 0-3 (Rajbhandari et al.)
zero_communication_volume   elements each device moves per update under ZeRO (same paper, §7)
korthikanti_activation_bytes activation bytes per GPT-style layer (Korthikanti et al.)
korthikanti_differences     that formula against a Qwen2 layer's inventory, as five named terms
deepspeed_zero2_gpu_bytes / deepspeed_zero3_gpu_bytes   DeepSpeed's own model-state estimators
"""

from __future__ import annotations

from trainmech.errors import TrainmechError

__all__ = [
    "zero_bytes_per_device",
    "zero_communication_volume",
    "korthikanti_activation_bytes",
    "korthikanti_differences",
    "deepspeed_zero2_gpu_bytes",
    "deepspeed_zero3_gpu_bytes",
]


def zero_bytes_per_device(n_params: float, n_devices: int, stage: int, k: float = 12) -> float:
    """Model-state bytes per device under ZeRO data parallelism (optimizer states, gradients, parameters).

    Source: Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models", SC 2020 (arXiv:1910.02054), §3.1 and Figure 1. Mixed-precision Adam keeps
    2Ψ bytes of fp16 parameters, 2Ψ of fp16 gradients and KΨ of optimizer states (K = 12: fp32
    master parameters, momentum and variance). Stage 1 (P_os) partitions the optimizer states over
    N_d devices, stage 2 (P_os+g) the gradients too, stage 3 (P_os+g+p) the parameters too:
    stage 0: (2+2+K)Ψ;  1: 4Ψ + KΨ/N_d;  2: 2Ψ + (2+K)Ψ/N_d;  3: (2+2+K)Ψ/N_d.
    The paper's row for Ψ = 7.5e9, N_d = 64: 120 / 31.4 / 16.6 / 1.9 GB (1 GB = 1e9 bytes).
    Refuses a stage outside 0–3, n_devices < 1, negative n_params or k.
    """
    _check_stage(stage, n_devices)
    if n_params < 0 or k < 0:
        raise TrainmechError(f"need n_params >= 0 and k >= 0; got {n_params}, {k}")
    psi, n = float(n_params), float(n_devices)
    return [(2 + 2 + k) * psi, 4 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (2 + 2 + k) * psi / n][
        stage
    ]


def zero_communication_volume(n_params: float, stage: int) -> float:
    """Elements each device sends and receives per update, as the ZeRO paper counts them (§7).

    Data parallelism all-reduces the gradients: a reduce-scatter and an all-gather, 2Ψ. Stages 1
    and 2 reduce-scatter the gradients (Ψ) and all-gather the updated parameters (Ψ): 2Ψ, no more
    than data parallelism. Stage 3 all-gathers the parameters twice, for the forward and again for
    the backward, and reduce-scatters the gradients once: 3Ψ, 1.5× data parallelism.
    """
    _check_stage(stage, 1)
    return (3.0 if stage == 3 else 2.0) * float(n_params)


_MATH_UPCAST = ("self_attn.q_scaled", "self_attn.k_scaled_t", "self_attn.v_repeated")  # fp32 under math


def korthikanti_differences(shape, batch: int, seq: int, inventory) -> dict[str, int]:
    """Where a Qwen2 layer (16-bit activations) differs from Korthikanti's GPT layer, sbh(34 + 5as/h), as five
    named terms in bytes (positive: Qwen2 keeps more). shape: a ledger ModelShape; inventory: the layer's
    saved tensors (`ledger.layer_saved`, 16-bit, the kernel that runs), from whose rows every term is read:
    the norms' fp32 input, rsqrt and normalised x; K and V as that kernel keeps them (at kv_heads, or
    repeated to every head: math, a mask, a kernel refusing enable_gqa); what the kernel keeps besides q,
    k, v and its output (the fp32 logsumexp, RNG state, math's s×s probabilities, a mask's bias, and the
    fp32 half of math's upcast q, k and v: `_MATH_UPCAST`); the MLP's four tensors of width I.

    The terms are arithmetic: the rows left over (Q, the attention output o_proj reads, the two norms'
    outputs the projections read) are the formula's 8sbh, so the formula plus the five terms is the
    inventory's total for every kernel, with or without a mask (refused otherwise). The check of the
    decomposition is the measured layer against the inventory, not this sum.
    """
    s, b, h, a = seq, batch, shape.hidden_size, shape.num_heads  # the paper's symbols
    groups = {"norms": 0, "kv": 0, "kernel": 0, "mlp": 0, "rest": 0}
    for t in inventory:
        name, nbytes = t.name, t.nbytes
        if name in _MATH_UPCAST and t.element_bytes == 4:  # math's fp32 copy: its 16-bit half where GPT's is
            groups["kernel"] += nbytes // 2
            nbytes //= 2
        if name.startswith(("input_layernorm.", "post_attention_layernorm.")) and not name.endswith(".out"):
            groups["norms"] += nbytes
        elif name.startswith(("self_attn.k_", "self_attn.v")):
            groups["kv"] += nbytes
        elif any(k in name for k in ("logsumexp", "rng", "probs", "mask_bias")):
            groups["kernel"] += nbytes
        elif name.startswith("mlp."):
            groups["mlp"] += nbytes
        else:
            groups["rest"] += nbytes
    if groups["rest"] != 4 * 2 * s * b * h:
        raise TrainmechError(
            f"korthikanti_differences reads a 16-bit layer's inventory: Q, the attention output and the norms' "
            f"outputs should be 8sbh = {8 * s * b * h:,} bytes, got {groups['rest']:,}"
        )
    return {
        "RMSNorm (fp32 input, rsqrt, normed)": groups["norms"] - 4 * s * b * h,
        "grouped-query attention (K, V)": groups["kv"] - 4 * s * b * h,
        "no dropout (masks, dropout output)": -(2 * s * b * h + 3 * a * s * s * b),
        "SDPA kernel (kept beyond 16-bit q, k, v, out)": groups["kernel"] - 2 * a * s * s * b,
        "SwiGLU (4 tensors of width I)": groups["mlp"] - 16 * s * b * h,
    }


def _check_stage(stage: int, n_devices: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise TrainmechError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise TrainmechError(f"n_devices must be an integer >= 1, got {n_devices!r}")


def korthikanti_activation_bytes(
    s: int, b: int, h: int, a: int, *, t: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes per transformer layer of a GPT-style model (16-bit activations, 1-byte dropout masks).

    Source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
    MLSys 2023 (arXiv:2205.05198), §4 and Table 2. s sequence, b micro-batch, h hidden, a heads,
    t tensor-parallel degree:
      no parallelism              sbh (34 + 5as/h)
      tensor parallel             sbh (10 + 24/t + 5as/(ht))
      tensor + sequence parallel  sbh (34/t + 5as/(ht))
      selective recompute         sbh (10 + 24/t), with sequence parallel sbh (34/t)
      full recompute              2sbh (only each layer's input is kept)
    The 34 counts the LayerNorm inputs, the QKV/projection/MLP inputs, the GeLU input and output and
    the dropout masks; 5as/h counts the attention scores, softmax output and its dropout (s² terms).
    Refuses recompute other than "none" / "selective" / "full" and non-positive sizes.
    """
    if recompute not in ("none", "selective", "full"):
        raise TrainmechError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    if min(s, b, h, a, t) <= 0:
        raise TrainmechError(f"s, b, h, a and t must be positive, got {s}, {b}, {h}, {a}, {t}")
    sbh = float(s) * b * h
    if recompute == "full":
        return 2 * sbh
    linear = 34 / t if sequence_parallel else 10 + 24 / t  # the terms that scale with sbh
    scores = 0.0 if recompute == "selective" else 5 * a * s / (h * t)  # the s² attention terms
    return sbh * (linear + scores)


def deepspeed_zero2_gpu_bytes(n_params: int, n_devices: int = 1) -> int:
    """DeepSpeed's estimate of model-state bytes per GPU for ZeRO-2 without offload: 4Ψ + 16Ψ/N.

    Source: `estimate_zero2_model_states_mem_needs` in deepspeed/runtime/zero/stage_1_and_2.py, the
    function behind DeepSpeed's "Memory Requirements" page. Model states only: no activations.
    """
    _check_stage(2, n_devices)
    return 4 * n_params + int(16 * n_params / n_devices)


def deepspeed_zero3_gpu_bytes(n_params: int, largest_layer_params: int, n_devices: int = 1) -> int:
    """DeepSpeed's estimate for ZeRO-3 without offload: 4 × the largest layer's parameters + 18Ψ/N.

    Source: `estimate_zero3_model_states_mem_needs` in deepspeed/runtime/zero/stage3.py. Model states
    only; the largest layer is gathered whole while it computes.
    """
    _check_stage(3, n_devices)
    return 4 * largest_layer_params + int(18 * n_params / n_devices)
