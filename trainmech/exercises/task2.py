"""Task2 exercises: RMSNorm, grouped-query attention and cross-entropy backward by hand."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainmech.exercises.harness import _exercise, _randn, _Run, _tensor, _tuple
from trainmech.vjp_check import reference_vjp

__all__: list[str] = []  # nothing to import: the checks register into EXERCISES


@_exercise("task2.rms_norm_backward", "手写 RMSNorm 的反向")
def _task2_rms(run: _Run) -> None:
    from trainmech import vjp

    gen = torch.Generator().manual_seed(4)
    for c, (shape, eps) in enumerate((((2, 5, 8), 1e-6), ((3, 16), 1e-5), ((1, 3, 4, 12), 1e-6)), 1):
        C = shape[-1]
        row_scale = 10.0 ** (torch.rand(shape[:-1] + (1,), generator=gen, dtype=torch.float64) * 2 - 1)
        x, w, dy = _randn(gen, *shape) * row_scale, 1 + _randn(gen, C, scale=0.3), _randn(gen, *shape)
        _, saved = vjp.rms_norm_forward(x, w, eps=eps)
        where = f"输入 {c}（x {tuple(shape)}，w ≠ 1）"
        out = _tuple(where, run.call(where, dict(saved), dy.clone()), ("dx", "dw"))
        _, (dx_ref, dw_ref) = reference_vjp(lambda x_, w_: F.rms_norm(x_, (C,), w_, eps), (x, w), dy)
        rstd = saved["rstd"]
        n = x * rstd
        g = dy * w
        dx_variants = [
            ("漏了第二项（x 还经过 rstd 影响每个通道）：dx = rstd·g", lambda: rstd * g),
            (
                "到达 n 的梯度忘了乘 w：g = ȳ 而不是 ȳ ⊙ w",
                lambda: rstd * (dy - n * (dy * n).mean(-1, keepdim=True)),
            ),
            ("第二项沿 C 求了和而不是求平均", lambda: rstd * (g - n * (g * n).sum(-1, keepdim=True))),
            ("第二项少乘了 n：rstd·(g − mean(g ⊙ n))", lambda: rstd * (g - (g * n).mean(-1, keepdim=True))),
        ]
        dw_variants = [
            ("dw 对位置取了平均而不是求和", lambda: (dy * n).reshape(-1, C).mean(0)),
            ("dw 用了 ȳ ⊙ x（没有归一化）", lambda: (dy * x).reshape(-1, C).sum(0)),
        ]
        r1 = _tensor(where, "dx", out[0], dx_ref, rtol=1e-10, against="Autograd", variants=dx_variants)
        r2 = _tensor(
            where,
            "dw",
            out[1],
            dw_ref,
            rtol=1e-10,
            against="Autograd",
            variants=dw_variants,
            shape_hint="权重被每个位置共享：dw 要对全部位置求和，形状是 (C,)。",
        )
        run.ok(f"{where}：dx rel={r1:.1e}，dw rel={r2:.1e}（≤ 1e-10，对照 Autograd 的 F.rms_norm）")


def _attention_backward_variant(saved, dout, *, scaled=True, rowsum=True, group="sum", p_t=True):
    """A (possibly deliberately wrong) attention backward, to name a learner's mistake."""
    q, k, v, P, s = saved["q"], saved["k"], saved["v"], saved["probs"], saved["scale"]
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, H, T_k, D)
    dv = (P.transpose(-1, -2) if p_t else P) @ dout
    dP = dout @ vr.transpose(-1, -2)
    dS = P * (dP - (dP * P).sum(-1, keepdim=True)) if rowsum else P * dP
    if scaled:
        dS = dS * s
    dq = dS @ kr
    dk = dS.transpose(-1, -2) @ q
    reduce = (
        (lambda t: t.reshape(B, Hkv, G, *t.shape[2:]).sum(2))
        if group == "sum"
        else (lambda t: t.reshape(B, Hkv, G, *t.shape[2:]).mean(2))
    )
    return dq, reduce(dk), reduce(dv)


