"""The code linter, as `make lint` runs it: ruff's checks and its formatter (configuration in pyproject.toml);
and every module of the package says what it exports (`__all__`).

Part of `make test`, so CI fails on a lint error or an unformatted file. The notebooks are not in
ruff's scope: nbval and the glossary lint check them.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.package

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_is_clean(command):
    run = subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]


def test_ruff_finds_what_it_is_configured_to_find(tmp_path):
    """The configuration is live: an unused import in a file under the package's rules is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"), str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and "F401" in run.stdout


def test_every_module_of_the_package_declares_its_exports():
    """`__all__` in every module (an empty list where the module only registers something at import).
    `__main__.py` files are exempt: a `python -m` entry point is run, never imported by name."""
    modules = [p for p in sorted((ROOT / "trainmech").rglob("*.py")) if p.name != "__main__.py"]
    assert len(modules) > 40  # the walk found the package

    def declares(path):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return True
        return False

    missing = [str(p.relative_to(ROOT)) for p in modules if not declares(p)]
    assert not missing, f"modules without __all__: {missing}"
