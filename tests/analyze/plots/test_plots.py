"""hooktrace plot and the tables behind it: numbers against plain torch and the full tensors,
pictures that decode, long and odd module names, one-line errors, and no torch (nor
matplotlib) needed where the pictures do not need them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections import OrderedDict
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from recorded_runs import LONG, MLP, SCRIPT, record_odd_names, train
from repo import ROOT
from torch import nn

import hooktrace
from hooktrace.analyze.plots.plots import (
    NAME_WIDTH,
    ONE_RUN_ONLY_COLOUR,
    cell_layers,
    diff_figure,
    plot,
)
from hooktrace.analyze.plots.tables import (
    ONE_RUN_ONLY,
    activation_tables,
    diff_table,
    grad_norm_table,
    histogram_table,
    silent_unit_table,
)
from hooktrace.cli import cli
from hooktrace.errors import ConfigError

SAMPLES = ROOT / "sample_traces"


@pytest.fixture(scope="module")
def odd_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_odd_names(tmp_path_factory.mktemp("odd") / "run$1$")


def invoke(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def decode_png(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100
    return pixels


# --- the tables --------------------------------------------------------------------------------


def test_grad_norm_table_matches_plain_torch(tmp_path: Path) -> None:
    norms = train(MLP(), tmp_path / "run", steps=6)  # each Linear's gradient norm, by torch
    table = grad_norm_table(tmp_path / "run")
    assert table.index.tolist() == ["fc1", "fc2", "fc3"]  # the model's order
    assert table.columns.tolist() == list(range(6))
    for module, expected in norms.items():
        np.testing.assert_allclose(table.loc[module].to_numpy(), expected, rtol=1e-5)
    assert grad_norm_table(tmp_path / "run", modules="fc[12]", steps="2-3").shape == (2, 2)


def test_non_finite_cells_are_inf_and_missing_ones_nan() -> None:
    table = grad_norm_table(SAMPLES / "nan")
    assert np.isfinite(table.loc[:, :14].to_numpy()).all()
    assert np.isinf(table.loc[:, 15:].to_numpy()).all()  # the NaN gradients of step 15 on
    rms, _ = activation_tables(SAMPLES / "nan")
    assert np.isinf(rms.loc["log_probs", 15]) and np.isfinite(rms.loc["head", 15])
    assert grad_norm_table(SAMPLES / "nan", modules="no such module").empty


def test_nan_outputs_are_drawn_as_non_finite_not_as_silence_or_zeros() -> None:
    """From step 16 of the NaN sample the ReLU layers output NaN: neither silent units nor a
    share of zeros (both would read as dead), but the red non-finite cells."""
    silent = silent_unit_table(SAMPLES / "nan")
    assert np.isinf(silent.loc[:, 16:].to_numpy()).all()
    assert np.isfinite(silent.loc[:, :15].to_numpy()).all()
    rms, zeros = activation_tables(SAMPLES / "nan")
    assert (np.isinf(zeros.to_numpy()) == np.isinf(rms.to_numpy())).all()
    assert np.isinf(zeros.loc["blocks.0.act", 16]) and zeros.loc["blocks.0.act", 15] < 1
    figure = plot(SAMPLES / "nan", what="dead-units")
    legend = figure.axes[0].get_legend()
    assert legend is not None and "NaN or Inf" in [t.get_text() for t in legend.get_texts()]


def test_activation_tables_match_the_full_tensors() -> None:
    trace = hooktrace.load(SAMPLES / "healthy")
    rms, zeros = activation_tables(trace)
    for module in ("blocks.1.norm", "blocks.1.fc", "blocks.1.act"):
        for step in (0, 12):
            values = trace.tensor(module, "output", step=step).astype(np.float64)
            assert rms.loc[module, step] == pytest.approx(np.sqrt(np.mean(values**2)), rel=1e-5)
            assert zeros.loc[module, step] == pytest.approx(np.mean(values == 0), abs=1e-9)


def test_silent_unit_table_shows_the_planted_dead_units() -> None:
    table = silent_unit_table(SAMPLES / "dead")
    assert table.index.tolist() == ["blocks.0.act", "blocks.1.act"]
    assert (table.loc["blocks.0.act", :9] == 0).all()
    assert (table.loc["blocks.0.act", 10:] == 0.5).all()  # 16 of 32 units, from step 10
    assert (table.loc["blocks.1.act"] < 0.5).all()


def test_diff_table_is_zero_until_the_first_divergence() -> None:
    table, result = diff_table(SAMPLES / "healthy", SAMPLES / "diverged")
    assert result.first is not None and result.first.module == "blocks.1.norm"
    assert (table.loc[:, :11] == 0).all().all()
    assert table.loc["blocks.1.norm", 12] > 1e-3
    assert (table.loc[:, 13:] > 0).all().all()
    same, again = diff_table(SAMPLES / "healthy", SAMPLES / "healthy")
    assert again.match and (same == 0).all().all()


class Fault(nn.Module):
    """x * 1.0, through ``extra`` at ``detour_at`` (records one run lacks), and log(x) (-inf
    at the ReLU's zeros) from ``log_from`` on."""

    def __init__(self, *, detour_at: int | None = None, log_from: int | None = None) -> None:
        super().__init__()
        self.extra = nn.Identity()
        self.detour_at, self.log_from, self.step = detour_at, log_from, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step == self.detour_at:
            x = self.extra(x)
        if self.log_from is not None and self.step >= self.log_from:
            return torch.log(x)
        return x * 1.0


def record_fault(out: Path, fault: Fault, steps: int = 4) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(4, 4), act=nn.ReLU(), fault=fault))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with hooktrace.record(model, out):
        for step in range(steps):
            fault.step = step
            model(torch.randn(8, 4, generator=generator)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return out


def test_diff_tells_non_finite_cells_from_records_in_one_run_only(tmp_path: Path) -> None:
    a = record_fault(tmp_path / "a", Fault())
    b = record_fault(tmp_path / "b", Fault(detour_at=1, log_from=2))
    table, result = diff_table(a, b)
    assert not result.match
    assert table.index.tolist() == ["Sequential", "fc", "act", "fault", "fault.extra"]
    # what each cell must be, from the records themselves: run A is all finite; a cell is
    # non-finite where a record of B holds a NaN or an Inf, in one run only where B has a
    # record that A lacks
    keys = ["module", "step", "micro_step", "phase", "call", "kind", "slot"]
    records_a, records_b = hooktrace.load(a).records, hooktrace.load(b).records
    assert (records_a[["nan_count", "inf_count"]] == 0).all().all()
    bad = records_b[(records_b["nan_count"] + records_b["inf_count"]) > 0]
    nonfinite = set(zip(bad["module"].astype(str), bad["step"], strict=True))
    lacking = records_b.merge(records_a[keys], on=keys, how="left", indicator=True)
    lacking = lacking[lacking["_merge"] == "left_only"]
    one_run = set(zip(lacking["module"].astype(str), lacking["step"], strict=True))
    assert one_run == {("fault.extra", 1)}
    assert ("fault", 2) in nonfinite and not any(step < 2 for _, step in nonfinite)
    cells = table.stack().dropna()  # NaN: neither run recorded the module at the step
    assert set(cells[cells == np.inf].index) == nonfinite
    assert set(cells[cells == ONE_RUN_ONLY].index) == one_run
    assert (cells[cells.index.map(lambda cell: cell[1] < 2)].drop(("fault.extra", 1)) == 0).all()

    # the picture: a colour and a legend entry each, and no cell in two of them
    layers = dict(
        cell_layers(
            table.where(table > 0),
            log=True,
            inf_label="non-finite",
            marks={
                "in one run only": (table == ONE_RUN_ONLY, ONE_RUN_ONLY_COLOUR),
                "equal within tolerance": (table == 0, "#dddddd"),
            },
        )
    )
    assert list(layers) == ["non-finite", "in one run only", "equal within tolerance"]
    assert layers["non-finite"][1] != layers["in one run only"][1]
    rows, columns = list(table.index), list(table.columns)

    def cells_of(mask: np.ndarray) -> set[tuple[str, int]]:
        return {(rows[i], columns[j]) for i, j in np.argwhere(mask)}

    assert cells_of(layers["in one run only"][0]) == one_run
    assert cells_of(layers["non-finite"][0]) == nonfinite
    figure = diff_figure(hooktrace.load(a), hooktrace.load(b), table, result)
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == ["non-finite", "in one run only", "equal within tolerance"]


# --- pictures ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("run", "what", "against"),
    [
        ("exploding", "grad-norms", None),
        ("nan", "activations", None),
        ("dead", "dead-units", None),
        ("healthy", "diff", "diverged"),
    ],
)
def test_each_picture_is_drawn(tmp_path: Path, run: str, what: str, against: str | None) -> None:
    out = tmp_path / f"{what}.png"
    other = SAMPLES / against if against else None
    figure = plot(SAMPLES / run, what=what, against=other, output=out)
    decode_png(out)
    title = figure.axes[0].get_title(loc="left")
    assert title.startswith(run)
    if what == "diff":  # on a line of its own, as the README's picture shows it
        first = "first divergence (circled): step 12, output of blocks.1.norm"
        assert title.split("\n")[1:] == [first], title


