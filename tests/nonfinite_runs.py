"""Real recorded runs where a NaN or Inf begins at a known operation and line, for the tests
of what the analyzer makes of non-finite captures: a forward origin (``log`` of a ReLU's
zeros), a backward origin (``sqrt`` of a ReLU's zeros: its backward divides by zero), and a
run where the forward turns NaN only from a chosen step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import hooktrace


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # -inf where the ReLU gave 0
        return torch.log(x)  # LOG_LINE


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # finite, but its backward divides by 0 where x == 0
        return torch.sqrt(x)  # SQRT_LINE


class LogFrom(nn.Module):
    """Identity until ``armed``, then ``log``: the forward turns non-finite at a chosen step."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) if self.armed else x * 1.0  # LOG_FROM_LINE


class Net(nn.Module):
    """fc -> act (ReLU) -> fault -> out."""

    def __init__(self, fault: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.fault = fault
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fault(self.act(self.fc(x))))  # type: ignore[no-any-return]


def record_run(
    fault: nn.Module, out: Path, *, steps: int = 3, arm_at: int | None = None, **record: Any
) -> Path:
    """A seeded SGD run of ``Net(fault)`` recorded into ``out``; ``arm_at``: the step from
    which ``fault.armed`` is set."""
    torch.manual_seed(0)
    model = Net(fault)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with hooktrace.record(model, out, **record):
        for step in range(steps):
            if arm_at is not None:
                fault.armed = step >= arm_at  # type: ignore[assignment]
            loss = model(torch.randn(8, 4, generator=generator)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return out


def source_line(marker: str) -> tuple[str, int]:
    """This file and the line of it marked ``# MARKER``: where a capture must point."""
    lines = Path(__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.endswith(f"# {marker}"))
    return shown(Path(__file__)), line


def shown(path: Path) -> str:
    """A source file as a capture names it: relative to the working directory (where the
    tests run from the repository's root), else whole."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
