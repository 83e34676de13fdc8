"""AdamW as PyTorch runs it: three implementations of one update, and the update moved into the backward.

    opt = optimizers.adamw(model.parameters(), impl="foreach", lr=1e-4)   # "loop" | "foreach" | "fused"
    opt = optimizers.OptimizerInBackward(model.parameters(), impl="loop", lr=1e-4)

The three implementations compute the same update and differ in memory: the per-tensor loop (the
default on CPU) makes the sqrt temporary of one tensor at a time, foreach (the default on CUDA)
makes it for every parameter at once, fused makes none. `OptimizerInBackward` gives each parameter
its own AdamW and steps it from a post-accumulate-grad hook, the moment its gradient is complete,
then frees that gradient: the gradients of the model are never all alive at once, and no update
phase follows the backward (its `step()` and `zero_grad()` do nothing).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from trainmech.errors import TrainmechError

IMPLS = ("auto", "loop", "foreach", "fused")


def adamw(params, impl: str = "loop", **kwargs) -> torch.optim.AdamW:
    """torch.optim.AdamW with the implementation chosen explicitly (foreach=False / True, or fused=True), or
    "auto": PyTorch's own choice for the parameters' device (the loop on CPU, foreach on CUDA)."""
    if impl not in IMPLS:
        raise TrainmechError(f"unknown AdamW implementation {impl!r}; valid: {', '.join(IMPLS)}")
    choice = {"auto": {}, "loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    return torch.optim.AdamW(params, **choice, **kwargs)


class OptimizerInBackward:
    """One AdamW per parameter, stepped in the parameter's post-accumulate-grad hook, which then frees the gradient.

    Use it like an optimizer in a training loop (`step()` and `zero_grad()` are no-ops: the work is
    done inside `loss.backward()`); `remove()` takes the hooks off. `state` maps each parameter to its
    AdamW state, as torch.optim does.
    """

    def __init__(self, params, impl: str = "loop", **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = {p: adamw([p], impl, **kwargs) for p in self.params}
        self._tracker = None
        self._handles = [p.register_post_accumulate_grad_hook(self._update) for p in self.params]

    def _update(self, param: torch.Tensor) -> None:
        tracker = self._tracker
        if tracker is not None:  # trainmech.measure: the gradient is a gradient, the temporaries workspace
            tracker.tag([param.grad], "gradients")
        with tracker.tagging("workspace") if tracker is not None else nullcontext():
            self.optimizers[param].step()
        if tracker is not None:
            tracker.tag([t for t in self.optimizers[param].state[param].values() if isinstance(t, torch.Tensor)], "optimizer_states")
        param.grad = None  # the update has consumed it: free it now, not at zero_grad

    @property
    def state(self) -> dict:
        return {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}

    def step(self) -> None:
        """Nothing left to do: every parameter was updated during the backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to free: each gradient was freed right after its update."""

    def watch(self, tracker):
        """Let a trainmech.measure.StorageTracker label what the hooks create; returns a handle with remove()."""
        self._tracker = tracker

        class _Stop:
            def remove(_self):
                self._tracker = None

        return _Stop()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
