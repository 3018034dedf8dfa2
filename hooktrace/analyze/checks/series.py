"""Norms over steps against a robust baseline: the exploding, vanishing and spike checks of
:func:`hooktrace.anomalies` (the definitions are in its module docstring). Never imports torch.

Work happens in log10 space, where "10 times the baseline" is a fixed distance whatever the
scale. The baseline of a step is the median of the last ``window`` normal steps before it;
the spread is their median absolute deviation (MAD, scaled by 1.4826 to a standard deviation).
Steps found high stay out of the baseline, so a sustained explosion keeps being measured
against the level it left, not against itself. An episode starts at its onset: its first high
step, or earlier while the steps just before were already sqrt(spike_factor) times the
baseline (half the jump in log scale), so a steady 10x-a-step growth starts where it starts.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.lib.stride_tricks import sliding_window_view

from hooktrace.analyze.findings import Finding, fmt, keys
from hooktrace.trace.filters import in_order

MADS = 5.0
"""A high step is also this many (scaled) MADs above the baseline: noisy series need more."""
MIN_HISTORY = 1
"""Normal steps needed before a step can be judged."""
MAD_HISTORY = 5
"""Normal steps needed before the MAD is trusted (a short history's MAD is mostly noise)."""
GAP = 3
"""High steps at most GAP - 1 steps apart (in recorded steps) belong to one episode."""


@dataclass(frozen=True)
class Config:
    window: int
    spike_factor: float
    explode_factor: float
    exploding_above: float


@dataclass
class Episode:
    """High steps close together: positions into the series, and what they reached."""

    start: int
    end: int
    high: int
    peak: int
    peak_ratio: float  # peak value / baseline at the peak
    baseline: float  # the baseline at the first high step
    reaches_end: bool = False


def episodes(values: np.ndarray, config: Config) -> list[Episode]:
    """Episodes of high steps in ``values`` (one per recorded step, in order)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(np.isfinite(values) & (values > 0), np.log10(values), np.nan)
    jump = math.log10(config.spike_factor)
    judged = ~np.isnan(z)
    if judged.sum() <= MIN_HISTORY:
        return []
    # fast screens: until its first high step, a series' baseline is the plain rolling median,
    # which is never below the smallest value of its window
    if not _rises(z[judged], config.window, jump):
        return []
    finite = pd.Series(z[judged])
    plain = finite.rolling(config.window, min_periods=MIN_HISTORY).median().shift(1)
    if not ((finite - plain) >= jump).any():
        return []
    history: deque[float] = deque(maxlen=config.window)
    high: list[tuple[int, float, float]] = []  # position, excess (log10), baseline (log10)
    for i in np.flatnonzero(judged):
        zi = float(z[i])
        if len(history) >= MIN_HISTORY:
            past = np.fromiter(history, dtype=np.float64)
            base = float(np.median(past))
            spread = (
                1.4826 * float(np.median(np.abs(past - base))) if len(past) >= MAD_HISTORY else 0.0
            )
            if zi - base >= max(jump, MADS * spread):
                high.append((int(i), zi - base, base))
                continue
        history.append(zi)
    last_judged = int(np.flatnonzero(judged)[-1])
    found: list[Episode] = []
    for position, excess, base in high:
        current = found[-1] if found else None
        if current is not None and position - current.end <= GAP:
            current.end, current.high = position, current.high + 1
            if excess > math.log10(current.peak_ratio):
                current.peak, current.peak_ratio = position, 10**excess
        else:
            found.append(Episode(position, position, 1, position, 10**excess, 10**base))
    # the onset: an episode starts earlier while the steps just before it were already half
    # the jump (in log scale, sqrt(spike_factor) times) above the baseline it left
    positions = np.flatnonzero(judged)
    floor = -1
    for episode in found:
        onset = math.log10(episode.baseline) + jump / 2
        k = int(np.searchsorted(positions, episode.start))
        while k > 0 and positions[k - 1] > floor and z[positions[k - 1]] >= onset:
            k -= 1
        episode.start, floor = int(positions[k]), episode.end
        episode.reaches_end = episode.end == last_judged
    return found


def _rises(values: np.ndarray, window: int, jump: float) -> bool:
    """Whether some value is ``jump`` above the smallest of the ``window`` values before it
    (with MIN_HISTORY 1: any before it, at the start)."""
    if len(values) < 2:
        return False
    low = np.minimum.accumulate(values[:-1])  # low[j]: the smallest before values[j + 1]
    if len(values) > window:
        low[window - 1 :] = sliding_window_view(values[:-1], window).min(axis=1)
    return bool((values[1:] - low >= jump).any())


def is_exploding(episode: Episode, values: np.ndarray, config: Config) -> bool:
    big = (
        episode.peak_ratio >= config.explode_factor or values[episode.peak] > config.exploding_above
    )
    return big and (episode.high > 1 or episode.reaches_end)


def gradient_findings(
    tables: Iterable[pd.DataFrame], config: Config, vanishing_below: float
) -> list[Finding]:
    """exploding_gradient, gradient_spike and vanishing_gradient, per rank and module, from
    tables of one parameter-gradient norm per (rank, module, step) (columns rank, module,
    step, value), each holding whole modules, in (rank, module) order."""
    found: list[Finding] = []
    for rank, module, _, steps, values, may_rise in (
        s for table in tables for s in _series(table, config)
    ):
        spikes: list[Episode] = []
        exploding: list[Episode] = []
        for episode in episodes(values, config) if may_rise else []:
            (exploding if is_exploding(episode, values, config) else spikes).append(episode)
        if exploding:
            found.append(_exploding(rank, module, steps, values, exploding, config))
        elif (values > config.exploding_above).any():
            at = int(np.flatnonzero(values > config.exploding_above)[0])
            found.append(
                Finding(
                    "exploding_gradient", "error", module, int(steps[at]), rank=rank,
                    evidence=f"gradient norm {fmt(values[at])} at step {steps[at]}, above the bound "
                    f"{fmt(config.exploding_above)}",
                    explanation="the gradient is far too large: lower the learning rate, clip "
                    "gradients or check the loss scale",
                    value=float(values[at]), reference=config.exploding_above,
                    count=int((values > config.exploding_above).sum()),
                )
            )  # fmt: skip
        if spikes:
            found.append(
                _spike("gradient_spike", "gradient norm", rank, module, steps, values, spikes)
            )
        small = np.flatnonzero((values > 0) & (values < vanishing_below))
        if len(small):
            found.append(
                Finding(
                    "vanishing_gradient", "warning", module, int(steps[small[0]]), rank=rank,
                    last_step=int(steps[small[-1]]),
                    evidence=f"gradient norm below {fmt(vanishing_below)} at {len(small)} of "
                    f"{len(values)} steps, from step {steps[small[0]]} (lowest {fmt(values[small].min())})",
                    explanation="the parameters barely move: check initialisation, normalisation "
                    "and saturating activations upstream",
                    value=float(values[small].min()), reference=vanishing_below, count=len(small),
                )
            )  # fmt: skip
    return found


def activation_findings(tables: Iterable[pd.DataFrame], config: Config) -> list[Finding]:
    """activation_spike per rank and module, from tables of one output norm per (rank,
    module, step) (columns rank, module, step, value, seq), each holding whole modules, in
    (rank, module) order; a series equal to an earlier-recorded module's (a container's
    output is its last child's) is left out. Only a digest of each series is kept across
    tables, and the findings."""
    # (rank, first seq, position, digest, finding or None) per series
    candidates: list[tuple[int, int, int, bytes, Finding | None]] = []
    for table in tables:
        for rank, module, first, steps, values, may_rise in _series(table, config):
            digest = hashlib.blake2b(
                bytes([rank % 256]) + steps.tobytes() + values.tobytes(), digest_size=16
            ).digest()
            spikes = episodes(values, config) if may_rise else []
            finding = (
                _spike("activation_spike", "output norm", rank, module, steps, values, spikes)
                if spikes
                else None
            )
            candidates.append((rank, first, len(candidates), digest, finding))
    seen: set[bytes] = set()
    found: list[Finding] = []
    for _, _, _, digest, finding in sorted(candidates, key=lambda c: (c[0], c[1], c[2])):
        if digest in seen:
            continue
        seen.add(digest)
        if finding is not None:
            found.append(finding)
    return found


def _series(
    table: pd.DataFrame, config: Config
) -> list[tuple[int, str, int, np.ndarray, np.ndarray, bool]]:
    """(rank, module, first seq, steps, values, whether it may hold an episode) per rank and
    module, in step order: where it may not, :func:`episodes` finds none."""
    module = table["module"]
    if isinstance(module.dtype, pd.CategoricalDtype) and len(table):
        # as SeriesStore gives them: sorted by (rank, module, step), one row a step
        rank, code = table["rank"].to_numpy(), module.cat.codes.to_numpy()
        steps = table["step"].to_numpy()
        if in_order(
            pd.DataFrame({"rank": rank, "code": code, "step": steps}), ["rank", "code", "step"]
        ):
            return _sorted_series(table, rank, code, steps, config)
    found = []
    for key, group in table.groupby(["rank", "module"], sort=True, observed=True):
        rank, module = keys(key)
        group = group.sort_values("step", kind="stable")
        first = int(group["seq"].min()) if "seq" in group else 0
        steps, values = group["step"].to_numpy(), group["value"].to_numpy(dtype=np.float64)
        found.append((int(rank), str(module), first, steps, values, True))
    return found


def _sorted_series(
    table: pd.DataFrame, rank: np.ndarray, code: np.ndarray, steps: np.ndarray, config: Config
) -> list[tuple[int, str, int, np.ndarray, np.ndarray, bool]]:
    """What :func:`_series` finds, from a table already in (rank, module, step) order."""
    starts = np.flatnonzero(np.r_[True, (rank[1:] != rank[:-1]) | (code[1:] != code[:-1])])
    ends = np.r_[starts[1:], len(table)]
    values = table["value"].to_numpy(dtype=np.float64)
    seq = table["seq"].to_numpy() if "seq" in table else np.zeros(len(table), dtype=np.int64)
    first = np.minimum.reduceat(seq, starts)
    may_rise = may_rise_all(values, starts, ends, config.window, math.log10(config.spike_factor))
    names = table["module"].cat.categories
    return [
        (int(rank[a]), str(names[code[a]]), int(f), steps[a:b], values[a:b], bool(m))
        for a, b, f, m in zip(starts.tolist(), ends.tolist(), first.tolist(), may_rise, strict=True)
    ]


SCREEN_MARGIN = 1e-9
"""How much closer than the jump (log10) :func:`may_rise_all` still calls a rise: its
logarithms may differ from :func:`episodes`' in the last bit."""


def may_rise_all(
    values: np.ndarray, starts: np.ndarray, ends: np.ndarray, window: int, jump: float
) -> np.ndarray:
    """For each series ``values[a:b]`` (``a``, ``b`` of ``starts``, ``ends``, none empty),
    whether :func:`episodes` may find an episode in it: False only where every value is
    less than ``jump`` (log10) above the smallest of the ``window`` before it, which
    :func:`_rises` would say too. A series with a value :func:`episodes` does not judge
    (not finite, or not above 0) is True: it leaves such values out of its windows, and
    decides itself.

    Many series at once, in a few passes over their values. A series whose values all lie
    within the jump of each other is False at once; the others are screened window by
    window, in groups of about :data:`PADDED_VALUES` values, each series' windows seeing
    ``window`` times +inf before its first value, never the series before it."""
    if not len(starts):
        return np.zeros(0, dtype=bool)
    lengths = ends - starts
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(np.isfinite(values) & (values > 0), np.log10(values), np.nan)
    found = np.logical_or.reduceat(np.isnan(z), starts)  # the gappy ones
    spread = np.fmax.reduceat(z, starts) - np.fmin.reduceat(z, starts)
    check = ~found & (spread >= jump - SCREEN_MARGIN)
    if not check.any():
        return found
    z, lengths = z[np.repeat(check, lengths)], lengths[check]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    window = min(window, int(lengths.max()) - 1)  # no window sees more than all before
    if window < 1:  # one value a series (a jump of next to nothing passes the spread)
        found[check] = False
        return found
    group = np.cumsum(lengths + window) // PADDED_VALUES
    cuts = [0, *(np.flatnonzero(np.diff(group)) + 1).tolist(), len(starts)]
    rises = np.zeros(len(starts), dtype=bool)
    for first, stop in itertools.pairwise(cuts):
        a, b = int(starts[first]), int(ends[stop - 1])
        rises[first:stop] = _rises_all(
            z[a:b], starts[first:stop] - a, ends[first:stop] - a, window, jump
        )
    found[check] = rises
    return found


PADDED_VALUES = 1 << 21
"""About how many values, padding included, :func:`may_rise_all` screens at once."""


def _rises_all(
    z: np.ndarray, starts: np.ndarray, ends: np.ndarray, window: int, jump: float
) -> np.ndarray:
    """:func:`_rises` for series of logarithms that lie one after the other from ``z[0]``
    (none empty; none with a NaN)."""
    series = np.repeat(np.arange(len(starts)), ends - starts)
    at = np.arange(len(z)) + window * (series + 1)  # each value's place after padding
    padded = np.full(len(z) + window * len(starts), np.inf)
    padded[at] = z
    low = _sliding_min(padded, window)[at - window]  # the smallest of the window before
    return np.logical_or.reduceat(z - low >= jump - SCREEN_MARGIN, starts)


def _sliding_min(values: np.ndarray, window: int) -> np.ndarray:
    """The smallest of ``values[i : i + window]`` for each i (van Herk and Gil-Werman: a
    running minimum forwards and backwards in blocks of ``window``, whatever its size)."""
    blocks = -(-len(values) // window)
    shaped = np.concatenate([values, np.full(blocks * window - len(values), np.inf)]).reshape(
        blocks, window
    )
    forwards = np.minimum.accumulate(shaped, axis=1).ravel()
    backwards = np.minimum.accumulate(shaped[:, ::-1], axis=1)[:, ::-1].ravel()
    i = np.arange(len(values) - window + 1)
    return np.minimum(backwards[i], forwards[i + window - 1])


def _exploding(
    rank: int,
    module: str,
    steps: np.ndarray,
    values: np.ndarray,
    exploding: list[Episode],
    config: Config,
) -> Finding:
    first = exploding[0]
    span = values[first.start : first.end + 1]
    at = first.start + int(np.argmax(np.where(np.isfinite(span), span, -np.inf)))
    peak = float(values[at])  # the largest norm of the episode
    more = f"; {len(exploding) - 1} more such episode(s)" if len(exploding) > 1 else ""
    return Finding(
        "exploding_gradient", "error", module, int(steps[first.start]), rank=rank,
        last_step=int(steps[first.end]),
        evidence=f"gradient norm from a baseline of {fmt(first.baseline)} to {fmt(peak)} at step "
        f"{steps[at]} ({fmt(peak / first.baseline)}x), high at {first.high} steps of "
        f"{steps[first.start]}–{steps[first.end]}{more}",
        explanation="the gradient grew by orders of magnitude and did not settle: lower the "
        "learning rate, clip gradients or check the loss scale",
        value=float(peak), reference=first.baseline, count=first.high,
    )  # fmt: skip


def _spike(
    kind: str,
    what: str,
    rank: int,
    module: str,
    steps: np.ndarray,
    values: np.ndarray,
    spikes: list[Episode],
) -> Finding:
    worst = max(spikes, key=lambda e: e.peak_ratio)
    baseline = float(values[worst.peak] / worst.peak_ratio)  # the baseline at the peak
    at = ", ".join(str(steps[e.start]) for e in spikes[:5]) + (", ..." if len(spikes) > 5 else "")

    return Finding(
        kind, "warning", module, int(steps[spikes[0].start]), rank=rank,
        last_step=int(steps[spikes[-1].end]),
        evidence=f"{what} {fmt(worst.peak_ratio)}x its baseline at step {steps[worst.peak]} "
        f"({fmt(baseline)} to {fmt(values[worst.peak])}); {len(spikes)} jump(s), from step {at}",
        explanation=f"a sudden jump of the {what}: look at the batch and the learning rate of "
        "that step",
        value=float(values[worst.peak]), reference=baseline, count=len(spikes),
    )  # fmt: skip
