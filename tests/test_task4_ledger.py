"""Task4: the training-state ledger — published formulas, state bytes, prediction vs measurement, the calculator."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainmech import ledger, measure, memory_history, profiles, workload
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.task4

GB = 1e9

# ----------------------------------------------------------------------------- published formulas


def test_zero_paper_row_7_5b_params_64_devices():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB
    got = [ledger.zero_bytes_per_device(7.5e9, 64, stage) / GB for stage in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]
    assert got == pytest.approx([120.0, 31.40625, 16.640625, 1.875], rel=1e-12)


def test_zero_one_device_is_unpartitioned_and_refusals():
    for stage in range(4):
        assert ledger.zero_bytes_per_device(1e6, 1, stage) == pytest.approx(16e6)
    with pytest.raises(TrainmechError, match="stage"):
        ledger.zero_bytes_per_device(1e6, 8, 4)
    with pytest.raises(TrainmechError):
        ledger.zero_bytes_per_device(1e6, 0, 1)


def test_korthikanti_table_2_and_worked_ratios():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B
    sbh = s * b * h
    assert 5 * a * s / h == 80  # "5as/h ≈ 80 for GPT-3"
    assert ledger.korthikanti_activation_bytes(s, b, h, a) == pytest.approx(sbh * (34 + 80))
    assert ledger.korthikanti_activation_bytes(s, b, h, a, t=8) == pytest.approx(sbh * (10 + 24 / 8 + 80 / 8))
    sp = ledger.korthikanti_activation_bytes(s, b, h, a, t=8, sequence_parallel=True)
    assert sp == pytest.approx(sbh * (34 + 80) / 8)
    sel = ledger.korthikanti_activation_bytes(s, b, h, a, t=8, sequence_parallel=True, recompute="selective")
    assert sel == pytest.approx(sbh * 34 / 8)
    assert 1 - sel / sp == pytest.approx(0.70, abs=0.005)  # selective recompute: -70 % for GPT-3
    assert ledger.korthikanti_activation_bytes(s, b, h, a, t=8, recompute="selective") == pytest.approx(
        sbh * (10 + 3)
    )
    assert ledger.korthikanti_activation_bytes(s, b, h, a, recompute="full") == pytest.approx(2 * sbh)
    s2, h2, a2 = 2048, 20480, 128  # MT-NLG 530B: 5as/h = 64, selective recompute -65 %
    full = ledger.korthikanti_activation_bytes(s2, 1, h2, a2, t=8, sequence_parallel=True)
    part = ledger.korthikanti_activation_bytes(
        s2, 1, h2, a2, t=8, sequence_parallel=True, recompute="selective"
    )
    assert 5 * a2 * s2 / h2 == 64 and 1 - part / full == pytest.approx(0.65, abs=0.005)
    with pytest.raises(TrainmechError, match="recompute"):
        ledger.korthikanti_activation_bytes(s, b, h, a, recompute="partial")


# ----------------------------------------------------------------------------- state bytes

HAND = {  # small enough to count by hand
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 10,
    "hidden_size": 4,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


def test_category_bytes_on_a_hand_counted_config():
    shape = ledger.model_shape(HAND)
    # embed 10*4; q 4*4+4, k 2*4+2, v 2*4+2, o 4*4; mlp 3*8*4; two norms 2*4; final norm 4
    n = 40 + 20 + 10 + 10 + 16 + 96 + 8 + 4
    assert shape.n_params == n == 204
    book = ledger.training_state_lifecycle(HAND, 1, 3, first_step=True)
    got = book.state_bytes()
    assert got["parameters"] == 4 * n and got["gradients"] == 4 * n
    assert got["optimizer_states"] == 2 * 4 * n + 4 * len(
        shape.parameter_tensors()
    )  # two moments + step counters
    # one layer (b=1, s=3, h=4, heads 2 × d 2, 1 kv head, I=8), fp32: per norm x 12 + rsqrt 3 + normed 12 + out 12
    # elements; q 12, k 6, v 6, sdpa out 12, logsumexp 2*3; mlp 4 × 24
    elements = 2 * (12 + 3 + 12 + 12) + 12 + 6 + 6 + 12 + 6 + 4 * 24
    assert sum(t.nbytes for t in ledger.layer_saved(shape, 1, 3)) == 4 * elements
    bf16 = ledger.training_state_lifecycle(HAND, 1, 3, dtype="mixed-bf16", device="cuda").state_bytes()
    assert (
        bf16["parameters"] + bf16["gradients"] + bf16["optimizer_states"] == 16 * n
    )  # ZeRO's 2 + 2 + K, K = 12


def test_the_pinned_qwen2_5_0_5b_count_and_named_parameters_order():
    assert ledger.model_shape("qwen2.5-0.5b").n_params == 494_032_768
    spec = profiles.for_mode("cpu").model("qwen2-tiny")
    model = workload.build_model(spec, seed=0).model
    assert ledger.model_shape(model.config).parameter_tensors() == [
        (n, p.numel()) for n, p in model.named_parameters()
    ]


def test_lifecycle_semantics():
    book = ledger.training_state_lifecycle("qwen2-tiny", 2, 16)
    by_name = {s.name: s for s in book.states}
    g = by_name["layer.0.mlp.down_proj.grad"]
    assert (g.category, g.last_consumed, g.released_at) == ("gradients", "optimizer", "zero_grad")
    # tied: the head's contribution is an upstream gradient of the embedding's AccumulateGrad, waiting in the engine
    assert by_name["lm_head.weight.grad_pending"].category == "upstream_grads"
    assert by_name["layer.0.mlp.gate"].created == "forward.layer.0"
    assert by_name["layer.0.mlp.gate"].released_at == "backward.layer.0:mlp"
    assert (
        by_name["layer.1.input_layernorm.x_fp32"].created == "forward.layer.0"
    )  # the residual, kept by reference
    peak = book.peak_overlap()
    assert sum(peak.by_category.values()) == peak.bytes and set(peak.by_category) == set(ledger.CATEGORIES)


def test_full_checkpointing_keeps_only_layer_inputs():
    none = ledger.training_state_lifecycle("qwen2.5-0.5b", 4, 1024, device="cuda")
    full = ledger.training_state_lifecycle("qwen2.5-0.5b", 4, 1024, device="cuda", checkpointing="full")
    assert "backward.layer.0:recompute" in full.ticks
    at_loss = {b: dict(b.live())["loss"]["saved"] for b in (none, full)}
    assert at_loss[full] < at_loss[none] / 3
    assert full.peak_overlap().bytes < none.peak_overlap().bytes


def test_refusals_of_the_builder():
    for kwargs, word in [
        ({"dtype": "fp8"}, "recipe"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"checkpointing": "some"}, "checkpointing"),
        ({"device": "tpu"}, "device"),
    ]:
        with pytest.raises(TrainmechError, match=word):
            ledger.training_state_lifecycle(HAND, 1, 3, **kwargs)
    with pytest.raises(TrainmechError, match="positive"):
        ledger.training_state_lifecycle(HAND, 0, 3)
    with pytest.raises(TrainmechError, match="not a causal LM"):
        ledger.model_shape({**HAND, "architectures": ["BertForMaskedLM"], "model_type": "bert"})


# ----------------------------------------------------------------------------- prediction vs measurement


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_predicted_peak_within_5_percent_of_measured(dtype):
    for c in ledger.measure_point("qwen2-tiny", 1, 32, dtype=dtype):
        assert abs(c.error) <= 0.05, (c.step, c.predicted_peak, c.measured_peak)
        assert c.predicted.peak_overlap().phase == c.measured.peak_phase


def test_math_attention_kernel_keeps_the_s_squared_probabilities():
    # what CUDA runs in fp32 with grouped-query attention; forced here on the CPU
    assert ledger.attention_kernel(ledger.model_shape("qwen2.5-0.5b"), "fp32", "cuda") == "math"
    assert ledger.attention_kernel(ledger.model_shape("qwen2.5-0.5b"), "bf16", "cuda") == "flash"
    for c in ledger.measure_point("qwen2-tiny", 2, 64, attention="math"):
        assert c.predicted.attention == "math"
        assert abs(c.error) <= 0.05 and c.predicted.peak_overlap().phase == c.measured.peak_phase
    rows = {t.name: t for t in ledger.layer_saved(ledger.model_shape("qwen2-tiny"), 2, 64, kernel="math")}
    assert rows["self_attn.probs"].shape == (2, 4, 64, 64)


def test_full_checkpointing_prediction_within_5_percent_of_measured():
    spec = profiles.for_mode("cpu").model("qwen2-small")
    model = workload.build_model(spec, seed=0).model
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    batch = workload.lm_batch("domain", 2, 128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for first in (True, False):
        measured = measure.training_step_memory(model, opt, batch)
        predicted = ledger.training_state_lifecycle(
            model.config, 2, 128, checkpointing="full", first_step=first
        )
        assert abs(predicted.peak_overlap().bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes
        assert predicted.peak_overlap().phase == measured.peak_phase


def test_every_state_crossing_a_phase_has_the_measured_lifecycle():
    first, _ = ledger.measure_point("qwen2-tiny", 2, 32)
    measured = {k: v for k, v in first.measured.lifecycles().items() if k[1] != k[2]}
    assert first.predicted.crossing_lifecycles() == measured


def test_the_tracker_agrees_with_the_allocator():
    spec = profiles.for_mode("cpu").model("qwen2-tiny")
    model = workload.build_model(spec, seed=0).model
    batch = workload.lm_batch("domain", 2, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracked = measure.training_step_memory(model, opt, batch)

    def step():
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    allocator = measure.allocator_peak_cpu(step)
    steady = measure.training_step_memory(model, opt, batch)
    assert (
        tracked.peak_allocated_bytes is None and tracked.peak_reserved_bytes is None
    )  # unknown on CPU, not 0
    assert allocator == pytest.approx(steady.peak_bytes - sum(steady.baseline.values()), rel=0.01)


# ----------------------------------------------------------------------------- the calculator


def _run(argv, capsys):
    rc = ledger.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_calculator_on_a_config_json_it_has_never_seen(tmp_path, capsys):
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama))
    rc, out, err = _run(["--config", str(path), "--batch", "2", "--seq", "256", "--json"], capsys)
    assert rc == 0 and err == ""
    got = json.loads(out)
    assert set(got["by_category"]) == set(ledger.CATEGORIES)
    assert got["peak_bytes"] == sum(got["by_category"].values()) > 0
    assert (
        got["n_params"]
        == 32000 * 512 * 2 + 3 * (512 * 512 * 2 + 256 * 512 * 2 + 3 * 512 * 1376 + 2 * 512) + 512
    )
    rc, out, _ = _run(
        ["--config", str(tmp_path), "--batch", "2", "--seq", "256"], capsys
    )  # the folder works too
    assert rc == 0 and "peak:" in out and "phase" in out


def test_calculator_refusals_are_one_line(tmp_path, capsys):
    bert = tmp_path / "bert.json"
    bert.write_text(
        json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 768})
    )
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    cases = [
        (["--config", str(tmp_path / "missing.json"), "--batch", "1", "--seq", "8"], "does not exist"),
        (["--config", str(bert), "--batch", "1", "--seq", "8"], "not a causal LM"),
        (["--config", str(gpt2), "--batch", "1", "--seq", "8"], "the ledger knows the decoder layout"),
        (["--config", str(broken), "--batch", "1", "--seq", "8"], "not readable JSON"),
        (["--config", "qwen2-tiny", "--batch", "-2", "--seq", "8"], "batch must be a positive integer"),
        (["--config", "qwen2-tiny", "--batch", "1", "--seq", "0"], "seq must be a positive integer"),
        (["--config", "qwen2-tiny", "--batch", "1", "--seq", "8", "--dtype", "int4"], "unknown dtype recipe"),
        (["--config", "no-such-model", "--batch", "1", "--seq", "8"], "neither a config.json"),
        (["--batch", "1"], "missing --config"),
    ]
    for argv, words in cases:
        rc, out, err = _run(argv, capsys)
        assert rc == 2 and out == "", argv
        assert err.count("\n") == 1 and words in err and err.startswith("trainmech: error: "), (argv, err)


QWEN = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"num_key_value_heads": "2"}, "num_key_value_heads must be a positive integer or absent, got '2'"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer or absent, got 0"),
        ({"num_key_value_heads": 4}, "num_attention_heads 14 is not a multiple of num_key_value_heads 4"),
        ({"head_dim": "64"}, "head_dim must be a positive integer or absent, got '64'"),
        ({"head_dim": -64}, "head_dim must be a positive integer or absent, got -64"),
        ({"head_dim": 63.5}, "head_dim must be a positive integer or absent, got 63.5"),
        ({"hidden_size": 900}, "hidden_size 900 is not a multiple of num_attention_heads 14"),
        ({"hidden_size": 896.0}, "lacks a positive integer for hidden_size"),
        ({"num_hidden_layers": 1e9}, "lacks a positive integer for num_hidden_layers"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers 1,000,000,000 is more than the 10,000"),
        ({"num_hidden_layers": True}, "lacks a positive integer for num_hidden_layers"),
        ({"vocab_size": -1}, "lacks a positive integer for vocab_size"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"architectures": "Qwen2ForCausalLM"}, "architectures must be a list of names"),
    ],
)
def test_nonsense_configs_are_refused_in_one_line(tmp_path, capsys, change, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN, **change}))
    rc, out, err = _run(["--config", str(path), "--batch", "1", "--seq", "8"], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("trainmech: error: ") and words in err, err


def test_a_config_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path, capsys):
    link = tmp_path / "config.json"
    link.symlink_to("/dev/zero")
    for config in (link, "/dev/zero", tmp_path):
        rc, out, err = _run(["--config", str(config), "--batch", "1", "--seq", "8"], capsys)
        assert rc == 2 and out == "" and err.count("\n") == 1 and "is not a regular file" in err, err
    link.unlink()
    link.write_bytes(b"\xff{}")
    rc, _, err = _run(["--config", str(link), "--batch", "1", "--seq", "8"], capsys)
    assert rc == 2 and "is not UTF-8 text" in err


def test_sizes_are_integers_and_time_grows_linearly_with_the_layers(capsys):
    import time

    rc, out, _ = _run(["--config", "qwen2.5-0.5b", "--batch", "2", "--seq", "512", "--json"], capsys)
    assert (
        rc == 0
        and json.loads(out)["n_params"] == 494_032_768
        and isinstance(json.loads(out)["n_params"], int)
    )

    def seconds(layers: int) -> float:
        """CPU seconds of the calculator's work for a loaded config, the best of three (CPU time, not wall
        time: other processes on the machine must not make a linear ledger look quadratic)."""
        shape = ledger.model_shape({**QWEN, "num_hidden_layers": layers})
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            ledger.render(ledger.training_state_lifecycle(shape, 2, 512))
            best = min(best, time.process_time() - t0)
        return best

    small, large = seconds(400), seconds(1600)
    assert large < 1.0 and seconds(24) < 1.0  # the 0.5B shape and a 1,600-layer one
    assert large / small < 8, (small, large)  # 4x the layers: linear is 4x, quadratic 16x


def test_python_dash_m_trainmech_ledger(tmp_path):
    run = [sys.executable, "-m", "trainmech", "ledger"]
    ok = subprocess.run(
        run + ["--config", "qwen2.5-0.5b", "--batch", "2", "--seq", "512", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "Qwen/Qwen2.5-0.5B" in ok.stdout and "494,032,768" in ok.stdout
    bad = subprocess.run(
        run + ["--config", "qwen2-tiny", "--batch", "x", "--seq", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


# ----------------------------------------------------------------------------- configs as transformers completes them


def test_missing_fields_take_transformers_defaults():
    untied = {k: v for k, v in QWEN.items() if k != "tie_word_embeddings"}
    assert ledger.model_shape(untied).tie_word_embeddings is False  # Qwen2Config's default
    assert ledger.model_shape(untied).n_params == ledger.model_shape(QWEN).n_params + 151936 * 896
    mistral = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
    }
    assert ledger.model_shape(mistral).num_kv_heads == 8  # MistralConfig's default, not the query heads
    llama = {**mistral, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert ledger.model_shape(llama).num_kv_heads == 16  # LlamaConfig: None -> the query heads
    with pytest.raises(TrainmechError, match="qwen2 default"):  # Qwen2Config defaults to 32 KV heads
        ledger.model_shape({k: v for k, v in QWEN.items() if k != "num_key_value_heads"})


def test_time_grows_linearly_with_the_layers():
    import time

    def seconds(layers: int) -> float:  # the calculator's work for a loaded config: the best of five
        shape = ledger.model_shape({**QWEN, "num_hidden_layers": layers})
        best = float("inf")
        for _ in range(5):  # a shared, loaded machine: more tries for one undisturbed run
            t0 = time.perf_counter()
            book = ledger.training_state_lifecycle(shape, 2, 512)
            book.peak_overlap(), book.state_bytes(), book.lifecycle_rows()
            best = min(best, time.perf_counter() - t0)
        return best

    small, large = seconds(100), seconds(400)
    assert large / small < 8, (small, large)  # 4x the layers: linear is 4x, quadratic 16x


# ----------------------------------------------------------------------------- the kernel follows the device and the mask


def test_the_kernel_is_chosen_for_the_device_dtype_and_mask():
    big = ledger.model_shape("qwen2.5-0.5b")
    choose = lambda dtype, device, padded=False: ledger.attention_kernel(big, dtype, device, padded=padded)  # noqa: E731
    assert [choose("fp32", "cpu"), choose("bf16", "cpu"), choose("fp32", "cpu", True)] == ["flash"] * 3
    assert choose("fp32", "cuda") == "math"  # enable_gqa, which the efficient kernel refuses
    assert choose("bf16", "cuda") == choose("autocast-bf16", "cuda") == "flash"
    assert (
        choose("fp32", "cuda", True) == choose("bf16", "cuda", True) == "efficient"
    )  # a mask: repeat_kv, no flash
    no_gqa = ledger.model_shape({**QWEN, "num_key_value_heads": 14})
    assert ledger.attention_kernel(no_gqa, "fp32", "cuda") == "efficient"
    # the inventory a caller gets for CUDA fp32 is the math one: the s×s probabilities
    rows = {t.name: t for t in ledger.layer_saved(big, 2, 512, "fp32", device="cuda")}
    assert rows["self_attn.probs"].nbytes == 4 * 2 * 14 * 512 * 512
    padded = {t.name: t for t in ledger.layer_saved(big, 2, 500, "fp32", device="cuda", padded=True)}
    assert padded["self_attn.k_repeated"].shape == (2, 14, 500, 64) and padded[
        "self_attn.mask_bias"
    ].shape == (2, 1, 500, 512)
    assert padded["self_attn.sdpa_logsumexp"].shape == (2, 14, 512)  # the efficient kernel pads rows to 32


def test_the_cuda_rule_for_fp32_grouped_query_attention_follows_the_torch_version():
    # enable_gqa: the memory-efficient kernel refuses it before EFFICIENT_GQA_SINCE (math keeps s×s), takes it after
    big = ledger.model_shape("qwen2.5-0.5b")
    no_gqa = ledger.model_shape({**QWEN, "num_key_value_heads": 14})

    def rule(shape, version, **options):
        return ledger.attention_kernel(shape, "fp32", "cuda", stack=ledger.SdpaStack(version), **options)

    assert ledger.EFFICIENT_GQA_SINCE == (2, 14)
    assert rule(big, "2.11.0+cu130") == rule(big, "2.13.0") == "math"
    assert rule(big, "2.14.0") == rule(big, "2.14.0.dev20261201+cu130") == rule(big, "3.0") == "efficient"
    for version in (
        "2.11.0",
        "2.14.0",
    ):  # without grouped-query attention, and with a mask, no version moves it
        assert rule(no_gqa, version) == rule(big, version, padded=True) == "efficient"
    # the default stack is this process's torch: the CPU profile pins 2.13, so the rule is 2.13's here
    assert ledger.sdpa_stack().torch == torch.__version__ and ledger.sdpa_stack().capability is None
    assert ledger.attention_kernel(big, "fp32", "cuda") == rule(big, torch.__version__)
    # the CPU rule does not depend on the torch version it is given: the CPU profile pins the torch it was read from
    assert ledger.attention_kernel(big, "fp32", "cpu", stack=ledger.SdpaStack("2.14.0")) == "flash"
    with pytest.raises(TrainmechError, match="major.minor") as e:
        rule(big, "nightly")
    assert "\n" not in str(e.value)


def test_the_cuda_rule_for_16_bit_puts_cudnn_first_on_sm90_and_sm100_with_a_new_cudnn():
    # sdp_utils.cpp check_prefer_cudnn_attention: cuDNN > 9.15.0 on sm90 / sm100, unless deprioritized
    big = ledger.model_shape("qwen2.5-0.5b")
    h200 = ledger.SdpaStack("2.11.0+cu130", (9, 0), 91501, "13.0")

    def rule(stack, dtype="bf16", **options):
        return ledger.attention_kernel(big, dtype, "cuda", stack=stack, **options)

    assert (
        h200.cudnn_first and rule(h200) == rule(h200, "autocast-fp16") == rule(h200, padded=True) == "cudnn"
    )
    assert rule(h200, dropout=True) == rule(h200, dropout=0.25) == "cudnn"  # on cuDNN's 1/16 grid
    # check_cudnn_dropout: a probability off the 1/16 grid refuses cuDNN; flash (or efficient with a mask) runs
    assert rule(h200, dropout=0.1) == "flash" and rule(h200, dropout=0.1, padded=True) == "efficient"
    deterministic = dataclasses.replace(h200, deterministic=True)  # check_cudnn_deterministic refuses cuDNN
    assert rule(deterministic) == "flash" and "deterministic algorithms" in deterministic.describe()
    assert (
        rule(h200, "fp32") == "math" and rule(h200, "fp32", padded=True) == "efficient"
    )  # cuDNN: 16-bit only
    assert rule(dataclasses.replace(h200, capability=(10, 0))) == "cudnn"  # B200
    flash = {
        "cuDNN 9.15.0": dataclasses.replace(h200, cudnn=91500),
        "deprioritized": dataclasses.replace(h200, cudnn_deprioritized=True),
        "sm89 (L40S)": dataclasses.replace(h200, capability=(8, 9)),
        "sm120": dataclasses.replace(h200, capability=(12, 0)),
        "torch 2.9": dataclasses.replace(h200, torch="2.9.1+cu128"),
        "sm101 on a CUDA 12 build": dataclasses.replace(h200, capability=(10, 1), cuda_build="12.8"),
        "no GPU seen": ledger.SdpaStack("2.11.0+cu130"),
        "no cuDNN": dataclasses.replace(h200, cudnn=None),
    }
    for why, stack in flash.items():
        assert not stack.cudnn_first and rule(stack) == "flash", why
    assert rule(flash["no GPU seen"], padded=True) == "efficient"
    assert dataclasses.replace(h200, capability=(10, 1)).cudnn_first  # any sm10x on a CUDA 13 build
    # a paper calculation sees no GPU: the rule does not assume cuDNN first (the calculator, the scenario tables)
    assert ledger.attention_kernel(big, "bf16", "cuda") == "flash"
    assert h200.describe() == "torch 2.11.0+cu130, sm90, cuDNN 91501"


def test_this_process_reads_its_own_stack(monkeypatch):
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    stack = ledger.sdpa_stack((9, 0), "13.0")
    assert stack.cudnn_deprioritized and stack.capability == (9, 0) and stack.torch == torch.__version__
    assert stack.cudnn == torch.backends.cudnn.version() and stack.cuda_build == "13.0"
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    assert not ledger.sdpa_stack().cudnn_deprioritized and ledger.sdpa_stack().cudnn is None
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert ledger.sdpa_stack((9, 0), "13.0").deterministic and not ledger.sdpa_stack().deterministic
        torch.use_deterministic_algorithms(True, warn_only=True)  # warn-only: cuDNN stays allowed
        assert not ledger.sdpa_stack((9, 0), "13.0").deterministic
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def test_the_rule_is_claimed_only_where_the_profile_pins_torch():
    for device, mode in (("cpu", "cpu"), ("cuda", "TRAIN-CUDA-MECHANISM")):
        pinned = profiles.for_mode(mode).packages["torch"].startswith("==")
        assert ledger.device_terms(device).torch_pinned is pinned
    assert ledger.device_terms("cpu").torch_pinned and not ledger.device_terms("cuda").torch_pinned


def test_the_kernel_line_names_a_rule_that_drifted(cuda_forced_pair):
    first, _ = cuda_forced_pair
    same = first.kernel_line()
    assert "drift" not in same and first.stack.describe() in same and torch.__version__ in same
    # a GPU stack whose dispatch the rule no longer matches: the line says so instead of failing
    drifted = dataclasses.replace(
        first, rule_kernel="efficient", stack=ledger.SdpaStack("2.14.0", (9, 0), 91501)
    )
    line = drifted.kernel_line()
    assert line.count("\n") == 1 and "drift" in line and "sm90" in line and "cuDNN 91501" in line


def test_attention_dropout_moves_the_cpu_to_the_math_kernel_and_keeps_its_mask():
    # torch's CPU flash kernel refuses dropout_p > 0 (sdp_utils_cpp.cpp, check_for_dropout): SDPA runs
    # the math composite, which keeps the dropout mask and the dropped probabilities as well
    tiny = ledger.model_shape("qwen2-tiny")
    assert ledger.attention_kernel(tiny, "fp32", "cpu", dropout=True) == "math"
    assert ledger.attention_kernel(tiny, "bf16", "cpu", padded=True, dropout=True) == "math"
    assert ledger.attention_kernel(tiny, "bf16", "cuda", dropout=True) == "flash"  # it takes a dropout_p
    config = {**QWEN, "attention_dropout": 0.1}  # the calculator reads it from a config.json too
    assert ledger.model_shape(config).attention_dropout == 0.1
    assert ledger.training_state_lifecycle(config, 2, 32).attention == "math"
    assert ledger.training_state_lifecycle(config, 2, 32, dropout=False).attention == "flash"
    with pytest.raises(TrainmechError, match="attention_dropout"):
        ledger.model_shape({**QWEN, "attention_dropout": 1.5})
    for c in ledger.measure_point("qwen2-tiny", 2, 32, attention_dropout=0.1):
        assert c.kernel == c.rule_kernel == "math"  # dispatched, and the rule agrees
        rows = {t.name: t.nbytes for t in c.predicted.layer_saved()}
        assert rows["self_attn.dropout_mask"] == rows["self_attn.probs_dropped"] == rows["self_attn.probs"]
        assert set(c.measured.saved_added_per_layer(tiny.num_layers)) == {sum(rows.values())}
        assert c.predicted_peak == c.measured_peak and not c.lifecycle_differences()


@pytest.mark.parametrize("kwargs", [{"attention": "math"}, {"attention_dropout": 0.1}])
def test_the_math_kernel_keeps_fp32_tensors_for_bf16_activations(kwargs):
    # torch's math composite upcasts 16-bit q, k, v and computes in fp32: what it saves (q, kᵀ, v, the
    # probabilities, and with dropout the mask and the dropped probabilities) is fp32; only the output
    # o_proj reads is cast back. Forced math, and dropout (which moves the CPU to math), in bf16.
    tiny = ledger.model_shape("qwen2-tiny")
    for c in ledger.measure_point("qwen2-tiny", 2, 32, dtype="bf16", **kwargs):
        assert c.kernel == "math"
        rows = {t.name: t for t in c.predicted.layer_saved()}
        fp32 = {n for n, t in rows.items() if n.startswith("self_attn.") and t.element_bytes == 4}
        assert fp32 == {
            "self_attn.q_scaled",
            "self_attn.k_scaled_t",
            "self_attn.v_repeated",
            "self_attn.probs",
        } | (
            {"self_attn.dropout_mask", "self_attn.probs_dropped"} if "attention_dropout" in kwargs else set()
        )
        assert rows["self_attn.attn_out"].element_bytes == 2
        assert set(c.measured.saved_added_per_layer(tiny.num_layers)) == {
            sum(t.nbytes for t in rows.values())
        }
        assert c.predicted_peak == c.measured_peak, (c.step, c.predicted_peak, c.measured_peak)
        assert c.predicted.peak_overlap().phase == c.measured.peak_phase


@pytest.mark.parametrize("attention", ["flash", "math"])
def test_a_padded_batch_is_predicted_byte_for_byte(attention):
    for c in ledger.measure_point("qwen2-tiny", 2, 32, padded=True, attention=attention):
        assert (
            c.predicted_peak == c.measured_peak and c.predicted.peak_overlap().phase == c.measured.peak_phase
        )
        assert c.predicted.crossing_lifecycles() == {
            k: v for k, v in c.measured.lifecycles().items() if k[1] != k[2]
        }


# ----------------------------------------------------------------------------- the update's variants, measured on CPU


def test_the_loop_update_workspace_is_the_largest_two_temporaries_plus_the_previous_denom():
    # exercise 4.3's hint: 4 · max_i (2 n_i + n_{i-1}) bytes, n_i in named_parameters() order; written
    # from the model's own parameters, not the ledger's inventory
    (c,) = ledger.measure_point("qwen2-tiny", 1, 16, optimizer_impl="loop", steps=("first",))
    step = c.measured
    measured = max(
        step.by_category(k)["workspace"] for k, phase in enumerate(step.phases) if phase == "optimizer"
    )
    from trainmech import profiles, workload

    model = workload.build_model(profiles.for_mode("cpu").model("qwen2-tiny"), seed=0).model
    sizes = [p.numel() for p in model.parameters()]
    assert measured == 4 * max(prev + 2 * cur for prev, cur in zip([0, *sizes], sizes))


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_foreach_and_fused_adamw_forced_on_cpu(impl):
    # foreach is CUDA's default: its sqrt temporary is as large as all parameters; fused makes none
    for c in ledger.measure_point("qwen2-tiny", 1, 32, optimizer_impl=impl):
        assert c.predicted_peak == c.measured_peak, (impl, c.step)
        measured = c.measured.by_phase()
        if impl == "foreach" or c.step == "first":  # foreach's temporaries; a first step creates the moments
            assert c.predicted.by_phase()["optimizer"] == measured["optimizer"]
        else:  # a steady fused step allocates nothing: no tracker event there, and no temporary in the ledger
            assert "optimizer" not in measured
            assert not any(st.name == "optimizer.sqrt_temporaries" for st in c.predicted.states)
    book = ledger.training_state_lifecycle("qwen2-tiny", 1, 32, optimizer_impl="foreach")
    temp = next(st for st in book.states if st.name == "optimizer.sqrt_temporaries")
    assert temp.nbytes == 4 * book.shape.n_params


def test_optimizer_in_backward_frees_each_gradient_at_once():
    for c in ledger.measure_point("qwen2-tiny", 1, 32, optimizer_in_backward=True):
        assert abs(c.error) <= 0.02 and c.measured.by_category(len(c.measured.live) - 1)["gradients"] == 0
    steady = ledger.training_state_lifecycle("qwen2.5-0.5b", 2, 512, device="cuda", checkpointing="full")
    hooked = ledger.training_state_lifecycle(
        "qwen2.5-0.5b", 2, 512, device="cuda", checkpointing="full", optimizer_in_backward=True
    )
    assert (
        steady.peak_overlap().phase == "optimizer"
        and hooked.peak_overlap().bytes < 0.9 * steady.peak_overlap().bytes
    )


def test_accumulation_and_zeroed_gradients_are_predicted_byte_for_byte():
    for kwargs in ({"micro_batches": 2}, {"set_to_none": False}):
        for c in ledger.measure_point("qwen2-tiny", 1, 32, **kwargs):
            assert c.predicted_peak == c.measured_peak, (kwargs, c.step, c.micro_batch)
            predicted, measured = c.predicted.by_phase(), c.measured.by_phase()
            assert {
                p: predicted[p] for p in measured
            } == measured  # every phase the tracker saw, byte for byte
            # a phase with no allocation leaves no event: only a micro-batch's update and zero_grad may be silent
            assert set(predicted) - set(measured) <= {"optimizer", "zero_grad"}, (kwargs, c.step)
    base = ledger.training_state_lifecycle("qwen2.5-0.5b", 2, 512, device="cuda")
    kept = ledger.training_state_lifecycle("qwen2.5-0.5b", 2, 512, device="cuda", set_to_none=False)
    at = lambda book: dict(book.live())["backward.loss:log_softmax"]  # noqa: E731
    assert at(kept)["gradients"] - at(base)["gradients"] == 4 * base.shape.n_params  # +4Ψ at backward.loss


@pytest.mark.parametrize("dtype", ["autocast-bf16", "autocast-fp16"])
def test_autocast_keeps_fp32_states_and_16_bit_copies(dtype):
    first, steady = ledger.measure_point("qwen2-small", 2, 64, dtype=dtype)
    for c in (first, steady):
        assert (
            c.predicted_peak == c.measured_peak and c.predicted.peak_overlap().phase == c.measured.peak_phase
        )
    m, shape = first.measured, first.predicted.shape
    at_end = lambda phase: m.by_category(max(k for k, p in enumerate(m.phases) if p == phase))["saved"]  # noqa: E731
    added = at_end("forward.layer.1") - at_end("forward.layer.0")
    rows = ledger.layer_saved(shape, 2, 64, dtype)
    assert added == sum(t.nbytes for t in rows)  # its own rows and the next layer's input, the fp32 residual
    copies = sum(t.nbytes for t in rows if t.name.endswith("weight_16bit"))
    assert copies == 2 * sum(
        n
        for name, n in shape.parameter_tensors()
        if name.startswith("model.layers.0.") and "proj.weight" in name
    )
    assert steady.predicted.state_bytes()["optimizer_states"] == 8 * shape.n_params + 4 * len(
        shape.parameter_tensors()
    )


# ----------------------------------------------------------------------------- scenarios, ZeRO, the allocator, the peers


def test_the_scenario_matrix_reconciles_the_registry_workloads():
    rows = ledger.scenario_matrix("qwen2.5-0.5b", 2, 512, device="cuda")
    change = ledger.scenarios.change
    assert change(rows, "checkpoint", "first", "forward_backward") == pytest.approx(-0.314, abs=0.002)
    assert change(rows, "checkpoint", "steady") == pytest.approx(
        -0.126, abs=0.002
    )  # the peak moves into foreach AdamW
    assert change(rows, "offload", "first") == 0.0  # one update: its peak is the first optimizer step
    steady = {r.strategy: r.whole for r in rows if r.update == "steady"}
    assert steady["checkpoint"].phase == steady["offload"].phase == "optimizer"


def test_offload_assumptions_state_what_the_offload_rows_do():
    """Task4's scenario-gpu prints this line beside the matrix: its threshold is the rows' own, and every tensor it
    says goes to the host has left the device by the forward's end (host copies not counted)."""
    shape = ledger.model_shape("qwen2-tiny")
    line = ledger.scenarios.offload_assumptions("qwen2-tiny", 2, 64)
    min_bytes = ledger.scenarios.offload_min_bytes(shape, 2, 64, "fp32")
    assert f">= {min_bytes:,} B" in line and f"0..{shape.num_layers - 2} keep" in line
    base, off = (
        ledger.scenarios.scenario_ledger("qwen2-tiny", 2, 64, strategy=s, update="steady")
        for s in ("baseline", "offload")
    )
    moved = base.offloadable_bytes(min_bytes)
    assert moved > 0 and base.saved_after_forward() - off.saved_after_forward() == moved


