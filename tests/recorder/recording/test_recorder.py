"""The recorder on real models and real training loops."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from models import batches, default_loss, make_batch, make_model, train_steps
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks

import hooktrace
from hooktrace.errors import ConfigError, RecordingError
from hooktrace.recorder.recording import rundir
from hooktrace.recorder.records.layout import Meta

KEY = ["rank", "step", "micro_step", "phase", "module", "call", "kind", "slot"]


def _hooks_left(model: nn.Module) -> list[str]:
    left = []
    for name, m in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        ):
            if getattr(m, attr):
                left.append(f"{name or '<root>'}.{attr}")
    if _global_optimizer_post_hooks:
        left.append("global optimizer post hooks")
    return left


@pytest.mark.parametrize(
    ("name", "optimizer"),
    [
        ("ReferenceMLP", "sgd"),
        ("InplaceCNN", "sgd"),
        ("SmallCNN", "adam"),
        ("TinyTransformer", "adam"),
    ],
)
def test_parameters_are_bit_identical_with_and_without_recording(
    run_dir: Path, name: str, optimizer: str
) -> None:
    plain = train_steps(make_model(name), batches(name), 5, lr=0.01, seed=1, optimizer=optimizer)  # type: ignore[arg-type]
    model = make_model(name)
    with hooktrace.record(model, run_dir, inputs=True, full_every=2):
        recorded = train_steps(model, batches(name), 5, lr=0.01, seed=1, optimizer=optimizer)  # type: ignore[arg-type]
    assert plain.keys() == recorded.keys()
    for key in plain:
        assert torch.equal(plain[key], recorded[key]), key
    trace = hooktrace.load(run_dir)
    assert sorted(trace.steps["step"]) == [0, 1, 2, 3, 4]
    assert trace.status == "complete"


def test_no_hook_is_left_after_the_context_even_when_the_body_raises(run_dir: Path) -> None:
    model = make_model("CheckpointedMLP")
    with pytest.raises(ZeroDivisionError), hooktrace.record(model, run_dir, inputs=True):
        batch = make_batch("CheckpointedMLP")
        default_loss(batch.run(model), batch.target).backward()
        1 / 0  # noqa: B018
    assert _hooks_left(model) == []
    trace = hooktrace.load(run_dir)
    assert trace.status == "failed"
    assert "ZeroDivisionError" in trace.manifest["ranks"]["0"]["error"]
    assert len(trace.records) > 0  # the partial step was kept

    with hooktrace.record(model, run_dir.with_name("again")):  # a new recording may start
        pass
    assert _hooks_left(model) == []


def test_statistics_equal_numpy_on_the_same_tensors(run_dir: Path) -> None:
    model = make_model("InplaceCNN")
    seen: dict[str, np.ndarray] = {}

    def keep(name: str):  # plain torch hooks: an independent copy of each output
        def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            seen[name] = output.detach().clone().numpy()

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n]
    with hooktrace.record(model, run_dir) as rec:
        batch = make_batch("InplaceCNN")
        default_loss(batch.run(model), batch.target).backward()
        rec.step()
    for h in handles:
        h.remove()
    records = hooktrace.load(run_dir).query(kinds=["output"]).set_index("module")
    for name, values in seen.items():
        row = records.loc[name]
        x = values.astype(np.float64)
        assert row["mean"] == pytest.approx(x.mean(), rel=1e-5, abs=1e-6), name
        assert row["std"] == pytest.approx(x.std(), rel=1e-4, abs=1e-6), name
        assert row["min"] == x.min() and row["max"] == x.max(), name
        assert row["norm"] == pytest.approx(np.linalg.norm(x.ravel()), rel=1e-5), name
        assert row["zero_fraction"] == pytest.approx((x == 0).mean()), name
        assert row["numel"] == x.size and row["shape"] == ",".join(map(str, x.shape))
        if x.ndim == 4:  # per channel: positives over batch and space
            activity = hooktrace.load(run_dir).activity(name, step=0)
            np.testing.assert_array_equal(activity, (x > 0).sum(axis=(0, 2, 3)))
    # the in-place ReLU overwrote bn's output after bn's hook ran: bn still shows negatives
    assert records.loc["bn", "min"] < 0


def test_nan_and_inf_are_counted(run_dir: Path) -> None:
    layer = nn.Identity()
    with hooktrace.record(layer, run_dir) as rec:
        layer(torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0]))
        rec.step()
    row = hooktrace.load(run_dir).record("Identity", "output", step=0)
    assert (row["nan_count"], row["inf_count"], row["zero_fraction"]) == (1, 2, 0.2)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int8,
        torch.bool,
    ],
)
def test_full_tensors_round_trip_exactly(run_dir: Path, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    if dtype.is_floating_point:
        value = (torch.randn(3, 5) * 1000).to(dtype)
        value[0, 0] = float("nan")
    elif dtype == torch.bool:
        value = torch.rand(3, 5) > 0.5
    else:
        value = torch.randint(-100, 100, (3, 5)).to(dtype)
    layer = nn.Identity()
    with hooktrace.record(layer, run_dir, full_every=1) as rec:
        layer(value)
        rec.step()
    trace = hooktrace.load(run_dir)
    back = trace.tensor("Identity", "output", step=0)
    assert trace.record("Identity", "output", step=0)["dtype"] == str(dtype).removeprefix("torch.")
    expected = value.view(torch.int16).numpy() if dtype == torch.bfloat16 else value.numpy()
    got = back.view(np.int16) if dtype == torch.bfloat16 else back
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()
    if dtype == torch.bfloat16:
        assert str(back.dtype) == "bfloat16"


def _unique(records: pd.DataFrame) -> None:
    duplicated = records[records.duplicated(KEY, keep=False)]
    assert duplicated.empty, duplicated[KEY].to_string()


def _train(name: str, run: Path, n_steps: int = 2, **options: object) -> hooktrace.Trace:
    model = make_model(name)
    with hooktrace.record(model, run, **options):
        train_steps(model, batches(name), n_steps, lr=0.01, seed=0)
    return hooktrace.load(run)


def test_dict_and_dataclass_outputs_are_flattened_into_slots(tmp_path: Path) -> None:
    records = _train("DictOutput", tmp_path / "dict").records
    root = records[records["module"] == "DictOutput"]
    assert set(root[root["kind"] == "output"]["slot"]) == {"logits", "aux"}
    assert set(root[root["kind"] == "grad_output"]["slot"]) == {"logits", "aux"}
    _unique(records)

    records = _train("DataclassOutput", tmp_path / "dataclass").records
    root = records[(records["module"] == "DataclassOutput") & (records["kind"] == "output")]
    assert set(root["slot"]) == {"logits", "hidden"}  # the None field holds no tensor

    records = _train("TupleNoneIntOutput", tmp_path / "tuple").records
    root = records[(records["module"] == "TupleNoneIntOutput") & (records["kind"] == "output")]
    assert set(root["slot"]) == {"0"}

    records = _train("KwargsOnly", tmp_path / "kwargs", inputs=True).records
    inputs = records[(records["module"] == "KwargsOnly") & (records["kind"] == "input")]
    assert set(inputs["slot"]) == {"x", "mask"}


def test_shared_module_and_rnn_cell_get_one_call_index_per_call(tmp_path: Path) -> None:
    records = _train("SharedTwice", tmp_path / "shared").records
    for kind in ("output", "grad_output"):
        calls = records[
            (records["module"] == "shared") & (records["kind"] == kind) & (records["step"] == 0)
        ]
        assert sorted(calls["call"]) == [0, 1], kind
    _unique(records)

    records = _train("RNNLoop", tmp_path / "rnn").records
    cell = records[(records["module"] == "cell") & (records["step"] == 0)]
    # LSTMCell returns (h, c): two slots per call, five calls
    assert sorted(set(cell[cell["kind"] == "output"]["call"])) == [0, 1, 2, 3, 4]
    assert set(cell[cell["kind"] == "output"]["slot"]) == {"0", "1"}
    assert len(cell[cell["kind"] == "output"]) == 10
    assert set(cell[cell["kind"] == "grad_output"]["call"]) == {0, 1, 2, 3, 4}
    _unique(records)


@pytest.mark.parametrize("name", ["CheckpointedMLP", "CheckpointedMLPReentrant"])
def test_checkpointed_blocks_are_recorded_once(run_dir: Path, name: str) -> None:
    reference = _train("CheckpointedMLP", run_dir.with_name("plain"), modules=None).records
    records = _train(name, run_dir).records
    _unique(records)
    for kind in ("output", "grad_output"):
        got = records[records["kind"] == kind].groupby("module", observed=True).size()
        want = reference[reference["kind"] == kind].groupby("module", observed=True).size()
        pd.testing.assert_series_equal(got, want, check_names=False)
    # the blocks' gradients arrive, and equal those of the same model without reentrancy
    grads = records[(records["module"] == "blocks.0.0") & (records["kind"] == "grad_output")]
    assert len(grads) == 2  # one per step
    ref = reference[(reference["module"] == "blocks.0.0") & (reference["kind"] == "grad_output")]
    np.testing.assert_allclose(grads["norm"].to_numpy(), ref["norm"].to_numpy(), rtol=1e-6)


def test_eval_under_no_grad_is_phase_eval_and_not_a_step(run_dir: Path) -> None:
    model = make_model("DictOutput")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir):
        for step in range(3):
            batch = make_batch("DictOutput", seed=step)
            default_loss(batch.run(model), batch.target).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model(batch.args[0])
            model.eval()
            model(batch.args[0])  # eval mode, grad enabled: eval too
            model.train()
    trace = hooktrace.load(run_dir)
    records = trace.records
    assert sorted(trace.steps["step"]) == [0, 1, 2, 3]  # step 3: the last eval passes
    evals = records[records["phase"] == "eval"]
    # no gradients in eval; parameters where an eval pass was the step's first forward, and
    # again (phase train) at the step's first training forward
    assert set(evals["kind"]) == {"output", "param"}
    assert set(evals.loc[evals["kind"] == "param", "step"]) == {1, 2, 3}
    train_params = records[(records["phase"] == "train") & (records["kind"] == "param")]
    assert set(train_params["step"]) == {0, 1, 2}
    outputs = evals[(evals["module"] == "body") & (evals["kind"] == "output")]
    assert list(outputs["call"]) == [0, 1] * 3
    assert set(evals["step"]) == {1, 2, 3}
    train = records[records["phase"] == "train"]
    assert set(train["step"]) == {0, 1, 2}


def test_gradient_accumulation_counts_micro_steps(run_dir: Path) -> None:
    model = make_model("SharedTwice")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir):
        for step in range(2):
            for micro in range(3):
                batch = make_batch("SharedTwice", seed=10 * step + micro)
                (default_loss(batch.run(model), batch.target) / 3).backward()
            opt.step()
            opt.zero_grad()
    trace = hooktrace.load(run_dir)
    assert list(trace.steps["micro_steps"]) == [3, 3]
    out = trace.records.query("kind == 'output' and module == 'head'")
    assert list(out["micro_step"]) == [0, 1, 2, 0, 1, 2]
    grads = trace.records.query("kind == 'grad_output' and module == 'head'")
    assert list(grads["micro_step"]) == [0, 1, 2, 0, 1, 2]
    assert set(trace.records.query("kind == 'grad_param'")["micro_step"]) == {2}
    assert set(trace.records.query("kind == 'param'")["micro_step"]) == {0}


def test_every_steps_and_module_filters(tmp_path: Path) -> None:
    trace = _train("SharedTwice", tmp_path / "every", n_steps=6, every=2)
    assert sorted(trace.steps["step"]) == [0, 2, 4]
    trace = _train("SharedTwice", tmp_path / "ranges", n_steps=6, steps="1,3-4")
    assert sorted(trace.steps["step"]) == [1, 3, 4]
    picked = [np.int64(1), (np.int64(3), np.int64(4))]  # numpy's integers, as pandas gives them
    trace = _train("SharedTwice", tmp_path / "numpy", n_steps=6, steps=picked)
    assert sorted(trace.steps["step"]) == [1, 3, 4]
    trace = _train("SharedTwice", tmp_path / "modules", modules="^head", params=False)
    assert set(trace.records["module"]) == {"head"}
    trace = _train("SharedTwice", tmp_path / "exclude", exclude=["head"], params=False)
    assert set(trace.records["module"]) == {"SharedTwice", "shared"}


def test_frozen_and_unused_parameters(run_dir: Path) -> None:
    records = _train("FrozenAndUnused", run_dir).records
    grads = records[records["kind"] == "grad_param"]
    none = grads[grads["dtype"] == "None"]
    assert set(none["module"]) == {"unused"}  # a frozen parameter has no gradient to miss
    assert "frozen" not in set(grads["module"])
    assert not records[(records["module"] == "unused") & (records["kind"] == "output")].shape[0]
    assert not records[(records["module"] == "frozen") & (records["kind"] == "grad_output")].shape[
        0
    ]


def test_sparse_gradients_are_summarised(run_dir: Path) -> None:
    records = _train("SparseEmbedding", run_dir, full_every=1).records
    grad = records[(records["module"] == "embedding") & (records["kind"] == "grad_param")]
    assert len(grad) == 2 and (grad["numel"] == 20 * 8).all()
    assert (grad["zero_fraction"] > 0).all()  # the dense view has untouched rows


def test_a_fault_inside_hooktrace_warns_once_and_training_goes_on(run_dir: Path) -> None:
    model = make_model("SharedTwice")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir) as rec, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            if step == 2:
                rec._observer.observe = None  # type: ignore[assignment,method-assign]  # a planted internal bug
            batch = make_batch("SharedTwice", seed=step)
            default_loss(batch.run(model), batch.target).backward()
            opt.step()
            opt.zero_grad()
    messages = [str(w.message) for w in caught if "hooktrace failed" in str(w.message)]
    assert len(messages) == 1 and "step 2" in messages[0]
    trace = hooktrace.load(run_dir)
    assert trace.status == "incomplete"
    assert sorted(trace.steps["step"]) == [0, 1]
    assert _hooks_left(model) == []


def _broken(*args: object, **kwargs: object) -> None:
    raise ValueError("a planted internal bug.")


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("capture", [True, False])
def test_the_fault_warning_points_at_the_users_line(
    run_dir: Path, where: str, capture: bool
) -> None:
    """A fault in a module's forward hook, or in a gradient's hook (whether or not the
    non-finite capture looks at the gradient too)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with (
        hooktrace.record(model, run_dir, capture_nonfinite=capture) as rec,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        observe = rec._observer.observe
        kind = "output" if where == "forward" else "grad_output"

        def broken_at(*args: object, **kwargs: object) -> object:
            if args[4] == kind:  # (pending, micro_step, module, call, kind, ...)
                _broken()
            return observe(*args, **kwargs)

        rec._observer.observe = broken_at  # type: ignore[method-assign]
        loss = model(torch.randn(2, 3)).sum()
        loss.backward()
    [warning] = [w for w in caught if "hooktrace failed" in str(w.message)]
    assert warning.filename == __file__  # not a line inside hooktrace or torch
    line = "loss = model(" if where == "forward" else "loss.backward()"
    assert line in Path(__file__).read_text().splitlines()[warning.lineno - 1]
    assert "ValueError: a planted internal bug. Recording stopped;" in str(warning.message)


def test_strict_makes_a_fault_fatal(run_dir: Path) -> None:
    model = make_model("SharedTwice")
    with (
        pytest.raises(RecordingError, match="hooktrace failed"),
        hooktrace.record(model, run_dir, strict=True) as rec,
    ):
        rec._observer.observe = None  # type: ignore[assignment,method-assign]
        make_batch("SharedTwice").run(model)
    assert _hooks_left(model) == []


class _TrainingFailed(Exception):
    pass


@pytest.mark.parametrize(
    ("strict", "failing"),
    [(False, False), (True, False), (True, True)],
    ids=["default", "strict", "strict, the training raising"],
)
def test_a_final_status_that_cannot_be_written(run_dir: Path, strict: bool, failing: bool) -> None:
    model = nn.Linear(2, 2)
    rec = hooktrace.record(model, run_dir, strict=strict)

    def train_and_lose_the_status_directory() -> None:
        with rec:
            model(torch.randn(3, 2)).sum().backward()
            rec.step()
            shutil.rmtree(run_dir / "status")
            (run_dir / "status").write_text("a file where the status directory was\n")  # ENOTDIR
            if failing:
                raise _TrainingFailed

    if strict and not failing:
        with pytest.raises(RecordingError, match="at the end of the recording: could not write"):
            train_and_lose_the_status_directory()
    else:  # a warning, pointing here; the training's own exception is the one that goes on
        with (
            pytest.warns(RuntimeWarning, match="could not write the final status") as caught,
            pytest.raises(_TrainingFailed) if failing else contextlib.nullcontext(),
        ):
            train_and_lose_the_status_directory()
        assert [w.filename for w in caught if "final status" in str(w.message)] == [__file__]
    assert _hooks_left(model) == []
    (run_dir / "status").unlink()
    trace = hooktrace.load(run_dir)  # what was written stays readable
    assert sorted(trace.steps["step"]) == [0]


def test_bad_options_and_outputs_are_refused(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="every"):
        hooktrace.record(model, tmp_path / "a", every=0)
    with pytest.raises(ConfigError, match="step range"):
        hooktrace.record(model, tmp_path / "a", steps="5-2")
    with pytest.raises(ConfigError, match="bad step -1: steps count from 0"):  # was "-1--1"
        hooktrace.record(model, tmp_path / "a", steps=[-1, 2])
    with pytest.raises(ConfigError, match=r"bad step range \(5, 2\): steps count from 0"):
        hooktrace.record(model, tmp_path / "a", steps=[(5, 2)])
    with pytest.raises(ConfigError, match=r"give \[5\] for step 5 alone, or range\(5\)"):
        hooktrace.record(model, tmp_path / "a", steps=5)  # was a TypeError from a loop
    with pytest.raises(ConfigError, match="bad steps 3"):
        hooktrace.record(model, tmp_path / "a", full_steps=3)
    for odd in (True, 0, -2, 5.0):  # each was a TypeError or a nonsensical suggestion
        with pytest.raises(ConfigError, match=r"give step numbers such as \[5\]"):
            hooktrace.record(model, tmp_path / "a", steps=odd)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="bad steps 4: give \\[4\\]"):
        hooktrace.record(model, tmp_path / "a", steps=np.int64(4))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="module pattern"):
        hooktrace.record(model, tmp_path / "a", modules="(")
    with hooktrace.record(model, tmp_path / "b"):
        pass
    with pytest.raises(ConfigError, match="already holds a trace"):
        hooktrace.record(model, tmp_path / "b")
    with hooktrace.record(model, tmp_path / "b", overwrite=True):
        pass
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        hooktrace.record(model, tmp_path / "file")
    with pytest.raises(ConfigError, match=r"holds other files \(b, file\) and no trace"):
        hooktrace.record(model, tmp_path)  # was written in among them, overwrite or not
    with pytest.raises(ConfigError, match="holds other files"):
        hooktrace.record(model, tmp_path, overwrite=True)
    (tmp_path / "c" / "d").mkdir(parents=True)
    (tmp_path / "c" / ".gitkeep").write_text("")
    for name in ("notes.txt", "x", "y"):
        (tmp_path / "c" / name).write_text("x")
    with pytest.raises(ConfigError, match=r"holds other files \(d, notes.txt, x, \.\.\.\)"):
        hooktrace.record(model, tmp_path / "c")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / ".gitkeep").write_text("")
    with hooktrace.record(model, tmp_path / "e"):  # hidden names are not the user's files
        pass
    (tmp_path / "f" / "modules").mkdir(parents=True)  # a project's package of that name
    (tmp_path / "f" / "modules" / "__init__.py").write_text("")
    with pytest.raises(ConfigError, match=r"holds other files \(modules\)"):
        hooktrace.record(model, tmp_path / "f")  # was taken for a part of a trace
    (tmp_path / "g" / "records").mkdir(parents=True)  # another rank's, being made
    with hooktrace.record(model, tmp_path / "g"):
        pass
    (tmp_path / "b" / "notes.txt").write_text("x")
    with hooktrace.record(model, tmp_path / "b", overwrite=True):  # a trace, notes beside it
        pass
    assert (tmp_path / "b" / "notes.txt").exists()
    assert _hooks_left(model) == []


