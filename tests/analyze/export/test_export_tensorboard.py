"""hooktrace export tensorboard: the events read back with TensorBoard's own reader hold the
trace's values (scalars to float32, histogram buckets count for count against the trace's
Parquet and, independently, numpy's binning of the full tensors), in the runs and tags the
docs promise; one-line errors, and neither torch nor (where it is missing) tensorboard needed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner, Result
from repo import ROOT
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from torch import nn

import hooktrace
from hooktrace.analyze.export.events import display_counts, histogram_proto
from hooktrace.analyze.export.tensorboard import MARKER, STATS, export_tensorboard
from hooktrace.cli import cli, main
from hooktrace.errors import ConfigError
from hooktrace.trace import histograms as bins

SAMPLES = ROOT / "sample_traces"
KEY = ["rank", "phase", "step", "module", "kind", "slot", "call"]


def events(directory: Path) -> EventAccumulator:
    """Every event of the run in ``directory``, read by TensorBoard's own reader."""
    accumulator = EventAccumulator(
        str(directory), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0}
    )
    accumulator.Reload()
    return accumulator


def scalars(directory: Path) -> pd.DataFrame:
    """tag, step, value, wall_time of every scalar in the run."""
    run = events(directory)
    rows = [
        (tag, e.step, e.value, e.wall_time)
        for tag in run.Tags()["scalars"]
        for e in run.Scalars(tag)
    ]
    return pd.DataFrame(rows, columns=["tag", "step", "value", "wall_time"])


def shown(records: pd.DataFrame, *, calls: str = "first") -> pd.DataFrame:
    """The records an export shows, computed here the plain way: those with statistics; per
    series and step, the last micro-step's, of the first call unless every call is shown."""
    rows = records[(records["numel"] > 0) & ~records["note"].astype(str).str.startswith("skipped")]
    if calls == "first":
        rows = rows[rows["call"] == 0]
    rows = rows.astype({c: str for c in ("phase", "module", "kind", "slot")})
    last = rows.groupby(KEY)["micro_step"].transform("max")
    rows = rows[rows["micro_step"] == last].copy()
    module = rows["module"].where(
        rows["call"] == 0, rows["module"] + " [call " + rows["call"].astype(str) + "]"
    )
    rows["prefix"] = module + "/" + rows["kind"] + "/" + rows["slot"]
    return rows.reset_index(drop=True)


def expected_scalars(rows: pd.DataFrame, stats: tuple[str, ...] = STATS) -> pd.DataFrame:
    long = rows.melt(id_vars=["step", "prefix"], value_vars=list(stats), var_name="stat")
    long["tag"] = long["prefix"] + "/" + long["stat"]
    return long[["tag", "step", "value"]]


def same_values(written: pd.DataFrame, expected: pd.DataFrame) -> None:
    """Every expected scalar written once, equal to the trace's value as a float32 (NaN too)."""
    merged = expected.merge(
        written, on=["tag", "step"], how="outer", suffixes=("", "_tb"), indicator=True
    )
    assert (merged["_merge"] == "both").all(), merged[merged["_merge"] != "both"].head()
    want = merged["value"].to_numpy(dtype=np.float64).astype(np.float32)
    got = merged["value_tb"].to_numpy(dtype=np.float32)
    assert np.array_equal(want, got, equal_nan=True)


# --- scalars and text of the committed sample traces ---------------------------------------------


