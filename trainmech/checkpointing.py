"""Activation checkpointing: keep a region's input, drop its saved tensors, recompute them in the backward.

Compute pays: the backward replays the region's forward. The math does not change, so loss and
gradients must equal the baseline's.

    with hf_checkpointing(model):                            # transformers' own, non-reentrant
        model(**batch).loss.backward()
    with checkpoint_layers(model.model.layers, every=2):     # torch.utils.checkpoint, our wrapper
        model(**batch).loss.backward()

Counting: `counting_context` gives checkpoint() a context_fn that counts the aten ops a
checkpointed region runs in the forward and again in the backward (and, with a policy, makes the
checkpoint selective); `count_calls` counts module calls, so a replayed layer shows up as extra
calls during the backward (`counted_update` runs one update's forward and backward so counted); `dispatched_ops` counts, in a plain forward, the ops a policy would
keep, so what a selective checkpoint saves is checked against what really ran; `expected_matmul_ops`
says by name what that should be, from the layers' Linear modules and the attention kernel the ledger
picks for the device (one fused SDPA op, or two `bmm` of the math kernel). Every replay is also announced to
`trainmech.measure` (`born_as("recompute")`): the tensors it re-creates are saved tensors again,
not workspace, in a memory measurement — the same word the ledger uses for them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainmech.measure import born_as

__all__ = [
    "aten",
    "hf_checkpointing",
    "checkpoint_layers",
    "MATMUL_OPS",
    "MATMUL_NAMES",
    "save_matmuls",
    "Region",
    "RecomputeCount",
    "same_replays",
    "counting_context",
    "count_calls",
    "counted_update",
    "dispatched_ops",
    "ATTENTION_OPS",
    "dispatched_kernel",
    "expected_matmul_ops",
]

aten = torch.ops.aten


# ----------------------------------------------------------------------------- the two harnesses


def _announced(context_fn: Callable | None) -> Callable[[], tuple]:
    """context_fn's pair with the recompute side announced to trainmech.measure as a re-creation."""

    def context_fn_announced():
        forward, recompute = context_fn() if context_fn is not None else (nullcontext(), nullcontext())
        return forward, _stacked(born_as("recompute"), recompute)

    return context_fn_announced


@contextmanager
def hf_checkpointing(model: torch.nn.Module, **checkpoint_kwargs) -> Iterator[None]:
    """transformers' own activation checkpointing (non-reentrant) inside the block, off after it.

    checkpoint_kwargs go to torch.utils.checkpoint.checkpoint (e.g. preserve_rng_state=False,
    context_fn=...). Recent transformers name the switch `activation_checkpointing_enable` and
    deprecate `gradient_checkpointing_enable`; whichever this version has is used. Run the model
    with use_cache=False: a KV cache written in a replayed forward would be written twice.

    The switch also calls `enable_input_require_grads()`, a forward hook on the input embeddings that the
    switch's `disable` removes only for a PEFT model; it is removed here on exit, or one more hook would run
    in every later forward for each time the block was entered.
    """
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    kwargs = {
        "use_reentrant": False,
        **checkpoint_kwargs,
        "context_fn": _announced(checkpoint_kwargs.get("context_fn")),
    }
    embeddings = model.get_input_embeddings()
    hooks_before = len(embeddings._forward_hooks)
    enable(kwargs)  # the first parameter in both spellings
    try:
        yield
    finally:
        disable()
        if len(embeddings._forward_hooks) > hooks_before:  # enable_input_require_grads' hook, left by disable
            model.disable_input_require_grads()


@contextmanager
def checkpoint_layers(
    layers: Iterable[torch.nn.Module],
    every: int = 1,
    *,
    context_fn: Callable | None = None,
    preserve_rng_state: bool = True,
) -> Iterator[list[int]]:
    """Run layer i inside torch.utils.checkpoint.checkpoint (non-reentrant) for i % every == 0.

    `context_fn` (e.g. from `counting_context`) is passed on; it decides what a selective
    checkpoint saves. Yields the checkpointed indices; the layers' forwards are restored on exit.
    """
    if every < 1:
        raise ValueError(f"every must be ≥ 1, got {every}")
    chosen = [(i, layer) for i, layer in enumerate(layers) if i % every == 0]
    announced = _announced(context_fn)
    for _, layer in chosen:

        def forward(*args, _plain=layer.forward, **kwargs):  # _plain: the class's bound forward
            return checkpoint(
                _plain,
                *args,
                use_reentrant=False,
                preserve_rng_state=preserve_rng_state,
                context_fn=announced,
                **kwargs,
            )

        layer.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield [i for i, _ in chosen]
    finally:
        for _, layer in chosen:
            del layer.forward


