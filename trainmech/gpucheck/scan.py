"""Find every device-dependent branch in the package and the notebooks, mechanically.

A *site* is one place whose behaviour depends on running on CUDA:

- a comparison with the string "cuda" or "cpu" (`device.type == "cuda"`, `device == "cpu"`, …),
- a read of an `on_cuda` / `cuda` / `on_gpu` flag (`session.on_cuda`, `self.cuda`),
- a call into `torch.cuda.*` (`torch.cuda.synchronize(...)`, `torch.cuda.Event(...)`),
- in a notebook cell, a read of the page's device terms (`TERMS.step_slack_bytes(...)`, where
  `TERMS = ledger.device_terms(DEVICE)`): the same code runs everywhere, with a value the device picks.

Sites are grouped by where they live: `module.qualname` for the package (the function or class
method that holds them, e.g. `measure.cuda_peaks`) and `TaskN:cell-NN` for a notebook cell. The
gpu-check registry must cover every group (tests/test_gpucheck.py holds it to that), so a new
CUDA-only branch cannot land without a check that runs it on a GPU.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PACKAGE_DIR",
    "NOTEBOOKS_DIR",
    "FLAGS",
    "DEVICE_STRINGS",
    "TERMS",
    "Site",
    "package_sites",
    "notebook_sites",
    "all_sites",
    "by_key",
]

PACKAGE_DIR = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = PACKAGE_DIR.parent / "notebooks"
FLAGS = frozenset({"on_cuda", "cuda", "on_gpu"})  # attribute or variable names that mean "running on CUDA"
TERMS = frozenset({"TERMS"})  # notebook variables that hold the device's terms (ledger.device_terms)
DEVICE_STRINGS = frozenset({"cuda", "cpu"})


@dataclass(frozen=True)
class Site:
    """One device-dependent spot: its group key, file, line and the source text that selects it."""

    key: str  # measure.cuda_peaks | Task5:timing-table
    path: str  # relative to the repository root
    line: int
    text: str  # the test or call, as written (first line)


def _is_torch_cuda_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    parts, f = [], node.func
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    return isinstance(f, ast.Name) and f.id == "torch" and parts[-1:] == ["cuda"]


def _is_device_compare(node: ast.AST) -> bool:
    return isinstance(node, ast.Compare) and any(
        isinstance(x, ast.Constant) and x.value in DEVICE_STRINGS for x in [node.left, *node.comparators]
    )


def _is_flag(node: ast.AST, names: frozenset[str] = FLAGS) -> bool:
    if isinstance(node, ast.Attribute) and node.attr in FLAGS and isinstance(node.ctx, ast.Load):
        return True
    return isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load)


class _Finder(ast.NodeVisitor):
    """Collect (qualname, node) for every site; annotations are skipped (a type is no branch)."""

    def __init__(self, names: frozenset[str] = FLAGS) -> None:
        self.names = names  # the flag variables this source's reads are sites of
        self.scope: list[str] = []
        self.found: list[tuple[str, ast.AST]] = []

    def _scoped(self, node):
        self.scope.append(node.name)
        for child in ast.iter_child_nodes(node):
            if child is not getattr(node, "returns", None):
                self.visit(child)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_arg(self, node):  # skip the annotation
        return

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def generic_visit(self, node):
        if _is_device_compare(node) or _is_flag(node, self.names) or _is_torch_cuda_call(node):
            self.found.append((".".join(self.scope), node))
            if isinstance(node, ast.Call):  # its arguments may hold more, same group anyway
                return
        super().generic_visit(node)


def _sites(source: str, key_of, path: str, names: frozenset[str] = FLAGS) -> list[Site]:
    tree = ast.parse(source)
    finder = _Finder(names)
    finder.visit(tree)
    lines = source.splitlines()
    out = []
    for qualname, node in finder.found:
        text = ast.get_source_segment(source, node) or lines[node.lineno - 1]
        out.append(Site(key_of(qualname), path, node.lineno, text.splitlines()[0].strip()))
    return out


def package_sites(package_dir: Path = PACKAGE_DIR) -> list[Site]:
    """Sites in every module of the package (this scanner and the gpu-check registry excluded)."""
    out = []
    root = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir)
        if rel.parts[0] == "gpucheck":
            continue  # the checks themselves: they exist to run those branches
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out += _sites(
            path.read_text(encoding="utf-8"),
            lambda q, m=module: f"{m}.{q}" if q else m,
            str(path.relative_to(root)),
        )
    return out


def _cell_source(cell: dict) -> str:
    """A code cell's Python, with IPython magics and shell escapes blanked out (lines keep their numbers)."""
    lines = "".join(cell["source"]).splitlines()
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)


def notebook_sites(notebooks_dir: Path = NOTEBOOKS_DIR) -> list[Site]:
    """Sites in the code cells of every Task notebook; a cell's group is `TaskN:<cell id>`."""
    out = []
    for path in sorted(notebooks_dir.glob("Task*.ipynb")):
        task = path.stem.split("_")[0]
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            out += _sites(
                _cell_source(cell),
                lambda _q, t=task, c=cell["id"]: f"{t}:{c}",
                f"notebooks/{path.name}#{cell['id']}",
                FLAGS | TERMS,
            )
    return out


def all_sites() -> list[Site]:
    return package_sites() + notebook_sites()


def by_key(sites: list[Site]) -> dict[str, list[Site]]:
    out: dict[str, list[Site]] = {}
    for s in sites:
        out.setdefault(s.key, []).append(s)
    return out
