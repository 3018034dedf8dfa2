"""A recording killed with SIGKILL keeps every flushed step, readable without repair."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from click.testing import CliRunner

import hooktrace
from hooktrace.cli import cli

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    import hooktrace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hooktrace.record(model, sys.argv[1], full_every=3):
        step = 0
        while True:  # until killed
            x = torch.randn(8, 16)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            step += 1
    """
)


def test_sigkill_mid_run_leaves_a_loadable_trace(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(run)])
    parts = run / "records" / "rank=0"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(parts.glob("part-*.parquet"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    trace = hooktrace.load(run)
    records = trace.records
    per_step = records.groupby("step").size()
    assert len(per_step) >= 3
    # every flushed step is whole: the same records as any other step, from step 0 on
    assert list(per_step.index) == list(range(len(per_step)))
    assert per_step.nunique() == 1, per_step
    assert trace.status == "recording"
    full = records[records["tensor_key"] != ""]
    for row in full.head(20).itertuples():
        assert trace.tensor(row.module, row.kind, step=row.step, slot=row.slot).size == row.numel

    result = CliRunner().invoke(cli, ["check", str(run)])
    assert result.exit_code == 1, result.output
    assert "INCOMPLETE" in result.output and "did not finish" in result.output
    assert not any(p.name.startswith(".") for p in parts.iterdir() if p.suffix == ".parquet")
    os.sync()
