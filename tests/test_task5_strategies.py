"""Task5 guard: activation checkpointing (trainmech.checkpointing), activation offload (trainmech.offload),
optimizer-in-backward, and the ledger's scenario views (trainmech.ledger.scenarios) against measured steps.

On the CPU the arithmetic of a recomputed forward, and of a backward reading restored copies, is
the arithmetic of the baseline, so loss and every gradient must be bitwise equal. A tiny real
Qwen2ForCausalLM (3 layers) keeps the suite fast; the pitfalls use a few-line function. Every CUDA
path's bookkeeping (groups, the stash, the prefetch window, the host arena, the refusals) runs here
with the CPU copy path; only streams and events are absent.
"""

from contextlib import contextmanager

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from trainmech import checkpointing as C
from trainmech import ledger, measure, strategy_records
from trainmech.errors import TrainmechError
from trainmech.gpucheck import limits
from trainmech.ledger import scenarios
from trainmech.offload import (
    ActivationOffload,
    CountingSaveOnCpu,
    HostArena,
    HostStreams,
    OffloadBook,
    activation_offload,
    describe,
    restore_check,
)
from trainmech.offload.copies import CudaCopies
from trainmech.offload.overlap import Overlap, covered, overlap, trace_intervals, union
from trainmech.offload.save_on_cpu import check_host_copy
from trainmech.optimizers import OptimizerInBackward

pytestmark = pytest.mark.task5

B, T, V, LAYERS = 2, 16, 97, 3


# The shared tiny Qwen2 (tests/conftest.py's `tiny_qwen2`) with 3 layers, SDPA attention and no KV cache.
TASK5_MODEL = dict(num_hidden_layers=LAYERS, attn_implementation="sdpa", use_cache=False)


@pytest.fixture(scope="module")
def model(tiny_qwen2):
    return tiny_qwen2(**TASK5_MODEL)


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


@pytest.fixture(scope="module")
def tensors(batch):
    """The batch as training_step_memory takes it (it passes use_cache=False itself)."""
    return {k: v for k, v in batch.items() if k != "use_cache"}


HIDDEN = B * T * 32 * 4  # one hidden state of the tiny model, float32


# ----------------------------------------------------------------------------- checkpointing


def test_hf_checkpointing_equal_and_replays_every_layer(model, batch, baseline):
    count = C.RecomputeCount()
    with C.hf_checkpointing(model, context_fn=C.counting_context(count)):
        with C.count_calls([layer.mlp for layer in model.model.layers]) as calls:
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


def test_hf_checkpointing_leaves_no_hook_behind(model):
    """transformers' switch adds enable_input_require_grads' forward hook on the embeddings each time, and its
    disable removes it only for a PEFT model: the harness removes it, so entering the block often adds nothing."""
    embeddings = model.get_input_embeddings()
    before = len(embeddings._forward_hooks)
    for _ in range(3):
        with C.hf_checkpointing(model):
            assert len(embeddings._forward_hooks) == before + 1
    assert len(embeddings._forward_hooks) == before


@pytest.mark.parametrize("every, replayed", [(1, [0, 1, 2]), (2, [0, 2]), (3, [0])])
def test_checkpoint_layers_equal_and_counts(model, batch, baseline, every, replayed):
    count = C.RecomputeCount()
    with C.checkpoint_layers(model.model.layers, every, context_fn=C.counting_context(count)) as chosen:
        with C.count_calls([layer.mlp for layer in model.model.layers]) as calls:
            got = step(model, batch)
    assert chosen == replayed
    assert_bitwise(got, baseline)
    assert {i: calls[i] for i in range(LAYERS)} == {i: 2 if i in replayed else 1 for i in range(LAYERS)}
    assert count.saved_ops == 0
    per_layer = count.forward_ops // len(replayed)
    assert count.forward_ops == per_layer * len(replayed)
    assert 0 < count.recomputed_ops <= count.forward_ops  # early stop: the last ops need no replay
    assert "forward" not in vars(model.model.layers[0])  # the wrapper is gone after the block


def test_count_calls_ignores_evaluation_forwards(model, batch):
    with C.count_calls([model.model.layers[0]]) as calls:
        model.eval()
        with torch.no_grad():
            model(**batch)
        model.train()
        model(**batch)
    assert calls[0] == 1


def _selective_counts(model, batch):
    """(full, selective) RecomputeCount of one step, and the ops a plain grad-enabled forward dispatched."""
    full, selective = C.RecomputeCount(), C.RecomputeCount()
    with C.checkpoint_layers(model.model.layers, context_fn=C.counting_context(full)):
        step(model, batch)
    with C.checkpoint_layers(model.model.layers, context_fn=C.counting_context(selective, C.save_matmuls)):
        got = step(model, batch)
    with C.dispatched_ops(
        model.model.layers
    ) as dispatched:  # grad enabled: SDPA's choice looks at requires_grad
        model(**batch)
    model.zero_grad(set_to_none=True)
    return full, selective, dispatched, got


def test_selective_checkpoint_saves_what_a_plain_forward_dispatched(model, batch, baseline):
    full, selective, dispatched, got = _selective_counts(model, batch)
    kernel = ledger.attention_kernel(ledger.model_shape(model.config), "fp32", "cpu")
    assert_bitwise(got, baseline)
    assert selective.forward_ops == full.forward_ops
    # by name: q, k, v (addmm, with a bias), o, gate, up, down (mm) and one fused SDPA op per layer
    assert dispatched == C.expected_matmul_ops(model.model.layers, kernel, "cpu")
    assert dispatched == {
        "addmm.default": 3 * LAYERS,
        "mm.default": 4 * LAYERS,
        "_scaled_dot_product_flash_attention_for_cpu.default": LAYERS,
    }
    # what torch's caches held when each recompute began, against a plain forward's matmuls (not the policy's answers)
    assert selective.stored_ops == selective.saved_ops == sum(dispatched.values()) and full.stored_ops is None
    assert not {op.__name__ for op in C.MATMUL_OPS} & set(selective.recomputed_by_op)
    assert {"mm.default", "addmm.default"} & set(full.recomputed_by_op)
    assert 0 < selective.recomputed_ops < full.recomputed_ops
    # the recompute replays each region's forward in order up to its early stop, counted op by op: the same stop
    # (down_proj's input is the last saved tensor: down_proj and the residual add never run again) in both
    assert full.replays_are_prefixes and selective.replays_are_prefixes
    assert full.skipped_by_op == selective.skipped_by_op == {"mm.default": LAYERS, "add.Tensor": LAYERS}
    assert full.replayed_ops == full.recomputed_ops and full.read_from_cache_ops == 0
    # selective keeps down_proj's output too, but the stop comes before it: kept, never read from the cache
    assert selective.kept_unread_ops == LAYERS
    # … measured in torch's selective caches after the backward: one unconsumed entry per layer
    assert selective.left_in_cache_ops == LAYERS and full.left_in_cache_ops is None
    # … each one down_proj's output (batch × tokens × hidden, float32): the bytes they hold through the backward
    assert (
        selective.left_in_cache_bytes == LAYERS * B * T * model.config.hidden_size * 4
        and full.left_in_cache_bytes is None
    )
    report = strategy_records.recompute_report({"per-layer": full, "selective": selective})
    dispatch = strategy_records.dispatch_report(dispatched, dispatched, rule=kernel, ran=kernel, device="cpu")
    assert f"the ledger's rule says {kernel}; the plain forward dispatched {kernel}" in dispatch
    row = next(line.split() for line in report.splitlines() if line.startswith("selective "))
    assert row == [
        "selective",
        *map(
            str,
            (
                selective.forward_ops,
                selective.saved_ops,
                selective.read_from_cache_ops,
                selective.kept_unread_ops,
                selective.recomputed_ops,
                selective.skipped_ops,
            ),
        ),
    ]
    assert "recomputed by op (selective, per update)" in report
    assert selective.forget_caches() == LAYERS  # what it read, before letting the caches go
    assert selective.left_in_cache_ops is None and selective.stored_ops == sum(dispatched.values())
    assert (
        selective.read_from_cache_ops + selective.recomputed_ops + selective.skipped_ops
        == selective.forward_ops
    )


