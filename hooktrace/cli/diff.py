"""``hooktrace diff RUN_A RUN_B``: exit 0 when the runs match, 1 when they differ, 2 on error."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hooktrace.cli.common import (
    CommandError,
    FrameWriter,
    library_errors,
    listed,
    output_options,
)

if TYPE_CHECKING:
    from hooktrace.analyze.diff.diff import DiffResult

# the library's DEFAULT_RTOL / DEFAULT_ATOL, repeated so that `hooktrace --help` needs no pandas
RTOL = 1e-5
ATOL = 1e-8


@click.command()
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path), required=False)
@click.option("--rtol", type=float, default=RTOL, show_default=True, help="Relative tolerance.")
@click.option("--atol", type=float, default=ATOL, show_default=True, help="Absolute tolerance.")
@click.option("--steps", help="Only these steps: '0-10,20', '100-'.")
@click.option("--modules", help="Only modules whose name matches this regex.")
@click.option("--kinds", help="Only these kinds, comma-separated: output,grad_output,param,...")
@click.option("--ranks", help="Only these ranks, comma-separated.")
@click.option("--rank", type=int, help="With --against-rank: the rank of RUN_A to compare.")
@click.option(
    "--against-rank",
    type=int,
    help="Compare --rank (default 0) with this rank of RUN_B, or of RUN_A.",
)
@click.option(
    "--per-rank",
    is_flag=True,
    help="Compare rank with rank, not logical tensors (the default for runs of several ranks).",
)
@click.option(
    "--top", type=click.IntRange(min=0), default=10, show_default=True, help="Modules to list."
)
@click.option(
    "--all",
    "all_rows",
    is_flag=True,
    help="csv/json/parquet: every aligned record, equal ones too.",
)
@click.option(
    "--stop-at-first", is_flag=True, help="Stop reading at the first divergence (faster)."
)
@output_options
@library_errors
def diff(
    run_a: Path,
    run_b: Path | None,
    rtol: float,
    atol: float,
    steps: str | None,
    modules: str | None,
    kinds: str | None,
    ranks: str | None,
    rank: int | None,
    against_rank: int | None,
    per_rank: bool,
    top: int,
    all_rows: bool,
    stop_at_first: bool,
    fmt: str,
    output: Path | None,
) -> None:
    """Where and when RUN_A and RUN_B first diverge, in execution order, and how far apart
    they are at the last step both recorded.

    Records align on (rank, step, micro-step, phase, module, call, kind, slot); a record
    matches when each statistic is within atol + rtol x its scale (full tensors, where both
    runs saved them, decide element by element). A run of several ranks is compared as its
    logical tensors, whatever the other's layout: shards pooled, replicas counted once, the
    data-parallel ranks' activations pooled into the global batch (their gradients divided by
    the data-parallel degree); --per-rank, --ranks and --against-rank compare ranks. Exits 0 when the runs match, 1 when they
    differ, 2 on error: it can guard numerics in CI. --format csv/json/parquet writes the
    records that differ (--all: every record).

    \b
    Example:
      hooktrace diff runs/before runs/after --rtol 1e-4
      hooktrace diff runs/one-gpu runs/fsdp-8-gpus
      hooktrace diff runs/ddp --rank 0 --against-rank 1 --kinds param
    """
    from hooktrace.analyze.diff.diff import diff as diff_runs

    if run_b is None and against_rank is None:
        raise CommandError("give RUN_B, or --against-rank R to compare two ranks of RUN_A")
    if rank is not None and against_rank is None:
        raise CommandError("--rank goes with --against-rank: give both, or use --ranks to filter")
    schema = _table_schema() if fmt == "parquet" else None
    writer = None if fmt == "table" else FrameWriter(fmt, output, schema=schema)
    pool = _system_allocator()
    try:
        with writer or contextlib.nullcontext():
            result = diff_runs(
                run_a,
                run_b,
                rtol=rtol,
                atol=atol,
                steps=steps,
                modules=modules,
                kinds=listed(kinds, str, "--kinds"),
                ranks=listed(ranks, int, "--ranks"),
                rank=rank,
                against_rank=against_rank,
                per_rank=per_rank,
                rows="all" if all_rows else "differing",
                sink=writer.write if writer is not None else lambda frame: None,
                stop_at_first=stop_at_first,
            )
    finally:
        if pool is not None:
            import pyarrow as pa

            pa.set_memory_pool(pool)
    if writer is None:
        text = render(result, top=top)
        if output is None:
            click.echo(text, nl=False)
        else:
            output.write_text(text)
    sys.exit(0 if result.match else 1)


def _system_allocator() -> Any:
    """Decode with the C library's allocator for the diff, unless the user chose pyarrow's
    (ARROW_DEFAULT_MEMORY_POOL); the pool it replaces, to put back. pyarrow's default,
    mimalloc, gave each row group's pages back and faulted them in again: 10M records took
    6.4 to 6.8 s with the C library's, 7.3 to 7.8 with mimalloc."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return None
    import pyarrow as pa

    before = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    return before


