"""Data-parallel and sharded training recorded trains bit-identically to the same training
unrecorded, in each layout a trainer uses: DDP (2 ranks), FSDP2 (2 ranks), tensor parallelism (2
ranks) and FSDP2 + tensor parallelism on a 2x2 mesh (4 ranks), and FSDP2 and tensor parallelism
compiled by inductor, as trainers run them (with statistics only, and with the graphs' variant
that returns their values: a full step, histograms of outputs); gloo, torchrun, one thread a
rank. The same losses on every rank, the same final parameters, gathered whole, and the same
checkpoints (torch.distributed.checkpoint's, of the model and the optimizer, and a full state
dict). The recorder reads each DTensor's local shard (and saves a capture's parameters) without
touching what FSDP2 and tensor parallelism do with their storages and collectives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrun import torchrun, unrecorded

import hooktrace

_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

layout = sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(  # "0" holds the colwise layer: its output is TP's local tensor
    nn.Sequential(nn.Linear(16, 32)), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16),
    nn.Linear(16, 5))
dp_mesh = None
if layout == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
elif layout != "fsdp2":  # tensor parallel over pairs of ranks: 0 by columns, 2 by rows
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0.0": ColwiseParallel(), "2": RowwiseParallel()})
    dp_mesh = mesh["dp"]
if "fsdp" in layout:
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
if sys.argv[3:] == ["compiled"]:  # the whole model, sharded or parallelised: DTensors inside
    model = torch.compile(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(rank if dp_mesh is None else dp_mesh.get_local_rank())
losses = []
for step in range(4):
    loss = model(torch.randn(8, 16, generator=data)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(repr(loss.item()))
with open(f"{sys.argv[1]}.rank{rank}", "w") as out:  # the ranks share one stdout
    out.write(" ".join(losses))
from torch._dynamo.utils import counters
with open(f"{sys.argv[1]}.graphs{rank}", "w") as out:  # graphs compiled, and graph breaks
    out.write(f"{counters['stats']['unique_graphs']} {sum(counters['graph_break'].values())}")
whole = {  # TP leaves the LayerNorm and the last layer plain tensors, whole on every rank
    name: p.full_tensor() if isinstance(p, DTensor) else p.detach()
    for name, p in model.named_parameters()
}
if rank == 0:
    torch.save(whole, sys.argv[1])
# checkpoints as trainers write them: sharded (torch.distributed.checkpoint), and whole
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict)
state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
dcp.save(state, checkpoint_id=f"{sys.argv[1]}.dcp")
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    torch.save(full, f"{sys.argv[1]}.full")
dist.barrier()  # every rank done with its collectives before gloo is torn down
dist.destroy_process_group()
"""


_VALUES = ("--full-steps", "2", "--histograms", "output,grad_output,param,grad_param")
"""Options that make a compiled graph run its variant that returns its values and their
gradients (a full step, histograms of outputs at every step)."""


