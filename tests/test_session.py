"""The run session (trainmech.session): parameter checks, seeding, environment, where records go."""

from __future__ import annotations

import platform

import pytest
import torch

from trainmech import results, session
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.package


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Records of these tests go to tmp_path; start()'s global switches are restored afterwards."""
    monkeypatch.setenv(session.RESULTS_ENV, str(tmp_path / "env-results"))
    deterministic = torch.are_deterministic_algorithms_enabled()
    rng = torch.random.get_rng_state()
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.random.set_rng_state(rng)


def test_start_opens_a_cpu_session():
    s = session.start("cpu", "local", page="Task0", notebook="Task0_training_loop")
    assert (s.run_mode, s.run_label, s.page, s.notebook) == ("cpu", "local", "Task0", "Task0_training_loop")
    assert s.profile.profile_id == "TRAIN-CPU"
    assert s.device == torch.device("cpu") and not s.on_cuda
    assert s.seed == 0
    assert torch.are_deterministic_algorithms_enabled()
    assert s.summary() == "run_mode=cpu  profile=TRAIN-CPU  device=cpu  seed=0"


def test_notebook_defaults_to_page():
    assert session.start("cpu", "local", page="Task3").notebook == "Task3"


@pytest.mark.parametrize("mode", ["gpu", "CPU", "cuda", "", "TRAIN-CPU", None])
def test_start_refuses_an_unknown_mode_naming_the_valid_ones(mode):
    with pytest.raises(TrainmechError) as e:
        session.start(mode, "local")
    text = str(e.value)
    assert "\n" not in text
    assert "cpu" in text and "TRAIN-CUDA-MECHANISM" in text


@pytest.mark.parametrize(
    "label",
    ["../x", "a/b", "..", ".", ".hidden", "", "a b", "läbel", "标签", "x\n", "a\\b", "x:y", None, 3],
)
def test_start_refuses_an_unsafe_label(label):
    with pytest.raises(TrainmechError) as e:
        session.start("cpu", label)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("label", ["ok-1.2_x", "local", "cpu-reference", "h200-2026-11-29", "A", "_x", "x.."])
def test_start_accepts_a_safe_label(label):
    assert session.start("cpu", label).run_label == label


def test_start_refuses_cuda_mode_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TrainmechError) as e:
        session.start("TRAIN-CUDA-MECHANISM", "gpu-run", page="Task3")
    text = str(e.value)
    assert "\n" not in text
    assert "CUDA" in text and "cpu" in text


def test_same_seed_same_numbers_other_seed_other_numbers():
    session.start("cpu", "local", seed=7)
    a = torch.randn(16)
    session.start("cpu", "local", seed=7)
    b = torch.randn(16)
    session.start("cpu", "local", seed=8)
    c = torch.randn(16)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_seed_everything_seeds_python_and_numpy():
    import random

    import numpy as np

    session.seed_everything(3)
    first = (random.random(), np.random.rand())
    session.seed_everything(3)
    assert (random.random(), np.random.rand()) == first


def test_environment_has_every_record_key_and_the_imported_versions():
    import accelerate
    import transformers

    s = session.start("cpu", "local")
    env = s.environment
    assert set(env) == set(results.Environment.model_fields)
    results.Environment.model_validate(env)
    assert env["torch"] == torch.__version__
    assert env["transformers"] == transformers.__version__
    assert env["accelerate"] == accelerate.__version__
    assert env["python"] == platform.python_version()
    assert (env["profile_id"], env["run_mode"], env["device"]) == ("TRAIN-CPU", "cpu", "cpu")
    assert env["cuda"] is None and env["gpu"] is None and env["gpu_memory_bytes"] is None


