"""Text twins of the notebooks: their code and prose as MyST Markdown, for reading diffs.

A notebook file is JSON with outputs and base64 figures; its twin `notebooks/text/<name>.md`
holds only what a person writes — markdown cells as Markdown, code cells as ```{code-cell}```
blocks with their tags — in jupytext's MyST format. The .ipynb stays the source (it carries the
committed outputs that nbval compares); the twin follows it.

    python -m trainmech twins                 # write every twin from its notebook
    python -m trainmech twins --check         # exit 1 naming each twin that is out of step
    python -m trainmech twins --from-text Task3   # edited the twin? carry it into the notebook
    python -m trainmech twins --rename-ids    # apply notebooks/cell_ids.toml (trainmech.cellids), then write

The loop for a maintainer: edit the notebook (JupyterLab, a script) or its twin (then
`--from-text`, which keeps the outputs and ids of unchanged cells), then
`python -m trainmech refresh --only TaskN` for fresh outputs, then `python -m trainmech twins`,
and commit both files. `tests/test_twins.py` fails while a twin is out of step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainmech.errors import TrainmechError, refuse
from trainmech.results import REPO_ROOT

__all__ = [
    "NOTEBOOKS_DIR",
    "TWINS_DIR",
    "FORMAT",
    "notebooks",
    "twin_path",
    "render",
    "cells",
    "stale",
    "write",
    "from_text",
    "main",
]

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
TWINS_DIR = NOTEBOOKS_DIR / "text"
FORMAT = "md:myst"


def notebooks(only: list[str] | None = None) -> list[Path]:
    found = sorted(NOTEBOOKS_DIR.glob("Task*.ipynb"))
    if only:
        found = [p for p in found if any(p.stem == o or p.stem.startswith(o + "_") for o in only)]
        if not found:
            raise TrainmechError(
                f"no notebook matches {' '.join(only)}; valid: {', '.join(p.stem.split('_')[0] for p in notebooks())}"
            )
    return found


def twin_path(notebook: Path) -> Path:
    return TWINS_DIR / f"{notebook.stem}.md"


def render(notebook: Path) -> str:
    """The twin's text for a notebook: inputs only, no tool version in it."""
    import jupytext

    nb = jupytext.read(notebook)
    nb.metadata.pop("jupytext", None)
    text = jupytext.writes(nb, fmt=FORMAT)
    return "".join(
        line for line in text.splitlines(keepends=True) if not line.lstrip().startswith("jupytext_version:")
    )


def cells(path: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """(type, source, tags) of every cell: what a twin and its notebook must share."""
    import jupytext

    nb = jupytext.read(path)
    return [(c.cell_type, c.source.strip("\n"), tuple(c.metadata.get("tags", []))) for c in nb.cells]


def stale(only: list[str] | None = None) -> list[Path]:
    """Notebooks whose twin is missing or holds other cells (compared as cells, not as text, so a
    newer jupytext that lays the file out differently is not a difference)."""
    return [nb for nb in notebooks(only) if not twin_path(nb).is_file() or cells(twin_path(nb)) != cells(nb)]


def write(only: list[str] | None = None) -> list[Path]:
    TWINS_DIR.mkdir(exist_ok=True)
    written = []
    for nb in stale(only):
        twin_path(nb).write_text(render(nb), encoding="utf-8")
        written.append(twin_path(nb))
    return written


def from_text(only: list[str]) -> list[Path]:
    """Carry edited twins into their notebooks; unchanged cells keep their outputs and ids."""
    import jupytext
    from jupytext.combine import combine_inputs_with_outputs

    changed = []
    for path in notebooks(only):
        text = twin_path(path)
        if not text.is_file():
            raise TrainmechError(
                f"{path.stem} has no twin at {text.relative_to(REPO_ROOT)}; write it with python -m trainmech twins"
            )
        edited, current = jupytext.read(text), jupytext.read(path)
        combined = combine_inputs_with_outputs(edited, current, fmt=FORMAT)
        combined.metadata = current.metadata
        jupytext.write(combined, path, fmt="ipynb")
        changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainmech twins",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--only", nargs="+", metavar="TaskN", help="only these notebooks")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a twin is out of step")
    parser.add_argument(
        "--from-text", nargs="+", metavar="TaskN", help="carry these edited twins into their notebooks"
    )
    parser.add_argument(
        "--rename-ids",
        action="store_true",
        help="apply the cell-id map notebooks/cell_ids.toml to the "
        "notebooks, the reference pages' citations and the gpu-check keys, then write the twins (idempotent)",
    )
    args = parser.parse_args(argv)
    try:
        if args.rename_ids:
            from trainmech import cellids

            rc = cellids.main(write=not args.check)
            if args.check:
                return rc
        if args.from_text:
            for path in from_text(args.from_text):
                print(
                    f"{path.relative_to(REPO_ROOT)}: inputs taken from its twin; now run python -m trainmech refresh --only {path.stem.split('_')[0]}"
                )
            return 0
        if args.check:
            out_of_step = stale(args.only)
            for path in out_of_step:
                print(
                    f"{twin_path(path).relative_to(REPO_ROOT)} is out of step with {path.name}: run python -m trainmech twins"
                )
            return 1 if out_of_step else 0
        for path in write(args.only):
            print(f"wrote {path.relative_to(REPO_ROOT)}")
        return 0
    except TrainmechError as e:
        return refuse(e)


if __name__ == "__main__":
    sys.exit(main())
