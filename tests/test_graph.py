"""Task1: the graph walk (levels, edges, consumers) and the backward-graph figure."""

import matplotlib.pyplot as plt
import pytest
import torch

from trainmech import graph, plots

pytestmark = pytest.mark.task1


def _residual():
    """x used twice (residual Add and the branch's Mv); W once; c needs no grad."""
    W = torch.tensor([[0.5, -0.3], [0.1, 0.4]], dtype=torch.float64, requires_grad=True)
    x = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    c = torch.tensor([2.0, 3.0], dtype=torch.float64)
    L = (c * (x + torch.tanh(W @ x))).sum()
    return W, x, L


def test_levels_are_longest_paths_and_every_edge_points_down():
    W, x, L = _residual()
    level = graph.levels(L)
    assert len(level) == len(list(graph.nodes(L)))
    assert level[L.grad_fn] == 0
    assert all(level[a] < level[b] for a, b in graph.edges(L))
    # x is reached by Add (level 2) and by Mv (level 4): the longest path decides, so its node is last.
    x_node = next(n for n in level if getattr(n, "variable", None) is x)
    assert level[x_node] == max(level.values()) == 5


def test_levels_of_a_leaf_is_empty():
    assert graph.levels(torch.ones(2, requires_grad=True)) == {}


def test_consumers_count_each_use():
    W, x, L = _residual()
    assert graph.consumers(L, x) == ["AddBackward0", "MvBackward0"]
    assert graph.consumers(L, W) == ["MvBackward0"]
    assert graph.consumers(L, torch.ones(1)) == []


def test_edges_match_next_functions():
    _, _, L = _residual()
    expected = sum(sum(n is not None for n, _ in node.next_functions) for node in graph.nodes(L))
    assert len(graph.edges(L)) == expected


def test_tied_weight_has_two_consumers():
    E = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([1, 3, 3])
    logits = torch.nn.functional.linear(torch.nn.functional.embedding(ids, E), E)  # lookup, then a head sharing E
    assert graph.consumers(logits.sum(), E) == ["EmbeddingBackward0", "TBackward0"]


@pytest.mark.parametrize("max_nodes", [None, 4])
def test_grad_fn_graph_returns_a_closed_figure(max_nodes):
    W, x, L = _residual()
    fig = plots.grad_fn_graph(L, max_nodes=max_nodes, names={"W": W, "x": x}, highlight=x)
    assert fig.number not in plt.get_fignums()  # closed: shown once, as the cell's value
    (ax,) = fig.axes
    n = len(graph.levels(L)) if max_nodes is None else max_nodes
    assert sum(len(c.get_offsets()) for c in ax.collections) == n
    assert f"{n} of {len(graph.levels(L))} nodes" in ax.get_title()
    labels = {t.get_text() for t in ax.texts}
    assert ("x" in labels) == (max_nodes is None)  # leaves are labelled by name when drawn


def test_grad_fn_graph_refuses_a_leaf():
    with pytest.raises(ValueError, match="no grad_fn"):
        plots.grad_fn_graph(torch.ones(2, requires_grad=True))


def test_saves_tensors_tells_which_nodes_a_first_backward_frees():
    s = torch.tensor([1.0, 2.0], requires_grad=True)
    add_sum = (s + 1.0).sum()
    assert not any(graph.saves_tensors(n) for n in graph.nodes(add_sum))
    add_sum.backward()
    add_sum.backward()  # nothing was freed
    tanh_sum = torch.tanh(s).sum()
    assert [type(n).__name__ for n in graph.nodes(tanh_sum) if graph.saves_tensors(n)] == ["TanhBackward0"]
    tanh_sum.backward()
    assert graph.saves_tensors(tanh_sum.grad_fn.next_functions[0][0])  # freed, but it held one
