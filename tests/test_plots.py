"""The figures (trainmech.plots): what each draws, and that it comes back closed (shown once, as the
cell's value). Task1's backward-graph figure also carries the task1 marker. Task5's strategy timelines are tested beside its measurements in test_task5_strategies.py."""

import matplotlib.pyplot as plt
import pytest
import torch

from trainmech import graph, plots

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
