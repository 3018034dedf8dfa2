"""``hooktrace.check`` streams: each part a batch at a time, nothing of the trace held whole."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from scale_runs import many_parts

import hooktrace
from hooktrace.trace import check_parts
from hooktrace.trace.reader import Trace


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return many_parts(tmp_path / "run", dead_units=2)


def test_check_never_loads_the_records_whole(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("check read the records through Trace.query")

    monkeypatch.setattr(Trace, "query", refuse)
    monkeypatch.setattr(check_parts, "_BATCH_ROWS", 7)  # batches across steps and row groups
    report = hooktrace.check(run)
    assert report.whole, report.problems
    assert report.steps == 40


def test_a_damaged_page_in_one_part_is_lost_and_the_rest_counted(run: Path) -> None:
    part = sorted((run / "records" / "rank=0").glob("part-*.parquet"))[5]
    column = pq.read_metadata(part).row_group(0).column(11)  # mean: plain float64 pages
    assert column.path_in_schema == "mean"
    data = bytearray(part.read_bytes())
    data[column.data_page_offset + column.total_compressed_size - 4] ^= 0x01
    part.write_bytes(bytes(data))
    report = hooktrace.check(run)
    assert not report.whole
    assert any("unreadable, left out: records/rank=0/part-000005" in p for p in report.problems)
    lost = [p for p in report.problems if "are readable: files were deleted or damaged" in p]
    assert lost and "rank 0 wrote 1600 records of 40 step(s)" in lost[0]


def test_records_pointing_past_the_activity_are_found(run: Path) -> None:
    part = sorted((run / "records" / "rank=0").glob("part-*.parquet"))[2]
    table = pq.read_table(part)
    offsets = table.column("activity_offset").to_numpy().copy()
    offsets[offsets >= 0] += 1 << 20
    index = table.schema.get_field_index("activity_offset")
    pq.write_table(
        table.set_column(index, table.schema.field(index), [offsets]), part, row_group_size=16
    )
    report = hooktrace.check(run)
    assert any("records point past the end of /activity" in p for p in report.problems)


def test_segments_problems_come_in_the_segments_order(run: Path) -> None:
    # read two at a time, reported one after the other as the segments sort: a damaged one
    # before a missing one after it
    segments = sorted((run / "tensors" / "rank=0").glob("*.h5"))
    assert len(segments) >= 3
    segments[0].write_bytes(b"not an HDF5 file" * 64)
    segments[1].unlink()
    report = hooktrace.check(run)
    found = [p for p in report.problems if p.startswith("segment ")]
    assert len(found) == 2, report.problems
    assert found[0].startswith(f"segment tensors/rank=0/{segments[0].name} is damaged (")
    assert found[1] == (
        f"segment tensors/rank=0/{segments[1].name} is missing: its activity and full "
        "tensors are lost"
    )