def test_every_rank_refuses_a_trace_an_earlier_run_left(tmp_path: Path) -> None:
    """Rank 0 refuses any manifest; another rank may find the one rank 0 of its own run has
    just written, and refuses only what an earlier run left: its own status, or a manifest
    older than its process."""
    out = tmp_path / "run"
    (out / "status").mkdir(parents=True)
    manifest = out / "manifest.json"
    manifest.write_text(json.dumps({"start_time": time.time()}))  # this run's rank 0's
    rundir.prepare_out(out, rank=1, overwrite=False)
    with pytest.raises(ConfigError, match="already holds a trace"):
        rundir.prepare_out(out, rank=0, overwrite=False)
    manifest.write_text(json.dumps({"start_time": time.time() - 60}))  # clocks a minute apart
    rundir.prepare_out(out, rank=1, overwrite=False)
    manifest.write_text(json.dumps({"start_time": time.time() - 3600}))  # a run of one rank
    with pytest.raises(ConfigError, match="already holds a trace"):
        rundir.prepare_out(out, rank=1, overwrite=False)
    manifest.write_text(json.dumps({"start_time": time.time()}))
    (out / "status" / "rank=1.json").write_text("{}")  # rank 1 of an earlier run of two
    with pytest.raises(ConfigError, match="already holds a trace"):
        rundir.prepare_out(out, rank=1, overwrite=False)
    rundir.prepare_out(out, rank=1, overwrite=True)
    assert not (out / "status" / "rank=1.json").exists() and manifest.exists()


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ({"inputs": "no"}, "inputs is True or False (true or false in TOML; got 'no')"),
        ({"strict": "yes"}, "strict is True or False (true or false in TOML; got 'yes')"),
        ({"max_tensor_mb": -1}, "max_tensor_mb must be a finite number, 0 or more (got -1)"),
        ({"buffer_mb": "8"}, "buffer_mb must be a finite number, 0 or more (got '8')"),
        ({"capture_max_mb": float("nan")}, "capture_max_mb must be a finite number, 0 or more"),
    ],
)
def test_an_option_of_the_wrong_kind_is_refused(
    tmp_path: Path, option: dict[str, object], said: str
) -> None:
    """Found in review: ``inputs="no"`` recorded the inputs (a string reads as true), and
    ``max_tensor_mb=-1`` dropped every full tensor, both without a word."""
    with pytest.raises(ConfigError, match=re.escape(said)):
        hooktrace.record(nn.Linear(2, 2), tmp_path / "run", **option)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


