"""Pairs of real recorded runs for the diff tests: a tiny model, a seeded SGD loop, and the
faults the tests plant (a perturbed weight, a changed op, a scaled gradient, another order
of the data, another architecture)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hooktrace


class ScaleGrad(torch.autograd.Function):
    """Identity in the forward pass; multiplies the gradient by ``factor`` in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class Scale(nn.Module):
    """Multiplies by ``factor`` once ``on`` is set: one op changed from some step on."""

    def __init__(self, factor: float = 1.001) -> None:
        super().__init__()
        self.factor = factor
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor if self.on else x


class GradScaledLinear(nn.Linear):
    """A Linear whose weight gradient is scaled by ``grad_factor`` (forward unchanged)."""

    grad_factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = (
            self.weight
            if self.grad_factor == 1.0
            else ScaleGrad.apply(self.weight, self.grad_factor)
        )
        return F.linear(x, weight, self.bias)


class Net(nn.Module):
    """fc1 -> act -> scale -> fc2; ``hidden`` and ``extra`` change the architecture."""

    def __init__(self, hidden: int = 8, extra: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.act = nn.ReLU()
        self.scale = Scale()
        self.extra = nn.Linear(hidden, hidden) if extra else None
        self.fc2 = GradScaledLinear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.scale(self.act(self.fc1(x)))
        if self.extra is not None:
            x = self.extra(x)
        return self.fc2(x)


Hook = Callable[[int, Net], None]


def train(
    out: Path,
    *,
    n_steps: int = 4,
    seed: int = 0,
    reverse_data: bool = False,
    before_step: Hook | None = None,
    hidden: int = 8,
    extra: bool = False,
    **options: Any,
) -> Path:
    """Record ``n_steps`` seeded SGD steps of :class:`Net` into ``out``; ``before_step(step,
    model)`` runs before each step's forward (after the previous optimizer step)."""
    torch.manual_seed(seed)
    model = Net(hidden, extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1234)
    batches = [
        (torch.randn(6, 4, generator=generator), torch.randint(0, 3, (6,), generator=generator))
        for _ in range(n_steps)
    ]
    if reverse_data:
        batches.reverse()
    with hooktrace.record(model, out, **options):
        for step, (x, y) in enumerate(batches):
            if before_step is not None:
                before_step(step, model)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return out


def perturb_weight(module: str, at: int, *, delta: float = 1e-3) -> Hook:
    """Adds ``delta`` to one weight of ``module`` just before step ``at``."""

    def hook(step: int, model: Net) -> None:
        if step == at:
            with torch.no_grad():
                getattr(model, module).weight[0, 0] += delta

    return hook


def swap_weights(module: str, at: int) -> Hook:
    """Swaps two weights of ``module`` just before step ``at``: its statistics do not change,
    its full tensor does."""

    def hook(step: int, model: Net) -> None:
        if step == at:
            with torch.no_grad():
                w = getattr(model, module).weight
                w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()

    return hook


def scale_on_from(at: int) -> Hook:
    def hook(step: int, model: Net) -> None:
        model.scale.on = step >= at

    return hook


def scale_grad_from(at: int, factor: float = 2.0) -> Hook:
    def hook(step: int, model: Net) -> None:
        model.fc2.grad_factor = factor if step >= at else 1.0

    return hook
