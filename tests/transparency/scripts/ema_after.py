"""An EMA of the model, deep-copied after the first two steps, updated every step from then
on and evaluated at the end of each epoch.

The copy is made while hooktrace records the model: it must carry nothing of hooktrace (a
hook copied with it would record the EMA under the model's names). The EMA is a module of
its own, called at top level under no_grad: root ``Net#1``. Its evaluation after the last
optimizer step belongs to the last step.

    python tests/transparency/scripts/ema_after.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net,Net#1

import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

DECAY = 0.9


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module) -> None:
    for ema_p, p in zip(ema.parameters(), model.parameters(), strict=True):
        ema_p.mul_(DECAY).add_(p, alpha=1 - DECAY)


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    ema = None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    x_val, y_val = torch.randn(8, 8), torch.randint(0, 4, (8,))
    for epoch in range(2):
        if ema is None and epoch == 1:  # after two steps
            ema = copy.deepcopy(model).requires_grad_(False)
        for i in range(2):
            step = 2 * epoch + i
            loss = F.cross_entropy(model(x[step]), y[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ema is not None:
                update_ema(ema, model)
            print(f"step {step} loss {loss.item():.4f}")
        if ema is not None:
            with torch.no_grad():
                val = F.cross_entropy(ema(x_val), y_val)
            print(f"epoch {epoch} ema val loss {val.item():.4f}")
    params = dict(model.state_dict())
    params.update({f"ema.{k}": v for k, v in ema.state_dict().items()})
    torch.save(params, out)


if __name__ == "__main__":
    main(sys.argv[1])
