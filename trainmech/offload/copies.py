"""The offload's two copy paths: CUDA (side streams, events, a pinned arena) and the plain CPU one.

Both carry out what `OffloadBook` decides, through the same calls: `to_host` (D2H into the host
arena), `let_go` (drop the device storage once its D2H is done), `to_device` (H2D into a fresh
device buffer), `before_use` (the compute stream waits for that H2D), `drain` (at the end of the
step: wait for fetched copies nobody used before letting them go) and `read_times` (after the timed
loop). On CUDA nothing here makes the host wait for the device, except `read_times`.

- **Streams**: one D2H and one H2D side stream per device, made once and shared by every offload. No
  device memory is allocated on them (an H2D destination comes from the compute stream, a D2H
  destination is host memory); the reason is ordering: every offload writes into the same host arena,
  and `CudaCopies.begin` makes the D2H stream wait for the H2D stream, so a step's D2H copies overwrite
  arena slots only after the previous step's H2D copies have read them. That wait orders the two steps
  only when both use the same H2D stream.
- **No record_stream**: a D2H source is held (the stash) until the compute stream has waited for
  its copy, then dropped; an H2D destination is allocated on the compute stream, which also frees
  it, after waiting for the copy. A block is never counted free while a copy still uses it, so
  allocator peaks tell the truth.
- **One host arena**: every offloaded storage of a step goes into a few large host chunks (pinned
  on CUDA), made in the first step and reused by every later one — not one pinned allocation per
  tensor per step (the pinned-memory allocator rounds each to a power of two).

`CudaCopies` is bookkeeping over events; the device calls themselves go through a small backend:
`CudaStreams` (torch.cuda streams and events) on a GPU, or `HostStreams` on a CPU, which performs
every copy at once on the host, stamps events with the host clock and logs each record, wait, copy
and release in order — so a CPU test runs the CUDA path's logic and checks its ordering. The plain
CPU path (`HostCopies`, what a CPU run uses) copies into the arena and back into a fresh buffer
without events; its times stay None.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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
    "CudaStreams",
    "HostEvent",
    "HostStreams",
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


class CudaStreams:
    """The CUDA copy path's device calls: torch.cuda streams and events (the backend `CudaCopies` uses on a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h, self.h2d = side_streams(device)

    def compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def mark(self, stream) -> torch.cuda.Event:
        """A timing event recorded on `stream` now."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def wait_stream(self, waiter, producer) -> None:
        waiter.wait_stream(producer)  # on the device: the host does not wait

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor, entry: int):
        """dst <- src queued on `stream` (non-blocking); (start, end) events around it."""
        with torch.cuda.stream(stream):
            start = self.mark(stream)
            dst.copy_(src, non_blocking=True)
            end = self.mark(stream)
        return start, end

    def note(self, what: str, entry: int) -> None:
        return None  # a moment of the bookkeeping; the device needs no call for it

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3


@dataclass(frozen=True)
class HostEvent:
    index: int  # its place among the events of this backend
    stream: str
    t: float  # the host clock when it was recorded (every copy before it has finished)


class HostStreams:
    """The CUDA copy path's device calls on a CPU: streams are names, each copy is done at once, events are
    stamped with the host clock. `log` keeps every call in order:

        ("record", stream, event)  ("wait_stream", waiter, producer)  ("wait_event", stream, event)
        ("copy", stream, start event, end event, entry)  ("note", what, entry)  ("synchronize",)

    with events as their indices; a note's `what` is "drop-source" (a D2H source let go), "use" (an H2D
    copy handed to autograd) or "drop-fetched" (an H2D copy let go unused at the end of the step)."""

    d2h, h2d = "d2h", "h2d"

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events: list[HostEvent] = []

    def compute(self) -> str:
        return "compute"

    def mark(self, stream: str) -> HostEvent:
        event = HostEvent(len(self.events), stream, time.perf_counter())
        self.events.append(event)
        self.log.append(("record", stream, event.index))
        return event

    def wait_stream(self, waiter: str, producer: str) -> None:
        self.log.append(("wait_stream", waiter, producer))

    def wait_event(self, stream: str, event: HostEvent) -> None:
        self.log.append(("wait_event", stream, event.index))

    def copy(self, stream: str, dst: torch.Tensor, src: torch.Tensor, entry: int):
        start = self.mark(stream)
        dst.copy_(src)
        end = self.mark(stream)
        self.log.append(("copy", stream, start.index, end.index, entry))
        return start, end

    def note(self, what: str, entry: int) -> None:
        self.log.append(("note", what, entry))

    def synchronize(self) -> None:
        self.log.append(("synchronize",))

    def seconds(self, start: HostEvent, end: HostEvent) -> float:
        return end.t - start.t

    def out_of_order(self, start: int = 0, stop: int | None = None) -> list[str]:
        """What the log's calls start:stop (one step's: entries are numbered per step) show done out of
        order ([] when every rule held): a D2H source let go before the compute stream waited for its copy, an H2D
        copy queued before that wait, an H2D copy waited for other than once or used before the wait, a copy not
        preceded by its side stream waiting for the compute stream."""
        log, problems = self.log[start:stop], []
        at = lambda item: [i for i, c in enumerate(log) if c == item]  # noqa: E731
        copies = {(c[1], c[4]): (c[3], i) for i, c in enumerate(log) if c[0] == "copy"}
        for (stream, entry), (end, i) in copies.items():
            if log[i - 3] != ("wait_stream", stream, "compute"):
                problems.append(f"{stream} copy of entry {entry} not queued behind the compute stream")
            waits = at(("wait_event", "compute", end))
            if len(waits) != 1:
                problems.append(f"{stream} copy of entry {entry} waited for {len(waits)} times")
                continue
            if stream == "d2h":
                dropped = at(("note", "drop-source", entry))
                fetched = copies.get(("h2d", entry), (None, len(log)))[1]
                if not dropped or dropped[0] < waits[0] or fetched < waits[0]:
                    problems.append(f"entry {entry}: source let go or fetched before its D2H was waited for")
            else:
                uses = at(("note", "use", entry)) or at(("note", "drop-fetched", entry))
                if not uses or uses[0] < waits[0]:
                    problems.append(
                        f"entry {entry}: fetched copy used or let go before its H2D was waited for"
                    )
        return problems


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

    def _fresh(self, entry) -> torch.Tensor:
        with born_as("fetch"):  # on the compute stream, which also frees it
            return torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)

    def to_device(self, entry) -> None:
        dev = self._fresh(entry)
        dev.copy_(entry.slot)
        entry.fetched = dev.untyped_storage()

    def before_use(self, entry) -> None:
        return None

    def drain(self, entries) -> int:
        """The step is over: fetched copies the backward never used may go. Returns how many there were."""
        return sum(e.fetched is not None and not e.used for e in entries)

    def end(self, owner: object) -> None:
        self.arena.release(owner)

    def read_times(self, stats) -> None:
        return None  # no GPU, no times: they stay None


class CudaCopies(HostCopies):
    """The CUDA path: D2H and H2D on their own side streams, ordered by events, timed by events.

    `streams` makes the device calls: `CudaStreams` (the default, a GPU) or `HostStreams` (a CPU,
    where the same bookkeeping runs with every copy done at once)."""

    def __init__(self, device: torch.device, arena: HostArena, streams=None) -> None:
        super().__init__(device, arena)
        self.streams = streams if streams is not None else CudaStreams(device)
        self.copies: list[tuple] = []  # ("d2h" or "h2d", start, end) of every copy on a side stream
        self.d2h_waits: list[tuple] = []  # (compute asked, copy ended)
        self.h2d_waits: list[tuple] = []
        self._done: dict[
            int, object
        ] = {}  # entry index -> end of its D2H, until the compute stream waits for it
        self._ready: dict[
            int, object
        ] = {}  # entry index -> end of its H2D, until the compute stream waits for it

    def begin(self, owner: object) -> None:
        super().begin(owner)
        s = self.streams
        s.wait_stream(s.d2h, s.h2d)  # the previous step's H2D copies have read the slots this step overwrites

    def to_host(self, entry, storage: torch.UntypedStorage) -> None:
        s = self.streams
        entry.slot = self.arena.slot(entry.nbytes)
        s.wait_stream(s.d2h, s.compute())  # the producer has written it
        start, end = s.copy(s.d2h, entry.slot, as_bytes(storage), entry.index)
        entry.source = storage
        self._done[entry.index] = end
        self.copies.append(("d2h", start, end))

    def _wait(self, ended, waits: list) -> None:
        """The compute stream waits (on the device, the host does not) for a copy's end event."""
        s = self.streams
        current = s.compute()
        waits.append((s.mark(current), ended))
        s.wait_event(current, ended)

    def let_go(self, entries) -> None:
        for e in entries:
            self._wait(self._done.pop(e.index), self.d2h_waits)  # before the block can be reused
            self.streams.note("drop-source", e.index)
            e.source = None

    def to_device(self, entry) -> None:
        s = self.streams
        dev = self._fresh(entry)
        s.wait_stream(
            s.h2d, s.compute()
        )  # work queued before may still use the block the allocator handed out
        start, end = s.copy(s.h2d, dev, entry.slot, entry.index)
        entry.fetched = dev.untyped_storage()
        self._ready[entry.index] = end
        self.copies.append(("h2d", start, end))

    def before_use(self, entry) -> None:
        ready = self._ready.pop(entry.index, None)
        if ready is not None:  # the first unpack of this copy
            self._wait(ready, self.h2d_waits)
        self.streams.note("use", entry.index)

    def drain(self, entries) -> int:
        """Fetched copies the backward never used: the compute stream waits for each H2D before its buffer goes,
        or the allocator would hand the block out again while the copy still writes it."""
        unused = super().drain(entries)
        by_index = {e.index: e for e in entries}
        for index in sorted(self._ready):
            self._wait(self._ready.pop(index), self.h2d_waits)
            self.streams.note("drop-fetched", index)
            by_index[index].fetched = None
        return unused

    def read_times(self, stats) -> None:
        """Copy and wait times from the events (one synchronisation: call it after the timed steps)."""
        s = self.streams
        s.synchronize()
        stats.transfer_time_s = sum(s.seconds(a, b) for _, a, b in self.copies)
        stats.d2h_wait_s = sum(max(0.0, s.seconds(a, b)) for a, b in self.d2h_waits)
        stats.h2d_wait_s = sum(max(0.0, s.seconds(a, b)) for a, b in self.h2d_waits)

    def intervals(self, origin, stream: str) -> list[tuple[float, float]]:
        """Every copy on one side stream ("d2h" or "h2d") as (start, end) in seconds after the event `origin`
        (one clock for every stream of the device; call it after read_times, whose synchronisation it relies on)."""
        if stream not in ("d2h", "h2d"):
            raise TrainmechError(f"a side stream is 'd2h' or 'h2d', got {stream!r}")
        s = self.streams
        return [(s.seconds(origin, a), s.seconds(origin, b)) for name, a, b in self.copies if name == stream]
