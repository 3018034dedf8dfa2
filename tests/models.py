"""A zoo of tiny, awkward models for the recorder's tests. Plain PyTorch only.

Each model's docstring says what is awkward about it: the odd cases a hook-based recorder
has to survive (non-tensor outputs, a module called twice, recomputation under
checkpointing, in-place ops, sparse gradients, ...). Each model also says how to make an
input for itself (`example_batch`), so a test can do:

    model = make_model("RNNLoop", seed=0)
    batch = make_batch("RNNLoop", seed=0)
    output = batch.run(model)

and `train_steps` runs a seeded training loop whose final parameters can be compared bit for
bit with and without a recorder around it. `python tests/models.py` checks every model.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class Batch:
    """One input for a model: positional args, keyword args, and an optional class target."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: torch.Tensor | None = None

    def run(self, model: nn.Module) -> Any:
        return model(*self.args, **self.kwargs)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with its tensors on ``device``."""

        def move(value: Any) -> Any:
            return value.to(device) if isinstance(value, torch.Tensor) else value

        return Batch(
            args=tuple(move(a) for a in self.args),
            kwargs={k: move(v) for k, v in self.kwargs.items()},
            target=move(self.target),
        )


class ZooModel(nn.Module):
    """Base class: a zoo model knows how to make an input for itself."""

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        raise NotImplementedError


# --- Reference cases 1 and 4 of /work/shared/REFERENCE_CASES.md ---------------------------

REFERENCE_WEIGHTS = {
    "fc1.weight": [[1.0, 2.0, 3.0], [-4.0, -5.0, -6.0], [7.0, 8.0, 9.0], [-10.0, -11.0, -12.0]],
    "fc1.bias": [1.0, 2.0, 3.0, 4.0],
    "fc2.weight": [[1.0, 2.0, 3.0, 4.0]],
    "fc2.bias": [1.0],
}
# Values worked out by hand in REFERENCE_CASES.md, for x = [[1, 1, 1]] and o.backward().
REFERENCE_OUTPUTS = {
    "fc1": [[7.0, -13.0, 27.0, -29.0]],
    "relu1": [[7.0, 0.0, 27.0, 0.0]],
    "fc2": [[89.0]],
}
REFERENCE_GRAD_OUTPUTS = {
    "fc2": [[1.0]],
    "relu1": [[1.0, 2.0, 3.0, 4.0]],
    "fc1": [[1.0, 0.0, 3.0, 0.0]],
}
REFERENCE_GRADS = {
    "fc2.weight": [[7.0, 0.0, 27.0, 0.0]],
    "fc2.bias": [1.0],
    "fc1.weight": [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [3.0, 3.0, 3.0], [0.0, 0.0, 0.0]],
    "fc1.bias": [1.0, 0.0, 3.0, 0.0],
}
REFERENCE_INPUT_GRAD = [[22.0, 26.0, 30.0]]


def set_reference_weights(module: nn.Module) -> None:
    """Give `module.fc1` and `module.fc2` the exact weights of reference case 1."""
    with torch.no_grad():
        for name, value in REFERENCE_WEIGHTS.items():
            module.get_parameter(name).copy_(torch.tensor(value))


def reference_input() -> torch.Tensor:
    """x = [[1, 1, 1]], requiring grad, so that x.grad can be checked too."""
    return torch.ones(1, 3, requires_grad=True)


class ReferenceMLP(ZooModel):
    """Reference case 1: fc1 -> relu1 -> fc2 with hand-checked values. Not awkward: the anchor.

    Built with the reference weights; the known values are REFERENCE_* above.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(4, 1)
        set_reference_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu1(self.fc1(x)))

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        return Batch(args=(reference_input(),))


def reference_block() -> nn.Sequential:
    """Reference case 4: Sequential(fc1, relu1, fc2) with the weights of case 1."""
    block = nn.Sequential(OrderedDict(fc1=nn.Linear(3, 4), relu1=nn.ReLU(), fc2=nn.Linear(4, 1)))
    set_reference_weights(block)
    return block


class ReferenceBlock(ZooModel):
    """Reference case 4 as a named submodule `block`: a composite whose own grad_output ([[1]])
    must be recorded, not only that of its last operation; x.grad = [[22, 26, 30]]."""

    def __init__(self) -> None:
        super().__init__()
        self.block = reference_block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        return Batch(args=(reference_input(),))


# --- Odd outputs and odd inputs --------------------------------------------------------------