@pytest.mark.parametrize("sample", ["healthy", "nan"])
def test_every_statistic_of_every_record_is_a_scalar_at_its_step(
    tmp_path: Path, sample: str
) -> None:
    trace = hooktrace.load(SAMPLES / sample)
    result = export_tensorboard(trace, tmp_path / "tb")
    assert result.runs == ["rank=0"] and (result.steps, result.first_step, result.last_step) == (
        30,
        0,
        29,
    )
    assert result.has_histograms and result.notes == []
    stored = trace.histograms()
    nonfinite = (stored["nan"] + stored["pos_inf"] + stored["neg_inf"] == stored["numel"]).sum()
    assert (result.histograms, result.nonfinite_histograms) == (len(stored) - nonfinite, nonfinite)
    assert nonfinite == (340 if sample == "nan" else 0)

    written = scalars(tmp_path / "tb" / "rank=0")
    rows = shown(trace.records)
    assert len(rows) == len(trace.records)  # one call, one micro-step, one phase
    same_values(written, expected_scalars(rows))
    assert result.scalars == len(written) == 8 * len(trace.records)
    assert result.series == rows["prefix"].nunique()
    if sample == "nan":  # the NaN and Inf show as they are, and are counted
        at = written.set_index(["tag", "step"])["value"]
        assert (
            at["log_probs/output/0/inf_count", 15] == 3
            and at["log_probs/output/0/inf_count", 14] == 0
        )
        assert math.isinf(at["log_probs/output/0/min", 15])
    # each step's wall time is when it ended
    ends = trace.steps.set_index("step")["end_time"]
    assert np.allclose(written["wall_time"], ends[written["step"]].to_numpy())


def test_the_run_is_described_in_text(tmp_path: Path) -> None:
    export_tensorboard(SAMPLES / "nan", tmp_path / "tb", kinds=["grad_param"], stats=["norm"])
    run = events(tmp_path / "tb" / "rank=0")
    texts = {
        tag: tensor_util.make_ndarray(run.Tensors(tag)[0].tensor_proto).item().decode()
        for tag in run.Tags()["tensors"]
    }
    assert sorted(texts) == [
        "hooktrace/command",
        "hooktrace/config",
        "hooktrace/export",
        "hooktrace/run",
    ]
    assert run.SummaryMetadata("hooktrace/run").plugin_data.plugin_name == "text"
    manifest = hooktrace.load(SAMPLES / "nan").manifest
    assert texts["hooktrace/command"] == f"```\n{shlex.join(manifest['command'])}\n```"
    assert "| status | complete (rank 0: complete) |" in texts["hooktrace/run"]
    assert (
        f"| recorded with | hooktrace {manifest['hooktrace_version']}, torch "
        f"{manifest['torch_version']}, python {manifest['python_version']} |"
        in texts["hooktrace/run"]
    )
    assert "| full_steps | `null` |" in texts["hooktrace/config"]
    assert "| statistics | norm |" in texts["hooktrace/export"]
    assert [e.step for e in run.Tensors("hooktrace/run")] == [0]
    # a header TensorBoard shows as the table's head, not an empty row above it
    assert texts["hooktrace/config"].startswith("| recording option | value |\n|---|---|\n")
    assert "| |" not in "".join(texts.values())


def test_a_regex_option_is_shown_as_it_was_given(tmp_path: Path) -> None:
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with hooktrace.record(model, tmp_path / "run", modules=r"^1\.?"):
        model(torch.ones(1, 2)).sum().backward()
    export_tensorboard(tmp_path / "run", tmp_path / "tb")
    run = events(tmp_path / "tb" / "rank=0")
    config = tensor_util.make_ndarray(run.Tensors("hooktrace/config")[0].tensor_proto).item()
    assert "| modules | `^1\\.?` |" in config.decode()


def test_filters_choose_steps_modules_kinds_and_statistics(tmp_path: Path) -> None:
    trace = hooktrace.load(SAMPLES / "exploding")
    result = export_tensorboard(
        trace, tmp_path / "tb", steps="18-22", modules=r"^blocks\.0\.", kinds=["grad_param", "output"],
        stats=["norm", "max"],
    )  # fmt: skip
    assert (result.steps, result.first_step, result.last_step) == (5, 18, 22)
    records = trace.query(steps=(18, 22), kinds=["grad_param", "output"])
    records = records[records["module"].astype(str).str.startswith("blocks.0.")]
    same_values(
        scalars(tmp_path / "tb" / "rank=0"), expected_scalars(shown(records), ("norm", "max"))
    )


