"""examples/dask_diff.py, the distributed engine's version of ``hooktrace diff``, names the
same first divergence and the same differing records per module as hooktrace does."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from scale_runs import many_parts, module_names

import hooktrace

pytest.importorskip("dask.dataframe", reason="the dask extra is not installed")
# dask's Parquet reader still passes inplace=True, which pandas 3.1 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:The inplace keyword")

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_traces"


def _example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("dask_diff", ROOT / "examples" / "dask_diff.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dask_diff"] = module
    spec.loader.exec_module(module)
    return module


def _agree(run_a: Path, run_b: Path) -> None:
    first, modules = _example().diff(str(run_a), str(run_b))
    ours = hooktrace.diff(run_a, run_b)
    assert ours.first is not None and len(first) == 1
    row = first.iloc[0]
    assert (int(row["step"]), row["kind"], row["module"], row["slot"], int(row["seq"])) == (
        ours.first.step, ours.first.kind, ours.first.module, ours.first.slot, ours.first.seq,
    )  # fmt: skip
    table = ours.modules
    expected = dict(zip(table["module"].astype(str), table["differing"].astype(int), strict=True))
    assert modules["differing"].to_dict() == expected


def test_the_sample_pair(capsys: pytest.CaptureFixture[str]) -> None:
    _agree(SAMPLES / "healthy", SAMPLES / "diverged")
    assert _example().main([str(SAMPLES / "healthy"), str(SAMPLES / "diverged")]) == 1
    printed = capsys.readouterr().out
    assert "first divergence: step 12, output of 'blocks.1.norm' (slot 0" in printed


def test_a_pair_of_many_parts(tmp_path: Path) -> None:
    a = many_parts(tmp_path / "a")
    b = many_parts(tmp_path / "b", perturb_from_step=25, perturb_module=module_names(10)[7])
    _agree(a, b)
    assert _example().main([str(a), str(a)]) == 0
