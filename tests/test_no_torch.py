"""The analyzer never imports torch: it works where importing torch fails. Nor ml_dtypes, until
a tensor read needs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

import hooktrace

BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], capture_output=True, text=True
    )


def test_load_summary_and_check_work_without_torch(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with hooktrace.record(model, run_dir, full_every=1) as rec:
        model(torch.randn(2, 4)).sum().backward()
        rec.step()

    result = _run(
        f"""
        import hooktrace
        trace = hooktrace.load({str(run_dir)!r})
        print(len(trace.records), trace.tensor("0", "output", step=0).shape)
        print(hooktrace.summary(trace).steps, hooktrace.check(trace).whole)
        try:
            import torch
        except ImportError:
            print("torch blocked")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == [
        f"{len(hooktrace.load(run_dir).records)} (2, 4)",
        "1 True",
        "torch blocked",
    ]

    for command in (["summary", str(run_dir)], ["check", str(run_dir)], ["--help"]):
        result = _run(f"from hooktrace.cli import main; main({command!r})")
        assert result.returncode == 0, (command, result.stderr)


def test_every_analyzer_module_imports_without_torch() -> None:
    """Each module of hooktrace.trace and hooktrace.analyze, and what it imports in turn,
    loads where importing torch fails (tests/test_architecture.py reads their imports,
    lazy ones included; this catches torch pulled in by another package)."""
    package = Path(hooktrace.__file__).parent
    names = sorted(
        ".".join(p.relative_to(package.parent).with_suffix("").parts)
        for room in ("trace", "analyze")
        for p in (package / room).glob("*.py")
        if p.stem != "__init__"
    )
    result = _run(
        f"""
        import importlib
        for name in {names!r}:
            importlib.import_module(name)
        print(len({names!r}))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(len(names))


def test_help_does_not_import_pandas() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from hooktrace.cli import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit: pass\n"
            "print('pandas' in sys.modules, 'torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
    )
    assert result.stdout.strip().endswith("False False"), result.stdout + result.stderr


def test_ml_dtypes_is_imported_by_the_first_tensor_that_needs_it(run_dir: Path) -> None:
    """Loading, summarising and checking a trace leave ml_dtypes unimported (its import took
    0.8 s, paid by every recording and every analyzer command); a bfloat16 tensor read back
    is ml_dtypes' bfloat16, bit for bit what the model made."""
    model = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with hooktrace.record(model, run_dir, full_every=1) as rec:
        made = model(x)
        made.float().sum().backward()
        rec.step()
    bits = made.detach().view(torch.int16).numpy().tolist()
    result = _run(
        f"""
        import sys
        import hooktrace
        trace = hooktrace.load({str(run_dir)!r})
        print(hooktrace.summary(trace).steps, hooktrace.check(trace).whole, len(trace.records))
        print("ml_dtypes" in sys.modules)
        value = trace.tensor("0", "output", step=0)
        print(value.dtype.name, value.view("int16").tolist() == {bits!r})
        print("ml_dtypes" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr
    records = len(hooktrace.load(run_dir).records)
    expected = [f"1 True {records}", "False", "bfloat16 True", "True"]
    assert result.stdout.split("\n")[:4] == expected, result.stdout
