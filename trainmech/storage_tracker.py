"""StorageTracker: live tensor bytes by phase and category on any device, from the ops that create
each storage to the moment it is released.

`measure` re-exports every public name here (the notebooks write `measure.StorageTracker`).

Hidden state: while a tracker records, Python's cyclic garbage collector is off (every release then
happens at the same event in every run) and the tracker is on `_ACTIVE` (what `born_as` labels).
"""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainmech.errors import TrainmechError
from trainmech.ledger.categories import CATEGORIES

__all__ = [
    "MEMORY_CATEGORIES",
    "FORWARD_PHASES",
    "REBUILDS",
    "born_as",
    "Allocation",
    "StorageTracker",
    "phase_hooks",
]


# ----------------------------------------------------------------------------- memory: live bytes by phase
#
# A CPU has no max_memory_allocated. StorageTracker watches every ATen op (a TorchDispatchMode)
# and counts each new tensor storage from the op that creates it to the moment it is released (a
# weakref finalizer on the storage), labelled with the phase of the step it was born and released
# in. Views and in-place results reuse an input's storage and cost nothing. Kernel-internal
# scratch that never becomes a tensor is invisible here; the allocator sees it
# (`allocator_peak_cpu`, from torch.profiler's memory events).

MEMORY_CATEGORIES = CATEGORIES  # the ledger's seven categories (trainmech.ledger.categories)
FORWARD_PHASES = ("forward", "loss")  # phase-name prefixes of the forward pass and the loss
REBUILDS = (
    "recompute",
    "fetch",
)  # backward moments that re-create saved tensors: a checkpoint's replay, an offload's copy back
_ACTIVE: list[StorageTracker] = []  # the trackers recording now


@contextmanager
def born_as(rebuild: str):
    """Storages born inside are re-created saved tensors (`rebuild`: "recompute" or "fetch").

    A checkpoint's replay and an offload's copy back run in the backward, yet what they create is
    what the forward would have kept: every active StorageTracker labels those births
    `<phase>:<rebuild>`, and `StepMemory.category` files them under saved (activations if they die
    before the rebuild ends), the ledger's word for them. Without an active tracker it does nothing.
    """
    if rebuild not in REBUILDS:
        raise TrainmechError(f"unknown rebuild {rebuild!r}; valid: {', '.join(REBUILDS)}")
    trackers = list(_ACTIVE)
    for t in trackers:
        t.rebuilds.append(rebuild)
    try:
        yield
    finally:
        for t in trackers:
            t.rebuilds.pop()


@dataclass
class Allocation:
    """One tensor storage created while a StorageTracker was active."""

    nbytes: int
    op: str  # the ATen op that created it
    born: int  # index of its birth event
    born_phase: str  # `<phase>:<rebuild>` when born inside `born_as` (a recompute or an offload's fetch)
    died: int | None = None  # index of its release event; None: still alive when tracking stopped
    died_phase: str | None = None
    tag: str | None = (
        None  # "gradients" / "optimizer_states" / "workspace", set by StorageTracker.tag / .tagging
    )
    recomputed: bool = (
        False  # born while autograd recorded inside a backward node: a checkpoint rebuilding its forward
    )
    address: int = 0  # the storage's data_ptr (matches the CUDA allocator's history)
    device: str = ""  # the storage's device type ("cpu", "cuda")


