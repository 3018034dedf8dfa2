"""Tensors hooktrace cannot summarise as they are: each costs its own record, never the
recording (observe.Observer._unusual, stats.unsupported)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import hooktrace
from hooktrace.analyze.overview.summary import summary
from hooktrace.trace.check import check

dispatched: list[str] = []


class Wrapper(torch.Tensor):
    """A wrapper subclass (as FakeTensor, DTensor, FunctionalTensor are): its operations run
    its own __torch_dispatch__, which counts them."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> Wrapper:
        made = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        made.elem = elem
        return made  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        dispatched.append(str(func))

        def unwrap(t: Any) -> Any:
            return t.elem if isinstance(t, Wrapper) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)


class Logged(torch.Tensor):
    """A Python subclass whose __torch_function__ sees every attribute read and operation."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


class Odd(nn.Module):
    """One module per kind of tensor, each returning it from its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.fc(x)
        return {
            "wrapped": Wrapper(h.detach()),
            "logged": h.detach().as_subclass(Logged),
            "meta": torch.empty(3, 2, device="meta"),
            "complex": torch.complex(h.detach(), h.detach()),
            "plain": h,
        }


def test_a_watched_subclass_sees_nothing_of_the_recorder(tmp_path: Path) -> None:
    """``watch`` of a script's own tensor subclass: its ``__torch_function__`` sees no
    attribute read of hooktrace's (found in review: ``dtype``, ``is_nested`` and
    ``requires_grad`` were), and the record is made all the same."""
    model = nn.Linear(4, 4)
    with hooktrace.record(model, tmp_path / "run") as rec:
        model(torch.randn(2, 4)).sum().backward()
        rec.step()
        mine = torch.randn(3, 4, requires_grad=True).as_subclass(Logged)
        Logged.seen.clear()
        rec.watch(mine, "mine")
        assert Logged.seen == []
        rec.step()
        assert rec.error is None
    records = hooktrace.load(tmp_path / "run").records
    watched = records[records["module"] == "mine"]
    assert list(watched["kind"]) == ["tensor"] and list(watched["numel"]) == [12]


def test_each_unusual_tensor_costs_its_record_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Odd()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 5)
    with hooktrace.record(model, tmp_path / "run") as rec:
        for _ in range(3):
            dispatched.clear()
            Logged.seen.clear()
            out = model(x)
            out["plain"].sum().backward()
            opt.step()
            opt.zero_grad()
            # what the model's code itself did, and nothing more
            assert dispatched == []
            assert Logged.seen == []
        assert rec.error is None
    records = hooktrace.load(tmp_path / "run").records
    assert sorted(records["step"].unique()) == [0, 1, 2]
    outputs = records[(records["module"] == "Odd") & (records["kind"] == "output")]
    by_slot = {str(r.slot): r for r in outputs[outputs["step"] == 0].itertuples()}
    assert by_slot["wrapped"].note == "skipped: tensor subclass test_unusual_tensors.Wrapper"
    assert by_slot["meta"].note == "skipped: meta tensor (a shape, no values)"
    assert by_slot["meta"].shape == "3,2"
    assert by_slot["complex"].note == "skipped: complex tensor"
    for slot in ("wrapped", "meta", "complex"):
        row = by_slot[slot]
        assert pd_isnan(row.mean) and pd_isnan(row.zero_fraction), slot
        # nothing is known of their values: no count of NaN or Inf says "none"
        assert pd.isna(row.nan_count) and pd.isna(row.inf_count), slot
    # the Python subclass is summarised as the plain tensor it holds; the same values
    assert by_slot["logged"].note == ""
    assert by_slot["logged"].mean == pytest.approx(by_slot["plain"].mean, rel=1e-6)
    assert by_slot["plain"].note == ""

    found = summary(tmp_path / "run").not_summarised
    assert found.to_dict(orient="records") == [
        {"module": "Odd", "kind": "output", "reason": "complex tensor", "records": 3},
        {"module": "Odd", "kind": "output", "reason": "meta tensor (a shape, no values)", "records": 3},
        {
            "module": "Odd",
            "kind": "output",
            "reason": "tensor subclass test_unusual_tensors.Wrapper",
            "records": 3,
        },
    ]  # fmt: skip
    report = check(tmp_path / "run")
    assert report.whole
    assert report.notes == [
        "9 records hold no statistics: complex tensor (3); meta tensor (a shape, no values) (3); "
        "tensor subclass test_unusual_tensors.Wrapper (3)"
    ]


def pd_isnan(value: float) -> bool:
    return value != value


def test_nested_outputs_are_summarised_over_their_values(tmp_path: Path) -> None:
    """TransformerEncoder in eval with a padding mask takes the nested-tensor fast path: its
    layers return nested tensors (this stopped the whole recording before)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    x = torch.randn(3, 5, 16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 2 + [True] * 3])
    seen: list[torch.Tensor] = []
    model.layers[1].register_forward_hook(lambda m, a, out: seen.append(out))
    model.eval()
    with hooktrace.record(model, tmp_path / "run") as rec, torch.no_grad():
        model(x, src_key_padding_mask=mask)
        rec.step()
        assert rec.error is None
    assert seen[0].is_nested  # the fast path was taken
    values = torch.cat([part.reshape(-1) for part in seen[0].unbind()]).double()
    records = hooktrace.load(tmp_path / "run").records
    row = records[(records["module"] == "layers.1") & (records["kind"] == "output")].iloc[0]
    assert row["note"] == "nested: statistics over the values of its 3 components"
    assert row["numel"] == 16 * (5 + 3 + 2)
    assert row["mean"] == pytest.approx(values.mean().item(), abs=1e-6)
    assert row["max"] == pytest.approx(values.max().item(), rel=1e-6)
    assert row["norm"] == pytest.approx(values.norm().item(), rel=1e-5)


def test_a_lazy_module_is_recorded_once_it_has_values(tmp_path: Path) -> None:
    """A lazy module's parameters have no shape before its first call; recording one stopped
    the recording before it started (the module table counted their values)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(8, 3)
    with hooktrace.record(model, tmp_path / "run") as rec:
        for i in range(2):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if i == 1:  # the values the second step's first forward finds
                expected = model[0].weight.detach().double().clone()
            model(x).sum().backward()
            opt.step()
        assert rec.error is None
    records = hooktrace.load(tmp_path / "run").records
    params = records[(records["module"] == "0") & (records["kind"] == "param")]
    first, second = params[params["step"] == 0], params[params["step"] == 1]
    assert set(first["note"]) == {"skipped: uninitialized (a lazy module's, before its first call)"}
    assert set(second["note"]) == {""}
    assert sorted(second["shape"]) == ["4", "4,3"]
    weight = second[second["shape"] == "4,3"].iloc[0]
    assert weight["mean"] == pytest.approx(expected.mean().item(), rel=1e-6)
    assert weight["max"] == pytest.approx(expected.max().item(), rel=1e-6)
