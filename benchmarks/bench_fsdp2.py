"""Recording overhead per training step under FSDP2 on 2 ranks (gloo, CPU), side by side.

A small transformer (token embedding, blocks of LayerNorm, attention with q/k/v/o projections
and ``scaled_dot_product_attention``, LayerNorm and a GELU feed-forward; ``fully_shard`` on
each block, then on the root), AdamW, each rank a batch of its own. Each repetition times a
window of steady training plain and a window recorded by ``hooktrace.record`` (defaults:
statistics of every module, histograms of parameters and gradients, non-finite capture),
in alternating order, so that the machine's noise falls on both alike; rank 0 prints the
median step time of each and the ratio recorded / plain, paired by repetition.

Run: python benchmarks/bench_fsdp2.py [--reps 5] [--seconds 2] [--ranks 2]
(it starts itself under torchrun, one thread a rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

WARM_UP_STEPS = 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # start under torchrun
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.ranks}", __file__, f"--reps={args.reps}",
                   f"--seconds={args.seconds}"]  # fmt: skip
        return subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    return measure(args.reps, args.seconds)


def measure(reps: int, seconds: float) -> int:
    import torch
    import torch.distributed as dist

    import hooktrace

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(rank)

    def step() -> None:
        tokens = torch.randint(0, 256, (8, 32), generator=data)
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    times: dict[str, list[float]] = {"plain": [], "recorded": []}
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run"
        for rep in range(reps):
            order = ["plain", "recorded"] if rep % 2 == 0 else ["recorded", "plain"]
            for variant in order:
                if variant == "plain":
                    times[variant].append(_window(step, seconds))
                else:
                    with hooktrace.record(model, out, overwrite=True):
                        times[variant].append(_window(step, seconds))
    if rank == 0:
        plain, recorded = times["plain"], times["recorded"]
        ratios = [r / p for r, p in zip(recorded, plain, strict=True)]
        print(f"FSDP2, {dist.get_world_size()} ranks (gloo, CPU), {reps} repetitions:")
        print(f"  plain     {statistics.median(plain) * 1e3:8.2f} ms a step")
        print(f"  recorded  {statistics.median(recorded) * 1e3:8.2f} ms a step")
        low, high = min(ratios), max(ratios)
        print(f"  recorded / plain, paired: {statistics.median(ratios):.2f}x "
              f"(from {low:.2f} to {high:.2f})")  # fmt: skip
    dist.destroy_process_group()
    return 0


def _window(step: Callable[[], None], seconds: float) -> float:
    """Median seconds a step over a window of steady steps, after a few untimed ones. Every
    rank runs the same number of steps (rank 0's count, broadcast): the collectives pair up."""
    import torch
    import torch.distributed as dist

    for _ in range(WARM_UP_STEPS):
        step()
    started = time.perf_counter()
    step()
    once = time.perf_counter() - started
    count = torch.tensor([max(3, int(seconds / max(once, 1e-6)))])
    dist.broadcast(count, 0)
    taken = []
    for _ in range(int(count)):
        started = time.perf_counter()
        step()
        taken.append(time.perf_counter() - started)
    return statistics.median(taken)


def _model() -> object:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Attention(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape

            def split(y: torch.Tensor) -> torch.Tensor:
                return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

            q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = Attention(dim, 4)
            self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.norm1(x))
            return x + self.ff(self.norm2(x))

    class Transformer(nn.Module):
        def __init__(self, dim: int = 64, layers: int = 2) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, dim)
            self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, 256)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    model = Transformer()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


if __name__ == "__main__":
    sys.exit(main())