class DictOutput(ZooModel):
    """forward returns {"logits": ..., "aux": ...}: a dict, not a tensor or tuple.

    A full backward hook on it never fires: torch only warns ("module output should be a
    Tensor or a tuple of Tensors").
    """

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.logits = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.body(x))
        return {"logits": self.logits(h), "aux": self.aux(h)}

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(5, 4, generator=generator)
        return Batch(args=(x,), target=torch.randint(0, 3, (5,), generator=generator))


@dataclass
class ModelOutput:
    """A Hugging Face style output: tensor fields plus an optional one left as None."""

    logits: torch.Tensor
    hidden: torch.Tensor
    attentions: torch.Tensor | None = None


class DataclassOutput(ZooModel):
    """forward returns a @dataclass instance with tensor fields and a None field; as with
    DictOutput, a full backward hook on it never fires."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> ModelOutput:
        hidden = torch.tanh(self.body(x))
        return ModelOutput(logits=self.head(hidden), hidden=hidden)

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(5, 4, generator=generator)
        return Batch(args=(x,), target=torch.randint(0, 3, (5,), generator=generator))


class TupleNoneIntOutput(ZooModel):
    """forward returns (tensor, None, 3): a tuple mixing a tensor with non-tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, int]:
        return self.fc(x), None, 3

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        return Batch(args=(torch.randn(5, 4, generator=generator),))


class KwargsOnly(ZooModel):
    """forward(*, x, mask=None): no positional inputs at all.

    A forward pre-hook registered without with_kwargs=True sees args == (), and full
    backward hooks see no inputs (grad_input is empty).
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, *, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            x = x * mask
        return self.fc(x)

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(5, 4, generator=generator)
        mask = (torch.rand(5, 4, generator=generator) > 0.25).float()
        return Batch(
            kwargs={"x": x, "mask": mask}, target=torch.randint(0, 2, (5,), generator=generator)
        )


# --- Modules called more than once per forward -----------------------------------------------


class SharedTwice(ZooModel):
    """One Linear called twice in one forward: its hooks fire twice per step, and its
    parameters' gradient is the sum of the two calls' contributions."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(torch.relu(self.shared(x)))
        return self.head(x)

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(5, 4, generator=generator)
        return Batch(args=(x,), target=torch.randint(0, 2, (5,), generator=generator))


class RNNLoop(ZooModel):
    """An LSTMCell called in a Python loop, once per time step (5 calls per forward).

    The cell takes a nested input (x_t, (h, c)) and returns a tuple (h, c); at t = 0 the state
    is zeros that do not require grad. Full backward hooks only see top-level tensors, so the
    gradient flowing back through the state (h, c) never shows up in the cell's grad_input.
    """

    steps = 5

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(3, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (batch, time, 3) -> logits (batch, 2) from the last hidden state."""
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        c = x.new_zeros(x.shape[0], self.cell.hidden_size)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h)

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(4, RNNLoop.steps, 3, generator=generator)
        return Batch(args=(x,), target=torch.randint(0, 2, (4,), generator=generator))


class CheckpointedMLP(ZooModel):
    """Inner blocks run under torch.utils.checkpoint, so they run forward again, recomputed,
    during backward, and their forward hooks fire then too. With use_reentrant=True the whole
    block re-runs (Linear, ReLU and the Sequential fire again); with use_reentrant=False
    recomputation stops once the saved tensors it needs are back (here only the Linear).

    The first layer is not checkpointed on purpose: with use_reentrant=True, a checkpointed
    block whose inputs do not require grad gives its parameters no gradient at all.
    """

    def __init__(self, use_reentrant: bool = False) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.fc_in = nn.Linear(4, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc_in(x))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(5, 4, generator=generator)
        return Batch(args=(x,), target=torch.randint(0, 2, (5,), generator=generator))


# --- Odd parameters and odd gradients --------------------------------------------------------


class InplaceCNN(ZooModel):
    """Conv2d -> BatchNorm2d -> ReLU(inplace=True) -> AdaptiveAvgPool2d -> Linear.

    The ReLU overwrites BatchNorm's output: a forward hook on the BatchNorm that keeps a
    reference instead of computing at once sees the ReLU'd values later (min 0, not < 0), and
    a full backward hook on the BatchNorm or on the ReLU makes the in-place ReLU raise
    ("Output 0 of BackwardHookFunction is a view and is being modified inplace").
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.bn(self.conv(x))))  # (batch, 4, 1, 1)
        return self.fc(x.flatten(start_dim=1))

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(4, 3, 8, 8, generator=generator)
        return Batch(args=(x,), target=torch.randint(0, 3, (4,), generator=generator))


