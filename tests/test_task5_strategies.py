"""Task5 guard: activation checkpointing and activation offload (trainmech.strategies).

On the CPU the arithmetic of a recomputed forward, and of a backward reading restored copies, is
the arithmetic of the baseline, so loss and every gradient must be bitwise equal. A tiny real
Qwen2ForCausalLM (3 layers) keeps the suite fast; the pitfalls use a few-line function.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainmech import strategies as S

B, T, V, LAYERS = 2, 16, 97, 3


def tiny_model(**overrides) -> Qwen2ForCausalLM:
    kwargs = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, use_cache=False)
    kwargs.update(overrides)
    config = Qwen2Config(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).train()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def batch():
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def step(model, batch, seed=None):
    """(loss, {name: grad}) of one forward + backward."""
    if seed is not None:
        torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_bitwise(got, ref):
    loss, grads = got
    assert torch.equal(loss, ref[0])
    assert grads.keys() == ref[1].keys()
    for name in grads:
        assert torch.equal(grads[name], ref[1][name]), name


@pytest.fixture(scope="module")
def baseline(model, batch):
    return step(model, batch)


# ----------------------------------------------------------------------------- checkpointing


def test_hf_checkpointing_equal_and_replays_every_layer(model, batch, baseline):
    count = S.RecomputeCount()
    with S.hf_checkpointing(model, context_fn=S.counting_context(count)):
        with S.count_calls([layer.mlp for layer in model.model.layers]) as calls:
            model.zero_grad(set_to_none=True)
            out = model(**batch)
            forward_calls = sum(calls.values())
            out.loss.backward()
        got = (out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert_bitwise(got, baseline)
    assert forward_calls == LAYERS
    assert sum(calls.values()) - forward_calls == LAYERS  # every layer replayed once
    assert 0 < count.recomputed_ops <= count.forward_ops
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


@pytest.mark.parametrize("every, replayed", [(1, [0, 1, 2]), (2, [0, 2]), (3, [0])])
def test_checkpoint_layers_equal_and_counts(model, batch, baseline, every, replayed):
    count = S.RecomputeCount()
    with S.checkpoint_layers(model.model.layers, every, context_fn=S.counting_context(count)) as chosen:
        with S.count_calls([layer.mlp for layer in model.model.layers]) as calls:
            got = step(model, batch)
    assert chosen == replayed
    assert_bitwise(got, baseline)
    assert {i: calls[i] for i in range(LAYERS)} == {i: 2 if i in replayed else 1 for i in range(LAYERS)}
    assert count.saved_ops == 0
    per_layer = count.forward_ops // len(replayed)
    assert count.forward_ops == per_layer * len(replayed)
    assert 0 < count.recomputed_ops <= count.forward_ops  # early stop: the last ops need no replay
    assert "forward" not in vars(model.model.layers[0])  # the wrapper is gone after the block


def test_selective_checkpoint_saves_matmuls(model, batch, baseline):
    full, selective = S.RecomputeCount(), S.RecomputeCount()
    with S.checkpoint_layers(model.model.layers, context_fn=S.counting_context(full)):
        step(model, batch)
    with S.checkpoint_layers(model.model.layers, context_fn=S.counting_context(selective, S.save_matmuls)):
        got = step(model, batch)
    assert_bitwise(got, baseline)
    assert selective.forward_ops == full.forward_ops
    # per layer: q, k, v, o projections, attention, gate, up, down
    assert selective.saved_ops == 8 * LAYERS
    assert not {op.__name__ for op in S.MATMUL_OPS} & set(selective.recomputed_by_op)
    assert {"mm.default", "addmm.default"} & set(full.recomputed_by_op)
    assert 0 < selective.recomputed_ops < full.recomputed_ops


def _scaled_tanh(w):
    def f(h):
        h.mul_(2.0)  # in place on the checkpointed function's own input
        return torch.tanh(h @ w)

    return f


def test_inplace_on_checkpoint_input_is_caught():
    torch.manual_seed(0)
    w, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out = checkpoint(_scaled_tanh(w), x * 1.0, use_reentrant=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_inplace_on_outside_state_is_silent_but_wrong():
    torch.manual_seed(0)
    w, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)

    def run(use_checkpoint):
        state = torch.ones(8)

        def f(h):
            state.add_(1.0)  # a counter / cache outside the inputs: replayed in the backward
            return torch.tanh((h * state) @ w)

        w.grad = None
        out = checkpoint(f, x * 1.0, use_reentrant=False) if use_checkpoint else f(x * 1.0)
        out.sum().backward()
        return w.grad.clone(), state

    (g_plain, s_plain), (g_ckpt, s_ckpt) = run(False), run(True)
    assert torch.equal(s_plain, torch.full((8,), 2.0)) and torch.equal(s_ckpt, torch.full((8,), 3.0))
    assert not torch.allclose(g_plain, g_ckpt)


def test_dropout_rng_preserved_or_not():
    model = tiny_model(attention_dropout=0.3)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    ref = step(model, batch, seed=5)
    assert_bitwise(step(model, batch, seed=5), ref)  # the baseline itself is reproducible
    with S.checkpoint_layers(model.model.layers, preserve_rng_state=True):
        assert_bitwise(step(model, batch, seed=5), ref)
    with S.checkpoint_layers(model.model.layers, preserve_rng_state=False):
        loss, grads = step(model, batch, seed=5)
    assert torch.equal(loss, ref[0])  # the forward drew the same masks …
    assert any(not torch.equal(grads[n], ref[1][n]) for n in grads)  # … the replay did not


# ----------------------------------------------------------------------------- offload


def offload_step(model, batch, hooks):
    model.zero_grad(set_to_none=True)
    with hooks:
        out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("prefetch_bytes", [0, 4096, 1 << 30])
def test_offload_equal_counts_bytes_and_keeps_params(model, batch, baseline, prefetch_bytes):
    hidden_bytes = B * T * model.config.hidden_size * 4
    offload = S.ActivationOffload("cpu", keep=model.parameters(), min_bytes=hidden_bytes // 2, prefetch_bytes=prefetch_bytes)
    got = offload_step(model, batch, offload)
    stats = offload.finish()
    assert_bitwise(got, baseline)
    assert stats.kept_params > 0 and stats.kept_small > 0 and stats.offloaded > 0
    assert stats.packed == stats.kept_params + stats.kept_small + stats.offloaded + stats.shared
    assert stats.d2h_bytes == stats.h2d_bytes > 0
    assert stats.d2h_bytes % hidden_bytes == 0 or stats.d2h_bytes >= hidden_bytes
    assert stats.transfer_s is None and stats.h2d_wait_s is None  # no CPU number dressed as GPU evidence
    if prefetch_bytes == 0:
        assert stats.prefetched == 0
    else:
        assert stats.prefetched > 0
    if prefetch_bytes == 1 << 30:
        assert stats.prefetched >= stats.offloaded // 2  # most copies were issued ahead of use
    assert offload.host_bytes() == 0  # finish() released the host buffers


def test_offload_restores_bitwise_and_leaves_params_and_small_in_place(model, batch):
    hidden_bytes = B * T * model.config.hidden_size * 4
    offload = S.ActivationOffload("cpu", keep=model.parameters(), min_bytes=hidden_bytes // 2)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = []
    pack = offload.pack_hook

    def spy(t):
        packed = pack(t)
        if isinstance(packed, torch.Tensor):
            same = packed.data_ptr() == t.data_ptr() and packed.shape == t.shape and packed.stride() == t.stride()
            kept.append((same and not packed.requires_grad, t.untyped_storage().data_ptr() in param_ptrs,
                         t.untyped_storage().nbytes()))
        return packed

    offload.pack_hook = spy
    hooks, counts = S.restore_check(offload)
    offload_step(model, batch, hooks)
    assert counts["checked"] == offload.stats.packed > 0
    assert counts["values_differ"] == 0 and counts["strides_differ"] == 0
    assert all(same for same, _, _ in kept)  # kept tensors: the same memory, detached (no reference cycle)
    assert all(is_param or nbytes < hidden_bytes // 2 for _, is_param, nbytes in kept)
    assert sum(is_param for _, is_param, _ in kept) == offload.stats.kept_params


def test_offload_host_copy_is_a_separate_buffer(model, batch):
    model.zero_grad(set_to_none=True)
    with S.ActivationOffload("cpu", keep=model.parameters(), min_bytes=1) as offload:
        out = model(**batch)
    assert offload.host_bytes() == offload.stats.d2h_bytes > 0
    live = {t.untyped_storage().data_ptr() for t in [out.logits]}
    assert not live & {e.host.untyped_storage().data_ptr() for e in offload.entries}
    out.loss.backward()
    offload.finish()


def test_save_on_cpu_moves_everything_and_restores_values(model, batch, baseline):
    hooks = S.CountingSaveOnCpu("cpu")
    got = offload_step(model, batch, hooks)
    stats = hooks.finish()
    assert_bitwise(got, baseline)
    assert stats.packed == stats.offloaded > 0 and stats.kept_params == 0
    assert stats.d2h_bytes == stats.h2d_bytes
    ours = S.ActivationOffload("cpu", keep=model.parameters(), min_bytes=1)
    offload_step(model, batch, ours)
    assert ours.finish().d2h_bytes < stats.d2h_bytes  # no parameters, no repeated storages
    wrapped, counts = S.restore_check(S.CountingSaveOnCpu("cpu"))
    offload_step(model, batch, wrapped)
    assert counts["values_differ"] == 0  # values come back; strides may not (contiguous copies)


def test_checkpoint_layers_rejects_bad_every(model):
    with pytest.raises(ValueError, match="every"):
        with S.checkpoint_layers(model.model.layers, 0):
            pass


def test_host_buffers_are_invisible_to_device_trackers(model, batch):
    """Off CUDA the host copies are made outside any dispatch mode, as a GPU allocator would not see pinned memory."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Births(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages = []  # held, so no address is reused while we compare

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.storages.append(t.untyped_storage())
            return out

    offload = S.ActivationOffload("cpu", keep=model.parameters(), min_bytes=1)
    model.zero_grad(set_to_none=True)
    with offload, Births() as births:
        out = model(**batch)
    hosts = {e.host.untyped_storage().data_ptr() for e in offload.entries}
    assert hosts and not hosts & {st.data_ptr() for st in births.storages}
    out.loss.backward()
    offload.finish()


def test_strategy_timelines_figure():
    from trainmech import plots

    runs = {"baseline": ([0, 5, 9, 4, 0], ["forward.embed", "loss", "backward.head", "optimizer", "zero_grad"], 10),
            "offload": ([0, 2, 3, 1, 0], ["forward.embed", "loss", "backward.head", "optimizer", "zero_grad"], 10)}
    fig = plots.strategy_timelines(runs, {"baseline": 19 * 2**20, "offload": None})
    assert [ax.get_title() for ax in fig.axes] == ["baseline", "offload"]
    assert len(fig.axes[0].get_lines()) == 3 and len(fig.axes[1].get_lines()) == 2  # curve, peak star, ledger line