def test_numpys_numbers_and_booleans_are_options_as_pythons_are(tmp_path: Path) -> None:
    """numpy's int64, float32 and bool_ take the place of Python's (found in review: the
    first check of the options' kinds refused them)."""
    model = nn.Linear(2, 2)
    options = {
        "inputs": np.bool_(True),
        "max_units": np.int64(1000),
        "max_tensor_mb": np.float32(8),
        "capture_limit": np.int64(2),
    }
    with hooktrace.record(model, tmp_path / "run", **options) as rec:  # type: ignore[arg-type]
        model(torch.ones(1, 2)).sum().backward()
        rec.step()
    assert "input" in set(hooktrace.load(tmp_path / "run").records["kind"])


@pytest.mark.parametrize(
    ("models", "said"),
    [
        (lambda x: x, "not function"),
        ("model", "not str"),
        ([nn.Linear(2, 2), "model"], "not str"),
        ({1: nn.Linear(2, 2)}, "keys, which must be non-empty strings"),
        ({"a": 5}, "not int"),
        ([], "not an empty one"),
        (None, "takes an nn.Module"),
    ],
    ids=["function", "string", "list-with-string", "int-key", "dict-of-int", "empty", "none"],
)
def test_what_is_not_a_model_is_refused_before_anything_is_written(
    tmp_path: Path, models: object, said: str
) -> None:
    """Found in review: each was a TypeError or an AttributeError from inside the recorder,
    or (None) a recording of nothing."""
    with pytest.raises(ConfigError, match=said):
        hooktrace.record(models, tmp_path / "run")  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("out", [None, "", 5])
