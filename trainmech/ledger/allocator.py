"""What `allocated` cannot see, and what `reserved` adds: PyTorch's CUDA caching allocator, modelled.

The ledger counts tensor bytes. On a GPU three more things take memory:

1. The caching allocator rounds every block up to 512 bytes (allocated counts the rounded blocks)
   and carves blocks out of segments it reserves from the driver: a 2 MiB segment for blocks up to
   1 MiB, 20 MiB for blocks under 10 MiB, the block rounded up to 2 MiB above. Freed blocks stay
   reserved for reuse; a free block is split when the rest is worth keeping (>= 512 B in the small
   pool, > 1 MiB in the large one), and merged with free neighbours. reserved − allocated is this
   cache and its fragmentation. `CachingAllocatorModel` replays a step's states through these rules
   (c10/cuda/CUDACachingAllocator.cpp: round_size, get_allocation_size, should_split) to predict
   both peaks; `cuda_peaks(book)` replays a first and a steady update. The replay is an
   approximation: within a tick every birth comes before every release, a state is its tensors (a
   lump such as the parameters, one tensor per parameter tensor; a few known groups, such as SDPA's
   four input gradients, split too) allocated together; expandable_segments, max_split_size_mb,
   roundup_power2_divisions and garbage_collection_threshold are not modelled, and a measured step
   whose environment sets any of them is refused (`check_alloc_conf`). Only the environment is read:
   settings changed at run time (torch.cuda.memory._set_allocator_settings) are not seen.
2. cuBLAS and cuBLASLt workspaces, allocated through the same allocator on a handle's first matmul on
   a stream and kept (the backward's device thread has its own handle): inside allocated, outside
   every tensor state. Their size depends on the torch version and on CUBLAS_WORKSPACE_CONFIG,
   CUBLASLT_WORKSPACE_SIZE and TORCH_CUBLASLT_UNIFIED_WORKSPACE, so the ledger assumes none: on a GPU,
   `trainmech.ledger.compare.measure_point` measures them around a warm-up step
   (`Comparison.workspace_bytes`).
3. The CUDA context (driver, loaded kernels): outside allocated and reserved alike; only the
   device's own count (nvidia-smi, cudaMemGetInfo) sees it. The ledger does not model it: gpu-check
   measures it (device used − reserved, in its limits), and `cuda_context()` reads that measurement
   back; without such a report it is unknown (None), never a guess.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

from trainmech.errors import TrainmechError
from trainmech.ledger.clock import AFTER, BEFORE
from trainmech.ledger.recipes import STEP_COUNTER_BYTES

__all__ = [
    "BLOCK_ROUND",
    "SMALL_BLOCK",
    "SMALL_SEGMENT",
    "LARGE_SEGMENT",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "round_size",
    "segment_size",
    "CachingAllocatorModel",
    "replay",
    "CudaPeaks",
    "cuda_peaks",
    "check_alloc_conf",
    "GPU_CHECK_REPORT",
    "CudaContext",
    "cuda_context",
]

BLOCK_ROUND = 512  # kMinBlockSize
SMALL_BLOCK = 1 << 20  # kSmallSize: blocks up to this size come from the small pool
SMALL_SEGMENT = 2 << 20  # kSmallBuffer
LARGE_SEGMENT = 20 << 20  # kLargeBuffer, for blocks under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def round_size(nbytes: int) -> int:
    """The block a request of nbytes gets: at least 512 B, a multiple of 512 B."""
    return max(BLOCK_ROUND, -(-nbytes // BLOCK_ROUND) * BLOCK_ROUND)


def segment_size(block: int) -> int:
    """The segment the allocator reserves when no cached block fits."""
    if block <= SMALL_BLOCK:
        return SMALL_SEGMENT
    if block < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-block // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


@dataclass
class CachingAllocatorModel:
    """Best-fit allocation from cached free blocks, split and merged as PyTorch does; no release to the driver."""

    allocated: int = 0  # bytes in allocated blocks (rounded), as torch.cuda.memory_allocated counts them
    reserved: int = 0  # bytes in segments, as torch.cuda.memory_reserved counts them
    peak_allocated: int = 0
    peak_reserved: int = 0
    _segments: list[list[_Block]] = field(default_factory=list)
    _free: dict[bool, list[tuple[int, int, int]]] = field(
        default_factory=lambda: {True: [], False: []}
    )  # small? -> (size, seg, offset)
    _live: dict[object, _Block] = field(default_factory=dict)

    def malloc(self, key: object, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_BLOCK
        pool = self._free[small]
        k = bisect.bisect_left(pool, (size, -1, -1))
        if k == len(pool):  # nothing cached fits: a new segment
            seg_size = segment_size(size)
            self._segments.append([_Block(len(self._segments), 0, seg_size)])
            self.reserved += seg_size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            block = self._segments[-1][0]
        else:
            _, seg, offset = pool.pop(k)
            block = next(b for b in self._segments[seg] if b.offset == offset)
        rest = block.size - size
        if rest >= BLOCK_ROUND if small else rest > SMALL_BLOCK:  # should_split
            blocks = self._segments[block.segment]
            tail = _Block(block.segment, block.offset + size, rest)
            blocks.insert(blocks.index(block) + 1, tail)
            bisect.insort(pool, (tail.size, tail.segment, tail.offset))
            block.size = size
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        block = self._live.pop(key)
        self.allocated -= block.size
        blocks = self._segments[block.segment]
        small = self._pool_of(blocks)
        block.free = True
        i = blocks.index(block)
        for j in (i + 1, i - 1):  # merge with a free neighbour, the later one first
            if 0 <= j < len(blocks) and blocks[j].free:
                other = blocks[j]
                self._free[small].remove((other.size, other.segment, other.offset))
                first, second = (block, other) if j > i else (other, block)
                first.size += second.size
                blocks.remove(second)
                block = first
                i = blocks.index(block)
        bisect.insort(self._free[small], (block.size, block.segment, block.offset))

    @staticmethod
    def _pool_of(blocks: list[_Block]) -> bool:
        return sum(b.size for b in blocks) == SMALL_SEGMENT


def _pieces(book, state) -> list[int]:
    """The tensors one ledger state stands for: lumps (parameters, optimizer states, the foreach
    temporaries) are one tensor per parameter tensor; the states that name several tensors of one
    operation are split into them (RoPE's cos and sin; its angles, their doubled copy and cos or sin
    before scaling; SDPA's input gradients; the MLP's two gradients at its `mlp` moment); everything
    else is one tensor."""
    numels = [n for _, n in book.shape.parameter_tensors()]
    setup, dtypes = book.setup, book.setup.dtypes
    if state.name == "parameters":
        return [n * dtypes.weight_bytes for n in numels]
    if state.category == "optimizer_states" and state.name.startswith("optimizer.") and "@" not in state.name:
        if state.name == "optimizer.step_counters":
            return [STEP_COUNTER_BYTES] * len(numels)
        per_tensor = ([dtypes.master_bytes] if dtypes.master_bytes else []) + (
            [dtypes.moment_bytes] * {"adamw": 2, "sgd-momentum": 1}.get(book.optimizer, 0)
        )
        return [n * b for n in numels for b in per_tensor]
    if state.name == "optimizer.sqrt_temporaries" and setup.optimizer_impl == "foreach":
        return [n * dtypes.moment_bytes for n in numels]
    b, s, act = setup.batch, setup.seq, dtypes.activation_bytes
    d, heads = book.shape.head_dim, book.shape.num_heads
    q, kv = heads * d, book.shape.num_kv_heads * d
    if state.name == "rope.cos_sin":
        return [state.nbytes // 2] * 2
    if state.name == "rope.angles":
        return [s * d // 2 * 4, s * d * 4, s * d * 4]
    if state.name.endswith(".d_act_d_up"):
        return [state.nbytes // 2] * 2
    if state.name.endswith(".d_sdpa"):
        if setup.kernel == "math":  # the two s×s gradients and the repeated v's
            return [b * heads * s * s * act] * 2 + [b * s * q * act]
        return [b * s * q * act] * 2 + [b * s * kv * act] * 2  # the output's gradient, dq, dk, dv
    return [state.nbytes]


def replay(book, allocator: CachingAllocatorModel, *, keep_before: bool = True) -> CachingAllocatorModel:
    """Run one step's states through the allocator, tick by tick: create what a tick creates, then free
    what it releases (an approximation of the real order, see the module's docstring). States alive
    BEFORE the step are allocated first unless the allocator already holds them (keep_before=False: a
    steady step after `replay` of the first one left them allocated)."""
    order = {t: k for k, t in enumerate(book.ticks)}
    if keep_before:
        for st in book.states:
            if st.created == BEFORE:
                for j, n in enumerate(_pieces(book, st)):
                    allocator.malloc((st.name, j), n)
    by_tick: dict[int, list] = {}
    ends: dict[int, list] = {}
    for st in book.states:
        if st.created != BEFORE:
            by_tick.setdefault(order[st.created], []).append(st)
        if st.released_at != AFTER:
            ends.setdefault(order[st.released_at], []).append(st)
    for k in range(len(book.ticks)):
        for st in by_tick.get(k, []):
            for j, n in enumerate(_pieces(book, st)):
                allocator.malloc((st.name, j), n)
        for st in ends.get(k, []):
            for j in range(len(_pieces(book, st))):
                allocator.free((st.name, j))
    return allocator


@dataclass(frozen=True)
class CudaPeaks:
    """The ledger's tensor peak and the allocator model's peaks for the same step (bytes)."""

    tensor_peak: int
    allocated_peak: int  # rounded blocks, as max_memory_allocated counts them (cuBLAS workspace not included)
    reserved_peak: int  # segments, as max_memory_reserved counts them


UNMODELLED_ALLOC_CONF = (
    "expandable_segments:true",
    "max_split_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "backend:cudamallocasync",
)  # settings the replay does not follow


def check_alloc_conf(conf: str | None) -> None:
    """Refuse an allocator configuration the replay does not model (PYTORCH_CUDA_ALLOC_CONF /
    PYTORCH_ALLOC_CONF): expandable segments grow one segment instead of reserving new ones,
    max_split_size_mb stops large blocks from being split, roundup_power2_divisions changes
    round_size (no longer every block up to 512 B), garbage_collection_threshold frees cached
    blocks, and backend:cudaMallocAsync replaces the caching allocator with CUDA's memory pool (no 2 / 20
    MiB segments, no 512 B blocks); each moves a peak. `conf` is the environment's string: settings changed at run time
    (torch.cuda.memory._set_allocator_settings) are not seen."""
    given = (conf or "").replace(" ", "").lower()
    found = [setting for setting in UNMODELLED_ALLOC_CONF if setting in given]
    if found:
        raise TrainmechError(
            f"the allocator model replays PyTorch's default caching allocator, but the allocator configuration "
            f"{conf!r} sets {', '.join(found)}: unset it (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF) to compare"
        )


def cuda_peaks(first_book, steady_book=None, *, alloc_conf: str | None = None) -> CudaPeaks:
    """Allocated and reserved peaks of the step `steady_book` describes, after the first update `first_book`
    (the allocator keeps the first update's segments); with one book, that step from a fresh allocator.
    alloc_conf: the allocator configuration of the run the replay stands beside (a measured CUDA step);
    one that sets what the replay does not model is refused (`check_alloc_conf`)."""
    check_alloc_conf(alloc_conf)
    allocator = replay(first_book, CachingAllocatorModel())
    book = first_book
    if steady_book is not None:
        allocator.peak_allocated = (
            allocator.allocated
        )  # the steady step's own allocated peak; reserved stays cumulative
        replay(steady_book, allocator, keep_before=False)
        book = steady_book
    return CudaPeaks(book.peak_overlap().bytes, allocator.peak_allocated, allocator.peak_reserved)


# ----------------------------------------------------------------------------- the CUDA context, as measured

GPU_CHECK_REPORT = Path(__file__).resolve().parents[2] / "results" / "gpu-check" / "gpu-check.json"


@dataclass(frozen=True)
class CudaContext:
    """The CUDA context's bytes and where the number comes from; both None when nothing measured it."""

    nbytes: int | None = None
    source: str | None = None


def cuda_context(report: Path | str | None = None) -> CudaContext:
    """The CUDA context a gpu-check report measured (its `limits.cuda_context_bytes`, from a run on a GPU),
    with the report's path, GPU and date as the source. report: default GPU_CHECK_REPORT. No report, an
    unreadable one, a CPU self-test or no measured value: CudaContext() (unknown)."""
    path = Path(report) if report is not None else GPU_CHECK_REPORT
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return CudaContext()
    measured = (data.get("limits") or {}).get("cuda_context_bytes") if isinstance(data, dict) else None
    if data.get("mode") != "cuda" or type(measured) is not int or measured < 0:
        return CudaContext()
    env = data.get("environment") or {}
    try:
        shown = path.resolve().relative_to(GPU_CHECK_REPORT.parents[2])
    except ValueError:
        shown = path
    return CudaContext(
        measured, f"gpu-check report {shown} ({env.get('gpu') or 'GPU unnamed'}, {data.get('started_at')})"
    )
