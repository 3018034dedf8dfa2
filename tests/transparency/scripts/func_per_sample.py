"""Per-sample gradients with ``torch.func`` (``functional_call`` + ``vmap(grad(...))``),
clipped per sample and averaged into ``.grad`` (DP-SGD's pattern), then a normal optimizer
step. No ``backward()`` is ever called; each step also logs the batch loss with a plain
forward under no_grad, which makes the model a root.

    python tests/transparency/scripts/func_per_sample.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

MAX_NORM = 0.5


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

    def sample_loss(params, xi, yi):
        logits = functional_call(model, params, (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    for step in range(4):
        with torch.no_grad():
            loss = F.cross_entropy(model(x[step]), y[step])
        params = {k: v.detach() for k, v in model.named_parameters()}
        grads = per_sample_grads(params, x[step], y[step])  # each: (batch, *param.shape)
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
        scale = (MAX_NORM / (norms + 1e-6)).clamp(max=1.0)  # (batch,)
        for name, p in model.named_parameters():
            g = grads[name]
            p.grad = (g * scale.view(-1, *[1] * (g.dim() - 1))).mean(dim=0)
        opt.step()
        shown = " ".join(f"{n:.4f}" for n in norms.tolist())
        print(f"step {step} loss {loss.item():.4f} per-sample gradient norms {shown}")
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
