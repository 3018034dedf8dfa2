"""Where the repository's files are, for tests at any depth of ``tests/``."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SAMPLES = ROOT / "sample_traces"
GOLDEN = TESTS / "golden"
FIXTURES = TESTS / "fixtures"
