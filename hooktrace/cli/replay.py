"""``hooktrace replay RUN --step N``: one recorded step, event by event, in execution order;
``hooktrace replay RUN --nonfinite``: the calls where a NaN or Inf began, as captured."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hooktrace.cli.common import (
    CommandError,
    emit_frame,
    library_errors,
    output_options,
    run_argument,
)

if TYPE_CHECKING:
    import pandas as pd

_LABEL_WIDTH = 64  # longer event labels are cut, so the statistics stay in columns
_SECTIONS = {"params": "parameters and buffers", "forward": "forward", "backward": "backward"}


@click.command()
@run_argument()
@click.option(
    "--step", type=int, help="The step to show (required, but with --nonfinite: its captures)."
)
@click.option(
    "--nonfinite",
    is_flag=True,
    help="Show the calls where a NaN or Inf began, as the recorder captured them.",
)
@click.option("--micro-step", type=int, help="Only this micro-step (backward pass) of the step.")
@click.option(
    "--rank", type=int, help="The rank to show (default 0; with --nonfinite: every rank)."
)
@click.option("--modules", help="Only events of modules whose name matches this regex.")
@click.option(
    "--depth",
    type=click.IntRange(min=0),
    help="Only events nested at most this deep (0: calls made outside any recorded module).",
)
@click.option(
    "--params",
    "show_params",
    is_flag=True,
    help="List the parameters and buffers one by one (by default: one line for all).",
)
@click.option(
    "--jumps",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Mark this many of the largest jumps (root-mean-square changes of 2x or more).",
)
@output_options
@library_errors
def replay(
    run: Path,
    step: int | None,
    nonfinite: bool,
    micro_step: int | None,
    rank: int | None,
    modules: str | None,
    depth: int | None,
    show_params: bool,
    jumps: int,
    fmt: str,
    output: Path | None,
) -> None:
    """Step through STEP of RUN in execution order: each module's inputs when its call began
    and its outputs when it ended, indented as the calls nested, then the gradients in the
    order they arrived, with the key statistics of each event.

    The first NaN or Inf of the step is marked, and so are the largest jumps: events whose
    root mean square is far from that of what they came from (an output against its call's
    input, a gradient against the one before it). --format csv/json/parquet writes the
    timeline table instead (the same as `hooktrace.load(RUN).timeline(STEP)`). To run a
    module again on its recorded inputs, see hooktrace.replay_module() in Python.

    With --nonfinite: each call where a NaN or Inf began, as the recorder captured it (the
    step, pass and module, what triggered it, the aten operation and the source line that
    made it, whether it reproduces on the captured tensors alone, the statistics of the
    operation's inputs, the tensors left out, and how to run it again in Python), or why the
    run holds none. --format writes the captures table instead (the same as
    `hooktrace.load(RUN).nonfinite_captures()`).

    \b
    Example:
      hooktrace replay runs/mlp --step 7
      hooktrace replay runs/mlp --step 7 --modules 'blocks\\.0' --depth 2
      hooktrace replay runs/mlp --nonfinite
    """
    if nonfinite:
        _step_view_only(micro_step=micro_step, modules=modules, depth=depth, params=show_params)
        _captures(run, step=step, rank=rank, fmt=fmt, output=output)
        return
    if step is None:
        from hooktrace.trace.reader import load

        load(run)  # a run that is not there is told first
        context = click.get_current_context()
        param = next(p for p in context.command.params if p.name == "step")
        raise click.MissingParameter(ctx=context, param=param)
    rank = 0 if rank is None else rank
    from hooktrace.analyze.overview.timeline import largest_jumps, timeline
    from hooktrace.cli.replay_nonfinite import step_lines
    from hooktrace.trace.reader import load

    pattern = _compile(modules)
    trace = load(run)  # once: a damaged part is named once
    frame = timeline(trace, step, micro_step=micro_step, rank=rank)
    shown = frame
    if pattern is not None:
        shown = shown[shown["module"].map(lambda name: bool(pattern.search(name)))]
    if depth is not None:
        shown = shown[shown["depth"] <= depth]
    if fmt != "table":
        emit_frame(shown.reset_index(drop=True), fmt, output)
        return
    marked = largest_jumps(frame, top=jumps) if jumps else frame.iloc[:0]
    captured = step_lines(trace, run, step=step, rank=rank)
    text = render(
        frame,
        shown,
        marked,
        run=run,
        step=step,
        rank=rank,
        show_params=show_params,
        captured=captured,
    )
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)


def _step_view_only(**given: Any) -> None:
    """--nonfinite lists captures: the options that cut the step view do not apply to it."""
    for name, value in given.items():
        if value is not None and value is not False:  # --micro-step 0 is given too
            option = "--" + name.replace("_", "-")
            raise CommandError(
                f"{option} cuts the step view and does not go with --nonfinite: leave one out"
            )
    jumps = click.get_current_context().get_parameter_source("jumps")
    if jumps is click.core.ParameterSource.COMMANDLINE:
        raise CommandError(
            "--jumps cuts the step view and does not go with --nonfinite: leave one out"
        )


def _captures(
    run: Path, *, step: int | None, rank: int | None, fmt: str, output: Path | None
) -> None:
    from hooktrace.cli.replay_nonfinite import render_captures
    from hooktrace.trace.reader import load

    trace = load(run)
    if rank is not None and rank not in trace.ranks:
        raise CommandError(
            f"{run} has no rank {rank} (ranks: {', '.join(map(str, trace.ranks)) or 'none'})"
        )
    captures = trace.nonfinite_captures(rank=rank)
    if step is not None:
        captures = captures[captures["step"] == step].reset_index(drop=True)
    if fmt != "table":
        emit_frame(captures, fmt, output)
        return
    text = render_captures(trace, captures, rank=rank, step=step)
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)


def render(
    frame: pd.DataFrame,
    shown: pd.DataFrame,
    jumps: pd.DataFrame,
    *,
    run: Path,
    step: int,
    rank: int,
    show_params: bool,
    captured: Sequence[str] = (),
) -> str:
    """The timeline as text: ``frame`` is the whole step, ``shown`` the rows to list;
    ``captured``: a line per non-finite capture of the step."""
    micro = sorted(int(m) for m in frame["micro_step"].unique())
    phases = ", ".join(sorted(frame["phase"].unique()))
    lines = [
        f"{run}  step {step}, rank {rank}: {len(frame)} events, micro-step(s) "
        f"{', '.join(map(str, micro))}, {phases}"
    ]
    params = shown[shown["pass"] == "params"]
    if not show_params and len(params):
        lines.append(_params_line(params))
        shown = shown[shown["pass"] != "params"]
    jump_of = dict(zip(jumps.index, jumps["gain"], strict=True))
    labels = {i: _label(row) for i, row in _rows(shown)}
    width = min(max((len(s) for s in labels.values()), default=5), _LABEL_WIDTH)
    header = (
        f"  {'seq':>5}  {'event':<{width}}  {'shape':<14} {'mean':>10} {'std':>10} "
        f"{'min':>10} {'max':>10}"
    )
    section = None
    for i, row in _rows(shown):
        here = (row.stage, int(row.micro_step), row.phase)
        if here != section:
            section = here
            title = _SECTIONS.get(str(here[0]), str(here[0]))
            lines += ["", f"{title}, micro-step {here[1]} ({here[2]})", header]
        label = labels[i]
        if len(label) > width:
            label = label[: width - 1] + "…"
        stats = " ".join(_number(getattr(row, c)) for c in ("mean", "std", "min", "max"))
        line = f"  {int(row.seq):>5}  {label:<{width}}  {row.shape or '()':<14} {stats}"
        notes = _notes(row, jump_of.get(i))
        lines.append(line + ("   " + notes if notes else ""))
    if shown.empty:
        lines += ["", "no events match --modules/--depth"]
    lines += ["", _first_nonfinite(frame), *captured]
    if not jumps.empty:
        lines.append("largest jumps: " + "; ".join(_jump(row) for _, row in _rows(jumps)))
    return "\n".join(lines) + "\n"


def _rows(frame: pd.DataFrame) -> list[tuple[Any, Any]]:
    """(index, row) pairs whose rows have attributes (``pass`` is renamed ``stage``)."""
    renamed = frame.rename(columns={"pass": "stage"})
    return list(zip(renamed.index, renamed.itertuples(index=False), strict=True))


def _label(row: Any) -> str:
    indent = "  " * int(row.depth)
    call = f"#{int(row.call)}" if int(row.call) else ""
    slot = "" if row.slot == "0" and row.kind not in ("param", "buffer", "grad_param") else row.slot
    return f"{indent}{row.module}{call} {row.kind}{' ' + slot if slot else ''}"


def _notes(row: Any, gain: float | None) -> str:
    notes = []
    if row.first_nonfinite:
        notes.append("<< first non-finite")
    if row.nan_count:
        notes.append(f"NaN {int(row.nan_count)}/{int(row.numel)}")
    if row.inf_count:
        notes.append(f"Inf {int(row.inf_count)}/{int(row.numel)}")
    if gain is not None:
        notes.append(f"<< jump x{_factor(gain)}")
    if row.dtype == "None":
        notes.append("no gradient" if row.kind == "grad_param" else "no value")
    return "  ".join(notes)


def _params_line(params: pd.DataFrame) -> str:
    kinds = params["kind"].value_counts()
    bad = params[(params["nan_count"] > 0) | (params["inf_count"] > 0)]
    health = (
        "all finite"
        if bad.empty
        else f"NON-FINITE in {', '.join(dict.fromkeys(bad['module'] + '.' + bad['slot']))}"
    )
    counts = [
        _count(int(kinds.get("param", 0)), "parameter"),
        _count(int(kinds.get("buffer", 0)), "buffer"),
        _count(int(params["module"].nunique()), "module"),
    ]
    return (
        f"params: {counts[0]} and {counts[1]} of {counts[2]} at the step's first forward, "
        f"{health} (--params lists them)"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _first_nonfinite(frame: pd.DataFrame) -> str:
    first = frame[frame["first_nonfinite"]]
    if first.empty:
        return "first non-finite: none (every value of the step is finite)"
    row = first.iloc[0]
    return (
        f"first non-finite: seq {int(row['seq'])}, {row['kind']} {row['slot']} of "
        f"{row['module']!r} (call {int(row['call'])}, micro-step {int(row['micro_step'])}, "
        f"{row['phase']}): NaN {int(row['nan_count'])}, Inf {int(row['inf_count'])} of "
        f"{int(row['numel'])} values"
    )


def _jump(row: Any) -> str:
    return f"seq {int(row.seq)} {row.module} {row.kind} x{_factor(float(row.gain))}"


def _factor(gain: float) -> str:
    return f"{gain:.3g}"


def _number(value: Any) -> str:
    return f"{float(value):>10.4g}"


def _compile(pattern: str | None) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise CommandError(f"--modules {pattern!r} is not a valid regex: {exc}") from exc
