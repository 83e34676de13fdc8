"""Task3 exercises: a streaming accumulation window divided by its supervised tokens at the end; the update
clock's learning rates."""

from __future__ import annotations

import torch

from trainmech.exercises.harness import _exercise, _fmt_index, _Run, _tensor, _tiny_model, _tuple, _Wrong

__all__: list[str] = []  # nothing to import: the checks register into EXERCISES


@_exercise("task3.streaming_window", "流式的累计窗口：先累加 Token 损失之和，最后把 .grad 除以 N")
def _task3_window(run: _Run) -> None:
    from trainmech import supervision, workload

    model = _tiny_model()
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    batch = workload.uneven_batch(4, 32)
    half_empty = {**batch, "labels": batch["labels"].clone()}
    half_empty["labels"][2:] = workload.IGNORE_INDEX  # the second micro-batch supervises nothing

    def grads():
        gs = [p.grad for p in model.parameters()]
        return None if any(g is None for g in gs) else torch.cat([g.flatten() for g in gs])

    for c, (full, n) in enumerate(((batch, 2), (batch, 4), (half_empty, 2)), 1):
        micro = workload.split_micro_batches(full, n)
        tokens = [workload.supervised_tokens(mb["labels"]) for mb in micro]
        where = f"输入 {c}（{n} 个微批次，监督 Token {tokens}）"
        model.zero_grad(set_to_none=True)
        loss = run.call(where, model, [dict(mb) for mb in micro])
        ours = grads()
        model.zero_grad(set_to_none=True)
        out = model(**full)  # the full batch: one forward, the model's own mean loss
        out.loss.backward()
        g_full, loss_full = grads(), out.loss.detach()
        model.zero_grad(set_to_none=True)
        if ours is None:
            raise _Wrong(
                f"✗ {where}：调用之后还有参数的 .grad 是 None——每个微批次都要 backward()，梯度累加在 .grad 里"
            )
        N, N_unshifted = sum(tokens), int((full["labels"] != workload.IGNORE_INDEX).sum())

        def micro_mean():
            model.zero_grad(set_to_none=True)
            supervision.accumulate_gradients(model, micro, normalization="micro_mean")
            g = grads()
            model.zero_grad(set_to_none=True)
            return g

        variants = [
            ("micro_mean：每个微批次先各自取平均再除以微批次个数——短微批次的 Token 权重更大", micro_mean),
            (
                f"数监督 Token 时没有错位：数了 labels != -100（{N_unshifted} 个），应数 labels[:, 1:] != -100（{N} 个）",
                lambda: g_full * (N / N_unshifted),
            ),
            (f"最后没有把 .grad 除以 N（= {N}）：留下的是 Token 损失之和的梯度", lambda: g_full * N),
        ]
        try:
            rel = _tensor(
                where, "窗口梯度（全部参数）", ours, g_full, rtol=1e-6, against="完整批次", variants=variants
            )
        except _Wrong as w:
            if ours.shape == g_full.shape and torch.isfinite(ours).all() and len(w.lines) > 1:
                worst = int((ours - g_full).abs().argmax())
                i = next(i for i, end in enumerate(torch.tensor(sizes).cumsum(0).tolist()) if worst < end)
                p = list(model.parameters())[i]
                local = tuple(
                    int(j) for j in torch.unravel_index(torch.tensor(worst - sum(sizes[:i])), p.shape)
                )
                w.lines[1] = (
                    f"    偏差最大的元素是参数 {names[i]} 的 {_fmt_index(local)}：你的 {ours[worst].item():.6g}，"
                    f"完整批次的 {g_full[worst].item():.6g}；{int(((ours - g_full).abs() > 1e-6 * g_full.abs().max()).sum())} "
                    f"/ {ours.numel()} 个元素超出容限"
                )
            elif not torch.isfinite(ours).all() and 0 in tokens:
                w.lines.append(
                    f"    这个窗口里有微批次一个监督 Token 也没有（{tokens}）：按微批次求平均会得到 0/0 = NaN；"
                    "按整个窗口的 N 归一化时它只贡献 0"
                )
            raise
        if loss is None:
            raise _Wrong(f"✗ {where}：没有返回窗口损失（应返回各微批次损失之和，一个数）")
        loss_value = torch.as_tensor(
            loss.detach() if isinstance(loss, torch.Tensor) else loss, dtype=torch.float64
        ).reshape(())
        lrel = _tensor(where, "窗口损失", loss_value, loss_full.double(), rtol=1e-6, against="完整批次的损失")
        run.ok(f"{where}：梯度 rel={rel:.1e}，损失 rel={lrel:.1e}（≤ 1e-6，对照完整批次）")


