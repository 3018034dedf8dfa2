"""Small synthetic runs of many parts, for the analyzer's scale paths: made through the real
writer by ``benchmarks/synthetic.py``, without torch."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from synthetic import generate_trace, module_names

__all__ = ["generate_trace", "many_parts", "module_names"]


def many_parts(path: Path, *, steps: int = 40, modules: int = 10, **faults: object) -> Path:
    """A run of ``steps`` steps of 40 records each (10 modules), a part about every step (the writer flushes as each step waits)."""
    generate_trace(
        path, steps=steps, modules=modules, writer_options={"max_buffer_bytes": 1},
        **faults,  # type: ignore[arg-type]
    )  # fmt: skip
    return path
