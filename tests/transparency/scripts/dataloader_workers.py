"""Child processes: a DataLoader with two workers over a TensorDataset, a
``multiprocessing.Pool(2)`` mapping a plain function, and a process ended by
``terminate()``.

Workers are forked (Linux): the first epoch's before the model's first forward, the
second's while hooktrace records. Under ``hooktrace record`` the script runs as
``__main__`` through runpy, so the ``__main__`` guard holds and ``square`` pickles by
reference as ``__main__.square``, as it does run plainly. The loss is a module
(``nn.CrossEntropyLoss``), called at top level: a root of its own.

Forked children inherit the parent's signal handlers: a SIGTERM handler of hooktrace's
makes a terminated worker print a traceback and exit 1 instead of dying of the signal.
``end_a_worker`` shows it every time. It also made ``Pool.__exit__``, which terminates the
workers still there, hang now and then (a worker raised while holding the task queue's
lock): the pool is closed and joined first, so that this test fails rather than hangs.

    python tests/transparency/scripts/dataloader_workers.py /tmp/out.pt
"""
# expect: exit=0 steps=6 roots=Net,CrossEntropyLoss

import multiprocessing
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def square(n: int) -> int:
    return n * n


def sleep_until_ended(ready) -> None:
    ready.set()
    time.sleep(60)


def end_a_worker() -> None:
    """A process ended by ``terminate()`` (SIGTERM) dies of the signal: exit code -15."""
    ready = multiprocessing.Event()
    worker = multiprocessing.Process(target=sleep_until_ended, args=(ready,))
    worker.start()
    ready.wait()
    worker.terminate()
    worker.join()
    print("terminated worker's exit code:", worker.exitcode)


def main(out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    criterion = nn.CrossEntropyLoss()  # a module: a root of its own
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(24, 8), torch.randint(0, 4, (24,)))
    loader = DataLoader(
        data,
        batch_size=8,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(1),
    )
    step = 0
    for epoch in range(2):
        for x, y in loader:
            loss = criterion(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"epoch {epoch} step {step} loss {loss.item():.4f} first label {y[0].item()}")
            step += 1
        with multiprocessing.Pool(2) as pool:
            print(f"epoch {epoch} pool:", pool.map(square, range(6)))
            pool.close()  # workers leave on their own: __exit__ has none left to terminate
            pool.join()
    end_a_worker()
    torch.save(dict(model.state_dict()), out)


if __name__ == "__main__":
    main(sys.argv[1])