class StorageTracker(TorchDispatchMode):
    """Live tensor bytes after every birth and release of a storage, with the phase of each event.

    Set `tracker.phase` as the work moves on (hooks do it for a model, see `phase_hooks`). device: count
    only the storages on this device type ("cuda": device memory); the others (AdamW's step counters on
    the host unless fused or capturable, foreach and the per-tensor loop alike; an SDPA kernel's
    host-side seed) go to `elsewhere`, with no event of their own.
    None: every storage counts.
    """

    def __init__(self, phase: str = "start", *, resize_tag: str | None = None, device: str | None = None):
        super().__init__()
        self.phase = phase
        self.device = device
        self.elsewhere: list[Allocation] = []  # storages on another device: born / died = len(live) then
        self._elsewhere_alive: dict[int, int] = {}  # id(storage) -> index into elsewhere
        # a storage resized from 0 bytes is born again (FSDP2 frees and re-gathers its unsharded parameters
        # with UntypedStorage.resize_, which no op dispatches): watched while the tracker is active, and
        # labelled resize_tag when given
        self.resize_tag = resize_tag
        self._resize = None
        self.allocations: list[Allocation] = []
        self.live: list[int] = []  # tracked bytes after each event
        self.phases: list[str] = []  # the phase of each event
        self._bytes = 0
        self._alive: dict[int, int] = {}  # id(storage) -> index into allocations
        self._births: dict[
            int, list[int]
        ] = {}  # id(storage) -> every allocation born on it (resized storages: several)
        self._finalizers: dict[int, weakref.finalize] = {}
        self._tag_births: str | None = None  # set by `tagging`
        self.rebuilds: list[str] = []  # set by born_as: what the backward is re-creating right now

    def _label(self) -> str:
        """The phase an allocation is born or released in, with the rebuild under way if any."""
        return f"{self.phase}:{self.rebuilds[-1]}" if self.rebuilds else self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.__name__ == "DTensor" for t in types):  # by name: importing DTensor costs seconds
            return NotImplemented  # let a DTensor (FSDP2) turn the op into ops on its local shards, which come back here
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_on_entry:
            return out  # DTensor's shape propagation on fake tensors: no memory
        fresh = func is torch.ops.aten.lift_fresh.default  # torch.tensor(...): a new storage passed through
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = set() if fresh else {id(t.untyped_storage()) for t in tensors}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                known = id(s) in self._alive or id(s) in self._elsewhere_alive
                if id(s) not in inputs and not known and s.nbytes() > 0:
                    self._born(s, func.__name__)
        if func.namespace in ("c10d", "_c10d_functional"):  # a collective's buffers: communication workspace
            for t in tensors:
                index = self._alive.get(id(t.untyped_storage()))
                if index is not None and self.allocations[index].tag is None:
                    self.allocations[index].tag = "workspace"
        return out

    def _resized(self, storage, size: int) -> None:
        index = self._alive.get(id(storage))
        self._resize(storage, size)
        if index is not None:  # the old bytes go: a release
            self._finalizers.pop(index).detach()
            self._released(id(storage), index)
        if size > 0:
            self._born(storage, "resize_")
            if self.resize_tag:
                self.allocations[-1].tag = self.resize_tag

    def _event(self, delta: int) -> int:
        self._bytes += delta
        self.live.append(self._bytes)
        self.phases.append(self.phase)
        return len(self.live) - 1

    def _born(self, storage, op: str) -> None:
        if self.device is not None and storage.device.type != self.device:
            self._born_elsewhere(storage, op)
            return
        index = len(self.allocations)
        self.allocations.append(
            Allocation(
                storage.nbytes(),
                op,
                self._event(storage.nbytes()),
                self._label(),
                tag=self._tag_births,
                recomputed=torch.is_grad_enabled() and torch._C._current_autograd_node() is not None,
                address=storage.data_ptr(),
                device=storage.device.type,
            )
        )
        self._alive[id(storage)] = index
        self._births.setdefault(id(storage), []).append(index)
        self._finalizers[index] = weakref.finalize(storage, self._released, id(storage), index)

    def _born_elsewhere(self, storage, op: str) -> None:
        index = len(self.elsewhere)
        self.elsewhere.append(
            Allocation(
                storage.nbytes(),
                op,
                len(self.live),
                self._label(),
                tag=self._tag_births,
                address=storage.data_ptr(),
                device=storage.device.type,
            )
        )
        self._elsewhere_alive[id(storage)] = index
        self._finalizers[-1 - index] = weakref.finalize(storage, self._released_elsewhere, id(storage), index)

    def _released_elsewhere(self, key: int, index: int) -> None:
        a = self.elsewhere[index]
        self._elsewhere_alive.pop(key, None)
        self._finalizers.pop(-1 - index, None)
        a.died, a.died_phase = len(self.live), self._label()

    def _released(self, key: int, index: int) -> None:
        a = self.allocations[index]
        self._alive.pop(key, None)
        self._finalizers.pop(index, None)
        a.died, a.died_phase = self._event(-a.nbytes), self._label()

    def tag(self, tensors, label: str) -> None:
        """Label the tracked storages of these tensors (e.g. every p.grad as "gradients")."""
        for t in tensors:
            index = self._alive.get(id(t.untyped_storage()))
            if index is not None:
                self.allocations[index].tag = label
            index = self._elsewhere_alive.get(id(t.untyped_storage()))
            if index is not None:
                self.elsewhere[index].tag = label

    def tag_every_birth(self, tensors, label: str) -> None:
        """Label every allocation ever born on these tensors' storages, alive or released since (FSDP2's
        unsharded parameters: one storage, freed and re-allocated with resize_ each step)."""
        for t in tensors:
            s = t.untyped_storage()
            for index in self._births.get(id(s), []):
                if self.allocations[index].nbytes == t.numel() * t.element_size():
                    self.allocations[index].tag = label

    @contextmanager
    def tagging(self, label: str):
        """Label every storage born inside the block (an update running inside the backward: "workspace")."""
        before, self._tag_births = self._tag_births, label
        try:
            yield
        finally:
            self._tag_births = before

    def __enter__(self):
        self._gc_was_enabled = gc.isenabled()
        gc.disable()  # no cycle collection mid-step: every release happens at the same event each run
        _ACTIVE.append(self)
        self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            tracker._resized(storage, size)

        torch.UntypedStorage.resize_ = resize_
        self._fake_on_entry = active_fake_mode()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        result = super().__exit__(*exc)
        _ACTIVE.remove(self)
        for f in list(self._finalizers.values()):  # what outlives the region stays alive, untracked
            f.detach()
        self._finalizers.clear()
        if self._gc_was_enabled:
            gc.enable()
        return result


