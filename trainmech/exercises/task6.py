"""Task6 exercises: the gradient gate and the update gate, on synthetic and real traces."""

from __future__ import annotations

import math

import torch

from trainmech.exercises.harness import _exercise, _Run, _tiny_model, _tuple, _Wrong

__all__: list[str] = []  # nothing to import: the checks register into EXERCISES

_GATE_TRACES: dict[str, object] = {}


def _gate_traces():
    """Reference and candidate traces on a small gate workload (qwen2-tiny), computed once per process."""
    if _GATE_TRACES:
        return _GATE_TRACES
    from trainmech import amp, candidates, tracing

    # check() forks the RNG around this: building the model and running traces re-seed it
    model = _tiny_model()
    gate_workload = candidates.gate_workload(
        model,
        rows=4,
        seq=16,
        micro_batches=2,
        attempts=5,
        inject_at=(2,),
        lr=3e-3,
        warmup_updates=1,
        decay_updates=1,
        seed=0,
    )

    def mean_per_micro_batch(state, window):
        total = 0.0
        for mb in window:
            loss = state.model(**mb, use_cache=False).loss / len(
                window
            )  # the bug: this micro-batch's mean, / n
            state.scaler.scale(loss).backward()
            total += loss.item()
        return total

    def scheduler_on_every_attempt(state):
        amp.scaled_step(state.scaler, state.optimizer)
        state.scheduler.step()  # the bug: moved whether or not the optimizer stepped
        state.optimizer.zero_grad(set_to_none=True)

    def step_without_guard(state):
        state.optimizer.step()  # the bug: no finiteness check
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)

    runs = {
        "reference": candidates.Candidate("fp32-baseline", "TRAIN-AMP-BACKWARD"),
        "fp16": candidates.candidate("fp16", "TRAIN-AMP-BACKWARD", dtype="float16"),
        "micro_mean": candidates.Candidate(
            "mean-per-micro-batch", "TRAIN-AMP-BACKWARD", backward=mean_per_micro_batch
        ),
        "scheduler_every_attempt": candidates.candidate(
            "fp16-scheduler-every-attempt",
            "TRAIN-AMP-BACKWARD",
            dtype="float16",
            update=scheduler_on_every_attempt,
        ),
        "step_without_guard": candidates.candidate(
            "fp32-step-without-guard", "TRAIN-AMP-BACKWARD", update=step_without_guard
        ),
    }
    for key, candidate in runs.items():
        _GATE_TRACES[key] = tracing.run_trace(candidate, gate_workload)
    _GATE_TRACES["expected_lrs"] = [
        gate_workload.expected_lr(k) for k in range(len(_GATE_TRACES["reference"].stepped))
    ]
    return _GATE_TRACES


def _synthetic_grads():
    gen = torch.Generator().manual_seed(7)
    reference = {
        "big": torch.randn(4, 5, generator=gen),
        "small": 1e-7 * torch.randn(6, generator=gen),
        "mid": 0.1 * torch.randn(3, 3, generator=gen),
    }
    noise = {n: 1e-8 * torch.randn(g.shape, generator=gen) for n, g in reference.items()}
    return reference, noise


