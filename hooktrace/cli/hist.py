"""``hooktrace hist RUN``: distributions over steps, as rows of block characters."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hooktrace.cli.anomalies import steps_option
from hooktrace.cli.common import (
    FrameWriter,
    emit_frame,
    library_errors,
    listed,
    output_options,
    per_rank_option,
    run_argument,
)

if TYPE_CHECKING:
    import pandas as pd

MAX_STEPS = 40
"""Steps shown per record in the table view unless --max-steps says otherwise."""

# hooktrace.analyze.histograms.histograms' float16 limits, repeated so that `hooktrace --help` needs no
# pandas
FP16_SUBNORMAL, FP16_NORMAL, FP16_OVERFLOW = -24, -14, 16

BARS = " ▁▂▃▄▅▆▇█"
MAX_COLUMNS = 64
COLUMN_WIDTHS = (1, 2, 5, 10)
"""Powers of two per column: divisors of 10, so that float16's limits (2^-24, 2^-14, 2^16) fall
between columns whatever the width."""


@click.command()
@run_argument()
@click.option("--modules", metavar="REGEX", help="Only modules whose name matches this regex.")
@click.option(
    "--kinds", metavar="KINDS", help="Only these kinds, comma-separated: param,grad_param,..."
)
@steps_option
@click.option("--ranks", metavar="RANKS", help="Only these ranks, comma-separated.")
@per_rank_option("Histograms")
@click.option(
    "--max-steps",
    type=click.IntRange(min=1),
    help=f"Show at most N steps per record, evenly spaced with the first and the last. "
    f"[default: {MAX_STEPS} in the table, every step in csv/json/parquet]",
)
@output_options
@library_errors
def hist(
    run: Path,
    modules: str | None,
    kinds: str | None,
    steps: str | None,
    ranks: str | None,
    per_rank: bool,
    max_steps: int | None,
    fmt: str,
    output: Path | None,
) -> None:
    """The distribution of each histogrammed record of RUN over steps.

    A block per record (module, kind, slot), a row per step: one column per power of two
    of |x| over the range the record's values take, the bar the share of values in it (each
    row scaled to its largest column; blank means no value at all). Beside it the zeros, NaNs
    and Infs counted, and as shares of the nonzero finite values, the negative ones and what
    float16 would do to them (as `hooktrace precision` counts): underflow (below 2^-24),
    subnormal (below 2^-14: fewer bits) or overflow (2^16 and up). With one step (--steps N),
    a row per record in one block, on one scale.

    A run of several ranks shows its logical tensors: the histograms of a tensor's shards
    and of the data-parallel ranks' parts of the batch summed, a replica counted once, the
    values as the ranks computed them. --per-rank or --ranks: each rank's own.

    Histograms are recorded with `hooktrace record --histograms param,grad_param`. csv, json
    and parquet hold one row per non-empty bin (the table of hooktrace.hist()).

    \b
    Example:
      hooktrace hist runs/mlp --modules 'fc1$' --kinds grad_param
      hooktrace hist runs/mlp --steps 500
      hooktrace hist runs/mlp --format csv -o hist.csv
    """
    from hooktrace.analyze.histograms.histograms import hist as histograms

    options: dict[str, Any] = {
        "modules": modules,
        "kinds": kinds,
        "steps": steps,
        "ranks": listed(ranks, int, "--ranks"),
        "per_rank": per_rank,
    }
    if fmt == "table":
        frame = histograms(run, **options, max_steps=max_steps or MAX_STEPS)
        emit_frame(frame, fmt, output, table_text=render(run, frame))
        return
    with FrameWriter(fmt, output) as writer:  # chunk by chunk: every step of a long run fits
        histograms(run, **options, max_steps=max_steps, sink=writer.write)


# --- the text view ------------------------------------------------------------------------


def render(run: object, frame: pd.DataFrame) -> str:
    """The text view of :func:`hooktrace.hist`'s ``frame``."""
    from hooktrace.analyze.histograms.histograms import in_order, per_step

    rows = in_order(per_step(frame)).reset_index(drop=True)
    counts = _magnitudes(frame, rows)
    keys = ["rank", "module", "kind", "slot"]
    records = rows.groupby(keys, sort=False).ngroups
    steps = sorted(set(rows["step"].tolist()))
    matched = int(frame.attrs.get("steps", len(steps)))
    span = f"{steps[0]}" if steps[0] == steps[-1] else f"{steps[0]}–{steps[-1]}"
    shown = (
        "each shown"
        if matched == len(steps)
        else f"{len(steps)} shown, evenly spaced from the first to the last (--max-steps)"
    )
    lines = [
        f"{run}: {records} record{'s' if records != 1 else ''} histogrammed, "
        f"{matched} step{'s' if matched != 1 else ''} ({span}), {shown}",
        "columns: |x| by powers of two, 2^e <= |x| < 2^(e+1); bars: the share of values in a "
        "column, scaled to the row's largest; blank: none",
        "fp16 row: x underflow (below 2^-24: zero in float16), s subnormal (2^-24 to 2^-14: fewer "
        "bits), . normal, ! overflow (2^16 and up: Inf); neg, underflow, subnormal, overflow: "
        "shares of the nonzero finite values",
    ]
    if frame.attrs.get("logical"):
        lines.append(LOGICAL_HISTOGRAMS)
    ranks = rows["rank"].nunique() > 1
    if len(steps) == 1 and records > 1:
        labels = [
            f"rank {r} {m} {k} {s}" if ranks else f"{m} {k} {s}"
            for r, m, k, s in zip(*(rows[c] for c in keys), strict=True)
        ]
        lines += ["", f"step {steps[0]}"]
        lines += _block(rows, counts, labels, "record")
    else:
        for _, mine in rows.groupby(keys, sort=False):
            lines += ["", _title(mine, ranks)]
            at = mine.index.to_numpy()
            lines += _block(mine, counts[at], [str(s) for s in mine["step"]], "step")
    return "\n".join(line.rstrip() for line in lines) + "\n"


