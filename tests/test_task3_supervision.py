"""Task3 · supervision: effective supervised tokens, the two normalisations, the refused windows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainmech import supervision, workload
from trainmech.errors import TrainmechError
from trainmech.workload import IGNORE_INDEX

pytestmark = pytest.mark.task3

VOCAB = 11


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small models run faster on one thread, and a shared CPU does not stall them; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ToyLM(torch.nn.Module):
    """A float64 causal LM small enough for hypothesis: embedding, a causal running mean, a head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, 6, generator=g, dtype=torch.float64))
        self.head = torch.nn.Parameter(torch.randn(VOCAB, 6, generator=g, dtype=torch.float64))

    def forward(self, input_ids, attention_mask):
        h = self.embed[input_ids] * attention_mask[..., None]  # (B, T, C)
        seen = attention_mask.cumsum(1).clamp_min(1)[..., None]  # (B, T, 1)
        return SimpleNamespace(logits=(h.cumsum(1) / seen) @ self.head.T)  # (B, T, V): position t sees ≤ t


def full_batch_grads(model, batch):
    """The reference: one forward over the whole batch, mean over its supervised tokens."""
    model.zero_grad(set_to_none=True)
    logits = model(batch["input_ids"], batch["attention_mask"]).logits
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX
    )
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def max_rel(a, b):
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


@st.composite
def masked_batches(draw):
    """4 rows of random tokens, random right padding and random supervision starts (≥ 1 token supervised)."""
    seq = draw(st.integers(3, 9))
    rows, starts = [], []
    for _ in range(4):
        length = draw(st.integers(2, seq))
        rows.append(draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length)))
        starts.append(draw(st.integers(0, length)))
    if all(max(s, 1) >= len(r) for s, r in zip(starts, rows)):
        starts[0] = 0  # keep at least one supervised token after the shift
    width = max(len(r) for r in rows)
    ids = torch.zeros(4, width, dtype=torch.long)
    att = torch.zeros(4, width, dtype=torch.long)
    labels = torch.full((4, width), IGNORE_INDEX, dtype=torch.long)
    for i, (r, s) in enumerate(zip(rows, starts)):
        ids[i, : len(r)] = torch.tensor(r)
        att[i, : len(r)] = 1
        labels[i, s : len(r)] = ids[i, s : len(r)]
    return {"input_ids": ids, "attention_mask": att, "labels": labels}


# ---------------------------------------------------------------- denominators and weights


def test_denominators_of_both_normalisations():
    assert supervision.denominators([3, 1, 4], "window_tokens") == [8, 8, 8]
    assert supervision.denominators([3, 1, 4], "micro_mean") == [9, 3, 12]


@given(st.lists(st.integers(1, 50), min_size=1, max_size=6))
def test_token_weights_sum_to_one_and_agree_only_for_equal_counts(tokens):
    for norm in supervision.NORMALIZATIONS:
        weights = supervision.token_weights(tokens, norm)
        assert abs(sum(w * n for w, n in zip(weights, tokens)) - 1) < 1e-12
    same = supervision.token_weights(tokens, "micro_mean") == supervision.token_weights(
        tokens, "window_tokens"
    )
    assert same == (len(set(tokens)) == 1)


def test_a_window_without_supervised_tokens_is_refused():
    for norm in supervision.NORMALIZATIONS:
        with pytest.raises(TrainmechError, match="supervises no token"):
            supervision.denominators([0, 0], norm)


def test_micro_mean_refuses_an_empty_micro_batch_window_tokens_does_not():
    assert supervision.denominators([5, 0], "window_tokens") == [5, 5]
    with pytest.raises(TrainmechError, match="micro-batch 1 supervises no token"):
        supervision.denominators([5, 0], "micro_mean")


def test_unknown_normalisation_and_empty_window_are_refused():
    with pytest.raises(TrainmechError, match="unknown normalization"):
        supervision.denominators([1], "mean")
    with pytest.raises(TrainmechError, match="at least one micro-batch"):
        supervision.denominators([], "window_tokens")