@_exercise("task6.gradient_gate", "梯度门：逐参数的相对误差与容限")
def _task6_gradient_gate(run: _Run) -> None:
    from trainmech import gates

    reference, noise = _synthetic_grads()
    nan = {n: g.clone() for n, g in reference.items()}
    nan["mid"][1, 1] = float("nan")
    synthetic = [
        (
            "合成 1：每个参数都只差约 1e-8 的噪声（“small” 的梯度约 1e-7，低于全局尺度的千分之一）",
            reference,
            {n: g + noise[n] for n, g in reference.items()},
            1e-4,
            True,
        ),
        (
            "合成 2：“mid” 整体放大 1.01 倍",
            reference,
            {n: g * (1.01 if n == "mid" else 1.0) for n, g in reference.items()},
            1e-4,
            False,
        ),
        (
            "合成 3：候选缺了参数 “small” 的梯度",
            reference,
            {n: g for n, g in reference.items() if n != "small"},
            1e-4,
            False,
        ),
        ("合成 4：候选的 “mid” 含一个 NaN", reference, nan, 1e-4, False),
    ]

    def judge(where, reference, candidate, rtol, want):
        out = _tuple(
            where,
            run.call(
                where,
                {n: g.clone() for n, g in reference.items()},
                {n: g.clone() for n, g in candidate.items()},
                rtol,
            ),
            ("passed", "errors"),
        )
        passed, errors = out
        expected = gates.gradient_errors(reference, candidate)
        if not isinstance(errors, dict) or set(errors) != set(expected):
            raise _Wrong(
                f"✗ {where}：errors 应是每个参考参数一项的字典（{sorted(expected)}），你返回了 "
                f"{sorted(errors) if isinstance(errors, dict) else type(errors).__name__}"
            )
        for n, e in expected.items():
            got = float(errors[n])
            same = (
                (math.isnan(e) and math.isnan(got))
                or (math.isinf(e) and got == e)
                or abs(got - e) <= 1e-6 * max(abs(e), 1e-30)
            )
            if not same:
                scale_own = (
                    (candidate[n].double() - reference[n].double()).abs().max().item()
                    / reference[n].double().abs().max().item()
                    if n in candidate
                    else None
                )
                top = max(float(g.abs().max()) for g in reference.values())
                lines = [f"✗ {where}：参数 {n} 的误差 e_p 是 {got:.3e}，门槛公式给出 {e:.3e}"]
                if n not in candidate:
                    lines.append("    候选缺了这个参数的梯度：它的误差应当是 inf，门必须不通过")
                elif scale_own is not None and abs(got - scale_own) <= 1e-6 * max(scale_own, 1e-30):
                    lines.append(
                        f"    你除以了这个参数自己的最大梯度，没有下限：它的梯度尺度只有全局最大值的 "
                        f"{float(reference[n].abs().max()) / top:.0e}，要改用 1e-3 × 全局最大梯度，免得两份舍入噪声相除"
                    )
                elif n in candidate and abs(
                    got - (candidate[n].double() - reference[n].double()).abs().max().item()
                ) <= 1e-6 * max(abs(got), 1e-30):
                    lines.append("    你用的是绝对误差 max|Δ|，没有除以梯度尺度")
                raise _Wrong(lines, f"{n} 的 e_p {got:.2e} ≠ {e:.2e}")
        if bool(passed) is not want:
            bad = [n for n, e in expected.items() if not e <= rtol]
            raise _Wrong(
                f"✗ {where}：你的门{'放行了' if passed else '拦下了'}它，应当{'通过' if want else '不通过'}"
                + (
                    f"（超出容限 {rtol:.0e} 的参数：{bad}；NaN 与 inf 都算超出）"
                    if bad
                    else f"（所有参数都在容限 {rtol:.0e} 内）"
                ),
                f"结论应为{'通过' if want else '不通过'}",
            )
        run.ok(f"{where}：{'通过' if want else '不通过'}，e_p 与 gates.gradient_errors 一致")

    for where, reference, candidate, rtol, want in synthetic:
        judge(where, reference, candidate, rtol, want)
    traces = _gate_traces()
    ref_trace = traces["reference"]
    judge(
        "真实运行：正确的 FP16 候选（容限 2e-2）",
        ref_trace.grads[0],
        traces["fp16"].grads[0],
        gates.GRAD_RTOL["float16"],
        True,
    )
    judge(
        "真实运行：埋入错误“按微批次取平均的损失”（容限 1e-4）",
        ref_trace.grads[0],
        traces["micro_mean"].grads[0],
        gates.GRAD_RTOL["float32"],
        False,
    )


def _trace(**fields):
    from trainmech import tracing

    return tracing.Trace("synthetic", **fields)


