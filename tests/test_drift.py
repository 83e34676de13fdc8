"""Records regression (trainmech.drift): fresh records against the committed CPU reference."""

from __future__ import annotations

import json
import shutil

import pytest

from trainmech import drift

pytestmark = pytest.mark.package

REFERENCE = drift.REFERENCE_DIR


def _copy_reference(tmp_path):
    fresh = tmp_path / "fresh"
    shutil.copytree(REFERENCE, fresh, ignore=shutil.ignore_patterns("notebooks", "checks"))
    return fresh


def _edit(folder, name, path, value):
    file = folder / name
    data = json.loads(file.read_text(encoding="utf-8"))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    file.write_text(json.dumps(data), encoding="utf-8")


def test_the_reference_matches_itself():
    assert drift.compare_runs(REFERENCE, REFERENCE) == []
    assert drift.compare_runs(REFERENCE, REFERENCE, strict=True) == []


@pytest.mark.parametrize(
    "field, value, fresh, reference",
    [
        ("metrics.domain_loss_after", 5.98, 5.98 * (1 + 5e-4), None),  # rel 1e-3: inside
        ("correctness.output_max_abs_error", 4.8e-7, 0.0, None),  # noise: shrinking is no regression
        ("correctness.output_max_abs_error", 0.0, 4.8e-7, None),  # noise: inside the floor
        ("resources.step_time_median_s", 0.01, 0.5, None),  # times are ignored
        ("metrics.high_lr_eval_loss_after", 6.1, 6.5, None),  # chaotic: ignored, with a reason
    ],
)
def test_within_tolerance(field, value, fresh, reference):
    assert drift.compare_values(field, fresh, value) == []


@pytest.mark.parametrize(
    "field, fresh, reference, tolerance",
    [
        ("metrics.domain_loss_after", 5.99, 5.98, "rel ≤ 0.001"),  # a loss in its 3rd digit
        ("resources.peak_allocated_bytes", 1_000_001, 1_000_000, "exact"),  # a byte count by one
        ("correctness.effective_updates", 13, 14, "exact"),
        ("correctness.all_finite", False, True, "exact"),
        ("correctness.grad_max_abs_error", 1e-3, 1e-7, "≤ 10×reference + 1e-05"),
        ("conclusion.decision", "reject", "accept", "exact"),
        ("metrics.some_new_ratio", 1.001, 1.0, "rel ≤ 0.0001"),  # floats default to rel 1e-4
        ("workload.input_shape", [4, 33], [4, 32], "exact"),
    ],
)
def test_beyond_tolerance_names_field_values_and_tolerance(field, fresh, reference, tolerance):
    (d,) = drift.compare_values(field, fresh, reference, "R.json")
    assert (d.record, d.tolerance) == ("R.json", tolerance)
    assert field.split(".")[0] in d.field
    text = str(d)
    assert "R.json" in text and tolerance in text


def test_an_int_turned_float_is_a_drift():
    assert drift.compare_values("correctness.skipped_updates", 0.0, 0) != []


def test_perturbed_reference_records_are_caught(tmp_path):
    fresh = _copy_reference(tmp_path)
    _edit(fresh, "TRAIN-LOOP__cpu-loop.json", ["metrics", "loss_after"], 9.99)
    _edit(fresh, "TRAIN-LOOP__cpu-loop.json", ["identity", "run_label"], "elsewhere")  # ignored
    (fresh / "TRAIN-SCHEDULER-CLOCK__cpu-default.json").unlink()
    drifts = drift.compare_runs(fresh)
    assert {(d.record, d.field) for d in drifts} == {
        ("TRAIN-LOOP__cpu-loop.json", "metrics.loss_after"),
        ("TRAIN-SCHEDULER-CLOCK__cpu-default.json", "(record)"),
    }
    # a partial run (not every notebook ran) is not blamed for the records it never wrote
    assert {d.field for d in drift.compare_runs(fresh, require_all=False)} == {"metrics.loss_after"}


def test_strict_comparison_is_exact_but_for_times_and_labels(tmp_path):
    fresh = _copy_reference(tmp_path)
    _edit(fresh, "TRAIN-LOOP__cpu-loop.json", ["resources", "step_time_median_s"], 123.0)
    _edit(fresh, "TRAIN-LOOP__cpu-loop.json", ["identity", "run_label"], "second-run")
    assert drift.compare_runs(fresh, strict=True) == []
    record = json.loads((fresh / "TRAIN-LOOP__cpu-loop.json").read_text())
    _edit(
        fresh,
        "TRAIN-LOOP__cpu-loop.json",
        ["metrics", "loss_after"],
        record["metrics"]["loss_after"] * (1 + 1e-12),
    )
    assert drift.compare_runs(fresh) == []  # within the cross-machine tolerance
    assert [d.field for d in drift.compare_runs(fresh, strict=True)] == [
        "metrics.loss_after"
    ]  # not bit-identical


def test_every_rule_has_a_known_kind_and_every_ignore_a_reason():
    rules, default = drift.rules()
    assert default.kind == "rel" and default.rel > 0
    assert {r.kind for r in rules} <= {"exact", "rel", "noise", "ignore"}
    assert all(r.why for r in rules if r.kind != "exact")
