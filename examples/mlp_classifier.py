"""Train a small MLP to classify synthetic Gaussian blobs.

The simplest training loop there is: a Linear/ReLU stack, a loss module called outside the
model, and one optimizer step per batch. Runs on CPU in about a second.

    python examples/mlp_classifier.py --steps 30 --seed 0 --save-params mlp.pt
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

NUM_CLASSES = 4
NUM_FEATURES = 8
HIDDEN = 32
BATCH_SIZE = 64


def make_blobs(
    num_samples: int, *, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample points around one random centre per class.

    Returns features (num_samples, NUM_FEATURES) and integer labels (num_samples,).
    """
    # Centres are spread wide (std 3) against a unit-std cloud, so the classes are separable
    # but not trivially: the first few steps still show a clear loss drop.
    centres = 3.0 * torch.randn(NUM_CLASSES, NUM_FEATURES, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    features = centres[labels] + torch.randn(num_samples, NUM_FEATURES, generator=generator)
    return features, labels


class MLP(nn.Module):
    """Linear -> ReLU -> Linear -> ReLU -> Linear, one named attribute per layer."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.fc1(x))
        x = self.relu2(self.fc2(x))
        return self.fc3(x)  # logits, (batch, num_classes)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--lr", type=float, default=None, help="default 1e-2 (adam), 0.1 (sgd)")
    parser.add_argument("--save-params", metavar="PATH", help="torch.save the final state_dict")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    # The data has its own generator so that the dataset does not change with the number of
    # parameters drawn from the global generator when the model is built.
    data_generator = torch.Generator().manual_seed(args.seed)
    features, labels = make_blobs(BATCH_SIZE * 16, generator=data_generator)

    model = MLP(NUM_FEATURES, HIDDEN, NUM_CLASSES)
    criterion = nn.CrossEntropyLoss()
    optimizer: torch.optim.Optimizer
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or 1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr or 0.1)

    model.train()
    for step in range(args.steps):
        # Walk through the dataset in fixed order: no shuffling, so runs are reproducible.
        start = (step * BATCH_SIZE) % len(features)
        x = features[start : start + BATCH_SIZE]
        y = labels[start : start + BATCH_SIZE]

        logits = model(x)
        loss = criterion(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if step % 5 == 0 or step == args.steps - 1:
            accuracy = (logits.argmax(dim=1) == y).float().mean().item()
            print(f"step {step:3d}  loss {loss.item():.4f}  accuracy {accuracy:.3f}")

    if args.save_params:
        torch.save(model.state_dict(), args.save_params)
        print(f"saved parameters to {args.save_params}")


if __name__ == "__main__":
    main()
