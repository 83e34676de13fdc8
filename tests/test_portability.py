"""The numeric-path report (trainmech.portability) on small inputs, and same-machine determinism."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import nbformat
import pytest

from trainmech import drift, portability

pytestmark = pytest.mark.package


def _notebook(*outputs_per_cell):
    nb = nbformat.v4.new_notebook()
    for i, outputs in enumerate(outputs_per_cell):
        cell = nbformat.v4.new_code_cell("pass")
        cell.id = f"c{i}"
        cell.outputs = outputs
        nb.cells.append(cell)
    return nb


def _stream(text, name="stdout"):
    return nbformat.v4.new_output("stream", name=name, text=text)


def test_outputs_are_read_as_nbval_compares_them():
    nb = _notebook(
        [
            _stream("a "),
            _stream("b\n"),
            _stream("warn\n", "stderr"),
            nbformat.v4.new_output("display_data", data={"image/png": "AAAA", "text/plain": "<Figure>"}),
        ]
    )
    assert portability.cell_outputs(nb, []) == {
        "c0": ["stderr: warn\n", "stdout: a b\n", "text/plain: <Figure>"]
    }


def test_output_diffs_report_the_first_differing_line_per_cell(tmp_path):
    committed, fresh = tmp_path / "committed.ipynb", tmp_path / "fresh.ipynb"
    nbformat.write(_notebook([_stream("loss 6.24\nsame\n")], [_stream("took 1.5 s\n")]), committed)
    nbformat.write(_notebook([_stream("loss 6.25\nsame\n")], [_stream("took 9.0 s\n")]), fresh)
    diffs = portability.output_diffs("p", fresh, committed, portability.sanitize_patterns())
    assert [(d.cell, d.committed, d.fresh) for d in diffs] == [
        ("c0", "stdout: loss 6.24", "stdout: loss 6.25")
    ]


def _entry(n, kind, value, limit, holds=True):
    return {"n": n, "kind": kind, "statement": f"check {n}", "holds": holds, "value": value, "limit": limit}


def test_margins_compare_distance_to_the_limit_with_its_spread():
    logs = {
        "a": [
            _entry(0, "at_most", 0.10, 1.0),
            _entry(1, "at_least", 5.0, 1.0),
            _entry(2, "claim", None, None),
        ],
        "b": [
            _entry(0, "at_most", 0.40, 1.0),
            _entry(1, "at_least", 5.0, 1.0),
            _entry(2, "claim", None, None),
        ],
    }
    found, problems = portability.margins(logs, "nb")
    assert problems == []
    tight, flat = found
    assert (
        tight.margins == {"a": 0.9, "b": 0.6}
        and math.isclose(tight.spread, 0.3)
        and math.isclose(tight.ratio, 2.0)
    )
    assert not tight.ok  # 0.6 < 3 × 0.3
    assert flat.margins == {"a": 4.0, "b": 4.0} and math.isinf(flat.ratio) and flat.ok


def test_margins_report_checks_that_differ_between_paths():
    logs = {
        "a": [_entry(0, "at_most", 0.1, 1.0), _entry(1, "claim", None, None)],
        "b": [_entry(0, "at_most", 2.0, 1.0, holds=False)],
    }
    _, problems = portability.margins(logs, "nb")
    assert any("different number of checks" in p for p in problems)
    assert any("fails on ['b']" in p for p in problems)


def test_environment_sets_the_path_and_restores_the_caller(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    with portability.environment(portability.PATHS["no-simd"]):
        assert (os.environ["ATEN_CPU_CAPABILITY"], os.environ["MKL_CBWR"]) == ("default", "COMPATIBLE")
        assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    with portability.environment(portability.PATHS["native"]):
        assert "MKL_CBWR" not in os.environ and "ATEN_CPU_CAPABILITY" not in os.environ
        assert "ONEDNN_MAX_CPU_ISA" not in os.environ
    assert os.environ["MKL_CBWR"] == "AUTO" and "ATEN_CPU_CAPABILITY" not in os.environ


def test_two_runs_on_one_machine_write_identical_records(tmp_path):
    """Same machine, same path: every record byte for byte the same, apart from times and labels."""
    notebooks = portability.discover(["Task0"])
    portability.execute("native", notebooks, tmp_path / "first")
    portability.execute("native", notebooks, tmp_path / "second")
    assert drift.compare_runs(tmp_path / "second", tmp_path / "first", strict=True) == []
    first = [
        json.loads(line)
        for line in (tmp_path / "first" / "checks" / "Task0_training_loop.jsonl").read_text().splitlines()
    ]
    second = [
        json.loads(line)
        for line in (tmp_path / "second" / "checks" / "Task0_training_loop.jsonl").read_text().splitlines()
    ]
    assert first == second and len(first) > 20


def test_only_forgets_just_those_notebooks_last_runs(tmp_path):
    """`--only TaskN` replaces TaskN's last run and keeps the others', so `--reuse` reports on every notebook."""
    import json

    from trainmech.portability import _forget

    (tmp_path / "notebooks").mkdir()
    (tmp_path / "checks").mkdir()
    for stem in ("Task0_training_loop", "Task4_state_ledger"):
        (tmp_path / "notebooks" / f"{stem}.ipynb").write_text("{}")
        (tmp_path / "checks" / f"{stem}.jsonl").write_text("")
        (tmp_path / f"R__{stem}.json").write_text(json.dumps({"identity": {"notebook": stem}}))
    _forget(tmp_path, ["Task4_state_ledger"])
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == [
        "R__Task0_training_loop.json",
        "checks/Task0_training_loop.jsonl",
        "notebooks/Task0_training_loop.ipynb",
    ]


def test_cap_onednn_caps_only_paths_below_avx512_that_chose_no_cap():
    from trainmech import cap_onednn

    for aten, preset, expect in [
        ("default", None, "AVX2"),
        ("AVX2", None, "AVX2"),
        ("avx512", None, None),
        (None, None, None),
        ("default", "AVX512_CORE_AMX", "AVX512_CORE_AMX"),  # a cap someone chose stays
    ]:
        env = {k: v for k, v in (("ATEN_CPU_CAPABILITY", aten), ("ONEDNN_MAX_CPU_ISA", preset)) if v}
        assert cap_onednn(env) == (expect is not None and preset is None)
        assert env.get("ONEDNN_MAX_CPU_ISA") == expect


def test_16bit_attention_runs_below_avx512_after_import():
    """On a CPU with AMX this failed with pack_vnni2 before the cap; elsewhere it must still run."""
    code = (
        "import torch, trainmech, os\n"
        "q = torch.randn(2, 4, 256, 64, dtype=torch.bfloat16, requires_grad=True)\n"
        "torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum().backward()\n"
        "print(os.environ['ONEDNN_MAX_CPU_ISA'], torch.backends.cpu.get_cpu_capability())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    env["ATEN_CPU_CAPABILITY"] = "default"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.split() == ["AVX2", "DEFAULT"]