# ----------------------------------------------------------------------------- selective checkpointing

# Selective checkpointing keeps the outputs of the expensive ops and recomputes the cheap rest.
_MATMUL_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
MATMUL_OPS = frozenset(getattr(aten, name).default for name in _MATMUL_NAMES if hasattr(aten, name))
MATMUL_NAMES = frozenset(op.__name__ for op in MATMUL_OPS)  # as the counts name them: "mm.default", …


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective policy: save matmul and attention outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# ----------------------------------------------------------------------------- counting

_ALIASES = frozenset({aten.detach.default, aten._unsafe_view.default})


def _counted(func) -> bool:
    """Ops that compute something: not views or aliases (they move no data)."""
    return func.namespace == "aten" and not func.is_view and func not in _ALIASES


def _unread_entries(per_op) -> int:
    """Outputs one op's slot of torch's selective cache still holds, unread by any recompute. Two layouts: a dict
    (newer torch: key -> output, or the sentinel `_CONSUMED` once handed back, `_RECOMPUTE` for a recomputed op)
    or a list (torch 2.11: only kept outputs are appended, the recompute pops each one it reads)."""
    if isinstance(per_op, dict):
        empty = tuple(
            getattr(torch.utils.checkpoint, n)
            for n in ("_RECOMPUTE", "_CONSUMED")
            if hasattr(torch.utils.checkpoint, n)
        )
        return sum(not any(entry is e for e in empty) for entry in per_op.values())
    return len(per_op)


@dataclass
class Region:
    """One checkpointed region's ops in order (views excluded): those its forward ran, those the recompute reached
    (answered from a selective cache or run again: the top of the recompute's dispatch modes sees both), and
    those run again (below the cache)."""

    forward: list[str] = field(default_factory=list)
    replayed: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    cache: dict | None = field(
        default=None, repr=False
    )  # the selective policy's cache (torch's storage), if any
    stored: int | None = None  # outputs torch's selective cache held when this region's recompute began


def _cache_entries(cache: dict) -> int:
    """Outputs a selective cache holds now (sentinels and consumed entries not counted), in either layout."""
    return sum(_unread_entries(per_op) for per_op in cache.values())


def _cache_bytes(cache: dict) -> int:
    """Bytes of the storages behind the outputs a selective cache holds now (each storage once), in either layout."""
    entries = [
        e for per_op in cache.values() for e in (per_op.values() if isinstance(per_op, dict) else per_op)
    ]
    leaves = [getattr(x, "val", x) for x in torch.utils._pytree.tree_leaves(entries)]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in leaves
        if isinstance(t, torch.Tensor)
    }
    return sum(storages.values())


@contextmanager
def _note_stored(region: Region):
    """Entered first in the recompute: what torch stored in the forward, read before the recompute takes any."""
    if region.stored is None and region.cache is not None:
        region.stored = _cache_entries(region.cache)
    yield


