"""The learner's reference pages (公式索引, 训练机制问题索引, 训练机制问题链) against the notebooks.

Each page cites notebook cells in one machine-readable form, documented at the top of the page:

    [Task3 · overflow-skip](../Task3_effective_updates.ipynb#cell-id=overflow-skip)

`overflow-skip` is the cited cell's ``id`` in the notebook file: it stays with the cell when cells are
inserted or removed around it. The link's fragment ``#cell-id=<the same id>`` makes JupyterLab scroll the
opened notebook to that cell (tests/test_browser.py clicks one); ids are meaningful slugs, never positional
``cell-NN`` (notebooks/cell_ids.toml maps the old ones, `python -m trainmech twins --rename-ids` applies it). An inline code span that holds a check line (it starts or ends with
``✓``, or says ``bitwise equal``) quotes the committed output of the nearest cell reference before it
on the same line; whitespace runs count as one space. So when a notebook changes, a page that cites it
goes stale loudly: a missing notebook, an id that is gone, or a quoted check line no longer printed
there fails here. A placeholder ``（TaskN 页面完成后补充）`` is allowed only while that notebook is absent or
has not been run (no code cell has an output); once it is committed with outputs, every page must cite
it. Code spans naming ``trainmech.module.attr`` must name something the package defines (read with
``ast``, nothing is imported). The pages must also pass the glossary lint. Reads JSON only: fast.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest

from trainmech.glossary import lint_paths

pytestmark = pytest.mark.package

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
REFERENCE = NOTEBOOKS / "reference"
PAGES = ("formulas.md", "troubleshooting.md", "problem_chain.md")
TASKS = range(7)  # Task0 … Task6

REF = re.compile(
    r"\[Task(\d) · ([A-Za-z0-9][A-Za-z0-9_-]*)\]\((\.\./(Task(\d)_[A-Za-z0-9_]+\.ipynb))(#[^)\s]*)?\)"
)
POSITIONAL = re.compile(r"cell-\d+")
LOOSE_REF = re.compile(r"Task\d\s*·\s*cell[\s-]*\d+")
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)")
PLACEHOLDER = re.compile(r"（Task(\d) 页面完成后补充）")
PACKAGE_NAME = re.compile(r"trainmech(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?:\(\))?")


def _collapse(text: str) -> str:
    return " ".join(text.split())


def _is_check_line(span: str) -> bool:
    return span.startswith("✓") or span.endswith("✓") or "bitwise equal" in span


def _cell(nb: dict, cell_id: str) -> dict | None:
    return next((c for c in nb["cells"] if c.get("id") == cell_id), None)


@functools.lru_cache(maxsize=None)
def _notebook(path: Path) -> dict | None:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _outputs(cell: dict) -> str:
    """The text a code cell printed (streams, and text/plain of results), whitespace collapsed."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"] if isinstance(out["text"], str) else "".join(out["text"]))
        elif "data" in out and "text/plain" in out["data"]:
            text = out["data"]["text/plain"]
            parts.append(text if isinstance(text, str) else "".join(text))
    return _collapse("\n".join(parts))


def _executed(nb: dict) -> bool:
    return any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def _task_notebook(task: int) -> Path | None:
    found = sorted(NOTEBOOKS.glob(f"Task{task}_*.ipynb"))
    return found[0] if found else None


def _page(name: str) -> str:
    return (REFERENCE / name).read_text(encoding="utf-8")


def _spans(line: str) -> list[tuple[int, str]]:
    """(position, content) of each inline code span; `\\|` (a pipe escaped for a table) reads as `|`."""
    out = []
    for m in CODE_SPAN.finditer(line):
        content = m.group(2)
        if content.startswith(" ") and content.endswith(" ") and content.strip():
            content = content[1:-1]
        out.append((m.start(), content.replace("\\|", "|")))
    return out


@pytest.mark.parametrize("page", PAGES)
def test_page_documents_the_reference_form(page):
    text = _page(page)
    head = text[: text.find("\n## ")] if "\n## " in text else text
    assert "[TaskN · 单元格 id](../TaskN_" in head, (
        f"{page}: the top of the page must document the cell-reference form"
    )


