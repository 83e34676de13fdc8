"""The autograd graph as data: walk it from a tensor's grad_fn back to the leaves it reaches.

Autograd records, for every non-leaf tensor, the node that made it (`grad_fn`) and that node's
inputs (`next_functions`). A leaf that requires grad appears as an `AccumulateGrad` node whose
`.variable` is the leaf itself: the place where backward writes `.grad`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import torch

__all__ = [
    "nodes",
    "reachable_leaves",
    "depends_on",
    "node_counts",
    "levels",
    "edges",
    "consumers",
    "saves_tensors",
]


def nodes(root: torch.Tensor) -> Iterator[torch.autograd.graph.Node]:
    """Every node reachable from root.grad_fn, each once, breadth first."""
    if root.grad_fn is None:
        return
    seen, queue = {root.grad_fn}, [root.grad_fn]
    while queue:
        node = queue.pop(0)
        yield node
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)


def reachable_leaves(root: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors (requiring grad) that root depends on: backward will write their .grad."""
    return [n.variable for n in nodes(root) if hasattr(n, "variable")]


def depends_on(root: torch.Tensor, named: dict[str, torch.Tensor]) -> dict[str, bool]:
    """For each named tensor, whether root's graph reaches it (compared by identity)."""
    reached = {id(t) for t in reachable_leaves(root)}
    return {name: id(t) in reached for name, t in named.items()}


def node_counts(root: torch.Tensor) -> Counter[str]:
    """How many graph nodes of each kind (e.g. MmBackward0) root's graph holds."""
    return Counter(type(n).__name__ for n in nodes(root))


def levels(root: torch.Tensor) -> dict[torch.autograd.graph.Node, int]:
    """Each reachable node's level: the longest path, in edges, from root.grad_fn (level 0).

    Every edge goes from a lower level to a higher one, so level order is an order backward
    may run the nodes in: a node runs only after every node that consumed its output has
    passed its upstream gradient to it.
    """
    reached = list(nodes(root))
    waiting = Counter(nxt for node in reached for nxt, _ in node.next_functions if nxt is not None)
    level = {node: 0 for node in reached}
    ready = [root.grad_fn] if reached else []
    while ready:  # topological order: a node is ready once every edge into it was seen
        node = ready.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            level[nxt] = max(level[nxt], level[node] + 1)
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                ready.append(nxt)
    return level


def edges(root: torch.Tensor) -> list[tuple[torch.autograd.graph.Node, torch.autograd.graph.Node]]:
    """Every (node, next node) pair of root's graph: the upstream gradient flows along it."""
    return [(node, nxt) for node in nodes(root) for nxt, _ in node.next_functions if nxt is not None]


def consumers(root: torch.Tensor, leaf: torch.Tensor) -> list[str]:
    """Kinds of the nodes that send a gradient into leaf's AccumulateGrad: one per use of leaf.

    A leaf used twice (a tied weight) has two; autograd sums them before writing leaf.grad.
    """
    return sorted(type(node).__name__ for node, nxt in edges(root) if getattr(nxt, "variable", None) is leaf)


def saves_tensors(node: torch.autograd.graph.Node) -> bool:
    """Whether a node keeps a tensor for its backward (a `_saved_*` attribute holding one).

    Such a node is what a first backward frees: running backward through it again raises unless
    the first call passed retain_graph=True. A node that keeps only sizes or scalars (Add, Sum)
    can run again. Reading a saved tensor that was already freed raises; that node held one.
    """
    for name in dir(node):
        if not name.startswith("_saved_") or name.endswith("_raw"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # "... after they have already been freed"
            return True
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) for v in values):
            return True
    return False
