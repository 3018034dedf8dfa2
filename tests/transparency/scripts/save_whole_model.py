"""Whole-model ``torch.save(model, f)`` every epoch, and ``torch.load`` back.

Recorded or not, the saved file holds nothing of hooktrace and the model loaded from it has
no hooks: the hook counts, summed over modules, are printed (the live model's too).

    python tests/transparency/scripts/save_whole_model.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net

import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def hook_counts(model: nn.Module) -> list[int]:
    """How many hooks of each kind (HOOK_DICTS' order) the model's modules hold, summed."""
    return [sum(len(getattr(m, d)) for m in model.modules()) for d in HOOK_DICTS]


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pt")
        for epoch in range(2):
            for i in range(2):
                xb, yb = x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                print(f"epoch {epoch} batch {i} loss {loss.item():.4f}")
            torch.save(model, path)
            with open(path, "rb") as f:
                print("hooktrace in the saved file:", b"hooktrace" in f.read())
            loaded = torch.load(path, weights_only=False)
            print("loaded", type(loaded).__name__, "hooks", hook_counts(loaded))
            print("live hooks", hook_counts(model))
            same = all(
                torch.equal(a, b)
                for a, b in zip(
                    loaded.state_dict().values(), model.state_dict().values(), strict=True
                )
            )
            print("loaded state equals the model's:", same)
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
