"""Environment profiles (trainmech.profiles): loading, validation, mode mapping, the pinned model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from trainmech import profiles, results, workload
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.package

QWEN_COMMIT = "060db6499f32faf8b98477b0a26969ef7d8b9987"
QWEN_SHA256 = "88c142557820ccad55bb59756bfcfcf891de9cc6202816bd346445188a0ed342"
QWEN_PARAMS = 494_032_768
REGISTRY_GPU_WORKLOADS = ("seq128", "seq256", "default14", "b2s512_default2", "b2s512_default1")


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, f"refusal spans several lines: {text!r}"
    assert "For further information" not in text and "input_value" not in text, text
    return text


def copy_profile(tmp_path: Path, source_id: str, new_id: str, edit=lambda s: s) -> None:
    text = (profiles.PROFILES_DIR / f"{source_id}.toml").read_text(encoding="utf-8")
    text = text.replace(f'profile_id = "{source_id}"', f'profile_id = "{new_id}"')
    (tmp_path / f"{new_id}.toml").write_text(edit(text), encoding="utf-8")


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("profile_id", ["TRAIN-CPU", "TRAIN-CUDA-MECHANISM"])
def test_both_shipped_profiles_load_and_validate(profile_id):
    p = profiles.load(profile_id)
    assert isinstance(p, profiles.Profile)
    assert p.profile_id == profile_id
    assert p.default_model in p.models
    assert p.workloads
    for w in p.workloads.values():
        assert w.model in p.models
        assert all(w.batch % m == 0 for m in w.micro_batches)
    assert profiles.available() == ["TRAIN-CPU", "TRAIN-CUDA-MECHANISM"]


def test_cpu_profile_is_deterministic_cpu_with_tokenizer_vocab():
    p = profiles.load("TRAIN-CPU")
    assert (p.run_mode, p.device, p.evidence_level) == ("cpu", "cpu", "cpu-mechanism")
    for spec in p.models.values():
        assert spec.vocab_size == "tokenizer"


def test_for_mode_maps_each_mode_to_its_profile():
    assert profiles.for_mode("cpu").profile_id == "TRAIN-CPU"
    cuda = profiles.for_mode("TRAIN-CUDA-MECHANISM")
    assert cuda.profile_id == "TRAIN-CUDA-MECHANISM"
    assert (cuda.device, cuda.evidence_level) == ("cuda", "gpu-measured")


@pytest.mark.parametrize("mode", ["gpu", "CPU", "", "TRAIN-CPU", None, 1])
def test_unknown_mode_is_refused_naming_the_valid_modes(mode):
    with pytest.raises(TrainmechError) as e:
        profiles.for_mode(mode)
    text = one_line(e)
    assert "cpu" in text and "TRAIN-CUDA-MECHANISM" in text


def test_unknown_profile_id_is_refused_naming_the_valid_ones():
    with pytest.raises(TrainmechError) as e:
        profiles.load("TRAIN-TPU")
    text = one_line(e)
    assert "TRAIN-TPU" in text and "TRAIN-CPU" in text


def test_profile_with_bad_toml_syntax_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "BROKEN.toml").write_text('profile_id = "BROKEN"\ndevice = \n', encoding="utf-8")
    with pytest.raises(TrainmechError) as e:
        profiles.load("BROKEN", directory=tmp_path)
    assert "BROKEN.toml" in one_line(e)


def test_profile_missing_fields_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "THIN.toml").write_text('profile_id = "THIN"\nrun_mode = "cpu"\n', encoding="utf-8")
    with pytest.raises(TrainmechError) as e:
        profiles.load("THIN", directory=tmp_path)
    text = one_line(e)
    assert "THIN.toml" in text and "malformed" in text


@pytest.mark.parametrize(
    "old, new, fragments",
    [
        ('device = "cpu"', 'device = "cpu"\ncolour = "red"', ["colour"]),
        (
            '[workloads.cpu-loop]\nmodel = "qwen2-tiny"',
            '[workloads.cpu-loop]\nmodel = "qwen2-huge"',
            ["qwen2-huge", "cpu-loop"],
        ),
        (
            "batch = 4\nseq = 32\nmicro_batches = [1, 2, 4]",
            "batch = 4\nseq = 32\nmicro_batches = [1, 3]",
            ["[3]"],
        ),
        ("num_key_value_heads = 2", "num_key_value_heads = 3", ["num_key_value_heads"]),
    ],
    ids=["unknown-key", "workload-names-a-missing-model", "micro-batches-divide-the-batch", "heads-divide"],
)
def test_an_edited_profile_is_refused_naming_what_is_wrong(tmp_path, old, new, fragments):
    assert old in (profiles.PROFILES_DIR / "TRAIN-CPU.toml").read_text(encoding="utf-8")  # the edit applies
    copy_profile(tmp_path, "TRAIN-CPU", "EDITED", lambda s: s.replace(old, new, 1))
    with pytest.raises(TrainmechError) as e:
        profiles.load("EDITED", directory=tmp_path)
    text = one_line(e)
    assert all(fragment in text for fragment in fragments), text


def test_profile_declaring_another_id_is_refused(tmp_path):
    shutil.copy(profiles.PROFILES_DIR / "TRAIN-CPU.toml", tmp_path / "OTHER.toml")
    with pytest.raises(TrainmechError) as e:
        profiles.load("OTHER", directory=tmp_path)
    assert "TRAIN-CPU" in one_line(e)


def test_copied_profile_loads_from_another_directory(tmp_path):
    copy_profile(tmp_path, "TRAIN-CPU", "COPY")
    assert profiles.load("COPY", directory=tmp_path).workloads == profiles.load("TRAIN-CPU").workloads


def test_model_and_workload_lookups_refuse_unknown_names():
    p = profiles.load("TRAIN-CPU")
    assert p.model().model_id == "trainmech/qwen2-tiny"
    assert p.workload("cpu-loop").updates == 8
    with pytest.raises(TrainmechError, match="qwen2-tiny"):
        p.model("nope")
    with pytest.raises(TrainmechError, match="cpu-loop"):
        p.workload("nope")


# ---------------------------------------------------------------- the pinned Qwen2.5-0.5B


def test_cuda_profile_pins_the_qwen25_identity():
    spec = profiles.load("TRAIN-CUDA-MECHANISM").model()
    assert spec.model_id == "Qwen/Qwen2.5-0.5B"
    assert spec.model_commit == QWEN_COMMIT
    assert spec.weights_sha256 == QWEN_SHA256
    assert spec.n_params == QWEN_PARAMS


def test_cuda_profile_config_is_the_exact_qwen25_shape_with_494m_params():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = profiles.load("TRAIN-CUDA-MECHANISM").model()
    kwargs = spec.qwen2_config()
    assert not {"model_id", "model_commit", "weights_sha256", "n_params"} & set(kwargs)
    config = workload.qwen2_config(spec)
    assert isinstance(config, Qwen2Config)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (896, 24, 14)
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (2, 4864, 151936)
    assert config.tie_word_embeddings is True
    assert config.rms_norm_eps == 1e-6
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    distinct = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    assert distinct == QWEN_PARAMS == spec.n_params
    assert workload.n_params(model) == QWEN_PARAMS


# ---------------------------------------------------------------- workloads vs the registry


@pytest.mark.parametrize("profile_id", ["TRAIN-CPU", "TRAIN-CUDA-MECHANISM"])
def test_every_workload_experiment_is_a_registry_semantic_id(profile_id):
    known = {e["semantic_id"] for e in results.experiments()}
    p = profiles.load(profile_id)
    named = {sid for w in p.workloads.values() for sid in w.experiments}
    assert named, "a profile without experiments"
    assert named <= known, named - known


def test_cuda_profile_carries_the_registry_gpu_workloads():
    p = profiles.load("TRAIN-CUDA-MECHANISM")
    for wid in REGISTRY_GPU_WORKLOADS:
        assert wid in p.workloads, wid
        assert p.workloads[wid].model == p.default_model
    assert p.workloads["seq128"].seq == 128
    assert p.workloads["seq256"].seq == 256
    assert p.workloads["default14"].updates == 14
    for wid, updates in (("b2s512_default2", 2), ("b2s512_default1", 1)):
        w = p.workloads[wid]
        assert (w.batch, w.seq, w.updates) == (2, 512, updates)
    assert "TRAIN-CHECKPOINT" in p.workloads["b2s512_default2"].experiments
    assert "TRAIN-OFFLOAD" in p.workloads["b2s512_default1"].experiments
    assert "TRAIN-GRADIENT-ACCUMULATION" in p.workloads["seq256"].experiments
    assert "TRAIN-AMP-BACKWARD" in p.workloads["default14"].experiments


def test_every_registry_experiment_with_a_workload_in_one_profile_has_one_in_the_other():
    cpu, cuda = profiles.load("TRAIN-CPU"), profiles.load("TRAIN-CUDA-MECHANISM")
    served = lambda p: {sid for w in p.workloads.values() for sid in w.experiments}  # noqa: E731
    assert served(cpu) == served(cuda)
