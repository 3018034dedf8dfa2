"""``sys.exit(3)`` after two steps: the recorded run exits 3 too.

hooktrace finishes the trace with status ``failed`` (the script exited with a non-zero code),
every step written before the exit readable.

    python tests/transparency/scripts/sys_exit.py /tmp/out.pt
"""
# expect: exit=3 steps=2 roots=Net status=failed

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


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    for step in range(4):
        if step == 2:
            torch.save(dict(model.state_dict()), out)
            print("stopping early", flush=True)
            sys.exit(3)
        loss = F.cross_entropy(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main(sys.argv[1])
