"""One self-contained HTML page about a run, or two: :func:`report`. Never imports torch.

The page holds the summary of each run, its findings (:func:`anomalies` and
:func:`dead_relus`), the calls where a NaN or Inf began as the recorder captured them, the
distributions of the flagged modules' histogrammed records (:func:`hooktrace.hist`), the diff
of the two runs when there are two, and the pictures of :mod:`hooktrace.analyze.plots` as
inline PNGs (``data:`` URIs). It needs no server, no
script and nothing from the network: open it from disk, attach it to an issue. Every name
that comes from a trace (modules, paths, commands, error messages) is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from hooktrace import __version__
from hooktrace.analyze import plots
from hooktrace.analyze.anomalies import anomalies
from hooktrace.analyze.captured import described, replay_command
from hooktrace.analyze.dead_units import dead_relus
from hooktrace.analyze.findings import KIND_ORDER, SEVERITIES
from hooktrace.analyze.histograms import hist, histogrammed, in_order, per_step
from hooktrace.analyze.plot_tables import (
    activation_tables,
    diff_table,
    grad_norm_table,
    silent_unit_table,
)
from hooktrace.analyze.precision import percent
from hooktrace.analyze.summary import summary
from hooktrace.errors import HooktraceError
from hooktrace.trace.reader import Trace, load
from hooktrace.trace.schema import KINDS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Run = str | os.PathLike[str] | Trace
Progress = Callable[[int, int, str], None]

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; }
code, td.mono, dd { font-family: ui-monospace, monospace; font-size: 0.92em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 0.25em 0.6em; text-align: left;
         vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; }
dt { color: #666; } dd { margin: 0; }
.error { color: #fff; background: #c0392b; } .warning { background: #f5c242; }
.info { background: #d6e4f0; } .match { color: #1e7e34; } .differ { color: #c0392b; }
.badge { padding: 0.05em 0.5em; border-radius: 0.6em; font-size: 0.85em; }
.why { color: #666; font-size: 0.9em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption, .note { color: #666; font-size: 0.9em; }
"""


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
    body = [f"<h1>hooktrace report: {' vs '.join(_e(n) for n in names)}</h1>"]
    if len(traces) == 2:
        step("diff")
        body += _diff_section(traces[0], traces[1], rtol, atol, no_pictures, max_modules)
    for trace, name in zip(traces, names, strict=True):
        body += _run_section(trace, name, step, no_pictures, max_modules)
    if no_pictures is not None:
        body.append(f'<p class="note">{_e(no_pictures)}</p>')
    body.append(
        f'<p class="note">Made by hooktrace {_e(__version__)}. The same from the shell: '
        + ", ".join(f"<code>hooktrace {c} {_e(names[0])}</code>" for c in _COMMANDS)
        + (
            f", <code>hooktrace diff {' '.join(_e(n) for n in names)}</code>"
            if len(names) > 1
            else ""
        )
        + "</p>"
    )
    page = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>hooktrace report: {_e(' vs '.join(names))}</title>\n"
        f"<style>{_STYLE}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )
    if output is not None:
        Path(output).write_text(page, encoding="utf-8")
    return page


