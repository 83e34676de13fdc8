"""The offline workload: a shipped corpus, a deterministic tokenizer, batches, the real model.

Nothing here downloads. The corpus is package data in two parts: `domain` (training mechanics)
and `general` (everyday text, for retention checks). The tokenizer is a byte-level BPE trained
on that corpus and shipped as `data/tokenizer.json`; `build_tokenizer()` retrains it and yields
the same file bit for bit. The model is transformers' real `Qwen2ForCausalLM`, built from a
profile's configuration, with pretrained weights only when they are found locally.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch

from trainmech import vjp
from trainmech.errors import TrainmechError
from trainmech.profiles import ModelSpec

__all__ = [
    "IGNORE_INDEX",
    "CORPUS_PARTS",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "TOKENIZER_NAME",
    "corpus",
    "paragraphs",
    "build_tokenizer",
    "tokenizer_path",
    "load_tokenizer",
    "tokenizer_identity",
    "pad_id",
    "encode",
    "decode",
    "token_stream",
    "lm_batch",
    "pad_batch",
    "prompt_response_batch",
    "uneven_batch",
    "supervised_tokens",
    "split_micro_batches",
    "to_device",
    "BuiltModel",
    "qwen2_config",
    "local_weights",
    "build_model",
    "n_params",
]

IGNORE_INDEX = vjp.IGNORE_INDEX  # labels at this value are not supervised (one definition, beside the loss)
CORPUS_PARTS = ("domain", "general")
SPECIAL_TOKENS = ("<|pad|>", "<|endoftext|>")
VOCAB_SIZE = 512
TOKENIZER_NAME = f"trainmech-bytebpe-{VOCAB_SIZE}"

# ----------------------------------------------------------------------------- corpus


def corpus(part: str) -> str:
    """The shipped text of one corpus part: "domain" or "general"."""
    if part not in CORPUS_PARTS:
        raise TrainmechError(f"unknown corpus part {part!r}; valid: {', '.join(CORPUS_PARTS)}")
    return resources.files("trainmech").joinpath(f"data/corpus_{part}.txt").read_text(encoding="utf-8")


def paragraphs(part: str) -> list[str]:
    return [p.strip() for p in corpus(part).split("\n\n") if p.strip()]


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """Train the byte-level BPE on both corpus parts; deterministic (same JSON on every machine)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([p for part in CORPUS_PARTS for p in paragraphs(part)], trainer=trainer)
    return tok


def tokenizer_path() -> Path:
    return Path(str(resources.files("trainmech").joinpath("data/tokenizer.json")))


@lru_cache(maxsize=1)
def load_tokenizer():
    """The shipped tokenizer (a `tokenizers.Tokenizer`)."""
    from tokenizers import Tokenizer

    path = tokenizer_path()
    if not path.is_file():
        raise TrainmechError(f"{path} is missing; rebuild it with `python -m trainmech.workload`")
    return Tokenizer.from_file(str(path))


def tokenizer_identity() -> str:
    """Name and SHA-256 of the shipped tokenizer file, as written into records."""
    digest = hashlib.sha256(tokenizer_path().read_bytes()).hexdigest()
    return f"{TOKENIZER_NAME} sha256:{digest[:16]}"


def pad_id() -> int:
    return load_tokenizer().token_to_id("<|pad|>")


def encode(text: str) -> list[int]:
    return load_tokenizer().encode(text).ids


def decode(ids: list[int]) -> str:
    return load_tokenizer().decode(list(ids))


@lru_cache(maxsize=4)
def token_stream(part: str) -> tuple[int, ...]:
    """The whole corpus part as one token stream, paragraphs separated by <|endoftext|>."""
    eot = load_tokenizer().token_to_id("<|endoftext|>")
    ids: list[int] = []
    for p in paragraphs(part):
        ids += encode(p) + [eot]
    return tuple(ids)


# ----------------------------------------------------------------------------- batches


def lm_batch(part: str, batch: int, seq: int, offset: int = 0) -> dict[str, torch.Tensor]:
    """Full-sequence causal-LM batch: `batch` windows of `seq` tokens from the stream.

    Windows start at offset + i*seq and wrap around the stream. labels equal input_ids (the
    model shifts them by one inside its loss); attention_mask is all ones (no padding).
    """
    stream = token_stream(part)
    if seq > len(stream):
        raise TrainmechError(f"seq {seq} is longer than the {part} corpus ({len(stream)} tokens)")
    ids = [[stream[(offset + i * seq + t) % len(stream)] for t in range(seq)] for i in range(batch)]
    input_ids = torch.tensor(ids, dtype=torch.long)  # (B, T)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}


