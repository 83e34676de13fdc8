"""What the ledger needs from a model: the shape of a decoder config (Qwen2 / Llama / Mistral layout).

A config is read from a dict, a transformers config, a config.json (file or folder) or a profile
model name, and completed the way transformers completes it: every field the file leaves out takes
its transformers default for that model type (Qwen2 and Llama untie the head unless
`tie_word_embeddings` says otherwise; Mistral has 8 KV heads unless `num_key_value_heads` says
otherwise). A config that is not a supported decoder, or whose sizes are not positive integers that
divide as attention needs, is refused in one sentence.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmech.errors import TrainmechError

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "MAX_LAYERS",
    "MAX_CONFIG_BYTES",
    "SIZES",
    "OPTIONAL_SIZES",
    "FLAGS",
    "ModelShape",
    "load_config",
    "model_shape",
]

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral")
MAX_LAYERS = 10_000  # the deepest published decoders have a few hundred layers
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")
FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that decide its state bytes."""

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
    attention_dropout: float = 0.0  # dropout_p of SDPA in train mode (> 0: the CPU runs the math kernel)

    def parameter_tensors(self) -> list[tuple[str, int]]:
        """(name, elements) of every distinct parameter tensor in model.named_parameters() order; a tied head once."""
        return list(self._tensors)

    @functools.cached_property
    def _tensors(self) -> tuple[tuple[str, int], ...]:
        hidden, inner = self.hidden_size, self.intermediate_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = [("model.embed_tokens.weight", self.vocab_size * hidden)]
        linears = [
            ("self_attn.q_proj", q_width, hidden, self.qkv_bias),
            ("self_attn.k_proj", kv_width, hidden, self.qkv_bias),
            ("self_attn.v_proj", kv_width, hidden, self.qkv_bias),
            ("self_attn.o_proj", hidden, q_width, self.o_bias),
            ("mlp.gate_proj", inner, hidden, self.mlp_bias),
            ("mlp.up_proj", inner, hidden, self.mlp_bias),
            ("mlp.down_proj", hidden, inner, self.mlp_bias),
        ]
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}."
            for name, n_out, n_in, bias in linears:
                out += [(prefix + name + ".weight", n_out * n_in)] + (
                    [(prefix + name + ".bias", n_out)] if bias else []
                )
            out += [
                (prefix + "input_layernorm.weight", hidden),
                (prefix + "post_attention_layernorm.weight", hidden),
            ]
        out += [("model.norm.weight", hidden)]
        if not self.tie_word_embeddings:
            out += [("lm_head.weight", self.vocab_size * hidden)]
        return tuple(out)

    @functools.cached_property
    def n_params(self) -> int:
        return sum(n for _, n in self._tensors)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        return sum(n for name, n in self._tensors if name.startswith("model.layers.0."))

    @property
    def matmul_weight_params(self) -> int:
        """Elements of every weight a matmul reads: the seven projections of each layer and the head."""
        per_layer = sum(
            n for name, n in self._tensors if name.startswith("model.layers.0.") and "proj.weight" in name
        )
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size


def _read_config_file(path: Path) -> Any:
    """The JSON value of a regular file of at most MAX_CONFIG_BYTES; anything else refused in one sentence."""
    from trainmech.results import read_json

    return read_json(path, "config file", MAX_CONFIG_BYTES, name=str(path))


