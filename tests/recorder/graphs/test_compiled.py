"""Compiled models recorded from the inside (issue: compiled models).

Every test here compiles for real: inductor, whose C++ kernels gcc builds on this CPU, is the
default backend scripts use, and ``aot_eager`` (dynamo and AOTAutograd, no code generation)
stands in where a test needs several compiles. Each run resets dynamo first: a graph compiled
before a recording began is not instrumented, and dynamo would reuse it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import math
import re
import shutil
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hooktrace
from hooktrace.recorder.graphs import backend, ops
from hooktrace.recorder.graphs.joint import joint_pass_available
from hooktrace.recorder.recording.discover import ScriptRecorder
from tests.models import (
    REFERENCE_GRAD_OUTPUTS,
    REFERENCE_OUTPUTS,
    ReferenceMLP,
    TinyTransformer,
    reference_input,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


Run = tuple[list[float], dict[str, torch.Tensor], Counter[str]]


def _train(
    out: Path | None,
    compile_model: Callable[[nn.Module], nn.Module] | None,
    *,
    steps: int = 3,
    strict: bool = True,
    make: Callable[[], nn.Module] = Blocks,
) -> Run:
    """``steps`` SGD steps of a freshly seeded model (``make``: :class:`Blocks`), compiled
    by ``compile_model`` (None: eager), recorded into ``out`` where given: the losses, the
    final parameters and dynamo's graph counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = make()
    run = compile_model(model) if compile_model is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=data) for _ in range(steps)]
    losses: list[float] = []

    def train() -> None:
        for x in batches:
            loss = run(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())

    if out is None:
        train()
    else:
        with hooktrace.record(run, out, strict=strict):
            train()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, params, Counter(torch._dynamo.utils.counters["stats"])


def _inductor(model: nn.Module) -> nn.Module:
    return torch.compile(model)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def inductor_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("compiled")
    return {
        "plain": _train(None, _inductor),
        "recorded": _train(root / "compiled", _inductor),
        "eager": _train(root / "eager", None),
        "root": root,
    }


def test_recording_a_compiled_model_leaves_its_training_and_graphs_as_they_were(
    inductor_runs: dict[str, object],
) -> None:
    losses, params, counters = inductor_runs["plain"]  # type: ignore[misc]
    recorded_losses, recorded_params, recorded_counters = inductor_runs["recorded"]  # type: ignore[misc]
    assert recorded_losses == losses
    for name, value in params.items():
        assert torch.equal(recorded_params[name], value), name
    # the same graphs, captured once: no graph break, no recompile per step (the recorder's
    # marks are calls captured too, taken out before the backend compiles the graph)
    assert recorded_counters["unique_graphs"] == counters["unique_graphs"] == 1


def test_every_module_inside_is_recorded_as_an_eager_run_records_it(
    inductor_runs: dict[str, object],
) -> None:
    root: Path = inductor_runs["root"]  # type: ignore[assignment]
    compiled = hooktrace.load(root / "compiled").records
    eager = hooktrace.load(root / "eager").records
    columns = ["step", "micro_step", "phase", "module", "call", "kind", "slot", "units"]
    # in the same order, but for the root's gradient: caught outside the graph, before the
    # backward of the graph whose taps catch the modules' inside
    assert sorted(compiled[columns].values.tolist()) == sorted(eager[columns].values.tolist())
    forward = compiled[compiled["kind"] != "grad_output"]
    eager_forward = eager[eager["kind"] != "grad_output"]
    assert forward[columns].values.tolist() == eager_forward[columns].values.tolist()
    assert set(compiled["module"]) == {
        "Blocks", "norm", "head",
        *(f"blocks.{i}{inner}" for i in range(3) for inner in ("", ".fc", ".act")),
    }  # fmt: skip


def test_a_compiled_run_matches_the_eager_run_at_the_compilers_tolerance(
    inductor_runs: dict[str, object],
) -> None:
    root: Path = inductor_runs["root"]  # type: ignore[assignment]
    result = hooktrace.diff(root / "eager", root / "compiled", rtol=1e-4)
    assert result.match, result
    assert result.records == len(hooktrace.load(root / "eager").records)


def test_dead_relus_are_counted_in_the_graph(inductor_runs: dict[str, object]) -> None:
    root: Path = inductor_runs["root"]  # type: ignore[assignment]
    compiled, eager = hooktrace.load(root / "compiled"), hooktrace.load(root / "eager")
    for step in range(3):
        for i in range(3):
            counts = compiled.activity(f"blocks.{i}.act", step=step)
            assert counts.tolist() == eager.activity(f"blocks.{i}.act", step=step).tolist()


def test_reference_case_one_compiled_by_inductor_records_the_values_worked_out_by_hand(
    tmp_path: Path,
) -> None:
    """REFERENCE_CASES.md, case 1, through inductor: outputs and output gradients whose
    values are known by hand, and relu1's two active units. With ``fullgraph=True`` (the
    recording adds no graph break) and ``mode="reduce-overhead"`` (CUDA graphs, which a CPU
    graph skips)."""
    torch._dynamo.reset()
    model = ReferenceMLP()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with hooktrace.record(compiled, tmp_path / "run", strict=True):
        compiled(reference_input()).sum().backward()
    trace = hooktrace.load(tmp_path / "run")
    records = trace.records.set_index(["module", "kind"])
    for name, kind, values in [
        *((m, "output", v) for m, v in REFERENCE_OUTPUTS.items()),
        *((m, "grad_output", v) for m, v in REFERENCE_GRAD_OUTPUTS.items()),
    ]:
        expected = np.array(values, dtype=np.float64)
        row = records.loc[(name, kind)]
        assert row["mean"] == pytest.approx(expected.mean()), (name, kind)
        assert row["std"] == pytest.approx(expected.std()), (name, kind)
        assert (row["min"], row["max"]) == (expected.min(), expected.max()), (name, kind)
        assert row["norm"] == pytest.approx(math.sqrt((expected**2).sum())), (name, kind)
        assert row["zero_fraction"] == (expected == 0).mean(), (name, kind)
        assert row["nan_count"] == row["inf_count"] == 0
    assert trace.activity("relu1", step=0).tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_other_backends_record_the_same(tmp_path: Path, backend: str) -> None:
    def compile_model(model: nn.Module) -> nn.Module:
        return torch.compile(model, backend=backend)  # type: ignore[return-value]

    _assert_trains_as_plain_and_matches_eager(tmp_path, compile_model)


def test_max_autotune_records_the_same(tmp_path: Path) -> None:
    """``mode="max-autotune"``: inductor tries several kernels for each operation and keeps
    the fastest; the statistics compiled in change neither the choice's numbers nor the
    records."""

    def compile_model(model: nn.Module) -> nn.Module:
        return torch.compile(model, mode="max-autotune")  # type: ignore[return-value]

    _assert_trains_as_plain_and_matches_eager(tmp_path, compile_model)
    names = set(hooktrace.load(tmp_path / "compiled").query(kinds=["output"])["module"])
    blocks = {f"blocks.{i}{part}" for i in range(3) for part in ("", ".fc", ".act")}
    assert names == {"Blocks", *blocks, "norm", "head"}


def test_a_compile_that_allows_only_pt2_compliant_operators_traces_the_marks(
    tmp_path: Path,
) -> None:
    """Dynamo traces the recorder's marks itself, from the hooks: under its
    ``only_allow_pt2_compliant_ops`` an operator without that tag is refused, a graph break
    at every recorded call, an error with ``fullgraph=True`` (found in review: the marks,
    declared on hooktrace's library, had lost the tag ``custom_op`` gave them)."""

    def compile_model(model: nn.Module) -> nn.Module:
        return torch.compile(model, backend="aot_eager", fullgraph=True)  # type: ignore[return-value]

    with torch._dynamo.config.patch(only_allow_pt2_compliant_ops=True):
        plain = _train(None, compile_model, steps=2)
        recorded = _train(tmp_path / "compiled", compile_model, steps=2)
    assert recorded[0] == plain[0]
    assert recorded[2]["unique_graphs"] == plain[2]["unique_graphs"] == 1
    names = set(hooktrace.load(tmp_path / "compiled").query(kinds=["output"])["module"])
    blocks = {f"blocks.{i}{part}" for i in range(3) for part in ("", ".fc", ".act")}
    assert names == {"Blocks", *blocks, "norm", "head"}


def _assert_trains_as_plain_and_matches_eager(
    tmp_path: Path, compile_model: Callable[[nn.Module], nn.Module]
) -> None:
    """Two steps compiled, recorded into ``compiled``: the losses of the same steps
    unrecorded, and records that match an eager recording (``eager``) at rtol 1e-4."""
    plain = _train(None, compile_model, steps=2)
    recorded = _train(tmp_path / "compiled", compile_model, steps=2)
    assert recorded[0] == plain[0]
    _train(tmp_path / "eager", None, steps=2)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result


def test_blocks_compiled_one_by_one_are_each_recorded_under_their_own_names(
    tmp_path: Path,
) -> None:
    """Large trainers compile each block: one graph then serves every block, and each call
    is named from the parameters it was given."""

    def compile_blocks(model: nn.Module) -> nn.Module:
        for block in model.blocks:  # type: ignore[union-attr]
            block.compile(backend="aot_eager")
        return model

    plain = _train(None, compile_blocks, steps=2)
    recorded = _train(tmp_path / "compiled", compile_blocks, steps=2)
    assert recorded[0] == plain[0]
    assert recorded[2]["unique_graphs"] == plain[2]["unique_graphs"]
    _train(tmp_path / "eager", None, steps=2)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result
    assert result.records == len(hooktrace.load(tmp_path / "eager").records)


