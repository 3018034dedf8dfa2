"""The records two runs hold bit for bit, found in Arrow before pandas sees a row. No torch.

Two runs of one script agree on almost every record until they diverge. Aligning and
comparing each of those in pandas (:mod:`hooktrace.analyze.diff.compare`) was most of a diff's
time; here a chunk of each run, as pyarrow read it, is checked column by column in numpy, and
only the rows that are not the same go on to be aligned and compared.

"The same" is stricter than ``equal``: every key, the seq, and every compared value (dtype,
shape, numel, the statistics and counts) identical, NaN matching NaN and a missing value
matching a missing one, as :func:`~hooktrace.analyze.diff.compare.compare` treats them; and not
a pair of full tensors, which are compared value by value. Such a row is ``equal`` at any tolerance,
with every difference 0. The chunks pair row by row only when they hold the same keys in the
same order, as two runs of one script write them; otherwise :func:`same_rows` says so, and
the whole chunk is aligned.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hooktrace.trace.schema import COUNT_COLUMNS, STAT_COLUMNS

COMPARED = ("dtype", "shape", "numel", *STAT_COLUMNS, *COUNT_COLUMNS)
"""The values that must be identical, besides the keys."""


def same_rows(a: pa.Table, b: pa.Table, keys: Sequence[str]) -> np.ndarray | None:
    """Where ``a`` and ``b`` hold, row by row, the same record with the same values and not
    both a full tensor (a boolean mask); None when they do not pair row by row (another
    length, or a key that differs somewhere)."""
    if a.num_rows != b.num_rows:
        return None
    for key in (*keys, "seq"):  # seq too: both then sort into (rank, step, seq) alike
        if not _equal(a.column(key), b.column(key)).all():
            return None
    same = np.ones(a.num_rows, dtype=bool)
    for name in COMPARED:
        same &= _equal(a.column(name), b.column(name))
    same &= ~(_saved(a.column("tensor_key")) & _saved(b.column("tensor_key")))
    return same


def others(table: pa.Table, same: np.ndarray) -> pa.Table:
    """The rows of ``table`` that are not the same (``same`` from :func:`same_rows`)."""
    return table.filter(pa.array(~same)) if same.any() else table


def _equal(x: pa.ChunkedArray, y: pa.ChunkedArray) -> np.ndarray:
    """Element-wise identity of two columns of one type (NaN and null match themselves)."""
    if pa.types.is_dictionary(x.type):
        return _equal_names(x.combine_chunks(), y.combine_chunks())
    if pa.types.is_string(x.type) or pa.types.is_large_string(x.type):
        equal = pc.equal(x, y)
        both_null = pc.and_(x.is_null(), y.is_null())
        return np.asarray(pc.or_kleene(equal, both_null).fill_null(False).to_numpy())
    if x.null_count == 0 and y.null_count == 0 and pa.types.is_floating(x.type):
        # bit patterns: one comparison, NaN matching the same NaN (-0.0 and 0.0 do not
        # match here, and are compared)
        xv, yv = x.to_numpy(), y.to_numpy()
        return np.asarray(xv.view(np.int64) == yv.view(np.int64))
    xv, yv = x.to_numpy(), y.to_numpy()  # nulls read as NaN
    if xv.dtype.kind == "f" or yv.dtype.kind == "f":
        return np.asarray((xv == yv) | (np.isnan(xv) & np.isnan(yv)))
    return np.asarray(xv == yv)


def _equal_names(x: pa.DictionaryArray, y: pa.DictionaryArray) -> np.ndarray:
    """Element-wise identity of two dictionary-encoded string columns."""
    x_codes, y_codes = x.indices, y.indices
    if x.null_count == 0 and y.null_count == 0 and x.dictionary.equals(y.dictionary):
        return np.asarray(x_codes.to_numpy() == y_codes.to_numpy())
    # each part has its own dictionary: y's names as indices into x's, one lookup per name;
    # a null is -2 on both sides, a name x lacks -1 (the lookup's last entry serves y's nulls)
    found = pc.index_in(y.dictionary, value_set=x.dictionary).fill_null(-1)
    lookup = np.append(found.to_numpy().astype(np.int64), -2)
    xc = x_codes.fill_null(-2).to_numpy().astype(np.int64)
    yc = lookup[y_codes.fill_null(-1).to_numpy().astype(np.int64)]
    return np.asarray(xc == yc)


def _saved(tensor_key: pa.ChunkedArray) -> np.ndarray:
    """Where a full tensor was saved (its key is not "")."""
    return np.asarray(pc.not_equal(tensor_key, "").fill_null(False).to_numpy())
