"""Meaningful cell ids: the committed rename map `notebooks/cell_ids.toml`, applied to everything that
names a cell.

The reference pages cite notebook cells by their nbformat ``id``, the gpu-check registry keys CUDA-only
branches as ``"TaskN:<id>"``. Positional ids (``cell-27``) say nothing and invite confusion with a
cell's position; the map gives every such cell a short English slug of what it does. Applying it:

- renames the ids in ``notebooks/Task*.ipynb`` (only the ``"id"`` line changes: outputs stay valid,
  nothing is re-executed);
- rewrites every citation ``[TaskN · <id>](../TaskN_x.ipynb…)`` in the reference pages to the new id and
  to a link that lands on the cell: ``../TaskN_x.ipynb#cell-id=<id>`` (JupyterLab 4 notebooks scroll to
  the cell a ``#cell-id=`` fragment names when a rendered Markdown link opens them);
- renames the keys ``"TaskN:<id>"`` in ``trainmech/gpucheck/branches.py``;
- rewrites the text twins.

It is idempotent, so after a merge that brings back old ids (another branch edited a cell's source) it
is simply run again::

    python -m trainmech twins --rename-ids

An old id that is not in its notebook is skipped with a warning (silently when its new id is already
there: the rename was applied before). A new id that another cell already holds is refused.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from trainmech.errors import TrainmechError
from trainmech.results import REPO_ROOT

__all__ = [
    "MAP_PATH",
    "NOTEBOOKS_DIR",
    "PAGES",
    "KEYED_FILES",
    "VALID_ID",
    "POSITIONAL_ID",
    "CITATION",
    "KEY",
    "fragment",
    "Report",
    "load_map",
    "apply",
    "positional_ids",
    "main",
]

MAP_PATH = REPO_ROOT / "notebooks" / "cell_ids.toml"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
PAGES = tuple(
    REPO_ROOT / "notebooks" / "reference" / p
    for p in ("formulas.md", "troubleshooting.md", "problem_chain.md")
)
KEYED_FILES = (REPO_ROOT / "trainmech" / "gpucheck" / "branches.py",)

VALID_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
POSITIONAL_ID = re.compile(r"cell-\d+")
# [TaskN · id](../TaskN_name.ipynb) with or without a fragment
CITATION = re.compile(
    r"\[Task(\d) · ([A-Za-z0-9][A-Za-z0-9_-]*)\]\(\.\./(Task(\d)_[A-Za-z0-9_]+\.ipynb)(#[^)\s]*)?\)"
)
KEY = re.compile(r"([\"'])Task(\d):([A-Za-z0-9_-]+)\1")


def fragment(cell_id: str) -> str:
    """The URL fragment that makes JupyterLab scroll a notebook to this cell."""
    return f"#cell-id={cell_id}"


@dataclass
class Report:
    changed: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def load_map(path: Path | None = None) -> dict[str, dict[str, str]]:
    """{"Task0": {old: new}} from the TOML map, checked: valid new ids, none given twice in a notebook."""
    path = path or MAP_PATH
    with open(path, "rb") as f:
        data = tomllib.load(f)
    for task, renames in data.items():
        if not re.fullmatch(r"Task\d", task) or not isinstance(renames, dict):
            raise TrainmechError(f'{path.name}: [{task}] is not a [TaskN] table of old = "new" ids')
        bad = [new for new in renames.values() if not isinstance(new, str) or not VALID_ID.fullmatch(new)]
        if bad:
            raise TrainmechError(
                f"{path.name} [{task}]: not a valid cell id (letters, digits, - and _, at most 64): {bad}"
            )
        seen: dict[str, str] = {}
        for old, new in renames.items():
            if new in seen:
                raise TrainmechError(
                    f"{path.name} [{task}]: {new!r} is given to both {seen[new]!r} and {old!r}"
                )
            seen[new] = old
    return data


def _notebook_of(task: str, notebooks_dir: Path) -> Path | None:
    found = sorted(notebooks_dir.glob(f"{task}_*.ipynb"))
    return found[0] if found else None


def _rename_in_notebook(path: Path, renames: dict[str, str], report: Report, write: bool) -> dict[str, str]:
    """Rename ids in one notebook by editing only their "id" lines; returns the renames that apply."""
    text = path.read_text(encoding="utf-8")
    ids = [c.get("id") for c in json.loads(text)["cells"]]
    present = set(ids)
    applied = {}
    for old, new in renames.items():
        if old == new:
            continue
        if old not in present:
            if new not in present:
                report.warnings.append(f"{path.name}: no cell with id {old!r} (nor {new!r}); skipped")
            continue
        if new in present:
            raise TrainmechError(
                f"{path.name}: cannot rename {old!r} to {new!r}, another cell already has that id"
            )
        pattern = re.compile(r'("id":\s*)"' + re.escape(old) + '"')
        text, n = pattern.subn(lambda m, new=new: m.group(1) + json.dumps(new), text)
        if n != 1:
            raise TrainmechError(f'{path.name}: expected one "id": {old!r} line, found {n}')
        present.discard(old)
        present.add(new)
        applied[old] = new
    if applied:
        assert [c.get("id") for c in json.loads(text)["cells"]] == [applied.get(i, i) for i in ids]
        if write:
            path.write_text(text, encoding="utf-8")
        report.changed.append(path)
    return applied


def _rewrite_citations(text: str, renames: dict[str, dict[str, str]]) -> str:
    def sub(m: re.Match) -> str:
        task, cell_id, target = m.group(1), m.group(2), m.group(3)
        cell_id = renames.get(f"Task{task}", {}).get(cell_id, cell_id)
        return f"[Task{task} · {cell_id}](../{target}{fragment(cell_id)})"

    return CITATION.sub(sub, text)


def _rewrite_keys(text: str, renames: dict[str, dict[str, str]]) -> str:
    def sub(m: re.Match) -> str:
        quote, task, cell_id = m.group(1), m.group(2), m.group(3)
        return f"{quote}Task{task}:{renames.get(f'Task{task}', {}).get(cell_id, cell_id)}{quote}"

    return KEY.sub(sub, text)


def apply(
    *,
    write: bool = True,
    map_path: Path | None = None,
    notebooks_dir: Path | None = None,
    pages: tuple[Path, ...] | None = None,
    keyed_files: tuple[Path, ...] | None = None,
) -> Report:
    """Apply the map everywhere (write=False: only report what would change)."""
    notebooks_dir = notebooks_dir or NOTEBOOKS_DIR
    mapping = load_map(map_path)
    report = Report()
    # the full map, not only what changed in this run: the pages and keys may still name an old id
    for task, renames in mapping.items():
        path = _notebook_of(task, notebooks_dir)
        if path is None:
            report.warnings.append(f"no {task}_*.ipynb under {notebooks_dir}; its renames skipped")
            continue
        _rename_in_notebook(path, renames, report, write)
    for path in (
        *(PAGES if pages is None else pages),
        *(KEYED_FILES if keyed_files is None else keyed_files),
    ):
        text = path.read_text(encoding="utf-8")
        new = _rewrite_citations(text, mapping) if path.suffix == ".md" else _rewrite_keys(text, mapping)
        if new != text:
            if write:
                path.write_text(new, encoding="utf-8")
            report.changed.append(path)
    return report


def positional_ids(notebooks_dir: Path | None = None) -> dict[str, list[str]]:
    """{notebook name: its positional ids (cell-NN)}, for the notebooks that still have any."""
    out = {}
    for path in sorted((notebooks_dir or NOTEBOOKS_DIR).glob("Task*.ipynb")):
        found = [
            c.get("id", "")
            for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
            if POSITIONAL_ID.fullmatch(c.get("id", ""))
        ]
        if found:
            out[path.name] = found
    return out


def main(write: bool = True) -> int:
    report = apply(write=write)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for path in report.changed:
        print(f"{'renamed ids in' if write else 'would change'} {path.relative_to(REPO_ROOT)}")
    return 1 if report.changed and not write else 0
