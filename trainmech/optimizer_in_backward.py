"""Optimizer-in-backward: update each parameter the moment its gradient is complete, and free that gradient.

    opt = OptimizerInBackward(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    model(**batch).loss.backward()     # every parameter is updated inside the backward
    opt.step(); opt.zero_grad()        # no-ops: kept so a training loop (or a memory tracker) runs unchanged
    opt.remove()                       # the hooks go

PyTorch's recipe: one optimizer per parameter, stepped from a hook registered with
`Tensor.register_post_accumulate_grad_hook`. The whole-update peak of a plain loop sits in
`optimizer.step()` when every gradient, both moments and the step's temporaries are alive at once;
here no moment holds more than one parameter's gradient and temporaries. What it gives up: no
accumulation over micro-batches (each backward updates), no clipping by the global norm, and no
skipping a window whose gradients are not finite — an update already written cannot be taken back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class OptimizerInBackward:
    """One optimizer per parameter, each stepped by its parameter's post-accumulate-grad hook."""

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.optimizers = {p: make_optimizer([p]) for p in params}
        self.handles = [p.register_post_accumulate_grad_hook(self._step) for p in self.optimizers]
        self.updates = 0  # parameter updates written so far

    def _step(self, p: torch.nn.Parameter) -> None:
        self.optimizers[p].step()
        p.grad = None  # the gradient has served its only reader
        self.updates += 1

    # the surface of torch.optim.Optimizer a training loop, a scheduler or a memory tracker reads
    @property
    def state(self) -> dict:
        return {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        """Nothing left to do: each parameter was updated in the backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing left to free: each gradient was freed in the backward."""

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
