"""Histograms as the recorder writes them: real models and training loops, every count held
against the tensors themselves (binned by hand, or by numpy's frexp, never by the recorder's
own code), through every route a tensor's statistics take."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from repo import SAMPLES
from torch import nn

import hooktrace
from hooktrace.cli import cli
from hooktrace.errors import ConfigError, TraceError
from hooktrace.trace.histograms import MAGNITUDE_BINS, NEG, POS, WIDTH, reference


def _flat(row: pd.Series) -> np.ndarray:
    """A histogram row of ``Trace.histograms()`` as the flat vector ``reference`` returns."""
    flat = np.zeros(WIDTH, dtype=np.int64)
    flat[:4] = [row["zero"], row["nan"], row["pos_inf"], row["neg_inf"]]
    flat[POS : POS + MAGNITUDE_BINS] = row["pos"]
    flat[NEG : NEG + MAGNITUDE_BINS] = row["neg"]
    return flat


def _nonzero_bins(values: np.ndarray) -> dict[str, int]:
    """{"pos 150": 2, ...}: the occupied magnitude bins of a row's pos/neg arrays."""
    return {str(k): int(values[k]) for k in np.flatnonzero(values)}


def test_known_values_land_in_the_bins_worked_out_by_hand(tmp_path: Path) -> None:
    # weight = [1, 2, 3, 0.5, -4]: 1 in [2^0, 2^1) is bin 0 + 150 = 150; 2 and 3 in
    # [2^1, 2^2) are bin 151; 0.5 is bin 149; -4 in [2^2, 2^3) is negative bin 152.
    # With the loss the output's sum, the weight's gradient is the input:
    # x = [2^-30, 1, 0, -8, 2^-20] gives pos bins 120 (2^-30), 150 (1), 130 (2^-20),
    # one zero, negative bin 153 (8 in [2^3, 2^4)); the bias's gradient is 1: pos bin 150.
    layer = nn.Linear(5, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 0.5, -4.0]]))
        layer.bias.zero_()
    x = torch.tensor([[2.0**-30, 1.0, 0.0, -8.0, 2.0**-20]])
    with hooktrace.record(layer, tmp_path / "run") as rec:
        layer(x).sum().backward()
        rec.step()
    frame = hooktrace.load(tmp_path / "run").histograms()
    by = {(r.kind, r.slot): r for r in frame.itertuples()}
    weight = by[("param", "weight")]
    assert _nonzero_bins(weight.pos) == {"149": 1, "150": 1, "151": 2}
    assert _nonzero_bins(weight.neg) == {"152": 1}
    counts = (weight.zero, weight.nan, weight.pos_inf, weight.neg_inf)
    assert counts == (0, 0, 0, 0) and weight.numel == 5
    assert by[("param", "bias")].zero == 1 and by[("param", "bias")].pos.sum() == 0
    grad = by[("grad_param", "weight")]
    assert _nonzero_bins(grad.pos) == {"120": 1, "130": 1, "150": 1}
    assert _nonzero_bins(grad.neg) == {"153": 1}
    assert grad.zero == 1
    assert _nonzero_bins(by[("grad_param", "bias")].pos) == {"150": 1}


