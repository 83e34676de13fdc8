"""Activation offload: keep saved tensors in host memory between forward and backward (transfer pays).

- `book`: the bookkeeping — what moves, what is shared, when a device copy may go, when to fetch;
- `copies`: the CUDA copy path (cached side streams, events, one pinned arena), its device calls behind a
  small backend (`CudaStreams`, or `HostStreams` to run it on a CPU), and the plain CPU copies;
- `hooks`: `ActivationOffload`, the saved-tensor hooks that join the two (`activation_offload(model)` builds
  one for a causal LM), and `restore_check`;
- `overlap`: how much copy time ran while the compute stream was busy (interval arithmetic, from events or a
  profiler trace);
- `save_on_cpu`: torch's own `save_on_cpu`, counted, as the simple baseline;
- `nominal`: compute or transfer — datasheet link and FP32 rates, and one step's FLOPs.
"""

from trainmech.offload.book import OffloadBook, TransferStats, describe, per_pass
from trainmech.offload.copies import HostArena, HostStreams, host_arena
from trainmech.offload.hooks import ActivationOffload, activation_offload, restore_check
from trainmech.offload.nominal import (
    NOMINAL,
    crossover_flops_per_byte,
    flops_per_byte,
    serial_x_scaled,
    step_flops,
)
from trainmech.offload.overlap import Overlap, overlap, trace_intervals
from trainmech.offload.save_on_cpu import CountingSaveOnCpu, check_host_copy, pack_copy_line, pack_copy_note

__all__ = [
    "ActivationOffload",
    "activation_offload",
    "describe",
    "per_pass",
    "CountingSaveOnCpu",
    "check_host_copy",
    "HostArena",
    "HostStreams",
    "NOMINAL",
    "OffloadBook",
    "Overlap",
    "TransferStats",
    "host_arena",
    "overlap",
    "pack_copy_line",
    "pack_copy_note",
    "restore_check",
    "step_flops",
    "flops_per_byte",
    "crossover_flops_per_byte",
    "serial_x_scaled",
    "trace_intervals",
]