# ---------------------------------------------------------------- token_loss_sum


def test_token_loss_sum_is_the_shifted_sum():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    labels[0, 3:] = IGNORE_INDEX
    expected = sum(
        F.cross_entropy(logits[b, t][None], labels[b, t + 1][None])
        for b in range(2)
        for t in range(4)
        if labels[b, t + 1] != IGNORE_INDEX
    )
    assert torch.allclose(supervision.token_loss_sum(logits, labels), expected, rtol=1e-6)
    assert supervision.token_loss_sum(logits, torch.full_like(labels, IGNORE_INDEX)).item() == 0.0


# ---------------------------------------------------------------- accumulate_gradients


@settings(max_examples=30, deadline=None)
@given(masked_batches(), st.sampled_from([1, 2, 4]))
def test_window_tokens_matches_the_full_batch(batch, n):
    model = ToyLM()
    loss_ref, g_ref = full_batch_grads(model, batch)
    model.zero_grad(set_to_none=True)
    window = supervision.accumulate_gradients(model, workload.split_micro_batches(batch, n))
    assert window.effective_tokens == workload.supervised_tokens(batch["labels"])
    assert sum(window.micro_tokens) == window.effective_tokens
    assert abs(window.loss.item() - loss_ref.item()) <= 1e-12 * abs(loss_ref.item())
    assert max_rel([p.grad for p in model.parameters()], g_ref) <= 1e-10


def test_micro_mean_diverges_when_counts_are_unequal():
    batch = workload.pad_batch(
        [[1, 2, 3, 4, 5, 6], [7, 8, 9], [2, 4, 6, 8], [3, 5]], supervise_from=[0, 1, 2, 0]
    )
    model = ToyLM()
    _, g_ref = full_batch_grads(model, batch)
    micro = workload.split_micro_batches(batch, 2)
    assert len({workload.supervised_tokens(mb["labels"]) for mb in micro}) == 2
    model.zero_grad(set_to_none=True)
    supervision.accumulate_gradients(model, micro, normalization="micro_mean")
    assert max_rel([p.grad for p in model.parameters()], g_ref) > 1e-2
    # ... and equals each micro-batch's mean divided by the number of micro-batches
    model.zero_grad(set_to_none=True)
    for mb in micro:
        logits = model(mb["input_ids"], mb["attention_mask"]).logits
        (F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten()) / len(micro)).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    supervision.accumulate_gradients(model, micro, normalization="micro_mean")
    assert max_rel([p.grad for p in model.parameters()], expected) <= 1e-12


def test_a_fully_masked_window_is_refused_before_touching_grad():
    batch = workload.pad_batch([[1, 2, 3], [4, 5]], supervise_from=[3, 2])
    assert workload.supervised_tokens(batch["labels"]) == 0
    model = ToyLM()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(TrainmechError, match="supervises no token"):
        supervision.accumulate_gradients(model, workload.split_micro_batches(batch, 2))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())


def test_accumulate_adds_into_existing_grad():
    batch = workload.pad_batch([[1, 2, 3, 4], [5, 6, 7]])
    model = ToyLM()
    model.zero_grad(set_to_none=True)
    supervision.accumulate_gradients(model, [batch])
    once = [p.grad.clone() for p in model.parameters()]
    supervision.accumulate_gradients(model, [batch])
    assert all(torch.allclose(p.grad, 2 * g) for p, g in zip(model.parameters(), once))


def test_real_qwen2_window_matches_its_own_loss_in_fp32(tiny_profile_model):
    built = tiny_profile_model(seed=0)
    model = built.model
    batch = workload.pad_batch(
        [list(range(5, 21)), list(range(30, 37)), list(range(40, 52)), list(range(60, 66))],
        supervise_from=[0, 3, 8, 1],
    )
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    supervision.accumulate_gradients(model, workload.split_micro_batches(batch, 4))
    assert max_rel([p.grad for p in model.parameters()], ref) <= 1e-6


# ---------------------------------------------------------------- host syncs, hooks for AMP and strategies


