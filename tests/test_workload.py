"""The offline workload (trainmech.workload): corpus, tokenizer, batches, masks, the model factory."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainmech
from trainmech import profiles, workload
from trainmech.errors import TrainmechError
from trainmech.workload import IGNORE_INDEX

pytestmark = pytest.mark.package


@pytest.fixture(scope="module")
def qwen_spec():
    return profiles.load("TRAIN-CUDA-MECHANISM").model()


def mixed_paragraphs() -> tuple[str, str]:
    """One Chinese and one English paragraph from the shipped corpus."""
    paras = workload.paragraphs("domain") + workload.paragraphs("general")
    zh = next(p for p in paras if any("\u4e00" <= ch <= "\u9fff" for ch in p))
    en = next(p for p in paras if p.isascii())
    return zh, en


# ---------------------------------------------------------------- offline


def test_importing_trainmech_sets_hf_offline():
    assert trainmech.__name__ == "trainmech"
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["TRANSFORMERS_OFFLINE"] == "1"


def test_importing_trainmech_overrides_an_online_setting():
    code = (
        "import os, trainmech, huggingface_hub.constants as c; "
        "print(os.environ['HF_HUB_OFFLINE'], c.HF_HUB_OFFLINE)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]


# ---------------------------------------------------------------- corpus


@pytest.mark.parametrize("part", workload.CORPUS_PARTS)
def test_corpus_parts_exist_and_are_non_trivial(part):
    text = workload.corpus(part)
    assert len(text.encode("utf-8")) > 3 * 1024
    assert len(workload.paragraphs(part)) >= 5
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text) and any("a" <= ch <= "z" for ch in text)


def test_corpus_parts_differ():
    assert workload.corpus("domain") != workload.corpus("general")


@pytest.mark.parametrize("part", ["", "Domain", "retain", "../domain"])
def test_unknown_corpus_part_is_refused(part):
    with pytest.raises(TrainmechError, match="domain, general"):
        workload.corpus(part)


# ---------------------------------------------------------------- tokenizer


def test_shipped_tokenizer_equals_a_freshly_trained_one():
    assert workload.build_tokenizer().to_str() == workload.load_tokenizer().to_str()


def test_tokenizer_identity_names_the_file_sha256():
    digest = hashlib.sha256(workload.tokenizer_path().read_bytes()).hexdigest()
    ident = workload.tokenizer_identity()
    assert ident.startswith(workload.TOKENIZER_NAME + " ")
    assert ident.split("sha256:")[1] == digest[: len(ident.split("sha256:")[1])]
    assert len(ident.split("sha256:")[1]) >= 16


def test_tokenizer_has_the_special_tokens_and_vocab_size():
    tok = workload.load_tokenizer()
    assert tok.get_vocab_size() == workload.VOCAB_SIZE
    assert workload.pad_id() == tok.token_to_id("<|pad|>") is not None
    assert tok.token_to_id("<|endoftext|>") is not None
    assert workload.pad_id() != tok.token_to_id("<|endoftext|>")


def test_encode_decode_round_trips_chinese_and_english_corpus_text():
    zh, en = mixed_paragraphs()
    for text in (zh, en, zh + "\n" + en, "激活（activations）与 optimizer.step()"):
        ids = workload.encode(text)
        assert ids and all(0 <= i < workload.VOCAB_SIZE for i in ids)
        assert workload.decode(ids) == text


def test_bpe_compresses_corpus_text():
    _, en = mixed_paragraphs()
    assert len(workload.encode(en)) < len(en.encode("utf-8")) / 1.5


@given(st.text(max_size=60))
@settings(max_examples=60, deadline=None)
def test_encode_decode_round_trips_any_text(text):
    assert workload.decode(workload.encode(text)) == text


# ---------------------------------------------------------------- batches


def test_lm_batch_shapes_labels_and_mask():
    b = workload.lm_batch("domain", 3, 16)
    assert set(b) == {"input_ids", "attention_mask", "labels"}
    for v in b.values():
        assert v.shape == (3, 16) and v.dtype == torch.long
    assert torch.equal(b["labels"], b["input_ids"])
    assert b["labels"].data_ptr() != b["input_ids"].data_ptr()  # a copy, not an alias
    assert bool((b["attention_mask"] == 1).all())
    stream = workload.token_stream("domain")
    assert b["input_ids"][1].tolist() == list(stream[16:32])


def test_lm_batch_is_deterministic_and_offset_moves_the_windows():
    a = workload.lm_batch("general", 2, 32)
    assert all(torch.equal(a[k], workload.lm_batch("general", 2, 32)[k]) for k in a)
    shifted = workload.lm_batch("general", 1, 32, offset=32)
    assert torch.equal(shifted["input_ids"][0], a["input_ids"][1])
    n = len(workload.token_stream("general"))
    assert torch.equal(workload.lm_batch("general", 2, 32, offset=n)["input_ids"], a["input_ids"])  # wraps


def test_lm_batch_refuses_a_sequence_longer_than_the_corpus():
    n = len(workload.token_stream("domain"))
    with pytest.raises(TrainmechError, match="longer"):
        workload.lm_batch("domain", 1, n + 1)


def test_pad_batch_pads_with_pad_id_mask_zero_and_ignored_labels():
    b = workload.pad_batch([[5, 6, 7], [8], [9, 10]])
    pad = workload.pad_id()
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, pad, pad], [9, 10, pad]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert b["labels"].tolist() == [[5, 6, 7], [8, -100, -100], [9, 10, -100]]


def test_pad_batch_supervise_from_masks_the_prefix():
    b = workload.pad_batch([[5, 6, 7, 8], [9, 10]], supervise_from=[2, 1])
    assert b["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, -100, -100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


@pytest.mark.parametrize(
    "sequences, supervise_from",
    [([], None), ([[1], []], None), ([[1, 2]], [0, 1])],
)
def test_pad_batch_refuses_bad_input(sequences, supervise_from):
    with pytest.raises(TrainmechError):
        workload.pad_batch(sequences, supervise_from=supervise_from)


def test_prompt_response_batch_supervises_only_the_response():
    pairs = [("什么是梯度？", "损失对参数的导数。"), ("What is a loss?", "One number to minimise.")]
    b = workload.prompt_response_batch(pairs)
    eot = workload.load_tokenizer().token_to_id("<|endoftext|>")
    expected_supervised = 0
    for i, (prompt, response) in enumerate(pairs):
        p, r = workload.encode(prompt), workload.encode(response)
        n = len(p) + len(r) + 1
        row_ids, row_labels = b["input_ids"][i].tolist(), b["labels"][i].tolist()
        assert row_ids[:n] == p + r + [eot]
        assert row_labels[: len(p)] == [IGNORE_INDEX] * len(p)  # the prompt is seen, not supervised
        assert row_labels[len(p) : n] == r + [eot]
        assert all(x == IGNORE_INDEX for x in row_labels[n:])
        assert b["attention_mask"][i].tolist() == [1] * n + [0] * (len(row_ids) - n)
        expected_supervised += len(r) + 1
    assert workload.supervised_tokens(b["labels"]) == expected_supervised


def test_supervised_tokens_counts_after_the_causal_shift():
    b = workload.lm_batch("domain", 2, 10)
    assert workload.supervised_tokens(b["labels"]) == 2 * 9  # the first position predicts nothing


@given(
    rows=st.lists(
        st.tuples(st.integers(min_value=1, max_value=12), st.integers(min_value=0, max_value=14)),
        min_size=1,
        max_size=5,
    )
)
@settings(max_examples=80, deadline=None)
def test_supervised_tokens_property(rows):
    """Row of n tokens supervised from s: positions max(s, 1) .. n-1 enter the loss after the shift."""
    sequences = [list(range(1, n + 1)) for n, _ in rows]
    starts = [s for _, s in rows]
    b = workload.pad_batch(sequences, supervise_from=starts)
    expected = sum(max(0, n - max(s, 1)) for n, s in rows)
    assert workload.supervised_tokens(b["labels"]) == expected
    # the same count as the loss itself sees: shifted labels != ignore_index
    shifted = b["labels"][:, 1:].reshape(-1)
    assert int((shifted != IGNORE_INDEX).sum()) == expected
    assert int((b["labels"] != IGNORE_INDEX).sum()) <= int(b["attention_mask"].sum())


def test_split_micro_batches_splits_evenly_and_in_order():
    b = workload.lm_batch("domain", 4, 8)
    parts = workload.split_micro_batches(b, 2)
    assert len(parts) == 2
    for part in parts:
        assert set(part) == set(b)
        assert all(v.shape == (2, 8) for v in part.values())
    for k in b:
        assert torch.equal(torch.cat([p[k] for p in parts]), b[k])
    assert len(workload.split_micro_batches(b, 4)) == 4
    assert workload.split_micro_batches(b, 1)[0]["input_ids"].shape == (4, 8)


@pytest.mark.parametrize("n", [3, 0, -1, 8])
def test_split_micro_batches_refuses_a_non_dividing_split(n):
    with pytest.raises(TrainmechError, match="4 rows"):
        workload.split_micro_batches(workload.lm_batch("domain", 4, 8), n)


# ---------------------------------------------------------------- the model


def test_build_model_gives_a_real_qwen2_in_train_mode_with_tied_embeddings(tiny_spec):
    from transformers import Qwen2ForCausalLM

    built = workload.build_model(tiny_spec, seed=3)
    m = built.model
    assert type(m) is Qwen2ForCausalLM
    assert m.training and all(mod.training for mod in m.modules())
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert m.config.vocab_size == workload.load_tokenizer().get_vocab_size()
    assert (m.config.hidden_size, m.config.num_hidden_layers) == (64, 2)
    assert built.model_weights == "random-init seed=3"
    assert (built.model_id, built.model_commit) == ("trainmech/qwen2-tiny", None)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in m.parameters())
    b = workload.lm_batch("domain", 2, 16)
    out = m(**b)
    assert out.logits.shape == (2, 16, workload.VOCAB_SIZE)
    assert torch.isfinite(out.loss) and out.loss.item() > 0


def test_build_model_same_seed_same_weights_other_seed_other_weights(tiny_spec):
    a = workload.build_model(tiny_spec, seed=11).model.state_dict()
    torch.randn(100)  # global RNG state in between must not matter
    b = workload.build_model(tiny_spec, seed=11).model.state_dict()
    c = workload.build_model(tiny_spec, seed=12).model.state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_build_model_honours_dtype_and_config_overrides(tiny_spec):
    built = workload.build_model(tiny_spec, seed=0, dtype=torch.float64, num_hidden_layers=1)
    assert all(p.dtype == torch.float64 for p in built.model.parameters())
    assert built.model.config.num_hidden_layers == 1


def test_n_params_counts_a_tied_weight_once(tiny_spec):
    m = workload.build_model(tiny_spec, seed=0).model
    every = sum(p.numel() for _, p in m.named_parameters(remove_duplicate=False))
    assert workload.n_params(m) == every - m.lm_head.weight.numel()


def test_local_weights_is_none_without_a_cached_snapshot(qwen_spec, tiny_spec, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path))
    assert workload.local_weights(qwen_spec) is None
    assert workload.local_weights(tiny_spec) is None  # no pinned commit: never pretrained


def test_local_weights_finds_the_snapshot_at_the_pinned_commit(qwen_spec, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path))
    base = tmp_path / "models--Qwen--Qwen2.5-0.5B" / "snapshots"
    other = base / ("0" * 40)
    other.mkdir(parents=True)
    (other / "model.safetensors").write_bytes(b"x")
    assert workload.local_weights(qwen_spec) is None  # another commit does not count
    snap = base / qwen_spec.model_commit
    snap.mkdir()
    assert workload.local_weights(qwen_spec) is None  # a snapshot without weights does not count
    (snap / "model.safetensors").write_bytes(b"not the pinned weights")
    assert workload.local_weights(qwen_spec) == snap


def test_build_model_refuses_cached_weights_with_the_wrong_sha256(qwen_spec, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path))
    snap = tmp_path / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / qwen_spec.model_commit
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"not the pinned weights")
    with pytest.raises(TrainmechError, match="SHA-256"):
        workload.build_model(qwen_spec, seed=0, device="meta")


def test_local_weights_refuses_a_folder_without_config_json(qwen_spec, tmp_path):
    with pytest.raises(TrainmechError, match="config.json"):
        workload.local_weights(qwen_spec, tmp_path)
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    assert workload.local_weights(qwen_spec, tmp_path) == tmp_path


def test_uneven_batch_supervises_unequal_counts_per_row():
    batch = workload.uneven_batch(4, 32)
    assert batch["input_ids"].shape == (4, 32)
    counts = [workload.supervised_tokens(batch["labels"][i : i + 1]) for i in range(4)]
    assert len(set(counts)) == 4
    assert bool((batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all())


def test_to_device_moves_every_tensor_and_keeps_the_keys():
    batch = workload.lm_batch("domain", 2, 8)
    moved = workload.to_device(batch, "meta")
    assert list(moved) == list(batch) and all(v.device.type == "meta" for v in moved.values())
    assert all(moved[k].shape == v.shape and moved[k].dtype == v.dtype for k, v in batch.items())
