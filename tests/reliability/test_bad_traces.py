"""Bad traces: every analyzer command on corrupted and wrong inputs.

Each corruption is applied to a fresh copy of a small real trace, then every command of
``hooktrace.cli.COMMANDS`` but ``record`` runs on it (commands added later are covered without
editing this file; ``diff`` gets a good run first and the damaged one second). An answer is
acceptable when it is

- a one-line error with exit code 2, or
- a result (exit 0 or 1) that is either the same as on the undamaged trace, or says what it
  skipped (names the damaged file or field);

and never a traceback, an "internal error", a hang, a crash or another exit code. Beyond
that: inputs that are not a readable run must be refused (exit 2), and ``hooktrace check``
must never call a damaged trace whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import hooktrace
from hooktrace.errors import TraceError

from .conftest import Figures
from .helpers import (
    HANG_SECONDS,
    Outcome,
    analyzer_commands,
    argv_for,
    normalise,
    problems_with_error,
    run_cli,
)
from .traces import record_small

RECORDS = "records/rank=0/part-000000.parquet"
STEPS = "steps/rank=0/part-000000.parquet"
MODULES = "modules/rank=0/part-000000.parquet"
SEGMENT = "tensors/rank=0/seg-000000.h5"
STATUS = "status/rank=0.json"


@dataclass(frozen=True)
class Corruption:
    """``make`` damages a fresh copy of the good run and returns the path to give commands.

    expect: ``refuse`` (exit 2 for every command), ``damage`` (a file or field the trace
    holds is damaged: a changed answer must name ``mention``), ``loss`` (something is gone:
    ``check`` must say so, naming ``mention``), ``odd`` (valid but unusual: ``extra`` judges).
    """

    name: str
    expect: Literal["refuse", "damage", "loss", "odd"]
    make: Callable[[Path], Path]
    mention: str = ""
    extra: Callable[[str, Outcome, Outcome], list[str]] | None = None


# -- ways to damage a trace ---------------------------------------------------------------------


def _edit_json(relative: str, **changes: object) -> Callable[[Path], Path]:
    def make(run: Path) -> Path:
        path = run / relative
        payload = json.loads(path.read_text())
        for key, value in changes.items():
            if value is _DELETE:
                payload.pop(key, None)
            else:
                payload[key] = value
        path.write_text(json.dumps(payload))
        return run

    return make


_DELETE = object()


def _write(relative: str, content: bytes) -> Callable[[Path], Path]:
    def make(run: Path) -> Path:
        (run / relative).write_bytes(content)
        return run

    return make


def _truncate(relative: str, keep: float = 0.5) -> Callable[[Path], Path]:
    def make(run: Path) -> Path:
        data = (run / relative).read_bytes()
        (run / relative).write_bytes(data[: int(len(data) * keep)])
        return run

    return make


def _flip_bits(
    relative: str, *, region: str, flips: int = 8, seed: int = 0
) -> Callable[[Path], Path]:
    """Flip bits in the middle of the file, or (Parquet) in its footer's metadata."""

    def make(run: Path) -> Path:
        path = run / relative
        data = bytearray(path.read_bytes())
        if region == "footer":
            footer = int.from_bytes(data[-8:-4], "little")
            lo, hi = len(data) - 8 - footer, len(data) - 8
        else:
            lo, hi = len(data) // 4, len(data) * 3 // 4
        rng = random.Random(seed)
        for _ in range(flips):
            data[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return run

    return make


def _delete(relative: str) -> Callable[[Path], Path]:
    def make(run: Path) -> Path:
        path = run / relative
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        return run

    return make


def _replace_by_dir(relative: str) -> Callable[[Path], Path]:
    def make(run: Path) -> Path:
        (run / relative).unlink()
        (run / relative).mkdir()
        return run

    return make


def _replace_by_fifo(relative: str) -> Callable[[Path], Path]:
    """A named pipe: opening it to read blocks until someone writes. A hang if read."""

    def make(run: Path) -> Path:
        (run / relative).unlink()
        os.mkfifo(run / relative)
        _unblock_later(run / relative)
        return run

    return make


def _unblock_later(fifo: Path) -> None:
    """A reader blocked in C++ on the pipe would hang this process for good (the alarm's
    signal handler runs only when control is back in Python): past the hang limit, open the
    pipe's other end, so that the reader returns and the alarm reports the hang."""

    def unblock() -> None:
        time.sleep(HANG_SECONDS + 1)
        while fifo.exists():
            with contextlib.suppress(OSError):  # no reader (ENXIO), or the test is over
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            time.sleep(0.2)

    threading.Thread(target=unblock, daemon=True).start()


def _move_part(to_dir: str) -> Callable[[Path], Path]:
    def make(run: Path) -> Path:
        target = run / "records" / to_dir
        target.mkdir()
        shutil.move(run / RECORDS, target / "part-000000.parquet")
        return run

    return make


def _non_utf8_part_name(run: Path) -> Path:
    directory = os.fsencode(run / "records" / "rank=0")
    os.rename(os.fsencode(run / RECORDS), directory + b"/part-\xff.parquet")
    return run


def _non_utf8_run_dir(run: Path) -> Path:
    target = os.fsencode(run.parent) + b"/run-\xff"
    os.rename(os.fsencode(run), target)
    return Path(os.fsdecode(target))


def _foreign_table(relative: str) -> Callable[[Path], Path]:
    def make(run: Path) -> Path:
        pq.write_table(pa.table({"loss": [0.5, 0.25], "epoch": [1, 2]}), run / relative)
        return run

    return make


def _step_as_text(run: Path) -> Path:
    """Every column there, but ``step`` holds words: no hooktrace writer makes that."""
    path = run / RECORDS
    table = pq.read_table(path)
    words = pa.array([f"step {s}" for s in table.column("step").to_pylist()])
    pq.write_table(table.set_column(table.schema.get_field_index("step"), "step", words), path)
    return run


def _non_utf8_module_names(run: Path) -> Path:
    """The module column's dictionary holds bytes that are not UTF-8 (pyarrow writes them
    without checking when the array is built from raw buffers)."""
    path = run / RECORDS
    table = pq.read_table(path)
    index = table.schema.get_field_index("module")
    column = table.column(index).combine_chunks()
    names = column.dictionary
    _, offsets, data = names.buffers()
    raw = bytearray(data.to_pybytes())
    raw[0] = 0xFF
    bad = pa.StringArray.from_buffers(len(names), offsets, pa.py_buffer(bytes(raw)))
    table = table.set_column(index, "module", pa.DictionaryArray.from_arrays(column.indices, bad))
    pq.write_table(table, path)
    return run


def _empty_dir(run: Path) -> Path:
    empty = run.parent / "empty"
    empty.mkdir()
    return empty


def _missing(run: Path) -> Path:
    return run.parent / "no-such-run"


def _a_file(run: Path) -> Path:
    path = run.parent / "run.txt"
    path.write_text("not a run\n")
    return path


def _nothing_flushed(run: Path) -> Path:
    for name in ("records", "steps", "modules", "tensors"):
        shutil.rmtree(run / name)
        (run / name / "rank=0").mkdir(parents=True)
    status = json.loads((run / STATUS).read_text())
    status.update(status="recording", end_time=None, steps_written=0, records_written=0)
    (run / STATUS).write_text(json.dumps(status))
    return run


def _stray_files(run: Path) -> Path:
    (run / "NOTES.txt").write_text("lr 0.1, seed 0\n")
    (run / "records" / "rank=0" / "README").write_text("hand-written\n")
    return run


def _leftover_tmp(run: Path) -> Path:
    shutil.copy(run / RECORDS, run / "records" / "rank=0" / ".part-000001.parquet.tmp")
    return run


def _different_model(run: Path) -> Path:
    shutil.rmtree(run)
    return record_small(run, other_model=True)


# -- what each answer must be -------------------------------------------------------------------


def _diff_must_differ(command: str, outcome: Outcome, good: Outcome) -> list[str]:
    if command == "diff" and outcome.code == 0:
        return ["diff says two runs of different models match"]
    return []


def _check_must_flag(command: str, outcome: Outcome, good: Outcome) -> list[str]:
    if command == "check" and outcome.code != 1:
        return [f"check exits {outcome.code} on a run that claims a huge world_size"]
    return []


def _same_as_good(command: str, outcome: Outcome, good: Outcome) -> list[str]:
    if (outcome.code, outcome.stdout) != (good.code, good.stdout):
        return ["stray files that are not part files changed the answer"]
    return []


CORRUPTIONS = [
    # not a readable run: refused
    Corruption("missing path", "refuse", _missing, "no run at"),
    Corruption("empty directory", "refuse", _empty_dir, "not a hooktrace run"),
    Corruption("a file instead of a directory", "refuse", _a_file, "is a file"),
    Corruption("manifest missing", "refuse", _delete("manifest.json"), "no manifest.json"),
    Corruption("manifest empty", "refuse", _write("manifest.json", b""), "manifest"),
    Corruption("manifest not JSON", "refuse", _write("manifest.json", b"{format: hooktrace"), "manifest"),
    Corruption("manifest a JSON list", "refuse", _write("manifest.json", b"[1, 2]"), "manifest"),
    Corruption("manifest not UTF-8", "refuse", _write("manifest.json", b'{"format": "\xff\xfe"}'), "manifest"),
    Corruption("manifest a directory", "refuse", _replace_by_dir("manifest.json"), "manifest"),
    Corruption("manifest a named pipe", "refuse", _replace_by_fifo("manifest.json"), "manifest"),
    Corruption("manifest of another format", "refuse", _edit_json("manifest.json", format="wandb"), "not a hooktrace manifest"),
    Corruption("format version from the future", "refuse", _edit_json("manifest.json", format_version="2.0"), "upgrade hooktrace"),
    Corruption("format version not a version", "refuse", _edit_json("manifest.json", format_version="one"), "format_version"),
    Corruption("format version missing", "refuse", _edit_json("manifest.json", format_version=_DELETE), "format_version"),
    Corruption("run path not UTF-8", "refuse", _non_utf8_run_dir, "not valid UTF-8"),
    # a damaged file or field: left out, and said so
    Corruption("world_size not a number", "damage", _edit_json("manifest.json", world_size="two"), "world_size"),
    Corruption("world_size negative", "damage", _edit_json("manifest.json", world_size=-1), "world_size"),
    Corruption("start_time not a number", "damage", _edit_json("manifest.json", start_time="yesterday"), "start_time"),
    Corruption("command not a list", "damage", _edit_json("manifest.json", command="python train.py"), "command"),
    Corruption("status not JSON", "damage", _write(STATUS, b"{status"), STATUS),
    Corruption("status a JSON list", "damage", _write(STATUS, b"[]"), STATUS),
    Corruption("status unknown", "damage", _edit_json(STATUS, status="exploded"), "unknown status"),
    Corruption("status end_time not a number", "damage", _edit_json(STATUS, end_time="soon"), "end_time"),
    Corruption("status counts not numbers", "damage", _edit_json(STATUS, steps_lost="many"), "steps_lost"),
    Corruption("status data_parallel out of its size", "damage", _edit_json(STATUS, data_parallel={"size": 2, "rank": 5}), "data_parallel"),
    Corruption("records part truncated", "damage", _truncate(RECORDS), RECORDS),
    Corruption("records part empty", "damage", _write(RECORDS, b""), RECORDS),
    Corruption("records part bit-flipped in its pages", "damage", _flip_bits(RECORDS, region="pages"), RECORDS),
    Corruption("records part bit-flipped in its footer", "damage", _flip_bits(RECORDS, region="footer"), RECORDS),
    Corruption("records part a directory", "damage", _replace_by_dir(RECORDS), RECORDS),
    Corruption("records part a named pipe", "damage", _replace_by_fifo(RECORDS), RECORDS),
    Corruption("records part of another table", "damage", _foreign_table(RECORDS), RECORDS),
    Corruption("records part with a column of the wrong type", "damage", _step_as_text, RECORDS),
    Corruption("records part named in bytes not UTF-8", "damage", _non_utf8_part_name, "not valid UTF-8"),
    Corruption("module names not UTF-8", "damage", _non_utf8_module_names, RECORDS),
    Corruption("rank directory not a number", "damage", _move_part("rank=abc"), "rank=abc"),
    Corruption("rank directory out of range", "damage", _move_part("rank=99999999999"), "rank=99999999999"),
    Corruption("steps part truncated", "damage", _truncate(STEPS), STEPS),
    Corruption("steps part bit-flipped", "damage", _flip_bits(STEPS, region="pages"), STEPS),
    Corruption("modules part truncated", "damage", _truncate(MODULES), MODULES),
    Corruption("modules part of another table", "damage", _foreign_table(MODULES), MODULES),
    Corruption("segment truncated", "damage", _truncate(SEGMENT), SEGMENT),
    Corruption("segment bit-flipped", "damage", _flip_bits(SEGMENT, region="pages", flips=64), SEGMENT),
    Corruption("segment not HDF5", "damage", _write(SEGMENT, b"PK\x03\x04 a zip file\n" * 64), SEGMENT),
    # something gone: check must say so
    Corruption("records part deleted", "loss", _delete(RECORDS), "readable"),
    Corruption("steps part deleted", "loss", _delete(STEPS), "steps table"),
    Corruption("modules part deleted", "loss", _delete(MODULES), "modules table"),
    Corruption("segment deleted", "loss", _delete(SEGMENT), "is missing"),
    Corruption("status directory deleted", "loss", _delete("status"), "wrote no status"),
    Corruption("a write left unfinished", "loss", _leftover_tmp, "interrupted write"),
    # valid, but unusual
    Corruption("two runs of different models", "odd", _different_model, extra=_diff_must_differ),
    Corruption("world_size of a trillion", "odd", _edit_json("manifest.json", world_size=10**12), extra=_check_must_flag),
    Corruption("killed before the first flush", "odd", _nothing_flushed),
    Corruption("stray files next to the parts", "odd", _stray_files, extra=_same_as_good),
]  # fmt: skip

# (corruption, command) -> why it fails, for a reason outside hooktrace/trace and hooktrace/cli
# (each becomes a strict xfail): none now
KNOWN: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_small(tmp_path_factory.mktemp("good") / "run")


@pytest.fixture(scope="module")
def good_answers(good_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Each command's answer on an undamaged copy, paths made comparable."""
    copy = tmp_path_factory.mktemp("copy") / "run"
    shutil.copytree(good_run, copy)
    answers = {}
    for command in analyzer_commands():
        outcome = run_cli(argv_for(command, copy, other=good_run))
        assert not problems_with_error(outcome), outcome
        outcome.stdout = normalise(outcome.stdout, copy, good_run)
        answers[command] = outcome
    return answers


def judge(corruption: Corruption, command: str, outcome: Outcome, good: Outcome) -> list[str]:
    found = problems_with_error(outcome)
    said = outcome.text
    if corruption.expect == "refuse":
        if outcome.code != 2:
            found.append(f"not refused (exit {outcome.code})")
        elif corruption.mention not in outcome.stderr:
            found.append(f"the error does not mention {corruption.mention!r}")
    elif corruption.expect == "damage":
        changed = (outcome.code, outcome.stdout) != (good.code, good.stdout)
        if command == "check" and outcome.code == 0:
            found.append("check calls a damaged trace whole")
        elif outcome.code in (0, 1) and changed and corruption.mention not in said:
            found.append(f"a changed result that does not say it left out {corruption.mention!r}")
    elif (
        corruption.expect == "loss"
        and command == "check"
        and (outcome.code != 1 or corruption.mention not in said)
    ):
        found.append(f"check does not report the loss ({corruption.mention!r})")
    if corruption.extra is not None:
        found += corruption.extra(command, outcome, good)
    return found


def _cases() -> list[Any]:
    cases = []
    for corruption in CORRUPTIONS:
        for command in analyzer_commands():
            reason = KNOWN.get((corruption.name, command))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            cases.append(
                pytest.param(corruption, command, id=f"{corruption.name}-{command}", marks=marks)
            )
    return cases


def test_there_are_at_least_30_corruptions() -> None:
    assert len(CORRUPTIONS) >= 30
    assert {c.name for c in CORRUPTIONS} >= {
        "missing path",
        "empty directory",
        "a file instead of a directory",
        "records part truncated",
        "records part bit-flipped in its pages",
        "segment truncated",
        "segment bit-flipped",
        "manifest missing",
        "format version from the future",
        "two runs of different models",
        "module names not UTF-8",
    }


@pytest.mark.parametrize(("corruption", "command"), _cases())
def test_a_bad_trace_gets_an_honest_answer(
    corruption: Corruption,
    command: str,
    good_run: Path,
    good_answers: dict[str, Outcome],
    tmp_path: Path,
    figures: Figures,
) -> None:
    copy = tmp_path / "run"
    shutil.copytree(good_run, copy)
    target = corruption.make(copy)
    outcome = run_cli(argv_for(command, target, other=good_run))
    outcome.stdout = normalise(outcome.stdout, good_run, target)
    found = judge(corruption, command, outcome, good_answers[command])
    figures.count("bad_traces", command, survived=not found, lost=int(bool(found)))
    assert not found, f"{corruption.name}: {'; '.join(found)}\n{outcome}"


def test_a_flipped_bit_in_a_saved_tensor_is_an_error_not_a_value(
    good_run: Path, tmp_path: Path
) -> None:
    """Segments checksum their metadata, and each full tensor carries the CRC-32 of its bytes:
    a flipped bit anywhere in a tensor's data makes reading it fail, where it used to read as
    other numbers."""
    copy = tmp_path / "run"
    shutil.copytree(good_run, copy)
    trace = hooktrace.load(copy)
    row = trace.records.query("tensor_key != '' and numel > 1").iloc[0]
    where = {"step": int(row["step"]), "slot": str(row["slot"])}
    expected = trace.tensor(str(row["module"]), str(row["kind"]), **where)  # type: ignore[arg-type]
    with h5py.File(copy / SEGMENT, "r") as f:
        dataset = f[str(row["tensor_key"])]
        assert int(dataset.attrs["crc32"]) == zlib.crc32(np.ascontiguousarray(dataset[()]).data)
        if dataset.chunks:
            chunk = dataset.id.get_chunk_info(0)
            offset, size = chunk.byte_offset, chunk.size
        else:  # one contiguous block
            offset, size = dataset.id.get_offset(), dataset.id.get_storage_size()
    data = bytearray((copy / SEGMENT).read_bytes())
    data[offset + size // 2] ^= 0x10
    (copy / SEGMENT).write_bytes(bytes(data))
    with pytest.raises(TraceError, match="cannot read"):
        got = trace.tensor(str(row["module"]), str(row["kind"]), **where)  # type: ignore[arg-type]
        assert not np.array_equal(got, expected)  # what a flip without checksums gave
    check = run_cli(["check", str(copy)])  # where the reader's error sends the user
    assert check.code == 1, check
    assert (
        f"{SEGMENT}: 1 full tensor(s) cannot be read ({row['tensor_key']} no longer matches its "
        "checksum): those are lost, the rest of the segment reads"
    ) in check.stdout


def _silent_flip(part: Path) -> tuple[int, int] | None:
    """A (byte, bit) inside a data page of ``part`` whose flip still decodes, to other values,
    when page checksums are not verified: what decompression alone lets through."""
    good = pq.read_table(part)
    data = bytearray(part.read_bytes())
    metadata = pq.ParquetFile(part).metadata
    for column in range(metadata.num_columns):
        chunk = metadata.row_group(0).column(column)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
        start = start or chunk.data_page_offset
        for offset in range(start + chunk.total_compressed_size - 1, start - 1, -1):
            for bit in range(8):
                data[offset] ^= 1 << bit
                flipped = part.with_name("flipped.parquet")
                flipped.write_bytes(bytes(data))
                data[offset] ^= 1 << bit
                try:
                    changed = not pq.read_table(flipped, page_checksum_verification=False).equals(
                        good
                    )
                except (OSError, pa.ArrowException):
                    continue
                finally:
                    flipped.unlink()
                if changed:
                    return offset, bit
    return None


def test_a_flipped_bit_that_still_decompresses_is_caught_by_the_page_checksum(
    good_run: Path, tmp_path: Path
) -> None:
    """zstd does not checksum its frames here, so a flipped bit can decode to other numbers;
    the CRC-32 in each page header makes it a damaged part instead."""
    copy = tmp_path / "run"
    shutil.copytree(good_run, copy)
    part = copy / RECORDS
    flip = _silent_flip(part)
    assert flip is not None, "no flip decodes silently: this test no longer tests anything"
    offset, bit = flip
    data = bytearray(part.read_bytes())
    data[offset] ^= 1 << bit
    part.write_bytes(bytes(data))
    trace = hooktrace.load(copy)
    with pytest.warns(hooktrace.TraceWarning, match="left out records/rank=0/part-000000"):
        records = trace.records
    assert trace.skipped and len(records) == 0  # the run's only records part
    check = run_cli(["check", str(copy)])
    assert check.code == 1 and "unreadable, left out: records/rank=0/part-000000" in check.stdout
