"""hooktrace report: one self-contained HTML page holding the summary, the findings, the diff
and the pictures of the sample traces, every name escaped; and the progress bar."""

from __future__ import annotations

import base64
import html
import io
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from nonfinite_runs import Log, record_run, source_line
from recorded_runs import record_odd_names
from repo import ROOT

from hooktrace.analyze.report.report import report
from hooktrace.cli import cli
from hooktrace.cli.progress import ProgressBar

SAMPLES = ROOT / "sample_traces"


class Page(HTMLParser):
    """The tags of a page, and the text of its headings."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.headings: list[str] = []
        self._heading = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._heading = tag in ("h1", "h2", "h3")

    def handle_endtag(self, tag: str) -> None:
        self._heading = False

    def handle_data(self, data: str) -> None:
        if self._heading:
            self.headings.append(data.strip())

    def images(self) -> list[bytes]:
        """The inline PNGs, decoded (each checked to be a picture)."""
        found = []
        for tag, attrs in self.tags:
            if tag == "img":
                source = attrs["src"] or ""
                assert source.startswith("data:image/png;base64,"), source[:40]
                data = base64.b64decode(source.partition(",")[2], validate=True)
                assert matplotlib.image.imread(io.BytesIO(data), format="png").shape[0] > 100
                found.append(data)
        return found


@pytest.fixture(scope="module")
def nan_page() -> str:
    return report(SAMPLES / "nan")


@pytest.fixture(scope="module")
def pair_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "pair.html"
    report(SAMPLES / "healthy", SAMPLES / "diverged", output=out)
    return out


def invoke(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_a_run_page_holds_summary_findings_and_pictures(nan_page: str) -> None:
    page = Page(nan_page)
    assert page.headings[:2] == [f"hooktrace report: {SAMPLES / 'nan'}", str(SAMPLES / "nan")]
    assert "Findings (2 errors, 4 warnings)" in page.headings
    for text in ("nonfinite_forward", "log_probs", "produced the first Inf of the forward pass",
                 "nonfinite_param", "activation_spike", "30 recorded (0–29)"):  # fmt: skip
        assert text in nan_page
    # gradient norms, activations, dead units; the flagged modules' distributions
    assert len(page.images()) == 3 + 1


def test_notes_show_their_code_spans_as_code(nan_page: str) -> None:
    """The analyses write notes as Markdown (for the terminal and TensorBoard); the page
    shows their `code spans` as code, not as backticks."""
    assert "see <code>hooktrace anomalies</code>" in nan_page
    assert "`" not in "".join(re.findall(r'<p class="note">(.*?)</p>', nan_page))


def test_the_footer_commands_run_as_written(
    nan_page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each command the page suggests runs as it is written (plot needs its output)."""
    monkeypatch.chdir(tmp_path)
    import shlex

    commands = re.findall(
        r"<code>(hooktrace [^<]+)</code>", nan_page.split("The same from the shell")[1]
    )
    assert [c.split()[1] for c in commands] == ["summary", "anomalies", "dead-relus", "plot"]
    for command in commands:
        args = shlex.split(html.unescape(command))[1:]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code in (0, 1), (command, result.output)
    assert (tmp_path / "picture.png").is_file()


def test_a_run_page_names_the_captured_operation_and_line(tmp_path: Path) -> None:
    run = record_run(Log(), tmp_path / "run")
    text = report(run)
    page = Page(text)
    assert "Non-finite captures" in page.headings
    file, line = source_line("LOG_LINE")
    # under the finding it explains, and in the table of captures
    assert (
        f"captured: aten::log at {file}:{line} (capture 0); hooktrace replay {run} --nonfinite"
        in text
    )
    for cell in ("aten::log", f"{file}:{line}", "return torch.log(x)  # LOG_LINE", "forward"):
        assert f'<td class="mono">{cell}</td>' in text
    assert f"<code>hooktrace replay {run} --nonfinite</code>" in text


def test_the_nan_samples_page_shows_its_capture(nan_page: str) -> None:
    assert "Non-finite captures" in Page(nan_page).headings
    assert "aten::log at sample_traces/make_samples.py:38" in nan_page


