"""The training-state ledger: state bytes, their lifecycles over one step, and the peak overlap.

    book = training_state_lifecycle("qwen2.5-0.5b", batch=2, seq=512)   # a profile model, a config.json, a dict
    book.peak_overlap()        # Peak: the tick and phase of the peak, its bytes, its composition by category
    book.states                # every State: category, bytes, created / last consumed / released tick
    book.by_phase()            # phase -> most bytes alive during it

The step is one training step of a transformers causal LM (Qwen2 / Llama / Mistral layout):
`loss = model(**batch, use_cache=False).loss; loss.backward(); optimizer.step();
optimizer.zero_grad(set_to_none=True)`. Its clock is a list of ticks: one per forward phase (two
for the head), and inside the backward the moments where memory peaks (`backward.layer.3:mlp` is the MLP backward of
layer 3). A State is alive from its `created` tick to its `released` tick, both included; it is
last used at `last_consumed` (gradients are consumed by the update and released by zero_grad).

Six categories, never lumped together: parameters, gradients, optimizer_states, activations
(forward tensors the forward itself releases), saved (forward tensors the backward consumes) and
workspace (buffers of one moment: upstream gradients in flight, the optimizer's temporaries, a
tied weight's gradient waiting in the autograd engine).

The saved-tensor inventory is read off the installed transformers' Qwen2 modules and PyTorch's
autograd formulas and SDPA kernels. Checked against `trainmech.measure` on CPU: fp32 and bf16, the
flash and the math SDPA kernel, with and without full checkpointing. The CUDA defaults (foreach
AdamW; the math fallback for fp32 grouped-query attention) are predicted, not yet measured.
`python -m trainmech ledger` is the calculator on top; `benchmark()` prints predicted vs measured.
Two published formulas, with their sources, stand beside it: `zero_bytes_per_device` and
`korthikanti_activation_bytes`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmech.errors import OneLineParser, TrainmechError

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "saved", "workspace")
SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral")
CHECKPOINTING = ("none", "full")
ATTENTION = ("auto", "flash", "efficient", "math")  # the SDPA kernel PyTorch picks decides what attention saves
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
DEVICES = ("cpu", "cuda")
LAYER_BACKWARD_MOMENTS = ("down_proj", "mlp", "attention", "input_layernorm")
BEFORE, AFTER = "before", "after"  # a state alive before the step starts / still alive after it ends
MAX_LAYERS = 10_000  # the deepest published decoders have a few hundred layers
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB

# ----------------------------------------------------------------------------- published formulas


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
    if stage not in (0, 1, 2, 3):
        raise TrainmechError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if n_devices < 1 or n_params < 0 or k < 0:
        raise TrainmechError(f"need n_devices >= 1, n_params >= 0, k >= 0; got {n_devices}, {n_params}, {k}")
    psi, n = float(n_params), float(n_devices)
    return [(2 + 2 + k) * psi, 4 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (2 + 2 + k) * psi / n][stage]


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, *, t: int = 1, sequence_parallel: bool = False,
                                 recompute: str = "none") -> float:
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


# ----------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class ModelShape:
    """What the ledger needs from a decoder config (Qwen2 / Llama / Mistral layout)."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: always; Llama/Mistral: attention_bias
    o_bias: bool = False
    mlp_bias: bool = False

    def parameter_tensors(self) -> list[tuple[str, int]]:
        """(name, elements) of every distinct parameter tensor; a tied head is not listed twice."""
        return list(self._tensors)

    @functools.cached_property
    def _tensors(self) -> tuple[tuple[str, int], ...]:
        h, inner, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = [("model.embed_tokens.weight", self.vocab_size * h)]
        linears = [("self_attn.q_proj", q, h, self.qkv_bias), ("self_attn.k_proj", kv, h, self.qkv_bias),
                   ("self_attn.v_proj", kv, h, self.qkv_bias), ("self_attn.o_proj", h, q, self.o_bias),
                   ("mlp.gate_proj", inner, h, self.mlp_bias), ("mlp.up_proj", inner, h, self.mlp_bias),
                   ("mlp.down_proj", h, inner, self.mlp_bias)]
        for i in range(self.num_layers):  # the order of model.named_parameters(): the optimizer walks it
            p = f"model.layers.{i}."
            for name, n_out, n_in, bias in linears:
                out += [(p + name + ".weight", n_out * n_in)] + ([(p + name + ".bias", n_out)] if bias else [])
            out += [(p + "input_layernorm.weight", h), (p + "post_attention_layernorm.weight", h)]
        out += [("model.norm.weight", h)]
        if not self.tie_word_embeddings:
            out += [("lm_head.weight", self.vocab_size * h)]
        return tuple(out)

    @functools.cached_property
    def n_params(self) -> int:
        return sum(n for _, n in self._tensors)


