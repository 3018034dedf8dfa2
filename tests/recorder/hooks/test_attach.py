"""How hooks attach (recorder/hooks/attach.py): nothing of hooktrace in the user's modules, and
nothing in what a script makes of them (copies, pickles, graphs), while recording."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

import hooktrace
from hooktrace.recorder.hooks import attach


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _hook_dicts(model: nn.Module) -> int:
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return sum(len(getattr(m, name)) for m in model.modules() for name in names)


def _global_hooks() -> tuple[int, ...]:
    return tuple(
        len(d)
        for d in (
            module_globals._global_forward_hooks,
            module_globals._global_forward_pre_hooks,
            module_globals._global_backward_hooks,
            module_globals._global_backward_pre_hooks,
            # what torch notes of a forward hook: these are left behind where its handle
            # forgets them (with_kwargs: torch's handle does; the recorder's takes it out)
            module_globals._global_forward_hooks_with_kwargs,
            module_globals._global_forward_hooks_always_called,
        )
    )


def _train(model: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_no_hook_in_the_model_and_none_left_behind(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    before = _global_hooks()
    with hooktrace.record(model, tmp_path / "run"):
        _train(model)
        assert _hook_dicts(model) == 0
        assert _global_hooks()[2:4] == before[2:4]  # never a process-wide backward hook
    assert _global_hooks() == before
    assert bool(module_globals._has_any_global_hook()) == any(before)
    assert not [w for w in warnings.filters if "global hooks" in str(w[1])]


def test_copies_pickles_and_saves_hold_nothing_of_hooktrace(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        _train(model)
        blob = pickle.dumps(model)
        assert b"hooktrace" not in blob
        assert b"hooktrace" not in pickle.dumps(opt)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        assert b"hooktrace" not in buffer.getvalue()
        for made in (pickle.loads(blob), copy.deepcopy(model), copy.copy(model)):
            assert _hook_dicts(made) == 0
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert _hook_dicts(loaded) == 0
        for a, b in zip(loaded.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_a_deep_copy_is_not_recorded_under_the_originals_names(tmp_path: Path) -> None:
    """The EMA pattern: hooktrace.record records the models it was given; a deep copy made
    while recording is a model of its own, not recorded (``hooktrace record`` finds it as a
    root of its own: tests/transparency)."""
    torch.manual_seed(0)
    model = Net()
    with hooktrace.record(model, tmp_path / "run") as rec:
        _train(model, steps=1)
        ema = copy.deepcopy(model)
        with torch.no_grad():
            ema(torch.randn(3, 4))
        _train(model, steps=1)
        assert rec.error is None
    records = hooktrace.load(tmp_path / "run").records
    assert set(records["phase"]) == {"train"}  # the copy's eval forward was not recorded
    assert set(records["module"]) == {"Net", "fc1", "act", "fc2"}
    sizes = records.groupby("step").size().tolist()
    assert sizes == [sizes[0], sizes[0]]


def _graphs(model: nn.Module, x: torch.Tensor) -> dict[str, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scripted = torch.jit.script(model)
        traced = torch.jit.trace(model, x)
        exported = torch.export.export(model, (x,))
        symbolic = torch.fx.symbolic_trace(model)
    return {
        "script": str(scripted.code),
        "trace": str(traced.code),
        "export": str(exported.graph_module.code),
        "fx": str(symbolic.code),
        "warnings": "\n".join(str(w.message) for w in caught),
    }


def test_graphs_are_those_of_the_model_unrecorded(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 4)
    _graphs(model, x)  # the first scripting in a process warns once more, recorded or not
    plain = _graphs(model, x)
    with hooktrace.record(model, tmp_path / "run") as rec:
        _train(model, steps=1)
        recorded = _graphs(model, x)
        _train(model, steps=1)
        assert rec.error is None
    assert recorded == plain
    # jit.trace's eager check run and the tracing itself added no calls to the step
    records = hooktrace.load(tmp_path / "run").records
    assert set(records["phase"]) == {"train"}
    sizes = records.groupby("step").size().tolist()
    assert sizes == [sizes[0], sizes[0]]


def _compile_warnings(compiled: nn.Module) -> list[str]:
    """What torch warns of at one call of ``compiled``, to a script that sees every warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.ones(1, 4))
    return [str(w.message) for w in caught]


