"""Models with a planted non-finite fault, each known by construction: the module, the
operation and the line (marked ``# planted:``) where the first NaN or Inf appears.

Each ``make_*`` returns ``(model, batch)``; :func:`train` runs a real SGD loop on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Planted:
    """What the capture must name."""

    module: str
    pass_: str
    op: str
    node: str | None
    marker: str

    @property
    def line(self) -> int:
        return line_of(self.marker)


def line_of(marker: str, path: Path = Path(__file__)) -> int:
    """The line of ``path`` (this file) that carries ``marker`` (a planted fault's comment)."""
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if marker in text and "marker=" not in text:
            return number
    raise AssertionError(f"no line marked {marker!r}")


class LogFeatures(nn.Module):
    """log of features that a ReLU before it has made exactly zero, after a dropout (which
    draws from the RNG: the capture's re-run must not shift the run's next draws; its mask
    begins as ``aten::empty_like``, whose uninitialised memory may hold a NaN that is no
    finding)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.drop(x))  # planted: log of zero


class LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.log = LogFeatures()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.log(self.act(self.fc(x))))


class CheckpointedLogNet(LogNet):
    """LogNet with its log layer under non-reentrant checkpointing: the checkpoint counts the
    tensors its forward saves, and neither the look at the output nor the capture's re-run
    may add to them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        return self.head(checkpoint(self.log, h, use_reentrant=False))


class PlainNorm(nn.Module):
    """A norm layer without epsilon: (x - mean) / sqrt(var)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)  # ~1e-50 underflows to 0 in float32
        return (x - mean) / torch.sqrt(var)  # planted: division by an underflowed variance


class TinyScale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e-25


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.scale = TinyScale()
        self.norm = PlainNorm()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.scale(self.fc(x))))


class HalfSoftmax(nn.Module):
    """A softmax written by hand, in float16: exp overflows past 11.09."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x)  # planted: exp overflow in float16
        return e / e.sum(-1, keepdim=True)


class HalfNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.softmax = HalfSoftmax()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.softmax(self.fc(x).half()).float())


class Distance(nn.Module):
    """The length of a - b: sqrt at zero has an infinite gradient, with a finite forward."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1, keepdim=True))  # planted: sqrt at zero


class DistanceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.dist = Distance()
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.head(self.dist(h, h.detach()))  # a - b is exactly zero


class ViewDistanceNet(DistanceNet):
    """DistanceNet with a view between fc and dist: the tensor dist takes is not the one fc
    returned, so the origin is found by the gradients of the re-run, not by identity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).view(-1, 4)
        return self.head(self.dist(h, h.detach()))


class InlineSqrtNet(nn.Module):
    """The fault in the root's own forward, between two recorded modules: the root is the
    innermost recorded call whose backward made it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.sqrt(h - h.detach())  # planted: sqrt in the root's own forward
        return self.head(h)


class AbsGain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((self.w * x).abs())  # planted: sqrt of |w x| at zero


class TwiceGainNet(nn.Module):
    """One module called twice; only the second call's backward makes w's gradient
    non-finite (its input is zero), and the two calls' gradients of w are summed."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = AbsGain()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gain(x.abs() + 3) + self.gain(x * 0))


class SqrtGain(nn.Module):
    """x * sqrt(w) with a gain of exactly zero: only the parameter's gradient is infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 0.0, 1.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sqrt(self.w)  # planted: sqrt of a zero gain


class GainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.gain = SqrtGain()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gain(self.fc(x)))


class Healthy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.act = nn.Tanh()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


CASES: dict[str, tuple[Callable[[], nn.Module], float, Planted]] = {
    # name: (model, input scale, what the capture names)
    "log": (LogNet, 1.0, Planted("log", "forward", "aten::log", None, "planted: log of zero")),
    "log_checkpointed": (
        CheckpointedLogNet,
        1.0,
        Planted("log", "forward", "aten::log", None, "planted: log of zero"),
    ),
    "norm": (
        NormNet,
        1.0,
        Planted("norm", "forward", "aten::div.Tensor", None, "planted: division by an"),
    ),
    "half_exp": (
        HalfNet,
        40.0,
        Planted("softmax", "forward", "aten::exp", None, "planted: exp overflow"),
    ),
    "sqrt_backward": (
        DistanceNet,
        1.0,
        Planted("dist", "backward", "aten::div.Tensor", "SqrtBackward0", "planted: sqrt at zero"),
    ),
    "sqrt_view": (
        ViewDistanceNet,
        1.0,
        Planted("dist", "backward", "aten::div.Tensor", "SqrtBackward0", "planted: sqrt at zero"),
    ),
    "sqrt_inline": (
        InlineSqrtNet,
        1.0,
        Planted(
            "InlineSqrtNet",
            "backward",
            "aten::div.Tensor",
            "SqrtBackward0",
            "planted: sqrt in the root",
        ),
    ),
    "sqrt_second_call": (
        TwiceGainNet,
        1.0,
        Planted("gain", "backward", "aten::div.Tensor", "SqrtBackward0", "planted: sqrt of |w x|"),
    ),
    "sqrt_param": (
        GainNet,
        1.0,
        Planted("gain", "backward", "aten::div.Tensor", "SqrtBackward0", "planted: sqrt of a"),
    ),
}


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    factory = CASES[name][0] if name in CASES else Healthy
    return factory()


def train(model: nn.Module, steps: int, *, scale: float = 1.0, seed: int = 1) -> list[float]:
    """A real SGD loop on batches made here; returns the losses (NaN ones included)."""
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 6, generator=generator) * scale
        y = torch.randn(16, 1, generator=generator)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def same_bits(a: list[float], b: list[float]) -> bool:
    """Equal floats, NaN equal to NaN."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )
