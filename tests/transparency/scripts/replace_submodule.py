"""Changing the model mid-run: after two steps ``fc2`` is replaced by a new Linear and a
module ``extra`` is added, used by forward from then on; the optimizer gets a parameter
group for the new modules' parameters.

    python tests/transparency/scripts/replace_submodule.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net modules=Net,fc1,act,fc2,extra

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
        self.extra = None  # a module once the model grows

    def forward(self, x):
        out = self.fc2(self.act(self.fc1(x)))
        if self.extra is not None:
            out = out + self.extra(out)
        return out


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    for step in range(4):
        if step == 2:
            model.fc2 = nn.Linear(16, 4)
            model.extra = nn.Linear(4, 4)
            new = [*model.fc2.parameters(), *model.extra.parameters()]
            opt.add_param_group({"params": new, "lr": 0.05})
            print("modules now:", [name for name, _ in model.named_modules()])
        loss = F.cross_entropy(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
