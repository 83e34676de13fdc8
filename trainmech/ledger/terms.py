"""What one device's measurements are held to on Task4's page: values the device picks, never other code.

    TERMS = device_terms("cuda")                    # CUDA's points, per-layer slack, tolerances
    pair = allocator_pair(first, steady, ...)       # the pair with an allocator's peaks counted

Task4 runs the same cells on a CPU and on a GPU; only these values differ. A CPU test runs every one of
those cells' calls with CUDA's terms and CUDA's choices forced (math SDPA for fp32 grouped-query
attention, foreach AdamW, an allocator counted), so that a GPU run cannot fail for a reason a CPU
could have caught.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmech.errors import TrainmechError
from trainmech.ledger import compare

__all__ = ["DeviceTerms", "device_terms", "allocator_pair"]


@dataclass(frozen=True)
class DeviceTerms:
    """The values Task4's checks take on one device.

    points: the (model -> [(batch, seq)]) points of the baseline table. slack_bytes_per_layer: what a
    measured storage count may differ from the ledger by per decoder layer (CPU none; CUDA a scalar a
    kernel keeps that the inventory does not name). lifecycle_tolerance: (relative, bytes) per
    (category, created, released) group. A whole step's counts (each phase's maximum, each category of
    the peak's composition) get the per-layer slack once per layer (`step_slack_bytes`; CPU none), the
    bound scenario-measured and the update's variants use: the tracker counts the device's storages
    exactly on CUDA too, so a relative tolerance would hide a mis-weighed tensor. exact_points: every point's predicted peak equals the measured one byte for byte (the CPU counts
    the tensor storages the ledger names; CUDA counts the allocator's rounded blocks).
    allocator_model_tolerance: the allocator model's allocated peak against the allocator's measured one
    (relative: the allocator's own count, with blocks and scratch the tracker cannot see).
    reserved_model_tolerance: the model's reserved peak against the allocator's (None: not claimed; the
    CPU allocator reports no reserved peak).
    allocator_tracked_tolerance: the allocator's peak against the tracked tensors (None: not claimed;
    on CUDA the allocator's peak has rounding and kernel scratch the tracker cannot see).
    blas_workspace_measured: the warm-up measures the cuBLAS workspaces (CUDA only).
    exact_engines: section 8's exact bytes, bitwise results and collective counts were checked on the
    torch the CPU profile pins; the GPU machine's torch differs.
    allocator_rounds: the device's allocator rounds blocks as the allocator model does (CUDA's caching
    allocator; the CPU allocator does not round to 512 B), so the model must beat the unrounded tensor
    count there (`AllocatedReserved.model_beats_tracked`).
    torch_pinned: the device's profile pins the torch version (CPU; the CUDA profile accepts the GPU
    machine's torch as it is): the SDPA rule (`attention_kernel`) is claimed equal to the dispatched
    kernel only there; elsewhere a difference is printed as drift (`Comparison.kernel_line`).
    """

    device: str
    points: dict
    slack_bytes_per_layer: int
    lifecycle_tolerance: tuple[float, int]
    exact_points: bool
    allocator_model_tolerance: float
    reserved_model_tolerance: float | None
    allocator_tracked_tolerance: float | None
    blas_workspace_measured: bool
    exact_engines: bool
    torch_pinned: bool
    allocator_rounds: bool

    @property
    def on_cuda(self) -> bool:
        return self.device == "cuda"

    def step_slack_bytes(self, num_layers: int) -> int:
        """What a whole step's count (a phase's maximum, a category of the peak) may differ from the ledger
        by, in bytes: the per-layer slack once per decoder layer (CPU: 0, byte for byte)."""
        return self.slack_bytes_per_layer * num_layers


_TERMS = {
    "cpu": DeviceTerms(
        "cpu", compare.CPU_POINTS, 0, (0.0, 0), True, 0.05, None, 0.01, False, True, True, False
    ),
    "cuda": DeviceTerms(
        "cuda",
        compare.CUDA_POINTS,
        compare.CUDA_SLACK_BYTES_PER_LAYER,
        compare.CUDA_LIFECYCLE_TOLERANCE,
        False,
        0.05,
        0.05,
        None,
        True,
        False,
        False,
        True,
    ),
}


def device_terms(device: str) -> DeviceTerms:
    """The terms of `device` ("cpu" or "cuda")."""
    if device not in _TERMS:
        raise TrainmechError(f"no terms for device {device!r}: valid are {', '.join(_TERMS)}")
    return _TERMS[device]


def allocator_pair(
    first: compare.Comparison, steady: compare.Comparison, **options
) -> tuple[compare.Comparison, compare.Comparison]:
    """(first, steady) with an allocator's peaks counted: the pair itself when it carries them (CUDA's
    caching allocator is counted by default, or the pair ran with allocator="cpu-profiler"); otherwise
    the same point again under torch.profiler's CPU allocator events (`options`: compare.measure_point's, e.g.
    run_mode, seed, dtype, padded, as the pair was measured)."""
    if steady.measured.step_peak_allocated_bytes is not None:
        return first, steady
    again = compare.measure_point(first.model, first.batch, first.seq, allocator="cpu-profiler", **options)
    return again[0], again[1]
