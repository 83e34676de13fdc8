"""The step's clock: its ticks in order, and a State's lifecycle on it.

One training step of a transformers causal LM: `loss = model(**batch, use_cache=False).loss;
loss.backward(); optimizer.step(); optimizer.zero_grad()`. A tick is one moment of it, written
"phase" or "phase:moment": one per forward phase (two for the head), and inside the backward the
moments where memory peaks locally (`backward.layer.3:mlp` is the MLP backward of layer 3). The
phase names are the ones `trainmech.measure` labels its events with.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "UPDATES",
    "LAYER_BACKWARD_MOMENTS",
    "BEFORE",
    "AFTER",
    "UPDATE_SUFFIX",
    "ticks",
    "phase_of",
    "is_forward_or_backward",
    "State",
]

UPDATES = ("first", "steady")  # the first update creates AdamW's states; a steady one finds them there
LAYER_BACKWARD_MOMENTS = ("down_proj", "mlp", "attention", "input_layernorm")
BEFORE, AFTER = "before", "after"  # a state alive before the step starts / still alive after it ends
UPDATE_SUFFIX = (
    "+update"  # optimizer-in-backward: the moment after a gradient's tick, when its parameter is updated
)


def ticks(n_layers: int, checkpointing: str = "none", updated=(), cast_logits: bool = False) -> list[str]:
    """The moments of one step, in order. updated: ticks followed by an in-backward update (`<tick>+update`).
    cast_logits: 16-bit logits, which the loss upcasts (`logits.float()`): the backward of that copy casts
    the fp32 gradient back to 16 bits inside the loss's backward (`backward.loss:cast`)."""
    out = [
        "forward.embed",
        *(f"forward.layer.{i}" for i in range(n_layers)),
        "forward.head:norm",
        "forward.head:lm_head",
        "loss",
        "backward.loss:nll",
        "backward.loss:log_softmax",
        *(["backward.loss:cast"] if cast_logits else []),
        "backward.head:lm_head",
        "backward.head:norm",
    ]
    for i in reversed(range(n_layers)):
        if checkpointing == "full":
            out.append(f"backward.layer.{i}:recompute")
        out += [f"backward.layer.{i}:{m}" for m in LAYER_BACKWARD_MOMENTS]
    out += ["backward.embed:lookup", "backward.embed:accumulate"]
    out = [t2 for t in out for t2 in ((t, t + UPDATE_SUFFIX) if t in updated else (t,))]
    return out + ["optimizer", "zero_grad"]


def phase_of(tick: str) -> str:
    """backward.layer.3:mlp -> backward.layer.3."""
    return tick.split(":")[0]


def is_forward_or_backward(tick: str) -> bool:
    """Ticks of the forward, the loss and the backward: everything before the update."""
    return tick.startswith(("forward", "loss", "backward"))


@dataclass(frozen=True)
class State:
    """One training state, alive from its `created` tick to its `released_at` tick, both included.

    `last_consumed` is the last tick that reads it. Most states are released right there (leave
    `released_at` out); gradients are read by the update and released by `zero_grad`. BEFORE /
    AFTER stand for "already alive when the step starts" / "still alive when it ends".
    """

    name: str
    category: str
    nbytes: int
    created: str
    last_consumed: str
    released_at: str | None = None

    def __post_init__(self):
        if self.released_at is None:
            object.__setattr__(self, "released_at", self.last_consumed)