def _train_with_a_compiled_step(
    out: Path | None, how: str, *, script: bool = False, steps: int = 3
) -> Run:
    """``steps`` AdamW steps of an eager :class:`Blocks` whose optimizer step is compiled by
    inductor (``how``: "step", ``torch.compile(opt.step)``; "function", a compiled function
    that calls it and ``zero_grad``; "eager", neither compiled), recorded into ``out`` where
    given, by ``hooktrace record``'s recorder, started before the script, where ``script``."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recorder = ScriptRecorder(str(out)) if script else None
    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step_and_zero() -> None:
        opt.step()
        opt.zero_grad()

    step: Callable[[], Any] = {
        "step": torch.compile(opt.step),
        "function": torch.compile(step_and_zero),
        "eager": step_and_zero,
    }[how]
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=data) for _ in range(steps)]
    losses: list[float] = []
    if recorder is None and out is not None:
        recorder = hooktrace.record(model, out)
    with recorder if recorder is not None else contextlib.nullcontext():
        for x in batches:
            loss = model(x).pow(2).mean()
            loss.backward()
            step()
            opt.zero_grad()
            losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    counters = Counter(torch._dynamo.utils.counters["stats"])
    counters["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    return losses, params, counters


@pytest.mark.parametrize(
    ("how", "script"), [("step", False), ("function", False), ("function", True)]
)
def test_a_compiled_optimizer_step_compiles_as_it_does_unrecorded(
    tmp_path: Path, how: str, script: bool
) -> None:
    """The optimizer's step hooks run outside its graph: dynamo traced the recorder's
    step boundary into it, and AdamW's step compiled into 14 graphs with 17 graph breaks."""
    plain = _train_with_a_compiled_step(None, how)
    recorded = _train_with_a_compiled_step(tmp_path / "compiled", how, script=script)
    assert recorded[0] == plain[0]
    for name, value in plain[1].items():
        assert torch.equal(recorded[1][name], value), name
    for counter in ("unique_graphs", "calls_captured"):
        assert recorded[2][counter] == plain[2][counter] > 0, counter
    # the hooks are left out of the step's frame, whose own break then goes uncounted
    assert recorded[2]["graph_breaks"] <= plain[2]["graph_breaks"]
    _train_with_a_compiled_step(tmp_path / "eager", "eager")
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled")
    assert result.match, result
    assert result.records == len(hooktrace.load(tmp_path / "eager").records)
    assert hooktrace.load(tmp_path / "compiled").steps["step"].tolist() == [0, 1, 2]


class Gate(nn.Module):
    """A block without parameters: what names its graph's module calls at run time is the
    frame running it, not a parameter it takes."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) * 2.0


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fcs = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.gates = nn.ModuleList([Gate() for _ in range(3)])
        self.run_gate: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda g, x: g(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc, gate in zip(self.fcs, self.gates, strict=True):
            x = self.run_gate(gate, fc(x))
        return x


@pytest.mark.parametrize("how", ["method", "function"])
def test_blocks_without_parameters_compiled_one_by_one_are_each_recorded_under_their_own_names(
    tmp_path: Path, how: str
) -> None:
    """One graph serves the three gates, which take no parameter: every gate's ReLU was
    recorded as the first gate's, its calls 0, 1 and 2."""

    def compile_gates(model: nn.Module) -> nn.Module:
        if how == "method":  # each gate's Module.compile()
            for gate in model.gates:  # type: ignore[union-attr]
                gate.compile(backend="aot_eager")
        else:  # a compiled function the gate is handed to
            model.run_gate = torch.compile(lambda g, x: g(x), backend="aot_eager")
        return model

    plain = _train(None, compile_gates, steps=2, make=Gated)
    recorded = _train(tmp_path / "compiled", compile_gates, steps=2, make=Gated)
    assert recorded[0] == plain[0]
    _train(tmp_path / "eager", None, steps=2, make=Gated)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result
    records = hooktrace.load(tmp_path / "compiled").records
    assert {f"gates.{i}.act" for i in range(3)} <= set(records["module"])


class Watching(Blocks):
    """Blocks that name a tensor of their forward with ``hooktrace.watch``, the README's way
    to record a value no module returns; once under activation checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = hooktrace.watch(self.blocks[0](x) * 2.0, "doubled")
        x = torch.utils.checkpoint.checkpoint(self._checkpointed, x, use_reentrant=False)
        return self.head(self.norm(self.blocks[2](x)))

    def _checkpointed(self, x: torch.Tensor) -> torch.Tensor:
        return hooktrace.watch(self.blocks[1](x).tanh(), "squashed")


def test_a_watched_tensor_is_marked_in_the_graph_as_a_module_output_is(tmp_path: Path) -> None:
    """Dynamo traced hooktrace.watch's recording into the graph: 14 graphs and 23 graph
    breaks where the model compiled into one. Now its tensor is marked, summarised and its
    gradient tapped in the graph, and recorded as an eager run records it."""
    plain = _train(None, _inductor, make=Watching)
    recorded = _train(tmp_path / "compiled", _inductor, make=Watching)
    assert recorded[0] == plain[0]
    for name, value in plain[1].items():
        assert torch.equal(recorded[1][name], value), name
    assert recorded[2]["unique_graphs"] == plain[2]["unique_graphs"] == 1
    _train(tmp_path / "eager", None, make=Watching)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result
    assert result.records == len(hooktrace.load(tmp_path / "eager").records)
    records = hooktrace.load(tmp_path / "compiled").records
    kinds = records.groupby("module")["kind"].agg(set)
    for name in ("doubled", "squashed"):
        assert kinds[name] == {"tensor", "grad_tensor"}, kinds


class CheckpointedBlocks(Blocks):
    """:class:`Blocks` whose blocks are recomputed in the backward (activation
    checkpointing, as large trainers use it with the compiler)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(self.norm(x))


def test_modules_inside_activation_checkpointing_are_recorded_as_an_eager_run_records_them(
    tmp_path: Path,
) -> None:
    """dynamo traces a checkpointed region as a graph of its own, which the frame's graph
    calls: its modules' outputs leave it to be summarised, their gradients are tapped
    inside it, and the recorded run trains bit-identically (inductor). They were missing
    from the trace, without a word."""
    plain = _train(None, _inductor, steps=2, make=CheckpointedBlocks)
    recorded = _train(tmp_path / "compiled", _inductor, steps=2, make=CheckpointedBlocks)
    assert recorded[0] == plain[0]
    assert all(torch.equal(recorded[1][k], plain[1][k]) for k in plain[1])
    assert recorded[2]["unique_graphs"] == plain[2]["unique_graphs"]
    _train(tmp_path / "eager", None, steps=2, make=CheckpointedBlocks)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result
    eager = hooktrace.load(tmp_path / "eager").records
    assert result.records == len(eager) == len(hooktrace.load(tmp_path / "compiled").records)
    assert {"blocks.0.fc", "blocks.0.act"} <= set(
        eager.loc[eager["kind"] == "grad_output", "module"]
    )


class TiedLM(nn.Module):
    """A language model whose head shares the embedding's weight, as most do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.embed(x))))


def test_a_model_whose_parameters_are_tied_is_recorded_inside_its_graph(tmp_path: Path) -> None:
    """The graph's first parameter is the embedding's weight, which the model also holds as
    its head's: the module that ran is found under either name. Nothing inside the graph
    was recorded, without a word."""
    xs = [
        torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    for name, compiled in (("eager", False), ("compiled", True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TiedLM()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        with hooktrace.record(run, tmp_path / name, strict=True):
            for x in xs:
                run(x).pow(2).mean().backward()
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-5)
    assert result.match, result
    eager = hooktrace.load(tmp_path / "eager").records
    assert result.records == len(eager) == len(hooktrace.load(tmp_path / "compiled").records)


class InPlaceBlocks(nn.Module):
    """Checkpointed blocks whose linear layer's output a ReLU then changes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)) for _ in range(2)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_a_value_changed_in_place_later_in_a_checkpointed_region_is_recorded_as_returned(
    tmp_path: Path,
) -> None:
    """Under no_grad no tap copies the value: it leaves the region as a copy made where it
    was returned. It was recorded after the ReLU had changed it."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for name, compiled in (("eager", False), ("compiled", True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = InPlaceBlocks()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        with hooktrace.record(run, tmp_path / name, strict=True), torch.no_grad():
            run(x)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-5)
    assert result.match, result
    records = hooktrace.load(tmp_path / "compiled").records
    assert result.records == len(hooktrace.load(tmp_path / "eager").records) == len(records)
    assert (records["kind"] == "output").sum() == 7  # the root, each block, its two layers


def test_steps_not_recorded_run_regions_without_their_marks(tmp_path: Path) -> None:
    """The graph compiled for steps that are not recorded holds no mark, in the regions it
    calls either (they were left in, and called at every step)."""
    plain_graphs: list[torch.fx.GraphModule] = []
    original = backend._Instrumenting._as_it_was

    def kept(self: Any, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled = original(self, gm, example_inputs)
        plain_graphs.append(gm)
        return compiled

    torch._dynamo.reset()
    model = CheckpointedBlocks()
    run = torch.compile(model, backend="aot_eager")
    with (
        pytest.MonkeyPatch.context() as patch,
        hooktrace.record(run, tmp_path / "run", every=2, strict=True),
    ):
        patch.setattr(backend._Instrumenting, "_as_it_was", kept)
        run(torch.randn(4, 8)).sum().backward()
    assert plain_graphs
    regions = [m for gm in plain_graphs for m in gm.modules() if m is not gm]
    assert regions  # the checkpointed blocks' regions
    marks = [n for gm in plain_graphs for m in gm.modules() for n in m.graph.nodes
             if n.op == "call_function" and n.target in ops.MARKS]  # fmt: skip
    assert marks == []


_TP_IN_A_REGION = """
import sys
import torch
import torch.distributed as dist
import torch.utils.checkpoint as cp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import hooktrace

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(cp.checkpoint(self.block, x, use_reentrant=False))


torch.manual_seed(0)
model = Model()
plan = {"fc": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel()}
parallelize_module(model.block, mesh, plan)
run = torch.compile(model, backend="aot_eager")
with hooktrace.record(run, sys.argv[1]):
    run(torch.randn(4, 8)).sum().backward()
dist.destroy_process_group()
"""


def test_a_tensor_parallel_layer_inside_a_checkpointed_region_is_said_to_be_left_out(
    tmp_path: Path,
) -> None:
    """A DTensor's local tensor is marked inside the region, where its shard's place is
    read from the DTensor: it stays there, and the note names its module. The records were
    dropped under a false reason (a dynamic shape)."""
    from tests.torchrun import torchrun

    (tmp_path / "tp.py").write_text(_TP_IN_A_REGION)
    done = torchrun(tmp_path, "tp.py", str(tmp_path / "run"), ranks=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dynamic shape" not in done.stderr
    (note,) = hooktrace.summary(tmp_path / "run").notes[0]
    assert "'block.fc', 'block.fc2' run in regions that the recorder does not open" in note
    records = hooktrace.load(tmp_path / "run").records  # the block's own output is plain
    assert set(records.loc[records["kind"] == "output", "module"]) == {"Model", "block", "head"}


_TP_WATCHED = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import hooktrace

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(hooktrace.watch(torch.relu(self.fc(x)), "hidden"))  # a DTensor


for out, compiled in (sys.argv[1], True), (sys.argv[2], False):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Model()
    parallelize_module(model, mesh, {"fc": ColwiseParallel(use_local_output=False),
                                     "fc2": RowwiseParallel()})
    run = torch.compile(model, backend="aot_eager") if compiled else model
    with hooktrace.record(run, out):
        for _ in range(2):
            run(torch.randn(4, 8)).sum().backward()
dist.destroy_process_group()
"""


