"""Inside one rank: one AdamW update of the tiny CPU Qwen2 under ZeRO stage 0-3, measured.

`worker` is what each process of `trainmech.distributed.run` runs (and `one_update` what each
torchrun rank runs): join the gloo group over 127.0.0.1, wrap the model in the stage's engine
(`_wrap`: DDP, DDP + ZeroRedundancyOptimizer, or FSDP2), run the update on this rank's rows, and
report it as a `RankReport`: the bytes it holds (local shards), the tracked peak with its phase and
composition (`trainmech.measure.StorageTracker`; PyTorch's FSDPMemTracker beside it on request),
every collective with its payload (`CommCounter`). Rank 0 also returns the full gradients and
updated parameters, gathered, for the comparison with one process (`trainmech.rank_reports`).

Hidden state, per worker process: `worker` sets GLOO_SOCKET_IFNAME=lo (loopback only), ignores the
engines' User/Future/DeprecationWarnings (`quiet_warnings`) and runs torch on one thread.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STAGES",
    "HOST",
    "LR",
    "COLLECTIVE_TIMEOUT_S",
    "Collective",
    "RankReport",
    "CommCounter",
    "one_update",
    "quiet_warnings",
    "worker",
]

STAGES = {
    0: "DDP",
    1: "DDP + ZeroRedundancyOptimizer",
    2: "FSDP2, reshard_after_forward=False",
    3: "FSDP2 per decoder layer + root",
}
HOST = "127.0.0.1"
LR = 1e-3
# A rank waiting for a peer (the store, a collective, the barrier) gives up after this. run() stops every
# worker as soon as one dies, so it only has to outlast a slow peer: 30 s was once too short on a loaded
# 2-core machine, where idle ranks wait at the barrier while the others start up and update.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass
class Collective:
    """Calls of one collective and their payload: the whole tensor it moves (an all-gather's output, a
    reduce-scatter's input, an all-reduce's or a broadcast's tensor), in bytes."""

    calls: int = 0
    payload_bytes: int = 0


@dataclass
class RankReport:
    """What one rank measured in one update of one stage at world size N."""

    stage: int
    world_size: int
    rank: int
    loss: float  # this rank's loss (on its rows)
    held: dict[str, int]  # parameters / gradients / optimizer_states bytes held, local shards
    peak_bytes: int  # the tracked peak of the update: baseline + storages alive at once
    peak_phase: str
    peak_by_category: dict[str, int]
    torch_tracker_peak: int | None  # FSDPMemTracker's peak (stages 2 and 3), None otherwise
    collectives: dict[str, Collective]
    comm_debug_counts: dict[str, int]  # CommDebugMode's counts of the same collectives (when asked for)
    seconds: float
    grads: dict[str, Any] | None = field(default=None, repr=False)  # rank 0: full gradients before the update
    params: dict[str, Any] | None = field(
        default=None, repr=False
    )  # rank 0: full parameters after the update
    step_counts: list[int] = field(
        default_factory=list
    )  # AdamW's state["step"] of each tensor this rank steps


def _local(t):
    """A DTensor's local shard; any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _held(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (a padded FSDP2 shard counts its padding)."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = _local(t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _state_tensors(optimizer) -> list:
    import torch

    inner = getattr(
        optimizer, "optim", optimizer
    )  # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
    return [t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def _step_counts(optimizer) -> list[int]:
    """AdamW's step count of every parameter tensor this rank's optimizer holds state for (its shard)."""
    inner = getattr(optimizer, "optim", optimizer)
    return [int(state["step"]) for state in inner.state.values() if "step" in state]


def _wrap(model, stage: int, group, device):
    """The model under stage `stage` of data parallelism over `group`, and the module the step calls."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    if stage in (0, 1):
        # gradient_as_bucket_view: .grad is a view of DDP's all-reduce bucket, not a second copy of it
        ids = [device.index] if device.type == "cuda" else None  # NCCL under torchrun: one GPU per rank
        runner = DistributedDataParallel(
            model, device_ids=ids, process_group=group, gradient_as_bucket_view=True
        )
        if stage == 0:
            return runner, torch.optim.AdamW(model.parameters(), lr=LR)
        return runner, ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, process_group=group, lr=LR
        )
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, device.type)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(
        model, mesh=mesh, reshard_after_forward=False
    )  # the root: embedding (tied head) and final norm
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _local_copies(named) -> dict:
    """name -> this rank's part of each tensor as a numpy copy: numpy copies no torch op, so no tracker sees it."""
    return {name: _local(t).detach().cpu().numpy().copy() for name, t in named}


def _assembled(parts: list[dict], sharded: bool) -> dict:
    """Full tensors from every rank's parts: FSDP2 shards dim 0 in rank order; otherwise rank 0's are whole."""
    import numpy as np

    if not sharded:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts], axis=0) for name in parts[0]}


