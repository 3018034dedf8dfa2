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
