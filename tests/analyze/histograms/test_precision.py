"""hooktrace.precision, ``hooktrace precision`` and the float16 findings of ``anomalies``, on
real recordings with histograms.

A seeded MLP is trained at full scale, then with its loss scaled by 2^-16 for its last steps,
which puts a good part of its gradients below float16's smallest subnormal (2^-24); its
healthy twin trains at full scale throughout. The reference fractions come from the gradient
tensors themselves, counted with torch in the same training loop as the recording, never from
hooktrace. Parameters set to values chosen by hand give fractions known without any program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner, Result
from repo import ROOT, SAMPLES
from torch import nn

import hooktrace
from hooktrace.analyze.histograms.precision import FRACTIONS, NO_HISTOGRAMS
from hooktrace.cli import cli

TINY = 2.0**-16
TINY_STEPS = range(4, 10)
STEPS = 10
HISTOGRAMS = ("param", "grad_param", "grad_output")

Key = tuple[str, str, str]  # module, kind, slot


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


def counts(tensor: torch.Tensor) -> np.ndarray:
    """Of the nonzero finite values: how many lie below 2^-24, how many there are, how many
    float16 actually makes zero, and how many lie at or below 2^-25 (which it always does)."""
    x = tensor.detach().reshape(-1)
    x = x[(x != 0) & x.isfinite()]
    return np.array(
        [
            int((x.abs() < 2.0**-24).sum()),
            x.numel(),
            int((x.half() == 0).sum()),
            int((x.abs() <= 2.0**-25).sum()),
        ]
    )


def train(out: Path, *, tiny_steps: range | None, histogram_every: int = 1) -> dict[Key, Any]:
    """A seeded SGD run recorded into ``out`` with histograms of ``HISTOGRAMS``; the loss is
    scaled by TINY at ``tiny_steps``. Returns :func:`counts` per (module, kind, slot) per
    step, of each parameter's gradient and each module's output gradient, taken with torch."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=generator)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            output.retain_grad()  # its gradient is what hooktrace records as grad_output
            outputs[name] = output

        return hook

    handles = [m.register_forward_hook(keep(name or "Net")) for name, m in model.named_modules()]
    reference: dict[Key, Any] = defaultdict(dict)
    try:
        with hooktrace.record(model, out, histograms=HISTOGRAMS, histogram_every=histogram_every):
            for step in range(STEPS):
                x = torch.randn(32, 16, generator=generator)
                y = (x @ teacher).argmax(dim=1)
                scale = TINY if tiny_steps is not None and step in tiny_steps else 1.0
                loss = F.cross_entropy(model(x), y) * scale
                loss.backward()
                if step % histogram_every == 0:
                    for name, output in outputs.items():
                        assert output.grad is not None
                        reference[(name, "grad_output", "0")][step] = counts(output.grad)
                    for name, module in model.named_children():
                        for slot, p in module.named_parameters():
                            assert p.grad is not None
                            reference[(name, "grad_param", slot)][step] = counts(p.grad)
                opt.step()
                opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
    return dict(reference)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Key, Any]]:
    run = tmp_path_factory.mktemp("precision") / "tiny"
    return run, train(run, tiny_steps=TINY_STEPS)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Key, Any]]:
    run = tmp_path_factory.mktemp("precision") / "healthy"
    return run, train(run, tiny_steps=None, histogram_every=2)


def per_module(reference: dict[Key, Any]) -> dict[tuple[str, str], dict[int, np.ndarray]]:
    """The counts of each module's slots together, per step, as the findings pool them."""
    pooled: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    for (module, kind, _), steps in reference.items():
        for step, c in steps.items():
            pooled[(module, kind)][step] = pooled[(module, kind)].get(step, 0) + c
    return dict(pooled)


def underflow_findings(run: Path, **options: Any) -> pd.DataFrame:
    found = hooktrace.anomalies(run, **options).findings
    found = found[found["kind"] == "fp16_underflow"].copy()
    found["record_kind"] = found["evidence"].str.split().str[0]  # "grad_param weight, ...: ..."
    return found


# --- gradients made tiny on purpose ----------------------------------------------------------


