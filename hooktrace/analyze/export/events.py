"""TensorBoard's side of ``hooktrace export tensorboard``: event files of scalars, histograms
and text. Never imports torch (nor TensorFlow).

The events are the ``tensorboard`` package's own protocol buffers (``tensorboard.compat.proto``,
the messages ``torch.utils.tensorboard`` writes), framed as TensorBoard's event files are
(:class:`EventRun`). The package is an optional extra (``pip install
'hooktrace[tensorboard]'``), imported only when an export runs. Values are written the way
``torch.utils.tensorboard`` writes them: scalars as ``simple_value`` (float32, as TensorBoard
keeps every scalar), histograms as ``HistogramProto``, text as a string tensor for the text
plugin (markdown).

How an exponent histogram (docs/FORMAT.md, "histograms") becomes TensorBoard's buckets, left
to right: the negative bins from the largest magnitude down, one bucket around 0, the positive
bins from the smallest magnitude up. Negative bin ``k`` (exponent ``e = k - 150``) spans
``[-2^(e+1), -2^e]``, positive bin ``k`` spans ``[2^e, 2^(e+1)]``. The bucket around 0,
``[-2^-149, 2^-149]``, holds the zeros and the two bins below ``2^-149`` (only float64
values reach those), which TensorBoard, whose bucket edges are float32, cannot tell from 0.
Empty buckets before the first and after the last non-empty one are dropped, and each run of
empty buckets in between is one empty bucket that spans it (as TensorFlow's own histograms
do), so every bucket keeps its edges. NaN and Inf have no place on an axis: they are not in
the histogram (the records' ``nan_count`` and ``inf_count`` scalars count them).
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hooktrace.analyze.export.text import HISTOGRAMS
from hooktrace.errors import HooktraceError
from hooktrace.trace import histograms as bins


class TensorBoardUnavailable(HooktraceError):
    """The ``tensorboard`` package is not installed."""


def require() -> None:
    """Raise :class:`TensorBoardUnavailable` unless TensorBoard's writer can be imported."""
    try:
        import tensorboard.compat.proto.event_pb2
        import tensorboard.compat.proto.summary_pb2  # noqa: F401
    except ImportError:
        raise TensorBoardUnavailable(
            "exporting to TensorBoard needs the tensorboard package, which is not installed: "
            "pip install 'hooktrace[tensorboard]'"
        ) from None


# -- histograms -------------------------------------------------------------------------------

_EXPONENTS = bins.exponents()[1:]  # of magnitude bins 1 .. 278 (the last: 2^128 and above)
_POS_LIMITS = np.ldexp(1.0, _EXPONENTS + 1)
_POS_LIMITS[-1] = np.finfo(np.float64).max  # bin 278 has no upper edge (TensorFlow's way)
_NEG_LIMITS = -np.ldexp(1.0, _EXPONENTS[::-1])
LIMITS = np.concatenate([_NEG_LIMITS, [math.ldexp(1.0, bins.EXPONENT_MIN)], _POS_LIMITS])
"""The upper edge of each display bucket, increasing: negative bins 278..1, the bucket around
0, positive bins 1..278 (TensorBoard takes bucket ``i`` to span ``LIMITS[i-1]..LIMITS[i]``)."""
LEFTS = np.concatenate([[-2.0 * math.ldexp(1.0, bins.EXPONENT_MAX + 1)], LIMITS[:-1]])
"""The lower edge of each display bucket."""


