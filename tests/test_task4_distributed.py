"""Task4 · 8: ZeRO's stages run by PyTorch's engines over gloo, per rank, against the ledger's per-rank projection;
the launcher's refusals and its failure handling (no process outlives a failed run)."""

import dataclasses
import os
import socket
import subprocess
import sys

import pytest
import torch

from trainmech import distributed, ledger
from trainmech.errors import TrainmechError
from trainmech.ledger import zero

pytestmark = pytest.mark.task4


def _children_alive() -> list[int]:
    """Pids of this process's children that still run and were not running before the test (zombies are
    reaped ones' leftovers; a child an earlier test left, e.g. multiprocessing's resource tracker, is not ours)."""
    me, alive = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                alive.append(int(entry))
    return [pid for pid in alive if pid not in _BEFORE]


_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before():
    """The children already running when a test starts."""
    _BEFORE.clear()
    _BEFORE.update(_children_alive())
    yield


@pytest.fixture(scope="module")
def reports():
    return distributed.run(stages=(0, 1, 2, 3), world_sizes=(1, 2))


def test_every_stage_is_predicted_rank_by_rank(reports):
    assert len(reports) == 4 * (1 + 2)
    shape = ledger.model_shape("qwen2-tiny")
    for r in reports:
        book = zero.per_rank("qwen2-tiny", 4, 32, r.stage, r.world_size, r.rank)
        assert book.peak_overlap().bytes == r.peak_bytes and book.peak_overlap().phase == r.peak_phase, (
            r.stage,
            r.world_size,
        )
        assert zero.held_per_rank("qwen2-tiny", r.stage, r.world_size, r.rank) == r.held
        measured = {k: (c.calls, c.payload_bytes) for k, c in r.collectives.items()}
        assert measured == zero.communication(shape, r.stage, r.world_size), (r.stage, r.world_size)
        if r.torch_tracker_peak is not None:  # PyTorch's FSDPMemTracker also counts the rotary buffers (64 B)
            assert r.torch_tracker_peak - r.peak_bytes == 64


def test_sharding_divides_what_the_stage_promises(reports):
    held = {(r.stage, r.world_size, r.rank): r.held for r in reports}
    one = held[(0, 1, 0)]
    assert (
        held[(1, 2, 0)]["optimizer_states"] + held[(1, 2, 1)]["optimizer_states"]
        == one["optimizer_states"] + 4 * 0
    )
    for stage in (2, 3):
        assert all(held[(stage, 2, r)][k] == one[k] // 2 for r in (0, 1) for k in ("parameters", "gradients"))
    assert held[(0, 2, 0)] == one  # DDP: everything on every rank


def test_the_update_equals_one_process(reports):
    loss, grads, params = distributed.reference_update()
    for r in (r for r in reports if r.rank == 0):
        if r.world_size == 1:  # the same arithmetic on one rank: bitwise
            assert all(torch.equal(r.grads[n], g) for n, g in grads.items()), r.stage
            assert all(torch.equal(r.params[n], p) for n, p in params.items()), r.stage
        else:  # the ranks' partial sums are added in another order: rounding only
            rel = max(float((r.grads[n] - g).abs().max() / g.abs().max()) for n, g in grads.items())
            moved = max(float((r.params[n] - p).abs().max()) for n, p in params.items())
            assert rel <= 1e-5 and moved <= 1e-2 * distributed.LR, (r.stage, rel, moved)
    mean_loss = {}
    for r in reports:
        mean_loss.setdefault((r.stage, r.world_size), []).append(r.loss)
    assert all(abs(sum(v) / len(v) - loss) <= 1e-6 * loss for v in mean_loss.values())


def test_skipped_and_effective_updates_are_counted_from_each_ranks_step_counts(reports):
    n = len(ledger.model_shape("qwen2-tiny").parameter_tensors())
    groups = {}
    for r in reports:
        groups.setdefault((r.stage, r.world_size), []).append(r)
    for (stage, size), ranks in groups.items():
        counts = [len(r.step_counts) for r in ranks]
        assert sum(counts) == n if stage == 1 else counts == [n] * size, (stage, size, counts)
        assert distributed.update_counts(ranks, n, True) == {"skipped_updates": 0, "effective_updates": 1}
        assert distributed.update_counts(ranks, n, False) == {"skipped_updates": 0, "effective_updates": 0}
        # one rank whose optimizer did not step (a skipped step: its counts stay 0), or lost a tensor's state
        unstepped = [dataclasses.replace(ranks[-1], step_counts=[0] * len(ranks[-1].step_counts))]
        lost = [dataclasses.replace(ranks[-1], step_counts=ranks[-1].step_counts[1:])]
        for broken in (unstepped, lost):
            assert distributed.update_counts(ranks[:-1] + broken, n, True) == {
                "skipped_updates": 1,
                "effective_updates": 0,
            }, (stage, size)


def test_pytorchs_comm_debug_mode_counts_the_same_collectives():
    for r in distributed.run(stages=(1, 3), world_sizes=(2,), comm_debug=True):
        assert r.comm_debug_counts == {k: c.calls for k, c in r.collectives.items()}, r.stage


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"world_sizes": (8,)}, "world size 8 is larger than the batch of 4"),
        ({"world_sizes": (3,)}, "does not split evenly over 3 ranks"),
        ({"stages": (4,)}, "stage must be 0, 1, 2 or 3"),
        ({"world_sizes": (0,)}, "a world size must be a positive integer"),
        ({"start_method": "thread"}, "start method 'thread' is not available"),
    ],
)
def test_bad_input_is_refused_in_one_line(kwargs, words):
    with pytest.raises(TrainmechError, match=words) as e:
        distributed.run(**kwargs)
    assert "\n" not in str(e.value)
    assert _children_alive() == []


