"""Pictures of a run: :func:`plot`. Never imports torch; matplotlib is an optional extra.

Each picture is a heatmap of modules (rows, in the model's order) over recorded steps
(columns), made from a table that the ``*_table`` functions return as a DataFrame, so a
notebook can draw its own:

- ``grad-norms``: the L2 norm of each module's parameter gradients per step, in log scale;
- ``activations``: the RMS of each module's outputs (train phase) and their fraction of
  zeros per step;
- ``dead-units``: per ReLU-family layer, the share of its units silent (positive in under
  ``threshold`` of their values) at each step, and beside it what :func:`dead_relus` calls
  dead at the end;
- ``histograms``: for a few histogrammed records (a parameter, a gradient), the distribution
  of ``|x|`` by binary exponent (rows) over steps (columns), as the share of values in each
  power of two in a log colour scale, with the exact zeros below and NaN/Inf above, and
  float16's limits drawn across (2^-24, 2^-14, 2^16): TensorBoard's histograms, on bins that
  are the same for every step;
- ``diff``: for two runs, the largest relative difference (``rel_diff`` of
  :func:`hooktrace.diff`) of each module's records per step, the first divergence marked;
  cells where a record is in one run only are told apart from non-finite ones.

Cells with a NaN or Inf are red; cells where nothing was recorded stay white. Long module
names are shortened from the left (``…locks.1.attn.out_proj``), and with more modules than
``max_modules`` the most remarkable ones are drawn (the title says how many). matplotlib is
imported inside, with the Agg canvas only (no pyplot, no window, no global state); the
drawing is in :mod:`hooktrace.analyze.plots.figures`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from hooktrace.analyze.checks.dead_units import dead_relus
from hooktrace.analyze.findings import StepsSpec
from hooktrace.analyze.histograms.histograms import hist, histogrammed
from hooktrace.analyze.plots.figures import (
    NAME_WIDTH,
    ONE_RUN_ONLY_COLOUR,
    PlotUnavailable,
    activations_figure,
    cell_layers,
    dead_units_figure,
    diff_figure,
    grad_norms_figure,
    histograms_figure,
    require_matplotlib,
)
from hooktrace.analyze.plots.tables import (
    Run,
    activation_tables,
    diff_table,
    grad_norm_table,
    silent_unit_table,
    trace_of,
)
from hooktrace.errors import ConfigError
from hooktrace.trace.reader import Trace

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DPI", "HISTOGRAM_PANELS", "HISTOGRAM_STEPS", "NAME_WIDTH", "ONE_RUN_ONLY_COLOUR", "WHAT",
    "PlotUnavailable", "activations_figure", "cell_layers", "check_format", "check_output",
    "chosen_histograms", "dead_units_figure", "diff_figure", "grad_norms_figure",
    "histograms_figure", "plot",
]  # fmt: skip
# the drawing lives in figures.py; its names are imported from here too

WHAT = ("grad-norms", "activations", "dead-units", "histograms", "diff")
"""The pictures :func:`plot` draws."""

HISTOGRAM_PANELS = 8
"""Records the histograms picture draws at most (fewer with ``max_modules``)."""
HISTOGRAM_STEPS = 500
"""Steps the histograms picture draws at most, evenly spaced from the first to the last."""

DPI = 110

Progress = Callable[[int, int, str], None]
"""``progress(done, total, what)``, called before each piece of work (see hooktrace.cli.progress)."""


def plot(
    run: Run,
    *,
    what: str = "grad-norms",
    against: Run | None = None,
    steps: StepsSpec = None,
    modules: str | None = None,
    kinds: Sequence[str] | str | None = None,
    rank: int | None = None,
    max_modules: int = 40,
    output: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> Figure:
    """Draw ``what`` (one of :data:`WHAT`) for ``run``; ``diff`` compares it ``against``
    another run. ``modules`` is a regex searched in module names; ``steps`` limits the steps
    (``"0-100"``, ``(first, last)`` or step numbers); ``kinds`` (``param``, ``grad_param``,
    ...) chooses the records of the histograms picture, which draws at most
    :data:`HISTOGRAM_PANELS` of them. With ``output``, the picture is also written there, in
    the format its suffix names (``.png``, ``.svg``, ``.pdf``). ``progress(done, total,
    what)`` is called before reading, drawing and writing. ``rank`` draws that rank's
    records; None, every rank's: a run of several ranks as its logical tensors.

    Raises :class:`PlotUnavailable` without matplotlib, ``ConfigError`` on bad options,
    ``TraceError`` for the histograms picture of a trace that holds none.
    """
    if what not in WHAT:
        raise ConfigError(f"unknown picture {what!r}: choose from {', '.join(WHAT)}")
    if (what == "diff") != (against is not None):
        raise ConfigError(
            "the diff picture compares two runs: give against=RUN_B (and only for what='diff')"
        )
    if kinds is not None and what != "histograms":
        raise ConfigError(f"kinds choose the records of the histograms picture, not of {what}")
    if max_modules < 1:
        raise ConfigError(f"max_modules must be 1 or more (got {max_modules})")
    require_matplotlib()  # fail before reading anything
    if output is not None:
        check_output(output)
        check_format(output)
    report = progress or (lambda done, total, what: None)
    report(0, 3, "reading")
    trace = trace_of(run)
    options: dict[str, Any] = {"steps": steps, "modules": modules, "rank": rank}
    draw: Callable[..., Figure]
    if what == "grad-norms":
        data: tuple[Any, ...] = (grad_norm_table(trace, **options),)
        draw = grad_norms_figure
    elif what == "activations":
        data, draw = activation_tables(trace, **options), activations_figure
    elif what == "dead-units":
        found = dead_relus(trace, steps=steps, ranks=None if rank is None else [rank])
        data, draw = (silent_unit_table(trace, **options), found.layers), dead_units_figure
    elif what == "histograms":
        limit = min(max_modules, HISTOGRAM_PANELS)
        data = chosen_histograms(trace, kinds=kinds, max_records=limit, **options)
        draw = histograms_figure
    else:
        assert against is not None
        other = trace_of(against)
        ranks = {} if rank is None else {"ranks": [rank], "per_rank": True}
        data = (other, *diff_table(trace, other, steps=steps, modules=modules, **ranks))
        draw = diff_figure
    report(1, 3, "drawing")
    figure = draw(trace, *data, max_modules=max_modules)
    if output is not None:
        report(2, 3, "writing")
        figure.savefig(output, dpi=DPI, bbox_inches="tight")
    return figure


def check_output(output: str | os.PathLike[str]) -> None:
    """ConfigError unless ``output`` can be written: its directory exists, it is no directory."""
    path = Path(output)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: give a file name for the output")
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write {path}: {path.parent} is not a directory; create it first")


def check_format(output: str | os.PathLike[str]) -> str:
    """The picture format ``output``'s suffix names; ConfigError when matplotlib has none."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.fspath(output).rpartition(".")[2].lower() if "." in os.fspath(output) else ""
    if suffix not in formats:
        raise ConfigError(
            f"cannot tell the picture format from {os.fspath(output)!r}: give a file name "
            f"ending in one of {', '.join('.' + f for f in sorted(formats))}"
        )
    return suffix