def display_counts(zero: Any, pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """The counts of the display buckets (:data:`LIMITS`) of histogram rows: ``zero`` a
    count per row, ``pos`` and ``neg`` rows of ``MAGNITUDE_BINS`` counts (or one row)."""
    pos = np.asarray(pos, dtype=np.int64)
    neg = np.asarray(neg, dtype=np.int64)
    center = np.asarray(zero, dtype=np.int64) + pos[..., 0] + neg[..., 0]
    return np.concatenate([neg[..., :0:-1], center[..., None], pos[..., 1:]], axis=-1)


def histogram_proto(
    counts: np.ndarray,
    *,
    low: float,
    high: float,
    total: float,
    squares: float,
) -> Any:
    """A ``HistogramProto`` of display bucket ``counts``, or None when it holds no value.

    ``low`` and ``high`` are the least and greatest value (where not finite, the outer edges of
    the outer non-empty buckets stand in); ``total`` and ``squares`` the sum and sum of squares
    of the values (NaN where unknown)."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    filled = counts.nonzero()[0]
    if len(filled) == 0:
        return None
    # of each run of empty buckets between two filled ones keep the last: its upper edge
    # ends the run, so that the next filled bucket keeps its lower edge
    gaps = filled[1:][np.diff(filled) > 1] - 1
    index = np.sort(np.concatenate([filled, gaps])) if len(gaps) else filled
    if not math.isfinite(low):
        low = float(LEFTS[filled[0]])
    if not math.isfinite(high):
        high = float(LIMITS[filled[-1]])
    return HistogramProto(
        min=low,
        max=high,
        num=float(counts.sum()),
        sum=total,
        sum_squares=squares,
        bucket_limit=LIMITS[index].tolist(),
        bucket=counts[index].tolist(),
    )


# -- summaries and events ---------------------------------------------------------------------


def histogram_value(tag: str, histogram: Any, *, describe: bool) -> Any:
    """A ``Summary.Value`` of a histogram; ``describe`` (a tag's first) says what it holds."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.histogram.metadata import create_summary_metadata

    if not describe:
        return Summary.Value(tag=tag, histo=histogram)
    metadata = create_summary_metadata(display_name=tag, description=HISTOGRAMS)
    return Summary.Value(tag=tag, histo=histogram, metadata=metadata)


def text_value(tag: str, markdown: str) -> Any:
    """A ``Summary.Value`` of text for TensorBoard's text plugin, which renders markdown."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.metadata import create_summary_metadata

    tensor = TensorProto(
        dtype="DT_STRING", string_val=[markdown.encode("utf-8")], tensor_shape=TensorShapeProto()
    )
    metadata = create_summary_metadata(display_name=tag, description="")
    return Summary.Value(tag=tag, metadata=metadata, tensor=tensor)


class EventRun:
    """One TensorBoard run: a directory with one event file.

    An event file is a sequence of TFRecords, each an ``Event`` proto framed by its length
    and two masked CRC-32C checksums, which TensorBoard's readers verify. The framing is
    written here rather than by ``tensorboard``'s ``EventFileWriter``, whose CRC-32C is pure
    Python (about 5 MB/s: it was most of the time of an export); ``google-crc32c`` (installed
    with the extra) computes it in C, and TensorBoard's own function stands in without it.
    Written synchronously through a buffer, in the caller's thread."""

    MAX_VALUES = 20_000
    """Values per event at most: a step with more is written as several events."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SourceMetadata

        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.described: set[str] = set()
        """Tags whose first value, which carries the tag's description, is written."""
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILES)}"
        self.path = directory / name
        self._crc = _masked_crc32c()
        self._file = self.path.open("wb", buffering=1 << 20)
        self._add(
            Event(
                wall_time=time.time(),
                file_version="brain.Event:2",  # what TensorBoard's readers expect
                source_metadata=SourceMetadata(writer="hooktrace"),
            )
        )

    def write(
        self,
        step: int,
        wall_time: float,
        tags: Sequence[str] = (),
        scalars: Sequence[float] = (),
        values: Sequence[Any] = (),
    ) -> None:
        """Scalars (``scalars[i]`` tagged ``tags[i]``, as ``simple_value``) and other
        ``Summary.Value``s (histograms, text) as events of ``step`` at ``wall_time``."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for start in range(0, len(tags) + len(values), self.MAX_VALUES):
            summary = Summary()
            add = summary.value.add
            end = start + self.MAX_VALUES
            for tag, scalar in zip(tags[start:end], scalars[start:end], strict=True):
                add(tag=tag, simple_value=scalar)
            summary.value.extend(values[max(start - len(tags), 0) : max(end - len(tags), 0)])
            self._add(Event(step=step, wall_time=wall_time, summary=summary))

    def _add(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        crc = self._crc
        self._file.write(
            header + struct.pack("<I", crc(header)) + data + struct.pack("<I", crc(data))
        )

    def close(self) -> None:
        self._file.close()


_FILES = itertools.count()


def _masked_crc32c() -> Callable[[bytes], int]:
    """The masked CRC-32C of TFRecords: google-crc32c's in C where installed, else
    TensorBoard's own (pure Python, as is google-crc32c's fallback, which is slower)."""
    try:
        import google_crc32c

        value = google_crc32c.value if google_crc32c.implementation == "c" else None
    except ImportError:
        value = None
    if value is None:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        return masked_crc32c

    def masked(data: bytes) -> int:
        crc = int(value(data))
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    return masked