_COMMANDS = ("summary", "anomalies", "dead-relus", "plot")
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
        "records": f"{s.records:,}: " + ", ".join(f"{k} {v:,}" for k, v in s.kinds.items()),
        "full tensors": f"{s.full_tensors:,}",
        "recorded with": f"hooktrace {s.versions['hooktrace']}, torch {s.versions['torch']}, "
        f"python {s.versions['python']}",
        "command": " ".join(s.command) or "-",
    }
    out = [f"<h2>{_e(name)}</h2>", "<dl>"]
    out += [f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in facts.items()]
    out.append("</dl>")

    step(f"anomalies of {trace.path.name}")
    found = anomalies(trace)
    step(f"dead units of {trace.path.name}")
    dead = dead_relus(trace)
    findings = _worst_first(pd.concat([found.findings, dead.findings()], ignore_index=True))
    out += _findings(findings, [*found.notes, *dead.notes])
    out += _captures(found.captures, trace.path)
    step(f"distributions of {trace.path.name}")
    out += _distributions(trace, findings, no_pictures)
    if not dead.layers.empty:
        out.append("<h3>ReLU layers</h3>")
        layers = dead.layers.assign(
            dead_fraction=dead.layers["dead_fraction"].map(lambda f: f"{f:.1%}"),
            since=dead.layers["since"].astype(object).where(dead.layers["dead"] > 0, "-"),
            activity=dead.layers["activity"].map(lambda f: f"{f:.1%}"),
        )
        out += _table(
            layers,
            ["module", "call", "type", "units", "dead", "dead_fraction", "since", "activity"],
            numeric={"call", "units", "dead", "dead_fraction", "activity"},
        )
    if no_pictures is None:
        step(f"pictures of {trace.path.name}")
        out.append("<h3>Pictures</h3>")
        out.append(
            _figure(
                plots.grad_norms_figure(trace, grad_norm_table(trace), max_modules=max_modules),
                "parameter gradient norm per module and step",
            )
        )
        step(f"pictures of {trace.path.name}")
        rms, zeros = activation_tables(trace)
        out.append(
            _figure(
                plots.activations_figure(trace, rms, zeros, max_modules=max_modules),
                "outputs per module and step: RMS and fraction of zeros",
            )
        )
        if not dead.layers.empty:
            silent = silent_unit_table(trace)
            out.append(
                _figure(
                    plots.dead_units_figure(trace, silent, dead.layers, max_modules=max_modules),
                    "silent units per ReLU layer and step, and dead at the end",
                )
            )
    return out


DISTRIBUTION_STEPS = 200
"""Steps the distribution picture samples at most, evenly, from the first to the last."""


def _distributions(trace: Trace, findings: pd.DataFrame, no_pictures: str | None) -> list[str]:
    """For the flagged modules (worst finding first), a table of their histogrammed records
    at the step that finding begins, and their distribution over steps; a note where the trace
    holds none."""
    worst: dict[str, tuple[str, int]] = {}  # module -> the kind of record and the step
    for module, kind, step, evidence in zip(
        findings["module"], findings["kind"], findings["step"], findings["evidence"], strict=True
    ):
        worst.setdefault(str(module), (_record_kind(str(kind), str(evidence)), int(step)))
    if not worst:
        return []
    out = ["<h3>Distributions of the flagged modules</h3>"]
    if not trace.has_histograms:
        return [
            *out,
            '<p class="note">No histograms in this trace, so no distributions: record them '
            "with <code>hooktrace record --histograms param,grad_param</code> (the default "
            "since format 1.3).</p>",
        ]
    try:
        records = histogrammed(trace, modules=list(worst))
        chosen = _about_the_findings(records, worst).head(plots.HISTOGRAM_PANELS)
        frame = (
            hist(
                trace,
                modules=sorted(set(chosen["module"])),
                kinds=sorted(set(chosen["kind"])),
                max_steps=DISTRIBUTION_STEPS,
            )
            if not chosen.empty
            else None
        )
    except HooktraceError as exc:  # the rest of the page holds
        return [*out, f'<p class="note">not drawn: {_e(exc)}</p>']
    notes = []
    without = [m for m in worst if m not in set(records["module"])]
    if without:
        kinds = trace.manifest.get("config", {}).get("histograms") or []
        notes.append(
            f"Not histogrammed: {', '.join(without)} (the trace histograms "
            f"{', '.join(kinds) or 'nothing'}; these modules record none of those)."
        )
    if frame is None:
        return [*out, *(f'<p class="note">{_e(n)}</p>' for n in notes)]
    if len(chosen) < len(records):
        notes.append(
            f"{len(chosen)} of the {len(records)} histogrammed records of these modules shown: "
            f"`hooktrace hist {trace.path} --modules REGEX` shows any."
        )
    wanted = set(zip(chosen["module"], chosen["kind"], chosen["slot"], strict=True))
    keys = zip(frame["module"], frame["kind"], frame["slot"], strict=True)
    frame = frame[[k in wanted for k in keys]]
    rows = in_order(per_step(frame))
    at = []
    for _, mine in rows.groupby(["rank", "module", "kind", "slot"], sort=False):
        when = worst[str(mine["module"].iloc[0])][1]
        before = mine[mine["step"] <= when]
        at.append(before.iloc[-1] if not before.empty else mine.iloc[0])
    table = pd.DataFrame(at)
    table["range of |x|"] = [
        _exponent_range(lo, hi) for lo, hi in zip(table["lowest"], table["highest"], strict=True)
    ]
    shares = {
        "neg": "negative",
        "fp16_underflow": "fp16 underflow (below 2^-24)",
        "fp16_subnormal": "fp16 subnormal (2^-24 to 2^-14)",
        "fp16_overflow": "fp16 overflow (2^16 and up)",
    }
    for name, title in shares.items():
        table[title] = table[name].map(_share)
    table = table.rename(columns={"numel": "values", "nan": "NaN", "inf": "Inf"})
    columns = ["module", "kind", "slot", "step", "values", "range of |x|", "zero", "NaN", "Inf"]
    out.append(
        "<p>Each record at the step where its module's worst finding begins (or the "
        "histogrammed step before it; the finding's own line names its worst step): the range of its nonzero finite values, and as shares of them the negative "
        "ones and what float16 would make of them.</p>"
    )
    out += _table(
        table,
        [*columns, *shares.values()],
        numeric={"step", "values", "zero", "NaN", "Inf", *shares.values()},
    )
    out += [f'<p class="note">{_e(n)}</p>' for n in notes]
    if no_pictures is None:
        figure = plots.histograms_figure(trace, frame)
        out.append(
            _figure(figure, "distribution of |x| by power of two over steps (share of values)")
        )
    return out


