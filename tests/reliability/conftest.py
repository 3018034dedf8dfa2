"""Figures for docs/RELIABILITY.md, and what the groups share.

Every case a group tries runs inside ``figures.case(group, name)``: it counts as tried on
entry and as survived only when its block finishes without an exception, so a failing
assertion (or an xfail) shows in the figures as well as in pytest's verdict. A case adds to
``lost`` whatever the group counts as lost (flushed steps that did not come back, parameter
bits that changed, files written outside a run). When ``HOOKTRACE_RELIABILITY_REPORT`` names
a file, the figures of the session are written there as JSON at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT_ENV = "HOOKTRACE_RELIABILITY_REPORT"

# group -> (title, what "lost" counts), in the order of docs/RELIABILITY.md
GROUPS = {
    "kills": (
        "Kills",
        "steps flushed before the signal (their part file renamed into place) that were "
        "missing or partial afterwards",
    ),
    "disk": (
        "Disk trouble during recording",
        "steps flushed before the fault that were missing or partial afterwards, plus runs "
        "whose training numbers changed",
    ),
    "bad_traces": (
        "Bad traces",
        "runs of a command that printed a traceback, hung, crashed, called its own code an "
        "internal error, or returned a result that hid what it skipped",
    ),
    "awkward": (
        "Awkward models and loops",
        "parameter and buffer tensors whose final value differed by any bit from an unrecorded run",
    ),
    "security": (
        "Security",
        "pickle calls, files written outside the run directory, or names left unescaped",
    ),
}


@dataclass
class Tally:
    tried: int = 0
    survived: int = 0
    lost: int = 0


class Case:
    """One case being tried; add to ``lost`` what the group counts as lost."""

    def __init__(self) -> None:
        self.lost = 0


class Figures:
    def __init__(self) -> None:
        self.tallies: dict[str, dict[str, Tally]] = {}

    @contextmanager
    def case(self, group: str, name: str) -> Iterator[Case]:
        assert group in GROUPS, group
        tally = self.tallies.setdefault(group, {}).setdefault(name, Tally())
        tally.tried += 1
        case = Case()
        try:
            yield case
        finally:
            tally.lost += case.lost
        tally.survived += 1  # reached only when the block raised nothing

    def count(self, group: str, name: str, *, survived: bool, lost: int = 0) -> None:
        """One case tried, outside a ``with`` block: for tests that try several at once."""
        assert group in GROUPS, group
        tally = self.tallies.setdefault(group, {}).setdefault(name, Tally())
        tally.tried += 1
        tally.survived += int(survived)
        tally.lost += lost

    def to_json(self) -> dict[str, object]:
        return {
            group: {
                "title": GROUPS[group][0],
                "lost_means": GROUPS[group][1],
                "cases": {name: asdict(t) for name, t in self.tallies[group].items()},
            }
            for group in GROUPS
            if group in self.tallies
        }


FIGURES = Figures()


@pytest.fixture
def figures() -> Figures:
    return FIGURES


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get(REPORT_ENV)
    if target and FIGURES.tallies:
        # under pytest-xdist each worker counts its own cases: a file each, which the report
        # adds up (one file for all, the last worker's figures were the page's)
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        path = Path(f"{target}.{worker}" if worker else target)
        path.write_text(json.dumps(FIGURES.to_json(), indent=2) + "\n")
