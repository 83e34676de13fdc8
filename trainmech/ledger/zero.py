"""The ledger over N data-parallel devices: ZeRO's partitioning applied moment by moment.

ZeRO's stages partition the model states over N devices (stage 1 the optimizer states, stage 2 the
gradients too, stage 3 the parameters too); each device keeps its own micro-batch's activations,
saved tensors and upstream gradients whole. With the optimizer states partitioned, each device also
runs the update on its shard only, so the update's workspace (AdamW's foreach sqrt temporary) is
partitioned too. The projection takes the ledger's every tick, divides what the stage partitions,
and keeps the largest tick: the per-device peak can move to another moment than the one-device peak.

The vocabulary-sized loss buffers (the fp32 log-softmax, the NLL gradient, dlogits) are reported as
their own line: no ZeRO stage, checkpointing or offload touches them; a chunked or fused
cross-entropy (which never materialises b·s·V fp32 values) does.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmech.ledger.categories import CATEGORIES
from trainmech.ledger.clock import AFTER, BEFORE
from trainmech.ledger.formulas import _check_stage

ZERO_SPLIT = {0: (), 1: ("optimizer_states",), 2: ("optimizer_states", "gradients"),
              3: ("optimizer_states", "gradients", "parameters")}
LOSS_BUFFERS = ("logits", "logits_fp32", "loss.log_softmax", "loss.nll_grad", "dlogits_fp32", "dlogits")


@dataclass(frozen=True)
class DevicePeak:
    """The per-device peak of a ZeRO stage on N devices: its tick, bytes, composition, and the loss buffers in it."""

    devices: int
    stage: int
    tick: str
    bytes: float
    by_category: dict[str, float]
    loss_buffer_bytes: int  # vocabulary-sized loss buffers alive at that tick (inside by_category)

    @property
    def loss_buffer_share(self) -> float:
        return self.loss_buffer_bytes / self.bytes


def loss_buffers_by_tick(book) -> list[int]:
    """Bytes of the vocabulary-sized loss buffers alive at each tick."""
    index = {t: k for k, t in enumerate(book.ticks)} | {BEFORE: -1, AFTER: len(book.ticks)}
    out = [0] * len(book.ticks)
    for st in book.states:
        if st.name in LOSS_BUFFERS:
            for k in range(max(index[st.created], 0), min(index[st.released_at], len(book.ticks) - 1) + 1):
                out[k] += st.nbytes
    return out


def per_device(book, devices: int, stage: int) -> DevicePeak:
    """The per-device peak of `book`'s step under ZeRO `stage` on `devices` data-parallel devices."""
    _check_stage(stage, devices)
    split = ZERO_SPLIT[stage]
    loss = loss_buffers_by_tick(book)
    best = None
    for k, (tick, row) in enumerate(book.live()):
        shares = {c: row[c] / devices if c in split or (c == "workspace" and stage >= 1) else float(row[c]) for c in CATEGORIES}
        total = sum(shares.values())
        if best is None or total > best.bytes:
            best = DevicePeak(devices, stage, tick, total, shares, loss[k])
    return best
