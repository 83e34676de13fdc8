"""Run a few code cells in a real IPython kernel (nbclient), as the runner and nbval do, and
return the executed cells: what a notebook stores and JupyterLab shows, outputs included."""

from __future__ import annotations

from pathlib import Path

import nbformat

from trainmech.execution import notebook_client


def run_cells(*sources: str, env: dict[str, str] | None = None, timeout: int = 180) -> list:
    """Execute the sources as consecutive code cells (errors kept as outputs); the executed cells."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    # the runner's client (trainmech.execution.notebook_client), the kernel in this process's folder
    client = notebook_client(nb, Path.cwd() / "cells.ipynb", timeout=timeout, allow_errors=True)
    client.execute(**({"env": env} if env is not None else {}))
    return nb.cells


def text_of(cell, name: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == name)


def errors_of(cell) -> list:
    return [o for o in cell.outputs if o.output_type == "error"]
