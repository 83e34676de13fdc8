"""gpu-check's package checks of measurement, the ledger, resumable state and distributed runs.

Each runs one CUDA-only branch of the package at small sizes on a `Probe` (trainmech.gpucheck.probe):
the session and its environment, step times and allocator peaks, a step's memory and the allocator's
history, the ledger against what the forward dispatched, the scenario matrix, the RNG in a resumable
checkpoint, and trainmech.distributed under torchrun and from a process that used CUDA. The checks of
the memory strategies and the gates are in trainmech.gpucheck.strategy_checks; which branch each check
covers is the registry's (trainmech.gpucheck.branches).
"""

from __future__ import annotations

import math
import tempfile
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainmech import ledger, measure, profiles
from trainmech.errors import TrainmechError
from trainmech.gpucheck.probe import Probe, forward_backward, require
from trainmech.gpucheck.strategy_checks import PEAK_AGREEMENT_BYTES, _allocator_peak

__all__ = [
    "check_session",
    "check_timing_and_peaks",
    "check_step_memory",
    "check_memory_history",
    "dispatched_attention_kernel",
    "check_ledger_on_device",
    "check_scenarios",
    "check_rng_resume",
    "check_distributed_torchrun",
    "check_distributed_spawn",
]


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
    tracked = [b for b in timeline.blocks if b.category in ledger.CATEGORIES]
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