@_exercise("task2.attention_backward", "手写分组查询注意力的反向")
def _task2_attention(run: _Run) -> None:
    from trainmech import vjp

    gen = torch.Generator().manual_seed(5)
    for c, (B, H, Hkv, T, D) in enumerate(((1, 2, 2, 5, 4), (2, 4, 2, 6, 8), (1, 6, 2, 7, 4)), 1):
        q, k, v = _randn(gen, B, H, T, D), _randn(gen, B, Hkv, T, D), _randn(gen, B, Hkv, T, D)
        _, saved = vjp.attention_forward(q, k, v, causal=True)
        dout = _randn(gen, B, H, T, D)
        where = f"输入 {c}（B={B}, H={H}, Hkv={Hkv}, T={T}, D={D}，因果）"
        out = _tuple(where, run.call(where, dict(saved), dout.clone()), ("dq", "dk", "dv"))
        sdpa = lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)  # noqa: E731
        _, refs = reference_vjp(sdpa, (q, k, v), dout)
        kinds = [
            ("q̄、k̄ 漏了缩放 s = D^(-1/2)", dict(scaled=False)),
            ("Softmax 反向漏了第二项 −P ⊙ rowsum(P̄ ⊙ P)", dict(rowsum=False)),
            ("k̄、v̄ 在共用一组键值的 G 个查询头之间取了平均，应当求和", dict(group="mean")),
            ("v̄ 用了 P Ō 而不是 Pᵀ Ō", dict(p_t=False)),
        ]
        hint = "k̄、v̄ 的形状与 k、v 相同 (B, Hkv, T_k, D)：共用一组键值的 G 个查询头的梯度要相加。"
        rels = []
        for i, name in enumerate(("dq", "dk", "dv")):
            variants = [
                (d, lambda kw=kw, i=i: _attention_backward_variant(saved, dout, **kw)[i]) for d, kw in kinds
            ]
            rels.append(
                _tensor(
                    where,
                    name,
                    out[i],
                    refs[i],
                    rtol=1e-10,
                    against="Autograd（SDPA）",
                    variants=variants,
                    shape_hint=hint if i else "",
                )
            )
        run.ok(f"{where}：dq/dk/dv rel={max(rels):.1e}（≤ 1e-10，对照 SDPA 的 Autograd）")


@_exercise("task2.cross_entropy_backward", "手写交叉熵对 logits 的反向（含 ignore_index）")
def _task2_cross_entropy(run: _Run) -> None:
    from trainmech import vjp

    gen = torch.Generator().manual_seed(6)
    for c, (N, V, every, reduction) in enumerate(
        ((12, 7, 4, "mean"), (9, 5, 3, "sum"), (6, 11, 0, "mean")), 1
    ):
        logits = _randn(gen, N, V, scale=2.0)
        targets = torch.randint(0, V, (N,), generator=gen)
        if every:
            targets[::every] = -100
        _, saved = vjp.cross_entropy_forward(logits, targets, ignore_index=-100, reduction=reduction)
        dloss = _randn(gen, scale=1.7)  # a scalar upstream gradient, not 1
        where = f"输入 {c}（N={N}, V={V}，{int((targets == -100).sum())} 行被忽略，reduction={reduction!r}）"
        ours = run.call(where, dict(saved), dloss.clone())
        leaf = logits.clone().requires_grad_(True)
        (F.cross_entropy(leaf, targets, ignore_index=-100, reduction=reduction) * dloss).backward()
        probs, valid = saved["probs"], targets != -100
        onehot = F.one_hot(torch.where(valid, targets, 0), V).double()
        scale = dloss / saved["n_valid"] if reduction == "mean" else dloss
        variants = [
            (
                "除以了全部行数 N，而不是有效行数 n_valid",
                lambda: torch.where(valid[:, None], probs - onehot, 0) * dloss / N,
            ),
            ("被忽略的行没有置 0", lambda: (probs - onehot) * scale),
            (
                "忘了乘上游梯度 grad_out",
                lambda: torch.where(valid[:, None], probs - onehot, 0) * (scale / dloss),
            ),
            ("漏了 −onehot 那一项（只剩 softmax）", lambda: torch.where(valid[:, None], probs, 0) * scale),
        ]
        rel = _tensor(
            where,
            "dlogits",
            ours,
            leaf.grad,
            rtol=1e-10,
            against="Autograd（F.cross_entropy）",
            variants=variants,
        )
        run.ok(f"{where}：dlogits rel={rel:.1e}（≤ 1e-10）")
