"""The topic glossary (术语表) as data, the learner's glossary page, and a lint for the writing rules.

The 23 terms live in ``trainmech/data/glossary.json`` in the seed's order. Each :class:`Term`
carries its Chinese main name (``zh``), English name (``en``), the identifier the code uses
(``code_name``), its meaning and the confusion to avoid, and ``forms``: the (Chinese, English)
pairs a text may use for a first mention. One term has several forms: 已分配显存（allocated memory）
and 保留显存（reserved memory） are written separately in prose, and the joint name
已分配显存与保留显存（allocated / reserved memory） also counts as introducing both.

The lint reads the markdown cells of ``.ipynb`` notebooks (code cells and outputs are not prose)
and whole ``.md`` files. One notebook, or one ``.md`` file, is one *document*. Before checking,
these are blanked out (replaced by spaces, so positions and line numbers stay true): fenced code
blocks, inline code spans, HTML comments and tags, LaTeX (``$$…$$`` and ``$…$``), markdown link
targets ``](…)`` and bare URLs. The rules:

``first-use``
    Terms are found by longest match at each position over all forms, so 激活检查点 and 激活卸载
    never count as 激活; a few ``look_alikes`` (激活函数) are consumed and ignored, and ``aliases``
    (激活值, dash variants of 向量—雅可比积) count as the term. The first occurrence of each form in
    a document must be followed, after optional ``*``/``_`` emphasis, by ``（English）`` in
    full-width parentheses. The English matches case-insensitively with whitespace collapsed; after
    it the parenthesis may close at once or continue after a separator (，、；：,;:), e.g.
    ``（upstream gradient，即 …）``. Only the first occurrence is checked. Bare English names are
    never checked, so Autograd and VJP may appear alone; their Chinese forms still need the
    parenthesis on first occurrence. A joint form counts as introduced once every form it contains
    is, and introducing it introduces them.
``catch-all``
    训练显存 anywhere outside code is flagged, unless the quotation marks directly enclose it
    (“训练显存”, 「训练显存」, 『训练显存』, "训练显存"): a program cannot tell a catch-all from another use,
    so a text either names the state category or talks about the word in quotes.
``english-in-prose``
    step/steps/stepped/stepping, skip/skips/skipped/skipping, allocated, reserved (ASCII word
    boundaries, case-insensitive) are flagged in running Chinese prose. Running Chinese prose is
    any block (lines between blank lines of the source, so a whole markdown table is one block)
    that still holds a CJK character after blanking. Allowed: code spans and fenced blocks (code
    fields, framework output), and a full-width parenthesis whose preceding character is CJK
    (after optional emphasis), i.e. a gloss such as 跳步（skip）. Quotation marks do not exempt
    them: write the word as code, `step`, to talk about it. A block without CJK (an English
    quotation) is not Chinese prose.

No file is exempt by name; the generated ``notebooks/reference/glossary.md`` passes the lint.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterable

__all__ = ["Term", "TERMS", "term", "render_markdown", "write_reference", "Finding", "lint_paths", "main"]

# its own copy of trainmech.REPO_ROOT: this module imports nothing from the package (it lints without torch)
REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_PATH = Path("notebooks") / "reference" / "glossary.md"


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class Term:
    zh: str  # Chinese main name, exactly as the seed
    en: str  # English name or abbreviation, exactly as the seed
    abbreviation_ok: bool  # the bare English abbreviation may stand in prose (Autograd, VJP)
    code_name: str  # the identifier the code uses
    meaning: str
    confusion: str
    forms: tuple[tuple[str, str], ...]  # (Chinese, English) pairs usable for a first mention
    aliases: tuple[str, ...] = ()  # other Chinese spellings that count as the term's first form
    look_alikes: tuple[str, ...] = ()  # words that contain a form but name something else


def _load_terms() -> tuple[Term, ...]:
    """Read the JSON; refuses duplicate zh/en/code_name and a main name missing from its forms."""
    path = resources.files(__package__ or "trainmech").joinpath("data/glossary.json")
    raw = json.loads(path.read_text(encoding="utf-8"))
    terms = tuple(
        Term(
            zh=t["zh"],
            en=t["en"],
            abbreviation_ok=t["abbreviation_ok"],
            code_name=t["code_name"],
            meaning=t["meaning"],
            confusion=t["confusion"],
            forms=tuple((f["zh"], f["en"]) for f in t["forms"]),
            aliases=tuple(t.get("aliases", ())),
            look_alikes=tuple(t.get("look_alikes", ())),
        )
        for t in raw["terms"]
    )
    for field in ("zh", "en", "code_name"):
        values = [getattr(t, field) for t in terms]
        if len(set(values)) != len(values):
            raise ValueError(f"glossary.json: duplicate {field}")
    for t in terms:
        if (t.zh, t.en) not in t.forms:
            raise ValueError(f"glossary.json: {t.zh} is not among its own forms")
    return terms


TERMS: tuple[Term, ...] = _load_terms()


def term(code_name_or_zh: str) -> Term:
    """The term with this code name, Chinese main name or Chinese form; refuses others (KeyError)."""
    for t in TERMS:
        if code_name_or_zh == t.code_name or code_name_or_zh in {zh for zh, _ in t.forms}:
            return t
    raise KeyError(f"no glossary term {code_name_or_zh!r}; known: {', '.join(t.code_name for t in TERMS)}")


# ---------------------------------------------------------------- the learner's page

_INTRO = (
    "本页收录反向传播与训练机制专题中最容易混淆的 23 个术语，关注训练过程里的对象、更新边界和运行时证据。"
    "每条给出中文主称与英文名、它在本专题中的含义、容易混淆之处，以及命名代码时采用的英文标识符"
    "（`trainmech` 的函数、变量和结果 JSON 的键名一律用英文，并尽量沿用这些名字）。"
    "本页由 `trainmech.glossary` 根据 `trainmech/data/glossary.json` 生成，"
    "要修改请改数据，再重新生成。"
)

_RULES = """\
## 写作规则

