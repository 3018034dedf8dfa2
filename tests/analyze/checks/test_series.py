"""The series checks' screen: :func:`series.may_rise_all` passes over every series at once,
and must never pass over one in which :func:`series.episodes` finds an episode."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from hooktrace.analyze.checks import series
from hooktrace.analyze.checks.series import Config, episodes, may_rise_all

CONFIG = Config(window=5, spike_factor=10.0, explode_factor=100.0, exploding_above=1e6)

# norms over a few orders of magnitude, with what episodes() does not judge among them
values = st.one_of(
    st.floats(1e-3, 1e3),
    st.sampled_from([0.0, -1.0, math.nan, math.inf, 1e-30, 1e30]),
)
all_series = st.lists(
    st.lists(st.one_of(st.floats(1e-3, 1e3), values), min_size=1, max_size=40),
    min_size=1,
    max_size=8,
)


def concatenated(found: list[list[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.array([len(s) for s in found])
    ends = np.cumsum(lengths)
    return np.array([v for s in found for v in s], dtype=np.float64), ends - lengths, ends


@settings(max_examples=300, deadline=None)
@given(all_series, st.integers(2, 7))
def test_a_series_passed_over_has_no_episode(found: list[list[float]], window: int) -> None:
    config = Config(window, 10.0, 100.0, 1e6)
    flat, starts, ends = concatenated(found)
    screened = may_rise_all(flat, starts, ends, window, 1.0)
    whole, series.PADDED_VALUES = series.PADDED_VALUES, 5  # a group of series a few values
    try:
        assert may_rise_all(flat, starts, ends, window, 1.0).tolist() == screened.tolist()
    finally:
        series.PADDED_VALUES = whole
    for one, may in zip(found, screened, strict=True):
        assert may or not episodes(np.array(one), config)
        judged = np.array([v for v in one if math.isfinite(v) and v > 0])
        if len(judged) == len(one):  # a series episodes() judges whole: the screen is _rises
            assert may == series._rises(np.log10(judged), window, 1.0)


def test_a_window_longer_than_every_series_is_all_before() -> None:
    found = [[1.0, 2.0, 11.0], [5.0], [3.0, 3.0]]
    for window in (2, 3, 1000):
        assert may_rise_all(*concatenated(found), window=window, jump=1.0).tolist() == [
            True,
            False,
            False,
        ]
    assert may_rise_all(*concatenated([[5.0], [50.0]]), window=20, jump=1.0).tolist() == [
        False,
        False,
    ]


def test_each_series_is_screened_against_its_own_past_only() -> None:
    # a tenth of the series before it is no rise; ten times its own last value is
    low, flat, jump = [1.0] * 6, [100.0] * 6, [1.0, 1.0, 12.0]
    got = may_rise_all(*concatenated([low, flat, jump]), window=3, jump=1.0)
    assert got.tolist() == [False, False, True]
    # the window: ten times what was 3 values back is not a rise at window 2
    assert may_rise_all(*concatenated([[1.0, 5.0, 5.0, 11.0]]), window=2, jump=1.0).tolist() == [
        False
    ]
    assert may_rise_all(*concatenated([[1.0, 5.0, 5.0, 11.0]]), window=3, jump=1.0).tolist() == [
        True
    ]


def test_the_findings_of_whole_tables_are_those_of_every_series_judged() -> None:
    rng = np.random.default_rng(7)
    rows = []
    for module in range(40):
        norms = np.exp(rng.normal(0, 0.3, 60)) * 10.0 ** rng.integers(-3, 3)
        if module % 7 == 0:
            norms[30] *= 50  # a spike
        if module % 11 == 0:
            norms[40:] *= 1e4  # an explosion
        if module % 13 == 0:
            norms[10] = 0.0  # a step episodes() does not judge
        rows += [(0, module, step, value, module) for step, value in enumerate(norms)]
    table = pd.DataFrame(rows, columns=["rank", "module", "step", "value", "seq"])
    table["module"] = pd.Categorical.from_codes(
        table["module"], categories=[f"m{i}" for i in range(40)]
    )
    screened = series.gradient_findings([table], CONFIG, 1e-7)
    activations = series.activation_findings([table], CONFIG)
    unsorted = table.sample(frac=1.0, random_state=1)  # not in order: every series is judged
    assert screened == series.gradient_findings([unsorted], CONFIG, 1e-7)
    assert activations == series.activation_findings([unsorted], CONFIG)
    assert {f.kind for f in screened} == {"gradient_spike", "exploding_gradient"}


def test_a_jump_of_next_to_nothing_over_series_of_one_value() -> None:
    # spike_factor 1 + 1e-9: the spread of one value passes; nothing is there to rise from
    got = may_rise_all(*concatenated([[1.0], [2.0]]), window=5, jump=math.log10(1 + 1e-9))
    assert got.tolist() == [False, False]