def test_an_output_that_is_not_a_path_is_refused(out: object) -> None:
    """Found in review: None was a TypeError of pathlib's, and "" recorded into the current
    directory."""
    with pytest.raises(ConfigError, match="give its path"):
        hooktrace.record(nn.Linear(2, 2), out)  # type: ignore[arg-type]


def test_a_generator_of_models_is_taken_once(run_dir: Path) -> None:
    """Its models are named once and recorded (the recorder asked a generator twice)."""
    models = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with hooktrace.record((m for m in models), run_dir) as rec:
        models[1](models[0](torch.ones(1, 2))).sum().backward()
        rec.step()
    assert set(hooktrace.load(run_dir).records["module"]) == {"Linear", "Linear#1"}


def test_a_recording_that_has_ended_cannot_be_entered_again(run_dir: Path) -> None:
    """Its hooks are gone: a second with block would record nothing (found in review)."""
    model = nn.Linear(2, 2)
    recording = hooktrace.record(model, run_dir)
    recording.close()
    with pytest.raises(RecordingError, match="has ended: start another"), recording:
        pass
    assert _hooks_left(model) == []


def test_only_one_recording_at_a_time(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with (
        hooktrace.record(model, tmp_path / "a"),
        pytest.raises(RecordingError, match="already active"),
    ):
        hooktrace.record(model, tmp_path / "b")


def test_several_models_are_named_by_key(run_dir: Path) -> None:
    gen, disc = nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 1))
    with hooktrace.record({"gen": gen, "disc": disc}, run_dir) as rec:
        disc(gen(torch.randn(2, 3))).sum().backward()
        rec.step()
    trace = hooktrace.load(run_dir)
    assert set(trace.records["module"]) == {"gen", "disc", "disc.0"}
    assert dict(zip(trace.modules["module"], trace.modules["root"], strict=True)) == {
        "gen": "gen",
        "disc": "disc",
        "disc.0": "disc",
    }


