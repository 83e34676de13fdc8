"""The output policy (trainmech.checks) and the proof that nbval under it still sees real changes.

The policy prints noise-level errors as verdicts and physical floats with a few significant
digits, so that committed outputs compare equal on any machine. These tests pin the printing
rules, the check log the portability report reads, and — the important part — that nbval with
the project's sanitizer still fails when a committed number, byte count or verdict changes.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainmech import checks, portability
from trainmech.checks import ClaimFailed

pytestmark = pytest.mark.package

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("Task*.ipynb"))


@pytest.mark.parametrize(
    "value, digits, text",
    [
        (6.2401, 3, "6.24"),
        (0.5, 3, "0.500"),
        (24615.7, 3, "2.46e+04"),
        (0.000123456, 2, "0.00012"),
        (100.0, 3, "100"),
        (-0.2889, 2, "-0.29"),
        (0.0, 3, "0"),
        (float("nan"), 3, "nan"),
        (3.5427, 4, "3.543"),
    ],
)
def test_num_keeps_the_requested_significant_digits(value, digits, text):
    assert checks.num(value, digits) == text


def test_num_takes_a_one_element_tensor_without_an_autograd_warning(recwarn):
    t = torch.tensor(6.2401, requires_grad=True) * 1
    assert checks.num(t) == "6.24"
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]


def test_close_prints_the_verdict_not_the_noise(capsys):
    ref = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    diff = checks.close("x", ref + 1e-9, ref, rtol=1e-6)
    line = capsys.readouterr().out.strip()
    assert line == f"{'x':<28} rel ≤ 1e-06 ✓"
    assert math.isclose(diff, 1e-9, rel_tol=1e-6)  # the raw value comes back, for the record
    with pytest.raises(ClaimFailed, match="相对误差 2.50e-04 超过容限 1e-06"):
        checks.close("x", ref + 1e-3, ref, rtol=1e-6)


def test_close_fails_loudly_on_an_error_a_nan_and_a_shape_mismatch(capsys):
    ref = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    diff = checks.close("demo.ok", ref + 1e-14, ref, rtol=1e-10)
    assert diff == pytest.approx(1e-14, rel=1e-2)
    assert capsys.readouterr().out.split() == [
        "demo.ok",
        "rel",
        "≤",
        "1e-10",
        "✓",
    ]  # the noise itself: returned, not printed
    with pytest.raises(ClaimFailed, match="demo.bad：相对误差 1.00e-03 超过容限 1e-10"):
        checks.close("demo.bad", ref * 1.001, ref, rtol=1e-10)
    assert capsys.readouterr().out.split() == ["demo.bad", "rel", "=", "1.0e-03", ">", "1e-10", "✗"]
    with pytest.raises(ClaimFailed, match="demo.nan：相对误差 nan"):  # a NaN never passes
        checks.close("demo.nan", ref * float("nan"), ref, rtol=1e-10)
    with pytest.raises(ClaimFailed, match=r"形状不同：\(2,\) 对 \(3,\)"):
        checks.close("demo.shape", ref[:2], ref, rtol=1e-10)


@pytest.mark.parametrize(
    "fn, value, limit, holds",
    [
        (checks.claim_at_most, 1.0, 2.0, True),
        (checks.claim_at_most, 2.0, 2.0, True),
        (checks.claim_at_most, 2.5, 2.0, False),
        (checks.claim_at_least, 3.0, 2.0, True),
        (checks.claim_at_least, 1.0, 2.0, False),
        (checks.claim_at_most, float("nan"), 2.0, False),
        (checks.claim_at_least, float("nan"), 2.0, False),
    ],
)
def test_quantitative_claims_compare_value_and_limit(fn, value, limit, holds, capsys):
    if holds:
        fn(value, limit, "s")
        assert capsys.readouterr().out == "✓ s\n"
    else:
        with pytest.raises(ClaimFailed, match="结论不成立：s"):
            fn(value, limit, "s")


def test_every_check_goes_to_the_log_with_its_value_and_limit(tmp_path):
    log = tmp_path / "checks" / "nb.jsonl"
    checks.log_checks_to(log)
    try:
        checks.claim(True, "a fact")
        checks.claim_at_most(0.25, 1.0, "small")
        checks.claim_at_least(torch.tensor(3.0), 2, "large")
        checks.close("c", torch.ones(2), torch.ones(2), rtol=1e-6)
        checks.equal("e", torch.ones(2), torch.ones(2))
        with pytest.raises(ClaimFailed):
            checks.claim_at_most(float("inf"), 1.0, "fails")
    finally:
        checks.log_checks_to(None)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["n"], e["kind"], e["holds"]) for e in entries] == [
        (0, "claim", True),
        (1, "at_most", True),
        (2, "at_least", True),
        (3, "close", True),
        (4, "equal", True),
        (5, "at_most", False),
    ]
    assert (entries[1]["value"], entries[1]["limit"]) == (0.25, 1.0)
    assert (entries[3]["value"], entries[3]["limit"]) == (0.0, 1e-6)
    assert entries[5]["value"] == "inf"  # JSON has no Infinity: kept as text
    checks.claim(True, "after the log stopped")  # nothing is written, nothing fails
    assert len(log.read_text().splitlines()) == 6


def test_starting_a_log_starts_it_afresh(tmp_path):
    log = tmp_path / "nb.jsonl"
    log.write_text('{"stale": true}\n')
    checks.log_checks_to(log)
    assert not log.exists()  # a stale log never outlives a new run
    checks.log_checks_to(tmp_path / "new" / "nb.jsonl")
    checks.log_checks_to(None)
    assert not (tmp_path / "new").exists()  # no check, no folder


# ----------------------------------------------------------------------------- the sanitizer

NUMBER = re.compile(r"\d")


def _committed_output_texts():
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell_id, parts in portability.cell_outputs(nb, []).items():
            for part in parts:
                yield path.stem, cell_id, part


def test_the_sanitizer_masks_only_times_and_addresses():
    patterns = portability.sanitize_patterns()
    assert {r.pattern for r, _ in patterns} and {rep for _, rep in patterns} == {"<TIME>", "<ADDRESS>"}
    digits_before = digits_after = 0
    for _, _, text in _committed_output_texts():
        digits_before += len(NUMBER.findall(text))
        digits_after += len(NUMBER.findall(portability.sanitize(text, patterns)))
    # Almost every digit of the committed outputs is compared: the sanitizer is not blinding nbval.
    assert digits_before > 5000
    assert digits_after >= 0.97 * digits_before, (digits_before, digits_after)


@pytest.mark.parametrize(
    "text",
    [
        "loss = 6.24",
        "total (distinct)          125,504",
        "x rel ≤ 1e-06 ✓",
        "tracked bytes 1,247,240",
        "✓ 29 prompt positions",
        "(4, 32)",
        "scale 65536",
    ],
)
def test_numbers_that_matter_survive_the_sanitizer(text):
    assert portability.sanitize(text, portability.sanitize_patterns()) == text


@pytest.mark.parametrize(
    "text, masked", [("took 12.5 s", "took <TIME>"), ("3 ms", "<TIME>"), ("at 0x7f3a9c2b10", "at <ADDRESS>")]
)
def test_what_honestly_varies_is_masked(text, masked):
    assert portability.sanitize(text, portability.sanitize_patterns()) == masked


# ----------------------------------------------------------------------------- nbval does not go blind


def _perturb(nb: dict, cell_id: str, old: str, new: str) -> None:
    cell = next(c for c in nb["cells"] if c.get("id") == cell_id)
    for out in cell["outputs"]:
        if out["output_type"] == "stream":
            text = "".join(out["text"])
            if old in text:
                out["text"] = text.replace(old, new, 1)
                return
    raise AssertionError(f"{old!r} is not in the committed output of {cell_id}")


def test_nbval_fails_on_a_changed_loss_byte_count_or_verdict(tmp_path):
    """Break the committed Task0 outputs in three ways; nbval must flag exactly those three cells."""
    source = REPO / "notebooks" / "Task0_training_loop.ipynb"
    nb = json.loads(source.read_text(encoding="utf-8"))
    # a loss in its 2nd significant digit, a parameter count by one, a claim's verdict and its tolerance
    _perturb(nb, "adamw-loop", "loss per effective update: 6.24", "loss per effective update: 6.34")
    _perturb(nb, "build-model", "125,504", "125,505")
    _perturb(nb, "shifted-cross-entropy", "rel ≤ 1e-06 ✓", "rel ≤ 1e-07 ✓")
    target = tmp_path / source.name
    target.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")
    env = {**os.environ, "TRAINMECH_RESULTS_DIR": str(tmp_path / "records"), "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--nbval",
            "--nbval-current-env",
            "--nbval-sanitize-with",
            str(REPO / "tests" / "nbval_sanitize.cfg"),
            "-q",
            "-rf",
            str(target),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    failed = set(re.findall(r"FAILED \S+::Cell (\d+)", run.stdout))
    code_ids = [c.get("id") for c in nb["cells"] if c["cell_type"] == "code"]
    expected = {str(code_ids.index(cid)) for cid in ("build-model", "shifted-cross-entropy", "adamw-loop")}
    assert run.returncode == 1, run.stdout[-3000:]
    assert failed == expected, run.stdout[-3000:]