def test_chunks_of_one_step_write_the_same_values(tmp_path: Path) -> None:
    # a trace too large for trace.records exports all the same: it is never loaded whole
    small = hooktrace.load(SAMPLES / "exploding", max_records=10)
    export_tensorboard(small, tmp_path / "one", chunk_rows=1)
    export_tensorboard(SAMPLES / "exploding", tmp_path / "all")
    one, whole = scalars(tmp_path / "one" / "rank=0"), scalars(tmp_path / "all" / "rank=0")
    key = ["tag", "step"]
    one, whole = (
        one.sort_values(key).reset_index(drop=True),
        whole.sort_values(key).reset_index(drop=True),
    )
    pd.testing.assert_frame_equal(one, whole)
    histograms = [events(tmp_path / name / "rank=0") for name in ("one", "all")]
    tags = histograms[0].Tags()["histograms"]
    assert len(tags) == 24 and tags == histograms[1].Tags()["histograms"]
    for tag in tags:
        a, b = (run.Histograms(tag) for run in histograms)
        assert [(e.step, e.histogram_value) for e in a] == [(e.step, e.histogram_value) for e in b]


@pytest.mark.parametrize("sample", ["nan", "underflow"])
def test_histograms_of_the_samples_count_as_the_trace_does(tmp_path: Path, sample: str) -> None:
    trace = hooktrace.load(SAMPLES / sample)
    export_tensorboard(trace, tmp_path / "tb", stats=["norm"])
    run = events(tmp_path / "tb" / "rank=0")
    written = {
        (tag.removesuffix("/histogram"), e.step): e.histogram_value
        for tag in run.Tags()["histograms"]
        for e in run.Histograms(tag)
    }
    stored = trace.histograms()
    placed = stored["numel"] - stored["nan"] - stored["pos_inf"] - stored["neg_inf"]
    assert len(written) == (placed > 0).sum() > 0
    for row in stored[placed > 0].itertuples():
        h = written[f"{row.module}/{row.kind}/{row.slot}", row.step]
        assert h.num == row.numel - row.nan - row.pos_inf - row.neg_inf
        assert buckets(h) == expected_buckets(row.zero, row.pos, row.neg)


@pytest.fixture
def no_histograms(tmp_path: Path) -> Path:
    """The healthy sample as recorded with histograms off."""
    run = tmp_path / "no-histograms"
    shutil.copytree(SAMPLES / "healthy", run)
    shutil.rmtree(run / "histograms")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["histograms"] = []
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


@pytest.mark.parametrize(
    ("which", "why"),
    [
        ("recorded off", "it was recorded with histograms off"),
        ("format 1.0", "it was written before format 1.3, which added them"),
    ],
)
def test_a_trace_without_histograms_says_so_in_one_line(
    no_histograms: Path, tmp_path: Path, which: str, why: str
) -> None:
    run = no_histograms if which == "recorded off" else ROOT / "tests" / "fixtures" / "healthy_1_0"
    done = invoke("export", "tensorboard", run, tmp_path / "tb")
    assert done.exit_code == 0, done.output
    assert done.stderr.splitlines() == [
        f"hooktrace: {run} holds no histograms ({why}; record with `hooktrace record "
        "--histograms param,grad_param`): exported its scalars and text",
        f"hooktrace: wrote 400 scalar charts (12,000 values), 0 histograms and the run's text, steps "
        f"0–29, into {tmp_path / 'tb'} (runs rank=0); view: tensorboard --logdir {tmp_path / 'tb'}",
    ]
    assert events(tmp_path / "tb" / "rank=0").Tags()["histograms"] == []
    assert invoke("export", "tensorboard", run, tmp_path / "q", "-q").output == ""