1. 术语第一次出现时写成“中文主称（English）”，此后直接用中文主称或通用缩写。
2. Autograd、VJP、AMP 这几个缩写可以原样保留；其余普通叙述优先用中文主称，例如上游梯度、保存张量、累计窗口、有效更新、更新时钟。
3. `step`、`skip`、`allocated`、`reserved` 只出现在框架输出、代码字段或第一次释义里；连续的中文叙述分别写成“更新”“跳步”“已分配显存”“保留显存”。
4. 前向状态、保存张量、梯度、优化器状态和工作区要分开记录，不能笼统地合称为“训练显存”。
5. 不对 Notebook JSON、代码变量和框架 API 做不看上下文的批量替换：代码和输出里的英文名保持原样。

## 自动检查

`trainmech.glossary.main`（`python -m trainmech lint`）检查 Notebook 的 Markdown 单元格和 `notebooks/reference/` 下的页面，代码块、行内代码、公式、链接和 HTML 标签不参与检查：

- `first-use`：每份文档里每个中文主称第一次出现时，紧跟全角括号里的英文名；激活检查点、激活卸载不算作激活。
- `catch-all`：不加引号的“训练显存”一律报出；谈论这个词本身时请加引号。
- `english-in-prose`：含中文的段落或表格里，`step`、`skip`、`allocated`、`reserved` 只能写在行内代码里，或写在中文词后的全角括号里作为释义。
"""


def render_markdown() -> str:
    """The learner's glossary page (Chinese markdown), ending in a newline; it passes the lint."""
    parts = ["# 术语表：反向传播与训练机制\n", _INTRO + "\n"]
    for t in TERMS:
        parts.append(
            f"## {t.zh}（{t.en}）\n\n"
            f"- 含义：{t.meaning}\n"
            f"- 容易混淆：{t.confusion}\n"
            f"- 英文标识符：`{t.code_name}`\n"
        )
    parts.append(_RULES)
    return "\n".join(parts)


def write_reference(path: str | Path | None = None) -> Path:
    """Write :func:`render_markdown` to ``path`` (default: the repo's notebooks/reference/glossary.md)."""
    path = Path(path) if path is not None else REPO_ROOT / REFERENCE_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown(), encoding="utf-8")
    return path


# ---------------------------------------------------------------- the lint


@dataclass(frozen=True)
class Finding:
    file: str
    cell: int  # cell index (0-based, into nb.cells) for a notebook, line number (1-based) for .md
    rule: str  # "first-use" | "catch-all" | "english-in-prose"
    message: str
    snippet: str

    def __str__(self) -> str:
        where = "cell" if self.file.endswith(".ipynb") else "line"
        return f'{self.file} {where} {self.cell} [{self.rule}] {self.message}: "{self.snippet}"'