def _untracked_steady_peak(probe: Probe) -> int:
    """The allocator's peak over a steady update of the probe's point that no tracker or ledger watches (a fresh
    model, measure_point's AdamW, one update first so its moments exist), plus the parameters and moments
    counted by storage (`strategy_checks._allocator_peak`): an instrument independent of the record's."""
    from trainmech.optimizers import adamw

    model = probe.model()
    optimizer = adamw(model.parameters(), "auto", lr=1e-4)
    batch = probe.lm_batch()
    model(**batch, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return _allocator_peak(model, optimizer, batch, lambda m: nullcontext())


def _rng_bytes(outputs) -> tuple[tuple[int, bool], ...]:
    """(bytes, on the device) of each RNG output `ledger.inventory._rng_outputs` names: its bytes, not its
    shape (cuDNN's op makes (1,) int64 tensors where its meta kernel says (); both are 8 bytes)."""
    return tuple((math.prod(shape) * element_bytes, on_device) for shape, element_bytes, on_device in outputs)


def check_ledger_on_device(probe: Probe) -> str:
    """The ledger predicts with the kernel the forward dispatched (fp32 unpadded and padded, bf16); its rule
    (`ledger.attention_kernel`, on the stack the point ran on) must pick that kernel where the profile pins
    torch (CPU), and elsewhere a difference is reported as drift; the peaks within 5 %, the lifecycles key by key (CUDA: within
    CUDA_LIFECYCLE_TOLERANCE), bf16's per-layer saved bytes against the dispatched kernel's inventory with
    the RNG state weighed on this device, and (CUDA) the warm-up's cuBLAS workspaces and the allocator
    model's allocated / reserved peaks within Task4's terms of the measured ones (DeviceTerms.
    allocator_model_tolerance / reserved_model_tolerance, one value with the notebook), and the
    record's allocated peak within PEAK_AGREEMENT_BYTES of the allocator's over an untracked steady step
    (`_untracked_steady_peak`) and at least its tracked peak (CPU: the record's tracked peak against the CPU
    allocator's)."""
    first, steady = ledger.measure_point(
        probe.model_name, probe.batch, probe.seq, run_mode=probe.mode, seed=0, warmup=True
    )
    shape = first.predicted.shape
    terms = ledger.device_terms(probe.device.type)  # Task4's values for this device
    kernels, rules, drift = [], [], []
    for padded in (False, True):
        rule = ledger.attention_kernel(shape, "fp32", probe.device.type, padded=padded, stack=first.stack)
        data = ledger.padded_batch(probe.batch, probe.seq) if padded else probe.lm_batch()
        ran = dispatched_attention_kernel(probe.model(), {k: v.to(probe.device) for k, v in data.items()})
        said = (
            f"the ledger's rule says the {rule} kernel for fp32 on {probe.device.type}"
            f"{' with padding' if padded else ''}, the forward ran {ran} ({first.stack.describe()})"
        )
        # the rule is what the calculator predicts with for a config it never ran: claimed where torch is
        # pinned; on a torch the profile does not pin, a difference is drift to report, not a failure
        require(ran == rule or not terms.torch_pinned, f"{said}: ledger.attention_kernel is out of date")
        if ran != rule:
            drift.append(said)
        kernels.append(ran)
        rules.append(rule)
    require(
        first.kernel == kernels[0],  # measure_point predicts with the kernel it saw: only this half can fail
        f"measure_point saw the {first.kernel} kernel; the forward dispatched {kernels[0]}",
    )
    errors = f"peak error first {first.error:+.1%}, steady {steady.error:+.1%}"
    require(
        abs(first.error) <= 0.05 and abs(steady.error) <= 0.05,
        f"the ledger's peak is off by more than 5 %: {errors}",
    )
    tolerance = terms.lifecycle_tolerance
    require(
        not any(c.lifecycle_differences(tolerance) for c in (first, steady)),
        f"lifecycles crossing a phase: {first.lifecycle_line(tolerance)}; {steady.lifecycle_line(tolerance)}",
    )
    require(
        first.workspace_bytes is not None and first.workspace_bytes > 0
        if probe.cuda
        else first.workspace_bytes is None,
        f"the warm-up's workspace bytes {first.workspace_bytes} on {probe.device.type} "
        "(CUDA: measured and > 0; elsewhere: None)",
    )
    (bf16,) = ledger.measure_point(
        probe.model_name, probe.batch, probe.seq, run_mode=probe.mode, seed=0, dtype="bf16", steps=("first",)
    )
    # the 16-bit rule (cuDNN first on sm90 / sm100 with a new cuDNN, else flash) against the kernel bf16 dispatched:
    # claimed where torch is pinned, drift to report elsewhere, as fp32's above
    said = f"the ledger's rule says the {bf16.rule_kernel} kernel for bf16, the forward ran {bf16.kernel} ({bf16.stack.describe()})"
    require(
        bf16.kernel == bf16.rule_kernel or not terms.torch_pinned,
        f"{said}: ledger.attention_kernel is out of date",
    )
    if bf16.kernel != bf16.rule_kernel:
        drift.append(said)
    rules.append(bf16.rule_kernel)
    rows = bf16.predicted.layer_saved()  # on CUDA its RNG state is weighed on this GPU
    added = bf16.measured.saved_added_per_layer(bf16.predicted.shape.num_layers)
    rng = [f"{t.name.rsplit('.', 1)[-1]} {t.nbytes} B" for t in rows if "rng" in t.name]
    inventory = sum(t.nbytes for t in rows)
    require(
        all(abs(x - inventory) <= terms.slack_bytes_per_layer for x in added),
        f"bf16 saved bytes per layer {added} vs the {bf16.kernel} inventory's {inventory:,} "
        f"(RNG state rows: {rng or 'none'})",
    )
    # where each fused kernel keeps its RNG seed and offset: weighed on this GPU against the paper rule
    # (the meta kernel's shapes and ledger.inventory.RNG_OUTPUTS), with and without dropout, so a wrong
    # placement entry fails here and not only in a book that happens to dispatch that kernel
    rng_placement, rng_unprobed = [], []
    for kernel in ledger.inventory.RNG_OUTPUTS if probe.cuda else ():
        for dropout in (False, True):
            try:
                weighed = _rng_bytes(ledger.inventory._rng_outputs(kernel, True, dropout))
            # a kernel this GPU or its libraries cannot run: named in the report, not guessed
            except (RuntimeError, NotImplementedError) as refusal:
                rng_unprobed.append(
                    f"{kernel}{' with dropout' if dropout else ''} ({str(refusal).splitlines()[0][:80]})"
                )
                continue
            paper = _rng_bytes(ledger.inventory._rng_outputs(kernel, False, dropout))
            require(
                weighed == paper,
                f"{kernel}{' with dropout' if dropout else ''}: RNG seed and offset (bytes, on the device) "
                f"weighed on this GPU {weighed}, the paper rule says {paper} (ledger.inventory.RNG_OUTPUTS)",
            )
            rng_placement.append(f"{kernel}{'+dropout' if dropout else ''}")
    # SDPA's math composite in bf16, forced, without and with dropout: fp32 q, k, v and probabilities
    # (it upcasts), and the dropout mask (bool on CUDA, fp32 on the CPU), against the ledger's inventory
    math_rows = []
    for extra in ({}, {"attention_dropout": 0.1}):
        (forced,) = ledger.measure_point(
            probe.model_name,
            probe.batch,
            probe.seq,
            run_mode=probe.mode,
            seed=0,
            dtype="bf16",
            attention="math",
            steps=("first",),
            **extra,
        )
        inventory_math = sum(t.nbytes for t in forced.predicted.layer_saved())
        added_math = forced.measured.saved_added_per_layer(forced.predicted.shape.num_layers)
        require(
            forced.kernel == "math"
            and all(abs(x - inventory_math) <= terms.slack_bytes_per_layer for x in added_math),
            f"bf16 forced math{' with dropout' if extra else ''}: the {forced.kernel} kernel ran, saved bytes per "
            f"layer {added_math} vs the math inventory's {inventory_math:,}",
        )
        math_rows.append(inventory_math)
    # Task4's path: the pair itself on CUDA (its allocator counted), the same point under torch.profiler on a CPU
    peaks = ledger.allocated_reserved(*ledger.allocator_pair(first, steady, run_mode=probe.mode, seed=0))
    # the model's peaks against the allocator's own (torch.cuda.max_memory_*), not against themselves, within
    # the bounds Task4's cuda-allocator-peaks claims: the allocated peak on every allocator, the reserved one
    # where the allocator reports it (CUDA; terms.reserved_model_tolerance is None on the CPU)
    reserved_bound = terms.reserved_model_tolerance
    require(
        abs(peaks.allocated_error) <= terms.allocator_model_tolerance
        and (
            reserved_bound is None
            or (peaks.reserved_error is not None and abs(peaks.reserved_error) <= reserved_bound)
        ),
        f"the allocator model beside the {peaks.source} allocator's peaks: {peaks.lines()} (bounds: allocated "
        f"{terms.allocator_model_tolerance:.0%}, reserved {'not claimed' if reserved_bound is None else f'{reserved_bound:.0%}'})",
    )
    require(  # as Task4's cuda-allocator-peaks: where the allocator rounds, the model beats the tensor count
        not terms.allocator_rounds or peaks.model_beats_tracked,
        f"the allocator model's allocated peak no nearer the allocator's than the tracked tensors: {peaks.lines()}",
    )
    require(
        probe.cuda or (abs(peaks.tracked_error) <= 0.01 and peaks.reserved_error is None),
        f"the CPU allocator's peak beside the tracked tensors: {peaks.lines()}",
    )
    fields = ledger.record_fields(
        steady, [first, steady], worst_error=0.0, on_cuda=probe.cuda, updates=[first, steady]
    )
    require(fields["correctness"]["all_finite"] is True, f"the record's correctness: {fields['correctness']}")
    if probe.cuda:  # the record's peak against two other instruments
        # the allocator over an untracked steady step of the same point (plus its state bytes)
        direct = _untracked_steady_peak(probe)
        # and the tracked storages below it (every tracked device storage is an allocator block, rounded up; the
        # bytes outside the step are taken off the allocator's count, so a mis-counted outside_bytes or a storage
        # counted twice fails)
        recorded, tracked = (
            fields["resources"]["peak_allocated_bytes"],
            fields["metrics"]["tracked_peak_bytes"],
        )
        require(
            recorded is not None and abs(recorded - direct) <= PEAK_AGREEMENT_BYTES,
            f"the record's peak_allocated_bytes {recorded} vs the allocator's peak over an untracked steady step "
            f"of the same point, plus its state bytes, {direct:,} B (within {PEAK_AGREEMENT_BYTES:,} B)",
        )
        require(
            tracked <= recorded,
            f"the record's peak_allocated_bytes {recorded} (torch.cuda.max_memory_allocated() minus the bytes "
            f"outside the step, {steady.measured.outside_bytes}) below its tracked peak {tracked:,}",
        )
    else:  # the record's tracked peak (this run's tracker) against another instrument: the profiler's run above
        tracked = fields["metrics"]["cpu_tracked_peak_bytes"]
        require(
            abs(tracked / peaks.measured_allocated - 1) <= 0.01,
            f"the record's tracked peak {tracked:,} vs the CPU allocator's {peaks.measured_allocated:,} (profiler run)",
        )
    gpu = ""
    if probe.cuda:
        gpu = (
            f"; the ledger's rule said {rules[0]} / {rules[1]} / bf16 {rules[2]} ({first.stack.describe()}); "
            f"rule drift: {'; '.join(drift) or 'none'}; cuBLAS workspaces {first.workspace_bytes:,} B; "
            f"allocator model allocated {peaks.allocated_error:+.1%}, reserved {peaks.reserved_error:+.1%} "
            "off the measured peaks; RNG placement weighed as the paper rule says: "
            f"{', '.join(rng_placement) or 'none'}{'; not probed: ' + '; '.join(rng_unprobed) if rng_unprobed else ''}"
        )
    return (
        f"kernels {kernels[0]} / {kernels[1]} (padded) dispatched and predicted with; foreach={probe.cuda}; {errors}; "
        f"bf16 saved per layer as the {bf16.kernel} inventory (RNG state rows: {rng or 'none'}), and as the math "
        f"inventory forced ({math_rows[0]:,} B, with dropout {math_rows[1]:,} B){gpu}"
    )


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


def check_rng_resume(probe: Probe) -> str:
    from trainmech import update

    model = probe.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward_backward(model, probe.lm_batch())
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