def test_checkpointing_measured_peaks_and_recompute_counts_as_saved():
    first, steady = ledger.measure_point("qwen2-tiny", 2, 64, checkpointing="full")
    for c in (first, steady):
        assert abs(c.error) <= 0.01 and c.predicted.peak_overlap().phase == c.measured.peak_phase
        assert (
            abs(c.measured_forward_backward_peak - c.predicted.forward_backward_peak().bytes)
            <= 0.01 * c.measured_peak
        )
    recomputed = [
        a for a in first.measured.allocations if a.born_phase.startswith("backward.layer") and a.recomputed
    ]
    assert recomputed and {first.measured.category(a) for a in recomputed} == {"saved"}


def test_zero_projection_partitions_the_update_and_names_the_loss_buffers():
    book = ledger.training_state_lifecycle("qwen2.5-0.5b", 2, 512, dtype="mixed-bf16", device="cuda")
    n = book.shape.n_params
    assert sum(book.state_bytes()[c] for c in ledger.MODEL_STATES) == ledger.zero_bytes_per_device(n, 1, 0)
    one = ledger.zero.per_device(book, 1, 3)
    assert one.bytes == book.peak_overlap().bytes and one.tick == book.peak_overlap().tick
    s1, s2, s3 = (ledger.zero.per_device(book, 64, k) for k in (1, 2, 3))
    assert (
        s1.bytes == s2.bytes and s1.by_category["gradients"] == 0
    )  # at backward.loss no gradient exists yet
    assert s3.loss_buffer_share == pytest.approx(0.55, abs=0.01)
    at_update = dict(book.live())["optimizer"]
    assert at_update["workspace"] > 0  # the foreach temporary, partitioned from stage 1 on
    with pytest.raises(TrainmechError, match="stage"):
        ledger.zero.per_device(book, 8, 4)


