"""One training update sharded over N processes on this machine: ZeRO's stages as PyTorch runs them.

    reports = distributed.run(stages=(0, 1, 2, 3), world_sizes=(1, 2, 4))   # one RankReport per (stage, N, rank)

The stages, with PyTorch's own engines:

    0  DDP: every rank holds everything; gradients are all-reduced (in DDP's buckets)
    1  DDP + ZeroRedundancyOptimizer: each rank keeps the AdamW states of its share of the parameters
       and broadcasts what it updated
    2  FSDP2 with reshard_after_forward=False: parameters, gradients and states sharded; a layer's
       parameters are gathered for its forward and stay whole until its backward is done
    3  FSDP2 fully_shard per decoder layer and on the root: gathered for the forward, freed, gathered
       again for the backward (the root, embedding and head, stays whole from its forward on)

Each rank runs the same update of the tiny CPU Qwen2 on its share of one batch (rows split evenly) and
reports what it measured: the parameter, gradient and optimizer-state bytes it holds (local shards),
the tracked peak of the update with its phase and composition (`trainmech.measure.StorageTracker`,
which also follows FSDP2's `UntypedStorage.resize_`; beside it the peak of PyTorch's own
`torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker` for stages 2 and 3), and every collective
with its payload (counted here and by PyTorch's `CommDebugMode`). Rank 0 also returns the full
gradients and updated parameters (gathered) for the comparison with one process.

The processes talk over gloo on 127.0.0.1 only. The rendezvous store is opened by the parent on a
port the system picks (no race for a free port). The workers are plain module-level functions, so
any start method works: "fork" starts them from the caller's warm interpreter in well under a
second; "spawn" / "forkserver" import this module afresh (the default after CUDA was used here). Every worker is joined, or
killed when one fails or the timeout passes; a failure is one line (`TrainmechError`).

The same worker runs under torchrun, one process per GPU or per CPU rank:

    torchrun --nproc-per-node 2 -m trainmech.distributed --stage 3               # gloo on CPU
    torchrun --nproc-per-node 8 -m trainmech.distributed --stage 3 --backend nccl   # NCCL, one GPU per rank
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue as queue_module
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from trainmech.errors import TrainmechError

__all__ = [
    "STAGES",
    "HOST",
    "LR",
    "COLLECTIVE_TIMEOUT_S",
    "Collective",
    "RankReport",
    "CommCounter",
    "worker",
    "start_method_for",
    "run",
    "reference_update",
    "predictions",
    "per_rank_table",
    "communication_table",
    "torch_isfinite",
    "agreement",
    "torch_equal",
    "write_records",
    "main",
]

STAGES = {
    0: "DDP",
    1: "DDP + ZeroRedundancyOptimizer",
    2: "FSDP2, reshard_after_forward=False",
    3: "FSDP2 per decoder layer + root",
}
HOST = "127.0.0.1"
LR = 1e-3
COLLECTIVE_TIMEOUT_S = 30.0  # a rank waiting for a dead peer gives up after this


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


# ----------------------------------------------------------------------------- inside one rank


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


def _one_update(
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
    )


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class CommCounter:
    """A TorchDispatchMode that counts every c10d collective and its payload (see Collective)."""

    # which argument is the whole tensor: an all-gather's output, a reduce-scatter's input, otherwise the tensor
    WHOLE = {"_allgather_base_": 0, "_reduce_scatter_base_": 1}

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.collectives: dict[str, Collective] = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "c10d" and func.__name__.split(".")[0] != "barrier":
                    from trainmech.saved_state import flat_tensors

                    name = func.__name__.split(".")[0]
                    tensors = flat_tensors(args[cls.WHOLE.get(name, 0)])
                    c = self.collectives.setdefault(name, Collective())
                    c.calls += 1
                    c.payload_bytes += sum(t.numel() * t.element_size() for t in tensors)
                return func(*args, **(kwargs or {}))

        return _Mode()


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


def _quiet() -> None:
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
    _quiet()
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
                        _one_update(
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


# ----------------------------------------------------------------------------- the parent


def _check(stages, world_sizes, batch: int) -> None:
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise TrainmechError(f"stage must be 0, 1, 2 or 3 (ZeRO's stages), got {bad[0]!r}")
    for n in world_sizes:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise TrainmechError(f"a world size must be a positive integer, got {n!r}")
        if n > batch:
            raise TrainmechError(
                f"world size {n} is larger than the batch of {batch}: every rank needs at least one sequence"
            )
        if batch % n:
            raise TrainmechError(f"the batch of {batch} does not split evenly over {n} ranks")


def _open_store(port: int):
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            HOST,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    except Exception as e:  # noqa: BLE001  a port in use, or one we may not bind
        raise TrainmechError(
            f"cannot listen on {HOST}:{port} for the workers' rendezvous ({' '.join(str(e).split())[:120]})"
        ) from None


def _blame_the_dead(processes, count: int, wait: float = 2.0) -> None:
    """Raise a one-line error naming a worker that exited with a failure (waiting up to `wait` s for one)."""
    deadline = time.monotonic() + wait
    while True:
        dead = [(r, p.exitcode) for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if dead:
            r, code = dead[0]
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise TrainmechError(
                f"worker {r} of {count} died ({how}) before reporting; every worker was stopped"
            )
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _stop(processes) -> None:
    """Kill every worker still alive, then join them all: none is left behind."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(10)


