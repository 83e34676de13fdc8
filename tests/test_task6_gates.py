"""Task6 guard: the correctness gates (trainmech.gates), the decision rules, the regenerated registry.

Every planted bug must be stopped by the gate meant for it, with every earlier gate passing and no
later gate run; the same candidate without the bug must pass every gate. The decision rules are
checked at their boundaries on plain numbers, the gates on small hand-made traces, and the
registry must come out byte-identical whenever it is rendered again from the same records.
"""

from __future__ import annotations

import io
import random
from contextlib import contextmanager, redirect_stdout
from dataclasses import replace
from functools import partial

import pytest
import torch

from trainmech import amp, gates, profiles, results, strategies, supervision, workload

ATTEMPTS, INJECT_AT, LR = 8, (2,), 3e-3


@pytest.fixture(scope="module")
def gw():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from threads that spin-wait on a shared machine
    built = workload.build_model(profiles.load("TRAIN-CPU").model("qwen2-tiny"), seed=0)
    yield gates.gate_workload(built.model, rows=4, seq=32, micro_batches=2, attempts=ATTEMPTS, inject_at=INJECT_AT,
                              lr=LR, warmup_updates=2, decay_updates=3)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(gw):
    ref = gates.Candidate("fp32-baseline", "TRAIN-AMP-BACKWARD")
    return gates.run_trace(ref, gw), gates.measure(ref, gw, warmup=0, repeats=1)


def offload(model):
    return gates.offloading(model, min_bytes=4096, prefetch_bytes=32768)


# ----------------------------------------------------------------------------- planted bugs


def autocast_around_backward(state, window):
    divisors = supervision.denominators([workload.supervised_tokens(mb["labels"]) for mb in window])
    for mb, divisor in zip(window, divisors):
        logits = state.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
        loss = supervision.token_loss_sum(logits, mb["labels"]) / divisor
        with torch.autocast(state.device.type, dtype=torch.float16):  # around backward: does nothing
            state.scaler.scale(loss).backward()
    return 0.0


def mean_per_micro_batch(state, window):
    for mb in window:
        with offload(state.model):
            state.scaler.scale(state.model(**mb, use_cache=False).loss / len(window)).backward()
    return 0.0


def scheduler_every_attempt(state):
    amp.scaled_step(state.scaler, state.optimizer)
    state.scheduler.step()


@contextmanager
def clamp_layer_inputs(model, in_place):
    for layer in model.model.layers:
        plain = layer.forward
        clamp = (lambda h: h.clamp_(-1e4, 1e4)) if in_place else (lambda h: h.clamp(-1e4, 1e4))
        layer.forward = lambda h, *a, _plain=plain, _clamp=clamp, **k: _plain(_clamp(h), *a, **k)
    try:
        yield
    finally:
        for layer in model.model.layers:
            layer.__dict__.pop("forward", None)


def each_layer(model):
    return strategies.checkpoint_layers(model.model.layers)


def first_micro_batch_only(state, window):
    return gates.accumulate(state, window[:1], contexts=(gates.checkpointing,))


def step_without_guard(state):
    state.optimizer.step()
    state.scheduler.step()


def raise_adam_eps(state):
    for group in state.optimizer.param_groups:
        group["eps"] = 1e-3
    gates.step_on_effective(state)


FP16 = gates.candidate("fp16", "TRAIN-AMP-BACKWARD", dtype="float16")
CHECKPOINT = gates.candidate("checkpoint", "TRAIN-CHECKPOINT", gates.checkpointing)
OFFLOAD = gates.candidate("offload", "TRAIN-OFFLOAD", offload)
CLAMP = gates.candidate("checkpoint-clamp", "TRAIN-CHECKPOINT", partial(clamp_layer_inputs, in_place=False), each_layer)