def test_repr_says_what_is_inside(run_dir: Path) -> None:
    trace = _train("SharedTwice", run_dir)
    text = repr(trace)
    assert "status complete" in text and "steps 0–1 (2)" in text and "grad_output" in text


def test_what_replay_needs_is_recorded_with_full_inputs(run_dir: Path) -> None:
    model = make_model("InplaceCNN")
    batch = make_batch("InplaceCNN")
    torch.manual_seed(3)
    expected_rng = torch.get_rng_state()
    with hooktrace.record(model, run_dir, inputs=True, full_every=1) as rec:
        default_loss(batch.run(model), batch.target).backward()
        rec.step()
    records = hooktrace.load(run_dir).records
    buffers = records[records["kind"] == "buffer"]
    assert set(buffers["slot"]) == {"running_mean", "running_var", "num_batches_tracked"}
    assert set(buffers["module"]) == {"bn"}
    specs = records[records["call_spec"] != ""]
    assert set(specs["kind"]) == {"input"}
    assert sorted(specs["module"]) == sorted(["InplaceCNN", "conv", "bn", "relu", "pool", "fc"])
    spec = json.loads(specs.set_index("module").loc["conv", "call_spec"])
    assert spec["args"] == [{"tensor": "0"}] and spec["kwargs"] == {}
    assert spec["training"] is True and spec["grad_enabled"] is True
    root = json.loads(specs.set_index("module").loc["InplaceCNN", "call_spec"])
    rng = np.frombuffer(base64.b64decode(root["cpu_rng_state"]), dtype=np.uint8)
    assert np.array_equal(rng, expected_rng.numpy())  # no draw happened before the first call