_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_HAS_CJK = re.compile(f"[{_CJK}]")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_BLANKED = [  # order matters: code first, so a `$` or `<` inside code never opens math or a tag
    re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S),  # inline code span
    re.compile(r"<!--.*?-->", re.S),
    re.compile(r"\$\$.*?\$\$", re.S),
    re.compile(r"\$[^$\n]+\$"),
    re.compile(r"</?[A-Za-z][^<>\n]*>"),  # HTML tag
    re.compile(r"\]\([^)\n]*\)"),  # markdown link target
    re.compile(r"https?://[!-~]+"),  # bare URL: printable ASCII only, so 。） end it
]
_GLOSS = re.compile(f"(?<=[{_CJK}])([*_]*（)([^（）\\n]*)(）)")
_ENGLISH = re.compile(
    r"(?<![A-Za-z0-9_])(step(?:s|ped|ping)?|skip(?:s|ped|ping)?|allocated|reserved)(?![A-Za-z0-9_])", re.I
)
_ENGLISH_ZH = {"step": "更新", "skip": "跳步", "allocated": "已分配显存", "reserved": "保留显存"}
_CATCH_ALL = "训练显存"
_QUOTES = {("“", "”"), ("「", "」"), ("『", "』"), ('"', '"')}
_GLOSS_AFTER = re.compile(r"[*_]*（\s*([^（）]*?)\s*）")
_SEPARATORS = "，、；：,;:"


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def _strip(text: str) -> str:
    """Blank out code, HTML, LaTeX, link targets and URLs, keeping length and newlines."""
    out, fence = [], None
    for line in text.splitlines(keepends=True):
        opening = _FENCE.match(line) if fence is None else None
        if opening:
            fence = opening.group(1)
        if fence is not None:
            body = line.strip()
            if not opening and body and set(body) == {fence[0]} and len(body) >= len(fence):
                fence = None
            line = re.sub(r"[^\n]", " ", line)
        out.append(line)
    text = "".join(out)
    for pattern in _BLANKED:
        text = pattern.sub(_blank, text)
    return text


def _form_table() -> tuple[re.Pattern, dict[str, tuple[int, int] | None]]:
    """All names to match, longest first, mapped to (term index, form index) or None (look-alike)."""
    table: dict[str, tuple[int, int] | None] = {}
    for i, t in enumerate(TERMS):
        for j, (zh, _) in enumerate(t.forms):
            table[zh] = (i, j)
        table.update({alias: (i, 0) for alias in t.aliases})
        table.update({word: None for word in t.look_alikes})
    names = sorted(table, key=len, reverse=True)  # regex alternation takes the first that fits
    return re.compile("|".join(map(re.escape, names))), table


_NAMES, _NAME_TABLE = _form_table()


def _normalise(english: str) -> str:
    return re.sub(r"\s*/\s*", "/", re.sub(r"\s+", " ", english.strip())).lower()


def _glossed(stripped: str, end: int, english: str) -> bool:
    """Whether ``（english）`` (or ``（english，…）``) follows position ``end``."""
    m = _GLOSS_AFTER.match(stripped, end)
    if not m:
        return False
    inside, want = _normalise(m.group(1)), _normalise(english)
    return inside == want or (inside.startswith(want) and inside[len(want)] in _SEPARATORS)


def _contained_forms(t: Term, j: int) -> list[int]:
    zh = t.forms[j][0]
    return [k for k, (other, _) in enumerate(t.forms) if k != j and other in zh]


def _snippet(text: str, start: int, end: int, context: int = 6) -> str:
    """The match with up to ``context`` characters either side, within its line."""
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end) % (len(text) + 1)  # -1 (last line) becomes len(text)
    a, b = max(line_start, start - context), min(line_end, end + context)
    return ("..." if a > line_start else "") + text[a:b] + ("..." if b < line_end else "")


