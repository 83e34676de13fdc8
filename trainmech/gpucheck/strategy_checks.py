"""gpu-check's package checks of the memory strategies, the gates and Task5's records.

Each runs one CUDA-only branch at small sizes on a `Probe` (trainmech.gpucheck.probe): activation
offload on CUDA streams (its hooks never synchronising, its copies on the side streams overlapping
kernels, its D2H copies hidden behind a stalled compute stream), torch's save_on_cpu timed by CUDA events, a
checkpoint candidate judged through the gates (the CUDA RNG, the allocator's peaks, accept / tune /
no-gain / costs-memory), and Task5's strategy records. Every strategy's gradients are held to the baseline's: bitwise
on a CPU, within 1e-4 of each gradient's scale on CUDA.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager, nullcontext

import torch

from trainmech import ledger, measure, profiles
from trainmech.decision import time_ratio_text
from trainmech.gpucheck.offload_overlap import (
    measured_bound,
    overlap_claims,
    profiled_step,
    sleep_rate,
    stalling,
)
from trainmech.gpucheck.probe import Probe, forward_backward, require, same_gradients

__all__ = [
    "check_offload",
    "check_save_on_cpu",
    "check_gates",
    "check_strategy_records",
]


@contextmanager
def _sync_error():
    """CUDA: inside, any call that makes the host wait for the device raises (torch.cuda.set_sync_debug_mode)."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _never_syncing(hooks):
    """The offload's own calls — pack, unpack, the layer-group pre-hooks — each under _sync_error (the model's
    own ops run outside it: whether they synchronise is the model's business, not the offload's)."""

    def guarded(fn):
        def call(*args):
            with _sync_error():
                return fn(*args)

        return call

    hooks.pack_hook, hooks.unpack_hook = guarded(hooks.pack_hook), guarded(hooks.unpack_hook)
    hooks._start_group = guarded(hooks._start_group)  # what the layers' forward pre-hooks call
    return hooks


def check_offload(probe: Probe) -> str:
    """The CUDA copy path (CudaCopies): on a GPU with CUDA streams, its second step's hooks and finish() under
    the sync debug mode "error", a third step profiled (copies on the side streams during kernels) and a fourth
    with the compute stream stalled after every D2H copy is queued (the copies hide behind the stalls); on a CPU with
    HostStreams (every copy done at once, every stream call logged, the log checked for order) the same four
    steps, the sync debug mode skipped (there is no device to wait for); the overlap verdict's arithmetic is
    checked on known intervals on both, the host's own intervals only printed (a CPU copies in line)."""
    from trainmech.offload import HostStreams, activation_offload

    model = probe.model()
    batch = probe.lm_batch()
    ref = forward_backward(model, batch)
    hidden = probe.batch * probe.seq * model.config.hidden_size * 4
    streams = None if probe.cuda else HostStreams()
    rate = sleep_rate() if probe.cuda else None
    runs, offloads, starts = [], [], []
    for step in range(4):  # the steps after the first reuse its host arena
        starts.append(len(streams.log) if streams else 0)
        hooks = activation_offload(
            model, min_bytes=hidden // 4, exempt_last=0, prefetch_groups=1, streams=streams
        )
        if step == 2:
            trace = profiled_step(model, batch, hooks, probe.cuda)
        else:
            if step == 3:  # each stall twice the first step's longest D2H copy
                first = offloads[0].copies
                d2h_s = max(first.streams.seconds(a, b) for name, a, b in first.copies if name == "d2h")
                stalls = stalling(hooks, max(2 * d2h_s, 2e-4), rate)
                backend = hooks.copies.streams
                origin = backend.mark(backend.compute())
            guarded = probe.cuda and step == 1  # the step after the arena exists, as every timed update
            ours = forward_backward(model, batch, _never_syncing(hooks) if guarded else hooks)
            with _sync_error() if guarded else nullcontext():
                hooks.finish()
        runs.append(hooks.read_times())  # the events, after the step (it waits for the device once)
        offloads.append(hooks)
    st, copies = runs[0], offloads[0].copies
    same, how = same_gradients(probe, ours, ref)
    require(same, f"gradients under ActivationOffload differ from the baseline ({how})")
    require(
        st.d2h_bytes > 0
        and st.on_demand == st.fetched_unused == st.unpacked_again == 0
        and st.unpacked == st.packed,
        f"transfer bookkeeping: {st}",
    )
    # the window observed: each inner group's H2D issued one group ahead (a fetch at a kept reference's unpack,
    # in the group's own backward, would show a lead of 0)
    layers = model.config.num_hidden_layers
    inner = {g: lead for g, lead in st.fetch_leads.items() if g + 1 < layers}
    require(
        inner and set(inner.values()) == {1},
        f"prefetch window 1, but the H2D leads per group were {st.fetch_leads}",
    )
    require(
        runs[1].host_chunks_allocated == 0,
        f"the second step allocated {runs[1].host_chunks_allocated} new host chunk(s)",
    )
    require(  # each let-go and each use waited on its copy's end event once
        len(copies.d2h_waits) == st.offloaded and len(copies.h2d_waits) == st.prefetched + st.on_demand,
        f"{len(copies.d2h_waits)} D2H / {len(copies.h2d_waits)} H2D waits for {st.offloaded} offloaded, "
        f"{st.prefetched + st.on_demand} fetched",
    )
    bound = measured_bound(probe, model, batch, st.d2h_bytes, st.h2d_bytes)
    hidden_line = overlap_claims(probe, offloads[2], trace, offloads[3], stalls, origin, bound)
    if probe.cuda:
        syncs = "the second step's hooks and finish() never synchronise (sync debug mode 'error')"
    else:
        bounds = zip(starts, [*starts[1:], len(streams.log)])
        problems = [p for start, stop in bounds for p in streams.out_of_order(start, stop)]
        require(not problems, "; ".join(problems[:3]))
        syncs = f"{len(streams.log)} stream calls in order; sync debug mode skipped (CUDA only)"
    return (
        f"gradients equal ({how}); {st.offloaded} storages, {st.d2h_bytes:,} B each way, {st.prefetched} prefetched, "
        f"arena reused; {hidden_line}; {syncs}"
    )