@_exercise("task3.scheduled_lrs", "更新时钟：跳步不推进调度")
def _task3_clock(run: _Run) -> None:
    from trainmech.update import logged_steps, replay_schedule, wsd_multiplier

    cases = [
        (14, (2, 9), dict(warmup_steps=3, stable_steps=5, decay_steps=4, min_lr_ratio=0.1)),
        (
            10,
            (0, 1),
            dict(warmup_steps=2, stable_steps=3, decay_steps=3, min_lr_ratio=0.0, decay_type="linear"),
        ),
        (8, (), dict(warmup_steps=2, stable_steps=2, decay_steps=2, min_lr_ratio=0.1)),
        (12, (5, 6, 7, 11), dict(warmup_steps=1, stable_steps=4, decay_steps=5, min_lr_ratio=0.2)),
    ]
    base_lr = 1e-3
    for c, (attempts, skips, wsd) in enumerate(cases, 1):
        stepped = [a not in skips for a in range(attempts)]
        where = f"输入 {c}（{attempts} 次尝试，跳过 {list(skips) or '无'}）"
        out = _tuple(where, run.call(where, list(stepped), base_lr, dict(wsd)), ("lrs", "logged"))
        # transformers' WSD scheduler, stepped after effective updates only
        lrs_ref = replay_schedule(stepped, int, base_lr, **wsd)
        logged_ref = logged_steps(stepped)
        lrs, logged = list(out[0]), list(out[1])
        if len(lrs) != attempts or len(logged) != attempts:
            raise _Wrong(
                f"✗ {where}：lrs 有 {len(lrs)} 项、logged 有 {len(logged)} 项，应各有 {attempts} 项（每次尝试一项）"
            )
        for a in range(attempts):
            ours, ref = float(lrs[a]), lrs_ref[a]
            if abs(ours - ref) <= 1e-12 * base_lr:
                continue
            k = sum(stepped[:a])
            lines = [
                f"✗ {where}：第 {a} 次尝试（此前有效更新 {k} 次、跳过 {a - k} 次）的学习率是 {ours:.6e}，"
                f"更新时钟给出 {ref:.6e}（调度的第 {k} 步，transformers 的 WSD 调度器只在有效更新后 step()）"
            ]
            matches = [
                j
                for j in range(attempts + 3)
                if abs(base_lr * wsd_multiplier(j, **wsd) - ours) <= 1e-12 * base_lr
            ]
            if a in matches and a != k:
                lines.append(f"    你的值是调度的第 {a} 步：调度跟着尝试次数走了——被跳过的更新也推进了它")
            elif k + 1 in matches:
                lines.append(
                    f"    你的值是调度的第 {k + 1} 步：超前一步——这次尝试用的是更新之前的时钟读数 {k}"
                )
            elif matches:
                lines.append(f"    你的值是调度的第 {matches[0]} 步，应为第 {k} 步")
            raise _Wrong(lines, f"第 {a} 次尝试的学习率 {ours:.3e} ≠ {ref:.3e}")
        for a in range(attempts):
            if logged[a] != logged_ref[a]:
                raise _Wrong(
                    f"✗ {where}：第 {a} 次尝试之后日志记的步数是 {logged[a]}，应为有效更新次数 {logged_ref[a]}"
                    + ("（被跳过的尝试不能记成新的一步）" if logged[a] == a + 1 else ""),
                    f"第 {a} 次尝试后的日志步数 {logged[a]} ≠ {logged_ref[a]}",
                )
        run.ok(
            f"{where}：每次尝试的学习率与只在有效更新后推进的 transformers 调度器逐个相同，日志步数等于有效更新次数"
        )
