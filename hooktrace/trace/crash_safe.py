"""Writing a trace's files so that a crash at any moment leaves only whole ones: each is
written under a temporary name and renamed once complete, and a write that fails removes
what it began. Never imports torch.

Apart from the writer because this is the I/O, one file at a time: the HDF5 segment (activity
and full tensors, each with a CRC-32), a Parquet part, a JSON manifest or status. The writer
decides when to flush and in what order; these decide how a file reaches the disk.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hooktrace.trace import schema
from hooktrace.trace.step_data import StepData, arrow_strings


def write_json_atomic(path: Path, payload: Mapping[str, Any]) -> None:
    tmp = path.with_name(schema.temporary_name(path.name))
    with removed_on_failure(tmp):
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
        os.replace(tmp, path)


@contextlib.contextmanager
def removed_on_failure(tmp: Path) -> Any:
    """A write that fails (disk full, directory gone) leaves no temporary file behind: on a
    full disk it would hold space the training itself may need. The file is removed through
    the directory it was begun in, held open meanwhile: a directory moved away mid-write
    (and a file put in its place) still loses it."""
    folder = _open_folder(tmp.parent)
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if folder is None:
                tmp.unlink()
            else:
                os.unlink(tmp.name, dir_fd=folder)
        raise
    finally:
        if folder is not None:
            os.close(folder)


def _open_folder(folder: Path) -> int | None:
    """``folder`` open for removing files in it by name, where the platform allows."""
    if os.unlink not in os.supports_dir_fd or not hasattr(os, "O_DIRECTORY"):
        return None
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # gone already: the write fails as it will
        return None


def write_parquet(table: pa.Table, directory: Path, index: int) -> None:
    name = schema.part_name(index)
    tmp = directory / schema.temporary_name(name)
    with removed_on_failure(tmp):
        # row groups of 64k rows: a step-range query decodes little more than it needs;
        # a CRC-32 in each page header, which the reader verifies. Statistics rarely
        # repeat a value: a dictionary of them is built only to be thrown away (plain,
        # they write a quarter faster and a quarter smaller)
        pq.write_table(
            table,
            tmp,
            compression="zstd",
            row_group_size=1 << 16,
            write_page_checksum=True,
            use_dictionary=[f.name for f in table.schema if not pa.types.is_floating(f.type)],
        )
        os.replace(tmp, directory / name)


def write_segment(
    run_dir: Path,
    rank: int,
    index: int,
    steps: list[StepData],
    columns: dict[str, Any],
    *,
    compression: str | None,
) -> Path | None:
    """Write activity and full tensors; fill the location columns. Returns the segment
    written, or None when the steps hold neither."""
    n = len(columns["step"])
    offsets = np.full(n, -1, dtype=np.int64)
    keys = [""] * n
    activity: list[np.ndarray] = []
    tensors: list[tuple[int, np.ndarray, str]] = []
    base = 0
    position = 0
    for data in steps:
        for row, counts in data.activity:
            offsets[base + row] = position
            activity.append(counts)
            position += len(counts)
        tensors.extend((base + row, array, dtype) for row, array, dtype in data.tensors)
        base += data.rows
    columns["activity_offset"] = offsets
    segment_type = schema.RECORD_SCHEMA.field("segment").type
    if not activity and not tensors:
        columns["tensor_key"] = keys
        columns["segment"] = pa.nulls(n, segment_type)
        return None

    name = schema.segment_name(index)
    final = run_dir / schema.rank_dir(schema.TENSORS_DIR, rank) / name
    tmp = final.with_name(schema.temporary_name(name))
    # h5py writes through a Python file object: a failed write (disk full, file too
    # large) is then a plain OSError, where HDF5's own driver leaves a half-closed file
    # behind that crashes the interpreter at exit. HDF5 1.10's file layout checksums its
    # metadata, and each tensor carries a CRC-32 of its bytes (below): a flipped bit is
    # then an error on reading, never a wrong value. (zlib computes it without holding the
    # GIL, where HDF5's fletcher32 filter held it and cost the training 3x a plain step.)
    with (
        removed_on_failure(tmp),
        open(tmp, "w+b", buffering=0) as raw,  # HDF5 seeks between writes: no buffer
        _Sink(raw) as sink,
        h5py.File(sink, "w", libver=("v110", "latest")) as f,
    ):
        f.attrs["format"] = schema.FORMAT_NAME
        f.attrs["format_version"] = schema.FORMAT_VERSION
        if activity:
            merged = np.concatenate(activity).astype(np.int64, copy=False)
            # counts are small: shuffled, their high bytes compress away first (a third
            # smaller and a third faster than gzip alone on the reference models)
            f.create_dataset(
                "activity", data=merged, compression="gzip", compression_opts=1, shuffle=True
            )
        group = f.create_group("t") if tensors else None
        for row, array, dtype in tensors:
            key = f"t/{row}"
            assert group is not None
            checksum = np.uint32(zlib.crc32(array.data))
            chunked = array.size > 1  # filters need chunks; a scalar has none
            ds = group.create_dataset(
                str(row), data=array, compression=compression if chunked else None
            )
            ds.attrs["dtype"] = dtype
            ds.attrs[schema.TENSOR_CHECKSUM] = checksum
            keys[row] = key
    with removed_on_failure(tmp):
        os.replace(tmp, final)
    relative = f"{schema.rank_dir(schema.TENSORS_DIR, rank)}/{name}"
    columns["tensor_key"] = keys
    columns["segment"] = pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(n, dtype=np.int32)), arrow_strings([relative], pa.string())
    ).cast(segment_type)
    return final


class _Sink:
    """The file h5py writes a segment through. Its first failed operation is kept, not
    raised, and it does nothing after it (the segment is discarded anyway): an error raised
    into HDF5 while it flushes its cache on closing is printed as an "Exception ignored"
    traceback, one per write that follows. The kept error is raised once HDF5 is done."""

    def __init__(self, raw: io.FileIO) -> None:
        self._raw = raw
        self._position = 0  # where HDF5 thinks it is, once the file is given up
        self.failed: OSError | None = None

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.failed is not None and exc_info[0] is None:
            raise self.failed

    def _guard(self, operation: Callable[[], Any], otherwise: Any) -> Any:
        if self.failed is not None:
            return otherwise
        try:
            return operation()
        except OSError as exc:
            self.failed = exc
            return otherwise

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")

        def write_all() -> int:  # an unbuffered write may take less than it was given
            written = 0
            while written < len(view):
                count = self._raw.write(view[written:])
                if not count:
                    raise OSError(errno.EIO, f"wrote nothing to {self._raw.name}")
                written += count
            return written

        return int(self._guard(write_all, len(view)))

    def truncate(self, size: int) -> int:
        return int(self._guard(lambda: self._raw.truncate(size), size))

    def flush(self) -> None:
        self._guard(self._raw.flush, None)

    def seek(self, offset: int, whence: int = 0) -> int:
        self._position = offset if whence == 0 else self._position
        return int(self._guard(lambda: self._raw.seek(offset, whence), self._position))

    def tell(self) -> int:
        return int(self._guard(self._raw.tell, self._position))

    def read(self, size: int = -1) -> bytes:
        return bytes(self._guard(lambda: self._raw.read(size), b""))

    def readinto(self, buffer: Any) -> int:
        return int(self._guard(lambda: self._raw.readinto(buffer), 0))
