"""The ledger itself: every state of one training step on the step's clock, and what follows from it.

book = training_state_lifecycle("qwen2.5-0.5b", batch=2, seq=512, device="cuda")
book.peak_overlap()           # the tick and phase of the peak, its bytes, its composition by category
book.forward_backward_peak()  # the peak before the update (what checkpointing and offload act on)
book.states                   # every State: category, bytes, created / last consumed / released_at tick
book.offloaded(min_bytes)     # the same step with activation offload (ActivationOffload's groups, stash, prefetch)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from dataclasses import dataclass
from typing import Any

from trainmech.errors import TrainmechError
from trainmech.ledger.categories import CATEGORIES
from trainmech.ledger.clock import (
    AFTER,
    BEFORE,
    UPDATE_SUFFIX,
    State,
    is_forward_or_backward,
    phase_of,
    ticks,
)
from trainmech.ledger.inventory import DEVICES, attention_kernel
from trainmech.ledger.recipes import recipe
from trainmech.ledger.shape import model_shape
from trainmech.ledger.states import (
    CHECKPOINTING,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    Setup,
    layer_rows,
    step_states,
)

__all__ = ["Peak", "Ledger", "training_state_lifecycle"]


@dataclass(frozen=True)
class Peak:
    """The peak overlap: where the most bytes are alive at once, and which categories they are."""

    tick: str
    bytes: int
    by_category: dict[str, int]

    @property
    def phase(self) -> str:
        return phase_of(self.tick)


@dataclass(frozen=True)
class Ledger:
    """Every state of one training step on the step's clock; built by `training_state_lifecycle`."""

    setup: Setup
    ticks: tuple[str, ...]
    states: tuple[State, ...]

    # the setup's fields, under the names callers read
    shape = property(lambda self: self.setup.shape)
    batch = property(lambda self: self.setup.batch)
    seq = property(lambda self: self.setup.seq)
    recipe = property(lambda self: self.setup.recipe)
    optimizer = property(lambda self: self.setup.optimizer)
    checkpointing = property(lambda self: self.setup.checkpointing)
    device = property(lambda self: self.setup.device)
    first_step = property(lambda self: self.setup.first_step)
    attention = property(lambda self: self.setup.kernel)  # the SDPA kernel the ledger assumed

    def layer_saved(self) -> list:
        """What one decoder layer saves for its backward in this step (`ledger.layer_saved` with this step's
        recipe, kernel, device, mask and RNG weighing): the rows behind every layer's saved states."""
        return layer_rows(self.setup)

    def live(self) -> list[tuple[str, dict[str, int]]]:
        """(tick, bytes alive by category) for every tick of the step."""
        return list(zip(self.ticks, self._alive))

    @functools.cached_property
    def _alive(self) -> list[dict[str, int]]:
        """Bytes alive by category at each tick: one pass over the states and one over the ticks."""
        n = len(self.ticks)
        index = {t: k for k, t in enumerate(self.ticks)} | {BEFORE: -1, AFTER: n}
        change = {
            c: [0] * n for c in CATEGORIES
        }  # bytes that become alive (+) or stop being alive (-) at a tick
        for st in self.states:  # alive from its created tick to its released_at tick, both included
            first, last = max(index[st.created], 0), min(index[st.released_at], n - 1)
            if first <= last:
                change[st.category][first] += st.nbytes
                if last + 1 < n:
                    change[st.category][last + 1] -= st.nbytes
        alive = {c: list(itertools.accumulate(change[c])) for c in CATEGORIES}
        return [{c: alive[c][k] for c in CATEGORIES} for k in range(n)]

    def by_phase(self) -> dict[str, int]:
        """Phase -> most bytes alive at any of its ticks."""
        out: dict[str, int] = {}
        for tick, row in self.live():
            out[phase_of(tick)] = max(out.get(phase_of(tick), 0), sum(row.values()))
        return out

    def peak_overlap(self, where=lambda tick: True) -> Peak:
        """The first tick with the most bytes alive (among the ticks `where` accepts), and its composition."""
        tick, row = max(
            ((t, alive) for t, alive in self.live() if where(t)), key=lambda pair: sum(pair[1].values())
        )
        return Peak(tick, sum(row.values()), row)

    def forward_backward_peak(self) -> Peak:
        """The peak before the update: forward, loss and backward ticks only."""
        return self.peak_overlap(is_forward_or_backward)

    def state_bytes(self) -> dict[str, int]:
        """Each category's own largest footprint over the step (they need not coincide: see peak_overlap)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for _, row in self.live():
            for c in CATEGORIES:
                out[c] = max(out[c], row[c])
        return out

    def saved_after_forward(self) -> int:
        """Saved bytes still alive once the forward's last tick ("loss") is over: a state released at that
        tick (an offloaded state whose device copy leaves then) is not counted."""
        index = {t: k for k, t in enumerate(self.ticks)} | {BEFORE: -1, AFTER: len(self.ticks)}
        last = index["loss"]
        return sum(
            st.nbytes
            for st in self.states
            if st.category == "saved" and index[st.created] <= last < index[st.released_at]
        )

    def crossing_lifecycles(self) -> dict[tuple[str, str, str | None], int]:
        """(category, created phase, released phase or None) -> bytes, for the states that cross a phase
        boundary during the step (the same key `trainmech.measure.StepMemory.lifecycles` gives)."""
        out: dict[tuple[str, str, str | None], int] = {}
        for st in self.states:
            if st.created == BEFORE:
                continue  # parameters, and optimizer states after the first update: alive before the step
            key = (
                st.category,
                phase_of(st.created),
                None if st.released_at == AFTER else phase_of(st.released_at),
            )
            if key[1] != key[2]:
                out[key] = out.get(key, 0) + st.nbytes
        return out

    def offloaded(
        self,
        min_bytes: int = 1 << 20,
        *,
        exempt_last: int = 1,
        prefetch_groups: int = 2,
        stash_groups: int = 1,
    ) -> Ledger:
        """The same step under `trainmech.offload.activation_offload` (device bytes only; the host
        copies are not on the device); the keyword defaults are the harness's.

        A saved state of ≥ min_bytes that layer j < L - exempt_last packs stays a saved state but lives on
        the device twice: from its creation until the compute stream waits for its D2H, when layer
        j + 1 + stash_groups starts (the stash); and from its H2D, issued when the backward reaches layer
        j + prefetch_groups (at once if that is above the last layer), to its original release. min_bytes is
        compared with a state's bytes, the hooks compare a storage's: the same wherever the ledger lists one
        state per storage (RoPE's cos and sin are one state of two storages, far below min_bytes on real shapes).
        """
        n = self.shape.num_layers
        first_backward = next(t for t in self.ticks if t.startswith("backward"))
        states = []
        for st in self.states:
            if not self._offloads(st, min_bytes, exempt_last):
                states.append(st)
                continue
            j = _packing_layer(st, n)
            on_device_until = f"forward.layer.{min(j + stash_groups, n - 1)}"
            back = j + prefetch_groups
            fetched_at = (
                next(t for t in self.ticks if phase_of(t) == f"backward.layer.{back}")
                if back < n
                else first_backward
            )
            states.append(
                dataclasses.replace(
                    st,
                    name=st.name + " (until its D2H is waited for)",
                    last_consumed=on_device_until,
                    released_at=on_device_until,
                )
            )
            states.append(
                State(
                    st.name + " (fetched back)",
                    "saved",
                    st.nbytes,
                    fetched_at,
                    st.last_consumed,
                    st.released_at,
                )
            )
        return dataclasses.replace(self, states=tuple(states))

    def offloadable_bytes(self, min_bytes: int = 1 << 20, *, exempt_last: int = 1) -> int:
        """Bytes `offloaded(min_bytes, exempt_last=…)` moves each way in one step."""
        return sum(st.nbytes for st in self.states if self._offloads(st, min_bytes, exempt_last))

    def _offloads(self, st: State, min_bytes: int, exempt_last: int) -> bool:
        n = self.shape.num_layers
        return (
            st.category == "saved" and st.nbytes >= min_bytes and 0 <= _packing_layer(st, n) < n - exempt_last
        )

    def lifecycle_rows(self) -> list[tuple[str, str, int, str, str, str]]:
        """(label, category, bytes, created, last consumed, released): states grouped by category and phases.

        Phases, not ticks; "before" / "after" for states that outlive the step. A label ending in
        ".*" stands for several tensors with the same lifecycle.
        """

        def phase(t: str) -> str:
            return t if t in (BEFORE, AFTER) else phase_of(t)

        groups: dict[tuple[str, str, str, str], list[State]] = {}
        for st in self.states:
            groups.setdefault(
                (st.category, phase(st.created), phase(st.last_consumed), phase(st.released_at)), []
            ).append(st)
        order = {p: k for k, p in enumerate([BEFORE, *dict.fromkeys(phase_of(t) for t in self.ticks), AFTER])}
        rows = []
        for (category, created, consumed, released), members in groups.items():
            names = [m.name for m in members]
            label = names[0] if len(names) == 1 else os.path.commonprefix(names).rpartition(".")[0] + ".*"
            label = " + ".join(names) if label == ".*" else label
            # a layer's saved, upstream and gradient groups share a prefix: say which one a label is
            if label.endswith(".*"):
                label += {"gradients": ".grad", "upstream_grads": ".upstream"}.get(category, "")
            rows.append((label, category, sum(m.nbytes for m in members), created, consumed, released))
        return sorted(rows, key=lambda r: (order[r[3]], order[r[5]], r[0]))

    def options(self, **change) -> dict[str, Any]:
        """The keyword arguments of `training_state_lifecycle` that rebuild this step (with `change` applied)."""
        s = self.setup
        return {
            "dtype": s.recipe,
            "optimizer": s.optimizer,
            "optimizer_impl": s.optimizer_impl,
            "optimizer_in_backward": s.in_backward,
            "checkpointing": s.checkpointing,
            "device": s.device,
            "attention": s.kernel,
            "padded": s.padded,
            "first_step": s.first_step,
            "micro_batches": s.micro_batches,
            "micro_batch": s.micro_batch,
            "set_to_none": s.set_to_none,
            "weigh_rng": s.weigh_rng,
            "repeat_kv": s.repeat_kv,
            "dropout": s.dropout,
            "residual_dropout": s.residual_dropout,
        } | change

    def to_json(self) -> dict[str, Any]:
        peak, fwd_bwd = self.peak_overlap(), self.forward_backward_peak()
        s, options = self.setup, self.options()
        first_step = options.pop("first_step")
        for how_measured in (
            "weigh_rng",
            "repeat_kv",
            "dropout",
            "residual_dropout",
        ):  # not the calculator's options
            options.pop(how_measured)
        return (
            {
                "config": s.shape.name,
                "model_type": s.shape.model_type,
                "n_params": s.shape.n_params,
                "batch": s.batch,
                "seq": s.seq,
            }
            | options
            | {
                "step": "first" if first_step else "steady",
                "peak_bytes": peak.bytes,
                "peak_phase": peak.phase,
                "peak_tick": peak.tick,
                "by_category": peak.by_category,
                "forward_backward_peak_bytes": fwd_bwd.bytes,
                "forward_backward_peak_tick": fwd_bwd.tick,
                "state_bytes": self.state_bytes(),
                "phases": [{"phase": p, "bytes": v} for p, v in self.by_phase().items()],
            }
        )


def _packing_layer(st: State, n_layers: int) -> int:
    """The layer whose forward packs a saved state: the one whose backward consumes it; -1 for the embedding,
    n_layers after the last layer (the head and the loss)."""
    phase = phase_of(st.last_consumed)
    if phase.startswith("backward.layer."):
        return int(phase.rsplit(".", 1)[1])
    return -1 if phase.startswith("backward.embed") else n_layers


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TrainmechError(f"{name} must be a positive integer, got {value!r}")
    return value


def _one_of(name: str, value: Any, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise TrainmechError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")
    return value


def training_state_lifecycle(
    config: Any,
    batch: int,
    seq: int,
    *,
    dtype: str = "fp32",
    optimizer: str = "adamw",
    optimizer_impl: str = "auto",
    optimizer_in_backward: bool = False,
    checkpointing: str = "none",
    device: str = "cpu",
    attention: str = "auto",
    padded: bool = False,
    first_step: bool = False,
    micro_batches: int = 1,
    micro_batch: int | None = None,
    set_to_none: bool = True,
    gradient_buffers: bool = False,
    weigh_rng: bool = False,
    repeat_kv: bool | None = None,
    dropout: bool | None = None,
    residual_dropout: bool = False,
) -> Ledger:
    """The ledger of one training step: every state, its bytes and its lifecycle.

    config: a profile model name, a config.json path, a dict, a transformers config or a ModelShape.
    dtype: a recipe of RECIPES. optimizer: adamw (two moments), sgd, sgd-momentum; optimizer_impl:
    loop / foreach / fused, "auto" is PyTorch's default (a per-tensor loop on CPU, foreach on CUDA);
    optimizer_in_backward: the update runs per parameter in a post-accumulate-grad hook, which frees
    each gradient at once. first_step: the optimizer states are created by this step's update (else
    they exist from an earlier one). checkpointing "full": every decoder layer keeps only its input and
    recomputes its saved tensors in the backward. attention: the SDPA kernel, "auto" is PyTorch's choice
    for this device, dtype and mask (`attention_kernel`); padded: the batch has padding, hence a mask.
    micro_batches / micro_batch: gradient accumulation; the step is micro-batch `micro_batch` (default:
    the last, the one that updates) of its window, and from the second on .grad exists before it starts.
    set_to_none=False: zero_grad zeroes the gradients in place instead of releasing them. gradient_buffers:
    .grad lives in buffers allocated once and kept (DDP's buckets with gradient_as_bucket_view): alive
    before and after every step, each new gradient copied in. weigh_rng: the SDPA kernel's RNG state is
    weighed on this process's GPU (a CUDA run's own point; default: torch's meta kernel, the same on every
    machine). repeat_kv: K and V repeated to every head before SDPA (default: with padding, as transformers
    does; True without: a torch whose kernel refuses enable_gqa, where they must be repeated to run it).
    dropout: attention dropout in the forward (default: the config's attention_dropout > 0; training runs in
    train mode): on a CPU the rule's kernel is then math, which keeps its dropout mask and dropped
    probabilities too. residual_dropout: a dropout on each decoder layer's MLP output (`candidates.residual_dropout`,
    Task6's gate workload), whose multiply keeps its mask (`inventory.layer_saved`).
    """
    shape = model_shape(config)
    b, s = _check_size("batch", batch), _check_size("seq", seq)
    recipe(dtype)
    _one_of("optimizer", optimizer, OPTIMIZERS)
    _one_of("optimizer implementation", optimizer_impl, OPTIMIZER_IMPLS)
    _one_of("checkpointing", checkpointing, CHECKPOINTING)
    _one_of("device", device, DEVICES)
    k = _check_size("micro_batches", micro_batches)
    index = k if micro_batch is None else _check_size("micro_batch", micro_batch)
    if index > k:
        raise TrainmechError(f"micro_batch {index} is past the window of {k} micro-batches")
    if optimizer_in_backward and k > 1:
        raise TrainmechError(
            "optimizer_in_backward updates inside every backward, so it cannot accumulate gradients over micro-batches"
        )
    impl = ("foreach" if device == "cuda" else "loop") if optimizer_impl == "auto" else optimizer_impl
    dropout = shape.attention_dropout > 0 if dropout is None else bool(dropout)
    kernel = attention_kernel(shape, dtype, device, attention, padded=padded, dropout=dropout)
    setup = Setup(
        shape,
        b,
        s,
        dtype,
        optimizer,
        impl,
        bool(optimizer_in_backward),
        checkpointing,
        device,
        kernel,
        bool(padded),
        bool(first_step),
        index,
        k,
        bool(set_to_none),
        bool(gradient_buffers),
        bool(weigh_rng),
        bool(padded if repeat_kv is None else repeat_kv),
        bool(dropout),
        bool(residual_dropout),
    )
    states = step_states(setup)
    updated = {st.created.removesuffix(UPDATE_SUFFIX) for st in states if st.created.endswith(UPDATE_SUFFIX)}
    clock = ticks(shape.num_layers, checkpointing, updated, cast_logits=setup.dtypes.sixteen_bit)
    return Ledger(setup, tuple(clock), tuple(states))
