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
from trainmech.ledger.clock import AFTER, BEFORE, State
from trainmech.ledger.formulas import _check_stage
from trainmech.ledger.recipes import FP32_BYTES, STEP_COUNTER_BYTES

__all__ = [
    "ZERO_SPLIT",
    "LOSS_BUFFERS",
    "DevicePeak",
    "loss_buffers_by_tick",
    "per_device",
    "ParamShard",
    "zero_partition",
    "STAGE_ENGINES",
    "per_rank",
    "communication",
    "zero_volume",
    "held_per_rank",
    "FIRST_STAGE_SPLITTING",
    "HeldAgainstRule",
    "held_against_rule",
]

ZERO_SPLIT = {
    0: (),
    1: ("optimizer_states",),
    2: ("optimizer_states", "gradients"),
    3: ("optimizer_states", "gradients", "parameters"),
}
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
        shares = {
            c: row[c] / devices if c in split or (c == "workspace" and stage >= 1) else float(row[c])
            for c in CATEGORIES
        }
        total = sum(shares.values())
        if best is None or total > best.bytes:
            best = DevicePeak(devices, stage, tick, total, shares, loss[k])
    return best


# ----------------------------------------------------------------------------- ZeRO as PyTorch runs it, per rank
#
# The paper's idealisation (each model state exactly 1/N) against what PyTorch's engines hold on one rank
# (`trainmech.distributed` measures them):
#
#   stage 0, DDP(gradient_as_bucket_view=True): .grad lives in the all-reduce buckets, allocated once and
#            kept between updates (each new gradient is copied in), so 4Ψ of gradients are alive even
#            before the backward; the paper counts them only while they exist.
#   stage 1, ZeroRedundancyOptimizer: optimizer states for whole tensors, assigned largest first to the
#            least-loaded rank (not Ψ/N exactly); its update loops over those tensors only; gradients
#            all-reduced in full (DDP), the updated tensors broadcast by their owner.
#   stage 2/3, FSDP2: each tensor split along dim 0 in N chunks of ceil(d0/N) rows, the shard storage
#            padded to that size; per group (the root: embedding, tied head, final norm; each decoder
#            layer) an all-gather buffer and the unsharded parameters while the group computes (stage 2
#            keeps a layer whole from its forward to its backward; stage 3 frees it after the forward and
#            gathers it again for the backward, one layer ahead); the layer's full gradients until its
#            reduce-scatter, whose buffer stays until the next one; sharded gradients and states after.
#            A buffer of the last all-gather and of the last reduce-scatter stays alive until the next
#            one is issued (FSDP2 frees it then instead of tracking streams).


