"""Small real traces to damage: recorded in this process by the real recorder."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import hooktrace


def record_small(out: Path, *, other_model: bool = False, steps: int = 4) -> Path:
    """A 4-step trace with statistics, per-unit activity and full tensors (every 2nd step).

    ``other_model`` records a model of another shape, for "two runs of different models".
    """
    torch.manual_seed(0)
    model: nn.Module
    if other_model:
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Linear(3, 2))
    else:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    with hooktrace.record(model, out, full_every=2):
        for _ in range(steps):
            model(torch.randn(5, 4, generator=generator)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return out
