"""The offload's two copy paths: CUDA (side streams, events, a pinned arena) and the CPU stand-in.

Both carry out what `OffloadBook` decides, through the same five calls: `to_host` (D2H into the
host arena), `let_go` (drop the device storage once its D2H is done), `to_device` (H2D into a fresh
device buffer), `before_use` (the compute stream waits for that H2D) and `read_times` (after the
timed loop). On CUDA nothing here makes the host wait for the device, except `read_times`.

- **Streams**: one D2H and one H2D side stream per device, made once and reused by every offload:
  the caching allocator reuses a block only on the stream it was allocated for, so a new stream per
  instance would mean fresh device allocations inside every timed step.
- **No record_stream**: a D2H source is held (the stash) until the compute stream has waited for
  its copy, then dropped; an H2D destination is allocated on the compute stream, which also frees
  it. A block is never counted free while a copy still uses it, so allocator peaks tell the truth.
- **One host arena**: every offloaded storage of a step goes into a few large host chunks (pinned
  on CUDA), made in the first step and reused by every later one — not one pinned allocation per
  tensor per step (the pinned-memory allocator rounds each to a power of two).

Off CUDA "device" and "host" are one memory: the CPU path still copies into the arena and back into
a fresh buffer, so bytes, bitwise restoration, the arena's reuse and the stash's timing can be
checked; streams and events do not exist there and every time stays None.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from trainmech.errors import TrainmechError
from trainmech.measure import born_as

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "as_bytes",
    "HostArena",
    "host_arena",
    "side_streams",
    "HostCopies",
    "CudaCopies",
]

ALIGN = 512  # bytes: every arena slot starts on this boundary (vectorised copies)
CHUNK_BYTES = 64 << 20  # smallest host chunk the arena allocates


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A (nbytes,) uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostArena:
    """Host memory for the offloaded storages of one step, reused step after step.

    `slot(n)` hands out the next n bytes of the current chunk (a new chunk of at least
    `chunk_bytes` when none has room); `claim` starts a step from the first chunk again. One
    ActivationOffload holds it at a time: a second one before the first finished is refused.
    """

    def __init__(self, *, pinned: bool, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.pinned, self.chunk_bytes = pinned, chunk_bytes
        self.chunks: list[torch.Tensor] = []
        self.allocations = 0  # host chunks allocated so far (stays put once the steps repeat)
        self.owner: object | None = None
        self._chunk = self._offset = 0

    @property
    def capacity(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def claim(self, owner: object) -> None:
        if self.owner is not None and self.owner is not owner:
            raise TrainmechError(
                "the offload's host arena is still held by another ActivationOffload: call finish() on "
                "it after its backward before the next one packs"
            )
        self.owner, self._chunk, self._offset = owner, 0, 0

    def release(self, owner: object) -> None:
        if self.owner is owner:
            self.owner = None

    def slot(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of host memory, as a uint8 view into a chunk."""
        while self._chunk < len(self.chunks):
            chunk = self.chunks[self._chunk]
            if self._offset + nbytes <= chunk.numel():
                view = chunk[self._offset : self._offset + nbytes]
                self._offset += -(-nbytes // ALIGN) * ALIGN
                return view
            self._chunk, self._offset = self._chunk + 1, 0
        with _disable_current_modes():  # host memory: a device-memory tracker must not count it
            self.chunks.append(
                torch.empty(max(nbytes, self.chunk_bytes), dtype=torch.uint8, pin_memory=self.pinned)
            )
        self.allocations += 1
        return self.slot(nbytes)


_ARENAS: dict[str, HostArena] = {}
_STREAMS: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def host_arena(device: torch.device) -> HostArena:
    """The arena every offload on this device shares (pinned when the device is a GPU)."""
    key = str(device)
    if key not in _ARENAS:
        _ARENAS[key] = HostArena(pinned=device.type == "cuda")
    return _ARENAS[key]


def side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(D2H stream, H2D stream) of a CUDA device, created on first use and reused by every offload."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = (torch.cuda.Stream(index), torch.cuda.Stream(index))
    return _STREAMS[index]


class HostCopies:
    """The CPU path: the same steps as on CUDA, with plain synchronous copies and no times."""

    def __init__(self, device: torch.device, arena: HostArena) -> None:
        self.device, self.arena = device, arena

    def begin(self, owner: object) -> None:
        self.arena.claim(owner)
        self._chunks_at_begin = self.arena.allocations

    def chunks_allocated(self) -> int:
        """Host chunks the arena had to allocate since `begin`."""
        return self.arena.allocations - getattr(self, "_chunks_at_begin", self.arena.allocations)

    def to_host(self, entry, storage: torch.UntypedStorage) -> None:
        entry.slot = self.arena.slot(entry.nbytes)
        entry.slot.copy_(as_bytes(storage))
        entry.source = storage  # held as on CUDA, until the book lets it go

    def let_go(self, entries) -> None:
        for e in entries:
            e.source = None

    def to_device(self, entry) -> None:
        with born_as("fetch"):
            dev = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
        dev.copy_(entry.slot)
        entry.fetched = dev.untyped_storage()

    def before_use(self, entry) -> None:
        return None

    def end(self, owner: object) -> None:
        self.arena.release(owner)

    def read_times(self, stats) -> None:
        return None  # no GPU, no times: they stay None


class CudaCopies(HostCopies):
    """The CUDA path: D2H and H2D on their own cached streams, ordered by events, timed by events."""

    def __init__(self, device: torch.device, arena: HostArena) -> None:
        super().__init__(device, arena)
        self.d2h, self.h2d = side_streams(device)
        self.copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (start, end) on a side stream
        self.d2h_waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (compute asked, copy ended)
        self.h2d_waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._done: dict[int, torch.cuda.Event] = {}  # entry index -> end of its D2H
        self._ready: dict[int, torch.cuda.Event] = {}  # entry index -> end of its H2D

    def _events(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def begin(self, owner: object) -> None:
        super().begin(owner)
        self.d2h.wait_stream(
            self.h2d
        )  # the previous step's H2D copies have read the slots this step overwrites

    def to_host(self, entry, storage: torch.UntypedStorage) -> None:
        entry.slot = self.arena.slot(entry.nbytes)
        start, end = self._events()
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # the producer has written it
        with torch.cuda.stream(self.d2h):
            start.record()
            entry.slot.copy_(as_bytes(storage), non_blocking=True)
            end.record()
        entry.source = storage
        self._done[entry.index] = end
        self.copies.append((start, end))

    def let_go(self, entries) -> None:
        current = torch.cuda.current_stream(self.device)
        for e in entries:
            asked = torch.cuda.Event(enable_timing=True)
            asked.record(current)
            done = self._done.pop(e.index)
            current.wait_event(
                done
            )  # the GPU waits for the copy before the block is reused; the host does not
            self.d2h_waits.append((asked, done))
            e.source = None

    def to_device(self, entry) -> None:
        current = torch.cuda.current_stream(self.device)
        with born_as("fetch"):
            dev = torch.empty(
                entry.nbytes, dtype=torch.uint8, device=self.device
            )  # on the compute stream, freed there
        start, end = self._events()
        self.h2d.wait_stream(
            current
        )  # work queued before may still use the block the allocator just handed out
        with torch.cuda.stream(self.h2d):
            start.record()
            dev.copy_(entry.slot, non_blocking=True)
            end.record()
        entry.fetched = dev.untyped_storage()
        self._ready[entry.index] = end
        self.copies.append((start, end))

    def before_use(self, entry) -> None:
        ready = self._ready.pop(entry.index, None)
        if ready is None:
            return
        current = torch.cuda.current_stream(self.device)
        asked = torch.cuda.Event(enable_timing=True)
        asked.record(current)
        current.wait_event(ready)
        self.h2d_waits.append((asked, ready))

    def read_times(self, stats) -> None:
        """Copy and wait times from the events (one synchronisation: call it after the timed steps)."""
        torch.cuda.synchronize(self.device)
        waited = lambda pairs: sum(max(0.0, asked.elapsed_time(ended)) for asked, ended in pairs) / 1e3  # noqa: E731
        stats.transfer_s = sum(s.elapsed_time(e) for s, e in self.copies) / 1e3
        stats.d2h_wait_s, stats.h2d_wait_s = waited(self.d2h_waits), waited(self.h2d_waits)