def chosen_histograms(
    trace: Trace,
    *,
    steps: StepsSpec = None,
    modules: str | None = None,
    kinds: Sequence[str] | str | None = None,
    rank: int | None = None,
    max_records: int = HISTOGRAM_PANELS,
) -> tuple[pd.DataFrame, int]:
    """:func:`hooktrace.hist` of the first ``max_records`` records that match, in the model's
    order (at most :data:`HISTOGRAM_STEPS` steps), and how many matched; ``rank``'s, or with
    None, the logical tensors' of a run of several ranks."""
    ranks = None if rank is None else [rank]
    records = histogrammed(trace, modules=modules, kinds=kinds, steps=steps, ranks=ranks)
    chosen = records.head(max_records)
    if chosen.empty:  # hist says what the trace holds
        return hist(trace, modules=modules, kinds=kinds, steps=steps, ranks=ranks), 0
    frame = hist(
        trace,
        modules=sorted(set(chosen["module"])),
        kinds=sorted(set(chosen["kind"])),
        steps=steps,
        ranks=ranks,
        max_steps=HISTOGRAM_STEPS,
    )
    wanted = set(zip(chosen["module"], chosen["kind"], chosen["slot"], strict=True))
    keys = zip(frame["module"], frame["kind"], frame["slot"], strict=True)
    mine = np.fromiter((k in wanted for k in keys), dtype=bool, count=len(frame))
    return frame[mine].reset_index(drop=True), len(records)