@dataclass(frozen=True)
class ParamShard:
    name: str
    numel: int
    rows: int  # dim 0

    def chunk_rows(self, n: int) -> int:
        return -(-self.rows // n)

    def padded_shard(self, n: int) -> int:
        """Elements of the (padded) shard every rank stores."""
        return self.chunk_rows(n) * (self.numel // self.rows)

    def local(self, n: int, rank: int) -> int:
        """Elements of rank's own rows (the last ranks may hold fewer, or none)."""
        rows = max(0, min(self.chunk_rows(n), self.rows - rank * self.chunk_rows(n)))
        return rows * (self.numel // self.rows)


def _shards(shape) -> list[ParamShard]:
    """Every parameter tensor with its rows: a weight (out, in) has out rows; a bias or norm weight its length."""
    out = []
    h, q, kv, inner = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.intermediate_size,
    )
    rows_of_projection = {
        "q_proj": q,
        "k_proj": kv,
        "v_proj": kv,
        "o_proj": h,
        "gate_proj": inner,
        "up_proj": inner,
        "down_proj": h,
    }
    for name, numel in shape.parameter_tensors():
        module = name.rsplit(".", 2)[-2]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            dim0_rows = shape.vocab_size
        else:
            dim0_rows = rows_of_projection.get(module, numel)  # norms and biases: one row per element
        out.append(ParamShard(name, numel, dim0_rows))
    return out


def zero_partition(numels: list[int], n: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's assignment: tensor indices per rank, largest first to the least-loaded rank."""
    loads, ranks = [0] * n, [[] for _ in range(n)]
    for k in sorted(range(len(numels)), key=lambda k: numels[k], reverse=True):  # a stable sort, as torch's
        lightest = loads.index(min(loads))
        ranks[lightest].append(k)
        loads[lightest] += numels[k]
    return ranks


def _own_update(label: str, numels: list[int], *, counters: int) -> list[State]:
    """What one rank's AdamW update (fp32, the CPU's loop) creates for the elements it updates itself: the
    two moments, `counters` step counters (ZeroRedundancyOptimizer: one per own tensor; FSDP2: one per
    tensor, rows or not), and the loop's sqrt temporaries."""
    return [
        State(
            f"optimizer.adamw_states ({label})",
            "optimizer_states",
            2 * FP32_BYTES * sum(numels) + STEP_COUNTER_BYTES * counters,
            "optimizer",
            AFTER,
        ),
        State(
            f"optimizer.sqrt_temporaries ({label})",
            "workspace",
            _loop_temporary(numels),
            "optimizer",
            "optimizer",
        ),
    ]


def _loop_temporary(numels: list[int], moment_bytes: int = FP32_BYTES) -> int:
    """AdamW's for-loop: two sqrt temporaries of one tensor while the previous tensor's denom is referenced."""
    return max((prev + 2 * cur for prev, cur in zip([0, *numels], numels)), default=0) * moment_bytes


def _groups(shape) -> dict[str, list[str]]:
    """FSDP2's groups (one fully_shard each): the root (embedding, tied head, final norm), every decoder layer."""
    groups = {"root": []}
    for name, _ in shape.parameter_tensors():
        key = f"layer.{name.split('.')[2]}" if name.startswith("model.layers.") else "root"
        groups.setdefault(key, []).append(name)
    return groups


STAGE_ENGINES = {
    0: "DDP",
    1: "DDP + ZeroRedundancyOptimizer",
    2: "FSDP2 reshard_after_forward=False",
    3: "FSDP2 per layer",
}


def per_rank(config, batch: int, seq: int, stage: int, world_size: int, rank: int = 0):
    """The ledger of one rank's first AdamW update (fp32, CPU loop) under PyTorch's engine for `stage` on
    `world_size` ranks, each with batch / world_size sequences (see the comment above for what it counts)."""
    import dataclasses

    from trainmech.errors import TrainmechError
    from trainmech.ledger.book import training_state_lifecycle

    _check_stage(stage, world_size)
    if batch % world_size:
        raise TrainmechError(f"the batch of {batch} does not split evenly over {world_size} ranks")
    b = batch // world_size
    if stage in (0, 1):
        book = training_state_lifecycle(
            config, b, seq, first_step=True, optimizer_impl="loop", gradient_buffers=True
        )
        if stage == 0:
            return book
        shards = _shards(book.shape)
        mine = [shards[k].numel for k in zero_partition([s.numel for s in shards], world_size)[rank]]
        states = [st for st in book.states if not st.name.startswith("optimizer.")]
        states += _own_update("own share", mine, counters=len(mine))
        return dataclasses.replace(book, states=tuple(states))
    return _fsdp_rank(
        training_state_lifecycle(config, b, seq, first_step=True, optimizer_impl="loop"),
        stage,
        world_size,
        rank,
    )


def _fsdp_ticks(ticks_: tuple[str, ...], n_layers: int) -> tuple[str, ...]:
    """The step's ticks with FSDP2's own moments: before a group computes in the forward, its all-gather and
    copy-out (`:fsdp_unshard`); after the head's backward the last layer is copied out again; at the end of
    each group's backward its reduce-scatter runs (`:fsdp_post_backward`) and then the next layer is copied
    out, still inside that phase."""
    out = []
    for t in ticks_:
        if t == "forward.embed" or (t.startswith("forward.layer.") and ":" not in t):
            out.append(f"{t}:fsdp_unshard")  # the group's all-gather and copy-out, before it computes
        out.append(t)
        if t == "backward.head:norm":
            out.append("backward.head:fsdp_unshard")
        elif t.endswith(":input_layernorm"):
            i = int(t.split(".")[2].split(":")[0])
            out += [f"backward.layer.{i}:fsdp_post_backward"] + (
                [f"backward.layer.{i}:fsdp_unshard"] if i > 0 else []
            )
        elif t == "backward.embed:accumulate":
            out.append("backward.embed:fsdp_post_backward")
    return tuple(out)


def _fsdp_rank(book, stage: int, n: int, rank: int):
    import dataclasses

    shape = book.shape
    ticks_ = _fsdp_ticks(book.ticks, shape.num_layers)
    after = {t: ticks_[k + 1] for k, t in enumerate(ticks_[:-1])}
    shards = {s.name: s for s in _shards(shape)}
    groups = _groups(shape)
    layers = [g for g in groups if g != "root"]
    full = {
        g: 4 * n * sum(shards[p].padded_shard(n) for p in names) for g, names in groups.items()
    }  # buffer = unsharded
    last_tick = {g: f"backward.{g}:input_layernorm" for g in layers} | {"root": "backward.embed:accumulate"}
    post = {g: f"backward.{g}:fsdp_post_backward" for g in layers} | {
        "root": "backward.embed:fsdp_post_backward"
    }
    states = []
    for st in book.states:
        if st.name == "parameters" or st.name.startswith("optimizer."):
            continue
        if (
            st.category == "gradients"
        ):  # the full gradient of an unsharded parameter: copied into its group's reduce-scatter
            group = f"layer.{st.name.split('.')[1]}" if st.name.startswith("layer.") else "root"
            states.append(
                State(st.name + " (unsharded)", "upstream_grads", st.nbytes, st.created, post[group])
            )
            continue
        states.append(st)
    states.append(
        State(
            "parameters (own shards, padded)",
            "parameters",
            4 * sum(s.padded_shard(n) for s in shards.values()),
            BEFORE,
            AFTER,
        )
    )
    order = ["root", *layers]
    gathers = n > 1  # on one rank FSDP2 copies its shard without an all-gather buffer
    # forward: each group gathered when it starts; its buffer stays until the next group's copies are made
    for k, g in enumerate(order):
        compute = "forward.embed" if g == "root" else f"forward.{g}"
        unshard = f"{compute}:fsdp_unshard"
        if gathers:
            states.append(
                State(
                    f"{g}.all_gather_buffer (forward)",
                    "workspace",
                    full[g],
                    unshard,
                    f"forward.{order[k + 1]}:fsdp_unshard" if k + 1 < len(order) else "loss",
                )
            )
        kept = (
            g == "root" or stage == 2
        )  # stage 2 and the root: whole from the forward to the end of the backward
        states.append(
            State(f"{g}.unsharded_params", "parameters", full[g], unshard, last_tick[g] if kept else compute)
        )
    if stage == 3:  # backward: each layer gathered again, the next one issued once the copies are made
        issue = "backward.loss:nll"
        for i in reversed(range(len(layers))):
            g = f"layer.{i}"
            copied = (
                "backward.head:fsdp_unshard"
                if i == len(layers) - 1
                else f"backward.layer.{i + 1}:fsdp_unshard"
            )
            if gathers:
                states.append(State(f"{g}.all_gather_buffer (backward)", "workspace", full[g], issue, copied))
            states.append(
                State(f"{g}.unsharded_params (backward)", "parameters", full[g], copied, last_tick[g])
            )
            issue = after[copied]
    # post-backward: the reduce-scatter buffer stays until the next reduce-scatter; sharded gradients until zero_grad
    finish = [f"layer.{i}" for i in reversed(range(len(layers)))] + ["root"]
    for k, g in enumerate(finish):
        until = last_tick[finish[k + 1]] if k + 1 < len(finish) else post[g]
        states += [
            State(f"{g}.reduce_scatter_buffer", "workspace", full[g], post[g], until),
            State(
                f"{g}.grad (own shards, padded)",
                "gradients",
                4 * sum(shards[p].padded_shard(n) for p in groups[g]),
                post[g],
                "optimizer",
                "zero_grad",
            ),
        ]
    local = [shards[name].local(n, rank) for name, _ in shape.parameter_tensors()]
    states += _own_update("own rows", [x for x in local if x], counters=len(local))
    return dataclasses.replace(book, ticks=ticks_, states=tuple(states))


def communication(shape, stage: int, world_size: int) -> dict[str, tuple[int, int]]:
    """Collective -> (calls, payload bytes) one update should issue under PyTorch's engine (see per_rank).
    FSDP2 skips its collectives on one rank; DDP still all-reduces, and broadcasts its buffers (the
    rotary inv_freq) every forward."""
    shards = _shards(shape)
    psi = (
        4 * sum(s.padded_shard(world_size) * world_size for s in shards) if stage >= 2 else 4 * shape.n_params
    )
    buffers = 2 * 4 * shape.head_dim // 2  # Qwen2RotaryEmbedding's inv_freq and original_inv_freq
    if stage in (0, 1):
        out = {
            "broadcast_": (1, buffers),
            "allreduce_": (1, psi),
        }  # one bucket below DDP's 1 MiB first-bucket cap
        if stage == 1:  # every tensor broadcast by its owner after the update
            out["broadcast_"] = (1 + len(shards), buffers + psi)
        return out
    if world_size == 1:
        return {}
    groups = _groups(shape)
    root = 4 * world_size * sum(s.padded_shard(world_size) for s in shards if s.name in groups["root"])
    gathers = (len(groups), psi) if stage == 2 else (2 * len(groups) - 1, 2 * psi - root)
    return {"_allgather_base_": gathers, "_reduce_scatter_base_": (len(groups), psi)}


def zero_volume(collectives: dict[str, tuple[int, int]]) -> float:
    """The ZeRO paper's per-device volume of these collectives, in bytes moved: an all-reduce counts twice
    (a reduce-scatter and an all-gather), an all-gather, a reduce-scatter or a broadcast once."""
    return sum(
        (2 if name.startswith("allreduce") else 1) * payload for name, (_, payload) in collectives.items()
    )


def held_per_rank(config, stage: int, world_size: int, rank: int = 0) -> dict[str, int]:
    """Bytes one rank holds after the update (fp32, AdamW): parameters and gradients (their storages: DDP's
    buckets, FSDP2's padded shards) and optimizer states (two moments per own element, a step counter per
    own tensor; FSDP2 gives every tensor a counter, ZeroRedundancyOptimizer only its own tensors)."""
    from trainmech.ledger.shape import model_shape

    shape = model_shape(config)
    _check_stage(stage, world_size)
    shards = _shards(shape)
    if stage in (0, 1):
        own = (
            [s.numel for s in shards]
            if stage == 0
            else [shards[k].numel for k in zero_partition([s.numel for s in shards], world_size)[rank]]
        )
        return {
            "parameters": 4 * shape.n_params,
            "gradients": 4 * shape.n_params,
            "optimizer_states": 2 * FP32_BYTES * sum(own) + STEP_COUNTER_BYTES * len(own),
        }
    padded = 4 * sum(s.padded_shard(world_size) for s in shards)
    return {
        "parameters": padded,
        "gradients": padded,
        "optimizer_states": 2 * FP32_BYTES * sum(s.local(world_size, rank) for s in shards)
        + STEP_COUNTER_BYTES * len(shards),
    }


FIRST_STAGE_SPLITTING = {
    "optimizer_states": 1,
    "gradients": 2,
    "parameters": 3,
}  # ZeRO: the stage that partitions each


HELD_CAPTION = (
    "the heaviest rank's bytes held (parameters, optimizer states: after the update; gradients: when it starts) "
    "÷ ZeRO's bytes per device (the rank a device's memory must fit)"
)


@dataclass(frozen=True)
class HeldAgainstRule:
    """The heaviest rank's held bytes against ZeRO's bytes per device, keyed (stage, N, category):
    ratio = heaviest / rule, excess = heaviest − rule (the rank a device's memory must fit)."""

    ratio: dict[tuple[int, int, str], float]
    excess: dict[tuple[int, int, str], float]

    def table(self, *, caption: bool = False) -> str:
        """One row per (N, stage), one column per category: the ratios; `caption` puts what they divide above."""
        rows = [HELD_CAPTION] if caption else []
        rows.append(f"{'N':>2} {'stage':>5}" + "".join(f"{c:>18}" for c in FIRST_STAGE_SPLITTING))
        for devices, stage in sorted({(n, s) for s, n, _ in self.ratio}):
            rows.append(
                f"{devices:>2} {stage:>5}"
                + "".join(f"{self.ratio[stage, devices, c]:>18.4f}" for c in FIRST_STAGE_SPLITTING)
            )
        return "\n".join(rows)


def held_against_rule(reports, config) -> HeldAgainstRule:
    """Every stage 1-3 and every N > 1 of `reports` (trainmech.distributed.RankReport: `held` bytes after
    the update, gradients when it starts): the heaviest rank's bytes per category against ZeRO's rule for
    fp32 AdamW (4 + 4 + 8 bytes per parameter, the category divided by N from the stage that partitions
    it, FIRST_STAGE_SPLITTING). AdamW's step counters are not in the rule: they are the excess's remainder."""
    from trainmech.ledger.shape import model_shape

    n_params = model_shape(config).n_params
    whole = {
        c: k * FP32_BYTES * n_params
        for c, k in (("parameters", 1), ("gradients", 1), ("optimizer_states", 2))
    }
    ratio, excess = {}, {}
    for devices in sorted({r.world_size for r in reports if r.world_size > 1}):
        for stage in (1, 2, 3):
            ranks = [r for r in reports if (r.stage, r.world_size) == (stage, devices)]
            for category, split_at in FIRST_STAGE_SPLITTING.items():
                rule = whole[category] / devices if stage >= split_at else whole[category]
                heaviest = max(r.held[category] for r in ranks)
                ratio[stage, devices, category], excess[stage, devices, category] = (
                    heaviest / rule,
                    heaviest - rule,
                )
    return HeldAgainstRule(ratio, excess)
