"""The script's own hooks, before and after recording starts: hooktrace must neither
change what they see nor what they do.

At the start (``hooktrace record`` is already recording, but has not met the model yet): a
forward hook that prints what ``fc1`` returns, and a full backward hook on ``fc2`` that
prints the gradient it gets and clips the gradient it passes on. After two steps (the
model is recorded by then): a forward hook that halves ``act``'s output.

    python tests/transparency/scripts/user_hooks.py /tmp/out.pt
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


def show_output(module, args, output):
    print(f"  fc1 saw input {args[0].sum().item():.4f}, returned {output.sum().item():.4f}")


def clip_grad_input(module, grad_input, grad_output):
    print(f"  fc2 grad_output norm {grad_output[0].norm().item():.6f}")
    return tuple(None if g is None else g.clamp(-0.01, 0.01) for g in grad_input)


def halve(module, args, output):
    return output * 0.5


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    model.fc1.register_forward_hook(show_output)
    model.fc2.register_full_backward_hook(clip_grad_input)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    for step in range(4):
        if step == 2:
            model.act.register_forward_hook(halve)
        loss = F.cross_entropy(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(
            f"step {step} loss {loss.item():.4f} fc1 grad norm {model.fc1.weight.grad.norm().item():.6f}"
        )
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