def test_a_run_per_rank(tmp_path: Path) -> None:
    """per_rank=True (or ranks): a run per rank, each holding its records."""
    from scale_runs import generate_trace

    run = tmp_path / "ddp"
    for rank in (0, 1):
        generate_trace(run, steps=4, modules=4, rank=rank, world_size=2)
    trace = hooktrace.load(run)
    stats = ["norm", "nan_count"]
    result = export_tensorboard(trace, tmp_path / "tb", per_rank=True, stats=stats)
    assert result.runs == ["rank=0", "rank=1"]
    records = trace.records
    for rank in (0, 1):
        rows = shown(records[records["rank"] == rank])
        written = scalars(tmp_path / "tb" / f"rank={rank}")
        same_values(written, expected_scalars(rows, ("norm", "nan_count")))
        assert len(events(tmp_path / "tb" / f"rank={rank}").Tags()["tensors"]) == 4
    one = export_tensorboard(trace, tmp_path / "one", ranks=[1])
    assert one.runs == ["rank=1"] and not (tmp_path / "one" / "rank=0").exists()


# --- a recorded run: calls, micro-steps, eval, histograms -----------------------------------------


class Shared(nn.Module):
    """A Linear called twice a forward, and a ReLU whose outputs are half zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1(x))
        return self.head(self.shared(torch.tanh(self.shared(x))))  # type: ignore[no-any-return]


STEPS = 6


HISTOGRAMS = ("output", "grad_output", "param", "grad_param")


def record_shared(out: Path, **options: Any) -> None:
    """Two micro-steps a step, an evaluation after each optimizer step (the last one fed a
    NaN and an Inf), every tensor saved in full."""
    torch.manual_seed(0)
    model = Shared()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with hooktrace.record(model, out, full_every=1, **options):
        for step in range(STEPS):
            for _ in range(2):
                x = torch.randn(4, 8, generator=generator)
                F.cross_entropy(model(x), torch.randint(0, 3, (4,), generator=generator)).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                x = torch.randn(4, 8, generator=generator)
                if step == STEPS - 1:
                    x[0, 0], x[1, 1] = float("nan"), float("inf")
                model(x)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("shared") / "run"
    record_shared(run, histograms=HISTOGRAMS, histogram_every=1)
    return run


@pytest.mark.parametrize("calls", ["first", "all"])
def test_calls_micro_steps_and_eval(shared_run: Path, tmp_path: Path, calls: str) -> None:
    records = hooktrace.load(shared_run).records
    assert set(records["micro_step"]) == {0, 1} and set(records["call"]) == {0, 1}
    result = export_tensorboard(shared_run, tmp_path / "tb", calls=calls, histograms=False)
    assert result.runs == ["rank=0", "rank=0/eval"]
    rows = shown(records, calls=calls)
    for phase, directory in (("train", "rank=0"), ("eval", "rank=0/eval")):
        written = scalars(tmp_path / "tb" / directory)
        same_values(written, expected_scalars(rows[rows["phase"] == phase]))
        later_calls = written["tag"].str.startswith("shared [call 1]/")
        assert later_calls.any() == (calls == "all")
    # the last micro-step's: the gradient at the model's output of micro-step 1, not 0
    train = scalars(tmp_path / "tb" / "rank=0").set_index(["tag", "step"])["value"]
    grads = records[
        (records["kind"] == "grad_output")
        & (records["module"] == "Shared")
        & (records["step"] == 2)
    ]
    assert train["Shared/grad_output/0/norm", 2] == np.float32(
        grads[grads["micro_step"] == 1]["norm"].item()
    )
    assert train["Shared/grad_output/0/norm", 2] != np.float32(
        grads[grads["micro_step"] == 0]["norm"].item()
    )


def test_histograms_hold_the_counts_of_the_trace(shared_run: Path, tmp_path: Path) -> None:
    trace = hooktrace.load(shared_run)
    result = export_tensorboard(trace, tmp_path / "tb", calls="all")
    assert result.has_histograms and not result.notes
    stored = trace.histograms()
    assert set(stored["kind"].astype(str)) == set(HISTOGRAMS)
    rows = shown(trace.records, calls="all").merge(
        stored[["step", "seq", "zero", "nan", "pos_inf", "neg_inf", "pos", "neg"]],
        on=["step", "seq"],
    )
    assert result.histograms == len(rows) > 100 and result.nonfinite_histograms == 0
    checked = nonfinite = 0
    for phase, directory in (("train", "rank=0"), ("eval", "rank=0/eval")):
        run = events(tmp_path / "tb" / directory)
        for row in rows[rows["phase"] == phase].itertuples():
            found = [e for e in run.Histograms(f"{row.prefix}/histogram") if e.step == row.step]
            assert len(found) == 1, (row.prefix, row.step)
            h = found[0].histogram_value
            tensor = trace.tensor(row.module, row.kind, step=row.step, slot=row.slot, call=row.call,
                                  micro_step=row.micro_step, phase=row.phase).astype(np.float64)  # fmt: skip
            finite = tensor[np.isfinite(tensor)]
            assert h.num == finite.size == row.numel - row.nan - row.pos_inf - row.neg_inf
            if np.isfinite(row.min):
                assert h.min == finite.min()
            if np.isfinite(row.max):
                assert h.max == finite.max()
            if row.nan + row.pos_inf + row.neg_inf:
                nonfinite += 1
                assert math.isnan(h.sum) and math.isnan(h.sum_squares)
            else:
                assert math.isclose(h.sum, finite.sum(), rel_tol=1e-5, abs_tol=1e-6)
                assert math.isclose(h.sum_squares, (finite**2).sum(), rel_tol=1e-5)
            assert buckets(h) == expected_buckets(row.zero, row.pos, row.neg)
            assert_values_fall_in_their_buckets(h, finite)
            checked += 1
    assert checked == len(rows) and nonfinite > 0


def buckets(h: Any) -> dict[tuple[float, float], float]:
    """The non-empty buckets of a HistogramProto, by (lower, upper) edge; the first bucket's
    lower edge is the histogram's min, as TensorBoard draws it."""
    lower = [h.min, *h.bucket_limit[:-1]]
    assert all(a < b for a, b in itertools.pairwise(h.bucket_limit)), "edges increase"
    assert h.bucket[0] > 0 and h.bucket[-1] > 0, "no empty bucket at either end"
    assert not any(a == 0 and b == 0 for a, b in itertools.pairwise(h.bucket)), (
        "empty runs collapsed"
    )
    found = {(lo, hi): n for lo, hi, n in zip(lower, h.bucket_limit, h.bucket, strict=True) if n}
    first = min(found)
    return {
        ((-math.inf, hi) if (lo, hi) == first else (lo, hi)): n for (lo, hi), n in found.items()
    }