def test_a_port_in_use_is_refused_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(TrainmechError, match="cannot listen on 127.0.0.1") as e:
            distributed.run(stages=(0,), world_sizes=(1,), port=taken.getsockname()[1])
    assert "\n" not in str(e.value) and _children_alive() == []


def test_a_worker_killed_mid_update_stops_every_process():
    with pytest.raises(TrainmechError, match="died") as e:
        distributed.run(stages=(3,), world_sizes=(2,), die_in=(1, "forward.layer.1"))
    assert "every worker was stopped" in str(e.value) and "\n" not in str(e.value)
    assert _children_alive() == []


def test_a_run_past_its_timeout_stops_every_process():
    with pytest.raises(TrainmechError, match="took longer than"):
        distributed.run(stages=(0, 1, 2, 3), world_sizes=(2,), timeout=0.5)
    assert _children_alive() == []


def test_spawned_workers_import_the_module_afresh():
    """What a notebook kernel needs: the worker is a module-level function, so "spawn" can start it."""
    (r,) = distributed.run(stages=(0,), world_sizes=(1,), start_method="spawn", timeout=300)
    assert r.held["parameters"] == 4 * ledger.model_shape("qwen2-tiny").n_params


def test_torchrun_runs_the_same_worker(tmp_path):
    """The README's torchrun command; each rank's stdout read from torchrun's own per-rank log (`--tee 3`
    keeps it on the console too): ranks printing into one shared pipe at once is not what is tested.

    A rank aborted (SIGABRT, "terminate called without an active exception") twice in about thirty runs
    on a loaded 2-core machine, cause not yet found: such a run is tried once more, in a fresh log folder,
    and every other failure fails at once. The rank's own stderr log goes into the message."""
    for attempt in (1, 2):
        logs_dir = tmp_path / f"attempt-{attempt}"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        command += ["--log-dir", str(logs_dir), "--tee", "3", "-m", "trainmech.distributed", "--stage", "2"]
        run = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if run.returncode == 0 or "SIGABRT" not in run.stderr or attempt == 2:
            break
    rank_errors = " | ".join(log.read_text()[-500:] for log in sorted(logs_dir.rglob("stderr.log")))
    assert run.returncode == 0, (run.stderr[-1500:], rank_errors)
    logs = sorted(logs_dir.rglob("stdout.log"))
    lines = sorted(line for log in logs for line in log.read_text().splitlines() if line.startswith("rank "))
    assert [line.split()[1] for line in lines] == ["0/2", "1/2"], (logs, run.stdout[-2000:])
    assert all("parameters 251,008 B" in line for line in lines)  # half of the 502,016 parameter bytes each
    alone = subprocess.run(
        [sys.executable, "-m", "trainmech.distributed"], capture_output=True, text=True, timeout=300
    )
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1 and "torchrun" in alone.stderr


def test_every_first_dimension_of_the_tiny_model_splits_evenly_over_2_and_4_ranks():
    # what exercise 4.4's prose says of qwen2-tiny: FSDP2's rows per rank are exact at N = 2 and N = 4
    from trainmech import profiles, workload

    model = workload.build_model(profiles.for_mode("cpu").model("qwen2-tiny"), seed=0).model
    assert all(p.shape[0] % 4 == 0 for p in model.parameters())
    assert any(p.shape[0] % 3 for p in model.parameters())  # and 3 ranks do not (the exercise's case)
