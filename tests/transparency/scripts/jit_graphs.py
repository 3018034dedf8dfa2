"""Graphs built from the model while it is recorded: ``torch.jit.script``,
``torch.jit.trace``, ``torch.export.export`` and ``torch.fx.symbolic_trace`` after two
steps, every graph and its code printed. Identical output recorded and not proves that no
hooktrace operation (nor hook) got into any of them.

    python tests/transparency/scripts/jit_graphs.py /tmp/out.pt
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
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def show_graphs(model: nn.Module, x: torch.Tensor) -> None:
    scripted = torch.jit.script(model)
    print("== torch.jit.script graph\n", scripted.graph, sep="")
    print("== torch.jit.script inlined graph\n", scripted.inlined_graph, sep="")
    print("== torch.jit.script code\n", scripted.code, sep="")
    traced = torch.jit.trace(model, x)
    print("== torch.jit.trace code\n", traced.code, sep="")
    print("== torch.jit.trace inlined graph\n", traced.inlined_graph, sep="")
    exported = torch.export.export(model, (x,))
    print("== torch.export graph module code\n", exported.graph_module.code, sep="")
    print("== torch.export graph\n", exported.graph, sep="")
    gm = torch.fx.symbolic_trace(model)
    print("== torch.fx code\n", gm.code, sep="")
    print("== torch.fx graph\n", gm.graph, sep="")


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    for step in range(4):
        if step == 2:
            show_graphs(model, x[step])
        loss = F.cross_entropy(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
