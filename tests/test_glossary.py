"""The glossary data, the learner's glossary page and the writing-rule lint (trainmech.glossary)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from trainmech import glossary
from trainmech.glossary import TERMS, Finding, lint_paths, main, render_markdown, term

pytestmark = pytest.mark.package

REPO = Path(__file__).resolve().parent.parent


def md(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def notebook(tmp_path: Path, cells: list, name: str = "Task0_demo.ipynb") -> Path:
    """Markdown cells from str, code cells from ("code", source)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(c[1]) if isinstance(c, tuple) else nbformat.v4.new_markdown_cell(c)
        for c in cells
    ]
    path = tmp_path / name
    nbformat.write(nb, path)
    return path


def lint_text(tmp_path: Path, text: str) -> list[Finding]:
    return lint_paths([md(tmp_path, text)])


def rules(findings: list[Finding]) -> list[str]:
    return [f.rule for f in findings]


# ---------------------------------------------------------------- data


def test_data_has_23_terms_in_seed_order_with_unique_names():
    assert len(TERMS) == 23
    assert (TERMS[0].zh, TERMS[1].en, TERMS[-1].zh) == ("自动求导", "upstream gradient", "正确性门槛")
    for field in ("zh", "en", "code_name"):
        values = [getattr(t, field) for t in TERMS]
        assert len(set(values)) == 23, field


def test_data_code_names_are_snake_case_and_style_names_present():
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", t.code_name) for t in TERMS)
    style = {
        "upstream_grad",
        "saved",
        "effective_tokens",
        "accumulation_window",
        "effective_update",
        "update_clock",
        "loss_scale",
        "peak_overlap",
        "exposed_transfer_time",
        "correctness_gate",
    }
    assert style <= {t.code_name for t in TERMS}


