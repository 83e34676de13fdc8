"""What a decoder layer keeps for its backward: the saved-tensor inventory, kernel by kernel.

Read off the installed transformers' Qwen2 modules and PyTorch's autograd formulas and SDPA
kernels, and checked against `trainmech.measure` on CPU. The attention part depends on the SDPA
kernel PyTorch dispatches, which depends on the device, the dtype, the attention mask, the GPU and
the torch and cuDNN versions. Two answers, never mixed up:

- `attention_kernel`: the ledger's rule, for paper calculations (a GPU it cannot see). On a CPU it
  is what the pinned torch dispatches; on CUDA it depends on the stack (`SdpaStack`: the torch
  version, and the GPU and cuDNN where a run sees them), and a torch it was not written for can
  break it.
- `kernel_of_ops`: the kernel a run really dispatched, read from the ATen ops a tracked forward
  created its storages with (`trainmech.ledger.compare.measure_point` predicts with that one).

The RNG state an SDPA kernel keeps (`rng_state_saved`) is weighed on the GPU only when the caller
measures there (`weigh=True`: a CUDA run's own points): the kernel's op runs once on small tensors and
its seed and offset outputs are weighed. Otherwise (paper calculations, on any machine) the shapes come
from torch's meta kernels, and where they live is the rule's: the same bytes on every machine.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from trainmech.errors import TrainmechError
from trainmech.ledger.recipes import FP32_BYTES, recipe
from trainmech.ledger.shape import ModelShape

__all__ = [
    "ATTENTION",
    "KERNELS",
    "DEVICES",
    "SavedTensor",
    "EFFICIENT_GQA_SINCE",
    "CUDNN_FIRST_SINCE",
    "CUDNN_FIRST_ABOVE",
    "CUDNN_FIRST_GPUS",
    "SdpaStack",
    "sdpa_stack",
    "attention_kernel",
    "kernel_of_ops",
    "norm_saved",
    "attention_saved",
    "RNG_OUTPUTS",
    "rng_state_saved",
    "layer_saved",
]

KERNELS = ("flash", "efficient", "cudnn", "math")  # SDPA's kernels, as far as memory is concerned
ATTENTION = ("auto", *KERNELS)
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class SavedTensor:
    """One row of a layer's saved-tensor inventory."""

    name: str
    shape: tuple[int, ...]
    element_bytes: int
    consumed_at: str  # the layer's backward moment that releases it
    own: bool = True  # False: another state's output, kept by reference (the fp32 residual stream)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.element_bytes


# The first torch (major, minor) whose CUDA memory-efficient kernel takes enable_gqa (pytorch PR #191085,
# after torch 2.13: 2.13's meta kernel of its backward still gives grad_k and grad_v the query's heads, and
# its scaled_dot_product_attention docstring says grouped-query attention runs on flash and math only).
# An assumption about a release this project has not run: a GPU run prints the rule beside the kernel
# that ran (`trainmech.ledger.compare.Comparison.kernel_line`).
EFFICIENT_GQA_SINCE = (2, 14)
# cuDNN's kernel goes first in SDPA's priority order on sm90 / sm100 (sm90, sm100 and sm103 on a CUDA < 13
# build) when torch runs a cuDNN newer than 9.15.0 (sdp_utils.cpp, check_prefer_cudnn_attention, since torch
# 2.10) and TORCH_CUDNN_SDPA_DEPRIORITIZED is not set; it takes only 16-bit inputs, and an attention mask.
CUDNN_FIRST_SINCE = (2, 10)
CUDNN_FIRST_ABOVE = 91500
CUDNN_FIRST_GPUS = (9, 10)  # compute capability majors: H100 / H200, B200