def _unsharded_storages(model) -> list:
    """FSDP2's per-parameter all-gather outputs: the storages of the unsharded parameters."""
    out = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else []:
            out += list(getattr(fsdp_param, "all_gather_outputs", []))
    return out


def one_update(
    stage: int,
    world_size: int,
    rank: int,
    group,
    model_name: str,
    batch: int,
    seq: int,
    die_in_phase: str | None = None,
    comm_debug: bool = False,
    device=None,
    torch_tracker: bool = True,
) -> RankReport:
    """Build, wrap and run one AdamW update of stage `stage` on this rank, measured; see RankReport.
    device: where the model runs (the CPU with gloo; a rank's GPU with NCCL under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from trainmech import measure, profiles, workload

    t0 = time.perf_counter()
    device = device or torch.device("cpu")
    model = workload.build_model(profiles.for_mode("cpu").model(model_name), seed=0, device=device).model
    runner, optimizer = _wrap(model, stage, group, device)
    rows = batch // world_size
    data = {
        k: v[rank * rows : (rank + 1) * rows].to(device)
        for k, v in workload.lm_batch("domain", batch, seq).items()
    }
    params = list(model.parameters())
    tracker = measure.StorageTracker(resize_tag="parameters")  # FSDP2's re-gathered parameters are parameters
    # CommDebugMode counts the same collectives, but its dispatch changes how SDPA's backward sums: only on request
    counter, debug = CommCounter(), CommDebugMode() if comm_debug else _Nothing()
    handles = measure.phase_hooks(model, tracker)
    if die_in_phase:  # tests: this rank dies mid-update
        handles += _die_when(model, die_in_phase)
    fsdp_tracker = _fsdp_tracker(model, optimizer) if stage >= 2 and torch_tracker else _Nothing()
    baseline = {"parameters": _held(params), "optimizer_states": 0, "gradients": 0}
    try:
        with fsdp_tracker, debug, counter, tracker:
            loss = runner(**data, use_cache=False).loss
            tracker.phase = "backward.loss"
            loss.backward()
            loss_value = float(loss.detach())
            del loss  # the loop drops the loss after its backward
            tracker.tag([_local(p.grad) for p in params if p.grad is not None], "gradients")
            grads, held_grads = (
                _local_copies((n, p.grad) for n, p in model.named_parameters()),
                _held([p.grad for p in params]),
            )
            tracker.phase = "optimizer"
            optimizer.step()
            tracker.tag([_local(t) for t in _state_tensors(optimizer)], "optimizer_states")
            tracker.phase = "zero_grad"
            optimizer.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    tracker.tag_every_birth(
        _unsharded_storages(model), "parameters"
    )  # their first all-gather allocated them with empty()
    if stage in (
        0,
        1,
    ):  # DDP's buckets hold the gradients from its construction on: outside the tracked storages
        baseline["gradients"] = held_grads
    step = measure.StepMemory(baseline, tracker.allocations, tracker.live, tracker.phases)
    held = {
        "parameters": _held(params),
        "gradients": held_grads,
        "optimizer_states": _held(_state_tensors(optimizer)),
    }
    parts = [None] * world_size
    dist.all_gather_object(parts, (grads, _local_copies(model.named_parameters())), group=group)
    sharded = stage >= 2
    return RankReport(
        stage,
        world_size,
        rank,
        loss_value,
        held,
        step.peak_bytes,
        step.peak_phase,
        step.by_category(),
        fsdp_tracker.peak_bytes() if isinstance(fsdp_tracker, _FSDPTracker) else None,
        dict(counter.collectives),
        {str(k).removeprefix("c10d."): v for k, v in debug.get_comm_counts().items()} if comm_debug else {},
        time.perf_counter() - t0,
        _assembled([p[0] for p in parts], sharded) if rank == 0 else None,
        _assembled([p[1] for p in parts], sharded) if rank == 0 else None,
        _step_counts(optimizer),
    )


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class CommCounter:
    """A TorchDispatchMode that counts every c10d collective and its payload (see Collective).

    On the CPU (gloo) it also makes each collective's release of memory deterministic (`_settle`). gloo
    runs a collective on a thread of its own, and that thread drops its reference to the collective's
    Work only after `wait()` has returned; whenever it was the last reference, a buffer the engine had
    already dropped (FSDP2's all-gather output, say) was freed on gloo's thread at a moment the
    scheduler chose, and a loaded machine moved the tracked peak from one run to the next. So the mode
    waits for the collective, hands the caller an already completed Work instead of gloo's, and waits
    until gloo's thread has let go of the collective's tensors. On the CPU nothing overlaps with a
    collective anyway, and the main thread's operations run in the same order. Settled are the collectives
    whose callers only wait on the Work (SETTLED): FSDP2's all-gather and reduce-scatter, and every
    broadcast (DDP's per-forward broadcast of the buffers, flattened into a fresh 64-byte tensor for
    qwen2-tiny's rotary frequencies, had the same race; ZeroRedundancyOptimizer's parameter broadcasts).
    DDP's all-reduce is passed through: its reducer chains on the Work's future, and its buckets outlive it."""

    # which argument is the whole tensor: an all-gather's output, a reduce-scatter's input, otherwise the tensor
    WHOLE = {"_allgather_base_": 0, "_reduce_scatter_base_": 1}
    SETTLED = ("_allgather_base_", "_reduce_scatter_base_", "broadcast_")
    SETTLE_TIMEOUT_S = 10.0

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.collectives: dict[str, Collective] = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace != "c10d" or func.__name__.split(".")[0] == "barrier":
                    return func(*args, **(kwargs or {}))
                from trainmech.saved_state import flat_tensors

                name = func.__name__.split(".")[0]
                tensors = flat_tensors(args[cls.WHOLE.get(name, 0)])
                c = self.collectives.setdefault(name, Collective())
                c.calls += 1
                c.payload_bytes += sum(t.numel() * t.element_size() for t in tensors)
                every = flat_tensors([args, kwargs or {}])
                if name not in cls.SETTLED or any(t.device.type != "cpu" for t in every):
                    return func(*args, **(kwargs or {}))
                before = [t._use_count() for t in every]
                return cls._settle(func(*args, **(kwargs or {})), every, before)

        return _Mode()

    @classmethod
    def _settle(cls, result, tensors, before):
        """`result` with gloo's Work waited for and replaced by a completed one, once every tensor's use
        count is back where it was before the call (gloo's Work, which holds them, is gone)."""
        import torch

        done = torch._C._distributed_c10d.FakeWork().boxed()
        items = list(result) if isinstance(result, (tuple, list)) else [result]
        for i, item in enumerate(items):
            if isinstance(item, torch.ScriptObject) and hasattr(item, "wait"):
                item.wait()
                items[i] = done
        del item, result  # the caller keeps no handle on gloo's Work: gloo's thread holds the last one
        deadline = time.monotonic() + cls.SETTLE_TIMEOUT_S
        while any(t._use_count() > n for t, n in zip(tensors, before)):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"gloo still held a collective's tensors {cls.SETTLE_TIMEOUT_S:g} s after it completed"
                )
            time.sleep(0)  # let gloo's thread finish
        return tuple(items) if len(items) > 1 else items[0]


class _FSDPTracker:
    """PyTorch's FSDPMemTracker around the same update, reduced to its peak."""

    def __init__(self, model, optimizer):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        self.tracker = FSDPMemTracker(model, optimizer)
        self.tracker.track_inputs(())

    def __enter__(self):
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        return self.tracker.__exit__(*exc)

    def peak_bytes(self) -> int:
        snapshot = self.tracker.get_tracker_snapshot("peak")
        return int(sum(by_type.get("Total", 0) for by_type in snapshot.values()))


def _fsdp_tracker(model, optimizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _FSDPTracker(model, optimizer)


def _die_when(model, phase: str) -> list:
    """A forward pre-hook that kills this process when the layer of `phase` (forward.layer.<i>) starts."""
    i = int(phase.rsplit(".", 1)[1])

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    return [model.model.layers[i].register_forward_pre_hook(die)]


def quiet_warnings() -> None:
    """Known, harmless warnings of the engines on CPU (FSDP2's hooks, DDP's first bucket rebuild)."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def worker(
    rank: int,
    processes: int,
    port: int,
    world_sizes: tuple[int, ...],
    stages: tuple[int, ...],
    model_name: str,
    batch: int,
    seq: int,
    results,
    die_in: tuple[int, str] | None = None,
    comm_debug: bool = False,
    torch_tracker: tuple[int, ...] = (),
) -> None:
    """One process of `processes`: join the process group over 127.0.0.1:port (gloo); for each world size N,
    the first N processes form a group and run each stage's update in it while the others wait; each
    RankReport (or one error line) goes on `results`. Importable, so every start method can run it."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    quiet_warnings()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            HOST, port, processes + 1, False, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=processes,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        groups = {
            n: dist.new_group(list(range(n))) for n in world_sizes
        }  # every process takes part in creating each
        for n in world_sizes:
            if rank < n:
                for stage in stages:
                    last = n == world_sizes[-1] and stage == stages[-1]
                    phase = die_in[1] if die_in is not None and die_in[0] == rank and last else None
                    results.put(
                        one_update(
                            stage,
                            n,
                            rank,
                            groups[n],
                            model_name,
                            batch,
                            seq,
                            phase,
                            comm_debug,
                            torch_tracker=n in torch_tracker,
                        )
                    )
            dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001  one line back to the parent, which stops the others
        results.put(("error", rank, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"))
