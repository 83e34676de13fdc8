"""Task1: the graph walk (trainmech.graph: levels, edges, consumers, saved tensors); its figure is in test_plots.py."""

import pytest
import torch

from trainmech import graph

pytestmark = pytest.mark.task1


def test_levels_are_longest_paths_and_every_edge_points_down(residual_graph):
    W, x, L = residual_graph
    level = graph.levels(L)
    assert len(level) == len(list(graph.nodes(L)))
    assert level[L.grad_fn] == 0
    assert all(level[a] < level[b] for a, b in graph.edges(L))
    # x is reached by Add (level 2) and by Mv (level 4): the longest path decides, so its node is last.
    x_node = next(n for n in level if getattr(n, "variable", None) is x)
    assert level[x_node] == max(level.values()) == 5


def test_levels_of_a_leaf_is_empty():
    assert graph.levels(torch.ones(2, requires_grad=True)) == {}


def test_consumers_count_each_use(residual_graph):
    W, x, L = residual_graph
    assert graph.consumers(L, x) == ["AddBackward0", "MvBackward0"]
    assert graph.consumers(L, W) == ["MvBackward0"]
    assert graph.consumers(L, torch.ones(1)) == []


def test_edges_match_next_functions(residual_graph):
    _, _, L = residual_graph
    expected = sum(sum(n is not None for n, _ in node.next_functions) for node in graph.nodes(L))
    assert len(graph.edges(L)) == expected


def test_tied_weight_has_two_consumers():
    E = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([1, 3, 3])
    logits = torch.nn.functional.linear(
        torch.nn.functional.embedding(ids, E), E
    )  # lookup, then a head sharing E
    assert graph.consumers(logits.sum(), E) == ["EmbeddingBackward0", "TBackward0"]


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
