"""FSDP2 training (2 ranks, gloo, torchrun, one thread a rank) recorded trains bit-identically
to the same training unrecorded: the same losses on every rank and the same final parameters,
gathered whole. The recorder reads each DTensor's local shard (and saves a capture's
parameters) without touching what FSDP2 does with its storages."""

from __future__ import annotations

from pathlib import Path

import torch
from torchrun import torchrun

import hooktrace

_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))
for layer in (model[0], model[3]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(rank)
losses = []
for step in range(4):
    loss = model(torch.randn(8, 16, generator=data)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(repr(loss.item()))
with open(f"{sys.argv[1]}.rank{rank}", "w") as out:  # the ranks share one stdout
    out.write(" ".join(losses))
whole = {name: p.full_tensor() for name, p in model.named_parameters()}
if rank == 0:
    torch.save(whole, sys.argv[1])
dist.destroy_process_group()
"""


def test_fsdp2_trains_bit_identically_recorded(tmp_path: Path) -> None:
    script = tmp_path / "fsdp2.py"
    script.write_text(_SCRIPT)
    plain = torchrun(tmp_path, str(script), str(tmp_path / "plain.pt"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    record = ["-m", "hooktrace", "record", "-q", "-o", str(tmp_path / "run")]
    recorded = torchrun(tmp_path, *record, str(script), "--", str(tmp_path / "recorded.pt"))
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    for rank in (0, 1):
        losses = (tmp_path / f"plain.pt.rank{rank}").read_text().split()
        assert len(losses) == 4
        assert (tmp_path / f"recorded.pt.rank{rank}").read_text().split() == losses
    expected, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "recorded.pt")
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "complete" and hooktrace.check(trace).whole
    params = trace.query(kinds=["param"], columns=["rank", "step", "placements", "mean"])
    assert len(params) == 2 * 4 * 6 and params["mean"].notna().all()