def package_names(root: Path = REPO / "trainmech") -> set[str]:
    """Every name the package's code gives: functions, classes, arguments, variables, attributes,
    keyword arguments and fields (annotated class attributes, and the keys of dict literals: the JSON
    fields of a record or a checkpoint)."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.Dict):
                keys = [k for k in node.keys if isinstance(k, ast.Constant)]
                names |= {k.value for k in keys if isinstance(k.value, str)}
    return names


def names_concept(code_name: str, names: set[str]) -> bool:
    """The code name is one of the names, or the prefix of a snake_case one (exposed_transfer_time_s)."""
    return any(n == code_name or (n.startswith(code_name + "_") and n.islower()) for n in names)


def test_names_concept_takes_snake_case_prefixes_only():
    assert names_concept("exposed_transfer_time", {"exposed_transfer_time_s"})
    assert names_concept("update_clock", {"update_clock"})
    assert not names_concept("update_clock", {"UpdateClock", "update_clocks"})
    assert not names_concept("leaf", {"leafy", "is_leaf", "LEAF_BYTES"})


def test_every_code_name_is_a_name_the_package_uses():
    names = package_names()
    assert {"accumulate_gradients", "accumulation_window", "UpdateClock"} <= names  # it read the package
    unused = [t.code_name for t in TERMS if not names_concept(t.code_name, names)]
    assert unused == [], f"glossary code names no identifier in trainmech/ uses: {unused}"


def test_every_name_in_the_readme_vocabulary_table_exists_in_its_modules():
    """The README's table of the package's vocabulary (module | concept | main names): each main name is an
    attribute of one of its row's modules (`Class.attr` followed; `plots.x` on the plots package; a call's
    arguments and the `<op>_…` pattern are not names)."""
    import importlib

    text = (REPO / "README.md").read_text(encoding="utf-8")
    table = text[text.index("### The package's vocabulary") :].split("\n### ")[0]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 20, "the vocabulary table was not found"
    missing = []
    for modules, _, names in rows:
        found = [
            importlib.import_module("trainmech." + m.rstrip("/")) for m in re.findall(r"`([^`]+)`", modules)
        ]
        for span in re.findall(r"`([^`]+)`", names):
            name = re.split(r"[(\s]", span)[0]
            if not name or name.startswith("<"):
                continue
            parts = name.split(".")
            if not any(_attribute(m, parts) or _attribute(m, parts[1:]) for m in found):
                missing.append(name)
    assert missing == [], f"README vocabulary names that no module of their row defines: {missing}"


def _attribute(obj, parts: list[str]) -> bool:
    for part in parts:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return bool(parts)


def test_data_abbreviations_and_forms():
    assert {t.en for t in TERMS if t.abbreviation_ok} == {"Autograd", "VJP"}
    memory = term("allocated_reserved")
    assert memory.en == "allocated / reserved memory"
    assert {("已分配显存", "allocated memory"), ("保留显存", "reserved memory")} <= set(memory.forms)
    assert all((t.zh, t.en) in t.forms for t in TERMS)


def test_term_lookup_by_code_name_or_zh_refuses_unknown():
    assert term("upstream_grad") is term("上游梯度")
    assert term("保留显存") is term("allocated_reserved")
    with pytest.raises(KeyError):
        term("训练显存")


# ---------------------------------------------------------------- first-use


def test_lint_first_use_requires_parenthesis(tmp_path):
    (f,) = lint_text(tmp_path, "前言。\n\n上游梯度沿路径传回。\n")
    assert (f.rule, f.cell) == ("first-use", 3)
    assert (
        str(f)
        == f'{tmp_path / "page.md"} line 3 [first-use] 上游梯度 first used without （upstream gradient）: "上游梯度沿路径传回。"'
    )


def test_lint_first_use_accepts_parenthesis_then_bare(tmp_path):
    text = "上游梯度（Upstream  Gradient）来自后续路径。之后的上游梯度不必再注英文。\n"
    text += "自动求导（autograd，即 `torch.autograd`）。**叶子张量**（leaf tensor）。\n"
    assert lint_text(tmp_path, text) == []


def test_lint_first_use_only_the_first_occurrence_counts(tmp_path):
    found = lint_text(tmp_path, "上游梯度很重要。\n\n上游梯度（upstream gradient）。\n")
    assert [(f.rule, f.cell) for f in found] == [("first-use", 1)]


def test_lint_first_use_rejects_wrong_english_and_half_width_parens(tmp_path):
    assert rules(lint_text(tmp_path, "上游梯度（upstream grad）。\n")) == ["first-use"]
    assert rules(lint_text(tmp_path, "上游梯度(upstream gradient)。\n")) == ["first-use"]


@pytest.mark.parametrize("zh,en", [f for t in TERMS for f in t.forms])
def test_lint_every_form_introduced_is_clean_and_bare_is_flagged(tmp_path, zh, en):
    assert lint_text(tmp_path, f"先看{zh}（{en}），再说{zh}。\n") == []
    assert rules(lint_text(tmp_path, f"先看{zh}。\n")) == ["first-use"]


def test_lint_first_use_ignores_code_and_is_per_document(tmp_path):
    assert lint_text(tmp_path, "变量 `上游梯度` 与代码块：\n\n```python\n# 上游梯度\n```\n") == []
    a = md(tmp_path, "上游梯度（upstream gradient）。\n", "a.md")
    b = md(tmp_path, "上游梯度。\n", "b.md")
    assert [f.file for f in lint_paths([a, b])] == [str(b)]


def test_lint_first_use_spans_notebook_cells_and_skips_code_cells(tmp_path):
    clean = notebook(tmp_path, [("code", "# 上游梯度"), "上游梯度（upstream gradient）。", "再看上游梯度。"])
    assert lint_paths([clean]) == []
    dirty = notebook(tmp_path, ["标题", ("code", "x = 1"), "上游梯度沿路径传回。"], "Task1_dirty.ipynb")
    (f,) = lint_paths([dirty], root=tmp_path)
    assert str(f).startswith("Task1_dirty.ipynb cell 2 [first-use] 上游梯度")


def test_lint_abbreviation_may_stand_alone_but_chinese_form_needs_parenthesis(tmp_path):
    assert lint_text(tmp_path, "VJP 与 Autograd 可以单独出现。\n") == []
    (f,) = lint_text(tmp_path, "VJP 就是向量—雅可比积。\n")
    assert f.message == "向量—雅可比积 first used without （VJP）"


def test_lint_activation_is_not_triggered_or_satisfied_by_longer_terms(tmp_path):
    assert (
        lint_text(tmp_path, "激活检查点（activation checkpointing）与激活卸载（activation offload）。\n")
        == []
    )
    found = lint_text(tmp_path, "激活检查点（activation checkpointing）。然后激活被释放。\n")
    assert [f.message for f in found] == ["激活 first used without （activation）"]
    found = lint_text(tmp_path, "激活（activation）。然后是激活检查点。\n")
    assert [f.message for f in found] == ["激活检查点 first used without （activation checkpointing）"]
    assert lint_text(tmp_path, "激活函数不是激活值（activation）。\n") == []


def test_lint_overlapping_names_are_distinct_terms(tmp_path):
    text = "梯度累积（gradient accumulation）之后，累计窗口与梯度汇合、有效更新（effective update）与有效批次。\n"
    messages = [f.message.split()[0] for f in lint_text(tmp_path, text)]
    assert messages == ["累计窗口", "梯度汇合", "有效批次"]


def test_lint_joint_memory_form_introduces_both(tmp_path):
    assert (
        lint_text(
            tmp_path, "已分配显存与保留显存（allocated / reserved memory）。之后保留显存、已分配显存。\n"
        )
        == []
    )
    assert (
        lint_text(
            tmp_path, "已分配显存（allocated memory）、保留显存（reserved memory）。已分配显存与保留显存。\n"
        )
        == []
    )
    found = lint_text(tmp_path, "已分配显存（allocated memory）。之后保留显存。\n")
    assert [f.message for f in found] == ["保留显存 first used without （reserved memory）"]


# ---------------------------------------------------------------- catch-all


def test_lint_catch_all_bare_is_flagged(tmp_path):
    (f,) = lint_text(tmp_path, "这些都算训练显存。\n")
    assert f.rule == "catch-all"


@pytest.mark.parametrize("quoted", ["“训练显存”", "「训练显存」", "`训练显存`", '"训练显存"'])
def test_lint_catch_all_quoted_is_allowed(tmp_path, quoted):
    assert lint_text(tmp_path, f"不要统称为{quoted}。\n") == []


# ---------------------------------------------------------------- english-in-prose


@pytest.mark.parametrize(
    "text", ["每个 step 之后清零。", "这次被 Skipped 了。", "前 10 steps 里。", "reserved 比 allocated 大。"]
)
def test_lint_english_in_prose_is_flagged(tmp_path, text):
    assert set(rules(lint_text(tmp_path, text + "\n"))) == {"english-in-prose"}


@pytest.mark.parametrize(
    "text",
    [
        "调用 `optimizer.step()` 完成更新。",
        "跳步（skip）不计入，**已分配显存**（allocated memory）。",
        "输出如下：\n\n```\nstep 3 skipped\n```",
        '公式 $\\text{step}_t$ 与链接 [说明](https://example.org/step) 和 <span class="step">。',
        "Each step is skipped when gradients overflow.",  # no CJK: not Chinese prose
        "逐步（stepwise）推导。",
    ],
)
def test_lint_english_in_code_gloss_or_english_text_is_allowed(tmp_path, text):
    assert lint_text(tmp_path, text + "\n") == []


def test_lint_english_in_table_is_prose(tmp_path):
    (f,) = lint_text(tmp_path, "| 字段 | 含义 |\n|---|---|\n| step | 更新次数 |\n| `skip` | 跳步 |\n")
    assert (f.rule, f.cell) == ("english-in-prose", 3)


def test_lint_refuses_other_files(tmp_path):
    with pytest.raises(ValueError):
        lint_paths([md(tmp_path, "x", "notes.txt")])


# ---------------------------------------------------------------- the page and main


def test_committed_glossary_page_is_current_and_lints_clean():
    page = REPO / "notebooks" / "reference" / "glossary.md"
    assert page.read_text(encoding="utf-8") == render_markdown(), (
        "run: python -m trainmech lint --write-glossary"
    )
    assert lint_paths([page]) == []


def test_rendered_page_names_every_term():
    page = render_markdown()
    for t in TERMS:
        assert f"## {t.zh}（{t.en}）\n" in page and f"`{t.code_name}`" in page


def test_main_returns_1_on_dirty_tree_and_0_on_clean(tmp_path, capsys):
    assert main(["--root", str(tmp_path)]) == 2  # no notebooks/ folder
    (tmp_path / "notebooks" / "reference").mkdir(parents=True)
    assert main(["--root", str(tmp_path), "--write-glossary"]) == 0
    assert (tmp_path / "notebooks" / "reference" / "glossary.md").read_text(
        encoding="utf-8"
    ) == render_markdown()
    notebook(tmp_path / "notebooks", ["上游梯度（upstream gradient）。"], "Task0_ok.ipynb")
    assert main(["--root", str(tmp_path)]) == 0
    md(tmp_path / "notebooks" / "reference", "每个 step 都算训练显存。\n", "bad.md")
    capsys.readouterr()
    assert main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert sorted(line.split("] ")[0] for line in out[:-1]) == [
        "notebooks/reference/bad.md line 1 [catch-all",
        "notebooks/reference/bad.md line 1 [english-in-prose",
    ]
    assert out[-1] == "glossary lint: 2 finding(s) in 1 of 3 file(s)"


def test_module_does_not_import_other_trainmech_modules():
    source = Path(glossary.__file__).read_text(encoding="utf-8")
    assert not re.search(r"^\s*(from trainmech|import trainmech|from \.)", source, re.M)
