"""Run a few code cells in a real IPython kernel (nbclient), as the runner and nbval do, and
return the executed cells: what a notebook stores and JupyterLab shows, outputs included."""

from __future__ import annotations

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient


def run_cells(*sources: str, env: dict[str, str] | None = None, timeout: int = 180) -> list:
    """Execute the sources as consecutive code cells (errors kept as outputs); the executed cells."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    km = AsyncKernelManager(kernel_name="python3", transport_encryption="auto")  # CurveZMQ, as in .jupyter/
    client = NotebookClient(
        nb, km=km, timeout=timeout, allow_errors=True, record_timing=False, shutdown_kernel="immediate"
    )  # killed at the end, as nbval and the runner do: the interpreter's teardown would only cost time
    client.execute(
        cleanup_kc=True, **({"env": env} if env is not None else {})
    )  # shut the kernel down: we own km
    return nb.cells


def text_of(cell, name: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == name)


def errors_of(cell) -> list:
    return [o for o in cell.outputs if o.output_type == "error"]
