"""Drawing the pictures of :func:`~hooktrace.analyze.plots.plots.plot`: a heatmap of modules over
steps per table, and the histograms picture. Never imports torch; matplotlib is imported
inside, with the Agg canvas only (no pyplot, no window, no global state).

Apart from :mod:`hooktrace.analyze.plots.plots` because this is all matplotlib: ``plot`` checks the
options and reads the tables (:mod:`hooktrace.analyze.plots.tables`), these draw them, and
the report draws them too. Past 400 lines by a few: the five pictures share their heatmap,
axes and name helpers, and are read together.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from hooktrace.analyze.histograms.histograms import RECORD, in_order, per_step
from hooktrace.analyze.histograms.precision import FP16
from hooktrace.analyze.plots.tables import ONE_RUN_ONLY, histogram_table, layer_name
from hooktrace.errors import HooktraceError
from hooktrace.trace.reader import Trace

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from hooktrace.analyze.diff.result import DiffResult

NAME_WIDTH = 36
"""Module names longer than this many characters are shortened from the left."""

NONFINITE_COLOUR = "#e74c3c"
ONE_RUN_ONLY_COLOUR = "#16a085"  # far from the plasma and magma colour maps, and from red
ZERO_COLOUR = "#9e9e9e"
MARK_COLOUR = "#dddddd"


class PlotUnavailable(HooktraceError):
    """matplotlib is not installed."""


def grad_norms_figure(trace: Trace, table: pd.DataFrame, *, max_modules: int = 40) -> Figure:
    """The grad-norms picture of ``table`` (from :func:`grad_norm_table`)."""
    table, note = _chosen(table, max_modules)
    figure, (ax,) = _figure(len(table), 1)
    _heatmap(
        figure,
        ax,
        table,
        label="gradient norm (log10)",
        log=True,
        cmap="viridis",
        empty="no parameter gradients recorded (params=False?)",
    )
    ax.set_title(_plain(f"{_name(trace)}: parameter gradient norm per module{note}"), loc="left")
    return figure


def activations_figure(
    trace: Trace, rms: pd.DataFrame, zeros: pd.DataFrame, *, max_modules: int = 40
) -> Figure:
    """The activations picture of the tables :func:`activation_tables` returns."""
    rms, note = _chosen(rms, max_modules)
    zeros = zeros.reindex(index=rms.index, columns=rms.columns)
    figure, (left, right) = _figure(len(rms), 2)
    empty = "no train-phase outputs recorded"
    _heatmap(
        figure, left, rms, label="RMS of outputs (log10)", log=True, cmap="viridis", empty=empty
    )
    _heatmap(
        figure,
        right,
        zeros,
        label="fraction of zeros",
        log=False,
        cmap="magma",
        vmax=1.0,
        empty=empty,
    )
    right.set_yticks([])
    left.set_title(_plain(f"{_name(trace)}: outputs per module (train){note}"), loc="left")
    return figure


def dead_units_figure(
    trace: Trace, silent: pd.DataFrame, layers: pd.DataFrame, *, max_modules: int = 40
) -> Figure:
    """The dead-units picture: ``silent`` from :func:`silent_unit_table`, ``layers`` the
    ``layers`` table of :func:`dead_relus`."""
    table, note = _chosen(silent, max_modules)
    calls = layers["module"].map(layers["module"].value_counts())
    names = [
        layer_name(m, c, n) for m, c, n in zip(layers["module"], layers["call"], calls, strict=True)
    ]
    layers = layers.set_axis(names)
    figure, (ax, bars) = _figure(len(table), 2, ratios=(4, 1))
    _heatmap(
        figure,
        ax,
        table,
        label="share of units silent",
        log=False,
        cmap="magma",
        vmax=1.0,
        empty="no per-unit activity of ReLU-family layers recorded",
    )
    title = f"{_name(trace)}: silent units per ReLU layer and step{note}"
    ax.set_title(_plain(title), loc="left")
    if table.empty:
        bars.set_axis_off()
        return figure
    fraction = layers["dead_fraction"].reindex(table.index, fill_value=0.0).to_numpy()
    flagged = layers["flagged"].reindex(table.index, fill_value=False).to_numpy(dtype=bool)
    bars.barh(np.arange(len(table)), fraction, color=np.where(flagged, "#c0392b", "#7f8c8d"))
    for y, value in enumerate(fraction):
        bars.text(min(value, 0.7) + 0.03, y, f"{value:.0%}", va="center", fontsize=8)
    bars.set_ylim(len(table) - 0.5, -0.5)
    bars.set_xlim(0, 1)
    bars.set_yticks([])
    bars.set_xlabel("dead at the end (red: flagged)")
    return figure


def histograms_figure(
    trace: Trace, frame: pd.DataFrame, matched: int | None = None, *, max_modules: int = 40
) -> Figure:
    """The histograms picture of :func:`hooktrace.hist`'s ``frame``: a panel per record (at
    most ``max_modules``), ``matched`` the records there were to choose from."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.figure import Figure

    require_matplotlib()
    rows = in_order(per_step(frame))
    groups = list(rows.groupby(RECORD, sort=False))[:max_modules]
    notes = []
    if matched is not None and matched > len(groups):
        notes.append(f"{len(groups)} of {matched} records shown: choose with modules/kinds")
    drawn, histogrammed_steps = frame["step"].nunique(), frame.attrs.get("steps")
    if isinstance(histogrammed_steps, int) and histogrammed_steps > drawn:
        notes.append(f"{drawn} of {histogrammed_steps} steps, evenly spaced")
    note = f" ({'; '.join(notes)})" if notes else ""
    tables = []
    for key, stats in groups:
        mine = frame[(frame[RECORD] == pd.Series(key, index=RECORD)).all(axis=1)]
        table = histogram_table(mine)
        stats = stats.set_index("step").reindex(table.columns)
        numel = stats["numel"].where(stats["numel"] > 0).astype("float64")
        below = (stats["zero"] / numel).to_numpy()
        above = ((stats["nan"] + stats["inf"]) / numel).to_numpy()
        tables.append((key, table, np.vstack([below, table.to_numpy(), above])))
    heights = [len(cells) for _, _, cells in tables] or [1]
    height = min(1.2 + sum(0.09 * h + 0.7 for h in heights), 40.0)
    figure = Figure(figsize=(10.0, height), layout="constrained")
    FigureCanvasAgg(figure)
    title = f"{_name(trace)}: distribution of |x| over steps{note}"
    if not tables:
        ax = figure.subplots()
        ax.text(0.5, 0.5, "no histograms to draw", ha="center", va="center")
        ax.set_axis_off()
        ax.set_title(_plain(title), loc="left")
        return figure
    axes = figure.subplots(len(tables), 1, squeeze=False, height_ratios=heights)[:, 0]
    shares = np.concatenate([cells[np.isfinite(cells) & (cells > 0)] for _, _, cells in tables])
    norm = LogNorm(vmin=max(float(shares.min()) if shares.size else 1e-6, 1e-12), vmax=1.0)
    image = None
    for ax, (key, table, cells) in zip(axes, tables, strict=True):
        shown = np.ma.masked_where(~(cells > 0), cells)
        shown[-1] = np.ma.masked  # NaN/Inf: red, below
        image = ax.imshow(
            shown, origin="lower", aspect="auto", interpolation="nearest", cmap="viridis", norm=norm
        )
        nonfinite = np.zeros_like(cells, dtype=bool)
        nonfinite[-1] = cells[-1] > 0
        if nonfinite.any():
            ax.imshow(
                np.ma.masked_where(~nonfinite, np.ones_like(cells)),
                origin="lower",
                aspect="auto",
                interpolation="nearest",
                cmap=ListedColormap([NONFINITE_COLOUR]),
            )
        _exponent_axis(ax, [int(e) for e in table.index])
        steps = [int(s) for s in table.columns]
        every = max(1, math.ceil(len(steps) / 12))
        ticks = list(range(0, len(steps), every))
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=8)
        _, module, kind, slot = key
        ax.set_title(_plain(f"{_short(str(module))} {kind} {slot}"), loc="left", fontsize=9)
    axes[-1].set_xlabel("step")
    figure.suptitle(_plain(title), x=0.0, ha="left")
    assert image is not None
    figure.colorbar(
        image, ax=list(axes), label="share of the step's values (log scale)", fraction=0.04
    )
    return figure