def test_a_page_without_captures_has_no_such_section(pair_page: Path) -> None:
    text = pair_page.read_text()
    assert "Non-finite captures" not in Page(text).headings
    assert "captured:" not in text and "--nonfinite" not in text


def test_a_page_stands_alone(nan_page: str, pair_page: Path) -> None:
    for text in (nan_page, pair_page.read_text()):
        tags = Page(text).tags
        assert not [t for t, _ in tags if t in ("script", "link", "iframe", "object")]
        for _, attrs in tags:
            for name in ("src", "href"):
                assert not (attrs.get(name) or "data:").lower().startswith(("http", "//")), attrs


def test_two_runs_page_holds_the_diff(pair_page: Path) -> None:
    text = pair_page.read_text()
    page = Page(text)
    assert page.headings[1] == "Diff"
    assert "DIFFER" in text and "846 of 1,500" in text
    assert "First divergence: step 12, forward pass: output of &#x27;blocks.1.norm&#x27;" in text
    # the full tensors' comparison is a table of its own, A against B, not under "run A"
    assert "<th>statistic</th><th>run A</th><th>run B</th>" in text
    assert "<th>full tensor</th><th>A against B</th>" in text
    assert re.search(r"<td[^>]*>cosine</td><td[^>]*>0\.99999", text)
    # no column that is empty in every row (max abs error: only where saved in full)
    assert "max abs error</th>" not in text
    assert "No anomalies and no dead layers found." in text
    assert len(page.images()) == 1 + 3 + 3  # the diff, then three per run


def test_a_first_divergence_in_one_run_only(tmp_path: Path) -> None:
    """The first difference is a record that run B lacks: it has no values to compare."""
    run_b = tmp_path / "fewer"
    shutil.copytree(SAMPLES / "healthy", run_b)
    (part,) = (run_b / "records").rglob("*.parquet")
    table = pq.read_table(part)
    lost = pc.and_(pc.equal(table["module"].cast("string"), "embed"), pc.equal(table["step"], 3))
    pq.write_table(table.filter(pc.invert(lost)), part)
    text = report(SAMPLES / "healthy", run_b)
    assert "First divergence: step 3, forward pass: param of &#x27;embed&#x27;" in text
    assert "(only in run A)" in text


def test_every_name_is_escaped(tmp_path: Path) -> None:
    run = record_odd_names(tmp_path / "<b>run</b>")
    text = report(run, output=tmp_path / "odd.html")
    assert (tmp_path / "odd.html").read_text() == text
    assert "<script" not in text and "<b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "&lt;b&gt;run&lt;/b&gt;" in text
    page = Page(text)
    assert not [t for t, _ in page.tags if t in ("script", "b")]
    assert page.headings[0].endswith("<b>run</b>")  # as text, not as markup


def test_report_command(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    result = invoke("report", SAMPLES / "dead", "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and result.stderr == f"hooktrace: wrote {out}\n"
    assert "dead_layer" in out.read_text()
    assert "16 of 32 units dead (50%), since step 10" in out.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{samples}/healthy", "{tmp}/missing", "-o", "{tmp}/r.html"], "no run at"),
        (["{samples}/healthy", "-o", "{tmp}/no/r.html"], "is not a directory; create it first"),
    ],
)
def test_report_errors_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = invoke("report", *[a.format(samples=SAMPLES, tmp=tmp_path) for a in args])
    assert result.exit_code == 2
    assert result.output.startswith("hooktrace: error: ") and message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_damaged_second_run_is_a_one_line_error_before_any_picture(tmp_path: Path) -> None:
    """The suites of damaged traces give report one run each (reliability/helpers.py,
    ``argv_for``): its two-run form meets a damaged run here."""
    damaged = tmp_path / "damaged"
    shutil.copytree(SAMPLES / "healthy", damaged)
    (damaged / "manifest.json").write_text("{")
    result = invoke("report", SAMPLES / "healthy", damaged, "-o", tmp_path / "r.html")
    assert result.exit_code == 2
    assert result.output.startswith("hooktrace: error: ") and "manifest is damaged" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal_and_not_when_quiet() -> None:
    terminal = Terminal()
    with ProgressBar("analysing", file=terminal) as progress:
        for done, what in enumerate(["summary", "anomalies", "pictures"]):
            progress(done, 3, what)
    drawn = terminal.getvalue()
    assert "analysing" in drawn and "anomalies" in drawn and "100%" in drawn
    for quiet, file in ((True, Terminal()), (False, io.StringIO())):
        with ProgressBar("analysing", quiet=quiet, file=file) as progress:
            progress(0, 3, "summary")
        assert file.getvalue() == ""


