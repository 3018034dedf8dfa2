"""benchmarks/reliability_report.py, which writes docs/RELIABILITY.md: the figures of
pytest-xdist's workers add up, and the page's text is the script's (not edited by hand)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _report() -> ModuleType:
    path = ROOT / "benchmarks" / "reliability_report.py"
    spec = importlib.util.spec_from_file_location("reliability_report", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _group(title: str, cases: dict[str, tuple[int, int, int]]) -> dict[str, object]:
    return {
        "title": title,
        "lost_means": "what is lost",
        "cases": {n: {"tried": t, "survived": s, "lost": x} for n, (t, s, x) in cases.items()},
    }


def test_the_workers_figures_add_up_in_the_pages_order() -> None:
    """Each worker of ``-n`` reports its own cases (found: the page held one worker's)."""
    first = {
        "security": _group("Security", {"pickle": (4, 4, 0)}),
        "bad_traces": _group("Bad traces", {"check": (26, 26, 0), "diff": (27, 26, 1)}),
    }
    second = {
        "bad_traces": _group("Bad traces", {"diff": (27, 27, 0), "plot": (54, 54, 0)}),
        "kills": _group("Kills", {"SIGKILL": (9, 9, 0)}),
    }
    merged = _report().merged([first, second])
    assert list(merged) == ["kills", "bad_traces", "security"]
    assert merged["bad_traces"]["cases"] == {
        "check": {"tried": 26, "survived": 26, "lost": 0},
        "diff": {"tried": 54, "survived": 53, "lost": 1},
        "plot": {"tried": 54, "survived": 54, "lost": 0},
    }
    assert merged["bad_traces"]["title"] == "Bad traces"


def test_the_page_holds_the_scripts_text() -> None:
    """docs/RELIABILITY.md is written by the script: its fixed text is the script's, so a
    sentence added to the page by hand is not lost at the next run (found in review)."""
    report = _report()
    page = (ROOT / "docs" / "RELIABILITY.md").read_text()
    assert page.startswith(report.INTRO)
    assert page.endswith(report.LIMITS)
    for details in report.DETAILS.values():
        assert details in page
