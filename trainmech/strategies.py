"""Activation checkpointing and activation offload: two ways to keep fewer saved tensors resident.

Checkpointing drops a region's saved tensors after the forward and recomputes them in the
backward (compute pays). Offload copies them to host memory during the forward and back before
the backward needs them (transfer pays). Neither changes the math, so loss and gradients must
equal the baseline's.

    with hf_checkpointing(model):                            # transformers' own, non-reentrant
        model(**batch).loss.backward()
    with checkpoint_layers(model.model.layers, every=2):     # torch.utils.checkpoint, our wrapper
        model(**batch).loss.backward()
    with ActivationOffload(device, keep=model.parameters(), min_bytes=1 << 20) as offload:
        model(**batch).loss.backward()
    offload.finish()                                         # TransferStats: bytes each way, …
    with CountingSaveOnCpu(device) as simple:                # torch's save_on_cpu, bytes counted
        model(**batch).loss.backward()

Counting: `counting_context` gives checkpoint() a context_fn that counts the aten ops a
checkpointed region runs in the forward and again in the backward (and, with a policy, makes
the checkpoint selective); `count_calls` counts module calls, so a replayed layer shows up as
extra calls during the backward. Off CUDA "device" and "host" are the same memory: the offload
harness still copies into separate buffers and counts bytes, and leaves every time None;
streams, events and pinned memory are used only on CUDA.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten

# ----------------------------------------------------------------------------- checkpointing


@contextmanager
def hf_checkpointing(model: torch.nn.Module, **checkpoint_kwargs) -> Iterator[None]:
    """transformers' own activation checkpointing (non-reentrant) inside the block, off after it.

    checkpoint_kwargs go to torch.utils.checkpoint.checkpoint (e.g. preserve_rng_state=False,
    context_fn=...). Recent transformers name the switch `activation_checkpointing_enable` and
    deprecate `gradient_checkpointing_enable`; whichever this version has is used. Run the model
    with use_cache=False: a KV cache written in a replayed forward would be written twice.
    """
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    enable({"use_reentrant": False, **checkpoint_kwargs})  # the first parameter in both spellings
    try:
        yield
    finally:
        disable()


@contextmanager
def checkpoint_layers(
    layers: Iterable[torch.nn.Module],
    every: int = 1,
    *,
    context_fn: Callable | None = None,
    preserve_rng_state: bool = True,
) -> Iterator[list[int]]:
    """Run layer i inside torch.utils.checkpoint.checkpoint (non-reentrant) for i % every == 0.

    `context_fn` (e.g. from `counting_context`) is passed on; it decides what a selective
    checkpoint saves. Yields the checkpointed indices; the layers' forwards are restored on exit.
    """
    if every < 1:
        raise ValueError(f"every must be ≥ 1, got {every}")
    chosen = [(i, layer) for i, layer in enumerate(layers) if i % every == 0]
    extra = {} if context_fn is None else {"context_fn": context_fn}
    for _, layer in chosen:

        def forward(*args, _plain=layer.forward, **kwargs):  # _plain: the class's bound forward
            return checkpoint(_plain, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **extra, **kwargs)

        layer.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield [i for i, _ in chosen]
    finally:
        for _, layer in chosen:
            del layer.forward


# Selective checkpointing keeps the outputs of the expensive ops and recomputes the cheap rest.
_MATMUL_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
MATMUL_OPS = frozenset(getattr(aten, name).default for name in _MATMUL_NAMES if hasattr(aten, name))


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective policy: save matmul and attention outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_ALIASES = frozenset({aten.detach.default, aten._unsafe_view.default})


def _counted(func) -> bool:
    """Ops that compute something: not views or aliases (they move no data)."""
    return func.namespace == "aten" and not func.is_view and func not in _ALIASES


@dataclass
class RecomputeCount:
    """Ops inside checkpointed regions: run in the forward, kept by a policy, run again in the backward."""

    forward_ops: int = 0
    saved_ops: int = 0
    recomputed_ops: int = 0
    recomputed_by_op: Counter = field(default_factory=Counter)


class _OpCounter(TorchDispatchMode):
    def __init__(self, count: RecomputeCount, recompute: bool) -> None:
        super().__init__()
        self.count, self.recompute = count, recompute

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _counted(func):
            if self.recompute:
                self.count.recomputed_ops += 1
                self.count.recomputed_by_op[func.__name__] += 1
            else:
                self.count.forward_ops += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _stacked(below, above):
    with below, above:  # `above` is entered last, so it sees each op first
        yield


def counting_context(count: RecomputeCount, policy: Callable | None = None) -> Callable[[], tuple]:
    """A `context_fn` for checkpoint(): counts ops into `count`; with `policy`, checkpoints selectively.

    In the recompute the selective cache sits above the counter: an op whose output was saved
    is answered from the cache and never reaches the counter, so only real recomputation counts.
    """

    def counted_policy(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        saved = decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)
        if saved and _counted(op) and not getattr(ctx, "is_recompute", False):  # older torch asks again in the recompute
            count.saved_ops += 1
        return decision

    def context_fn():
        forward, recompute = (
            create_selective_checkpoint_contexts(counted_policy) if policy else (nullcontext(), nullcontext())
        )
        return _stacked(_OpCounter(count, False), forward), _stacked(_OpCounter(count, True), recompute)

    return context_fn


@contextmanager
def count_calls(modules: Iterable[torch.nn.Module]) -> Iterator[Counter]:
    """Count forward calls per module (by position) while inside; a replayed module is called again."""
    calls: Counter = Counter()
    handles = [m.register_forward_pre_hook(lambda *_, i=i: calls.update([i])) for i, m in enumerate(modules)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- offload


@dataclass
class TransferStats:
    """What one forward + backward moved. Seconds are None off CUDA (not meaningful there)."""

    packed: int = 0  # saved-tensor references autograd handed to the pack hook
    kept_params: int = 0  # left in place: parameter storage (resident anyway)
    kept_small: int = 0  # left in place: storage below min_bytes, or on another device
    offloaded: int = 0  # storages copied to host
    shared: int = 0  # references served by a storage already offloaded (views, repeated saves)
    prefetched: int = 0  # H2D copies issued before the backward asked for that tensor
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    transfer_s: float | None = None  # total copy time (CUDA events)
    h2d_wait_s: float | None = None  # compute-stream time spent waiting for H2D copies


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A (nbytes,) uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Entry:
    """One offloaded storage: its host copy and, in the backward, its fetched device copy."""

    __slots__ = ("storage", "version", "nbytes", "refs", "host", "fetched", "used", "ready", "copies")

    def __init__(self, source: torch.Tensor, nbytes: int) -> None:
        self.storage = weakref.ref(source.untyped_storage())  # alive ⇒ its address is not reused by another
        self.version = source._version
        self.nbytes = nbytes
        self.refs = 0  # saved references to this storage still to be unpacked
        self.host: torch.Tensor | None = None
        self.fetched: torch.UntypedStorage | None = None  # device copy, held until its last reference is unpacked
        self.used = False  # the fetched copy was unpacked at least once (no longer "ahead")
        self.ready: torch.cuda.Event | None = None  # H2D finished
        self.copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """saved_tensors_hooks that hold large saved activations in host memory between forward and backward.

    Parameters (`keep`) and storages under `min_bytes` stay where they are. A saved tensor is
    offloaded by its whole storage, once: views of one storage share one host copy. On CUDA the
    copies run on their own stream into pinned buffers: each D2H starts as soon as the tensor is
    saved and overlaps the rest of the forward; in the backward, H2D copies are issued in reverse
    pack order (the order backward consumes them) up to `prefetch_bytes` ahead, and the compute
    stream waits on an event, never the host. Off CUDA the same bookkeeping runs with plain
    copies, so bytes and bitwise restoration can be checked. One instance per forward + backward.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        keep: Iterable[torch.Tensor] = (),
        min_bytes: int = 1 << 20,
        prefetch_bytes: int = 64 << 20,
    ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # tensors report cuda:N; compare like with like
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.keep = {p.untyped_storage().data_ptr() for p in keep}
        self.min_bytes, self.prefetch_bytes = min_bytes, prefetch_bytes
        self.stats = TransferStats()
        self.entries: list[_Entry] = []
        self._by_ptr: dict[int, int] = {}
        self._cursor = -1  # the next entry to prefetch (backward consumes in reverse pack order)
        self._inflight = 0  # bytes fetched ahead and not used yet
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        super().__init__(self.pack, self.unpack)

    def __enter__(self) -> ActivationOffload:
        super().__enter__()
        return self

    def host_bytes(self) -> int:
        """Bytes held in host buffers now."""
        return sum(e.nbytes for e in self.entries if e.host is not None)

    # -- forward ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        self.stats.packed += 1
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.keep:
            self.stats.kept_params += 1
            return t.detach()  # detached: a packed value must not hold the tensor (reference cycle)
        if nbytes < self.min_bytes or t.device != self.device:
            self.stats.kept_small += 1
            return t.detach()
        view = (t.dtype, t.storage_offset(), t.size(), t.stride())
        index = self._by_ptr.get(ptr)
        if index is not None:
            e = self.entries[index]
            if e.storage() is storage and e.version == t._version:
                self.stats.shared += 1
                e.refs += 1
                return index, view
        index = len(self.entries)
        e = _Entry(t, nbytes)
        e.refs = 1
        self.entries.append(e)
        self._by_ptr[ptr] = self._cursor = index
        self._to_host(e, storage)
        self.stats.offloaded += 1
        self.stats.d2h_bytes += nbytes
        return index, view

    def _to_host(self, e: _Entry, storage: torch.UntypedStorage) -> None:
        src = _as_bytes(storage)
        # Host buffers are made outside any dispatch mode: a device-memory tracker (trainmech.measure)
        # must not count them, just as CUDA's allocator does not count pinned host memory.
        with _disable_current_modes():
            if not self.cuda:
                e.host = src.clone()  # a separate buffer standing in for host memory
                return
            e.host = torch.empty(e.nbytes, dtype=torch.uint8, pin_memory=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer has written it
        with torch.cuda.stream(self.stream):
            start.record()
            e.host.copy_(src, non_blocking=True)
            end.record()
        src.record_stream(self.stream)  # the allocator must not hand the block out before the copy read it
        e.copies.append((start, end))

    # -- backward --------------------------------------------------------------------------
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed  # kept in place
        index, (dtype, offset, size, stride) = packed
        e = self.entries[index]
        if e.fetched is None:
            self._issue(index)  # not fetched ahead: on demand
        storage = e.fetched
        if not e.used:
            e.used = True
            self._inflight -= e.nbytes
        self._prefetch_below(index)
        if e.ready is not None:
            current = torch.cuda.current_stream(self.device)
            asked = torch.cuda.Event(enable_timing=True)
            asked.record(current)
            current.wait_event(e.ready)  # the GPU waits for the copy; the host does not
            self._waits.append((asked, e.ready))
            e.ready = None
            _as_bytes(storage).record_stream(current)
        e.refs -= 1
        if e.refs <= 0:
            e.fetched = None  # the last saved reference: from now on only autograd holds it
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, offset, size, stride)

    def _prefetch_below(self, index: int) -> None:
        """Issue H2D for the entries below `index`, nearest first, until prefetch_bytes are in flight."""
        self._cursor = min(self._cursor, index - 1)
        while self._cursor >= 0 and self._inflight < self.prefetch_bytes:
            self.stats.prefetched += self._issue(self._cursor)
            self._cursor -= 1

    def _issue(self, index: int) -> bool:
        e = self.entries[index]
        if e.fetched is not None or e.refs <= 0:
            return False
        if not self.cuda:
            dev = e.host.clone()  # stands in for the H2D copy into a fresh device buffer
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                start.record()
                dev = e.host.to(self.device, non_blocking=True)
                end.record()
            e.copies.append((start, end))
            e.ready = end
        e.fetched, e.used = dev.untyped_storage(), False
        self._inflight += e.nbytes
        self.stats.h2d_bytes += e.nbytes
        return True

    def finish(self) -> TransferStats:
        """After the backward: drop host buffers; on CUDA sum the copy times (one synchronisation)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            copy_ms = sum(s.elapsed_time(t) for e in self.entries for s, t in e.copies)
            wait_ms = sum(max(0.0, asked.elapsed_time(ready)) for asked, ready in self._waits)
            self.stats.transfer_s, self.stats.h2d_wait_s = copy_ms / 1e3, wait_ms / 1e3
        for e in self.entries:
            e.host = e.fetched = None
        return self.stats


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu(pin_memory=True), with what it moves counted in `stats`.

    Every saved tensor goes to the host, parameters and small tensors included, once per saved
    reference, and every copy is queued on the compute stream, so none overlaps with compute.
    Off CUDA torch does not pin, and the "H2D" `.to("cpu")` hands back the host tensor itself;
    the bytes are counted all the same (they are what a GPU run moves).
    """

    def __init__(self, device: torch.device | str) -> None:
        super().__init__(pin_memory=True)
        self.stats = TransferStats()
        self.cuda = torch.device(device).type == "cuda"
        self._copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        pack, unpack = self.pack_hook, self.unpack_hook
        self.pack_hook = lambda t: self._timed(pack, t, "d2h_bytes")
        self.unpack_hook = lambda packed: self._timed(unpack, packed, "h2d_bytes")

    def __enter__(self) -> CountingSaveOnCpu:
        super().__enter__()
        return self

    def _timed(self, hook, arg, counter: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = hook(arg)
            end.record()
            self._copies.append((start, end))
        else:
            out = hook(arg)
        t = arg if counter == "d2h_bytes" else out
        setattr(self.stats, counter, getattr(self.stats, counter) + t.numel() * t.element_size())
        if counter == "d2h_bytes":
            self.stats.packed += 1
            self.stats.offloaded += 1
        return out

    def finish(self) -> TransferStats:
        if self.cuda:
            torch.cuda.synchronize()
            self.stats.transfer_s = sum(s.elapsed_time(t) for s, t in self._copies) / 1e3
        return self.stats


def restore_check(hooks: torch.autograd.graph.saved_tensors_hooks) -> tuple[torch.autograd.graph.saved_tensors_hooks, dict[str, int]]:
    """Wrap an offload's hooks so each tensor unpacked is compared with what was packed.

    Returns (hooks to enter instead, counts). counts["checked"] tensors went through;
    counts["values_differ"] came back with another dtype, shape or any other bit;
    counts["strides_differ"] came back equal in value but laid out with other strides.
    """
    counts = {"checked": 0, "values_differ": 0, "strides_differ": 0}

    def pack(t):
        return (t.stride(), t.detach().clone()), hooks.pack_hook(t)  # a private copy to compare with

    def unpack(packed):
        (stride, ref), inner = packed
        t = hooks.unpack_hook(inner)
        same_values = t.dtype == ref.dtype and t.shape == ref.shape and torch.equal(t, ref)
        counts["checked"] += 1
        counts["values_differ"] += not same_values
        counts["strides_differ"] += same_values and t.stride() != stride
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack), counts