_FP16_LINES = (
    (FP16.smallest_subnormal, "fp16 underflow below"),
    (FP16.smallest_normal, "fp16 subnormal below"),
    (FP16.overflow, "fp16 overflow from"),
)


def _exponent_axis(ax: Axes, exponents: list[int]) -> None:
    """Rows: exact zeros (0), then one per exponent, then NaN/Inf; float16's limits as lines
    at the bottom edge of their row, labelled on the right."""
    last = len(exponents) + 1
    # ticks on float16's limits: every 1, 2, 5, 10, ... powers of two counted from 2^-24
    every = next(n for n in (1, 2, 5, 10, 20, 50, 100) if len(exponents) / n <= 10)
    labelled = [
        (i + 1, e) for i, e in enumerate(exponents) if (e - FP16.smallest_subnormal) % every == 0
    ]
    ticks = [0, *(y for y, _ in labelled), last]
    labels = ["0", *(f"$2^{{{e}}}$" for _, e in labelled), "NaN/Inf"]
    ax.set_yticks(ticks, labels, fontsize=7)
    for edge in (0.5, last - 0.5):
        ax.axhline(edge, color=MARK_COLOUR, linewidth=0.8)
    for exponent, text in _FP16_LINES:
        if exponents[0] <= exponent <= exponents[-1] + 1:
            y = exponent - exponents[0] + 0.5
            ax.axhline(y, color="#e67e22", linewidth=1.0, linestyle="--")
            ax.text(
                1.005,
                y,
                f"{text} $2^{{{exponent}}}$",
                transform=ax.get_yaxis_transform(),
                fontsize=7,
                va="center",
                color="#e67e22",
            )