def _saved_references(model, batch) -> list[int]:
    """Bytes of every saved reference of one forward + backward, seen by a pair of hooks that keeps them in place."""
    seen = []

    def pack(t):
        seen.append(t.numel() * t.element_size())
        return t

    forward_backward(model, batch, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    return seen


# save_on_cpu's copies queue on the compute stream; a step under it must take at least this share of their summed
# time longer than the plain step (not all of it: the plain step's launch gaps can absorb a little). A first guess,
# not yet measured on a GPU; gpu-check prints it with its finding.
SERIAL_COPY_FRACTION = 0.5


def _step_seconds(model, batch, make_hooks, repeats: int = 3) -> float:
    """Median seconds of a forward + backward under make_hooks() (None: plain), CUDA events on the compute
    stream around it; one untimed step first."""
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward_backward(model, batch, make_hooks() if make_hooks else None)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


def check_save_on_cpu(probe: Probe) -> str:
    from trainmech.offload import CountingSaveOnCpu

    model = probe.model()
    batch = probe.lm_batch()
    ref = forward_backward(model, batch)
    hooks = CountingSaveOnCpu(probe.device)
    ours = forward_backward(model, batch, hooks)
    st = hooks.read_times()
    same, how = same_gradients(probe, ours, ref)
    require(same, f"gradients under save_on_cpu differ from the baseline ({how})")
    saved = _saved_references(model, batch)
    # Every pack's result is checked to be a pinned host copy of its own with the saved tensor's bytes
    # (CountingSaveOnCpu's check_host_copy raises otherwise): its count and bytes against a plain pair of hooks
    # would count the same hook calls and the same numel x element_size again, so they are printed, not required.
    # What can still fail: every saved reference read back in the backward, exactly once.
    require(
        st.unpacked == st.packed and st.unpacked_again == 0,
        f"save_on_cpu's host copies: {st.packed} packed, {st.unpacked} read back, {st.unpacked_again} read again",
    )
    if probe.cuda:  # its copies run on the compute stream: the step grows by at least (most of) their time
        # The first step's events also time the pinned allocations (each pack misses the caching host allocator);
        # take the copy time from a warm step, as the step times below (first step dropped) are.
        warm = CountingSaveOnCpu(probe.device)
        forward_backward(model, batch, warm)
        st = warm.read_times()
        plain_s = _step_seconds(model, batch, None)
        moved_s = _step_seconds(model, batch, lambda: CountingSaveOnCpu(probe.device))
        require(
            st.transfer_time_s is not None
            and st.transfer_time_s > 0
            and moved_s - plain_s >= SERIAL_COPY_FRACTION * st.transfer_time_s,
            f"save_on_cpu on CUDA: copies {st.transfer_time_s * 1e3:.3f} ms, yet the step grew by only "
            f"{(moved_s - plain_s) * 1e3:.3f} ms ({plain_s * 1e3:.3f} -> {moved_s * 1e3:.3f} ms): not serial on the "
            f"compute stream",
        )
    return (
        f"gradients equal ({how}); {st.packed} host copies ({st.d2h_bytes:,} B; a plain pair of hooks saw "
        f"{len(saved)} saved references, {sum(saved):,} B), each read back once"
        + (
            f", {st.transfer_time_s * 1e3:.2f} ms of copies, the step {(moved_s - plain_s) * 1e3:.2f} ms longer "
            f"(floor {SERIAL_COPY_FRACTION:.0%} of the copy time, a first guess)"
            if probe.cuda
            else ""
        )
    )


def check_gates(probe: Probe) -> str:
    from trainmech import candidates, gate_report, gates, performance

    # CUDA: the smoke-gates shape, where the ledger predicts a checkpoint gain (test_task6_gates checks it)
    seq = profiles.for_mode(probe.mode).workload("smoke-gates").seq if probe.cuda else probe.seq
    workload = candidates.gate_workload(
        probe.model(),
        rows=4,
        seq=seq,
        micro_batches=2,
        attempts=3,
        warmup_updates=1,
        decay_updates=1,
        dropout=0.1,
    )
    reference = gates.make_reference(workload)
    report = gate_report.judge(
        candidates.candidate("checkpoint", "TRAIN-CHECKPOINT", candidates.activation_checkpointing),
        workload,
        reference,
        warmup=1,
        repeats=2,
    )
    require(
        report.failed_gate is None,
        f"the checkpoint candidate failed the {report.failed_gate} gate: {report.lines()}",
    )
    report.record_fields("gpu-check")  # the record builds from a GPU report
    table = gate_report.strategy_table(report.reference_performance, {"checkpoint": report})
    require("checkpoint" in table, f"the strategy table has no checkpoint row: {table}")
    p, ref = report.performance, report.reference_performance
    require(
        p.tracked_forward_backward_bytes < ref.tracked_forward_backward_bytes
        and p.bytes_per_row < ref.bytes_per_row,
        f"checkpointing keeps no less: forward + backward {p.tracked_forward_backward_bytes:,} vs "
        f"{ref.tracked_forward_backward_bytes:,} B, per sequence {p.bytes_per_row:,} vs {ref.bytes_per_row:,} B",
    )
    if (
        probe.cuda
    ):  # the measured savings and phase against the ledger's bytes for this very workload (None: undecided)
        spec = profiles.for_mode(probe.mode).workload("smoke-gates")
        predicted = gates.ledger_inputs(spec, "checkpoint", padded=True, residual_dropout=True)
        held = gates.against_ledger(p, ref, predicted)
        require(
            report.evidence_level == "gpu-measured" and all(ok is not False for ok, _ in held.values()),
            f"{report.evidence_level}; against the ledger ({predicted.shape}): "
            + "; ".join(words for _, words in held.values()),
        )
        # a reserved peak is not what runs out: the checkpoint, whose tensors hold less, runs under a cap at the
        # reference's reserved peak (measured just before, in the same state) plus the rule's slack
        capped = performance.capped_updates(
            report.candidate, reference.candidate, workload, slack=gates.RULE.no_higher_slack
        )
        require(
            capped.runs_out_first is False,
            f"the checkpoint candidate's allocated peak {p.peak_allocated_bytes:,} B, the reference's "
            f"{ref.peak_allocated_bytes:,} B; {capped.words()}",
        )
        measured = (
            f"outcome {report.outcome}: {report.reason}; against the ledger: "
            + "; ".join(words for _, words in held.values())
            + f"; {capped.words()}"
        )
    else:  # bitwise on a CPU; and the allocator's bookkeeping with the CPU allocator forced
        worst = report.verdict("gradients").evidence["window_worst"]
        require(
            all(e == 0 for e in worst), f"a CPU replays bitwise, yet the worst errors per window are {worst}"
        )
        forced, _ = performance.remeasure(
            report.candidate, reference.candidate, workload, warmup=1, repeats=1, allocator="cpu-profiler"
        )
        ratio = forced.peak_allocated_bytes / forced.tracked_peak_bytes
        require(
            abs(ratio - 1) <= 0.02
            and forced.peak_reserved_bytes is None
            and forced.cuda_context_bytes is None,
            f"CPU allocator / tracked peak {ratio:.3f}, reserved {forced.peak_reserved_bytes}",
        )
        measured = f"bitwise over {len(worst)} windows; CPU allocator / tracked update peak {ratio:.3f}"
    return f"checkpoint candidate passes gates 1-4 (RNG, noise floor), keeps less per sequence; {measured}"


# The record's measured peak against the allocator's over an untracked step: on CUDA within this many bytes (the
# allocator's per-step extras are absolute; a first guess, not yet measured on a GPU), on a CPU (its allocator seen
# by the profiler, temporaries inside ops included) within this share of it.
PEAK_AGREEMENT_BYTES = 2 << 20
PEAK_AGREEMENT_SHARE = 0.02


def _allocator_peak(model, optimizer, batch, context) -> int:
    """The allocator's peak over one untracked training step inside `context(model)` (no StorageTracker, no
    ledger): the bytes allocated above the start, plus the parameters and optimizer states counted by storage."""
    device = next(model.parameters()).device
    states = (
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.device == device
    )
    held = [*model.parameters(), *states]
    state = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}.values())
    with context(model), measure.allocator_window(device, assume_start_bytes=state) as window:
        model(**batch, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return window.peak_bytes - window.start_bytes + state


def check_strategy_records(probe: Probe) -> str:
    from trainmech import candidates, gates, performance, strategy_records, tracing
    from trainmech.ledger.compare import MEASURED_PEAK_WITH

    model = probe.model()
    batch = probe.lm_batch()
    workload = candidates.fixed_batch_workload(model, batch, updates=2)
    baseline = candidates.Candidate("baseline", "TRAIN-CHECKPOINT")
    base = tracing.run_trace(baseline, workload, keep_weights=True)
    candidate = candidates.candidate("hf-checkpoint", "TRAIN-CHECKPOINT", candidates.activation_checkpointing)
    trace = tracing.run_trace(candidate, workload, teacher=base)
    run = strategy_records.StrategyRun(
        "hf-checkpoint", "TRAIN-CHECKPOINT", 2, trace, gates.gradients_gate(base, trace, "float32")
    )
    require(run.verdict.passed, run.verdict.message)
    run.performance, run.reference_performance = performance.remeasure(
        candidate, baseline, workload, warmup=1, repeats=2
    )
    fields = run.record_fields("gpu-check")
    state = workload.fresh_state(baseline)
    baseline.backward(state, workload.windows[0])
    baseline.update(state)
    books = {
        s: ledger.scenario_ledger(
            model.config, probe.batch, probe.seq, strategy=s, update="steady", device=probe.device.type
        )
        for s in ("baseline", "checkpoint")
    }
    steps = [ledger.tracked_step(model, state.optimizer, batch, None)]
    steps.append(ledger.tracked_step(model, state.optimizer, batch, candidates.activation_checkpointing))
    direct = _allocator_peak(model, state.optimizer, batch, candidates.activation_checkpointing)
    ledger_record = strategy_records.ledger_fields(
        "hf-checkpoint",
        books["checkpoint"],
        steps[1],
        steps[0],
        books["baseline"],
        model=probe.model_name,
        min_bytes=None,
    )
    metrics = ledger_record["metrics"]
    # the record's measured peak against the allocator's peak over another, untracked checkpointed step plus the
    # state bytes counted here (not by the ledger), and below the baseline step's (checkpointing keeps less)
    base_peak = ledger.Comparison(
        probe.model_name, probe.batch, probe.seq, "steady", books["baseline"], steps[0]
    ).measured_peak
    peak = metrics["measured_peak_bytes"]
    within = PEAK_AGREEMENT_BYTES if probe.cuda else PEAK_AGREEMENT_SHARE * direct
    require(
        metrics["measured_with"] == MEASURED_PEAK_WITH["cuda" if probe.cuda else "cpu"]
        and peak is not None
        and abs(peak - direct) <= within
        and peak < base_peak,
        f"the state-ledger record's measured peak {peak} ({metrics['measured_with']!r}): the allocator's peak over "
        f"an untracked checkpointed step {direct:,} B (within {within:,.0f} B), the baseline step's {base_peak:,} B",
    )
    if probe.cuda:
        require(
            fields["resources"]["peak_reserved_bytes"] is not None
            and ledger_record["resources"]["peak_allocated_bytes"] is not None,
            f"record fields on CUDA: {fields['resources']}, ledger record {ledger_record['resources']}",
        )
    else:
        tracked = fields["metrics"]["cpu_tracked_peak_bytes"]
        base_tracked = fields["metrics"]["baseline_cpu_tracked_peak_bytes"]
        require(
            tracked is not None and 0 < tracked < base_tracked,
            f"the record's tracked peak {tracked}, baseline {base_tracked}",
        )
    return (
        f"gate 2 passed; records filled for {probe.device.type}; ledger peak error {ledger_record['metrics']['peak_error']:+.2%}; "
        f"the record's peak {peak:,} B, the allocator's over an untracked step {direct:,} B"
        + (f"; {time_ratio_text(run.performance, run.reference_performance)}" if probe.cuda else "")
    )
