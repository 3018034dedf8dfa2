"""Histograms with fixed bins: one per binary exponent of |x|, the same for every tensor.

Bins that do not depend on the data compare bin for bin across steps, modules and runs, and
answer numerics questions exactly: how much of a gradient lies below float16's smallest
subnormal (2^-24), or at or beyond its largest power of two (2^16).

A value ``x`` falls in one of these bins (docs/FORMAT.md, "histograms"):

* ``zero``, ``nan``, ``pos_inf``, ``neg_inf``;
* otherwise by its sign into ``pos`` or ``neg``, and there by ``e = floor(log2(|x|))``, the
  exponent of its binary representation: bin ``e - EXPONENT_MIN + 1`` holds
  ``2^e <= |x| < 2^(e+1)``, for ``EXPONENT_MIN <= e <= EXPONENT_MAX``; bin 0 holds the
  values below ``2^EXPONENT_MIN`` and the last bin those at or above ``2^(EXPONENT_MAX+1)``.

The range is float32's whole one, subnormals included (2^-149 up to 2^128), so every value of
a float32, float16 or bfloat16 tensor has a bin of its own exponent; only float64 values
(and integers beyond 2^128) reach the two end bins.

Nothing here imports torch: the analyzer reads these, and the recorder's computation
(:mod:`hooktrace.recorder.stats.histogram`) is tested against :func:`reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pyarrow as pa

EXPONENT_MIN: Final = -149
"""float32's smallest subnormal is 2^-149."""
EXPONENT_MAX: Final = 127
"""float32's largest finite values lie in [2^127, 2^128)."""
MAGNITUDE_BINS: Final = EXPONENT_MAX - EXPONENT_MIN + 3
"""Bins of each sign: below 2^EXPONENT_MIN, one per exponent, at or above 2^(EXPONENT_MAX+1)."""

ZERO, NAN, POS_INF, NEG_INF = 0, 1, 2, 3
POS: Final = 4
"""Where the positive magnitude bins start in a flat histogram vector."""
NEG: Final = POS + MAGNITUDE_BINS
WIDTH: Final = NEG + MAGNITUDE_BINS
"""A flat histogram vector, as the recorder hands it to the writer: zero, nan, pos_inf,
neg_inf, then ``MAGNITUDE_BINS`` positive and ``MAGNITUDE_BINS`` negative counts."""

HISTOGRAMS_DIR: Final = "histograms"

COUNT_FIELDS: Final = ("zero", "nan", "pos_inf", "neg_inf")

_dict_str = pa.dictionary(pa.int32(), pa.string())

# One row per histogrammed record; joins the records on (rank, step, seq). ``module``,
# ``kind`` and ``slot`` repeat the record's, so that a query by module or kind needs no join.
# ``pos`` and ``neg`` hold the span of magnitude bins from the first occupied one to the last,
# ``pos[i]`` being bin ``pos_start + i``: a tensor occupies a few dozen of the 279 bins, and
# the spans write five times faster and read four times faster than the whole rows.
# ``Trace.histograms()`` and the ``histograms`` SQL view give whole rows.
HISTOGRAM_SCHEMA: Final = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("module", _dict_str, nullable=False),
        pa.field("kind", _dict_str, nullable=False),
        pa.field("slot", _dict_str, nullable=False),
        pa.field("numel", pa.int64(), nullable=False),
        pa.field("zero", pa.int64(), nullable=False),
        pa.field("nan", pa.int64(), nullable=False),
        pa.field("pos_inf", pa.int64(), nullable=False),
        pa.field("neg_inf", pa.int64(), nullable=False),
        pa.field("pos_start", pa.int16(), nullable=False),
        pa.field("pos", pa.list_(pa.int64()), nullable=False),
        pa.field("neg_start", pa.int16(), nullable=False),
        pa.field("neg", pa.list_(pa.int64()), nullable=False),
    ]
)


def exponents() -> np.ndarray:
    """The exponent ``e`` of each magnitude bin, bin ``k`` holding ``2^e <= |x| < 2^(e+1)``;
    the two end bins are given the exponent just outside the range (EXPONENT_MIN - 1 and
    EXPONENT_MAX + 1), which is where their values begin or end."""
    return np.arange(EXPONENT_MIN - 1, EXPONENT_MAX + 2, dtype=np.int64)


def bin_of_exponent(e: int) -> int:
    """The magnitude bin that holds values with ``floor(log2|x|) == e``."""
    return int(np.clip(e - EXPONENT_MIN + 1, 0, MAGNITUDE_BINS - 1))


def reference(values: np.ndarray) -> np.ndarray:
    """The flat histogram (``WIDTH`` int64 counts) of ``values``, computed the plain way with
    numpy's ``frexp`` in float64: the definition that faster routes are tested against.
    ``values`` must be exactly representable in float64 (every float dtype is; integers up to
    2^53)."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    counts = np.zeros(WIDTH, dtype=np.int64)
    counts[ZERO] = np.count_nonzero(x == 0)
    counts[NAN] = np.count_nonzero(np.isnan(x))
    counts[POS_INF] = np.count_nonzero(x == np.inf)
    counts[NEG_INF] = np.count_nonzero(x == -np.inf)
    finite = x[np.isfinite(x) & (x != 0)]
    _, e = np.frexp(finite)  # |x| = m * 2^e with 0.5 <= m < 1: floor(log2|x|) = e - 1
    bins = np.clip(e.astype(np.int64) - 1 - EXPONENT_MIN + 1, 0, MAGNITUDE_BINS - 1)
    counts[POS : POS + MAGNITUDE_BINS] = np.bincount(bins[finite > 0], minlength=MAGNITUDE_BINS)
    counts[NEG : NEG + MAGNITUDE_BINS] = np.bincount(bins[finite < 0], minlength=MAGNITUDE_BINS)
    return counts


def columns(flat: np.ndarray) -> dict[str, pa.Array | np.ndarray]:
    """The histogram table's count columns of ``flat`` (rows of ``WIDTH`` counts)."""
    flat = np.asarray(flat, dtype=np.int64).reshape(-1, WIDTH)
    pos_start, pos = _spans(flat[:, POS : POS + MAGNITUDE_BINS])
    neg_start, neg = _spans(flat[:, NEG : NEG + MAGNITUDE_BINS])
    return {
        "zero": flat[:, ZERO].copy(),
        "nan": flat[:, NAN].copy(),
        "pos_inf": flat[:, POS_INF].copy(),
        "neg_inf": flat[:, NEG_INF].copy(),
        "pos_start": pos_start,
        "pos": pos,
        "neg_start": neg_start,
        "neg": neg,
    }


