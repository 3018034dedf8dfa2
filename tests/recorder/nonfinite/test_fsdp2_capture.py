"""A non-finite capture under FSDP2 (2 ranks, gloo, torchrun): the capture saves the
module's parameters, which inside a block's forward are the views FSDP2 all-gathered, and
FSDP2 frees them after the forward with ``storage.resize_(0)``. Saving them through
``Tensor.numpy()`` had marked their storage as never to be resized again, and the reshard
raised "Trying to resize storage that is not resizable" on every rank: the recording took
the training down. Here an output overflows at step 2, deterministically."""

from __future__ import annotations

from pathlib import Path

from torchrun import torchrun, unrecorded

import hooktrace

_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


class Amplify(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.scale


dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), Amplify(16)) for _ in range(2)))
for block in model:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.Generator().manual_seed(dist.get_rank())
losses = []
for step in range(3):
    if step == 2:  # finite inputs and parameters, an infinite output: a capture
        with torch.no_grad():
            model[0][2].scale.fill_(3e38)
    loss = model(4 * torch.randn(8, 16, generator=data)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(repr(loss.item()))
with open(f"{sys.argv[1]}.rank{dist.get_rank()}", "w") as out:  # the ranks share one stdout
    out.write(" ".join(losses))
dist.destroy_process_group()
"""


def test_a_capture_under_fsdp2_leaves_the_reshard_and_the_training_as_they_were(
    tmp_path: Path,
) -> None:
    script = tmp_path / "fsdp2_overflow.py"
    script.write_text(_SCRIPT)
    plain = unrecorded(tmp_path, str(script), "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    run = tmp_path / "run"
    record = ["-m", "hooktrace", "record", "-o", str(run)]
    recorded = torchrun(tmp_path, *record, str(script), "--", "recorded")
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    assert "not resizable" not in recorded.stderr
    for rank in (0, 1):
        losses = (tmp_path / f"plain.rank{rank}").read_text().split()
        assert (tmp_path / f"recorded.rank{rank}").read_text().split() == losses
        assert len(losses) == 3 and losses[2] == "nan"
    trace = hooktrace.load(run)
    assert trace.status == "complete"
    captures = trace.nonfinite_captures()
    assert sorted(captures["rank"]) == [0, 1]
    assert set(captures["module"]) == {"0.2"} and set(captures["step"]) == {2}
    # anomalies checks the logical tensors: the overflow planted in 0.2 at step 2 is one
    # finding, its capture named; rank by rank, each rank's
    found = hooktrace.anomalies(run)
    assert found.logical and found.steps == 3
    origins = found.findings[found.findings["kind"].str.startswith("nonfinite")]
    assert len(origins) == 1, origins
    origin = origins.iloc[0]
    assert (origin["module"], origin["step"]) == ("0.2", 2) and origin["capture"]
    apart = hooktrace.anomalies(run, per_rank=True)
    origins = apart.findings[apart.findings["kind"].str.startswith("nonfinite")]
    assert not apart.logical and sorted(origins["rank"]) == [0, 1]
    assert set(origins["module"]) == {"0.2"}
