"""What a learner sees in JupyterLab besides printed lines: short error displays and progress bars.

- `ShortTraceback`, a mixin for the package's exceptions. In IPython (JupyterLab, and the
  headless runner's kernels) a raised one shows its one-line message and the notebook line that
  led to it, not a wall of frames inside trainmech (IPython's `_render_traceback_` protocol). It
  is still raised, so Run All stops at it. `TRAINMECH_TRACEBACK=full` restores IPython's full
  traceback for maintainers.
- `user_frame(tb)`: the innermost frame of a traceback in code the learner wrote (a notebook cell
  or their own file), skipping trainmech, the standard library and installed packages.
- `progress(iterable)`: a notebook progress bar in JupyterLab; a text bar in a terminal; nothing
  where outputs are recorded (the headless runner, nbval), so committed outputs never hold times.
- `format_table(header, rows)`: the plain-text table every printed table uses (columns padded to
  their widest cell, all-number columns right-aligned, integers with thousands separators).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "PACKAGE_DIR",
    "TRACEBACK_ENV",
    "PROGRESS_ENV",
    "user_frame",
    "describe_frame",
    "ShortTraceback",
    "progress_mode",
    "progress",
    "PLACEHOLDERS",
    "format_table",
]

PACKAGE_DIR = Path(__file__).resolve().parent
TRACEBACK_ENV = "TRAINMECH_TRACEBACK"  # "full": IPython's own traceback for the package's errors
PROGRESS_ENV = "TRAINMECH_PROGRESS"  # "bar" | "text" | "off": overrides progress_mode()'s choice

_RED, _RESET = "\x1b[0;31m", "\x1b[0m"


@functools.cache
def _library_dirs() -> tuple[Path, ...]:
    """trainmech itself, the standard library and every site-packages: code the learner did not write."""
    dirs = {PACKAGE_DIR}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(Path(path).resolve())
    dirs.update(Path(p).resolve() for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return tuple(sorted(dirs))


def _is_user_code(filename: str) -> bool:
    if filename.startswith("<frozen ") or filename == "<string>":
        return False
    path = Path(filename)
    if not path.is_absolute():
        return True  # "<ipython-input-…>", a relative script path
    resolved = path.resolve()
    return not any(resolved.is_relative_to(d) for d in _library_dirs())


def user_frame(tb) -> traceback.FrameSummary | None:
    """The innermost frame of traceback `tb` whose code the learner wrote, or None."""
    for frame in reversed(traceback.extract_tb(tb)):
        if _is_user_code(frame.filename):
            return frame
    return None


def describe_frame(frame: traceback.FrameSummary) -> str:
    """`Cell In[5]，第 3 行：<that line>` in IPython; `<file name>，第 3 行：…` elsewhere."""
    where = Path(frame.filename).name
    try:
        from IPython import get_ipython

        shell = get_ipython()
        named = shell.compile.format_code_name(frame.filename) if shell is not None else None
        if named:
            where = " ".join(named)
    except (ImportError, AttributeError):
        pass
    line = (frame.line or "").strip()
    return f"{where}，第 {frame.lineno} 行" + (f"：{line}" if line else "")


class ShortTraceback:
    """Mixin for exceptions whose message says everything: IPython shows the message and where
    in the learner's code it was raised, without the package's frames."""

    @property
    def _render_traceback_(self):
        if os.environ.get(TRACEBACK_ENV) == "full":
            raise AttributeError("_render_traceback_")  # IPython then formats its full traceback
        return self._short_traceback

    def _short_traceback(self) -> list[str]:
        lines = [f"{_RED}{type(self).__name__}{_RESET}: {self}"]
        frame = user_frame(self.__traceback__)
        if frame is not None:
            lines.append(f"  ↳ {describe_frame(frame)}")
        return lines


# ----------------------------------------------------------------------------- progress


def _in_kernel() -> bool:
    """Whether this process is an IPython kernel (JupyterLab, VS Code, nbclient alike)."""
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def progress_mode() -> str:
    """How `progress` shows itself here: "bar", "text" or "off".

    "bar": a kernel that a Jupyter server started for a notebook (JupyterLab sets JPY_SESSION_NAME
    for it; nbclient, the runner and nbval do not), with ipywidgets installed. "text": a terminal
    (stderr is a TTY). "off": everything else — recorded outputs must not hold times or rates.
    TRAINMECH_PROGRESS overrides.
    """
    forced = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if forced in ("bar", "text", "off"):
        return forced
    if os.environ.get("JPY_SESSION_NAME") and _in_kernel():
        # the bar is an ipywidget (the `lab` extra); without it tqdm would print times into the cell
        return "bar" if importlib.util.find_spec("ipywidgets") is not None else "off"
    stderr = sys.stderr
    if stderr is not None and not _in_kernel() and stderr.isatty():
        return "text"
    return "off"


def progress(iterable: Iterable, *, desc: str = "", total: int | None = None, unit: str = "it"):
    """Wrap a long loop: `for step in progress(range(n), desc="updates"): …`.

    Yields the items of `iterable` unchanged. Shows a tqdm notebook bar in JupyterLab, a tqdm text
    bar on a terminal, and prints nothing at all under the headless runner or nbval (see
    `progress_mode`), so adopting it never changes a notebook's committed outputs.
    """
    mode = progress_mode()
    if mode == "off":
        return iterable
    if mode == "bar":
        from tqdm.notebook import tqdm
    else:
        from tqdm import tqdm
    return tqdm(
        iterable, desc=desc or None, total=total, unit=unit, file=None if mode == "bar" else sys.stderr
    )


# what a table prints where a number is unknown or does not apply
PLACEHOLDERS = ("—", "-", "null", "None", "")


def _is_number(cell) -> bool:
    """An int or float (not a bool), or a string that reads as one: what `checks.num` or f"{x:.2e}" print."""
    if isinstance(cell, str):
        try:
            float(cell.replace(",", ""))
        except ValueError:
            return False
        return True
    return isinstance(cell, (int, float)) and not isinstance(cell, bool)


def _is_placeholder(cell) -> bool:
    """None, or a string that stands where a number is unknown or does not apply (`PLACEHOLDERS`)."""
    return cell is None or isinstance(cell, str) and cell.strip() in PLACEHOLDERS


def format_table(header: list[str], rows: list[list]) -> str:
    """A plain-text table with columns padded to their widest cell.

    Integers get thousands separators; a column of numbers (or numbers already printed as strings) is
    right-aligned, also where some of its cells are placeholders (None, "—", "null": `PLACEHOLDERS`); any
    other column is left-aligned; headers always left.
    """
    cells = [[str(c) for c in header]] + [
        [f"{c:,}" if isinstance(c, int) and not isinstance(c, bool) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [
        all(_is_number(row[i]) or _is_placeholder(row[i]) for row in rows)
        and any(_is_number(row[i]) for row in rows)
        for i in range(len(header))
    ]
    lines = []
    for j, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.rjust(w) if numeric[i] and j else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
            ).rstrip()
        )
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
