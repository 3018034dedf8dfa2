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

layout = sys.argv[1]  # one | fsdp2 | ddp | tp | fsdp_tp
plant = int(os.environ.get("PLANT_STEP", "-1"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))  # 5 rows: uneven shards
data = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 16, generator=data), torch.randn(8, 5, generator=data))
           for _ in range(4)]
rank, dp, dp_rank = 0, 1, 0
if layout != "one":
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if layout == "fsdp2":
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        dp, dp_rank = world, rank
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        dp, dp_rank = world, rank
    else:  # tensor parallel over 2 ranks; fsdp_tp: with FSDP2 over the other 2
        dp = world // 2
        mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if dp > 1:
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            dp_rank = mesh["dp"].get_local_rank()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
truth = []
for step, (x, y) in enumerate(batches):
    x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
    if step == plant and dp_rank == dp - 1:
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
    for layout, ranks, env in (
        ("fsdp2", 2, {}), ("ddp", 2, {"PLANT_STEP": "3"}), ("tp", 2, {}), ("fsdp_tp", 4, {})
    ):  # fmt: skip
        done = torchrun(where, *record, layout, "train.py", layout, env=env, ranks=ranks)
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


@pytest.mark.parametrize("layout", ["tp", "fsdp_tp"])
def test_tensor_parallel_runs_match_one_process(runs: tuple[Path, list], layout: str) -> None:
    """Colwise and rowwise layers on 2 ranks, alone and under FSDP2 on a 2x2 mesh: every
    logical tensor matches; the rowwise layer's output, a partial sum on each rank until
    its reduction, is set aside with a note."""
    where, _ = runs
    result = hooktrace.diff(where / "one", where / layout)
    assert result.match and not result.structure.differs, result
    assert result.records == 4 * 15  # all but the rowwise layer's output
    assert "partial sums" in result.notes[1]


def test_what_tensor_parallelism_hands_between_its_layers(runs: tuple[Path, list]) -> None:
    where, _ = runs
    trace = hooktrace.load(where / "tp")
    step = trace.query(steps=[0], kinds=["output"])
    placed = step.groupby("module", observed=True)["placements"].agg(set)
    assert placed["0"] == {"S(1)"}  # ColwiseParallel's output, a DTensor at the boundary
    assert placed["2"] == {"P(sum)"}  # RowwiseParallel's, before its reduction
    assert placed["1"] == {""}  # the ReLU between them gets the local shard, a plain tensor
    # the model's output is the reduction's pending result: summarised once it is done
    # (it was skipped, "tensor subclass AsyncCollectiveTensor")
    root = step[step["module"] == "Sequential"]
    assert (root["note"] == "").all() and root["mean"].notna().all()
    logical = trace.query(steps=[0], modules=["1"], logical=True)
    one = hooktrace.load(where / "one").query(steps=[0], modules=["1"])
    assert (logical["merged"] == "local shards").all()
    assert (logical["shape"] == "8,16+8,16").all()  # where each shard lies is not recorded
    assert logical["norm"].to_numpy() == pytest.approx(one["norm"].to_numpy(), rel=1e-6)


def test_each_rank_says_where_it_sits_among_the_data_parallel_ranks(
    runs: tuple[Path, list],
) -> None:
    where, _ = runs
    expected = {
        "one": None,
        "ddp": {0: 0, 1: 1},
        "fsdp2": {0: 0, 1: 1},
        "tp": {0: 0, 1: 0},
        "fsdp_tp": {0: 0, 1: 0, 2: 1, 3: 1},
    }
    assert {name: hooktrace.load(where / name).layout for name in expected} == expected
