"""Task0 exercises: SGD with momentum and weight decay; AdamW's first update in closed form."""

from __future__ import annotations

import torch

from trainmech.exercises.harness import _exercise, _randn, _Run, _tensor, _tuple

__all__: list[str] = []  # nothing to import: the checks register into EXERCISES


@_exercise("task0.sgd_momentum_update", "手写带动量和权重衰减的 SGD 更新")
def _task0_sgd(run: _Run) -> None:
    gen = torch.Generator().manual_seed(0)
    cases = [
        dict(shape=(3, 4), lr=0.1, momentum=0.9, weight_decay=0.01),
        dict(shape=(7,), lr=0.05, momentum=0.5, weight_decay=0.1),
    ]
    for c, case in enumerate(cases, 1):
        lr, mu, wd = case["lr"], case["momentum"], case["weight_decay"]
        theta = _randn(gen, *case["shape"])
        p = theta.clone().requires_grad_(True)
        opt = torch.optim.SGD([p], lr=lr, momentum=mu, weight_decay=wd)
        buf = None
        for k in range(3):
            grad = _randn(
                gen, *case["shape"], scale=10.0 ** (k - 1)
            )  # 0.1, 1, 10: the scales change between updates
            p.grad = grad.clone()
            opt.step()
            ref_theta, ref_buf = p.detach().clone(), opt.state[p]["momentum_buffer"].clone()
            where = f"输入 {c}（lr={lr:g}, μ={mu:g}, λ={wd:g}）第 {k + 1} 次更新"
            out = _tuple(
                where,
                run.call(
                    where,
                    theta.clone(),
                    grad.clone(),
                    None if buf is None else buf.clone(),
                    lr=lr,
                    momentum=mu,
                    weight_decay=wd,
                ),
                ("theta", "buf"),
            )

            def variant(kind, th=theta, g=grad, b=buf):
                d = g if kind == "no_decay" else g + wd * th
                if kind == "ema":
                    nb = mu * (torch.zeros_like(d) if b is None else b) + (1 - mu) * d
                else:
                    nb = d.clone() if b is None else mu * b + d
                if kind == "decay_outside":
                    nb = g.clone() if b is None else mu * b + g
                    return th - lr * (nb + wd * th), nb
                if kind == "no_momentum":
                    return th - lr * d, nb
                if kind == "sign":
                    return th + lr * nb, nb
                return th - lr * nb, nb

            kinds = {
                "no_decay": "漏了权重衰减：梯度里没有加 λθ",
                "decay_outside": "λθ 没有先加进梯度、进入动量，而是最后单独减去 lr·λθ",
                "ema": "动量写成了 μ·buf + (1−μ)·g（那是 Adam 一阶矩的写法；SGD 是 μ·buf + g）",
                "no_momentum": "参数沿梯度 g 而不是沿动量缓冲 buf 移动",
                "sign": "更新方向反了：θ + lr·buf",
            }
            # θ is judged first. With θ right, a buffer without λθ means the decay went around the
            # momentum, not missing: for buf, "decay_outside" is tried first (its buffer equals "no_decay"'s).
            buf_kinds = {"decay_outside": kinds["decay_outside"]} | kinds
            judged = [("θ（新参数）", ref_theta, kinds), ("buf（动量缓冲）", ref_buf, buf_kinds)]
            for i, (name, reference, tried) in enumerate(judged):
                variants = [(d, lambda k_=k_, i=i: variant(k_)[i]) for k_, d in tried.items()]
                _tensor(
                    where, name, out[i], reference, rtol=1e-12, against="torch.optim.SGD", variants=variants
                )
            theta, buf = ref_theta, ref_buf  # the next update starts from the correct state
        run.ok(f"输入 {c}：3 次更新的 θ 与 buf 都与 torch.optim.SGD 一致（相对误差 ≤ 1e-12）")


@_exercise("task0.adamw_first_update", "AdamW 第一次更新的闭式解")
def _task0_adamw(run: _Run) -> None:
    gen = torch.Generator().manual_seed(1)
    b1, b2 = 0.9, 0.999
    cases = [
        dict(shape=(4, 5), lr=1e-2, weight_decay=0.1, eps=1e-8),
        dict(shape=(9,), lr=3e-3, weight_decay=0.01, eps=1e-6),
    ]
    for c, case in enumerate(cases, 1):
        lr, wd, eps = case["lr"], case["weight_decay"], case["eps"]
        theta = _randn(gen, *case["shape"])
        magnitude = 10.0 ** (
            torch.rand(case["shape"], generator=gen, dtype=torch.float64) * 11 - 10
        )  # |g| from 1e-10 to 10
        grad = _randn(gen, *case["shape"]) * magnitude
        grad.view(-1)[0] = 0.0  # one element with no gradient at all: only the decay moves it
        p = theta.clone().requires_grad_(True)
        p.grad = grad.clone()
        torch.optim.AdamW([p], lr=lr, weight_decay=wd, eps=eps).step()
        where = f"输入 {c}（lr={lr:g}, λ={wd:g}, ε={eps:g}，|g| 从 0 到 10）"
        ours = run.call(where, theta.clone(), grad.clone(), lr=lr, weight_decay=wd, eps=eps)
        g, th = grad, theta
        variants = [
            (
                "权重衰减耦合进了梯度（Adam + L2：g ← g + λθ），AdamW 是解耦的",
                lambda: th - lr * (g + wd * th) / ((g + wd * th).abs() + eps),
            ),
            ("漏了权重衰减 θ(1 − ηλ)", lambda: th - lr * g / (g.abs() + eps)),
            (
                "衰减放在了梯度步之后：(θ − η·g/(|g|+ε))(1 − ηλ)",
                lambda: (th - lr * g / (g.abs() + eps)) * (1 - lr * wd),
            ),
            ("衰减因子写成了 (1 − λ)，少乘了学习率 η", lambda: th * (1 - wd) - lr * g / (g.abs() + eps)),
            (
                "没有做偏差校正：m = (1−β₁)g、v = (1−β₂)g² 直接相除",
                lambda: th * (1 - lr * wd) - lr * (1 - b1) * g / (((1 - b2) * g * g).sqrt() + eps),
            ),
            ("ε 放进了根号里：g/√(g² + ε)", lambda: th * (1 - lr * wd) - lr * g / (g * g + eps).sqrt()),
            ("方向反了：+η·g/(|g|+ε)", lambda: th * (1 - lr * wd) + lr * g / (g.abs() + eps)),
        ]
        rel = _tensor(
            where, "θ₁", ours, p.detach(), rtol=1e-12, against="torch.optim.AdamW", variants=variants
        )
        run.ok(f"{where}：θ₁ 与 torch.optim.AdamW 一致（相对误差 {rel:.1e} ≤ 1e-12）")
