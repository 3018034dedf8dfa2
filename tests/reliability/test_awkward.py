"""Awkward models and loops, recorded without changing a single parameter bit.

Each case trains a fresh seeded model three times: without hooktrace, under
``hooktrace.record(model, ...)`` (inputs and full tensors on, the most hooks), and under the
recorder ``hooktrace record SCRIPT`` uses (ScriptRecorder: models and steps found as the
script runs). The final state_dicts (parameters and buffers) must be equal bit for bit
(``torch.equal``), the trace must load as a complete run that ``hooktrace check`` calls whole,
and no hook may be left behind.

tests/models.py provides most models; the loops that are awkward by themselves (bf16
autocast, a skipped step, torch.compile, LBFGS, exceptions inside a step) are here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Batch, batches, default_loss, make_model, train_steps
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

import hooktrace
from hooktrace.recorder.recording.discover import ScriptRecorder

from .conftest import Figures

STEPS = 4
Loop = Callable[[nn.Module], None]


def _zoo(name: str, optimizer: str = "sgd") -> tuple[Callable[[], nn.Module], Loop]:
    def loop(model: nn.Module) -> None:
        train_steps(model, batches(name), STEPS, lr=0.05, seed=1, optimizer=optimizer)  # type: ignore[arg-type]

    return (lambda: make_model(name, seed=0)), loop


def _mlp() -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _plain_loop(
    model: nn.Module, body: Callable[[nn.Module, torch.optim.Optimizer, int], None]
) -> None:
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        body(model, opt, step)


def bf16_autocast(model: nn.Module) -> None:
    def body(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    _plain_loop(model, body)


def skipped_step(model: nn.Module) -> None:
    """Step 1's loss is NaN: the loop skips opt.step() and throws the gradients away."""

    def body(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x, y = _batch(step)
        loss = nn.functional.cross_entropy(model(x), y) * (float("nan") if step == 1 else 1.0)
        loss.backward()
        if torch.isfinite(loss):
            opt.step()
        opt.zero_grad()

    _plain_loop(model, body)


def grad_scaler_skip(model: nn.Module) -> None:
    """A GradScaler that finds an Inf at step 2 and skips that optimizer step."""
    scaler = torch.amp.GradScaler("cpu")

    def body(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x, y = _batch(step)
        loss = nn.functional.cross_entropy(model(x), y) * (float("inf") if step == 2 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    _plain_loop(model, body)


def compiled(model: nn.Module) -> None:
    def body(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    _plain_loop(model, body)


def _compiled_mlp() -> nn.Module:
    torch._dynamo.reset()
    return torch.compile(_mlp(), backend="aot_eager")  # type: ignore[return-value]


def lbfgs(model: nn.Module) -> None:
    torch.manual_seed(1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    x, y = _batch(0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(STEPS):
        opt.step(closure)


class FailsMidForward(nn.Module):
    """Raises inside forward, after its first layer ran, on its 3rd call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.body[0](x)
        if self.calls == 3:
            raise ValueError("a bad batch")
        return self.body[2](self.body[1](h))


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fail: bool) -> torch.Tensor:
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.fail:
            raise RuntimeError("a bad gradient")
        return grad, None


class FailsMidBackward(nn.Module):
    """Its backward pass raises halfway (after the head's gradients), on its 2nd call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.body[1](self.body[0](x))
        h = _FailingBackward.apply(h, self.calls == 2)
        return self.body[2](h)


def _with_fail_mid_forward() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return FailsMidForward()


def _with_fail_mid_backward() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return FailsMidBackward()


def survives_exceptions(model: nn.Module) -> None:
    """The training loop catches what the model raises and goes on with the next batch."""

    def body(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x, y = _batch(step)
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except (ValueError, RuntimeError):
            opt.zero_grad()
            return
        opt.step()
        opt.zero_grad()

    _plain_loop(model, body)


def eval_inside_training(model: nn.Module) -> None:
    def body(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(_batch(100 + step)[0])
        model.train()

    _plain_loop(model, body)


def inference_mode_eval(model: nn.Module) -> None:
    def body(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.inference_mode():
            model(_batch(100 + step)[0])

    _plain_loop(model, body)


def per_sample_gradients(model: nn.Module) -> None:
    """torch.func: vmap over grad of a functional_call, as DP-SGD libraries do."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = dict(model.named_parameters())

    def loss_of(values: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, values, (x[None],))
        return nn.functional.cross_entropy(logits, y[None])

    for step in range(STEPS):
        x, y = _batch(step)
        detached = {k: v.detach() for k, v in params.items()}
        grads = vmap(grad(loss_of), in_dims=(None, 0, 0))(detached, x, y)
        for key, param in params.items():
            param.grad = grads[key].mean(0)
        opt.step()
        opt.zero_grad()


CASES: dict[str, tuple[Callable[[], nn.Module], Loop]] = {
    "in-place ops (ReLU(inplace) after BatchNorm)": _zoo("InplaceCNN"),
    "dict outputs": _zoo("DictOutput"),
    "tuple with None and int outputs": _zoo("TupleNoneIntOutput"),
    "dataclass outputs": _zoo("DataclassOutput"),
    "a module shared by two calls": _zoo("SharedTwice"),
    "an RNN cell in a Python loop": _zoo("RNNLoop"),
    "non-reentrant checkpointing": _zoo("CheckpointedMLP"),
    "reentrant checkpointing": _zoo("CheckpointedMLPReentrant"),
    "frozen and unused layers": _zoo("FrozenAndUnused"),
    "sparse embedding gradients": _zoo("SparseEmbedding"),
    "a forward with keyword arguments only": _zoo("KwargsOnly", optimizer="adam"),
    "bf16 autocast": (_mlp, bf16_autocast),
    "a skipped optimizer step (NaN loss)": (_mlp, skipped_step),
    "a GradScaler skipping a step": (_mlp, grad_scaler_skip),
    "torch.compile (aot_eager)": (_compiled_mlp, compiled),
    "LBFGS with a closure": (_mlp, lbfgs),
    "an exception inside forward, mid-step": (_with_fail_mid_forward, survives_exceptions),
    "an exception inside backward, mid-step": (_with_fail_mid_backward, survives_exceptions),
    "evaluation under no_grad between steps": (_mlp, eval_inside_training),
    "evaluation under inference_mode between steps": (_mlp, inference_mode_eval),
    "per-sample gradients with torch.func": (_mlp, per_sample_gradients),
}

XFAIL: dict[str, str] = {}  # cases failing for a reason outside this suite, none now


def _hooks_left(model: nn.Module) -> list[str]:
    left = [
        f"{name or 'root'}.{attr}"
        for name, module in model.named_modules()
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
        if getattr(module, attr)
    ]
    for what, hooks in (
        ("global forward hooks", _global_forward_hooks),
        ("global forward pre-hooks", _global_forward_pre_hooks),
        ("global optimizer post-hooks", _global_optimizer_post_hooks),
        ("global optimizer pre-hooks", _global_optimizer_pre_hooks),
    ):
        if hooks:
            left.append(what)
    return left


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_there_are_at_least_15_cases() -> None:
    assert len(CASES) >= 15


def _cases() -> list[Any]:
    return [
        pytest.param(
            case,
            marks=[pytest.mark.xfail(strict=True, reason=XFAIL[case])] if case in XFAIL else [],
        )
        for case in CASES
    ]


@pytest.mark.parametrize("recorder", ["hooktrace.record()", "hooktrace record"])
@pytest.mark.parametrize("case", _cases())
def test_recording_changes_no_parameter_bit(
    case: str, recorder: str, tmp_path: Path, figures: Figures
) -> None:
    make, loop = CASES[case]
    plain_model = make()
    loop(plain_model)
    plain = _state(plain_model)

    model = make()
    run = tmp_path / "run"
    with figures.case("awkward", case) as tally:
        if recorder == "hooktrace.record()":
            with hooktrace.record(model, run, inputs=True, full_every=2):
                loop(model)
        else:
            script = ScriptRecorder(str(run))
            try:
                loop(model)
            finally:
                script.close()
        recorded = _state(model)
        differing = _differing(plain, recorded)
        tally.lost = len(differing)
        assert not differing, f"recording changed {differing}"
        assert not _hooks_left(model)
        trace = hooktrace.load(run)
        assert trace.status == "complete", trace.manifest["ranks"]
        assert len(trace.records) > 0
        report = hooktrace.check(run)
        assert report.whole, report.problems


def test_a_batch_runs_the_same_after_recording(tmp_path: Path) -> None:
    """Observation only: after recording, a model answers a batch exactly as one that was
    never recorded (no hook, no state left on it)."""
    model, plain = make_model("InplaceCNN", seed=0), make_model("InplaceCNN", seed=0)
    with hooktrace.record(model, tmp_path / "run", full_every=1):
        train_steps(model, batches("InplaceCNN"), 2, lr=0.05, seed=1)
    train_steps(plain, batches("InplaceCNN"), 2, lr=0.05, seed=1)
    batch: Batch = batches("InplaceCNN")(99)
    a, b = (
        default_loss(batch.run(model), batch.target),
        default_loss(batch.run(plain), batch.target),
    )
    assert torch.equal(a, b)
