"""The figures (trainmech.plots): what each draws, and that it comes back closed (shown once, as the
cell's value). Each test also carries the marker of the Task whose notebook draws the figure."""

import matplotlib.pyplot as plt
import pytest
import torch

from trainmech import gates, graph, plots

pytestmark = pytest.mark.package


@pytest.mark.task1
@pytest.mark.parametrize("max_nodes", [None, 4])
def test_grad_fn_graph_returns_a_closed_figure(max_nodes, residual_graph):
    W, x, L = residual_graph
    fig = plots.grad_fn_graph(L, max_nodes=max_nodes, names={"W": W, "x": x}, highlight=x)
    assert fig.number not in plt.get_fignums()  # closed: shown once, as the cell's value
    (ax,) = fig.axes
    n = len(graph.levels(L)) if max_nodes is None else max_nodes
    assert sum(len(c.get_offsets()) for c in ax.collections) == n
    assert f"{n} of {len(graph.levels(L))} nodes" in ax.get_title()
    labels = {t.get_text() for t in ax.texts}
    assert ("x" in labels) == (max_nodes is None)  # leaves are labelled by name when drawn


@pytest.mark.task1
def test_grad_fn_graph_refuses_a_leaf():
    with pytest.raises(ValueError, match="no grad_fn"):
        plots.grad_fn_graph(torch.ones(2, requires_grad=True))


@pytest.mark.task5
def test_strategy_timelines_draw_one_panel_per_strategy_and_the_ledger_line_only_where_predicted():
    phases = ["forward.embed", "loss", "backward.head", "optimizer", "zero_grad"]
    runs = {"baseline": ([0, 5, 9, 4, 0], phases, 10), "offload": ([0, 2, 3, 1, 0], phases, 10)}
    fig = plots.strategy_timelines(runs, {"baseline": 19 * 2**20, "offload": None})
    assert fig.number not in plt.get_fignums()
    assert [ax.get_title() for ax in fig.axes] == ["baseline", "offload"]
    # baseline: curve, peak star, ledger line; offload (no prediction): curve and star only
    assert [len(ax.get_lines()) for ax in fig.axes] == [3, 2]


@pytest.mark.task2
@pytest.mark.task6
def test_grad_errors_name_each_tolerance_and_the_reference():
    fig = plots.grad_errors(
        ["a", "b"],
        {"fp16": [1e-3, 2e-3], "bug": [1.0, 2.0]},
        {"fp16": 2e-2, "bug": 1e-4},
        against="the reference run",
    )
    assert fig.number not in plt.get_fignums()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"fp16: tolerance 2e-02", "bug: tolerance 1e-04"} <= set(labels)
    assert "vs the reference run" in fig.axes[0].get_title()


@pytest.mark.task6
def test_gate_matrix_marks_what_was_not_run_and_what_was_not_measured():
    rows = {
        "twin": [True] * 4 + ["not measured"],
        "bug": [True, False, None, None, None],
        "real": [True] * 4 + ["measured"],
    }
    fig = plots.gate_matrix(rows, list(gates.GATES))
    assert fig.number not in plt.get_fignums()
    marks = [t.get_text() for t in fig.axes[0].texts]
    assert marks.count("○") == 1 and marks.count("·") == 3 and marks.count("—") == 1
    assert marks.count("✓") == 9 and marks.count("✗") == 1
    ruled = plots.gate_matrix(rows, list(gates.GATES), breaks=(1,))  # a rule under the planted bugs
    assert [line.get_ydata()[0] for line in ruled.axes[0].lines] == [1]


@pytest.mark.task4
def test_memory_timeline_draws_the_ledgers_own_phase_maxima():
    from matplotlib.collections import LineCollection

    from trainmech import ledger

    (first,) = ledger.measure_point("qwen2-tiny", 1, 16, steps=("first",))
    fig = plots.memory_timeline(first.measured, first.predicted)
    assert not plt.fignum_exists(fig.number)
    top, bottom = fig.axes[:2]
    drawn = [
        segments for c in top.collections if isinstance(c, LineCollection) for segments in c.get_segments()
    ]
    maxima = first.predicted.by_phase()
    phases = list(dict.fromkeys(first.measured.phases))
    assert len(drawn) == len(
        [p for p in phases if p in maxima]
    )  # one green line per measured phase the ledger has
    heights = sorted(round(segment[0][1] * 2**20) for segment in drawn)
    assert heights == sorted(maxima[p] for p in phases if p in maxima)
    assert len(bottom.patches) >= len(
        first.predicted.ticks
    )  # one bar per tick and category, the peak outlined


def test_crowded_phase_names_are_spread_and_the_others_stay_on_their_phase():
    from trainmech.plots.ledger import _spread

    centres = [0.0, 10.0, 10.5, 11.0, 30.0]
    placed = _spread(centres, 2.0)
    assert placed[0] == 0.0 and placed[-1] == 30.0  # far from the others: on their own centres
    assert all(b - a >= 2.0 - 1e-9 for a, b in zip(placed, placed[1:]))
    assert sum(placed[1:4]) / 3 == pytest.approx(
        sum(centres[1:4]) / 3
    )  # the crowded run stays centred on its phases


@pytest.mark.task4
def test_lifecycle_chart_labels_a_state_under_one_kib_in_bytes():
    rows = [
        ("loss.value", "saved", 4, "loss", "backward.loss", "backward.embed"),
        ("layer.0.*", "saved", 3 << 10, "forward.layer.0", "backward.layer.0", "backward.layer.0"),
    ]
    phases = ["forward.layer.0", "loss", "backward.loss", "backward.layer.0", "backward.embed"]
    fig = plots.lifecycle_chart(rows, phases)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "4 B" in labels and "3 KiB" in labels and "0 KiB" not in labels