def test_call_specs_round_trip_nested_calls() -> None:
    from hooktrace.recorder.records.flatten import describe_call, flatten_call, rebuild_call

    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    args = (a, (b, None, 3), [{"k": c}])
    kwargs = {"mask": None, "scale": float("inf"), "mode": "x", "extra": b}
    spec = json.loads(json.dumps(describe_call(args, kwargs)))
    tensors = dict(flatten_call(args, kwargs))
    got_args, got_kwargs = rebuild_call(spec, tensors)
    assert got_args[0] is a and got_args[1][0] is b and got_args[1][1:] == (None, 3)
    assert (
        got_args[2][0]["k"] is c
        and isinstance(got_args[1], tuple)
        and isinstance(got_args[2], list)
    )
    assert (
        got_kwargs["mask"] is None
        and got_kwargs["scale"] == float("inf")
        and got_kwargs["extra"] is b
    )
    with pytest.raises(ValueError, match="type object was not recorded"):
        rebuild_call(describe_call((object(),), {}), {})


def test_the_recorder_keeps_no_reference_to_the_training_tensors(run_dir: Path) -> None:
    """Once summarised, activations and gradients are the training's alone: a recorder that
    held the last few (to summarise a container's output only once) kept 2 MB tensors alive
    past their use and cost the CNN 2.3 ms a step."""
    import gc
    import weakref

    model = make_model("SmallCNN")
    batch = make_batch("SmallCNN", seed=0)
    seen: list[weakref.ref[torch.Tensor]] = []

    def keep_weakly(tensor: torch.Tensor) -> None:
        seen.append(weakref.ref(tensor))

    model_grads: list[weakref.ref[torch.Tensor]] = []

    def on_output(module: nn.Module, args: object, output: torch.Tensor) -> None:
        keep_weakly(output)
        if module is model:  # the gradient at the model's own output
            output.register_hook(lambda grad: model_grads.append(weakref.ref(grad)))
        else:
            output.register_hook(keep_weakly)  # its gradient, when backward computes it

    handles = [m.register_forward_hook(on_output) for m in model.modules()]
    try:
        with hooktrace.record(model, run_dir) as rec:
            loss = default_loss(batch.run(model), batch.target)
            loss.backward()
            del loss
            gc.collect()
            # all but the gradient at the model's output (its last layer's too), which a
            # non-finite capture's re-run of the step would start from, until the step ends
            # (docs/PERFORMANCE.md)
            assert model_grads and model_grads[0]() is not None
            alive = [ref() for ref in seen if ref() is not None]
            alive = [t for t in alive if t is not model_grads[0]()]
            assert len(seen) > 20 and not alive, [tuple(t.shape) for t in alive]
            rec.step()
            gc.collect()
            assert model_grads[0]() is None
    finally:
        for h in handles:
            h.remove()
    assert len(hooktrace.load(run_dir).query(steps=[0])) > 40