def _record_kind(finding: str, evidence: str) -> str:
    """The kind of record a finding is about: parameters for a non-finite parameter, the kind
    its evidence names for float16's findings (``grad_output blocks.0: ...``), else the
    parameters' gradients, which the other findings on gradients watch."""
    if finding == "nonfinite_param":
        return "param"
    named = evidence.split(" ", 1)[0]
    if finding.startswith("fp16_") and named in KINDS:
        return named
    return "grad_param"


def _about_the_findings(records: pd.DataFrame, worst: dict[str, tuple[str, int]]) -> pd.DataFrame:
    """The records each flagged module's worst finding is about (:func:`_record_kind`), the
    modules in the findings' order; all of a module's records where it has none of those."""
    chosen = []
    for module, (kind, _) in worst.items():
        mine = records[records["module"] == module]
        about = mine[mine["kind"] == kind]
        chosen.append(about if not about.empty else mine)
    return pd.concat(chosen, ignore_index=True) if chosen else records.head(0)


def _exponent_range(lowest: Any, highest: Any) -> str:
    if pd.isna(lowest):
        return "-"
    return f"2^{lowest} to 2^{int(highest) + 1}"


def _share(value: float) -> str:
    return "-" if value != value else percent(value)  # NaN: no nonzero finite value


def _diff_section(
    a: Trace, b: Trace, rtol: float, atol: float, no_pictures: str | None, max_modules: int
) -> list[str]:
    out = ["<h2>Diff</h2>"]
    try:
        table, result = diff_table(a, b, rtol=rtol, atol=atol)
    except HooktraceError as exc:  # e.g. the runs share no step: the rest of the page holds
        return [*out, f'<p class="note">not compared: {_e(exc)}</p>']
    verdict = "match" if result.match else "differ"
    out.append(
        f'<p><strong class="{verdict}">{verdict.upper()}</strong> '
        f"{_e(_label(a))} vs {_e(_label(b))}: {result.differing:,} of {result.records:,} "
        f"records differ over {result.steps} steps ({result.first_step}–{result.last_step}), "
        f"rtol {result.rtol:g}, atol {result.atol:g}</p>"
    )
    first = result.first
    if first is not None:
        out.append(f"<p>First divergence: {_e(first.describe())}</p>")
        values = [(k, a_, b_) for k, (a_, b_) in first.values.items()]
        values += [(f"full tensor {k}", v, "") for k, v in first.errors.items()]
        if values:  # none when the record is in one run only
            frame = pd.DataFrame(values, columns=["value", "run A", "run B"])
            out += _table(frame, list(frame.columns), numeric={"run A", "run B"})
    out += [f"<p>{_e(line)}</p>" for line in result.structure.lines()]
    modules = result.modules.head(10).rename(columns=_DIFF_COLUMNS)
    if not modules.empty:
        out.append(f"<p>The modules that differ most at step {result.last_step}, the last:</p>")
        out += _table(modules, list(modules.columns), numeric=set(modules.columns) - {"module"})
    out += [f'<p class="note">{_e(note)}</p>' for note in result.notes]
    if no_pictures is None and not table.empty:
        caption = "largest relative difference per module and step; the first divergence circled"
        out.append(
            _figure(plots.diff_figure(a, b, table, result, max_modules=max_modules), caption)
        )
    return out