def test_a_watched_dtensor_inside_a_compiled_graph_is_recorded_by_its_local_shard(
    tmp_path: Path,
) -> None:
    """A watched DTensor was not marked in the graph, and went unrecorded without a word;
    now by its local tensor, placed as an eager run places it."""
    from tests.torchrun import torchrun

    (tmp_path / "tp.py").write_text(_TP_WATCHED)
    done = torchrun(tmp_path, "tp.py", str(tmp_path / "compiled"), str(tmp_path / "eager"),
                    ranks=1)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-5)
    assert result.match, result
    assert result.records == len(hooktrace.load(tmp_path / "eager").records)
    records = hooktrace.load(tmp_path / "compiled").records
    watched = records[records["module"] == "hidden"]
    assert sorted(watched["kind"]) == ["grad_tensor"] * 2 + ["tensor"] * 2


class Branching(nn.Module):
    """Modules called inside ``torch.cond``'s branches."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cond(x.sum() > 0, lambda t: self.act(self.fc(t)), lambda t: self.fc(t), (x,))
        return self.head(y)


def test_modules_inside_a_region_that_is_not_opened_are_said_to_be_left_out(
    tmp_path: Path,
) -> None:
    """torch.cond's branches are regions of their own too, which the recorder does not take
    apart: the modules inside are named, in a warning and in the trace's notes, and the rest
    of the graph is recorded. They went unrecorded without a word."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(Branching(), backend="aot_eager")
    with (
        pytest.warns(RuntimeWarning, match="'fc', 'act' run in regions that the recorder"),
        hooktrace.record(compiled, tmp_path / "run", strict=True),
    ):
        for _ in range(2):
            compiled(torch.randn(4, 8)).sum().backward()
    records = hooktrace.load(tmp_path / "run").records
    outputs = records[records["kind"].isin(["output", "grad_output"])]
    assert sorted(set(outputs["module"])) == ["Branching", "head"]
    (note,) = hooktrace.summary(tmp_path / "run").notes[0]
    assert "'fc', 'act' run in regions that the recorder does not open" in note

    # a model that is not recorded is not named
    torch._dynamo.reset()
    bystander = torch.compile(Branching(), backend="aot_eager")
    recorded = nn.Linear(8, 8)
    with hooktrace.record(recorded, tmp_path / "other", strict=True):
        recorded(torch.randn(4, 8)).sum().backward()
        bystander(torch.randn(4, 8)).sum().backward()
    assert hooktrace.summary(tmp_path / "other").notes == {}


