"""A trace's records a window of steps at a time, each row group read once
(trace/stream.py): the same rows as queries of the same windows, in the same order."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from repo import FIXTURES
from scale_runs import generate_trace, many_parts, with_nulls

import hooktrace
from hooktrace.errors import TraceWarning
from hooktrace.trace.stream import RecordStream

COLUMNS = ["rank", "step", "seq", "module", "kind", "mean"]


def _small_row_groups(run: Path, rows: int) -> None:
    """Rewrite every records part in row groups of ``rows`` rows: groups that hold the end
    of one step and the start of the next, as a part's 65,536-row groups do."""
    for part in sorted((run / "records").glob("rank=*/part-*.parquet")):
        table = pq.read_table(part)
        pq.write_table(table, part, row_group_size=rows, write_page_checksum=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "run"
    for rank in (0, 1):  # two ranks, each in its own parts
        generate_trace(path, steps=12, modules=5, rank=rank, world_size=2,
                       writer_options={"max_buffer_bytes": 1})  # fmt: skip
    _small_row_groups(path, 7)
    return path


def _watch(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    read: list[tuple[str, int]] = []
    read_group = RecordStream._read

    def watched(self: RecordStream, rank: int, queue: Any) -> list[pa.Table]:
        read.append((queue[0].part.name + queue[0].part.parent.name, queue[0].index))
        return read_group(self, rank, queue)

    monkeypatch.setattr(RecordStream, "_read", watched)
    return read


@pytest.mark.parametrize("windows", [[11], [0, 1, 2, 11], [3, 4, 9, 11], [5, 5, 11]])
def test_windows_hand_out_what_queries_of_them_read_each_row_group_once(
    run: Path, monkeypatch: pytest.MonkeyPatch, windows: list[int]
) -> None:
    trace = hooktrace.load(run)
    read = _watch(monkeypatch)
    stream = trace.stream(columns=COLUMNS)
    start, handed = 0, 0
    for last in windows:
        got = stream.through(last).select(COLUMNS)
        expected = trace.query_table(columns=COLUMNS, steps=(start, last)).select(COLUMNS)
        assert got.to_pylist() == expected.to_pylist(), (start, last)  # names, not codes
        start, handed = last + 1, handed + got.num_rows
    assert len(read) == len(set(read))  # no row group twice
    groups = sum(trace._metadata[p].num_row_groups for p in trace._parts["records"])
    assert len(read) == groups and handed == trace.record_count


def test_filters_and_a_span_read_only_the_row_groups_that_may_hold_them(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = hooktrace.load(run)
    read = _watch(monkeypatch)
    stream = trace.stream(columns=COLUMNS, steps=(4, 6), kinds=["output"], ranks=[1])
    got = stream.through(6).select(COLUMNS)
    expected = trace.query_table(columns=COLUMNS, steps=(4, 6), kinds=["output"], ranks=[1])
    assert got.to_pylist() == expected.select(COLUMNS).to_pylist() and got.num_rows > 0
    assert stream.through(100).num_rows == 0
    spans = [g for g in read]
    assert spans and len(spans) < sum(
        trace._metadata[p].num_row_groups for p in trace._parts["records"]
    )


def test_a_damaged_part_is_left_out_with_a_warning_and_the_rest_handed_out(
    tmp_path: Path,
) -> None:
    run = many_parts(tmp_path / "run")
    _small_row_groups(run, 13)
    part = sorted((run / "records" / "rank=0").glob("part-*.parquet"))[5]
    metadata = pq.read_metadata(part)
    column = metadata.row_group(0).column(metadata.schema.names.index("mean"))
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data = bytearray(part.read_bytes())
    data[start + column.total_compressed_size - 4] ^= 0x01  # in its last page
    part.write_bytes(bytes(data))
    trace = hooktrace.load(run)
    whole = sum(trace._metadata[p].num_rows for p in trace._parts["records"])
    lost = trace._metadata[part].num_rows
    with pytest.warns(TraceWarning, match="part-000005"):
        got = trace.stream(columns=COLUMNS).through(10**9)
    assert got.num_rows == whole - lost
    assert part not in trace._parts["records"] and trace.skipped


def test_where_full_tensors_live_is_made_from_one_value_not_decoded(tmp_path: Path) -> None:
    from hooktrace.trace.stream import _constant, _repeat

    table = pa.table(
        {
            "segment": pa.array(["tensors/rank=0/seg-000001.h5"] * 3).dictionary_encode(),
            "tensor_key": pa.array(["", "", ""]),
            "phase": pa.array(["train"] * 3).dictionary_encode(),  # a value: always decoded
            "shape": pa.array(["2", "2", "2"]),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    found = _constant(pq.read_metadata(tmp_path / "t.parquet").row_group(0))
    assert found == {"segment": "tensors/rank=0/seg-000001.h5", "tensor_key": ""}
    for name, value in found.items():
        made = _repeat(value, 3, table.schema.field(name).type)
        assert made.type == table.schema.field(name).type
        assert made.to_pylist() == table.column(name).to_pylist()
    saved = table.set_column(1, "tensor_key", pa.array(["", "t1", ""]))
    pq.write_table(saved, tmp_path / "t.parquet")
    assert "tensor_key" not in _constant(pq.read_metadata(tmp_path / "t.parquet").row_group(0))


def test_parts_whose_names_do_not_sort_by_step_are_read_by_step(tmp_path: Path) -> None:
    """Part names past 999,999 sort before shorter ones: the groups go by their first step."""
    import shutil

    original = many_parts(tmp_path / "a", steps=12)
    renamed = tmp_path / "b"
    shutil.copytree(original, renamed)
    parts = sorted((renamed / "records" / "rank=0").glob("part-*.parquet"))
    for i, part in enumerate(parts):
        part.rename(part.with_name(f"part-{999_995 + i}.parquet.tmp"))
    for part in sorted((renamed / "records" / "rank=0").glob("*.tmp")):
        part.rename(part.with_suffix(""))
    names = sorted(p.name for p in (renamed / "records" / "rank=0").glob("part-*.parquet"))
    assert names[0].startswith("part-1000000")  # a later step's part is listed first
    trace = hooktrace.load(renamed)
    stream, start = trace.stream(columns=COLUMNS), 0
    for last in (2, 5, 11):
        got = stream.through(last).select(COLUMNS).to_pandas()
        got = got.sort_values(["rank", "step", "seq"])
        expected = trace.query(columns=COLUMNS, steps=(start, last))
        assert got.reset_index(drop=True).astype(str).equals(expected.astype(str))
        start = last + 1
    result = hooktrace.diff(original, renamed, chunk_rows=30)
    assert result.match and result.records == trace.record_count


def test_a_damaged_part_read_by_two_streams_of_one_trace_is_left_out_once(
    tmp_path: Path,
) -> None:
    run = many_parts(tmp_path / "run", steps=12)
    part = sorted((run / "records" / "rank=0").glob("part-*.parquet"))[4]
    metadata = pq.read_metadata(part)
    column = metadata.row_group(0).column(metadata.schema.names.index("mean"))
    data = bytearray(part.read_bytes())
    data[column.data_page_offset + column.total_compressed_size - 4] ^= 0x01
    part.write_bytes(bytes(data))
    trace = hooktrace.load(run)
    with pytest.warns(TraceWarning, match="part-000004"):
        result = hooktrace.diff(trace, trace)
    assert result.match and len(trace.skipped) == 1
    assert any("unreadable file" in note for note in result.notes)


def test_every_column_diff_reads_comes_out_as_the_query_reads_it(run: Path) -> None:
    from hooktrace.analyze.diff.compare import KEYS, VALUES

    trace = hooktrace.load(run)
    columns = [*KEYS, *VALUES, "note", "call_spec", "units"]
    got = trace.stream(columns=columns).through(5).select(columns)
    expected = trace.query_table(columns=columns, steps=(0, 5)).select(columns)
    assert got.schema == expected.schema
    assert got.to_pylist() == expected.to_pylist()


def test_row_groups_without_step_statistics_are_read_when_their_steps_are_due(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run"
    generate_trace(path, steps=12, modules=5, writer_options={"max_buffer_bytes": 1})
    for part in sorted((path / "records").glob("rank=*/part-*.parquet")):  # as another tool
        table = pq.read_table(part)  # might rewrite them
        pq.write_table(table, part, row_group_size=7, write_statistics=False)
    trace = hooktrace.load(path)
    read = _watch(monkeypatch)
    stream = trace.stream(columns=COLUMNS)
    got = stream.through(0).select(COLUMNS)
    assert got.to_pylist() == trace.query_table(columns=COLUMNS, steps=(0, 0)).to_pylist()
    held = sum(t.num_rows for t in stream._held.values())
    assert held < 7 and len(read) <= 4  # what step 0 needs, not the whole rank
    assert stream.through(11).num_rows + got.num_rows == trace.record_count
    assert hooktrace.diff(path, path, chunk_rows=20).match


def test_filters_on_columns_not_handed_out_and_sets_of_steps_keep_what_queries_keep(
    run: Path,
) -> None:
    # the filter reads module, phase and step; only rank, seq and mean are asked for
    trace = hooktrace.load(run)
    chosen = {"modules": ["blocks.1.fc", "blocks.0.relu"], "phases": ["train"], "ranks": [0]}
    columns = ["rank", "seq", "mean"]
    got = trace.stream(columns=columns, steps=[1, 4, 5, 9], **chosen).through(11)
    expected = trace.query_table(columns=columns, steps=[1, 4, 5, 9], **chosen)
    assert got.select(columns).to_pylist() == expected.select(columns).to_pylist()
    assert 0 < got.num_rows < trace.record_count


def test_a_span_cuts_the_row_groups_that_cross_it_and_only_those(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    generate_trace(run, steps=12, modules=5)  # one part
    _small_row_groups(run, 7)  # 22 records a step: groups that hold two steps
    filtered: list[int] = []
    cut = RecordStream._in_span

    def watched(self: RecordStream, table: pa.Table, group: Any) -> pa.Table:
        kept = cut(self, table, group)
        filtered.append(int(kept is not table))
        return kept

    monkeypatch.setattr(RecordStream, "_in_span", watched)
    trace = hooktrace.load(run)
    got = trace.stream(columns=COLUMNS, steps=(3, 8)).through(8)
    expected = trace.query_table(columns=COLUMNS, steps=(3, 8))
    assert got.select(COLUMNS).to_pylist() == expected.select(COLUMNS).to_pylist()
    assert set(got.column("step").to_pylist()) == set(range(3, 9))
    # the groups that cross step 3 or step 8 are cut; those inside are handed out as read
    assert 0 < sum(filtered) < len(filtered)


def test_a_trace_older_than_a_column_hands_it_out_null() -> None:
    old = FIXTURES / "healthy_1_0"  # before notes (1.1)
    trace = hooktrace.load(old)
    columns = ["step", "seq", "module", "note", "mean"]
    got = trace.stream(columns=columns).through(10**9)
    expected = trace.query_table(columns=columns)
    assert got.select(columns).to_pylist() == expected.select(columns).to_pylist()
    assert got.num_rows == trace.record_count and got.column("note").null_count == got.num_rows


def test_a_part_written_with_other_types_is_handed_out_as_the_schema_types_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run"
    generate_trace(path, steps=4, modules=3)
    for part in sorted((path / "records").glob("rank=*/part-*.parquet")):  # as another tool
        table = pq.read_table(part)  # might rewrite them: plain strings, wider integers
        table = table.set_column(
            table.schema.get_field_index("module"),
            "module",
            table.column("module").cast(pa.string()),
        )
        table = table.set_column(
            table.schema.get_field_index("call"), "call", table.column("call").cast(pa.int64())
        )
        pq.write_table(table, part)
    trace = hooktrace.load(path)
    columns = ["step", "module", "call", "kind", "mean"]
    got = trace.stream(columns=columns, modules=["blocks.1.fc"]).through(3).select(columns)
    expected = trace.query_table(columns=columns, modules=["blocks.1.fc"]).select(columns)
    assert got.schema == expected.schema and got.schema.field("call").type == pa.int32()
    assert got.to_pylist() == expected.to_pylist() and got.num_rows > 0


class _SlowList(list):  # type: ignore[type-arg]
    """A list whose membership test lets other threads run before it answers."""

    def __contains__(self, item: object) -> bool:
        found = super().__contains__(item)
        time.sleep(0.01)
        return found


def test_a_part_found_damaged_by_many_threads_at_once_is_left_out_once(tmp_path: Path) -> None:
    # the two streams of a diff of a trace with itself read in two threads
    run = many_parts(tmp_path / "run", steps=12)
    trace = hooktrace.load(run)
    trace._parts["records"] = _SlowList(trace._parts["records"])
    part = trace._parts["records"][3]
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def drop() -> None:
        start.wait()
        try:
            trace._drop("records", part, "damaged")
        except BaseException as exc:  # reported below
            errors.append(exc)

    with pytest.warns(TraceWarning, match=part.name) as caught:
        threads = [threading.Thread(target=drop) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert len([w for w in caught if part.name in str(w.message)]) == 1
    assert part not in trace._parts["records"] and len(trace.skipped) == 1


def test_a_set_of_steps_reads_only_the_row_groups_that_hold_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    generate_trace(run, steps=12, modules=5)  # one part, 22 records a step
    _small_row_groups(run, 7)
    trace = hooktrace.load(run)
    read = _watch(monkeypatch)
    got = trace.stream(columns=COLUMNS, steps=[0, 11]).through(11)
    expected = trace.query_table(columns=COLUMNS, steps=[0, 11])
    assert got.select(COLUMNS).to_pylist() == expected.select(COLUMNS).to_pylist()
    assert set(got.column("step").to_pylist()) == {0, 11}
    assert len(read) == 8  # 4 groups of 7 hold step 0's 22 records, 4 step 11's; not 38


def test_records_without_a_step_are_not_in_a_span(tmp_path: Path) -> None:
    # a part rewritten by another tool, with nulls where the schema has none: the footer's
    # statistics leave them out, and the group seems to lie inside the span
    path = tmp_path / "run"
    generate_trace(path, steps=4, modules=3)
    with_nulls(sorted((path / "records").glob("rank=*/part-*.parquet"))[0], "step", [5, 6])
    trace = hooktrace.load(path)
    stream = trace.stream(columns=COLUMNS, steps=(0, 3))
    got = stream.through(3)
    assert got.num_rows == trace.record_count - 2 and got.column("step").null_count == 0
    assert not stream._held  # not kept for a window that never comes


def _open_parts(run: Path) -> list[str]:
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(run)) and target.endswith(".parquet"):
            found.append(target)
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_stream_holds_no_file_open_between_windows(run: Path) -> None:
    # a run of a thousand ranks would otherwise hold a thousand files, past the limit
    stream = hooktrace.load(run).stream(columns=COLUMNS)
    assert stream.through(4).num_rows > 0
    assert _open_parts(run) == []


class _ScanningList(list):  # type: ignore[type-arg]
    """A list whose membership test lets another thread run half-way through its scan."""

    def __init__(self, items: list[Path], halfway: threading.Event, go: threading.Event):
        super().__init__(items)
        self.halfway, self.go = halfway, go

    def __contains__(self, item: object) -> bool:
        for i in range(len(self)):
            if i == 3:
                self.halfway.set()
                self.go.wait(0.5)  # the other thread runs meanwhile
            if i < len(self) and self[i] == item:
                return True
        return False


def test_a_part_is_not_missed_while_another_is_being_left_out(tmp_path: Path) -> None:
    # a list that shrinks under a scan of it can skip what the scan looks for: a part read
    # by one stream, while the other stream leaves an earlier part out
    run = many_parts(tmp_path / "run", steps=12)
    trace = hooktrace.load(run)
    parts = list(trace._parts["records"])
    halfway, go = threading.Event(), threading.Event()
    trace._parts["records"] = _ScanningList(parts, halfway, go)

    def drop() -> None:
        halfway.wait(5)
        trace._drop("records", parts[0], "damaged")
        go.set()

    dropping = threading.Thread(target=drop)
    dropping.start()
    with pytest.warns(TraceWarning, match=parts[0].name):
        held = trace._holds("records", parts[3])
        dropping.join()
    assert held