def start_method_for(requested: str = "auto") -> str:
    """The start method `run` uses: "auto" is "fork" (the workers start from this warm interpreter) unless
    this process has used CUDA, then "spawn" (a process that has used CUDA must not fork: its children
    could not touch CUDA safely; the workers import this module afresh)."""
    if requested != "auto":
        return requested
    import torch

    return "spawn" if torch.cuda.is_initialized() else "fork"


def run(
    stages=(0, 1, 2, 3),
    world_sizes=(1, 2, 4),
    *,
    model: str = "qwen2-tiny",
    batch: int = 4,
    seq: int = 32,
    port: int = 0,
    timeout: float = 120.0,
    start_method: str = "auto",
    die_in: tuple[int, str] | None = None,
    comm_debug: bool = False,
    torch_tracker: tuple[int, ...] | None = None,
) -> list[RankReport]:
    """Every stage at every world size; one RankReport per (N, stage, rank), in that order.

    max(world_sizes) processes start once; for each N the first N of them form a group. start_method
    "auto": "fork" (fast: the workers start from this warm interpreter) unless this process has used
    CUDA, then "spawn" (the workers import this module afresh). port 0: the system picks a free one. die_in=(rank, "forward.layer.1"): that rank kills itself when the phase
    starts, in the last run (tests). comm_debug: PyTorch's CommDebugMode counts the collectives too (it
    changes SDPA's backward summation order, so the comparison with one process is no longer bitwise).
    torch_tracker: the world sizes at which PyTorch's FSDPMemTracker measures stages 2 and 3 beside the
    tracker (None: all; it costs time). Refuses bad input in one line; a worker that fails or dies, or a run past `timeout` seconds, stops
    every worker and raises a one-line TrainmechError.
    """
    stages, world_sizes = tuple(stages), tuple(sorted(world_sizes))
    _check(stages, world_sizes, batch)
    start_method = start_method_for(start_method)
    methods = multiprocessing.get_all_start_methods()
    if start_method not in methods:
        raise TrainmechError(
            f"start method {start_method!r} is not available here; valid: {', '.join(methods)}"
        )
    ctx, count = multiprocessing.get_context(start_method), max(world_sizes)
    if start_method == "fork":  # import the engines once here rather than once in every forked worker
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.optim  # noqa: F401
        import torch.distributed.tensor.debug  # noqa: F401
        import torch.nn.parallel  # noqa: F401
    store = _open_store(port)
    results = ctx.Queue()
    with (
        warnings.catch_warnings()
    ):  # Python 3.12 warns that fork() in a threaded process (a notebook kernel) may deadlock;
        warnings.simplefilter("ignore", DeprecationWarning)  # the workers only run torch and exit
        processes = [
            ctx.Process(
                target=worker,
                args=(
                    r,
                    count,
                    store.port,
                    world_sizes,
                    stages,
                    model,
                    batch,
                    seq,
                    results,
                    die_in,
                    comm_debug,
                    world_sizes if torch_tracker is None else tuple(torch_tracker),
                ),
                daemon=True,
            )
            for r in range(count)
        ]
        for p in processes:
            p.start()
    reports, expected, deadline = [], sum(world_sizes) * len(stages), time.monotonic() + timeout
    try:
        while len(reports) < expected:
            try:
                item = results.get(timeout=0.2)
            except queue_module.Empty:
                _blame_the_dead(processes, count, wait=0.0)
                if time.monotonic() > deadline:
                    raise TrainmechError(
                        f"the {count}-process run took longer than {timeout:g} s; every worker was stopped"
                    ) from None
                continue
            if isinstance(item, tuple) and item[0] == "error":
                _blame_the_dead(
                    processes, count
                )  # a peer that died makes the others fail in their collectives
                raise TrainmechError(
                    f"worker {item[1]} of {count} failed: {item[2]}; every worker was stopped"
                )
            if item.grads is not None:
                import torch

                item.grads = {k: torch.from_numpy(v) for k, v in item.grads.items()}
                item.params = {k: torch.from_numpy(v) for k, v in item.params.items()}
            reports.append(item)
        for p in processes:
            p.join(max(1.0, deadline - time.monotonic()))
        if any(p.exitcode != 0 for p in processes):
            raise TrainmechError(
                f"a worker did not exit cleanly (exit codes {[p.exitcode for p in processes]})"
            )
    finally:
        _stop(processes)
        results.close()
        del store
    return sorted(reports, key=lambda r: (r.world_size, r.stage, r.rank))


