"""Records regression: compare fresh result records with the committed CPU reference, field by field.

    drifts = compare_runs(fresh_dir, REFERENCE_DIR)   # [] when every number is within tolerance

Per-field tolerances live in one place, the package data `record_tolerances.toml` (its header
explains the four kinds: exact, rel, noise, ignore). A drift names the record, the field, both
values and the tolerance, so a failure says what moved and by how much.
"""

from __future__ import annotations

import fnmatch
import json
import math
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from trainmech import results
from trainmech.session import REPO_ROOT

__all__ = ["REFERENCE_DIR", "Rule", "Drift", "rules", "rule_for", "compare_values", "compare_runs"]

REFERENCE_DIR = REPO_ROOT / "results" / "cpu-reference"
_MISSING = object()


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str  # "exact" | "rel" | "noise" | "ignore"
    rel: float = 0.0
    factor: float = 1.0
    floor: float = 0.0
    why: str = ""
    always_ignore: bool = False

    def describe(self) -> str:
        return {
            "exact": "exact",
            "rel": f"rel ≤ {self.rel:g}",
            "noise": f"≤ {self.factor:g}×reference + {self.floor:g}",
            "ignore": "ignored",
        }[self.kind]


@dataclass(frozen=True)
class Drift:
    record: str
    field: str
    fresh: Any
    reference: Any
    tolerance: str

    def __str__(self) -> str:
        return f"{self.record}: {self.field} = {_show(self.fresh)}, reference {_show(self.reference)} (tolerance: {self.tolerance})"


@cache
def rules() -> tuple[tuple[Rule, ...], Rule]:
    """(the ordered rules, the default rule for floats) from record_tolerances.toml."""
    text = resources.files("trainmech").joinpath("data/record_tolerances.toml").read_text(encoding="utf-8")
    data = tomllib.loads(text)
    default = Rule("*", "rel", rel=float(data["default"]["rel"]))
    return tuple(Rule(**r) for r in data["rule"]), default


def rule_for(field: str, value: Any, *, strict: bool = False) -> Rule:
    """The first rule matching field; strict (same machine): exact unless the rule is always ignored."""
    ordered, default = rules()
    rule = next((r for r in ordered if fnmatch.fnmatchcase(field, r.pattern)), None)
    if rule is None:
        rule = default if isinstance(value, float) else Rule(field, "exact")
    if strict and not rule.always_ignore:
        return Rule(rule.pattern, "exact")
    return rule


def compare_values(
    field: str, fresh: Any, reference: Any, record: str = "", *, strict: bool = False
) -> list[Drift]:
    """Drifts of one field (nested dicts and lists walked element by element)."""
    if isinstance(reference, dict) and isinstance(fresh, dict):
        out = []
        for key in sorted(set(reference) | set(fresh)):
            name = f"{field}.{key}" if field else key
            out += compare_values(
                name, fresh.get(key, _MISSING), reference.get(key, _MISSING), record, strict=strict
            )
        return out
    rule = rule_for(field, reference if reference is not _MISSING else fresh, strict=strict)
    if rule.kind == "ignore":
        return []
    if isinstance(reference, list) and isinstance(fresh, list) and len(reference) == len(fresh):
        out = []
        for i, (f, r) in enumerate(zip(fresh, reference)):
            out += compare_values(f"{field}[{i}]", f, r, record, strict=strict)
        return out
    return (
        [] if _within(rule, fresh, reference) else [Drift(record, field, fresh, reference, rule.describe())]
    )


def _within(rule: Rule, fresh: Any, reference: Any) -> bool:
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (fresh, reference))
    if not numbers or rule.kind == "exact" or isinstance(fresh, int) and isinstance(reference, int):
        return type(fresh) is type(reference) and fresh == reference
    fresh, reference = float(fresh), float(reference)
    if not (math.isfinite(fresh) and math.isfinite(reference)):
        return fresh == reference
    if rule.kind == "noise":
        return fresh <= rule.factor * abs(reference) + rule.floor
    return abs(fresh - reference) <= rule.rel * max(abs(reference), 1e-300)


def compare_runs(
    fresh_dir: Path, reference_dir: Path = REFERENCE_DIR, *, require_all: bool = True, strict: bool = False
) -> list[Drift]:
    """Every drift between the records of two run folders.

    A record present in only one of them is a drift too; with require_all=False a reference
    record that the fresh run did not write (a notebook that was not run) is left out.
    strict=True compares two runs of the same machine: every number exactly, times and labels aside.
    """
    fresh = {p.name: p for p in results.record_paths(Path(fresh_dir))}
    reference = {p.name: p for p in results.record_paths(Path(reference_dir))}
    drifts = [
        Drift(name, "(record)", "present", "absent", "the same set of records")
        for name in sorted(set(fresh) - set(reference))
    ]
    if require_all:
        drifts += [
            Drift(name, "(record)", "absent", "present", "the same set of records")
            for name in sorted(set(reference) - set(fresh))
        ]
    for name in sorted(set(fresh) & set(reference)):
        a = json.loads(fresh[name].read_text(encoding="utf-8"))
        b = json.loads(reference[name].read_text(encoding="utf-8"))
        drifts += compare_values("", a, b, name, strict=strict)
    return drifts


def _show(x: Any) -> str:
    if x is _MISSING:
        return "(missing)"
    return f"{x:.6g}" if isinstance(x, float) else json.dumps(x, ensure_ascii=False)