def _units(path: Path) -> list[tuple[int | None, str]]:
    """(cell index, text) per markdown cell, or one (None, text) for a .md file; refuses other files."""
    if path.suffix == ".md":
        return [(None, path.read_text(encoding="utf-8"))]
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text(encoding="utf-8"))
        if nb.get("nbformat") != 4:
            raise ValueError(f"{path}: only nbformat 4 notebooks are linted")
        return [
            (i, "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for i, c in enumerate(nb["cells"])
            if c["cell_type"] == "markdown"
        ]
    raise ValueError(f"{path}: the glossary lint reads .ipynb and .md files only")


def _lint_document(path: Path, shown: str) -> list[Finding]:
    findings: list[Finding] = []
    introduced: set[tuple[int, int]] = set()
    seen: set[tuple[int, int]] = set()

    def add(cell: int | None, text: str, start: int, end: int, rule: str, message: str) -> None:
        where = cell if cell is not None else text.count("\n", 0, start) + 1
        findings.append(Finding(shown, where, rule, message, _snippet(text, start, end)))

    for cell, text in _units(path):
        stripped = _strip(text)

        for m in _NAMES.finditer(stripped):  # first-use
            key = _NAME_TABLE[m.group(0)]
            if key is None or key in seen:
                continue
            seen.add(key)
            i, j = key
            t = TERMS[i]
            zh, en = t.forms[j]
            parts = _contained_forms(t, j)
            if _glossed(stripped, m.end(), en):
                introduced.add(key)
                introduced.update((i, k) for k in parts)
                seen.update((i, k) for k in parts)
            elif not (parts and all((i, k) in introduced for k in parts)):
                add(cell, text, m.start(), m.end(), "first-use", f"{zh} first used without （{en}）")

        for m in re.finditer(_CATCH_ALL, stripped):  # catch-all
            around = (stripped[m.start() - 1 : m.start()], stripped[m.end() : m.end() + 1])
            if around not in _QUOTES:
                add(
                    cell,
                    text,
                    m.start(),
                    m.end(),
                    "catch-all",
                    "训练显存 used as a catch-all; name the state (参数/激活/保存张量/梯度/优化器状态/工作区) or quote the word",
                )

        glossed = _GLOSS.sub(lambda g: g.group(1) + " " * len(g.group(2)) + g.group(3), stripped)
        for block in re.finditer(r"(?:^[ \t]*\S.*(?:\n|$))+", text, re.M):  # english-in-prose
            if not _HAS_CJK.search(stripped, block.start(), block.end()):
                continue
            for m in _ENGLISH.finditer(glossed, block.start(), block.end()):
                word = m.group(1).lower()
                base = next(k for k in _ENGLISH_ZH if word.startswith(k))
                add(
                    cell,
                    text,
                    m.start(),
                    m.end(),
                    "english-in-prose",
                    f"{m.group(1)} in Chinese prose; write {_ENGLISH_ZH[base]} or put it in `code`",
                )
    return findings


def lint_paths(paths: Iterable[str | Path], root: str | Path | None = None) -> list[Finding]:
    """Lint each notebook / .md file as one document; files are shown relative to ``root`` if given.

    Refuses (ValueError) a file that is neither ``.ipynb`` nor ``.md``, and a notebook not in nbformat 4.
    """
    findings: list[Finding] = []
    for p in map(Path, paths):
        shown = p
        if root is not None:
            try:
                shown = p.resolve().relative_to(Path(root).resolve())
            except ValueError:
                pass
        findings.extend(_lint_document(p, shown.as_posix()))
    return findings


def main(argv: list[str] | None = None) -> int:
    """Lint notebooks/*.ipynb and notebooks/reference/*.md under the root; 0 clean, 1 findings.

    Refuses (returns 2) a root without a ``notebooks/`` folder.
    """
    parser = argparse.ArgumentParser(prog="trainmech lint", description="Check the glossary's writing rules.")
    parser.add_argument(
        "--root", type=Path, default=REPO_ROOT, help="repository root (default: this checkout)"
    )
    parser.add_argument(
        "--write-glossary", action="store_true", help="regenerate notebooks/reference/glossary.md first"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    notebooks = root / "notebooks"
    if not notebooks.is_dir():
        print(f"glossary lint: no notebooks/ folder under {root}", file=sys.stderr)
        return 2
    if args.write_glossary:
        print(f"wrote {write_reference(root / REFERENCE_PATH).relative_to(root).as_posix()}")
    paths = sorted(notebooks.glob("*.ipynb")) + sorted((notebooks / "reference").glob("*.md"))
    findings = lint_paths(paths, root=root)
    for f in findings:
        print(f)
    if findings:
        files = len({f.file for f in findings})
        print(f"glossary lint: {len(findings)} finding(s) in {files} of {len(paths)} file(s)")
        return 1
    print(f"glossary lint: clean ({len(paths)} file(s))")
    return 0
