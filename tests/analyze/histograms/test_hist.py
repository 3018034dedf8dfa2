"""hooktrace.hist and ``hooktrace hist`` on real recordings: the bins of parameters set by hand
worked out by hand, those of a trained model computed again from the tensors with numpy's
log2 (never hooktrace's own binning), the text view pinned by a golden file, every format
read back, and one-line errors where a trace holds no histograms."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner, Result
from recorded_runs import record_known, without_histograms
from repo import GOLDEN, ROOT
from torch import nn

import hooktrace
from hooktrace.analyze.histograms import histograms
from hooktrace.analyze.histograms.histograms import (
    COLUMNS,
    hist,
    histogrammed,
    per_step,
    sample_steps,
)
from hooktrace.cli import cli
from hooktrace.errors import ConfigError, TraceError

SAMPLES = ROOT / "sample_traces"
UPDATE = os.environ.get("HOOKTRACE_UPDATE_GOLDEN") == "1"


@pytest.fixture(scope="module")
def known(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_known(tmp_path_factory.mktemp("known") / "run")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # type: ignore[no-any-return]


Values = dict[tuple[int, str, str, str], np.ndarray]


def train_mlp(out: Path, steps: int = 6, **options: object) -> Values:
    """A seeded SGD run, recorded; returns each parameter and gradient as numpy saw it, by
    (step, module, kind, slot)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen: Values = {}
    with hooktrace.record(model, out, **options):
        for step in range(steps):
            for name, p in model.named_parameters():
                module, _, slot = name.rpartition(".")
                seen[(step, module, "param", slot)] = p.detach().numpy().copy()
            x = torch.randn(32, 8)
            (model(x) * 1e-3).pow(2).mean().backward()  # small gradients: some below 2^-24
            for name, p in model.named_parameters():
                module, _, slot = name.rpartition(".")
                assert p.grad is not None
                seen[(step, module, "grad_param", slot)] = p.grad.numpy().copy()
            opt.step()
            opt.zero_grad()
    return seen


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Values]:
    out = tmp_path_factory.mktemp("mlp") / "run"
    return out, train_mlp(out)


def expected_bins(values: np.ndarray) -> dict[tuple[str, int | None], int]:
    """{(bin, exponent): count} of ``values``, by numpy's log2 in float64."""
    x = values.astype(np.float64).ravel()
    found: dict[tuple[str, int | None], int] = {}
    for name, mask in (
        ("zero", x == 0),
        ("nan", np.isnan(x)),
        ("pos_inf", x == np.inf),
        ("neg_inf", x == -np.inf),
    ):
        if mask.any():
            found[(name, None)] = int(mask.sum())
    finite = x[np.isfinite(x) & (x != 0)]
    exponents = np.floor(np.log2(np.abs(finite))).astype(int)
    for name, sign in (("pos", finite > 0), ("neg", finite < 0)):
        for e, n in zip(*np.unique(exponents[sign], return_counts=True), strict=True):
            found[(name, int(e))] = int(n)
    return found


def bins_of(frame: pd.DataFrame, step: int, module: str, kind: str, slot: str) -> dict:
    mine = frame[
        (frame["step"] == step)
        & (frame["module"] == module)
        & (frame["kind"] == kind)
        & (frame["slot"] == slot)
    ]
    return {
        (b, None if pd.isna(e) else int(e)): int(c)
        for b, e, c in zip(mine["bin"], mine["exponent"], mine["count"], strict=True)
    }