def test_the_fractions_are_those_of_the_gradients_themselves(tiny: tuple[Path, Any]) -> None:
    run, reference = tiny
    table = hooktrace.precision(run, kinds=["grad_param", "grad_output"])
    assert len(table) == len(reference)
    for row in table.to_dict("records"):
        steps = reference[(row["module"], row["kind"], row["slot"])]
        below, nonzero, _, _ = sum(steps.values())
        assert row["nonzero"] == nonzero and row["steps"] == STEPS, row
        assert row["fp16_underflow"] == pytest.approx(below / nonzero, rel=1e-12), row
        fractions = {s: c[0] / c[1] if c[1] else 0.0 for s, c in steps.items()}
        worst = max(fractions.values())
        if worst > 0:  # no overflow here: the worst step is the one that underflows most
            assert row["worst_fraction"] == pytest.approx(worst, rel=1e-12)
            assert row["worst_step"] == min(s for s, f in fractions.items() if f == worst)
        assert row["fp16_overflow"] == row["bf16_underflow"] == row["bf16_overflow"] == 0
    assert table["fp16_underflow"].max() > 0.3  # the run does what it is for
    # worst first
    trouble = (table["fp16_underflow"] + table["fp16_overflow"]).to_numpy()
    assert (np.diff(trouble) <= 0).all()


def test_below_2_to_the_minus_24_is_what_float16_loses(tiny: tuple[Path, Any]) -> None:
    """The bins cannot split [2^-25, 2^-24): float16 rounds part of it up to 2^-24. What it
    truly makes zero lies between the values at or below 2^-25 and those below 2^-24."""
    _, reference = tiny
    for steps in reference.values():
        for below, _, flushed, below_half in steps.values():
            assert below_half <= flushed <= below


def test_anomalies_flag_the_gradients_float16_would_lose(tiny: tuple[Path, Any]) -> None:
    run, reference = tiny
    expected = {}
    for (module, kind), steps in per_module(reference).items():
        fractions = {s: c[0] / c[1] for s, c in steps.items() if c[1]}
        over = sorted(s for s, f in fractions.items() if f > 0.01)
        if over:
            expected[(module, kind)] = (over[0], over[-1], len(over), max(fractions.values()))
    assert expected and all(first >= TINY_STEPS[0] for first, _, _, _ in expected.values())

    found = underflow_findings(run)
    got = {
        (r["module"], r["record_kind"]): (r["step"], r["last_step"], r["count"], r["value"])
        for r in found.to_dict("records")
    }
    assert got.keys() == expected.keys()
    for key, (first, last, count, value) in expected.items():
        assert got[key][:3] == (first, last, count), key
        assert got[key][3] == pytest.approx(value, rel=1e-12), key
    assert (found["reference"] == 0.01).all()
    assert set(found["severity"]) <= {"warning", "info"}
    assert (found["severity"] == "warning").tolist() == (found["value"] >= 0.1).tolist()
    assert "GradScaler" in found["explanation"].iloc[0]
    assert "bfloat16" in found["explanation"].iloc[0]
    assert not (hooktrace.anomalies(run).findings["kind"] == "fp16_overflow").any()


def test_bounds_and_steps_read(tiny: tuple[Path, Any]) -> None:
    run, _ = tiny
    before = f"0-{TINY_STEPS[0] - 1}"
    assert underflow_findings(run, steps=before).empty
    assert hooktrace.precision(run, steps=before)["fp16_underflow"].max() < 0.01
    assert len(underflow_findings(run, underflow_above=0.5)) < len(underflow_findings(run))
    only = hooktrace.precision(run, modules="^fc3$", kinds=["grad_param"])
    assert sorted(only["slot"]) == ["bias", "weight"] and set(only["module"]) == {"fc3"}


