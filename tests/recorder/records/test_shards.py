"""FSDP2's parameters and gradients, recorded from each rank's local shard (2 ranks, gloo,
torchrun): every record holds its shard's statistics and says what it is a part of, and the
shards' statistics merge into the logical tensor's, checked against ``full_tensor()``'s.
Before, every such record was empty ("skipped: tensor subclass DTensor")."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from torchrun import torchrun

import hooktrace

_SCRIPT = """
import json
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def stats(t):
    t = t.detach().double()
    return {"numel": t.numel(), "mean": t.mean().item(), "std": t.std(correction=0).item(),
            "min": t.min().item(), "max": t.max().item(), "norm": t.norm().item(),
            "zeros": int((t == 0).sum())}


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))  # 5 rows: uneven
with torch.no_grad():
    model[0].bias[:4] = 0  # zeros to count
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(rank)
truth = []
for step in range(3):
    params = {n: stats(p.full_tensor()) for n, p in model.named_parameters()}
    model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
    grads = {n: stats(p.grad.full_tensor()) for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    truth.append({"param": params, "grad_param": grads})
if rank == 0:
    print(json.dumps(truth))
dist.destroy_process_group()
"""

_COLUMNS = ["rank", "step", "module", "kind", "slot", "shape", "numel", "mean", "std", "min",
            "max", "norm", "zero_fraction", "nan_count", "inf_count", "note", "logical_shape",
            "mesh_shape", "mesh_coord", "placements", "shard_offset"]  # fmt: skip


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[hooktrace.Trace, list]:
    where = tmp_path_factory.mktemp("fsdp2")
    (where / "shards.py").write_text(_SCRIPT)
    done = torchrun(
        where, "-m", "hooktrace", "record", "-q", "-o", str(where / "run"), str(where / "shards.py")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return hooktrace.load(where / "run"), json.loads(done.stdout)


def _merged(shards: pd.DataFrame) -> dict[str, float]:
    """The logical tensor's statistics from its shards': counts and extremes added up and
    taken over, mean and variance by Chan's formula (the records' std has no correction)."""
    n = shards["numel"].to_numpy(np.float64)
    means = shards["mean"].to_numpy()
    mean = float((n * means).sum() / n.sum())
    m2 = (n * shards["std"].to_numpy() ** 2 + n * (means - mean) ** 2).sum()
    return {
        "numel": int(n.sum()),
        "mean": mean,
        "std": math.sqrt(m2 / n.sum()),
        "min": float(shards["min"].min()),
        "max": float(shards["max"].max()),
        "norm": math.sqrt(float((shards["norm"] ** 2).sum())),
        "zeros": round(float((n * shards["zero_fraction"]).sum())),
    }


def test_each_shard_says_what_it_is_a_part_of(recorded: tuple[hooktrace.Trace, list]) -> None:
    trace, _ = recorded
    records = trace.query(columns=_COLUMNS, kinds=["param", "grad_param"], logical=False)
    assert not records["note"].str.startswith("skipped").any()
    assert (records["placements"] == "S(0)").all() and (records["mesh_shape"] == "2").all()
    assert (records["mesh_coord"] == records["rank"].astype(str)).all()
    weight = records[(records["module"] == "2") & (records["slot"] == "weight")]
    by_rank = weight.groupby("rank")[["shape", "logical_shape", "shard_offset"]].first()
    # 5 rows over 2 ranks: 3 and 2, as torch.chunk splits them
    assert by_rank.loc[0].tolist() == ["3,32", "5,32", "0,0"]
    assert by_rank.loc[1].tolist() == ["2,32", "5,32", "3,0"]
    # the activations are plain tensors: whole, with empty shard columns
    outputs = trace.query(columns=_COLUMNS, kinds=["output"], logical=False)
    assert len(outputs) and (outputs["logical_shape"] == "").all()


@pytest.mark.parametrize("kind", ["param", "grad_param"])
def test_the_shards_merge_into_the_full_tensors_statistics(
    recorded: tuple[hooktrace.Trace, list], kind: str
) -> None:
    trace, truth = recorded
    records = trace.query(columns=_COLUMNS, kinds=[kind], logical=False)
    checked = 0
    for (step, module, slot), shards in records.groupby(["step", "module", "slot"]):
        assert sorted(shards["rank"]) == [0, 1]
        assert (shards[["nan_count", "inf_count"]] == 0).all().all()
        expected = truth[step][kind][f"{module}.{slot}"]
        merged = _merged(shards)
        assert merged["numel"] == expected["numel"] and merged["zeros"] == expected["zeros"]
        for name in ("mean", "std", "min", "max", "norm"):
            assert merged[name] == pytest.approx(expected[name], rel=1e-6, abs=1e-9), name
        checked += 1
    assert checked == 3 * 4  # 3 steps, 4 parameters
    if kind == "param":  # zeros were planted in the first layer's bias
        assert truth[0]["param"]["0.bias"]["zeros"] == 4


def test_the_shards_histograms_add_up_to_the_logical_tensors_values(
    recorded: tuple[hooktrace.Trace, list],
) -> None:
    trace, truth = recorded
    counts = trace.histograms(logical=False)
    counts = counts[counts["kind"] == "param"]
    assert len(counts)
    counted = counts[["zero", "nan", "pos_inf", "neg_inf"]].sum(axis=1)
    counted += np.stack(counts["pos"]).sum(axis=1) + np.stack(counts["neg"]).sum(axis=1)
    counts = counts.assign(counted=counted)
    for (step, module, slot), shards in counts.groupby(["step", "module", "slot"]):
        assert shards["counted"].sum() == truth[step]["param"][f"{module}.{slot}"]["numel"]
    # as logical tensors (the default of a run of several ranks): one histogram a parameter
    whole = trace.histograms(kinds=["param"])
    assert len(whole) == len(counts.groupby(["step", "module", "slot"]))
    for row in whole.itertuples():
        counted = row.zero + row.nan + row.pos_inf + row.neg_inf + row.pos.sum() + row.neg.sum()
        assert counted == row.numel == truth[row.step]["param"][f"{row.module}.{row.slot}"]["numel"]