def test_environment_names_the_cpu_and_the_numeric_path(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    env = session.start("cpu", "local").environment
    assert env["intra_op_threads"] == session.CPU_THREADS == torch.get_num_threads() == 1
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["cpu"] and "\n" not in env["cpu"]
    config = torch.__config__.show()
    if "BLAS_INFO=mkl" in config:
        assert env["blas"].startswith("mkl 20") and env["blas"].split()[1] in config
    if "MKL-DNN v" in config:
        assert f"MKL-DNN v{env['onednn']}" in config
    assert env["numeric_env"] == {
        "ATEN_CPU_CAPABILITY": None,
        "MKL_CBWR": "COMPATIBLE",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }


def test_results_dir_follows_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(session.RESULTS_ENV, str(tmp_path / "here"))
    assert session.start("cpu", "lbl").results_dir == tmp_path / "here"


def test_results_dir_argument_wins_over_the_environment(tmp_path):
    assert session.start("cpu", "lbl", results_dir=tmp_path / "arg").results_dir == tmp_path / "arg"


def test_results_dir_defaults_to_results_label_in_the_repo(monkeypatch):
    monkeypatch.delenv(session.RESULTS_ENV, raising=False)
    s = session.start("cpu", "some-label")
    assert s.results_dir == session.REPO_ROOT / "results" / "some-label"
    assert not s.results_dir.exists()  # start() itself writes nothing


def test_record_writes_a_valid_record_where_the_environment_says(monkeypatch, tmp_path):
    out = tmp_path / "records"
    monkeypatch.setenv(session.RESULTS_ENV, str(out))
    s = session.start("cpu", "lbl", page="Task3", notebook="Task3_effective_updates", seed=5)
    built = s.build_model()
    rec = s.record(
        "TRAIN-GRADIENT-ACCUMULATION",
        "cpu-seq32",
        built=built,
        input_shape=[4, 32],
        effective_batch={"sequences": 4, "supervised_tokens": 124},
        dtype="float32",
        update_count=1,
        correctness={"grad_max_abs_error": 1e-7, "all_finite": True},
        metrics={"loss": 2.5},
    )
    path = out / "TRAIN-GRADIENT-ACCUMULATION__cpu-seq32.json"
    assert s.written == [path]
    assert list(out.iterdir()) == [path]
    back = results.read_record(path)
    assert back == rec
    assert back.conclusion.evidence_level == s.profile.evidence_level == "cpu-mechanism"
    assert back.identity.page == "Part 02 · 11"  # the registry's page, not the notebook's
    assert back.identity.run_label == "lbl"
    assert back.workload.model_weights == "random-init seed=5"
    assert back.workload.seed == 5
    assert back.workload.tokenizer.startswith("trainmech-bytebpe-")
    assert back.environment.model_dump() == s.environment
    assert back.resources.peak_allocated_bytes is None  # unknown stays null


def test_record_keeps_an_explicit_evidence_level_and_decision(tmp_path):
    s = session.start("cpu", "lbl", results_dir=tmp_path)
    rec = s.record(
        "TRAIN-LOOP",
        "cpu-loop",
        built=s.build_model(),
        input_shape=[4, 32],
        effective_batch={"sequences": 4, "supervised_tokens": None},
        dtype="float32",
        conclusion={"evidence_level": "not-measured", "decision": "tune"},
    )
    assert (rec.conclusion.evidence_level, rec.conclusion.decision) == ("not-measured", "tune")
    assert rec.identity.page == "Task0"


def test_workload_for_picks_the_workload_serving_a_semantic_id():
    s = session.start("cpu", "local")
    wid, w = s.workload_for("TRAIN-GRADIENT-ACCUMULATION")
    assert wid == "cpu-seq32" and "TRAIN-GRADIENT-ACCUMULATION" in w.experiments
    assert s.workload_for("TRAIN-OFFLOAD")[0] == "cpu-b2s128"
    wid, w = s.workload_for("TRAIN-GRADIENT-ACCUMULATION", "cpu-seq64")
    assert (wid, w.seq) == ("cpu-seq64", 64)


def test_workload_for_refuses_an_unknown_semantic_id_or_workload():
    s = session.start("cpu", "local")
    with pytest.raises(TrainmechError, match="TRAIN-NOTHING"):
        s.workload_for("TRAIN-NOTHING")
    with pytest.raises(TrainmechError, match="cpu-seq32"):
        s.workload_for("TRAIN-GRADIENT-ACCUMULATION", "seq128")


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"conclusion": {"evidence_level": "proven"}}, ["evidence_level"]),
        ({"conclusion": {"decision": "adopt"}}, ["decision"]),
        ({"metrics": {"loss": float("nan")}}, ["metrics"]),
        ({"correctness": {"colour": 1}}, ["colour"]),
    ],
)
def test_record_refuses_a_bad_record_in_one_sentence_and_writes_nothing(tmp_path, kwargs, words):
    s = session.start("cpu", "lbl", results_dir=tmp_path / "out")
    with pytest.raises(TrainmechError) as e:
        s.record(
            "TRAIN-LOOP",
            "cpu-loop",
            built=s.build_model(),
            input_shape=[4, 32],
            effective_batch={"sequences": 4},
            dtype="float32",
            **kwargs,
        )
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)
    assert not (tmp_path / "out").exists() and s.written == []
