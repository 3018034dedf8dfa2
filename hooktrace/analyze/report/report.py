"""One self-contained HTML page about a run, or two: :func:`report`. Never imports torch.

The page holds the summary of each run, its findings (:func:`anomalies` and
:func:`dead_relus`), the calls where a NaN or Inf began as the recorder captured them, the
distributions of the flagged modules' histogrammed records (:func:`hooktrace.hist`), the diff
of the two runs when there are two, and the pictures of :mod:`hooktrace.analyze.plots.plots` as
inline PNGs (``data:`` URIs). It needs no server, no
script and nothing from the network: open it from disk, attach it to an issue. Every name
that comes from a trace (modules, paths, commands, error messages) is HTML-escaped.

The distributions section is made in :mod:`hooktrace.analyze.report.distributions`, the HTML
pieces (style, tables, figures, escaping) in :mod:`hooktrace.analyze.report.html`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from hooktrace.analyze.checks.anomalies import anomalies
from hooktrace.analyze.checks.captured import described, replay_command
from hooktrace.analyze.checks.dead_units import dead_relus
from hooktrace.analyze.findings import KIND_ORDER, SEVERITIES
from hooktrace.analyze.overview.summary import summary
from hooktrace.analyze.plots import figures, plots
from hooktrace.analyze.plots.tables import (
    activation_tables,
    diff_table,
    grad_norm_table,
    silent_unit_table,
)
from hooktrace.analyze.report.distributions import distributions
from hooktrace.analyze.report.html import STYLE, escaped, html_figure, html_table, note
from hooktrace.errors import HooktraceError
from hooktrace.package import __version__
from hooktrace.trace.reader import Trace, load

Run = str | os.PathLike[str] | Trace
Progress = Callable[[int, int, str], None]


def report(
    run: Run,
    run_b: Run | None = None,
    *,
    output: str | os.PathLike[str] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    max_modules: int = 40,
    progress: Progress | None = None,
) -> str:
    """The HTML page about ``run`` (and ``run_b``, compared with it at ``rtol``/``atol``);
    written to ``output`` when given. ``progress(done, total, what)`` is called before each
    piece of work. Without matplotlib the page is written without its pictures, saying why.
    """
    if output is not None:
        plots.check_output(output)
    traces = [run if isinstance(run, Trace) else load(run)]
    if run_b is not None:
        traces.append(run_b if isinstance(run_b, Trace) else load(run_b))
    no_pictures = _why_no_pictures()
    work = len(traces) * (4 + (0 if no_pictures else 2)) + (1 if run_b is not None else 0)
    done = 0

    def step(what: str) -> None:
        nonlocal done
        if progress is not None:
            progress(done, work, what)
        done += 1

    names = [_label(t) for t in traces]
    body = [f"<h1>hooktrace report: {' vs '.join(escaped(n) for n in names)}</h1>"]
    if len(traces) == 2:
        step("diff")
        body += _diff_section(traces[0], traces[1], rtol, atol, no_pictures, max_modules)
    for trace, name in zip(traces, names, strict=True):
        body += _run_section(trace, name, step, no_pictures, max_modules)
    if no_pictures is not None:
        body.append(f'<p class="note">{escaped(no_pictures)}</p>')
    body.append(
        f'<p class="note">Made by hooktrace {escaped(__version__)}. The same from the shell: '
        + ", ".join(_command(c, names[0]) for c in _COMMANDS)
        + (
            f", <code>hooktrace diff {' '.join(escaped(n) for n in names)}</code>"
            if len(names) > 1
            else ""
        )
        + "</p>"
    )
    page = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>hooktrace report: {escaped(' vs '.join(names))}</title>\n"
        f"<style>{STYLE}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )
    if output is not None:
        Path(output).write_text(page, encoding="utf-8")
    return page


_COMMANDS = ("summary", "anomalies", "dead-relus", "plot -o picture.png")
_DIFF_COLUMNS = {
    "first_step": "since step",
    "differing": "records differing",
    "last_differing": "differing at the last step",
    "last_rel_diff": "rel diff",
    "last_max_abs_error": "max abs error",
}


def _run_section(
    trace: Trace,
    name: str,
    step: Callable[[str], None],
    no_pictures: str | None,
    max_modules: int,
) -> list[str]:
    step(f"summary of {trace.path.name}")
    s = summary(trace)
    duration = f", {s.duration_s:.1f} s" if s.duration_s is not None else ""
    facts = {
        "status": f"{s.status}{duration}" + (f" ({s.error})" if s.error else ""),
        "steps": f"{s.steps} recorded ({s.first_step}–{s.last_step}), "
        f"{s.micro_steps} micro-steps, {s.skipped_steps} skipped"
        if s.steps
        else "none",
        "modules": f"{s.modules} (roots: {', '.join(s.roots) or '-'})",
        **(
            {
                "ranks": f"{', '.join(map(str, trace.ranks))}: their records read as logical "
                "tensors (shards and the data-parallel ranks' batches pooled, a replica once), "
                "replicas compared rank with rank"
            }
            if len(trace.ranks) > 1
            else {}
        ),
        "records": f"{s.records:,}: " + ", ".join(f"{k} {v:,}" for k, v in s.kinds.items()),
        "full tensors": f"{s.full_tensors:,}",
        "recorded with": f"hooktrace {s.versions['hooktrace']}, torch {s.versions['torch']}, "
        f"python {s.versions['python']}",
        "command": " ".join(s.command) or "-",
    }
    out = [f"<h2>{escaped(name)}</h2>", "<dl>"]
    out += [f"<dt>{escaped(k)}</dt><dd>{escaped(v)}</dd>" for k, v in facts.items()]
    out.append("</dl>")

    step(f"anomalies of {trace.path.name}")
    found = anomalies(trace)
    step(f"dead units of {trace.path.name}")
    dead = dead_relus(trace)
    findings = _worst_first(pd.concat([found.findings, dead.findings()], ignore_index=True))
    out += _findings(findings, [*found.notes, *dead.notes])
    out += _captures(found.captures, trace.path)
    step(f"distributions of {trace.path.name}")
    out += distributions(trace, findings, no_pictures)
    if not dead.layers.empty:
        out.append("<h3>ReLU layers</h3>")
        layers = dead.layers.assign(
            dead_fraction=dead.layers["dead_fraction"].map(lambda f: f"{f:.1%}"),
            since=dead.layers["since"].astype(object).where(dead.layers["dead"] > 0, "-"),
            activity=dead.layers["activity"].map(lambda f: f"{f:.1%}"),
        )
        out += html_table(
            layers,
            ["module", "call", "type", "units", "dead", "dead_fraction", "since", "activity"],
            numeric={"call", "units", "dead", "dead_fraction", "activity"},
        )
    if no_pictures is None:
        step(f"pictures of {trace.path.name}")
        out.append("<h3>Pictures</h3>")
        out.append(
            html_figure(
                figures.grad_norms_figure(trace, grad_norm_table(trace), max_modules=max_modules),
                "parameter gradient norm per module and step",
            )
        )
        step(f"pictures of {trace.path.name}")
        rms, zeros = activation_tables(trace)
        out.append(
            html_figure(
                figures.activations_figure(trace, rms, zeros, max_modules=max_modules),
                "outputs per module and step: RMS and fraction of zeros",
            )
        )
        if not dead.layers.empty:
            silent = silent_unit_table(trace)
            out.append(
                html_figure(
                    figures.dead_units_figure(trace, silent, dead.layers, max_modules=max_modules),
                    "silent units per ReLU layer and step, and dead at the end",
                )
            )
    return out


def _diff_section(
    a: Trace, b: Trace, rtol: float, atol: float, no_pictures: str | None, max_modules: int
) -> list[str]:
    out = ["<h2>Diff</h2>"]
    try:
        table, result = diff_table(a, b, rtol=rtol, atol=atol)
    except HooktraceError as exc:  # e.g. the runs share no step: the rest of the page holds
        return [*out, f'<p class="note">not compared: {escaped(exc)}</p>']
    verdict = "match" if result.match else "differ"
    out.append(
        f'<p><strong class="{verdict}">{verdict.upper()}</strong> '
        f"{escaped(_label(a))} vs {escaped(_label(b))}: {result.differing:,} of {result.records:,} "
        f"records differ over {result.steps} steps ({result.first_step}–{result.last_step}), "
        f"rtol {result.rtol:g}, atol {result.atol:g}</p>"
    )
    first = result.first
    if first is not None:
        out.append(f"<p>First divergence: {escaped(first.describe())}</p>")
        values = [(k, a_, b_) for k, (a_, b_) in first.values.items()]
        if values:  # none when the record is in one run only
            frame = pd.DataFrame(values, columns=["statistic", "run A", "run B"])
            out += html_table(frame, list(frame.columns), numeric={"run A", "run B"})
        errors = [(k.replace("_", " "), v) for k, v in first.errors.items()]
        if errors:  # where both runs saved the tensor in full: A against B
            frame = pd.DataFrame(errors, columns=["full tensor", "A against B"])
            out += html_table(frame, list(frame.columns), numeric={"A against B"})
    out += [f"<p>{escaped(line)}</p>" for line in result.structure.lines()]
    modules = result.modules.head(10).rename(columns=_DIFF_COLUMNS)
    modules = modules.dropna(axis=1, how="all")  # (max abs error: only where saved in full)
    if not modules.empty:
        out.append(f"<p>The modules that differ most at step {result.last_step}, the last:</p>")
        out += html_table(modules, list(modules.columns), numeric=set(modules.columns) - {"module"})
    out += [note(n) for n in result.notes]
    if no_pictures is None and not table.empty:
        caption = "largest relative difference per module and step; the first divergence circled"
        out.append(
            html_figure(figures.diff_figure(a, b, table, result, max_modules=max_modules), caption)
        )
    return out


def _findings(findings: pd.DataFrame, notes: Iterable[str]) -> list[str]:
    if findings.empty:
        out = ["<h3>Findings</h3>", '<p class="match">No anomalies and no dead layers found.</p>']
    else:
        counts = findings["severity"].value_counts()
        tally = ", ".join(_severities(int(counts[s]), s) for s in SEVERITIES if s in counts)
        out = [
            f"<h3>Findings ({escaped(tally)})</h3>",
            "<table>",
            "<tr><th>severity</th><th>kind</th><th>module</th><th>steps</th><th>evidence</th></tr>",
        ]
        for row in findings.to_dict("records"):
            steps = f"{row['step']}" + (
                f"–{row['last_step']}" if row["last_step"] != row["step"] else ""
            )
            severity = str(row["severity"])
            badge = severity if severity in SEVERITIES else "info"
            out.append(
                f'<tr><td><span class="badge {badge}">{escaped(severity)}</span></td>'
                f'<td>{escaped(row["kind"])}</td><td class="mono">{escaped(row["module"])}</td>'
                f'<td class="num">{escaped(steps)}</td><td>{escaped(row["evidence"])}'
                f'<div class="why">{escaped(row["explanation"])}</div>{_captured(row)}</td></tr>'
            )
        out.append("</table>")
    return out + [note(n) for n in notes]


def _captured(finding: dict[Any, Any]) -> str:
    """The capture that explains a non-finite finding, under its explanation ("" if none)."""
    text = finding.get("capture")
    return f'<div class="why">{escaped(text)}</div>' if isinstance(text, str) and text else ""


def _captures(captures: pd.DataFrame, run: Path) -> list[str]:
    """The calls where a NaN or Inf began, as captured: nothing for a run without any."""
    if captures.empty:
        return []
    rows = captures.assign(
        operation=[described({**row, "file": None}) for row in captures.to_dict("records")],
        source=[
            f"{row['file']}:{row['line']}" if isinstance(row["file"], str) else "-"
            for row in captures.to_dict("records")
        ],
        reproduces=captures["reproduces"].map({True: "yes", False: "no"}),
    )
    columns = ["capture", "rank", "step", "pass", "module", "operation", "source", "code"]
    return [
        "<h3>Non-finite captures</h3>",
        *html_table(rows, [*columns, "reproduces"], numeric={"capture", "rank", "step"}),
        f'<p class="note">The calls where a NaN or Inf began, saved by the recorder and run '
        f"again to name the operation. Each in full: <code>{escaped(replay_command(run))}</code></p>",
    ]


def _worst_first(findings: pd.DataFrame) -> pd.DataFrame:
    severity = findings["severity"].map({s: i for i, s in enumerate(SEVERITIES)})
    kind = findings["kind"].map({k: i for i, k in enumerate(KIND_ORDER)})
    order = pd.DataFrame({"s": severity, "k": kind, "step": findings["step"]})
    order = order.sort_values(["s", "k", "step"], kind="stable", na_position="last")
    return findings.loc[order.index].reset_index(drop=True)


def _why_no_pictures() -> str | None:
    """None when pictures can be drawn, else why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "Pictures are left out: matplotlib is not installed (pip install 'hooktrace[plot]')."
    return None


def _label(trace: Trace) -> str:
    return str(trace.path)


def _command(command: str, run: str) -> str:
    """``hooktrace COMMAND RUN [OPTIONS]``, as a reader would type it (the run before the
    options, as the CLI reference writes them)."""
    name, _, options = command.partition(" ")
    return f"<code>hooktrace {name} {escaped(run)}{' ' + options if options else ''}</code>"


def _severities(n: int, severity: str) -> str:
    """``2 errors``, ``1 warning``, ``3 info``."""
    return f"{n} {severity}{'s' if n != 1 and severity != 'info' else ''}"
