"""The states of one training step, moment by moment: the ledger's byte formulas.

`step_states(setup)` lists every State of the step a `Setup` describes. Four builders, in the
order the step creates them: the model's parameters, what the forward and the loss create (saved
tensors and unsaved activations), what the backward creates (upstream gradients and `.grad`), and
what the update creates (optimizer states and its workspace). Sizes: b batch, s sequence, h hidden,
v vocabulary, I intermediate width; element bytes from the dtype recipe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainmech.ledger.clock import AFTER, BEFORE, UPDATE_SUFFIX, State
from trainmech.ledger.inventory import SavedTensor, layer_saved, norm_saved
from trainmech.ledger.recipes import FP32_BYTES, INDEX_BYTES, STEP_COUNTER_BYTES, Recipe, recipe
from trainmech.ledger.shape import ModelShape

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_IMPLS",
    "CHECKPOINTING",
    "GRADS_AT",
    "Setup",
    "layer_rows",
    "step_states",
    "model_states",
    "forward_states",
    "backward_states",
    "update_states",
]

OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
OPTIMIZER_IMPLS = ("auto", "loop", "foreach", "fused")
CHECKPOINTING = ("none", "full")
# which parameters' gradients each backward moment of a layer writes
GRADS_AT = {
    "down_proj": ("mlp.down_proj",),
    "attention": ("mlp.gate_proj", "mlp.up_proj", "post_attention_layernorm", "self_attn.o_proj"),
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "input_layernorm"),
}


@dataclass(frozen=True)
class Setup:
    """Everything one step's states depend on (resolved: no "auto" left)."""

    shape: ModelShape
    batch: int
    seq: int
    recipe: str
    optimizer: str
    optimizer_impl: str  # loop (PyTorch's default on CPU) | foreach (default on CUDA) | fused
    in_backward: bool  # the update runs in a post-accumulate-grad hook per parameter and frees its gradient
    checkpointing: str
    device: str
    kernel: str  # the SDPA kernel
    padded: bool  # the batch has padding: an attention mask
    first_step: bool  # the optimizer states are created by this step's update
    micro_batch: int  # this step is micro-batch `micro_batch` of `micro_batches` in one accumulation window
    micro_batches: int
    set_to_none: bool  # zero_grad(set_to_none=True) releases the gradients; False zeroes them in place
    gradient_buffers: bool = (
        False  # .grad lives in buffers that outlive every step (DDP's buckets, gradient_as_bucket_view)
    )
    weigh_rng: bool = False  # the SDPA kernel's RNG state weighed on this process's GPU (a CUDA run's point)
    repeat_kv: bool = (
        False  # K and V repeated to every head before SDPA (a mask; or a kernel refusing enable_gqa)
    )
    dropout: bool = False  # attention dropout (dropout_p > 0): the math composite keeps its mask too
    residual_dropout: bool = False  # a dropout on each MLP's output (Task6's gate workload): its mask is kept

    @property
    def dtypes(self) -> Recipe:
        return recipe(self.recipe)

    @property
    def updates(self) -> bool:
        """The update runs after this micro-batch (the last of its window)."""
        return self.micro_batch == self.micro_batches

    @property
    def grads_at_start(self) -> bool:
        """.grad exists when the step starts: an earlier micro-batch wrote it, or zero_grad kept it as zeros."""
        return (
            self.gradient_buffers
            or self.micro_batch > 1
            or (not self.set_to_none and not self.first_step and not self.in_backward)
        )


def layer_rows(setup: Setup) -> list[SavedTensor]:
    """One decoder layer's saved-tensor inventory in this step's setup (`inventory.layer_saved`)."""
    options = {
        name: getattr(setup, name)
        for name in ("device", "padded", "weigh_rng", "repeat_kv", "dropout", "residual_dropout")
    }
    return layer_saved(setup.shape, setup.batch, setup.seq, setup.recipe, setup.kernel, **options)