@pytest.mark.parametrize("page", PAGES)
def test_cell_references_point_at_existing_cells(page):
    text, problems, count = _page(page), [], 0
    for lineno, line in enumerate(text.splitlines(), 1):
        spans = [(m.start(), m.end()) for m in CODE_SPAN.finditer(line)]
        refs = list(REF.finditer(line))
        covered = [(m.start(), m.end()) for m in refs] + spans
        for loose in LOOSE_REF.finditer(line):
            if not any(a <= loose.start() < b for a, b in covered):
                problems.append(f"line {lineno}: malformed cell reference {loose.group(0)!r}")
        for m in refs:
            count += 1
            task, cell_id, target, file_task = int(m.group(1)), m.group(2), m.group(3), int(m.group(5))
            path = (REFERENCE / target).resolve()
            nb = _notebook(path)
            if m.group(6) != f"#cell-id={cell_id}":
                problems.append(
                    f"line {lineno}: the link to {cell_id} must end in #cell-id={cell_id} (it lands on the cell), "
                    f"not {m.group(6) or 'no fragment'}"
                )
            if task != file_task:
                problems.append(f"line {lineno}: Task{task} label on {target}")
            elif nb is None:
                problems.append(f"line {lineno}: {target} does not exist")
            elif _cell(nb, cell_id) is None:
                problems.append(f"line {lineno}: {target} has no cell with id {cell_id!r}")
    assert count > 0, f"{page} cites no cell"
    assert not problems, f"{page}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_quoted_check_lines_are_in_the_cited_cells_outputs(page):
    text, problems, quoted = _page(page), [], 0
    for lineno, line in enumerate(text.splitlines(), 1):
        refs = list(REF.finditer(line))
        for pos, span in _spans(line):
            if not _is_check_line(span):
                continue
            quoted += 1
            before = [m for m in refs if m.end() <= pos]
            if not before:
                problems.append(
                    f"line {lineno}: check line quoted without a cell reference before it: {span!r}"
                )
                continue
            ref = before[-1]
            nb = _notebook((REFERENCE / ref.group(3)).resolve())
            cell_id = ref.group(2)
            cell = _cell(nb, cell_id) if nb is not None else None
            if cell is None:
                continue  # reported by test_cell_references_point_at_existing_cells
            if cell["cell_type"] != "code":
                problems.append(
                    f"line {lineno}: {ref.group(3)} {cell_id} is {cell['cell_type']}, it prints nothing: {span!r}"
                )
            elif _collapse(span) not in _outputs(cell):
                problems.append(f"line {lineno}: not in the outputs of {ref.group(3)} {cell_id}: {span!r}")
    assert quoted > 0, f"{page} quotes no check line"
    assert not problems, f"{page}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_placeholders_only_for_notebooks_not_yet_run(page):
    text = _page(page)
    waiting = {int(m.group(1)) for m in PLACEHOLDER.finditer(text)}
    cited = {int(m.group(1)) for m in REF.finditer(text)}
    for task in TASKS:
        path = _task_notebook(task)
        nb = _notebook(path) if path else None
        ready = nb is not None and _executed(nb)
        if ready:
            assert task not in waiting, (
                f"{page}: placeholder for Task{task}, but {path.name} is committed with outputs: write its entries"
            )
            assert task in cited, f"{page}: {path.name} exists with outputs but the page never cites it"
        else:
            assert task in waiting, (
                f"{page}: Task{task} has no run notebook yet: mark its place with （Task{task} 页面完成后补充）"
            )


def _defined(module: Path, names: list[str]) -> bool:
    """Whether module (a .py file) defines names[0] at top level (or imports it, by name or by a star
    import of a trainmech module, as a package's __init__ re-exports), and names[1:] inside it (class members)."""
    body = ast.parse(module.read_text(encoding="utf-8")).body
    for k, name in enumerate(names):
        found = None
        starred = []  # `from trainmech.x import *`: modules whose public names this one re-exports
        for node in body:
            if (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("trainmech.")
                and any((a.asname or a.name) in (name, "*") for a in node.names)
            ):  # a package re-exports it: look where it lives
                source = ROOT.joinpath(*node.module.split("."))
                source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
                if node.names[0].name == "*":
                    starred.append(source)
                    continue
                return source.is_file() and _defined(source, names[k:])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = node
            elif isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                if any(isinstance(t, ast.Name) and t.id == name for t in flat):
                    found = node
        if found is None:
            return k == 0 and any(s.is_file() and _defined(s, names) for s in starred)
        body = getattr(found, "body", [])
    return True


def _module_of(parts: list[str]) -> tuple[Path | None, list[str]]:
    """(the .py file the longest prefix of parts names: a module, or a package's __init__; the names after it)."""
    for n in range(len(parts), 0, -1):
        base = ROOT / "trainmech" / Path(*parts[:n])
        for module in (base.with_suffix(".py"), base / "__init__.py"):
            if module.is_file():
                return module, parts[n:]
    return None, parts


@pytest.mark.parametrize("page", PAGES)
def test_named_package_functions_exist(page):
    missing = []
    for line in _page(page).splitlines():
        for _, span in _spans(line):
            if not PACKAGE_NAME.fullmatch(span):
                continue
            parts = span.removesuffix("()").split(".")[1:]
            module, rest = _module_of(parts)
            if module is None or (rest and not _defined(module, rest)):
                missing.append(span)
    assert not missing, f"{page} names what trainmech does not define: {missing}"


def test_notebook_cell_ids_are_meaningful_not_positional():
    """Ids say what a cell does; a positional `cell-NN` reads like a position and invites citing one."""
    positional = {}
    for path in sorted(NOTEBOOKS.glob("Task*.ipynb")):
        ids = [c.get("id", "") for c in _notebook(path)["cells"]]
        assert len(set(ids)) == len(ids), f"{path.name}: duplicate cell ids"
        assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", i) for i in ids), (
            f"{path.name}: an id nbformat rejects"
        )
        if found := [i for i in ids if POSITIONAL.fullmatch(i)]:
            positional[path.name] = found
    assert not positional, (
        "positional cell ids; give each a meaningful id in notebooks/cell_ids.toml and run "
        f"python -m trainmech twins --rename-ids: {positional}"
    )


def test_the_cell_id_map_is_applied():
    """Applying notebooks/cell_ids.toml again changes nothing: notebooks, citations and gpu-check keys are in step."""
    from trainmech import cellids

    report = cellids.apply(write=False)
    assert not report.changed, (
        f"run python -m trainmech twins --rename-ids: {[p.name for p in report.changed]}"
    )


def test_pages_pass_the_glossary_lint():
    findings = lint_paths([REFERENCE / p for p in PAGES], root=ROOT)
    assert not findings, "\n".join(map(str, findings))
