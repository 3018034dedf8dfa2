"""The analysis notebooks run from top to bottom on the sample traces (each checks its own
answer against hooktrace's), and they are committed stripped of outputs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parent.parent
ANALYSIS = ROOT / "analysis"
NOTEBOOKS = sorted(ANALYSIS.glob("*.ipynb"))


def test_there_is_a_notebook_for_each_question() -> None:
    names = [path.stem for path in NOTEBOOKS]
    assert names == [
        "01_first_divergence",
        "02_dead_units",
        "03_gradient_norms",
        "04_nan_origin",
        "05_distributions",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_is_stripped(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"
    assert set(notebook.metadata) <= {"kernelspec", "language_info"}, "extra notebook metadata"
    for cell in notebook.cells:
        assert cell.metadata == {}, f"{path.name}: cell {cell.id} has metadata"
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: cell {cell.id} has outputs"
            assert cell.execution_count is None, f"{path.name}: cell {cell.id} was run"


@pytest.fixture(scope="module")
def executed() -> dict[Path, NotebookNode | BaseException]:
    """Every notebook, run as Jupyter would from analysis/ (they read ../sample_traces/), all
    at once: most of a notebook's time is its kernel starting, which they can share."""

    async def run(path: Path) -> NotebookNode:
        notebook = nbformat.read(path, as_version=4)
        client = NotebookClient(
            notebook,
            timeout=120,
            kernel_name="python3",
            resources={"metadata": {"path": str(ANALYSIS)}},
        )
        await client.async_execute()  # raises CellExecutionError, with the cell's traceback
        return notebook

    async def run_all() -> list[NotebookNode | BaseException]:
        return await asyncio.gather(*(run(path) for path in NOTEBOOKS), return_exceptions=True)

    return dict(zip(NOTEBOOKS, asyncio.run(run_all()), strict=True))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs(path: Path, executed: dict[Path, NotebookNode | BaseException]) -> None:
    notebook = executed[path]
    if isinstance(notebook, BaseException):
        raise notebook
    errors = [
        output
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output.output_type == "error"
        or (output.output_type == "stream" and output.name == "stderr")
    ]
    assert errors == [], f"{path.name} wrote to stderr or failed: {errors}"
