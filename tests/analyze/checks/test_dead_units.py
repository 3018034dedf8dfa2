"""hooktrace.dead_relus on real recordings with planted dead units, against plain-torch counts.

The reference: forward hooks of our own count, per step, how many values of each unit were
positive, exactly as the definition says; a dead unit is one that stayed at zero positives
through the last step for at least ``min_steps`` steps, dead since the first of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hooktrace
from hooktrace.errors import ConfigError


class MLP(nn.Module):
    def __init__(self, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.relu1 = act()
        self.fc2 = nn.Linear(32, 32)
        self.relu2 = act()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.relu2(self.fc2(self.relu1(self.fc1(x)))))


class SharedReLU(nn.Module):
    """One ReLU module called twice per forward, on layers of different widths."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.act = nn.ReLU()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc2(self.act(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.relu(self.conv(x))).flatten(1))


def train(
    model: nn.Module,
    out: Path,
    *,
    steps: int = 30,
    probe: Sequence[str] = (),
    on_step: Callable[[int], None] | None = None,
    shape: tuple[int, ...] = (32, 16),
    **record: Any,
) -> dict[str, np.ndarray]:
    """Seeded SGD, recorded into ``out``; returns (steps, units) positive counts per unit of
    each module in ``probe``, counted by our own hooks (channels of 4-D outputs)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts: dict[str, list[torch.Tensor]] = {name: [] for name in probe}

    def counter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            dims = [0, 2, 3] if output.dim() == 4 else list(range(output.dim() - 1))
            counts[name].append((output.detach() > 0).sum(dim=dims))

        return hook

    handles = [model.get_submodule(n).register_forward_hook(counter(n)) for n in probe]
    with hooktrace.record(model, out, **record):
        for step in range(steps):
            if on_step is not None:
                on_step(step)
            x = torch.randn(*shape, generator=generator)
            y = torch.randint(0, 4, (shape[0],), generator=generator)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for handle in handles:
        handle.remove()
    return {name: torch.stack(c).numpy() for name, c in counts.items()}


def reference_dead(positive: np.ndarray, min_steps: int = 3) -> dict[int, int]:
    """unit -> since, from (steps, units) positive counts: zero from `since` to the end."""
    dead = {}
    for unit in range(positive.shape[1]):
        nonzero = np.flatnonzero(positive[:, unit] > 0)
        since = int(nonzero[-1]) + 1 if len(nonzero) else 0
        if len(positive) - since >= min(min_steps, len(positive)):
            dead[unit] = since
    return dead


def negative_bias(layer: nn.Linear | nn.Conv2d, units: slice, value: float = -50.0) -> None:
    with torch.no_grad():
        assert layer.bias is not None
        layer.bias[units] = value


def dead_of(
    result: hooktrace.analyze.checks.dead_units.DeadUnits, module: str, call: int = 0
) -> dict[int, int]:
    units = result.units[(result.units["module"] == module) & (result.units["call"] == call)]
    return dict(zip(units["unit"].astype(int), units["since"].astype(int), strict=True))


# --- 1. a layer with a large negative bias ---------------------------------------------------


@pytest.mark.parametrize("act", [nn.ReLU, nn.LeakyReLU, nn.ReLU6])
def test_large_negative_bias_kills_exactly_those_units(
    tmp_path: Path, act: type[nn.Module]
) -> None:
    model = MLP(act)
    negative_bias(model.fc2, slice(0, 12))
    counts = train(model, tmp_path / "run", probe=["relu1", "relu2"])
    result = hooktrace.dead_relus(tmp_path / "run")

    # the 12 planted units, and any that training killed on its own (as in the healthy twin):
    # our own hooks count them the same way
    expected = reference_dead(counts["relu2"])
    assert {u: expected.get(u) for u in range(12)} == dict.fromkeys(range(12), 0)
    assert len(expected) <= 14
    assert dead_of(result, "relu2") == expected
    assert dead_of(result, "relu1") == reference_dead(counts["relu1"]) == {}
    layers = result.layers.set_index("module")
    assert layers.index.tolist() == ["relu2", "relu1"]  # worst first
    relu2 = layers.loc["relu2"]
    assert (relu2["units"], relu2["dead"], relu2["since"], relu2["flagged"]) == (
        32,
        len(expected),
        0,
        True,
    )
    assert relu2["last_since"] == max(expected.values())
    assert relu2["dead_fraction"] == pytest.approx(len(expected) / 32)
    assert (layers.loc["relu1", "dead"], layers.loc["relu1", "flagged"]) == (0, False)
    assert layers.loc["relu2", "type"] == act.__name__
    # per-unit activity: positives over values, as our own hooks counted them
    units = result.units[result.units["module"] == "relu2"]
    assert np.allclose(units["activity"], counts["relu2"][:, units["unit"]].sum(axis=0) / (30 * 32))
    findings = result.findings()
    assert findings[["kind", "severity", "module", "step", "count"]].values.tolist() == [
        ["dead_layer", "warning", "relu2", 0, len(expected)]
    ]


def test_healthy_twin_flags_nothing(tmp_path: Path) -> None:
    counts = train(MLP(), tmp_path / "run", probe=["relu1", "relu2"])
    result = hooktrace.dead_relus(tmp_path / "run")
    # one unit of 32 is dead from initialisation in this seed, as in most ReLU networks: it is
    # reported, and the layer is not flagged
    assert reference_dead(counts["relu1"]) == {} and reference_dead(counts["relu2"]) == {18: 0}
    assert dead_of(result, "relu2") == {18: 0} and dead_of(result, "relu1") == {}
    assert result.layers["dead"].tolist() == [1, 0] and not result.layers["flagged"].any()
    assert result.flagged.empty and result.findings().empty and len(result) == 0


def test_a_network_without_dead_units(tmp_path: Path) -> None:
    model = MLP()
    with torch.no_grad():
        model.fc2.bias.fill_(0.5)  # every unit of relu2 gets some positive values
    counts = train(model, tmp_path / "run", probe=["relu1", "relu2"])
    assert reference_dead(counts["relu1"]) == reference_dead(counts["relu2"]) == {}
    result = hooktrace.dead_relus(tmp_path / "run")
    assert result.units.empty and result.layers["dead"].tolist() == [0, 0]


# --- since when ------------------------------------------------------------------------------


def test_units_that_die_mid_run_are_dead_since_that_step(tmp_path: Path) -> None:
    model = MLP()
    counts = train(
        model,
        tmp_path / "run",
        probe=["relu2"],
        on_step=lambda step: negative_bias(model.fc2, slice(0, 20)) if step == 15 else None,
    )
    result = hooktrace.dead_relus(tmp_path / "run")
    expected = reference_dead(counts["relu2"])
    alive_before = {u for u in range(20) if counts["relu2"][14, u] > 0}
    assert len(alive_before) >= 18
    assert {u: s for u, s in expected.items() if u in alive_before} == dict.fromkeys(
        alive_before, 15
    )
    assert dead_of(result, "relu2") == expected
    relu2 = result.layers.set_index("module").loc["relu2"]
    assert (relu2["dead"], relu2["flagged"]) == (len(expected), True)
    assert (relu2["since"], relu2["last_since"]) == (min(expected.values()), 15)
    # before they died, only what was dead then
    before = dead_of(hooktrace.dead_relus(tmp_path / "run", steps=(0, 14)), "relu2")
    assert before == reference_dead(counts["relu2"][:15]) and not set(before) & alive_before


def test_min_steps_needs_enough_evidence(tmp_path: Path) -> None:
    model = MLP()
    counts = train(
        model,
        tmp_path / "run",
        steps=20,
        probe=["relu2"],
        on_step=lambda step: negative_bias(model.fc2, slice(0, 20)) if step == 18 else None,
    )
    assert dead_of(hooktrace.dead_relus(tmp_path / "run"), "relu2") == reference_dead(
        counts["relu2"], 3
    )
    assert len(reference_dead(counts["relu2"], 3)) < 20  # two steps are not enough
    two = hooktrace.dead_relus(tmp_path / "run", min_steps=2)
    assert dead_of(two, "relu2") == reference_dead(counts["relu2"], 2)
    alive_before = {u for u in range(20) if counts["relu2"][17, u] > 0}
    assert {u for u, s in dead_of(two, "relu2").items() if s == 18} >= alive_before


def test_many_segments_give_the_same_answer(tmp_path: Path) -> None:
    """A tiny write buffer puts every step in its own HDF5 segment: the streaming must agree.
    (Slow: with a full buffer the writer waits for its flush timer, about 1 s a step.)"""
    results = []
    for name, options in (("one", {}), ("many", {"buffer_mb": 0.0001})):
        model = MLP()
        train(
            model,
            tmp_path / name,
            steps=7,
            on_step=lambda step, model=model: (
                negative_bias(model.fc2, slice(3, 11)) if step == 3 else None
            ),
            **options,
        )
        results.append(hooktrace.dead_relus(tmp_path / name))
    segments = hooktrace.load(tmp_path / "many").query(columns=["segment"])["segment"].nunique()
    assert segments == 7
    assert results[0].layers.equals(results[1].layers) and results[0].units.equals(results[1].units)
    assert {
        u: s for u, s in dead_of(results[1], "relu2").items() if u in range(3, 11)
    } == dict.fromkeys(range(3, 11), 3)


# --- units are channels, calls are layers ----------------------------------------------------


def test_conv_units_are_channels(tmp_path: Path) -> None:
    model = CNN()
    negative_bias(model.conv, slice(0, 3), value=-100.0)
    counts = train(model, tmp_path / "run", steps=10, shape=(4, 3, 28, 28), probe=["relu"])
    result = hooktrace.dead_relus(tmp_path / "run")
    assert dead_of(result, "relu") == reference_dead(counts["relu"]) == dict.fromkeys(range(3), 0)
    relu = result.layers.set_index("module").loc["relu"]
    assert (relu["units"], relu["dead"]) == (8, 3)
    row = hooktrace.load(tmp_path / "run").record("relu", "output", step=0)
    assert (row["units"], row["unit_size"]) == (8, 4 * 26 * 26)  # reference case 3


def test_a_shared_relu_is_one_layer_per_call(tmp_path: Path) -> None:
    model = SharedReLU()
    negative_bias(model.fc2, slice(0, 10))
    train(model, tmp_path / "run", steps=10)
    result = hooktrace.dead_relus(tmp_path / "run")
    assert result.layers[["module", "call", "units", "dead"]].values.tolist() == [
        ["act", 1, 16, 10],
        ["act", 0, 32, 0],
    ]
    assert dead_of(result, "act", call=1) == dict.fromkeys(range(10), 0)


# --- nothing to analyse, bad options ---------------------------------------------------------


def test_no_relu_and_no_activity(tmp_path: Path) -> None:
    train(MLP(nn.Tanh), tmp_path / "tanh", steps=2)
    result = hooktrace.dead_relus(tmp_path / "tanh")
    assert result.layers.empty and "no ReLU-family modules" in result.notes[0]
    train(MLP(), tmp_path / "relu", steps=2)
    eval_only = hooktrace.dead_relus(tmp_path / "relu", phases=["eval"])
    assert eval_only.layers.empty and "no per-unit activity" in eval_only.notes[0]


@pytest.mark.parametrize(
    "options",
    [{"threshold": 0}, {"threshold": 2}, {"layer_threshold": 1}, {"min_steps": 0}, {"steps": "x"}],
)
def test_bad_options(tmp_path: Path, options: dict[str, Any]) -> None:
    train(MLP(), tmp_path / "run", steps=1)
    with pytest.raises(ConfigError):
        hooktrace.dead_relus(tmp_path / "run", **options)


def test_ranks_are_summed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit is dead only where it is dead on every rank (each rank sees its own data)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, dead in ((0, slice(0, 12)), (1, slice(0, 6))):
        monkeypatch.setenv("RANK", str(rank))
        model = MLP()
        negative_bias(model.fc2, dead)
        train(model, tmp_path / "run", steps=8)
    trace = hooktrace.load(tmp_path / "run")
    assert trace.ranks == [0, 1]
    result = hooktrace.dead_relus(trace)
    assert set(range(6)) <= set(dead_of(result, "relu2")) and not set(range(6, 12)) & set(
        dead_of(result, "relu2")
    )
    assert result.layers.set_index("module").loc["relu2", "steps"] == 8