def test_a_healthy_run_has_no_such_finding(healthy: tuple[Path, Any]) -> None:
    run, reference = healthy
    found = hooktrace.anomalies(run)
    assert not found.findings["kind"].isin(["fp16_underflow", "fp16_overflow"]).any()
    assert found.notes == []
    table = hooktrace.precision(run)
    assert (table["steps"] == STEPS // 2).all()  # histograms every 2nd step
    grads = table[table["kind"] != "param"]
    for row in grads.to_dict("records"):
        below, nonzero, _, _ = sum(reference[(row["module"], row["kind"], row["slot"])].values())
        assert row["fp16_underflow"] == pytest.approx(below / nonzero, rel=1e-12)
    assert grads["fp16_underflow"].max() <= 0.01


def test_the_same_gradient_under_two_modules_is_reported_once() -> None:
    """In the underflow sample, a block's output gradient reaches its ReLU unchanged (the
    skip connection adds), and ``blocks`` returns ``blocks.1``'s output: one finding each."""
    run = ROOT / "sample_traces" / "underflow"
    table = hooktrace.precision(run, kinds=["grad_output"]).set_index("module")
    same = ["blocks.1", "blocks", "blocks.1.act"]
    assert table.loc[same, "fp16_underflow"].nunique() == 1
    assert table.loc[same, "nonzero"].nunique() == 1
    found = underflow_findings(run)
    outputs = set(found.loc[found["record_kind"] == "grad_output", "module"])
    assert len(outputs & set(same)) == 1
    assert len(outputs & {"blocks.0", "blocks.0.act"}) == 1
    assert {"blocks.1.fc", "blocks.0.fc", "head", "embed"} <= outputs


# --- values known by hand --------------------------------------------------------------------


def record_weights(out: Path, values: list[float], dtype: torch.dtype) -> None:
    model = nn.Linear(len(values), 1, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values], dtype=dtype))
    with hooktrace.record(model, out, histograms=("param",), histogram_every=1) as rec:
        model(torch.ones(1, len(values), dtype=dtype)).sum().backward()
        rec.step()


def test_values_known_by_hand(tmp_path: Path) -> None:
    # float16: 2^-30 is lost, 2^-20 a subnormal, 70000 beyond 65504; the zero is no part of it
    record_weights(tmp_path / "f32", [2.0**-30, 2.0**-20, 1.0, 70000.0, 0.0], torch.float32)
    row = hooktrace.precision(tmp_path / "f32").iloc[0]
    assert (row["module"], row["kind"], row["slot"]) == ("Linear", "param", "weight")
    assert (row["numel"], row["nonzero"], row["steps"]) == (5, 4, 1)
    assert [row[c] for c in FRACTIONS] == [0.25, 0.25, 0.25, 0.0, 0.0, 0.0]
    assert (row["worst_step"], row["worst_fraction"]) == (0, 0.5)

    # float64 reaches bfloat16's ends: below 2^-133, between 2^-133 and 2^-126, past 2^128
    values = [2.0**-140, 2.0**-130, 2.0**130, 1.0, -(2.0**-20)]
    record_weights(tmp_path / "f64", values, torch.float64)
    row = hooktrace.precision(tmp_path / "f64").iloc[0]
    assert [row[c] for c in FRACTIONS] == [0.4, 0.2, 0.2, 0.2, 0.2, 0.2]


def test_overflow_is_flagged_for_any_kind_and_underflow_for_gradients_only(
    tmp_path: Path,
) -> None:
    record_weights(tmp_path / "run", [2.0**-30, 2.0**-20, 1.0, 70000.0, 0.0], torch.float32)
    found = hooktrace.anomalies(tmp_path / "run")
    low = found.findings[found.findings["kind"].str.startswith("fp16_")]
    assert low[["kind", "severity", "module", "slot", "step", "count"]].values.tolist() == [
        ["fp16_overflow", "warning", "Linear", "weight", 0, 1]
    ]
    assert (low["value"].item(), low["reference"].item()) == (0.25, 0.0)
    assert low["evidence"].item().startswith("param weight: 25.0% of the nonzero values 2^16")
    assert found.notes == [
        "histograms recorded of param only: float16 underflow of gradients not checked "
        "(record with --histograms grad_param)"
    ]
    assert hooktrace.anomalies(tmp_path / "run", overflow_above=0.25).findings.empty


# --- the command line ------------------------------------------------------------------------


