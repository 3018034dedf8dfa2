"""The HTML pieces of :func:`~hooktrace.analyze.report.report.report`'s page: the style sheet,
escaping, tables and figures as inline PNGs. Never imports torch.

Apart from the report because every section of the page is made of them
(:mod:`hooktrace.analyze.report.report`, :mod:`hooktrace.analyze.report.distributions`); they know
nothing of traces.
"""

from __future__ import annotations

import base64
import html
import io
import re
from typing import TYPE_CHECKING, Any

import pandas as pd

from hooktrace.analyze.plots import plots

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STYLE = """
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


def html_table(frame: pd.DataFrame, columns: list[str], *, numeric: set[str]) -> list[str]:
    head = "".join(f"<th>{escaped(c)}</th>" for c in columns)
    rows = []
    for record in frame[columns].to_dict("records"):
        cells = "".join(
            f'<td class="{"num" if c in numeric else "mono"}">{escaped(_cell(record[c]))}</td>'
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


def html_figure(figure: Figure, caption: str) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=plots.DPI, bbox_inches="tight")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return (
        f'<figure><img alt="{escaped(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{escaped(caption)}</figcaption></figure>"
    )


def escaped(value: object) -> str:
    return html.escape(str(value), quote=True)


def note(text: object) -> str:
    """A note of the analyses as a paragraph: escaped, its `code spans` (the analyses write
    their notes as Markdown, for the terminal and TensorBoard) as code."""
    return '<p class="note">' + re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped(text)) + "</p>"
