"""hooktrace.replay_module on real recordings: bit-exact replays checked against plain torch,
a planted NaN reproduced, clear errors for what was not recorded, and the known limits."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import batches, make_model, train_steps
from torch import nn

import hooktrace
from hooktrace.errors import ConfigError, RecordingError, TensorNotRecorded
from hooktrace.recorder.replay.compare import to_torch
from hooktrace.trace.reader import Trace


def _record(model: nn.Module, run: Path, train: Any, **options: Any) -> Trace:
    options = {"inputs": True, "full_every": 1, **options}
    with hooktrace.record(model, run, **options):
        train()
    return hooktrace.load(run)


def _calls(trace: Trace, step: int) -> list[tuple[str, int, int, str]]:
    """Every call of the step that has a call spec: (module, call, micro_step, phase)."""
    rows = trace.query(steps=[step], columns=["module", "call", "micro_step", "phase", "call_spec"])
    rows = rows[rows["call_spec"] != ""]
    return [
        (str(r.module), int(r.call), int(r.micro_step), str(r.phase))
        for r in rows.itertuples(index=False)
    ]


def _submodule(model: nn.Module, trace: Trace, name: str) -> nn.Module:
    root = str(trace.modules.loc[trace.modules["depth"] == 0, "module"].iloc[0])
    return model if name == root else model.get_submodule(name)


def _replay_all(model: nn.Module, trace: Trace, step: int) -> dict[tuple[str, int, int, str], Any]:
    results = {}
    for name, call, micro_step, phase in _calls(trace, step):
        results[(name, call, micro_step, phase)] = hooktrace.replay_module(
            trace,
            name,
            step=step,
            call=call,
            micro_step=micro_step,
            phase=phase,
            module=_submodule(model, trace, name),
        )
    return results


def _tensor(trace: Trace, module: str, kind: str, step: int, **key: Any) -> torch.Tensor:
    row = trace.record(module, kind, step=step, **key)
    return to_torch(trace.tensor(module, kind, step=step, **key), str(row["dtype"]))


# -- bit-exact replays --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["ReferenceMLP", "SharedTwice", "RNNLoop", "InplaceCNN", "KwargsOnly", "DictOutput"]
)
def test_every_call_of_a_zoo_model_replays_bit_exactly(run_dir: Path, name: str) -> None:
    model = make_model(name)
    trace = _record(model, run_dir, lambda: train_steps(model, batches(name), 2, lr=0.1, seed=0))
    results = _replay_all(model, trace, step=1)
    outputs = trace.query(steps=[1], kinds=["output"], columns=["module", "call"])
    assert {(k[0], k[1]) for k in results} == set(
        zip(outputs["module"], outputs["call"], strict=True)
    )
    inexact = {key: r.comparison for key, r in results.items() if not r.exact}
    assert not inexact


def test_mlp_replay_matches_plain_torch_and_leaves_the_module_alone(run_dir: Path) -> None:
    model = make_model("ReferenceMLP")
    trace = _record(
        model, run_dir, lambda: train_steps(model, batches("ReferenceMLP"), 3, lr=0.1, seed=0)
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()

    result = hooktrace.replay_module(trace, "fc1", step=2, module=model.fc1)

    # independently: the recorded input through the recorded weights, with plain torch
    x = _tensor(trace, "fc1", "input", 2)
    weight, bias = (_tensor(trace, "fc1", "param", 2, slot=s) for s in ("weight", "bias"))
    expected = F.linear(x, weight, bias)
    assert torch.equal(result.output, expected)
    assert torch.equal(result.recorded["0"], expected)
    assert result.exact and result.comparison["max_abs_error"].tolist() == [0.0]
    assert not torch.equal(weight, model.fc1.weight)  # step 2's weights, not today's
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(result.module.weight, weight)
    assert "EXACT" in repr(result) and "'fc1'" in repr(result)


def _dropout_mlp() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))


def test_dropout_draws_the_recorded_random_numbers(run_dir: Path) -> None:
    model = _dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train() -> None:
        for _ in range(3):
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    trace = _record(model, run_dir, train)
    result = hooktrace.replay_module(trace, "2", step=1, module=model[2])
    assert result.exact
    assert 0 < float((result.output == 0).float().mean()) < 1  # dropout did drop
    # the same numbers with plain torch, from the recorded RNG state
    spec = json.loads(trace.record("2", "input", step=1)["call_spec"])
    state = torch.frombuffer(bytearray(base64.b64decode(spec["cpu_rng_state"])), dtype=torch.uint8)
    with torch.random.fork_rng():
        torch.set_rng_state(state)
        expected = F.dropout(_tensor(trace, "2", "input", 1), p=0.5, training=True)
    assert torch.equal(result.output, expected)
    results = _replay_all(model, trace, step=2)
    assert len(results) == 5 and all(r.exact for r in results.values())


def test_bfloat16_replays_bit_exactly(run_dir: Path) -> None:
    model = _dropout_mlp().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train() -> None:
        for _ in range(2):
            model(torch.randn(16, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    trace = _record(model, run_dir, train)
    results = _replay_all(_dropout_mlp(), trace, step=1)  # a float32 module: dtype comes back
    assert results and all(r.exact for r in results.values())
    assert all(r.output.dtype == torch.bfloat16 for r in results.values())


# -- a transformer block ------------------------------------------------------------------


def _block() -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(
        d_model=32, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True
    )


def _train_block(block: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.Adam(block.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    block.train()
    for _ in range(steps):
        block(torch.randn(4, 10, 32, generator=generator)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    block.eval()
    with torch.no_grad():  # an evaluation after the last optimizer step: step `steps`, eval
        block(torch.randn(4, 10, 32, generator=generator))


def test_transformer_block_replays_bit_exactly(run_dir: Path) -> None:
    block = _block()
    trace = _record(block, run_dir, lambda: _train_block(block))
    # in eval, the layer takes torch's fused fast path, as it does unrecorded (per-module
    # hooks used to turn it off): its submodules are not called, so not recorded
    for step, phase, called in (
        (1, "train", {"TransformerEncoderLayer", "self_attn", "linear1"}),
        (2, "eval", {"TransformerEncoderLayer"}),
    ):
        results = _replay_all(block, trace, step=step)
        assert {key[3] for key in results} == {phase}
        assert {key[0] for key in results} >= called
        inexact = {key[0] for key, r in results.items() if not r.exact}
        # dropout1 is fed a transposed view: exact because the spec keeps its strides
        assert inexact == set(), inexact


def test_transformer_block_output_against_plain_torch(run_dir: Path) -> None:
    block = _block()
    trace = _record(block, run_dir, lambda: _train_block(block))
    root = "TransformerEncoderLayer"
    result = hooktrace.replay_module(trace, root, step=1, module=block)
    assert result.exact

    # independently: a fresh layer given the recorded weights and RNG state, no hooktrace
    fresh = _block()
    fresh.load_state_dict(
        {
            name: _tensor(trace, module, "param", 1, slot=slot)
            for name, _ in fresh.named_parameters()
            for module, slot in [name.rsplit(".", 1)]  # "self_attn.out_proj.weight"
        }
    )
    spec = json.loads(trace.record(root, "input", step=1)["call_spec"])
    state = torch.frombuffer(bytearray(base64.b64decode(spec["cpu_rng_state"])), dtype=torch.uint8)
    with torch.random.fork_rng():
        torch.set_rng_state(state)
        expected = fresh.train()(_tensor(trace, root, "input", 1))
    assert torch.equal(expected, result.recorded["0"])
    assert torch.equal(expected, result.output)


# -- a planted NaN ------------------------------------------------------------------------


class PoisonFrom(nn.Module):
    """Passes its input through, until its `start`-th call: from then on it returns NaN. The
    count lives in a buffer, so the trace knows where each step's call stood."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        poison = torch.where(self.calls >= self.start, float("nan"), 0.0)
        self.calls += 1
        return x + poison  # (x * nan under a where would make the gradients NaN at once)


