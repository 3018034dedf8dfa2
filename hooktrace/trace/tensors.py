"""Full tensors and per-unit activity, read from a run's HDF5 segments with their exact
dtypes. Never imports torch, and never unpickles: numeric HDF5 datasets only.

Apart from the reader because it is the HDF5 side of reading (the reader's tables are
Parquet), and non-finite captures (:mod:`hooktrace.trace.captures`) decode their tensors the
same way.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hooktrace.errors import TraceError
from hooktrace.trace import schema
from hooktrace.trace.paths import one_line, regular

_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
"""torch dtypes numpy lacks: stored as unsigned integers of the same width (docs/FORMAT.md),
read as ml_dtypes' types of the same names. ml_dtypes is imported by the first tensor read
that needs it: its import takes 0.8 s, which every recording and analyzer command would pay."""


def _ml_dtype(name: str) -> Any:
    import ml_dtypes

    return getattr(ml_dtypes, name)


def decode_dataset(dataset: Any, where: str) -> np.ndarray:
    """A full tensor from its HDF5 dataset, with its exact dtype (bfloat16 and float8 as
    ml_dtypes). Raises TraceError for anything that is not a plain numeric array: hooktrace
    writes no such thing, so the trace was altered, and it is not read."""
    kind = dataset.dtype.kind if isinstance(dataset, h5py.Dataset) else "group"
    if kind not in ("b", "i", "u", "f", "c"):
        raise TraceError(
            f"{where} is not a numeric array ({kind}): hooktrace writes no such thing, so the "
            "trace was altered; it is not read"
        )
    data = np.asarray(dataset[()])
    checksum = dataset.attrs.get(schema.TENSOR_CHECKSUM)
    if checksum is not None and zlib.crc32(np.ascontiguousarray(data).data) != int(checksum):
        raise TraceError(
            f"cannot read {where}: its bytes no longer match their checksum, so the segment "
            "was damaged after it was written; run `hooktrace check`"
        )
    dtype = dataset.attrs.get("dtype", data.dtype.name)
    if isinstance(dtype, bytes):
        dtype = dtype.decode("utf-8", "replace")
    if str(dtype) in _ML_DTYPES:
        target = _ml_dtype(str(dtype))
        if data.dtype.itemsize != np.dtype(target).itemsize:
            raise TraceError(
                f"{where} is stored as {data.dtype}, which cannot hold {dtype}: the trace was altered"
            )
        data = data.view(target)
    return data


def segment_path(run: Path, segment: str) -> Path:
    """The file of ``segment`` (as a record names it) in the run directory ``run``."""
    path = (run / segment).resolve()
    if not path.is_relative_to(run.resolve()):
        raise TraceError(f"refusing to read {segment!r}: it points outside the run directory")
    if not path.exists():
        raise TraceError(f"segment {segment} is missing from {run}: run `hooktrace check`")
    if not regular(path):
        raise TraceError(f"segment {segment} of {run} is not a regular file")
    return path


def read_dataset(run: Path, segment: str, key: str) -> np.ndarray:
    """One full tensor (or the activity array) of a segment; a damaged segment or an altered
    dataset is a TraceError."""
    path = segment_path(run, segment)
    try:
        with h5py.File(path, "r") as f:
            return decode_dataset(f[key], f"{segment}:{key}")
    except TraceError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, AttributeError) as exc:
        raise TraceError(
            f"cannot read {key} from segment {segment} of {run} ({one_line(exc)}): "
            "run `hooktrace check` to see what is damaged"
        ) from exc