def pad_batch(
    sequences: list[list[int]], *, supervise_from: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad token lists into a batch with attention mask and labels.

    Padded positions get attention_mask 0 and label IGNORE_INDEX. With `supervise_from`, the
    labels of sequence i are IGNORE_INDEX before position supervise_from[i] too: the
    response-only mask of the post-training path (the prompt is seen but not supervised).
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise TrainmechError("pad_batch needs at least one sequence and no empty sequence")
    if supervise_from is not None and len(supervise_from) != len(sequences):
        raise TrainmechError(
            f"supervise_from has {len(supervise_from)} entries for {len(sequences)} sequences"
        )
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id(), dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, T)
    labels = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    for i, s in enumerate(sequences):
        n = len(s)
        input_ids[i, :n] = torch.tensor(s)
        attention_mask[i, :n] = 1
        start = 0 if supervise_from is None else supervise_from[i]
        labels[i, start:n] = input_ids[i, start:n]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def prompt_response_batch(pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """A post-training batch: prompt + response per row, only response tokens supervised."""
    eot = load_tokenizer().token_to_id("<|endoftext|>")
    seqs, starts = [], []
    for prompt, response in pairs:
        p = encode(prompt)
        seqs.append(p + encode(response) + [eot])
        starts.append(len(p))
    return pad_batch(seqs, supervise_from=starts)


def uneven_batch(rows: int, seq: int, part: str = "domain", offset: int = 0) -> dict[str, torch.Tensor]:
    """rows × seq tokens whose rows differ in length (right padding) and in where supervision starts
    (response-only), so micro-batches supervise unequal token counts: a per-micro-batch mean cannot hide.

    The rows cycle through four (length, supervised from) patterns and read successive stretches of the
    part's token stream from `offset` on, wrapping around its end.
    """
    pattern = [
        (seq, 0),
        (seq * 3 // 8, seq // 4),
        (seq * 7 // 8, seq * 5 // 8),
        (seq // 2, 1),
    ]  # (length, supervised from)
    stream, sequences, starts = token_stream(part), [], []
    for i in range(rows):
        length, start = pattern[i % len(pattern)]
        sequences.append([stream[(offset + t) % len(stream)] for t in range(length)])
        starts.append(start)
        offset += length
    return pad_batch(sequences, supervise_from=starts)


def supervised_tokens(labels: torch.Tensor) -> int:
    """Positions that enter the loss after the causal shift: labels[:, 1:] != IGNORE_INDEX."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def split_micro_batches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Split a batch along dim 0 into n equal micro-batches (refuses a split that does not divide)."""
    rows = batch["input_ids"].shape[0]
    if n <= 0 or rows % n:
        raise TrainmechError(f"cannot split a batch of {rows} rows into {n} equal micro-batches")
    return [{k: v[i * rows // n : (i + 1) * rows // n] for k, v in batch.items()} for i in range(n)]


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The batch with every tensor moved to `device` (the same keys; tensors already there are kept)."""
    return {k: v.to(device) for k, v in batch.items()}


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class BuiltModel:
    model: torch.nn.Module
    model_id: str
    model_commit: str | None
    model_weights: str  # "random-init seed=N" or "pretrained <path>"


def qwen2_config(spec: ModelSpec, **overrides):
    from transformers import Qwen2Config

    kwargs = spec.qwen2_config()
    if kwargs.get("vocab_size") == "tokenizer":
        kwargs["vocab_size"] = load_tokenizer().get_vocab_size()
    kwargs.setdefault("pad_token_id", None)
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def local_weights(spec: ModelSpec, path: str | os.PathLike | None = None) -> Path | None:
    """A local folder with the pinned pretrained weights, or None. Never downloads.

    Looks at `path` if given, else at the Hugging Face cache snapshot of the pinned commit.
    """
    if path is not None:
        p = Path(path)
        if not (p / "config.json").is_file():
            raise TrainmechError(f"weights folder {p} has no config.json")
        return p
    if spec.model_commit is None:
        return None
    from huggingface_hub.constants import HF_HUB_CACHE

    folder = "models--" + spec.model_id.replace("/", "--")
    snap = Path(HF_HUB_CACHE) / folder / "snapshots" / spec.model_commit
    return snap if (snap / "model.safetensors").is_file() else None


def build_model(
    spec: ModelSpec,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    weights: str | os.PathLike | None = None,
    attn_implementation: str = "sdpa",
    **config_overrides,
) -> BuiltModel:
    """The real transformers Qwen2ForCausalLM for a profile's model spec, in train mode.

    Pretrained weights are loaded only from a local folder (`weights`, or the HF cache at the
    pinned commit) and their SHA-256 checked when the spec pins one; otherwise the
    configuration is randomly initialised from `seed`.
    """
    from transformers import Qwen2ForCausalLM

    config = qwen2_config(spec, **config_overrides)
    config._attn_implementation = attn_implementation
    found = local_weights(spec, weights)
    if found is not None:
        if spec.weights_sha256 and weights is None:
            digest = hashlib.sha256((found / "model.safetensors").read_bytes()).hexdigest()
            if digest != spec.weights_sha256:
                raise TrainmechError(
                    f"{found}/model.safetensors has SHA-256 {digest[:16]}…, not the pinned one"
                )
        model = Qwen2ForCausalLM.from_pretrained(
            found, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation
        )
        described = f"pretrained {found}"
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
        model = model.to(dtype)
        described = f"random-init seed={seed}"
    model.to(device).train()
    return BuiltModel(model, spec.model_id, spec.model_commit, described)


def n_params(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":  # python -m trainmech.workload: rebuild the shipped tokenizer
    tok = build_tokenizer()
    tok.save(str(tokenizer_path()))
    print(f"wrote {tokenizer_path()} ({tok.get_vocab_size()} tokens) {tokenizer_identity()}")