class _Mixed(nn.Module):
    """Small and large parameters: the small ones taken together (staged, or read in place
    once the compiled kernels are loaded), the large one (past STAGED_MAX_VALUES) on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(6, 12)
        self.large = nn.Linear(12, 1000)  # 12,000 weights
        self.head = nn.Linear(1000, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.large(torch.relu(self.small(x)))))


def _train(model: nn.Module, steps: int, *, dtype: torch.dtype) -> tuple:
    """Train, keeping each step's parameters (as its forward finds them) and gradients (as
    the optimizer finds them): what the records must describe."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params, grads, losses = [], [], []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, 6, generator=g).to(dtype)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        loss = model(x).float().pow(2).mean()
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return params, grads, losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_every_histogram_equals_numpy_binning_of_the_tensor_at_that_step(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = _Mixed().to(dtype)
    with hooktrace.record(model, tmp_path / "run", histogram_every=2):
        params, grads, _ = _train(model, 5, dtype=dtype)
    trace = hooktrace.load(tmp_path / "run")
    frame = trace.histograms()
    assert sorted(frame["step"].unique()) == [0, 2, 4]  # step % 2 == 0
    assert set(frame["kind"]) == {"param", "grad_param"}
    assert len(frame) == 3 * 2 * 6  # steps, kinds, parameters
    for row in frame.itertuples():
        name = f"{row.module}.{row.slot}"
        source = params if row.kind == "param" else grads
        values = source[row.step][name].float().double().numpy()
        np.testing.assert_array_equal(_flat(pd.Series(row._asdict())), reference(values))
        assert row.numel == values.size


def test_the_eager_route_writes_the_same_histograms(tmp_path: Path) -> None:
    """Before numba loads, or without it, small tensors are staged (float64 copies) and
    histogrammed in the writer thread: the same counts as read in place."""
    script = """
import sys, torch, hooktrace
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2000), nn.Tanh(), nn.Linear(2000, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with hooktrace.record(model, sys.argv[1], histograms="param,grad_param,output,grad_output"):
    for i in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
"""
    frames = {}
    for switch in ("wait", "0"):
        out = tmp_path / f"run{switch}"
        env = {**os.environ, "HOOKTRACE_ONE_PASS": switch}
        subprocess.run([sys.executable, "-c", script, str(out)], env=env, check=True)
        frames[switch] = hooktrace.load(out).histograms()
    one, eager = frames["wait"], frames["0"]
    assert len(one) == len(eager) > 0
    assert set(one["kind"]) == {"param", "grad_param", "output", "grad_output"}
    for column in ("step", "seq", "module", "kind", "zero", "nan", "numel"):
        assert one[column].tolist() == eager[column].tolist()
    np.testing.assert_array_equal(np.stack(one["pos"]), np.stack(eager["pos"]))
    np.testing.assert_array_equal(np.stack(one["neg"]), np.stack(eager["neg"]))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_outputs_and_their_gradients_when_asked_for(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3000), nn.ReLU(), nn.Linear(3000, 2))
    seen: dict[tuple[str, str], np.ndarray] = {}

    def keep(name: str) -> None:
        module = model.get_submodule(name)
        module.register_forward_hook(
            lambda m, a, out: seen.__setitem__((name, "output"), out.detach().double().numpy())
        )
        module.register_full_backward_hook(
            lambda m, gi, go: seen.__setitem__((name, "grad_output"), go[0].double().numpy())
        )

    for name in ("0", "1", "2"):
        keep(name)
    with hooktrace.record(model, tmp_path / "run", histograms=["output", "grad_output"]) as rec:
        model(torch.randn(5, 4)).sum().backward()
        rec.step()
    frame = hooktrace.load(tmp_path / "run").histograms()
    assert set(frame["kind"]) == {"output", "grad_output"}
    for name in ("0", "1", "2"):
        for kind in ("output", "grad_output"):
            (row,) = frame[(frame["module"] == name) & (frame["kind"] == kind)].itertuples()
            np.testing.assert_array_equal(
                _flat(pd.Series(row._asdict())), reference(seen[(name, kind)])
            )
    relu = frame[(frame["module"] == "1") & (frame["kind"] == "output")].iloc[0]
    assert relu["neg"].sum() == 0 and relu["zero"] > 0  # a ReLU's output holds no negatives


def test_nan_and_inf_are_counted_apart(tmp_path: Path) -> None:
    layer = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0]]))
    with hooktrace.record(
        layer, tmp_path / "run", histograms="param", capture_nonfinite=False
    ) as rec:
        layer(torch.ones(1, 4))
        rec.step()
    (row,) = hooktrace.load(tmp_path / "run").histograms().itertuples()
    assert (row.nan, row.pos_inf, row.neg_inf, row.zero) == (1, 1, 1, 1)  # -0.0 is a zero
    assert row.pos.sum() == row.neg.sum() == 0