@dataclass(frozen=True)
class SdpaStack:
    """What CUDA's SDPA dispatch depends on besides the call itself.

    torch: the torch version ("2.11.0+cu130"). The GPU's facts are known only where a run sees its GPU
    (None otherwise): capability, the GPU's compute capability (major, minor); cudnn, the cuDNN version
    torch runs (torch.backends.cudnn.version(), e.g. 91501); cuda_build, the CUDA version torch was built
    with ("13.0"); cudnn_deprioritized, the environment sets TORCH_CUDNN_SDPA_DEPRIORITIZED; deterministic,
    torch.use_deterministic_algorithms(True) without warn_only, which refuses cuDNN's SDPA
    (sdp_utils.cpp, check_cudnn_deterministic).
    """

    torch: str
    capability: tuple[int, int] | None = None
    cudnn: int | None = None
    cuda_build: str | None = None
    cudnn_deprioritized: bool = False
    deterministic: bool = False

    @property
    def torch_minor(self) -> tuple[int, int]:
        """(major, minor) of `torch`."""
        found = re.match(r"(\d+)\.(\d+)", self.torch)
        if not found:
            raise TrainmechError(
                f"torch version {self.torch!r} is not major.minor[.patch], e.g. '2.13.0+cpu'"
            )
        return int(found[1]), int(found[2])

    @property
    def cudnn_first(self) -> bool:
        """SDPA tries cuDNN's kernel first on this stack (False where the GPU or cuDNN is unknown)."""
        if self.cudnn_deprioritized or self.capability is None or self.cudnn is None:
            return False
        major, minor = self.capability
        new_cuda = self.cuda_build is not None and int(self.cuda_build.split(".")[0]) >= 13
        return (
            self.torch_minor >= CUDNN_FIRST_SINCE
            and self.cudnn > CUDNN_FIRST_ABOVE
            and major in CUDNN_FIRST_GPUS
            and (new_cuda or minor in (0, 3))
        )

    def describe(self) -> str:
        """One line: the facts the rule read (a GPU's only where known)."""
        parts = [f"torch {self.torch}"]
        if self.capability is not None:
            parts.append(f"sm{self.capability[0]}{self.capability[1]}")
        if self.cudnn is not None:
            parts.append(f"cuDNN {self.cudnn}")
        if self.cudnn_deprioritized:
            parts.append("TORCH_CUDNN_SDPA_DEPRIORITIZED set")
        if self.deterministic:
            parts.append("deterministic algorithms")
        return ", ".join(parts)


