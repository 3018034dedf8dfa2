"""TensorBoard's side of ``hooktrace export tensorboard``: event files, scalars, histograms and
text, in TensorBoard's own protocol buffers. Never imports torch (nor TensorFlow).

The writer is the ``tensorboard`` package's own: ``EventFileWriter`` (the one
``torch.utils.tensorboard`` writes with) and the protos in ``tensorboard.compat.proto``. It is
an optional extra (``pip install 'hooktrace[tensorboard]'``), imported by :func:`require` only
when an export runs. Values are written the way ``torch.utils.tensorboard`` writes them:
scalars as ``simple_value`` (float32, as TensorBoard keeps every scalar), histograms as
``HistogramProto``, text as a string tensor for the text plugin (markdown).

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

import math
from pathlib import Path
from typing import Any

import numpy as np

from hooktrace.errors import HooktraceError
from hooktrace.trace import histograms as bins


class TensorBoardUnavailable(HooktraceError):
    """The ``tensorboard`` package is not installed."""


def require() -> None:
    """Raise :class:`TensorBoardUnavailable` unless TensorBoard's writer can be imported."""
    try:
        import tensorboard.compat.proto.summary_pb2
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError:
        raise TensorBoardUnavailable(
            "exporting to TensorBoard needs the tensorboard package, which is not installed: "
            "pip install 'hooktrace[tensorboard]'"
        ) from None


# -- histograms -------------------------------------------------------------------------------

_ABOVE = bins.MAGNITUDE_BINS - 1  # magnitude bins 1 .. _ABOVE have an exponent of their own

_EXPONENTS = bins.exponents()[1:]  # of magnitude bins 1 .. 278 (the last: 2^128 and above)
_POS_LIMITS = np.ldexp(1.0, _EXPONENTS + 1)
_POS_LIMITS[-1] = np.finfo(np.float64).max  # bin 278 has no upper edge (TensorFlow's way)
_NEG_LIMITS = -np.ldexp(1.0, _EXPONENTS[::-1])
LIMITS = np.concatenate([_NEG_LIMITS, [math.ldexp(1.0, bins.EXPONENT_MIN)], _POS_LIMITS])
"""The upper edge of each display bucket, increasing: negative bins 278..1, the bucket around
0, positive bins 1..278 (TensorBoard takes bucket ``i`` to span ``LIMITS[i-1]..LIMITS[i]``)."""
LEFTS = np.concatenate([[-2.0 * math.ldexp(1.0, bins.EXPONENT_MAX + 1)], LIMITS[:-1]])
"""The lower edge of each display bucket."""
CENTER = _ABOVE
"""Where the bucket around 0 sits in :data:`LIMITS`."""

HISTOGRAM_DESCRIPTION = (
    "hooktrace's exponent histogram: one bucket per power of 2 of |x|, by sign, and one "
    "around 0 for the zeros. NaN and Inf are not in it: see the nan_count and inf_count scalars."
)


def display_counts(zero: int | np.integer, pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """The counts of the display buckets (:data:`LIMITS`) of one histogram row."""
    pos = np.asarray(pos, dtype=np.int64)
    neg = np.asarray(neg, dtype=np.int64)
    center = int(zero) + int(pos[0]) + int(neg[0])
    return np.concatenate([neg[:0:-1], [center], pos[1:]])


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

    filled = np.flatnonzero(counts)
    if len(filled) == 0:
        return None
    first, last = int(filled[0]), int(filled[-1])
    inner = counts[first : last + 1]
    # of a run of empty buckets keep the last: its upper edge ends the run
    keep = np.ones(len(inner), dtype=bool)
    keep[:-1] = (inner[:-1] != 0) | (inner[1:] != 0)
    index = np.flatnonzero(keep) + first
    if not math.isfinite(low):
        low = float(LEFTS[first])
    if not math.isfinite(high):
        high = float(LIMITS[last])
    return HistogramProto(
        min=low,
        max=high,
        num=float(inner.sum()),
        sum=total,
        sum_squares=squares,
        bucket_limit=LIMITS[index].tolist(),
        bucket=counts[index].astype(np.float64).tolist(),
    )


# -- summaries and events ---------------------------------------------------------------------


def scalar_values(tags: list[str], values: list[float]) -> list[Any]:
    """``Summary.Value``s of scalars, one per tag."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    value = Summary.Value
    return [value(tag=t, simple_value=v) for t, v in zip(tags, values, strict=True)]


def histogram_value(tag: str, histogram: Any, *, describe: bool) -> Any:
    """A ``Summary.Value`` of a histogram; ``describe`` (a tag's first) says what it holds."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.histogram.metadata import create_summary_metadata

    if not describe:
        return Summary.Value(tag=tag, histo=histogram)
    metadata = create_summary_metadata(display_name=tag, description=HISTOGRAM_DESCRIPTION)
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
    """One TensorBoard run: a directory with one event file, written in the background by
    TensorBoard's ``EventFileWriter`` (its queue is bounded, so memory is too)."""

    MAX_VALUES = 20_000
    """Values per event at most: a step with more is written as several events."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.directory = directory
        self.described: set[str] = set()
        """Tags whose first value, which carries the tag's description, is written."""
        self._writer = EventFileWriter(str(directory), max_queue_size=32, flush_secs=30)

    def write(self, step: int, wall_time: float, values: list[Any]) -> None:
        """``values`` (``Summary.Value``s) as events of ``step`` at ``wall_time``."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for start in range(0, len(values), self.MAX_VALUES):
            summary = Summary(value=values[start : start + self.MAX_VALUES])
            self._writer.add_event(Event(step=step, wall_time=wall_time, summary=summary))

    def close(self) -> None:
        self._writer.close()