class _MixedParameters(nn.Module):
    """Parameters and buffers of several dtypes, one frozen, one too large to stage."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor([2.0**40 + 1.0, -0.5], dtype=torch.float64))
        self.frozen = nn.Parameter(torch.tensor([3.0, 4.0]), requires_grad=False)
        self.big = nn.Parameter(torch.linspace(-1.0, 1.0, 9000))
        self.bn = nn.BatchNorm1d(3)  # an int64 buffer among float32 ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.fc(x)) * self.big[:3]
        return y.double() * self.scale[1] + self.frozen.sum()


@pytest.mark.parametrize("full", [False, True])
def test_parameters_of_every_dtype_keep_their_own_values_and_order(
    run_dir: Path, full: bool
) -> None:
    """Small parameters are staged together, one copy per dtype: each record must still hold
    its own tensor's values, in the order the model lists them (full steps included, where
    those with a full tensor take the hook's own path)."""
    torch.manual_seed(0)
    model = _MixedParameters()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"full_every": 1, "full_modules": "fc"} if full else {}
    # parameters and buffers as the step's first forward finds them, gradients at its end
    values = {("param", name): p.detach().clone() for name, p in model.named_parameters()}
    values |= {("buffer", name): b.clone() for name, b in model.named_buffers()}
    with hooktrace.record(model, run_dir, **options):
        model(torch.randn(5, 4)).sum().backward()
        values |= {
            ("grad_param", name): p.grad.clone()
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        opt.step()
    records = hooktrace.load(run_dir).records
    step = records[records["kind"].isin(["param", "buffer", "grad_param"])]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    parameters, buffers = len(list(model.parameters())), len(list(model.buffers()))
    assert len(step) == parameters + len(trainable) + buffers  # no gradient of the frozen
    for row in step.itertuples():
        name = f"{row.module}.{row.slot}".removeprefix("_MixedParameters.")
        key = (row.kind, name)
        want = values[key].double().numpy()
        assert row.shape == ",".join(map(str, want.shape)), key
        assert row.min == want.min() and row.max == want.max(), key
        np.testing.assert_allclose(row.mean, want.mean(), rtol=1e-6, atol=1e-7, err_msg=str(key))
    assert step.loc[step["slot"] == "scale", "max"].max() == 2.0**40 + 1.0  # kept whole
    for kind in ("param", "grad_param"):  # the model's own order
        names = step.loc[step["kind"] == kind].sort_values("seq")
        listed = [n for n, _ in model.named_parameters()] if kind == "param" else trainable
        assert [f"{m}.{s}".removeprefix("_MixedParameters.") for m, s in
                zip(names["module"], names["slot"], strict=True)] == listed  # fmt: skip


def test_a_record_half_appended_when_the_step_ends_is_left_out(run_dir: Path) -> None:
    """A signal between a hook's two appends leaves a record's metadata without its
    statistics: the step keeps its whole records only, and nothing that points past them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir, params=False, histograms="output") as rec:
        for step in range(2):  # outputs' records come last
            model(torch.randn(5, 4)).sum().backward()
            if step == 1:
                pending = rec._pending
                half = len(pending.meta)
                pending.meta.append(Meta(*pending.meta[-1])._replace(module="half"))
                pending.activity.append((half, np.ones(3, dtype=np.int64)))
                pending.histograms.append((half, pending.histograms[-1][1]))
            opt.step()
            opt.zero_grad()
    trace = hooktrace.load(run_dir)
    records = trace.records
    assert "half" not in set(records["module"].astype(str))
    counts = records.groupby("step").size()
    assert counts[0] == counts[1]
    histograms = trace.histograms().groupby("step").size()
    assert histograms[0] == histograms[1] == 3  # one per output, none for the half record
    assert hooktrace.check(trace).whole


def test_a_tensor_seen_again_after_an_in_place_change_keeps_the_others_remembered(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hooks remember the last few tensors they summarised (a container's output is its
    last child's). A tensor changed in place and seen again is summarised again, and takes
    the newest place: it must not push out another tensor, nor be the next one dropped."""
    from hooktrace.recorder.records import observe as recorder_module

    summarised: list[int] = []
    real = recorder_module.summarize_with_activity

    def counting(tensor: torch.Tensor, dim: int | None, **options: object) -> object:
        summarised.append(id(tensor))
        return real(tensor, dim, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(recorder_module, "summarize_with_activity", counting)
    a, b, c, d, e, f = (torch.randn(9000) for _ in range(6))  # large: summarised in the hook
    with hooktrace.record(nn.Linear(2, 2), run_dir, params=False) as rec:

        def observe(tensor: torch.Tensor) -> None:
            rec._observe("m", 0, "output", "0", tensor, phase="train", full=False, units=False)

        for tensor in (a, b, c, d):
            observe(tensor)
        b.add_(1)
        observe(b)  # a new version: summarised again
        observe(e)
        observe(f)
        assert len(summarised) == 7
        observe(b)  # unchanged since: still remembered
        observe(f)
        assert len(summarised) == 7
        observe(a)  # the oldest, long dropped
        assert len(summarised) == 8
        rec._pending.meta.clear(), rec._pending.stats.clear()


def test_hooks_firing_in_several_threads_at_once_record_every_call(run_dir: Path) -> None:
    """nn.DataParallel's replicas, autograd's device threads and a user's own threads fire
    hooks at once. Each hook's changes to the step (its records, the staging buffer, the
    remembered tensors) are made under the recorder's lock: without it, two threads' copies
    into the staging buffer overlapped and recording stopped."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    calls, threads = 1000, 4

    def work() -> None:
        with torch.no_grad():
            for _ in range(calls):
                model(torch.randn(2, 8))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        with hooktrace.record(model, run_dir, params=False) as rec:
            workers = [threading.Thread(target=work) for _ in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            assert rec.error is None
    finally:
        sys.setswitchinterval(interval)
    records = hooktrace.load(run_dir).records
    assert len(records) == threads * calls * 7  # six layers and the Sequential, every call
    assert (records.groupby("module")["call"].nunique() == threads * calls).all()


class _Doubled(nn.Module):
    """Returns its child's output after doubling it in place: the same tensor, changed."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).mul_(2.0)


def test_a_tensor_returned_by_several_modules_takes_one_gradient_hook(run_dir: Path) -> None:
    """``inner.0``'s output is ``inner``'s output too (a container returns its last child's):
    one hook on the tensor records the gradient under both. The root changes that tensor in
    place before returning it: its gradient differs (the loss is the sum of the doubled
    values, so 1 after the doubling and 2 before it), and takes a hook of its own."""
    model = _Doubled()
    hooks_on_output: list[int] = []

    def count_hooks(module: nn.Module, args: object, output: torch.Tensor) -> None:
        hooks_on_output.append(len(output._backward_hooks or {}))

    with hooktrace.record(model, run_dir, params=False) as rec:
        mine = model.inner.register_forward_hook(count_hooks)  # after hooktrace's hook there
        model(torch.randn(4, 3)).sum().backward()
        mine.remove()
        rec.step()
    assert hooks_on_output == [1]  # for inner.0 and inner; it was one each

    records = hooktrace.load(run_dir).records
    grads = records[records["kind"] == "grad_output"].set_index("module")
    assert list(grads.index) == ["_Doubled", "inner.0", "inner"]  # the order they fired in
    for module, value in (("_Doubled", 1.0), ("inner.0", 2.0), ("inner", 2.0)):
        row = grads.loc[module]
        assert (row["mean"], row["min"], row["max"], row["std"]) == (value, value, value, 0.0)


def test_gradient_hook_handles_stay_bounded_and_live_ones_are_removed(run_dir: Path) -> None:
    """Each step hooks its outputs' gradients. The handles of graphs that are gone are dropped
    at a step's end once 64 are held, not kept for ever; a tensor the user keeps has its hook
    removed at the end."""
    from hooktrace.recorder.hooks.calls import _PRUNE_AT

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with hooktrace.record(model, run_dir, params=False) as rec:
        kept = model(torch.randn(2, 4))  # hooked, and alive to the end
        for _ in range(400):  # 6 hooks a step (the Sequential's output shares the last
            # Linear's): 2,400 handles in all
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            assert len(rec._tensor_handles) <= _PRUNE_AT + 6  # and the graph kept
    assert not kept._backward_hooks
    assert len(hooktrace.load(run_dir).steps) == 400


class _ScaledBetween(nn.Module):
    """A hook of the user's on a child's output, before this module returns it too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.lin(x)
        t.register_hook(lambda g: g * 3.0)
        return t


def test_a_hook_of_the_users_between_two_returns_of_a_tensor_is_seen_by_the_later_one(
    run_dir: Path,
) -> None:
    """Gradient hooks run in the order they were registered: ``lin``'s record comes before
    the user's hook triples the gradient, the root's after it. One hook for both records
    (which a tensor returned twice takes) recorded the root's before the user's hook too."""
    torch.manual_seed(0)
    model = _ScaledBetween()
    with hooktrace.record(model, run_dir, params=False) as rec:
        model(torch.randn(2, 4)).sum().backward()
        rec.step()
    records = hooktrace.load(run_dir).records
    grads = records[records["kind"] == "grad_output"].set_index("module")["mean"]
    assert grads.to_dict() == {"_ScaledBetween": 3.0, "lin": 1.0}


def test_a_filter_that_selects_nothing_is_told_with_the_names_it_could_have_chosen(
    tmp_path: Path,
) -> None:
    """Several models' modules are named ``root.qualname``: the warning shows them so, once
    each (found in review: it showed '0', '0')."""
    enc, dec = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    told = "modules='nope' selects no module of enc, dec (names such as 'enc.0', 'dec.0', 'dec.1')"
    with (
        pytest.warns(RuntimeWarning, match=re.escape(told)),
        hooktrace.record({"enc": enc, "dec": dec}, tmp_path / "run", modules="nope"),
    ):
        pass