def expected_buckets(
    zero: int, pos: np.ndarray, neg: np.ndarray
) -> dict[tuple[float, float], float]:
    """The buckets docs and FORMAT.md promise, from the stored counts: negative bin k (k >= 1)
    is [-2^(k-149), -2^(k-150)], positive bin k [2^(k-150), 2^(k-149)], and the zeros with
    both bins 0 are [-2^-149, 2^-149]."""
    out: dict[tuple[float, float], float] = {}
    for k in range(1, len(pos)):
        if neg[k]:
            out[(-(2.0 ** (k - 149)), -(2.0 ** (k - 150)))] = float(neg[k])
        if pos[k]:
            upper = 2.0 ** (k - 149) if k < len(pos) - 1 else sys.float_info.max
            out[(2.0 ** (k - 150), upper)] = float(pos[k])
    if zero + pos[0] + neg[0]:
        out[(-(2.0**-149), 2.0**-149)] = float(zero + pos[0] + neg[0])
    first = min(out)
    return {((-math.inf, hi) if (lo, hi) == first else (lo, hi)): n for (lo, hi), n in out.items()}


def assert_values_fall_in_their_buckets(h: Any, values: np.ndarray) -> None:
    """numpy, not the trace, puts each value in its bucket: [lower, upper) for positive
    values, (lower, upper] for negative ones, 0 in the bucket around 0."""
    limits = np.asarray(h.bucket_limit)
    at = np.where(
        values > 0,
        np.searchsorted(limits, values, side="right"),
        np.searchsorted(limits, values, side="left"),
    )
    counts = np.bincount(at, minlength=len(limits))[: len(limits)]
    assert counts.tolist() == list(h.bucket)


