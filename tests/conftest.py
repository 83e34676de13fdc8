"""Fixtures shared by the unit tests.

The repository's root `conftest.py` holds what every pytest run needs, nbval included (where records
go, the records regression); this one only what several test files build the same way.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

# A tiny real Qwen2ForCausalLM: small enough for exact float64 comparisons and bitwise CPU replays,
# with grouped-query attention (4 heads over 2 KV heads) and tied embeddings like Qwen2.5-0.5B.
TINY_QWEN2 = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="session")
def tiny_qwen2_config():
    """Factory: the tiny Qwen2Config (TINY_QWEN2, eager attention), with any field overridden."""
    from transformers import Qwen2Config

    def build(**overrides):
        return Qwen2Config(**{**TINY_QWEN2, "attn_implementation": "eager", **overrides})

    return build


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_qwen2_config):
    """Factory: the tiny Qwen2ForCausalLM, initialised from torch seed 0, in `dtype` and train mode.

    off_init=True moves the norm weights and biases off their init (ones / zeros; seed 1), so a wrong
    backward cannot hide behind them. Other keywords override config fields.
    """
    from transformers import Qwen2ForCausalLM

    def build(dtype: torch.dtype = torch.float32, *, off_init: bool = False, **overrides):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(tiny_qwen2_config(**overrides)).to(dtype).train()
        if off_init:
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
                    elif name.endswith(".bias"):
                        p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        return model

    return build


@pytest.fixture(scope="session")
def tiny_spec():
    """The CPU profile's `qwen2-tiny` model spec (the model the CPU notebooks and exercises build)."""
    from trainmech import profiles

    return profiles.load("TRAIN-CPU").model("qwen2-tiny")


@pytest.fixture(scope="session")
def tiny_profile_model(tiny_spec):
    """Factory: the real Qwen2ForCausalLM of `tiny_spec`, random-init from `seed`, as
    `trainmech.workload.build_model` gives it (keywords pass through: dtype, config overrides)."""
    from trainmech import workload

    def build(seed: int = 0, **kwargs):
        return workload.build_model(tiny_spec, seed=seed, **kwargs)

    return build


@pytest.fixture(scope="session")
def gpu_performance():
    """Factory: a real `performance.Performance` as a GPU run fills it: median and P95 seconds, the allocated peak
    (`reserved` the same unless given) and bytes per sequence, `rounds` timed rounds of the median each (step_times_s,
    unless given; the default 7 is enough for decision's interval, MIN_TIMING_ROUNDS, so a speedup can count);
    every other field unknown (None) unless given."""
    from trainmech.performance import Performance

    def build(median=1.0, p95=None, allocated=1000, per_row=100, reserved=None, rounds=7, **fields):
        unknown = dict.fromkeys(f.name for f in dataclasses.fields(Performance))
        times = {
            "step_time_median_s": median,
            "step_time_p95_s": median if p95 is None else p95,
            "step_times_s": (median,) * rounds,
        }
        peaks = {
            "peak_allocated_bytes": allocated,
            "peak_reserved_bytes": allocated if reserved is None else reserved,
            "bytes_per_row": per_row,
        }
        return Performance(**{**unknown, "device_type": "cuda", **times, **peaks, **fields})

    return build


@pytest.fixture
def residual_graph():
    """(W, x, L): x used twice (the residual Add and the branch's Mv); W once; c needs no grad."""
    W = torch.tensor([[0.5, -0.3], [0.1, 0.4]], dtype=torch.float64, requires_grad=True)
    x = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    c = torch.tensor([2.0, 3.0], dtype=torch.float64)
    L = (c * (x + torch.tanh(W @ x))).sum()
    return W, x, L