def test_left_in_cache_reads_both_layouts_of_torchs_selective_cache():
    # torch 2.11 (the GPU run's): op -> list of kept outputs, the recompute pops each it reads;
    # newer torch: op -> {key: output or a sentinel}. Both must count the kept outputs nobody read.
    out = torch.zeros(1)
    listed = C.RecomputeCount([C.Region(cache={"mm": [out], "add": []}), C.Region(cache={"mm": [out, out]})])
    assert listed.left_in_cache_ops == 3
    sentinels = [
        getattr(torch.utils.checkpoint, n)
        for n in ("_RECOMPUTE", "_CONSUMED")
        if hasattr(torch.utils.checkpoint, n)
    ]
    keyed = C.RecomputeCount(
        [C.Region(cache={"mm": {0: out, **{k + 1: e for k, e in enumerate(sentinels)}}})]
    )
    assert keyed.forget_caches() == 1 and keyed.left_in_cache_ops is None
    # stored_ops reads the same layouts: a region whose recompute never began is read as it is now
    assert listed.stored_ops == 3 and keyed.stored_ops is None


def test_stored_ops_reads_torchs_cache_before_the_recompute_takes_from_it():
    """stored_ops is what torch's cache held after the forward, read when the recompute begins: after the
    backward the cache holds only what the recompute never reached, the stored count stays."""
    count = C.RecomputeCount()
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    fn = C.counting_context(count, C.save_matmuls)
    y = checkpoint(lambda a: torch.relu(a @ w) @ w, x, use_reentrant=False, context_fn=fn)
    assert count.stored_ops == 2 and count.regions[0].stored is None  # read now: no recompute yet
    y.sum().backward()
    # the recompute took the first mm's output and stopped before the second (its output was not needed)
    assert count.regions[0].stored == count.stored_ops == 2 and count.left_in_cache_ops == 1


def test_recompute_count_finds_a_replay_that_is_not_the_forwards_prefix():
    """The skipped ops are read off the forward after the replay's prefix: a replay in another order is refused."""
    count = C.RecomputeCount([C.Region(["mm", "silu", "mul", "mm"], ["mm", "silu"], ["silu"])], saved_ops=2)
    assert count.replays_are_prefixes and count.skipped_by_op == {"mul": 1, "mm": 1}
    assert (count.read_from_cache_ops, count.kept_unread_ops) == (1, 1)
    count.regions[0].replayed = ["silu", "mm"]
    assert not count.replays_are_prefixes


