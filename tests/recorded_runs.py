"""Recordings that tests of several analyses share, each of a real seeded training run.

- models with a planted fault, and the seeded SGD loop on a teacher problem that records them
  and measures each Linear's gradient norm with plain torch (the anomaly checks, the plots,
  the report, the CLI's findings);
- a Linear(6, 2) with parameters set by hand across float16's limits (the histograms);
- a model whose module names are awkward to print, quote and escape (the plots, the report).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hooktrace

# --- models with a planted fault, and the training loop ---------------------------------------


class MLP(nn.Module):
    """fc1 -> relu1 -> fault -> fc2 -> relu2 -> fc3; ``fault`` is where a fault is planted."""

    def __init__(self, fault: nn.Module | None = None, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.relu1 = act()
        self.fault = fault if fault is not None else nn.Identity()
        self.fc2 = nn.Linear(32, 32)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.relu2(self.fc2(self.fault(self.relu1(self.fc1(x))))))


class Armed(nn.Module):
    """A fault that switches on when the training loop sets ``armed``."""

    armed = False


class NaNForward(Armed):
    """sqrt of a centred activation once armed: NaN wherever it is below its mean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x - x.mean()) if self.armed else x * 1.0


class _DivideGradByZero(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, armed: bool) -> torch.Tensor:
        ctx.armed = armed
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad / torch.zeros_like(grad) if ctx.armed else grad), None


class InfBackward(Armed):
    """Identity forward; once armed, a custom backward that divides the gradient by zero."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DivideGradByZero.apply(x, self.armed)  # type: ignore[no-any-return]


class ZeroFrom(Armed):
    """Multiplies by zero once armed: nothing upstream gets a gradient any more."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (0.0 if self.armed else 1.0)


def train(
    model: nn.Module,
    out: Path,
    *,
    steps: int = 40,
    lr: float = 0.1,
    arm_at: int | None = None,
    loss_scale: float = 1.0,
    frozen_at: int | None = None,
    before_step: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    **record: Any,
) -> dict[str, list[float]]:
    """A seeded SGD run on a teacher problem, recorded into ``out``; returns each Linear's
    gradient norm per step (the L2 norm over its parameters), measured with plain torch.
    ``frozen_at``: a step whose update is skipped (learning rate 0)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=generator)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    norms: dict[str, list[float]] = {n: [] for n in linears}
    with hooktrace.record(model, out, **record):
        for step in range(steps):
            if arm_at is not None and step == arm_at:
                model.get_submodule("fault").armed = True
            x = torch.randn(32, 16, generator=generator)
            y = (x @ teacher).argmax(dim=1)
            if before_step is not None:
                x = before_step(step, x)
            loss = F.cross_entropy(model(x), y) * loss_scale
            loss.backward()
            for name, module in linears.items():
                grads = [p.grad.pow(2).sum() for p in module.parameters() if p.grad is not None]
                norms[name].append(float(torch.stack(grads).sum().sqrt()) if grads else 0.0)
            for group in opt.param_groups:
                group["lr"] = 0.0 if step == frozen_at else lr
            opt.step()
            opt.zero_grad()
    return norms


# --- a Linear set by hand ----------------------------------------------------------------------

# The parameters of a Linear(6, 2), set by hand: magnitudes 2^-30 .. 2^20 across float16's
# limits (2^-24, 2^-14, 2^16), two zeros, four negatives.
WEIGHT = [
    [2.0**-30, 2.0**-20, 2.0**-10, 1.0, 2.0**10, 2.0**17],
    [-(2.0**-26), -(2.0**-16), 0.0, 0.0, -3.0, -(2.0**20)],
]
BIAS = [0.5, -0.25]


def known_input(step: int) -> torch.Tensor:
    """The input at ``step``; with the loss the output's sum, each row of the weight's
    gradient is this input: 2^(step-20), 1, 0 (Inf at step 3), -8, 2^(-30-step), 3."""
    x = torch.tensor([[2.0 ** (step - 20), 1.0, 0.0, -8.0, 2.0 ** (-30 - step), 3.0]])
    if step == 3:
        x[0, 2] = float("inf")
    return x


def record_known(out: Path, steps: int = 4, **options: object) -> Path:
    layer = nn.Linear(6, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(WEIGHT))
        layer.bias.copy_(torch.tensor(BIAS))
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)  # the parameters stay as set
    with hooktrace.record(layer, out, capture_nonfinite=False, **options):
        for step in range(steps):
            layer(known_input(step)).sum().backward()
            opt.step()
            opt.zero_grad()
    return out


def without_histograms(out: Path, *, older: bool) -> Path:
    """A real recording with no histograms: recorded with histograms off, or made to look as
    a trace written before format 1.3 (no histograms/, no such configuration)."""
    record_known(out, steps=1, histograms=None)
    if older:
        manifest = json.loads((out / "manifest.json").read_text())
        for key in ("histograms", "histogram_every"):
            manifest["config"].pop(key)
        manifest["format_version"] = "1.2"
        (out / "manifest.json").write_text(json.dumps(manifest))
    assert not (out / "histograms").exists()
    return out


# --- awkward names -----------------------------------------------------------------------------

LONG = "transformer_layer_with_a_rather_long_name"
SCRIPT = "<script>alert(1)</script>"


class OddNames(nn.Module):
    """Names a picture or a page must survive: long, with mathtext dollars, with HTML."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({LONG: nn.Sequential(nn.Linear(4, 8), nn.ReLU())})
        self.add_module("cost$in$dollars", nn.Linear(8, 8))
        self.add_module(SCRIPT, nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = getattr(self, "cost$in$dollars")(self.encoder[LONG](x))
        return self.head(getattr(self, SCRIPT)(x))  # type: ignore[no-any-return]


def record_odd_names(out: Path) -> Path:
    torch.manual_seed(0)
    model = OddNames()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, out):
        for _ in range(4):
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return out
