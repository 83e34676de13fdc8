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
second; "spawn" / "forkserver" import trainmech.rank_update afresh (the default after CUDA was used here). Every worker is joined, or
killed when one fails or the timeout passes; a failure is one line (`TrainmechError`).

The same worker runs under torchrun, one process per GPU or per CPU rank:

    torchrun --nproc-per-node 2 -m trainmech.distributed --stage 3               # gloo on CPU
    torchrun --nproc-per-node 8 -m trainmech.distributed --stage 3 --backend nccl   # NCCL, one GPU per rank

The modules: this one starts and supervises the processes (`run`) and is the torchrun entry
(`main`); `trainmech.rank_update` is what each rank runs; `trainmech.rank_reports` reads the reports.
Every public name of both is re-exported here, so `distributed.<name>` (Task4) reaches it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue as queue_module
import sys
import time
import warnings

from trainmech import rank_reports, rank_update
from trainmech.errors import TrainmechError
from trainmech.rank_reports import *  # noqa: F403  every name re-exported: distributed.<name>
from trainmech.rank_update import *  # noqa: F403
from trainmech.rank_update import (
    COLLECTIVE_TIMEOUT_S,
    HOST,
    STAGES,
    RankReport,
    one_update,
    quiet_warnings,
    worker,
)

__all__ = [*rank_update.__all__, "start_method_for", "run", *rank_reports.__all__, "main"]


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
    could not touch CUDA safely; the workers import trainmech.rank_update afresh)."""
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
    CUDA, then "spawn" (the workers import trainmech.rank_update afresh). port 0: the system picks a free one. die_in=(rank, "forward.layer.1"): that rank kills itself when the phase
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
        quiet_warnings()
        import torch
        import torch.distributed as dist

        device = torch.device("cpu")
        if args.backend == "nccl":  # one GPU per rank
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        dist.init_process_group(args.backend)
        r = one_update(
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
