"""Write the sample traces in this folder: six small seeded runs of one model.

    python sample_traces/make_samples.py            # rewrite every sample
    python sample_traces/make_samples.py nan dead   # rewrite some

Each run trains the same small residual MLP on a synthetic teacher problem with Adam,
recorded by ``hooktrace.record``; each sample plants one fault at a known module and step
(sample_traces/README.md says which, and the command that finds it). Everything is seeded
and runs on one CPU thread, so regenerating writes the same numbers (only the times and
versions in manifest.json and status/ change).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hooktrace

HERE = Path(__file__).resolve().parent
FEATURES, WIDTH, CLASSES, BATCH = 16, 32, 4, 32
STEPS = 30
LR = 0.01


class NaiveLogSoftmax(nn.Module):
    """log(softmax(x)), written out the naive way: a softmax that underflows to 0 gives -inf.
    (``F.log_softmax`` is the safe spelling; this one is here to have a NaN to find.)"""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(logits, dim=-1))


class Block(nn.Module):
    """x + relu(fc(norm(x))): a pre-norm residual block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(self.norm(x)))


class Net(nn.Module):
    """embed -> blocks.0 -> blocks.1 -> head -> log_probs; (batch, FEATURES) -> (batch, CLASSES)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.Sequential(Block(WIDTH), Block(WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)
        self.log_probs = NaiveLogSoftmax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log_probs(self.head(self.blocks(self.embed(x))))


# A fault is called before each step's forward pass with the step, the model and the batch,
# and returns the batch (changed or not).
Fault = Callable[[int, Net, torch.Tensor], torch.Tensor]


def no_fault(step: int, model: Net, x: torch.Tensor) -> torch.Tensor:
    return x


def eps_from_12(step: int, model: Net, x: torch.Tensor) -> torch.Tensor:
    """From step 12 on, blocks.1.norm divides by sqrt(var + 1e-2) instead of 1e-5."""
    if step == 12:
        model.blocks[1].norm.eps = 1e-2
    return x


def kill_units_at_10(step: int, model: Net, x: torch.Tensor) -> torch.Tensor:
    """At step 10, a bad update pushes half of blocks.0.fc's biases far below zero: those
    units of blocks.0.act never fire again (and so never get a gradient to recover)."""
    if step == 10:
        with torch.no_grad():
            model.blocks[0].fc.bias[: WIDTH // 2] -= 30.0
    return x


def outlier_at_15(step: int, model: Net, x: torch.Tensor) -> torch.Tensor:
    """At step 15 one sample of the batch is scaled by 1000 (a corrupt record): its logits are
    so far apart that the naive softmax underflows to 0 and log(0) = -inf."""
    if step == 15:
        x = x.clone()
        x[0] *= 1000.0
    return x


def no_scale(step: int) -> float:
    return 1.0


def scale_from_20(step: int) -> float:
    """A hand-rolled loss scaler gone wrong: from step 20 the loss is multiplied by a scale
    that grows 10x per step, and the gradients are never unscaled. Adam's update does not
    depend on the gradients' scale, so the loss still looks fine; the gradients explode."""
    return 1.0 if step < 20 else 10.0 ** (step - 19)


def tiny(step: int) -> float:
    """A loss averaged over the whole data set's size (2^16 samples) where the batch's was
    meant: every gradient is 2^-16 of what it should be. Adam's update hardly depends on the
    gradients' scale, so training goes on much as in healthy, in float32; in float16, without
    loss scaling, much of each gradient would fall below 2^-24 and flush to zero."""
    return 2.0**-16


@dataclass(frozen=True)
class Sample:
    fault: Fault = no_fault
    loss_scale: Callable[[int], float] = no_scale
    options: dict[str, Any] = field(default_factory=dict)
    """hooktrace.record options besides the defaults (statistics of every module, histograms
    of parameters and their gradients, each step)"""


FULL = {"full_steps": "0,12", "full_modules": r"^blocks\.1"}  # a few full tensors, for diff
SAMPLES = {
    "healthy": Sample(options=FULL),
    "diverged": Sample(eps_from_12, options=FULL),
    "dead": Sample(kill_units_at_10),
    "nan": Sample(outlier_at_15),
    "exploding": Sample(loss_scale=scale_from_20),
    "underflow": Sample(loss_scale=tiny, options={"histograms": "param,grad_param,grad_output"}),
}


def train(out: Path, sample: Sample) -> list[float]:
    """One seeded run of STEPS Adam steps, recorded into ``out``; returns the losses."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    with hooktrace.record(model, out, overwrite=True, **sample.options):
        for step in range(STEPS):
            x = torch.randn(BATCH, FEATURES, generator=generator)
            y = (x @ teacher).argmax(dim=1)  # the class a fixed linear teacher picks
            x = sample.fault(step, model, x)
            loss = F.nll_loss(model(x), y)
            (loss * sample.loss_scale(step)).backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", help=f"samples to write (default: {', '.join(SAMPLES)})"
    )
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write into")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(SAMPLES))
    if unknown:
        parser.error(f"unknown sample(s) {', '.join(unknown)}: choose from {', '.join(SAMPLES)}")
    torch.set_num_threads(1)  # one thread: the same sums in the same order on every machine
    for name in args.names or list(SAMPLES):
        losses = train(args.out / name, SAMPLES[name])
        shown = "  ".join(
            f"{step}: {loss:.3g}" for step, loss in enumerate(losses) if step % 5 == 4
        )
        print(f"{name:<10} losses  {shown}")


if __name__ == "__main__":
    main()
