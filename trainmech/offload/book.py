"""The offload's bookkeeping, with no copy in it: what moves, what is shared, when to let go, when to fetch.

Pure Python over sizes and indices, the same on every device, so a CPU test runs every rule a GPU
run relies on. Saved tensors are grouped by the layer whose forward packed them (group i for
decoder layer i, -1 before the first layer, L after the last); the backward consumes the groups in
reverse. Four rules:

- **what moves**: a storage of at least `min_bytes`, not a parameter, packed in a group below
  `exempt_from` (the last layer, the head and the loss stay: the backward needs them first, and a
  copy there would only wait behind the whole D2H backlog). A storage is moved once; every other
  view of it shares that copy.
- **when the device copy may go** (the forward stash): a moved storage is held, not freed, until
  its D2H has finished. Group g's storages are let go when group g + 1 + `stash_groups` starts (the
  compute stream first waits for their copies), and every one when the backward starts. The
  allocator never sees a block freed while a copy still reads it, so the peak it reports is honest.
- **when to fetch**: when the backward first touches group g, every moved storage of groups
  g - `prefetch_groups` … g that is not back yet is fetched, nearest first.
- **when the fetched copy goes**: after the last saved reference to it was unpacked (autograd then
  holds it as long as it needs it). Unpacking it again after that is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainmech.errors import TrainmechError

__all__ = [
    "EMBED_GROUP",
    "TransferStats",
    "pass_label",
    "per_pass",
    "describe",
    "References",
    "Entry",
    "OffloadBook",
]

EMBED_GROUP = -1  # what the forward packs before the first decoder layer
_KEPT = {"param": "kept_params", "small": "kept_small", "exempt": "kept_exempt"}  # keep_reason -> its counter


@dataclass
class TransferStats:
    """What one forward + backward moved. Times stay None until `read_times()` and off CUDA."""

    packed: int = 0  # saved-tensor references autograd handed to the pack hook
    kept_params: int = 0  # left in place: parameter storage (resident anyway)
    kept_small: int = 0  # left in place: storage below min_bytes, or on another device
    kept_exempt: int = 0  # left in place: packed by an exempt group (the last layers, the head and the loss)
    offloaded: int = 0  # storages copied to host
    shared: int = 0  # references served by a storage already offloaded (views, repeated saves)
    prefetched: int = 0  # H2D copies issued before the backward asked for that storage (issued, not arrived:
    #                      whether a copy was back in time is what the compute stream's H2D wait measures)
    on_demand: int = 0  # H2D copies issued only when the backward asked (it then waits for them)
    fetch_leads: dict = field(
        default_factory=dict
    )  # packing group -> groups the backward was ahead of it when
    #                      its H2D was issued (the least over its storages): the prefetch window, observed
    fetched_unused: int = 0  # H2D copies the backward never unpacked (let go at finish, after their copy)
    unpacked: int = 0  # saved references the backward read back, each counted once (`References`)
    unpacked_again: int = 0  # unpacks of a reference already read back once
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    stash_peak_bytes: int = 0  # most device bytes held at once for D2H copies not yet waited for
    host_peak_bytes: int = 0  # most bytes held in the host arena at once
    host_chunks_allocated: int = (
        0  # host chunks this step had to allocate (0 once the arena holds a step's worth)
    )
    # copy time, both directions (CUDA events; CountingSaveOnCpu: its whole pack / unpack on the compute stream)
    transfer_time_s: float | None = None
    h2d_wait_s: float | None = None  # compute-stream time spent waiting for H2D copies
    d2h_wait_s: float | None = None  # compute-stream time spent waiting for D2H copies before a release
    attempt: int | None = None  # the run_trace attempt this pass trained in (candidates.Offloading.collect);
    #                             None: a pass outside run_trace

    @property
    def exposed_transfer_time_s(self) -> float | None:
        """The glossary's exposed transfer time: what the compute stream waited for copies (None off CUDA).
        A copy queued on the compute stream itself (save_on_cpu) is all exposed: its wait is its whole time."""
        if self.h2d_wait_s is None or self.d2h_wait_s is None:
            return None
        return self.h2d_wait_s + self.d2h_wait_s


def pass_label(stats: TransferStats) -> str:
    """Which pass a TransferStats counts: its run_trace attempt, or "untraced" (a pass outside run_trace)."""
    return "untraced" if stats.attempt is None else f"attempt {stats.attempt}"


def per_pass(passes: list[TransferStats], value: Callable[[TransferStats], object]) -> str:
    """One value per pass, each labelled with the pass (`pass_label`): 'attempt 0: 1, attempt 1: 0, …'."""
    return ", ".join(f"{pass_label(s)}: {value(s)}" for s in passes)


def describe(passes: list[TransferStats]) -> str:
    """Task5's printout of an offload's counts: the first pass's saved references by what became of them, the
    bytes each way and when the H2D copies were issued, the stash and the host arena, the times (CUDA only), and
    per pass, labelled with its attempt (`pass_label`), what varies (host chunks allocated, fetched copies never
    used, references read back). Times are None off CUDA (and until read_times): said so."""
    st = passes[0]
    times = f"transfer_time_s = {st.transfer_time_s}   exposed_transfer_time_s = {st.exposed_transfer_time_s}"
    return "\n".join(
        [
            f"saved references packed: {st.packed} = {st.kept_params} parameters + {st.kept_small} small + "
            f"{st.kept_exempt} last-layer/head/loss kept in place + {st.offloaded} storages offloaded + "
            f"{st.shared} served by a storage already offloaded",
            f"D2H {st.d2h_bytes:,} B   H2D {st.h2d_bytes:,} B   H2D issued before the backward asked: "
            f"{st.prefetched} of {st.offloaded}, issued when it asked: {st.on_demand}",
            f"device bytes held until their D2H was waited for: at most {st.stash_peak_bytes:,} B; host arena: "
            f"{st.host_peak_bytes:,} B; host chunks allocated by pass: {per_pass(passes, lambda s: s.host_chunks_allocated)}",
            times + ("" if st.transfer_time_s is not None else "   (CPU: not meaningful, recorded as null)"),
            f"H2D copies the backward never used, by pass: {per_pass(passes, lambda s: s.fetched_unused)}; saved references "
            f"read back (of those packed), read again: {per_pass(passes, lambda s: (s.unpacked, s.packed, s.unpacked_again))}",
        ]
    )


class References:
    """Each saved reference's unpacks, counted into the stats: a pack hook takes `new()`, its unpack calls
    `read(ref)`. After a backward, every reference read back exactly once is `unpacked == packed` and
    `unpacked_again == 0`: none forgotten (a saved tensor whose node's backward never ran), none read twice."""

    def __init__(self, stats: TransferStats) -> None:
        self.stats = stats
        self._count = 0
        self._read: set[int] = set()

    def new(self) -> int:
        self._count += 1
        return self._count - 1

    def read(self, ref: int) -> None:
        if ref in self._read:
            self.stats.unpacked_again += 1
        else:
            self._read.add(ref)
            self.stats.unpacked += 1


@dataclass(eq=False)
class Entry:
    """One moved storage: where its bytes are at each moment of the step."""

    index: int
    group: int
    nbytes: int
    version: int  # the source's version counter when packed: a later in-place write makes it another tensor
    refs: int = 1  # saved references to it still to be unpacked
    slot: object = None  # its place in the host arena (the copy path's handle)
    source: object = None  # the device storage, held until its D2H was waited for (the stash)
    fetched: object = None  # the device copy made by the H2D, held until its last reference is unpacked
    used: bool = False  # the backward has unpacked the fetched copy at least once
    released: bool = False  # the fetched copy has been let go: unpacking again is an error


@dataclass
class OffloadBook:
    """Decisions and counts of one ActivationOffload; the copy path does what they say."""

    min_bytes: int
    exempt_from: int | None = None  # groups >= this stay on the device; None: none is exempt
    prefetch_groups: int = 2
    stash_groups: int = 1
    stats: TransferStats = field(default_factory=TransferStats)
    entries: list[Entry] = field(default_factory=list)
    group: int = EMBED_GROUP  # the group the forward is in
    backward_started: bool = False
    _stash: list[Entry] = field(default_factory=list)
    _stash_bytes: int = 0
    _host_bytes: int = 0

    def __post_init__(self) -> None:
        if self.min_bytes < 0 or self.prefetch_groups < 0 or self.stash_groups < 0:
            raise TrainmechError(
                f"min_bytes, prefetch_groups and stash_groups must be ≥ 0, got "
                f"{self.min_bytes}, {self.prefetch_groups}, {self.stash_groups}"
            )

    # -- forward ---------------------------------------------------------------------------
    def keep_reason(self, nbytes: int, is_param: bool, same_device: bool) -> str | None:
        """Why a packed storage stays where it is ("param" / "small" / "exempt"), or None: it moves."""
        if is_param:
            return "param"
        if nbytes < self.min_bytes or not same_device:
            return "small"
        if self.exempt_from is not None and self.group >= self.exempt_from:
            return "exempt"
        return None

    def count_kept(self, reason: str) -> None:
        self.stats.packed += 1
        counter = _KEPT[reason]
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def share(self, entry: Entry) -> None:
        """Another saved reference to a storage already moved."""
        self.stats.packed += 1
        self.stats.shared += 1
        entry.refs += 1

    def new_entry(self, nbytes: int, version: int) -> Entry:
        """A storage to move: counted, placed in the stash until its copy is waited for."""
        if self.backward_started:
            raise TrainmechError(
                "ActivationOffload packed a tensor after the backward started: one instance serves one "
                "forward + backward; use a new one (or finish() this one) for the next step"
            )
        e = Entry(len(self.entries), self.group, nbytes, version)
        self.entries.append(e)
        self._stash.append(e)
        self._stash_bytes += nbytes
        self._host_bytes += nbytes
        self.stats.packed += 1
        self.stats.offloaded += 1
        self.stats.d2h_bytes += nbytes
        self.stats.stash_peak_bytes = max(self.stats.stash_peak_bytes, self._stash_bytes)
        self.stats.host_peak_bytes = max(self.stats.host_peak_bytes, self._host_bytes)
        return e

    def start_group(self, group: int) -> list[Entry]:
        """The forward enters `group`; returns the stashed entries whose device storage may go now."""
        self.group = group
        return self._let_go(lambda e: e.group <= group - 1 - self.stash_groups)

    def _let_go(self, due) -> list[Entry]:
        out = [e for e in self._stash if due(e)]
        if out:
            self._stash = [e for e in self._stash if not due(e)]
            self._stash_bytes -= sum(e.nbytes for e in out)
        return out

    # -- backward --------------------------------------------------------------------------
    def start_backward(self) -> list[Entry]:
        """The first unpack: every stashed storage may go (its copy is waited for first)."""
        self.backward_started = True
        return self._let_go(lambda e: True)

    def to_fetch(self, group: int) -> list[Entry]:
        """The backward touches `group`: moved storages of groups group - prefetch_groups … group not
        fetched yet and still needed, nearest (last packed) first."""
        low = group - self.prefetch_groups
        return [
            e
            for e in reversed(self.entries)
            if low <= e.group <= group and e.fetched is None and not e.released and e.refs > 0
        ]

    def fetching(self, entry: Entry, ahead: bool, touched: int | None = None) -> None:
        """An H2D for `entry` is issued while the backward touches group `touched` (None: its own group)."""
        self.stats.h2d_bytes += entry.nbytes
        lead = (entry.group if touched is None else touched) - entry.group
        self.stats.fetch_leads[entry.group] = min(lead, self.stats.fetch_leads.get(entry.group, lead))
        if ahead:
            self.stats.prefetched += 1
        else:
            self.stats.on_demand += 1

    def refuse_if_released(self, entry: Entry) -> None:
        """Unpacking a storage whose fetched copy is already gone is an error, said in one sentence."""
        if entry.released or entry.refs <= 0:
            raise TrainmechError(
                "ActivationOffload: a saved tensor was unpacked again after its last use, and its fetched copy is gone; "
                "each saved reference is unpacked once per backward, so a second backward over the same graph "
                "(backward(retain_graph=True) twice) needs the activations kept on the device: run it without offload"
            )

    def unpacked(self, entry: Entry) -> bool:
        """One saved reference to `entry` was unpacked; True when it was the last (its copy may go)."""
        self.refuse_if_released(entry)
        entry.used = True
        entry.refs -= 1
        if entry.refs == 0:
            entry.released = True
            return True
        return False

    def finish(self) -> None:
        """The step is over: every host byte is free again."""
        self._host_bytes = 0
        self._stash, self._stash_bytes = [], 0
