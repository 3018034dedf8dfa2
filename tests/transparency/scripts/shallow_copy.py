"""``copy.copy`` of a module (shallow): the copy shares the original's submodules,
parameters and hook dicts, and is called in place of the original for the last two steps.

The copy is a root of its own, ``Net#1`` (called at top level, never named): only the copy
itself is recorded under that name; the submodules it shares keep their names under ``Net``.

    python tests/transparency/scripts/shallow_copy.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net,Net#1

import copy
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
    twin = None
    for step in range(4):
        if step == 2:
            twin = copy.copy(model)
            print("twin shares fc1:", twin.fc1 is model.fc1)
            print("twin forward hooks:", len(twin._forward_hooks), len(twin._forward_pre_hooks))
        net = model if twin is None else twin
        loss = F.cross_entropy(net(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
