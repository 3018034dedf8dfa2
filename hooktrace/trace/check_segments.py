"""The HDF5 files of a run, checked for ``hooktrace check``: each segment a record points to
opens, its activity reads in full, and every full tensor reads, a block at a time, with the
CRC-32 the writer stored; each non-finite capture opens and its tensors match theirs. Never
imports torch.

Apart from :mod:`hooktrace.trace.check` because this is the HDF5 side, read a block at a
time (a trace can hold far more full tensors than memory); the Parquet side is
:mod:`hooktrace.trace.check_parts`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hooktrace.errors import TraceError
from hooktrace.trace import schema
from hooktrace.trace.captures import GROUPS, capture_paths, read_meta
from hooktrace.trace.check_parts import Seen, Segment
from hooktrace.trace.threads import read_in_threads

MAX_LISTED = 5  # ranks, tensors or captures named one by one before "and N more"
_BLOCK_BYTES = 64 << 20  # how much of a full tensor is read at a time to check its CRC-32


def check_segments(run: Path, seen: Seen, problems: list[str]) -> None:
    """Each segment the records of the run directory ``run`` point to, read two at a time
    (h5py inflates one while the other is checked), its problems added to ``problems`` in the
    segments' order."""
    root = run.resolve()
    segments = [
        (segment, (run / segment).resolve(), held, root)
        for segment, held in sorted(seen.segments.items())
    ]
    with contextlib.closing(read_in_threads(_problem_of, segments)) as reads:
        for (segment, _, _, _), found in reads:
            if isinstance(found, Exception):  # h5py raises OSError, KeyError, RuntimeError, ...
                found = f"segment {segment} is damaged ({_why(found)}): its data is lost"
            if found is not None:
                problems.append(found)


def _problem_of(segment: tuple[str, Path, Segment, Path]) -> str | None:
    """What is wrong with a segment (its name, path, what the records hold of it, and the
    run's directory), as :func:`check_segments` reports it; None if nothing."""
    name, path, held, root = segment
    if not path.is_relative_to(root):
        return f"segment {name} points outside the run directory: not read, its data is lost"
    if not path.exists():
        return f"segment {name} is missing: its activity and full tensors are lost"
    unreadable: list[str] = []
    damage = _segment_damage(path, held, unreadable)
    if damage:
        return f"segment {name} is damaged ({damage}): its data is lost"
    if unreadable:
        return (
            f"segment {name}: {len(unreadable)} full tensor(s) cannot be read "
            f"({_listed(unreadable)}): those are lost, the rest of the segment reads"
        )
    return None


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _segment_damage(path: Path, held: Segment, unreadable: list[str]) -> str | None:
    """What makes the whole segment unreadable, if anything; the full tensors that cannot be
    read on their own are added to ``unreadable``."""
    if not path.is_file():
        return "not a regular file"
    with h5py.File(path, "r") as f:
        if held.counted:
            activity = f["activity"]
            if not isinstance(activity, h5py.Dataset) or activity.dtype.kind not in "iu":
                return "/activity is not an integer array"
            size = _read_through(activity)
            if held.start < 0 or held.end > size:
                return f"records point past the end of /activity ({size} counts)"
        for key in held.tensor_keys:
            dataset = f.get(key)
            if not isinstance(dataset, h5py.Dataset):
                unreadable.append(f"{key} is missing")
            elif dataset.dtype.kind not in "biufc":
                unreadable.append(f"{key} is not a numeric array")
            else:
                try:
                    if not _checksum_matches(dataset):
                        unreadable.append(f"{key} no longer matches its checksum")
                except Exception as exc:  # an HDF5 checksum or decompression error
                    unreadable.append(f"{key}: {type(exc).__name__}")
    return None


def check_captures(
    run: Path, statuses: dict[str, Any], problems: list[str], notes: list[str]
) -> None:
    """Each non-finite capture of the run directory ``run`` opens, holds its description, and
    every tensor of it has the CRC-32 stored with it; as many are there as each rank's status
    (``statuses``, the manifest's ``ranks``) says were written."""
    found: dict[int, int] = {}
    for rank, _, path in capture_paths(run):
        where = path.relative_to(run)
        try:
            read_meta(path)
            with h5py.File(path, "r") as f:
                bad = [
                    f"{group}/{name}"
                    for group in GROUPS
                    if group in f
                    for name, dataset in f[group].items()
                    if not _checksum_matches(dataset)
                ]
        except (OSError, TraceError) as exc:
            problems.append(f"capture {where} is damaged ({exc}): it is lost")
            continue
        if bad:
            problems.append(
                f"capture {where}: {len(bad)} tensor(s) no longer match their checksum "
                f"({_listed(bad)}): it cannot be replayed"
            )
        found[rank] = found.get(rank, 0) + 1
    for key, status in sorted(statuses.items()):
        written = status.get("nonfinite_captures")
        if isinstance(written, int) and written > found.get(int(key), 0):
            problems.append(
                f"rank {key}: {written} non-finite capture(s) written, "
                f"{found.get(int(key), 0)} readable: the others are lost"
            )
    if found:
        total = sum(found.values())
        notes.append(
            f"{total} non-finite capture(s), each whole: `hooktrace replay {run} "
            "--nonfinite` shows them"
        )


def _read_through(activity: h5py.Dataset) -> int:
    """Read the whole activity array, a block at a time (a damaged chunk raises), and return
    its length."""
    for _ in _blocks(activity):
        pass
    return int(activity.shape[0]) if activity.ndim else 1


def _checksum_matches(dataset: h5py.Dataset) -> bool:
    """Whether a full tensor's bytes, read a block at a time, have the CRC-32 stored with it.
    Segments written before hooktrace stored one were checksummed per chunk by HDF5
    (fletcher32), which reading verifies: an error is raised then instead."""
    crc = 0
    for block in _blocks(dataset):
        crc = zlib.crc32(np.ascontiguousarray(block).data, crc)
    expected = dataset.attrs.get(schema.TENSOR_CHECKSUM)
    return expected is None or crc == int(expected)


def _blocks(dataset: h5py.Dataset) -> Iterator[np.ndarray]:
    """The dataset's values in C order, in pieces of at most ``_BLOCK_BYTES`` (or of one
    value): along the first axis whose slices fit, for each index of the axes before it."""
    if dataset.ndim == 0 or dataset.size == 0:
        yield np.asarray(dataset[()])
        return
    shape = dataset.shape
    axis = 0
    while axis < len(shape) - 1 and math.prod(shape[axis + 1 :]) * dataset.dtype.itemsize > (
        _BLOCK_BYTES
    ):
        axis += 1
    count = max(1, _BLOCK_BYTES // (math.prod(shape[axis + 1 :]) * dataset.dtype.itemsize))
    for lead in itertools.product(*(range(n) for n in shape[:axis])):
        for start in range(0, shape[axis], count):
            yield np.asarray(dataset[(*lead, slice(start, start + count))])


def _listed(items: list[str]) -> str:
    more = len(items) - MAX_LISTED
    return "; ".join(items[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