def test_recording_histograms_leaves_training_bit_identical(tmp_path: Path) -> None:
    def losses(record: str | None) -> list[float]:
        torch.manual_seed(3)
        model = _Mixed()
        if record is None:
            return _train(model, 4, dtype=torch.float32)[2]
        with hooktrace.record(model, tmp_path / record, histograms=record):
            return _train(model, 4, dtype=torch.float32)[2]

    plain = losses(None)
    assert losses("none") == plain
    assert losses("param,grad_param,output,grad_output") == plain


def test_a_trace_without_histograms_says_so(tmp_path: Path) -> None:
    layer = nn.Linear(3, 2)
    with hooktrace.record(layer, tmp_path / "run", histograms=None) as rec:
        layer(torch.randn(2, 3)).sum().backward()
        rec.step()
    trace = hooktrace.load(tmp_path / "run")
    assert not trace.has_histograms
    assert trace.manifest["config"]["histograms"] == []
    with pytest.raises(TraceError, match="recorded with histograms off"):
        trace.histograms()
    assert trace.sql("SELECT count(*) AS n FROM histograms")["n"].item() == 0
    sample = hooktrace.load(SAMPLES / "dead")
    if not sample.has_histograms:  # a sample written before 1.3
        with pytest.raises(TraceError, match="holds no histograms"):
            sample.histograms()


def test_bad_histogram_options_are_refused_before_training(tmp_path: Path) -> None:
    layer = nn.Linear(3, 2)
    with pytest.raises(ConfigError, match=r"unknown kind.*bogus"):
        hooktrace.record(layer, tmp_path / "a", histograms="param,bogus")
    with pytest.raises(ConfigError, match="histogram_every must be 1 or more"):
        hooktrace.record(layer, tmp_path / "b", histogram_every=0)
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    result = CliRunner().invoke(cli, ["record", "--histograms", "grads", str(script)])
    assert result.exit_code == 2 and "unknown kind(s) to histogram: grads" in result.output
    assert "trained" not in result.output


