"""The registry of CUDA-only branches and the checks that run them at small sizes.

A `Branch` names the sites it covers (`scan` keys: `measure.cuda_peaks`, `Task5:timing-table`), says
what only CUDA runs there and what chooses it, and either carries a `check` (package code) or is
run by the notebook pass (a notebook cell). Each package check takes a `Probe` and runs on any
device: on a GPU it takes the CUDA side, on a CPU the same logic with the CPU side chosen, so the
CPU tests run every check before a GPU ever does. A check returns its one-line reason, or raises.

To add a branch: write it, run `pytest tests/test_gpucheck.py` (it names the uncovered site), then
add its key to a Branch's `covers` here — with a check that reaches it, or, for a notebook cell, a
line in NOTEBOOK_CELLS.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainmech import ledger, measure, profiles, workload
from trainmech.errors import TrainmechError

__all__ = [
    "CheckFailed",
    "require",
    "Probe",
    "check_session",
    "check_timing_and_peaks",
    "check_step_memory",
    "check_memory_history",
    "dispatched_attention_kernel",
    "check_ledger_on_device",
    "check_offload",
    "check_save_on_cpu",
    "check_gates",
    "check_scenarios",
    "check_strategy_records",
    "check_rng_resume",
    "check_distributed_torchrun",
    "check_distributed_spawn",
    "Branch",
    "PACKAGE",
    "NOT_BRANCHES",
    "NOTEBOOK_CELLS",
    "KERNEL_CHOICE_CELLS",
    "registry",
    "covered",
    "notebook_cells",
    "result_row",
    "with_expectation",
    "repo_path",
]


class CheckFailed(AssertionError):
    """A check's finding, in one line."""


def require(condition: bool, reason: str) -> None:
    if not condition:
        raise CheckFailed(reason)