@_exercise("task6.update_gate", "更新门：有效更新、有限值、优化器与调度器跟随更新时钟")
def _task6_update_gate(run: _Run) -> None:
    lrs = [1e-3 * m for m in (0.1, 1.0, 1.0, 0.55, 0.1)]  # the clock's lr of effective updates 0..4
    skip = [True, True, False, True, True, True]  # attempt 2 skipped: 5 effective updates
    reference = _trace(stepped=skip, finite=[True] * 6, lrs=lrs, optimizer_steps=5, scheduler_steps=5)
    synthetic = [
        ("合成 1：与参照完全相同的正确候选", reference, True),
        (
            "合成 2：跳步也推进调度器（调度器 6 次，第 2 次跳步后学习率超前一步）",
            _trace(
                stepped=skip,
                finite=[True] * 6,
                lrs=lrs[:2] + lrs[3:] + [1e-4],
                optimizer_steps=5,
                scheduler_steps=6,
            ),
            False,
        ),
        (
            "合成 3：没有有限性保护，NaN 写进了参数",
            _trace(
                stepped=[True] * 6,
                finite=[True, True] + [False] * 4,
                lrs=lrs + [1e-4],
                optimizer_steps=6,
                scheduler_steps=6,
            ),
            False,
        ),
        (
            "合成 4：少做了一次有效更新（第 4 次尝试没有 step）",
            _trace(
                stepped=[True, True, False, True, False, True],
                finite=[True] * 6,
                lrs=lrs[:4],
                optimizer_steps=4,
                scheduler_steps=4,
            ),
            False,
        ),
        (
            '合成 5：优化器自己的计数与有效更新不符（state["step"] 多算一次）',
            _trace(stepped=skip, finite=[True] * 6, lrs=lrs, optimizer_steps=6, scheduler_steps=5),
            False,
        ),
        (
            "合成 6：次数都对，但第 3 次有效更新的学习率不是时钟给的",
            _trace(
                stepped=skip,
                finite=[True] * 6,
                lrs=lrs[:3] + [2e-3, lrs[4]],
                optimizer_steps=5,
                scheduler_steps=5,
            ),
            False,
        ),
        (
            "合成 7：候选在第 1 次尝试抛出异常，运行中断",
            _trace(
                stepped=[True],
                finite=[True],
                lrs=lrs[:1],
                optimizer_steps=1,
                scheduler_steps=1,
                error="attempt 1, backward: RuntimeError: boom",
            ),
            False,
        ),
    ]

    def judge(where, reference, candidate, expected_lrs, want):
        out = _tuple(where, run.call(where, reference, candidate, list(expected_lrs)), ("passed", "message"))
        passed, message = out
        if not isinstance(message, str) or not message.strip():
            raise _Wrong(f"✗ {where}：message 应是一句说明（拦下时说出证据），你返回了 {message!r}")
        if bool(passed) is not want:
            raise _Wrong(
                f"✗ {where}：你的门{'放行了' if passed else '拦下了'}它（“{message.strip()[:80]}”），应当"
                f"{'不通过：这个埋入的错误漏过去了' if not want else '通过：这是误报'}",
                f"{where.split('：', 1)[-1]}：应{'通过' if want else '不通过'}",
            )
        run.ok(f"{where}：{'通过' if want else '拦下'}（“{message.strip()[:60]}”）")

    for where, candidate, want in synthetic:
        judge(where, reference, candidate, lrs, want)
    traces = _gate_traces()
    real = [
        ("真实运行：参照自己", "reference", True),
        ("真实运行：正确的 FP16 候选", "fp16", True),
        ("真实运行：埋入错误“跳步也推进调度器”", "scheduler_every_attempt", False),
        ("真实运行：埋入错误“没有有限性保护的更新”", "step_without_guard", False),
    ]
    for where, key, want in real:
        judge(where, traces["reference"], traces[key], traces["expected_lrs"], want)
