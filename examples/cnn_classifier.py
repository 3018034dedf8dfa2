"""Train a small CNN to say which quadrant of a noisy 16x16 image holds a bright square.

Covers what an image model brings to a training loop: convolutions, BatchNorm (whose
behaviour differs between train and eval), an in-place ReLU, max pooling, and an evaluation
pass every few steps under torch.no_grad().

    python examples/cnn_classifier.py --steps 20 --seed 0 --save-params cnn.pt
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

IMAGE_SIZE = 16
SQUARE_SIZE = 4
NUM_CLASSES = 4  # quadrants: 0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right
BATCH_SIZE = 32
EVAL_EVERY = 10


def make_images(
    num_samples: int, *, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise images (num_samples, 1, 16, 16) with one bright square; label = its quadrant."""
    images = 0.5 * torch.randn(num_samples, 1, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    half = IMAGE_SIZE // 2
    # The square sits at a random place inside its quadrant, so the net must learn position
    # coarsely rather than memorise one pixel.
    offsets = torch.randint(0, half - SQUARE_SIZE + 1, (num_samples, 2), generator=generator)
    for i in range(num_samples):
        row = (labels[i] // 2) * half + offsets[i, 0]
        col = (labels[i] % 2) * half + offsets[i, 1]
        images[i, 0, row : row + SQUARE_SIZE, col : col + SQUARE_SIZE] += 0.5
    return images, labels


class SmallCNN(nn.Module):
    """Two conv blocks (Conv2d -> BatchNorm2d -> in-place ReLU -> MaxPool2d), then a Linear."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),  # overwrites the BatchNorm output: no extra activation kept
            nn.MaxPool2d(2),  # 16x16 -> 8x8
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Linear(16 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)  # (batch, 16, 4, 4)
        return self.head(x.flatten(start_dim=1))


def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy on a held-out set, with BatchNorm's running statistics and no autograd graph."""
    model.eval()
    with torch.no_grad():
        predictions = model(images).argmax(dim=1)
    model.train()  # back to batch statistics, which also updates the running ones
    return (predictions == labels).float().mean().item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    parser.add_argument("--save-params", metavar="PATH", help="torch.save the final state_dict")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    data_generator = torch.Generator().manual_seed(args.seed)
    train_images, train_labels = make_images(BATCH_SIZE * 8, generator=data_generator)
    test_images, test_labels = make_images(128, generator=data_generator)

    model = SmallCNN(NUM_CLASSES)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    model.train()
    for step in range(args.steps):
        start = (step * BATCH_SIZE) % len(train_images)
        x = train_images[start : start + BATCH_SIZE]
        y = train_labels[start : start + BATCH_SIZE]

        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
        if (step + 1) % EVAL_EVERY == 0:
            accuracy = evaluate(model, test_images, test_labels)
            print(f"step {step:3d}  eval accuracy {accuracy:.3f}")

    if args.save_params:
        torch.save(model.state_dict(), args.save_params)
        print(f"saved parameters to {args.save_params}")


if __name__ == "__main__":
    main()