PLANTED = {  # bug -> (the candidate with it, the gate that must stop it, the candidate without it)
    "fp32-claiming-fp16": (gates.Candidate("b1", "TRAIN-AMP-BACKWARD", "float16", autocast_around_backward), "gradients", FP16),
    "mean-per-micro-batch": (gates.Candidate("b2", "TRAIN-OFFLOAD", backward=mean_per_micro_batch), "gradients", OFFLOAD),
    "scheduler-on-skips": (gates.candidate("b3", "TRAIN-AMP-BACKWARD", dtype="float16", update=scheduler_every_attempt), "updates", FP16),
    "checkpoint-in-place": (gates.candidate("b4", "TRAIN-CHECKPOINT", partial(clamp_layer_inputs, in_place=True), each_layer),
                            "gradients", CLAMP),
    "faster-skips-work": (gates.Candidate("b5", "TRAIN-CHECKPOINT", backward=first_micro_batch_only), "inputs", CHECKPOINT),
    "no-finiteness-guard": (gates.candidate("b6", "TRAIN-AMP-BACKWARD", update=step_without_guard), "updates", FP16),
    "recipe-change": (gates.candidate("b7", "TRAIN-AMP-BACKWARD", dtype="float16", update=raise_adam_eps), "quality", FP16),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_is_stopped_by_its_gate_and_only_then(gw, reference, bug):
    buggy, gate, _ = PLANTED[bug]
    report = gates.judge(buggy, gw, *reference, warmup=0, repeats=1)
    k = gates.GATES.index(gate)
    assert report.failed_gate == gate, report.lines()
    assert [v.name for v in report.verdicts] == list(gates.GATES[: k + 1])  # the pipeline stopped there
    assert all(v.passed for v in report.verdicts[:k])  # every earlier gate let it through
    assert report.performance is None and report.decision == "reject"
    assert report.reason.startswith(f"{gate} gate failed")


@pytest.mark.parametrize("fixed", [FP16, CHECKPOINT, OFFLOAD, CLAMP], ids=lambda c: c.name)
def test_without_the_bug_no_gate_fires(gw, reference, fixed):
    report = gates.judge(fixed, gw, *reference, warmup=0, repeats=1)
    assert report.failed_gate is None, report.lines()
    assert [v.name for v in report.verdicts] == list(gates.GATES)
    assert [v.passed for v in report.verdicts] == [True] * 4 + [None]  # performance is measured, never passed or failed
    assert report.lines()[-2].startswith("  — performance")
    assert report.performance is not None and report.performance.peak_allocated_bytes is None  # CPU: unknown, not 0
    assert report.decision is None and report.evidence_level == "cpu-mechanism"  # nothing to accept from CPU numbers


def test_the_reference_skips_exactly_the_injected_attempts(reference):
    trace, _ = reference
    assert [not s for s in trace.stepped] == [a in INJECT_AT for a in range(ATTEMPTS)]
    assert trace.scheduler_steps == trace.optimizer_steps == ATTEMPTS - len(INJECT_AT)
    assert all(trace.finite) and trace.error is None


def test_splitting_a_window_into_more_micro_batches_keeps_the_inputs_digest(gw, reference):
    def four_micro_batches(state, window):
        rows = [{k: v[i : i + 1] for k, v in mb.items()} for mb in window for i in range(mb["input_ids"].shape[0])]
        return gates.accumulate(state, rows)

    trace = gates.run_trace(gates.Candidate("split", "TRAIN-GRADIENT-ACCUMULATION", backward=four_micro_batches), gw)
    assert gates.inputs_gate(reference[0], trace).passed
    assert gates.gradients_gate(reference[0], trace).passed  # the window's token count keeps it exact


def test_a_candidate_that_draws_random_numbers_changes_the_rng_evidence(gw, reference):
    def noisy(state, window):
        torch.rand(1)  # consumes the generator: the next window starts from another state
        return gates.accumulate(state, window)

    verdict = gates.inputs_gate(reference[0], gates.run_trace(gates.Candidate("rng", "X", backward=noisy), gw))
    assert not verdict.passed and "RNG" in verdict.message


# ----------------------------------------------------------------------------- gates on hand-made traces


def grads_trace(values: dict[str, list[float]], dtypes=("float32",)) -> gates.Trace:
    return gates.Trace("t", loss=1.0, grads={n: torch.tensor(v, dtype=torch.float32) for n, v in values.items()},
                       dtypes=list(dtypes))


def test_gradients_gate_at_its_tolerance():
    ref = grads_trace({"a": [1.0, -2.0], "b": [0.5, 0.25]})
    rtol = gates.GRAD_RTOL["float16"]
    at = grads_trace({"a": [1.0, -2.0 + 2.0 * rtol], "b": [0.5, 0.25]}, ["float16"])  # error = rtol x scale 2
    over = grads_trace({"a": [1.0, -2.0 + 2.0 * rtol * 1.01], "b": [0.5, 0.25]}, ["float16"])
    assert gates.gradients_gate(ref, at, "float16").passed
    verdict = gates.gradients_gate(ref, over, "float16")
    assert not verdict.passed and "worst a" in verdict.message
    assert list(verdict.evidence["worst"])[0] == "a"


def test_gradients_gate_uses_the_floor_for_a_vanishing_gradient():
    ref = grads_trace({"big": [1.0], "tiny": [1e-9]})
    noisy = grads_trace({"big": [1.0], "tiny": [5e-9]})  # 4x off its own scale, but far below 1e-3 of the largest
    assert gates.gradient_errors(ref.grads, noisy.grads)["tiny"] == pytest.approx(4e-9 / gates.GRAD_FLOOR, rel=1e-3)
    assert gates.gradients_gate(ref, noisy).passed


def test_gradients_gate_refuses_another_dtype_and_non_finite_gradients():
    ref = grads_trace({"a": [1.0]})
    assert "ran float32" in gates.gradients_gate(ref, grads_trace({"a": [1.0]}), "float16").message
    assert not gates.gradients_gate(ref, grads_trace({"a": [float("nan")]})).passed
    assert not gates.gradients_gate(ref, replace(grads_trace({"a": [1.0]}), grads=None, error="attempt 0, backward: X")).passed


def test_quality_gate_at_its_bound():
    ref = gates.Trace("r", held_out_loss=5.0)
    bound = gates.QUALITY_BOUND["float32"]
    assert gates.quality_gate(ref, gates.Trace("c", held_out_loss=5.0 + bound / 2)).passed
    assert not gates.quality_gate(ref, gates.Trace("c", held_out_loss=5.0 + 2 * bound)).passed
    assert gates.quality_gate(ref, gates.Trace("c", held_out_loss=5.0 + 2 * bound), "float16").passed  # wider for 16 bits


def updates_trace(**kw) -> gates.Trace:
    base = dict(stepped=[True, False, True], finite=[True, True, True], lrs=[1.0, 2.0], optimizer_steps=2, scheduler_steps=2)
    return gates.Trace("u", **{**base, **kw})


@pytest.mark.parametrize("change, fragment", [
    ({}, None),
    ({"scheduler_steps": 3}, "scheduler moved 3 times"),
    ({"optimizer_steps": 3}, "optimizer counted 3 steps"),
    ({"lrs": [1.0, 2.5]}, "effective update 1 ran at lr"),
    ({"finite": [True, False, False]}, "non-finite value"),
    ({"stepped": [True, True, True], "lrs": [1.0, 2.0, 2.0], "optimizer_steps": 3, "scheduler_steps": 3}, "3 effective updates"),
])
def test_updates_gate_checks_every_clock(change, fragment):
    verdict = gates.updates_gate(updates_trace(), updates_trace(**change), expected_lrs=[1.0, 2.0, 3.0])
    assert verdict.passed is (fragment is None)
    if fragment:
        assert fragment in verdict.message


# ----------------------------------------------------------------------------- the decision rules


@pytest.mark.parametrize("drop, ratio, decision", [
    (0.10, 1.25, "accept"),     # both limits met exactly
    (0.0999, 1.25, "tune"),     # the peak falls a little less than required
    (0.10, 1.2501, "tune"),     # the step takes a little more than allowed
    (0.337, 1.192, "accept"),   # the registry's checkpoint figures
    (0.343, 5.87, "tune"),      # the registry's offload figures
    (0.0, 0.90, "accept"),      # faster by exactly min_speedup at the same peak
    (0.0, 0.9001, "tune"),
    (-0.01, 0.80, "tune"),      # faster, but a higher peak
    (0.0, 1.0, "reject"),       # no lower peak, no faster
    (-0.2, 1.5, "reject"),
])
def test_decide_measured_at_its_boundaries(drop, ratio, decision):
    assert gates.decide_measured(drop, ratio) == decision


def perf(device="cuda", median=1.0, peak=1000):
    return gates.Performance(device, median, median, peak if device == "cuda" else None, None, 0, 0, 1)


def test_decide_rejects_a_failed_gate_on_any_device_and_decides_nothing_from_cpu_numbers():
    passed = [gates.Verdict(g, True, {}, "") for g in gates.GATES[:4]] + [gates.Verdict("performance", None, {}, "")]
    failed = passed[:1] + [gates.Verdict("gradients", False, {}, "off")]
    assert gates.decide(failed, None, None)[0] == "reject"
    assert gates.decide(failed, perf(), perf())[0] == "reject"  # a faster wrong candidate stays rejected
    assert gates.decide(passed, perf("cpu"), perf("cpu")) [0] is None
    assert gates.decide(passed, perf(), perf("cpu"))[0] is None
    assert gates.decide(passed, perf(median=1.1, peak=850), perf())[0] == "accept"
    assert gates.decide(passed, perf(median=3.0, peak=650), perf())[0] == "tune"
    assert gates.decide(passed, perf(median=1.0, peak=1000), perf())[0] == "reject"


def test_a_candidate_refuses_an_unknown_dtype():
    with pytest.raises(Exception, match="unknown dtype"):
        gates.Candidate("x", "X", "float8")


# ----------------------------------------------------------------------------- the registry


def record(semantic_id, workload_id, level="cpu-mechanism", decision=None, failure=None, label="unit") -> results.Record:
    gpu = level == "gpu-measured"  # GPU evidence comes from a GPU
    return results.validate({
        "identity": {"semantic_id": semantic_id, "workload_id": workload_id, "run_label": label, "page": "Task6",
                     "notebook": "Task6_gates_evidence", "candidate": workload_id.split(".")[-1]},
        "workload": {"model_id": "trainmech/qwen2-tiny", "model_weights": "random-init seed=0", "tokenizer": "t",
                     "input_shape": [4, 32], "effective_batch": {"sequences": 4, "supervised_tokens": 58}, "dtype": "float32", "seed": 0},
        "environment": {"profile_id": "TRAIN-CPU", "run_mode": "cpu", "python": "3.11", "torch": "2", "transformers": "5",
                        "accelerate": None, "cuda": "12.8" if gpu else None, "gpu": "NVIDIA H200" if gpu else None,
                        "gpu_memory_bytes": 150_000_000_000 if gpu else None, "device": "cuda:0" if gpu else "cpu"},
        "conclusion": {"evidence_level": level, "decision": decision, "failure": failure},
        "metrics": {"gates": {"inputs": True, "gradients": True}, "note": "中文"},
    })


RECORDS = [
    record("TRAIN-CHECKPOINT", "cpu-gates.checkpoint"),
    record("TRAIN-CHECKPOINT", "b4s256_gates.checkpoint", "gpu-measured", "accept"),
    record("TRAIN-OFFLOAD", "b4s256_gates.offload", "gpu-measured", "tune"),
    record("TRAIN-MEMORY-STRATEGY", "cpu-gates.checkpoint-fp16"),
    record("TRAIN-MEMORY-STRATEGY", "cpu-gates.checkpoint-offload", failure="gradients gate failed"),
    record("TRAIN-CORRECTNESS-GATE", "cpu-gates"),
    record("TRAIN-SOMETHING-NEW", "cpu-gates"),
]


def test_registry_is_byte_identical_when_regenerated_from_the_same_records(tmp_path, monkeypatch):
    run = tmp_path / "unit"
    for r in RECORDS:
        results.write_record(r, run)
    first = results.registry_markdown(RECORDS, "unit").encode("utf-8")
    for seed in range(5):  # any order in, the same bytes out
        shuffled = results.read_records(run)
        random.Random(seed).shuffle(shuffled)
        assert results.registry_markdown(shuffled, "unit").encode("utf-8") == first
    before = {p.name: p.read_bytes() for p in results.record_paths(run)}  # a read-write round trip changes no byte
    for p in results.record_paths(run):
        results.write_record(results.read_record(p), run)
    assert {p.name: p.read_bytes() for p in results.record_paths(run)} == before

    from trainmech import __main__ as cli, runner

    monkeypatch.setattr(runner, "RESULTS_ROOT", tmp_path)
    printed = []
    for _ in range(2):
        out = io.StringIO()
        with redirect_stdout(out):
            assert cli.main(["registry", "--label", "unit"]) == 0
        printed.append(out.getvalue().encode("utf-8"))
    assert printed[0] == printed[1] == first


def test_registry_rows_for_the_gates_and_the_memory_strategy_interface():
    md = results.registry_markdown(RECORDS, "unit")
    row = {line.split(" / ")[0].lstrip("| "): line for line in md.splitlines() if " / " in line}
    assert "gpu-measured (b4s256_gates.checkpoint, cpu-gates.checkpoint); decision accept" in row["TRAIN-CHECKPOINT"]
    assert "Part 02 · 76" in row["TRAIN-MEMORY-STRATEGY"] and "1 failed" in row["TRAIN-MEMORY-STRATEGY"]
    assert "cpu-mechanism (cpu-gates)" in row["TRAIN-CORRECTNESS-GATE"]
    assert md.index("TRAIN-MEMORY-STRATEGY") < md.index("TRAIN-SOMETHING-NEW")  # unknown ids after the registry's own


def test_runs_with_gpu_evidence_are_found_by_their_records(tmp_path):
    for label, records in (("cpu-run", RECORDS[:1]), ("h200-run", RECORDS[:3])):  # a record's run label is its folder
        for r in records:
            results.write_record(r.model_copy(update={"identity": r.identity.model_copy(update={"run_label": label})}),
                                 tmp_path / label)
    (tmp_path / "h200-run" / "BROKEN__x.json").write_text("{", encoding="utf-8")  # left out, as the runner does
    (tmp_path / ".staging-x").mkdir()
    found = results.runs_with_evidence(tmp_path, "gpu-measured")
    assert list(found) == ["h200-run"] and len(found["h200-run"]) == 3
    assert list(results.runs_with_evidence(tmp_path, "cpu-mechanism")) == ["cpu-run", "h200-run"]
    with pytest.raises(Exception, match="unknown evidence level"):
        results.runs_with_evidence(tmp_path, "measured")


def test_the_profiles_carry_the_gate_workload_in_both_modes():
    for profile_id in ("TRAIN-CPU", "TRAIN-CUDA-MECHANISM"):
        p = profiles.load(profile_id)
        wid = next(w for w, spec in p.workloads.items() if "TRAIN-CORRECTNESS-GATE" in spec.experiments)
        spec = p.workloads[wid]
        assert spec.micro_batches == [2] and spec.batch % 2 == 0 and spec.updates > max(INJECT_AT) + 1
        assert spec.experiments == ["TRAIN-CORRECTNESS-GATE", "TRAIN-MEMORY-STRATEGY"]
