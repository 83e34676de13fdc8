"""Result records (trainmech.results): the model, the atomic writer, the reader, the registry."""

from __future__ import annotations

import io
import json
import os
import random
import typing
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from trainmech import results
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.package

REPO = Path(__file__).resolve().parent.parent


def full_record(
    semantic_id: str = "TRAIN-GRADIENT-ACCUMULATION", workload_id: str = "cpu-seq32", **conclusion
) -> dict:
    """A record with every group and every field filled (nothing left to defaults)."""
    return {
        "schema_version": 2,
        "identity": {
            "semantic_id": semantic_id,
            "workload_id": workload_id,
            "run_label": "unit",
            "page": "Part 02 · 11",
            "notebook": "Task3_effective_updates",
            "candidate": "micro-batches=2",
        },
        "workload": {
            "model_id": "trainmech/qwen2-tiny",
            "model_commit": None,
            "model_weights": "random-init seed=0",
            "tokenizer": "trainmech-bytebpe-512 sha256:0123456789abcdef",
            "input_shape": [4, 32],
            "effective_batch": {"sequences": 4, "supervised_tokens": 124},
            "update_count": 1,
            "dtype": "float32",
            "seed": 0,
        },
        "environment": {
            "profile_id": "TRAIN-CPU",
            "run_mode": "cpu",
            "python": "3.12.3",
            "torch": "2.13.0",
            "transformers": "5.24.0",
            "accelerate": None,
            "cuda": None,
            "gpu": None,
            "gpu_memory_bytes": None,
            "device": "cpu",
            "cpu": "Intel(R) Xeon(R) Platinum 8480+",
            "cpu_capability": "AVX512",
            "blas": "mkl 2024.2",
            "onednn": "3.12.0",
            "intra_op_threads": 1,
            "numeric_env": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": None, "ONEDNN_MAX_CPU_ISA": None},
        },
        "correctness": {
            "output_max_abs_error": 1.5e-7,
            "grad_max_abs_error": 3e-8,
            "all_finite": True,
            "skipped_updates": 0,
            "effective_updates": 1,
        },
        "resources": {
            "peak_allocated_bytes": None,
            "peak_reserved_bytes": None,
            "step_time_median_s": 0.012,
            "step_time_p95_s": 0.02,
            "transfer_bytes": 0,
            "recompute_count": None,
        },
        "conclusion": {
            "failure": None,
            "evidence_level": "cpu-mechanism",
            "decision": "tune",
            "next_step": "measure on the GPU",
            **conclusion,
        },
        "metrics": {
            "loss": 5.25,
            "losses": [5.25, 5.0],
            "by_split": {"1": 0.0, "2": 1e-7},
            "note": "中文",
            "ok": True,
        },
    }


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


# ---------------------------------------------------------------- round trip


def test_full_record_round_trips(tmp_path):
    data = full_record()
    path = results.write_record(data, tmp_path)
    assert path == tmp_path / "TRAIN-GRADIENT-ACCUMULATION__cpu-seq32.json"
    assert json.loads(path.read_text(encoding="utf-8")) == data
    back = results.read_record(path)
    assert back == results.Record.model_validate(data)
    assert back.model_dump(mode="json") == data
    results.write_record(back, tmp_path / "again")  # a Record object writes the same bytes
    assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes()


def test_minimal_record_fills_unknowns_with_null(tmp_path):
    data = full_record()
    for group in ("correctness", "resources", "metrics"):
        del data[group]
    back = results.read_record(results.write_record(data, tmp_path))
    assert back.correctness.model_dump() == dict.fromkeys(results.Correctness.model_fields)
    assert back.resources.model_dump() == dict.fromkeys(results.Resources.model_fields)
    assert back.metrics == {} and back.schema_version == results.SCHEMA_VERSION


def test_record_has_the_six_groups_of_the_registry():
    fields = set(results.Record.model_fields)
    assert {"identity", "workload", "environment", "correctness", "resources", "conclusion"} <= fields
    assert {"semantic_id", "workload_id", "run_label", "page", "notebook", "candidate"} <= set(
        results.Identity.model_fields
    )
    assert {
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "step_time_median_s",
        "step_time_p95_s",
        "transfer_bytes",
        "recompute_count",
    } <= set(results.Resources.model_fields)
    assert {"failure", "evidence_level", "decision", "next_step"} <= set(results.Conclusion.model_fields)


