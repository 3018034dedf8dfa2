"""Train one small model as large ones are trained: in one process, or on several ranks under
torchrun with DDP, FSDP2, tensor parallelism, or FSDP2 and tensor parallelism on a 2x2 mesh.
Every layout sees the same global batch each step (each data-parallel rank its share), so
all of them train to the same numbers, to float rounding.

    hooktrace record -o runs/one examples/distributed.py one
    torchrun --standalone --nproc-per-node 2 -m hooktrace record -o runs/fsdp2 \\
        examples/distributed.py fsdp2
    hooktrace diff runs/one runs/fsdp2           # MATCH: the same training, sharded

Layouts: ``one``; ``ddp``, ``fsdp2`` and ``tp`` on 2 ranks (or more, for ddp and fsdp2);
``fsdp_tp`` on 4. Gloo on the CPU; one thread a rank (``OMP_NUM_THREADS=1``, which
torchrun sets) for bit-identical runs. Two faults can be planted, each at one step:
``--desync-at`` nudges a bias on the last rank only (a replica that came apart, which no loss
curve shows), ``--skew-at`` scales the last data-parallel rank's inputs (its data went wrong).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, OUTPUTS, BATCH = 16, 32, 5, 8  # 5 outputs: shards of uneven rows


class MLP(nn.Module):
    """fc1 -> act -> fc2: (batch, FEATURES) -> (batch, OUTPUTS)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def distribute(model: MLP, layout: str) -> tuple[nn.Module, int, int]:
    """The model laid out over the ranks; the data-parallel degree, and this rank's place."""
    if layout == "one":
        return model, 1, 0
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(model), world, rank
    if layout == "fsdp2":
        for layer in (model.fc1, model.fc2):
            fully_shard(layer)
        fully_shard(model)
        return model, world, rank
    # tensor parallel over pairs of ranks: fc1's columns and fc2's rows split between them
    dp = world // 2
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if layout == "tp":
        return model, 1, 0
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, dp, mesh["dp"].get_local_rank()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", choices=["one", "ddp", "fsdp2", "tp", "fsdp_tp"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--desync-at", type=int, default=-1, metavar="STEP")
    parser.add_argument("--skew-at", type=int, default=-1, metavar="STEP")
    parser.add_argument(
        "--stats", metavar="FILE", help="write torch's own statistics of each step's output"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    model, dp, dp_rank = distribute(MLP(), args.layout)
    data = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    last = dp_rank == dp - 1 and _rank() == _world() - 1
    seen = []
    for step in range(args.steps):
        x = torch.randn(BATCH, FEATURES, generator=data).chunk(dp)[dp_rank]
        y = torch.randn(BATCH, OUTPUTS, generator=data).chunk(dp)[dp_rank]
        if step == args.skew_at and dp_rank == dp - 1:
            x = x * 1.5
        if step == args.desync_at and last:
            with torch.no_grad():
                _inner(model).fc2.bias.add_(1e-3)
        out = model(x)
        out.retain_grad()
        loss = F.mse_loss(out, y)
        loss.backward()
        seen.append({"output": _stats(out.detach()), "grad_output": _stats(out.grad)})
        opt.step()
        opt.zero_grad()
        if _rank() == 0:
            print(f"step {step}: loss {loss.item():.6f}")
    if args.stats and _rank() == 0:
        with open(args.stats, "w") as file:
            json.dump(seen, file)


def _stats(t: torch.Tensor) -> list[float]:
    """mean, std (no correction), min, max and L2 norm of this rank's ``t``."""
    std = t.std(correction=0).item()
    return [t.mean().item(), std, t.min().item(), t.max().item(), t.norm().item()]


def _inner(model: nn.Module) -> MLP:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


if __name__ == "__main__":
    main()