def test_selective_checkpoint_with_the_kernel_the_ledger_picks_for_cuda(model, batch, baseline):
    """CUDA's choice for fp32 grouped-query attention (math: two bmm per layer), forced on the CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = ledger.attention_kernel(ledger.model_shape(model.config), "fp32", "cuda")
    with sdpa_kernel(SDPBackend.MATH):
        _, selective, dispatched, _ = _selective_counts(model, batch)
    expected = C.expected_matmul_ops(model.model.layers, kernel, "cuda")
    assert kernel == "math" and expected["bmm.default"] == 2 * LAYERS
    assert dispatched == expected and selective.stored_ops == sum(expected.values()) == 9 * LAYERS
    with pytest.raises(ValueError, match="no attention ops known"):
        C.expected_matmul_ops(model.model.layers, "flash", "mps")


def test_dispatched_ops_follow_the_attention_kernel(model, batch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), C.dispatched_ops(model.model.layers) as dispatched:
        model(**batch)
    assert dispatched["bmm.default"] == 2 * LAYERS  # the math kernel: scores and the weighted sum
    assert not any("scaled_dot_product" in name for name in dispatched)
    assert C.dispatched_kernel(dispatched, "cpu") == C.dispatched_kernel(dispatched, "cuda") == "math"
    with C.dispatched_ops(model.model.layers) as plain:
        model(**batch)
    assert C.dispatched_kernel(plain, "cpu") == "flash" and C.dispatched_kernel(plain, "cuda") is None
    fused = {"_scaled_dot_product_cudnn_attention.default": LAYERS, "mm.default": 4 * LAYERS}
    assert (
        C.dispatched_kernel(fused, "cuda") == "cudnn"
    )  # what torch >= 2.10 may pick on sm90 instead of the rule


def test_recomputed_tensors_are_saved_tensors_in_a_measurement(batch, tensors, tiny_qwen2):
    """One vocabulary with the ledger: what the backward re-creates is filed as saved, not workspace."""
    model = tiny_qwen2(**TASK5_MODEL)  # updated here: not the module's shared model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, batch)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    with C.hf_checkpointing(model):
        tracked = measure.training_step_memory(model, optimizer, tensors)
    rebuilt = [a for a in tracked.allocations if a.born_phase.endswith(":recompute")]
    assert rebuilt and {tracked.category(a) for a in rebuilt} == {"saved", "unsaved_activations"}
    assert all(tracked.category(a) == "saved" for a in rebuilt if a.died_phase != a.born_phase)


def test_born_as_without_a_tracker_does_nothing_and_refuses_an_unknown_rebuild():
    with measure.born_as("fetch"):
        torch.ones(3)
    with pytest.raises(TrainmechError, match="unknown rebuild"):
        with measure.born_as("prefetch"):
            pass


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


def test_checkpoint_saves_its_positional_tensors_only_and_a_keyword_tensor_escapes_every_hook():
    """What Task5 §2.4 and Task6's nested-hooks cell say of torch.utils.checkpoint (non-reentrant): the positional
    tensors are saved tensors (an outer hook, the offload's, packs them; their version is checked), a keyword
    argument's tensor is held by the replay's closure — no outer hook sees it, and changing it in place is not
    refused: the replay silently computes with the new values."""
    torch.manual_seed(0)
    x, scale = torch.randn(4, 8, requires_grad=True), torch.randn(8)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        out = checkpoint(lambda h, *, s: (h * s).tanh(), x, s=scale, use_reentrant=False)
    assert len(seen) == 1 and seen[0] is x  # the positional input, and nothing else
    (expected,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
    scale.mul_(2.0)  # in place on the keyword tensor: no version to check
    (silently_wrong,) = torch.autograd.grad(out.sum(), x)
    assert not torch.equal(silently_wrong, expected)


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


def test_dropout_rng_preserved_or_not(tiny_qwen2):
    model = tiny_qwen2(**TASK5_MODEL, attention_dropout=0.3)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    ref = step(model, batch, seed=5)
    assert_bitwise(step(model, batch, seed=5), ref)  # the baseline itself is reproducible
    with C.checkpoint_layers(model.model.layers, preserve_rng_state=True):
        assert_bitwise(step(model, batch, seed=5), ref)
    with C.checkpoint_layers(model.model.layers, preserve_rng_state=False):
        loss, grads = step(model, batch, seed=5)
    assert torch.equal(loss, ref[0])  # the forward drew the same masks …
    assert any(not torch.equal(grads[n], ref[1][n]) for n in grads)  # … the replay did not


def test_checkpoint_layers_rejects_bad_every(model):
    with pytest.raises(ValueError, match="every"):
        with C.checkpoint_layers(model.model.layers, 0):
            pass


# ----------------------------------------------------------------------------- offload: the bookkeeping


def test_book_keeps_parameters_small_and_exempt_groups_and_moves_the_rest():
    book = OffloadBook(min_bytes=100, exempt_from=2)
    book.group = 0
    assert book.keep_reason(1000, True, True) == "param"
    assert book.keep_reason(99, False, True) == "small"
    assert book.keep_reason(1000, False, False) == "small"  # on another device
    assert book.keep_reason(1000, False, True) is None
    book.group = 2
    assert book.keep_reason(1000, False, True) == "exempt"


def test_book_lets_go_of_a_group_when_the_group_after_next_starts_and_fetches_a_window_ahead():
    book = OffloadBook(min_bytes=1, exempt_from=4, prefetch_groups=2, stash_groups=1)
    entries = []
    for g in range(4):
        book.start_group(g)
        entries.append(book.new_entry(10, 0))
    # at the start of group 3, group 0 and 1 were let go (group g goes when g + 2 starts), 2 and 3 are held
    assert book.stats.stash_peak_bytes == 20
    assert book.start_group(4) == [entries[2]]  # group 2 goes when group 4 (after the last layer) starts
    assert book.start_backward() == [entries[3]]  # the rest at the first unpack
    assert book.to_fetch(4) == [entries[3], entries[2]]  # nearest first: the groups 2 … 4
    for e in (entries[3], entries[2]):
        book.fetching(e, ahead=True)
        e.fetched = object()
    assert book.to_fetch(3) == [entries[1]]
    assert book.unpacked(entries[3]) is True  # its last reference
    with pytest.raises(TrainmechError, match="unpacked again after its last use"):
        book.unpacked(entries[3])
    with pytest.raises(TrainmechError, match="after the backward started"):
        book.new_entry(10, 0)


def test_book_refuses_negative_settings():
    with pytest.raises(TrainmechError, match="must be ≥ 0"):
        OffloadBook(min_bytes=-1)


def test_arena_reuses_its_chunks_and_refuses_a_second_owner():
    arena = HostArena(pinned=False, chunk_bytes=1000)
    first, second = object(), object()
    arena.claim(first)
    views = [arena.slot(300), arena.slot(300), arena.slot(600)]  # the third does not fit: a second chunk
    assert arena.allocations == 2 and views[1].data_ptr() - views[0].data_ptr() == 512  # aligned slots
    with pytest.raises(TrainmechError, match="still held by another ActivationOffload"):
        arena.claim(second)
    arena.release(first)
    arena.claim(second)
    again = [arena.slot(300), arena.slot(300), arena.slot(600)]
    assert arena.allocations == 2 and [v.data_ptr() for v in again] == [v.data_ptr() for v in views]


# ----------------------------------------------------------------------------- offload: the hooks on a model


def offload_step(model, batch, hooks):
    model.zero_grad(set_to_none=True)
    with hooks:
        out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("prefetch_groups", [0, 1, 2])
def test_offload_equal_counts_bytes_and_keeps_params(model, batch, baseline, prefetch_groups):
    offload = activation_offload(
        model, min_bytes=HIDDEN // 2, prefetch_groups=prefetch_groups, arena=HostArena(pinned=False)
    )
    got = offload_step(model, batch, offload)
    stats = offload.finish()
    assert_bitwise(got, baseline)
    assert stats.kept_params > 0 and stats.kept_small > 0 and stats.kept_exempt > 0 and stats.offloaded > 0
    assert (
        stats.packed
        == stats.kept_params + stats.kept_small + stats.kept_exempt + stats.offloaded + stats.shared
    )
    assert stats.d2h_bytes == stats.h2d_bytes > 0
    assert stats.prefetched + stats.on_demand == stats.offloaded
    assert (
        stats.transfer_time_s is None and stats.exposed_transfer_time_s is None
    )  # no CPU number dressed as GPU evidence
    assert offload.host_bytes() == 0  # finish() released the host buffers
    assert all(e.group < LAYERS - 1 for e in offload.entries)  # the last layer stays on the device


def test_offload_moves_what_the_ledger_lists_and_its_peak_is_the_ledgers(batch, tensors, tiny_qwen2):
    """The ledger's offload view (ledger.Ledger.offloaded) models the groups, the stash and the prefetch window.

    min_bytes half a hidden state: the ledger lists RoPE's cos and sin as one state, the hooks see two storages,
    so a threshold between their sizes would split them differently (far below min_bytes on the real shapes)."""
    model = tiny_qwen2(**TASK5_MODEL)  # updated here: not the module's shared model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, batch)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    hooks = activation_offload(model, min_bytes=HIDDEN // 2, prefetch_groups=1)
    with hooks:
        tracked = measure.training_step_memory(model, optimizer, tensors)
    hooks.finish()
    book = ledger.training_state_lifecycle(model.config, B, T, device="cpu")
    view = book.offloaded(HIDDEN // 2, prefetch_groups=1)
    assert book.offloadable_bytes(HIDDEN // 2) == hooks.stats.d2h_bytes
    assert abs(view.peak_overlap().bytes / tracked.peak_bytes - 1) <= 0.01
    assert view.peak_overlap().phase == tracked.peak_phase
    fetched = [a for a in tracked.allocations if a.born_phase.endswith(":fetch")]
    assert fetched and all(tracked.category(a) == "saved" for a in fetched)  # one vocabulary with the ledger


@pytest.mark.parametrize("window", [0, 1, 2])
def test_offload_issues_each_h2d_the_window_ahead_of_its_layer(model, batch, window):
    # fetch_leads observes the window: a hook that fetched on demand (or at a kept reference's unpack, in its own
    # layer) would show 0 whatever the window says
    hooks = activation_offload(model, min_bytes=HIDDEN // 2, prefetch_groups=window)
    with hooks:
        model(**batch).loss.backward()
    stats = hooks.finish()
    model.zero_grad(set_to_none=True)
    layers = model.config.num_hidden_layers
    inner = {g: n for g, n in stats.fetch_leads.items() if g + window < layers}
    assert inner and set(inner.values()) == {window}
    assert stats.on_demand == 0 and sorted(stats.fetch_leads) == list(range(layers - 1))


def test_offload_second_step_allocates_no_host_memory_and_two_at_once_are_refused(model, batch):
    arena = HostArena(pinned=False)
    stats = []
    for _ in range(2):
        hooks = activation_offload(model, min_bytes=HIDDEN // 2, arena=arena)
        offload_step(model, batch, hooks)
        stats.append(hooks.finish())
    assert stats[0].host_chunks_allocated == 1 and stats[1].host_chunks_allocated == 0
    text, first = describe(stats), stats[0]  # the notebook's printout: the first update, and per update
    assert (
        f"saved references packed: {first.packed} = {first.kept_params} parameters + {first.kept_small} small + "
        f"{first.kept_exempt} last-layer/head/loss kept in place + {first.offloaded} storages offloaded"
    ) in text
    assert (
        "host chunks allocated by pass: untraced: 1, untraced: 0" in text and "(CPU: not meaningful" in text
    )
    # as read_times fills them on CUDA:
    stats[0].transfer_time_s, stats[0].h2d_wait_s, stats[0].d2h_wait_s = 1.0, 0.5, 0.0
    timed = describe(stats)
    assert "(CPU: not meaningful" not in timed and "exposed_transfer_time_s = 0.5" in timed
    first = activation_offload(model, min_bytes=HIDDEN // 2, arena=arena)
    with first:
        out = model(**batch)
    with pytest.raises(TrainmechError, match="still held"):
        offload_step(model, batch, activation_offload(model, min_bytes=HIDDEN // 2, arena=arena))
    out.loss.backward()
    first.finish()


def test_offload_refuses_a_second_backward_in_one_sentence(model, batch):
    hooks = activation_offload(model, min_bytes=HIDDEN // 2, arena=HostArena(pinned=False))
    model.zero_grad(set_to_none=True)
    with hooks:
        loss = model(**batch).loss
    loss.backward(retain_graph=True)
    with pytest.raises(TrainmechError) as e:
        loss.backward()
    assert "unpacked again after its last use" in str(e.value) and "\n" not in str(e.value)
    hooks.finish()
    model.zero_grad(set_to_none=True)


def test_offload_holds_each_group_until_the_group_after_next_starts(model, batch):
    """The stash: a moved storage's device copy lives on until its D2H was waited for (CPU: the same timing)."""
    hooks = activation_offload(model, min_bytes=HIDDEN // 2, arena=HostArena(pinned=False))
    per_group = {}
    model.zero_grad(set_to_none=True)
    with hooks:
        out = model(**batch)
    for e in hooks.entries:
        per_group[e.group] = per_group.get(e.group, 0) + e.nbytes
    assert hooks.stats.stash_peak_bytes == max(per_group[g] + per_group.get(g + 1, 0) for g in per_group)
    out.loss.backward()
    hooks.finish()


@pytest.mark.parametrize("make", ["activation_offload", "save_on_cpu"])
def test_each_saved_reference_is_read_back_once_and_a_forgotten_one_is_counted(make):
    """`unpacked == packed` and `unpacked_again == 0` are measured, not a balance: a saved tensor whose node's
    backward never runs is never read back, and a second backward over a kept graph reads references again."""
    w = torch.randn(64, 64, requires_grad=True)

    def hooks():
        if make == "save_on_cpu":
            return CountingSaveOnCpu("cpu")
        return ActivationOffload("cpu", keep=[w], min_bytes=1, arena=HostArena(pinned=False))

    x = torch.randn(8, 64, requires_grad=True)
    with (h := hooks()):
        used, unused = (x @ w).tanh(), (x * 2).sin()  # the second feeds no loss: its backward never runs
    used.sum().backward()
    stats = h.finish()
    assert stats.packed >= 3 and stats.unpacked == stats.packed - 1 and stats.unpacked_again == 0
    with (h := hooks()):
        y = (x @ w).tanh()
    y.sum().backward(retain_graph=make == "save_on_cpu")
    if make == "save_on_cpu":  # ActivationOffload refuses a second read (test_offload_refuses_…)
        y.sum().backward()
    stats = h.finish()
    assert stats.unpacked == stats.packed
    assert stats.unpacked_again == (stats.packed if make == "save_on_cpu" else 0)
    del unused


def test_offload_restores_bitwise_and_leaves_params_and_small_in_place(model, batch):
    offload = activation_offload(model, min_bytes=HIDDEN // 2, arena=HostArena(pinned=False))
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = []
    pack = offload.pack_hook

    def spy(t):
        packed = pack(t)
        _ref, where, item, _source, _version = packed
        if isinstance(where, int):
            same = item.data_ptr() == t.data_ptr() and item.shape == t.shape and item.stride() == t.stride()
            kept.append(
                (
                    same and not item.requires_grad,
                    t.untyped_storage().data_ptr() in param_ptrs,
                    t.untyped_storage().nbytes(),
                )
            )
        return packed

    offload.pack_hook = spy
    hooks, counts = restore_check(offload)
    offload_step(model, batch, hooks)
    offload.finish()
    assert counts["checked"] == offload.stats.packed > 0
    assert counts["values_differ"] == 0 and counts["strides_differ"] == 0
    assert all(same for same, _, _ in kept)  # kept tensors: the same memory, detached (no reference cycle)
    assert sum(is_param for _, is_param, _ in kept) == offload.stats.kept_params


def test_host_arena_is_invisible_to_device_trackers(model, batch):
    """Off CUDA the host chunks are made outside any dispatch mode, as a GPU allocator would not see pinned memory."""
    arena = HostArena(pinned=False)
    offload = activation_offload(model, min_bytes=1, arena=arena)
    tracker = measure.StorageTracker()
    model.zero_grad(set_to_none=True)
    with offload, tracker:
        out = model(**batch)
    chunks = {c.untyped_storage().data_ptr() for c in arena.chunks}
    assert chunks and not any(a.nbytes == arena.chunks[0].numel() for a in tracker.allocations)
    out.loss.backward()
    offload.finish()


def test_save_on_cpu_moves_everything_and_restores_values(model, batch, baseline):
    hooks = CountingSaveOnCpu("cpu")
    got = offload_step(model, batch, hooks)
    stats = hooks.read_times()
    assert_bitwise(got, baseline)
    assert stats.packed == stats.offloaded > 0 and stats.kept_params == 0
    assert stats.d2h_bytes == stats.h2d_bytes and stats.transfer_time_s is None
    ours = activation_offload(model, min_bytes=1, exempt_last=0, arena=HostArena(pinned=False))
    offload_step(model, batch, ours)
    assert ours.finish().d2h_bytes < stats.d2h_bytes  # no parameters, no repeated storages
    wrapped, counts = restore_check(CountingSaveOnCpu("cpu"))
    offload_step(model, batch, wrapped)
    assert counts["values_differ"] == 0  # values come back; strides may not (contiguous copies)


def test_save_on_cpu_counts_the_host_copies_torch_returns(model, batch):
    """The bytes come from torch's returned host tensor: a pack that hands back the saved tensor itself
    (torch's own save_on_cpu without pin_memory does, off CUDA: `.cpu()` of a host tensor) is refused."""
    x = torch.randn(4, 8, requires_grad=True)
    hooks = CountingSaveOnCpu("cpu")
    with hooks:
        y = (x * x.t().contiguous().t()).sum()  # saves two 128 B tensors
    y.backward()
    assert hooks.stats.packed == 2 and hooks.stats.d2h_bytes == hooks.stats.h2d_bytes == 2 * 4 * 8 * 4
    lazy = CountingSaveOnCpu("cpu")
    lazy._torch_pack = torch.autograd.graph.save_on_cpu(pin_memory=False).pack_hook  # returns x itself
    with pytest.raises(TrainmechError, match="shares the saved tensor's storage"), lazy:
        (x * x).sum()
    with pytest.raises(TrainmechError, match="not in pinned memory"):
        check_host_copy(x, x.detach().clone(), pinned=True)
    with pytest.raises(TrainmechError, match="holds 64 B, the saved tensor 128 B"):
        check_host_copy(x, torch.empty(4, 4), pinned=False)


# ----------------------------------------------------------------------------- offload: the CUDA copy path, on host streams


def _copies(log, stream):
    """{entry: (start event, end event, position in the log)} of the copies on one side stream."""
    return {c[4]: (c[2], c[3], i) for i, c in enumerate(log) if c[0] == "copy" and c[1] == stream}


def _at(log, item) -> list[int]:
    return [i for i, c in enumerate(log) if c == item]


def _host_streams_step(model, batch):
    """One forward + backward through the CUDA copy path on HostStreams: (streams, offload, step, its stats)."""
    streams = HostStreams()
    offload = activation_offload(model, min_bytes=HIDDEN // 2, arena=HostArena(pinned=False), streams=streams)
    got = offload_step(model, batch, offload)
    return streams, offload, got, offload.finish()


def test_cuda_copy_path_on_host_streams_is_bitwise_and_waits_before_every_drop_and_use(
    model, batch, baseline
):
    """CudaCopies with every copy done at once on the host: the events, waits and releases in their order."""
    streams, offload, got, stats = _host_streams_step(model, batch)
    copies = offload.copies
    assert isinstance(copies, CudaCopies)
    assert_bitwise(got, baseline)
    assert (
        copies._done == {} and copies._ready == {}
    )  # every copy's end event waited for by the compute stream
    assert all(e.used for e in offload.entries) and stats.fetched_unused == 0
    assert len(copies.copies) == stats.offloaded + stats.prefetched + stats.on_demand
    log = streams.log
    d2h, h2d = _copies(log, "d2h"), _copies(log, "h2d")
    assert set(d2h) == set(h2d) == {e.index for e in offload.entries}
    for entry, (_start, end, at) in d2h.items():
        assert log[at - 3] == ("wait_stream", "d2h", "compute")  # the producer's work comes first
        (waited,), (dropped,) = (
            _at(log, ("wait_event", "compute", end)),
            _at(log, ("note", "drop-source", entry)),
        )
        assert waited < dropped  # the source is held until the compute stream waited for its copy
        assert waited < h2d[entry][2]  # … and its H2D is queued after that wait
    for entry, (_start, end, at) in h2d.items():
        assert log[at - 3] == ("wait_stream", "h2d", "compute")
        waits, uses = _at(log, ("wait_event", "compute", end)), _at(log, ("note", "use", entry))
        assert len(waits) == 1 and uses and waits[0] < uses[0]  # waited once, before the first use


def test_the_offload_bound_stands_on_the_schedule_the_copy_path_runs(model, batch):
    """limits.offload_bound lets D2H hide behind the forward only and adds the H2D that outlasts the backward:
    true only while the compute stream waits for every D2H before the first H2D is queued. Checked on the
    copy path's own log, with the bound at a known case."""
    streams, *_ = _host_streams_step(model, batch)
    log = streams.log
    d2h, h2d = _copies(log, "d2h"), _copies(log, "h2d")
    last_d2h_wait = max(_at(log, ("wait_event", "compute", end))[0] for _s, end, _a in d2h.values())
    assert last_d2h_wait < min(at for _s, _e, at in h2d.values())
    bound = limits.offload_bound(
        {"d2h_gbps": 40.0, "h2d_gbps": 50.0},
        {"forward_s": 0.1, "backward_s": 0.2, "step_s": 0.35},
        d2h_bytes=8 * 10**9,
        h2d_bytes=12 * 10**9,
    )  # D2H 0.2 s under a 0.1 s forward, H2D 0.24 s under a 0.2 s backward: 0.1 + 0.04 exposed, added
    assert bound["exposed_transfer_bound_s"] == pytest.approx(0.14)
    assert bound["serial_ratio_bound"] == pytest.approx((0.35 + 0.2 + 0.24) / 0.35)
    assert "OffloadBook.start_backward" in bound["assumes"] and "lower bound" in bound["assumes"]


def test_timed_offload_is_held_to_added_time_not_to_the_phase_timed_ratio():
    """The timing-table claim: a timed step does extra work O beyond the phase-timed step S (its own loss, a
    finiteness check). A perfect offload (added time = the exposed bound E) then misses 0.95 x step_ratio_bound,
    and still meets added_time_floor; an offload that adds too little fails the floor."""
    step_s, exposed_s, extra_s = 0.1, 0.125, 0.01  # nominal H200-like: bound x2.25, O = 0.1 S
    bound = limits.offload_bound(
        {"d2h_gbps": 1.0, "h2d_gbps": 1.0},
        {"forward_s": 0.03, "backward_s": 0.07, "step_s": step_s},
        d2h_bytes=int(0.03e9),
        h2d_bytes=int((0.07 + exposed_s) * 1e9),
    )
    assert bound["exposed_transfer_bound_s"] == pytest.approx(exposed_s)
    base_s = step_s + extra_s
    perfect_s = base_s + exposed_s
    assert perfect_s / base_s < 0.95 * bound["step_ratio_bound"]  # the ratio would fail a correct offload
    assert perfect_s - base_s >= limits.added_time_floor(bound, base_s)
    too_fast_s = base_s + exposed_s - 2 * limits.TIMING_NOISE * base_s
    assert too_fast_s - base_s < limits.added_time_floor(bound, base_s)


def test_host_streams_out_of_order_names_a_release_before_its_wait(model, batch):
    streams, *_ = _host_streams_step(model, batch)
    assert streams.out_of_order() == []
    _, end, _ = _copies(streams.log, "d2h")[0]
    (waited,), (dropped,) = (
        _at(streams.log, ("wait_event", "compute", end)),
        _at(streams.log, ("note", "drop-source", 0)),
    )
    streams.log[waited], streams.log[dropped] = (
        streams.log[dropped],
        streams.log[waited],
    )  # let go first, then wait
    assert streams.out_of_order() == ["entry 0: source let go or fetched before its D2H was waited for"]


def test_cuda_copy_path_read_times_adds_up_the_events(model, batch):
    streams, offload, *_ = _host_streams_step(model, batch)
    stats = offload.read_times()
    ev = streams.events
    spans = [ev[end].t - ev[start].t for c in streams.log if c[0] == "copy" for start, end in [c[2:4]]]
    assert (
        streams.log[-1] == ("synchronize",)
        and len(spans) == stats.offloaded + stats.prefetched + stats.on_demand
    )
    assert stats.transfer_time_s == sum(spans) and stats.transfer_time_s > 0
    # every copy had ended when the compute stream asked for it: no wait is exposed
    assert stats.d2h_wait_s == 0.0 and stats.h2d_wait_s == 0.0 and stats.exposed_transfer_time_s == 0.0


def test_cuda_copy_path_begin_makes_the_d2h_stream_wait_for_the_previous_steps_h2d(model, batch):
    streams, arena = HostStreams(), HostArena(pinned=False)
    ends = []
    for _ in range(2):
        hooks = activation_offload(model, min_bytes=HIDDEN // 2, arena=arena, streams=streams)
        offload_step(model, batch, hooks)
        hooks.finish()
        ends.append(len(streams.log))
    log = streams.log
    last_h2d = max(at for _, _, at in _copies(log[: ends[0]], "h2d").values())
    first_d2h = ends[0] + min(at for _, _, at in _copies(log[ends[0] :], "d2h").values())
    assert ("wait_stream", "d2h", "h2d") in log[last_h2d:first_d2h]  # the slots are overwritten only after
    assert arena.allocations == 1


def test_a_fetched_copy_never_used_is_waited_for_before_finish_lets_it_go():
    """A saved tensor of a branch the backward does not run is fetched with its group, never unpacked."""
    x = torch.randn(64, 64, requires_grad=True)
    streams = HostStreams()
    hooks = ActivationOffload("cpu", min_bytes=0, arena=HostArena(pinned=False), streams=streams)
    with hooks:
        (x * 2).exp().sum()  # exp saves its result: entry 0
        used = (x * 3).tanh().sum()  # tanh saves its result: entry 1
    (grad,) = torch.autograd.grad(used, x)  # only the tanh branch runs
    stats = hooks.finish()
    assert torch.equal(grad, torch.autograd.grad((x * 3).tanh().sum(), x)[0])  # without the hooks
    assert [e.used for e in hooks.entries] == [False, True] and stats.fetched_unused == 1
    assert hooks.copies._ready == {}
    _, end, _ = _copies(streams.log, "h2d")[0]
    (waited,), (dropped,) = (
        _at(streams.log, ("wait_event", "compute", end)),
        _at(streams.log, ("note", "drop-fetched", 0)),
    )
    assert waited < dropped


# ----------------------------------------------------------------------------- offload: did the copies overlap compute?


def test_overlap_counts_copy_time_inside_compute_once_and_nothing_outside_it():
    # a copy inside compute is hidden, one beside it is not, one across an edge is split there
    assert overlap([(1.0, 2.0)], [(0.0, 3.0)]) == Overlap(1.0, 3.0, 1.0)
    assert overlap([(4.0, 5.0)], [(0.0, 3.0)]).hidden_s == 0.0
    split = overlap([(2.0, 4.0)], [(0.0, 3.0), (3.5, 6.0)])
    assert (split.hidden_s, split.alone_s, split.hidden_fraction) == (1.5, 0.5, 0.75)
    # two side streams copying at once count once; compute split in touching pieces counts its length
    both = overlap([(0.0, 2.0), (1.0, 3.0)], [(0.0, 1.0), (1.0, 2.0)])
    assert (both.copy_s, both.compute_s, both.hidden_s) == (3.0, 2.0, 2.0)
    assert covered([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0  # touching is not overlapping
    assert union([(3.0, 4.0), (0.0, 2.0), (1.0, 2.5)]) == [(0.0, 2.5), (3.0, 4.0)]
    assert overlap([], [(0.0, 1.0)]).hidden_fraction is None
    with pytest.raises(TrainmechError, match="finite start <= end"):
        overlap([(2.0, 1.0)], [])


def test_overlap_problems_tell_hidden_copies_from_serial_ones_threshold_by_threshold():
    """gpu-check's overlap verdict on intervals whose overlap is known: each threshold fails on its own."""
    from trainmech.gpucheck import offload_overlap as oo

    assert "tell hidden copies from serial ones" in oo.arithmetic_self_check()
    compute = [(0.0, 4.0)]
    hidden = overlap([(1.0, 3.0)], compute)
    # compute busy 4 of the 5 s from the first start to the last end: the kernel floor is half of 4/5
    floor = oo.kernel_floor([(3.95, 5.0)], compute)
    assert floor == pytest.approx(oo.HIDDEN_SHARE_OF_BUSY * 4 / 5)
    assert oo.overlap_problems(hidden, floor, 0.0, 1.0, 0.6, hidden, 0.0) == []
    thin = overlap([(3.95, 5.0)], compute)  # 0.05 s of 1.05 during kernels: under the floor
    (problem,) = oo.overlap_problems(thin, floor, 0.0, 1.0, 0.6, hidden, 0.0)
    assert "during kernels" in problem
    (problem,) = oo.overlap_problems(hidden, floor, 0.7, 1.0, 0.6, hidden, 0.0)
    assert "above 60%" in problem
    (problem,) = oo.overlap_problems(hidden, floor, 0.0, 1.0, 0.6, thin, 0.0)
    assert "during the stalls" in problem
    (problem,) = oo.overlap_problems(hidden, floor, 0.0, 1.0, 0.6, hidden, 0.2)
    assert "waited 200000.0 us" in problem
    # a stalled step without a D2H copy is a failure that says so, not a format error
    (problem,) = oo.overlap_problems(hidden, floor, 0.0, 1.0, 0.6, overlap([], compute), 0.0)
    assert "no copy of the D2H" in problem
    # no copy under any kernel fails even where the compute stream was hardly busy (the floor near 0)
    (problem,) = oo.overlap_problems(overlap([(5.0, 6.0)], compute), 0.0, 0.0, 1.0, 0.6, hidden, 0.0)
    assert "during kernels" in problem
    floor, ceiling = oo.exposed_ceiling({"exposed_transfer_bound_s": 0.1, "d2h_s": 0.2, "h2d_s": 0.2})
    assert (floor, ceiling) == (0.25, 0.625)


def _kineto(cat, stream, ts, dur):
    return {"ph": "X", "cat": cat, "name": cat, "ts": ts, "dur": dur, "args": {"stream": stream, "device": 0}}


def test_trace_intervals_takes_copies_on_streams_without_kernels_and_refuses_a_trace_without_kernels(
    model, batch
):
    trace = {
        "traceEvents": [
            _kineto("kernel", 7, 0, 100),
            _kineto("kernel", 7, 150, 100),
            _kineto("gpu_memcpy", 7, 260, 40),  # on the compute stream (save_on_cpu's kind): compute time
            _kineto("gpu_memcpy", 13, 80, 100),  # a side copy: 20 + 30 us under kernels, 50 alone
            _kineto("gpu_memcpy", 17, 300, 10),  # after the compute stream's copy ends: alone
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
        ]
    }
    copies, compute = trace_intervals(trace)
    assert copies == [(80e-6, 180e-6), (300e-6, 310e-6)] and len(compute) == 3
    got = overlap(copies, compute)
    assert got.hidden_s == pytest.approx(50e-6) and got.alone_s == pytest.approx(60e-6)
    # a real profiler trace from this CPU has operators but no kernel: refused in one sentence
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, batch)
    events = [
        {"ph": "X", "cat": "cpu_op", "ts": e.time_range.start, "dur": e.time_range.elapsed_us()}
        for e in prof.events()
    ]
    assert events
    with pytest.raises(TrainmechError, match="holds no CUDA kernel"):
        trace_intervals({"traceEvents": events})


def test_copies_on_a_cpu_fall_inside_the_layer_that_packed_them_and_never_inside_a_stall(model, batch):
    """Real host-clock intervals of the CUDA copy path on HostStreams: a CPU copies in line with its work, so
    every D2H copy lies inside the forward of the layer that packed it and none inside a sleep queued between
    layers; the same arithmetic must say both."""
    import time

    streams = HostStreams()
    hooks = activation_offload(model, min_bytes=HIDDEN // 2, arena=HostArena(pinned=False), streams=streams)
    origin = streams.mark("compute")
    spans, stalls, handles = {}, [], []
    for layer in model.model.layers:

        def before(module, args):
            begin = streams.mark("compute")
            time.sleep(1e-3)  # the host stalls between layers: no copy is under way
            stalls.append((begin, streams.mark("compute")))
            spans[module] = streams.mark("compute")

        def after(module, args, out):
            spans[module] = (spans[module], streams.mark("compute"))

        handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    try:
        offload_step(model, batch, hooks)
    finally:
        for h in handles:
            h.remove()
    hooks.finish()
    hooks.read_times()
    rel = lambda pairs: [(streams.seconds(origin, a), streams.seconds(origin, b)) for a, b in pairs]  # noqa: E731
    d2h = hooks.copies.intervals(origin, "d2h")
    assert len(d2h) == hooks.stats.offloaded and len(hooks.copies.intervals(origin, "h2d")) == len(d2h)
    in_layers, in_stalls = overlap(d2h, rel(spans.values())), overlap(d2h, rel(stalls))
    assert in_layers.copy_s > 0 and in_layers.hidden_s == pytest.approx(in_layers.copy_s)
    assert in_stalls.hidden_s == 0.0 and in_stalls.compute_s >= len(stalls) * 1e-3
    with pytest.raises(TrainmechError, match="'d2h' or 'h2d'"):
        hooks.copies.intervals(origin, "compute")


# ----------------------------------------------------------------------------- optimizer-in-backward and the scenarios


def test_optimizer_in_backward_equals_adamw_and_frees_every_gradient(batch, tiny_qwen2):
    def two_updates(in_backward):
        model = tiny_qwen2(**TASK5_MODEL)
        optimizer = (
            OptimizerInBackward(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
            if in_backward
            else torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        )
        for _ in range(2):
            model(**batch).loss.backward()
            if in_backward:
                assert all(p.grad is None for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], optimizer

    plain, _ = two_updates(False)
    fused, opt = two_updates(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, fused))
    assert opt.updates == 2 * len(plain) and len(opt.state) == len(plain)
    opt.remove()


@contextmanager
def _offloaded(model):
    hooks = activation_offload(model, min_bytes=HIDDEN // 4, arena=HostArena(pinned=False))
    with hooks:
        yield hooks
    hooks.finish()


def test_scenario_matrix_predicts_every_measured_cell(model, tensors):
    """Strategies x first / steady x forward+backward / whole update x optimizer steps: the ledger's views within 1 %."""
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizers = {
        "foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
        "fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "in-backward": lambda ps: OptimizerInBackward(
            ps, lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False)
        ),
    }
    got = ledger.measure_matrix(
        model,
        tensors,
        initial,
        optimizers=optimizers,
        strategies={"baseline": None, "checkpoint": lambda m: C.hf_checkpointing(m), "offload": _offloaded},
    )
    rows = scenarios.scenario_matrix(
        model.config, B, T, device="cpu", optimizer_steps=tuple(optimizers), min_bytes=HIDDEN // 4
    )
    measured = {k: (m.forward_backward_bytes, m.whole_bytes) for k, m in got.items()}
    assert len(rows) == 24 and scenarios.worst_peak_error(rows, measured) <= 0.01
    text = scenarios.render_rows(rows, unit=2**10, unit_name="KiB", measured_rows=measured)
    assert text.count("\n") == 24 and "in-backward" in text
    head = text.splitlines()[0]
    assert "fwd+bwd change" in head and "update change" in head  # each change column names its peak
    assert all(m.whole_allocated is None for m in got.values())  # no CUDA allocator here: unknown, not 0


def test_scenario_views_refuse_what_they_do_not_model():
    with pytest.raises(TrainmechError, match="unknown optimizer step"):
        scenarios.scenario_ledger(
            "qwen2-tiny", 1, 32, strategy="baseline", update="first", optimizer_step="adafactor"
        )
    with pytest.raises(TrainmechError, match="strategy must be one of"):
        scenarios.scenario_ledger("qwen2-tiny", 1, 32, strategy="zero", update="first")


def test_gpu_shape_scenarios_tell_the_forward_backward_peak_from_the_update_peak():
    rows = scenarios.scenario_matrix(
        "qwen2.5-0.5b", 2, 512, device="cuda", optimizer_steps=("default", "in-backward")
    )
    drops = scenarios.drops(rows, "checkpoint")
    assert (
        drops[("first", "default", "fwd+bwd")] > 0.25 and drops[("first", "default", "update")] < 0.01
    )  # the step peaks
    assert drops[("steady", "in-backward", "update")] > drops[("steady", "default", "update")]  # the remedy
    per_row = {
        s: scenarios.bytes_per_row("qwen2.5-0.5b", 2, 256, strategy=s, device="cuda")
        for s in ("baseline", "checkpoint")
    }
    assert per_row["checkpoint"] < per_row["baseline"] / 2


def test_record_lines_name_the_peak_field_once_per_experiment_and_print_what_the_record_holds():
    from types import SimpleNamespace as NS

    from trainmech import strategy_records

    def record(sid, wid, **metrics):
        return NS(
            identity=NS(semantic_id=sid, workload_id=wid),
            resources=NS(peak_allocated_bytes=None, recompute_count=128, transfer_bytes=1234567),
            conclusion=NS(decision=None),
            metrics=metrics,
        )

    records = [
        record("TRAIN-CHECKPOINT", "w.a", cpu_tracked_peak_bytes=6521608),
        record("TRAIN-CHECKPOINT", "w.b", cpu_tracked_peak_bytes=7890952),
        record("TRAIN-OFFLOAD", "w.c", exposed_transfer_time_s=0.0123456),
    ]
    lines = strategy_records.record_lines(records)
    heads = [line for line in lines if not line.startswith(" ")]
    assert [h.split(" — ")[0] for h in heads] == ["TRAIN-CHECKPOINT", "TRAIN-OFFLOAD"]
    assert "metrics.cpu_tracked_peak_bytes" in heads[0] and "not Task4's count" in heads[0]
    assert "    metrics.cpu_tracked_peak_bytes = 6,521,608" in lines
    assert "    resources.peak_allocated_bytes = null" in lines and "    metrics.outcome = null" in lines
    assert "    metrics.exposed_transfer_time_s = 0.0123" in lines  # a time: three digits
    assert "    resources.transfer_bytes = 1,234,567" in lines
    assert set(strategy_records.RECORD_FIELDS) == set(strategy_records.PEAK_FIELD)


def test_timing_table_prints_one_row_per_measured_strategy_and_a_dash_for_what_was_not_measured(
    gpu_performance,
):
    """The GPU timing table (the notebook prints it on CUDA only): a strategy without a measurement is left out,
    a field the strategy does not have (no transfers for a checkpoint) is a dash, never 0."""
    from types import SimpleNamespace as NS

    from trainmech import strategy_records

    measured = gpu_performance(0.2, 0.25, 2_500_000, peak_reserved_bytes=3_000_000)
    measured.forward_backward_reserved_bytes = 2_000_000
    runs = {
        "checkpoint": NS(performance=measured, reference_performance=gpu_performance(0.1)),
        "not-timed": NS(performance=None, reference_performance=None),
    }
    header, rule, row = strategy_records.timing_table(runs).splitlines()
    assert header.split()[:3] == ["strategy", "median", "s"] and set(rule) <= {"-", " "}
    assert row.split() == [
        "checkpoint",
        "0.2000",
        "0.2500",
        "2.00",
        "3,000,000",
        "2,500,000",
        "2,000,000",
        "—",
        "—",
    ]


def test_step_phase_times_leaves_the_model_and_optimizer_as_they_were(tiny_qwen2):
    model = tiny_qwen2(**TASK5_MODEL)
    batch = {"input_ids": torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))}
    batch["labels"] = batch["input_ids"].clone()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    phases = limits.step_phase_times(model, batch, optimizer, warmup=1, repeats=1)
    assert phases["update_s"] > 0
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # two real AdamW steps at lr 1e-2 ran
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_offload_refuses_a_saved_tensor_modified_in_place_after_pack():
    """Under any saved-tensor hook autograd skips its version check; ActivationOffload does it instead."""
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    hooks = ActivationOffload(device=torch.device("cpu"), min_bytes=1, arena=HostArena(pinned=False))
    with hooks:
        y = x * 1
        z = (y * w.sum()).sum()
    y.mul_(2)
    with pytest.raises(TrainmechError, match="modified in place after ActivationOffload packed it"):
        z.backward()


def test_same_replays_maps_each_partial_region_to_its_layer_in_the_full_run():
    def ops(layer, fwd):  # a region's recomputed ops, distinct per layer and forward
        return [f"op{layer}.{fwd}"]

    full = C.RecomputeCount(regions=[C.Region(recomputed=ops(i, f)) for f in range(2) for i in range(4)])
    half = C.RecomputeCount(regions=[C.Region(recomputed=ops(i, f)) for f in range(2) for i in (0, 2)])
    assert C.same_replays(full, half, [0, 2], 4)
    assert not C.same_replays(full, half, [1, 3], 4)  # the wrong layers
    swapped = C.RecomputeCount(regions=[C.Region(recomputed=ops(i, 1 - f)) for f in range(2) for i in (0, 2)])
    assert not C.same_replays(full, swapped, [0, 2], 4)  # the right layers of the other forward
    assert not C.same_replays(full, C.RecomputeCount(regions=half.regions[:3]), [0, 2], 4)  # a region missing


def test_checkpoint_relations_follow_the_ledger_for_the_workload_not_the_cpu_shape():
    """scenario-matrix on a GPU smoke shape: at 128 tokens the ledger puts both forward + backward peaks at the tied
    embedding's accumulation (checkpoint cannot lower it), so the claim must expect "=" there; a measurement that
    is lower, or one off by more than the margin, is told apart."""
    from trainmech import ledger, profiles

    assert [ledger.scenarios.relation(a, 100, 1.01) for a in (98, 100, 100.9, 102)] == ["<", "=", "=", ">"]
    spec = profiles.for_mode("TRAIN-CUDA-MECHANISM").workload("smoke-b2s128")
    rows = ledger.scenario_matrix(
        spec.model, spec.batch, spec.seq, dtype="fp32", device="cuda", optimizer_steps=("foreach",)
    )
    exact = {
        (r.strategy, r.update, r.optimizer_step): (r.forward_backward.bytes, r.whole.bytes) for r in rows
    }
    relations = ledger.scenarios.checkpoint_relations(rows, exact, 1.01)
    assert relations["fwd+bwd"] == ("=", "=")
    lowered = dict(exact)
    fb, whole = exact["checkpoint", "steady", "foreach"]
    lowered["checkpoint", "steady", "foreach"] = (fb * 0.9, whole)
    assert ledger.scenarios.checkpoint_relations(rows, lowered, 1.01)["fwd+bwd"] == ("=", "<")