@dataclass
class RecomputeCount:
    """Ops inside checkpointed regions, one `Region` per region a forward ran: run in the forward, kept by a
    policy, reached again in the backward's recompute (read from the cache or run again), or never reached.

    The recompute replays the region's forward in order and stops early (non-reentrant checkpointing) once
    every saved tensor the backward asks for is back, so what it reaches must be a prefix of what the forward
    ran (`replays_are_prefixes`, counted, not assumed); the ops after that prefix are the skipped ones, counted
    one by one (`skipped_by_op`). An op a selective policy kept past the stop is counted as kept but is never
    read from the cache (`kept_unread_ops`)."""

    regions: list[Region] = field(default_factory=list)
    saved_ops: int = 0  # ops whose output a selective policy kept in the forward

    @property
    def forward_ops(self) -> int:
        return sum(len(r.forward) for r in self.regions)

    @property
    def replayed_ops(self) -> int:
        """Ops the recompute reached before its early stop: read from the cache or run again."""
        return sum(len(r.replayed) for r in self.regions)

    @property
    def recomputed_ops(self) -> int:
        return sum(len(r.recomputed) for r in self.regions)

    @property
    def recomputed_by_op(self) -> Counter:
        return Counter(op for r in self.regions for op in r.recomputed)

    @property
    def read_from_cache_ops(self) -> int:
        """Ops the recompute reached and the selective cache answered (reached, not run again)."""
        return self.replayed_ops - self.recomputed_ops

    @property
    def kept_unread_ops(self) -> int:
        """Ops a policy kept whose cached output the recompute never read: past its early stop."""
        return self.saved_ops - self.read_from_cache_ops

    @property
    def left_in_cache_ops(self) -> int | None:
        """Measured, not derived from the counts above: the entries the selective caches still hold after the
        backward, outputs kept in the forward that no recompute consumed (torch marks an entry it hands back
        as consumed, and an op the policy recomputes holds no output). None: no selective cache. Read it, then
        `forget_caches()`: the regions would otherwise keep those outputs alive."""
        caches = [r.cache for r in self.regions if r.cache is not None]
        if not caches:
            return None
        return sum(_cache_entries(cache) for cache in caches)

    @property
    def left_in_cache_bytes(self) -> int | None:
        """Measured like `left_in_cache_ops`: the bytes of the storages behind those unread outputs. None: no cache."""
        caches = [r.cache for r in self.regions if r.cache is not None]
        return sum(_cache_bytes(cache) for cache in caches) if caches else None

    @property
    def stored_ops(self) -> int | None:
        """Measured in torch's selective caches, not the policy's answers: the outputs each region's cache held
        after its forward (read when its recompute began; a region never recomputed, read now). None: no cache."""
        regions = [r for r in self.regions if r.stored is not None or r.cache is not None]
        if not regions:
            return None
        return sum(r.stored if r.stored is not None else _cache_entries(r.cache) for r in regions)

    def forget_caches(self) -> int | None:
        """Drop the references to the selective caches (and the unread outputs in them); returns what
        `left_in_cache_ops` read in them just before."""
        left = self.left_in_cache_ops
        for r in self.regions:
            r.cache = None
        return left

    @property
    def replays_are_prefixes(self) -> bool:
        """In every region the recompute reached the forward's ops in the forward's order, up to where it stopped."""
        return all(r.replayed == r.forward[: len(r.replayed)] for r in self.regions)

    @property
    def skipped_by_op(self) -> Counter:
        """The forward's ops after the point where each region's recompute stopped, by name: never run again."""
        return Counter(op for r in self.regions for op in r.forward[len(r.replayed) :])

    @property
    def skipped_ops(self) -> int:
        """Forward ops the recompute never reached (its early stop), counted one by one."""
        return sum(self.skipped_by_op.values())