SPAN_HEAD: Final = 8
"""A histogram's fixed part in :class:`Spans`: its zero, nan, pos_inf and neg_inf counts,
then where its positive span starts and how long it is, and the same of its negative one."""


@dataclass(frozen=True)
class Spans:
    """Histograms already cut to their spans, as the recorder's kernel counts a kind's
    parameters (or gradients) into a buffer: ``head`` (rows of ``SPAN_HEAD``), and each
    sign's spans one after the other, ``pos`` and ``neg``, in row order. The arrays may be
    views of a buffer that is used again once the step is materialized: :meth:`columns`
    copies."""

    head: np.ndarray
    pos: np.ndarray
    neg: np.ndarray

    def __len__(self) -> int:
        return len(self.head)

    def columns(self) -> dict[str, Any]:
        """The histogram table's count columns of these rows (as :func:`columns` makes them
        from whole rows), copied out of the buffer."""
        head = self.head
        return {
            "zero": head[:, ZERO].copy(),
            "nan": head[:, NAN].copy(),
            "pos_inf": head[:, POS_INF].copy(),
            "neg_inf": head[:, NEG_INF].copy(),
            "pos_start": head[:, 4].astype(np.int16),
            "pos": _list_array(head[:, 5], self.pos),
            "neg_start": head[:, 6].astype(np.int16),
            "neg": _list_array(head[:, 7], self.neg),
        }

    def rows(self) -> np.ndarray:
        """These histograms as whole rows of ``WIDTH`` counts."""
        return whole_rows(self.columns())

    def __getitem__(self, rows: np.ndarray) -> Spans:
        """The rows ``rows`` selects (a boolean mask, or positions in order)."""
        head = self.head
        picked = head[rows]
        return Spans(
            picked,
            _gather(head[:, 5], self.pos, picked.shape[0], rows),
            _gather(head[:, 7], self.neg, picked.shape[0], rows),
        )


def _list_array(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values[: offsets[-1]].copy()))


def _gather(lengths: np.ndarray, values: np.ndarray, n: int, rows: np.ndarray) -> np.ndarray:
    """The spans of ``rows`` out of spans of ``lengths`` laid one after the other."""
    starts = np.cumsum(lengths) - lengths
    kept = np.arange(len(lengths))[rows] if n else np.zeros(0, dtype=np.int64)
    pieces = [values[starts[i] : starts[i] + lengths[i]] for i in kept]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def _spans(bins: np.ndarray) -> tuple[np.ndarray, pa.ListArray]:
    """Each row's occupied span (from its first nonzero bin to its last) and where it starts;
    an empty row is an empty span starting at 0.

    Two passes over the rows' bins find the ends; the spans' values are then gathered by
    index, a cost of the occupied bins only (a step's few hundred rows of 270 bins hold a few
    dozen occupied ones each): the writer thread does this every step, and its Python time
    is taken from the training's."""
    n = len(bins)
    occupied = bins != 0
    first = occupied.argmax(axis=1)
    anywhere = occupied[np.arange(n), first] if n else np.zeros(0, dtype=bool)
    first = np.where(anywhere, first, 0)
    end = np.where(anywhere, bins.shape[1] - occupied[:, ::-1].argmax(axis=1), 0)
    lengths = end - first
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    rows = np.repeat(np.arange(n), lengths)
    columns = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1] - first, lengths)
    spans = pa.ListArray.from_arrays(pa.array(offsets), pa.array(bins[rows, columns]))
    return first.astype(np.int16), spans


def whole_rows(made: dict[str, Any]) -> np.ndarray:
    """The flat histograms (rows of ``WIDTH`` counts) whose count columns are ``made``
    (:func:`columns`' form)."""
    rows = np.zeros((len(made["zero"]), WIDTH), dtype=np.int64)
    for at, name in enumerate(COUNT_FIELDS):
        rows[:, at] = made[name]
    rows[:, POS : POS + MAGNITUDE_BINS] = whole(made["pos_start"], made["pos"])
    rows[:, NEG : NEG + MAGNITUDE_BINS] = whole(made["neg_start"], made["neg"])
    return rows


def whole(starts: np.ndarray, spans: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The whole rows (``MAGNITUDE_BINS`` counts each) of spans stored from ``starts``."""
    if isinstance(spans, pa.ChunkedArray):
        spans = spans.combine_chunks() if spans.num_chunks else pa.array([], spans.type)
    lengths = np.diff(spans.offsets.to_numpy()).astype(np.int64)
    rows = np.zeros((len(lengths), MAGNITUDE_BINS), dtype=np.int64)
    if len(lengths):
        row = np.repeat(np.arange(len(lengths)), lengths)
        within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        column = np.repeat(np.asarray(starts, dtype=np.int64), lengths) + within
        rows[row, column] = spans.flatten().to_numpy()
    return rows