def test_written_file_is_complete_utf8_json(tmp_path):
    path = results.write_record(full_record(), tmp_path)
    text = path.read_text(encoding="utf-8")
    assert text.endswith("}\n")
    assert "中文" in text and "Part 02 · 11" in text  # not \u-escaped
    json.loads(text)


# ---------------------------------------------------------------- atomic writer


def test_writer_leaves_no_temporary_files(tmp_path):
    results.write_record(full_record(), tmp_path)
    results.write_record(full_record(), tmp_path)  # overwrite in place
    results.write_record(full_record(workload_id="cpu-seq64"), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "TRAIN-GRADIENT-ACCUMULATION__cpu-seq32.json",
        "TRAIN-GRADIENT-ACCUMULATION__cpu-seq64.json",
    ]


@pytest.mark.parametrize(
    "spoil",
    [
        lambda d: d["conclusion"].update(evidence_level="proven"),
        lambda d: d["correctness"].update(output_max_abs_error=float("nan")),
        lambda d: d["metrics"].update(loss=float("inf")),
        lambda d: d.pop("environment"),
    ],
    ids=["evidence", "nan", "inf", "missing-group"],
)
def test_invalid_record_writes_nothing_and_keeps_the_existing_file(tmp_path, spoil):
    path = results.write_record(full_record(), tmp_path)
    before = path.read_bytes()
    bad = full_record()
    spoil(bad)
    with pytest.raises(TrainmechError) as e:
        results.write_record(bad, tmp_path)
    assert "\n" not in str(e.value)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_invalid_record_into_a_new_folder_writes_nothing(tmp_path):
    bad = full_record(decision="maybe")
    with pytest.raises(TrainmechError):
        results.write_record(bad, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_failed_rename_keeps_the_existing_file_and_removes_the_temporary(tmp_path, monkeypatch):
    path = results.write_record(full_record(), tmp_path)
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "replace", broken_replace)
    with pytest.raises(OSError):
        results.write_record(full_record(next_step="changed"), tmp_path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


# ---------------------------------------------------------------- reader


def refuse(tmp_path: Path, data) -> str:
    path = tmp_path / "X__y.json"
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        write_json(path, data)
    with pytest.raises(TrainmechError) as e:
        results.read_record(path)
    text = str(e.value)
    assert "\n" not in text and "X__y.json" in text
    return text


@pytest.mark.parametrize("text", ["", "{", "not json", '{"identity": '])
def test_reader_refuses_malformed_json(tmp_path, text):
    assert "JSON" in refuse(tmp_path, text)


def test_reader_refuses_a_missing_file(tmp_path):
    with pytest.raises(TrainmechError):
        results.read_record(tmp_path / "absent__x.json")


@pytest.mark.parametrize("group", ["identity", "workload", "environment", "conclusion"])
def test_reader_refuses_a_missing_group(tmp_path, group):
    data = full_record()
    del data[group]
    assert group in refuse(tmp_path, data)


@pytest.mark.parametrize(
    "group, key, value",
    [
        ("workload", "seed", "zero"),
        ("workload", "input_shape", "4x32"),
        ("workload", "effective_batch", 4),
        ("correctness", "all_finite", "perhaps"),
        ("resources", "peak_allocated_bytes", "1 GiB"),
        ("identity", "page", 2),
        ("environment", "gpu_memory_bytes", [1]),
    ],
)
def test_reader_refuses_a_wrong_type(tmp_path, group, key, value):
    data = full_record()
    data[group][key] = value
    assert key in refuse(tmp_path, data)


def test_reader_refuses_an_unknown_evidence_level(tmp_path):
    assert "evidence_level" in refuse(tmp_path, full_record(evidence_level="gpu-guessed"))


@pytest.mark.parametrize("decision", ["adopt", "ACCEPT", "", 1])
def test_reader_refuses_a_decision_outside_accept_tune_reject(tmp_path, decision):
    assert "decision" in refuse(tmp_path, full_record(decision=decision))


@pytest.mark.parametrize("decision", ["accept", "tune", "reject", None])
def test_reader_accepts_each_decision_and_null(tmp_path, decision):
    path = write_json(
        tmp_path / "TRAIN-GRADIENT-ACCUMULATION__cpu-seq32.json", full_record(decision=decision)
    )
    assert results.read_record(path).conclusion.decision == decision


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_reader_refuses_nan_and_infinity(tmp_path, literal):
    text = json.dumps(full_record()).replace(
        '"output_max_abs_error": 1.5e-07', f'"output_max_abs_error": {literal}'
    )
    assert literal in text
    refuse(tmp_path, text)


def test_reader_refuses_nan_in_metrics(tmp_path):
    text = json.dumps(full_record()).replace('"loss": 5.25', '"loss": NaN')
    assert "NaN" in text
    refuse(tmp_path, text)


def test_reader_refuses_unknown_keys_and_schema_versions(tmp_path):
    data = full_record()
    data["identity"]["colour"] = "red"
    assert "colour" in refuse(tmp_path, data)
    data = full_record()
    data["schema_version"] = 3
    assert "schema_version" in refuse(tmp_path, data)


@pytest.mark.parametrize("bad_id", ["../x", "a/b", ".hidden", "", "a b", "x\n"])
def test_reader_refuses_an_unsafe_semantic_or_workload_id(tmp_path, bad_id):
    refuse(tmp_path, full_record(semantic_id=bad_id))
    refuse(tmp_path, full_record(workload_id=bad_id))


def test_read_records_reads_only_record_files(tmp_path):
    run = tmp_path / "unit"
    results.write_record(full_record(), run)
    results.write_record(full_record("TRAIN-LOOP", "cpu-loop"), run)
    (run / "run.json").write_text("{}", encoding="utf-8")
    (run / ".tmp-abc__x.json").write_text("{", encoding="utf-8")
    records = results.read_records(run)
    assert [r.identity.semantic_id for r in records] == ["TRAIN-GRADIENT-ACCUMULATION", "TRAIN-LOOP"]


@pytest.mark.parametrize("label", ["../x", "a/b", ".hidden", "", "a b", "é", "x\n", "\nx"])
def test_check_label_refuses_unsafe_labels(label):
    with pytest.raises(TrainmechError):
        results.check_label(label)


# ---------------------------------------------------------------- schema


def test_committed_schema_file_is_current():
    committed = (REPO / "results" / "record.schema.json").read_text(encoding="utf-8")
    assert committed == json.dumps(results.json_schema(), ensure_ascii=False, indent=2) + "\n", (
        "results/record.schema.json is stale: regenerate it with results.write_schema(path)"
    )


def test_write_schema_writes_the_schema(tmp_path):
    path = results.write_schema(tmp_path / "s.json")
    schema = json.loads(path.read_text(encoding="utf-8"))
    assert schema == results.json_schema()
    assert set(schema["required"]) >= {"identity", "workload", "environment", "conclusion"}


# ---------------------------------------------------------------- registry


def rows(markdown: str) -> dict[str, list[str]]:
    """semantic_id -> the cells of its row in the registry table."""
    out = {}
    for line in markdown.splitlines():
        if line.startswith("| ") and " / " in line and not line.startswith("| 实验 ID"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            out[cells[0].split(" / ")[0]] = cells
    return out


def rec(semantic_id: str, workload_id: str, **conclusion) -> results.Record:
    data = full_record(semantic_id, workload_id, **{"decision": None, **conclusion})
    if conclusion.get("evidence_level") == "gpu-measured":  # GPU evidence comes from a GPU
        data["environment"].update(
            device="cuda:0", gpu="NVIDIA H200", gpu_memory_bytes=150_000_000_000, cuda="12.8"
        )
    return results.Record.model_validate(data)


def test_registry_lists_every_experiment_and_no_record_without_records():
    md = results.registry_markdown([], "lbl")
    table = rows(md)
    ids = [e["semantic_id"] for e in results.experiments()]
    assert list(table) == ids
    assert all(cells[3] == "no record" for cells in table.values())
    assert "`lbl`" in md.splitlines()[0]


def test_registry_experiments_are_the_architecture_ones():
    ids = {e["semantic_id"] for e in results.experiments()}
    assert {
        "TRAIN-LOCAL-BACKWARD",
        "TRAIN-ATTENTION-BACKWARD",
        "TRAIN-GRADIENT-ACCUMULATION",
        "TRAIN-SCHEDULER-CLOCK",
        "TRAIN-UPDATE-DYNAMICS",
        "TRAIN-CONTINUAL-PRETRAIN",
        "TRAIN-AMP-BACKWARD",
        "TRAIN-CHECKPOINT",
        "TRAIN-OFFLOAD",
        "TRAIN-STATE-LEDGER",
    } <= ids
    for e in results.experiments():
        assert {"semantic_id", "page", "notebook", "comparison", "metrics", "reference"} <= set(e)


def test_registry_figures_are_the_numbers_its_reference_quotes():
    """`figures` is the `reference` text as data: every change there is quoted in the text, and back."""
    quoted = {e["semantic_id"]: e for e in results.experiments() if "figures" in e}
    assert {"TRAIN-CHECKPOINT", "TRAIN-OFFLOAD", "TRAIN-AMP-BACKWARD"} <= set(quoted)
    for sid, e in quoted.items():
        figures = results.reference_figures(sid)
        assert figures["device"] in e["reference"] and figures["workload"] in e["reference"], sid
        for name, value in figures.items():
            if name.endswith("_change"):
                assert f"{abs(value) * 100:.1f}%" in e["reference"], (sid, name)
            elif name.endswith("_ratio"):
                assert f"×{value}" in e["reference"], (sid, name)
    assert results.reference_figures("TRAIN-CHECKPOINT")["allocated_peak_change"] == -0.337
    assert results.reference_figures("TRAIN-LOOP") == {}
    with pytest.raises(TrainmechError):
        results.reference_figures("TRAIN-NOPE")


def test_registry_status_is_derived_from_the_records():
    records = [
        rec("TRAIN-GRADIENT-ACCUMULATION", "cpu-seq32"),
        rec("TRAIN-CHECKPOINT", "cpu-b2s128", evidence_level="cpu-mechanism"),
        rec("TRAIN-CHECKPOINT", "b2s512_default2", evidence_level="gpu-measured", decision="accept"),
        rec("TRAIN-OFFLOAD", "b2s512_default1", evidence_level="not-measured", failure="no CUDA device"),
        rec("TRAIN-OFFLOAD", "cpu-b2s128", evidence_level="cpu-mechanism", decision="tune"),
    ]
    table = rows(results.registry_markdown(records, "lbl"))
    assert table["TRAIN-GRADIENT-ACCUMULATION"][3] == "cpu-mechanism (cpu-seq32)"
    checkpoint = table["TRAIN-CHECKPOINT"][3]
    assert checkpoint.startswith("gpu-measured (")  # the strongest evidence wins
    assert "b2s512_default2" in checkpoint and "cpu-b2s128" in checkpoint
    assert "decision accept" in checkpoint
    offload = table["TRAIN-OFFLOAD"][3]
    assert offload.startswith("not-measured (") and "decision tune" in offload and "1 failed" in offload
    assert table["TRAIN-LOOP"][3] == "no record"
    assert table["TRAIN-STATE-LEDGER"][3] == "no record"


def test_registry_order_of_records_does_not_matter():
    a = rec("TRAIN-CHECKPOINT", "b2s512_default2", evidence_level="gpu-measured")
    b = rec("TRAIN-CHECKPOINT", "cpu-b2s128", evidence_level="cpu-mechanism")
    assert results.registry_markdown([a, b]) == results.registry_markdown([b, a])


def test_registry_keeps_records_of_experiments_outside_the_registry():
    md = results.registry_markdown([rec("TRAIN-EXTRA", "cpu-loop")])
    assert rows(md)["TRAIN-EXTRA"][3] == "cpu-mechanism (cpu-loop)"


def test_evidence_levels_are_ordered_weakest_first():
    """The registry cell names the strongest level among an experiment's records: for every pair of
    levels, the later one in EVIDENCE_LEVELS wins, whatever the order of the records; a record's
    level can only be one of them; and the ends are ARCHITECTURE.md's (CPU mechanism only, GPU measured)."""
    levels = results.EVIDENCE_LEVELS
    assert set(levels) == set(typing.get_args(results.Evidence))
    assert (levels[0], levels[-1]) == ("cpu-mechanism", "gpu-measured")
    for i, weaker in enumerate(levels):
        for stronger in levels[i + 1 :]:
            pair = [
                rec("TRAIN-CHECKPOINT", "cpu-b2s128", evidence_level=weaker),
                rec("TRAIN-CHECKPOINT", "b2s512_default2", evidence_level=stronger),
            ]
            for records in (pair, pair[::-1]):
                assert results.evidence_status(records) == f"{stronger} (b2s512_default2, cpu-b2s128)", (
                    weaker,
                    stronger,
                )
    assert results.evidence_status([]) == "no record"


# ---------------------------------------------------------------- registry: Task6's gate and memory-strategy records


def gate_record(
    semantic_id, workload_id, level="cpu-mechanism", decision=None, failure=None, label="unit"
) -> results.Record:
    gpu = level == "gpu-measured"  # GPU evidence comes from a GPU
    return results.validate(
        {
            "identity": {
                "semantic_id": semantic_id,
                "workload_id": workload_id,
                "run_label": label,
                "page": "Task6",
                "notebook": "Task6_gates_evidence",
                "candidate": workload_id.split(".")[-1],
            },
            "workload": {
                "model_id": "trainmech/qwen2-tiny",
                "model_weights": "random-init seed=0",
                "tokenizer": "t",
                "input_shape": [4, 32],
                "effective_batch": {"sequences": 4, "supervised_tokens": 58},
                "dtype": "float32",
                "seed": 0,
            },
            "environment": {
                "profile_id": "TRAIN-CPU",
                "run_mode": "cpu",
                "python": "3.11",
                "torch": "2",
                "transformers": "5",
                "accelerate": None,
                "cuda": "12.8" if gpu else None,
                "gpu": "NVIDIA H200" if gpu else None,
                "gpu_memory_bytes": 150_000_000_000 if gpu else None,
                "device": "cuda:0" if gpu else "cpu",
            },
            "conclusion": {"evidence_level": level, "decision": decision, "failure": failure},
            "metrics": {"gates": {"inputs": True, "gradients": True}, "note": "中文"},
        }
    )


GATE_RECORDS = [
    gate_record("TRAIN-CHECKPOINT", "cpu-gates.checkpoint"),
    gate_record("TRAIN-CHECKPOINT", "b4s256_gates.checkpoint", "gpu-measured", "accept"),
    gate_record("TRAIN-OFFLOAD", "b4s256_gates.offload", "gpu-measured", "tune"),
    gate_record("TRAIN-MEMORY-STRATEGY", "cpu-gates.checkpoint-fp16"),
    gate_record("TRAIN-MEMORY-STRATEGY", "cpu-gates.checkpoint-offload", failure="gradients gate failed"),
    gate_record("TRAIN-CORRECTNESS-GATE", "cpu-gates"),
    gate_record("TRAIN-SOMETHING-NEW", "cpu-gates"),
]


def test_registry_is_byte_identical_when_regenerated_from_the_same_records(tmp_path, monkeypatch):
    run = tmp_path / "unit"
    for r in GATE_RECORDS:
        results.write_record(r, run)
    first = results.registry_markdown(GATE_RECORDS, "unit").encode("utf-8")
    for seed in range(5):  # any order in, the same bytes out
        shuffled = results.read_records(run)
        random.Random(seed).shuffle(shuffled)
        assert results.registry_markdown(shuffled, "unit").encode("utf-8") == first
    before = {
        p.name: p.read_bytes() for p in results.record_paths(run)
    }  # a read-write round trip changes no byte
    for p in results.record_paths(run):
        results.write_record(results.read_record(p), run)
    assert {p.name: p.read_bytes() for p in results.record_paths(run)} == before

    from trainmech import __main__ as cli
    from trainmech import runner

    monkeypatch.setattr(runner, "RESULTS_ROOT", tmp_path)
    printed = []
    for _ in range(2):
        out = io.StringIO()
        with redirect_stdout(out):
            assert cli.main(["registry", "--label", "unit"]) == 0
        printed.append(out.getvalue().encode("utf-8"))
    assert printed[0] == printed[1] == first


def test_registry_rows_for_the_gates_and_the_memory_strategy_interface():
    md = results.registry_markdown(GATE_RECORDS, "unit")
    row = {line.split(" / ")[0].lstrip("| "): line for line in md.splitlines() if " / " in line}
    assert (
        "gpu-measured (b4s256_gates.checkpoint, cpu-gates.checkpoint); decision accept"
        in row["TRAIN-CHECKPOINT"]
    )
    assert "Part 02 · 76" in row["TRAIN-MEMORY-STRATEGY"] and "1 failed" in row["TRAIN-MEMORY-STRATEGY"]
    assert "cpu-mechanism (cpu-gates)" in row["TRAIN-CORRECTNESS-GATE"]
    assert md.index("TRAIN-MEMORY-STRATEGY") < md.index(
        "TRAIN-SOMETHING-NEW"
    )  # unknown ids after the registry's own


def test_registry_keeps_wrong_apart_from_not_worth_it():
    """No gain is filed as decision reject, as a failed gate is: the registry shows each record's outcome beside it."""
    no_gain = gate_record("TRAIN-CHECKPOINT", "b4s256_gates.checkpoint", "gpu-measured", "reject")
    no_gain.metrics["outcome"] = "no-gain"
    wrong = gate_record(
        "TRAIN-OFFLOAD", "b4s256_gates.offload", "gpu-measured", "reject", failure="gradients gate failed"
    )
    wrong.metrics["outcome"] = "reject"
    table = rows(results.registry_markdown([no_gain, wrong], "unit"))
    assert table["TRAIN-CHECKPOINT"][3].endswith("; decision reject; outcome no-gain")
    assert table["TRAIN-OFFLOAD"][3].endswith(
        "; decision reject; outcome reject (gradients gate failed); 1 failed"
    )
    assert results.outcome_of(gate_record("TRAIN-LOOP", "cpu-loop")) is None  # nothing judged: nothing shown


def test_runs_with_gpu_evidence_are_found_by_their_records(tmp_path):
    for label, records in (
        ("cpu-run", GATE_RECORDS[:1]),
        ("h200-run", GATE_RECORDS[:3]),
    ):  # a record's run label is its folder
        for r in records:
            results.write_record(
                r.model_copy(update={"identity": r.identity.model_copy(update={"run_label": label})}),
                tmp_path / label,
            )
    (tmp_path / "h200-run" / "BROKEN__x.json").write_text(
        "{", encoding="utf-8"
    )  # left out, as the runner does
    (tmp_path / ".staging-x").mkdir()
    found = results.runs_with_evidence(tmp_path, "gpu-measured")
    assert list(found) == ["h200-run"] and len(found["h200-run"]) == 3
    assert list(results.runs_with_evidence(tmp_path, "cpu-mechanism")) == ["cpu-run", "h200-run"]
    with pytest.raises(
        TrainmechError,
        match="unknown evidence level 'measured'; valid: cpu-mechanism, not-measured, gpu-measured",
    ):
        results.runs_with_evidence(tmp_path, "measured")


# ---------------------------------------------------------------- strict records (issue 13)


def record_file(tmp_path: Path, data=None, folder: str = "unit") -> Path:
    """A record file named after its identity, in a run folder named after its label."""
    data = full_record() if data is None else data
    path = tmp_path / folder / "TRAIN-GRADIENT-ACCUMULATION__cpu-seq32.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)
    return path


def refused_on_read(path: Path, *words: str, run_label: str | None = None) -> str:
    with pytest.raises(TrainmechError) as e:
        results.read_record(path, run_label)
    text = str(e.value)
    assert "\n" not in text and results.shown(path) in text, text
    for w in words:
        assert w in text, (w, text)
    return text


def spoiled(path: list, value) -> dict:
    data = full_record()
    *parents, key = path
    node = data
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[key]
    else:
        node[key] = value
    return data


@pytest.mark.parametrize(
    "where, value, word",
    [
        (["workload", "seed"], "5", "workload.seed"),
        (["workload", "seed"], 5.0, "workload.seed"),
        (["workload", "seed"], True, "workload.seed"),
        (["workload", "input_shape"], ["4", "32"], "workload.input_shape.0"),
        (["workload", "input_shape"], [4, 0], "workload.input_shape.1"),
        (["schema_version"], 2.0, "schema_version"),
        (["schema_version"], True, "schema_version"),
        (["schema_version"], "2", "schema_version"),
        (["schema_version"], KeyError, "schema_version"),
        (["resources", "peak_allocated_bytes"], -1, "peak_allocated_bytes"),
        (["resources", "transfer_bytes"], -4096, "transfer_bytes"),
        (["resources", "step_time_median_s"], -0.5, "step_time_median_s"),
        (["resources", "step_time_p95_s"], "0.1", "step_time_p95_s"),
        (["correctness", "grad_max_abs_error"], -1e-9, "grad_max_abs_error"),
        (["correctness", "skipped_updates"], -1, "skipped_updates"),
        (["correctness", "all_finite"], 1, "all_finite"),
        (["environment", "gpu_memory_bytes"], -1, "gpu_memory_bytes"),
        (["environment", "intra_op_threads"], 0, "intra_op_threads"),
        (["environment", "numeric_env"], {"OMP_NUM_THREADS": "1"}, "OMP_NUM_THREADS"),
        (["workload", "effective_batch", "supervised_tokens"], -3, "supervised_tokens"),
    ],
)
def test_reader_is_strict_about_types_and_signs(tmp_path, where, value, word):
    refused_on_read(record_file(tmp_path, spoiled(where, value)), "malformed", word)


def test_writer_refuses_what_the_reader_refuses_and_writes_nothing(tmp_path):
    with pytest.raises(TrainmechError, match="peak_allocated_bytes"):
        results.write_record(spoiled(["resources", "peak_allocated_bytes"], -1), tmp_path)
    with pytest.raises(TrainmechError, match="seed"):
        results.write_record(spoiled(["workload", "seed"], "5"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_writer_takes_tuples_and_numpy_scalars_as_the_json_they_become(tmp_path):
    import numpy as np

    data = full_record()
    data["workload"]["input_shape"] = (4, 32)
    data["metrics"] = {"loss": np.float32(5.25), "steps": np.int64(3), "pair": (1, 2)}
    back = results.read_record(results.write_record(data, tmp_path / "unit"), "unit")
    assert back.workload.input_shape == [4, 32]
    assert back.metrics == {"loss": 5.25, "steps": 3, "pair": [1, 2]} and type(back.metrics["steps"]) is int


def test_gpu_evidence_needs_a_gpu(tmp_path):
    data = full_record(evidence_level="gpu-measured")  # device cpu, gpu null
    text = refused_on_read(record_file(tmp_path, data), "gpu-measured", "'cpu'")
    with pytest.raises(TrainmechError, match="gpu-measured"):
        results.write_record(data, tmp_path / "w")
    assert not (tmp_path / "w").exists()
    data["environment"].update(
        device="cuda:0", gpu="NVIDIA H200", gpu_memory_bytes=150_000_000_000, cuda="12.8"
    )
    assert results.read_record(record_file(tmp_path, data)).conclusion.evidence_level == "gpu-measured"
    assert "gpu" in text


def test_file_name_must_be_the_identity(tmp_path):
    path = tmp_path / "unit" / "TRAIN-LOOP__cpu-loop.json"
    path.parent.mkdir()
    write_json(path, full_record())
    refused_on_read(path, "TRAIN-GRADIENT-ACCUMULATION__cpu-seq32.json", "identity")


def test_run_label_must_be_the_folder(tmp_path):
    path = record_file(tmp_path, folder="other")
    refused_on_read(path, "'unit'", "'other'", run_label="other")
    with pytest.raises(TrainmechError, match="belongs to run 'unit'"):
        results.read_records(path.parent)
    records, invalid = results.read_run(path.parent)
    assert records == [] and list(invalid) == [path.name]
    assert results.read_run(tmp_path / "other", "unit")[0][0].identity.run_label == "unit"
    partial = record_file(tmp_path, folder="unit.partial")  # a partial run's folder holds its label's records
    assert len(results.read_records(partial.parent)) == 1


def test_schema_1_records_are_read_with_null_provenance(tmp_path):
    data = full_record()
    data["schema_version"] = 1
    for key in ("cpu", "cpu_capability", "blas", "onednn", "intra_op_threads", "numeric_env"):
        del data["environment"][key]
    back = results.read_record(record_file(tmp_path, data))
    assert back.schema_version == 2
    assert back.environment.cpu is None and back.environment.intra_op_threads is None
    assert back.environment.numeric_env.model_dump() == {
        "ATEN_CPU_CAPABILITY": None,
        "MKL_CBWR": None,
        "ONEDNN_MAX_CPU_ISA": None,
    }
    data["schema_version"] = 1.0
    refused_on_read(record_file(tmp_path, data), "schema_version")


@pytest.mark.parametrize(
    "content, words",
    [
        (b'{"identity": "\xff\xfe"}', ["UTF-8", "offset 14"]),
        (b"[" * 100_000 + b"]" * 100_000, ["JSON", "nested too deeply"]),
        (b'{"a": ' + b"9" * 5000 + b"}", ["JSON"]),
        (b"\x00" * (results.MAX_RECORD_BYTES + 1), ["larger than 1,048,576 bytes"]),
        (b"", ["JSON"]),
    ],
    ids=["not-utf8", "deep", "huge-int", "too-large", "empty"],
)
def test_undecodable_records_are_one_line_naming_the_file(tmp_path, content, words):
    path = tmp_path / "TRAIN-LOOP__cpu-loop.json"
    path.write_bytes(content)
    refused_on_read(path, *words)


def test_records_that_are_not_regular_files_are_refused_without_reading_them(tmp_path):
    link = tmp_path / "TRAIN-LOOP__zero.json"
    link.symlink_to("/dev/zero")
    refused_on_read(link, "not a regular file")
    fifo = tmp_path / "TRAIN-LOOP__fifo.json"
    os.mkfifo(fifo)
    refused_on_read(fifo, "not a regular file")  # and the open did not block
    (tmp_path / "TRAIN-LOOP__dir.json").mkdir()
    refused_on_read(tmp_path / "TRAIN-LOOP__dir.json", "not a regular file")
    weird = tmp_path / "TRAIN-LOOP__a\nb.json"
    weird.write_text("{", encoding="utf-8")
    assert "\\n" in refused_on_read(weird, "JSON")


def test_registry_lists_invalid_records_instead_of_refusing(tmp_path):
    folder = tmp_path / "unit"
    results.write_record(full_record(), folder)
    (folder / "TRAIN-LOOP__bad.json").write_bytes(b"\xff")
    write_json(
        folder / "TRAIN-CHECKPOINT__x.json",
        full_record("TRAIN-CHECKPOINT", "x", evidence_level="gpu-measured"),
    )
    records, invalid = results.read_run(folder)
    assert [r.filename for r in records] == ["TRAIN-GRADIENT-ACCUMULATION__cpu-seq32.json"]
    assert sorted(invalid) == ["TRAIN-CHECKPOINT__x.json", "TRAIN-LOOP__bad.json"]
    md = results.registry_markdown(records, "unit", invalid)
    table = rows(md)
    assert table["TRAIN-CHECKPOINT"][3] == "no record"  # never shown as GPU evidence
    assert table["TRAIN-GRADIENT-ACCUMULATION"][3] == "cpu-mechanism (cpu-seq32); decision tune"
    tail = md.split("## 无效记录", 1)[1]
    assert "`TRAIN-LOOP__bad.json`: record TRAIN-LOOP__bad.json is not UTF-8 text" in tail
    assert "`TRAIN-CHECKPOINT__x.json`:" in tail and "gpu-measured" in tail


@pytest.mark.parametrize("label, ok", [("a" * 100, True), ("a" * 101, False), ("a" * 300, False)])
def test_labels_are_bounded_in_length(label, ok):
    if ok:
        assert results.check_label(label) == label
    else:
        with pytest.raises(TrainmechError) as e:
            results.check_label(label)
        assert "1 to 100" in str(e.value) and len(str(e.value)) < 200
