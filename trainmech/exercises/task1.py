"""Task1 exercises: the VJP of a residual branch; the gradient of tied embedding weights."""

from __future__ import annotations

import torch

from trainmech.exercises.harness import _exercise, _randn, _Run, _tensor, _tuple
from trainmech.vjp_check import reference_vjp

__all__: list[str] = []  # nothing to import: the checks register into EXERCISES


@_exercise("task1.residual_vjp", "残差分支 y = x + tanh(Wx) 的 VJP")
def _task1_residual(run: _Run) -> None:
    gen = torch.Generator().manual_seed(2)
    for c, n in enumerate((4, 6), 1):
        W, x, v = _randn(gen, n, n, scale=0.8), _randn(gen, n), _randn(gen, n)
        where = f"输入 {c}（n={n}，W 不对称）"
        out = _tuple(where, run.call(where, W.clone(), x.clone(), v.clone()), ("dx", "dW"))
        _, (dW_ref, dx_ref) = reference_vjp(lambda W_, x_: x_ + torch.tanh(W_ @ x_), (W, x), v)
        u = W @ x
        g = torch.tanh(u)
        ubar = v * (1 - g * g)
        dx_variants = [
            ("只算了分支路径，漏了恒等路径直接送回的 v——两条路径的梯度要相加", lambda: W.T @ ubar),
            ("只算了恒等路径，漏了经过 tanh 分支的那一份", lambda: v.clone()),
            ("分支里用了 W ū 而不是 Wᵀ ū", lambda: v + W @ ubar),
            (
                "tanh 的导数用了 1 − u²（u = Wx 是 tanh 的输入），应为 1 − tanh(u)²",
                lambda: v + W.T @ (v * (1 - u * u)),
            ),
            ("漏了 tanh 的局部导数 1 − tanh²", lambda: v + W.T @ v),
        ]
        dW_variants = [
            ("外积顺序反了：写成了 x ūᵀ，应为 ū xᵀ", lambda: torch.outer(x, ubar)),
            ("漏了 tanh 的局部导数：W̄ = v xᵀ", lambda: torch.outer(v, x)),
            ("tanh 的导数用了 1 − u²", lambda: torch.outer(v * (1 - u * u), x)),
        ]
        r1 = _tensor(where, "dx", out[0], dx_ref, rtol=1e-12, against="Autograd", variants=dx_variants)
        r2 = _tensor(where, "dW", out[1], dW_ref, rtol=1e-12, against="Autograd", variants=dW_variants)
        run.ok(f"{where}：dx rel={r1:.1e}，dW rel={r2:.1e}（≤ 1e-12，对照 Autograd）")


@_exercise("task1.tied_embedding_grad", "共享权重：嵌入查表与输出头的梯度汇合")
def _task1_tied(run: _Run) -> None:
    gen = torch.Generator().manual_seed(3)
    cases = [
        (6, 4, torch.tensor([1, 3, 3, 0, 5, 1, 1, 2])),
        (10, 5, torch.randint(0, 7, (12,), generator=gen)),
    ]
    for c, (V, C, ids) in enumerate(cases, 1):
        E, G = _randn(gen, V, C), _randn(gen, len(ids), V)
        where = f"输入 {c}（V={V}, C={C}, ids={ids.tolist()}）"
        ours = run.call(where, E.clone(), ids.clone(), G.clone())
        leaf = E.clone().requires_grad_(True)
        h = leaf[ids]  # (T, C) the lookup
        ((h @ leaf.T) * G).sum().backward()  # (T, V) the tied head, upstream G
        h0 = E[ids]
        dh = G @ E  # (T, C)

        def lookup(assign=False):
            out = torch.zeros_like(E)
            if assign:
                out[ids] = dh  # a repeated id keeps only one row's gradient
            else:
                out.index_add_(0, ids, dh)
            return out

        variants = [
            ("只有输出头那一份 Ḡᵀh，漏了嵌入查表那一份", lambda: G.T @ h0),
            ("只有嵌入查表那一份，漏了输出头那一份 Ḡᵀh", lambda: lookup()),
            (
                "查表的梯度用了赋值 dE[ids] = …：重复的 id 只留下一行，应累加（index_add_）",
                lambda: G.T @ h0 + lookup(assign=True),
            ),
        ]
        rel = _tensor(
            where,
            "dE",
            ours,
            leaf.grad,
            rtol=1e-12,
            against="Autograd",
            variants=variants,
            shape_hint="dE 的形状与 E 相同：(V, C)。",
        )
        run.ok(f"{where}：dE rel={rel:.1e}（≤ 1e-12，对照 Autograd）")