def reference_update(model: str = "qwen2-tiny", batch: int = 4, seq: int = 32) -> tuple[float, dict, dict]:
    """The same update in this one process on the whole batch, on one thread like each worker (the thread
    count changes how a matmul splits its sums): (loss, gradients, parameters after the update)."""
    import torch

    from trainmech import profiles, workload

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = workload.build_model(profiles.for_mode("cpu").model(model), seed=0).model
        optimizer = torch.optim.AdamW(m.parameters(), lr=LR)
        loss = m(**workload.lm_batch("domain", batch, seq), use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return float(loss.detach()), grads, {n: p.detach().clone() for n, p in m.named_parameters()}


# ----------------------------------------------------------------------------- reading the reports


def predictions(reports: list[RankReport], model: str = "qwen2-tiny", batch: int = 4, seq: int = 32) -> dict:
    """(stage, N, rank) -> the ledger's per-rank book (`trainmech.ledger.zero.per_rank`)."""
    from trainmech.ledger import zero

    return {
        (r.stage, r.world_size, r.rank): zero.per_rank(model, batch, seq, r.stage, r.world_size, r.rank)
        for r in reports
    }


def per_rank_table(
    reports: list[RankReport], books: dict, model: str = "qwen2-tiny"
) -> tuple[str, float, bool]:
    """One line per (N, stage, rank): held bytes and the peak, measured beside predicted. Returns the text,
    the worst relative peak error and whether every held byte count was predicted exactly."""
    from trainmech.ledger import zero

    lines = [
        f"{'N':>2} {'stage':>5} {'rank':>4} {'params':>9} {'grads':>9} {'opt states':>10} {'peak measured':>14} "
        f"{'predicted':>10} {'error':>7}  peak phase (measured / predicted)"
    ]
    worst, exact = 0.0, True
    for r in reports:
        book = books[(r.stage, r.world_size, r.rank)]
        peak = book.peak_overlap()
        held = zero.held_per_rank(model, r.stage, r.world_size, r.rank)
        exact &= held == r.held
        err = peak.bytes / r.peak_bytes - 1
        worst = max(worst, abs(err))
        lines.append(
            f"{r.world_size:>2} {r.stage:>5} {r.rank:>4} {r.held['parameters']:>9,} {r.held['gradients']:>9,} "
            f"{r.held['optimizer_states']:>10,} {r.peak_bytes:>14,} {peak.bytes:>10,} {err:>+7.2%}  "
            f"{r.peak_phase} / {peak.phase}"
        )
    return "\n".join(lines), worst, exact


def communication_table(reports: list[RankReport], model: str = "qwen2-tiny") -> tuple[str, bool]:
    """Per (stage, N), rank 0's collectives: calls and payload, the volume in the ZeRO paper's terms (in units of
    Ψ fp32 elements, Ψ the parameter count: 4Ψ bytes), beside the prediction. Returns the text and whether every
    count and payload matched."""
    from trainmech.ledger import model_shape, zero, zero_communication_volume

    shape = model_shape(model)
    psi = 4 * shape.n_params
    lines = [
        f"{'N':>2} {'stage':>5}  {'collectives: calls × payload (measured)':<58} {'volume':>7} {'paper':>6}  as predicted"
    ]
    same = True
    for r in (r for r in reports if r.rank == 0):
        measured = {k: (c.calls, c.payload_bytes) for k, c in r.collectives.items()}
        predicted = zero.communication(shape, r.stage, r.world_size)
        same &= measured == predicted
        text = (
            ", ".join(f"{k.strip('_')} {c} × {b / psi:.2f}Ψ" for k, (c, b) in measured.items())
            or "none (one rank)"
        )
        paper = zero_communication_volume(1, r.stage) if r.world_size > 1 else 0
        lines.append(
            f"{r.world_size:>2} {r.stage:>5}  {text:<58} {zero.zero_volume(measured) / psi:>6.2f}Ψ {paper:>5.0f}Ψ  "
            f"{'yes' if measured == predicted else 'no: ' + str(predicted)}"
        )
    return "\n".join(lines), same


def torch_isfinite(t) -> bool:
    """Every element of a tensor finite."""
    import torch

    return bool(torch.isfinite(t).all())


def agreement(reports: list[RankReport], reference: tuple[float, dict, dict]) -> dict[tuple[int, int], dict]:
    """(stage, N) -> the comparison with one process: bitwise (gradients and parameters), the largest relative
    gradient error, the largest parameter difference, the mean loss over the ranks minus the reference loss."""
    loss, grads, params = reference
    out = {}
    for r in (r for r in reports if r.rank == 0):
        losses = [x.loss for x in reports if (x.stage, x.world_size) == (r.stage, r.world_size)]
        out[(r.stage, r.world_size)] = {
            "bitwise": all(torch_equal(r.grads[n], g) for n, g in grads.items())
            and all(torch_equal(r.params[n], p) for n, p in params.items()),
            "grad_rel": max(float((r.grads[n] - g).abs().max() / g.abs().max()) for n, g in grads.items()),
            "grad_abs": max(float((r.grads[n] - g).abs().max()) for n, g in grads.items()),
            "all_finite": all(torch_isfinite(g) for g in r.grads.values())
            and all(torch_isfinite(p) for p in r.params.values()),
            "param_abs": max(float((r.params[n] - p).abs().max()) for n, p in params.items()),
            "loss_diff": sum(losses) / len(losses) - loss,
        }
    return out


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def write_records(
    session,
    reports: list[RankReport],
    books: dict,
    agreed: dict,
    model: str = "qwen2-tiny",
    batch: int = 4,
    seq: int = 32,
) -> list:
    """One TRAIN-STATE-LEDGER record per (stage, N): rank 0's measured and predicted bytes, the others' peaks."""
    from trainmech import profiles, workload

    built = workload.build_model(profiles.for_mode("cpu").model(model), seed=0)
    out = []
    for r in (r for r in reports if r.rank == 0):
        key, peak = (r.stage, r.world_size), books[(r.stage, r.world_size, 0)].peak_overlap()
        ranks = [x for x in reports if (x.stage, x.world_size) == key]
        data = workload.lm_batch("domain", batch, seq)
        out.append(
            session.record(
                "TRAIN-STATE-LEDGER",
                f"cpu-tiny-b{batch}s{seq}-zero{r.stage}-n{r.world_size}",
                built=built,
                input_shape=[batch, seq],
                effective_batch={
                    "sequences": batch,
                    "supervised_tokens": workload.supervised_tokens(data["labels"]),
                },
                dtype="float32",
                update_count=1,
                candidate=f"zero-stage-{r.stage}",
                correctness={
                    "grad_max_abs_error": agreed[key]["grad_abs"],
                    "all_finite": agreed[key]["all_finite"],
                    "skipped_updates": 0,  # every worker runs optimizer.step(): no update is skipped
                    "effective_updates": int(bool(agreed[key]["all_finite"])),  # applied, and finite
                },
                conclusion={
                    "evidence_level": "cpu-mechanism",
                    "next_step": "torchrun --nproc-per-node N -m trainmech.distributed on GPUs (NCCL)",
                },
                metrics={
                    "engine": STAGES[r.stage],
                    "world_size": r.world_size,
                    "backend": "gloo",
                    "held_bytes_rank0": r.held,
                    "measured_peak_bytes_per_rank": [x.peak_bytes for x in ranks],
                    "measured_peak_phase": r.peak_phase,
                    "predicted_peak_bytes": peak.bytes,
                    "predicted_peak_phase": peak.phase,
                    "peak_error": peak.bytes / r.peak_bytes - 1,
                    "measured_by_category": r.peak_by_category,
                    "predicted_by_category": peak.by_category,
                    "collective_calls": {k.strip("_"): c.calls for k, c in r.collectives.items()},
                    "collective_payload_bytes": {
                        k.strip("_"): c.payload_bytes for k, c in r.collectives.items()
                    },
                    "bitwise_equal_to_one_process": agreed[key]["bitwise"],
                    "grad_max_rel_error": agreed[key]["grad_rel"],
                    "param_max_abs_error": agreed[key]["param_abs"],
                }
                | (
                    {}
                    if r.torch_tracker_peak
                    is None  # only where PyTorch's FSDPMemTracker ran (torch_tracker=)
                    else {"torch_fsdp_mem_tracker_peak_bytes": r.torch_tracker_peak}
                ),
            )
        )
    return out


# ----------------------------------------------------------------------------- torchrun


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: this rank's update of one stage; prints one line per rank. The measurement is the
    same StorageTracker (tensor storages, on any device); with NCCL on GPUs, FSDP2's all-gather and
    reduce-scatter buffers are ordered by CUDA streams and live otherwise than on gloo, which the ledger's
    per-rank book (`ledger.zero.per_rank`, checked on the CPU) does not model."""
    from trainmech.errors import OneLineParser

    parser = OneLineParser(
        prog="torchrun --nproc-per-node N -m trainmech.distributed",
        description="One sharded training update per rank (ZeRO stage 0-3 with DDP / ZeroRedundancyOptimizer / FSDP2).",
    )
    parser.add_argument(
        "--stage", type=int, default=3, help="0 DDP, 1 DDP + ZeroRedundancyOptimizer, 2 / 3 FSDP2 (default 3)"
    )
    parser.add_argument(
        "--backend", default="gloo", help="gloo (CPU) or nccl (one GPU per rank); default gloo"
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences in the whole batch (default 4)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    args = parser.parse_args(argv)
    try:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise TrainmechError(
                "run it under torchrun (RANK and WORLD_SIZE are not set), or call trainmech.distributed.run()"
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _check((args.stage,), (world_size,), args.batch)
        if args.backend not in ("gloo", "nccl"):
            raise TrainmechError(f"backend must be gloo or nccl, got {args.backend!r}")
        _quiet()
        import torch
        import torch.distributed as dist

        device = torch.device("cpu")
        if args.backend == "nccl":  # one GPU per rank
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        dist.init_process_group(args.backend)
        r = _one_update(
            args.stage, world_size, rank, dist.group.WORLD, "qwen2-tiny", args.batch, args.seq, device=device
        )
        print(
            f"rank {rank}/{world_size} stage {args.stage} ({STAGES[args.stage]}): loss {r.loss:.4f}; held "
            + ", ".join(f"{k} {v:,} B" for k, v in r.held.items())
            + f"; peak {r.peak_bytes:,} B in {r.peak_phase}; "
            + ", ".join(f"{k} x{c.calls} {c.payload_bytes:,} B" for k, c in r.collectives.items()),
            flush=True,
        )
        dist.destroy_process_group()
        return 0
    except TrainmechError as e:
        print(f"trainmech: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
