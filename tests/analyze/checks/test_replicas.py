"""``replicas_differ`` (hooktrace.analyze.checks.replicas) on a real DDP run (2 ranks, gloo,
torchrun): rank 1 nudges one bias of its replica at step 3, as a desynchronised rank would.
Beside it each rank trains a model of its own, seeded by rank: its parameters differ from
the start, as a hand-written tensor parallelism's shards would, and are no replicas."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun import torchrun

import hooktrace

_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
torch.manual_seed(100 + rank)
own = nn.Linear(4, 2)  # a model of each rank's own
opt = torch.optim.SGD([*model.parameters(), *own.parameters()], lr=0.1)
data = torch.Generator().manual_seed(rank)
for step in range(6):
    if step == 3 and rank == 1:
        with torch.no_grad():
            model.module[2].bias.add_(1e-3)
    x = torch.randn(5, 4, generator=data)
    (model(x).pow(2).mean() + own(x).pow(2).mean()).backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("replicas")
    (where / "ddp.py").write_text(_SCRIPT)
    done = torchrun(
        where, "-m", "hooktrace", "record", "-q", "-o", str(where / "run"), str(where / "ddp.py")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return where / "run"


def test_a_replica_nudged_on_one_rank_is_found_at_its_step(run: Path) -> None:
    found = hooktrace.anomalies(run).findings
    apart = found[found["kind"] == "replicas_differ"]
    assert len(apart) == 1
    row = apart.iloc[0]
    assert (row["module"], row["slot"], row["step"], row["severity"]) == ("2", "bias", 3, "error")
    assert row["count"] == 3  # steps 3, 4 and 5: SGD keeps the two copies apart
    assert row["value"] > 1e-3
    assert "on rank 0" in row["evidence"] and "on rank 1" in row["evidence"]
    # the ranks' own models differ from their first step: no replicas, no finding
    assert not (found["module"] == "Linear").any()


def test_steps_before_the_nudge_hold_no_finding(run: Path) -> None:
    found = hooktrace.anomalies(run, steps="0-2").findings
    assert not (found["kind"] == "replicas_differ").any()
    later = hooktrace.anomalies(run, steps=[4, 5]).findings
    assert later.loc[later["kind"] == "replicas_differ", "step"].tolist() == [4]


def test_a_run_of_one_rank_has_no_replicas(tmp_path: Path) -> None:
    from recorded_runs import MLP, train

    train(MLP(), tmp_path / "one", steps=3)
    found = hooktrace.anomalies(tmp_path / "one").findings
    assert not (found["kind"] == "replicas_differ").any()


def test_dtensor_replicas_of_a_shard_nudged_on_one_rank(tmp_path: Path) -> None:
    """FSDP2 + tensor parallelism on a 2x2 mesh (examples/distributed.py fsdp_tp): fc2's
    bias is sharded over the data-parallel ranks and replicated over each pair of
    tensor-parallel peers (placements S(0),R). Rank 3 nudges its shard at step 3: its peer,
    rank 2, holds the same shard offset, and the two came apart there. No rank holds a
    replica of any other parameter."""
    example = Path(__file__).resolve().parents[3] / "examples" / "distributed.py"
    record = ["-m", "hooktrace", "record", "-q", "-o", str(tmp_path / "run")]
    done = torchrun(tmp_path, *record, str(example), "fsdp_tp", "--desync-at", "3", ranks=4)
    assert done.returncode == 0, done.stderr[-3000:]
    params = hooktrace.load(tmp_path / "run").query(kinds=["param"], steps=[0], logical=False)
    bias = params[(params["module"] == "fc2") & (params["slot"] == "bias")]
    assert set(bias["placements"]) == {"S(0),R"}
    found = hooktrace.anomalies(tmp_path / "run").findings
    apart = found[found["kind"] == "replicas_differ"]
    assert len(apart) == 1, found
    row = apart.iloc[0]
    assert (row["module"], row["slot"], row["step"], row["count"]) == ("fc2", "bias", 3, 3)
    assert "on rank 2" in row["evidence"] and "on rank 3" in row["evidence"]