def _uneven(seq=8):
    rows = [[1, 2, 3, 4, 5, 6, 7, 8][:seq], [2, 3, 4], [5, 6, 7, 8, 9], [3, 4]]
    return workload.pad_batch([r[:seq] for r in rows], supervise_from=[0, 1, 2, 0])


def test_count_tokens_reads_every_micro_batch_after_the_shift():
    micro = workload.split_micro_batches(_uneven(), 4)
    assert supervision.count_tokens(micro) == tuple(workload.supervised_tokens(mb["labels"]) for mb in micro)
    assert supervision.count_tokens([]) == ()


def _window_and_grads(model, micro, **options):
    """(Window, every parameter's .grad) of one accumulation window from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    window = supervision.accumulate_gradients(model, micro, **options)
    return window, [p.grad.clone() for p in model.parameters()]


def test_precounted_tokens_give_the_same_window_and_the_loss_stays_a_float64_tensor():
    micro, model = workload.split_micro_batches(_uneven(), 2), ToyLM()
    counted_here, g_here = _window_and_grads(model, micro)
    precounted, g_pre = _window_and_grads(model, micro, micro_tokens=supervision.count_tokens(micro))
    assert all(torch.equal(a, b) for a, b in zip(g_pre, g_here))
    assert torch.equal(precounted.loss, counted_here.loss)
    assert precounted.loss.dtype == torch.float64 and precounted.loss.dim() == 0


def test_scale_multiplies_the_gradient_not_the_returned_loss():
    micro, model = workload.split_micro_batches(_uneven(), 2), ToyLM()
    plain, g = _window_and_grads(model, micro)
    scaled, g_scaled = _window_and_grads(model, micro, scale=lambda loss: loss * 8.0)
    assert torch.equal(scaled.loss, plain.loss)
    assert all(torch.allclose(a, 8.0 * b, rtol=1e-15, atol=0) for a, b in zip(g_scaled, g))


def test_autocast_wraps_each_forward_and_contexts_wrap_each_micro_batch():
    from contextlib import contextmanager

    events = []

    @contextmanager
    def tagged(name):
        events.append(f"enter {name}")
        yield
        events.append(f"exit {name}")

    micro = workload.split_micro_batches(_uneven(), 2)
    model = ToyLM()
    supervision.accumulate_gradients(
        model,
        micro,
        autocast=lambda: tagged("autocast"),
        contexts=(lambda m: tagged("strategy"),),
        forward_kwargs={},
    )
    assert events == ["enter strategy", "enter autocast", "exit autocast", "exit strategy"] * 2


def test_precounted_empty_window_is_still_refused_before_any_forward():
    micro = workload.split_micro_batches(_uneven(), 2)
    calls = []
    model = ToyLM()
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(TrainmechError, match="supervises no token"):
        supervision.accumulate_gradients(model, micro, micro_tokens=(0, 0))
    assert not calls


def test_gradient_accumulation_experiment_reports_both_normalizations_and_record_fields():
    from trainmech.session import start

    session = start("cpu", "scratch-tests", results_dir="/tmp/trainmech-test-unused")
    wid = next(
        w
        for w, spec in session.profile.workloads.items()
        if "TRAIN-GRADIENT-ACCUMULATION" in spec.experiments
    )
    result = supervision.gradient_accumulation_experiment(session, wid, lr=1e-3, warmup=0, timed_windows=1)
    assert max(result.errors("window_tokens")) <= 1e-6 < 1e-2 <= min(result.errors("micro_mean"))
    fields = result.record_fields()
    assert fields["effective_batch"]["supervised_tokens"] == result.effective_tokens
    assert fields["resources"]["peak_allocated_bytes"] is None  # not measured on a CPU
    assert "peaks: not measured on CPU" in result.peak_lines("reference")
    table = result.table().splitlines()  # a title, the header, its rule, one row per split
    assert len(table) == 3 + len(result.rows) and table[1].startswith("micro-batches")
    assert all(("≤ 1e-6" in line) == ("window_tokens" in line) for line in table[3:])