def render(result: DiffResult, *, top: int = 10) -> str:
    """The human report: verdict, first divergence, structure, the modules that differ most."""
    r = result
    label = f"{r.run_a} vs {r.run_b}"
    if r.ranks[1] is not None:
        other = "" if r.run_b == r.run_a else f"{r.run_b} "
        label = f"{r.run_a} rank {r.ranks[0]} vs {other}rank {r.ranks[1]}"
    span = f"{r.steps} step{'s' if r.steps != 1 else ''} ({r.first_step}–{r.last_step})"
    tolerance = f"rtol {r.rtol:g}, atol {r.atol:g}"
    if r.match:
        lines = [f"MATCH  {label}: {r.records:,} records over {span} agree ({tolerance})"]
    else:
        s = r.structure
        lines = [
            f"DIFFER  {label} ({tolerance})",
            f"compared {r.records:,} records over {span}: {r.differing:,} differ"
            + (f" ({s.records_only_a:,} only in A, {s.records_only_b:,} only in B, {len(s.changed)} changed)"
               if s.differs else ""),
        ]  # fmt: skip
    if r.first is not None:
        lines.append(f"first divergence: {r.first.describe()}")
        for name, (a, b) in r.first.values.items():
            lines.append(f"    {name:<14} A {_num(a):>14}   B {_num(b):>14}" + _delta(a, b))
        if r.first.errors:
            e = r.first.errors
            lines.append(
                f"    full tensor    max abs error {_num(e.get('max_abs_error'))}, max rel error "
                f"{_num(e.get('max_rel_error'))}, cosine {_num(e.get('cosine'), 10)}, "
                f"{100 * e.get('mismatch_fraction', 0):.3g}% of elements out of tolerance"
            )
    structure = r.structure.lines()
    if structure:
        lines.append("structure:")
        lines += [f"  {line}" for line in structure]
    modules = r.modules
    if top and not modules.empty and modules["last_differing"].fillna(0).gt(0).any():
        lines.append(f"modules that differ most at step {r.last_step} (the last common step):")
        lines.append(
            f"  {'module':<36} {'differing':>9} {'rel diff':>10} {'max abs err':>12} {'since step':>10}"
        )
        shown = modules[modules["last_differing"].fillna(0) > 0].head(top)
        for row in shown.to_dict("records"):
            lines.append(
                f"  {_cut(str(row['module']), 36):<36} {int(row['last_differing']):>9} "
                f"{_num(row['last_rel_diff'], 4):>10} {_num(row['last_max_abs_error'], 4):>12} "
                f"{_num(row['first_step']):>10}"
            )
    elif not r.match and r.complete:
        lines.append(f"no module differs at step {r.last_step}, the last common step")
    lines += [f"note: {note}" for note in r.notes]
    return "\n".join(lines) + "\n"


def _table_schema() -> Any:
    """The Arrow schema of the diff table (``--format parquet``)."""
    import pyarrow as pa

    from hooktrace.analyze.diff.compare import TABLE_DTYPES

    types = {"int64": pa.int64(), "float64": pa.float64()}
    return pa.schema([(c, types.get(t, pa.string())) for c, t in TABLE_DTYPES.items()])


def _num(value: Any, digits: int = 6) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _delta(a: Any, b: Any) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return f"   (B - A {b - a:+.3g})"
    return ""


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1) :]