LOGICAL_HISTOGRAMS = (
    "logical tensors: each the sum of its parts' histograms over the ranks (shards, the "
    "data-parallel ranks' batches; a replica once; a partial sum, not yet reduced, its rank's "
    "own), values as the ranks computed them; --per-rank for each rank's"
)


def _magnitudes(frame: pd.DataFrame, rows: pd.DataFrame) -> Any:
    """Counts of both signs by magnitude bin (columns: exponents from the lowest bin's up), a
    row per row of ``rows`` (per_step's)."""
    import numpy as np
    import pandas as pd

    from hooktrace.trace.histograms import EXPONENT_MIN, MAGNITUDE_BINS

    keys = ["rank", "step", "module", "kind", "slot"]
    signed = frame[frame["bin"].isin(["pos", "neg"])]
    at = pd.MultiIndex.from_frame(rows[keys]).get_indexer(pd.MultiIndex.from_frame(signed[keys]))
    counts = np.zeros((len(rows), MAGNITUDE_BINS), dtype=np.int64)
    bins = signed["exponent"].to_numpy(dtype=np.int64) - (EXPONENT_MIN - 1)
    np.add.at(counts, (at, bins), signed["count"].to_numpy(dtype=np.int64))
    return counts


def _title(rows: pd.DataFrame, ranks: bool) -> str:
    row = rows.iloc[0]
    numel = rows["numel"]
    size = f"{numel.iloc[0]:,}" if numel.nunique() == 1 else f"{numel.min():,}–{numel.max():,}"
    where = f"rank {row['rank']}: " if ranks else ""
    return f"{where}{row['module']} {row['kind']} {row['slot']}: {size} values"


