"""Notebook parameters: what the `parameters` cell assigns, and `-p NAME=VALUE` overrides checked against it.

    defaults = notebook_parameters(nb)              # {"SEED": 0, "LR": 0.01, "WORKLOAD": None, …}
    value = parse_override("SEED", "1", defaults)   # 1; "abc", 1e999 or a name the cell does not assign: refused
    inject_parameters(nb, {"RUN_MODE": "cpu", "SEED": 1})

An override must name a variable the notebook's parameters cell assigns, and its value must be a
Python literal of the default's type (an int where the default is an int; an int or a finite float
where it is a float; any text where it is a string; a list or tuple of the default's element type).
Where the default is None, any small literal is taken, and a bare word is a string. RUN_MODE and
RUN_LABEL are set only by the runner's --mode and --label.
"""

from __future__ import annotations

import ast
import keyword
import math
import re
from typing import TYPE_CHECKING, Any

from trainmech.errors import TrainmechError

__all__ = [
    "RESERVED",
    "MAX_TEXT",
    "MAX_DEPTH",
    "MAX_INT",
    "BARE_WORD",
    "EXPRESSION",
    "parameters_index",
    "notebook_parameters",
    "check_name",
    "parse_override",
    "inject_parameters",
]

if TYPE_CHECKING:
    import nbformat  # imported where used: it takes seconds

RESERVED = {"RUN_MODE": "--mode", "RUN_LABEL": "--label"}
MAX_TEXT = 1000  # characters of one value
MAX_DEPTH = 4  # nesting of lists, tuples and dicts
MAX_INT = 2**63  # what a seed or a size can be
BARE_WORD = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]*\Z")
EXPRESSION = object()  # a default that is not a literal (computed): it cannot be overridden


def parameters_index(nb: nbformat.NotebookNode) -> int:
    """Index of the code cell tagged `parameters`; refused when the notebook has none."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            return i
    raise TrainmechError("the notebook has no code cell tagged 'parameters'")


def notebook_parameters(nb: nbformat.NotebookNode) -> dict[str, Any]:
    """{name: default} for every name the parameters cell assigns at top level (EXPRESSION when computed)."""
    try:
        tree = ast.parse(nb.cells[parameters_index(nb)].source)
    except SyntaxError as e:
        raise TrainmechError(f"the parameters cell is not valid Python (line {e.lineno}: {e.msg})") from None
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                try:
                    out[target.id] = ast.literal_eval(value)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    out[target.id] = EXPRESSION
    return out


def check_name(name: str) -> str:
    """A name -p may set at all: an identifier, not a keyword, not RUN_MODE / RUN_LABEL."""
    if name in RESERVED:
        raise TrainmechError(f"{name} is set with {RESERVED[name]}, not with -p")
    if not name.isidentifier() or keyword.iskeyword(name) or not name.isascii():
        raise TrainmechError(
            f"-p {name[:40]!r} does not name a parameter (NAME=VALUE, for example -p SEED=1)"
        )
    return name


def parse_override(name: str, text: str, defaults: dict[str, Any]) -> Any:
    """The value of `-p name=text` for a notebook with these defaults, or a one-sentence refusal."""
    check_name(name)
    if name not in defaults:
        valid = ", ".join(n for n in defaults if n not in RESERVED) or "none"
        raise TrainmechError(f"the parameters cell does not assign {name}; it assigns: {valid}")
    if len(text) > MAX_TEXT:
        raise TrainmechError(f"-p {name}: the value is longer than {MAX_TEXT} characters")
    default = defaults[name]
    if default is EXPRESSION:
        raise TrainmechError(
            f"-p {name}: its default is computed, not a literal; change it in the notebook instead"
        )
    if isinstance(default, str):
        value = _literal(text)
        return value if isinstance(value, str) else text  # any text is a string; a quoted literal is unquoted
    value = _literal(text)
    if value is _NOT_LITERAL:
        if default is None and BARE_WORD.match(text):
            return text  # WORKLOAD=cpu-seq32
        raise TrainmechError(
            f"-p {name}={text[:40]!r} is not a Python literal; {name} takes {_kind(default)}"
        )
    _check_small(name, value, 0)
    if default is None:
        return value
    typed = _as_type_of(value, default)
    if typed is _NOT_LITERAL:
        raise TrainmechError(f"-p {name}={text[:40]!r}: {name} takes {_kind(default)} (default {default!r})")
    return typed


def inject_parameters(nb: nbformat.NotebookNode, params: dict[str, Any]) -> nbformat.NotebookNode:
    """Insert a cell tagged `injected-parameters` right after the `parameters` cell (papermill style)."""
    import nbformat

    index = parameters_index(nb)
    source = "# Parameters injected by python -m trainmech run\n" + "".join(
        f"{k} = {v!r}\n" for k, v in params.items()
    )
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    if "id" in cell:
        cell.id = "injected-parameters"  # not a random id: executed copies of two runs diff cleanly
    nb.cells.insert(index + 1, cell)
    return nb


_NOT_LITERAL = object()


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def _check_small(name: str, value: Any, depth: int) -> None:
    """Finite numbers, bounded ints, strings, booleans, None and shallow containers of them."""
    if depth > MAX_DEPTH:
        raise TrainmechError(f"-p {name}: the value is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise TrainmechError(f"-p {name}: {value} is not a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_INT:
        raise TrainmechError(f"-p {name}: {value:.3g} is outside the 64-bit integer range")
    if isinstance(value, (list, tuple, set)):
        for v in value:
            _check_small(name, v, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_small(name, k, depth + 1)
            _check_small(name, v, depth + 1)
    elif not isinstance(value, (bool, int, float, str, type(None))):
        raise TrainmechError(f"-p {name}: a {type(value).__name__} is not a parameter value")


def _as_type_of(value: Any, default: Any) -> Any:
    """value converted to the default's type where that loses nothing (int -> float, list <-> tuple), else _NOT_LITERAL."""
    if isinstance(default, bool):
        return value if isinstance(value, bool) else _NOT_LITERAL
    if isinstance(default, int):
        return value if type(value) is int else _NOT_LITERAL
    if isinstance(default, float):
        return float(value) if type(value) in (int, float) else _NOT_LITERAL
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        kinds = {type(d) for d in default}
        if len(kinds) == 1 and default:
            items = [_as_type_of(v, default[0]) for v in value]
            if any(i is _NOT_LITERAL for i in items):
                return _NOT_LITERAL
            return type(default)(items)
        return type(default)(value)
    if isinstance(default, dict):
        return value if isinstance(value, dict) else _NOT_LITERAL
    return _NOT_LITERAL


def _kind(default: Any) -> str:
    if default is None:
        return "a literal such as 3, 0.5, 'text' or [1, 2]"
    if isinstance(default, bool):
        return "True or False"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a finite number"
    if isinstance(default, (list, tuple)):
        inner = f" of {_kind(default[0]).removeprefix('an ').removeprefix('a ')}s" if default else ""
        return f"a {type(default).__name__}{inner}"
    return f"a {type(default).__name__}"