def test_the_table_reads_without_hooktrace_and_joins_the_records(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Mixed()
    with hooktrace.record(model, tmp_path / "run"):
        _train(model, 3, dtype=torch.float32)
    run = tmp_path / "run"
    frame = pd.read_parquet(run / "histograms")  # each row's occupied span, and its start
    assert len(frame) == 3 * 2 * 6
    whole = hooktrace.load(run).histograms()
    for stored, row in zip(frame.itertuples(), whole.itertuples(), strict=True):
        for sign in ("pos", "neg"):
            start, span = getattr(stored, f"{sign}_start"), getattr(stored, sign)
            expected = np.zeros(MAGNITUDE_BINS, dtype=np.int64)
            expected[start : start + len(span)] = span
            np.testing.assert_array_equal(getattr(row, sign), expected)
            assert len(span) == 0 or (span[0] > 0 and span[-1] > 0)
    joined = duckdb.sql(f"""
        SELECT r.numel, r.zero_fraction, r.nan_count, r.kind AS rk, h.kind AS hk,
               h.zero, h.nan, h.pos_inf + h.neg_inf AS inf,
               coalesce(list_sum(h.pos), 0) + coalesce(list_sum(h.neg), 0)
               + h.zero + h.nan + h.pos_inf + h.neg_inf AS counted, h.numel AS hn
        FROM read_parquet('{run}/records/*/*.parquet', hive_partitioning = 1) r
        JOIN read_parquet('{run}/histograms/*/*.parquet', hive_partitioning = 1) h
        USING (rank, step, seq)""").df()
    assert len(joined) == len(frame)
    assert (joined["rk"] == joined["hk"]).all()
    assert (joined["counted"] == joined["numel"]).all() and (joined["hn"] == joined["numel"]).all()
    assert np.allclose(joined["zero"] / joined["numel"], joined["zero_fraction"])


def test_the_record_command_takes_the_options_and_the_toml_keys(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "model = nn.Linear(3, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for i in range(4):\n"
        "    model(torch.randn(2, 3)).sum().backward(); opt.step(); opt.zero_grad()\n"
    )
    config = tmp_path / "hooktrace.toml"
    config.write_text('histograms = ["grad_param"]\nhistogram_every = 3\n')
    out = tmp_path / "run"
    command = [sys.executable, "-m", "hooktrace", "record", "-q", "-o", str(out)]
    subprocess.run([*command, "--config", str(config), str(script)], check=True)
    frame = hooktrace.load(out).histograms()
    assert set(frame["kind"]) == {"grad_param"} and sorted(set(frame["step"])) == [0, 3]
    subprocess.run(
        [*command, "--overwrite", "--histograms", "output", "--histogram-every", "2", str(script)],
        check=True,
    )
    trace = hooktrace.load(out)
    config_written = json.loads((out / "manifest.json").read_text())["config"]
    assert config_written["histograms"] == ["output"] and config_written["histogram_every"] == 2
    frame = trace.histograms()
    assert set(frame["kind"]) == {"output"} and sorted(set(frame["step"])) == [0, 2]


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_overwrite_leaves_nothing_of_the_earlier_trace(tmp_path: Path) -> None:
    """Found while adding histograms: --overwrite removed the records, steps, modules and
    segments of the earlier trace but kept its non-finite captures, which the new trace
    then reported as its own."""
    model = nn.Sequential(nn.Linear(2, 2), _Log())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[0].bias.zero_()
    with hooktrace.record(model, tmp_path / "run") as rec:
        model(torch.tensor([[1.0, -1.0]])).sum()
        rec.step()
    assert len(hooktrace.load(tmp_path / "run").nonfinite_captures()) == 1
    with hooktrace.record(model, tmp_path / "run", overwrite=True, histograms=None) as rec:
        model(torch.tensor([[1.0, 1.0]])).sum()
        rec.step()
    trace = hooktrace.load(tmp_path / "run")
    assert len(trace.nonfinite_captures()) == 0
    assert not trace.has_histograms  # the first recording's are gone too


def test_check_verifies_that_each_histogram_counts_its_tensor(tmp_path: Path) -> None:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    layer = nn.Linear(3, 2)
    with hooktrace.record(layer, tmp_path / "run") as rec:
        layer(torch.randn(2, 3)).sum().backward()
        rec.step()
    assert hooktrace.check(tmp_path / "run").whole
    (part,) = (tmp_path / "run" / "histograms").glob("rank=0/part-*.parquet")
    table = pq.read_table(part)
    column = table.schema.get_field_index("zero")
    table = table.set_column(column, "zero", pc.add(table["zero"], 1))  # one value too many
    pq.write_table(table, part)
    report = hooktrace.check(tmp_path / "run")
    assert not report.whole
    assert any("4 histogram row(s) do not count" in p for p in report.problems)


def test_the_formats_queries_agree_with_the_whole_rows() -> None:
    """docs/FORMAT.md's two ways to ask what float16 would flush to zero: through the
    histograms view (whole rows) and over the files (spans shifted by their start)."""
    run = SAMPLES / "underflow"
    trace = hooktrace.load(run)
    where = "module = 'blocks.1.fc' AND kind = 'grad_param' AND slot = 'weight' ORDER BY step"
    view = trace.sql(
        "SELECT (list_sum(pos[1:126]) + list_sum(neg[1:126])) / numel AS lost "
        f"FROM histograms WHERE {where}"
    )
    files = duckdb.sql(f"""
        SELECT (coalesce(list_sum(pos[1 : greatest(126 - pos_start, 0)]), 0)
                + coalesce(list_sum(neg[1 : greatest(126 - neg_start, 0)]), 0)) / numel AS lost
        FROM read_parquet('{run}/histograms/*/*.parquet', hive_partitioning = 1)
        WHERE {where}""").df()
    rows = trace.histograms(modules=["blocks.1.fc"], kinds=["grad_param"])
    rows = rows[rows["slot"] == "weight"]
    below = np.stack(rows["pos"])[:, :126].sum(axis=1) + np.stack(rows["neg"])[:, :126].sum(axis=1)
    expected = below / rows["numel"].to_numpy()
    assert len(expected) == 30 and expected.min() > 0.2
    np.testing.assert_array_equal(view["lost"].to_numpy(), expected)
    np.testing.assert_array_equal(files["lost"].to_numpy(), expected)


def test_summary_says_what_was_histogrammed(tmp_path: Path) -> None:
    from hooktrace.cli.summary import render

    layer = nn.Linear(3, 2)
    for name, options in (("on", {"histogram_every": 2}), ("off", {"histograms": "none"})):
        with hooktrace.record(layer, tmp_path / name, **options) as rec:
            for _ in range(3):
                layer(torch.randn(2, 3)).sum().backward()
                rec.step()
    on = hooktrace.summary(tmp_path / "on")
    assert on.histograms == len(hooktrace.load(tmp_path / "on").histograms()) == 2 * 2 * 2
    assert "histogram 8 records of grad_param, param, every 2 steps" in render(on)
    assert on.bytes_on_disk["histograms"] > 0
    off = render(hooktrace.summary(tmp_path / "off"))
    assert "histogram none (recorded with histograms off)" in off


def test_a_window_of_steps_reads_the_parts_that_hold_it(tmp_path: Path) -> None:
    layer = nn.Linear(3, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with hooktrace.record(layer, tmp_path / "run", buffer_mb=1e-6):  # a flush each step
        for _ in range(10):
            layer(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    trace = hooktrace.load(tmp_path / "run")
    parts = trace._parts["histograms"]
    assert len(parts) > 3
    holding = trace._parts_holding(3, 4, "histograms")
    assert 0 < len(holding) < len(parts)
    window = trace.histograms(steps=(3, 4))
    everything = trace.histograms()
    expected = everything[everything["step"].between(3, 4)].reset_index(drop=True)
    assert sorted(set(window["step"])) == [3, 4]
    pd.testing.assert_frame_equal(
        window.drop(columns=["pos", "neg"]), expected.drop(columns=["pos", "neg"])
    )
    np.testing.assert_array_equal(np.stack(window["pos"]), np.stack(expected["pos"]))


def test_a_caught_interrupt_leaves_every_histogram_on_its_own_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a KeyboardInterrupt between two parameter records, caught by the
    script, which went on in the same step, left the parameters' histograms queued for rows
    that later records then took: histograms joined the wrong records."""
    from hooktrace.recorder.recording.recorder import Recorder

    original = Recorder._observe
    fired: list[bool] = []

    def interrupted(
        self: Recorder, module: str, call: int, kind: str, *args: object, **kw: object
    ) -> object:
        if kind == "param" and not fired:
            fired.append(True)
            raise KeyboardInterrupt  # as SIGINT would, between two records
        return original(self, module, call, kind, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Recorder, "_observe", interrupted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 200), nn.Linear(200, 3))  # observed one by one
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run", histograms="param,output"):
        for _ in range(2):
            try:
                out = model(torch.randn(4, 200))
            except KeyboardInterrupt:
                out = model(torch.randn(4, 200))
            out.sum().backward()
            opt.step()
            opt.zero_grad()
    assert fired
    trace = hooktrace.load(tmp_path / "run")
    joined = trace.histograms().merge(
        trace.records, on=["rank", "step", "seq"], suffixes=("", "_r")
    )
    assert len(joined) == len(trace.histograms())
    assert (joined["kind"] == joined["kind_r"].astype(str)).all()
    assert (joined["module"] == joined["module_r"].astype(str)).all()
    assert (joined["numel"] == joined["numel_r"]).all()
    assert hooktrace.check(trace).whole


def test_a_value_recorded_twice_in_a_step_counts_once(tmp_path: Path) -> None:
    """Found in review: with an evaluation's forward before training's in one step, the
    parameters and buffers are recorded twice; hist kept one record of a parameter but summed
    a buffer's two, and precision summed both of either (numel 16 of 8)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run", histograms="param,buffer,grad_param"):
        for _ in range(2):
            model.eval()
            with torch.no_grad():
                model(torch.randn(16, 4))
            model.train()
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    records = hooktrace.load(tmp_path / "run").records
    twice = records[(records["step"] == 0) & (records["module"] == "1")]
    assert (twice["slot"] == "running_mean").sum() == 2  # recorded twice indeed
    dist = hooktrace.hist(tmp_path / "run", modules="^1$", steps=[0])
    assert dist.groupby(["kind", "slot"])["numel"].first().to_dict() == {
        ("buffer", "num_batches_tracked"): 1, ("buffer", "running_mean"): 8,
        ("buffer", "running_var"): 8, ("grad_param", "bias"): 8, ("grad_param", "weight"): 8,
        ("param", "bias"): 8, ("param", "weight"): 8,
    }  # fmt: skip
    shares = hooktrace.precision(tmp_path / "run", modules="^1$", steps=[0])
    assert shares.set_index(["kind", "slot"])["numel"].to_dict() == {
        ("buffer", "num_batches_tracked"): 1, ("buffer", "running_mean"): 8,
        ("buffer", "running_var"): 8, ("grad_param", "bias"): 8, ("grad_param", "weight"): 8,
        ("param", "bias"): 8, ("param", "weight"): 8,
    }  # fmt: skip


def test_a_trailing_comma_in_the_kinds_is_no_kind() -> None:
    """Found in review: `--histograms param,` said "unknown kind(s) to histogram: ;"."""
    from hooktrace.recorder.hooks.select import histogram_kinds

    assert histogram_kinds("param,") == {"param"}
    assert histogram_kinds(" grad_param , param ") == {"grad_param", "param"}
    assert histogram_kinds("none") == frozenset()


@pytest.mark.parametrize("where", ["hook", "writer"])
def test_a_histogram_that_fails_costs_itself_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Found in review: a histogram that raised stopped the recording (in a hook) or lost the
    whole step, statistics included (in the writer). Histograms are the optional part."""
    from hooktrace.recorder.records import observe as recorder_module
    from hooktrace.recorder.records import pending

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no histogram today")

    if where == "hook":
        monkeypatch.setattr(recorder_module, "histogram_many", broken)
        monkeypatch.setattr(recorder_module, "histogram_of", broken)
    else:
        from hooktrace.recorder.stats import numba_kernels

        monkeypatch.setattr(pending, "histogram_staged", broken)
        monkeypatch.setattr(
            numba_kernels, "staged", lambda: None
        )  # small tensors staged, for the writer
    layer = nn.Linear(100, 100)  # 10,000 weights: histogrammed in the hook, not staged
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    warned = (
        pytest.warns(RuntimeWarning, match="no histogram today")
        if where == "hook"
        else contextlib.nullcontext()
    )
    kinds = "param,grad_param,output"
    with warned, hooktrace.record(layer, tmp_path / "run", histograms=kinds):
        for _ in range(3):
            layer(torch.randn(2, 100)).sum().backward()
            opt.step()
            opt.zero_grad()
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "complete" and len(trace.steps) == 3
    assert len(trace.records) == 3 * 6  # output and its gradient, two params, two gradients
    assert trace.manifest["ranks"]["0"]["histograms_failed"] > 0
    assert hooktrace.check(trace).whole