def diff_figure(
    a: Trace, b: Trace, table: pd.DataFrame, result: DiffResult, *, max_modules: int = 40
) -> Figure:
    """The diff picture of ``table`` and ``result`` (both from :func:`diff_table`)."""
    table, note = _chosen(table, max_modules)
    figure, (ax,) = _figure(len(table), 1)
    _heatmap(
        figure,
        ax,
        table.where(table > 0),
        label="largest relative difference (log10)",
        log=True,
        cmap="plasma",
        inf_label="non-finite",
        marks={
            "in one run only": (table == ONE_RUN_ONLY, ONE_RUN_ONLY_COLOUR),
            "equal within tolerance": (table == 0, MARK_COLOUR),
        },
        empty="no records to compare",
    )
    verdict = "match" if result.match else "differ"
    title = (
        f"{_name(a)} vs {_name(b)}: {verdict} (rtol {result.rtol:g}, atol {result.atol:g}){note}"
    )
    first = result.first
    if first is not None and first.module in table.index and first.step in table.columns:
        y, x = table.index.get_loc(first.module), table.columns.get_loc(first.step)
        ax.plot(
            [x],
            [y],
            marker="o",
            markersize=12,
            markerfacecolor="none",
            markeredgecolor="#00b4ff",
            markeredgewidth=2,
        )
        where = f"first divergence (circled): step {first.step}, {first.kind} of {first.module}"
        title = f"{_plain(title)}\n{_plain(where)}"  # two lines: each part escaped on its own
    else:
        title = _plain(title)
    ax.set_title(title, loc="left")
    return figure