def test_histogram_of_values_with_zeros_nan_inf_and_float64_extremes() -> None:
    values = np.array([0.0, 0.0, -0.0, np.nan, np.inf, -np.inf, 1e-310, -1e-320, 1.5, -3.0, 1e300])
    flat = bins.reference(values)
    counts = display_counts(flat[bins.ZERO], flat[bins.POS : bins.NEG], flat[bins.NEG :])
    h = histogram_proto(counts, low=np.nan, high=np.inf, total=np.nan, squares=np.nan)
    assert h.num == 8  # NaN and the infinities have no place
    assert buckets(h) == {
        (-math.inf, -2.0): 1.0,                      # -3 in [-4, -2]
        (-(2.0**-149), 2.0**-149): 5.0,              # the zeros, and float64's below 2^-149
        (1.0, 2.0): 1.0,
        (2.0**128, sys.float_info.max): 1.0,         # 1e300: float64's beyond 2^128
    }  # fmt: skip
    # edges stand in for a min or max that is NaN or infinite
    assert (h.min, h.max) == (-4.0, sys.float_info.max)
    assert (
        histogram_proto(
            display_counts(0, np.zeros(279), np.zeros(279)), low=0, high=0, total=0, squares=0
        )
        is None
    )


# --- the log directory --------------------------------------------------------------------------


def invoke(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_logdir_is_new_empty_or_an_earlier_export_replaced_whole(tmp_path: Path) -> None:
    logdir = tmp_path / "tb" / "healthy"
    first = invoke("export", "tensorboard", SAMPLES / "healthy", logdir)
    assert first.exit_code == 0, first.output
    assert first.output.splitlines()[-1].startswith(
        "hooktrace: wrote 400 scalar charts (12,000 values), 720 histograms and the run's text"
    )
    marker = json.loads((logdir / MARKER).read_text())
    assert marker["run"] == str((SAMPLES / "healthy").resolve()) and marker["scalars"] == 12_000

    again = invoke("export", "tensorboard", SAMPLES / "nan", logdir)
    assert again.exit_code == 2
    assert again.output == (
        f"hooktrace: error: {logdir} holds an earlier export (of {SAMPLES / 'healthy'}): give "
        "--overwrite to replace it, or a new directory\n"
    )
    replaced = invoke(
        "export",
        "tensorboard",
        SAMPLES / "nan",
        logdir,
        "--overwrite",
        "--kinds",
        "grad_param",
        "-q",
    )
    assert replaced.exit_code == 0 and replaced.output == ""
    assert [p.name for p in (logdir / "rank=0").iterdir()].__len__() == 1  # one event file: no mix
    assert set(scalars(logdir / "rank=0")["tag"].str.split("/").str[1]) == {"grad_param"}
    assert sorted(p.name for p in tmp_path.joinpath("tb").iterdir()) == [
        "healthy"
    ]  # nothing left beside

    empty = tmp_path / "empty"
    empty.mkdir()
    assert invoke("export", "tensorboard", SAMPLES / "healthy", empty, "-q").exit_code == 0
    assert (empty / "rank=0").is_dir()

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    refused = invoke("export", "tensorboard", SAMPLES / "healthy", theirs, "--overwrite")
    assert refused.exit_code == 2 and "holds no hooktrace export" in refused.output
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


def test_a_failed_export_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown statistic 'median'"):
        export_tensorboard(SAMPLES / "healthy", tmp_path / "tb", stats=["median"])
    nothing = invoke(
        "export", "tensorboard", SAMPLES / "healthy", tmp_path / "tb", "--modules", "^nope$"
    )
    assert nothing.exit_code == 2
    assert nothing.output == (
        f"hooktrace: error: no record of {SAMPLES / 'healthy'} matches the filters (steps, "
        "modules, kinds, ranks): loosen them\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stats", "mean,median"], "unknown statistic 'median': choose from mean, std"),
        (["--kinds", "outputs"], "unknown kind 'outputs': choose from input, output"),
        (["--ranks", "one"], "bad --ranks 'one': give int values, comma-separated"),
        (["--ranks", "3"], "has no rank 3: its ranks are 0"),
        (["--steps", "5-2"], "bad step range 5-2"),
        (["--modules", "("], "bad module pattern '('"),
        (["--calls", "some"], "Invalid value for '--calls'"),
    ],
)
def test_bad_options_get_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["export", "tensorboard", str(SAMPLES / "healthy"), str(tmp_path / "tb"), *args])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("hooktrace: error: ") and message in err, err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "tb").exists()