def sdpa_stack(capability: tuple[int, int] | None = None, cuda_build: str | None = None) -> SdpaStack:
    """This process's stack: its torch and TORCH_CUDNN_SDPA_DEPRIORITIZED, and with the GPU `capability`
    and `cuda_build` the caller read from its device (torch.cuda.get_device_capability, torch.version.cuda)
    the cuDNN torch runs; no capability: no GPU seen (a paper calculation)."""
    import os

    import torch

    return SdpaStack(
        torch.__version__,
        None if capability is None else (int(capability[0]), int(capability[1])),
        torch.backends.cudnn.version() if capability is not None else None,
        cuda_build,
        os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower() in ("1", "true", "yes", "on"),
        capability is not None  # a GPU's fact, as cuDNN's version: read only where a run sees its GPU
        and torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def attention_kernel(
    shape: ModelShape,
    recipe_name: str,
    device: str,
    attention: str = "auto",
    *,
    padded: bool = False,
    dropout: bool | float = False,
    stack: SdpaStack | None = None,
) -> str:
    """The ledger's rule for the SDPA kernel of this layer (flash / efficient / cudnn / math).

    dropout: the attention dropout probability, or a bool (True: a probability on cuDNN's 1/16 grid).

    CPU: its flash kernel, for any dtype, with or without a mask, as long as there is no attention
    dropout; with dropout_p > 0 (a config's attention_dropout, in train mode) the math composite, whose
    softmax is followed by a dropout (torch 2.13's sdp_utils_cpp.cpp: the CPU flash kernel's constraints
    include check_for_dropout; measured by tests/test_task4_ledger.py). CUDA, dropout or not (its flash,
    memory-efficient and cuDNN kernels take a dropout_p), on the stack `stack` (default: this process's
    torch, no GPU seen): 16-bit activations (autocast included) run cuDNN's kernel where the stack puts
    it first (`SdpaStack.cudnn_first`: an sm90 / sm100 GPU, a cuDNN newer than 9.15.0, torch ≥ 2.10,
    TORCH_CUDNN_SDPA_DEPRIORITIZED unset), with a mask too, unless its dropout probability is off
    cuDNN's 1/16 grid (sdp_utils.cpp, check_cudnn_dropout: 0.1 is refused, 0.25 taken) or the stack runs
    deterministic algorithms (check_cudnn_deterministic); with no GPU seen (a paper calculation) it is
    not assumed first. Otherwise a padded batch comes with an attention mask, which the flash kernel
    refuses, so transformers repeats K and V to every head and the memory-efficient kernel runs. Without
    a mask: flash for 16-bit activations; in fp32 the memory-efficient kernel, except with
    grouped-query attention, where transformers passes enable_gqa=True, which that kernel refuses before
    torch EFFICIENT_GQA_SINCE, so SDPA falls back to the math composite that keeps the s×s
    probabilities. A rule, not a measurement: a run on a GPU reads the kernel it dispatched
    (`kernel_of_ops`) and predicts with that one.
    """
    if attention not in ATTENTION:
        raise TrainmechError(f"unknown attention kernel {attention!r}; valid: {', '.join(ATTENTION)}")
    if device not in DEVICES:
        raise TrainmechError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    if attention != "auto":
        return attention
    if device == "cpu":
        return "math" if dropout else "flash"
    stack = sdpa_stack() if stack is None else stack
    sixteen_bit = recipe(recipe_name).sixteen_bit
    refused = (
        stack.deterministic or not (16 * float(dropout)).is_integer()
    )  # check_cudnn_deterministic, _dropout
    if sixteen_bit and stack.cudnn_first and not refused:
        return "cudnn"
    if padded:
        return "efficient"
    if sixteen_bit:
        return "flash"
    if shape.num_heads == shape.num_kv_heads or stack.torch_minor >= EFFICIENT_GQA_SINCE:
        return "efficient"
    return "math"


def kernel_of_ops(ops) -> str | None:
    """The SDPA kernel a forward dispatched, from the names of the ATen ops it ran (or that created its
    storages): a fused op names its kernel (`_scaled_dot_product_flash_attention_for_cpu`,
    `_scaled_dot_product_cudnn_attention`, …); the math composite shows as `bmm` and `_softmax`.
    None: no attention op among them."""
    names = {str(op).split(".")[0] for op in ops}
    for kernel in ("flash", "efficient", "cudnn"):
        if any(n.startswith(f"_scaled_dot_product_{kernel}_attention") for n in names):
            return kernel
    if "bmm" in names and names & {"_softmax", "_safe_softmax", "softmax"}:
        return "math"
    return None


def norm_saved(
    prefix: str,
    b: int,
    s: int,
    h: int,
    out_bytes: int,
    consumed_at: str,
    own_input: bool,
    *,
    keeps_output: bool = True,
) -> list[SavedTensor]:
    """RMSNorm as transformers writes it: x.to(float32) -> x * rsqrt(mean(x²) + eps) -> weight * normed.to(dtype).

    pow and mul keep the fp32 input (the input itself when it is fp32, an upcast copy otherwise),
    mul keeps rsqrt, and the weight's mul keeps the normalised x; the output is kept by whoever reads
    it next (not under autocast: there each projection keeps its own 16-bit copy of it).
    """
    rows = [
        SavedTensor(f"{prefix}.x_fp32", (b, s, h), FP32_BYTES, consumed_at, own_input),
        SavedTensor(f"{prefix}.rsqrt", (b, s, 1), FP32_BYTES, consumed_at),
        SavedTensor(f"{prefix}.normed", (b, s, h), out_bytes, consumed_at),
    ]
    return rows + ([SavedTensor(f"{prefix}.out", (b, s, h), out_bytes, consumed_at)] if keeps_output else [])


# Where each fused SDPA op returns the philox seed and offset its autograd node keeps for the backward,
# and whether they live on the device (with dropout, without): flash keeps both there, dropout or not
# (FlashAttention-2's mha_fwd since "[Note] BC breaking change to flash seed/offset", pytorch #146372,
# torch >= 2.7: rng_state = at::empty({2}, kUInt64) and _unused = at::empty({}, kUInt64) on kCUDA; the
# meta kernel's uint64 (2,) seed is that code's shape, a CPU test holds it); cuDNN keeps them there; the
# memory-efficient kernel on the host (outside graph capture). No device byte holds a host tensor.
RNG_OUTPUTS = {
    "flash": ((6, 7), True, True),
    "cudnn": ((6, 7), True, True),
    "efficient": ((2, 3), False, False),
}
PROBE_DROPOUT = 0.25  # the dropout_p a probe with dropout draws (a multiple of 1/16: cuDNN's resolution)


def _sdpa_op(kernel: str, q, dropout_p: float = 0.0):
    """Call the fused CUDA op of `kernel` on (q, q, q), causal (meta tensors: shapes only)."""
    import torch

    aten = torch.ops.aten
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(q, q, q, dropout_p, True, False)
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, dropout_p, True, False)
    return aten._scaled_dot_product_efficient_attention(q, q, q, None, True, dropout_p, True)


