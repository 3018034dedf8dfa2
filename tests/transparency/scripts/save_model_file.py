"""A model saved whole with ``torch.save(model, path)`` while it is recorded, to be loaded
later by a process that has no hooktrace (test_transparency.py's
``test_saved_model_loads_without_hooktrace`` does).

The model is built of torch's own modules, so loading it needs no code of this script. It is
written to ``OUTFILE.model``, next to the parameters.

    python tests/transparency/scripts/save_model_file.py /tmp/out.pt   # writes /tmp/out.pt.model
"""
# expect: exit=0 steps=4 roots=Sequential

import sys

import torch
import torch.nn.functional as F
from torch import nn


def main(out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, 8), torch.randint(0, 4, (4, 8))
    for step in range(4):
        loss = F.cross_entropy(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")
    torch.save(model, out + ".model")
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