class FrozenAndUnused(ZooModel):
    """A frozen first layer (requires_grad False) and a submodule that is never called.

    The frozen layer's output does not require grad, so no backward hook fires for it; the
    unused layer has no forward record at all and its parameters' .grad stays None.
    """

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 8)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.frozen(x)))

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(5, 4, generator=generator)
        return Batch(args=(x,), target=torch.randint(0, 2, (5,), generator=generator))


class SparseEmbedding(ZooModel):
    """nn.Embedding(sparse=True): its weight's .grad is an uncoalesced sparse COO tensor (one
    entry per looked-up token, repeats included), on which .mean() and .isfinite() raise.
    Train it with SGD: Adam rejects sparse gradients. Its input is integer indices."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8, sparse=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) of ints -> logits (batch, 3) from the mean embedding."""
        return self.fc(self.embedding(tokens).mean(dim=1))

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        tokens = torch.randint(0, 20, (6, 4), generator=generator)
        return Batch(args=(tokens,), target=torch.randint(0, 3, (6,), generator=generator))


# --- Performance references: shapes fixed, do not change them --------------------------------


class TinyTransformer(ZooModel):
    """Linear(32, 128) -> 2-layer nn.TransformerEncoder (d_model 128, 4 heads, feed-forward 256,
    dropout 0.1) -> Linear(128, 10), on 16 x 64 tokens x 32 features. A performance reference.

    nn.MultiheadAttention never calls its out_proj module (it reads out_proj.weight directly),
    and in eval mode under no_grad each encoder layer takes a fused fast path that runs none of
    its submodules, unless some module inside it has a forward (pre-)hook: then it falls back
    to the slow path. Dropout draws from the global RNG.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 128)
        layer = nn.TransformerEncoderLayer(
            d_model=128, nhead=4, dim_feedforward=256, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (16, 64, 32) -> logits (16, 64, 10), one per token."""
        return self.head(self.encoder(self.embed(x)))

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(16, 64, 32, generator=generator)
        return Batch(args=(x,), target=torch.randint(0, 10, (16, 64), generator=generator))


class SmallCNN(ZooModel):
    """Three Conv2d -> BatchNorm2d -> ReLU(inplace=True) stages on 32 x 3 x 32 x 32 images, then
    a Linear head. A performance reference."""

    def __init__(self) -> None:
        super().__init__()

        def stage(c_in: int, c_out: int) -> list[nn.Module]:
            return [
                nn.Conv2d(c_in, c_out, 3, padding=1),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
            ]

        self.features = nn.Sequential(
            *stage(3, 16),
            nn.MaxPool2d(2),  # 32x32 -> 16x16
            *stage(16, 32),
            nn.MaxPool2d(2),  # 16x16 -> 8x8
            *stage(32, 64),
            nn.AdaptiveAvgPool2d(1),  # 8x8 -> 1x1
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(start_dim=1))

    @staticmethod
    def example_batch(generator: torch.Generator) -> Batch:
        x = torch.randn(32, 3, 32, 32, generator=generator)
        return Batch(args=(x,), target=torch.randint(0, 10, (32,), generator=generator))


# --- Registry and helpers --------------------------------------------------------------------

# name -> (class, constructor keyword arguments)
MODELS: dict[str, tuple[type[ZooModel], dict[str, Any]]] = {
    "ReferenceMLP": (ReferenceMLP, {}),
    "ReferenceBlock": (ReferenceBlock, {}),
    "DictOutput": (DictOutput, {}),
    "DataclassOutput": (DataclassOutput, {}),
    "TupleNoneIntOutput": (TupleNoneIntOutput, {}),
    "KwargsOnly": (KwargsOnly, {}),
    "SharedTwice": (SharedTwice, {}),
    "RNNLoop": (RNNLoop, {}),
    "CheckpointedMLP": (CheckpointedMLP, {"use_reentrant": False}),
    "CheckpointedMLPReentrant": (CheckpointedMLP, {"use_reentrant": True}),
    "InplaceCNN": (InplaceCNN, {}),
    "FrozenAndUnused": (FrozenAndUnused, {}),
    "SparseEmbedding": (SparseEmbedding, {}),
    "TinyTransformer": (TinyTransformer, {}),
    "SmallCNN": (SmallCNN, {}),
}