def test_a_watched_tensor_is_saved_whole_on_a_full_step_as_an_eager_run_saves_it(
    tmp_path: Path,
) -> None:
    """A full step saved a watched tensor's gradient but not the tensor: the graph's records
    asked whether a module of that name is saved whole, which no watched name is."""
    for out, compile_model in (("compiled", _aot_eager), ("eager", None)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Watching()
        run = compile_model(model) if compile_model is not None else model
        with hooktrace.record(run, tmp_path / out, full_steps=[0]):
            run(torch.randn(4, 8)).pow(2).mean().backward()
    compiled, eager = (hooktrace.load(tmp_path / out) for out in ("compiled", "eager"))
    for name in ("doubled", "squashed"):
        for kind in ("tensor", "grad_tensor"):
            expected = eager.tensor(name, kind, step=0)
            np.testing.assert_allclose(compiled.tensor(name, kind, step=0), expected, rtol=1e-5)


def _aot_eager(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="aot_eager")  # type: ignore[return-value]


class WatchingInABranch(Branching):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        watched = lambda t: hooktrace.watch(self.fc(t) * 2.0, "inside")  # noqa: E731
        return self.head(torch.cond(x.sum() > 0, watched, lambda t: self.fc(t), (x,)))


def test_a_watched_tensor_inside_a_region_that_is_not_opened_is_named_by_its_name(
    tmp_path: Path,
) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(WatchingInABranch(), backend="aot_eager")
    with pytest.warns(RuntimeWarning), hooktrace.record(compiled, tmp_path / "run"):
        compiled(torch.randn(4, 8)).sum().backward()
    (note,) = hooktrace.summary(tmp_path / "run").notes[0]
    assert note.startswith("inside a compiled graph, 'inside', 'fc' run in regions"), note


class RegionBlock(Block):
    forward = torch.compiler.nested_compile_region(Block.forward)


class RegionBlocks(Blocks):
    """Four blocks, each a nested compile region: one region, whose body dynamo traces once,
    called for every block but the first."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([RegionBlock() for _ in range(4)])


class CheckpointedRegionBlocks(RegionBlocks):
    """The four blocks run inside activation checkpointing's region."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.utils.checkpoint.checkpoint(self._blocks, x, use_reentrant=False)
        return self.head(self.norm(x))

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("make", [RegionBlocks, CheckpointedRegionBlocks])
def test_every_call_of_a_nested_compile_region_is_named_as_left_out(
    tmp_path: Path, make: Callable[[], nn.Module]
) -> None:
    """The region's body holds the marks of the call it was traced for: the note named that
    block's modules, not the other blocks that run it (inside a checkpointed region too,
    where the parameters each call hands the region are the region's arguments)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(make(), backend="aot_eager")
    with pytest.warns(RuntimeWarning), hooktrace.record(compiled, tmp_path / "run"):
        compiled(torch.randn(4, 8)).sum().backward()
    (note,) = hooktrace.summary(tmp_path / "run").notes[0]
    records = hooktrace.load(tmp_path / "run").records
    recorded = set(records.loc[records["kind"] == "output", "module"])
    for i in range(4):
        for inner in ("fc", "act"):
            path = f"blocks.{i}.{inner}"
            assert (f"'{path}'" in note) != (path in recorded), (path, note)


def test_an_evaluation_under_no_grad_is_recorded_from_its_inference_graph(
    tmp_path: Path,
) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks().eval()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 8)
    with hooktrace.record(compiled, tmp_path / "run", strict=True), torch.no_grad():
        compiled(x)
    records = hooktrace.load(tmp_path / "run").records
    assert set(records["phase"]) == {"eval"}
    assert "grad_output" not in set(records["kind"])
    assert len(records[records["kind"] == "output"]) == 1 + 3 * 3 + 2


def test_a_compiled_function_that_calls_the_model_records_it_whole(tmp_path: Path) -> None:
    """``torch.compile`` of a training step's forward, which calls the model inside: no hook
    of the model runs, its root's output and its parameters come from the graph too."""

    def compile_forward(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return torch.compile(lambda x: model(x), backend="aot_eager")

    def train(out: Path) -> list[float]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Blocks()
        forward = compile_forward(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(1)
        losses = []
        with hooktrace.record(model, out, strict=True):
            for _ in range(2):
                loss = forward(torch.randn(4, 8, generator=data)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses

    train(tmp_path / "compiled")
    _train(tmp_path / "eager", None, steps=2)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result
    assert result.records == len(hooktrace.load(tmp_path / "eager").records)


class _Trainer:
    """What training scripts often compile: a method of an object that holds the model and
    its loss (no module itself)."""

    def __init__(self) -> None:
        self.model = Blocks()
        self.loss_fn = nn.MSELoss()

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(x), torch.zeros(4, 2))


class _Lit(nn.Module):
    """A module whose own method, not its forward, is compiled: a LightningModule's
    ``training_step``, calling the model it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Blocks()

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).pow(2).mean()


_COMPILED_CALLERS: dict[str, Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]] = {
    # the model a global of the compiled function's module, reached as G['model']
    "global": lambda model: torch.compile(_global_forward, backend="aot_eager"),
    # a closure's variable, and an argument (L['model'])
    "closure": lambda model: torch.compile(lambda x: model(x), backend="aot_eager"),
    "argument": lambda model: functools.partial(
        torch.compile(lambda m, x: m(x), backend="aot_eager"), model
    ),
}

_global_model: list[nn.Module] = []


def _global_forward(x: torch.Tensor) -> torch.Tensor:
    return _global_model[0](x)


def _train_compiled_caller(
    out: Path, how: str, *, script: bool, steps: int = 2
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` SGD steps of :class:`Blocks` called only inside a compiled function
    (``how``: a key of ``_COMPILED_CALLERS``; "method": a compiled method of a
    :class:`_Trainer`; "module method": of a :class:`_Lit`), recorded by ``hooktrace.record(model, out)``, or where ``script``
    by ``hooktrace record``'s recorder, which is told of no model. The loss is the
    eager run's of :func:`_train` (``pow(2).mean()``), but for "method" (its own loss
    module, inside the graph)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    if how == "method":
        trainer = _Trainer()
        model, loss_of = trainer.model, torch.compile(trainer.loss, backend="aot_eager")
    elif how == "module method":
        lit = _Lit()
        model, loss_of = lit.model, torch.compile(lit.training_step, backend="aot_eager")
    else:
        model = Blocks()
        _global_model[:] = [model]
        forward = _COMPILED_CALLERS[how](model)

        def loss_of(x: torch.Tensor) -> torch.Tensor:
            return forward(x).pow(2).mean()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    losses = []
    recorder = (
        ScriptRecorder(str(out), strict=True)
        if script
        else hooktrace.record(model, out, strict=True)
    )
    with recorder:
        for _ in range(steps):
            loss = loss_of(torch.randn(4, 8, generator=data))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    _global_model.clear()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("how", ["global", "closure", "argument", "method", "module method"])
@pytest.mark.parametrize("script", [False, True], ids=["record", "script"])
def test_a_model_called_only_inside_a_compiled_function_is_recorded_as_an_eager_run(
    tmp_path: Path, how: str, script: bool
) -> None:
    """However a compiled function reaches the model (a global, a closure, an argument, a
    trainer's ``self.model``, a module's own method's), every module inside is recorded as an eager run records it:
    given to ``hooktrace.record``, or found by ``hooktrace record`` as dynamo compiles the
    function (no call of the model runs outside the graph for it to meet). The trainer's
    loss module is found too, as a root of its own, as an eager run finds it."""
    compiled = _train_compiled_caller(tmp_path / "compiled", how, script=script)
    with torch._dynamo.config.patch(disable=True):
        eager = _train_compiled_caller(tmp_path / "eager", how, script=script)
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result
    records = hooktrace.load(tmp_path / "compiled").records
    assert result.records == len(records)
    kinds = Counter(records["kind"])
    assert kinds["output"] == kinds["grad_output"] > 0, kinds
    modules = set(records["module"])
    assert {"blocks.0.fc", "blocks.2.act", "norm", "head"} <= modules, modules
    if script and how == "method":
        assert "MSELoss" in modules  # the trainer's loss module, a root found beside it
    roots = hooktrace.load(tmp_path / "compiled").modules
    assert not any("GraphModule" in name for name in roots["module"]), roots


def test_a_graph_a_backend_runs_as_a_module_is_not_taken_for_a_model(tmp_path: Path) -> None:
    """aot_eager runs its forward graph as a module, called at the top of the script's
    calls as a model is: ``hooktrace record`` does not record it as a root (it recorded the
    graph's outputs as an evaluation's, and found no model)."""
    _train_compiled_caller(tmp_path / "run", "global", script=True)
    trace = hooktrace.load(tmp_path / "run")
    assert set(trace.records["phase"]) == {"train"}
    assert not any("GraphModule" in name for name in trace.modules["module"])


def _eager_and_compiled(
    tmp_path: Path, run: Callable[[Path], None]
) -> tuple[hooktrace.Trace, hooktrace.Trace]:
    """``run(out)`` with dynamo disabled into ``eager``, then compiled into ``compiled``
    (``run`` compiles what it compiles), each from a fresh dynamo: both traces."""
    for name, disable in (("eager", True), ("compiled", False)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        with torch._dynamo.config.patch(disable=disable):
            run(tmp_path / name)
    return hooktrace.load(tmp_path / "eager"), hooktrace.load(tmp_path / "compiled")


def _matching(eager: hooktrace.Trace, compiled: hooktrace.Trace) -> None:
    result = hooktrace.diff(eager.path, compiled.path, rtol=1e-4)
    assert result.match, result
    assert result.records == len(eager.records) == len(compiled.records) > 0


class _TwoParts(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.emb = embedding
        self.fc = nn.Linear(4, 4)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(i))


def test_two_models_sharing_a_module_are_each_recorded_under_their_names(tmp_path: Path) -> None:
    """An encoder and a decoder sharing an embedding, called by a trainer's compiled method
    (the decoder first): the shared parameter fits both models' paths, and the decoder's
    calls were written under the encoder's names."""

    def run(out: Path) -> None:
        embedding = nn.Embedding(10, 4)
        enc, dec = _TwoParts(embedding), _TwoParts(embedding)

        class Trainer:
            def loss(self, i: torch.Tensor) -> torch.Tensor:
                return (self.dec(i) * 3).sum() + self.enc(i).sum()

        trainer = Trainer()
        trainer.enc, trainer.dec = enc, dec  # type: ignore[attr-defined]
        step = torch.compile(trainer.loss, backend="aot_eager")
        with hooktrace.record({"enc": enc, "dec": dec}, out, strict=True):
            step(torch.tensor([1, 2, 3])).backward()

    eager, compiled = _eager_and_compiled(tmp_path, run)
    _matching(eager, compiled)
    assert {"dec.fc", "enc.fc"} <= set(compiled.records["module"])


def test_a_module_not_recorded_called_first_leaves_the_model_recorded(tmp_path: Path) -> None:
    """A trainer's compiled method calls a projection that is not recorded before the model:
    the frame was found by the projection's parameter, held by no recorded model, and
    nothing of the model was recorded."""

    class Trainer:
        def __init__(self) -> None:
            self.projection, self.model = nn.Linear(8, 8), Blocks()

        def loss(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(self.projection(x)).pow(2).mean()

    def run(out: Path) -> None:
        trainer = Trainer()
        step = torch.compile(trainer.loss, backend="aot_eager")
        with hooktrace.record(trainer.model, out, strict=True):
            step(torch.randn(4, 8)).backward()

    eager, compiled = _eager_and_compiled(tmp_path, run)
    _matching(eager, compiled)


def test_a_model_found_inside_a_compiled_function_in_inference_has_a_step_a_forward(
    tmp_path: Path,
) -> None:
    """``hooktrace record`` of inference (no backward, no optimizer) makes each forward of
    the model a step: a model called only inside a compiled function had its three
    forwards in one step."""

    def run(out: Path) -> None:
        model = Blocks()
        predict = torch.compile(lambda x: model(x).softmax(-1), backend="aot_eager")
        with ScriptRecorder(str(out), strict=True), torch.no_grad():
            for _ in range(3):
                predict(torch.randn(4, 8))

    eager, compiled = _eager_and_compiled(tmp_path, run)
    _matching(eager, compiled)
    assert list(compiled.steps["step"]) == [0, 1, 2]


class _Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("teacher_first", [True, False], ids=["teacher first", "student first"])
@pytest.mark.parametrize("script", [False, True], ids=["record", "script"])
def test_a_teacher_and_a_student_in_one_graph_each_take_their_own_phase(
    tmp_path: Path, teacher_first: bool, script: bool
) -> None:
    """Distillation in one compiled function: a frozen teacher in eval mode under
    ``torch.no_grad()``, and the student training. The graph took the phase of the first
    root it called for every call in it: teacher first, the student's records were an
    evaluation's and its gradients went unrecorded; student first, the teacher's were a
    training's. Each root now takes its own, as an eager run's calls do; and a root found
    after the step's first forward has its parameters recorded at that step too (the
    eager run found the student after the teacher, and missed them)."""

    def run(out: Path) -> None:
        teacher, student = _Teacher().eval(), Blocks()

        def loss_of(x: torch.Tensor) -> torch.Tensor:
            if teacher_first:
                with torch.no_grad():
                    target = teacher(x)
                return (student(x) - target).pow(2).mean()
            guess = student(x)
            with torch.no_grad():
                target = teacher(x)
            return (guess - target).pow(2).mean()

        step = torch.compile(loss_of, backend="aot_eager")
        recorder = (
            ScriptRecorder(str(out), strict=True)
            if script
            else hooktrace.record({"Teacher": teacher, "Blocks": student}, out, strict=True)
        )
        with recorder:  # (the optimizer made inside, as a script's is)
            opt = torch.optim.SGD(student.parameters(), lr=0.1)
            for i in range(2):
                step(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).backward()
                opt.step()
                opt.zero_grad()

    eager, compiled = _eager_and_compiled(tmp_path, run)
    _matching(eager, compiled)
    assert list(compiled.steps["step"]) == [0, 1]
    records = compiled.records
    calls = records[records["kind"].isin(["output", "grad_output"])]
    teacher = calls["module"].str.contains("Teacher") | calls["module"].str.startswith("body")
    assert set(calls.loc[teacher, "phase"]) == {"eval"}
    assert set(calls.loc[~teacher, "phase"]) == {"train"}
    assert (calls.loc[~teacher, "kind"] == "grad_output").sum() > 0
    assert not (calls.loc[teacher, "kind"] == "grad_output").any()


def test_modules_selected_inside_a_model_a_compiled_function_calls_keep_its_parameters(
    tmp_path: Path,
) -> None:
    """``modules`` that leaves the model's root out: no call of the root was in the graph
    to enter it by, and the step recorded no parameters."""

    def run(out: Path) -> None:
        model = Blocks()
        step = torch.compile(lambda x: model(x).pow(2).mean(), backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hooktrace.record(model, out, strict=True, modules="blocks.0"):
            for _ in range(2):
                step(torch.randn(4, 8)).backward()
                opt.step()
                opt.zero_grad()

    eager, compiled = _eager_and_compiled(tmp_path, run)
    _matching(eager, compiled)
    assert "param" in set(compiled.records["kind"])


def test_a_models_forward_compiled_on_its_own_is_found_as_the_model(tmp_path: Path) -> None:
    """``torch.compile(model.forward)``: the model's own call never runs, and the graph's
    stack leaves the frame's module out: ``hooktrace record`` found nothing (0 records). It
    finds the model, named as its own call would name it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks()
    forward = torch.compile(model.forward, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ScriptRecorder(str(tmp_path / "run"), strict=True):
        for _ in range(2):
            forward(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    records = hooktrace.load(tmp_path / "run").records
    assert {"blocks.0.fc", "norm", "head"} <= set(records["module"])
    assert {"output", "grad_output", "param", "grad_param"} <= set(records["kind"])


def test_two_models_passed_in_turn_to_one_compiled_function_are_both_found(
    tmp_path: Path,
) -> None:
    """Two models of one class passed in turn to a compiled function: dynamo runs the graph
    compiled for the first for the second, so no compile meets the second, and no call of
    it runs outside the graph: ``hooktrace record`` recorded the first only, silently. It
    is found in the graph's frame as the graph runs for it."""

    def run(out: Path) -> None:
        first, second = Blocks(), Blocks()
        loss_of = torch.compile(lambda model, x: model(x).pow(2).mean(), backend="aot_eager")
        with ScriptRecorder(str(out), strict=True):
            opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
            for i in range(4):
                loss_of(first if i % 2 == 0 else second, torch.randn(4, 8)).backward()
                opt.step()
                opt.zero_grad()

    eager, compiled = _eager_and_compiled(tmp_path, run)
    _matching(eager, compiled)
    assert {"Blocks", "Blocks#1"} <= set(compiled.records["module"])


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class _Watching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(hooktrace.watch(torch.relu(self.a(x)), "hidden"))


def _every_other_prediction(out: Path) -> None:
    model = Blocks()
    predict = torch.compile(lambda x: model(x).softmax(-1), backend="aot_eager")
    with ScriptRecorder(str(out), strict=True, every=2), torch.no_grad():
        for _ in range(6):
            predict(torch.randn(4, 8))


def _an_ensemble(out: Path) -> None:
    first, second = Blocks(), Blocks()
    predict = torch.compile(lambda x: first(x) + second(x), backend="aot_eager")
    with ScriptRecorder(str(out), strict=True), torch.no_grad():
        for _ in range(2):
            predict(torch.randn(4, 8))


def _a_model_called_three_times(out: Path) -> None:
    model = _Traced()

    def generate(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.cat([x[:, 2:], model(x)], dim=1)
        return x

    with ScriptRecorder(str(out), strict=True), torch.no_grad():
        torch.compile(generate, backend="aot_eager")(torch.randn(3, 4))


def _a_watched_tensor_in_an_evaluation(out: Path) -> None:
    model = _Watching().eval()  # grad mode left on
    predict = torch.compile(lambda x: model(x).softmax(-1), backend="aot_eager")
    with hooktrace.record(model, out, strict=True) as recording:
        for _ in range(2):
            predict(torch.randn(4, 8))
            recording.step()


def _batch_norm_statistics(out: Path) -> None:
    model, criterion = _Normed(), nn.MSELoss()
    loss_of = torch.compile(lambda x: criterion(model(x), torch.zeros(4, 8)), backend="aot_eager")
    with hooktrace.record({"model": model, "criterion": criterion}, out, strict=True):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss_of(torch.randn(4, 8)).backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize(
    "run",
    [
        _every_other_prediction,
        _an_ensemble,
        _a_model_called_three_times,
        _a_watched_tensor_in_an_evaluation,
        _batch_norm_statistics,
    ],
    ids=lambda run: run.__name__.strip("_").replace("_", " "),
)
def test_a_compiled_functions_root_forwards_are_entered_as_eager_calls_are(
    tmp_path: Path, run: Callable[[Path], None]
) -> None:
    """A compiled function's graph runs its models' forwards with no call of theirs around
    it: each is entered where it begins, as an eager call is. Found by a review, each
    diffed against the same script with dynamo disabled:
    - every other step recorded, in inference: the forward was counted only where the
      graph ran with its statistics, and steps stopped ending after the first unrecorded
      one ({0: 11, 1: 3} records, not {0, 2, 4: 11});
    - two models in one graph, in inference: both entered before any record was queued,
      the step ended between them, and both models' outputs landed in the next step;
    - a model called three times in one graph: one forward, one step (eager: three);
    - a watched tensor in a model evaluated with grad mode on: recorded as training;
    - a BatchNorm's running statistics: recorded after the graph had updated them."""
    eager, compiled = _eager_and_compiled(tmp_path, run)
    _matching(eager, compiled)


class _Static(nn.Linear):
    torchdynamo_force_dynamic = False  # dynamo keeps it as it is: its stack key is a name


@pytest.mark.parametrize("script", [False, True], ids=["record", "script"])
def test_a_module_dynamo_keeps_as_it_is_compiles_and_trains_as_unrecorded(
    tmp_path: Path, script: bool
) -> None:
    """A module dynamo does not trace as a dynamic one names its graph's calls by name, not
    id: reading them failed the script's compile ("invalid literal for int()"), recorded
    or not. The compile is the script's; the training goes on as unrecorded. Such a graph
    is compiled as it was, and the trace says so; ``hooktrace record`` cannot find the
    model in it, and says that nothing was recorded."""

    def losses(out: Path | None) -> list[float]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Static(4, 2)
        step = torch.compile(lambda x: model(x).pow(2).mean(), backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        recorder: Any = contextlib.nullcontext()
        if out is not None:
            recorder = ScriptRecorder(str(out)) if script else hooktrace.record(model, out)
        found = []
        with recorder:
            for i in range(2):
                loss = step(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)))
                loss.backward()
                opt.step()
                opt.zero_grad()
                found.append(loss.item())
        return found

    assert losses(tmp_path / "run") == losses(None)
    trace = hooktrace.load(tmp_path / "run")
    if script:
        assert trace.status == "incomplete"
        assert "no recorded model holds its parameters" in trace.manifest["ranks"]["0"]["error"]
    else:
        assert trace.status == "complete"


class _Traced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


@pytest.mark.parametrize("how", ["compiled function", "functional_call"])
def test_a_users_fx_graph_module_is_found_as_a_model(tmp_path: Path, how: str) -> None:
    """A model that is an ``fx.GraphModule`` (``torch.fx.symbolic_trace``'s) is the
    script's, not a backend's graph: called inside a compiled function, or through
    ``torch.func.functional_call`` (torch's ``_functorch``), it was taken for aot_eager's
    forward graph and nothing was recorded."""

    def run(out: Path) -> None:
        model = torch.fx.symbolic_trace(_Traced())
        if how == "compiled function":
            forward = torch.compile(lambda x: model(x), backend="aot_eager")
        else:
            params = dict(model.named_parameters())

            def forward(x: torch.Tensor) -> torch.Tensor:
                return torch.func.functional_call(model, params, (x,))

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ScriptRecorder(str(out), strict=True):
            for _ in range(2):
                forward(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()

    eager, compiled = _eager_and_compiled(tmp_path, run)
    _matching(eager, compiled)
    assert {"fc", "act"} <= set(compiled.records["module"])


def test_dynamic_shapes_record_each_calls_own_shape(tmp_path: Path) -> None:
    """``dynamic=True``: one graph for every batch size; each record has its call's shape,
    its sizes handed out by the graph with the statistics."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Blocks()
    compiled = torch.compile(model, dynamic=True)
    sizes = (4, 6, 9)
    with hooktrace.record(compiled, tmp_path / "run", strict=True) as rec:
        for n in sizes:
            compiled(torch.randn(n, 8)).sum().backward()
            rec.step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    records = hooktrace.load(tmp_path / "run").records
    act = records[(records["module"] == "blocks.1.act") & (records["kind"] == "output")]
    assert list(act["shape"]) == [f"{n},8" for n in sizes]
    assert list(act["unit_size"]) == list(sizes)
    grads = records[(records["module"] == "blocks.1.fc") & (records["kind"] == "grad_output")]
    assert list(grads["shape"]) == [f"{n},8" for n in sizes]


def test_graphs_compiled_before_the_recording_are_said_to_be_seen_from_outside(
    tmp_path: Path,
) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(4, 8))  # compiled now, unrecorded: dynamo keeps the graph
    with (
        pytest.warns(RuntimeWarning, match="compiled before the recording began"),
        hooktrace.record(compiled, tmp_path / "run", strict=True),
    ):
        compiled(torch.randn(4, 8)).sum().backward()
    records = hooktrace.load(tmp_path / "run").records
    assert set(records["module"]) - {"Blocks"} == {"blocks.0.fc", "blocks.1.fc", "blocks.2.fc",
                                                    "norm", "head"}  # fmt: skip
    assert set(records.loc[records["module"] != "Blocks", "kind"]) == {"param"}
    # and the trace says so: the rank's status, which summary shows
    found = hooktrace.summary(tmp_path / "run")
    assert list(found.notes) == [0] and len(found.notes[0]) == 1
    assert "Blocks runs graphs that were compiled before the recording began" in found.notes[0][0]
    from hooktrace.cli.summary import render

    text = render(found)
    assert "not recorded:\n  Blocks runs graphs that were compiled before" in text


def test_training_goes_on_bit_identically_after_the_recording_ends(tmp_path: Path) -> None:
    """The instrumented graphs stay in dynamo's cache after the recording: they go on
    training as the script's own graphs would, handing their statistics to nobody."""

    def compile_model(model: nn.Module) -> nn.Module:
        return torch.compile(model, backend="aot_eager")  # type: ignore[return-value]

    plain = _train(None, compile_model, steps=4)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks()
    compiled = compile_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    losses = []
    with hooktrace.record(compiled, tmp_path / "run", steps="0-1") as rec:
        for i in range(4):
            if i == 3:
                rec.close()
            loss = compiled(torch.randn(4, 8, generator=data)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert losses == plain[0]
    assert sorted(hooktrace.load(tmp_path / "run").records["step"].unique()) == [0, 1]


def test_a_graph_break_leaves_two_graphs_each_recorded(tmp_path: Path) -> None:
    class Broken(Blocks):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, block in enumerate(self.blocks):
                x = block(x)
                if i == 0:
                    torch._dynamo.graph_break()
            return self.head(self.norm(x))

    def train(out: Path | None, model_class: type[Blocks]) -> tuple[list[float], int]:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        model = model_class()
        compiled = torch.compile(model, backend="aot_eager")
        losses = []
        with hooktrace.record(compiled, out, strict=True) if out else _nothing():
            for x in torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1)):
                loss = compiled(x).pow(2).mean()
                loss.backward()
                losses.append(loss.item())
        return losses, torch._dynamo.utils.counters["stats"]["unique_graphs"]

    plain = train(None, Broken)
    recorded = train(tmp_path / "run", Broken)
    assert recorded == plain and plain[1] == 2
    records = hooktrace.load(tmp_path / "run").records
    first = records[(records["step"] == 0) & (records["micro_step"] == 0)]
    outputs = first[first["kind"] == "output"]
    assert list(outputs["module"]) == [
        "blocks.0.fc", "blocks.0.act", "blocks.0", "blocks.1.fc", "blocks.1.act", "blocks.1",
        "blocks.2.fc", "blocks.2.act", "blocks.2", "norm", "head", "Broken",
    ]  # fmt: skip


class ScaledLoss(nn.Module):
    """Returns a value no module returns, and a loss the forward computes from it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.fc(x) * 2
        return logits, logits.pow(2).mean()


class AuxBlock(nn.Module):
    """Returns its output and a loss of its own computed from it (a mixture of experts'
    balancing loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, h.pow(2).mean()


class AuxBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([AuxBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aux = x.new_zeros(())
        for block in self.blocks:
            x, loss = block(x)
            aux = aux + loss
        return x, aux


def _blocks_compiled(model: nn.Module) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        block.compile()
    return model


@pytest.mark.parametrize(
    ("make", "compile_model"),
    [(ScaledLoss, _inductor), (AuxBlocks, _blocks_compiled)],
    ids=["root", "blocks-compiled-one-by-one"],
)
def test_an_output_the_graph_reads_too_has_the_gradient_an_eager_run_records(
    tmp_path: Path, make: Callable[[], nn.Module], compile_model: Callable[[nn.Module], nn.Module]
) -> None:
    """A module whose hooks run outside its graph (a compiled root, a block compiled on its
    own) returns a value the graph also reads (the loss it computes from it): the value's
    gradient from that use arises inside the graph, where a tap takes it; a hook on the
    tensor the graph returns saw the rest only (none for the root: its record was missing;
    half for each block: its statistics wrong)."""

    def train(out: Path | None, compiled: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make()
        run = compile_model(model) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with hooktrace.record(run, out, strict=True) if out else _nothing():
            for x in torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1)):
                value, loss = run(x)
                total = loss + value.sum() * 0.01  # a gradient from outside the graph too
                total.backward()
                opt.step()
                opt.zero_grad()
                losses.append(total.item())
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    plain = train(None, compiled=True)
    recorded = train(tmp_path / "compiled", compiled=True)
    train(tmp_path / "eager", compiled=False)
    assert recorded[0] == plain[0]
    for name, value in plain[1].items():
        assert torch.equal(recorded[1][name], value), name
    columns = ["step", "micro_step", "phase", "module", "call", "kind", "slot"]
    compiled = hooktrace.load(tmp_path / "compiled").records
    eager = hooktrace.load(tmp_path / "eager").records
    assert sorted(compiled[columns].values.tolist()) == sorted(eager[columns].values.tolist())
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result
    assert result.records == len(eager)


def _count_summaries(patch: pytest.MonkeyPatch, summaries: list[int]) -> None:
    """Append to ``summaries`` each time the graphs' CPU operator summarises a value."""
    original = ops.summarize_with_activity

    def counted(x: torch.Tensor, dim: int | None) -> Any:
        summaries.append(1)
        return original(x, dim)

    patch.setattr(ops, "summarize_with_activity", counted)


def _nothing() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def test_steps_not_recorded_run_the_graph_compiled_without_statistics(tmp_path: Path) -> None:
    """``every=2``: the graph is compiled with and without its statistics, and the steps
    not recorded run the latter (no summary runs in them), with training bit-identical."""
    summaries: list[int] = []

    def compile_model(model: nn.Module) -> nn.Module:
        return torch.compile(model, backend="eager")  # type: ignore[return-value]

    plain = _train(None, compile_model, steps=4)
    with pytest.MonkeyPatch.context() as patch:
        _count_summaries(patch, summaries)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        model = Blocks()
        compiled = compile_model(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(1)
        losses, per_step = [], []
        with hooktrace.record(compiled, tmp_path / "run", every=2, strict=True):
            for _ in range(4):
                before = len(summaries)
                loss = compiled(torch.randn(4, 8, generator=data)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                per_step.append(len(summaries) - before)
    assert losses == plain[0]
    assert per_step[1] == per_step[3] == 0 and per_step[0] == per_step[2] > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == plain[2]["unique_graphs"]
    records = hooktrace.load(tmp_path / "run").records
    assert sorted(records["step"].unique()) == [0, 2]
    assert "blocks.1.act" in set(records["module"])


class InPlace(nn.Module):
    """A convolution followed by ``ReLU(inplace=True)`` and ``+=``: the values the modules
    returned are changed in place after them (torchvision's blocks, the reference CNN)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.conv(x)).mean(dim=(2, 3))
        y = self.fc(h)
        y += 1.0
        return y


class InPlaceThroughViews(InPlace):
    """The values the modules returned changed in place through views of them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        h[:, :2].relu_()  # a slice
        y = self.fc(h.mean(dim=(2, 3)))
        y.t()[0].mul_(2.0)  # a row of a transpose
        return y


@pytest.mark.parametrize("make", [InPlace, InPlaceThroughViews])
def test_outputs_changed_in_place_are_recorded_as_they_were_returned(
    tmp_path: Path, make: Callable[[], nn.Module]
) -> None:
    """Found by benchmarks/bench_compiled.py: the tap's view of a value changed in place
    failed the compile (the graph then went unrecorded); through a view of it, likewise."""

    def train(out: Path, compile_: bool) -> list[float]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make()
        run = torch.compile(model, backend="aot_eager") if compile_ else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with hooktrace.record(run, out, strict=True):
            for x in torch.randn(2, 2, 3, 6, 6, generator=torch.Generator().manual_seed(1)):
                loss = run(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses

    compiled = train(tmp_path / "compiled", True)
    eager = train(tmp_path / "eager", False)
    assert compiled == pytest.approx(eager, rel=1e-5)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result
    assert result.records == len(hooktrace.load(tmp_path / "eager").records)
    kinds = hooktrace.load(tmp_path / "compiled").records.groupby("module")["kind"].agg(set)
    called = ("conv", "act", "fc") if make is InPlace else ("conv", "fc")
    assert all({"output", "grad_output"} <= kinds[m] for m in called), kinds


def _seeded_training(
    model_class: Callable[[], nn.Module],
    batches: Sequence[torch.Tensor],
    out: Path | None,
    *,
    compile_: bool = True,
    backend: Any = "inductor",
    call: Callable[[Any, torch.Tensor], torch.Tensor] = lambda run, x: run(x),
    **options: Any,
) -> list[float]:
    """SGD steps (the output's mean square as the loss) of a fresh ``model_class`` seeded
    with 0, a step a batch, compiled by ``backend`` where ``compile_``, recorded into ``out``
    (strict, with ``options``) where given: the losses."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model_class()
    run = torch.compile(model, backend=backend) if compile_ else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    recording = hooktrace.record(model, out, strict=True, **options) if out else None
    with recording or contextlib.nullcontext():
        for x in batches:
            loss = call(run, x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


class ConvStage(nn.Module):
    """Convolution, batch normalisation, ReLU and pooling, as the reference CNN's stages:
    inductor lays the convolution's output out channels-last on a CPU and fuses the three
    after it into one kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(8 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.act(self.norm(self.conv(x)))).flatten(1))


_BUFFER = re.compile(r"empty_strided_cpu\(\((4, 8, 8, 8)\), \(([\d, ]+)\), torch\.float32\)")


def test_values_are_summarised_in_the_layout_the_compiler_chose(tmp_path: Path) -> None:
    """Found by profiling benchmarks/bench_compiled.py: the operator that summarises a CPU
    value took it in the eager run's layout, so inductor copied each channels-last
    activation into it, and its kernels after the convolution, no longer fused, ran 2 to 3
    times as long. The recorded forward graph now makes its activations in the plain
    graph's layout, and counts each channel's units where they lie."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))

    def step(out: Path | None, compile_: bool = True) -> set[str]:
        """One training step of a freshly seeded model, recorded into ``out`` where given:
        the layouts of the activations its compiled forward makes."""
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ConvStage()
        run = torch.compile(model) if compile_ else model
        with hooktrace.record(model, out, strict=True) if out else contextlib.nullcontext():
            _, code = run_and_get_code(lambda: run(x).pow(2).mean().backward())
        forward = code[0] if code else ""  # the forward graph's, compiled first
        return {m.group(2) for m in _BUFFER.finditer(forward)}

    plain_layouts = step(None)
    assert plain_layouts == {"512, 1, 64, 8"}  # channels-last: what the test is about
    assert step(tmp_path / "compiled") == plain_layouts
    step(tmp_path / "eager", compile_=False)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result
    compiled, eager = hooktrace.load(tmp_path / "compiled"), hooktrace.load(tmp_path / "eager")
    for module in ("conv", "norm", "act"):
        assert compiled.activity(module, step=0).tolist() == eager.activity(module, step=0).tolist()


@pytest.mark.skipif(
    not joint_pass_available(), reason="this torch runs no joint pass of the recorder"
)
def test_a_compiled_forward_keeps_for_its_backward_what_it_keeps_unrecorded(
    tmp_path: Path,
) -> None:
    """Found by profiling benchmarks/bench_compiled.py: a BatchNorm output summarised is made
    real, and AOTAutograd's partitioner then kept the ReLU's bool mask for the backward (and
    the ReLU's output, in the eager layout, copied), where the graph unrecorded recomputes
    both from what it keeps anyway; the kernel storing the mask ran 9 times as long on the
    CPU. The recorded forward now keeps, as the unrecorded one, no bool tensor and no
    activation of the convolution's size (``graphs/masks.py``)."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))

    def kept(out: Path | None) -> list[tuple[str, ...]]:
        """What one training step's compiled forward returns beyond its output: the
        tensors kept for the backward, as (sizes, strides, dtype) of each buffer made."""
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ConvStage()
        run = torch.compile(model)
        with hooktrace.record(model, out, strict=True) if out else contextlib.nullcontext():
            _, code = run_and_get_code(lambda: run(x).pow(2).mean().backward())
        made = dict(_MADE.findall(code[0]))
        returned = re.search(r"return \((.*)\)", code[0])
        assert returned is not None
        names = re.findall(r"\b(buf\d+)\b", returned.group(1))
        return sorted(made[name] for name in names if made.get(name))

    def activations(buffers: list[str]) -> list[str]:  # of the convolution's output's size
        return [b for b in buffers if b.startswith("(4, 8, 8, 8)")]

    plain, recorded = kept(None), kept(tmp_path / "run")
    # unrecorded, the normalisation and the ReLU are made again in the backward from the
    # convolution's output (made by its own kernel, and kept: not one of these buffers)
    assert activations(plain) == []
    assert activations(recorded) == []
    assert [b for b in plain + recorded if "torch.bool" in b] == []


class Draw(nn.Module):
    """Adds a small term picked by ``multinomial``, a draw inductor leaves to torch: it draws
    at its place in the program, where inductor seeds its own dropouts from one draw of its
    own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picks = torch.multinomial(torch.softmax(x.detach().flatten(0, 1)[:, :8], -1), 1)
        return x + picks.view(*x.shape[:2], 1).to(x.dtype) * 1e-3


def _transformer_that_draws() -> nn.Module:
    model = TinyTransformer()
    model.embed = nn.Sequential(model.embed, Draw())
    return model


@pytest.mark.skipif(
    not joint_pass_available(), reason="this torch runs no joint pass of the recorder"
)
def test_a_recorded_forward_draws_its_random_numbers_in_the_graphs_order(tmp_path: Path) -> None:
    """Found by gpu_check on an H200 (attention's dropout, a draw of its own there, and the
    encoder's dropouts): inductor's peak-memory scheduling ran the seeds of the recorded
    graph's dropouts before the other draw, where the graph unrecorded ran them after it, so
    every mask differed and the recorded training with them (pytorch/pytorch#192635). The
    recorded forward now keeps the graph's order of draws (``graphs/draws.py``), which is
    the order the graph unrecorded draws in here."""
    batches = [torch.randn(16, 64, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    plain = _seeded_training(_transformer_that_draws, batches, None)
    recorded = _seeded_training(_transformer_that_draws, batches, tmp_path / "run")
    assert recorded == plain
    assert hooktrace.load(tmp_path / "run").records["module"].nunique() > 10


class CountingScale(nn.Module):
    """Divides by a buffer it increments in place at each call: its output, a pointwise
    value, is made from an input the graph changes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        return x / self.n


def test_a_value_made_from_a_buffer_changed_in_place_is_kept_as_unrecorded(
    tmp_path: Path,
) -> None:
    """A module's output made from a buffer the forward changes in place, kept by the Linear
    after it for its backward: the recorded compiled training's gradients are the unrecorded
    one's, bit for bit. ``graphs/masks.py`` leaves such values untagged (a review found that,
    made again in the backward, one could read the buffer's new contents; this model does
    not show it either way: the partitioner keeps the incremented value)."""

    def grads(out: Path | None) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(CountingScale(), nn.Linear(4, 4))  # the Linear keeps its input
        run = torch.compile(model)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
        with hooktrace.record(model, out, strict=True) if out else contextlib.nullcontext():
            run(x).pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain, recorded = grads(None), grads(tmp_path / "run")
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded, strict=True))


_MADE = re.compile(r"(buf\d+) = empty_strided_cpu\((\([\d, ]*\), \([\d, ]*\), torch\.\w+)\)")


def test_full_steps_save_the_tensors_inside_the_graph_as_an_eager_run_does(
    tmp_path: Path,
) -> None:
    """A step that saves tensors whole runs a variant of the graph that returns each value
    it summarises (and hands on each gradient); the other steps run the graph with
    statistics only, and steps not recorded the graph as compiled: three variants, no
    recompile per step. ``ReLU(inplace=True)`` after the convolution: the convolution's
    tensor is saved as the module returned it, before the ReLU changed it."""
    options = {
        "steps": "0-2",
        "full_every": 2,
        "full_modules": ["conv", "act", "head"],
        "inputs": True,
    }
    batches = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))] * 4
    compiles: list[Path | None] = []

    def train(out: Path | None, compile_: bool) -> list[float]:
        def inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            from torch._inductor.compile_fx import compile_fx

            compiles.append(out)
            return compile_fx(gm, example_inputs)

        # step 3 is not recorded
        return _seeded_training(
            InPlaceStage, batches, out, compile_=compile_, backend=inductor, **options
        )

    plain = train(None, True)
    assert train(tmp_path / "compiled", True) == plain  # bit for bit
    # one graph: compiled with statistics, returning its values, and as it was; once each
    assert compiles.count(tmp_path / "compiled") == 3 and compiles.count(None) == 1
    train(tmp_path / "eager", False)
    compiled, eager = hooktrace.load(tmp_path / "compiled"), hooktrace.load(tmp_path / "eager")
    columns = ["step", "module", "kind", "slot"]
    saved = compiled.records[compiled.records["tensor_key"] != ""]
    eager_saved = eager.records[eager.records["tensor_key"] != ""]
    assert sorted(saved[columns].values.tolist()) == sorted(eager_saved[columns].values.tolist())
    inside = saved[
        saved["module"].isin(["conv", "act", "head"]) & saved["kind"].str.endswith("output")
    ]
    assert len(inside) == 2 * 3 * 2  # two full steps, three modules, output and gradient
    assert (saved["kind"] == "input").sum() == 2 * 3  # and their arguments
    assert set(inside["step"]) == {0, 2}
    assert set(compiled.records["step"]) == {0, 1, 2}
    for step, module, kind, slot in saved[columns].itertuples(index=False):
        np.testing.assert_allclose(
            compiled.tensor(module, kind, step=step, slot=slot),
            eager.tensor(module, kind, step=step, slot=slot),
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"{module} {kind} {slot} step {step}",
        )
    conv = compiled.tensor("conv", "output", step=0)
    assert (conv < 0).any()  # as returned, before the ReLU in place
    # replay needs the call as the hooks see it: a graph's is not kept, and the error says so
    with pytest.raises(hooktrace.TensorNotRecorded, match="inside a compiled graph"):
        hooktrace.replay_module(tmp_path / "compiled", "head", module=InPlaceStage().head, step=0)
    hooktrace.replay_module(tmp_path / "eager", "head", module=InPlaceStage().head, step=0)


def test_histograms_of_outputs_inside_the_graph_match_an_eager_runs(tmp_path: Path) -> None:
    """Histograms of the kinds a graph records (``output``, ``grad_output``) are made from
    the values the graph returns on the steps that take them (``histogram_every``); the
    exponent bins count the same values as an eager run's, but for rounding at a bin's
    edge."""
    options = {"histograms": ("output", "grad_output", "param"), "histogram_every": 2}
    batches = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))] * 3

    def train(out: Path | None, compile_: bool) -> list[float]:
        return _seeded_training(InPlaceStage, batches, out, compile_=compile_, **options)

    assert train(tmp_path / "compiled", True) == train(None, True)  # bit for bit
    train(tmp_path / "eager", False)
    key = ["step", "module", "kind", "slot"]
    compiled = hooktrace.load(tmp_path / "compiled").histograms().sort_values(key)
    eager = hooktrace.load(tmp_path / "eager").histograms().sort_values(key)
    assert compiled[key].values.tolist() == eager[key].values.tolist()
    assert set(compiled["step"]) == {0, 2}
    assert {"conv", "act", "head"} <= set(compiled[compiled["kind"] == "grad_output"]["module"])
    for (_, a), (_, b) in zip(compiled.iterrows(), eager.iterrows(), strict=True):
        assert a["numel"] == b["numel"] and a["zero"] == b["zero"], (a["module"], a["kind"])
        # values at rtol 1e-5 of each other: at most a few cross a power of two
        moved = np.abs(a["pos"] - b["pos"]).sum() + np.abs(a["neg"] - b["neg"]).sum()
        assert moved <= max(2, a["numel"] // 100), (a["module"], a["kind"], moved)


class InPlaceStage(nn.Module):
    """A convolution whose output a ``ReLU(inplace=True)`` changes, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x)).flatten(1))


class Scaled(nn.Module):
    """Blocks, then a value made outside any module passed through ``nn.Identity``: the
    identity's argument is marked before the same value is marked as its output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = Blocks()
        self.ident = nn.Identity()
        self.out = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
        return self.out(self.ident(self.blocks(x) * scale))


def test_inputs_inside_the_graph_are_recorded_as_an_eager_run_records_them(
    tmp_path: Path,
) -> None:
    """``inputs=True``: each module call's arguments inside the graph, under the slots,
    calls and kinds of an eager run and in its order, and the gradients as without it."""
    batches = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))

    def train(out: Path | None, compile_: bool) -> list[float]:
        return _seeded_training(
            Scaled,
            batches,
            out,
            compile_=compile_,
            call=lambda run, x: run(x, scale=3.0),
            inputs=True,
        )

    compiled_losses = train(tmp_path / "compiled", True)
    assert compiled_losses == train(None, True)  # bit for bit
    assert compiled_losses == pytest.approx(train(tmp_path / "eager", False), rel=1e-5)
    compiled, eager = hooktrace.load(tmp_path / "compiled"), hooktrace.load(tmp_path / "eager")
    columns = ["step", "micro_step", "phase", "module", "call", "kind", "slot", "units"]
    assert sorted(compiled.records[columns].values.tolist()) == sorted(
        eager.records[columns].values.tolist()
    )
    # in the order hooks see them: a call's arguments before the calls inside it
    forward = compiled.records[compiled.records["kind"] != "grad_output"]
    eager_forward = eager.records[eager.records["kind"] != "grad_output"]
    assert forward[columns].values.tolist() == eager_forward[columns].values.tolist()
    kinds = compiled.records.groupby("module")["kind"].agg(set)
    assert {"input", "output", "grad_output"} <= kinds["ident"]
    assert {"input", "output", "grad_output"} <= kinds["blocks.blocks.1.fc"]
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match, result


class Changed(nn.Module):
    """A value changed in place between the module that made it and the one it is passed
    to (``h[:, 0] = 0``, ``mul_``, then a ``ReLU(inplace=True)``), and a module returning a
    complex value, called twice, whose arguments are the only tensors recorded of it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(8, 8)
        self.spectrum = Spectrum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h[:, 0] = 0.0
        h.mul_(2.0)
        y = self.b(self.act(h))
        return y + self.spectrum(y).abs().sum() + self.spectrum(x).abs().sum()


def test_arguments_changed_in_place_are_read_as_the_call_found_them(tmp_path: Path) -> None:
    """Found by review: an argument's statistics were those of the value when it was made,
    not when the call received it; and a call whose only outputs hold nothing to summarise
    was not counted, so the next one took its number."""
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(1))] * 2

    def train(out: Path, compile_: bool) -> None:
        _seeded_training(Changed, batches, out, compile_=compile_, inputs=True)

    train(tmp_path / "compiled", True)
    train(tmp_path / "eager", False)
    compiled, eager = hooktrace.load(tmp_path / "compiled"), hooktrace.load(tmp_path / "eager")
    arguments = compiled.records[compiled.records["kind"] == "input"]
    assert sorted(arguments[arguments["module"] == "spectrum"]["call"]) == [0, 0, 1, 1]
    act = arguments[(arguments["module"] == "act") & (arguments["step"] == 0)].iloc[0]
    assert act["zero_fraction"] >= 1 / 8  # the column set to zero before the call
    eager_act = eager.records.query("module == 'act' and kind == 'input' and step == 0")
    assert act["mean"] == pytest.approx(eager_act["mean"].iloc[0], rel=1e-5)
    assert act["max"] == pytest.approx(eager_act["max"].iloc[0], rel=1e-5)
    a = compiled.records.query("module == 'a' and kind == 'output' and step == 0").iloc[0]
    assert a["zero_fraction"] < 1 / 8  # a's own output, as it returned it


def test_a_compiled_model_that_is_not_recorded_pays_nothing(tmp_path: Path) -> None:
    """The process-wide hook marks every module's outputs while dynamo traces; a graph of
    modules the recording does not hold (a teacher model, a compiled loss) is compiled
    without statistics."""
    summaries: list[int] = []

    torch._dynamo.reset()
    recorded, bystander = Blocks(), Blocks()
    compiled = torch.compile(bystander, backend="eager")
    with (
        pytest.MonkeyPatch.context() as patch,
        hooktrace.record(recorded, tmp_path / "run", strict=True),
    ):
        _count_summaries(patch, summaries)
        recorded(torch.randn(4, 8)).sum().backward()
        compiled(torch.randn(4, 8)).sum().backward()
    assert summaries == []
    assert "blocks.0.fc" in set(hooktrace.load(tmp_path / "run").records["module"])


@pytest.mark.parametrize(
    ("compiled_for", "make"),
    [("recorded", Blocks), ("other", Blocks), ("other", Watching)],
    ids=["recorded", "other", "other-watching"],
)
def test_a_graph_that_serves_two_models_of_one_class_records_the_recorded_one_only(
    tmp_path: Path, compiled_for: str, make: Callable[[], nn.Module]
) -> None:
    """dynamo checks a module's type, not which one it is: the graph it compiled for one
    model of a class runs for every other (an EMA copy, a reference model). Whichever model
    it was compiled for, the recorded model's calls are recorded as an eager run records
    them, and only they: the other model's values went into its records, and where the
    other compiled it first, none of the recorded model's modules were (nor, where the
    graph held a watched tensor, which no module's call is: ``make``). The other model
    still pays nothing where it compiled the graph."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    recorded, other = make(), make()
    eager = copy.deepcopy(recorded)
    run, run_other = (torch.compile(m, backend="aot_eager") for m in (recorded, other))
    xs = [torch.randn(4, 8) for _ in range(3)]
    summaries: list[int] = []

    def step(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
        model(x).sum().backward()

    with pytest.MonkeyPatch.context() as patch, hooktrace.record(recorded, tmp_path / "run"):
        _count_summaries(patch, summaries)
        if compiled_for == "other":
            step(run_other, xs[0])
            assert summaries == []  # compiled without statistics for it too, and run so
        for x in xs:
            step(run, x)
            step(run_other, x + 1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph served both
    with hooktrace.record(eager, tmp_path / "eager"):
        for x in xs:
            step(eager, x)
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "run", rtol=1e-5)
    assert result.match, result
    records = hooktrace.load(tmp_path / "run").records
    assert result.records == len(records) == len(hooktrace.load(tmp_path / "eager").records)
    assert (records[records["kind"] == "output"].groupby("module").size() == len(xs)).all()


def test_statistics_fused_into_the_graph_match_the_eager_run(tmp_path: Path) -> None:
    """The statistics as tensor operations inductor compiles with the model (``ops.FUSED``,
    not the default: on a GPU they changed the model's kernels): records that match the
    eager run's."""

    def compile_model(model: nn.Module) -> nn.Module:
        return torch.compile(model)  # type: ignore[return-value]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "FUSED", True)
        _assert_trains_as_plain_and_matches_eager(tmp_path, compile_model)
    records = hooktrace.load(tmp_path / "compiled")
    assert (
        records.activity("blocks.1.act", step=1).tolist()
        == hooktrace.load(tmp_path / "eager").activity("blocks.1.act", step=1).tolist()
    )


class Spectrum(nn.Module):
    """A module whose only output is complex: nothing of it is summarised."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x)


class WithSpectrum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.spectrum = Spectrum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spectrum(x).abs()


def test_a_graph_whose_marked_values_hold_nothing_to_summarise_compiles_as_it_was(
    tmp_path: Path,
) -> None:
    """Its marks are taken out and nothing added (an empty stack of statistics failed the
    instrumented compile, which fell back with a warning)."""
    torch._dynamo.reset()
    model = WithSpectrum()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 8)
    with hooktrace.record(compiled, tmp_path / "run", strict=True):
        out = compiled(x)
    assert torch.equal(out, model(x))
    assert "spectrum" not in set(hooktrace.load(tmp_path / "run").records["module"])


def test_a_graph_that_cannot_be_instrumented_runs_as_compiled_and_the_trace_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault while reading a graph (planted in its plan): the graph is compiled as the
    script asked, training goes on bit-identically, the modules inside go unrecorded, and
    the rank's status says which graph and why (not that it was compiled before)."""
    from hooktrace.recorder.graphs import backend

    def aot_eager(model: nn.Module) -> nn.Module:
        return torch.compile(model, backend="aot_eager")  # type: ignore[return-value]

    losses, params, counted = _train(None, aot_eager)

    def planted(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planted")

    monkeypatch.setattr(backend, "instrument", planted)
    with pytest.warns(RuntimeWarning, match=r"reading a compiled graph failed \(RuntimeError"):
        got = _train(tmp_path / "run", aot_eager, strict=False)
    assert got[0] == losses and got[2]["unique_graphs"] == counted["unique_graphs"]
    assert all(torch.equal(got[1][name], value) for name, value in params.items())
    records = hooktrace.load(tmp_path / "run").records
    assert set(records.loc[records["kind"] == "output", "module"]) == {"Blocks"}
    notes = hooktrace.summary(tmp_path / "run").notes
    assert list(notes) == [0] and len(notes[0]) == 1, notes
    assert notes[0][0].startswith("reading a compiled graph failed (RuntimeError: planted)")


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN where x < 0


class _Logged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.log = _Log()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.log(self.fc(x)))


def test_a_nan_made_inside_a_graph_names_its_module_and_its_operation(tmp_path: Path) -> None:
    """The statistics the graph computed say which module made the first NaN, as an eager
    run's do; the capture runs the root's call again eagerly and names the operation and
    the line that made it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Logged()
    compiled = torch.compile(model)
    with hooktrace.record(compiled, tmp_path / "run"):
        compiled(torch.randn(3, 4)).sum().backward()
    found = hooktrace.anomalies(tmp_path / "run").findings
    origin = found[found["kind"] == "nonfinite_forward"]
    assert origin["module"].tolist() == ["log"]
    captures = hooktrace.load(tmp_path / "run").nonfinite_captures()
    assert captures["op"].iloc[0] == "aten::log"
    assert captures["code"].iloc[0].strip() == "return torch.log(x)  # NaN where x < 0"


class _Root(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x.clamp(min=0.0))  # planted: sqrt's gradient at 0 is Inf


class _Faulty(nn.Module):
    """fc's first two units are 0: their square root is too, its gradient Inf (a NaN in the
    backward, the forward finite); a ``shift`` of -1 makes log's input negative (a NaN in
    the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.root = _Root()
        self.log = _Log()
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight[:2] = 0.0
            self.fc.bias[:2] = 0.0

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.head(self.log(self.root(self.fc(x)) + shift))


@pytest.fixture(scope="module")
def compiled_captures(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Counter[str]]:
    """A model compiled whole by inductor (one compile), recorded: its backward makes the
    first NaN at step 0 (capture 0), its forward at step 1 (capture 1). The parameters are
    put back after each step, so that the next step's NaN is an origin again. The run, and
    dynamo's graph counters (graph breaks among them) at its end. (The backward first: a
    forward capture's re-run under the watch's dispatch mode, where dynamo compiles
    nothing, once kept a later backward capture's re-run from being compiled.)"""
    out = tmp_path_factory.mktemp("captures") / "run"
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = _Faulty()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    finite = copy.deepcopy(model.state_dict())
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with hooktrace.record(compiled, out):
        for shift in (1.0, -1.0):
            compiled(x, torch.tensor(shift)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            model.load_state_dict(finite)
    counters = torch._dynamo.utils.counters
    return out, Counter(counters["stats"]) + Counter({"graph_breaks": len(counters["graph_break"])})


def test_a_capture_of_a_compiled_model_holds_the_model_and_replays_from_either(
    compiled_captures: tuple[Path, Counter[str]],
) -> None:
    """The recorder hooks torch.compile's wrapper; a capture holds the model inside it, its
    class and its state named as the model names it, so that ``replay_module`` runs it
    again from the model or from the model compiled, as ``hooktrace replay --nonfinite``
    prints the call. A review found both refused: the capture held the wrapper (its class,
    its state named ``_orig_mod.fc.weight``)."""
    run, _ = compiled_captures
    trace = hooktrace.load(run)
    captures = trace.nonfinite_captures()
    assert captures[["step", "pass", "module"]].values.tolist() == [
        [0, "backward", "_Faulty"],
        [1, "forward", "_Faulty"],
    ]
    names = {name for name, _ in _Faulty().named_parameters()}
    for capture in (0, 1):
        assert trace.capture_info(capture)["module_type"].endswith("test_compiled._Faulty")
        assert set(trace.capture_tensors(capture)["state"]) == names
    for given in (_Faulty(), torch.compile(_Faulty())):  # (replay runs an eager copy)
        replay = hooktrace.replay_module(run, "_Faulty", module=given, capture=1)
        assert replay.finding.op == "aten::log" and replay.finding.reproduces and replay.same


def test_a_capture_of_a_compiled_model_written_before_is_replayed_all_the_same(
    compiled_captures: tuple[Path, Counter[str]], tmp_path: Path
) -> None:
    """Format 1.4's captures of a compiled model, before the fix, held the wrapper: its
    class, and the model's state named inside it. ``replay_module`` reads them as the
    model's."""
    import h5py

    old = tmp_path / "run"
    shutil.copytree(compiled_captures[0], old)
    with h5py.File(old / "captures" / "rank=0" / "capture-001.h5", "r+") as f:
        meta = json.loads(f.attrs["capture"])
        f.attrs["capture"] = json.dumps(
            {**meta, "module_type": "torch._dynamo.eval_frame.OptimizedModule"}
        )
        for dataset in f["state"].values():
            dataset.attrs["name"] = "_orig_mod." + dataset.attrs["name"]
    assert set(hooktrace.load(old).capture_tensors(1)["state"]) == {
        "_orig_mod." + name for name, _ in _Faulty().named_parameters()
    }
    replay = hooktrace.replay_module(old, "_Faulty", module=_Faulty(), capture=1)
    assert replay.finding.op == "aten::log" and replay.finding.reproduces and replay.same


def test_a_backward_nan_in_a_compiled_model_is_named_as_an_eager_run_names_it(
    compiled_captures: tuple[Path, Counter[str]],
) -> None:
    """The capture runs the step again on a copy of the model, eagerly, torch.compile set
    aside: the operation and the line are the ones an eager run names (sqrt's backward
    divides by its output, 0), and nothing is compiled for the copy. A review found the copy
    of torch.compile's wrapper run compiled: the watch saw only the compiled backward's
    extern kernels and named ``aten::mm.out in CompiledFunctionBackward`` at the model's
    forward, with its uninitialised ``out=`` buffer among the operation's inputs, and
    dynamo compiled the copy into the user's cache (six graphs more, four graph breaks at
    the re-run's hooks), which the model then ran."""
    run, dynamo = compiled_captures
    trace = hooktrace.load(run)
    row = trace.nonfinite_captures().iloc[0]
    assert (row["pass"], row["op"], row["node"]) == (
        "backward",
        "aten::div.Tensor",
        "SqrtBackward0",
    )
    assert row["line"] == inspect.getsourcelines(_Root.forward)[1] + 1 and row["reproduces"]
    gradient, divisor = trace.capture_info(0)["analysis"]["op_inputs"]  # (grad, 2 * sqrt(x))
    assert gradient["shape"] == divisor["shape"] == [8, 4]
    assert divisor["zeros"] >= 16 and divisor["negatives"] == 0  # fc's 2 units of 0, at least
    replay = hooktrace.replay_module(run, "_Faulty", module=torch.compile(_Faulty()), capture=0)
    assert replay.finding.reproduces and replay.same
    assert (dynamo["unique_graphs"], dynamo["graph_breaks"]) == (1, 0)


@torch.compile(backend="aot_eager")
def _compiled_root(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x.clamp(min=0.0))  # planted: compiled inside an eager model


class _CallsCompiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight[:2] = 0.0
            self.fc.bias[:2] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_compiled_root(self.fc(x)))


def test_a_capture_runs_what_the_model_compiled_inside_it_eagerly(tmp_path: Path) -> None:
    """A function compiled inside an eager model's forward runs as its Python code in the
    capture's re-runs too: its backward's own node and line are named, not the compiled
    graph's backward (``CompiledFunctionBackward``, at the line that called it)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _CallsCompiled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    row = hooktrace.load(tmp_path / "run").nonfinite_captures().iloc[0]
    assert (row["pass"], row["op"], row["node"]) == (
        "backward",
        "aten::div.Tensor",
        "SqrtBackward0",
    )
    assert row["line"] == inspect.getsourcelines(_compiled_root)[1] + 2 and row["reproduces"]


def test_the_operators_that_reach_the_recorder_stay_out_of_cuda_graphs(tmp_path: Path) -> None:
    """A CUDA graph's replay runs kernels, not Python: a tap's gradient would never reach
    the recorder, and the rows it holds for the writer would be overwritten by the next
    replay. Inductor leaves operators tagged ``cudagraph_unsafe`` out of the CUDA graphs
    it makes (``mode="reduce-overhead"``): every such node of an instrumented graph is
    one, as inductor's own check reads it."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)  # forward and backward, in aten operators as inductor gets them
        return gm.forward

    torch._dynamo.reset()
    model = Blocks()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    with hooktrace.record(compiled, tmp_path / "run", full_steps=[1]):
        for _ in range(2):
            compiled(torch.randn(4, 8)).sum().backward()
    ours = [
        node
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "call_function" and "hooktrace" in str(node.target)
    ]
    assert {str(node.target).split(".")[1] for node in ours} >= {
        "summarize",
        "copy",
        "sink_summary",
    }
    assert all(is_cudagraph_unsafe_fx_node(node) for node in ours)
    for op in ("summarize", "copy", "sink", "sink_kept", "sink_summary"):
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.hooktrace, op).default.tags
