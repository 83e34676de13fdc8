"""What the learner sees in JupyterLab: the package's errors as a short Chinese message with the
notebook line behind it; progress bars in JupyterLab and nothing in recorded outputs."""

from __future__ import annotations

import pytest

from trainmech import display
from trainmech.checks import ClaimFailed, claim
from trainmech.errors import TrainmechError

pytestmark = pytest.mark.package


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("nothing was raised")


def test_a_failed_claim_renders_as_its_message_and_the_line_that_claimed():
    e = _raised(lambda: claim(1 + 1 == 3, "1 + 1 等于 3"))
    assert isinstance(e, ClaimFailed) and str(e) == "结论不成立：1 + 1 等于 3"
    header, where = e._render_traceback_()
    assert header.endswith("ClaimFailed\x1b[0m: 结论不成立：1 + 1 等于 3")
    # the innermost frame outside trainmech: this file's lambda, not checks.py
    assert where.startswith("  ↳ test_display.py，第 ") and 'claim(1 + 1 == 3, "1 + 1 等于 3")' in where


def test_trainmech_errors_render_short_too():
    from trainmech import session

    e = _raised(lambda: session.start("gpu", "local", "x"))
    assert isinstance(e, TrainmechError)
    lines = e._render_traceback_()
    assert len(lines) == 2 and "session.start(" in lines[1]


def test_maintainers_can_ask_for_the_full_traceback(monkeypatch):
    e = _raised(lambda: claim(False, "x"))
    assert hasattr(e, "_render_traceback_")
    monkeypatch.setenv(display.TRACEBACK_ENV, "full")
    assert not hasattr(e, "_render_traceback_")  # IPython then prints its own full traceback


@pytest.mark.parametrize(
    "env,mode",
    [
        ({}, "off"),
        ({"JPY_SESSION_NAME": "notebooks/Task0.ipynb"}, "off"),
        ({"TRAINMECH_PROGRESS": "bar"}, "bar"),
        ({"TRAINMECH_PROGRESS": "OFF"}, "off"),
    ],
)
def test_progress_outside_a_kernel(monkeypatch, env, mode):
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delenv("TRAINMECH_PROGRESS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert display.progress_mode() == mode  # pytest captures stderr: not a terminal
    items = list(display.progress(range(3))) if mode == "off" else None
    assert items in (None, [0, 1, 2])


def test_progress_in_a_kernel_bar_for_jupyterlab_nothing_for_the_runner():
    """The same cell in a kernel that JupyterLab started (it sets JPY_SESSION_NAME) and in one that
    nbclient started, as the runner and nbval do: a widget bar in the first, no output at all in
    the second — so a notebook that adopts `progress` keeps its committed outputs."""
    import os

    from kernel_cells import run_cells

    cell = "from trainmech.display import progress, progress_mode\nprint(progress_mode())\nfor _ in progress(range(3), desc='updates'):\n    pass"
    env = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", "TRAINMECH_PROGRESS")}
    [headless] = run_cells(cell, env=env)
    assert [(o.output_type, o.get("text")) for o in headless.outputs] == [("stream", "off\n")]
    [lab] = run_cells(cell, env=env | {"JPY_SESSION_NAME": "notebooks/Task0_training_loop.ipynb"})
    assert lab.outputs[0].text == "bar\n"
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in lab.outputs[1:]), (
        lab.outputs
    )


def test_format_table_aligns_columns():
    text = display.format_table(["op", "bytes"], [["linear", 8192], ["softmax", 128]])
    assert text.splitlines() == ["op       bytes", "-------  -----", "linear   8,192", "softmax    128"]
    # a column is as wide as its widest cell or header; only all-number columns are right-aligned
    # (booleans are not numbers here), headers always left
    text = display.format_table(
        ["layer", "n", "mixed", "ok"], [["a", 1234567, 1, True], ["bb", 5, "x", False]]
    )
    assert text.splitlines() == [
        "layer  n          mixed  ok",
        "-----  ---------  -----  -----",
        "a      1,234,567  1      True",
        "bb             5  x      False",
    ]
    # numbers already printed as strings (checks.num, f"{x:.2e}") align like numbers; words do not
    text = display.format_table(["x", "name"], [["0.125", "a"], ["-1.5e-05", "nan or not"], ["12", "b"]])
    assert text.splitlines() == [
        "x         name",
        "--------  ----------",
        "   0.125  a",
        "-1.5e-05  nan or not",
        "      12  b",
    ]
    # a column of numbers with placeholders where a number is unknown ("—", "null", None, "") is still numbers
    # (right-aligned); a column of placeholders alone, or placeholders among words, is not
    text = display.format_table(
        ["recipe", "predicted", "measured", "gpu", "note"],
        [["fp32", 16, "—", "null", "—"], ["bf16", None, 8, "null", "words"], ["fp16", "", "null", None, "x"]],
    )
    assert text.splitlines() == [
        "recipe  predicted  measured  gpu   note",
        "------  ---------  --------  ----  -----",
        "fp32           16         —  null  —",
        "bf16         None         8  null  words",
        "fp16                   null  None  x",
    ]
