"""``model.compile()`` (nn.Module's in-place compile), then training.

A compiled model is recorded inside, from statistics compiled into its graph: every
module, under the names an eager run gives them.

The backend is ``aot_eager`` (dynamo and AOTAutograd, no code generation): on a 2-core CPU
inductor took 21 s per process with a cold cache (gcc builds its kernels), 7 s warm, which
would make this suite several times slower; dynamo's graph capture, which is where hooks
could leak into a graph, is the same.

    python tests/transparency/scripts/module_compile.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net modules=Net,act,fc1,fc2

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
    model.compile(backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    for step in range(4):
        loss = F.cross_entropy(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