@pytest.fixture(scope="module")
def vanishing_page(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run whose gradients vanish (the loss scaled by 1e-9): flagged, and histogrammed."""
    from recorded_runs import MLP, train

    run = tmp_path_factory.mktemp("vanishing") / "run"
    train(MLP(), run, steps=5, loss_scale=1e-9)
    return report(run)


def test_flagged_modules_show_their_distributions(vanishing_page: str) -> None:
    page = Page(vanishing_page)
    assert "Distributions of the flagged modules" in page.headings
    section = vanishing_page.partition("Distributions of the flagged modules")[2]
    section = section.partition("<h3>")[0]
    rows = section.split("<tr>")[2:]  # after the header
    cells = [[c.partition(">")[2] for c in r.split("</td>")[:-1]] for r in rows]
    # the gradients the findings are about, fc1 to fc3, each at step 0
    assert [c[:4] for c in cells] == [
        [m, "grad_param", s, "0"] for m in ("fc1", "fc2", "fc3") for s in ("weight", "bias")
    ]
    # a gradient 1e-9 of its usual size (2^-30): float16 loses most of it, all of some
    lost = [float(c[10].rstrip("%")) for c in cells]
    assert min(lost) > 80 and max(lost) == 100
    assert len(page.images()) == 3 + 1  # the run's pictures, and the distributions


def test_the_nan_samples_page_shows_the_flagged_parameters_before_they_turn_nan(
    nan_page: str,
) -> None:
    """embed's parameters are all NaN from step 16 (nonfinite_param): a row of that step has
    no range and no shares to show ("-" in every column), so the table shows step 15, the
    last they held finite values, which is what led into the fault."""
    section = nan_page.partition("Distributions of the flagged modules")[2].partition("<h3>")[0]
    assert '<td class="mono">embed</td><td class="mono">param</td>' in section
    assert '<td class="num">15</td><td class="num">512</td><td class="mono">2^-13 to 2^-1</td>' in (
        section
    )
    assert '<td class="mono">-</td>' not in section
    assert "Not histogrammed: log_probs" in section


def test_a_trace_without_histograms_gets_a_note_not_a_failure(tmp_path: Path) -> None:
    run = tmp_path / "nan"
    shutil.copytree(SAMPLES / "nan", run)
    shutil.rmtree(run / "histograms")  # none written
    page = report(run)
    assert "Distributions of the flagged modules" in Page(page).headings
    assert "No histograms in this trace, so no distributions" in page
    assert "--histograms param,grad_param" in page
    assert len(Page(page).images()) == 3


def test_a_page_with_nothing_flagged_has_no_distributions(pair_page: Path) -> None:
    assert "Distributions of the flagged modules" not in Page(pair_page.read_text()).headings


def test_a_page_of_runs_of_several_ranks_reads_logical_tensors() -> None:
    """The DDP sample (rank 1's replica of fc2.bias nudged at step 3) against the one-process
    one: the page says the ranks' records are read as logical tensors, names the replicas
    that came apart, and finds the first divergence at step 3 (records of rank 0 and 1 alike
    up to there)."""
    page = report(SAMPLES / "distributed" / "ddp", SAMPLES / "distributed" / "one")
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    assert "0, 1: their records read as logical tensors" in text
    assert "replicas_differ" in text
    assert "compared logical tensors" in text
    first = re.search(r"first divergence[^.]*?step (\d+)", text, re.IGNORECASE)
    assert first and first.group(1) == "3", text[:3000]
