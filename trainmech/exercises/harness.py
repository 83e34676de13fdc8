"""The machinery of the exercise checks: the registry, one learner call, the comparisons.

`@_exercise(id, title)` registers a check into `EXERCISES` when its Task module (task0 … task6) is
imported; `check(id, fn)` runs it. `_Run.call` calls the learner's function and turns whatever goes
wrong (a stub, an exception, an input modified in place) into a diagnosis; `_tensor` and `_tuple`
compare what it returned (the autograd reference is `trainmech.vjp_check.reference_vjp`). See the package's docstring for what a learner sees.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainmech.checks import ClaimFailed, rel_error
from trainmech.display import describe_frame, user_frame
from trainmech.errors import TrainmechError

__all__ = [
    "check",
    "EXERCISES",
    "PASSED",
    "Exercise",
    "_exercise",
    "_Run",
    "_Wrong",
    "_randn",
    "_rel",
    "_fmt_index",
    "_first_line",
    "_tensor",
    "_tuple",
    "_tiny_model",
]


class _Passed:
    """What a passing check returns: truthy, and invisible as a cell's last expression."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "PASSED"

    def _ipython_display_(self) -> None:  # IPython shows nothing: no stray `Out[n]: True`
        pass


PASSED = _Passed()


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
        given = _given_tensors(self.learner, args, kwargs)
        before = {name: t.detach().clone() for name, t in given.items()}
        try:
            out = self.learner(*args, **kwargs)
        except NotImplementedError as e:
            if self.answered == 0:
                raise _NotAttempted() from None
            raise _Wrong(
                [
                    f"✗ {where}：你的函数抛出了 NotImplementedError（{_first_line(e)}）——还有分支没写完？",
                    *_raising_line(e),
                ]
            ) from None
        except Exception as e:  # noqa: BLE001 — the learner's own error is the diagnosis
            raise _Wrong(
                [f"✗ {where}：你的函数抛出了 {type(e).__name__}：{_first_line(e)}", *_raising_line(e)]
            ) from None
        changed = [name for name, t in given.items() if not _same(t, before[name])]
        if changed:
            names = "、".join(f"`{n}`" for n in changed)
            raise _Wrong(
                [
                    f"✗ {where}：你的函数原地修改了传入的 {names}（调用后它的值变了）",
                    "    函数应当返回新张量、不改动传进来的张量：把 `x -= …`、`x.add_(…)`、`x[i] = …` 这类原地运算"
                    "换成产生新张量的写法（`x = x - …`），或先 `x = x.clone()`。",
                ],
                f"原地修改了输入 {names}",
            )
        self.answered += 1
        return out

    @staticmethod
    def ok(line: str) -> None:
        print(f"  ✓ {line}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else "（没有说明）"


def _raising_line(e: BaseException) -> list[str]:
    """The line of the learner's own code where `e` was raised, as one printed line (or none)."""
    frame = user_frame(e.__traceback__.tb_next)  # tb_next: skip _Run.call's own frame
    return [f"    出错的是你代码里的这一行（{describe_frame(frame)}）"] if frame is not None else []


def _given_tensors(fn: Callable, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """The tensors handed to fn, by the name fn knows them under: top-level ones and those in a
    dict argument (`saved["x"]`). Nested structures and models are not followed."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):  # a signature that does not fit is diagnosed by the call itself
        bound = {f"#{i + 1}": a for i, a in enumerate(args)} | kwargs
    found = {}
    for name, value in bound.items():
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif isinstance(value, dict):
            found |= {f"{name}[{k!r}]": v for k, v in value.items() if isinstance(v, torch.Tensor)}
    return found


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and values, NaN where NaN was: what "not modified" means for an input."""
    a, b = a.detach(), b.detach()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(
            torch.where(a.isnan(), 0, a), torch.where(b.isnan(), 0, b)
        )
    return torch.equal(a, b)


def check(exercise_id: str, learner: Callable) -> _Passed | None:
    """Check the learner's answer to one exercise. PASSED (truthy): correct; None: not attempted
    yet; a wrong answer prints the diagnosis and raises ClaimFailed."""
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
    return PASSED


# ----------------------------------------------------------------------------- comparisons


def _randn(gen: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(shape, generator=gen, dtype=torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """checks.rel_error's relative error, or inf for a shape mismatch (a diagnosis, not a raise)."""
    return math.inf if a.shape != b.shape else rel_error(a, b)[1]


def _fmt_index(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, index)) + ")" if index else "()"


def _tensor(
    where: str,
    name: str,
    ours,
    ref: torch.Tensor,
    *,
    rtol: float,
    against: str,
    variants: list[tuple[str, Callable[[], torch.Tensor]]] = (),
    shape_hint: str = "",
) -> float:
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
        raise _Wrong(
            f"✗ {where}：{name} 含有 {int(bad.sum())} 个非有限值（inf 或 NaN）", f"{name} 含有非有限值"
        )
    rel = _rel(a, b)
    if rel <= rtol:
        return rel
    diff = (a - b).abs()
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
    scale = max(b.abs().max().item(), torch.finfo(torch.float64).tiny)
    lines = [
        f"✗ {where}：{name}{sep}不对：max|Δ|={diff.max().item():.2e}，相对误差 {rel:.2e}，超过容限 {rtol:.0e}",
        f"    偏差最大的元素在索引 {_fmt_index(idx)}：你的 {a[idx].item():.6g}，{against}{of}的 {b[idx].item():.6g}；"
        f"{int((diff > rtol * scale).sum())} / {a.numel()} 个元素超出容限",
    ]
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


def _tiny_model(seed: int = 0, **overrides):
    from trainmech import profiles, workload

    return workload.build_model(profiles.for_mode("cpu").model("qwen2-tiny"), seed=seed, **overrides).model