def load_config(source: Any) -> tuple[str, dict]:
    """(name, config dict) from a dict, a transformers config, a config.json path or folder, or a profile model name."""
    if isinstance(source, dict):
        return source.get("_name_or_path") or source.get("model_type", "config"), dict(source)
    if hasattr(source, "to_dict"):
        return getattr(source, "name_or_path", "") or source.model_type, source.to_dict()
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if os.path.lexists(path):
        from trainmech.results import read_json

        return str(path), read_json(path, "config file", MAX_CONFIG_BYTES, str(path))  # a regular file of bounded size
    from trainmech import profiles, workload

    for profile_id in profiles.available():
        profile = profiles.load(profile_id)
        if text in profile.models:
            spec = profile.models[text]
            return spec.model_id, workload.qwen2_config(spec).to_dict()
    names = sorted({m for pid in profiles.available() for m in profiles.load(pid).models})
    if path.suffix == ".json" or "/" in text or "\\" in text:
        raise TrainmechError(f"config file {path} does not exist")
    raise TrainmechError(f"{text!r} is neither a config.json file nor a profile model name ({', '.join(names)})")


def _size(cfg: dict, key: str) -> int | None:
    """A size the config may leave out (None); when given, a positive integer."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TrainmechError(f"{cfg.get('_name', 'the config')}: {key} must be a positive integer or absent, got {value!r}")
    return value


def model_shape(source: Any) -> ModelShape:
    """The ModelShape of a causal-LM config; refuses configs that are not a supported decoder or whose
    sizes are not positive integers that divide as attention needs (one sentence each)."""
    name, cfg = load_config(source)
    if not isinstance(cfg, dict):
        raise TrainmechError(f"{name}: a config must be a JSON object, got {type(cfg).__name__}")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise TrainmechError(f"{name}: architectures must be a list of names, got {archs!r:.60}")
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise TrainmechError(f"{name} describes {', '.join(archs)}, not a causal LM (no *ForCausalLM architecture)")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TrainmechError(
            f"{name} has model_type {model_type!r:.40}; the ledger knows the decoder layout of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (RMSNorm, rotary attention, SwiGLU MLP)")
    needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in needed if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int) or cfg[k] <= 0]
    if missing:
        raise TrainmechError(f"{name} lacks a positive integer for {', '.join(missing)}")
    if cfg["num_hidden_layers"] > MAX_LAYERS:
        raise TrainmechError(f"{name}: num_hidden_layers {cfg['num_hidden_layers']:,} is more than the {MAX_LAYERS:,} the ledger counts")
    if cfg.get("hidden_act", "silu") != "silu":
        raise TrainmechError(f"{name} has hidden_act {cfg['hidden_act']!r:.40}; the ledger's MLP is SwiGLU (silu)")
    flags = [k for k in ("tie_word_embeddings", "attention_bias", "mlp_bias") if not isinstance(cfg.get(k, False), bool)]
    if flags:
        raise TrainmechError(f"{name}: {', '.join(flags)} must be true or false")
    cfg = {**cfg, "_name": name}
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads = _size(cfg, "num_key_value_heads") or heads
    if heads % kv_heads:
        raise TrainmechError(f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = _size(cfg, "head_dim")
    if head_dim is None and hidden % heads:
        raise TrainmechError(f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no head_dim is given)")
    attention_bias = cfg.get("attention_bias", False)
    return ModelShape(
        name=name, model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
        tie_word_embeddings=cfg.get("tie_word_embeddings", model_type != "llama"),
        qkv_bias=model_type == "qwen2" or attention_bias, o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=cfg.get("mlp_bias", False),
    )


# ----------------------------------------------------------------------------- dtype recipes


@dataclass(frozen=True)
class Recipe:
    """Bytes per element of each state: model weights, gradients, activations, optimizer moments, master copy."""

    name: str
    param: int
    grad: int
    activation: int
    moment: int
    master: int  # an fp32 copy of the weights kept by the optimizer (0: none)
    measured: bool  # compared with a measurement in this project (Task4 on CPU)


RECIPES = {
    "fp32": Recipe("fp32", 4, 4, 4, 4, 0, True),
    "bf16": Recipe("bf16", 2, 2, 2, 2, 0, True),  # the whole model in bf16; AdamW's moments follow the weights
    "fp16": Recipe("fp16", 2, 2, 2, 2, 0, False),
    "mixed-bf16": Recipe("mixed-bf16", 2, 2, 2, 4, 4, False),  # ZeRO's accounting: 16-bit weights, fp32 master + moments
    "mixed-fp16": Recipe("mixed-fp16", 2, 2, 2, 4, 4, False),
}
FP32, INDEX = 4, 8  # bytes of the tensors that stay fp32 whatever the recipe (norm statistics, loss), and of int64


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise TrainmechError(f"unknown dtype recipe {name!r}; valid: {', '.join(RECIPES)}")
    return RECIPES[name]


# ----------------------------------------------------------------------------- the step's clock


def ticks(n_layers: int, checkpointing: str = "none") -> list[str]:
    """The moments of one step, in order. A tick is "phase" or "phase:moment"."""
    out = ["forward.embed", *(f"forward.layer.{i}" for i in range(n_layers)), "forward.head:norm", "forward.head:lm_head", "loss",
           "backward.loss:nll", "backward.loss:log_softmax", "backward.head:lm_head", "backward.head:norm"]
    for i in reversed(range(n_layers)):
        if checkpointing == "full":
            out.append(f"backward.layer.{i}:recompute")
        out += [f"backward.layer.{i}:{m}" for m in LAYER_BACKWARD_MOMENTS]
    return out + ["backward.embed:lookup", "backward.embed:accumulate", "optimizer", "zero_grad"]


def phase_of(tick: str) -> str:
    """backward.layer.3:mlp -> backward.layer.3 (the phase names `trainmech.measure` uses)."""
    return tick.split(":")[0]


@dataclass(frozen=True)
class State:
    """One training state: alive from `created` to `released` (ticks, both included)."""

    name: str
    category: str
    nbytes: int
    created: str
    last_consumed: str
    released: str | None = None  # None: released right after it is last consumed

    @property
    def release(self) -> str:
        return self.released or self.last_consumed


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


def _norm_saved(prefix: str, b: int, s: int, h: int, e: int, consumed_at: str, own_input: bool) -> list[SavedTensor]:
    """RMSNorm as transformers writes it: x.to(float32) -> x * rsqrt(mean(x²) + eps) -> weight * normed.to(dtype).

    pow and mul keep the fp32 input (the input itself in fp32, an upcast copy otherwise), mul keeps
    rsqrt, and the weight's mul keeps the normalised x; the output is kept by whoever reads it next.
    """
    return [SavedTensor(f"{prefix}.x_fp32", (b, s, h), FP32, consumed_at, own_input),
            SavedTensor(f"{prefix}.rsqrt", (b, s, 1), FP32, consumed_at),
            SavedTensor(f"{prefix}.normed", (b, s, h), e, consumed_at),
            SavedTensor(f"{prefix}.out", (b, s, h), e, consumed_at)]


def attention_kernel(shape: ModelShape, recipe_name: str, device: str, attention: str = "auto") -> str:
    """The SDPA kernel PyTorch picks for this layer, as far as memory is concerned.

    CPU: its flash kernel, any dtype. CUDA: flash for 16-bit; in fp32 the memory-efficient kernel,
    except with grouped-query attention, where transformers passes enable_gqa=True, which that
    kernel refuses, so SDPA falls back to the math composite that keeps the s×s probabilities.
    """
    if attention not in ATTENTION:
        raise TrainmechError(f"unknown attention kernel {attention!r}; valid: {', '.join(ATTENTION)}")
    if attention != "auto":
        return attention
    if device == "cpu" or recipe(recipe_name).activation < FP32:
        return "flash"
    return "math" if shape.num_heads != shape.num_kv_heads else "efficient"


def _attention_saved(b: int, s: int, heads: int, kv_heads: int, d: int, e: int, kernel: str) -> list[SavedTensor]:
    """What SDPA keeps. flash / efficient: q, k, v and the output plus one logsumexp per row (the
    efficient kernel pads rows to 32); math: q and kᵀ and v repeated to every query head, the s×s
    softmax probabilities, and the output copy o_proj reads. The math kernel's v and output copy
    are consumed (o_proj's and probs @ v's backward) before its softmax backward, the
    `backward.layer.<i>:attention` moment, so they are released at the layer's `mlp` moment."""
    if kernel == "math":
        return [SavedTensor("self_attn.q_scaled", (b, heads, s, d), e, "attention"),
                SavedTensor("self_attn.k_scaled_t", (b, heads, d, s), e, "attention"),  # repeated to all heads
                SavedTensor("self_attn.v_repeated", (b, heads, s, d), e, "mlp"),
                SavedTensor("self_attn.probs", (b, heads, s, s), e, "attention"),  # the s² term
                SavedTensor("self_attn.attn_out", (b, s, heads * d), e, "mlp")]  # o_proj's input
    rows = -(-s // 32) * 32 if kernel == "efficient" else s
    return [SavedTensor("self_attn.q_rope", (b, heads, s, d), e, "attention"),  # q after RoPE, read by SDPA's backward
            SavedTensor("self_attn.k_rope", (b, kv_heads, s, d), e, "attention"),  # grouped-query: kv_heads, not heads
            SavedTensor("self_attn.v", (b, kv_heads, s, d), e, "attention"),
            SavedTensor("self_attn.sdpa_out", (b, s, heads * d), e, "attention"),  # also o_proj's input
            SavedTensor("self_attn.sdpa_logsumexp", (b, heads, rows), FP32, "attention")]  # instead of the s×s scores


def layer_saved(shape: ModelShape, batch: int, seq: int, recipe_name: str = "fp32", kernel: str = "flash") -> list[SavedTensor]:
    """The tensors autograd keeps for one decoder layer's backward (transformers Qwen2/Llama, SDPA attention).

    In fp32 the input_layernorm's x is the layer input itself (created by the layer before); with
    16-bit activations both norms keep an fp32 upcast copy of their input instead. kernel: the SDPA
    kernel (`attention_kernel`).
    """
    b, s, h, inner = batch, seq, shape.hidden_size, shape.intermediate_size
    heads, kv_heads, d, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, recipe(recipe_name).activation
    low = e < FP32
    return [
        *_norm_saved("input_layernorm", b, s, h, e, "input_layernorm", own_input=low),
        *_attention_saved(b, s, heads, kv_heads, d, e, kernel),
        *_norm_saved("post_attention_layernorm", b, s, h, e, "mlp", own_input=True),  # fp32: the residual x + attn
        SavedTensor("mlp.gate", (b, s, inner), e, "mlp"),  # silu's input
        SavedTensor("mlp.up", (b, s, inner), e, "mlp"),
        SavedTensor("mlp.act", (b, s, inner), e, "mlp"),  # silu(gate)
        SavedTensor("mlp.act_up", (b, s, inner), e, "down_proj"),  # silu(gate) * up, down_proj's input
    ]


# ----------------------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class Peak:
    """The peak overlap: where the most bytes are alive at once, and which states they are."""

    tick: str
    bytes: int
    by_category: dict[str, int]

    @property
    def phase(self) -> str:
        return phase_of(self.tick)


@dataclass(frozen=True)
class Ledger:
    """Every state of one training step on the step's clock; built by `training_state_lifecycle`."""

    shape: ModelShape
    batch: int
    seq: int
    recipe: str
    optimizer: str
    checkpointing: str
    device: str
    first_step: bool
    attention: str  # the SDPA kernel the ledger assumed
    ticks: tuple[str, ...]
    states: tuple[State, ...]

    def live(self) -> list[tuple[str, dict[str, int]]]:
        """(tick, bytes alive by category) for every tick of the step."""
        return list(zip(self.ticks, self._alive))

    @functools.cached_property
    def _alive(self) -> list[dict[str, int]]:
        """Bytes alive by category at each tick: one pass over the states and one over the ticks."""
        n = len(self.ticks)
        index = {t: k for k, t in enumerate(self.ticks)} | {BEFORE: -1, AFTER: n}
        change = {c: [0] * n for c in CATEGORIES}  # bytes that become alive (+) or stop being alive (-) at a tick
        for st in self.states:  # alive from its created tick to its release tick, both included
            first, last = max(index[st.created], 0), min(index[st.release], n - 1)
            if first <= last:
                change[st.category][first] += st.nbytes
                if last + 1 < n:
                    change[st.category][last + 1] -= st.nbytes
        alive = {c: list(itertools.accumulate(change[c])) for c in CATEGORIES}
        return [{c: alive[c][k] for c in CATEGORIES} for k in range(n)]

    def by_phase(self) -> dict[str, int]:
        """Phase -> most bytes alive at any of its ticks."""
        out: dict[str, int] = {}
        for tick, row in self.live():
            out[phase_of(tick)] = max(out.get(phase_of(tick), 0), sum(row.values()))
        return out

    def peak_overlap(self) -> Peak:
        """The first tick with the most bytes alive, and its composition by category."""
        tick, row = max(self.live(), key=lambda tr: sum(tr[1].values()))
        return Peak(tick, sum(row.values()), row)

    def state_bytes(self) -> dict[str, int]:
        """Each category's own largest footprint over the step (they need not coincide: see peak_overlap)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for _, row in self.live():
            for c in CATEGORIES:
                out[c] = max(out[c], row[c])
        return out

    def lifecycle_rows(self) -> list[tuple[str, str, int, str, str, str]]:
        """(label, category, bytes, created, last consumed, released): states grouped by category and phases.

        Phases, not ticks; "before" / "after" for states that outlive the step. A label ending in
        ".*" stands for several tensors with the same lifecycle.
        """
        def phase(t: str) -> str:
            return t if t in (BEFORE, AFTER) else phase_of(t)

        groups: dict[tuple[str, str, str, str], list[State]] = {}
        for st in self.states:
            groups.setdefault((st.category, phase(st.created), phase(st.last_consumed), phase(st.release)), []).append(st)
        order = {p: k for k, p in enumerate([BEFORE, *dict.fromkeys(phase_of(t) for t in self.ticks), AFTER])}
        rows = []
        for (category, created, consumed, released), members in groups.items():
            names = [m.name for m in members]
            label = names[0] if len(names) == 1 else os.path.commonprefix(names).rpartition(".")[0] + ".*"
            label = " + ".join(names) if label == ".*" else label
            rows.append((label, category, sum(m.nbytes for m in members), created, consumed, released))
        return sorted(rows, key=lambda r: (order[r[3]], order[r[5]], r[0]))

    def to_json(self) -> dict[str, Any]:
        peak = self.peak_overlap()
        return {
            "config": self.shape.name, "model_type": self.shape.model_type, "n_params": self.shape.n_params,
            "batch": self.batch, "seq": self.seq, "dtype": self.recipe, "optimizer": self.optimizer,
            "checkpointing": self.checkpointing, "device": self.device, "attention": self.attention,
            "step": "first" if self.first_step else "steady",
            "peak_bytes": peak.bytes, "peak_phase": peak.phase, "peak_tick": peak.tick,
            "by_category": peak.by_category, "state_bytes": self.state_bytes(),
            "phases": [{"phase": p, "bytes": v} for p, v in self.by_phase().items()],
        }


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TrainmechError(f"{name} must be a positive integer, got {value!r}")
    return value


def training_state_lifecycle(config: Any, batch: int, seq: int, *, dtype: str = "fp32", optimizer: str = "adamw",
                             checkpointing: str = "none", device: str = "cpu", first_step: bool = False,
                             attention: str = "auto") -> Ledger:
    """The ledger of one training step: every state, its bytes and its lifecycle.

    config: a profile model name, a config.json path, a dict or a transformers config.
    dtype: a recipe of RECIPES. optimizer: adamw (two moments; a for-loop on CPU, foreach on
    CUDA, PyTorch's defaults), sgd, sgd-momentum. first_step: the optimizer states are created by
    this step's update (else they exist from an earlier one). checkpointing "full": every decoder
    layer keeps only its input and recomputes its saved tensors in the backward. attention: the
    SDPA kernel; "auto" is PyTorch's choice for this device and dtype (see `attention_kernel`).
    """
    shape = config if isinstance(config, ModelShape) else model_shape(config)
    b, s = _check_size("batch", batch), _check_size("seq", seq)
    r = recipe(dtype)
    if optimizer not in OPTIMIZERS:
        raise TrainmechError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    if checkpointing not in CHECKPOINTING:
        raise TrainmechError(f"unknown checkpointing {checkpointing!r}; valid: {', '.join(CHECKPOINTING)}")
    if device not in DEVICES:
        raise TrainmechError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    kernel = attention_kernel(shape, dtype, device, attention)
    clock = ticks(shape.num_layers, checkpointing)
    states = [*_model_states(shape, r), *_forward_states(shape, b, s, r, checkpointing, kernel),
              *_backward_states(shape, b, s, r, kernel), *_update_states(shape, r, optimizer, device, first_step)]
    return Ledger(shape, b, s, dtype, optimizer, checkpointing, device, first_step, kernel, tuple(clock), tuple(states))


def _model_states(shape: ModelShape, r: Recipe) -> list[State]:
    return [State("parameters", "parameters", shape.n_params * r.param, BEFORE, AFTER)]


def _forward_states(shape: ModelShape, b: int, s: int, r: Recipe, checkpointing: str, kernel: str) -> list[State]:
    """What the forward and the loss create: saved tensors and activations (forward-only tensors)."""
    h, v, e, n = shape.hidden_size, shape.vocab_size, r.activation, shape.num_layers
    low = e < FP32
    d = shape.head_dim
    out = [State("position_ids", "activations", s * INDEX, "forward.embed", "forward.head:norm"),
           # Qwen2RotaryEmbedding in fp32: angles (s, d/2), their doubled copy and cos or sin before scaling
           State("rope.angles", "activations", (s * d // 2 + 2 * s * d) * FP32, "forward.embed", "forward.embed"),
           State("rope.cos_sin", "saved", 2 * s * d * e, "forward.embed", "backward.layer.0:attention")]
    if low:  # the 16-bit embedding output: nobody saves it, but Qwen2Model.forward holds it to the end of the layers
        out.append(State("embed.out", "activations", b * s * h * e, "forward.embed", "forward.head:norm"))
    rows = layer_saved(shape, b, s, r.name, kernel)  # the same inventory for every layer
    for i in range(n):
        here, prev = f"forward.layer.{i}", "forward.embed" if i == 0 else f"forward.layer.{i - 1}"
        if checkpointing == "full":  # only the layer input is kept; the rest is rebuilt in the backward
            out.append(State(f"layer.{i}.checkpoint_input", "saved", b * s * h * e, prev, f"backward.layer.{i}:input_layernorm"))
            out += [State(f"layer.{i}.{t.name}", "saved", t.nbytes, f"backward.layer.{i}:recompute",
                          f"backward.layer.{i}:{t.consumed_at}") for t in rows if t.own]
            out.append(State(f"layer.{i}.no_grad_forward", "activations", 2 * b * s * (h + shape.intermediate_size) * e, here, here))
            continue
        out += [State(f"layer.{i}.{t.name}", "saved", t.nbytes, here if t.own else prev,
                      f"backward.layer.{i}:{t.consumed_at}") for t in rows]
        out.append(State(f"layer.{i}.mlp_out", "activations", b * s * h * e, here, here))  # down_proj's output, before the residual add
        if low:  # the 16-bit residual stream lives only in the forward: x + attn, and the layer output,
            # which the model's loop variable holds while the next layer runs
            out += [State(f"layer.{i}.residual_attn", "activations", b * s * h * e, here, here),
                    State(f"layer.{i}.out", "activations", b * s * h * e, here,
                          f"forward.layer.{i + 1}" if i + 1 < n else "forward.head:norm")]
    last = f"forward.layer.{n - 1}"
    out += [State(f"model.norm.{t.name.split('.', 1)[1]}", "saved", t.nbytes,
                  "forward.head:norm" if t.own else last, "backward.head:norm")
            for t in _norm_saved("norm", b, s, h, e, "head", own_input=low)]
    out.append(State("logits", "activations", b * s * v * e, "forward.head:lm_head", "loss"))
    if low:  # ForCausalLMLoss upcasts the logits: logits.float()
        out.append(State("logits_fp32", "activations", b * s * v * FP32, "loss", "loss"))
    # pad(labels, (0, 1))[..., 1:].contiguous(): the shifted targets are a copy, except for one row, where
    # the slice is already contiguous and the padded labels themselves are kept
    out.append(State("loss.labels_padded", "activations" if b > 1 else "saved", b * (s + 1) * INDEX, "loss",
                     "loss" if b > 1 else "backward.loss:nll"))
    if b > 1:
        out.append(State("loss.targets", "saved", b * s * INDEX, "loss", "backward.loss:nll"))
    out += [State("loss.log_softmax", "saved", b * s * v * FP32, "loss", "backward.loss:log_softmax"),
            State("loss.total_weight", "saved", FP32, "loss", "backward.loss:nll"),
            # the loss scalar the training loop holds until it drops it after backward()
            State("loss.value", "saved", FP32, "loss", "backward.loss:nll", "backward.embed:accumulate")]
    return out


def _backward_states(shape: ModelShape, b: int, s: int, r: Recipe, kernel: str) -> list[State]:
    """Gradients (into .grad) and the backward's workspace, moment by moment."""
    h, v, inner, e, g = shape.hidden_size, shape.vocab_size, shape.intermediate_size, r.activation, r.grad
    q, kv, n = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.num_layers
    low = e < FP32
    tied = shape.tie_word_embeddings
    # SDPA's backward: flash holds the output's grad and dq, dk, dv; math, at its softmax backward,
    # holds two s×s grads (of the probabilities and of the scores) and the grad of the repeated v
    d_sdpa = b * s * (2 * q + 2 * kv) * e
    if kernel == "math":
        d_sdpa = (2 * b * shape.num_heads * s * s + b * s * q) * e
    out = [State("loss.grad_seed", "workspace", FP32, "backward.loss:nll", "backward.loss:nll", "backward.embed:accumulate"),
           State("loss.nll_grad", "workspace", b * s * v * FP32, "backward.loss:nll", "backward.loss:log_softmax"),
           State("dlogits_fp32", "workspace", b * s * v * FP32, "backward.loss:log_softmax",
                 "backward.loss:log_softmax" if low else "backward.head:lm_head")]
    if low:
        out.append(State("dlogits", "workspace", b * s * v * e, "backward.head:lm_head", "backward.head:lm_head"))
    # a tied head's gradient waits in the autograd engine until the embedding's contribution arrives
    out.append(State("lm_head.weight.grad", "workspace" if tied else "gradients", v * h * g, "backward.head:lm_head",
                     "backward.embed:accumulate" if tied else "optimizer", None if tied else "zero_grad"))
    out.append(_grad("model.norm.weight", h * g, "backward.head:norm"))
    upstream = "backward.head:lm_head"  # lm_head's input gradient, passed on through the final norm
    by_layer = {name: numel for name, numel in shape.parameter_tensors()}
    for i in reversed(range(n)):
        t = f"backward.layer.{i}:"
        p = f"model.layers.{i}."
        out.append(State(f"layer.{i}.upstream_grad", "workspace", b * s * h * e, upstream, t + "mlp"))
        grads_at = {"down_proj": ["mlp.down_proj"],
                    "attention": ["mlp.gate_proj", "mlp.up_proj", "post_attention_layernorm", "self_attn.o_proj"],
                    "input_layernorm": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "input_layernorm"]}
        for moment, modules in grads_at.items():
            for m in modules:
                numel = sum(by_layer.get(p + m + suffix, 0) for suffix in (".weight", ".bias"))
                out.append(_grad(f"layer.{i}.{m}", numel * g, t + moment))
        out += [State(f"layer.{i}.d_act_up", "workspace", b * s * inner * e, t + "down_proj", t + "mlp"),
                State(f"layer.{i}.d_act_d_up", "workspace", 2 * b * s * inner * e, t + "mlp", t + "mlp"),
                State(f"layer.{i}.d_residual", "workspace", b * s * h * e, t + "attention", t + "input_layernorm"),
                State(f"layer.{i}.d_sdpa", "workspace", d_sdpa, t + "attention", t + "attention"),
                State(f"layer.{i}.d_normed", "workspace", b * s * h * e, t + "input_layernorm", t + "input_layernorm")]
        upstream = t + "input_layernorm"
    out.append(State("embed.upstream_grad", "workspace", b * s * h * e, upstream, "backward.embed:lookup"))
    if tied:  # the lookup's gradient meets the head's in the engine's buffer; their sum becomes .grad
        out += [State("embed.lookup_grad", "workspace", v * h * g, "backward.embed:lookup", "backward.embed:accumulate"),
                _grad("model.embed_tokens", v * h * g, "backward.embed:accumulate")]
    else:
        out.append(_grad("model.embed_tokens", v * h * g, "backward.embed:lookup"))
    return out


def _grad(name: str, nbytes: int, created: str) -> State:
    """A parameter gradient: written into .grad, read by the update, released by zero_grad(set_to_none=True)."""
    return State(f"{name}.grad", "gradients", nbytes, created, "optimizer", "zero_grad")


def _update_states(shape: ModelShape, r: Recipe, optimizer: str, device: str, first_step: bool) -> list[State]:
    """Optimizer states (created by the first update) and the update's temporaries."""
    n, born = shape.n_params, "optimizer" if first_step else BEFORE
    numels = [numel for _, numel in shape.parameter_tensors()]
    foreach = device == "cuda"  # PyTorch's default: foreach kernels on CUDA, a per-tensor loop on CPU
    out = []
    if r.master:
        out.append(State("optimizer.master_weights", "optimizer_states", n * r.master, born, AFTER))
    if optimizer == "adamw":
        out.append(State("optimizer.exp_avg_exp_avg_sq", "optimizer_states", 2 * n * r.moment, born, AFTER))
        if device == "cpu":  # state["step"]: one fp32 scalar per tensor, on the host (on CUDA too, so 0 there)
            out.append(State("optimizer.step_counters", "optimizer_states", 4 * len(numels), born, AFTER))
        # denom = exp_avg_sq.sqrt() / bias_correction2_sqrt: foreach makes one per tensor, all at once; the
        # loop makes two per tensor while the previous tensor's denom is still referenced
        temp = n if foreach else max(prev + 2 * cur for prev, cur in zip([0, *numels], numels))
        temp *= r.moment
        out.append(State("optimizer.sqrt_temporaries", "workspace", temp, "optimizer", "optimizer"))
    elif optimizer == "sgd-momentum":
        out.append(State("optimizer.momentum_buffer", "optimizer_states", n * r.moment, born, AFTER))
    return out


# ----------------------------------------------------------------------------- measurement beside prediction

CPU_POINTS = {"qwen2-tiny": [(1, 32), (2, 128), (4, 256)], "qwen2-small": [(1, 64), (2, 128), (2, 256)]}
CUDA_POINTS = {"qwen2.5-0.5b": [(2, 512)]}


@dataclass
class Comparison:
    """Predicted and measured peak of one (model, batch, seq, step) point."""

    model: str
    batch: int
    seq: int
    step: str  # "first" | "steady"
    predicted: Ledger
    measured: Any  # trainmech.measure.StepMemory
    measured_peak: int = field(init=False)

    def __post_init__(self):
        # on CUDA the allocator is the machine's own count; elsewhere the tracked tensor bytes
        allocated = self.measured.step_peak_allocated_bytes
        self.measured_peak = allocated if allocated is not None else self.measured.peak_bytes

    @property
    def predicted_peak(self) -> int:
        return self.predicted.peak_overlap().bytes

    @property
    def error(self) -> float:
        """(predicted − measured) / measured."""
        return (self.predicted_peak - self.measured_peak) / self.measured_peak


def measure_point(model: str, batch: int, seq: int, *, run_mode: str = "cpu", seed: int = 0, dtype: str = "fp32",
                  attention: str = "auto", steps: tuple[str, ...] = ("first", "steady")) -> list[Comparison]:
    """Build the profile's model, run tracked steps (the first, then a steady one) and pair each with its prediction.

    attention other than "auto" forces that SDPA kernel (torch.nn.attention.sdpa_kernel) for the steps;
    steps=("first",) stops after the first step.
    """
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainmech import measure, profiles, workload

    profile = profiles.for_mode(run_mode)
    device = torch.device("cuda" if profile.device == "cuda" else "cpu")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise TrainmechError(f"measure_point runs fp32 or bf16 models, not {dtype!r}")
    built = workload.build_model(profile.model(model), seed=seed, dtype=torch_dtype, device=device)
    batch_tensors = {k: t.to(device) for k, t in workload.lm_batch("domain", batch, seq).items()}
    optimizer = torch.optim.AdamW(built.model.parameters(), lr=1e-4)
    shape = model_shape(built.model.config)
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    if tuple(steps) not in (("first",), ("first", "steady")):
        raise TrainmechError(f"steps must be ('first',) or ('first', 'steady'), got {tuple(steps)!r}: a steady step needs a first one before it")
    out = []
    for step in steps:
        with sdpa_kernel(backends[attention]) if attention in backends else contextlib.nullcontext():
            measured = measure.training_step_memory(built.model, optimizer, batch_tensors)
        predicted = training_state_lifecycle(shape, batch, seq, dtype=dtype, device=device.type,
                                             first_step=step == "first", attention=attention)
        out.append(Comparison(model, batch, seq, step, predicted, measured))
    return out


def benchmark(points: dict[str, list[tuple[int, int]]] | None = None, *, run_mode: str = "cpu", out=print) -> list[Comparison]:
    """Predicted vs measured peak at every point, all measured in this one run; prints one line each."""
    points = points or (CUDA_POINTS if run_mode != "cpu" else CPU_POINTS)
    out(f"{'model':<14}{'batch':>6}{'seq':>6}  {'step':<7}{'predicted':>14}{'measured':>14}{'ratio':>8}{'error':>9}  peak phase (pred / meas)")
    rows = []
    for model, shapes in points.items():
        for batch, seq in shapes:
            for c in measure_point(model, batch, seq, run_mode=run_mode):
                rows.append(c)
                out(f"{model:<14}{batch:>6}{seq:>6}  {c.step:<7}{c.predicted_peak:>14,}{c.measured_peak:>14,}"
                    f"{c.predicted_peak / c.measured_peak:>8.4f}{c.error:>+9.2%}  "
                    f"{c.predicted.peak_overlap().phase} / {c.measured.peak_phase}")
    worst = max(abs(c.error) for c in rows)
    out(f"{len(rows)} points, worst |error| = {worst:.2%}")
    return rows


# ----------------------------------------------------------------------------- the calculator


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def render(book: Ledger) -> str:
    """The calculator's text: per-category table, the peak phase and its composition."""
    peak, biggest = book.peak_overlap(), book.state_bytes()
    r = RECIPES[book.recipe]
    lines = [
        f"training-state ledger: {book.shape.name} ({book.shape.model_type}, {book.shape.n_params:,} parameters"
        f"{', tied embeddings' if book.shape.tie_word_embeddings else ''})",
        f"batch={book.batch} seq={book.seq} dtype={book.recipe} optimizer={book.optimizer} "
        f"checkpointing={book.checkpointing} device={book.device} attention={book.attention} "
        f"step={'first' if book.first_step else 'steady'}",
        "",
        f"{'category':<18}{'largest footprint':>22}{'at the peak':>22}",
    ]
    for c in CATEGORIES:
        lines.append(f"{c:<18}{_mib(biggest[c]):>22}{_mib(peak.by_category[c]):>22}")
    lines += [f"{'peak':<18}{'':>22}{_mib(peak.bytes):>22}", "",
              f"peak: {peak.bytes:,} bytes in phase {peak.phase} (moment {peak.tick})"]
    if not r.measured:
        lines.append(f"note: the {r.name} recipe is paper accounting; Task4 compares only fp32 and bf16 with measurements")
    lines.append("not counted: the input batch, kernel-internal scratch, allocator rounding and caching (reserved memory), "
                 "communication buffers")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m trainmech ledger",
        description="Training-state ledger: bytes of parameters, gradients, optimizer states, activations, saved "
                    "tensors and workspace over one training step, the phase of the peak and what it is made of. "
                    "Unlike `accelerate estimate-memory` it counts activations and the overlap at the peak.")
    parser.add_argument("--config", help="a Hugging Face config.json (file or folder) or a profile model name, e.g. qwen2.5-0.5b")
    parser.add_argument("--batch", type=int, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, help="tokens per sequence")
    parser.add_argument("--dtype", default="fp32", help=f"dtype recipe: {', '.join(RECIPES)} (default fp32)")
    parser.add_argument("--optimizer", default="adamw", help=f"{', '.join(OPTIMIZERS)} (default adamw)")
    parser.add_argument("--checkpointing", default="none", help=f"activation checkpointing: {', '.join(CHECKPOINTING)} (default none)")
    parser.add_argument("--device", default="cpu", help="cpu (per-tensor AdamW loop) or cuda (foreach AdamW); default cpu")
    parser.add_argument("--attention", default="auto", help=f"SDPA kernel: {', '.join(ATTENTION)} (default auto: PyTorch's choice)")
    parser.add_argument("--first-step", action="store_true", help="the step that creates the optimizer states (default: a later step)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (peak_bytes, by_category, …)")
    parser.add_argument("--benchmark", action="store_true", help="measure the CPU points on this machine and print predicted vs measured")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The calculator; a bad input gets one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.benchmark:
            benchmark()
            return 0
        missing = [f"--{k}" for k in ("config", "batch", "seq") if getattr(args, k) is None]
        if missing:
            raise TrainmechError(f"missing {', '.join(missing)} (for example --config qwen2.5-0.5b --batch 2 --seq 512)")
        book = training_state_lifecycle(args.config, args.batch, args.seq, dtype=args.dtype, optimizer=args.optimizer,
                                        checkpointing=args.checkpointing, device=args.device, first_step=args.first_step,
                                        attention=args.attention)
        print(json.dumps(book.to_json(), indent=2) if args.json else render(book))
        return 0
    except TrainmechError as e:
        print(f"trainmech: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