def test_the_allocator_model_rounds_caches_and_splits():
    from trainmech.ledger import allocator as A

    assert [A.round_size(n) for n in (1, 512, 513, 3 * 2**20 + 1)] == [512, 512, 1024, 3 * 2**20 + 512]
    assert [A.segment_size(n) for n in (512, 2**20, 2**20 + 512, 12 << 20)] == [
        2 << 20,
        2 << 20,
        20 << 20,
        12 << 20,
    ]
    m = A.CachingAllocatorModel()
    m.malloc("a", 4 << 20)  # a 20 MiB segment, split
    m.malloc("b", 4 << 20)  # the same segment
    assert (m.allocated, m.reserved) == (8 << 20, 20 << 20)
    m.free("a")
    m.malloc("c", 3 << 20)  # reuses a's block; its 1 MiB rest is not worth a split, so allocated counts 4 MiB
    assert m.reserved == 20 << 20 and m.allocated == 8 << 20
    m.free("c")
    m.malloc("e", 5 << 19)  # 2.5 MiB: a 1.5 MiB rest is split off
    assert m.allocated == (4 << 20) + (5 << 19)
    m.malloc("d", 100)  # the small pool: a 2 MiB segment of its own
    assert m.reserved == 22 << 20 and m.allocated == (4 << 20) + (5 << 19) + 512
    reuse = A.CachingAllocatorModel()  # a large block freed before the next is made: its segment is reused
    reuse.malloc("x", 30 << 20)
    reuse.free("x")
    reuse.malloc("y", 30 << 20)
    assert (reuse.peak_allocated, reuse.peak_reserved) == (30 << 20, 30 << 20)  # not 60 MiB reserved
    reuse.malloc("z", 30 << 20)  # alive together: a second segment
    assert (reuse.peak_allocated, reuse.peak_reserved) == (60 << 20, 60 << 20)
    first = ledger.training_state_lifecycle("qwen2.5-0.5b", 2, 512, device="cuda", first_step=True)
    steady = ledger.training_state_lifecycle("qwen2.5-0.5b", 2, 512, device="cuda")
    peaks = A.cuda_peaks(first, steady)
    assert peaks.tensor_peak <= peaks.allocated_peak <= 1.05 * peaks.tensor_peak <= peaks.reserved_peak


