"""The autograd probe: what a forward creates, and the tensors autograd saves for its backward.

    with record_forward(root=layer, references=layer.parameters()) as m:
        out = layer(x, ...)
    m.find_consumers(out)       # before backward: which backward node reads each saved tensor
    m.saved, m.saved_bytes      # distinct saved storages; parameters excluded from the bytes
    m.activations               # every new storage the forward's ATen ops created, saved or not

How it is measured. `torch.autograd.graph.saved_tensors_hooks` calls a pack hook for every tensor
an autograd node keeps for its backward; the hook notes it and hands back a detached alias of the
same memory, so backward is unchanged. A TorchDispatchMode sees every ATen op of the forward; an
op output whose storage did not exist before is an activation (views and no-op casts reuse their
input's storage and are not). Tensors are identified by storage (device + data pointer of
`untyped_storage()`): a saved view costs the storage it keeps alive, counted once however many
nodes save it. Every storage seen is held until the block ends, so no address is reused inside it;
addresses are used as keys only, never printed. `references` (the parameters) are saved by
reference: listed, but their bytes are not new memory.

Autograd's VJP for a comparison (`autograd_vjp`, `compare_vjp`) lives in trainmech.vjp_check, which
builds on this probe; the names are also reachable here (loaded on first use), as Task2 imports them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainmech import graph
from trainmech.checks import dtype_name
from trainmech.display import format_table

__all__ = [
    "SavedStorage",
    "Activation",
    "ForwardRecord",
    "record_forward",
    "flat_tensors",
    "storage_bytes",
    "storage_summary",
    "describe",
    "saved_table",
    "activation_table",
]


def _key(t: torch.Tensor) -> tuple[str, int]:
    """A storage's identity while it is alive: (device, data pointer). Never shown to a reader."""
    return str(t.device), t.untyped_storage().data_ptr()