def test_torch_compile_warns_of_the_scripts_process_wide_hooks_not_of_the_recorders(
    tmp_path: Path,
) -> None:
    """torch.compile's wrapper warns at every call while a process-wide module hook exists.
    Under ``hooktrace record`` every filter a script sets comes after the recording began,
    and in front of any the recorder would set: a script seeing every warning saw this one
    at every call of its model (or raised it, with ``"error"``). The recorder's hooks are
    not counted; the script's own still are, as in a run unrecorded; and once the recording
    ends, nothing of its hooks is left to count (torch's handle left one behind)."""
    torch._dynamo.reset()
    compiled = torch.compile(Net(), backend="eager")
    asked = module_globals._has_any_global_hook
    try:
        with hooktrace.record(compiled, tmp_path / "run"):
            assert _compile_warnings(compiled) == []
            handle = module_globals.register_module_forward_hook(lambda *_: None)
            try:
                said = _compile_warnings(compiled)
            finally:
                handle.remove()
            assert len(said) == 1 and "when there are global hooks" in said[0]
            assert _compile_warnings(compiled) == []
        assert module_globals._has_any_global_hook is asked  # torch's own again
        assert _compile_warnings(compiled) == []
        handle = module_globals.register_module_forward_hook(lambda *_: None)
        try:
            assert len(_compile_warnings(compiled)) == 1
        finally:
            handle.remove()
    finally:
        torch._dynamo.reset()  # graphs compiled while recording: not for the tests after


