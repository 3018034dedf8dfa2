"""The recorder's joint graph pass, as inductor runs it (graphs/joint.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import fx, nn
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass

import hooktrace
from hooktrace.recorder.graphs.joint import joint_pass_available

pytestmark = pytest.mark.skipif(
    not joint_pass_available(), reason="this torch runs no joint pass of the recorder"
)


class Picks(nn.Module):
    """Adds a term ``multinomial`` picks: a draw of its own beside inductor's seeds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.multinomial(torch.softmax(x.detach(), -1), 1).to(x.dtype) * 1e-3


class Seen(CustomGraphPass):
    """A pass of the script's: notes that it ran, and the scheduler's reordering then."""

    def __init__(self) -> None:
        self.reordering: list[bool] = []

    def __call__(self, graph: fx.Graph) -> None:
        self.reordering.append(config.reorder_for_peak_memory)

    def uuid(self) -> None:  # no cache: each compile runs it
        return None


def _step(out: Path | None, joint: Seen, post_grad: Seen) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Picks(), nn.Dropout(0.5), nn.Linear(8, 2))
    run = torch.compile(model)
    with (
        config.patch(joint_custom_post_pass=joint, post_grad_custom_post_pass=post_grad),
        hooktrace.record(model, out, strict=True) if out else contextlib.nullcontext(),
    ):
        run(torch.randn(4, 8)).sum().backward()


def test_a_recorded_forward_that_draws_twice_is_compiled_without_reordering(
    tmp_path: Path,
) -> None:
    """Its forward (the first graph the post-grad pass sees) is scheduled in the graph's
    order; the script's joint pass still runs, before the recorder's; and the setting is the
    script's again once the compile is over."""
    assert config.reorder_for_peak_memory
    joint, post_grad = Seen(), Seen()
    _step(None, joint, post_grad)
    assert post_grad.reordering[0] is True  # unrecorded: inductor's own choice
    joint, post_grad = Seen(), Seen()
    _step(tmp_path / "run", joint, post_grad)
    assert joint.reordering == [True]  # the script's pass ran, before the recorder's
    assert post_grad.reordering[0] is False
    assert config.reorder_for_peak_memory
