"""ActivationOffload: saved-tensor hooks that keep large saved activations in host memory between forward and backward.

    with activation_offload(model, min_bytes=1 << 20) as offload:
        loss = model(**batch, use_cache=False).loss
    loss.backward()
    stats = offload.finish()      # bytes each way, what stayed, what was fetched ahead — no device wait
    ...                           # after the timed steps:
    offload.read_times()          # CUDA: copy time and the compute stream's waits (exposed transfer time)

The decisions are `OffloadBook`'s (trainmech.offload.book), the copies the copy path's
(trainmech.offload.copies): CUDA side streams, or the plain CPU copies. `streams=HostStreams()` runs
the CUDA path's bookkeeping on a CPU (every copy done at once, every stream call logged).
`activation_offload(model)` groups the saved tensors by decoder layer, exempts the last layer, the head
and the loss, and fetches `prefetch_groups` layers ahead of the backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from trainmech.errors import TrainmechError
from trainmech.offload.book import OffloadBook, References, TransferStats
from trainmech.offload.copies import CudaCopies, HostArena, HostCopies, HostStreams, host_arena

__all__ = ["ActivationOffload", "activation_offload", "restore_check"]


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Pack: leave parameters, small storages and exempt groups in place; copy every other storage
    to host once (its views share the copy). Unpack: fetch groups ahead of the backward, wait on the
    device (never the host) for a copy, rebuild each view with its dtype, offset, shape and strides.

    `layers` (decoder layers, in order) defines the groups: their forward pre-hooks, and a forward
    hook on the last one, tell the book which group the forward is in while the block is entered.
    Without layers everything is group 0, nothing is exempt. One instance per forward + backward.
    `streams`: the CUDA copy path's device calls (default: CUDA streams on a GPU, none elsewhere);
    `HostStreams()` makes a CPU run the CUDA path (`CudaCopies`) with host copies.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        keep: Iterable[torch.Tensor] = (),
        min_bytes: int = 1 << 20,
        layers: Iterable[torch.nn.Module] | None = None,
        exempt_last: int = 1,
        prefetch_groups: int = 2,
        stash_groups: int = 1,
        arena: HostArena | None = None,
        streams: HostStreams | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # tensors report cuda:N; compare like with like
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.keep = {p.untyped_storage().data_ptr() for p in keep}
        self.layers = list(layers) if layers is not None else []
        exempt_from = max(len(self.layers) - exempt_last, 0) if self.layers else None
        self.book = OffloadBook(min_bytes, exempt_from, prefetch_groups, stash_groups)
        self.book.group = -1 if self.layers else 0
        self.refs = References(self.book.stats)
        arena = arena or host_arena(self.device)
        self.copies = (
            CudaCopies(self.device, arena, streams)
            if self.cuda or streams is not None
            else HostCopies(self.device, arena)
        )
        self._identity: dict[
            int, tuple[weakref.ref, object]
        ] = {}  # storage address -> (the storage, its entry)
        self._handles: list = []
        self._begun = False
        super().__init__(self.pack, self.unpack)

    @property
    def stats(self) -> TransferStats:
        return self.book.stats

    @property
    def entries(self):
        return self.book.entries

    def host_bytes(self) -> int:
        """Bytes this offload holds in the host arena now (0 after finish)."""
        return self.book._host_bytes

    def __enter__(self) -> ActivationOffload:
        self.watch_groups()
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.unwatch_groups()
        super().__exit__(*exc)

    def watch_groups(self) -> None:
        """Forward hooks that tell the book which layer the forward is in (done by entering the hooks)."""
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(lambda *_, g=i: self._start_group(g)))
        if self.layers:
            self._handles.append(self.layers[-1].register_forward_hook(lambda *_: self._start_group(n)))

    def unwatch_groups(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _start_group(self, group: int) -> None:
        if not self.book.backward_started:
            self.copies.let_go(self.book.start_group(group))

    # -- forward ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        reason = self.book.keep_reason(storage.nbytes(), ptr in self.keep, t.device == self.device)
        if reason:
            self.book.count_kept(reason)
            # detached: a packed value must not hold the tensor (reference cycle)
            return self.refs.new(), self.book.group, t.detach(), weakref.ref(t), t._version
        view = (t.dtype, t.storage_offset(), t.size(), t.stride())
        known = self._identity.get(ptr)
        if (
            known is not None
            and known[0]() is storage
            and known[1].version == t._version
            and not known[1].released
        ):
            self.book.share(known[1])
            return self.refs.new(), known[1], view, weakref.ref(t), t._version
        if not self._begun:
            self.copies.begin(self)
            self._begun = True
        entry = self.book.new_entry(storage.nbytes(), t._version)
        self._identity[ptr] = (weakref.ref(storage), entry)  # alive ⇒ its address is not reused by another
        self.copies.to_host(entry, storage)
        return self.refs.new(), entry, view, weakref.ref(t), t._version

    # -- backward --------------------------------------------------------------------------
    def unpack(self, packed):
        if not self.book.backward_started:
            self.copies.let_go(self.book.start_backward())
        ref, where, item, source, version = packed
        _refuse_if_modified(source(), version)
        if isinstance(where, int):  # kept in place
            self._fetch_ahead(where, None)
            self.refs.read(ref)
            return item
        entry = where
        self.book.refuse_if_released(entry)
        self._fetch_ahead(entry.group, entry)
        if entry.fetched is None:  # not fetched ahead: now, and the compute stream waits for it
            self.book.fetching(entry, ahead=False)
            self.copies.to_device(entry)
        self.copies.before_use(entry)
        storage = entry.fetched
        if self.book.unpacked(entry):
            entry.fetched = None  # the last saved reference: from now on only autograd holds it
        self.refs.read(ref)
        dtype, offset, size, stride = item
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, offset, size, stride)

    def _fetch_ahead(self, group: int, now) -> None:
        for e in self.book.to_fetch(group):
            if e is not now:
                self.book.fetching(e, ahead=True, touched=group)
                self.copies.to_device(e)

    def finish(self) -> TransferStats:
        """After the backward: let go of every device and host buffer. The host does not wait for the device;
        the compute stream waits for any copy still in flight (a fetched copy the backward never used)."""
        if not self.book.backward_started:
            self.copies.let_go(self.book.start_backward())
        self.stats.fetched_unused = self.copies.drain(self.book.entries)
        for e in self.book.entries:
            e.source = e.fetched = e.slot = None
        self.book.finish()
        if self._begun:
            self.stats.host_chunks_allocated = self.copies.chunks_allocated()
            self.copies.end(self)
            self._begun = False
        return self.stats

    def read_times(self) -> TransferStats:
        """CUDA: fill the copy and wait times from the events (waits for the device once); off CUDA: None."""
        self.copies.read_times(self.stats)
        return self.stats


def _refuse_if_modified(t: torch.Tensor | None, version: int) -> None:
    """Autograd checks a saved tensor's version only when no saved-tensor hook is installed: this hook does it."""
    if t is not None and t._version != version:
        raise TrainmechError(
            f"a tensor saved for backward was modified in place after ActivationOffload packed it (version {version} "
            f"at pack, {t._version} now): the copy on the host no longer matches it; use an out-of-place "
            "operation (y = y * 2, not y.mul_(2)) on tensors the backward still needs."
        )


def activation_offload(model: torch.nn.Module, **kwargs) -> ActivationOffload:
    """Activation offload for a transformers causal LM: its parameters stay, its decoder layers are the groups
    (kwargs as ActivationOffload: min_bytes, exempt_last, prefetch_groups, arena, streams, …)."""
    device = next(model.parameters()).device
    return ActivationOffload(device, keep=model.parameters(), layers=model.model.layers, **kwargs)


def restore_check(
    hooks: torch.autograd.graph.saved_tensors_hooks,
) -> tuple[torch.autograd.graph.saved_tensors_hooks, dict[str, int]]:
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

    return _Checked(hooks, pack, unpack), counts


class _Checked(torch.autograd.graph.saved_tensors_hooks):
    """restore_check's hooks: entering them also lets the wrapped offload watch its layer groups."""

    def __init__(self, inner, pack, unpack) -> None:
        self.inner = inner
        super().__init__(pack, unpack)

    def __enter__(self):
        getattr(self.inner, "watch_groups", lambda: None)()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        getattr(self.inner, "unwatch_groups", lambda: None)()
        super().__exit__(*exc)