def test_only_torch_compiles_wrapper_asks_whether_process_wide_hooks_exist() -> None:
    """While recording, ``_has_any_global_hook`` answers without the recorder's hooks
    (``Patches.hide_hooks_from_compile``): right for torch.compile's warning, wrong for
    anything in torch that would decide by it whether to run hooks. In the torch installed
    here the wrapper's warning is the only one to ask."""
    root = Path(torch.__file__).parent
    asking = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if "_has_any_global_hook()" in path.read_text(encoding="utf-8", errors="replace")
    )  # (its definition, and whoever calls it)
    assert asking in ([], ["_dynamo/eval_frame.py", "nn/modules/module.py"]), asking
    defined = (root / "nn" / "modules" / "module.py").read_text(encoding="utf-8")
    assert defined.count("_has_any_global_hook(") == 1  # defined there, called nowhere


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_a_compiled_model_is_recorded_inside_under_the_names_eager_gives(
    tmp_path: Path, how: str
) -> None:
    torch._dynamo.reset()  # graphs compiled by an earlier test were compiled unrecorded
    torch.manual_seed(0)
    model = Net()
    compiled: nn.Module = model
    if how == "torch.compile":
        compiled = torch.compile(model, backend="eager")
    else:
        model.compile(backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hooktrace.record(compiled, tmp_path / "run") as rec:
            _train(compiled, steps=3)
            assert rec.error is None
    # neither hooktrace nor torch's warning about process-wide hooks reaches the script
    assert not [
        w for w in caught if "hooktrace" in str(w.message) or "global hooks" in str(w.message)
    ]
    records = hooktrace.load(tmp_path / "run").records
    assert sorted(records["step"].unique()) == [0, 1, 2]
    step = records[records["step"] == 1]
    assert set(step["module"]) == {"Net", "fc1", "act", "fc2"}
    outputs = step[step["kind"] == "output"]
    assert list(outputs["module"]) == ["fc1", "act", "fc2", "Net"]  # as eager records them
    assert set(step.loc[step["kind"] == "grad_output", "module"]) == {"Net", "fc1", "act", "fc2"}
    assert len(step[step["kind"] == "param"]) == len(step[step["kind"] == "grad_param"]) == 4
    # nothing of hooktrace in the model's compiled call
    assert "hooktrace" not in type(model.__dict__.get("_compiled_call_impl")).__module__


def test_a_hook_traced_by_the_compiler_tells_compiling_from_exporting() -> None:
    """torch 2.11's dynamo answers ``torch.compiler.is_exporting()`` with True inside every
    ``torch.compile`` trace: the recorder's hook then marked nothing, and no module inside
    a compiled graph was recorded (seen on a GPU machine's torch). ``attach.exporting``
    reads export's own flag."""
    seen: list[tuple[str, bool]] = []

    def hook(module: nn.Module, args: object, output: object) -> None:
        if torch.compiler.is_compiling():
            seen.append((type(module).__name__, attach.exporting()))

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    handle = module_globals.register_module_forward_hook(hook)
    try:
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on process-wide hooks
            torch.compile(model, backend="eager")(torch.randn(2, 4))
        compiled, seen[:] = list(seen), []
        torch.export.export(model, (torch.randn(2, 4),))
    finally:
        handle.remove()
        torch._dynamo.reset()
    assert ("Linear", False) in compiled and all(not exporting for _, exporting in compiled)
    assert ("Linear", True) in seen and all(exporting for _, exporting in seen)


def test_module_compile_during_recording_is_recorded_from_then_on(tmp_path: Path) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    with hooktrace.record(model, tmp_path / "run") as rec:
        _train(model, steps=1)
        model.compile(backend="eager")
        _train(model, steps=1)
        assert rec.error is None
    assert "hooktrace" not in type(model.__dict__["_compiled_call_impl"]).__module__
    records = hooktrace.load(tmp_path / "run").records
    step0, step1 = (records[records["step"] == s] for s in (0, 1))
    for step in (step0, step1):
        assert list(step.loc[step["kind"] == "output", "module"]) == ["fc1", "act", "fc2", "Net"]
        assert len(step[step["kind"] == "param"]) == 4


class Growing(nn.Module):
    """A model whose head is replaced, and to which a module is added, mid-run."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
        self.extra: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if self.extra is not None:
            h = self.extra(h)
        return self.head(h)


def test_modules_assigned_mid_run_are_recorded_from_then_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Growing()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run") as rec:
        for i in range(4):
            if i == 2:
                model.head = nn.Sequential(nn.Linear(8, 3), nn.ReLU(), nn.Linear(3, 2))
                model.extra = nn.Linear(8, 8)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                new_head = model.head[0].weight.detach().clone()
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert rec.error is None
    trace = hooktrace.load(tmp_path / "run")
    records = trace.records
    outputs = records[records["kind"] == "output"]
    by_step = outputs.groupby("step")["module"].agg(lambda m: sorted(map(str, m))).to_dict()
    assert by_step[1] == ["Growing", "body", "head"]
    assert by_step[2] == ["Growing", "body", "extra", "head", "head.0", "head.1", "head.2"]
    # parameter records follow the modules there now: the first step after the change
    # records the new head's values, not the old one's
    params = records[(records["step"] == 3) & (records["kind"] == "param")]
    assert sorted(map(str, params["module"])) == [
        "body", "body", "extra", "extra", "head.0", "head.0", "head.2", "head.2"
    ]  # fmt: skip
    step2 = records[(records["step"] == 2) & (records["kind"] == "grad_param")]
    assert "head" not in set(map(str, step2["module"]))  # the old head's gradients are gone
    weight = records[
        (records["step"] == 2) & (records["module"] == "head.0") & (records["kind"] == "grad_param")
    ]
    assert len(weight) == 2
    modules = trace.modules
    assert modules["module"].is_unique
    added = modules.set_index("module").loc[["extra", "head.0"], "first_step"].tolist()
    assert added == [2, 2]
    assert new_head.shape == (3, 8)


_POOL_MODEL = nn.Linear(3, 3)
_COMPILE = nn.Module.__dict__["compile"]
_GLOBAL_HOOKS = _global_hooks()


def _call_in_child(out: str) -> list[float]:
    """In a forked worker: the parent's recording is not this process's; one of its own is."""
    from hooktrace.recorder.recording.recorder import active_recorder

    assert active_recorder() is None
    # the parent's hooks and patches are gone from the child: its modules run as unrecorded
    assert _global_hooks() == _GLOBAL_HOOKS
    assert nn.Module.__dict__["compile"] is _COMPILE
    with torch.no_grad():
        values = [float(_POOL_MODEL(torch.ones(1, 3)).sum())]
    with hooktrace.record(_POOL_MODEL, out) as rec, torch.no_grad():
        _POOL_MODEL(torch.ones(1, 3))
        rec.step()
    return values


def test_a_process_forked_while_recording_records_nothing_of_the_parents(tmp_path: Path) -> None:
    import multiprocessing

    opt = torch.optim.SGD(_POOL_MODEL.parameters(), lr=0.1)
    with hooktrace.record(_POOL_MODEL, tmp_path / "run") as rec:
        _POOL_MODEL(torch.randn(2, 3)).sum().backward()
        opt.step()
        with multiprocessing.get_context("fork").Pool(1) as pool:
            [values] = pool.map(_call_in_child, [str(tmp_path / "child")])
        _POOL_MODEL(torch.randn(2, 3)).sum().backward()
        opt.step()
        assert rec.error is None
    assert len(values) == 1
    steps = hooktrace.load(tmp_path / "run").steps
    assert list(steps["records"]) == [6, 6]  # params 2, output, its gradient, gradients 2
    assert list(hooktrace.load(tmp_path / "child").steps["step"]) == [0]


def test_a_model_not_recorded_inside_a_recorded_forward_stays_unrecorded(tmp_path: Path) -> None:
    """A frozen teacher called inside the student's forward is not the student's: it is not
    recorded, and modules assigned to the student later are still found."""
    torch.manual_seed(0)
    teacher = nn.Sequential(*[nn.Linear(4, 4) for _ in range(100)])

    class Student(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.extra: nn.Module | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                target = teacher(x)
            h = self.fc(x)
            if self.extra is not None:
                h = self.extra(h)
            return (h - target).pow(2)

    student = Student()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with hooktrace.record(student, tmp_path / "run") as rec:
        for i in range(3):
            if i == 2:
                student.extra = nn.Linear(4, 4)
            student(torch.randn(3, 4)).mean().backward()
            opt.step()
            opt.zero_grad()
        assert rec.error is None
    modules = set(map(str, hooktrace.load(tmp_path / "run").records["module"]))
    assert modules == {"Student", "fc", "extra"}


def test_a_recorded_root_called_inside_another_takes_the_outer_ones_phase(
    tmp_path: Path,
) -> None:
    """Two recorded models, the teacher (in eval mode) called inside the student's training
    forward: the teacher's call is inside the student's, so its records take the student's
    phase, also in a step whose first forward a KeyboardInterrupt ended (the depth it left
    is found stale; the student's call then running is not)."""
    torch.manual_seed(0)
    teacher = nn.Linear(4, 4).eval()

    class Student(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.interrupt = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            target = teacher(x).detach()
            if self.interrupt:
                raise KeyboardInterrupt
            return (self.fc(x) - target).pow(2)

    student = Student()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with hooktrace.record([student, teacher], tmp_path / "run") as rec:
        for i in range(3):
            if i == 1:
                student.interrupt = True
                with contextlib.suppress(KeyboardInterrupt):
                    student(torch.randn(3, 4))
                student.interrupt = False
            student(torch.randn(3, 4)).mean().backward()
            opt.step()
            opt.zero_grad()
        assert rec.error is None
    records = hooktrace.load(tmp_path / "run").records
    outputs = records[records["kind"] == "output"]
    by_step = outputs.groupby("step")["phase"].agg(lambda p: sorted(set(map(str, p))))
    assert by_step.to_dict() == {0: ["train"], 1: ["train"], 2: ["train"]}
    step1 = outputs[outputs["step"] == 1]
    assert sorted(map(str, step1["module"])) == ["Linear", "Linear", "Student", "Student.fc"]


def test_hooktraces_warnings_never_raise_into_the_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script that makes warnings errors (``-W error``) gets hooktrace's warnings printed,
    not raised inside its own calls."""
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hooktrace.record(model, tmp_path / "run") as rec:
            _train(model, steps=1)
            model.compile(backend="eager")
            rec._observer.observe = None  # type: ignore[assignment,method-assign]  # a planted fault
            _train(model, steps=1)
    err = capsys.readouterr().err
    assert "hooktrace failed in the forward of 'Net' at step 1" in err
    assert rec.error is not None


def test_a_fault_naming_a_module_stops_the_recording_not_the_training(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Growing()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run") as rec, warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _train(model, steps=1)

        def broken(*args: object) -> None:
            raise ValueError("a planted internal bug")

        rec._module_rows = broken  # type: ignore[assignment,method-assign]
        model.extra = nn.Linear(8, 8)
        model(torch.randn(5, 4)).sum().backward()  # reaches the user's code: no exception
        opt.step()
        model(torch.randn(5, 4)).sum().backward()
    assert rec.error is not None and "naming the modules of Growing" in rec.error


class Interrupted(nn.Module):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.interrupt = False
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.interrupt:
            raise self.error
        return self.fc(x)


@pytest.mark.parametrize("error", [KeyboardInterrupt, ValueError])
def test_a_forward_ended_by_an_exception_leaves_no_depth_behind(
    tmp_path: Path, error: type[BaseException]
) -> None:
    """torch calls hooktrace's post hook where the forward raised an Exception (as
    ``(module, args, None)``): the root's depth is as before the call, and a forward after
    it in the same step is a root's call of its own. After a BaseException torch calls no
    hook: the next root's forward finds no root's call running on its thread's stack, and
    is a root's call of its own too (it was taken for one inside the forward that had
    ended, in the phase of that one). Either way the steps after it are recorded in their
    phases."""
    torch.manual_seed(0)
    model = Interrupted(error)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        for i in range(3):
            model.interrupt = i == 1
            with contextlib.suppress(error):
                model(torch.randn(3, 4)).sum().backward()
            if i == 1:  # the same step goes on: a forward of its own, not inside the one before
                model.interrupt = False
                model.eval()
                with torch.no_grad():
                    model(torch.randn(3, 4))
                model.train()
            opt.step()
            opt.zero_grad()
            model.interrupt = False
            model.eval()
            with torch.no_grad():
                model(torch.randn(3, 4))
            model.train()
    records = hooktrace.load(tmp_path / "run").records
    params = records[records["kind"] == "param"]
    # each step's first forward records them, whatever happened to the one before
    phases = params.groupby("step")["phase"].agg(lambda p: sorted(set(map(str, p))))
    assert phases.to_dict() == {
        0: ["train"],
        1: ["eval", "train"],
        2: ["eval", "train"],
        3: ["eval"],
    }
    step1 = records[(records["step"] == 1) & (records["module"] == "fc")]
    assert list(step1[step1["kind"] == "output"]["phase"]) == ["eval", "eval"]
    step2 = records[(records["step"] == 2) & (records["module"] == "fc")]
    outputs = step2[step2["kind"] == "output"]
    assert list(outputs["phase"]) == ["eval", "train"]  # the eval after step 1, then training
    step3 = records[(records["step"] == 3) & (records["kind"] == "output")]
    assert set(step3["phase"]) == {"eval"}


class LoRA(nn.Module):
    """Wraps a Linear, as low-rank adapters do: ``model.fc = LoRA(model.fc)``."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Linear(base.in_features, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.a(x)


def test_a_module_wrapped_mid_run_is_renamed_where_it_now_sits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 4))
    model.add_module("out", nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run") as rec:
        for i in range(3):
            if i == 1:
                model.fc = LoRA(model.fc)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert rec.error is None
    records = hooktrace.load(tmp_path / "run").records
    later = records[records["step"] == 2]
    outputs = later[later["kind"] == "output"]
    assert list(outputs["module"]) == ["fc.base", "fc.a", "fc", "out", "Sequential"]
    assert list(outputs["call"]) == [0, 0, 0, 0, 0]
    params = later[later["kind"] == "param"]
    assert list(zip(params["module"], params["slot"], strict=True)) == [
        ("out", "weight"), ("out", "bias"), ("fc.base", "weight"), ("fc.base", "bias"),
        ("fc.a", "weight"),
    ]  # fmt: skip


def _replicate(net: nn.Module) -> nn.Module:
    """What torch.nn.parallel.replicate does for each device, on the CPU: copies of every
    module (``_replicate_for_data_parallel``) wired together, sharing the parameters."""
    copies = {m: m._replicate_for_data_parallel() for m in net.modules()}
    for module, copy_ in copies.items():
        for key, child in module._modules.items():
            copy_._modules[key] = copies[child] if child is not None else None
        for key, param in module._parameters.items():
            copy_._parameters[key] = param
    return copies[net]


class DataParallel(nn.Module):
    """nn.DataParallel on two devices, as far as hooks see it: the wrapped module is never
    called, two replicas made at each forward are, in threads of their own."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import threading

        outputs: list[torch.Tensor] = [x, x]
        replicas = [_replicate(self.module) for _ in range(2)]

        def run(i: int, chunk: torch.Tensor) -> None:
            outputs[i] = replicas[i](chunk)

        threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(x.chunk(2))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return torch.cat(outputs)


def test_data_parallel_replicas_are_recorded_as_their_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model = DataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run") as rec:
        for _ in range(2):
            model(torch.randn(6, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert rec.error is None
        assert not rec._table._replicas  # the replicas of the last forward are gone
    records = hooktrace.load(tmp_path / "run").records
    step = records[records["step"] == 1]
    outputs = step[step["kind"] == "output"]
    # each module once per replica: calls 0 and 1
    assert outputs.groupby("module")["call"].agg(sorted).to_dict() == {
        "0": [0, 1], "1": [0, 1], "2": [0, 1], "Sequential": [0, 1]
    }  # fmt: skip
    assert len(step[step["kind"] == "grad_output"]) == 8


def test_the_layout_checked_each_step_is_the_modules_in_their_order() -> None:
    """What each step's first forward compares to see whether modules were assigned: the
    modules as ``modules()`` gives them, each once, in its order, where modules are
    shared, a child slot holds None, and a module holds its own parent."""
    from hooktrace.recorder.hooks.names import _layout

    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), shared, nn.ModuleList([shared]))
    model.register_module("empty", None)
    model[0].parent = model  # a cycle
    assert _layout(model) == [id(m) for m in model.modules()]
    before = _layout(model)
    model[0][1] = nn.GELU()  # assigned deep inside: the layout says so
    assert _layout(model) != before and _layout(model) == [id(m) for m in model.modules()]