def make_model(name: str, *, seed: int = 0) -> ZooModel:
    """Build a zoo model with weights drawn from `seed`, leaving the global RNG untouched."""
    cls, kwargs = MODELS[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls(**kwargs)


def make_batch(name: str, seed: int = 0) -> Batch:
    """An input for the model called `name`, drawn from its own generator seeded with `seed`."""
    cls, _ = MODELS[name]
    return cls.example_batch(torch.Generator().manual_seed(seed))


def batches(name: str) -> Callable[[int], Batch]:
    """A batch_fn for train_steps: step i gets make_batch(name, seed=i)."""
    return lambda step: make_batch(name, seed=step)


def float_tensors(output: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in an output: a tensor, a mapping, a list or tuple, or a
    dataclass, searched recursively in order. Non-tensors (None, ints) are skipped."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, Mapping):
        values: list[Any] = list(output.values())
    elif isinstance(output, (list, tuple)):
        values = list(output)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        values = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        return []
    return [t for value in values for t in float_tensors(value)]


def default_loss(output: Any, target: torch.Tensor | None) -> torch.Tensor:
    """The first float tensor in `output` is the prediction: its cross-entropy against `target`
    (classes on the last dim), or its plain mean without a target (for ReferenceMLP that is
    o itself, so the gradients are exactly those of reference case 1). Every further float
    tensor adds its mean square, so that every output (DictOutput's aux) gets a gradient."""
    prediction, *others = float_tensors(output)
    if target is None:
        loss = prediction.mean()
    else:
        loss = F.cross_entropy(prediction.reshape(-1, prediction.shape[-1]), target.reshape(-1))
    for t in others:
        loss = loss + t.pow(2).mean()
    return loss


def train_steps(
    model: nn.Module,
    batch_fn: Callable[[int], Batch],
    steps: int,
    *,
    lr: float,
    seed: int,
    optimizer: Literal["sgd", "adam"] = "sgd",
    loss_fn: Callable[[Any, torch.Tensor | None], torch.Tensor] = default_loss,
) -> dict[str, torch.Tensor]:
    """Run `steps` seeded training steps (forward, loss, backward, step, zero_grad) and return
    a copy of the final state_dict: parameters and persistent buffers (BatchNorm's running
    statistics). Two runs with the same arguments on equal models give bit-identical results;
    a recorder that changes them has changed the training.

    `seed` seeds the global RNG (dropout draws from it); `batch_fn(step)` should be
    deterministic itself, as `batches(name)` is.
    """
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr)
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr)  # rejects sparse gradients (SparseEmbedding)
    else:
        raise ValueError(f"optimizer must be 'sgd' or 'adam', not {optimizer!r}")

    model.train()
    for step in range(steps):
        batch = batch_fn(step)
        loss = loss_fn(batch.run(model), batch.target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _run_reference(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    """One forward and o.backward() on x = [[1, 1, 1]], recording every module's output and
    grad_output with plain torch hooks."""
    names = {module: name for name, module in model.named_modules()}
    outputs: dict[str, Any] = {}
    grad_outputs: dict[str, Any] = {}

    def save_output(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        outputs[names[module]] = output.tolist()

    def save_grad_output(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        grad_outputs[names[module]] = grad_output[0].tolist()

    for module in names:
        module.register_forward_hook(save_output)
        module.register_full_backward_hook(save_grad_output)
    x = reference_input()
    model(x).backward()
    return outputs, grad_outputs, x


def _check_reference_cases() -> None:
    """Cases 1 and 4 against the hand-worked values in REFERENCE_CASES.md."""
    model = ReferenceMLP()
    outputs, grad_outputs, x = _run_reference(model)
    assert {k: outputs[k] for k in REFERENCE_OUTPUTS} == REFERENCE_OUTPUTS, outputs
    assert {k: grad_outputs[k] for k in REFERENCE_GRAD_OUTPUTS} == REFERENCE_GRAD_OUTPUTS
    grads = {name: p.grad.tolist() for name, p in model.named_parameters() if p.grad is not None}
    assert grads == REFERENCE_GRADS, grads
    assert x.grad is not None and x.grad.tolist() == REFERENCE_INPUT_GRAD

    _, grad_outputs, x = _run_reference(ReferenceBlock())
    assert grad_outputs["block"] == [[1.0]], grad_outputs
    assert x.grad is not None and x.grad.tolist() == REFERENCE_INPUT_GRAD


if __name__ == "__main__":
    _check_reference_cases()
    for name in MODELS:
        model = make_model(name)
        batch = make_batch(name)
        loss = default_loss(batch.run(model), batch.target)
        loss.backward()
        assert any(p.grad is not None for p in model.parameters()), name
        first = train_steps(make_model(name), batches(name), 2, lr=0.01, seed=0)
        again = train_steps(make_model(name), batches(name), 2, lr=0.01, seed=0)
        assert first.keys() == again.keys() and all(
            torch.equal(first[k], again[k]) for k in first
        ), name
        print(f"{name:26s} loss {loss.item():9.4f}")
    print("OK")
