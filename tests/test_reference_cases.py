"""Records checked against values worked out by hand (../shared/REFERENCE_CASES.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from models import (
    REFERENCE_GRAD_OUTPUTS,
    REFERENCE_GRADS,
    REFERENCE_OUTPUTS,
    ReferenceBlock,
    ReferenceMLP,
    reference_input,
)
from torch import nn

import hooktrace


def _record_once(model: nn.Module, run: Path, **options: object) -> torch.Tensor:
    x = reference_input()
    with hooktrace.record(model, run, full_every=1, **options) as rec:
        model(x).backward()
        rec.step()
    return x


@pytest.mark.parametrize("inplace", [False, True])
def test_case_1_forward_backward_and_parameter_gradients(run_dir: Path, inplace: bool) -> None:
    model = ReferenceMLP()
    model.relu1 = nn.ReLU(inplace=inplace)
    _record_once(model, run_dir, inputs=True)
    trace = hooktrace.load(run_dir)

    for module, value in REFERENCE_OUTPUTS.items():
        np.testing.assert_array_equal(trace.tensor(module, "output", step=0), value)
    for module, value in REFERENCE_GRAD_OUTPUTS.items():
        np.testing.assert_array_equal(trace.tensor(module, "grad_output", step=0), value)
    for name, value in REFERENCE_GRADS.items():
        module, slot = name.split(".")
        np.testing.assert_array_equal(trace.tensor(module, "grad_param", step=0, slot=slot), value)
    # relu1's input is fc1's output, seen before the in-place ReLU overwrote it
    np.testing.assert_array_equal(trace.tensor("relu1", "input", step=0), REFERENCE_OUTPUTS["fc1"])


def test_case_1_statistics_and_activity(run_dir: Path) -> None:
    _record_once(ReferenceMLP(), run_dir)
    trace = hooktrace.load(run_dir)
    relu = trace.record("relu1", "output", step=0)
    assert relu["zero_fraction"] == 0.5
    np.testing.assert_array_equal(trace.activity("relu1", step=0), [1, 0, 1, 0])  # units 1, 3 dead
    fc1 = trace.record("fc1", "output", step=0)
    assert (fc1["mean"], fc1["min"], fc1["max"]) == (-2.0, -29.0, 27.0)
    assert fc1["shape"] == "1,4" and fc1["numel"] == 4 and fc1["dtype"] == "float32"


def test_case_2_watched_intermediate_tensor(run_dir: Path) -> None:
    x = torch.tensor([0.0, 1, 2, 3], requires_grad=True)
    y = torch.tensor([4.0, 5, 6, 7], requires_grad=True)
    w = torch.tensor([1.0, 2, 3, 4], requires_grad=True)
    with hooktrace.record(nn.Identity(), run_dir, full_every=1) as rec:
        z = hooktrace.watch(x + y, "z")
        (w @ z).backward()
        rec.step()
    trace = hooktrace.load(run_dir)
    np.testing.assert_array_equal(trace.tensor("z", "tensor", step=0), [4, 6, 8, 10])
    np.testing.assert_array_equal(trace.tensor("z", "grad_tensor", step=0), [1, 2, 3, 4])
    np.testing.assert_array_equal(w.grad, [4, 6, 8, 10])  # training saw the usual gradients


def test_a_watched_leaf_records_each_backwards_gradient_once(run_dir: Path) -> None:
    """A parameter watched at every forward keeps its gradient hooks from one backward to the
    next: the second micro-step recorded two gradients, the third three, and so on."""
    w = nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    xs = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 5.0]])]
    with hooktrace.record(nn.Identity(), run_dir, full_every=1) as rec:
        for _ in range(2):
            for x in xs:  # two micro-steps: d(sum(x @ w.T))/dw = each row x
                (x @ hooktrace.watch(w, "w").t()).sum().backward()
            rec.step()
    records = hooktrace.load(run_dir).records
    grads = records[(records["module"] == "w") & (records["kind"] == "grad_tensor")]
    assert grads[["step", "micro_step"]].values.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    trace = hooktrace.load(run_dir)
    for step in range(2):
        for micro_step, x in enumerate(xs):
            expected = [x[0].tolist()] * 2
            got = trace.tensor("w", "grad_tensor", step=step, micro_step=micro_step)
            np.testing.assert_array_equal(got, expected)


def test_watch_outside_a_recording_is_a_no_op() -> None:
    t = torch.ones(3, requires_grad=True)
    assert hooktrace.watch(t * 2, "t") is not t
    u = t * 2
    assert hooktrace.watch(u, "u") is u
    assert not u._backward_hooks  # no gradient hook was registered


@pytest.mark.parametrize(
    ("tensor", "name", "said"),
    [
        (torch.ones(2), 5, "takes a non-empty string as the name, not 5"),
        (torch.ones(2), "", "takes a non-empty string as the name, not ''"),
        ("not a tensor", "x", "takes a torch.Tensor, not str"),
    ],
)
def test_watch_refuses_what_it_cannot_record_and_the_trace_keeps_its_steps(
    run_dir: Path, tensor: object, name: object, said: str
) -> None:
    """A bad argument is the caller's error, said at once, recording or not (found in review:
    a name that was not a string failed the writer, and the steps recorded before it were
    lost; a value that was not a tensor stopped the recording)."""
    model = nn.Linear(2, 2)
    with pytest.raises(hooktrace.ConfigError, match=said):
        hooktrace.watch(tensor, name)  # type: ignore[arg-type]
    with hooktrace.record(model, run_dir) as rec:
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            rec.step()
        with pytest.raises(hooktrace.ConfigError, match=said):
            hooktrace.watch(tensor, name)  # type: ignore[arg-type]
        model(torch.ones(1, 2)).sum().backward()
        rec.step()
    trace = hooktrace.load(run_dir)
    assert trace.status == "complete" and sorted(trace.steps["step"]) == [0, 1, 2]


def test_case_3_conv_shapes_and_channel_units(run_dir: Path) -> None:
    conv = nn.Conv2d(1, 3, kernel_size=3)
    with hooktrace.record(conv, run_dir) as rec:
        conv(torch.randn(1, 1, 28, 28))
        rec.step()
    row = hooktrace.load(run_dir).record("Conv2d", "output", step=0)
    assert row["shape"] == "1,3,26,26"
    assert (row["units"], row["unit_size"]) == (3, 26 * 26)


def test_case_4_composite_module_gradient(run_dir: Path) -> None:
    x = _record_once(ReferenceBlock(), run_dir)
    trace = hooktrace.load(run_dir)
    np.testing.assert_array_equal(trace.tensor("block", "grad_output", step=0), [[1.0]])
    np.testing.assert_array_equal(trace.tensor("block.fc1", "grad_output", step=0), [[1, 0, 3, 0]])
    np.testing.assert_array_equal(x.grad, [[22.0, 26.0, 30.0]])