@functools.lru_cache(maxsize=None)
def _rng_outputs(
    kernel: str, weigh: bool, dropout: bool = False
) -> tuple[tuple[tuple[int, ...], int, bool], ...]:
    """(shape, element bytes, on the device) of the seed and offset `kernel` returns, with or without
    dropout: weighed by running its op on this process's GPU (weigh), else from torch's meta kernel and
    the rule for where they live (RNG_OUTPUTS). A probe that fails raises: the kernel is one a run
    dispatched, or one a paper calculation names, and a silent () would drop its RNG rows from the inventory."""
    import torch

    positions, with_dropout, without = RNG_OUTPUTS[kernel]
    on_device = with_dropout if dropout else without
    if weigh:  # (batch, seq, heads, dim) transposed: the layout transformers hands SDPA
        q = torch.zeros(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        q = torch.empty(1, 2, 64, 64, device="meta", dtype=torch.bfloat16)
    out = _sdpa_op(kernel, q, PROBE_DROPOUT if dropout else 0.0)
    kept = [out[k] for k in positions if isinstance(out[k], torch.Tensor)]
    return tuple(
        (tuple(t.shape), t.element_size(), t.device.type == "cuda" if weigh else on_device) for t in kept
    )


def rng_state_saved(
    kernel: str, device: str, *, weigh: bool = False, dropout: bool = False
) -> list[SavedTensor]:
    """The RNG state one SDPA call keeps on the device for its backward. CPU: none (its kernels return
    output and logsumexp only); math: none (its dropout mask is a tensor of its own). CUDA: the seed and
    offset of the fused kernel that stay on the device (`_rng_outputs`: flash's and cuDNN's):
    weighed on this process's GPU when `weigh` (the caller measures there), else the meta kernel's
    shapes and RNG_OUTPUTS, whatever GPU the machine has."""
    if device != "cuda" or kernel not in RNG_OUTPUTS:
        return []
    outputs = _rng_outputs(kernel, bool(weigh), bool(dropout))
    names = ("self_attn.sdpa_rng_seed", "self_attn.sdpa_rng_offset")
    return [
        SavedTensor(name, shape, element_bytes, "attention")
        for name, (shape, element_bytes, on_device) in zip(names, outputs)
        if on_device
    ]


def attention_saved(
    shape: ModelShape,
    b: int,
    s: int,
    element_bytes: int,
    kernel: str,
    padded: bool,
    device: str = "cpu",
    *,
    weigh_rng: bool = False,
    repeat_kv: bool | None = None,
    dropout: bool = False,
) -> list[SavedTensor]:
    """What SDPA keeps (and, with a mask, transformers' repeated K and V).

    flash / efficient / cudnn: q, k, v and the output plus one fp32 logsumexp per row (the efficient
    kernel pads rows to 32; cuDNN's is (b, heads, s, 1), the same bytes), with k and v at kv_heads, or
    repeated to every head when a mask made transformers call repeat_kv; with a mask also the mask
    turned into an additive float bias (the efficient kernel pads its last dimension to a multiple of
    16). cuDNN's inventory is the ledger's reading of its backward's arguments, checked only by a run
    on a GPU that dispatches it. math: q and kᵀ scaled and repeated
    to every head, v repeated, the s×s softmax probabilities, and the output copy o_proj reads; 16-bit
    inputs are upcast first (torch ≥ 2.5's _scaled_dot_product_attention_math computes in fp32), so all
    but that output copy are fp32 whatever the activations' dtype (measured on the CPU in bf16); its v
    and output copy are consumed (o_proj's and probs @ v's backward) before its softmax backward, the
    `attention` moment, so they are released at the layer's `mlp` moment. On CUDA cuDNN, and flash with
    dropout, also keep their RNG seed and offset on the device (`rng_state_saved`, weighed on the GPU
    with weigh_rng).
    repeat_kv: K and V repeated to every head before SDPA (default: with a mask, as transformers does;
    True without one: a torch whose kernel refuses enable_gqa needs them repeated to run it).
    dropout: the math composite drops out its probabilities (at::dropout: on the CPU a scaled Bernoulli mask
    of the probabilities' dtype, fp32 as above, kept by the multiply; on CUDA native_dropout's bool mask, and the dropped probabilities, kept by probs @ v), two more
    s×s tensors; the fused kernels draw their mask inside and keep only their RNG state.
    """
    heads, kv_heads, d, act = shape.num_heads, shape.num_kv_heads, shape.head_dim, element_bytes
    if kernel == "math":
        acc = max(act, FP32_BYTES)  # the math composite upcasts 16-bit q, k, v to fp32 and computes in fp32
        return [
            SavedTensor("self_attn.q_scaled", (b, heads, s, d), acc, "attention"),
            SavedTensor("self_attn.k_scaled_t", (b, heads, d, s), acc, "attention"),  # repeated to all heads
            SavedTensor("self_attn.v_repeated", (b, heads, s, d), acc, "mlp"),
            SavedTensor("self_attn.probs", (b, heads, s, s), acc, "attention"),  # the s² term
            *(
                [
                    # CUDA: at::dropout runs the fused native_dropout, whose mask is bool (Dropout.cpp,
                    # is_fused_kernel_acceptable); the CPU multiplies by a mask of the probabilities' dtype
                    SavedTensor(
                        "self_attn.dropout_mask", (b, heads, s, s), 1 if device == "cuda" else acc, "mlp"
                    ),
                    SavedTensor("self_attn.probs_dropped", (b, heads, s, s), acc, "mlp"),
                ]
                if dropout
                else []
            ),
            SavedTensor("self_attn.attn_out", (b, s, heads * d), act, "mlp"),
        ]  # o_proj's input
    rows = -(-s // 32) * 32 if kernel == "efficient" else s
    repeated = padded if repeat_kv is None else repeat_kv  # a mask: transformers' repeat_kv copies K and V
    kv_kept = heads if repeated else kv_heads
    out = [
        SavedTensor(
            "self_attn.q_rope", (b, heads, s, d), act, "attention"
        ),  # q after RoPE, read by SDPA's backward
        SavedTensor(
            "self_attn.k_repeated" if repeated else "self_attn.k_rope", (b, kv_kept, s, d), act, "attention"
        ),
        SavedTensor(
            "self_attn.v_repeated" if repeated else "self_attn.v", (b, kv_kept, s, d), act, "attention"
        ),
    ]
    if padded:
        columns = -(-s // 16) * 16 if kernel == "efficient" else s
        out.append(
            SavedTensor("self_attn.mask_bias", (b, 1, s, columns), act, "attention")
        )  # bool mask -> additive bias
    return out + [
        SavedTensor("self_attn.sdpa_out", (b, s, heads * d), act, "attention"),  # also o_proj's input
        SavedTensor("self_attn.sdpa_logsumexp", (b, heads, rows), FP32_BYTES, "attention"),  # instead of s×s
        *rng_state_saved(kernel, device, weigh=weigh_rng, dropout=dropout),
    ]


def _autocast_copies(shape: ModelShape, b: int, s: int, act: int) -> list[SavedTensor]:
    """torch.autocast: each projection keeps a 16-bit copy of its fp32 input and of its weight (the
    weight copy is cast once per forward and cached); q and k after the fp32 RoPE are cast for SDPA."""
    h, inner, q, kv = (
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
    )
    rows = []
    for name, n_out, n_in, moment, casts_input in [
        ("q_proj", q, h, "input_layernorm", True),
        ("k_proj", kv, h, "input_layernorm", True),
        ("v_proj", kv, h, "input_layernorm", True),
        ("o_proj", h, q, "attention", False),
        ("gate_proj", inner, h, "mlp", True),
        ("up_proj", inner, h, "mlp", True),
        ("down_proj", h, inner, "down_proj", False),
    ]:
        module = ("self_attn." if name[0] in "qkvo" else "mlp.") + name
        rows.append(SavedTensor(f"{module}.weight_16bit", (n_out, n_in), act, moment))
        if casts_input:  # o_proj and down_proj read a 16-bit tensor already
            rows.append(SavedTensor(f"{module}.input_16bit", (b, s, n_in), act, moment))
    return rows


def layer_saved(
    shape: ModelShape,
    batch: int,
    seq: int,
    recipe_name: str = "fp32",
    kernel: str = "auto",
    *,
    device: str = "cpu",
    padded: bool = False,
    weigh_rng: bool = False,
    repeat_kv: bool | None = None,
    dropout: bool = False,
    residual_dropout: bool = False,
) -> list[SavedTensor]:
    """The tensors autograd keeps for one decoder layer's backward (transformers Qwen2/Llama, SDPA attention).

    kernel "auto": the one `attention_kernel` picks for this device, recipe and mask. weigh_rng: weigh the
    fused kernel's RNG state on this process's GPU (a CUDA run's own point), else torch's meta kernel
    gives it. repeat_kv, dropout: see `attention_saved` (repeat_kv's default: with the mask); dropout also
    moves the rule's CPU kernel to math (`attention_kernel`). In fp32 the
    input_layernorm's x is the layer input itself (created by the layer before); with 16-bit
    activations both norms keep an fp32 upcast copy of their input instead; under autocast the
    residual stream stays fp32 and the projections keep 16-bit copies (`_autocast_copies`).
    residual_dropout: a dropout on the MLP's output (`candidates.residual_dropout`: `out * keep / (1 - p)`) keeps
    its mask, of the MLP output's dtype, until the first step of the layer's backward.
    """
    dtypes = recipe(recipe_name)
    kernel = attention_kernel(shape, recipe_name, device, kernel, padded=padded, dropout=dropout)
    if dtypes.autocast and kernel == "math":
        raise TrainmechError(
            "the ledger does not model SDPA's math kernel under autocast (it runs flash or efficient there)"
        )
    b, s, h, inner, act = batch, seq, shape.hidden_size, shape.intermediate_size, dtypes.activation_bytes
    extra = {"weigh_rng": weigh_rng, "repeat_kv": repeat_kv, "dropout": dropout}
    mask = [SavedTensor("mlp.residual_dropout_mask", (b, s, h), act, "down_proj")] if residual_dropout else []
    if dtypes.autocast:  # the residual stream and the norms stay fp32; matmuls read 16-bit copies
        attention = attention_saved(shape, b, s, act, kernel, padded, device, **extra)
        copies = _autocast_copies(shape, b, s, act)
        return [
            *norm_saved(
                "input_layernorm", b, s, h, FP32_BYTES, "input_layernorm", own_input=False, keeps_output=False
            ),
            *[c for c in copies if c.consumed_at == "input_layernorm"],
            *attention,
            *[c for c in copies if c.name.startswith("self_attn.o_proj")],
            *norm_saved(
                "post_attention_layernorm", b, s, h, FP32_BYTES, "mlp", own_input=True, keeps_output=False
            ),
            *[c for c in copies if c.consumed_at in ("mlp", "down_proj")],
            SavedTensor("mlp.gate", (b, s, inner), act, "mlp"),
            SavedTensor("mlp.up", (b, s, inner), act, "mlp"),
            SavedTensor("mlp.act", (b, s, inner), act, "mlp"),
            SavedTensor("mlp.act_up", (b, s, inner), act, "down_proj"),
            *mask,
        ]
    sixteen = dtypes.sixteen_bit
    return [
        *norm_saved("input_layernorm", b, s, h, act, "input_layernorm", own_input=sixteen),
        *attention_saved(shape, b, s, act, kernel, padded, device, **extra),
        *norm_saved(
            "post_attention_layernorm", b, s, h, act, "mlp", own_input=True
        ),  # fp32: the residual x + attn
        SavedTensor("mlp.gate", (b, s, inner), act, "mlp"),  # silu's input
        SavedTensor("mlp.up", (b, s, inner), act, "mlp"),
        SavedTensor("mlp.act", (b, s, inner), act, "mlp"),  # silu(gate)
        SavedTensor("mlp.act_up", (b, s, inner), act, "down_proj"),  # silu(gate) * up, down_proj's input
        *mask,
    ]