def test_the_peers_estimate_model_states_only(monkeypatch):
    from trainmech.ledger import peers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = workload.qwen2_config(profiles.for_mode("cpu").model("qwen2-tiny"))
    shape = ledger.model_shape(cfg)
    untied = shape.n_params + shape.vocab_size * shape.hidden_size  # a meta-device model is not tied yet
    assert (
        0 <= peers.accelerate_estimate(cfg) - 16 * untied <= 1024
    )  # 4 × (weights + the rotary buffers), fp32 Adam
    ds = peers.deepspeed_estimates(shape)
    assert ds["deepspeed-zero2"] == 20 * shape.n_params
    assert ds["deepspeed-zero3"] == 4 * shape.vocab_size * shape.hidden_size + 18 * shape.n_params
    rows = peers.benchmark({"qwen2-tiny": [(1, 32)]}, out=lambda line: None)
    assert [r.error("ledger") for r in rows] == [0.0, 0.0]
    assert all(r.error("accelerate") != 0 for r in rows)


def test_the_calculator_prints_the_scenario_matrix_and_the_gpu_lines(capsys):
    rc, out, err = _run(
        ["--config", "qwen2.5-0.5b", "--batch", "2", "--seq", "512", "--device", "cuda", "--scenario"], capsys
    )
    assert rc == 0 and err == "" and "checkpoint" in out and "-31.4%" in out and "-12.6%" in out
    rc, out, _ = _run(
        ["--config", "qwen2.5-0.5b", "--batch", "2", "--seq", "512", "--device", "cuda"], capsys
    )
    assert rc == 0 and "reserved peak" in out and "cuBLAS" in out and "CUDA context" in out
    rc, out, _ = _run(
        [
            "--config",
            "qwen2-tiny",
            "--batch",
            "1",
            "--seq",
            "8",
            "--json",
            "--micro-batches",
            "2",
            "--keep-grads",
        ],
        capsys,
    )
    got = json.loads(out)
    assert (
        rc == 0
        and got["micro_batches"] == 2
        and got["set_to_none"] is False
        and set(got["by_category"]) == set(ledger.CATEGORIES)
    )


def test_measure_and_the_ledger_share_one_vocabulary():
    assert measure.MEMORY_CATEGORIES is ledger.CATEGORIES
    assert "activations" not in ledger.CATEGORIES and {
        "saved",
        "unsaved_activations",
        "upstream_grads",
    } <= set(ledger.CATEGORIES)


# ----------------------------------------------------------------------------- Task4's CUDA branches, run on a CPU


def test_lifecycles_are_compared_key_by_key_within_the_cuda_tolerance():
    first, steady = ledger.measure_point("qwen2-tiny", 2, 32)
    for c in (first, steady):
        assert not c.lifecycle_differences() and "differences: none" in c.lifecycle_line()
    # the same measurement against a ledger of the math kernel: the s×s probabilities cross forward -> backward
    math = ledger.training_state_lifecycle(first.predicted.shape, 2, 32, first_step=True, attention="math")
    wrong = ledger.Comparison(first.model, 2, 32, "first", math, first.measured)
    probs = sum(
        t.nbytes for t in ledger.layer_saved(math.shape, 2, 32, kernel="math") if t.name.endswith("probs")
    )
    assert probs > ledger.CUDA_LIFECYCLE_TOLERANCE[1]  # a wrong kernel is far beyond the CUDA allowance
    off = wrong.lifecycle_differences(ledger.CUDA_LIFECYCLE_TOLERANCE)
    assert off and "differences: {" in wrong.lifecycle_line(ledger.CUDA_LIFECYCLE_TOLERANCE)
    # a right total with the bytes in the wrong phases fails too: key by key, not the sum
    moved = dataclasses.replace(
        first.predicted,
        states=tuple(
            dataclasses.replace(st, released_at="backward.layer.1:attention")
            if st.name == "layer.0.self_attn.q_rope"
            else st
            for st in first.predicted.states
        ),
    )
    shifted = ledger.Comparison(first.model, 2, 32, "first", moved, first.measured)
    assert sum(moved.crossing_lifecycles().values()) == sum(first.measured_crossing_lifecycles().values())
    assert shifted.lifecycle_differences(ledger.CUDA_LIFECYCLE_TOLERANCE)
    # a scalar a CUDA kernel keeps on its own passes the allowance; one int64 element more (an RNG state
    # weighed wrong, 8 B) does not
    key = next(iter(first.measured_crossing_lifecycles()))

    def off_by(extra: int) -> ledger.Comparison:
        c = ledger.Comparison(first.model, 2, 32, "first", first.predicted, first.measured)
        c.measured_crossing_lifecycles = lambda: {  # noqa: E731
            k: v + (extra if k == key else 0) for k, v in first.measured_crossing_lifecycles().items()
        }
        return c

    slack = ledger.CUDA_SLACK_BYTES_PER_LAYER
    assert ledger.CUDA_LIFECYCLE_TOLERANCE == (0.0, slack) and slack < 8
    assert off_by(slack).lifecycle_differences() and not off_by(slack).lifecycle_differences(
        ledger.CUDA_LIFECYCLE_TOLERANCE
    )
    assert off_by(8).lifecycle_differences(ledger.CUDA_LIFECYCLE_TOLERANCE)


def test_a_step_measured_by_the_cpu_allocator_takes_the_cuda_side_of_the_comparison():
    first, steady = ledger.measure_point("qwen2-tiny", 2, 32, allocator="cpu-profiler")
    for c in (first, steady):  # measured_peak is the allocator's, as torch.cuda's would be
        m = c.measured
        assert m.step_peak_allocated_bytes is not None and c.measured_peak == m.step_peak_allocated_bytes
        assert abs(c.error) <= 0.01 and c.tracked_peak == m.peak_bytes
    peaks = ledger.allocated_reserved(first, steady)
    assert peaks.source == "cpu-profiler" and peaks.measured_reserved is None and peaks.reserved_error is None
    assert peaks.tracked_bytes == steady.measured.peak_bytes and abs(peaks.tracked_error) <= 0.01
    assert peaks.model == ledger.allocator.cuda_peaks(first.predicted, steady.predicted)
    assert peaks.model.tensor_peak <= peaks.model.allocated_peak <= peaks.model.reserved_peak
    assert peaks.allocated_error == peaks.model.allocated_peak / steady.measured.step_peak_allocated_bytes - 1
    text = "\n".join(peaks.lines())
    assert f"torch.profiler): {steady.measured.step_peak_allocated_bytes:,}" in text and "unknown" in text
    # the arithmetic the CUDA cell prints, with a reserved peak as torch.cuda reports one
    gpu = ledger.AllocatedReserved("cuda", 1000, 1100, 1500, ledger.allocator.CudaPeaks(1000, 1155, 1200))
    assert gpu.tracked_error == pytest.approx(0.1) and gpu.allocated_error == pytest.approx(0.05)
    assert gpu.reserved_error == pytest.approx(-0.2)
    text = "\n".join(gpu.lines())
    assert "allocated peak 1,155, +55 B (+5.00%) beside the measured 1,100" in text
    assert "reserved peak 1,200 (-20.00% of the measured 1,500" in text
    plain = ledger.measure_point("qwen2-tiny", 1, 16, steps=("first",))
    with pytest.raises(TrainmechError, match="without an allocator") as e:
        ledger.allocated_reserved(plain[0], plain[0])
    assert "\n" not in str(e.value)


