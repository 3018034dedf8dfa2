"""The report's distributions of the flagged modules: for each module a finding names (worst
first), its histogrammed records at the step where that finding begins, as a table of ranges
and float16 shares, and their distribution over steps as a picture. Never imports torch.

Apart from :mod:`hooktrace.analyze.report.report` because it is the one section that joins two
analyses, the findings and the histograms (:func:`hooktrace.hist`), to choose what to show.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from hooktrace.analyze.histograms.histograms import hist, histogrammed, in_order, per_step
from hooktrace.analyze.histograms.precision import percent
from hooktrace.analyze.plots import figures, plots
from hooktrace.analyze.report.html import escaped, html_figure, html_table, note
from hooktrace.errors import HooktraceError
from hooktrace.trace.reader import Trace
from hooktrace.trace.schema import KINDS

DISTRIBUTION_STEPS = 200
"""Steps the distribution picture samples at most, evenly, from the first to the last."""


def distributions(trace: Trace, findings: pd.DataFrame, no_pictures: str | None) -> list[str]:
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
        return [*out, f'<p class="note">not drawn: {escaped(exc)}</p>']
    notes = []
    without = [m for m in worst if m not in set(records["module"])]
    if without:
        kinds = trace.manifest.get("config", {}).get("histograms") or []
        notes.append(
            f"Not histogrammed: {', '.join(without)} (the trace histograms "
            f"{', '.join(kinds) or 'nothing'}; these modules record none of those)."
        )
    if frame is None:
        return [*out, *(note(n) for n in notes)]
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
        finite = before[before["lowest"].notna()]  # a step all NaN has no range to show
        if not finite.empty:
            at.append(finite.iloc[-1])
        else:
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
        "<p>Each record at the step where its module's worst finding begins, or the last "
        "histogrammed step before it that held finite values (a record all NaN has none to "
        "show; the finding's own line names its worst step): the range of its nonzero finite "
        "values, and as shares of them the negative ones and what float16 would make of "
        "them.</p>"
    )
    out += html_table(
        table,
        [*columns, *shares.values()],
        numeric={"step", "values", "zero", "NaN", "Inf", *shares.values()},
    )
    out += [note(n) for n in notes]
    if no_pictures is None:
        figure = figures.histograms_figure(trace, frame)
        out.append(
            html_figure(figure, "distribution of |x| by power of two over steps (share of values)")
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
