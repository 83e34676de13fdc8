"""Checks that print one line when a claim holds and raise when it does not.

Every claim a notebook asks a learner to believe is followed by one of these. They print
numbers in a fixed short format so that notebook outputs stay identical run after run.
"""

from __future__ import annotations

import torch


class ClaimFailed(AssertionError):
    """A mechanism claim did not hold on this run."""


def claim(condition: bool, statement: str) -> None:
    """Raise ClaimFailed(statement) unless condition holds; print `✓ statement` when it does."""
    if not bool(condition):
        raise ClaimFailed(f"claim does not hold: {statement}")
    print(f"✓ {statement}")


def rel_error(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max |ours - reference|, that divided by max |reference|), computed in float64."""
    a, b = ours.detach().double(), reference.detach().double()
    if a.shape != b.shape:
        raise ClaimFailed(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return diff, diff / max(scale, torch.finfo(torch.float64).tiny)


def close(name: str, ours: torch.Tensor, reference: torch.Tensor, *, rtol: float) -> float:
    """Compare one tensor with its reference; print `name  max|Δ|=…  rel=…  ok`; raise beyond rtol.

    rtol is relative to the reference's largest magnitude. Returns the max absolute error.
    """
    diff, rel = rel_error(ours, reference)
    ok = rel <= rtol  # False for NaN too: a non-finite value never passes
    print(f"{name:<28} max|Δ|={diff:.1e}  rel={rel:.1e}  (≤ {rtol:.0e}) {'ok' if ok else 'MISMATCH'}")
    if not ok:
        raise ClaimFailed(f"{name}: relative error {rel:.2e} exceeds {rtol:.0e}")
    return diff


def equal(name: str, ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Bitwise equality (same shape, dtype and every bit); prints one line, raises otherwise."""
    same = ours.dtype == reference.dtype and ours.shape == reference.shape and torch.equal(ours, reference)
    if not same:
        n = int((ours != reference).sum()) if ours.shape == reference.shape else -1
        raise ClaimFailed(f"{name}: not bitwise equal ({n} element(s) differ)")
    print(f"{name:<28} bitwise equal ({ours.numel()} element(s))")


def raises(fn, fragment: str, exc: type[BaseException] = RuntimeError) -> None:
    """Run fn; it must raise `exc` whose message contains `fragment`.

    Prints only the fragment (a framework's full message can change between versions).
    """
    try:
        fn()
    except exc as e:
        claim(fragment in str(e), f"{exc.__name__} raised, saying: {fragment!r}")
        return
    raise ClaimFailed(f"expected a {exc.__name__} saying {fragment!r}, but nothing was raised")
