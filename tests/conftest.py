from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parent.parent

# The tests check the one-pass kernel, so recordings here (and in the scripts they start)
# compile it where numba's cache lacks it instead of taking the eager route while a process of
# its own compiles it; tests/test_kernel_cache.py checks that default, unset.
os.environ.setdefault("HOOKTRACE_ONE_PASS", "wait")


SLOW_FIRST = (
    "recorder/stats/test_kernel_cache.py",  # a cold compile of its own, on the other core
    "transparency/test_sharded.py",
    "analyze/diff/test_layouts.py",
    "reliability/test_fuzz.py",
    "cli/test_cli_record.py",
    "transparency/test_transparency.py",
    "recorder/nonfinite/test_fsdp2_capture.py",
    "recorder/stats/test_device_batches.py",
    "reliability/test_kills.py",
)
"""Test files run first, slowest first (by CI's --durations): pytest-xdist hands tests out in
this order, so the run ends on short tests, not on a minute-long one while the other worker
waits."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.path.relative_to(ROOT / "tests").as_posix()
        return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: each file's own order, and the others', as collected


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def _torch_seeded() -> None:
    """Each test starts from one torch seed, whichever tests ran before it in its process:
    under pytest-xdist that depends on how the tests fall to workers, and a model built
    before a test seeds (``train(MLP(), ...)``) would start elsewhere each time. Only where
    torch is imported already: the analyzer's tests never import it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)
