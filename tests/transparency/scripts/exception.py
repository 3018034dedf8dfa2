"""An uncaught exception at step 5, before its forward: the recorded run exits 1 with the
same traceback as the plain run (hooktrace's frames cut off).

    python tests/transparency/scripts/exception.py /tmp/out.pt
"""
# expect: exit=1 steps=5 roots=Net status=failed

import sys

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def check_batch(x: torch.Tensor, step: int) -> None:
    if step == 5:
        raise ValueError(f"bad batch at step {step}: {x.shape[0]} rows")


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 8, 8), torch.randint(0, 4, (6, 8))
    for step in range(6):
        if step == 5:
            torch.save(dict(model.state_dict()), out)  # what the test compares
        check_batch(x[step], step)
        loss = F.cross_entropy(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main(sys.argv[1])