def invoke(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_precision_command(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    run, _ = tiny
    result = invoke("precision", run, "--kinds", "grad_param", "--modules", "fc")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"6 tensors with histograms in {run} (steps 0–9)")
    assert lines[2].split()[:6] == ["module", "kind", "slot", "steps", "nonzero", "fp16"]
    expected = hooktrace.precision(run, kinds=["grad_param"], modules="fc")
    first = expected.iloc[0]
    assert lines[3].split()[:3] == [first["module"], "grad_param", first["slot"]]
    records = json.loads(invoke("precision", run, "--format", "json").output)
    assert len(records) == len(hooktrace.precision(run))
    assert set(records[0]) == set(expected.columns)


def test_anomalies_command_shows_the_finding(tiny: tuple[Path, Any]) -> None:
    run, _ = tiny
    result = invoke("anomalies", run)
    assert result.exit_code == 0, result.output
    found = underflow_findings(run)
    header = [line for line in result.output.splitlines() if "fp16_underflow" in line]
    warnings = (found["severity"] == "warning").sum()
    assert header[0] == f"WARNING fp16_underflow ({warnings})"
    assert "of the nonzero values below 2^-24 at step" in result.output
    assert "note:" not in result.output
    assert set(hooktrace.anomalies(run).findings["kind"]) == {"fp16_underflow"}
    assert invoke("anomalies", run, "--fail").exit_code == 1


def test_without_histograms_anomalies_says_so_once(tmp_path: Path) -> None:
    sample = tmp_path / "run"
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with hooktrace.record(model, sample, histograms=None) as rec:
        model(torch.randn(2, 4)).sum().backward()
        rec.step()
    result = invoke("anomalies", sample, "--fail")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1:] == [f"note: {NO_HISTOGRAMS}"]
    assert "--histograms param,grad_param" in NO_HISTOGRAMS
    # precision answers, in a line, that there is nothing to measure; the library says so
    missing = invoke("precision", sample)
    assert missing.exit_code == 0, missing.output
    assert missing.output.startswith(f"no histograms in {sample}: recorded with histograms off")
    assert len(missing.output.splitlines()) == 1
    assert json.loads(invoke("precision", sample, "--format", "json").output) == []
    with pytest.raises(hooktrace.TraceError, match="holds no histograms: record with"):
        hooktrace.precision(sample)


@pytest.mark.parametrize(
    "args",
    [
        ["anomalies", "{run}", "--underflow-above", "1"],
        ["anomalies", "{run}", "--overflow-above", "-0.1"],
        ["precision", "{run}", "--modules", "("],
        ["precision", "{run}", "--steps", "ten"],
    ],
)
def test_bad_options_are_one_line_and_exit_2(tiny: tuple[Path, Any], args: list[str]) -> None:
    result = invoke(*[a.format(run=tiny[0]) for a in args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("hooktrace: error: ")
    assert len(result.output.strip().splitlines()) == 1


def test_the_commands_work_where_torch_cannot_be_imported(tiny: tuple[Path, Any]) -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now fails
        from hooktrace.cli import main
        main(sys.argv[1:])
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["precision", tiny[0]], ["anomalies", tiny[0], "--format", "json"]):
        done = subprocess.run(
            [sys.executable, "-c", code, *map(str, args)],
            capture_output=True, text=True, cwd=ROOT, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "fc1" in done.stdout and done.stderr == ""


def test_layers_with_equal_shares_are_not_taken_for_one_tensor(tmp_path: Path) -> None:
    """Found in review: a repeated activation gradient (a container's, a skip connection's)
    was told apart from another by its shares alone, so three layers whose output gradients
    all overflow float16 made one finding. Now it takes the same histogram, bin for bin."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with hooktrace.record(model, tmp_path / "run", histograms="grad_output"):
        for _ in range(3):
            (model(torch.randn(8, 16)).sum() * 1e9).backward()
            opt.step()
            opt.zero_grad()
    found = hooktrace.anomalies(tmp_path / "run").findings
    overflow = found[found["kind"] == "fp16_overflow"]
    # the root's output gradient is the last layer's: one finding for the two
    assert sorted(overflow["module"]) == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("kinds", "message"), [("foo", "unknown kind(s) foo"), (",", "no kind named")]
)
def test_precision_refuses_kinds_that_do_not_exist(kinds: str, message: str) -> None:
    """Found in review: an unknown kind answered "no histograms match the filters", exit 0,
    where hist, plot and export say it is unknown, exit 2."""
    from click.testing import CliRunner

    from hooktrace.cli import cli

    run = SAMPLES / "underflow"
    result = CliRunner().invoke(cli, ["precision", str(run), "--kinds", kinds])
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1
