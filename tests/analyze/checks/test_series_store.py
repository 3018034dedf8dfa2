"""SeriesStore: chunks of per-step values go in by step, come back whole per module."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from repo import SAMPLES

import hooktrace
from hooktrace.analyze.checks import series_store
from hooktrace.analyze.checks.series_store import SeriesStore
from hooktrace.trace import sql


def test_values_come_back_whole_per_module_in_order() -> None:
    con = sql.open_connection()
    store = SeriesStore(con)
    names = [f"m{i}" for i in range(7)]
    for first in range(0, 30, 4):  # chunks of 4 steps, every module in each
        steps = np.arange(first, min(first + 4, 30))
        chunk = pd.DataFrame(
            [(r, m, s, float(s * 10 + m), m) for s in steps for r in (1, 0) for m in range(7)],
            columns=["rank", "module", "step", "value", "seq"],
        )
        con.register("chunk", chunk)
        store.insert("norms", "SELECT * FROM chunk")
        con.unregister("chunk")
    tables = list(store.tables("norms", names, rows=5))
    assert list(store.tables("other", names)) == []
    store.close()
    assert "hooktrace_norms" not in str(con.sql("SHOW TABLES").fetchall())
    con.close()
    assert len(tables) > 3
    seen: list[tuple[int, str]] = []
    for table in tables:
        for (rank, module), group in table.groupby(["rank", "module"], observed=True, sort=False):
            seen.append((int(rank), str(module)))
            assert group["step"].tolist() == list(range(30))
            assert group["value"].tolist() == [s * 10.0 + int(str(module)[1:]) for s in range(30)]
    assert seen == [(r, n) for r in (0, 1) for n in names]


@pytest.mark.parametrize("run", ["exploding", "nan", "dead", "healthy"])
def test_findings_do_not_depend_on_the_batch(run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = hooktrace.anomalies(SAMPLES / run).findings
    monkeypatch.setattr(series_store, "BATCH_ROWS", 7)  # a module in several batches
    pd.testing.assert_frame_equal(hooktrace.anomalies(SAMPLES / run).findings, whole)