@dataclass(frozen=True)
class Probe:
    """What a check runs on: a device, the profile that goes with it, and a small model and batch."""

    device: torch.device
    mode: str
    model_name: str
    batch: int
    seq: int

    @classmethod
    def for_device(cls, device: torch.device | str) -> Probe:
        """CUDA: the Qwen2.5-0.5B shape with 2 layers, b2 s64. CPU: the tiny CPU model, b2 s32."""
        device = torch.device(device)
        if device.type == "cuda":
            return cls(device, "TRAIN-CUDA-MECHANISM", "qwen2.5-0.5b-2layers", 2, 64)
        return cls(device, "cpu", "qwen2-tiny", 2, 32)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def model(self, **kwargs) -> torch.nn.Module:
        spec = profiles.for_mode(self.mode).model(self.model_name)
        return workload.build_model(spec, seed=0, device=self.device, **kwargs).model

    def lm_batch(self, batch: int | None = None, seq: int | None = None) -> dict[str, torch.Tensor]:
        data = workload.lm_batch("domain", batch or self.batch, seq or self.seq)
        return {k: v.to(self.device) for k, v in data.items()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst_rel(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((ours[n] - g).abs().max()) / max(float(g.abs().max()), 1e-30) for n, g in ref.items())


def _fwd_bwd(model, batch, hooks=None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with hooks if hooks is not None else nullcontext():
        model(**batch, use_cache=False).loss.backward()
    return _grads(model)


def _same(probe: Probe, ours, ref) -> tuple[bool, str]:
    """Bitwise on a CPU; within 1e-4 of each gradient's scale on CUDA (atomics reorder sums)."""
    if not probe.cuda:
        return all(torch.equal(ours[n], g) for n, g in ref.items()), "bitwise"
    worst = _worst_rel(ours, ref)
    return worst <= 1e-4, f"worst relative error {worst:.1e}"


# ----------------------------------------------------------------------------- package checks


def check_session(probe: Probe) -> str:
    from trainmech import session

    with tempfile.TemporaryDirectory() as scratch:
        s = session.start(probe.mode, "gpu-check", page="gpu-check", results_dir=scratch)
    env = s.environment
    require(
        s.on_cuda == probe.cuda and env["device"] == str(s.device),
        f"session device {env['device']}, on_cuda={s.on_cuda}",
    )
    problems = profiles.version_problems(s.profile)
    require(not problems, "; ".join(problems))
    if probe.cuda:
        require(
            bool(env["gpu"]) and bool(env["cuda"]) and env["gpu_memory_bytes"] > 0,
            f"environment lacks GPU facts: {env}",
        )
        return (
            f"{env['device']}: {env['gpu']}, CUDA {env['cuda']}, {env['gpu_memory_bytes'] / 2**30:.0f} GiB; torch {env['torch']}, "
            f"transformers {env['transformers']} satisfy {s.profile.profile_id}"
        )
    require(
        env["gpu"] is None and env["cuda"] is None and env["gpu_memory_bytes"] is None,
        f"CPU session reports a GPU: {env}",
    )
    refused = []
    for start in (lambda: session.start("TRAIN-CUDA-MECHANISM", "x"), _runner_cuda):
        try:
            start()
        except TrainmechError as e:
            refused.append("\n" not in str(e) and "CUDA" in str(e))
    require(refused == [True, True], "the CUDA mode is not refused in one sentence on a machine without CUDA")
    return f"cpu session without GPU facts; the CUDA mode refused in one sentence by session and runner; versions satisfy {s.profile.profile_id}"


def _runner_cuda():
    from trainmech import runner

    runner.run("TRAIN-CUDA-MECHANISM", "x", progress=False)


def check_timing_and_peaks(probe: Probe) -> str:
    n = 32 << 20
    _, seconds = measure.timed(
        lambda: torch.ones(n, dtype=torch.uint8, device=probe.device).sum(), probe.device
    )
    require(seconds > 0, f"timed() returned {seconds} s")
    with measure.allocator_window(probe.device) as window:
        a = torch.ones(n, dtype=torch.uint8, device=probe.device)
        b = torch.ones(2 * n, dtype=torch.uint8, device=probe.device)
        del a, b
    above = window.peak_above_start
    require(
        3 * n <= above <= 3 * n + (2 << 20),
        f"{window.source}: peak {above:,} B above the start for 3 x {n:,} B alive at once",
    )
    peaks, allocated = measure.cuda_peaks(probe.device), measure.cuda_allocated(probe.device)
    if probe.cuda:
        require(
            peaks["peak_allocated_bytes"] >= window.start_bytes + 3 * n and allocated is not None,
            f"cuda_peaks {peaks} below the window's {window.start_bytes + 3 * n:,} B",
        )
        require(
            peaks["peak_reserved_bytes"] >= peaks["peak_allocated_bytes"],
            f"reserved below allocated: {peaks}",
        )
    else:
        require(
            set(peaks.values()) == {None} and allocated is None,
            f"CPU peaks must be None (unknown), got {peaks}, {allocated}",
        )
    return f"{window.source}: {above:,} B above the start for 3 x {n >> 20} MiB alive at once; timed {seconds * 1e3:.2f} ms"


def check_step_memory(probe: Probe) -> str:
    model = probe.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = probe.lm_batch()
    allocator = None if probe.cuda else "cpu-profiler"  # CPU: the CPU allocator's count, forced
    ratios = []
    for _ in ("first", "steady"):
        step = measure.training_step_memory(model, optimizer, batch, allocator=allocator)
        require(step.step_peak_allocated_bytes is not None, "no allocator peak over the step")
        ratios.append(step.step_peak_allocated_bytes / step.peak_bytes)
    low, high = (0.97, 1.5) if probe.cuda else (0.99, 1.01)
    require(
        all(low <= r <= high for r in ratios),
        f"allocator / tracked peak {ratios[0]:.3f} (first), {ratios[1]:.3f} (steady), "
        f"outside [{low}, {high}]",
    )
    return f"allocator ({allocator or 'cuda'}) / tracked tensor peak: first {ratios[0]:.3f}, steady {ratios[1]:.3f}"


def check_memory_history(probe: Probe) -> str:
    """The allocator's history around a tracked step (CUDA), recorded after a warm-up forward and backward and
    labelled by the tracker, the blocks alive at its start counted as the baseline; off CUDA the tracker's own."""
    model, batch = probe.model(), probe.lm_batch()
    model(**batch, use_cache=False).loss.backward()  # the first matmuls' workspaces: before the recording
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with measure.cuda_memory_history(probe.device) as history:
        step = measure.training_step_memory(model, optimizer, batch)
    timeline = measure.step_history(history, [step])
    tracked = [b for b in timeline.blocks if b.category != "allocator only"]
    if not probe.cuda:
        require(
            dict(history) == {} and history.source is None,
            f"history off CUDA must stay empty, got {dict(history)}",
        )
        require(
            timeline.source == "storage-tracker" and len(tracked) == len(step.allocations),
            "the tracker's history lost blocks",
        )
        return f"off CUDA the tracker's history stands in: {len(timeline.blocks)} blocks"
    require(
        history.get("alloc_events", 0) >= len(step.allocations) and history.get("segments", 0) >= 1,
        f"history recorded {dict(history)}",
    )
    require(
        len(tracked) >= 0.95 * len(step.allocations),
        f"only {len(tracked)} of {len(step.allocations)} tracked storages matched",
    )
    require(
        history.get("alive_at_start_bytes", 0) >= step.baseline["parameters"],
        f"the baseline alive when the recording began: {history.get('alive_at_start_bytes')} bytes, "
        f"the parameters alone {step.baseline['parameters']:,}",
    )
    return (
        f"{history['alloc_events']} alloc / {history['free_events']} free events, {history['segments']} segment(s), "
        f"{history['reserved_bytes']:,} B reserved; {history['alive_at_start_bytes']:,} B alive at the start; "
        f"{len(tracked)} blocks labelled, {len(timeline.blocks) - len(tracked)} allocator-only"
    )


class _SdpaOps(TorchDispatchMode):
    """The names of the aten ops a forward dispatches."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def dispatched_attention_kernel(model: torch.nn.Module, batch: dict) -> str:
    """flash / efficient / cudnn / math: the SDPA kernel one training forward of the model actually ran (grad
    enabled, as in training: SDPA's choice of kernel looks at requires_grad; the graph is dropped after),
    read from every op it dispatched (`ledger.kernel_of_ops`)."""
    ops = _SdpaOps()
    with ops:
        model(**batch, use_cache=False)
    attention = sorted(n for n in ops.names if "scaled_dot_product" in n or n in ("bmm", "_softmax"))
    return ledger.kernel_of_ops(ops.names) or f"unknown ({', '.join(attention) or 'no attention op'})"


def check_ledger_on_device(probe: Probe) -> str:
    """The ledger predicts with the kernel the forward dispatched (unpadded and padded; on a CPU that is also
    the ledger's rule), the peaks within 5 %, the lifecycles key by key (CUDA: within
    CUDA_LIFECYCLE_TOLERANCE), bf16's per-layer saved bytes against the dispatched kernel's inventory with
    the RNG state weighed on this device, and (CUDA) the warm-up's cuBLAS workspaces and the allocator
    model's allocated / reserved peaks beside the measured ones."""
    first, steady = ledger.measure_point(
        probe.model_name, probe.batch, probe.seq, run_mode=probe.mode, seed=0, warmup=True
    )
    shape = first.predicted.shape
    kernels, rules = [], []
    for padded in (False, True):
        rule = ledger.attention_kernel(shape, "fp32", probe.device.type, padded=padded)
        data = ledger.padded_batch(probe.batch, probe.seq) if padded else probe.lm_batch()
        ran = dispatched_attention_kernel(probe.model(), {k: v.to(probe.device) for k, v in data.items()})
        require(
            probe.cuda or ran == rule,
            f"the ledger's rule says the {rule} kernel for fp32 on a CPU{' with padding' if padded else ''}, "
            f"the forward ran {ran}",
        )
        kernels.append(ran)
        rules.append(rule)
    require(
        first.kernel == kernels[0] and first.predicted.attention == kernels[0],
        f"measure_point saw the {first.kernel} kernel and predicted with {first.predicted.attention}; "
        f"the forward dispatched {kernels[0]}",
    )
    errors = f"peak error first {first.error:+.1%}, steady {steady.error:+.1%}"
    require(
        abs(first.error) <= 0.05 and abs(steady.error) <= 0.05,
        f"the ledger's peak is off by more than 5 %: {errors}",
    )
    tolerance = ledger.CUDA_LIFECYCLE_TOLERANCE if probe.cuda else (0.0, 0)
    require(
        not any(c.lifecycle_differences(tolerance) for c in (first, steady)),
        f"lifecycles crossing a phase: {first.lifecycle_line(tolerance)}; {steady.lifecycle_line(tolerance)}",
    )
    require(
        (first.workspace_bytes is not None) == probe.cuda,
        f"the warm-up's workspace bytes {first.workspace_bytes} on {probe.device.type}",
    )
    (bf16,) = ledger.measure_point(
        probe.model_name, probe.batch, probe.seq, run_mode=probe.mode, seed=0, dtype="bf16", steps=("first",)
    )
    rows = ledger.layer_saved(
        bf16.predicted.shape, probe.batch, probe.seq, "bf16", bf16.kernel, device=probe.device.type
    )
    added = bf16.measured.saved_added_per_layer(bf16.predicted.shape.num_layers)
    rng = [f"{t.name.rsplit('.', 1)[-1]} {t.nbytes} B" for t in rows if "rng" in t.name]
    inventory = sum(t.nbytes for t in rows)
    require(
        all(abs(x - inventory) <= (0.01 * inventory if probe.cuda else 0) for x in added),
        f"bf16 saved bytes per layer {added} vs the {bf16.kernel} inventory's {inventory:,} "
        f"(RNG state rows: {rng or 'none'})",
    )
    measured = (
        (first, steady)
        if probe.cuda
        else ledger.measure_point(probe.model_name, probe.batch, probe.seq, seed=0, allocator="cpu-profiler")
    )
    peaks = ledger.allocated_reserved(*measured)
    model = peaks.model
    require(
        model.reserved_peak >= model.allocated_peak >= model.tensor_peak,
        f"allocator model out of order: {model}",
    )
    require(
        probe.cuda or (abs(peaks.tracked_error) <= 0.01 and peaks.reserved_error is None),
        f"the CPU allocator's peak beside the tracked tensors: {peaks.lines()}",
    )
    fields = ledger.record_fields(
        steady, [first, steady], worst_error=0.0, on_cuda=probe.cuda, updates=[first, steady]
    )
    carried = (fields["metrics"]["measured_peak_bytes"], fields["metrics"]["peak_error"])
    require(
        carried == (steady.measured_peak, steady.error),
        f"the record carries {carried}, the steady step measured {(steady.measured_peak, steady.error)}",
    )
    require(fields["correctness"]["all_finite"] is True, f"the record's correctness: {fields['correctness']}")
    if probe.cuda:
        allocator_fields = [
            fields["resources"]["peak_allocated_bytes"],
            fields["resources"]["peak_reserved_bytes"],
            fields["metrics"]["measured_forward_backward_peak_bytes"],
        ]
        require(
            all(v is not None for v in allocator_fields), f"the record's allocator peaks: {allocator_fields}"
        )
    else:
        require(
            fields["metrics"]["cpu_tracked_peak_bytes"] == steady.measured.peak_bytes > 0,
            f"the record's tracked peak {fields['metrics']['cpu_tracked_peak_bytes']}",
        )
    gpu = ""
    if probe.cuda:
        gpu = (
            f"; the ledger's rule said {rules[0]} / {rules[1]}; cuBLAS workspaces {first.workspace_bytes:,} B; "
            f"allocator model allocated {peaks.allocated_error:+.1%}, reserved {peaks.reserved_error:+.1%} "
            "off the measured peaks"
        )
    return (
        f"kernels {kernels[0]} / {kernels[1]} (padded) dispatched and predicted with; foreach={probe.cuda}; {errors}; "
        f"bf16 saved per layer as the {bf16.kernel} inventory (RNG state rows: {rng or 'none'}){gpu}"
    )


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
    the sync debug mode "error"; on a CPU with HostStreams (every copy done at once, every stream call logged,
    the log checked for order), the sync debug mode skipped (there is no device to wait for)."""
    from trainmech.offload import HostStreams, activation_offload

    model = probe.model()
    batch = probe.lm_batch()
    ref = _fwd_bwd(model, batch)
    hidden = probe.batch * probe.seq * model.config.hidden_size * 4
    streams = None if probe.cuda else HostStreams()
    runs, offloads, starts = [], [], []
    for step in range(2):  # the second step must reuse the first one's host arena
        starts.append(len(streams.log) if streams else 0)
        hooks = activation_offload(
            model, min_bytes=hidden // 4, exempt_last=0, prefetch_groups=1, streams=streams
        )
        guarded = probe.cuda and step == 1  # the step after the arena exists, as every timed update
        ours = _fwd_bwd(model, batch, _never_syncing(hooks) if guarded else hooks)
        with _sync_error() if guarded else nullcontext():
            runs.append(hooks.finish())
        hooks.read_times()  # the events, after the step (it waits for the device once)
        offloads.append(hooks)
    st, copies = runs[0], offloads[0].copies
    same, how = _same(probe, ours, ref)
    require(same, f"gradients under ActivationOffload differ from the baseline ({how})")
    require(
        st.d2h_bytes == st.h2d_bytes > 0 and st.prefetched > 0 and st.on_demand == 0,
        f"transfer bookkeeping: {st}",
    )
    require(
        runs[1].host_chunks_allocated == 0,
        f"the second step allocated {runs[1].host_chunks_allocated} new host chunk(s)",
    )
    require(
        not copies._done and not copies._ready and all(e.used for e in offloads[0].entries),
        "a copy's end event was never waited for, or a fetched copy never used",
    )
    require(
        len(copies.copies) == st.offloaded + st.prefetched + st.on_demand,
        f"{len(copies.copies)} copies for {st.offloaded} offloaded + {st.prefetched + st.on_demand} fetched",
    )
    require(
        st.transfer_time_s is not None and st.transfer_time_s > 0 and st.exposed_transfer_time_s is not None,
        f"transfer times {st.transfer_time_s} / {st.exposed_transfer_time_s}",
    )
    if probe.cuda:
        times = f"copies {st.transfer_time_s * 1e3:.2f} ms, exposed {st.exposed_transfer_time_s * 1e3:.2f} ms"
        syncs = "the second step's hooks and finish() never synchronise (sync debug mode 'error')"
    else:
        bounds = zip(starts, [*starts[1:], len(streams.log)])
        problems = [p for start, stop in bounds for p in streams.out_of_order(start, stop)]
        require(not problems, "; ".join(problems[:3]))
        require(
            st.exposed_transfer_time_s == 0.0,
            f"host copies are done at once, yet {st.exposed_transfer_time_s} s exposed",
        )
        times = f"{len(streams.log)} stream calls in order, host-clock copies {st.transfer_time_s * 1e3:.2f} ms, none exposed"
        syncs = "sync debug mode skipped (CUDA only)"
    return (
        f"gradients equal ({how}); {st.offloaded} storages, {st.d2h_bytes:,} B each way, {st.prefetched} prefetched, "
        f"arena reused; {times}; {syncs}"
    )


def _saved_references(model, batch) -> list[int]:
    """Bytes of every saved reference of one forward + backward, seen by a pair of hooks that keeps them in place."""
    seen = []

    def pack(t):
        seen.append(t.numel() * t.element_size())
        return t

    _fwd_bwd(model, batch, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    return seen


def check_save_on_cpu(probe: Probe) -> str:
    from trainmech.offload import CountingSaveOnCpu

    model = probe.model()
    batch = probe.lm_batch()
    ref = _fwd_bwd(model, batch)
    hooks = CountingSaveOnCpu(probe.device)
    ours = _fwd_bwd(model, batch, hooks)
    st = hooks.read_times()
    same, how = _same(probe, ours, ref)
    require(same, f"gradients under save_on_cpu differ from the baseline ({how})")
    saved = _saved_references(model, batch)
    require(
        st.packed == len(saved) and st.d2h_bytes == st.h2d_bytes == sum(saved),
        f"save_on_cpu counted {st.packed} references, {st.d2h_bytes:,} B; a plain pair of hooks saw "
        f"{len(saved)}, {sum(saved):,} B",
    )
    if probe.cuda:  # its copies run on the compute stream: all of their time is exposed
        require(
            st.transfer_time_s is not None
            and st.transfer_time_s > 0
            and st.exposed_transfer_time_s == st.transfer_time_s,
            f"save_on_cpu on CUDA: transfer {st.transfer_time_s} s, exposed {st.exposed_transfer_time_s} s",
        )
    else:
        require(
            st.transfer_time_s is None and st.exposed_transfer_time_s is None,
            f"save_on_cpu off CUDA: transfer {st.transfer_time_s} s, exposed {st.exposed_transfer_time_s} s",
        )
    return (
        f"gradients equal ({how}); every one of {len(saved)} saved references moved, {st.d2h_bytes:,} B each way"
        + (f", {st.transfer_time_s * 1e3:.2f} ms of copies" if probe.cuda else "")
    )


def check_gates(probe: Probe) -> str:
    from trainmech import candidates, gate_report, gates, tracing

    gw = candidates.gate_workload(
        probe.model(),
        rows=4,
        seq=probe.seq,
        micro_batches=2,
        attempts=3,
        warmup_updates=1,
        decay_updates=1,
        dropout=0.1,
    )
    reference = gates.make_reference(gw)
    report = gate_report.judge(
        candidates.candidate("checkpoint", "TRAIN-CHECKPOINT", candidates.activation_checkpointing),
        gw,
        reference,
        warmup=1,
        repeats=2,
    )
    require(
        report.failed_gate is None,
        f"the checkpoint candidate failed the {report.failed_gate} gate: {report.lines()}",
    )
    fields, table = (
        report.record_fields("gpu-check"),
        gate_report.strategy_table(report.reference_performance, {"checkpoint": report}),
    )
    require(
        fields["conclusion"]["decision"] == report.decision and "checkpoint" in table,
        "record fields or the strategy table",
    )
    p, ref = report.performance, report.reference_performance
    require(
        p.tracked_forward_backward_bytes < ref.tracked_forward_backward_bytes
        and p.bytes_per_row < ref.bytes_per_row,
        f"checkpointing keeps no less: forward + backward {p.tracked_forward_backward_bytes:,} vs "
        f"{ref.tracked_forward_backward_bytes:,} B, per sequence {p.bytes_per_row:,} vs {ref.bytes_per_row:,} B",
    )
    if probe.cuda:
        require(
            report.outcome in gates.OUTCOMES
            and report.evidence_level == "gpu-measured"
            and p.on_gpu
            and p.forward_backward_reserved_bytes
            and p.cuda_context_bytes is not None
            and p.bytes_per_row > 0,
            f"outcome {report.outcome} ({report.evidence_level}): {report.reason}; {p}",
        )
        measured = f"outcome {report.outcome} ({report.evidence_level}): {report.reason}"
    else:  # bitwise on a CPU; and the allocator's bookkeeping with the CPU allocator forced
        worst = report.verdict("gradients").evidence["window_worst"]
        require(
            all(e == 0 for e in worst), f"a CPU replays bitwise, yet the worst errors per window are {worst}"
        )
        forced, _ = tracing.remeasure(
            report.candidate, reference.candidate, gw, warmup=1, repeats=1, allocator="cpu-profiler"
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


def check_scenarios(probe: Probe) -> str:
    from trainmech import candidates
    from trainmech.optimizers import OptimizerInBackward

    model = probe.model()
    batch = probe.lm_batch()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizers = {
        "foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
        "in-backward": lambda ps: OptimizerInBackward(
            ps, lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=probe.cuda)
        ),
    }
    got = ledger.measure_matrix(
        model,
        batch,
        initial,
        strategies={"baseline": None, "checkpoint": candidates.activation_checkpointing},
        optimizers=optimizers,
    )
    rows = ledger.scenario_matrix(
        model.config,
        probe.batch,
        probe.seq,
        device=probe.device.type,
        strategies=("baseline", "checkpoint"),
        optimizer_steps=tuple(optimizers),
    )
    tracked = ledger.scenarios.worst_peak_error(
        rows, {k: (m.forward_backward_bytes, m.whole_bytes) for k, m in got.items()}
    )
    if probe.cuda:
        allocated = {k: (m.forward_backward_allocated, m.whole_allocated) for k, m in got.items()}
        require(all(a and b for a, b in allocated.values()), f"allocator peaks missing: {allocated}")
        return (
            f"{len(rows)} scenarios measured; ledger vs tracked bytes worst {tracked:.1%}, vs allocated worst "
            f"{ledger.scenarios.worst_peak_error(rows, allocated):.1%} (accuracy targets: issue 15)"
        )
    require(
        tracked <= 0.01 and all(m.whole_allocated is None for m in got.values()),
        f"ledger vs tracked bytes {tracked:.2%}",
    )
    return f"{len(rows)} scenarios: the ledger's views within {tracked:.2%} of the tracked bytes; allocator fields null off CUDA"


def check_strategy_records(probe: Probe) -> str:
    from trainmech import candidates, gates, strategy_records, tracing
    from trainmech.ledger.compare import MEASURED_PEAK_WITH

    model = probe.model()
    batch = probe.lm_batch()
    gw = candidates.fixed_batch_workload(model, batch, updates=2)
    baseline = candidates.Candidate("baseline", "TRAIN-CHECKPOINT")
    base = tracing.run_trace(baseline, gw, keep_weights=True)
    cand = candidates.candidate("hf-checkpoint", "TRAIN-CHECKPOINT", candidates.activation_checkpointing)
    trace = tracing.run_trace(cand, gw, teacher=base)
    run = strategy_records.StrategyRun(
        "hf-checkpoint", "TRAIN-CHECKPOINT", 2, trace, gates.gradients_gate(base, trace, "float32")
    )
    require(run.verdict.passed, run.verdict.message)
    run.performance, run.reference_performance = tracing.remeasure(cand, baseline, gw, warmup=1, repeats=2)
    fields = run.record_fields("gpu-check")
    state = gw.fresh_state(baseline)
    baseline.backward(state, gw.windows[0])
    baseline.update(state)
    books = {
        s: ledger.scenario_ledger(
            model.config, probe.batch, probe.seq, strategy=s, update="steady", device=probe.device.type
        )
        for s in ("baseline", "checkpoint")
    }
    steps = [
        ledger.tracked_step(model, state.optimizer, batch, c)
        for c in (None, candidates.activation_checkpointing)
    ]
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
    measured = ledger.Comparison(
        probe.model_name, probe.batch, probe.seq, "steady", books["checkpoint"], steps[1]
    )
    require(
        metrics["measured_with"] == MEASURED_PEAK_WITH["cuda" if probe.cuda else "cpu"]
        and (metrics["measured_peak_bytes"], metrics["measured_forward_backward_peak_bytes"])
        == (measured.measured_peak, measured.measured_forward_backward_peak),
        f"the state-ledger record's measured fields are not Task4's: {metrics['measured_with']!r}, "
        f"{metrics['measured_peak_bytes']}, {metrics['measured_forward_backward_peak_bytes']}",
    )
    tracked = fields["metrics"]["cpu_tracked_peak_bytes"]
    if probe.cuda:
        require(
            tracked is None
            and fields["resources"]["peak_reserved_bytes"] is not None
            and ledger_record["resources"]["peak_allocated_bytes"] is not None,
            f"record fields on CUDA: {fields['resources']}, ledger record {ledger_record['resources']}",
        )
    else:
        base_tracked = fields["metrics"]["baseline_cpu_tracked_peak_bytes"]
        require(
            tracked == run.performance.tracked_peak_bytes and 0 < tracked < base_tracked,
            f"the record's tracked peak {tracked} (measured {run.performance.tracked_peak_bytes}), baseline {base_tracked}",
        )
    return (
        f"gate 2 passed; records filled for {probe.device.type}; ledger peak error {ledger_record['metrics']['peak_error']:+.2%}"
        + (
            f"; median x{run.performance.step_time_median_s / run.reference_performance.step_time_median_s:.2f}"
            if probe.cuda
            else ""
        )
    )


def check_rng_resume(probe: Probe) -> str:
    from trainmech import update

    model = probe.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _fwd_bwd(model, probe.lm_batch())
    optimizer.step()
    with tempfile.TemporaryDirectory() as folder:
        update.save_training_state(
            folder, model=model, optimizer=optimizer, scaler=None, clock=update.UpdateClock(), data_position=7
        )
        drawn = torch.rand(8, device=probe.device)
        before = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        _, position = update.load_training_state(folder, model=model, optimizer=optimizer, scaler=None)
        again = torch.rand(8, device=probe.device)
    require(torch.equal(drawn, again), f"the {probe.device.type} RNG was not restored")
    require(
        position == 7 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before)),
        "model or position not restored",
    )
    return f"parameters, optimizer and the {probe.device.type} RNG restored from safetensors"


def check_distributed_torchrun(probe: Probe) -> str:
    """The torchrun entry of trainmech.distributed on one rank: NCCL on the GPU, gloo on a CPU."""
    import subprocess
    import sys

    backend = "nccl" if probe.cuda else "gloo"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "-m",
            "trainmech.distributed",
            "--stage",
            "3",
            "--backend",
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("rank 0/1")]
    require(
        run.returncode == 0 and len(lines) == 1,
        f"torchrun exit {run.returncode}: {(run.stderr or run.stdout).strip().splitlines()[-1:]}",
    )
    return f"{backend}: {lines[0][:160]}"


def check_distributed_spawn(probe: Probe) -> str:
    """trainmech.distributed.run from this process: on a GPU machine CUDA is initialised here, so "auto"
    spawns; on a CPU "spawn" is forced, the same path."""
    from trainmech import distributed

    method = "auto" if probe.cuda else "spawn"
    if probe.cuda:
        torch.zeros(1, device=probe.device)  # CUDA initialised in this process, as in a CUDA-mode notebook
    reports = distributed.run(
        stages=(3,), world_sizes=(2,), start_method=method, timeout=300, torch_tracker=()
    )
    require(
        len(reports) == 2 and reports[0].held["parameters"] == reports[1].held["parameters"],
        f"reports {reports}",
    )
    return f"{method}: 2 workers, FSDP2 stage 3, {reports[0].held['parameters']:,} parameter bytes per rank"


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Branch:
    name: str
    covers: tuple[str, ...]  # scan keys
    cuda_side: str  # what runs only on CUDA, and what chooses it
    check: Callable[[Probe], str] | None = None  # None: a notebook cell, run by the notebook pass
    seconds: float = 2.0  # estimated on one H200 (small sizes)
    known: str | None = None  # an open issue whose fix this branch waits for

    @property
    def notebook(self) -> str | None:
        return self.covers[0].split(":")[0] if self.check is None else None


PACKAGE = [
    Branch(
        "session",
        ("session.start", "session.capture_environment", "session.Session.on_cuda", "runner.run"),
        "profile.device == 'cuda' picks cuda:<current>; the environment reads the GPU's name, memory and CUDA version; "
        "versions checked against the profile",
        check_session,
        2,
    ),
    Branch(
        "measure.timing",
        (
            "measure.timed",
            "measure.cuda_peaks",
            "measure.reset_cuda_peaks",
            "measure.cuda_allocated",
            "measure.allocator_window",
        ),
        "CUDA synchronises around timings and reads the caching allocator's statistics (the CPU: the profiler's)",
        check_timing_and_peaks,
        1,
    ),
    Branch(
        "measure.step_memory",
        ("measure.training_step_memory",),
        "the allocator's peak over a tracked step beside the tracked tensor peak (CPU: the profiler's allocator, forced)",
        check_step_memory,
        4,
    ),
    Branch(
        "measure.history",
        ("measure.cuda_memory_history",),
        "torch.cuda.memory._record_memory_history(stacks='python') around a tracked step; the snapshot's blocks "
        "labelled by the tracker (CPU: the tracker's own history)",
        check_memory_history,
        2,
    ),
    Branch(
        "ledger.cuda",
        (
            "ledger.inventory.attention_kernel",
            "ledger.inventory.rng_state_saved",
            "ledger.inventory._rng_outputs",
            "ledger.states._state_bytes_per_tensor",
            "ledger.book.training_state_lifecycle",
            "ledger.compare.measure_point",
            "ledger.compare.record_fields",
            "ledger.peers.benchmark",
            "ledger.cli.render",
        ),
        "kernel choice: the ledger predicts with the SDPA kernel the forward dispatched (cuDNN, flash, efficient or math; "
        "its rule, math for fp32 GQA and efficient when padded, is only reported on CUDA); the RNG seed and offset weighed "
        "by running the fused op on the GPU; foreach AdamW temporaries and AdamW's step counters on the host on CUDA; "
        "the warm-up's cuBLAS workspaces; lifecycles key by key within CUDA_LIFECYCLE_TOLERANCE; the allocator model's "
        "peaks beside the allocator's own",
        check_ledger_on_device,
        8,
    ),
    Branch(
        "offload",
        (
            "offload.hooks.ActivationOffload.__init__",
            "offload.copies.host_arena",
            "offload.copies.side_streams",
            "offload.copies.CudaStreams.compute",
            "offload.copies.CudaStreams.mark",
            "offload.copies.CudaStreams.copy",
            "offload.copies.CudaStreams.synchronize",
        ),
        "CudaCopies on CUDA streams: pinned host arena, cached D2H / H2D side streams, held sources released at a D2H "
        "event, CUDA events for copy and wait times read after the step, the hooks never synchronising (sync debug "
        "mode 'error'); on a CPU the same bookkeeping over HostStreams, its order checked",
        check_offload,
        3,
    ),
    Branch(
        "offload.save_on_cpu",
        (
            "offload.save_on_cpu.CountingSaveOnCpu.__init__",
            "offload.save_on_cpu.CountingSaveOnCpu._mark",
            "offload.save_on_cpu.CountingSaveOnCpu.pack",
            "offload.save_on_cpu.CountingSaveOnCpu.unpack",
            "offload.save_on_cpu.CountingSaveOnCpu.read_times",
        ),
        "torch's save_on_cpu with pinned memory, timed by CUDA events read after the step: every copy on the compute "
        "stream, so its exposed transfer time is its transfer time",
        check_save_on_cpu,
        3,
    ),
    Branch(
        "gates.cuda",
        (
            "tracing._rng_digest",
            "tracing._rng_states",
            "tracing._set_rng_states",
            "tracing.Performance.on_gpu",
            "tracing._allocator",
            "tracing._emptied_cache",
            "tracing._allocator_peaks",
            "gates.decide",
            "gate_report.performance_verdict",
            "gate_report.Report.record_fields",
            "gate_report.strategy_table",
        ),
        "the CUDA RNG in the inputs gate and the teacher-forced pass; empty_cache, reserved / allocated peaks through "
        "measure.allocator_window, the CUDA context and the bytes per sequence in the performance stage; accept / tune / "
        "no-gain (CPU: the same allocator bookkeeping with the CPU allocator forced)",
        check_gates,
        8,
    ),
    Branch(
        "scenarios.measured",
        ("ledger.compare.measure_matrix", "ledger.compare._allocator_probe"),
        "the scenario matrix measured with the allocator's peaks after the backward and after the step (CPU: tracked bytes)",
        check_scenarios,
        5,
    ),
    Branch(
        "strategy_records",
        ("strategy_records.StrategyRun.record_fields", "strategy_records.ledger_fields"),
        "Task5's records take the allocator's peaks on CUDA, the tracked bytes elsewhere",
        check_strategy_records,
        5,
    ),
    Branch(
        "distributed.torchrun",
        ("distributed._wrap", "distributed.main"),
        "trainmech.distributed under torchrun with NCCL: the model on the rank's GPU, DDP device_ids, a cuda DeviceMesh",
        check_distributed_torchrun,
        20,
    ),
    Branch(
        "distributed.spawn",
        ("distributed.start_method_for",),
        "after CUDA was used in this process the workers are spawned, not forked (CPU: spawn forced)",
        check_distributed_spawn,
        25,
    ),
    Branch(
        "update.rng",
        ("update._rng_state", "update._set_rng_state"),
        "the CUDA generator's state saved into and restored from the checkpoint",
        check_rng_resume,
        2,
    ),
]

# Not branches, though the scan sees a device string there: why each is no CUDA path.
NOT_BRANCHES = {
    "measure._cpu_allocator_events": "filters the CPU profiler's events to CPU ones; nothing runs on CUDA",
    "execution.choose_jobs": "decides how many notebooks run at once (one in the CUDA mode); nothing runs on CUDA, "
    "tests/test_runner_faults.py covers both sides on a CPU",
    "runner._provenance": "names run.json's intra-op thread count (CPU kernels pin one); nothing runs on CUDA",
    "ledger.cli.main": "the calculator's --device is a paper choice (cuda works on any machine): it reads the CUDA "
    "context from a gpu-check report; tests/test_task4_ledger.py runs both sides",
    "tracing.timing_counts": "picks the default warm-up and timed update counts for the device; nothing runs on "
    "CUDA, tests/test_task6_gates.py covers both sides",
    "ledger.allocator.cuda_context": "reads a gpu-check report's mode (a report of a GPU run or a CPU self-test); "
    "nothing runs on CUDA, tests/test_task4_ledger.py reads both kinds",
}

# Notebook cells whose CUDA side only a CUDA-mode run executes (the notebook pass runs them).
NOTEBOOK_CELLS = {
    "Task0:shifted-cross-entropy": "the random model's loss ≈ ln V claim is checked on CPU only",
    "Task2:sdpa-identity": "SDPA's saved rows identified by storage on CPU only (a CUDA kernel may keep RNG state, padded lse)",
    "Task2:layer-bytes-identity": "the exact HF-vs-ours saved-bytes identity asserted on CPU only",
    "Task2:model-bytes": "the whole-model saved-bytes identity asserted on CPU only",
    "Task3:imports-setup": "3 warm-up + 20 timed windows on CUDA (1 + 3 on CPU)",
    "Task3:accelerate-accumulate": "accelerate's Accelerator(cpu=False): it prepares the model on the GPU",
    "Task3:record-accumulation": "frees comparison copies, prints allocated / reserved peaks and the accumulation deltas",
    "Task3:accelerate-precision": "accelerate's fp16 really runs float16 Linear layers on CUDA (float32 on CPU)",
    "Task3:record-amp": "prints FP16 vs FP32 peak and median",
    "Task3:trainer-count": "TrainingArguments(use_cpu=False): the Trainer counts num_items_in_batch on the GPU",
    "Task3:resume-check": "resume within 1e-2 relative on CUDA (atomics), bitwise on CPU",
    "Task4:imports-setup": "ledger.CUDA_POINTS instead of the CPU points; BYTE_TOLERANCE 1 % instead of byte for byte",
    "Task4:lifecycle-vs-measured": "lifecycles key by key within ledger.CUDA_LIFECYCLE_TOLERANCE instead of byte for byte",
    "Task4:cuda-allocator-peaks": "ledger.allocated_reserved on the GPU's own counters: the allocator model's allocated peak "
    "within 5 %, reserved beside it, the warm-up's measured cuBLAS workspaces, the allocator history (CPU: the profiler's "
    "allocator against the tracked tensors)",
    "Task4:record-state-ledger": "the record's fields from ledger.record_fields (CUDA: the step's own allocator peaks, "
    "the allocator's forward+backward peak)",
    "Task4:multi-device-run": "section 8 runs on the CPU with the GPU machine's torch: the exact held-bytes, bitwise and "
    "collective checks tuned on the CPU profile's torch are printed there, not claimed (EXACT = False)",
    "Task5:imports-setup": "3 warm-up + 21 timed updates on CUDA (1 + 3 on CPU)",
    "Task5:protocol": "gate 2 against the baseline everywhere; the bitwise claim on CPU only, for strategies that keep "
    "every tensor's layout",
    "Task5:baseline-ledger": "the baseline peak claim is CPU-only",
    "Task5:dropout-rng": "RNG-preserving replay within gates.GRAD_RTOL instead of bitwise",
    "Task5:overlapped-offload": "copy and exposed transfer times from CUDA events",
    "Task5:strategy-peaks": "ledger-vs-measured peak claims are CPU-only",
    "Task5:saved-at-forward-end": "saved-bytes claims are CPU-only",
    "Task5:peak-composition": "peak phase and composition claims are CPU-only",
    "Task5:scenario-matrix": "the scenario matrix with the allocator's peaks on CUDA (the checkpoint claim on them); the 1 % claim on tracked bytes CPU-only",
    "Task5:in-backward": "optimizer-in-backward within 1e-5 of AdamW on CUDA, bitwise on CPU",
    "Task5:transfer-measured": "this machine's copy bandwidth and phase times, measured: the bound the timing table is held "
    "to; the save_on_cpu byte estimate claimed on CPU only",
    "Task5:timing-table": "the timing table, decisions from reserved peaks, bytes per sequence and medians; the exposed fraction "
    "(per-copy CUDA events) and the step ratio against the measured bound",
    "Task6:imports-setup": "3 warm-up + 21 timed steps on CUDA; one CPU thread only on CPU",
    "Task6:gradient-errors-figure": "the FP16 margin claim is CPU-only; on CUDA the margin is printed as unverified (the "
    "float16 tolerance's first GPU calibration)",
    "Task6:noise-floor": "the bitwise reference rerun is claimed on CPU only; on CUDA the 16-bit tolerance is marked "
    "not yet calibrated on a GPU",
    "Task6:strategy-table": "the exact moved layer inputs and the tracked-bytes identity of checkpoint+offload are claimed "
    "on CPU only (a 2-layer model, this transformers' hook placement)",
    "Task6:performance-rule": "the checkpoint candidate's measured capacity gain against the rule's min_peak_drop, beside "
    "the ledger's prediction (CPU: the prediction alone, no claim)",
    "Task6:outcomes": "the offload's per-sequence bytes equal the reference's on CPU only (the 2-layer model's prefetch "
    "window covers every moved layer)",
}

# Kernel choices with no device test in the cell: the SDPA kernel follows the device and dtype
# (fp32 grouped-query attention runs the math kernel on CUDA). Listed so gpu-check runs and reports
# them; an issue named is one whose fix they wait for.
KERNEL_CHOICE_CELLS = {
    "Task4:layer-saved-inventory": (
        "the inventory of the kernel ledger.attention_kernel's rule picks for this device (math for CUDA fp32 GQA), "
        "printed as the rule's",
        None,
    ),
    "Task4:measure-first-steady": (
        "the kernel the forward dispatched beside the rule's (claimed equal on a CPU only); per-layer saved bytes "
        "against the dispatched kernel's inventory within BYTE_TOLERANCE",
        None,
    ),
    "Task4:bf16-layer-saved": (
        "bf16 per-layer saved bytes against the dispatched kernel's inventory within BYTE_TOLERANCE; its SDPA term "
        "carries the RNG seed and offset weighed on this GPU (ledger.rng_state_saved)",
        None,
    ),
    "Task5:layer-saved-inventory": (
        "the layer inventory follows the ledger's kernel for the device (books['baseline'].attention); the measured "
        "saved bytes equal to the inventory plus the saved tensors outside the layers claimed on CPU only",
        None,
    ),
    "Task5:selective": (
        "the matmul and attention ops a grad-enabled forward dispatched against checkpointing.expected_matmul_ops "
        "(7 projections per layer and the attention of ledger.attention_kernel's choice: one fused SDPA op on CPU, "
        "two bmm with CUDA's math kernel), and the selective checkpoint's saved outputs against them",
        None,
    ),
}


def registry() -> list[Branch]:
    """Every branch: package checks first, then the notebook cells in Task order."""
    cells = [Branch(key, (key,), text) for key, text in NOTEBOOK_CELLS.items()]
    cells += [
        Branch(key, (key,), f"kernel choice: {text}", known=issue)
        for key, (text, issue) in KERNEL_CHOICE_CELLS.items()
    ]
    order = lambda b: (int(b.name[4:].split(":")[0]), b.name)  # noqa: E731  (Task4:layer-saved-inventory -> 4)
    return PACKAGE + sorted(cells, key=order)


def covered() -> set[str]:
    return {key for b in registry() for key in b.covers} | set(NOT_BRANCHES)


def notebook_cells(notebook: str) -> list[Branch]:
    return [b for b in registry() if b.notebook == notebook]


def result_row(branch: Branch) -> dict:
    """The report row of a branch before it runs."""
    return {
        "name": branch.name,
        "covers": list(branch.covers),
        "cuda_side": branch.cuda_side,
        "known": branch.known,
        "seconds": None,
        "device_memory_used_peak_bytes": None,
        "device_memory_used_at_start_bytes": None,
    }


def with_expectation(row: dict) -> dict:
    """A failure its `known` issue expects becomes "expected"; a pass there says the fix may have landed."""
    if row.get("known") and row["status"] == "failed":
        row["status"] = "expected"
        row["reason"] = f"expected until {row['known']}: {row['reason']}"
    elif row.get("known") and row["status"] == "ok":
        row["reason"] += f" (passes: {row['known']} may have fixed it)"
    return row


def repo_path(key: str) -> Path:
    """The file a registry key lives in (for messages): a module, or a module of a subpackage (offload.copies…)."""
    from trainmech.gpucheck.scan import NOTEBOOKS_DIR, PACKAGE_DIR

    if ":" in key:
        task = key.split(":")[0]
        return next(NOTEBOOKS_DIR.glob(f"{task}_*.ipynb"), NOTEBOOKS_DIR / f"{task}.ipynb")
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        candidate = PACKAGE_DIR.joinpath(*parts[:n]).with_suffix(".py")
        if candidate.is_file():
            return candidate
    return PACKAGE_DIR / (parts[0] + ".py")