def _heatmap(
    figure: Figure,
    ax: Axes,
    table: pd.DataFrame,
    *,
    label: str,
    log: bool,
    cmap: str,
    empty: str,
    vmax: float | None = None,
    inf_label: str = "NaN or Inf",
    marks: dict[str, tuple[pd.DataFrame, str]] | None = None,
) -> None:
    """``table`` (modules x steps) as an image, with the layers of :func:`cell_layers` over
    it and in the legend; NaN (nothing recorded) white."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    if table.empty:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    raw = table.to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        shown = np.ma.masked_invalid(np.log10(raw) if log else raw)
    if shown.count():
        image = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, vmax=vmax)
        figure.colorbar(image, ax=ax, label=label, fraction=0.05, pad=0.02)
    handles = []
    for name, (mask, colour) in cell_layers(table, log=log, inf_label=inf_label, marks=marks):
        ax.imshow(
            np.ma.masked_where(~mask, np.ones_like(raw)),
            aspect="auto",
            interpolation="nearest",
            cmap=ListedColormap([colour]),
        )
        handles.append(Patch(color=colour, label=name))
    if handles:
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(0.0, -0.08),
            ncol=3,
            fontsize=8,
            frameon=False,
        )
    _axes(ax, table)


def cell_layers(
    table: pd.DataFrame,
    *,
    log: bool,
    inf_label: str = "NaN or Inf",
    marks: dict[str, tuple[pd.DataFrame, str]] | None = None,
) -> list[tuple[str, tuple[np.ndarray, str]]]:
    """The cells of ``table`` drawn in one colour over the image, each layer with its legend
    label, mask and colour, in drawing order: +inf (``inf_label``) red, zeros (on a log
    scale) grey, then each of ``marks`` (a boolean table and a colour); only layers with a
    cell. A cell is in one layer at most: the first that takes it."""
    raw = table.to_numpy(dtype=np.float64)
    layers = [(inf_label, (raw == np.inf, NONFINITE_COLOUR))]
    if log:
        layers.append(("zero", (raw == 0, ZERO_COLOUR)))
    for name, (mask, colour) in (marks or {}).items():
        layers.append((name, (mask.to_numpy(dtype=bool), colour)))
    taken = np.zeros(raw.shape, dtype=bool)
    found = []
    for name, (mask, colour) in layers:
        mine = mask & ~taken
        taken |= mine
        if mine.any():
            found.append((name, (mine, colour)))
    return found


def _axes(ax: Axes, table: pd.DataFrame) -> None:
    """Module names on y (shortened, never parsed as math), step numbers on x."""
    names = [_plain(_short(str(n))) for n in table.index]
    ax.set_yticks(range(len(names)), names, fontsize=8 if len(names) < 30 else 6)
    steps = list(table.columns)
    every = max(1, math.ceil(len(steps) / 12))
    ticks = list(range(0, len(steps), every))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=8)
    ax.set_xlabel("step")


def _figure(rows: int, columns: int, ratios: tuple[int, ...] | None = None) -> tuple[Figure, Any]:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    height = min(2.0 + 0.22 * max(rows, 3), 40.0)
    figure = Figure(figsize=(6.0 + 4.0 * columns, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, columns, squeeze=False, width_ratios=ratios)[0]
    return figure, axes


def _chosen(table: pd.DataFrame, max_modules: int) -> tuple[pd.DataFrame, str]:
    """At most ``max_modules`` rows, those with the largest values, kept in their order."""
    if len(table) <= max_modules:
        return table, ""
    rank = table.max(axis=1).rank(method="first", ascending=False)
    kept = table[rank.to_numpy() <= max_modules]
    return kept, f" ({max_modules} of {len(table)} shown: the largest)"


def _short(name: str, width: int = NAME_WIDTH) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def _plain(text: str) -> str:
    """Text that matplotlib draws as it is: ``$`` would start mathtext, and a character no
    font draws (a NUL, a line break, a byte that was not UTF-8, in a module's name) is shown
    as its escape, as Python writes it (``\\x00``), not as a box and a warning."""
    text = text.replace("$", r"\$")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _name(trace: Trace) -> str:
    return _short(trace.path.name or str(trace.path), 40)


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(
            "pictures need matplotlib, which is not installed: pip install 'hooktrace[plot]'"
        ) from None
