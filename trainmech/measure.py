"""Measurements: step-time statistics (median / P95) and memory peaks.

Times are wall-clock seconds from `time.perf_counter`, with CUDA synchronised around each
sample when the work runs on a GPU. On a CPU a time is a behaviour check at most: it is written
into records and run.json, never printed into a notebook's compared outputs.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from trainmech.errors import TrainmechError
from trainmech.ledger.allocator import round_size
from trainmech.ledger.categories import CATEGORIES

__all__ = [
    "percentile",
    "time_stats",
    "timed",
    "cuda_peaks",
    "reset_cuda_peaks",
    "cuda_allocated",
    "MEMORY_CATEGORIES",
    "FORWARD_PHASES",
    "REBUILDS",
    "born_as",
    "Allocation",
    "StorageTracker",
    "phase_hooks",
    "StepMemory",
    "training_step_memory",
    "ALLOCATOR_ONLY",
    "HistoryBlock",
    "MemoryHistory",
    "history_from_tracker",
    "cuda_memory_history",
    "step_history",
    "ALLOCATORS",
    "AllocatorWindow",
    "allocator_window",
    "allocator_peak_cpu",
]


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_stats(samples: list[float]) -> dict[str, float]:
    """{"step_time_median_s", "step_time_p95_s"} of per-step seconds (the record's field names)."""
    return {"step_time_median_s": statistics.median(samples), "step_time_p95_s": percentile(samples, 95)}


def timed(fn: Callable[[], object], device: torch.device | None = None) -> tuple[object, float]:
    """Run fn once; return (its result, seconds). Synchronises CUDA before and after."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def cuda_peaks(device: torch.device) -> dict[str, int | None]:
    """Peak allocated / reserved bytes since the last reset; None (unknown) off CUDA."""
    if device.type != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }


def reset_cuda_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def cuda_allocated(device: torch.device) -> int | None:
    """Bytes held by live tensors right now (the base an incremental peak is measured from); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


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


@dataclass
class StepMemory:
    """Live bytes over one tracked training step, and what they were.

    `baseline`: bytes alive before the step, by category (parameters; optimizer states after the
    first step). `live[k]`: tracked bytes after event k, baseline excluded. On CUDA the allocator's
    own peaks come along; off CUDA they are None (unknown, not zero). `device`: the device type whose
    storages these counts are (None: every storage); the storages elsewhere (the host, on a CUDA step)
    are in `elsewhere` and `baseline_elsewhere`, outside every count above (`elsewhere_at_end`).
    """

    baseline: dict[str, int]
    allocations: list[Allocation]
    live: list[int]
    phases: list[str]
    peak_allocated_bytes: int | None = None  # torch.cuda.max_memory_allocated over the step
    peak_reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved over the step
    outside_bytes: int | None = (
        None  # CUDA: allocated bytes at the start that are not baseline (batch, other tensors)
    )
    forward_backward_allocated_bytes: int | None = (
        None  # CUDA: the allocator's peak up to the end of the backward, minus outside_bytes
    )
    all_finite: bool | None = (
        None  # the loss and every gradient after the backward finite; None: no gradient left to check
    )
    device: str | None = None  # the device type counted; None: every storage
    elsewhere: list[Allocation] = field(default_factory=list)  # storages on another device (no events)
    baseline_elsewhere: dict[str, int] = field(default_factory=dict)  # their baseline, by category
    stepped: bool | None = None  # the update ran: counted from what ran (`_stepped`); None: not recorded

    def elsewhere_at_end(self) -> dict[str, int]:
        """Bytes on another device than the counted one when the step ended, by category (baseline
        included): what a device-memory count leaves out (AdamW's host-side step counters on CUDA)."""
        out = {c: self.baseline_elsewhere.get(c, 0) for c in MEMORY_CATEGORIES}
        for a in self.elsewhere:
            if a.died is None:
                out[self.category(a)] += a.nbytes
        return out

    @property
    def step_peak_allocated_bytes(self) -> int | None:
        """The allocator's peak minus what was on the device besides the baseline: comparable to peak_bytes."""
        if self.peak_allocated_bytes is None or self.outside_bytes is None:
            return None
        return self.peak_allocated_bytes - self.outside_bytes

    @staticmethod
    def category(a: Allocation) -> str:
        """The ledger's categories, from what the tracker saw.

        By tag first (gradients, optimizer states, an update's workspace). Born in the forward: saved
        if the backward releases it, an unsaved activation if the forward does. Re-created in the
        backward inside `born_as` (a checkpoint's replay, an offload's copy back): saved, or an unsaved
        activation if released before that rebuild ended. Born in the backward otherwise: a saved
        tensor if autograd was recording (a checkpoint rebuilding its forward), else an upstream
        gradient (every tensor the backward computes is some op's input gradient, the loss's seed
        dL/dL included). Born in the update or zero_grad: workspace.
        """
        if a.tag:
            return a.tag
        if a.born_phase.startswith(FORWARD_PHASES):
            released_in_forward = a.died_phase is not None and a.died_phase.startswith(FORWARD_PHASES)
            return "unsaved_activations" if released_in_forward else "saved"
        if a.born_phase.endswith(REBUILDS):
            return "unsaved_activations" if a.died_phase == a.born_phase else "saved"
        if a.born_phase.startswith("backward"):
            return "saved" if a.recomputed else "upstream_grads"
        return "workspace"

    @property
    def peak_event(self) -> int:
        return max(range(len(self.live)), key=self.live.__getitem__)

    @property
    def peak_bytes(self) -> int:
        """Baseline plus the most tracked bytes alive at any event."""
        return sum(self.baseline.values()) + self.live[self.peak_event]

    @property
    def peak_phase(self) -> str:
        return self.phases[self.peak_event]

    def by_category(self, event: int | None = None) -> dict[str, int]:
        """Bytes alive right after `event` (default: the peak), by category, baseline included."""
        k = self.peak_event if event is None else event
        out = {c: self.baseline.get(c, 0) for c in MEMORY_CATEGORIES}
        for a in self.allocations:
            if a.born <= k and (a.died is None or a.died > k):
                out[self.category(a)] += a.nbytes
        return out

    def saved_at_end_of(self, phase: str) -> int:
        """Saved-tensor bytes alive right after the last event of a phase."""
        return self.by_category(max(k for k, p in enumerate(self.phases) if p == phase))["saved"]

    def saved_added_per_layer(self, n_layers: int) -> list[int]:
        """Saved bytes each decoder layer's forward added (its own and the next layer's input)."""
        ends = ["forward.embed"] + [f"forward.layer.{i}" for i in range(n_layers)]
        return [self.saved_at_end_of(b) - self.saved_at_end_of(a) for a, b in zip(ends, ends[1:])]

    def forward_backward_peak(self) -> int:
        """The most bytes alive (baseline included) before the update: forward, loss and backward events."""
        base = sum(self.baseline.values())
        return base + max(
            live
            for live, phase in zip(self.live, self.phases)
            if phase.startswith((*FORWARD_PHASES, "backward"))
        )

    def by_phase(self) -> dict[str, int]:
        """Most bytes alive (baseline included) during each phase, counting what it started with."""
        base, out, before = sum(self.baseline.values()), {}, 0
        for live, phase in zip(self.live, self.phases):
            out[phase] = max(out.get(phase, base + before), base + live)
            before = live
        return out

    def lifecycles(self) -> dict[tuple[str, str, str | None], int]:
        """(category, born phase, released phase or None) -> bytes: who lives from when to when."""
        out: dict[tuple[str, str, str | None], int] = {}
        for a in self.allocations:
            key = (self.category(a), a.born_phase, a.died_phase)
            out[key] = out.get(key, 0) + a.nbytes
        return out


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def _distinct_bytes(tensors, device: str | None = None) -> int:
    """Bytes of the distinct storages of these tensors: on `device` (a device type), or every one (None)."""
    seen = {}
    for t in tensors:
        if device is None or t.device.type == device:
            seen[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _elsewhere_bytes(tensors, device: str) -> int:
    """Bytes of the distinct storages of these tensors that are not on `device`."""
    return _distinct_bytes(tensors) - _distinct_bytes(tensors, device)


def training_step_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict,
    *,
    allocator: str | None = None,
    grads_at_start: bool = False,
    update: bool = True,
    set_to_none: bool = True,
    autocast: torch.dtype | None = None,
) -> StepMemory:
    """Track one training step of a transformers causal LM and return its StepMemory.

    The step: loss = model(**batch, use_cache=False).loss (under torch.autocast(dtype=autocast) when
    given); loss.backward(); then, with update, optimizer.step(); optimizer.zero_grad(set_to_none).
    Gradients must be None when it starts, unless grads_at_start: then every gradient must exist (an
    earlier micro-batch wrote it, or zero_grad(set_to_none=False) kept it) and counts in the baseline.
    Every p.grad is tagged "gradients" after the backward, every optimizer state tensor
    "optimizer_states" after the update. An optimizer with a `watch(tracker)` method (an update that
    runs inside the backward, `trainmech.optimizers.OptimizerInBackward`) tags its own. The counts are
    the storages on the model's device; the others (the host, on a CUDA step) are kept apart
    (`StepMemory.elsewhere_at_end`). The allocator's peaks are read as well: on CUDA by default;
    `allocator="cpu-profiler"` reads the CPU allocator's instead (see `allocator_window`), so the same
    bookkeeping runs on a CPU. The forward+backward allocator peak is read before the finiteness check,
    which makes one scalar per gradient (`_finite`) and no tracked storage.
    """
    params = list(model.parameters())
    have = [p.grad is not None for p in params]
    if grads_at_start and not all(have):
        raise TrainmechError(
            "grads_at_start needs every p.grad to exist (an earlier micro-batch, or zero_grad(set_to_none=False))"
        )
    if not grads_at_start and any(have):
        raise TrainmechError(
            "training_step_memory needs p.grad = None before the step (zero_grad(set_to_none=True))"
        )
    device = params[0].device
    before = {
        "parameters": params,
        "optimizer_states": _state_tensors(optimizer),
        "gradients": [p.grad for p in params] if grads_at_start else [],
    }
    baseline = {category: _distinct_bytes(tensors, device.type) for category, tensors in before.items()}
    baseline_elsewhere = {
        category: _elsewhere_bytes(tensors, device.type) for category, tensors in before.items()
    }
    if allocator is None:
        allocator = "cuda" if device.type == "cuda" else None
    window = (
        allocator_window(device, allocator, assume_start_bytes=sum(baseline.values()))
        if allocator
        else contextlib.nullcontext(None)
    )
    tracker = StorageTracker(device=device.type)
    handles = phase_hooks(model, tracker)
    if hasattr(optimizer, "watch"):
        handles.append(optimizer.watch(tracker))
    calls: list[int] = []  # optimizer.step() calls that returned (its step hooks ran)
    handles.append(optimizer.register_step_post_hook(lambda *_: calls.append(1)))
    counted_before = _step_counts(optimizer)
    precision = (
        torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    )
    try:
        with window as seen, tracker:
            with precision:
                loss = model(**batch, use_cache=False).loss
            tracker.phase = "backward.loss"
            loss.backward()
            loss_value = float(loss.detach())  # a view and a Python number: no storage for the tracker
            del loss
            forward_backward = cuda_peaks(device)["peak_allocated_bytes"] if allocator == "cuda" else None
            grads = [p.grad for p in params if p.grad is not None]
            tracker.tag(grads, "gradients")
            finite = _finite(loss_value, grads)
            del grads  # zero_grad must be able to release them
            if update:
                tracker.phase = "optimizer"
                optimizer.step()
                tracker.tag(_state_tensors(optimizer), "optimizer_states")
                tracker.phase = "zero_grad"
                optimizer.zero_grad(set_to_none=set_to_none)
    finally:
        for h in handles:
            h.remove()
    apart = {
        "device": device.type,
        "elsewhere": tracker.elsewhere,
        "baseline_elsewhere": baseline_elsewhere,
        "stepped": _stepped(optimizer, counted_before, calls),
    }
    if seen is None:
        return StepMemory(
            baseline, tracker.allocations, tracker.live, tracker.phases, all_finite=finite, **apart
        )
    outside = seen.start_bytes - sum(baseline.values())  # what else was allocated: the batch, other tensors
    return StepMemory(
        baseline,
        tracker.allocations,
        tracker.live,
        tracker.phases,
        seen.peak_bytes,
        seen.peak_reserved_bytes,
        outside,
        None if forward_backward is None else forward_backward - outside,
        finite,
        **apart,
    )


def _step_counts(optimizer: torch.optim.Optimizer) -> dict[int, float]:
    """id(parameter) -> its state["step"] (AdamW's, Adam's: the updates each parameter has taken)."""
    out = {}
    for p, state in optimizer.state.items():
        step = state.get("step") if isinstance(state, dict) else None
        if step is not None:
            out[id(p)] = float(step)
    return out


def _stepped(optimizer: torch.optim.Optimizer, before: dict[int, float], calls: list[int]) -> bool:
    """Whether this step updated the parameters, from what ran: an optimizer that counts its updates per
    parameter (state["step"]) stepped when every counted parameter's count moved on (inside the backward
    too: `OptimizerInBackward`); one that keeps no count, when its step() returned (a step post-hook).
    A skipped step (a GradScaler that found an inf, a step never called) leaves both unmoved."""
    after = _step_counts(optimizer)
    if after:
        return all(count > before.get(key, 0.0) for key, count in after.items())
    return bool(calls)


def _finite(loss: float, grads: list[torch.Tensor]) -> bool | None:
    """The loss and every gradient finite; None when no gradient is left to check (an update inside the
    backward consumed them). The gradients' inf-norm, max |g| (`torch.nn.utils.get_total_norm`, fused per
    device and dtype on CUDA): one scalar per gradient, no temporary of a gradient's size, and an inf or a
    NaN anywhere makes it non-finite. It runs outside every dispatch mode, so no tracked storage; on CUDA
    its scalars are in the allocator's history, after the backward's peak was read (`_history_from_snapshot`
    names them by the Python frame that made them)."""
    if not grads:
        return None
    with _disable_current_modes():
        return math.isfinite(loss) and bool(
            torch.isfinite(torch.nn.utils.get_total_norm(grads, float("inf")))
        )


ALLOCATOR_ONLY = "allocator only"  # a history block no tensor state explains
FINITENESS_CHECK = "finiteness check"  # a history block `_finite` allocated (one scalar per gradient)


@dataclass
class HistoryBlock:
    """One allocation in a memory history: its size, the events it lives between, what it was."""

    nbytes: int
    born: int  # index of its alloc event
    died: int | None  # index of its free event; None: alive at the end
    category: str  # one of CATEGORIES, ALLOCATOR_ONLY (no tensor state: kernel scratch) or FINITENESS_CHECK
    phase: str  # the phase it was born in ("" when unknown)
    address: int = 0  # the allocator's address (CUDA history)


class MemoryHistory(dict):
    """A memory history: the summary (alloc_events, free_events, segments, reserved_bytes,
    largest_segment_bytes, alive_at_start_blocks, alive_at_start_bytes; empty when nothing was recorded)
    and `blocks`, every allocation made while it recorded, in order.

    `source`: "cuda-allocator" (torch.cuda.memory._record_memory_history, Python stacks) or
    "storage-tracker" (trainmech's tracker: tensor storages only; what a CPU can record). Blocks that
    were alive when the recording began (the baseline: parameters, the batch, the cuBLAS workspaces of a
    warm-up) have no alloc event: they are counted in the summary, not drawn.
    """

    def __init__(self, source: str | None = None):
        super().__init__()
        self.source = source
        self.blocks: list[HistoryBlock] = []
        self.events = 0

    def labelled(self, steps: list[StepMemory]) -> MemoryHistory:
        """Name each allocator block after the tracked storage born at the same address, with the same
        size rounded as the caching allocator rounds it, in the same order (category and phase); a block
        no tensor matches is "allocator only", one the finiteness check made stays FINITENESS_CHECK.
        Address and size together: the allocator reuses a freed address at once, so an untracked block
        of another size there must not take the next tensor's label. Returns self."""
        births = [
            (a.address, round_size(a.nbytes), step.category(a), a.born_phase)
            for step in steps
            for a in step.allocations
        ]
        k = 0
        for block in self.blocks:
            if block.category == FINITENESS_CHECK:
                continue
            block.category, block.phase = ALLOCATOR_ONLY, ""
            key = (block.address, round_size(block.nbytes))
            for j in range(k, min(k + 64, len(births))):  # internal allocations interleave, never reorder
                if births[j][:2] == key:
                    block.category, block.phase = births[j][2], births[j][3]
                    k = j + 1
                    break
        return self

    def allocator_only(self) -> list[HistoryBlock]:
        """The blocks no tracked tensor storage explains (kernels' scratch buffers, a workspace created inside
        the recording); only a labelled allocator history can hold any: in the tracker's own history every
        block is a storage."""
        return [b for b in self.blocks if b.category == ALLOCATOR_ONLY]

    def describe(self) -> str:
        """Where the history comes from and its size; the baseline it started from; the blocks no tensor
        state explains."""
        head = f"{self.source}: {len(self.blocks):,} blocks in {self.events:,} events"
        if self.source != "cuda-allocator":
            return head + (
                "\nevery block here is a tracked tensor storage by construction: "
                "the CPU history cannot show allocator-only blocks"
            )
        only = self.allocator_only()
        checks = [b for b in self.blocks if b.category == FINITENESS_CHECK]
        return head + (
            f"\n{self.get('alive_at_start_blocks', 0):,} blocks ({self.get('alive_at_start_bytes', 0):,} bytes) were "
            "alive when the recording began (the baseline: parameters, the batch, the warm-up's cuBLAS workspaces): "
            f"not drawn\n{len(checks)} blocks ({sum(b.nbytes for b in checks):,} bytes) of the finiteness check "
            "(one scalar per gradient, after the backward's allocator peak was read)"
            f"\n{len(only)} blocks ({sum(b.nbytes for b in only):,} bytes) no tensor state explains "
            "(kernels' scratch buffers)"
        )


def history_from_tracker(steps: list[StepMemory]) -> MemoryHistory:
    """The tracked storages of these steps as a memory history (what a CPU can record; baselines excluded)."""
    history, offset = MemoryHistory("storage-tracker"), 0
    for step in steps:
        for a in step.allocations:
            died = None if a.died is None else offset + a.died
            history.blocks.append(
                HistoryBlock(a.nbytes, offset + a.born, died, step.category(a), a.born_phase)
            )
        offset += len(step.live)
    history.events = offset
    history.update(
        alloc_events=len(history.blocks), free_events=sum(b.died is not None for b in history.blocks)
    )
    return history


def _is_finiteness_check(frame: dict) -> bool:
    """A snapshot frame of `_finite` in this module (a Python frame: stacks="python")."""
    return frame.get("name") == _finite.__name__ and str(frame.get("filename", "")).endswith(
        ("trainmech/measure.py", "trainmech\\measure.py")
    )


def _history_from_snapshot(snapshot: dict, index: int) -> MemoryHistory:
    """A MemoryHistory from torch.cuda.memory._snapshot()'s trace of one device. A block freed with no
    alloc event in the trace, or still allocated in a segment without one, was alive when the recording
    began: counted as the baseline (alive_at_start_*), not drawn."""
    traces = snapshot.get("device_traces", [])
    trace = traces[index] if index < len(traces) else []
    segments = [seg for seg in snapshot.get("segments", []) if seg.get("device", index) == index]
    history, live, seen = MemoryHistory("cuda-allocator"), {}, set()
    before = {}  # address -> bytes of the blocks alive at the start
    for e in trace:
        action, address = e.get("action"), int(e.get("addr", 0))
        if action == "alloc":
            made_by_check = any(_is_finiteness_check(frame) for frame in e.get("frames", []))
            category = FINITENESS_CHECK if made_by_check else ""
            block = HistoryBlock(int(e.get("size", 0)), history.events, None, category, "", address)
            live[address] = block
            seen.add(address)
            history.blocks.append(block)
            history.events += 1
        elif action == "free_completed" and address in live:
            live.pop(address).died = history.events
            history.events += 1
        elif action == "free_completed" and address not in seen:
            before[address] = int(e.get("size", 0))
    for seg in segments:
        for b in seg.get("blocks", []):
            address = int(b.get("address", 0))
            if b.get("state") == "active_allocated" and address not in seen:
                before[address] = int(b.get("size", 0))
    history.update(
        alloc_events=sum(e.get("action") == "alloc" for e in trace),
        free_events=sum(e.get("action") == "free_completed" for e in trace),
        segments=len(segments),
        reserved_bytes=sum(int(seg.get("total_size", 0)) for seg in segments),
        largest_segment_bytes=max((int(seg.get("total_size", 0)) for seg in segments), default=0),
        alive_at_start_blocks=len(before),
        alive_at_start_bytes=sum(before.values()),
    )
    return history


@contextmanager
def cuda_memory_history(device: torch.device, max_entries: int = 200_000):
    """Record the CUDA caching allocator's history, with Python stacks, while the block runs
    (torch.cuda.memory._record_memory_history(stacks="python")).

    Yields a MemoryHistory filled on exit (see there). Off CUDA it stays empty, source None: there is no
    such history; `history_from_tracker` gives the CPU's stand-in from a tracked step. Start it after the
    model is built and warmed up (`trainmech.ledger.measure_point(memory_history=True)` does), or the
    model's construction and the first matmul's workspaces are in it as blocks no tensor state explains.
    """
    if device.type != "cuda":
        yield MemoryHistory()
        return
    history = MemoryHistory("cuda-allocator")
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield history
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    recorded = _history_from_snapshot(
        snapshot, device.index if device.index is not None else torch.cuda.current_device()
    )
    history.update(recorded)
    history.blocks, history.events = recorded.blocks, recorded.events


def step_history(history: MemoryHistory, steps: list[StepMemory]) -> MemoryHistory:
    """The allocator's history of these steps, labelled by the tracker, when one was recorded (CUDA);
    otherwise the tracker's own history of them (tensor storages only)."""
    return history.labelled(steps) if history.blocks else history_from_tracker(steps)


# ----------------------------------------------------------------------------- memory: the allocator's own count
#
# Two allocators keep a running total of the bytes they handed out: CUDA's caching allocator
# (torch.cuda statistics, always on) and, while torch.profiler records memory, the CPU allocator
# (its memory events carry the running total). `allocator_window` reads either with the same
# bookkeeping, so a CPU test runs the arithmetic a GPU run relies on.

ALLOCATORS = ("cuda", "cpu-profiler")


@dataclass
class AllocatorWindow:
    """What an allocator reported over a block (bytes). Filled when the block exits.

    start_bytes: held when the block began; peak_bytes: the most held inside it; peak_reserved_bytes:
    the most reserved from the device (CUDA: segments cached by the allocator; None on the CPU).
    The CPU allocator is counted only while the profiler records, so there start_bytes is the
    baseline the caller states (`assume_start_bytes`): what lived before is outside its view.
    """

    source: str
    start_bytes: int = 0
    peak_bytes: int = 0
    peak_reserved_bytes: int | None = None

    @property
    def peak_above_start(self) -> int:
        return self.peak_bytes - self.start_bytes


@contextmanager
def allocator_window(device: torch.device, source: str | None = None, *, assume_start_bytes: int = 0):
    """Yield an AllocatorWindow that holds the allocator's start and peak bytes once the block ends.

    source: "cuda" (the default on a CUDA device) or "cpu-profiler" (the default elsewhere);
    refuses a source the device cannot give. The profiler's start/stop lines on stderr are
    silenced for the duration.
    """
    device = torch.device(device)
    source = source or ("cuda" if device.type == "cuda" else "cpu-profiler")
    if source not in ALLOCATORS:
        raise TrainmechError(f"unknown allocator {source!r}; valid: {', '.join(ALLOCATORS)}")
    if (source == "cuda") != (device.type == "cuda"):
        raise TrainmechError(f"allocator {source!r} cannot count memory on a {device.type} device")
    window = AllocatorWindow(source)
    if source == "cuda":
        reset_cuda_peaks(device)
        window.start_bytes = cuda_allocated(device)
        yield window
        peaks = cuda_peaks(device)
        window.peak_bytes, window.peak_reserved_bytes = (
            peaks["peak_allocated_bytes"],
            peaks["peak_reserved_bytes"],
        )
        return
    with _cpu_allocator_events() as totals:
        yield window
    window.start_bytes = assume_start_bytes
    window.peak_bytes = assume_start_bytes + _running_peak(totals)


@contextmanager
def _cpu_allocator_events():
    """Record the CPU allocator's memory events; yields a list filled on exit with
    (time ns, total before the event, total after it)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    events: list[tuple[int, int, int]] = []
    sys.stderr.flush()
    saved_fd, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield events
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.close(null)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            f = node.extra_fields
            events.append((node.start_time_ns, f.total_allocated - f.alloc_size, f.total_allocated))


def _running_peak(events: list[tuple[int, int, int]]) -> int:
    """The most the running total rose above where it stood at the first event."""
    if not events:
        return 0
    events.sort()
    return max(total for _, _, total in events) - events[0][1]


def allocator_peak_cpu(fn: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator handed out while fn ran (torch.profiler's memory events).

    Counts every allocation, kernel-internal scratch included, relative to the start of fn.
    """
    with allocator_window(torch.device("cpu"), "cpu-profiler") as window:
        fn()
    return window.peak_above_start
