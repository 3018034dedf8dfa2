"""The histogram table's spans (hooktrace/trace/histograms.py): each row stored as its
occupied span of bins, read back whole."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from hooktrace.trace import histograms as H


def spans_by_mask(bins: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
    """The spans worked out row by row, the plain way: an independent reference."""
    starts, spans = [], []
    for row in bins:
        nonzero = np.flatnonzero(row)
        if len(nonzero) == 0:
            starts.append(0)
            spans.append([])
        else:
            starts.append(int(nonzero[0]))
            spans.append(row[nonzero[0] : nonzero[-1] + 1].tolist())
    return np.array(starts, dtype=np.int16), spans


rows_of_bins = st.lists(
    st.lists(st.integers(0, 3), min_size=H.MAGNITUDE_BINS, max_size=H.MAGNITUDE_BINS).map(
        lambda row: [v if v > 1 else 0 for v in row]  # mostly empty, as real rows are
    ),
    min_size=0,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(rows_of_bins)
def test_spans_are_the_occupied_bins_of_each_row_and_read_back_whole(rows: list[list[int]]) -> None:
    bins = np.array(rows, dtype=np.int64).reshape(-1, H.MAGNITUDE_BINS)
    starts, spans = H._spans(bins)
    want_starts, want_spans = spans_by_mask(bins)
    np.testing.assert_array_equal(starts, want_starts)
    assert starts.dtype == np.int16
    assert spans.to_pylist() == want_spans
    assert spans.type == pa.list_(pa.int64())
    np.testing.assert_array_equal(H.whole(starts, spans), bins)


def test_spans_of_edge_rows() -> None:
    """Empty, full, first bin only, last bin only, and a strided view (as the writer passes
    the positive and negative halves of each histogram row)."""
    width = H.MAGNITUDE_BINS
    bins = np.zeros((5, width), dtype=np.int64)
    bins[1] = 1
    bins[2, 0] = 7
    bins[3, width - 1] = 9
    bins[4, [3, 10]] = [2, 5]
    wide = np.zeros((5, width + 3), dtype=np.int64)
    wide[:, 2 : 2 + width] = bins
    for view in (bins, wide[:, 2 : 2 + width]):
        starts, spans = H._spans(view)
        assert starts.tolist() == [0, 0, 0, width - 1, 3]
        assert [len(s) for s in spans.to_pylist()] == [0, width, 1, 1, 8]
        np.testing.assert_array_equal(H.whole(starts, spans), bins)
