"""AdamW as PyTorch runs it: three implementations of one update, and the update moved into the backward.

    opt = optimizers.adamw(model.parameters(), impl="foreach", lr=1e-4)   # "loop" | "foreach" | "fused"
    opt = optimizers.OptimizerInBackward(model.parameters(), lambda ps: optimizers.adamw(ps, "loop", lr=1e-4))
    model(**batch).loss.backward()     # every parameter is updated inside the backward
    opt.step(); opt.zero_grad()        # no work: kept so a training loop (a scheduler, a memory tracker) runs unchanged
    opt.remove()                       # the hooks go

The three implementations compute the same update and differ in memory: the per-tensor loop (the
default on CPU) makes the sqrt temporary of one tensor at a time, foreach (the default on CUDA)
makes it for every parameter at once, fused makes none.

Optimizer-in-backward is PyTorch's documented recipe: one optimizer per parameter, stepped from a
hook registered with `Tensor.register_post_accumulate_grad_hook`, which then frees the gradient.
The whole-update peak of a plain loop sits in `optimizer.step()` when every gradient, both moments
and the step's temporaries are alive at once; here a gradient lives only from the node that produces
it to its parameter's update right after, with one parameter's step temporaries at a time. Not one
gradient at a time, though: a node hands out several at once (a Linear's weight and bias), and a tied
weight (the embedding shared with the head) is updated only after its last use in the backward, the
embedding, so the head's part of its gradient waits in the engine the whole backward long. What it gives up: no accumulation over micro-batches (each backward
updates), no clipping by the global norm, and no skipping a window whose gradients are not finite —
an update already written cannot be taken back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch

from trainmech.errors import TrainmechError

__all__ = ["IMPLS", "adamw", "OptimizerInBackward"]

IMPLS = ("auto", "loop", "foreach", "fused")


def adamw(params, impl: str = "loop", **kwargs) -> torch.optim.AdamW:
    """torch.optim.AdamW with the implementation chosen explicitly (foreach=False / True, or fused=True), or
    "auto": PyTorch's own choice for the parameters' device (the loop on CPU, foreach on CUDA)."""
    if impl not in IMPLS:
        raise TrainmechError(f"unknown AdamW implementation {impl!r}; valid: {', '.join(IMPLS)}")
    choice = {"auto": {}, "loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[
        impl
    ]
    return torch.optim.AdamW(params, **choice, **kwargs)


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per parameter (`make_optimizer([p])`), each stepped by its parameter's post-accumulate-grad
    hook, which then frees the gradient.

    Use it like an optimizer in a training loop (`step()` and `zero_grad()` do no work: it is done inside
    `loss.backward()`); `remove()` takes the hooks off. It is a `torch.optim.Optimizer` whose param groups and
    per-parameter state are the parts' own dicts, shared: a learning-rate scheduler that sets a group's lr sets
    the lr the next in-backward step reads, `state[p]` holds that part's moments and step count, and `step()`
    runs the step hooks (`register_step_pre_hook`) once per update, as a plain optimizer's would. `updates`
    counts the parameter updates written so far.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        self.optimizers = {p: make_optimizer([p]) for p in params if p.requires_grad}
        if any(len(opt.param_groups) != 1 for opt in self.optimizers.values()):
            raise TrainmechError("make_optimizer must give an optimizer with one param group per parameter")
        super().__init__([opt.param_groups[0] for opt in self.optimizers.values()], {})
        for p, opt in self.optimizers.items():
            self.state[p] = opt.state[p]  # the part's own dict (its defaultdict makes it once)
        self.handles = [p.register_post_accumulate_grad_hook(self._step) for p in self.optimizers]
        self.updates = 0
        self._tracker = None

    def _step(self, p: torch.nn.Parameter) -> None:
        tracker = self._tracker
        if (
            tracker is not None
        ):  # trainmech.measure: the gradient is a gradient, the step's temporaries workspace
            tracker.tag([p.grad], "gradients")
        with tracker.tagging("workspace") if tracker is not None else nullcontext():
            self.optimizers[p].step()
        if tracker is not None:
            tracker.tag(
                [t for t in self.optimizers[p].state[p].values() if isinstance(t, torch.Tensor)],
                "optimizer_states",
            )
        p.grad = None  # the gradient has served its only reader: free it now, not at zero_grad
        self.updates += 1

    def step(self, closure=None) -> None:
        """Nothing left to do: each parameter was updated in the backward (the step hooks still run)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing left to free: each gradient was freed in the backward."""

    def watch(self, tracker):
        """Let a trainmech.measure.StorageTracker label what the hooks create; returns a handle with remove()."""
        self._tracker = tracker

        class _Stop:
            def remove(_self):
                self._tracker = None

        return _Stop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
