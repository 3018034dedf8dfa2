"""``hooktrace precision RUN``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hooktrace.cli.anomalies import steps_option
from hooktrace.cli.common import (
    CommandError,
    emit_frame,
    library_errors,
    output_options,
    per_rank_option,
    require_steps,
    run_argument,
)

if TYPE_CHECKING:
    import pandas as pd


@click.command()
@run_argument()
@steps_option
@click.option("--modules", metavar="REGEX", help="Only modules whose name matches this regex.")
@click.option("--kinds", help="Only these kinds, comma-separated: grad_param,grad_output,...")
@per_rank_option("Measure")
@output_options
@library_errors
def precision(
    run: Path,
    steps: str | None,
    modules: str | None,
    kinds: str | None,
    per_rank: bool,
    fmt: str,
    output: Path | None,
) -> None:
    """What float16 and bfloat16 would lose of each tensor of RUN that has histograms.

    Per module, kind and slot, over the steps read: the fraction of its nonzero values that
    each format would flush to zero (underflow: below 2^-24 in float16, 2^-133 in bfloat16),
    keep only as subnormals (fewer significant bits: below 2^-14, 2^-126) and make Inf
    (overflow: 2^16 and above, 2^128), and the step at which float16 would lose the most of
    it. Worst first. `hooktrace anomalies` flags what passes its bounds. A run without
    histograms (recorded with them off, or before format 1.3) gets a line saying so. A run
    of several ranks is measured per logical tensor (its parts' histograms summed over the
    ranks, a replica once); --per-rank: rank by rank.

    \b
    Example:
      hooktrace precision runs/mlp --kinds grad_param,grad_output
      hooktrace precision runs/mlp --steps 100- --format csv -o precision.csv
    """
    import pandas as pd

    from hooktrace.analyze.histograms.precision import COLUMNS
    from hooktrace.analyze.histograms.precision import precision as measure
    from hooktrace.trace import schema
    from hooktrace.trace.reader import load

    trace = load(run)
    if not trace.has_histograms:  # an answer, not an error: the run holds none to measure
        text = f"no histograms in {run}: {NO_HISTOGRAMS}\n"
        emit_frame(pd.DataFrame(columns=list(COLUMNS)), fmt, output, table_text=text)
        return
    chosen = [k.strip() for k in kinds.split(",") if k.strip()] if kinds is not None else None
    unknown = sorted(set(chosen or ()) - set(schema.KINDS))
    if unknown or chosen == []:
        what = f"unknown kind(s) {', '.join(unknown)}" if unknown else "no kind named"
        raise CommandError(f"--kinds {kinds!r}: {what}; choose from {', '.join(schema.KINDS)}")
    require_steps(run, steps)
    table = measure(trace, steps=steps, modules=modules, kinds=chosen, per_rank=per_rank)
    emit_frame(table, fmt, output, table_text=render(run, table))


NO_HISTOGRAMS = (
    "recorded with histograms off, or before format 1.3; record with `hooktrace record "
    "--histograms param,grad_param`"
)


def render(run: Path, table: pd.DataFrame) -> str:
    if table.empty:
        return f"no histograms in {run} match the filters\n"
    steps = f"{table['first_step'].min()}–{table['last_step'].max()}"
    lines = [
        f"{len(table)} tensors with histograms in {run} (steps {steps}): of their nonzero "
        "values, the share each format would flush to zero (under), keep as subnormals (sub) "
        "or make Inf (over)",
        *([LOGICAL] if table.attrs.get("logical") else []),
        "",
    ]
    ranks = table["rank"].nunique() > 1
    rows = [
        [
            *([str(r["rank"])] if ranks else []), r["module"], r["kind"], r["slot"],
            f"{r['steps']}", f"{r['nonzero']:,}",
            *(_share(r[c]) for c in ("fp16_underflow", "fp16_subnormal", "fp16_overflow",
                                      "bf16_underflow", "bf16_subnormal", "bf16_overflow")),
            f"{r['worst_step']} ({_share(r['worst_fraction'])})" if r["worst_fraction"] else "-",
        ]
        for r in table.to_dict("records")
    ]  # fmt: skip
    header = [
        *(["rank"] if ranks else []), "module", "kind", "slot", "steps", "nonzero",
        "fp16 under", "sub", "over", "bf16 under", "sub", "over", "fp16 worst step",
    ]  # fmt: skip
    text = [str(h) for h in header]
    widths = [max(len(text[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    left = 4 if ranks else 3  # names left-aligned, numbers right
    for row in [text, *rows]:
        cells = [
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


LOGICAL = (
    "logical tensors: each tensor's parts summed over the ranks (shards, the data-parallel "
    "ranks' batches; a replica once; a partial sum, not yet reduced, its rank's own); "
    "--per-rank for each rank's"
)


def _share(fraction: Any) -> str:
    from hooktrace.analyze.histograms.precision import percent

    return percent(float(fraction))
