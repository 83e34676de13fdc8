"""Exercises (练习) at the end of every Task notebook, with instant checks.

    import trainmech.exercises
    trainmech.exercises.check("task2.rms_norm_backward", rms_norm_backward)

A check runs the learner's function on several inputs (float64, deliberately non-trivial: weights
off their init, repeated ids, unequal micro-batches, skipped updates) and compares it with what the
notebook compares against: autograd, the framework (torch.optim, transformers' scheduler), or a
measurement (the Task4 storage tracker). It answers in Chinese, one line per input that passed.
Three outcomes:

    unfilled stub (it raises NotImplementedError)  ->  prints "未完成：…" (fixed text), returns None
    correct                                        ->  prints "✓ …" lines and "通过", returns True
    wrong                                          ->  prints which tensor / update / byte count is
                                                       off and by how much, names a known mistake it
                                                       matches, then raises checks.ClaimFailed

Checks always run on the CPU, whatever RUN_MODE the notebook ran in, and never move the
notebook's random state (torch.random.fork_rng). Reference solutions are in trainmech.solutions;
a check never reads them.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

import torch
import torch.nn.functional as F

from trainmech.checks import ClaimFailed
from trainmech.errors import TrainmechError

__all__ = ["check", "EXERCISES"]


class _NotAttempted(Exception):
    """The learner's stub still raises NotImplementedError."""


class _Wrong(Exception):
    """A wrong answer: the lines to print and a one-line summary for ClaimFailed."""

    def __init__(self, lines: str | list[str], summary: str | None = None):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        self.summary = summary or self.lines[0].lstrip("✗ ").strip()
        super().__init__(self.summary)


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str  # Chinese, printed in the header
    run: Callable[[_Run], None]


EXERCISES: dict[str, Exercise] = {}


def _exercise(exercise_id: str, title: str):
    def register(fn):
        EXERCISES[exercise_id] = Exercise(exercise_id, title, fn)
        return fn

    return register