def test_names_no_font_draws_are_shown_as_their_escapes(tmp_path: Path) -> None:
    """A module named with a NUL, a line break or bytes that were not UTF-8 is labelled with
    Python's escapes, and matplotlib warns of no missing glyph."""
    model = nn.Sequential()
    for name in ("a\x00b", "line\nbreak", "\udcff\udcfe"):
        model.add_module(name, nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Glyph 0 missing from font(s)" is a UserWarning
        figure = plot(tmp_path / "run", what="activations", output=tmp_path / "odd.png")
    labels = {label.get_text() for label in figure.axes[0].get_yticklabels()}
    assert {r"a\x00b", r"line\nbreak", r"\udcff\udcfe"} <= labels


def test_long_and_odd_names_stay_readable(odd_run: Path, tmp_path: Path) -> None:
    figure = plot(odd_run, what="activations", output=tmp_path / "odd.png")
    decode_png(tmp_path / "odd.png")
    labels = [label.get_text() for label in figure.axes[0].get_yticklabels()]
    long = [label for label in labels if label.startswith("…")]
    assert long and all(len(label) == NAME_WIDTH for label in long)
    assert f"…{LONG[-(NAME_WIDTH - 3) :]}.0" in labels  # the end of a name is what tells
    assert r"cost\$in\$dollars" in labels  # drawn as it is, not as mathtext
    assert SCRIPT in labels
    assert len(set(labels)) == len(labels)
    assert figure.axes[0].get_title(loc="left").startswith(r"run\$1\$: outputs per module")


def test_max_modules_keeps_the_largest(tmp_path: Path) -> None:
    figure = plot(SAMPLES / "exploding", what="grad-norms", max_modules=2)
    labels = [label.get_text() for label in figure.axes[0].get_yticklabels()]
    peaks = grad_norm_table(SAMPLES / "exploding").max(axis=1)
    assert set(labels) == set(peaks.nlargest(2).index) == {"embed", "head"}
    assert labels == ["embed", "head"]  # in the model's order
    assert "(2 of 6 shown: the largest)" in figure.axes[0].get_title(loc="left")


def test_nothing_to_draw_is_said_not_drawn(tmp_path: Path) -> None:
    """No parameter gradients (params=False), no ReLU: a picture that says so, no warning."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with hooktrace.record(model, tmp_path / "run", params=False) as rec:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            rec.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for what, said in (
            ("grad-norms", "no parameter gradients recorded (params=False?)"),
            ("dead-units", "no per-unit activity of ReLU-family layers recorded"),
        ):
            figure = plot(tmp_path / "run", what=what, output=tmp_path / f"{what}.png")
            assert [t.get_text() for t in figure.axes[0].texts] == [said]
            decode_png(tmp_path / f"{what}.png")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"what": "pie"}, "unknown picture 'pie'"),
        ({"what": "diff"}, "give against=RUN_B"),
        ({"against": SAMPLES / "dead"}, "give against=RUN_B"),
        ({"output": "grads.txt"}, "cannot tell the picture format"),
        ({"output": "/no/such/dir/grads.png"}, "is not a directory"),
        ({"modules": "("}, "bad modules regex"),
        ({"steps": "ten"}, "bad steps"),
    ],
)
def test_bad_options_raise_config_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plot(SAMPLES / "healthy", **options)  # type: ignore[arg-type]


# --- the command -------------------------------------------------------------------------------


def test_plot_command(tmp_path: Path) -> None:
    result = invoke("plot", SAMPLES / "exploding", "-o", tmp_path / "grads.png")
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and result.stderr == f"hooktrace: wrote {tmp_path / 'grads.png'}\n"
    decode_png(tmp_path / "grads.png")
    quiet = invoke("plot", SAMPLES / "healthy", "--against", SAMPLES / "diverged", "-q",
                   "-o", tmp_path / "diff.svg")  # fmt: skip
    assert quiet.exit_code == 0 and quiet.output == ""
    assert (tmp_path / "diff.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--what", "diff"], "--what diff compares two runs: give --against RUN_B"),
        (["--what", "activations", "--against", "{run}"], "--against draws the diff picture"),
        (["-o", "{tmp}/x.txt"], "cannot tell the picture format"),
        (["--modules", "("], "bad modules regex"),
        (["--steps", "9-2"], "a range goes upwards"),
    ],
)
def test_plot_command_errors_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    args = [a.format(run=SAMPLES / "diverged", tmp=tmp_path) for a in args]
    output = [] if "-o" in args else ["-o", tmp_path / "x.png"]
    result = invoke("plot", SAMPLES / "healthy", *args, *output)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("hooktrace: error: ") and message in result.output
    assert len(result.output.strip().splitlines()) == 1
    missing = invoke("plot", tmp_path / "missing", "-o", tmp_path / "x.png")
    assert missing.exit_code == 2 and "no run at" in missing.output
    no_output = invoke("plot", SAMPLES / "healthy")
    assert no_output.exit_code == 2 and "Missing option '--output'" in no_output.output


# --- what it does not need ---------------------------------------------------------------------

_RUN_COMMANDS = textwrap.dedent(
    """
    import sys
    for blocked in sys.argv[1].split(","):
        sys.modules[blocked] = None  # importing it now fails
    from hooktrace.cli import main
    for command in sys.argv[2:]:
        try:
            main(command.split("|"))
        except SystemExit as exc:
            print(f"exit {exc.code}", flush=True)
    assert sys.modules.get("torch") is None
    """
)


def run_blocked(blocked: str, *commands: list[object]) -> subprocess.CompletedProcess[str]:
    """Run hooktrace commands in one process where importing ``blocked`` fails."""
    return subprocess.run(
        [sys.executable, "-c", _RUN_COMMANDS, blocked,
         *("|".join(str(a) for a in command) for command in commands)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_pictures_and_report_without_torch(tmp_path: Path) -> None:
    done = run_blocked(
        "torch",
        ["plot", SAMPLES / "dead", "--what", "dead-units", "-q", "-o", tmp_path / "dead.png"],
        ["plot", SAMPLES / "healthy", "--against", SAMPLES / "diverged", "-q", "-o",
         tmp_path / "diff.png"],
        ["report", SAMPLES / "nan", "-q", "-o", tmp_path / "r.html"],
    )  # fmt: skip
    assert done.stdout.split("\n") == ["exit 0"] * 3 + [""], done.stderr
    decode_png(tmp_path / "dead.png")
    decode_png(tmp_path / "diff.png")
    assert "nonfinite_forward" in (tmp_path / "r.html").read_text()


def test_without_matplotlib_plot_says_how_to_install_it_and_report_leaves_pictures_out(
    tmp_path: Path,
) -> None:
    done = run_blocked(
        "torch,matplotlib",
        ["plot", SAMPLES / "dead", "-o", tmp_path / "dead.png"],
        ["report", SAMPLES / "dead", "-q", "-o", tmp_path / "r.html"],
    )
    assert done.stdout.split("\n") == ["exit 2", "exit 0", ""], done.stderr
    assert done.stderr == (
        "hooktrace: error: pictures need matplotlib, which is not installed: "
        "pip install 'hooktrace[plot]'\n"
    )
    page = (tmp_path / "r.html").read_text()
    assert "matplotlib is not installed" in page and "<img" not in page
    assert "dead_layer" in page


def test_help_needs_neither_pandas_nor_matplotlib() -> None:
    code = (
        "import sys\nfrom hooktrace.cli import cli\n"
        "for name in ('plot', 'report'):\n"
        "    try:\n        cli.main([name, '--help'])\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('pandas', 'matplotlib', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip().endswith("[]"), done.stdout + done.stderr


# --- distributions (histograms) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def known_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from recorded_runs import record_known

    return record_known(tmp_path_factory.mktemp("known") / "run")


def test_histogram_table_holds_each_powers_share(known_run: Path) -> None:
    frame = hooktrace.hist(known_run, kinds="param", modules="Linear")
    weight = histogram_table(frame[frame["slot"] == "weight"])
    assert weight.index.tolist() == list(range(-30, 21))  # float16's -24..-15 inside anyway
    assert weight.columns.tolist() == [0, 1, 2, 3]
    # 2^-30, -2^-26, 2^-20, -2^-16, 2^-10, 1, -3, 2^10, 2^17, -2^20: one of 12 values each
    occupied = weight.index[weight[0] > 0].tolist()
    assert occupied == [-30, -26, -20, -16, -10, 0, 1, 10, 17, 20]
    np.testing.assert_allclose(weight.loc[occupied, 0], 1 / 12)
    np.testing.assert_allclose(weight.sum(), 10 / 12)  # the two zeros are not in a power
    bias = histogram_table(frame[frame["slot"] == "bias"])  # 0.5 and -0.25
    assert bias.index.tolist() == list(range(-24, 0))  # the subnormal band, up to 2^-2
    assert bias.loc[[-2, -1], 2].tolist() == [0.5, 0.5]


def test_histograms_picture_is_drawn(known_run: Path, tmp_path: Path) -> None:
    figure = plot(known_run, what="histograms", output=tmp_path / "h.png")
    decode_png(tmp_path / "h.png")
    panels = [ax.get_title(loc="left") for ax in figure.axes if ax.get_title(loc="left")]
    assert panels == [
        "Linear param weight", "Linear param bias",
        "Linear grad_param weight", "Linear grad_param bias",
    ]  # fmt: skip
    labels = [t.get_text() for ax in figure.axes for t in ax.texts]
    assert "fp16 underflow below $2^{-24}$" in labels and "fp16 overflow from $2^{16}$" in labels
    one = plot(known_run, what="histograms", kinds=["grad_param"], modules="Lin", max_modules=1)
    assert one.get_suptitle().endswith("(1 of 2 records shown: choose with modules/kinds)")


def test_histograms_command_and_a_trace_without_them(known_run: Path, tmp_path: Path) -> None:
    done = invoke("plot", known_run, "--what", "histograms", "--kinds", "grad_param", "-q",
                  "-o", tmp_path / "h.svg")  # fmt: skip
    assert done.exit_code == 0 and done.output == ""
    assert (tmp_path / "h.svg").read_text().lstrip().startswith("<?xml")
    from recorded_runs import without_histograms

    off = without_histograms(tmp_path / "off", older=False)
    none = invoke("plot", off, "--what", "histograms", "-o", tmp_path / "x.png")
    assert none.exit_code == 2 and len(none.output.strip().splitlines()) == 1
    assert "holds no histograms" in none.output and "--histograms param,grad_param" in none.output
    assert not (tmp_path / "x.png").exists()
    assert invoke("plot", off, "-q", "-o", tmp_path / "grads.png").exit_code == 0  # the others
    kinds = invoke("plot", known_run, "--kinds", "param", "-o", tmp_path / "x.png")
    assert kinds.exit_code == 2
    assert "--kinds chooses the records of --what histograms, not of grad-norms" in kinds.output
    with pytest.raises(ConfigError, match="kinds choose the records of the histograms picture"):
        plot(known_run, what="activations", kinds="param")
