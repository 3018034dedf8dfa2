"""Storages the script resizes once hooktrace has looked at them: its activations, its
parameters, and the parameter of a module whose output overflowed (which a non-finite
capture saves).

``Tensor.numpy()`` marks a storage as never to be resized again; a recorder that read a
tensor through it made the script's own ``storage.resize_`` raise "Trying to resize storage
that is not resizable". FSDP2 frees every all-gathered parameter after a block's forward
that way, and crashed when a capture had saved them.

    python tests/transparency/scripts/resize_storages.py /tmp/out.pt
"""
# expect: exit=0 steps=4 roots=Net

import sys

import torch
from torch import nn


class Amplify(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(256))

    def forward(self, x):
        return x * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 256)
        self.act = nn.ReLU()
        self.amplify = Amplify()
        self.fc2 = nn.Linear(256, 4)

    def forward(self, x):
        self.hidden = self.act(self.fc1(x))  # kept by the script, as a cache would
        return self.fc2(self.amplify(self.hidden))


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    for step in range(4):
        x = torch.randn(64, 256) + 1
        if step == 3:  # finite inputs and parameters, an infinite output: a capture
            with torch.no_grad():
                model.amplify.scale.fill_(3e38)
            print(f"probe finite: {bool(model(x).isfinite().all())}")
            with torch.no_grad():
                model.amplify.scale.fill_(1.0)
        output = model(x)
        output.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        kept += [x, model.hidden.detach(), output.detach()]
        print(f"step {step} output finite: {bool(output.isfinite().all())}")
    torch.save(dict(model.state_dict()), out)
    kept += [p.detach() for p in model.parameters()]
    for tensor in kept:
        tensor.untyped_storage().resize_(0)
    print(f"resized {len(kept)} storages")


if __name__ == "__main__":
    main(sys.argv[1])