class Poisoned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 8)
        self.poison = PoisonFrom(start=2)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.poison(torch.relu(self.fc1(x))))


def _train_poisoned(model: nn.Module, steps: int = 4) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        model(torch.randn(5, 6, generator=generator)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_replaying_the_module_that_made_the_first_nan_reproduces_it(run_dir: Path) -> None:
    model = Poisoned()
    trace = _record(model, run_dir, lambda: _train_poisoned(model))
    timeline = trace.timeline(2)
    first = timeline[timeline["first_nonfinite"]].iloc[0]
    assert (first["module"], first["kind"]) == ("poison", "output")
    assert int(model.poison.calls) == 4  # the module as it is now: past the NaN

    result = hooktrace.replay_module(trace, str(first["module"]), step=2, module=model.poison)
    assert result.exact and torch.isnan(result.output).all()
    recorded = trace.tensor("poison", "output", step=2)
    assert np.array_equal(np.isnan(recorded), torch.isnan(result.output).numpy())
    assert result.comparison[["nan_equal", "nan", "recorded_nan"]].values.tolist() == [
        [True, 40, 40]
    ]
    assert int(result.module.calls) == 3 and int(model.poison.calls) == 4  # a copy ran

    before = hooktrace.replay_module(trace, "poison", step=1, module=model.poison)
    assert before.exact and torch.isfinite(before.output).all()
    downstream = hooktrace.replay_module(trace, "fc2", step=2, module=model.fc2)
    assert downstream.exact and torch.isnan(downstream.output).all()


# -- what replay needs, and what it says when it is missing --------------------------------


def _mlp_trace(run: Path, **options: Any) -> tuple[nn.Module, Trace]:
    model = make_model("ReferenceBlock")
    train = lambda: train_steps(model, batches("ReferenceBlock"), 2, lr=0.1, seed=0)  # noqa: E731
    return model, _record(model, run, train, **options)


def test_without_inputs_the_error_names_the_options(run_dir: Path) -> None:
    model, trace = _mlp_trace(run_dir, inputs=False)
    with pytest.raises(TensorNotRecorded) as error:
        hooktrace.replay_module(trace, "block.fc1", step=1, module=model.block.fc1)
    message = str(error.value)
    assert "its inputs were not recorded" in message
    assert "inputs=True and full_steps=[1] (or full_every=1)" in message
    assert "full_modules matching 'block\\.fc1'" in message
    assert "(CLI: --inputs --full-steps 1 --full-modules 'block\\.fc1')" in message


def test_statistics_only_steps_and_modules_are_refused(run_dir: Path) -> None:
    model, trace = _mlp_trace(run_dir, full_steps=[0], full_every=None)
    with pytest.raises(TensorNotRecorded, match=r"statistics only; record with full_steps=\[1\]"):
        hooktrace.replay_module(trace, "block.fc1", step=1, module=model.block.fc1)
    assert hooktrace.replay_module(run_dir, "block.fc1", step=0, module=model.block.fc1).exact


def test_parameters_of_inner_modules_must_be_saved_too(tmp_path: Path) -> None:
    model, trace = _mlp_trace(tmp_path / "a", full_modules="^block$")
    with pytest.raises(TensorNotRecorded) as error:
        hooktrace.replay_module(trace, "block", step=1, module=model.block)
    assert "fc1.weight, fc1.bias, fc2.weight, fc2.bias (4 in all) were not saved" in str(
        error.value
    )
    assert "full_modules matching 'block'" in str(error.value)

    model, trace = _mlp_trace(tmp_path / "b", full_modules="fc2")
    with pytest.raises(TensorNotRecorded, match="no full_modules filter"):
        hooktrace.replay_module(trace, "ReferenceBlock", step=1, module=model)


def test_calls_steps_and_modules_that_do_not_exist(run_dir: Path) -> None:
    model, trace = _mlp_trace(run_dir)
    fc1 = model.block.fc1
    with pytest.raises(TensorNotRecorded, match="step 7 was not recorded"):
        hooktrace.replay_module(trace, "block.fc1", step=7, module=fc1)
    with pytest.raises(TensorNotRecorded, match=re.escape("it has call 0 of micro-step 0 (train)")):
        hooktrace.replay_module(trace, "block.fc1", step=1, call=3, module=fc1)
    with pytest.raises(TensorNotRecorded, match="'fc9' did not run at step 1"):
        hooktrace.replay_module(trace, "fc9", step=1, module=fc1)


def test_a_module_of_another_shape_is_refused(run_dir: Path) -> None:
    _, trace = _mlp_trace(run_dir)
    with pytest.raises(
        ConfigError, match=r"block\.fc1\.weight has shape \(5, 3\) here and \(4, 3\)"
    ):
        hooktrace.replay_module(trace, "block.fc1", step=1, module=nn.Linear(3, 5))
    with (
        pytest.warns(RuntimeWarning, match="recorded as a Linear; the module given is a Bilinear"),
        pytest.raises(ConfigError),
    ):
        hooktrace.replay_module(trace, "block.fc1", step=1, module=nn.Bilinear(3, 3, 4))


def test_replay_is_refused_inside_a_recording(tmp_path: Path) -> None:
    model, trace = _mlp_trace(tmp_path / "a")
    with (
        hooktrace.record(nn.Linear(2, 2), tmp_path / "b"),
        pytest.raises(RecordingError, match="inside an active recording"),
    ):
        hooktrace.replay_module(trace, "block.fc1", step=1, module=model.block.fc1)


def test_a_leaf_taking_no_tensor_input_replays(run_dir: Path) -> None:
    class Source(nn.Module):
        def forward(self, n: int) -> torch.Tensor:
            return torch.rand(n)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.source, self.fc = Source(), nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x + self.source(3))

    model = Model()
    trace = _record(model, run_dir, lambda: model(torch.randn(2, 3)).sum().backward())
    result = hooktrace.replay_module(trace, "source", step=0, module=model.source)
    assert result.exact and result.args == [3]


# -- known limits of the recording (the recorder would have to record more) -----------------


def test_dropout_on_a_transposed_input_replays_exactly(run_dir: Path) -> None:
    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.fc(x).transpose(0, 1))

    model = Transposed()
    trace = _record(model, run_dir, lambda: model(torch.randn(6, 4)).sum().backward())
    assert hooktrace.replay_module(trace, "drop", step=0, module=model.drop).exact


def test_a_container_taking_no_tensor_input_replays(run_dir: Path) -> None:
    class Source(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, n: int) -> torch.Tensor:
            return self.fc(torch.ones(n, 3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.source = Source()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.source(x.shape[0]) * x

    model = Model()
    trace = _record(model, run_dir, lambda: model(torch.ones(2, 3)).sum().backward())
    assert hooktrace.replay_module(trace, "source", step=0, module=model.source).exact


def test_equal_but_distinct_inputs_stay_distinct(run_dir: Path) -> None:
    class AddInPlace(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a.add_(1) + b  # changes a; b is another tensor that holds the same values

    model = AddInPlace()
    x = torch.ones(3)
    trace = _record(model, run_dir, lambda: model(x.clone(), x.clone()))
    assert hooktrace.replay_module(trace, "AddInPlace", step=0, module=model).exact
