"""``torch.compile(model)`` (the OptimizedModule wrapper), then training through it.

A compiled model is recorded inside, from statistics compiled into its graph: every
module, under the names an eager run gives them (no ``_orig_mod.`` prefix).

The backend is ``aot_eager`` (dynamo and AOTAutograd, no code generation): on a 2-core CPU
inductor took 21 s per process with a cold cache (gcc builds its kernels), 7 s warm, which
would make this suite several times slower; dynamo's graph capture, which is where hooks
could leak into a graph, is the same.

The script sees every warning its training raises (``simplefilter("always")``, as a strict
test suite does with ``"error"``): torch warns at each call of a compiled module where a
process-wide module hook exists, and the recorder's own must not count (a filter on the
warning was put behind the script's, and the script saw it at every step).

    python tests/transparency/scripts/torch_compile.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net modules=Net,act,fc1,fc2

import sys
import warnings

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
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(4):
            loss = F.cross_entropy(compiled(x[step]), y[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step} loss {loss.item():.4f}")
    for warning in seen:
        print(f"warned: {warning.category.__name__}: {str(warning.message)[:60]}")
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