@pytest.mark.parametrize(
    ("layout", "ranks", "how", "options"),
    [("ddp", 2, "eager", ()), ("fsdp2", 2, "eager", ()), ("tp", 2, "eager", ()),
     ("fsdp_tp", 4, "eager", ()), ("fsdp2", 2, "compiled", ()),
     ("tp", 2, "compiled", (*_VALUES, "--inputs")), ("fsdp2", 2, "compiled", _VALUES)],
)  # fmt: skip
def test_sharded_training_trains_bit_identically_recorded(
    tmp_path: Path, layout: str, ranks: int, how: str, options: tuple[str, ...]
) -> None:
    script = tmp_path / "sharded.py"
    script.write_text(_SCRIPT)
    plain = unrecorded(tmp_path, str(script), str(tmp_path / "plain.pt"), layout, how, ranks=ranks)
    assert plain.returncode == 0, plain.stderr[-3000:]
    record = ["-m", "hooktrace", "record", "-q", "-o", str(tmp_path / "run"), *options]
    recorded = torchrun(
        tmp_path, *record, str(script), "--", str(tmp_path / "recorded.pt"), layout, how,
        ranks=ranks,
    )  # fmt: skip
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    for rank in range(ranks):
        losses = (tmp_path / f"plain.pt.rank{rank}").read_text().split()
        assert len(losses) == 4
        assert (tmp_path / f"recorded.pt.rank{rank}").read_text().split() == losses
        # the same graphs, and no graph break added (one was, at a DTensor's mark)
        graphs = (tmp_path / f"plain.pt.graphs{rank}").read_text()
        assert (tmp_path / f"recorded.pt.graphs{rank}").read_text() == graphs
        assert (graphs != "0 0") == (how == "compiled"), graphs
    expected, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "recorded.pt")
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for name in ("plain", "recorded"):
        dcp_to_torch_save(tmp_path / f"{name}.pt.dcp", tmp_path / f"{name}.dcp.pt")
    for suffix in (".dcp.pt", ".pt.full"):
        expected, got = (torch.load(tmp_path / f"{n}{suffix}") for n in ("plain", "recorded"))
        assert _flat(expected).keys() == _flat(got).keys() and _flat(expected)
        for key, value in _flat(expected).items():
            assert _same(_flat(got)[key], value), (suffix, key)
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "complete" and hooktrace.check(trace).whole
    params = trace.query(
        kinds=["param"], columns=["rank", "step", "placements", "mean"], logical=False
    )
    assert len(params) == ranks * 4 * 8 and params["mean"].notna().all()
    sharded = params["placements"].str.contains("S(", regex=False)
    if layout == "ddp":
        assert not sharded.any()
    else:
        assert sharded.all() if "fsdp" in layout else sharded.any()  # TP: LayerNorm whole
    # compiled or not, every layer's output and its gradient, each step, on every rank
    outputs = trace.query(
        kinds=["output", "grad_output"], columns=["rank", "module", "kind"], logical=False
    )
    counted = outputs.groupby(["rank", "module", "kind"], observed=True).size()
    counted = counted[counted > 0]
    expected = {
        (rank, m, kind)
        for rank in range(ranks)
        for m in ("0", "0.0", "1", "2", "3", "4")
        for kind in ("output", "grad_output")
    }
    assert {i for i in counted.index if i[1] != "Sequential"} == expected
    assert (counted[list(expected)] == 4).all()  # one a step
    assert "hooktrace:" not in recorded.stderr  # nothing it could not record (FSDP2 compiled
    assert hooktrace.summary(trace).notes == {}  # was said to run graphs compiled before)
    if options:  # inside the graph: each local shard saved whole at step 2, and histogrammed
        at_two = trace.query(
            kinds=["output", "grad_output"], steps=[2], logical=False,
            columns=["rank", "module", "kind", "tensor_key"],
        )  # fmt: skip
        saved = at_two[at_two["tensor_key"] != ""]
        assert {(int(r), m, k) for r, m, k, _ in saved.itertuples(index=False)} >= expected
        hist = trace.histograms()
        inside = hist[hist["kind"].isin(["output", "grad_output"])]
        assert set(zip(inside["module"], inside["kind"], strict=True)) >= {
            (m, kind)
            for m in ("0", "0.0", "1", "2", "3", "4")
            for kind in ("output", "grad_output")
        }
    if "--inputs" in options:  # every module's argument, as the call got it: the plain
        # tensor, before tensor parallelism's own pre-hooks make it a DTensor (as eager)
        inputs = trace.query(
            kinds=["input"], logical=False, columns=["rank", "module", "shape", "placements"]
        )
        got = inputs.groupby(["rank", "module"], observed=True).size()
        assert {(int(r), m) for r, m in got.index if m != "Sequential"} == {
            (rank, m) for rank in range(ranks) for m in ("0", "0.0", "1", "2", "3", "4")
        }
        assert (got == 4).all() and set(inputs["shape"]) == {"8,16"}
        assert set(inputs["placements"]) == {""}
    if layout == "tp":  # each DTensor output and gradient placed, compiled or not: by hand
        placed = trace.query(
            kinds=["output", "grad_output"], modules=["0", "0.0", "2"], steps=[0], logical=False,
            columns=["rank", "module", "kind", "shape", "logical_shape", "placements",
                     "shard_offset"],
        )  # fmt: skip
        assert {(int(row[0]), *map(str, row[1:])) for row in placed.itertuples(index=False)} == {
            (0, "0.0", "output", "8,16", "8,32", "S(1)", "0,0"),
            (1, "0.0", "output", "8,16", "8,32", "S(1)", "0,16"),
            (0, "0.0", "grad_output", "8,16", "8,32", "S(1)", "0,0"),
            (1, "0.0", "grad_output", "8,16", "8,32", "S(1)", "0,16"),
            # the layer around it returns the local tensor tensor parallelism hands on
            (0, "0", "output", "8,16", "", "", ""),
            (1, "0", "output", "8,16", "", "", ""),
            (0, "0", "grad_output", "8,16", "", "", ""),
            (1, "0", "grad_output", "8,16", "", "", ""),
            (0, "2", "output", "8,16", "8,16", "P(sum)", "0,0"),
            (1, "2", "output", "8,16", "8,16", "P(sum)", "0,0"),
            (0, "2", "grad_output", "8,16", "8,16", "R", "0,0"),
            (1, "2", "grad_output", "8,16", "8,16", "R", "0,0"),
        }


def _flat(state: object, prefix: str = "") -> dict[str, object]:
    """The leaves of a nested state dict (tensors, and plain values), by dotted key."""
    if isinstance(state, dict):
        return {
            k: v for key, sub in state.items() for k, v in _flat(sub, f"{prefix}{key}.").items()
        }
    if isinstance(state, (list, tuple)):
        return {k: v for i, sub in enumerate(state) for k, v in _flat(sub, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): state}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def test_a_recording_imports_no_distributed_module_the_script_did_not() -> None:
    """Recording a model in one process leaves torch.distributed.tensor unimported (the
    compiled graphs' DTensor check imported it: a second of start-up, and a module the
    script could see)."""
    import subprocess
    import sys

    script = (
        "import sys, tempfile, torch, hooktrace\n"
        "from torch import nn\n"
        "model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())\n"
        "with hooktrace.record(model, tempfile.mkdtemp() + '/run'):\n"
        "    model(torch.randn(1, 2)).sum().backward()\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