class _Run:
    """One check of one learner function: calls it, prints what passed."""

    def __init__(self, learner: Callable):
        self.learner = learner
        self.answered = 0  # calls that returned

    def call(self, where: str, *args, **kwargs):
        try:
            out = self.learner(*args, **kwargs)
        except NotImplementedError as e:
            if self.answered == 0:
                raise _NotAttempted() from None
            raise _Wrong(f"✗ {where}：你的函数抛出了 NotImplementedError（{_first_line(e)}）——还有分支没写完？") from None
        except Exception as e:  # noqa: BLE001 — the learner's own error is the diagnosis
            raise _Wrong(f"✗ {where}：你的函数抛出了 {type(e).__name__}：{_first_line(e)}") from None
        self.answered += 1
        return out

    @staticmethod
    def ok(line: str) -> None:
        print(f"  ✓ {line}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0][:200] if text else "（没有说明）")


def check(exercise_id: str, learner: Callable) -> bool | None:
    """Check the learner's answer to one exercise. True: correct; None: not attempted yet;
    a wrong answer prints the diagnosis and raises ClaimFailed."""
    ex = EXERCISES.get(exercise_id)
    if ex is None:
        raise TrainmechError(f"没有练习 {exercise_id!r}；已有：{', '.join(EXERCISES)}")
    print(f"练习 {ex.id} · {ex.title}")
    name = getattr(learner, "__name__", type(learner).__name__)
    try:
        with torch.random.fork_rng(devices=[]):  # the check's own draws never move the notebook's RNG
            ex.run(_Run(learner))
    except _NotAttempted:
        print(f"未完成：`{name}` 还是存根（它抛出 NotImplementedError）。在上一格写出实现后，再运行这一格。")
        return None
    except _Wrong as w:
        for line in w.lines:
            print(f"  {line}")
        raise ClaimFailed(f"练习 {ex.id} 未通过：{w.summary}") from None
    print(f"通过：`{name}` 在全部输入上与参照一致。")
    return True


# ----------------------------------------------------------------------------- comparisons


def _randn(gen: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(shape, generator=gen, dtype=torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, float64; inf for a shape mismatch."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.detach().double(), b.detach().double()
    if not a.numel():
        return 0.0
    return (a - b).abs().max().item() / max(b.abs().max().item(), torch.finfo(torch.float64).tiny)


def _fmt_index(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, index)) + ")" if index else "()"


def _tensor(where: str, name: str, ours, ref: torch.Tensor, *, rtol: float, against: str,
            variants: list[tuple[str, Callable[[], torch.Tensor]]] = (), shape_hint: str = "") -> float:
    """Compare one returned tensor with its reference; raise _Wrong with a diagnosis when it is off.

    variants: (description, thunk) of known mistakes; a wrong answer that matches one is named.
    """
    if ours is None:
        raise _Wrong(f"✗ {where}：{name} 是 None，应为形状 {tuple(ref.shape)} 的张量")
    if not isinstance(ours, torch.Tensor):
        raise _Wrong(f"✗ {where}：{name} 是 {type(ours).__name__}，应为形状 {tuple(ref.shape)} 的张量")
    sep = "" if name.endswith("）") else " "  # no space after a full-width bracket
    of = "" if against.endswith("）") else " "
    if ours.shape != ref.shape:
        lines = [f"✗ {where}：{name}{sep}的形状是 {tuple(ours.shape)}，应为 {tuple(ref.shape)}"]
        if ours.dim() == 2 and tuple(ours.shape) == tuple(ref.shape)[::-1]:
            lines.append("    形状正好反了：是不是把矩阵乘或外积的顺序写反了（转置）？")
        if shape_hint:
            lines.append(f"    {shape_hint}")
        raise _Wrong(lines, f"{name}{sep}的形状 {tuple(ours.shape)} ≠ {tuple(ref.shape)}")
    a, b = ours.detach().double(), ref.detach().double()
    bad = ~torch.isfinite(a)
    if bad.any():
        raise _Wrong(f"✗ {where}：{name} 含有 {int(bad.sum())} 个非有限值（inf 或 NaN）",
                     f"{name} 含有非有限值")
    rel = _rel(a, b)
    if rel <= rtol:
        return rel
    diff = (a - b).abs()
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
    scale = max(b.abs().max().item(), torch.finfo(torch.float64).tiny)
    lines = [f"✗ {where}：{name}{sep}不对：max|Δ|={diff.max().item():.2e}，相对误差 {rel:.2e}，超过容限 {rtol:.0e}",
             f"    偏差最大的元素在索引 {_fmt_index(idx)}：你的 {a[idx].item():.6g}，{against}{of}的 {b[idx].item():.6g}；"
             f"{int((diff > rtol * scale).sum())} / {a.numel()} 个元素超出容限"]
    for description, thunk in variants:
        try:
            v = thunk()
        except Exception:  # noqa: BLE001 — a variant that cannot be formed simply does not match
            continue
        if isinstance(v, torch.Tensor) and _rel(a, v) <= max(rtol, 1e-9):
            lines.append(f"    提示：你的结果与「{description}」一模一样。")
            break
    else:
        denom = (b * b).sum().item()
        c = (a * b).sum().item() / denom if denom > 0 else 0.0
        if c and abs(c - 1) > 1e-6 and _rel(a, c * b) <= max(rtol, 1e-9):
            lines.append(f"    提示：你的结果恰好是{against}{of}的 {c:.6g} 倍——少除或多除了一个因子？")
    raise _Wrong(lines, f"{name}{sep}的相对误差 {rel:.1e}（容限 {rtol:.0e}）")


def _tuple(where: str, out, names: tuple[str, ...]):
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        got = f"{type(out).__name__}" + (f"（{len(out)} 项）" if isinstance(out, (tuple, list)) else "")
        raise _Wrong(f"✗ {where}：应返回 {len(names)} 项的元组 ({', '.join(names)})，你返回了 {got}")
    return out


def _autograd_vjp(fn, inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor, wrt: tuple[int, ...]):
    """fn(*inputs) and the gradients of <fn(*inputs), grad_out> for the inputs at positions `wrt`."""
    leaves = [t.detach().clone().requires_grad_(i in wrt) if t.is_floating_point() else t for i, t in enumerate(inputs)]
    out = fn(*leaves)
    (out * grad_out).sum().backward()
    return out.detach(), [leaves[i].grad for i in wrt]


# ============================================================================= Task0


@_exercise("task0.sgd_momentum_update", "手写带动量和权重衰减的 SGD 更新")
def _task0_sgd(run: _Run) -> None:
    gen = torch.Generator().manual_seed(0)
    cases = [dict(shape=(3, 4), lr=0.1, momentum=0.9, weight_decay=0.01),
             dict(shape=(7,), lr=0.05, momentum=0.5, weight_decay=0.1)]
    for c, case in enumerate(cases, 1):
        lr, mu, wd = case["lr"], case["momentum"], case["weight_decay"]
        theta = _randn(gen, *case["shape"])
        p = theta.clone().requires_grad_(True)
        opt = torch.optim.SGD([p], lr=lr, momentum=mu, weight_decay=wd)
        buf = None
        for k in range(3):
            grad = _randn(gen, *case["shape"], scale=10.0 ** (k - 1))   # 0.1, 1, 10: the scales change between updates
            p.grad = grad.clone()
            opt.step()
            ref_theta, ref_buf = p.detach().clone(), opt.state[p]["momentum_buffer"].clone()
            where = f"输入 {c}（lr={lr:g}, μ={mu:g}, λ={wd:g}）第 {k + 1} 次更新"
            out = _tuple(where, run.call(where, theta.clone(), grad.clone(), None if buf is None else buf.clone(),
                                         lr=lr, momentum=mu, weight_decay=wd), ("theta", "buf"))

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

            kinds = {"no_decay": "漏了权重衰减：梯度里没有加 λθ", "decay_outside": "λθ 没有先加进梯度、进入动量，而是最后单独减去 lr·λθ",
                     "ema": "动量写成了 μ·buf + (1−μ)·g（那是 Adam 一阶矩的写法；SGD 是 μ·buf + g）",
                     "no_momentum": "参数沿梯度 g 而不是沿动量缓冲 buf 移动", "sign": "更新方向反了：θ + lr·buf"}
            _tensor(where, "θ（新参数）", out[0], ref_theta, rtol=1e-12, against="torch.optim.SGD",
                    variants=[(d, lambda k_=k_: variant(k_)[0]) for k_, d in kinds.items()])
            _tensor(where, "buf（动量缓冲）", out[1], ref_buf, rtol=1e-12, against="torch.optim.SGD",
                    variants=[(d, lambda k_=k_: variant(k_)[1]) for k_, d in kinds.items()])
            theta, buf = ref_theta, ref_buf  # the next update starts from the correct state
        run.ok(f"输入 {c}：3 次更新的 θ 与 buf 都与 torch.optim.SGD 一致（相对误差 ≤ 1e-12）")


@_exercise("task0.adamw_first_update", "AdamW 第一次更新的闭式解")
def _task0_adamw(run: _Run) -> None:
    gen = torch.Generator().manual_seed(1)
    b1, b2 = 0.9, 0.999
    cases = [dict(shape=(4, 5), lr=1e-2, weight_decay=0.1, eps=1e-8), dict(shape=(9,), lr=3e-3, weight_decay=0.01, eps=1e-6)]
    for c, case in enumerate(cases, 1):
        lr, wd, eps = case["lr"], case["weight_decay"], case["eps"]
        theta = _randn(gen, *case["shape"])
        magnitude = 10.0 ** (torch.rand(case["shape"], generator=gen, dtype=torch.float64) * 11 - 10)   # |g| from 1e-10 to 10
        grad = _randn(gen, *case["shape"]) * magnitude
        grad.view(-1)[0] = 0.0   # one element with no gradient at all: only the decay moves it
        p = theta.clone().requires_grad_(True)
        p.grad = grad.clone()
        torch.optim.AdamW([p], lr=lr, weight_decay=wd, eps=eps).step()
        where = f"输入 {c}（lr={lr:g}, λ={wd:g}, ε={eps:g}，|g| 从 0 到 10）"
        ours = run.call(where, theta.clone(), grad.clone(), lr=lr, weight_decay=wd, eps=eps)
        g, th = grad, theta
        variants = [
            ("权重衰减耦合进了梯度（Adam + L2：g ← g + λθ），AdamW 是解耦的", lambda: th - lr * (g + wd * th) / ((g + wd * th).abs() + eps)),
            ("漏了权重衰减 θ(1 − ηλ)", lambda: th - lr * g / (g.abs() + eps)),
            ("衰减放在了梯度步之后：(θ − η·g/(|g|+ε))(1 − ηλ)", lambda: (th - lr * g / (g.abs() + eps)) * (1 - lr * wd)),
            ("衰减因子写成了 (1 − λ)，少乘了学习率 η", lambda: th * (1 - wd) - lr * g / (g.abs() + eps)),
            ("没有做偏差校正：m = (1−β₁)g、v = (1−β₂)g² 直接相除",
             lambda: th * (1 - lr * wd) - lr * (1 - b1) * g / (((1 - b2) * g * g).sqrt() + eps)),
            ("ε 放进了根号里：g/√(g² + ε)", lambda: th * (1 - lr * wd) - lr * g / (g * g + eps).sqrt()),
            ("方向反了：+η·g/(|g|+ε)", lambda: th * (1 - lr * wd) + lr * g / (g.abs() + eps)),
        ]
        rel = _tensor(where, "θ₁", ours, p.detach(), rtol=1e-12, against="torch.optim.AdamW", variants=variants)
        run.ok(f"{where}：θ₁ 与 torch.optim.AdamW 一致（相对误差 {rel:.1e} ≤ 1e-12）")


# ============================================================================= Task1


@_exercise("task1.residual_vjp", "残差分支 y = x + tanh(Wx) 的 VJP")
def _task1_residual(run: _Run) -> None:
    gen = torch.Generator().manual_seed(2)
    for c, n in enumerate((4, 6), 1):
        W, x, v = _randn(gen, n, n, scale=0.8), _randn(gen, n), _randn(gen, n)
        where = f"输入 {c}（n={n}，W 不对称）"
        out = _tuple(where, run.call(where, W.clone(), x.clone(), v.clone()), ("dx", "dW"))
        _, (dW_ref, dx_ref) = _autograd_vjp(lambda W_, x_: x_ + torch.tanh(W_ @ x_), (W, x), v, wrt=(0, 1))
        u = W @ x
        g = torch.tanh(u)
        ubar = v * (1 - g * g)
        dx_variants = [
            ("只算了分支路径，漏了恒等路径直接送回的 v——两条路径的梯度要相加", lambda: W.T @ ubar),
            ("只算了恒等路径，漏了经过 tanh 分支的那一份", lambda: v.clone()),
            ("分支里用了 W ū 而不是 Wᵀ ū", lambda: v + W @ ubar),
            ("tanh 的导数用了 1 − u²（u = Wx 是 tanh 的输入），应为 1 − tanh(u)²", lambda: v + W.T @ (v * (1 - u * u))),
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
    cases = [(6, 4, torch.tensor([1, 3, 3, 0, 5, 1, 1, 2])), (10, 5, torch.randint(0, 7, (12,), generator=gen))]
    for c, (V, C, ids) in enumerate(cases, 1):
        E, G = _randn(gen, V, C), _randn(gen, len(ids), V)
        where = f"输入 {c}（V={V}, C={C}, ids={ids.tolist()}）"
        ours = run.call(where, E.clone(), ids.clone(), G.clone())
        leaf = E.clone().requires_grad_(True)
        h = leaf[ids]                         # (T, C) the lookup
        ((h @ leaf.T) * G).sum().backward()   # (T, V) the tied head, upstream G
        h0 = E[ids]
        dh = G @ E                            # (T, C)

        def lookup(assign=False):
            out = torch.zeros_like(E)
            if assign:
                out[ids] = dh                 # a repeated id keeps only one row's gradient
            else:
                out.index_add_(0, ids, dh)
            return out

        variants = [("只有输出头那一份 Ḡᵀh，漏了嵌入查表那一份", lambda: G.T @ h0),
                    ("只有嵌入查表那一份，漏了输出头那一份 Ḡᵀh", lambda: lookup()),
                    ("查表的梯度用了赋值 dE[ids] = …：重复的 id 只留下一行，应累加（index_add_）", lambda: G.T @ h0 + lookup(assign=True))]
        rel = _tensor(where, "dE", ours, leaf.grad, rtol=1e-12, against="Autograd", variants=variants,
                      shape_hint="dE 的形状与 E 相同：(V, C)。")
        run.ok(f"{where}：dE rel={rel:.1e}（≤ 1e-12，对照 Autograd）")


# ============================================================================= Task2


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
        _, (dx_ref, dw_ref) = _autograd_vjp(lambda x_, w_: F.rms_norm(x_, (C,), w_, eps), (x, w), dy, wrt=(0, 1))
        rstd = saved["rstd"]
        n = x * rstd
        g = dy * w
        dx_variants = [("漏了第二项（x 还经过 rstd 影响每个通道）：dx = rstd·g", lambda: rstd * g),
                       ("到达 n 的梯度忘了乘 w：g = ȳ 而不是 ȳ ⊙ w", lambda: rstd * (dy - n * (dy * n).mean(-1, keepdim=True))),
                       ("第二项沿 C 求了和而不是求平均", lambda: rstd * (g - n * (g * n).sum(-1, keepdim=True))),
                       ("第二项少乘了 n：rstd·(g − mean(g ⊙ n))", lambda: rstd * (g - (g * n).mean(-1, keepdim=True)))]
        dw_variants = [("dw 对位置取了平均而不是求和", lambda: (dy * n).reshape(-1, C).mean(0)),
                       ("dw 用了 ȳ ⊙ x（没有归一化）", lambda: (dy * x).reshape(-1, C).sum(0))]
        r1 = _tensor(where, "dx", out[0], dx_ref, rtol=1e-10, against="Autograd", variants=dx_variants)
        r2 = _tensor(where, "dw", out[1], dw_ref, rtol=1e-10, against="Autograd", variants=dw_variants,
                     shape_hint="权重被每个位置共享：dw 要对全部位置求和，形状是 (C,)。")
        run.ok(f"{where}：dx rel={r1:.1e}，dw rel={r2:.1e}（≤ 1e-10，对照 Autograd 的 F.rms_norm）")


def _attention_backward_variant(saved, dout, *, scaled=True, rowsum=True, group="sum", p_t=True):
    """A (possibly deliberately wrong) attention backward, to name a learner's mistake."""
    q, k, v, P, s = saved["q"], saved["k"], saved["v"], saved["probs"], saved["scale"]
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)   # (B, H, S, D)
    dv = (P.transpose(-1, -2) if p_t else P) @ dout
    dP = dout @ vr.transpose(-1, -2)
    dS = P * (dP - (dP * P).sum(-1, keepdim=True)) if rowsum else P * dP
    if scaled:
        dS = dS * s
    dq = dS @ kr
    dk = dS.transpose(-1, -2) @ q
    reduce = (lambda t: t.reshape(B, Hkv, G, *t.shape[2:]).sum(2)) if group == "sum" else \
             (lambda t: t.reshape(B, Hkv, G, *t.shape[2:]).mean(2))
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
        _, refs = _autograd_vjp(sdpa, (q, k, v), dout, wrt=(0, 1, 2))
        kinds = [("q̄、k̄ 漏了缩放 s = D^(-1/2)", dict(scaled=False)),
                 ("Softmax 反向漏了第二项 −P ⊙ rowsum(P̄ ⊙ P)", dict(rowsum=False)),
                 ("k̄、v̄ 在共用一组键值的 G 个查询头之间取了平均，应当求和", dict(group="mean")),
                 ("v̄ 用了 P Ō 而不是 Pᵀ Ō", dict(p_t=False))]
        hint = "k̄、v̄ 的形状与 k、v 相同 (B, Hkv, S, D)：共用一组键值的 G 个查询头的梯度要相加。"
        rels = []
        for i, name in enumerate(("dq", "dk", "dv")):
            variants = [(d, lambda kw=kw, i=i: _attention_backward_variant(saved, dout, **kw)[i]) for d, kw in kinds]
            rels.append(_tensor(where, name, out[i], refs[i], rtol=1e-10, against="Autograd（SDPA）", variants=variants,
                                shape_hint=hint if i else ""))
        run.ok(f"{where}：dq/dk/dv rel={max(rels):.1e}（≤ 1e-10，对照 SDPA 的 Autograd）")


@_exercise("task2.cross_entropy_backward", "手写交叉熵对 logits 的反向（含 ignore_index）")
def _task2_cross_entropy(run: _Run) -> None:
    from trainmech import vjp

    gen = torch.Generator().manual_seed(6)
    for c, (N, V, every, reduction) in enumerate(((12, 7, 4, "mean"), (9, 5, 3, "sum"), (6, 11, 0, "mean")), 1):
        logits = _randn(gen, N, V, scale=2.0)
        targets = torch.randint(0, V, (N,), generator=gen)
        if every:
            targets[::every] = -100
        _, saved = vjp.cross_entropy_forward(logits, targets, ignore_index=-100, reduction=reduction)
        dloss = _randn(gen, scale=1.7)   # a scalar upstream gradient, not 1
        where = f"输入 {c}（N={N}, V={V}，{int((targets == -100).sum())} 行被忽略，reduction={reduction!r}）"
        ours = run.call(where, dict(saved), dloss.clone())
        leaf = logits.clone().requires_grad_(True)
        (F.cross_entropy(leaf, targets, ignore_index=-100, reduction=reduction) * dloss).backward()
        probs, valid = saved["probs"], targets != -100
        onehot = F.one_hot(torch.where(valid, targets, 0), V).double()
        scale = dloss / saved["n_valid"] if reduction == "mean" else dloss
        variants = [("除以了全部行数 N，而不是有效行数 n_valid", lambda: torch.where(valid[:, None], probs - onehot, 0) * dloss / N),
                    ("被忽略的行没有置 0", lambda: (probs - onehot) * scale),
                    ("忘了乘上游梯度 grad_out", lambda: torch.where(valid[:, None], probs - onehot, 0) * (scale / dloss)),
                    ("漏了 −onehot 那一项（只剩 softmax）", lambda: torch.where(valid[:, None], probs, 0) * scale)]
        rel = _tensor(where, "dlogits", ours, leaf.grad, rtol=1e-10, against="Autograd（F.cross_entropy）", variants=variants)
        run.ok(f"{where}：dlogits rel={rel:.1e}（≤ 1e-10）")


# ============================================================================= Task3


def _tiny_model(seed: int = 0, **overrides):
    from trainmech import profiles, workload

    return workload.build_model(profiles.for_mode("cpu").model("qwen2-tiny"), seed=seed, **overrides).model


def _uneven_batch(rows: int, seq: int) -> dict[str, torch.Tensor]:
    """Rows of different lengths and supervision starts (Task3 · 1): unequal token counts per micro-batch."""
    from trainmech import workload

    pattern = [(seq, 0), (seq * 3 // 8, seq // 4), (seq * 7 // 8, seq * 5 // 8), (seq // 2, 1)]
    stream, sequences, starts, offset = workload.token_stream("domain"), [], [], 0
    for i in range(rows):
        length, start = pattern[i % len(pattern)]
        sequences.append(list(stream[offset: offset + length]))
        starts.append(start)
        offset += length
    return workload.pad_batch(sequences, supervise_from=starts)


@_exercise("task3.accumulate_window", "累计窗口：按整个窗口的监督 Token 数归一化")
def _task3_window(run: _Run) -> None:
    from trainmech import supervision, workload

    model = _tiny_model()
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    batch = _uneven_batch(4, 32)
    half_empty = {**batch, "labels": batch["labels"].clone()}
    half_empty["labels"][2:] = workload.IGNORE_INDEX   # the second micro-batch supervises nothing

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
        out = model(**full)              # the full batch: one forward, the model's own mean loss
        out.loss.backward()
        g_full, loss_full = grads(), out.loss.detach()
        model.zero_grad(set_to_none=True)
        if ours is None:
            raise _Wrong(f"✗ {where}：调用之后还有参数的 .grad 是 None——每个微批次都要 backward()，梯度累加在 .grad 里")
        N, N_unshifted = sum(tokens), int((full["labels"] != workload.IGNORE_INDEX).sum())

        def micro_mean():
            model.zero_grad(set_to_none=True)
            supervision.accumulate_gradients(model, micro, normalization="micro_mean")
            g = grads()
            model.zero_grad(set_to_none=True)
            return g

        variants = [("micro_mean：每个微批次先各自取平均再除以微批次个数——短微批次的 Token 权重更大", micro_mean),
                    (f"数监督 Token 时没有错位：数了 labels != -100（{N_unshifted} 个），应数 labels[:, 1:] != -100（{N} 个）",
                     lambda: g_full * (N / N_unshifted))]
        try:
            rel = _tensor(where, "窗口梯度（全部参数）", ours, g_full, rtol=1e-6, against="完整批次", variants=variants)
        except _Wrong as w:
            if ours.shape == g_full.shape and torch.isfinite(ours).all() and len(w.lines) > 1:
                worst = int((ours - g_full).abs().argmax())
                i = next(i for i, end in enumerate(torch.tensor(sizes).cumsum(0).tolist()) if worst < end)
                p = list(model.parameters())[i]
                local = tuple(int(j) for j in torch.unravel_index(torch.tensor(worst - sum(sizes[:i])), p.shape))
                w.lines[1] = (f"    偏差最大的元素是参数 {names[i]} 的 {_fmt_index(local)}：你的 {ours[worst].item():.6g}，"
                              f"完整批次的 {g_full[worst].item():.6g}；{int(((ours - g_full).abs() > 1e-6 * g_full.abs().max()).sum())} "
                              f"/ {ours.numel()} 个元素超出容限")
            elif not torch.isfinite(ours).all() and 0 in tokens:
                w.lines.append(f"    这个窗口里有微批次一个监督 Token 也没有（{tokens}）：按微批次求平均会得到 0/0 = NaN；"
                               "按整个窗口的 N 归一化时它只贡献 0")
            raise
        if loss is None:
            raise _Wrong(f"✗ {where}：没有返回窗口损失（应返回各微批次损失之和，一个数）")
        loss_value = torch.as_tensor(loss.detach() if isinstance(loss, torch.Tensor) else loss, dtype=torch.float64).reshape(())
        lrel = _tensor(where, "窗口损失", loss_value, loss_full.double(), rtol=1e-6, against="完整批次的损失")
        run.ok(f"{where}：梯度 rel={rel:.1e}，损失 rel={lrel:.1e}（≤ 1e-6，对照完整批次）")


def _wsd_reference(stepped: list[bool], base_lr: float, wsd: dict) -> tuple[list[float], list[int]]:
    """transformers' WSD scheduler stepped only after effective updates, and the update clock's count."""
    import transformers

    from trainmech.update import UpdateClock

    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    sched = transformers.get_wsd_schedule(
        dummy, num_warmup_steps=wsd["warmup_steps"], num_stable_steps=wsd["stable_steps"], num_decay_steps=wsd["decay_steps"],
        min_lr_ratio=wsd.get("min_lr_ratio", 0.0), warmup_type=wsd.get("warmup_type", "linear"), decay_type=wsd.get("decay_type", "cosine"))
    lrs, logged, clock = [], [], UpdateClock()
    for s in stepped:
        lrs.append(dummy.param_groups[0]["lr"])
        if s:
            dummy.step()
            sched.step()
        clock.tick(s)
        logged.append(clock.effective_updates)
    return lrs, logged


@_exercise("task3.scheduled_lrs", "更新时钟：跳步不推进调度")
def _task3_clock(run: _Run) -> None:
    from trainmech.update import wsd_multiplier

    cases = [(14, (2, 9), dict(warmup_steps=3, stable_steps=5, decay_steps=4, min_lr_ratio=0.1)),
             (10, (0, 1), dict(warmup_steps=2, stable_steps=3, decay_steps=3, min_lr_ratio=0.0, decay_type="linear")),
             (8, (), dict(warmup_steps=2, stable_steps=2, decay_steps=2, min_lr_ratio=0.1)),
             (12, (5, 6, 7, 11), dict(warmup_steps=1, stable_steps=4, decay_steps=5, min_lr_ratio=0.2))]
    base_lr = 1e-3
    for c, (attempts, skips, wsd) in enumerate(cases, 1):
        stepped = [a not in skips for a in range(attempts)]
        where = f"输入 {c}（{attempts} 次尝试，跳过 {list(skips) or '无'}）"
        out = _tuple(where, run.call(where, list(stepped), base_lr, dict(wsd)), ("lrs", "logged"))
        lrs_ref, logged_ref = _wsd_reference(stepped, base_lr, wsd)
        lrs, logged = list(out[0]), list(out[1])
        if len(lrs) != attempts or len(logged) != attempts:
            raise _Wrong(f"✗ {where}：lrs 有 {len(lrs)} 项、logged 有 {len(logged)} 项，应各有 {attempts} 项（每次尝试一项）")
        for a in range(attempts):
            ours, ref = float(lrs[a]), lrs_ref[a]
            if abs(ours - ref) <= 1e-12 * base_lr:
                continue
            k = sum(stepped[:a])
            lines = [f"✗ {where}：第 {a} 次尝试（此前有效更新 {k} 次、跳过 {a - k} 次）的学习率是 {ours:.6e}，"
                     f"更新时钟给出 {ref:.6e}（调度的第 {k} 步，transformers 的 WSD 调度器只在有效更新后 step()）"]
            matches = [j for j in range(attempts + 3) if abs(base_lr * wsd_multiplier(j, **wsd) - ours) <= 1e-12 * base_lr]
            if a in matches and a != k:
                lines.append(f"    你的值是调度的第 {a} 步：调度跟着尝试次数走了——被跳过的更新也推进了它")
            elif k + 1 in matches:
                lines.append(f"    你的值是调度的第 {k + 1} 步：超前一步——这次尝试用的是更新之前的时钟读数 {k}")
            elif matches:
                lines.append(f"    你的值是调度的第 {matches[0]} 步，应为第 {k} 步")
            raise _Wrong(lines, f"第 {a} 次尝试的学习率 {ours:.3e} ≠ {ref:.3e}")
        for a in range(attempts):
            if logged[a] != logged_ref[a]:
                raise _Wrong(f"✗ {where}：第 {a} 次尝试之后日志记的步数是 {logged[a]}，应为有效更新次数 {logged_ref[a]}"
                             + ("（被跳过的尝试不能记成新的一步）" if logged[a] == a + 1 else ""),
                             f"第 {a} 次尝试后的日志步数 {logged[a]} ≠ {logged_ref[a]}")
        run.ok(f"{where}：每次尝试的学习率与只在有效更新后推进的 transformers 调度器逐个相同，日志步数等于有效更新次数")


# ============================================================================= Task4


def _added_saved_per_layer(measured, n_layers: int) -> list[int]:
    """Saved-tensor bytes each layer's forward added (Task4 · 1, `saved_at_end_of`)."""
    def at_end(phase):
        return measured.by_category(max(k for k, p in enumerate(measured.phases) if p == phase))["saved"]

    ends = ["forward.embed"] + [f"forward.layer.{i}" for i in range(n_layers)]
    return [at_end(b) - at_end(a) for a, b in zip(ends, ends[1:])]


@_exercise("task4.layer_saved_bytes", "一个解码层为反向保存的字节数（fp32，CPU）")
def _task4_layer(run: _Run) -> None:
    from trainmech import ledger, profiles, workload

    profile = profiles.for_mode("cpu")
    for c, (model_name, b, s) in enumerate((("qwen2-tiny", 2, 16), ("qwen2-small", 1, 24)), 1):
        cfg = workload.qwen2_config(profile.model(model_name))
        where = f"输入 {c}（{model_name}：hidden={cfg.hidden_size}, heads={cfg.num_attention_heads}, " \
                f"kv_heads={cfg.num_key_value_heads}, intermediate={cfg.intermediate_size}；batch={b}, seq={s}）"
        ours = run.call(where, cfg, b, s)
        point, = ledger.measure_point(model_name, b, s, steps=("first",))
        added = _added_saved_per_layer(point.measured, cfg.num_hidden_layers)
        measured = added[0]
        if not isinstance(ours, (int, float)) or isinstance(ours, bool) or ours != int(ours):
            raise _Wrong(f"✗ {where}：应返回一个整数（字节数），你返回了 {ours!r}")
        ours = int(ours)
        if ours == measured:
            run.ok(f"{where}：{ours:,} 字节，等于实测每层前向新增的保存张量字节（{', '.join(f'{x:,}' for x in added)}）")
            continue
        diff = ours - measured
        lines = [f"✗ {where}：你算出 {ours:,} 字节，实测每层新增 {measured:,} 字节，{'多' if diff > 0 else '少'}了 {abs(diff):,} 字节"
                 f"（每个位置 {abs(diff) / (b * s):g} 字节，即 {abs(diff) / (4 * b * s):g} 个 fp32 元素）"]
        shape = ledger.model_shape(cfg)
        if diff > 0 and diff == 4 * b * shape.num_heads * s * s:
            lines.append("    多出的正好是 s×s 的注意力概率 (B, H, T, T)：CPU 上 SDPA 的 flash 内核不保存它，只保存每行的 logsumexp")
        elif diff > 0 and diff == 4 * b * (shape.num_heads - shape.num_kv_heads) * s * shape.head_dim * 2:
            lines.append("    多出的正好是把 K、V 复制到每个查询头的量：分组查询注意力只保存 kv_heads 个头的 K、V")
        else:
            rows = ledger.layer_saved(shape, b, s, "fp32")
            for size in (1, 2, 3):
                hit = next((combo for combo in combinations(rows, size) if sum(t.nbytes for t in combo) == abs(diff)), None)
                if hit:
                    names = "、".join(f"{t.name} {t.shape}" for t in hit)
                    lines.append(f"    账本清单里{'恰好' if size == 1 else '这几项加起来'}是这么多字节的：{names}"
                                 + ("——是不是漏了？" if diff < 0 else "——是不是算了两遍？"))
                    break
        raise _Wrong(lines, f"每层保存字节 {ours:,} ≠ 实测 {measured:,}（差 {diff:+,}）")


def _phase_label(key) -> str:
    return f"{key[0]} → {key[1]}"


@_exercise("task4.gradient_lifecycle", "梯度这一类状态的字节与生命周期")
def _task4_gradients(run: _Run) -> None:
    from trainmech import measure, workload

    batch = workload.lm_batch("domain", 1, 16)
    for c, tied in enumerate((True, False), 1):
        model = _tiny_model(tie_word_embeddings=tied)
        where = f"输入 {c}（qwen2-tiny，{'输出头与嵌入共享权重' if tied else '输出头有自己的权重'}）"
        ours = run.call(where, model)
        if not isinstance(ours, dict):
            raise _Wrong(f"✗ {where}：应返回 dict {{(创建阶段, 释放阶段): 字节数}}，你返回了 {type(ours).__name__}")
        model.zero_grad(set_to_none=True)
        step = measure.training_step_memory(model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch)
        measured = {(born, died): n for (cat, born, died), n in step.lifecycles().items() if cat == "gradients"}
        try:
            ours = {(str(k[0]), str(k[1])): int(v) for k, v in ours.items()}
        except Exception:  # noqa: BLE001
            raise _Wrong(f"✗ {where}：字典的键应是 (创建阶段, 释放阶段) 两个字符串，值是整数字节数") from None
        if ours == measured:
            run.ok(f"{where}：{len(measured)} 组生命周期、共 {sum(measured.values()):,} 字节，与实测逐字节一致")
            continue
        lines = [f"✗ {where}：与实测（trainmech.measure 追踪的 .grad 存储）不一致："]
        for key in sorted(ours.keys() | measured.keys()):
            a, m = ours.get(key, 0), measured.get(key, 0)
            if a != m:
                lines.append(f"    {_phase_label(key):<32} 你的 {a:>9,} 字节，实测 {m:>9,} 字节（差 {a - m:+,}）")
        released = {k[1] for k in ours}
        if "optimizer" in released:
            lines.append("    提示：更新读完梯度（最后消费）并不释放它；要等 zero_grad(set_to_none=True) 才释放，释放阶段是 zero_grad")
        head = model.lm_head.weight.numel() * 4
        if tied and ours.get(("backward.head", "zero_grad"), 0) - measured.get(("backward.head", "zero_grad"), 0) == head:
            lines.append("    提示：共享权重时，输出头那份梯度先在自动求导引擎里等着，到 backward.embed 与查表那份相加后才写进 .grad")
        if tied and sum(ours.values()) - sum(measured.values()) == head:
            lines.append("    提示：共享的权重只有一个 .grad，只算一次")
        raise _Wrong(lines, "梯度的生命周期与实测不一致")


# ============================================================================= Task5


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors_in(obj, depth: int = 0) -> list[torch.Tensor]:
    """Tensors reachable from a packed value (tuples, lists, dicts, plain objects; a few levels)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 3:
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        obj = list(vars(obj).values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors_in(item, depth + 1)]
    return []


def _offload_model():
    from trainmech import workload

    return _tiny_model(), workload.lm_batch("domain", 2, 16)


@_exercise("task5.offload_hooks", "一对把保存张量搬走的 saved-tensor 钩子")
def _task5_offload(run: _Run) -> None:
    from trainmech import strategies

    model, batch = _offload_model()
    where = "qwen2-tiny，2 × 16 Token，一次前向 + 反向"
    hooks = _tuple(where, run.call(where, model.parameters()), ("pack", "unpack"))
    pack, unpack = hooks
    params = {_storage_ptr(p) for p in model.parameters()}

    def forward_backward(pack_hook, unpack_hook):
        model.zero_grad(set_to_none=True)
        alive = []
        def watch(t):  # noqa: E306
            if _storage_ptr(t) not in params:
                alive.append(weakref.ref(t.untyped_storage()))
            return pack_hook(t)
        with torch.autograd.graph.saved_tensors_hooks(watch, unpack_hook):
            loss = model(**batch, use_cache=False).loss
        still = sum(r() is not None for r in alive)   # device storages the packed values keep alive
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, still

    base_loss, base_grads, _ = forward_backward(lambda t: t, lambda t: t)
    framework = strategies.ActivationOffload("cpu", keep=model.parameters(), min_bytes=0)
    *_, framework_alive = forward_backward(framework.pack_hook, framework.unpack_hook)
    framework.finish()

    stats = {"packed": 0, "params_kept": 0, "params_copied": 0, "moved": 0, "moved_bytes": 0, "not_moved": 0,
             "unpacked": 0, "differ": []}

    def pack_watch(t):
        stats["packed"] += 1
        packed = pack(t)
        aliased = any(_storage_ptr(x) == _storage_ptr(t) for x in _tensors_in(packed))
        if _storage_ptr(t) in params:
            stats["params_kept" if aliased else "params_copied"] += 1
        elif aliased:
            stats["not_moved"] += 1
        else:
            stats["moved"] += 1
            stats["moved_bytes"] += t.numel() * t.element_size()
        return (t.detach().clone(), t.stride()), packed   # a private copy to compare the unpacked tensor with

    def unpack_watch(value):
        (ref, stride), packed = value
        t = unpack(packed)
        stats["unpacked"] += 1
        if not isinstance(t, torch.Tensor):
            stats["differ"].append(f"返回了 {type(t).__name__}")
        elif t.dtype != ref.dtype or t.shape != ref.shape:
            stats["differ"].append(f"{tuple(ref.shape)} {str(ref.dtype).removeprefix('torch.')} 取回成了 "
                                   f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        elif not torch.equal(t, ref):
            stats["differ"].append(f"{tuple(ref.shape)} 的数值变了（max|Δ|={(t.double() - ref.double()).abs().max().item():.1e}）")
        return t

    try:
        loss, grads, alive = forward_backward(pack_watch, unpack_watch)
    except _Wrong:
        raise
    except Exception as e:  # noqa: BLE001
        raise _Wrong(f"✗ {where}：带着你的钩子做前向 + 反向时出错：{type(e).__name__}：{_first_line(e)}") from None
    lines = []
    if stats["params_copied"]:
        lines.append(f"✗ {stats['params_copied']} 个参数也被复制走了：参数本来就常驻设备，搬走它只会多传一遍——"
                     "用 keep 里各参数的存储地址（t.untyped_storage().data_ptr()）判断，原样返回 t.detach()")
    if stats["not_moved"]:
        lines.append(f"✗ {stats['not_moved']} / {stats['not_moved'] + stats['moved']} 个非参数的保存张量没有被搬走："
                     "pack 返回的东西仍然引用原来的存储")
        lines.append("    在 CPU 上 t.to('cpu') 直接返回 t 本身、不复制；用 t.detach().clone() 或 t.to('cpu', copy=True) 复制一份")
    elif alive > framework_alive:
        lines.append(f"✗ 前向结束时仍有 {alive} 块被保存的存储活着（trainmech 的 ActivationOffload 只剩 {framework_alive} 块）："
                     "pack 在别处（例如闭包里的字典）留住了原张量，设备上的内存没有被释放")
    if stats["differ"]:
        lines.append(f"✗ {len(stats['differ'])} / {stats['unpacked']} 个取回的张量与打包时不同，第一个：{stats['differ'][0]}")
    if not torch.equal(loss, base_loss):
        lines.append(f"✗ 损失与不加钩子的基线不同：{loss.item():.6f} vs {base_loss.item():.6f}")
    wrong = [n for n in base_grads if not torch.equal(grads[n], base_grads[n])]
    if wrong:
        lines.append(f"✗ {len(wrong)} / {len(base_grads)} 个参数的梯度与基线不逐位相等，例如 {wrong[0]}"
                     f"（相对误差 {_rel(grads[wrong[0]], base_grads[wrong[0]]):.1e}）")
    if lines:
        raise _Wrong(lines, lines[0].lstrip("✗ ").split("：")[0])
    run.ok(f"{where}：打包 {stats['packed']} 个保存张量——参数 {stats['params_kept']} 个原样留下，"
           f"其余 {stats['moved']} 个复制走（{stats['moved_bytes']:,} 字节），前向结束时设备上只剩 {alive} 块（与 ActivationOffload 相同）")
    run.ok(f"{where}：{stats['unpacked']} 个取回的张量逐位等于打包时的张量；损失与 {len(grads)} 个参数梯度与基线逐位相等")


@_exercise("task5.checkpoint", "手写激活检查点：前向只留输入，反向重算")
def _task5_checkpoint(run: _Run) -> None:
    model = _tiny_model()
    layer = model.model.layers[0]
    x0 = torch.randn(2, 16, model.config.hidden_size)
    params = {f"{m}.{n}": p for m in ("post_attention_layernorm", "mlp") for n, p in getattr(layer, m).named_parameters()}
    param_ptrs = {_storage_ptr(p) for p in params.values()}
    calls = [0]

    def block(h):
        """A residual MLP block of qwen2-tiny's layer 0: h + mlp(norm(h))."""
        calls[0] += 1
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def run_once(fn):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        saved = {}
        def pack(t):  # noqa: E306
            if _storage_ptr(t) not in param_ptrs:
                saved[_storage_ptr(t)] = t.untyped_storage().nbytes()
            return t
        calls[0] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x)
        forward_calls = calls[0]
        return x, out, sum(saved.values()), forward_calls

    x_ref, out_ref, base_bytes, _ = run_once(block)
    out_ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in params.items()}
    ref_dx = x_ref.grad.clone()

    where = "qwen2-tiny 第 0 层的 h + mlp(norm(h))，h 为 (2, 16, 64)"
    x, out, ours_bytes, forward_calls = run_once(lambda h: run.call(where, block, h))
    input_bytes = x0.untyped_storage().nbytes()
    if not isinstance(out, torch.Tensor):
        raise _Wrong(f"✗ {where}：应返回 fn(x) 的输出张量，你返回了 {type(out).__name__}")
    if not torch.equal(out.detach(), out_ref.detach()):
        _tensor(where, "输出", out, out_ref, rtol=0.0, against="不加检查点的 fn(x)")
    if not out.requires_grad:
        raise _Wrong(f"✗ {where}：输出不需要梯度（requires_grad=False）：它没有接进计算图，反向到不了 x 和参数")
    if ours_bytes > input_bytes:
        raise _Wrong([f"✗ {where}：前向留下了 {ours_bytes:,} 字节的保存张量（不计参数），不加检查点是 {base_bytes:,} 字节；"
                      f"检查点只应留下输入 x 的 {input_bytes:,} 字节",
                      "    在 torch.autograd.Function 的 forward 里调用 fn（那里不记录计算图），只 ctx.save_for_backward(x)"],
                     f"前向保存了 {ours_bytes:,} 字节，应只有 {input_bytes:,}")
    calls[0] = 0
    try:
        out.sum().backward()
    except Exception as e:  # noqa: BLE001
        lines = [f"✗ {where}：反向时出错：{type(e).__name__}：{_first_line(e)}"]
        if "does not require grad" in str(e) or "does not have a grad_fn" in str(e):
            lines.append("    重算要在 torch.enable_grad() 里进行（Function.backward 默认不记录计算图），"
                         "并对 x.detach().requires_grad_() 调用 fn")
        raise _Wrong(lines, f"反向出错：{type(e).__name__}") from None
    if calls[0] != 1:
        raise _Wrong(f"✗ {where}：反向里 fn 被调用了 {calls[0]} 次，应重算恰好 1 次", f"反向调用 fn {calls[0]} 次")
    if x.grad is None:
        raise _Wrong(f"✗ {where}：反向之后 x.grad 是 None：backward 要返回对 x 的梯度（对 fn 参数的位置返回 None）")
    _tensor(where, "x.grad", x.grad, ref_dx, rtol=0.0, against="不加检查点的反向")
    missing = [n for n, p in params.items() if n in ref_grads and p.grad is None]
    if missing:
        raise _Wrong([f"✗ {where}：{len(missing)} 个参数没有得到梯度，例如 {missing[0]}",
                      "    重算出的输出要对全部需要梯度的张量反向：torch.autograd.backward(out, grad_out) 会把参数的梯度"
                      "累加进它们的 .grad（torch.autograd.grad(out, x, …) 只给 x）"], f"{len(missing)} 个参数没有梯度")
    for n, g in ref_grads.items():
        _tensor(where, f"{n}.grad", params[n].grad, g, rtol=0.0, against="不加检查点的反向")
    run.ok(f"{where}：输出逐位相同；前向只保存 {ours_bytes:,} 字节（输入本身；不加检查点是 {base_bytes:,} 字节）；"
           f"fn 前向调用 {forward_calls} 次、反向重算 1 次")
    run.ok(f"{where}：x.grad 与 {len(ref_grads)} 个参数的梯度都与不加检查点的反向逐位相等")


# ============================================================================= Task6


_GATE_TRACES: dict[str, object] = {}


def _gate_traces():
    """Reference and candidate traces on a small gate workload (qwen2-tiny), computed once per process."""
    if _GATE_TRACES:
        return _GATE_TRACES
    from trainmech import amp, gates

    # check() forks the RNG around this: building the model and running traces re-seed it
    model = _tiny_model()
    gw = gates.gate_workload(model, rows=4, seq=16, micro_batches=2, attempts=5, inject_at=(2,), lr=3e-3,
                             warmup_updates=1, decay_updates=1, seed=0)

    def mean_per_micro_batch(state, window):
        total = 0.0
        for mb in window:
            loss = state.model(**mb, use_cache=False).loss / len(window)   # the bug: this micro-batch's mean, / n
            state.scaler.scale(loss).backward()
            total += loss.item()
        return total

    def scheduler_on_every_attempt(state):
        amp.scaled_step(state.scaler, state.optimizer)
        state.scheduler.step()   # the bug: moved whether or not the optimizer stepped

    def step_without_guard(state):
        state.optimizer.step()   # the bug: no finiteness check
        state.scheduler.step()

    candidates = {
        "reference": gates.Candidate("fp32-baseline", "TRAIN-AMP-BACKWARD"),
        "fp16": gates.candidate("fp16", "TRAIN-AMP-BACKWARD", dtype="float16"),
        "micro_mean": gates.Candidate("mean-per-micro-batch", "TRAIN-AMP-BACKWARD", backward=mean_per_micro_batch),
        "scheduler_every_attempt": gates.candidate("fp16-scheduler-every-attempt", "TRAIN-AMP-BACKWARD", dtype="float16",
                                                   update=scheduler_on_every_attempt),
        "step_without_guard": gates.candidate("fp32-step-without-guard", "TRAIN-AMP-BACKWARD", update=step_without_guard),
    }
    for key, cand in candidates.items():
        _GATE_TRACES[key] = gates.run_trace(cand, gw)
    _GATE_TRACES["expected_lrs"] = [gw.expected_lr(k) for k in range(len(_GATE_TRACES["reference"].stepped))]
    return _GATE_TRACES


def _synthetic_grads():
    gen = torch.Generator().manual_seed(7)
    ref = {"big": torch.randn(4, 5, generator=gen), "small": 1e-7 * torch.randn(6, generator=gen), "mid": 0.1 * torch.randn(3, 3, generator=gen)}
    noise = {n: 1e-8 * torch.randn(g.shape, generator=gen) for n, g in ref.items()}
    return ref, noise


@_exercise("task6.gradient_gate", "梯度门：逐参数的相对误差与容限")
def _task6_gradient_gate(run: _Run) -> None:
    from trainmech import gates

    ref, noise = _synthetic_grads()
    nan = {n: g.clone() for n, g in ref.items()}
    nan["mid"][1, 1] = float("nan")
    synthetic = [
        ("合成 1：每个参数都只差约 1e-8 的噪声（“small” 的梯度约 1e-7，低于全局尺度的千分之一）", ref,
         {n: g + noise[n] for n, g in ref.items()}, 1e-4, True),
        ("合成 2：“mid” 整体放大 1.01 倍", ref, {n: g * (1.01 if n == "mid" else 1.0) for n, g in ref.items()}, 1e-4, False),
        ("合成 3：候选缺了参数 “small” 的梯度", ref, {n: g for n, g in ref.items() if n != "small"}, 1e-4, False),
        ("合成 4：候选的 “mid” 含一个 NaN", ref, nan, 1e-4, False),
    ]

    def judge(where, r, cnd, rtol, want):
        out = _tuple(where, run.call(where, {n: g.clone() for n, g in r.items()}, {n: g.clone() for n, g in cnd.items()}, rtol),
                     ("passed", "errors"))
        passed, errors = out
        expected = gates.gradient_errors(r, cnd)
        if not isinstance(errors, dict) or set(errors) != set(expected):
            raise _Wrong(f"✗ {where}：errors 应是每个参考参数一项的字典（{sorted(expected)}），你返回了 "
                         f"{sorted(errors) if isinstance(errors, dict) else type(errors).__name__}")
        for n, e in expected.items():
            got = float(errors[n])
            same = (math.isnan(e) and math.isnan(got)) or (math.isinf(e) and got == e) or abs(got - e) <= 1e-6 * max(abs(e), 1e-30)
            if not same:
                scale_own = (cnd[n].double() - r[n].double()).abs().max().item() / r[n].double().abs().max().item() if n in cnd else None
                top = max(float(g.abs().max()) for g in r.values())
                lines = [f"✗ {where}：参数 {n} 的误差 e_p 是 {got:.3e}，门槛公式给出 {e:.3e}"]
                if n not in cnd:
                    lines.append("    候选缺了这个参数的梯度：它的误差应当是 inf，门必须不通过")
                elif scale_own is not None and abs(got - scale_own) <= 1e-6 * max(scale_own, 1e-30):
                    lines.append(f"    你除以了这个参数自己的最大梯度，没有下限：它的梯度尺度只有全局最大值的 "
                                 f"{float(r[n].abs().max()) / top:.0e}，要改用 1e-3 × 全局最大梯度，免得两份舍入噪声相除")
                elif n in cnd and abs(got - (cnd[n].double() - r[n].double()).abs().max().item()) <= 1e-6 * max(abs(got), 1e-30):
                    lines.append("    你用的是绝对误差 max|Δ|，没有除以梯度尺度")
                raise _Wrong(lines, f"{n} 的 e_p {got:.2e} ≠ {e:.2e}")
        if bool(passed) is not want:
            bad = [n for n, e in expected.items() if not e <= rtol]
            raise _Wrong(f"✗ {where}：你的门{'放行了' if passed else '拦下了'}它，应当{'通过' if want else '不通过'}"
                         + (f"（超出容限 {rtol:.0e} 的参数：{bad}；NaN 与 inf 都算超出）" if bad else f"（所有参数都在容限 {rtol:.0e} 内）"),
                         f"结论应为{'通过' if want else '不通过'}")
        run.ok(f"{where}：{'通过' if want else '不通过'}，e_p 与 gates.gradient_errors 一致")

    for where, r, cnd, rtol, want in synthetic:
        judge(where, r, cnd, rtol, want)
    traces = _gate_traces()
    ref_trace = traces["reference"]
    judge("真实运行：正确的 FP16 候选（容限 2e-2）", ref_trace.grads, traces["fp16"].grads, gates.GRAD_RTOL["float16"], True)
    judge("真实运行：埋入错误“按微批次取平均的损失”（容限 1e-4）", ref_trace.grads, traces["micro_mean"].grads, gates.GRAD_RTOL["float32"], False)


def _trace(**fields):
    from trainmech import gates

    return gates.Trace("synthetic", **fields)


@_exercise("task6.update_gate", "更新门：有效更新、有限值、优化器与调度器跟随更新时钟")
def _task6_update_gate(run: _Run) -> None:
    lrs = [1e-3 * m for m in (0.1, 1.0, 1.0, 0.55, 0.1)]   # the clock's lr of effective updates 0..4
    skip = [True, True, False, True, True, True]             # attempt 2 skipped: 5 effective updates
    ref = _trace(stepped=skip, finite=[True] * 6, lrs=lrs, optimizer_steps=5, scheduler_steps=5)
    synthetic = [
        ("合成 1：与参照完全相同的正确候选", ref, True),
        ("合成 2：跳步也推进调度器（调度器 6 次，第 2 次跳步后学习率超前一步）",
         _trace(stepped=skip, finite=[True] * 6, lrs=lrs[:2] + lrs[3:] + [1e-4], optimizer_steps=5, scheduler_steps=6), False),
        ("合成 3：没有有限性保护，NaN 写进了参数",
         _trace(stepped=[True] * 6, finite=[True, True] + [False] * 4, lrs=lrs + [1e-4], optimizer_steps=6, scheduler_steps=6), False),
        ("合成 4：少做了一次有效更新（第 4 次尝试没有 step）",
         _trace(stepped=[True, True, False, True, False, True], finite=[True] * 6, lrs=lrs[:4], optimizer_steps=4, scheduler_steps=4), False),
        ("合成 5：优化器自己的计数与有效更新不符（state[\"step\"] 多算一次）",
         _trace(stepped=skip, finite=[True] * 6, lrs=lrs, optimizer_steps=6, scheduler_steps=5), False),
        ("合成 6：次数都对，但第 3 次有效更新的学习率不是时钟给的",
         _trace(stepped=skip, finite=[True] * 6, lrs=lrs[:3] + [2e-3, lrs[4]], optimizer_steps=5, scheduler_steps=5), False),
        ("合成 7：候选在第 1 次尝试抛出异常，运行中断",
         _trace(stepped=[True], finite=[True], lrs=lrs[:1], optimizer_steps=1, scheduler_steps=1,
                error="attempt 1, backward: RuntimeError: boom"), False),
    ]

    def judge(where, r, cand, expected_lrs, want):
        out = _tuple(where, run.call(where, r, cand, list(expected_lrs)), ("passed", "message"))
        passed, message = out
        if not isinstance(message, str) or not message.strip():
            raise _Wrong(f"✗ {where}：message 应是一句说明（拦下时说出证据），你返回了 {message!r}")
        if bool(passed) is not want:
            raise _Wrong(f"✗ {where}：你的门{'放行了' if passed else '拦下了'}它（“{message.strip()[:80]}”），应当"
                         f"{'不通过：这个埋入的错误漏过去了' if not want else '通过：这是误报'}",
                         f"{where.split('：', 1)[-1]}：应{'通过' if want else '不通过'}")
        run.ok(f"{where}：{'通过' if want else '拦下'}（“{message.strip()[:60]}”）")

    for where, cand, want in synthetic:
        judge(where, ref, cand, lrs, want)
    traces = _gate_traces()
    real = [("真实运行：参照自己", "reference", True), ("真实运行：正确的 FP16 候选", "fp16", True),
            ("真实运行：埋入错误“跳步也推进调度器”", "scheduler_every_attempt", False),
            ("真实运行：埋入错误“没有有限性保护的更新”", "step_without_guard", False)]
    for where, key, want in real:
        judge(where, traces["reference"], traces[key], traces["expected_lrs"], want)
