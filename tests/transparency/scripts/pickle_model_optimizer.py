"""``pickle`` the model and its optimizer together, train on with the copies; and a
checkpoint of both state dicts through ``torch.save``/``torch.load``.

After two steps, ``pickle.loads(pickle.dumps((model, opt)))`` gives a model and an Adam
optimizer over its parameters; they train the last two steps. The unpickled model is a new
module called at top level: a second root, ``Net#1``. A state-dict checkpoint taken at the
same moment is restored into a fresh ``Net`` and a fresh Adam, never called, and saved as
``restored.*``.

    python tests/transparency/scripts/pickle_model_optimizer.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net,Net#1

import io
import pickle
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


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> float:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    for step in range(2):
        print(f"step {step} loss {train_step(model, opt, x[step], y[step]):.4f}")

    blob = pickle.dumps((model, opt))
    print("hooktrace in the pickle:", b"hooktrace" in blob)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    print("hooktrace in the checkpoint:", b"hooktrace" in buffer.getvalue())

    model, opt = pickle.loads(blob)
    print(
        "unpickled optimizer holds the unpickled parameters:",
        all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters(), strict=True)),
    )
    for step in range(2, 4):
        print(f"step {step} loss {train_step(model, opt, x[step], y[step]):.4f}")

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    restored = Net()
    restored.load_state_dict(checkpoint["model"])
    restored_opt = torch.optim.Adam(restored.parameters(), lr=0.01)
    restored_opt.load_state_dict(checkpoint["opt"])
    exp_avg = restored_opt.state[restored_opt.param_groups[0]["params"][0]]["exp_avg"]
    print(f"restored optimizer: exp_avg sum {exp_avg.sum().item():.6f}")

    params = dict(model.state_dict())
    params.update({f"restored.{k}": v for k, v in restored.state_dict().items()})
    torch.save(params, out)


if __name__ == "__main__":
    main(sys.argv[1])
