"""torch's save_on_cpu(pin_memory=True), its pack and unpack written out, with what they move counted.

Every saved tensor goes to the host, parameters and small tensors included, once per saved
reference, as a contiguous copy (`torch.empty(size)` then `copy_`: a transposed view comes back with
other strides). On CUDA the host buffer is pinned memory from the caching host allocator; the H2D copy
is `non_blocking`, and whether the D2H `copy_` is too depends on the torch version (older ones copy
synchronously, so the host waits at every pack): `pack_copy_line()` reads it from the installed
source. Either way every copy is queued on the compute stream, so none overlaps with compute and its
whole time is exposed (its wait is its pack / unpack time). Off CUDA torch does not pin, and the "H2D"
`.to(device)` hands back the host tensor itself; the bytes are counted all the same (they are what a
GPU run moves).

The bytes are counted from what torch's pack returned, not from the tensor handed to it: every pack's
host tensor must be on the host, in a storage of its own, as many bytes as the saved tensor, and on
CUDA pinned; a pack that breaks one of these raises (`check_host_copy`). The CUDA events bracket
torch's whole pack / unpack on the compute stream (a pinned allocation on a cache miss included, and
a host-synchronous copy where the D2H is not `non_blocking`): pack / unpack time, not the DMA alone.
"""

from __future__ import annotations

import inspect

import torch

from trainmech.errors import TrainmechError
from trainmech.offload.book import References, TransferStats

__all__ = ["CountingSaveOnCpu", "check_host_copy", "pack_copy_line", "pack_copy_note"]


def check_host_copy(saved: torch.Tensor, host: torch.Tensor, *, pinned: bool) -> int:
    """The bytes of `host`, torch's copy of `saved`, after checking it is one: on the host, in a storage other
    than `saved`'s, `saved.numel() * saved.element_size()` bytes, and pinned when `pinned`. Raises otherwise."""
    nbytes = saved.numel() * saved.element_size()
    problem = (
        f"it is on {host.device}, not the host"
        if host.device.type != "cpu"
        else "it shares the saved tensor's storage (nothing was copied)"
        if host.untyped_storage().data_ptr() == saved.untyped_storage().data_ptr()
        else f"it holds {host.nbytes:,} B, the saved tensor {nbytes:,} B"
        if host.nbytes != nbytes
        else "it is not in pinned memory"
        if pinned and not host.is_pinned()
        else None
    )
    if problem is not None:
        raise TrainmechError(
            f"save_on_cpu's pack did not return a host copy of the saved tensor: {problem}; a pack must return "
            "a host tensor of its own with the saved tensor's bytes (pinned on CUDA)."
        )
    return host.nbytes


def pack_copy_line() -> str:
    """The line of the installed torch's `save_on_cpu` whose `copy_` moves a saved tensor to pinned host memory:
    whether it passes `non_blocking` (the host does not wait for the D2H copy) differs between torch versions."""
    lines = inspect.getsource(torch.autograd.graph.save_on_cpu).splitlines()
    return next((line.strip() for line in lines if ".copy_(" in line), "")


def pack_copy_note() -> str:
    """Task5's line on `pack_copy_line()`: the installed torch's version, the line, and what it means for the host."""
    line = pack_copy_line()
    means = (
        "non_blocking from pinned memory, so the host does not wait for it; it still runs on the compute stream, "
        "in line with compute"
        if "non_blocking" in line
        else "a synchronous copy: the host waits for every D2H"
    )
    return f"torch {torch.__version__.split('+')[0]}: save_on_cpu's D2H copy is written `{line}`: {means}"


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """save_on_cpu whose pack / unpack count bytes and, on CUDA, record events read after the timed steps."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__(pin_memory=True)
        self.stats = TransferStats()
        self.refs = References(self.stats)
        self.cuda = torch.device(device).type == "cuda"
        self._copies: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {"d2h": [], "h2d": []}
        self._torch_pack, self._torch_unpack = self.pack_hook, self.unpack_hook  # torch's own pair
        self.pack_hook, self.unpack_hook = self.pack, self.unpack  # read when the hooks are entered

    def __enter__(self) -> CountingSaveOnCpu:
        super().__enter__()
        return self

    def _mark(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def pack(self, t: torch.Tensor):
        """D2H: a (pinned) host copy of every saved tensor, on the compute stream; its bytes counted from torch's copy."""
        start = self._mark()
        packed = self._torch_pack(t)
        if self.cuda:
            self._copies["d2h"].append((start, self._mark()))
        nbytes = check_host_copy(t, packed[1], pinned=self.cuda)
        self.stats.packed += 1
        self.stats.offloaded += 1
        self.stats.d2h_bytes += nbytes
        return self.refs.new(), packed

    def unpack(self, packed) -> torch.Tensor:
        """H2D: the host copy back to the device it came from, on the compute stream; its bytes are the host copy's."""
        ref, packed = packed
        start = self._mark()
        t = self._torch_unpack(packed)
        self.refs.read(ref)
        if self.cuda:
            self._copies["h2d"].append((start, self._mark()))
        device, host = packed
        if t.device != device:
            raise TrainmechError(
                f"save_on_cpu's unpack returned a tensor on {t.device}; it must come back to {device}, where it was saved."
            )
        self.stats.h2d_bytes += host.nbytes
        return t

    def finish(self) -> TransferStats:
        return self.stats

    def read_times(self) -> TransferStats:
        """CUDA: the copies' time from the events (waits for the device once), each direction's also its wait:
        the copies run on the compute stream, so all of it is exposed; off CUDA: None."""
        if self.cuda:
            torch.cuda.synchronize()
            spent = {k: sum(s.elapsed_time(e) for s, e in pairs) / 1e3 for k, pairs in self._copies.items()}
            self.stats.d2h_wait_s, self.stats.h2d_wait_s = spent["d2h"], spent["h2d"]
            self.stats.transfer_time_s = spent["d2h"] + spent["h2d"]
        return self.stats