def step_states(setup: Setup) -> list[State]:
    if setup.in_backward:  # the plain step's states, re-timed by the hooks
        plain = dataclasses.replace(setup, in_backward=False, set_to_none=True)
        return _in_backward_states(setup, step_states(plain))
    return [*model_states(setup), *forward_states(setup), *backward_states(setup), *update_states(setup)]


def model_states(setup: Setup) -> list[State]:
    return [
        State("parameters", "parameters", setup.shape.n_params * setup.dtypes.weight_bytes, BEFORE, AFTER)
    ]


def _residual_bytes(dtypes: Recipe) -> int:
    """The residual stream's element bytes: the embedding's dtype (fp32 under autocast)."""
    return dtypes.weight_bytes


def forward_states(setup: Setup) -> list[State]:
    """What the forward and the loss create: saved tensors and unsaved activations."""
    shape, b, s, dtypes = setup.shape, setup.batch, setup.seq, setup.dtypes
    h, n, d, act = (
        shape.hidden_size,
        shape.num_layers,
        shape.head_dim,
        dtypes.activation_bytes,
    )
    pure_16bit = dtypes.sixteen_bit and not dtypes.autocast
    out = [
        # the layers read position_ids until the head; under full checkpointing each checkpoint also keeps it
        # as an input of its layer call, so it lives (saved) until layer 0 is rebuilt in the backward
        (
            State(
                "position_ids", "saved", s * INDEX_BYTES, "forward.embed", "backward.layer.0:input_layernorm"
            )
            if setup.checkpointing == "full"
            else State(
                "position_ids", "unsaved_activations", s * INDEX_BYTES, "forward.embed", "forward.head:norm"
            )
        ),
        # Qwen2RotaryEmbedding in fp32: angles (s, d/2), their doubled copy and cos or sin before scaling
        State(
            "rope.angles",
            "unsaved_activations",
            (s * d // 2 + 2 * s * d) * FP32_BYTES,
            "forward.embed",
            "forward.embed",
        ),
        State(
            "rope.cos_sin",
            "saved",
            2 * s * d * _residual_bytes(dtypes),
            "forward.embed",
            "backward.layer.0:attention",
        ),
    ]
    if (
        setup.padded
    ):  # the boolean causal-and-padding mask (b, 1, s, s) the model builds once and holds over the layers
        out.append(
            State("attention_mask", "unsaved_activations", b * s * s, "forward.embed", "forward.head:norm")
        )
    if pure_16bit:  # the 16-bit embedding output: nobody saves it, but Qwen2Model.forward holds it to the end of the layers
        out.append(
            State("embed.out", "unsaved_activations", b * s * h * act, "forward.embed", "forward.head:norm")
        )
    rows = layer_rows(setup)
    bias_copies = (
        2 * (shape.num_heads + 2 * shape.num_kv_heads) * d * act if dtypes.autocast and shape.qkv_bias else 0
    )
    for i in range(n):
        here, prev = f"forward.layer.{i}", "forward.embed" if i == 0 else f"forward.layer.{i - 1}"
        if (
            bias_copies
        ):  # autocast caches the 16-bit bias copies until the autocast region ends (after the loss)
            out.append(
                State(f"layer.{i}.bias_16bit_cached", "unsaved_activations", bias_copies, here, "loss")
            )
        if setup.checkpointing == "full":  # only the layer input is kept; the rest is rebuilt in the backward
            out.append(
                State(
                    f"layer.{i}.checkpoint_input",
                    "saved",
                    b * s * h * _residual_bytes(dtypes),
                    prev,
                    f"backward.layer.{i}:input_layernorm",
                )
            )
            out += [
                State(
                    f"layer.{i}.{t.name}",
                    "saved",
                    t.nbytes,
                    f"backward.layer.{i}:recompute",
                    f"backward.layer.{i}:{t.consumed_at}",
                )
                for t in rows
                if t.own
            ]
            out.append(
                State(
                    f"layer.{i}.no_grad_forward",
                    "unsaved_activations",
                    2 * b * s * (h + shape.intermediate_size) * act,
                    here,
                    here,
                )
            )
            continue
        out += [
            State(
                f"layer.{i}.{t.name}",
                "saved",
                t.nbytes,
                here if t.own else prev,
                f"backward.layer.{i}:{t.consumed_at}",
            )
            for t in rows
        ]
        out.append(
            State(f"layer.{i}.mlp_out", "unsaved_activations", b * s * h * act, here, here)
        )  # down_proj's output, before the residual add
        if (
            pure_16bit
        ):  # the 16-bit residual stream lives only in the forward: x + attn, and the layer output,
            # which the model's loop variable holds while the next layer runs
            out += [
                State(f"layer.{i}.residual_attn", "unsaved_activations", b * s * h * act, here, here),
                State(
                    f"layer.{i}.out",
                    "unsaved_activations",
                    b * s * h * act,
                    here,
                    f"forward.layer.{i + 1}" if i + 1 < n else "forward.head:norm",
                ),
            ]
    out += _head_states(setup)
    return out + _loss_states(setup)


def _head_states(setup: Setup) -> list[State]:
    """The final norm and lm_head: their saved tensors and the logits."""
    shape, b, s, dtypes = setup.shape, setup.batch, setup.seq, setup.dtypes
    h, v, act = shape.hidden_size, shape.vocab_size, dtypes.activation_bytes
    last = f"forward.layer.{shape.num_layers - 1}"
    norm_rows = norm_saved(
        "norm",
        b,
        s,
        h,
        FP32_BYTES if dtypes.autocast else act,
        "head",
        own_input=dtypes.sixteen_bit and not dtypes.autocast,
        keeps_output=not dtypes.autocast,
    )
    if dtypes.autocast:  # lm_head keeps 16-bit copies of its input and of the (tied) weight
        norm_rows += [
            SavedTensor("lm_head.input_16bit", (b, s, h), act, "head"),
            SavedTensor("lm_head.weight_16bit", (v, h), act, "head"),
        ]
    out = [
        State(
            f"model.norm.{t.name.split('.', 1)[1]}" if t.name.startswith("norm.") else t.name,
            "saved",
            t.nbytes,
            ("forward.head:lm_head" if t.name.startswith("lm_head") else "forward.head:norm")
            if t.own
            else last,
            "backward.head:lm_head" if t.name.startswith("lm_head") else "backward.head:norm",
        )
        for t in norm_rows
    ]
    return out + [State("logits", "unsaved_activations", b * s * v * act, "forward.head:lm_head", "loss")]


def _loss_states(setup: Setup) -> list[State]:
    """transformers' ForCausalLMLoss: logits.float(), shifted labels, log-softmax and NLL."""
    b, s, v, dtypes = setup.batch, setup.seq, setup.shape.vocab_size, setup.dtypes
    out = []
    if dtypes.sixteen_bit:  # logits.float() copies 16-bit logits
        out.append(State("logits_fp32", "unsaved_activations", b * s * v * FP32_BYTES, "loss", "loss"))
    # pad(labels, (0, 1))[..., 1:].contiguous(): the shifted targets are a copy, except for one row, where
    # the slice is already contiguous and the padded labels themselves are kept
    out.append(
        State(
            "loss.labels_padded",
            "unsaved_activations" if b > 1 else "saved",
            b * (s + 1) * INDEX_BYTES,
            "loss",
            "loss" if b > 1 else "backward.loss:nll",
        )
    )
    if b > 1:
        out.append(State("loss.targets", "saved", b * s * INDEX_BYTES, "loss", "backward.loss:nll"))
    return out + [
        State("loss.log_softmax", "saved", b * s * v * FP32_BYTES, "loss", "backward.loss:log_softmax"),
        State("loss.total_weight", "saved", FP32_BYTES, "loss", "backward.loss:nll"),
        # the loss scalar the training loop holds until it drops it after backward()
        State("loss.value", "saved", FP32_BYTES, "loss", "backward.loss:nll", "backward.embed:accumulate"),
    ]


def _gradient(setup: Setup, name: str, nbytes: int, created: str) -> list[State]:
    """A parameter's gradient written at `created`: the new .grad, or, when .grad already exists, the
    contribution AccumulateGrad adds into it in place (an upstream gradient of that moment)."""
    born, out = created, []
    if setup.grads_at_start:
        born = BEFORE
        out.append(State(f"{name}.grad_contribution", "upstream_grads", nbytes, created, created))
    if setup.updates and setup.set_to_none and not setup.gradient_buffers:
        return out + [State(f"{name}.grad", "gradients", nbytes, born, "optimizer", "zero_grad")]
    return out + [
        State(f"{name}.grad", "gradients", nbytes, born, "optimizer" if setup.updates else AFTER, AFTER)
    ]


def backward_states(setup: Setup) -> list[State]:
    """Upstream gradients and gradients (.grad), moment by moment."""
    shape, b, s, dtypes = setup.shape, setup.batch, setup.seq, setup.dtypes
    h, v, inner, act, grad_bytes = (
        shape.hidden_size,
        shape.vocab_size,
        shape.intermediate_size,
        dtypes.activation_bytes,
        dtypes.grad_bytes,
    )
    q, kv, n = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.num_layers
    stream = _residual_bytes(dtypes)  # the residual stream's gradient has the stream's dtype
    tied = shape.tie_word_embeddings
    # SDPA's backward: flash holds the output's grad and dq, dk, dv; math, at its softmax backward,
    # holds two s×s grads (of the probabilities and of the scores) and the grad of the repeated v
    d_sdpa = b * s * (2 * q + 2 * (q if setup.repeat_kv else kv)) * act  # repeated: dk, dv at every head
    if setup.kernel == "math":
        d_sdpa = (2 * b * shape.num_heads * s * s + b * s * q) * act
    out = [
        State(
            "loss.grad_seed",
            "upstream_grads",
            FP32_BYTES,
            "backward.loss:nll",
            "backward.loss:nll",
            "backward.embed:accumulate",
        ),
        State(
            "loss.nll_grad",
            "upstream_grads",
            b * s * v * FP32_BYTES,
            "backward.loss:nll",
            "backward.loss:log_softmax",
        ),
        State(
            "dlogits_fp32",
            "upstream_grads",
            b * s * v * FP32_BYTES,
            "backward.loss:log_softmax",
            "backward.loss:cast" if dtypes.sixteen_bit else "backward.head:lm_head",
        ),
    ]
    if (
        dtypes.sixteen_bit
    ):  # the backward of logits.float(), inside the loss's: the gradient cast back to 16 bits
        out.append(
            State("dlogits", "upstream_grads", b * s * v * act, "backward.loss:cast", "backward.head:lm_head")
        )
    if dtypes.autocast:  # the head's weight gradient is computed in 16 bits, then cast to fp32
        out.append(
            State(
                "lm_head.weight.grad_16bit",
                "upstream_grads",
                v * h * act,
                "backward.head:lm_head",
                "backward.head:lm_head",
            )
        )
    if (
        tied
    ):  # a tied head's gradient is an upstream gradient of the embedding's AccumulateGrad: it waits in the
        # autograd engine until the lookup's contribution arrives (梯度汇合)
        out.append(
            State(
                "lm_head.weight.grad_pending",
                "upstream_grads",
                v * h * grad_bytes,
                "backward.head:lm_head",
                "backward.embed:accumulate",
            )
        )
    else:
        out += _gradient(setup, "lm_head.weight", v * h * grad_bytes, "backward.head:lm_head")
    out += _gradient(setup, "model.norm.weight", h * grad_bytes, "backward.head:norm")
    upstream = "backward.head:lm_head"  # lm_head's input gradient, passed on through the final norm
    numel = dict(shape.parameter_tensors())
    for i in reversed(range(n)):
        t, p = f"backward.layer.{i}:", f"model.layers.{i}."
        out.append(
            State(f"layer.{i}.upstream_grad", "upstream_grads", b * s * h * stream, upstream, t + "mlp")
        )
        for moment, modules in GRADS_AT.items():
            for module in modules:
                size = sum(numel.get(p + module + suffix, 0) for suffix in (".weight", ".bias"))
                out += _gradient(setup, f"layer.{i}.{module}", size * grad_bytes, t + moment)
                if dtypes.autocast and "proj" in module:  # the 16-bit weight gradient before its cast to fp32
                    out.append(
                        State(
                            f"layer.{i}.{module}.grad_16bit",
                            "upstream_grads",
                            numel[p + module + ".weight"] * act,
                            t + moment,
                            t + moment,
                        )
                    )
        out += [
            State(f"layer.{i}.d_act_up", "upstream_grads", b * s * inner * act, t + "down_proj", t + "mlp"),
            State(f"layer.{i}.d_act_d_up", "upstream_grads", 2 * b * s * inner * act, t + "mlp", t + "mlp"),
            State(
                f"layer.{i}.d_residual",
                "upstream_grads",
                b * s * h * stream,
                t + "attention",
                t + "input_layernorm",
            ),
            State(f"layer.{i}.d_sdpa", "upstream_grads", d_sdpa, t + "attention", t + "attention"),
            State(
                f"layer.{i}.d_normed",
                "upstream_grads",
                b * s * h * stream,
                t + "input_layernorm",
                t + "input_layernorm",
            ),
        ]
        upstream = t + "input_layernorm"
    out.append(
        State("embed.upstream_grad", "upstream_grads", b * s * h * stream, upstream, "backward.embed:lookup")
    )
    if tied:  # the lookup's gradient meets the head's in the engine's buffer; their sum becomes .grad
        out.append(
            State(
                "embed.lookup_grad",
                "upstream_grads",
                v * h * grad_bytes,
                "backward.embed:lookup",
                "backward.embed:accumulate",
            )
        )
        out += _gradient(
            setup, "model.embed_tokens", v * h * grad_bytes, "backward.embed:accumulate"
        )  # with .grad there: the sum, added in place
    else:
        out += _gradient(setup, "model.embed_tokens", v * h * grad_bytes, "backward.embed:lookup")
    return out


def _step_temporary(setup: Setup, numels: list[int]) -> int:
    """Bytes of the AdamW update's temporaries over these tensors: denom = exp_avg_sq.sqrt() / bias_correction2_sqrt.

    foreach makes one per tensor, all at once; the per-tensor loop makes two per tensor while the
    previous tensor's denom is still referenced; fused kernels make none.
    """
    impl, moment_bytes = setup.optimizer_impl, setup.dtypes.moment_bytes
    if setup.optimizer != "adamw" or impl == "fused" or not numels:
        return 0
    if impl == "foreach":
        return sum(numels) * moment_bytes
    return max(prev + 2 * cur for prev, cur in zip([0, *numels], numels)) * moment_bytes


def _state_bytes_per_tensor(setup: Setup) -> tuple[int, int]:
    """(bytes per parameter element, bytes per tensor) of the optimizer states."""
    dtypes, per_element = setup.dtypes, setup.dtypes.master_bytes
    if setup.optimizer == "adamw":
        per_element += 2 * dtypes.moment_bytes
    elif setup.optimizer == "sgd-momentum":
        per_element += dtypes.moment_bytes
    # AdamW's state["step"]: one fp32 scalar per tensor, on the host unless fused or capturable (torch/optim/adam.py
    # _init_group: foreach and the per-tensor loop alike), so 0 device bytes on CUDA for those two
    counters = (
        STEP_COUNTER_BYTES
        if setup.optimizer == "adamw" and (setup.device == "cpu" or setup.optimizer_impl == "fused")
        else 0
    )
    return per_element, counters


def update_states(setup: Setup) -> list[State]:
    """Optimizer states (created by the first update) and the update's workspace."""
    numels = [numel for _, numel in setup.shape.parameter_tensors()]
    per_element, counters = _state_bytes_per_tensor(setup)
    if not setup.updates and setup.first_step:
        return []  # an earlier micro-batch of the first window: no update has run yet, no optimizer state exists
    born = "optimizer" if setup.first_step else BEFORE
    out = []
    if per_element:
        out.append(
            State(
                f"optimizer.{setup.optimizer}_states",
                "optimizer_states",
                sum(numels) * per_element,
                born,
                AFTER,
            )
        )
    if counters:
        out.append(State("optimizer.step_counters", "optimizer_states", counters * len(numels), born, AFTER))
    temporary = _step_temporary(setup, numels) if setup.updates else 0
    if temporary:
        out.append(State("optimizer.sqrt_temporaries", "workspace", temporary, "optimizer", "optimizer"))
    return out


def _in_backward_states(setup: Setup, plain: list[State]) -> list[State]:
    """Optimizer-in-backward, from the plain step's states: each parameter's gradient is consumed and freed
    by a step of its own in its post-accumulate-grad hook, so no moment holds more than one gradient and one
    update's temporaries.

    The step gets a tick of its own right after the tick that completes the gradient (`<tick>+update`):
    the node that made the gradient has released what it consumed by then, and the step's temporaries
    live only there. One parameter at a time, so a tick holds the largest gradient (+ temporaries) of its
    parameters, not their sum. On a first update the optimizer states are created there too; the
    optimizer tick holds nothing.
    """
    grad_bytes = setup.dtypes.grad_bytes
    per_element, counter_bytes = _state_bytes_per_tensor(setup)
    names = [name for name, _ in setup.shape.parameter_tensors()]
    at_tick: dict[str, list[tuple[int, int]]] = {}  # tick -> (gradient bytes, its update's temporary bytes)
    born: dict[str, int] = {}  # update tick -> bytes of the optimizer states a first update creates there
    for st in plain:
        if st.category == "gradients":
            numel = st.nbytes // grad_bytes
            at_tick.setdefault(st.created, []).append((st.nbytes, _step_temporary(setup, [numel])))
            # each parameter tensor's step counter is created by its own hook, with its moments
            module = st.name.removesuffix(".grad")
            module = (
                "model.layers." + module.removeprefix("layer.") if module.startswith("layer.") else module
            )
            tensors = sum(1 for n in names if n == module or n.startswith(module + "."))
            update = st.created + UPDATE_SUFFIX
            born[update] = born.get(update, 0) + numel * per_element + tensors * counter_bytes

    def created_by_update(st):
        return setup.first_step and st.category == "optimizer_states" and st.created == "optimizer"

    last_update = (
        "backward.embed:accumulate" + UPDATE_SUFFIX
    )  # a hook after the backward's last moment (tied)
    extend = last_update in {tick + UPDATE_SUFFIX for tick in at_tick}

    def until_backward_returns(st):  # the loss and its seed outlive that hook: backward() returns after it
        if extend and st.name in ("loss.value", "loss.grad_seed"):
            return dataclasses.replace(st, released_at=last_update)
        return st

    out = [
        until_backward_returns(st)
        for st in plain
        if st.category != "gradients"
        and st.name != "optimizer.sqrt_temporaries"
        and not created_by_update(st)
    ]
    for tick, items in at_tick.items():
        update = tick + UPDATE_SUFFIX
        grad, temp = max(items, key=sum)
        out += [
            State(f"grad_in_hook@{tick}", "gradients", max(g for g, _ in items), tick, tick),
            State(f"grad_in_hook@{update}", "gradients", grad, update, update),
        ]
        if temp:
            out.append(State(f"optimizer.sqrt_temporaries@{update}", "workspace", temp, update, update))
    if setup.first_step:
        out += [
            State(f"optimizer.states@{tick}", "optimizer_states", nbytes, tick, AFTER)
            for tick, nbytes in born.items()
            if nbytes
        ]
    return out
