"""What the checks report: :class:`Finding`, its table, and the step filter they share.

A finding is one thing worth a look: a kind (``nonfinite_forward``, ``exploding_gradient``,
``dead_layer``, ...), a severity, the module and the step, the evidence as numbers and as a
sentence, and a one-line explanation. Severities:

- ``error``: training is broken: a NaN or Inf was produced, gradients explode, the ranks'
  replicas of a parameter came apart;
- ``warning``: training is likely hurt: a dead layer, vanishing gradients, a gradient or
  activation spike, a parameter that never gets a gradient; or would be, in float16: values
  it would make Inf, a tenth or more of a gradient it would flush to zero;
- ``info``: worth knowing, often intended: gradients exactly zero, saturated tanh/sigmoid,
  less of a gradient that float16 would flush to zero.

Tables of findings come worst first: by severity, then grouped by kind (in the order of
:data:`KIND_ORDER`), then earliest step first. Never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any, Final

import numpy as np
import pandas as pd

from hooktrace.errors import ConfigError
from hooktrace.trace.filters import step_pair
from hooktrace.trace.reader import Trace

SEVERITIES: Final = ("error", "warning", "info")

KIND_ORDER: Final = (
    "nonfinite_forward",
    "nonfinite_backward",
    "nonfinite_param",
    "exploding_gradient",
    "replicas_differ",
    "dead_layer",
    "vanishing_gradient",
    "no_gradient",
    "gradient_spike",
    "activation_spike",
    "zero_gradient",
    "saturated",
    "fp16_overflow",
    "fp16_underflow",
)

COLUMNS: Final = (
    "kind",
    "severity",
    "module",
    "slot",
    "rank",
    "step",
    "last_step",
    "micro_step",
    "value",
    "reference",
    "count",
    "evidence",
    "explanation",
)


@dataclass(frozen=True)
class Finding:
    """One finding; ``value`` is what was seen, ``reference`` what it was held against (a
    baseline or a bound), ``count`` how many steps or records it covers (see each kind)."""

    kind: str
    severity: str
    module: str
    step: int
    evidence: str
    explanation: str
    slot: str = ""
    rank: int = 0
    last_step: int | None = None
    micro_step: int | None = None
    value: float = float("nan")
    reference: float = float("nan")
    count: int = 1


def findings_frame(findings: Iterable[Finding]) -> pd.DataFrame:
    """A DataFrame of ``findings`` with :data:`COLUMNS`, worst first."""
    rows = [asdict(f) for f in findings]
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    frame["last_step"] = frame["last_step"].fillna(frame["step"])
    for name in ("rank", "step", "last_step", "count"):
        frame[name] = frame[name].astype("int64")
    frame["micro_step"] = frame["micro_step"].astype("Int64")
    for name in ("value", "reference"):
        frame[name] = frame[name].astype("float64")
    for name in ("kind", "severity", "module", "slot", "evidence", "explanation"):
        frame[name] = frame[name].astype(str)
    severity = frame["severity"].map({s: i for i, s in enumerate(SEVERITIES)})
    kind = frame["kind"].map({k: i for i, k in enumerate(KIND_ORDER)}).fillna(len(KIND_ORDER))
    order = pd.DataFrame({"s": severity, "k": kind, "step": frame["step"], "r": frame["rank"]})
    order = order.sort_values(["s", "k", "step", "r"], kind="stable")
    return frame.loc[order.index].reset_index(drop=True)


StepsSpec = str | tuple[int, int] | Iterable[int] | None
"""``"0-100"``, ``"50"`` or ``"100-"`` (to the end), an inclusive ``(first, last)`` pair, or
step numbers."""


def step_filter(spec: StepsSpec) -> tuple[int, int] | list[int] | None:
    """``spec`` as :meth:`Trace.query` takes it; raises ConfigError on a bad spec."""
    if spec is None:
        return None
    if isinstance(spec, str):
        first, dash, last = spec.strip().partition("-")
        try:
            lo = int(first)
            hi = (int(last) if last.strip() else 2**62) if dash else lo
        except ValueError:
            raise ConfigError(
                f"bad steps {spec!r}: write a step or an inclusive range: '5', '0-100' or '100-'"
            ) from None
        return _checked((lo, hi))
    pair = step_pair(spec)
    if pair is not None:
        return _checked(pair)
    steps = list(spec)
    if not all(isinstance(s, int | np.integer) and not isinstance(s, bool) for s in steps):
        raise ConfigError("steps must be step numbers, a (first, last) pair or a string '0-100'")
    return [int(s) for s in steps]


def step_chunks(
    trace: Trace, steps: tuple[int, int] | list[int] | None, rows: int
) -> Iterator[tuple[int, int] | list[int]]:
    """Step selections (as :func:`step_filter` gives them) of about ``rows`` records each,
    whole steps, in step order, covering every step ``steps`` selects.

    The plan comes from the steps table (records per step); the ranges between planned
    boundaries are open, so a step that the steps table lacks is still read."""
    lo, hi = steps if isinstance(steps, tuple) else (0, 2**62)
    table = trace.steps
    per_step = (
        table.groupby("step")["records"].sum() if not table.empty else pd.Series(dtype="int64")
    )
    per_step = per_step[(per_step.index >= lo) & (per_step.index <= hi)]
    if isinstance(steps, list):
        per_step = per_step[per_step.index.isin(steps)]
    group = (per_step.cumsum().to_numpy() - 1) // max(rows, 1)
    new_group = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if len(group) else group
    starts = per_step.index.to_numpy()[new_group]
    bounds = [lo, *(int(s) for s in starts[1:]), hi + 1]
    for first, end in pairwise(bounds):
        if isinstance(steps, list):
            chosen = sorted(s for s in set(steps) if first <= s < end)
            if chosen:
                yield chosen
        else:
            yield first, end - 1


def _checked(pair: tuple[int, int]) -> tuple[int, int]:
    lo, hi = pair
    if lo < 0 or hi < lo:
        raise ConfigError(f"bad step range {lo}-{hi}: steps count from 0 and a range goes upwards")
    return pair


def module_pattern(text: str) -> re.Pattern[str]:
    """``--modules REGEX``, compiled; a bad one is a ConfigError that says how to write it."""
    try:
        return re.compile(text)
    except re.error as exc:
        raise ConfigError(
            f"bad module pattern {text!r}: {exc}; write a Python regex such as 'blocks\\.0'"
        ) from None


def type_name(qualified: str) -> str:
    """``torch.nn.modules.activation.ReLU`` -> ``ReLU``: what family checks match on."""
    return qualified.rpartition(".")[2]


def modules_of_type(modules: pd.DataFrame, names: Sequence[str]) -> dict[str, str]:
    """Module name -> class name, for the modules whose class name is one of ``names``."""
    if modules.empty:
        return {}
    short = modules["type"].astype(str).map(type_name)
    chosen = modules[short.isin(list(names))]
    return dict(zip(chosen["module"].astype(str), short[chosen.index], strict=True))


def fmt(value: float) -> str:
    """A number for evidence: 3 significant digits, NaN and Inf spelled out."""
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Inf" if value > 0 else "-Inf"
    return f"{value:.3g}"


def keys(key: Hashable) -> tuple[Any, ...]:
    """A pandas group key as a tuple (pandas types it as Hashable)."""
    return key if isinstance(key, tuple) else (key,)


def strings(column: pd.Series) -> np.ndarray:
    """A column as an object array of str; a categorical's names are converted only once."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        names = np.array([str(c) for c in column.cat.categories], dtype=object)
        return names[column.cat.codes.to_numpy()]
    return column.astype(str).to_numpy(dtype=object)


def codes(column: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """A string column as integer codes (int64) and the names (str) they index."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        names = np.array([str(c) for c in column.cat.categories], dtype=object)
        return column.cat.codes.to_numpy().astype(np.int64), names
    found, uniques = pd.factorize(strings(column))
    return found.astype(np.int64), np.asarray(uniques, dtype=object)
