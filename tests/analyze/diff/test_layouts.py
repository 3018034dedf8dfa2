"""``hooktrace diff`` across layouts: the same model and global batch trained in one process,
under FSDP2 on 2 ranks and under DDP on 2 ranks (each rank half the batch; gloo, torchrun),
compared as logical tensors with no option. The ground truth is the one process's own
statistics of the model's output and its gradient, computed by the script in torch, and
the one-process recording."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from torchrun import torchrun

import hooktrace
from hooktrace.cli import cli

_SCRIPT = """
import json, os, sys
import torch
from torch import nn

layout = sys.argv[1]  # one | fsdp2 | ddp
plant = int(os.environ.get("PLANT_STEP", "-1"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))  # 5 rows: uneven shards
data = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 16, generator=data), torch.randn(8, 5, generator=data))
           for _ in range(4)]
rank, world = 0, 1
if layout != "one":
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
truth = []
for step, (x, y) in enumerate(batches):
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    if step == plant and rank == world - 1:
        x = x * 1.5
    out = model(x)
    out.retain_grad()
    nn.functional.mse_loss(out, y).backward()
    stats = lambda t: [t.mean().item(), t.std(correction=0).item(), t.min().item(),
                       t.max().item(), t.norm().item()]
    truth.append({"output": stats(out.detach()), "grad_output": stats(out.grad)})
    opt.step()
    opt.zero_grad()
if rank == 0:
    print(json.dumps(truth))
"""

_STATS = ["mean", "std", "min", "max", "norm"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """``one``, ``fsdp2`` and ``ddp``; in ``ddp``, rank 1's inputs are scaled at step 3: a
    change planted in one layout. With the one process's truth, step by step."""
    where = tmp_path_factory.mktemp("layouts")
    (where / "train.py").write_text(_SCRIPT)
    record = ["-m", "hooktrace", "record", "-q", "-o"]
    one = subprocess.run(
        [sys.executable, *record, "one", "train.py", "one"],
        capture_output=True, text=True, cwd=where, timeout=300,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    for layout, env in (("fsdp2", {}), ("ddp", {"PLANT_STEP": "3"})):
        done = torchrun(where, *record, layout, "train.py", layout, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    return where, json.loads(one.stdout)


def test_one_process_and_fsdp2_match_as_logical_tensors(runs: tuple[Path, list]) -> None:
    where, _ = runs
    result = hooktrace.diff(where / "one", where / "fsdp2")
    assert result.match and result.first is None, result
    # every record of the one process paired with a logical one: 4 parameters, their
    # gradients, 4 outputs (three layers and the root) and their gradients, 4 steps
    assert result.records == len(hooktrace.load(where / "one").records) == 4 * 16
    assert not result.structure.differs
    assert "compared logical tensors (run A one rank and run B 2 ranks)" in result.notes[0]


def test_ddp_matches_until_the_step_a_change_was_planted(runs: tuple[Path, list]) -> None:
    where, _ = runs
    before = hooktrace.diff(where / "one", where / "ddp", steps="0-2")
    assert before.match and before.records == 3 * 16
    result = hooktrace.diff(where / "one", where / "ddp")
    assert not result.match and result.first is not None
    assert (result.first.step, result.first.module, result.first.kind) == (3, "0", "output")


def test_the_logical_view_holds_the_one_processs_own_numbers(runs: tuple[Path, list]) -> None:
    """The last layer's output and its gradient, pooled over the ranks' halves of the batch
    (the gradient divided by 2), against torch's statistics of the whole batch's."""
    where, truth = runs
    for layout in ("fsdp2", "ddp"):
        logical = hooktrace.load(where / layout).query(
            modules=["2"], kinds=["output", "grad_output"], steps=(0, 2), logical=True
        )
        assert len(logical) == 3 * 2
        for row in logical.itertuples():
            assert (row.shape, row.numel, row.ranks, row.dp, row.merged) == (
                "8,5",
                40,
                2,
                2,
                "batch",
            )
            got = [getattr(row, name) for name in _STATS]
            assert got == pytest.approx(truth[row.step][row.kind], rel=1e-5, abs=1e-9), (
                layout,
                row,
            )


def test_parameters_count_once_whether_sharded_or_replicated(runs: tuple[Path, list]) -> None:
    where, _ = runs
    one = hooktrace.load(where / "one").query(kinds=["param", "grad_param"])
    for layout, merged in (("fsdp2", "shards"), ("ddp", "replicas")):
        trace = hooktrace.load(where / layout)
        logical = trace.query(kinds=["param", "grad_param"], logical=True)
        assert len(logical) == len(one) and set(logical["merged"]) == {merged}
        assert (logical["shape"].to_numpy() == one["shape"].to_numpy()).all()
        assert (logical["logical_shape"] == "").all() and (logical["ranks"] == 2).all()
        # the SQL view says the same
        viewed = trace.sql(
            "SELECT count(*) AS n, count(DISTINCT merged) AS how FROM logical_records "
            "WHERE kind IN ('param', 'grad_param')"
        )
        assert viewed.iloc[0].tolist() == [len(one), 1]


def test_per_rank_compares_rank_with_rank(runs: tuple[Path, list]) -> None:
    where, _ = runs
    result = hooktrace.diff(where / "one", where / "fsdp2", per_rank=True)
    assert not result.match
    assert result.structure.records_only_b == 64  # rank 1's records: the one process has no rank 1
    assert not any("logical" in note for note in result.notes)


def test_the_cli_compares_layouts_with_no_option(runs: tuple[Path, list]) -> None:
    where, _ = runs
    runner = CliRunner()
    done = runner.invoke(cli, ["diff", str(where / "one"), str(where / "fsdp2")])
    assert done.exit_code == 0, done.output
    assert done.output.startswith("MATCH") and "compared logical tensors" in done.output
    apart = runner.invoke(cli, ["diff", str(where / "one"), str(where / "fsdp2"), "--per-rank"])
    assert apart.exit_code == 1, apart.output


def test_a_sharded_model_is_named_as_in_one_process(runs: tuple[Path, list]) -> None:
    """fully_shard swaps the root's class for FSDPSequential: the root is still Sequential."""
    where, _ = runs
    modules = hooktrace.load(where / "fsdp2").modules
    root = modules[modules["depth"] == 0].iloc[0]
    assert (root["module"], root["type"]) == ("Sequential", "torch.nn.modules.container.Sequential")