def test_cuda_record_fields_validate_as_a_gpu_measured_record():
    from trainmech import results

    points = ledger.measure_point("qwen2-tiny", 2, 32, allocator="cpu-profiler")
    steady = points[1]
    fields = ledger.record_fields(steady, points, worst_error=0.0, on_cuda=True, updates=points)
    template = json.loads(
        (results.REPO_ROOT / "results" / "cpu-reference" / "TRAIN-STATE-LEDGER__cpu-b2s128.json").read_text()
    )
    gpu_env = {"device": "cuda:0", "gpu": "NVIDIA H200", "gpu_memory_bytes": 150_000_000_000, "cuda": "12.8"}
    record = results.validate(
        {
            **template,
            "environment": {**template["environment"], **gpu_env},
            "correctness": {**template["correctness"], **fields.pop("correctness")},
            "conclusion": {**template["conclusion"], "evidence_level": "gpu-measured"},
            **fields,
        }
    )
    # the step's own allocated peak: what else the process held is not in it
    assert record.resources.peak_allocated_bytes == steady.measured.step_peak_allocated_bytes is not None
    assert record.metrics["cpu_tracked_peak_bytes"] is None
    assert record.metrics["tracked_peak_bytes"] == steady.measured.peak_bytes
    assert record.metrics["measured_peak_bytes"] == steady.measured.step_peak_allocated_bytes
    assert record.metrics["measured_with"].startswith("torch.cuda.max_memory_allocated")
    assert record.correctness.all_finite is True and record.correctness.effective_updates == 2
    cpu = ledger.record_fields(steady, points, worst_error=0.0, on_cuda=False)
    assert cpu["resources"] == {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    assert cpu["metrics"]["measured_forward_backward_peak_bytes"] == steady.measured_forward_backward_peak
    untracked = ledger.measure_point("qwen2-tiny", 1, 16, steps=("first",))
    with pytest.raises(TrainmechError, match="allocator's peaks"):
        ledger.record_fields(untracked[0], untracked, worst_error=0.0, on_cuda=True)


def test_a_non_finite_gradient_is_no_effective_update():
    first, steady = ledger.measure_point("qwen2-tiny", 1, 16)
    assert first.measured.all_finite is steady.measured.all_finite is True
    broken = dataclasses.replace(steady.measured, all_finite=False)
    bad = ledger.Comparison(steady.model, 1, 16, "steady", steady.predicted, broken)
    fields = ledger.record_fields(bad, [first, bad], worst_error=0.0, on_cuda=False, updates=[first, bad])
    assert fields["correctness"] == {"all_finite": False, "skipped_updates": 0, "effective_updates": 1}
    hooked = ledger.measure_point("qwen2-tiny", 1, 16, optimizer_in_backward=True, steps=("first",))
    assert hooked[0].measured.all_finite is None  # the hooks consumed every gradient: nothing left to check


def test_a_warm_up_changes_no_tracked_byte_and_the_kernel_is_the_one_dispatched():
    plain = ledger.measure_point("qwen2-tiny", 2, 32)
    warm = ledger.measure_point("qwen2-tiny", 2, 32, warmup=True, memory_history=True)
    for a, b in zip(plain, warm):
        assert (a.measured.live, a.measured.phases, a.predicted_peak) == (
            b.measured.live,
            b.measured.phases,
            b.predicted_peak,
        )
        assert (
            b.workspace_bytes is None and b.history.source is None and b.history.blocks == []
        )  # no CUDA here
        assert (
            a.kernel == a.rule_kernel == a.predicted.attention == "flash"
        )  # the CPU's op, seen by the tracker
    forced = ledger.measure_point("qwen2-tiny", 2, 32, attention="math", steps=("first",))
    assert forced[0].kernel == forced[0].predicted.attention == "math"
    assert ledger.kernel_of_ops(["_scaled_dot_product_cudnn_attention", "mm"]) == "cudnn"
    assert ledger.kernel_of_ops(["bmm", "_safe_softmax"]) == "math" and ledger.kernel_of_ops(["mm"]) is None


def _cuda_snapshot(steps, workspace: int, scratch: int) -> dict:
    """A torch.cuda.memory._snapshot() dict, in the format torch/cuda/memory.py documents (segments, and
    device_traces of TraceEntry: action, addr, size, stream, time_us, frames), for tracked steps run here:
    every tracked storage an alloc and a free_requested / free_completed pair at its own address, in event
    order, and two blocks no tensor is: a workspace allocated first and never freed (as cuBLAS's is), and a
    kernel's scratch buffer alive for one event of the first step."""
    frames = [{"filename": "trainmech/measure.py", "line": 1, "name": "training_step_memory"}]
    events, offset = [], 0
    for step in steps:
        for a in step.allocations:
            events.append((offset + a.born, 0, "alloc", a.address, a.nbytes))
            if a.died is not None:
                events.append((offset + a.died, 0, "free", a.address, a.nbytes))
        offset += len(step.live)
    top = max(a.address + a.nbytes for s in steps for a in s.allocations)
    ws_addr, scratch_addr = top + (1 << 30), top + (2 << 30)
    events += [(-1, 0, "alloc", ws_addr, workspace), (3, 1, "alloc", scratch_addr, scratch)]
    events.append((3, 2, "free", scratch_addr, scratch))
    trace = [
        {
            "action": "segment_alloc",
            "addr": ws_addr,
            "size": 20 << 20,
            "stream": 0,
            "time_us": 0,
            "frames": [],
        }
    ]
    for t, (_, _, action, addr, size) in enumerate(sorted(events), start=1):
        entry = {"addr": addr, "size": size, "stream": 0, "time_us": t, "frames": frames}
        actions = ("alloc",) if action == "alloc" else ("free_requested", "free_completed")
        trace += [{"action": name, **entry} for name in actions]
    alive = [(ws_addr, workspace)] + [
        (a.address, a.nbytes) for s in steps for a in s.allocations if a.died is None
    ]
    blocks = [
        {
            "address": addr,
            "size": -(-size // 512) * 512,
            "requested_size": size,
            "state": "active_allocated",
            "frames": frames,
        }
        for addr, size in alive
    ]
    blocks.append({"address": 0, "size": 2 << 20, "requested_size": 0, "state": "inactive", "frames": []})
    used = sum(b["size"] for b in blocks[:-1])
    segment = {
        "device": 0,
        "address": ws_addr,
        "total_size": used + (2 << 20),
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "allocated_size": used,
        "active_size": used,
        "requested_size": sum(size for _, size in alive),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }
    return {"segments": [segment], "device_traces": [trace]}


def test_the_memory_history_of_a_cuda_snapshot_names_the_blocks_no_tensor_explains():
    from torch.cuda import _memory_viz

    from trainmech import plots

    (first,) = ledger.measure_point("qwen2-tiny", 2, 32, steps=("first",))
    steps = [first.measured]
    snapshot = _cuda_snapshot(steps, workspace=1 << 19, scratch=1 << 17)  # beside a few MiB of tensors
    assert "TOTAL MEM" in _memory_viz.trace(snapshot)  # PyTorch's own readers take it
    assert "segments: 1" in _memory_viz.segsum(snapshot)
    history = memory_history._history_from_snapshot(snapshot, 0)
    tracked = steps[0].allocations
    assert history.source == "cuda-allocator" and len(history.blocks) == len(tracked) + 2
    assert history["alloc_events"] == len(tracked) + 2
    assert history["free_events"] == sum(a.died is not None for a in tracked) + 1
    assert history["segments"] == 1 and history["reserved_bytes"] == snapshot["segments"][0]["total_size"]
    assert memory_history._history_from_snapshot(snapshot, 1).blocks == []  # another device: nothing recorded
    timeline = measure.step_history(history, steps)
    assert timeline is history  # the allocator's history, labelled: not the tracker's stand-in
    # memory-history prints its peak on CUDA too: the tracked storages plus the unexplained blocks alive then
    assert max(steps[0].live) <= timeline.peak_bytes() <= max(steps[0].live) + (1 << 19) + (1 << 17)
    only = timeline.allocator_only()
    assert (
        [b.nbytes for b in only] == [1 << 19, 1 << 17] and only[0].died is None and only[1].died is not None
    )
    named = [(b.category, b.phase) for b in timeline.blocks if b.category != measure.ALLOCATOR_ONLY]
    assert named == [(steps[0].category(a), a.born_phase) for a in tracked]
    assert f"2 blocks ({(1 << 19) + (1 << 17):,} bytes) no tensor state explains" in timeline.describe()
    assert history["alive_at_start_blocks"] == 0  # every block in this trace was allocated inside it
    trace = list(snapshot["device_traces"][0])
    trace.remove(next(e for e in trace if e["action"] == "alloc" and e["addr"] == tracked[0].address))
    started = {**snapshot, "device_traces": [trace]}
    # the first storage existed before the recording began
    late = memory_history._history_from_snapshot(started, 0)
    assert late["alive_at_start_blocks"] == 1 and late["alive_at_start_bytes"] == tracked[0].nbytes
    assert len(late.blocks) == len(history.blocks) - 1 and "alive when the recording began" in late.describe()
    fig = plots.memory_viz_timeline(timeline, title="snapshot")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert measure.ALLOCATOR_ONLY in labels and "saved" in labels
    stand_in = measure.step_history(measure.MemoryHistory(), steps)
    assert stand_in.source == "storage-tracker" and stand_in.allocator_only() == []
    assert "by construction" in stand_in.describe()


@pytest.mark.parametrize(
    "kernel, dropout", [("flash", False), ("flash", True), ("cudnn", False), ("cudnn", True)]
)
def test_fused_kernels_keep_their_rng_state_on_cuda_as_torch_meta_kernels_say(kernel, dropout):
    q = torch.empty(1, 2, 64, 64, device="meta", dtype=torch.bfloat16)
    out = ledger.inventory._sdpa_op(kernel, q, ledger.inventory.PROBE_DROPOUT if dropout else 0.0)
    seed, offset = out[6], out[7]  # philox seed and offset, which its autograd node saves
    rows = ledger.rng_state_saved(kernel, "cuda", dropout=dropout)  # no GPU here: the meta kernel's shapes
    assert [(t.shape, t.element_bytes) for t in rows] == [
        (tuple(seed.shape), seed.element_size()),
        (tuple(offset.shape), offset.element_size()),
    ]
    assert (
        ledger.rng_state_saved(kernel, "cpu", dropout=dropout) == []
    )  # the CPU kernels: output and logsumexp
    big = ledger.model_shape("qwen2.5-0.5b")
    on = {
        d: sum(t.nbytes for t in ledger.layer_saved(big, 2, 512, "bf16", kernel, device=d, dropout=dropout))
        for d in ("cpu", "cuda")
    }
    assert on["cuda"] - on["cpu"] == sum(t.nbytes for t in rows) > 0  # the same inventory, plus the RNG state
    book = ledger.training_state_lifecycle(
        big, 2, 512, dtype="bf16", device="cuda", attention=kernel, dropout=dropout
    )
    seed_state = next(st for st in book.states if st.name == "layer.0.self_attn.sdpa_rng_seed")
    assert (seed_state.category, seed_state.nbytes, seed_state.released_at) == (
        "saved",
        rows[0].nbytes,
        "backward.layer.0:attention",
    )


def test_the_efficient_and_math_kernels_keep_no_rng_state_on_the_device_and_flash_keeps_it_without_dropout():
    for dropout in (False, True):
        assert ledger.rng_state_saved("efficient", "cuda", dropout=dropout) == []  # on the host
        assert ledger.rng_state_saved("math", "cuda", dropout=dropout) == []
    assert ledger.inventory._rng_outputs("efficient", False)  # the meta kernel has them: on the host
    # FlashAttention-2's mha_fwd since "[Note] BC breaking change to flash seed/offset" (torch >= 2.7): a (2,)
    # uint64 seed and a () uint64 offset, made on the device with or without dropout; the meta kernel of the
    # torch installed here has that code's shapes (the old code's were int64 scalars, host without dropout)
    q = torch.empty(1, 2, 64, 64, device="meta", dtype=torch.bfloat16)
    out = ledger.inventory._sdpa_op("flash", q, 0.0)
    assert (tuple(out[6].shape), out[6].dtype, tuple(out[7].shape), out[7].dtype) == (
        (2,),
        torch.uint64,
        (),
        torch.uint64,
    )
    for dropout in (False, True):
        rows = ledger.rng_state_saved("flash", "cuda", dropout=dropout)
        assert [(t.name.rsplit(".", 1)[-1], t.nbytes) for t in rows] == [
            ("sdpa_rng_seed", 16),
            ("sdpa_rng_offset", 8),
        ]
    big = ledger.model_shape("qwen2.5-0.5b")
    book = ledger.training_state_lifecycle(big, 2, 512, dtype="bf16", device="cuda", attention="flash")
    assert {st.name for st in book.states} >= {
        "layer.0.self_attn.sdpa_rng_seed",
        "layer.0.self_attn.sdpa_rng_offset",
    }
    saved = {
        kernel: sum(t.nbytes for t in ledger.layer_saved(big, 2, 512, "bf16", kernel, device="cuda"))
        for kernel in ("flash", "cudnn")
    }
    assert saved["flash"] - saved["cudnn"] == 24 - 16  # flash: (2,) + () uint64; cuDNN: two int64 scalars


def _context_report(tmp_path, **limits) -> str:
    report = {
        "schema": "trainmech-gpu-check/1",
        "started_at": "2026-11-29T10:00:00+00:00",
        "mode": "cuda",
        "environment": {"gpu": "NVIDIA H200"},
        "limits": limits,
    }
    path = tmp_path / "gpu-check.json"
    path.write_text(json.dumps(report))
    return str(path)


def test_the_cuda_context_is_null_until_gpu_check_measured_it(tmp_path, capsys):
    argv = ["--config", "qwen2.5-0.5b", "--batch", "2", "--seq", "512", "--device", "cuda"]
    missing = ["--gpu-check", str(tmp_path / "none.json")]
    rc, out, _ = _run(argv + missing, capsys)
    line = next(x for x in out.splitlines() if "CUDA context" in x)
    assert rc == 0 and "unknown (null)" in line
    rc, out, _ = _run(argv + missing + ["--json"], capsys)
    got = json.loads(out)
    assert (got["cuda_context_bytes"], got["cuda_context_source"]) == (None, None)
    measured = ["--gpu-check", _context_report(tmp_path, cuda_context_bytes=536_870_912)]
    rc, out, _ = _run(argv + measured, capsys)
    line = next(x for x in out.splitlines() if "CUDA context" in x)
    assert "512.0 MiB (536,870,912 bytes)" in line and "NVIDIA H200" in line and "gpu-check.json" in line
    rc, out, _ = _run(argv + measured + ["--json"], capsys)
    got = json.loads(out)
    assert got["cuda_context_bytes"] == 536_870_912 and "NVIDIA H200" in got["cuda_context_source"]
    rc, out, _ = _run(argv[:-2] + measured + ["--json"], capsys)  # a CPU step has no CUDA context
    assert json.loads(out)["cuda_context_bytes"] is None
    for unknown in (
        {"cuda_context_bytes": None},
        {},
    ):  # gpu-check off CUDA, or before it measured the context
        assert (
            ledger.allocator.cuda_context(_context_report(tmp_path, **unknown))
            == ledger.allocator.CudaContext()
        )
    self_test = json.loads(Path(_context_report(tmp_path, cuda_context_bytes=1)).read_text()) | {
        "mode": "cpu-self-test (no GPU evidence)"
    }
    (tmp_path / "gpu-check.json").write_text(json.dumps(self_test))
    assert ledger.allocator.cuda_context(tmp_path / "gpu-check.json").nbytes is None


def test_precision_changes_name_every_peak_the_ledger_predicts():
    default14 = ledger.scenarios.precision_changes(
        "qwen2.5-0.5b", 2, 256, device="cuda", dtype="autocast-fp16"
    )
    assert list(default14) == list(ledger.scenarios.PRECISION_PEAKS)
    steady = ledger.training_state_lifecycle("qwen2.5-0.5b", 2, 256, device="cuda", dtype="autocast-fp16")
    assert (
        steady.peak_overlap().phase == "optimizer"
    )  # fp32 states only at that moment: autocast cannot move it
    assert default14["steady update, whole update (tensors)"] == 0.0
    # where activations dominate, the same function sees autocast's saving
    long = ledger.scenarios.precision_changes("qwen2.5-0.5b", 4, 2048, device="cuda", dtype="autocast-bf16")
    assert long["steady update, forward+backward (tensors)"] < -0.1


def test_the_committed_peers_report_has_the_points_and_tools_the_code_defines():
    from trainmech import results
    from trainmech.ledger import peers

    folder = results.REPO_ROOT / "results" / "benchmarks"
    data = json.loads((folder / "ledger-peers.json").read_text(encoding="utf-8"))
    assert data["schema"] == peers.REPORT_SCHEMA and data["tools"] == list(peers.TOOLS)
    assert data["points"] == {m: [list(p) for p in shapes] for m, shapes in peers.BENCHMARK_POINTS.items()}
    expected = [
        (m, b, s, update)
        for m, shapes in peers.BENCHMARK_POINTS.items()
        for b, s in shapes
        for update in ("first", "steady")
    ]
    assert [(r["model"], r["batch"], r["seq"], r["update"]) for r in data["rows"]] == expected
    assert all(set(r["errors"]) == set(peers.TOOLS) == set(r["estimates_bytes"]) for r in data["rows"])
    table = [
        line
        for line in (folder / "ledger-peers.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| ")
    ]
    assert all(t in table[0] for t in peers.TOOLS) and len(table) == 1 + len(expected)
    assert 4.5e6 < ledger.model_shape("qwen2-5m").n_params < 5.5e6  # the ~5M-parameter reference points


def test_the_benchmark_report_is_written_beside_its_data(tmp_path, capsys):
    from trainmech.ledger import peers

    rows = peers.benchmark({"qwen2-tiny": [(1, 32)]}, out=lambda line: None)
    md, js = peers.write_report(rows, tmp_path / "peers.md", seconds=1.0)
    data = json.loads(js.read_text())
    assert js.name == "peers.json" and data["points"] == {"qwen2-tiny": [[1, 32]]}
    assert [r["errors"]["ledger"] for r in data["rows"]] == [0.0, 0.0]
    assert md.read_text().count("| qwen2-tiny |") == 2
    rc, out, err = _run(["--report", str(tmp_path / "x.md")], capsys)
    assert rc == 2 and "use it with --benchmark" in err and err.count("\n") == 1
    rc, out, err = _run(["--benchmark", "--report", str(tmp_path / "x.txt")], capsys)
    assert rc == 2 and ".md path" in err


def test_an_update_in_the_backward_is_predicted_byte_for_byte():
    # the loss and its seed outlive the last hook; each hook creates its own tensors' step counters
    for c in ledger.measure_point("qwen2-tiny", 2, 32, optimizer_in_backward=True):
        assert c.predicted_peak == c.measured_peak, c.step
        assert c.predicted.forward_backward_peak().bytes == c.measured_forward_backward_peak, c.step
        assert not c.lifecycle_differences(), (c.step, c.lifecycle_line())


def test_checkpointing_keeps_position_ids_saved_until_layer_0_is_rebuilt():
    # position_ids is an input of every checkpointed layer call: saved until layer 0's recompute
    for c in ledger.measure_point("qwen2-tiny", 2, 32, checkpointing="full"):
        assert c.predicted_peak == c.measured_peak, c.step
        assert c.predicted.forward_backward_peak().bytes == c.measured_forward_backward_peak, c.step
        assert not c.lifecycle_differences(), (c.step, c.lifecycle_line())
    position_ids = {
        state.name: state
        for state in ledger.training_state_lifecycle("qwen2-tiny", 2, 32, checkpointing="full").states
    }["position_ids"]
    assert (position_ids.category, position_ids.released_at) == ("saved", "backward.layer.0:input_layernorm")


def test_the_allocator_replay_allocates_each_state_as_its_tensors():
    for kwargs in ({}, {"attention": "math"}, {"optimizer_impl": "foreach"}, {"dtype": "mixed-bf16"}):
        book = ledger.training_state_lifecycle("qwen2-tiny", 2, 32, device="cuda", **kwargs)
        for st in book.states:
            pieces = ledger.allocator._pieces(book, st)
            assert sum(pieces) == st.nbytes and all(p > 0 for p in pieces), (kwargs, st.name, pieces)
    book = ledger.training_state_lifecycle("qwen2-tiny", 2, 32, device="cuda", attention="flash")
    d_sdpa = next(st for st in book.states if st.name == "layer.0.d_sdpa")
    assert len(ledger.allocator._pieces(book, d_sdpa)) == 4  # the output's gradient, dq, dk, dv


# ----------------------------------------------------------------------------- device memory, history, the RNG probe, records


def test_a_tracker_for_one_device_keeps_the_others_storages_apart():
    # a CUDA step's host-side storages (foreach AdamW's step counters), forced on a CPU: count only "cuda"
    with measure.StorageTracker(device="cuda") as tracker:
        kept = torch.empty(8)
        tracker.tag([kept], "optimizer_states")
        dropped = torch.empty(4)
        del dropped
    assert tracker.live == [] and tracker.allocations == []  # no device storage: no event
    assert [(a.nbytes, a.device, a.tag) for a in tracker.elsewhere] == [
        (32, "cpu", "optimizer_states"),
        (16, "cpu", None),
    ]
    assert tracker.elsewhere[0].died is None and tracker.elsewhere[1].died == 0
    with measure.StorageTracker(device="cpu") as same:  # the CPU run's own choice: every storage counts
        kept = torch.empty(8)
    assert same.elsewhere == [] and same.live == [32] and same.allocations[0].device == "cpu"
    step = measure.StepMemory(
        {}, [], [0], ["x"], elsewhere=tracker.elsewhere, baseline_elsewhere={"parameters": 4}
    )
    assert step.elsewhere_at_end() == dict.fromkeys(ledger.CATEGORIES, 0) | {
        "parameters": 4,
        "optimizer_states": 32,
    }


def test_bytes_per_param_holds_when_the_step_counters_live_on_another_device():
    # the CUDA accounting path on a CPU: file AdamW's step counters as elsewhere (where a CUDA run's
    # foreach / loop AdamW keeps them, on the host), out of the device count, and count again
    (point,) = ledger.measure_point("qwen2-tiny", 1, 16, steps=("first",))
    step, shape = point.measured, point.predicted.shape
    n_tensors = len(shape.parameter_tensors())
    counters = [
        a
        for a in step.allocations
        if step.category(a) == "optimizer_states" and a.nbytes == ledger.STEP_COUNTER_BYTES
    ]
    assert len(counters) == n_tensors  # one per parameter tensor: the CPU run keeps them with the moments
    as_on_cuda = dataclasses.replace(
        step,
        allocations=[a for a in step.allocations if a not in counters],
        elsewhere=[dataclasses.replace(a, device="cpu") for a in counters],
        device="cuda",
    )
    assert as_on_cuda.elsewhere_at_end()["optimizer_states"] == ledger.STEP_COUNTER_BYTES * n_tensors
    on_cpu = ledger.model_state_bytes_per_param(step, n_tensors, shape.n_params)
    assert on_cpu == ledger.RECIPES["fp32"].model_state_bytes_per_param == 16
    assert ledger.model_state_bytes_per_param(as_on_cuda, n_tensors, shape.n_params) == on_cpu
    # the old accounting (counters subtracted from the device count alone) is what this guards against
    device_only = (
        as_on_cuda.by_category(len(step.live) - 1)["optimizer_states"] - ledger.STEP_COUNTER_BYTES * n_tensors
    )
    assert device_only < 2 * 4 * shape.n_params


def test_a_cpu_step_has_nothing_elsewhere_and_records_that_it_stepped():
    first, steady = ledger.measure_point("qwen2-tiny", 1, 16)
    for c in (first, steady):
        assert c.measured.device == "cpu" and c.measured.stepped is True
        assert set(c.measured.elsewhere_at_end().values()) == {0}


def test_a_step_that_did_not_update_is_recorded_as_skipped_whatever_the_caller_asked():
    # stepped is counted from what ran (AdamW's per-parameter step counts, or a step post-hook), not
    # from the update flag: a step() that updates nothing (a GradScaler skip) is a skipped update
    from trainmech import measure, optimizers, profiles, workload

    model = workload.build_model(profiles.for_mode("cpu").model("qwen2-tiny"), seed=0).model
    data = workload.lm_batch("domain", 1, 16)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
    assert measure.training_step_memory(model, adamw, data).stepped is True
    adamw.step = lambda closure=None: None  # called, but no parameter is updated
    assert measure.training_step_memory(model, adamw, data).stepped is False
    assert measure.training_step_memory(model, adamw, data, update=False).stepped is False
    model.zero_grad(set_to_none=True)  # no update: the gradients stayed
    sgd = torch.optim.SGD(model.parameters(), lr=1e-4)  # keeps no step count: its post-hook tells
    assert measure.training_step_memory(model, sgd, data).stepped is True
    in_backward = optimizers.OptimizerInBackward(model.parameters(), lambda ps: optimizers.adamw(ps, "loop"))
    try:  # the updates run inside the backward, and are counted there
        assert measure.training_step_memory(model, in_backward, data).stepped is True
    finally:
        in_backward.remove()


def test_the_finiteness_check_sees_inf_and_nan_with_one_scalar_per_gradient():
    ok = [torch.ones(3), torch.full((2, 2), 3e38)]  # no overflow: the inf-norm takes max |g|
    assert measure._finite(1.0, ok) is True
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert measure._finite(1.0, ok + [torch.tensor([0.0, bad])]) is False
    assert measure._finite(float("nan"), ok) is False and measure._finite(1.0, []) is None
    with measure.StorageTracker() as tracker:  # run inside a tracked step: it leaves no tracked storage
        measure._finite(1.0, ok)
    assert tracker.allocations == []


def test_history_blocks_need_the_same_address_and_rounded_size_and_the_check_is_named():
    (first,) = ledger.measure_point("qwen2-tiny", 2, 32, steps=("first",))
    steps = [first.measured]
    snapshot = _cuda_snapshot(steps, workspace=1 << 19, scratch=1 << 17)
    trace = snapshot["device_traces"][0]
    tracked = steps[0].allocations
    # an untracked block of another size at the address the next tensor will take: it must not take its label
    at = next(k for k, e in enumerate(trace) if e["action"] == "alloc" and e["addr"] == tracked[1].address)
    impostor = {**trace[at], "size": tracked[1].nbytes + 4096, "time_us": 0}
    trace[at:at] = [
        impostor,
        {**impostor, "action": "free_requested"},
        {**impostor, "action": "free_completed"},
    ]
    # a scalar the finiteness check made, after the backward
    check_frames = [{"filename": "/x/trainmech/measure.py", "line": 1, "name": "_finite"}]
    scalar = {
        "action": "alloc",
        "addr": 7 << 40,
        "size": 512,
        "stream": 0,
        "time_us": 0,
        "frames": check_frames,
    }
    trace.append(scalar)
    history = measure.step_history(memory_history._history_from_snapshot(snapshot, 0), steps)
    named = [
        (b.category, b.phase)
        for b in history.blocks
        if b.category not in (measure.ALLOCATOR_ONLY, measure.FINITENESS_CHECK)
    ]
    assert named == [(steps[0].category(a), a.born_phase) for a in tracked]
    assert sorted(b.nbytes for b in history.allocator_only()) == sorted(
        [tracked[1].nbytes + 4096, 1 << 19, 1 << 17]
    )
    checks = [b for b in history.blocks if b.category == measure.FINITENESS_CHECK]
    assert [b.nbytes for b in checks] == [
        512
    ] and "1 blocks (512 bytes) of the finiteness check" in history.describe()


def test_the_rng_probe_weighs_only_when_asked_and_a_failed_probe_raises():
    big = ledger.model_shape("qwen2.5-0.5b")
    paper = ledger.layer_saved(big, 2, 512, "bf16", "cudnn", device="cuda")  # the meta kernel: any machine
    assert [t.name for t in paper if "rng" in t.name] == [
        "self_attn.sdpa_rng_seed",
        "self_attn.sdpa_rng_offset",
    ]
    book = ledger.training_state_lifecycle(big, 2, 512, dtype="bf16", device="cuda", attention="cudnn")
    assert book.setup.weigh_rng is False and book.layer_saved() == paper
    if not torch.cuda.is_available():  # weighing needs this process's GPU: without one the probe fails loudly
        ledger.inventory._rng_outputs.cache_clear()
        with pytest.raises((RuntimeError, AssertionError)):
            ledger.rng_state_saved("flash", "cuda", weigh=True)
        assert not torch.cuda.is_initialized()


def test_a_kernel_that_refuses_enable_gqa_keeps_k_and_v_at_every_head():
    big = ledger.model_shape("qwen2.5-0.5b")
    kv = {t.name: t for t in ledger.layer_saved(big, 2, 512, "fp32", "efficient", device="cuda")}
    every = {
        t.name: t for t in ledger.layer_saved(big, 2, 512, "fp32", "efficient", device="cuda", repeat_kv=True)
    }
    assert kv["self_attn.k_rope"].shape == (2, big.num_kv_heads, 512, 64)
    assert (
        every["self_attn.k_repeated"].shape
        == every["self_attn.v_repeated"].shape
        == (2, big.num_heads, 512, 64)
    )
    assert "self_attn.mask_bias" not in every  # repeated without a mask: no bias
    extra = 2 * 2 * (big.num_heads - big.num_kv_heads) * 512 * 64 * 4
    assert sum(t.nbytes for t in every.values()) - sum(t.nbytes for t in kv.values()) == extra
    plain = ledger.scenarios.variants("qwen2.5-0.5b", 2, 512, device="cuda")
    repeated, at_kv = (
        plain[f"fp32, memory-efficient SDPA, K/V {how}"] for how in ("repeated", "at kv_heads")
    )
    assert (
        repeated.bytes - at_kv.bytes == extra * big.num_layers
    )  # every layer's repeated K and V, at the peak


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn", "math"])
@pytest.mark.parametrize("padded", [False, True])
def test_korthikanti_terms_are_read_off_the_rows_for_every_kernel(kernel, padded):
    big = ledger.model_shape("qwen2.5-0.5b")
    rows = ledger.layer_saved(big, 2, 512, "bf16", kernel, device="cuda", padded=padded)
    terms = ledger.korthikanti_differences(big, 2, 512, rows)
    gpt = ledger.korthikanti_activation_bytes(512, 2, big.hidden_size, big.num_heads)
    assert gpt + sum(terms.values()) == sum(t.nbytes for t in rows)
    repeated = padded or kernel == "math"
    assert (terms["grouped-query attention (K, V)"] == 0) == repeated
    if kernel == "math" and not padded:  # formulas.md 4.8: fp32 probabilities, the fp32 half of q, kᵀ, v
        s, b, h, a = 512, 2, big.hidden_size, big.num_heads
        assert (
            terms["SDPA kernel (kept beyond 16-bit q, k, v, out)"]
            == 4 * a * s * s * b + 6 * s * b * h - 2 * a * s * s * b
        )
    with pytest.raises(TrainmechError, match="16-bit"):
        ledger.korthikanti_differences(
            big, 2, 512, ledger.layer_saved(big, 2, 512, "fp32", kernel, device="cuda")
        )


def test_skipped_and_effective_updates_are_counted_from_what_ran():
    first, steady = ledger.measure_point("qwen2-tiny", 1, 16)
    broken = ledger.Comparison(
        "qwen2-tiny",
        1,
        16,
        "steady",
        steady.predicted,
        dataclasses.replace(steady.measured, all_finite=False),
    )
    unstepped = ledger.Comparison(
        "qwen2-tiny", 1, 16, "steady", steady.predicted, dataclasses.replace(steady.measured, stepped=False)
    )

    def count(updates):
        return ledger.record_fields(steady, updates, worst_error=0.0, on_cuda=False, updates=updates)[
            "correctness"
        ]

    assert count([first, steady]) == {"all_finite": True, "skipped_updates": 0, "effective_updates": 2}
    assert count([first, broken]) == {
        "all_finite": False,
        "skipped_updates": 0,
        "effective_updates": 1,
    }  # applied
    assert count([first, unstepped]) == {"all_finite": True, "skipped_updates": 1, "effective_updates": 1}


def test_the_blas_workspaces_are_freed_only_where_torch_can_and_the_cpu_keeps_none():
    assert ledger.clear_blas_workspaces() == hasattr(torch._C, "_cuda_clearCublasWorkspaces")
    (c,) = ledger.measure_point("qwen2-tiny", 1, 16, warmup=True, steps=("first",))
    assert c.workspace_bytes is None  # no CUDA: nothing to measure, unknown rather than 0


def test_under_checkpointing_the_kernel_is_read_from_the_recompute():
    (c,) = ledger.measure_point("qwen2-tiny", 2, 32, checkpointing="full", steps=("first",))
    recomputed = [a.op for a in c.measured.allocations if a.recomputed]
    assert ledger.kernel_of_ops(recomputed) == c.kernel == c.predicted.attention == "flash"


def test_adamw_step_counters_are_device_states_only_where_torch_puts_them_there():
    # torch.optim.adam._init_group: state["step"] on the parameter's device only when fused or capturable
    for device, impl, on_device in [
        ("cuda", "foreach", False),
        ("cuda", "loop", False),
        ("cuda", "fused", True),
        ("cpu", "loop", True),
    ]:
        book = ledger.training_state_lifecycle(
            "qwen2-tiny", 2, 32, device=device, optimizer_impl=impl, first_step=True
        )
        names = {st.name for st in book.states}
        assert ("optimizer.step_counters" in names) == on_device, (device, impl)
        pieces = [
            p
            for st in book.states
            for p in ledger.allocator._pieces(book, st)
            if st.category == "optimizer_states"
        ]
        assert (
            ledger.STEP_COUNTER_BYTES in pieces
        ) == on_device  # the allocator replays no host scalar as a block


def test_the_precision_sweep_is_precision_changes_over_a_grid_and_matches_within_a_margin():
    sweep = ledger.scenarios.precision_sweep(
        "qwen2-tiny", (1, 2), (32, 64), device="cuda", dtype="autocast-fp16"
    )
    assert list(sweep) == [(1, 32), (1, 64), (2, 32), (2, 64)]
    assert sweep[2, 64] == ledger.scenarios.precision_changes(
        "qwen2-tiny", 2, 64, device="cuda", dtype="autocast-fp16"
    )
    some = sweep[2, 64][ledger.scenarios.PRECISION_PEAKS[2]]
    hits = ledger.scenarios.matching_shapes(sweep, some, 0.0)
    assert (2, 64, ledger.scenarios.PRECISION_PEAKS[2], some) in hits
    assert all(change == some for *_, change in hits)
    everything = ledger.scenarios.matching_shapes(sweep, 0.0, 10.0)
    assert len(everything) == 4 * len(ledger.scenarios.PRECISION_PEAKS)
    with pytest.raises(TrainmechError, match="within"):
        ledger.scenarios.matching_shapes(sweep, 0.0, -0.01)
    with pytest.raises(TrainmechError, match="at least one"):
        ledger.scenarios.precision_sweep("qwen2-tiny", (), (32,), dtype="autocast-fp16")


def test_the_allocator_model_refuses_a_configuration_it_does_not_model():
    # expandable segments, max_split_size_mb, power-of-two rounding divisions and a garbage-collection
    # threshold move a peak; the replay models none of them
    book = ledger.training_state_lifecycle("qwen2-tiny", 1, 16, device="cuda", first_step=True)
    plain = ledger.allocator.cuda_peaks(book)
    for conf in (
        "expandable_segments:True",
        "max_split_size_mb:128",
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[256:1,512:2,>:4]",
        "garbage_collection_threshold:0.6",
        "pinned_use_cuda_host_register:True,garbage_collection_threshold:0.6",
        "Roundup_Power2_Divisions: 8",
        "backend:cudaMallocAsync",
    ):
        with pytest.raises(TrainmechError, match="allocator configuration") as caught:
            ledger.allocator.cuda_peaks(book, alloc_conf=conf)
        assert str(caught.value).count("\n") == 0
    assert ledger.allocator.cuda_peaks(book, alloc_conf="expandable_segments:False") == plain
    assert ledger.allocator.cuda_peaks(book, alloc_conf="pinned_use_cuda_host_register:True") == plain
    assert ledger.allocator.cuda_peaks(book, alloc_conf="backend:native") == plain


# ---------------------------------------------------------------- Task4's CUDA side, forced on a CPU


@pytest.fixture(scope="module")
def cuda_forced_pair():
    """qwen2-tiny b2s32 with CUDA's choices forced: the math SDPA kernel (the rule's for fp32 grouped-query
    attention on CUDA), foreach AdamW (CUDA's default), a warm-up, the memory history and an allocator
    counted (the CPU allocator under torch.profiler, as torch.cuda's would be)."""
    return ledger.measure_point(
        "qwen2-tiny",
        2,
        32,
        attention="math",
        optimizer_impl="foreach",
        warmup=True,
        memory_history=True,
        allocator="cpu-profiler",
    )


def test_device_terms_are_values_and_refuse_an_unknown_device():
    cpu, cuda = ledger.device_terms("cpu"), ledger.device_terms("cuda")
    assert (cpu.points, cuda.points) == (ledger.CPU_POINTS, ledger.CUDA_POINTS)
    assert (cpu.slack_bytes_per_layer, cuda.slack_bytes_per_layer) == (0, ledger.CUDA_SLACK_BYTES_PER_LAYER)
    # whole-step counts (per-phase maxima, the peak's composition) in bytes: the slack once per layer, not a
    # percentage of an 11 GB peak that would hide a mis-weighed s×s tensor
    assert (
        cpu.step_slack_bytes(24) == 0 and cuda.step_slack_bytes(24) == 24 * ledger.CUDA_SLACK_BYTES_PER_LAYER
    )
    assert not hasattr(cuda, "phase_tolerance") and not hasattr(cuda, "composition_tolerance")
    assert cuda.lifecycle_tolerance == ledger.CUDA_LIFECYCLE_TOLERANCE and cpu.lifecycle_tolerance == (0.0, 0)
    assert cpu.exact_points and cpu.exact_engines and not cuda.exact_points and not cuda.exact_engines
    assert (cpu.on_cuda, cuda.on_cuda) == (False, True) and cuda.blas_workspace_measured
    with pytest.raises(TrainmechError, match="valid are cpu, cuda") as e:
        ledger.device_terms("mps")
    assert "\n" not in str(e.value)


def test_task4_cells_run_with_cudas_terms_and_choices_forced_on_a_cpu(cuda_forced_pair, monkeypatch):
    """Every call Task4's cells make on CUDA, with ledger.device_terms("cuda") and CUDA's choices forced:
    a GPU run cannot fail for a reason this CPU run catches."""
    from trainmech import results

    terms = ledger.device_terms("cuda")
    first, steady = cuda_forced_pair
    shape = first.predicted.shape
    assert ledger.attention_kernel(shape, "fp32", "cuda") == "math"  # the rule the forced kernel stands for
    assert first.kernel == steady.kernel == "math"  # kernel_of_ops on the tracked ops
    assert first.predicted.setup.optimizer_impl == "foreach" and first.predicted.device == "cpu"
    # measure-first-steady: CUDA's torch is not pinned, so the rule is printed beside the kernel that ran, not claimed
    assert not terms.torch_pinned and first.kernel_line().startswith(
        "SDPA kernel the forward dispatched: math"
    )
    # per-layer saved bytes against the math inventory within CUDA's slack
    added = first.measured.saved_added_per_layer(shape.num_layers)
    inventory = sum(t.nbytes for t in first.predicted.layer_saved())
    assert "self_attn.probs" in {t.name for t in first.predicted.layer_saved()}
    assert max(abs(layer - inventory) for layer in added) <= terms.slack_bytes_per_layer
    # lifecycle-vs-measured, bytes-by-phase, peak-composition
    for pair in (first, steady):
        assert not pair.lifecycle_differences(terms.lifecycle_tolerance)
        assert "differences: none" in pair.lifecycle_line(terms.lifecycle_tolerance)
        ours, theirs = pair.predicted.by_phase(), pair.measured.by_phase()
        bound = terms.step_slack_bytes(shape.num_layers)
        assert max(abs(ours[p] - theirs[p]) for p in theirs) <= bound
        peak, composition = pair.predicted.peak_overlap(), pair.measured.by_category()
        assert peak.phase == pair.measured.peak_phase
        assert max(abs(peak.by_category[k] - composition[k]) for k in ledger.CATEGORIES) <= bound
        # baseline-peaks: the prediction against the allocator's peak, as against torch.cuda's
        assert abs(pair.error) <= 0.05
    # the foreach temporary is in the update: the steady peak's workspace is one parameter copy or more
    at_update = steady.predicted.peak_overlap().by_category
    assert (
        steady.predicted.peak_overlap().phase != "optimizer" or at_update["workspace"] >= 4 * shape.n_params
    )
    # memory-history: the timeline of the pair (empty history off CUDA: the tracker's own)
    assert first.history.source is None and first.workspace_bytes is None  # no CUDA allocator here
    assert measure.step_history(first.history, [first.measured, steady.measured]).describe()
    # cuda-allocator-peaks: the pair already carries its allocator's peaks, so nothing runs again
    pair = ledger.allocator_pair(first, steady, run_mode="cpu", seed=0)
    assert pair[0] is first and pair[1] is steady
    peaks = ledger.allocated_reserved(*pair)
    assert peaks.model.allocated_peak > peaks.model.tensor_peak  # rounded to 512 B blocks
    assert abs(peaks.allocated_error) <= terms.allocator_model_tolerance
    lines = peaks.lines()  # the model's allocated peak printed beside the measured one, on every allocator
    assert any(f"allocated peak {peaks.model.allocated_peak:,}" in line for line in lines)
    assert peaks.reserved_error is None  # the CPU allocator reports no reserved peak: the claim is CUDA's
    # cuda-allocator-peaks on CUDA: the reserved claim's arithmetic on an allocator that reports a reserved peak
    assert (
        terms.reserved_model_tolerance == 0.05 and ledger.device_terms("cpu").reserved_model_tolerance is None
    )
    reported = dataclasses.replace(peaks, source="cuda", measured_reserved=peaks.model.reserved_peak)
    assert reported.reserved_error == 0.0  # segment reuse: test_the_allocator_model_rounds_caches_and_splits
    # the CUDA-only claim that the model beats the unrounded tensor count: a measured peak at the model's wins,
    # a model that returned the tensor peak itself ties and fails
    at_model = dataclasses.replace(reported, measured_allocated=peaks.model.allocated_peak)
    assert terms.allocator_rounds and at_model.model_beats_tracked
    unrounded = dataclasses.replace(
        at_model, model=dataclasses.replace(peaks.model, allocated_peak=peaks.tracked_bytes)
    )
    assert not unrounded.model_beats_tracked
    assert f"{reported.measured_reserved:,}" in reported.lines()[-1] and len(reported.lines()) == 3
    monkeypatch.setenv(
        "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"
    )  # refused on this path on any device
    with pytest.raises(TrainmechError, match="expandable_segments"):
        ledger.allocated_reserved(*pair)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    # record-state-ledger: the CUDA fields, validated as a GPU-measured record
    fields = ledger.record_fields(
        steady, [first, steady], worst_error=0.0, on_cuda=terms.on_cuda, updates=[first, steady]
    )
    assert (
        fields["resources"]["peak_allocated_bytes"] == steady.measured.step_peak_allocated_bytes is not None
    )
    assert (
        fields["metrics"]["attention_kernel"] == "math" and fields["metrics"]["optimizer_impl"] == "foreach"
    )
    assert fields["metrics"]["measured_with"] == ledger.compare.MEASURED_PEAK_WITH["cuda"]
    template = json.loads(
        (results.REPO_ROOT / "results" / "cpu-reference" / "TRAIN-STATE-LEDGER__cpu-b2s128.json").read_text()
    )
    record = results.validate(
        {
            **template,
            "environment": {
                **template["environment"],
                "device": "cuda:0",
                "gpu": "NVIDIA H200",
                "cuda": "12.8",
            },
            "correctness": {**template["correctness"], **fields.pop("correctness")},
            "conclusion": {**template["conclusion"], "evidence_level": "gpu-measured"},
            **fields,
        }
    )
    assert record.correctness.effective_updates == 2 and record.metrics["cpu_tracked_peak_bytes"] is None


def _as_a_cuda_run_records_it(pair):
    """`pair` as a CUDA run records and predicts it: AdamW's step counters (foreach keeps them on the
    host) out of every device count and in `elsewhere` / `baseline_elsewhere` (the storages another
    device holds), and the prediction built with device="cuda" (no counter on the device)."""
    step, shape = pair.measured, pair.predicted.shape
    n_tensors = len(shape.parameter_tensors())
    counters = {
        id(a)
        for a in step.allocations
        if step.category(a) == "optimizer_states" and a.nbytes == ledger.STEP_COUNTER_BYTES
    }
    assert len(counters) == (n_tensors if pair.step == "first" else 0)  # the first update creates them
    kept = [a for a in step.allocations if id(a) not in counters]
    live = [
        sum(a.nbytes for a in kept if a.born <= k and (a.died is None or a.died > k))
        for k in range(len(step.live))
    ]
    assert [
        sum(a.nbytes for a in step.allocations if a.born <= k and (a.died is None or a.died > k))
        for k in range(len(step.live))
    ] == step.live  # live is the allocations alive after each event
    on_host = ledger.STEP_COUNTER_BYTES * n_tensors if pair.step == "steady" else 0  # the first update's
    measured = dataclasses.replace(
        step,
        allocations=kept,
        live=live,
        elsewhere=[dataclasses.replace(a, device="cpu") for a in step.allocations if id(a) in counters],
        baseline={**step.baseline, "optimizer_states": step.baseline["optimizer_states"] - on_host},
        baseline_elsewhere={**step.baseline_elsewhere, "optimizer_states": on_host},
        device="cuda",
    )
    predicted = ledger.training_state_lifecycle(
        shape,
        pair.batch,
        pair.seq,
        dtype=pair.predicted.setup.recipe,
        device="cuda",
        first_step=pair.step == "first",
        attention=pair.kernel,
        optimizer_impl=pair.predicted.setup.optimizer_impl,
        weigh_rng=True,  # as measure_point on CUDA: the RNG state of the kernel that ran (math: none)
    )
    return dataclasses.replace(pair, predicted=predicted, measured=measured)


def test_task4_state_cells_hold_with_the_cuda_book_and_the_step_counters_on_the_host(cuda_forced_pair):
    """grads-and-states, lifecycle-vs-measured and peak-composition on the pair a CUDA run gets: the
    prediction with device="cuda" (foreach AdamW's step counters on the host, not on the device)
    against a measured step whose counters are elsewhere."""
    terms = ledger.device_terms("cuda")
    first, steady = (_as_a_cuda_run_records_it(pair) for pair in cuda_forced_pair)
    shape = first.predicted.shape
    assert first.predicted.device == steady.predicted.device == "cuda"
    assert first.measured.elsewhere_at_end()["optimizer_states"] > 0  # the split is really exercised
    # grads-and-states, as the cell computes it
    step_memory = first.measured
    grads = step_memory.by_category(step_memory.phases.index("optimizer"))["gradients"]
    states = step_memory.by_category(len(step_memory.live) - 1)["optimizer_states"]
    host = step_memory.elsewhere_at_end()["optimizer_states"]
    predicted = first.predicted.state_bytes()
    dtypes, tensors = ledger.RECIPES["fp32"], len(shape.parameter_tensors())
    moments = 2 * dtypes.moment_bytes * shape.n_params
    assert grads == dtypes.grad_bytes * shape.n_params == predicted["gradients"]
    assert predicted["optimizer_states"] == moments  # the CUDA book: no step counter on the device
    assert states - moments + host == ledger.STEP_COUNTER_BYTES * tensors
    again = steady.measured
    states_before = again.baseline["optimizer_states"] + again.baseline_elsewhere.get("optimizer_states", 0)
    states_after = (
        again.by_category(len(again.live) - 1)["optimizer_states"]
        + again.elsewhere_at_end()["optimizer_states"]
    )
    assert states_before == states_after == states + host
    # lifecycle-vs-measured and peak-composition, with CUDA's tolerances; this CPU's tracker is exact, so
    # the CUDA book must match it byte for byte too
    for pair in (first, steady):
        assert not pair.lifecycle_differences(terms.lifecycle_tolerance) and not pair.lifecycle_differences()
        peak, composition = pair.predicted.peak_overlap(), pair.measured.by_category()
        assert peak.phase == pair.measured.peak_phase and peak.bytes == pair.measured.peak_bytes
        worst = max(abs(peak.by_category[k] - composition[k]) for k in ledger.CATEGORIES)
        assert worst <= terms.step_slack_bytes(shape.num_layers) and worst == 0
    # the CPU book on the same pair counts the counters on the device: what the CUDA book must not do
    assert cuda_forced_pair[0].predicted.state_bytes()["optimizer_states"] == moments + host


def test_task4_section5_cells_run_with_cudas_choices_forced_on_a_cpu(cuda_forced_pair):
    """scenario-measured and bf16-layer-saved with CUDA's terms: checkpointing and bf16 under the forced choices."""
    terms = ledger.device_terms("cuda")
    first, steady = cuda_forced_pair
    layers = first.predicted.shape.num_layers
    checkpointed = ledger.measure_point(
        "qwen2-tiny", 2, 32, attention="math", optimizer_impl="foreach", checkpointing="full"
    )
    assert checkpointed[0].kernel == "math"
    table, worst = ledger.scenarios.render_measured(
        {"baseline": (first, steady), "checkpoint": tuple(checkpointed)}
    )
    assert worst <= terms.slack_bytes_per_layer * layers and "checkpoint" in table
    (bf16,) = ledger.measure_point("qwen2-tiny", 2, 32, dtype="bf16", attention="math", steps=("first",))
    inventory = sum(t.nbytes for t in bf16.predicted.layer_saved())
    added = bf16.measured.saved_added_per_layer(layers)
    assert max(abs(layer - inventory) for layer in added) <= terms.slack_bytes_per_layer


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_task4_calculator_cell_with_cudas_choices_forced_on_a_cpu(dtype, cuda_forced_pair, capsys):
    """calculator-json on CUDA: torch is not pinned there and the calculator sees no GPU, so its rule may
    name another kernel than the forward dispatched (bf16 on an H100 / H200: flash by the rule, cuDNN
    dispatched; here bf16: flash by the rule, math forced). The cell prints the rule's kernel, asks again
    with --attention <the dispatched kernel> and claims that answer byte for byte against the point's
    prediction."""
    terms = ledger.device_terms("cuda")
    if dtype == "fp32":
        first, steady = cuda_forced_pair
    else:
        first, steady = ledger.measure_point(
            "qwen2-tiny", 2, 32, dtype=dtype, attention="math", optimizer_impl="foreach"
        )
    point = _as_a_cuda_run_records_it(steady)
    assert first.kernel == "math" and point.predicted.setup.recipe == dtype

    def calculator(*extra):
        args = ["--config", "qwen2-tiny", "--batch", "2", "--seq", "32", "--dtype", dtype, "--device", "cuda"]
        assert ledger.main([*args, "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    assert not terms.torch_pinned  # the cell's CUDA branch
    rule = calculator()
    assert rule["attention"] == ledger.attention_kernel(point.predicted.shape, dtype, "cuda")
    if dtype == "bf16":  # the drift the guard is for: the rule's kernel and its peak are another kernel's
        assert rule["attention"] == "flash" != first.kernel and rule["peak_bytes"] != point.predicted_peak
    answer = calculator("--attention", first.kernel)
    assert answer["attention"] == first.kernel and answer["step"] == "steady"
    assert answer["optimizer_impl"] == point.predicted.setup.optimizer_impl == "foreach"
    assert answer["peak_bytes"] == point.predicted_peak
    assert answer["peak_tick"] == point.predicted.peak_overlap().tick


@pytest.mark.parametrize("options", [{}, {"attention": "math"}, {"micro_batches": 2}])
def test_the_bf16_logits_gradient_is_born_in_the_loss_backward(options):
    # logits.float()'s backward casts the fp32 gradient back to bf16 inside the loss's backward, before
    # the head's: the ledger's `backward.loss:cast` tick, between log_softmax and the head
    for c in ledger.measure_point("qwen2-tiny", 2, 32, dtype="bf16", **options):
        assert not c.lifecycle_differences(), c.lifecycle_line()
        assert c.predicted_peak == c.tracked_peak
        assert c.predicted.forward_backward_peak().bytes == c.measured_forward_backward_peak
        dlogits = next(st for st in c.predicted.states if st.name == "dlogits")
        assert (dlogits.created, dlogits.released_at) == ("backward.loss:cast", "backward.head:lm_head")
        ticks = list(c.predicted.ticks)
        assert ticks.index("backward.loss:cast") == ticks.index("backward.loss:log_softmax") + 1
    assert (
        "backward.loss:cast" not in ledger.training_state_lifecycle("qwen2-tiny", 2, 32).ticks
    )  # fp32: no cast


def test_held_against_rule_divides_from_the_stage_that_partitions_each_category():
    from types import SimpleNamespace

    n = ledger.model_shape("qwen2-tiny").n_params
    whole = {"parameters": 4 * n, "gradients": 4 * n, "optimizer_states": 8 * n}
    reports = [
        SimpleNamespace(stage=s, world_size=1, held=whole) for s in (0, 1, 2, 3)
    ]  # N = 1: not compared
    for stage in (1, 2, 3):  # two ranks, the heaviest 100 B above an even split of what the stage partitions
        split = {c: b // 2 if stage >= ledger.zero.FIRST_STAGE_SPLITTING[c] else b for c, b in whole.items()}
        reports += [
            SimpleNamespace(stage=stage, world_size=2, held=split),
            SimpleNamespace(stage=stage, world_size=2, held={c: b + 100 for c, b in split.items()}),
        ]
    held = ledger.zero.held_against_rule(reports, "qwen2-tiny")
    assert {k[:2] for k in held.ratio} == {(1, 2), (2, 2), (3, 2)}
    assert all(excess == 100 for excess in held.excess.values())
    assert held.ratio[1, 2, "gradients"] == (4 * n + 100) / (4 * n)  # stage 1 keeps whole gradients
    assert held.ratio[2, 2, "gradients"] == (2 * n + 100) / (2 * n)
    assert held.table().splitlines()[0].split() == [
        "N",
        "stage",
        "optimizer_states",
        "gradients",
        "parameters",
    ]
    assert len(held.table().splitlines()) == 4
    assert held.table(caption=True).splitlines() == [ledger.zero.HELD_CAPTION, *held.table().splitlines()]


def test_points_table_and_peak_phase_groups():
    points = ledger.measure_point("qwen2-tiny", 1, 16)
    rows = ledger.compare.points_table(points).splitlines()
    assert rows[0].split()[:4] == ["model", "batch", "seq", "update"] and len(rows) == 3
    assert rows[1].split()[:4] == ["qwen2-tiny", "1", "16", "first"]
    assert f"{points[1].measured_peak:,}" in rows[2] and rows[2].endswith(
        points[1].predicted.peak_overlap().phase
    )
    groups = ledger.compare.by_peak_phase(points)
    assert sum(len(v) for v in groups.values()) == 2
    assert "qwen2-tiny b1s16 steady" in groups[points[1].measured.peak_phase]


def test_allocator_pair_measures_again_only_a_pair_without_an_allocator():
    plain = ledger.measure_point("qwen2-tiny", 1, 16)
    again = ledger.allocator_pair(*plain, run_mode="cpu", seed=0)
    assert again[0] is not plain[0] and [c.step for c in again] == ["first", "steady"]
    assert all(c.measured.step_peak_allocated_bytes is not None for c in again)
    assert (again[1].model, again[1].batch, again[1].seq) == ("qwen2-tiny", 1, 16)
    assert again[1].tracked_peak == plain[1].tracked_peak  # the same point: the same tensors
    assert ledger.allocator_pair(*again) == again  # it carries them now: nothing runs again


def test_the_peak_of_a_memory_history_is_its_most_bytes_alive_at_once():
    history = measure.MemoryHistory("storage-tracker")
    block = memory_history.HistoryBlock  # one alloc or free per event index
    history.blocks = [
        block(100, 0, 2, "saved", ""),
        block(30, 1, None, "gradients", ""),
        block(50, 3, 4, "saved", ""),
    ]
    history.events = 5
    assert history.peak_bytes() == 130  # events 0 and 1 alive together; the 50 comes after the 100 is freed
    history.blocks.append(block(200, 5, None, "workspace", ""))
    history.events = 6
    assert history.peak_bytes() == 30 + 200
    assert measure.MemoryHistory().peak_bytes() == 0