def phase_hooks(model: torch.nn.Module, tracker: StorageTracker) -> list:
    """Hooks that set tracker.phase over one step of a transformers causal LM (Qwen2/Llama layout).

    Forward: forward.embed, forward.layer.<i>, forward.head (final norm + lm_head), loss.
    Backward: a tensor hook on each block's output names the phase whose backward starts when that
    output's gradient is ready: backward.head, backward.layer.<i>, backward.embed. The caller sets
    backward.loss before loss.backward(). Returns the handles; call .remove() on each when done.
    """

    def set_phase(name):
        def hook(*_):
            tracker.phase = name

        return hook

    def on_output_grad(module, name):
        def forward_hook(_module, _inputs, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(set_phase(name))

        return module.register_forward_hook(forward_hook)

    inner = model.model
    # prepend: before any wrapper's own pre-hook, so that FSDP2's all-gather of a layer counts in that layer's phase
    handles = [
        inner.embed_tokens.register_forward_pre_hook(set_phase("forward.embed"), prepend=True),
        on_output_grad(inner.embed_tokens, "backward.embed"),
    ]
    for i, layer in enumerate(inner.layers):
        handles += [
            layer.register_forward_pre_hook(set_phase(f"forward.layer.{i}"), prepend=True),
            on_output_grad(layer, f"backward.layer.{i}"),
        ]
    handles += [
        inner.norm.register_forward_pre_hook(set_phase("forward.head"), prepend=True),
        model.lm_head.register_forward_hook(set_phase("loss")),
        on_output_grad(model.lm_head, "backward.head"),
    ]
    return handles