def invoke(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


# --- the values --------------------------------------------------------------------------------


def test_parameters_set_by_hand_land_in_the_bins_worked_out_by_hand(known: Path) -> None:
    frame = hist(known)
    assert list(frame.columns) == list(COLUMNS)
    assert sorted(set(frame["step"])) == [0, 1, 2, 3]
    for step in range(4):
        # 2^-30, 2^-20, 2^-10, 1 (exponent 0), 2^10, 2^17; -2^-26, -2^-16, -3 (exponent 1),
        # -2^20; two zeros
        assert bins_of(frame, step, "Linear", "param", "weight") == {
            ("zero", None): 2,
            ("neg", -26): 1,
            ("neg", -16): 1,
            ("neg", 1): 1,
            ("neg", 20): 1,
            ("pos", -30): 1,
            ("pos", -20): 1,
            ("pos", -10): 1,
            ("pos", 0): 1,
            ("pos", 10): 1,
            ("pos", 17): 1,
        }
        assert bins_of(frame, step, "Linear", "param", "bias") == {
            ("neg", -2): 1,
            ("pos", -1): 1,
        }
        # the input twice: 2^(step-20), 1, 0 (Inf at step 3), -8, 2^(-30-step), 3 (exponent 1)
        special = ("pos_inf", None) if step == 3 else ("zero", None)
        assert bins_of(frame, step, "Linear", "grad_param", "weight") == {
            special: 2,
            ("neg", 3): 2,
            ("pos", -30 - step): 2,
            ("pos", step - 20): 2,
            ("pos", 0): 2,
            ("pos", 1): 2,
        }
        assert bins_of(frame, step, "Linear", "grad_param", "bias") == {("pos", 0): 2}
    weight = frame[(frame["kind"] == "param") & (frame["slot"] == "weight")]
    assert set(weight["numel"]) == {12}
    np.testing.assert_array_equal(weight["fraction"], weight["count"] / 12)


def test_what_float16_would_do_worked_out_by_hand(known: Path) -> None:
    rows = per_step(hist(known)).set_index(["step", "kind", "slot"])
    weight = rows.loc[(0, "param", "weight")]
    assert (weight["zero"], weight["nan"], weight["inf"], weight["nonzero"]) == (2, 0, 0, 10)
    assert (weight["lowest"], weight["highest"]) == (-30, 20)
    # as fractions of the 10 nonzero finite values
    assert weight["neg"] == pytest.approx(4 / 10)
    assert weight["fp16_underflow"] == pytest.approx(2 / 10)  # 2^-30, -2^-26
    assert weight["fp16_subnormal"] == pytest.approx(2 / 10)  # 2^-20, -2^-16
    assert weight["fp16_overflow"] == pytest.approx(2 / 10)  # 2^17, -2^20
    grad = rows.loc[(3, "grad_param", "weight")]  # 2^-17, 1, Inf, -8, 2^-33, 3, twice
    assert (grad["zero"], grad["inf"], grad["nonzero"]) == (0, 2, 10)
    assert grad["fp16_underflow"] == pytest.approx(2 / 10)  # 2^-33
    assert grad["fp16_subnormal"] == pytest.approx(2 / 10)  # 2^-17
    assert grad["fp16_overflow"] == 0 and grad["neg"] == pytest.approx(2 / 10)


def test_a_trained_model_matches_numpy_on_its_own_tensors(mlp: tuple[Path, Values]) -> None:
    run, seen = mlp
    frame = hist(run)
    assert len(seen) == 6 * 8
    for (step, module, kind, slot), values in seen.items():
        assert bins_of(frame, step, module, kind, slot) == expected_bins(values), (
            step, module, kind, slot,
        )  # fmt: skip
    rows = per_step(frame)
    assert len(rows) == len(seen)
    for row in rows.to_dict("records"):
        x = seen[(row["step"], row["module"], row["kind"], row["slot"])].ravel().astype(float)
        x = x[np.isfinite(x) & (x != 0)]  # the fractions are of the nonzero finite values
        magnitude = np.abs(x)
        assert row["nonzero"] == len(x)
        assert row["fp16_underflow"] == pytest.approx(np.mean(magnitude < 2.0**-24))
        subnormal = (magnitude >= 2.0**-24) & (magnitude < 2.0**-14)
        assert row["fp16_subnormal"] == pytest.approx(np.mean(subnormal))
        assert row["fp16_overflow"] == pytest.approx(np.mean(magnitude >= 2.0**16))
        assert row["neg"] == pytest.approx(np.mean(x < 0))
        assert row["lowest"] == np.floor(np.log2(magnitude.min()))
        assert row["highest"] == np.floor(np.log2(magnitude.max()))
    assert rows["fp16_underflow"].max() > 0  # the small gradients reach below float16


def test_the_reader_route_gives_the_same_table(
    mlp: tuple[Path, Values], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where DuckDB cannot decode a part, hooktrace's reader answers instead: the same rows."""
    import duckdb

    options: list[dict[str, object]] = [
        {}, {"modules": "fc2", "kinds": ["grad_param"], "steps": "2-4"}, {"max_steps": 2},
    ]  # fmt: skip
    expected = [hist(mlp[0], **o) for o in options]  # type: ignore[arg-type]
    sql = hooktrace.Trace.sql

    def failing(self: hooktrace.Trace, query: str, parameters: object = None) -> pd.DataFrame:
        if "pos, neg" in query:
            raise TraceError("the engine failed") from duckdb.IOException("a bad page")
        return sql(self, query, parameters)  # type: ignore[arg-type]

    monkeypatch.setattr(hooktrace.Trace, "sql", failing)
    for o, frame in zip(options, expected, strict=True):
        pd.testing.assert_frame_equal(hist(mlp[0], **o), frame)  # type: ignore[arg-type]


def test_chunks_of_steps_and_a_sink_give_the_same_rows(
    mlp: tuple[Path, Values], monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = hist(mlp[0])
    monkeypatch.setattr(histograms, "CHUNK_RECORDS", 10)  # 8 histograms a step: one at a time
    chunks: list[pd.DataFrame] = []
    assert hist(mlp[0], sink=chunks.append).empty
    assert [sorted(set(c["step"])) for c in chunks] == [[s] for s in range(6)]
    pd.testing.assert_frame_equal(pd.concat(chunks, ignore_index=True), whole)
    pd.testing.assert_frame_equal(hist(mlp[0]), whole)


def test_a_parameter_recorded_twice_in_a_step_counts_once_and_calls_add_up(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)  # one module, two calls a step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run", histograms=("param", "output")):
        for _ in range(2):
            model.eval()
            with torch.no_grad():
                model(torch.randn(3, 4))  # the step's first forward: parameters, phase eval
            model.train()
            model(torch.randn(5, 4)).sum().backward()  # and again, phase train
            opt.step()
            opt.zero_grad()
    trace = hooktrace.load(tmp_path / "run")
    params = trace.histograms(kinds=["param"])
    assert len(params[params["slot"] == "weight"]) == 4  # two records a step
    rows = per_step(hist(trace)).set_index(["step", "module", "kind", "slot"])
    assert rows.loc[(0, "0", "param", "weight"), "numel"] == 16  # counted once
    # outputs of both calls, in both phases: (3 + 3 + 5 + 5) x 4 values
    assert rows.loc[(0, "0", "output", "0"), "numel"] == 64


# --- options -----------------------------------------------------------------------------------


def test_filters_choose_records_and_steps(mlp: tuple[Path, Values]) -> None:
    run, _ = mlp
    frame = hist(run, modules="fc2", kinds="grad_param", steps="1-3")
    assert set(frame["module"]) == {"fc2"} and set(frame["kind"]) == {"grad_param"}
    assert sorted(set(frame["step"])) == [1, 2, 3]
    exact = hist(run, modules=["fc1"], kinds=["param"], steps=[0, 5], ranks=[0])
    assert set(exact["module"]) == {"fc1"} and sorted(set(exact["step"])) == [0, 5]
    records = histogrammed(run, kinds="grad_param")
    assert records[["module", "slot"]].values.tolist() == [
        ["fc1", "weight"], ["fc1", "bias"], ["fc2", "weight"], ["fc2", "bias"],
    ]  # fmt: skip
    assert set(records["steps"]) == {6} and set(records["last_step"]) == {5}


def test_max_steps_keeps_the_first_and_the_last_evenly(mlp: tuple[Path, Values]) -> None:
    frame = hist(mlp[0], max_steps=3)
    assert sorted(set(frame["step"])) == [0, 2, 5]  # 0, 2.5 and 5, rounded half to even
    assert frame.attrs["steps"] == 6
    assert sample_steps(list(range(0, 1000, 10)), 5) == [0, 250, 500, 740, 990]
    assert sample_steps([4, 8], 1) == [8] and sample_steps([1, 2], 5) == [1, 2]


def test_histogram_every_and_kinds_as_recorded(tmp_path: Path) -> None:
    train_mlp(tmp_path / "run", steps=7, histograms=("grad_param",), histogram_every=3)
    frame = hist(tmp_path / "run")
    assert sorted(set(frame["step"])) == [0, 3, 6] and set(frame["kind"]) == {"grad_param"}
    with pytest.raises(ConfigError, match=r"every 3 steps \(histogram_every\)"):
        hist(tmp_path / "run", steps="1-2")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"modules": "nothing"}, "no histograms match modules 'nothing': the trace holds "
         "histograms of grad_param of 2 modules at 6 steps (0–5); param of 2 modules"),
        ({"kinds": "output"}, "no histograms match kinds output"),
        ({"kinds": "outputs"}, "unknown kind 'outputs': choose from input, output"),
        ({"modules": "("}, "bad modules regex"),
        ({"steps": "4-2"}, "a range goes upwards"),
        ({"max_steps": 0}, "max_steps must be 1 or more"),
    ],
)  # fmt: skip
def test_bad_options_say_what_the_trace_holds(
    mlp: tuple[Path, Values], options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        hist(mlp[0], **options)  # type: ignore[arg-type]
    assert message in str(caught.value)


def test_a_trace_without_histograms_says_how_to_record_them(tmp_path: Path) -> None:
    older = without_histograms(tmp_path / "older", older=True)
    with pytest.raises(TraceError, match=r"it was written before format 1.3, which added them"):
        hist(older)
    off = without_histograms(tmp_path / "off", older=False)
    with pytest.raises(TraceError, match=r"it was recorded with histograms off"):
        hist(off)
    for run in (older, off):
        result = invoke("hist", run)
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr.startswith(f"hooktrace: error: {run} holds no histograms")
        assert "--histograms param,grad_param" in result.stderr
        assert len(result.stderr.splitlines()) == 1


@pytest.mark.filterwarnings("ignore::hooktrace.errors.TraceWarning")
@pytest.mark.parametrize("fmt", ["table", "csv"])
def test_histograms_whose_pages_are_damaged_get_a_one_line_error(
    known: Path, tmp_path: Path, fmt: str
) -> None:
    """The footer of the only histograms part reads, its pages do not (found by the fuzzer:
    the text view then failed with an IndexError on no rows)."""
    run = tmp_path / "run"
    shutil.copytree(known, run)
    (part,) = (run / "histograms").rglob("*.parquet")
    _zero_pages(part)
    with pytest.raises(TraceError, match=r"no histogram of .* could be read: the parts holding"):
        hist(run)
    result = invoke("hist", run, "--format", fmt)
    assert result.exit_code == 2
    error = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "hooktrace check" in error[0]


@pytest.mark.filterwarnings("ignore::hooktrace.errors.TraceWarning")
def test_a_damaged_part_of_one_rank_is_left_out_per_rank(tmp_path: Path) -> None:
    """A run of two ranks, rank 1's first histograms part damaged in its pages: the logical
    histograms need every rank's, so they refuse in one line that names ``--per-rank``;
    per rank, the reader leaves the damaged part out and the rest is answered."""
    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_traces" / "distributed" / "fsdp2", run)
    _zero_pages(run / "histograms" / "rank=1" / "part-000000.parquet")
    with pytest.raises(TraceError, match=r"read the ranks' histograms apart \(--per-rank\)"):
        hist(run)
    result = invoke("hist", run)
    assert result.exit_code == 2 and result.stdout == ""
    assert "--per-rank" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    whole = hist(ROOT / "sample_traces" / "distributed" / "fsdp2", per_rank=True)
    with pytest.warns(hooktrace.TraceWarning, match="part-000000.parquet"):
        left = hist(run, per_rank=True)
    assert set(left["rank"]) == {0, 1}
    kept = whole[(whole["rank"] == 0) | (whole["step"].isin(left["step"][left["rank"] == 1]))]
    pd.testing.assert_frame_equal(left.reset_index(drop=True), kept.reset_index(drop=True))
    assert len(left) < len(whole)


def _zero_pages(part: Path) -> None:
    """Zero 12 bytes of a Parquet part's pages (its footer still reads)."""
    data = bytearray(part.read_bytes())
    at = int(len(data) * 0.09)
    data[at : at + 12] = bytes(12)
    part.write_bytes(bytes(data))


# --- the command -------------------------------------------------------------------------------

# golden file -> the command, run where the run is (the hand-set Linear: "run"; the samples:
# the repository root)
GOLDEN_COMMANDS = {
    "hist_known": "hist run",
    "hist_known_step3": "hist run --steps 3",
    "hist_underflow": "hist sample_traces/underflow --modules embed --kinds grad_param "
    "--max-steps 10",
    "hist_underflow_step29": "hist sample_traces/underflow --steps 29",
}


@pytest.mark.parametrize("golden", sorted(GOLDEN_COMMANDS))
def test_text_view_matches_golden(
    known: Path, golden: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HOOKTRACE_UPDATE_GOLDEN=1 rewrites the golden files (then read the diff)."""
    command = GOLDEN_COMMANDS[golden]
    monkeypatch.chdir(ROOT if "sample_traces/" in command else known.parent)
    result = invoke(*command.split())
    assert result.exit_code == 0 and result.stderr == "", result.output
    text = f"$ hooktrace {command}\n{result.stdout}"
    path = GOLDEN / f"{golden}.txt"
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"hooktrace {command} changed: see {path}"


def test_text_view_is_what_the_numbers_say(known: Path) -> None:
    lines = invoke("hist", known, "--kinds", "param", "--modules", "Lin").stdout.splitlines()
    at = lines.index("Linear param weight: 12 values")
    header, ruler, step0 = lines[at + 1 : at + 4]
    assert header.split()[:3] == ["step", "2^-30", "2^21"]  # 2^-30 .. 2^20 and its top edge
    cells = ruler.split()[1]
    assert cells == "x" * 6 + "s" * 10 + "." * 30 + "!" * 5  # -30..-25, -24..-15, -14..15, 16..20
    bars = step0[len("  step  ") : len("  step  ") + len(cells)]
    occupied = [i - 30 for i, c in enumerate(bars) if c != " "]
    assert occupied == [-30, -26, -20, -16, -10, 0, 1, 10, 17, 20]
    assert step0.split()[-7:] == ["2", "0", "0", "40.0%", "20.0%", "20.0%", "20.0%"]  # of 10


def test_bars_are_scaled_to_the_rows_largest_and_blank_only_where_empty() -> None:
    from hooktrace.cli.hist import _bars, _columns

    def counts(by_exponent: dict[int, int]) -> np.ndarray:  # by bin: exponent e is e + 150
        row = np.zeros(279, dtype=np.int64)
        for e, n in by_exponent.items():
            row[e + 150] = n
        return row

    assert _bars(counts({0: 800, 1: 1, 2: 400, 4: 100}), 0, 1, 6) == "█▁▄ ▁ "
    assert _bars(counts({-30: 5, -21: 5}), -30, 2, 5) == "█   █"  # -30/-29, ..., -22/-21
    assert _bars(counts({-150: 1, 128: 2}), -154, 5, 57) == "▄" + " " * 55 + "█"  # both ends
    assert _columns(-30, 20) == (-30, 1, 51)
    assert _columns(-150, 128) == (-154, 5, 57)  # float16's limits between columns: -24 + 5k
    assert _columns(-40, 40) == (-40, 2, 41)


def test_many_steps_are_sampled_and_the_view_says_so(mlp: tuple[Path, Values]) -> None:
    result = invoke("hist", mlp[0], "--modules", "fc2", "--kinds", "grad_param", "--max-steps", "2")
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first.endswith("2 records histogrammed, 6 steps (0–5), 2 shown, evenly spaced "
                          "from the first to the last (--max-steps)")  # fmt: skip
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("     ")]
    assert rows == ["0", "5", "0", "5"]


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_formats_hold_the_table(known: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / f"hist.{fmt}"
    result = invoke("hist", known, "--format", fmt, "-o", out)
    assert result.exit_code == 0 and result.output == "", result.output
    expected = hist(known)
    if fmt == "csv":
        back = pd.read_csv(out, dtype={"module": str, "slot": str})
    elif fmt == "json":
        back = pd.DataFrame(json.loads(out.read_text()))
    else:
        back = pd.read_parquet(out)
    assert list(back.columns) == list(COLUMNS) and len(back) == len(expected)
    pd.testing.assert_series_equal(
        back["exponent"].astype("Int64"), expected["exponent"], check_names=False
    )
    for name in ("step", "count", "numel"):
        assert back[name].tolist() == expected[name].tolist()
    assert back["bin"].tolist() == expected["bin"].tolist()
    np.testing.assert_allclose(back["fraction"], expected["fraction"])
    to_stdout = invoke("hist", known, "--format", "csv")
    assert to_stdout.stdout.splitlines()[0] == ",".join(COLUMNS)


def test_csv_holds_every_step_unless_told(mlp: tuple[Path, Values]) -> None:
    every = pd.read_csv(pd.io.common.StringIO(invoke("hist", mlp[0], "--format", "csv").stdout))
    assert every["step"].nunique() == 6
    two = invoke("hist", mlp[0], "--format", "csv", "--max-steps", "2").stdout
    assert pd.read_csv(pd.io.common.StringIO(two))["step"].nunique() == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kinds", "bogus"], "unknown kind 'bogus'"),
        (["--modules", "("], "bad modules regex"),
        (["--modules", "nope"], "no histograms match modules 'nope': the trace holds"),
        (["--ranks", "a"], "bad --ranks 'a': give int values, comma-separated"),
        (["--steps", "x"], "bad steps 'x'"),
        (["--format", "parquet"], "give --output FILE.parquet"),
        (["--max-steps", "0"], "0 is not in the range x>=1"),
    ],
)
def test_command_errors_are_one_line(known: Path, args: list[str], message: str) -> None:
    result = invoke("hist", known, *args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("hooktrace: error: ") or "Error" in result.output
    assert message in result.output
    missing = invoke("hist", known.parent / "missing")
    assert missing.exit_code == 2 and "no run at" in missing.output


def test_without_torch(known: Path, tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None
        import hooktrace
        print(len(hooktrace.hist({str(known)!r})))
        from hooktrace.cli import main
        try:
            main(["hist", {str(known)!r}, "--format", "csv", "-o", {str(tmp_path / "h.csv")!r}])
        except SystemExit as exc:
            print("exit", exc.code)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.split() == [str(len(hist(known))), "exit", "0"], done.stderr


def test_ranks_are_told_apart(known: Path, tmp_path: Path) -> None:
    """Two ranks (the known run's shard, copied as rank 1's): rank by rank (--per-rank), blocks
    and labels name them; as logical tensors, the copies are replicas, counted once."""
    import shutil

    run = tmp_path / "ranks"
    shutil.copytree(known, run)
    for table in ("records", "steps", "modules", "histograms"):
        shutil.copytree(run / table / "rank=0", run / table / "rank=1")
    shutil.copy(run / "status" / "rank=0.json", run / "status" / "rank=1.json")
    frame = hist(run, kinds="param", per_rank=True)
    assert sorted(set(frame["rank"])) == [0, 1]
    assert set(hist(run, ranks=[1])["rank"]) == {1}
    text = invoke("hist", run, "--kinds", "param", "--steps", "0-1", "--per-rank").stdout
    assert "rank 0: Linear param weight: 12 values" in text
    assert "rank 1: Linear param bias: 2 values" in text
    one_step = invoke("hist", run, "--kinds", "param", "--steps", "2", "--per-rank").stdout
    assert one_step.count("  rank 1 Linear param ") == 2
    logical = hist(run, kinds="param")
    pd.testing.assert_frame_equal(logical, frame[frame["rank"] == 0], check_like=True)
    assert "logical tensors" in invoke("hist", run, "--kinds", "param").stdout


def test_help_needs_neither_pandas_nor_torch() -> None:
    code = (
        "import sys\nfrom hooktrace.cli import cli\n"
        "try:\n    cli.main(['hist', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('pandas', 'numpy', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "Example:" in done.stdout and done.stdout.strip().endswith("[]"), done.stderr


def test_float16s_shares_agree_with_precision_at_every_step() -> None:
    """hooktrace.precision counts the same from the stored spans, in SQL: step by step, the
    two agree on every record of the underflow sample."""
    run = SAMPLES / "underflow"
    rows = per_step(hist(run, steps="27-29"))
    columns = ["fp16_underflow", "fp16_subnormal", "fp16_overflow"]
    for step in (27, 28, 29):
        theirs = hooktrace.precision(run, steps=str(step)).set_index(["module", "kind", "slot"])
        ours = rows[rows["step"] == step].set_index(["module", "kind", "slot"])
        assert sorted(ours.index) == sorted(theirs.index)
        for column in columns:
            np.testing.assert_allclose(ours[column], theirs.loc[ours.index, column], rtol=1e-12)
        assert (ours["nonzero"] == theirs.loc[ours.index, "nonzero"]).all()