def _block(rows: pd.DataFrame, counts: Any, labels: Sequence[str], label_header: str) -> list[str]:
    """A header, the fp16 ruler and a row per row of ``rows`` (per_step's), ``counts`` their
    magnitude bins (:func:`_magnitudes`)."""
    from hooktrace.trace.histograms import EXPONENT_MIN

    numbers = _numbers(rows)
    names = ("zero", "NaN", "Inf", "neg", "underflow", "subnormal", "overflow")
    widths = [max(len(n), *(len(row[i]) for row in numbers)) for i, n in enumerate(names)]
    label_width = max(len(label_header), len("fp16"), *(len(label) for label in labels))

    occupied = counts.any(axis=0).nonzero()[0] + (EXPONENT_MIN - 1)
    if len(occupied):
        first, per, cells = _columns(int(occupied[0]), int(occupied[-1]))
        left, right = f"2^{first}", f"2^{first + per * cells}"
        width = max(cells, len(left) + 1 + len(right))
        axis = left + " " * (width - len(left) - len(right)) + right
        ruler = "".join(_zone(first + i * per, per) for i in range(cells))
        bars = [_bars(row, first, per, cells) for row in counts]
    else:
        axis = "no nonzero finite value"
        width, ruler, bars = len(axis), "", ["" for _ in labels]
    head = "  ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True))
    out = [f"  {label_header:<{label_width}}  {axis:<{width}}  {head}"]
    if ruler:
        out.append(f"  {'fp16':<{label_width}}  {ruler}")
    for label, bar, row in zip(labels, bars, numbers, strict=True):
        cells_text = "  ".join(f"{v:>{w}}" for v, w in zip(row, widths, strict=True))
        aligned = f"{label:>{label_width}}" if label_header == "step" else f"{label:<{label_width}}"
        out.append(f"  {aligned}  {bar:<{width}}  {cells_text}")
    return out


def _columns(lowest: int, highest: int) -> tuple[int, int, int]:
    """The first exponent, powers of two per column, and columns, to show lowest..highest in
    at most MAX_COLUMNS columns whose edges fall on float16's limits."""
    for per in COLUMN_WIDTHS:
        first = lowest - (lowest - FP16_SUBNORMAL) % per
        cells = math.ceil((highest + 1 - first) / per)
        if cells <= MAX_COLUMNS:
            return first, per, cells
    raise AssertionError("279 bins fit in 28 columns of 10")


def _zone(first: int, per: int) -> str:
    """The fp16 ruler's character for a column of exponents first .. first + per - 1."""
    if first >= FP16_OVERFLOW:
        return "!"
    if first < FP16_SUBNORMAL:
        return "x"
    if first < FP16_NORMAL:
        return "s"
    return "."


def _bars(counts: Any, first: int, per: int, cells: int) -> str:
    """One row's bars: ``counts`` by magnitude bin (as :func:`_magnitudes`), in ``cells``
    columns of ``per`` exponents from ``first``."""
    import numpy as np

    from hooktrace.trace.histograms import EXPONENT_MIN

    lowest = EXPONENT_MIN - 1  # the exponent of bin 0
    padded = np.zeros(cells * per, dtype=np.int64)
    lo, hi = max(first, lowest), min(first + cells * per, lowest + len(counts))
    padded[lo - first : hi - first] = counts[lo - lowest : hi - lowest]
    columns = padded.reshape(cells, per).sum(axis=1)
    top = int(columns.max())
    if top == 0:
        return ""
    return "".join(BARS[min(8, math.ceil(8 * int(c) / top))] if c else " " for c in columns)


def _numbers(rows: pd.DataFrame) -> list[tuple[str, ...]]:
    """The numbers beside the bars, formatted, a tuple per row of ``rows`` (per_step's)."""
    return [
        (f"{zero:,}", f"{nan:,}", f"{inf:,}", *(_share(v) for v in shares))
        for zero, nan, inf, *shares in zip(
            rows["zero"],
            rows["nan"],
            rows["inf"],
            rows["neg"],
            rows["fp16_underflow"],
            rows["fp16_subnormal"],
            rows["fp16_overflow"],
            strict=True,
        )
    ]


def _share(value: float) -> str:
    if value != value:  # no nonzero finite value
        return "-"
    if value == 0:
        return "-"
    if value < 0.0005:
        return "<0.1%"
    if value > 0.9995 and value < 1:
        return ">99.9%"
    return f"{value:.1%}"
