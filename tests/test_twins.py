"""Text twins (trainmech.twins): every notebook has one, in step, and edits travel both ways."""

from __future__ import annotations

import json
import shutil

import pytest

from trainmech import twins

pytestmark = pytest.mark.package


def test_every_notebook_has_a_twin_in_step():
    out_of_step = twins.stale()
    assert not out_of_step, f"run python -m trainmech twins: {[p.name for p in out_of_step]}"
    assert {p.stem for p in twins.TWINS_DIR.glob("*.md")} == {p.stem for p in twins.notebooks()}


def test_a_twin_holds_the_inputs_and_no_outputs():
    nb = twins.notebooks(["Task0"])[0]
    text = twins.twin_path(nb).read_text(encoding="utf-8")
    data = json.loads(nb.read_text(encoding="utf-8"))
    first_code = next(c for c in data["cells"] if c["cell_type"] == "code" and c["outputs"])
    assert "".join(first_code["source"]).splitlines()[0] in text
    assert "image/png" not in text and '"outputs"' not in text
    assert ":tags: [parameters]" in text  # the runner's injection point survives in the twin


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A copy of Task0 and its twin where the module looks for them."""
    (tmp_path / "text").mkdir()
    nb = twins.notebooks(["Task0"])[0]
    shutil.copy(nb, tmp_path / nb.name)
    shutil.copy(twins.twin_path(nb), tmp_path / "text" / f"{nb.stem}.md")
    monkeypatch.setattr(twins, "NOTEBOOKS_DIR", tmp_path)
    monkeypatch.setattr(twins, "TWINS_DIR", tmp_path / "text")
    monkeypatch.setattr(twins, "REPO_ROOT", tmp_path)
    return tmp_path / nb.name


def test_an_edited_notebook_makes_its_twin_stale_until_rewritten(sandbox):
    data = json.loads(sandbox.read_text(encoding="utf-8"))
    data["cells"][0]["source"] = ["# changed title\n"]
    sandbox.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    assert twins.stale() == [sandbox]
    assert twins.main(["--check"]) == 1
    assert twins.write() == [twins.twin_path(sandbox)]
    assert twins.stale() == [] and twins.main(["--check"]) == 0


def test_an_edited_twin_carries_into_the_notebook_keeping_outputs_and_ids(sandbox):
    before = json.loads(sandbox.read_text(encoding="utf-8"))
    twin = twins.twin_path(sandbox)
    twin.write_text(
        twin.read_text(encoding="utf-8").replace("## 运行参数", "## 运行参数（改过）", 1), encoding="utf-8"
    )
    assert twins.from_text(["Task0"]) == [sandbox]
    after = json.loads(sandbox.read_text(encoding="utf-8"))
    assert [c["id"] for c in after["cells"]] == [c["id"] for c in before["cells"]]
    changed = [
        i for i, (a, b) in enumerate(zip(before["cells"], after["cells"])) if a["source"] != b["source"]
    ]
    assert len(changed) == 1 and "（改过）" in "".join(after["cells"][changed[0]]["source"])
    code = [i for i, c in enumerate(before["cells"]) if c["cell_type"] == "code"]
    assert all(after["cells"][i]["outputs"] == before["cells"][i]["outputs"] for i in code)
    assert twins.stale() == []


def test_an_unknown_notebook_is_refused_in_one_line(capsys):
    assert twins.main(["--only", "Task9"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_cell_id_rename_is_reappliable(tmp_path):
    """The rename map applies to a notebook, a page's citation and a gpu-check key; twice changes nothing more;
    an old id that is gone is skipped with a warning; a new id another cell holds is refused."""
    from trainmech import cellids
    from trainmech.errors import TrainmechError

    nb = {
        "cells": [
            {
                "cell_type": "code",
                "id": "cell-01",
                "metadata": {},
                "outputs": [],
                "execution_count": None,
                "source": "x = 1",
            },
            {"cell_type": "markdown", "id": "kept", "metadata": {}, "source": "# t"},
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (tmp_path / "Task9_x.ipynb").write_text(json.dumps(nb, indent=1), encoding="utf-8")
    page, keys, mapping = tmp_path / "page.md", tmp_path / "keys.py", tmp_path / "ids.toml"
    page.write_text(
        "see [Task9 · cell-01](../Task9_x.ipynb) and [Task9 · kept](../Task9_x.ipynb)\n", encoding="utf-8"
    )
    keys.write_text('CELLS = {"Task9:cell-01": "why"}\n', encoding="utf-8")
    mapping.write_text('[Task9]\n"cell-01" = "set-x"\n"cell-77" = "gone"\n', encoding="utf-8")
    run = lambda: cellids.apply(map_path=mapping, notebooks_dir=tmp_path, pages=(page,), keyed_files=(keys,))  # noqa: E731
    first = run()
    assert len(first.changed) == 3 and first.warnings == [
        "Task9_x.ipynb: no cell with id 'cell-77' (nor 'gone'); skipped"
    ]
    assert [c["id"] for c in json.loads((tmp_path / "Task9_x.ipynb").read_text())["cells"]] == [
        "set-x",
        "kept",
    ]
    assert page.read_text() == (
        "see [Task9 · set-x](../Task9_x.ipynb#cell-id=set-x) and "
        "[Task9 · kept](../Task9_x.ipynb#cell-id=kept)\n"
    )
    assert keys.read_text() == 'CELLS = {"Task9:set-x": "why"}\n'
    assert run().changed == []
    mapping.write_text('[Task9]\n"set-x" = "kept"\n', encoding="utf-8")
    with pytest.raises(TrainmechError, match="already has that id"):
        run()
