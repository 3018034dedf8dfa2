"""``model.double()`` after two steps, training on in float64 with the same optimizer.

``double()`` converts parameters in place (the same Parameter objects, new data) and
replaces the BatchNorm's buffers with new tensors.

    python tests/transparency/scripts/to_double.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net

import sys

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.norm(self.fc1(x))))


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    for step in range(4):
        if step == 2:
            model.double()
            x = x.double()
        loss = F.cross_entropy(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.6f} {loss.dtype}")
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