def load_config(source: Any) -> tuple[str, dict]:
    """(name, config dict) from a dict, a transformers config, a config.json path or folder, or a profile model name."""
    if isinstance(source, dict):
        return source.get("_name_or_path") or source.get("model_type", "config"), dict(source)
    if hasattr(source, "to_dict"):
        return getattr(source, "name_or_path", "") or source.model_type, source.to_dict()
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir() and not path.is_symlink():
        path = path / "config.json"
    if os.path.lexists(path):
        return str(path), _read_config_file(path)
    from trainmech import profiles, workload

    for profile_id in profiles.available():
        profile = profiles.load(profile_id)
        if text in profile.models:
            spec = profile.models[text]
            return spec.model_id, workload.qwen2_config(spec).to_dict()
    names = sorted({m for pid in profiles.available() for m in profiles.load(pid).models})
    if path.suffix == ".json" or "/" in text or "\\" in text:
        raise TrainmechError(f"config file {path} does not exist")
    raise TrainmechError(
        f"{text!r} is neither a config.json file nor a profile model name ({', '.join(names)})"
    )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _with_transformers_defaults(name: str, model_type: str, cfg: dict) -> Any:
    """The transformers config of this model type built from cfg: what the file leaves out takes its default."""
    from transformers import AutoConfig

    known = {k: cfg[k] for k in (*SIZES, *OPTIONAL_SIZES, *FLAGS, "hidden_act") if k in cfg}
    try:
        return AutoConfig.for_model(model_type, **known)
    except Exception as e:  # noqa: BLE001  transformers' own validation: one line, not its traceback
        raise TrainmechError(
            f"{name}: transformers refuses this {model_type} config ({' '.join(str(e).split())[:100]})"
        ) from None


def model_shape(source: Any) -> ModelShape:
    """The ModelShape of a causal-LM config (see the module docstring for defaults and refusals)."""
    if isinstance(source, ModelShape):
        return source
    name, cfg = load_config(source)
    if not isinstance(cfg, dict):
        raise TrainmechError(f"{name}: a config must be a JSON object, got {type(cfg).__name__}")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise TrainmechError(f"{name}: architectures must be a list of names, got {archs!r:.60}")
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise TrainmechError(
            f"{name} describes {', '.join(archs)}, not a causal LM (no *ForCausalLM architecture)"
        )
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TrainmechError(
            f"{name} has model_type {model_type!r:.40}; the ledger knows the decoder layout of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (RMSNorm, rotary attention, SwiGLU MLP)"
        )
    wrong = [k for k in SIZES if k in cfg and not _positive_int(cfg[k])]
    if wrong:
        raise TrainmechError(f"{name} lacks a positive integer for {', '.join(wrong)}")
    for k in OPTIONAL_SIZES:
        if cfg.get(k) is not None and not _positive_int(cfg[k]):
            raise TrainmechError(f"{name}: {k} must be a positive integer or absent, got {cfg[k]!r:.40}")
    flags = [k for k in FLAGS if not isinstance(cfg.get(k, False), bool)]
    if flags:
        raise TrainmechError(f"{name}: {', '.join(flags)} must be true or false")
    if cfg.get("num_hidden_layers", 0) > MAX_LAYERS:
        raise TrainmechError(
            f"{name}: num_hidden_layers {cfg['num_hidden_layers']:,} is more than the {MAX_LAYERS:,} the ledger counts"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise TrainmechError(
            f"{name} has hidden_act {cfg['hidden_act']!r:.40}; the ledger's MLP is SwiGLU (silu)"
        )
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    kv_given = cfg.get("num_key_value_heads")
    if heads and kv_given and heads % kv_given:
        raise TrainmechError(
            f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_given}"
        )
    if heads and hidden and cfg.get("head_dim") is None and hidden % heads:
        raise TrainmechError(
            f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no head_dim is given)"
        )
    full = _with_transformers_defaults(name, model_type, cfg)
    heads, hidden = full.num_attention_heads, full.hidden_size
    kv_heads = full.num_key_value_heads or heads
    if heads % kv_heads:  # a default that does not fit the given heads (Qwen2 defaults to 32 KV heads)
        raise TrainmechError(
            f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} "
            f"({'the ' + model_type + ' default' if kv_given is None else 'given'})"
        )
    attention_bias = bool(getattr(full, "attention_bias", False))
    dropout = cfg.get("attention_dropout") or 0.0  # transformers defaults it to 0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise TrainmechError(f"{name}: attention_dropout must be a number in [0, 1), got {dropout!r}")
    return ModelShape(
        name=name,
        model_type=model_type,
        vocab_size=full.vocab_size,
        hidden_size=hidden,
        intermediate_size=full.intermediate_size,
        num_layers=full.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=getattr(full, "head_dim", None) or hidden // heads,
        tie_word_embeddings=bool(full.tie_word_embeddings),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=bool(getattr(full, "mlp_bias", False)),
        attention_dropout=float(dropout),
    )