def _findings(findings: pd.DataFrame, notes: Iterable[str]) -> list[str]:
    if findings.empty:
        out = ["<h3>Findings</h3>", '<p class="match">No anomalies and no dead layers found.</p>']
    else:
        counts = findings["severity"].value_counts()
        tally = ", ".join(f"{counts[s]} {s}" for s in SEVERITIES if s in counts)
        out = [
            f"<h3>Findings ({_e(tally)})</h3>",
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
                f'<tr><td><span class="badge {badge}">{_e(severity)}</span></td>'
                f'<td>{_e(row["kind"])}</td><td class="mono">{_e(row["module"])}</td>'
                f'<td class="num">{_e(steps)}</td><td>{_e(row["evidence"])}'
                f'<div class="why">{_e(row["explanation"])}</div>{_captured(row)}</td></tr>'
            )
        out.append("</table>")
    return out + [f'<p class="note">{_e(note)}</p>' for note in notes]


def _captured(finding: dict[Any, Any]) -> str:
    """The capture that explains a non-finite finding, under its explanation ("" if none)."""
    text = finding.get("capture")
    return f'<div class="why">{_e(text)}</div>' if isinstance(text, str) and text else ""


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
        *_table(rows, [*columns, "reproduces"], numeric={"capture", "rank", "step"}),
        f'<p class="note">The calls where a NaN or Inf began, saved by the recorder and run '
        f"again to name the operation. Each in full: <code>{_e(replay_command(run))}</code></p>",
    ]


def _worst_first(findings: pd.DataFrame) -> pd.DataFrame:
    severity = findings["severity"].map({s: i for i, s in enumerate(SEVERITIES)})
    kind = findings["kind"].map({k: i for i, k in enumerate(KIND_ORDER)})
    order = pd.DataFrame({"s": severity, "k": kind, "step": findings["step"]})
    order = order.sort_values(["s", "k", "step"], kind="stable", na_position="last")
    return findings.loc[order.index].reset_index(drop=True)


def _table(frame: pd.DataFrame, columns: list[str], *, numeric: set[str]) -> list[str]:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    rows = []
    for record in frame[columns].to_dict("records"):
        cells = "".join(
            f'<td class="{"num" if c in numeric else "mono"}">{_e(_cell(record[c]))}</td>'
            for c in columns
        )
        rows.append(f"<tr>{cells}</tr>")
    return ["<table>", f"<tr>{head}</tr>", *rows, "</table>"]


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value) or value is pd.NA:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _figure(figure: Figure, caption: str) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=plots.DPI, bbox_inches="tight")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return (
        f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def _why_no_pictures() -> str | None:
    """None when pictures can be drawn, else why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "Pictures are left out: matplotlib is not installed (pip install 'hooktrace[plot]')."
    return None


def _label(trace: Trace) -> str:
    return str(trace.path)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)