class _OpCounter(TorchDispatchMode):
    """Appends each counted op's name to `ops` (one of a Region's lists)."""

    def __init__(self, ops: list[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _counted(func):
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@contextmanager
def _stacked(below, above):
    with below, above:  # `above` is entered last, so it sees each op first
        yield


def counting_context(count: RecomputeCount, policy: Callable | None = None) -> Callable[[], tuple]:
    """A `context_fn` for checkpoint(): counts ops into `count` (a Region per checkpointed call); with `policy`,
    checkpoints selectively.

    In the recompute the selective cache sits between two counters: the one above it sees every op the
    recompute reaches, the one below only those the cache did not answer, so only real recomputation counts
    as recomputed.
    """

    def counted_policy(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        saved = decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)
        if (
            saved and _counted(op) and not getattr(ctx, "is_recompute", False)
        ):  # older torch asks again in the recompute
            count.saved_ops += 1
        return decision

    def context_fn():
        region = Region()
        count.regions.append(region)
        forward, recompute = (
            create_selective_checkpoint_contexts(counted_policy) if policy else (nullcontext(), nullcontext())
        )
        region.cache = getattr(forward, "storage", None)
        return (
            _stacked(_OpCounter(region.forward), forward),
            _stacked(
                _note_stored(region),
                _stacked(_stacked(_OpCounter(region.recomputed), recompute), _OpCounter(region.replayed)),
            ),
        )

    return context_fn


@contextmanager
def count_calls(modules: Iterable[torch.nn.Module]) -> Iterator[Counter]:
    """Count training-mode forward calls per module (by position) while inside; a replayed module is called
    again. Evaluation forwards (a held-out loss) are not counted."""
    calls: Counter = Counter()

    def called(i, module, *_):
        if module.training:
            calls.update([i])

    handles = [m.register_forward_pre_hook(lambda m, *a, i=i: called(i, m)) for i, m in enumerate(modules)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def same_replays(full: RecomputeCount, part: RecomputeCount, part_layers: list[int], num_layers: int) -> bool:
    """Whether each region of `part` (only `part_layers` checkpointed) recomputed, op by op in order, what `full`
    (all `num_layers` checkpointed) recomputed for the same layer in the same forward. Both keep one region per
    checkpointed layer call, in run order, forward after forward: region j of `part` is layer
    part_layers[j % len(part_layers)] of forward j // len(part_layers)."""
    k = len(part_layers)
    if k == 0 or len(part.regions) * num_layers != len(full.regions) * k:
        return False
    return all(
        region.recomputed == full.regions[j // k * num_layers + part_layers[j % k]].recomputed
        for j, region in enumerate(part.regions)
    )


def counted_update(model, workload, baseline, *contexts) -> Counter:
    """One more update's forward and backward (the workload's first window, from `baseline`'s fresh state) under
    these strategy contexts: it fills the counters they carry; returns the MLP calls counted per layer."""
    from trainmech import candidates  # it imports this module

    with count_calls([layer.mlp for layer in model.model.layers]) as calls:
        candidates.window_backward(workload.fresh_state(baseline), workload.windows[0], contexts=contexts)
    model.zero_grad(set_to_none=True)
    return calls


class _Dispatched(TorchDispatchMode):
    """Ops of `ops` dispatched while `inside` is set, by name."""

    def __init__(self, ops: frozenset) -> None:
        super().__init__()
        self.ops, self.inside, self.seen = ops, False, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside and func in self.ops:
            self.seen[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def dispatched_ops(layers: Iterable[torch.nn.Module], ops: frozenset = MATMUL_OPS) -> Iterator[Counter]:
    """Count the ops of `ops` the layers dispatch while inside (by op name), e.g. in one plain forward.

    What a selective policy keeps is decided per dispatched op, so this is the count it must reach:
    on a CPU one fused attention op per layer; with the math SDPA kernel two `bmm` instead.
    """
    mode = _Dispatched(ops)

    def enter(*_):
        mode.inside = True

    def leave(*_):
        mode.inside = False

    handles = [
        h
        for layer in layers
        for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))
    ]
    try:
        with mode:
            yield mode.seen
    finally:
        for h in handles:
            h.remove()


# What one layer's attention dispatches, by (device type, kernel as `ledger.attention_kernel` names it).
ATTENTION_OPS = {
    ("cpu", "flash"): {"_scaled_dot_product_flash_attention_for_cpu.default": 1},
    ("cuda", "flash"): {"_scaled_dot_product_flash_attention.default": 1},
    ("cuda", "efficient"): {"_scaled_dot_product_efficient_attention.default": 1},
    ("cuda", "cudnn"): {"_scaled_dot_product_cudnn_attention.default": 1},
    ("cpu", "math"): {"bmm.default": 2},  # the composite: scores q·kᵀ, then probabilities · v
    ("cuda", "math"): {"bmm.default": 2},
}


def dispatched_kernel(dispatched: Counter, device: str) -> str | None:
    """The attention kernel a count of dispatched ops (`dispatched_ops`) shows on `device`: the first of
    ATTENTION_OPS whose ops all appear (a fused op names its kernel; two `bmm` are the math composite).
    None: no known attention op among them. On a GPU this, not the ledger's rule, says what ran."""
    for (on, kernel), ops in ATTENTION_OPS.items():
        if on == device and all(op in dispatched for op in ops):
            return kernel
    return None


def expected_matmul_ops(layers: Iterable[torch.nn.Module], kernel: str, device: str) -> Counter:
    """The matmul and attention ops a forward of these decoder layers should dispatch, by op name, written
    down without MATMUL_OPS: one `addmm` per nn.Linear with a bias and one `mm` per nn.Linear without (a
    Qwen2 layer: q, k, v with a bias; o, gate, up, down without), and the attention as `kernel`
    (`ledger.attention_kernel`'s choice for the device) runs it on `device` (ATTENTION_OPS)."""
    if (device, kernel) not in ATTENTION_OPS:
        raise ValueError(f"no attention ops known for the {kernel} kernel on {device}")
    out: Counter = Counter()
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                out["addmm.default" if m.bias is not None else "mm.default"] += 1
        out.update(ATTENTION_OPS[device, kernel])
    return out