def flat_tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts / lists / tuples (e.g. a composed op's saved dict, a pack hook's
    packed value, a hook's args); other leaves (ints, options, None) are dropped."""
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def storage_summary(obj, references=()) -> tuple[int, int, int]:
    """(new storages, reference storages, new bytes) of the tensors in `obj` (a tensor or a nest of
    them, e.g. our saved dict), each storage once; storages shared with `references` are not new."""
    refs = {_key(t) for t in references}
    sizes = {_key(t): t.untyped_storage().nbytes() for t in flat_tensors(obj)}
    new = [n for k, n in sizes.items() if k not in refs]
    return len(new), len(sizes) - len(new), sum(new)


def storage_bytes(obj, references=()) -> int:
    """The new bytes of `storage_summary`: the count `ForwardRecord.saved_bytes` applies to what
    autograd saves, so the two sides of a comparison count alike."""
    return storage_summary(obj, references)[2]


@dataclass
class SavedStorage:
    """One storage autograd saved for backward."""

    shape: tuple[int, ...]  # of the first view saved
    dtype: torch.dtype
    nbytes: int  # bytes of the storage kept alive
    reference: bool  # shares memory with a `references` tensor (a parameter): no new bytes
    times: int = 1  # how many saves (nodes) point at this storage
    consumers: tuple[str, ...] = ()  # backward node kinds that read it (see find_consumers)
    key: tuple[str, int] = field(default=("", 0), repr=False)


@dataclass
class Activation:
    """One new storage created by an ATen op of the forward."""

    where: str  # module path under `root`, the root's class name, or the trainmech.vjp* function
    op: str  # the ATen op, e.g. "addmm"
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    saved: bool  # whether autograd saved this storage for backward
    key: tuple[str, int] = field(default=("", 0), repr=False)


class _Recorder(TorchDispatchMode):
    """Notes every op output whose storage is new, with where in the model it was made."""

    def __init__(self, where):
        super().__init__()
        self.where = where
        self.known: set[tuple[str, int]] = set()
        self.rows: list[Activation] = []
        self.held: list[torch.Tensor] = []  # keeps every storage alive: no address reuse in the block

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in flat_tensors((args, kwargs)):
            self.known.add(_key(t))
        for t in flat_tensors(out):
            if t.untyped_storage().nbytes() > 0 and _key(t) not in self.known:
                self.known.add(_key(t))
                self.held.append(t)
                name = func.overloadpacket.__name__
                self.rows.append(
                    Activation(
                        self.where(),
                        name,
                        tuple(t.shape),
                        t.dtype,
                        t.untyped_storage().nbytes(),
                        False,
                        _key(t),
                    )
                )
        return out


_OUR_FORWARDS = ("trainmech.vjp", "trainmech.vjp_qwen2")  # the hand-written ops (not vjp_check)


def _vjp_function() -> str:
    """The innermost trainmech.vjp* function on the Python stack (labels ops of our own forward)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "") in _OUR_FORWARDS:
            return frame.f_code.co_name
        frame = frame.f_back
    return "-"


class ForwardRecord:
    """What one forward created and what autograd saved from it; see the module docstring."""

    def __init__(self, root: torch.nn.Module | None = None, references=()):
        self.root = root
        self.references = {_key(t) for t in references}
        self._saved: dict[tuple[str, int], SavedStorage] = {}
        self.activations: list[Activation] = []
        self._stack: list[str] = []
        self._names = {id(m): name for name, m in root.named_modules()} if root is not None else {}

    # -- saved tensors ------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        k = _key(t)
        if k in self._saved:
            self._saved[k].times += 1
        else:
            self._saved[k] = SavedStorage(
                tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), k in self.references, key=k
            )
        return t.detach()  # the same memory without grad_fn: no reference cycle through the graph

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def saved(self) -> list[SavedStorage]:
        """One row per distinct saved storage, in the order autograd first saved it."""
        return list(self._saved.values())

    @property
    def saved_bytes(self) -> int:
        """Bytes of the saved storages that are not references (new memory kept for backward)."""
        return sum(s.nbytes for s in self._saved.values() if not s.reference)

    def summary(self) -> tuple[int, int, int]:
        """(new storages, parameter storages, new bytes) saved: the same count as `storage_summary`."""
        refs = sum(s.reference for s in self._saved.values())
        return len(self._saved) - refs, refs, self.saved_bytes

    def find_consumers(self, *outputs: torch.Tensor) -> None:
        """Fill SavedStorage.consumers: walk the graph from `outputs` (before backward frees it) and
        read each node's `_saved_*` attributes (`saved_tensors` for a custom autograd.Function).
        Raises if a saved storage is found in no node."""
        found: dict[tuple[str, int], list[str]] = {}
        seen = set()
        for out in outputs:
            for node in graph.nodes(out):
                if node in seen:
                    continue
                seen.add(node)
                for attr in dir(node):
                    if not (attr.startswith("_saved_") or attr == "saved_tensors"):
                        continue
                    for t in flat_tensors(getattr(node, attr)):
                        found.setdefault(_key(t), []).append(type(node).__name__)
        for k, row in self._saved.items():
            if k not in found:
                raise RuntimeError(f"a saved tensor of shape {row.shape} was not found in the graph")
            row.consumers = tuple(sorted(found[k]))

    # -- activations --------------------------------------------------------------------------

    def _where(self) -> str:
        if self._stack:
            return self._stack[-1] or type(self.root).__name__
        return _vjp_function()

    def consumers_of(self, activation: Activation) -> tuple[str, ...]:
        """The backward nodes that read this activation (empty when autograd did not save it)."""
        row = self._saved.get(activation.key)
        return row.consumers if row is not None else ()

    def not_created_here(self) -> list[SavedStorage]:
        """Saved storages that no op of the block created: its inputs, constants and parameters."""
        made = {a.key for a in self.activations}
        return [row for row in self._saved.values() if row.key not in made]

    def activations_saved_by(self, saved) -> list[Activation]:
        """The activations again, with `saved` telling whether our hand-written `saved` (a dict /
        nest of tensors, alive since the block) holds that storage instead of autograd."""
        keys = {_key(t) for t in flat_tensors(saved)}
        return [replace(a, saved=a.key in keys) for a in self.activations]

    # -- the block ----------------------------------------------------------------------------

    def __enter__(self) -> "ForwardRecord":
        def pre(module, args):
            if id(module) in self._names:
                self._stack.append(self._names[id(module)])

        def post(module, args, out):
            if id(module) in self._names and self._stack:
                self._stack.pop()

        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post, always_call=True),
        ]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._recorder = _Recorder(self._where)
        self._hooks.__enter__()
        self._recorder.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._recorder.__exit__(*exc)
            self._hooks.__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
        self.activations = [replace(a, saved=a.key in self._saved) for a in self._recorder.rows]
        self._recorder.held.clear()  # storages nothing else holds may go now
        return False


def record_forward(root: torch.nn.Module | None = None, references=()) -> ForwardRecord:
    """A block that records one forward (what it created, what autograd saved): see the module docstring.
    `root` names the modules."""
    return ForwardRecord(root, references)


def describe(saved) -> str:
    """One line naming what a hand-written `saved` dict holds: 'x (2, 16, 64) · weight (64,) · dim=-1'."""
    parts = [
        f"{k} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"{k}={v!r}" for k, v in saved.items()
    ]
    return " · ".join(parts)


def saved_table(rows: list[SavedStorage]) -> str:
    """What autograd saved, one line per storage: shape, dtype, bytes (0 for a parameter: saved by
    reference), how many nodes saved it, and the backward nodes that read it."""
    return format_table(
        ["shape", "dtype", "new bytes", "saves", "read by (backward nodes)"],
        [
            [
                r.shape,
                dtype_name(r.dtype),
                0 if r.reference else r.nbytes,
                r.times,
                ", ".join(r.consumers) + ("  [parameter]" if r.reference else ""),
            ]
            for r in rows
        ],
    )


def activation_table(m: ForwardRecord) -> str:
    """Every activation of a measured forward: where it was made, by which ATen op, its shape and
    bytes, and which backward nodes read it ('-' = never saved)."""
    return format_table(
        ["where", "op", "shape", "bytes", "read by (backward nodes)"],
        [[a.where, a.op, a.shape, a.nbytes, ", ".join(m.consumers_of(a)) or "-"] for a in m.activations],
    )


_FROM_VJP_CHECK = ("AutogradVJP", "autograd_vjp", "compare_vjp", "reference_vjp")


def __getattr__(name: str):
    """`saved_state.autograd_vjp` & co. as trainmech.vjp_check's (imported on first use: vjp_check
    imports this module, so an import at the top would be circular)."""
    if name in _FROM_VJP_CHECK:
        from trainmech import vjp_check

        return getattr(vjp_check, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
