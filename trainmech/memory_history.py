"""Memory histories: the allocator's own block-by-block history of a training step (CUDA,
`torch.cuda.memory._record_memory_history`), labelled by the tracker's categories, or the tracker's
history of tensor storages where no allocator history exists (CPU).

`measure` re-exports every public name here.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainmech.ledger.allocator import round_size

if TYPE_CHECKING:
    from trainmech.measure import StepMemory

__all__ = [
    "ALLOCATOR_ONLY",
    "FINITENESS_CHECK",
    "HistoryBlock",
    "MemoryHistory",
    "history_from_tracker",
    "cuda_memory_history",
    "step_history",
]


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

    def peak_bytes(self) -> int:
        """The most bytes its blocks hold at once: the top of the drawn bands (the baseline, alive before the
        recording began, is not in it)."""
        ends = [
            self.events,
            *(b.born for b in self.blocks),
            *(b.died for b in self.blocks if b.died is not None),
        ]
        change = [0] * (max(ends) + 2)
        for block in self.blocks:
            change[block.born] += block.nbytes
            if block.died is not None:
                change[block.died] -= block.nbytes
        alive = top = 0
        for step in change:
            alive += step
            top = max(top, alive)
        return top

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
    """A snapshot frame of `measure._finite` (a Python frame: stacks="python")."""
    from trainmech import measure  # measure imports this module

    return frame.get("name") == measure._finite.__name__ and str(frame.get("filename", "")).endswith(
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
