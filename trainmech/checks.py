"""Checks that print one line when a claim holds and raise when it does not, and the output policy.

Every claim a notebook asks a learner to believe is followed by one of these.

The output policy: what a notebook prints must read the same on every machine (other SIMD
widths, BLAS libraries, ARM), so that nbval can compare it there, and must still change when a
result really changes.

1. What is exact by construction is printed exactly: integers, shapes, byte counts, dtypes,
   booleans, verdicts and their tolerances.
2. A quantity at the noise floor (an error against a reference, a difference that should be
   zero) is printed as a verdict against its tolerance, `rel ≤ 1e-06 ✓`; the function returns the
   raw value so that the record keeps it.
3. A physical float (a loss, a norm, a ratio) is printed with `num(x)`: only the significant
   digits that survive every numeric path (three unless a caller measured otherwise).

Every check also goes to the run's check log (`log_checks_to`): the statement, the value and the
limit it was compared with. `python -m trainmech portability` compares those logs across numeric
paths to measure each claim's margin against the spread of its value. The log's path is module
state: `log_checks_to` (which `session.start` calls) sets it for every later check in the process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from trainmech.display import ShortTraceback

__all__ = [
    "ClaimFailed",
    "log_checks_to",
    "num",
    "dtype_name",
    "claim",
    "claim_at_most",
    "claim_at_least",
    "rel_error",
    "close",
    "equal",
    "raises",
]

_log_path: Path | None = None
_logged = 0


class ClaimFailed(ShortTraceback, AssertionError):
    """A mechanism claim did not hold on this run.

    In a notebook it shows as one line, `ClaimFailed: 结论不成立：…`, and the notebook line that made
    the claim — not the frames inside this module (trainmech.display.ShortTraceback).
    """


def log_checks_to(path: str | Path | None) -> None:
    """Write every later check to path (JSON lines), replacing an earlier log; None stops logging.

    Nothing is created until the first check: a session that checks nothing leaves no folder behind.
    """
    global _log_path, _logged
    _log_path, _logged = (Path(path) if path is not None else None), 0
    if _log_path is not None:
        _log_path.unlink(missing_ok=True)


def _log(
    kind: str, statement: str, holds: bool, value: float | None = None, limit: float | None = None
) -> None:
    global _logged
    if _log_path is None:
        return
    entry = {
        "n": _logged,
        "kind": kind,
        "statement": statement,
        "holds": holds,
        "value": _finite_or_text(value),
        "limit": _finite_or_text(limit),
    }
    if _logged == 0:
        _log_path.parent.mkdir(parents=True, exist_ok=True)
    with _log_path.open("a" if _logged else "w", encoding="utf-8") as f:
        f.write(json.dumps(entry, ensure_ascii=False) + "\n")
    _logged += 1


def _finite_or_text(x: float | None) -> float | str | None:
    if x is None:
        return None
    x = _scalar(x)
    return x if math.isfinite(x) else str(x)  # JSON has no NaN / Infinity


def _scalar(x) -> float:
    """A Python float from a number or a one-element tensor (detached: no autograd warning)."""
    return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)


def num(x: float, digits: int = 3) -> str:
    """x with `digits` significant digits, trailing zeros kept: 6.2401 → '6.24', 0.5 → '0.500'."""
    x = _scalar(x)
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    text = f"{x:#.{digits}g}"
    return text[:-1] if text.endswith(".") else text


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as printed on a page: torch.bfloat16 → 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def claim(condition: bool, statement: str) -> None:
    """Raise ClaimFailed(statement) unless condition holds; print `✓ statement` when it does.

    For a fact that is exact by construction (a count, an identity, a boolean). A comparison of a
    float with a threshold goes through claim_at_most / claim_at_least, so its margin is logged.
    """
    holds = bool(condition)
    _log("claim", statement, holds)
    if not holds:
        raise ClaimFailed(f"结论不成立：{statement}")
    print(f"✓ {statement}")


def claim_at_most(value: float, limit: float, statement: str) -> None:
    """Claim value ≤ limit (NaN never holds); prints `✓ statement`. Numbers or one-element tensors."""
    value, limit = _scalar(value), _scalar(limit)
    holds = value <= limit
    _log("at_most", statement, holds, value, limit)
    if not holds:
        raise ClaimFailed(f"结论不成立：{statement} ({value:.3g} > {limit:.3g})")
    print(f"✓ {statement}")


def claim_at_least(value: float, limit: float, statement: str) -> None:
    """Claim value ≥ limit (NaN never holds); prints `✓ statement`. Numbers or one-element tensors."""
    value, limit = _scalar(value), _scalar(limit)
    holds = value >= limit
    _log("at_least", statement, holds, value, limit)
    if not holds:
        raise ClaimFailed(f"结论不成立：{statement} ({value:.3g} < {limit:.3g})")
    print(f"✓ {statement}")


def rel_error(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max |ours - reference|, that divided by max |reference|), computed in float64."""
    a, b = ours.detach().double(), reference.detach().double()
    if a.shape != b.shape:
        raise ClaimFailed(f"形状不同：{tuple(a.shape)} 对 {tuple(b.shape)}")
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return diff, diff / max(scale, torch.finfo(torch.float64).tiny)


def close(name: str, ours: torch.Tensor, reference: torch.Tensor, *, rtol: float) -> float:
    """Compare one tensor with its reference; print the verdict `name  rel ≤ rtol ✓`; raise beyond rtol.

    rtol is relative to the reference's largest magnitude. The error itself sits at the noise
    floor, so it is not printed (output policy, rule 2): it is returned (the max absolute error)
    and logged.
    """
    diff, rel = rel_error(ours, reference)
    ok = rel <= rtol  # False for NaN too: a non-finite value never passes
    _log("close", name, ok, rel, rtol)
    if not ok:
        print(f"{name:<28} rel = {rel:.1e} > {rtol:.0e} ✗")
        raise ClaimFailed(f"{name}：相对误差 {rel:.2e} 超过容限 {rtol:.0e}")
    print(f"{name:<28} rel ≤ {rtol:.0e} ✓")
    return diff


def equal(name: str, ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Bitwise equality (same shape, dtype and every bit); prints one line, raises otherwise."""
    same = ours.dtype == reference.dtype and ours.shape == reference.shape and torch.equal(ours, reference)
    _log("equal", name, same)
    if not same:
        n = int((ours != reference).sum()) if ours.shape == reference.shape else -1
        raise ClaimFailed(f"{name}：不是逐位相等（{n} 个元素不同）")
    print(f"{name:<28} bitwise equal ({ours.numel()} element(s))")


def raises(fn, fragment: str, exc: type[BaseException] = RuntimeError) -> None:
    """Run fn; it must raise `exc` whose message contains `fragment`.

    Prints only the fragment (a framework's full message can change between versions).
    """
    try:
        fn()
    except exc as e:
        claim(fragment in str(e), f"抛出 {exc.__name__}，报错里有 {fragment!r}")
        return
    _log("raises", f"expected {exc.__name__}: {fragment}", False)
    raise ClaimFailed(f"结论不成立：应当抛出 {exc.__name__}（报错里有 {fragment!r}），却什么也没有抛出")
