"""Train a tiny GPT-style decoder on a noisy repeating token stream.

Written out in full (no nn.MultiheadAttention) so that every projection is its own module:
token + position embeddings, causal self-attention, a GELU MLP, LayerNorm, dropout, and an
lm_head whose weight is tied to the token embedding. Training uses AdamW and gradient
accumulation: --accum micro-batches per optimizer step.

    python examples/tiny_gpt.py --steps 20 --accum 2 --seed 0 --save-params gpt.pt
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 64
WIDTH = 64
NUM_HEADS = 4
NUM_BLOCKS = 2
CONTEXT = 32
DROPOUT = 0.1
BATCH_SIZE = 16  # per micro-batch


def make_token_stream(length: int, *, generator: torch.Generator) -> torch.Tensor:
    """A random 12-token pattern repeated to `length`, with 10% of tokens replaced by noise."""
    pattern = torch.randint(0, VOCAB_SIZE, (12,), generator=generator)
    stream = pattern.repeat(length // len(pattern) + 1)[:length]
    noisy = torch.rand(length, generator=generator) < 0.1
    stream[noisy] = torch.randint(0, VOCAB_SIZE, (int(noisy.sum()),), generator=generator)
    return stream


def get_batch(
    stream: torch.Tensor, *, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows (BATCH_SIZE, CONTEXT) and their targets: the windows shifted by one."""
    starts = torch.randint(0, len(stream) - CONTEXT, (BATCH_SIZE,), generator=generator).tolist()
    x = torch.stack([stream[s : s + CONTEXT] for s in starts])
    y = torch.stack([stream[s + 1 : s + CONTEXT + 1] for s in starts])
    return x, y


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t sees only positions <= t."""

    causal_mask: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH)
        self.v = nn.Linear(WIDTH, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(DROPOUT)
        # Not persistent: it is derived, so it stays out of the state_dict.
        mask = torch.tril(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        head_dim = WIDTH // NUM_HEADS

        # (B, T, WIDTH) -> (B, heads, T, head_dim)
        q, k, v = (
            t.view(batch, time, NUM_HEADS, head_dim).transpose(1, 2)
            for t in (self.q(x), self.k(x), self.v(x))
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)  # (B, heads, T, T)
        scores = scores.masked_fill(~self.causal_mask[:time, :time], float("-inf"))
        weights = self.dropout(scores.softmax(dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, time, WIDTH)
        return self.proj(out)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(DROPOUT)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, WIDTH)
        self.position_embedding = nn.Embedding(CONTEXT, WIDTH)
        self.dropout = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_BLOCKS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB_SIZE, bias=False)
        # Weight tying: one Parameter, two modules. named_parameters() lists it once, under
        # the first name it was registered with (token_embedding.weight); the state_dict
        # keeps both keys.
        self.lm_head.weight = self.token_embedding.weight
        # nn.Embedding starts at N(0, 1), which through the tied head gives logits of std ~8
        # and a first loss near 40 instead of ln(64) = 4.2. Small weights, as in GPT-2.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) of ints -> logits (B, T, VOCAB_SIZE)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--save-params", metavar="PATH", help="torch.save the final state_dict")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)  # also drives dropout
    data_generator = torch.Generator().manual_seed(args.seed)
    stream = make_token_stream(4096, generator=data_generator)

    model = TinyGPT()
    # As in nanoGPT: decay the matrices (weights, embeddings) but not biases or LayerNorm gains.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
    )

    model.train()
    for step in range(args.steps):
        total_loss = 0.0
        for _ in range(args.accum):
            x, y = get_batch(stream, generator=data_generator)
            logits = model(x)  # (BATCH_SIZE, CONTEXT, VOCAB_SIZE)
            # Divide so that the accumulated gradient is the mean over all micro-batches.
            loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), y.view(-1)) / args.accum
            loss.backward()
            total_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {total_loss:.4f}")

    if args.save_params:
        torch.save(model.state_dict(), args.save_params)
        print(f"saved parameters to {args.save_params}")


if __name__ == "__main__":
    main()