def test_missing_run_and_logdirs_that_cannot_be(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    for logdir, message in (
        (tmp_path / "tb", f"no run at {tmp_path / 'nope'}: give the directory a recording wrote"),
        (
            tmp_path / "file",
            f"Invalid value for 'LOGDIR': Directory '{tmp_path / 'file'}' is a file.",
        ),
        (SAMPLES, f"{SAMPLES} holds the run {SAMPLES / 'healthy'}: give a directory of its own"),
        (Path("."), ". is the current directory or holds it, which the export would replace"),
        (tmp_path / "link", f"{tmp_path / 'link'} is a symbolic link: give the directory"),
    ):
        run = tmp_path / "nope" if logdir == tmp_path / "tb" else SAMPLES / "healthy"
        with pytest.raises(SystemExit) as exited:
            main(["export", "tensorboard", str(run), str(logdir)])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


# --- what it does not need --------------------------------------------------------------------

_RUN = textwrap.dedent(
    """
    import sys
    for blocked in sys.argv[1].split(","):
        sys.modules[blocked] = None  # importing it now fails
    from hooktrace.cli import main
    try:
        main(sys.argv[2:])
    except SystemExit as exc:
        print(f"exit {exc.code}", flush=True)
    assert sys.modules.get("torch") is None and "tensorflow" not in sys.modules
    """
)


def run_blocked(blocked: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RUN, blocked, *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_exports_without_torch(tmp_path: Path) -> None:
    done = run_blocked("torch", "export", "tensorboard", SAMPLES / "dead", tmp_path / "tb")
    assert done.stdout == "exit 0\n", done.stderr
    assert done.stderr.startswith(
        "hooktrace: wrote 400 scalar charts (12,000 values), 720 histograms"
    )
    assert len(scalars(tmp_path / "tb" / "rank=0")) == 12_000


def test_without_tensorboard_says_how_to_install_it(tmp_path: Path) -> None:
    done = run_blocked(
        "torch,tensorboard", "export", "tensorboard", SAMPLES / "dead", tmp_path / "tb"
    )
    assert done.stdout == "exit 2\n"
    assert done.stderr == (
        "hooktrace: error: exporting to TensorBoard needs the tensorboard package, which is not "
        "installed: pip install 'hooktrace[tensorboard]'\n"
    )
    assert not (tmp_path / "tb").exists()
    helped = run_blocked("torch,tensorboard,pandas", "export", "tensorboard", "--help")
    assert (
        helped.stdout.endswith("exit 0\n")
        and "hooktrace export tensorboard runs/a tb/a" in helped.stdout
    )


def test_without_google_crc32c_tensorboards_own_checksum_writes_the_same_events(
    tmp_path: Path,
) -> None:
    done = run_blocked(
        "torch,google_crc32c", "export", "tensorboard", SAMPLES / "nan", tmp_path / "slow", "-q"
    )
    assert done.stdout == "exit 0\n", done.stderr
    export_tensorboard(SAMPLES / "nan", tmp_path / "fast")
    slow, fast = scalars(tmp_path / "slow" / "rank=0"), scalars(tmp_path / "fast" / "rank=0")
    pd.testing.assert_frame_equal(slow, fast)  # read back: TensorBoard checks every CRC


SAMPLES_DISTRIBUTED = ROOT / "sample_traces" / "distributed"


@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_a_run_of_several_ranks_is_one_run_of_logical_tensors(tmp_path: Path, layout: str) -> None:
    """The same training in one process and on 2 ranks (examples/distributed.py's samples):
    exported, the 2-rank run is one TensorBoard run, ``logical``, of the one process's tags,
    scalars (to float32 rounding, up to the step the DDP run's rank 1 went its own way) and
    histograms (bin for bin at step 0, the same parameters everywhere)."""
    steps = "0-2" if layout == "ddp" else None  # rank 1's replica nudged at step 3
    one = export_tensorboard(SAMPLES_DISTRIBUTED / "one", tmp_path / "one", steps=steps)
    got = export_tensorboard(SAMPLES_DISTRIBUTED / layout, tmp_path / "tb", steps=steps)
    assert got.runs == ["logical"] and one.runs == ["rank=0"]
    assert (got.scalars, got.histograms, got.steps) == (one.scalars, one.histograms, one.steps)
    written = scalars(tmp_path / "tb" / "logical").sort_values(["tag", "step"])
    expected = scalars(tmp_path / "one" / "rank=0").sort_values(["tag", "step"])
    assert written["tag"].tolist() == expected["tag"].tolist()
    counts = written["tag"].str.endswith(("nan_count", "inf_count"))
    np.testing.assert_array_equal(written["value"][counts], expected["value"][counts])
    np.testing.assert_allclose(written["value"], expected["value"], rtol=2e-5, atol=1e-7)
    runs = [events(tmp_path / name) for name in ("tb/logical", "one/rank=0")]
    for tag in runs[1].Tags()["histograms"]:
        if "/param/" in tag:
            a, b = (run.Histograms(tag)[0].histogram_value for run in runs)
            exact = ("min", "max", "num", "bucket_limit", "bucket")
            assert [getattr(a, f) for f in exact] == [getattr(b, f) for f in exact], tag
            assert (a.sum, a.sum_squares) == pytest.approx((b.sum, b.sum_squares), rel=1e-12)
    texts = {t: tensor_util.make_ndarray(runs[0].Tensors(t)[0].tensor_proto).item().decode()
             for t in runs[0].Tags()["tensors"]}  # fmt: skip
    assert "| ranks | 0, 1 as logical tensors" in texts["hooktrace/export"]
    apart = invoke("export", "tensorboard", SAMPLES_DISTRIBUTED / layout, tmp_path / "r", "-q",
                   "--per-rank")  # fmt: skip
    assert apart.exit_code == 0 and sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "hooktrace-export.json",
        "rank=0",
        "rank=1",
    ]


def test_a_pooled_activation_gradients_histogram_holds_the_values_as_computed() -> None:
    """A logical record of an activation gradient pooled over 2 data-parallel ranks holds
    statistics divided by 2 (the gradient of the run's mean loss); its histogram counts the
    values each rank computed: the extremes, sum and sum of squares TensorBoard is given
    beside the counts are those values', not the divided ones."""
    from hooktrace.analyze.export.writer import undivided

    frame = pd.DataFrame(
        {
            "kind": ["grad_output", "grad_output", "output", "grad_param"],
            "dp": [2, 1, 2, 1],
            "shape": ["8,4", "8,4", "8,4", "4"],
        }
    )
    assert undivided(frame).tolist() == [2.0, 1.0, 1.0, 1.0]
    assert undivided(frame.drop(columns="dp")).tolist() == [1.0] * 4  # per-rank records
