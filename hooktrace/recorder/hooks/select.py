"""Which modules, steps and kinds to record: each filter type normalised in one place."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Collection, Iterable, Mapping

import numpy as np

from hooktrace.errors import ConfigError
from hooktrace.trace import schema

ModuleFilter = str | Iterable[str] | Callable[[str], bool] | None
"""A regex (searched in the name), a list of exact names, or a predicate on the name."""

StepSpec = str | Iterable[int | range | tuple[int, int]] | None
"""``"0-10,20,100-"``, or ints, ranges and inclusive ``(first, last)`` pairs."""

FLAGS = ("inputs", "params", "strict", "overwrite", "capture_nonfinite")
"""The options that are True or False."""

SIZES = ("max_tensor_mb", "max_units", "buffer_mb", "capture_limit", "capture_max_mb")
"""The options that are a number, 0 or more."""


def check_options(options: Mapping[str, object]) -> None:
    """Refuse a flag or a size (:data:`FLAGS`, :data:`SIZES`) of the wrong kind at once: a
    string where a flag goes reads as true (``inputs="no"`` recorded the inputs), and a
    negative size as nothing at all. numpy's numbers and booleans are numbers and flags."""
    for name in FLAGS:
        value = options.get(name, False)
        flag = isinstance(value, numbers.Integral | np.bool_)
        if not flag or value not in (0, 1):
            raise ConfigError(f"{name} is True or False (true or false in TOML; got {value!r})")
    for name in SIZES:
        value = options.get(name, 0)
        if (
            not isinstance(value, numbers.Real)
            or isinstance(value, bool | np.bool_)
            or not 0 <= float(value) < math.inf  # (NaN too)
        ):
            raise ConfigError(f"{name} must be a finite number, 0 or more (got {value!r})")


def module_matcher(spec: ModuleFilter, *, default: bool) -> Callable[[str], bool]:
    """Turn any filter form into a predicate on the module name."""
    if spec is None:
        return lambda name: default
    if isinstance(spec, str):
        pattern = _compile(spec)
        return lambda name: pattern.search(name) is not None
    if callable(spec):
        return spec
    names = list(spec)
    if all(isinstance(n, str) for n in names):
        patterns = [_compile(n) for n in names if _is_regex(n)]
        exact = {n for n in names if not _is_regex(n)}
        return lambda name: name in exact or any(p.search(name) for p in patterns)
    raise ConfigError(
        "a module filter is a regex, a list of names or regexes, or a function of the name"
    )


def _is_regex(text: str) -> bool:
    return any(c in text for c in "^$*+?[](){}|\\")


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ConfigError(
            f"bad module pattern {pattern!r}: {exc}; write a Python regex such as 'blocks\\.0'"
        ) from exc


class StepSelection:
    """A set of step numbers, possibly open-ended, with an ``every`` stride on top."""

    def __init__(self, spec: StepSpec = None, *, every: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"every must be a whole number of steps, 1 or more (got {every!r})")
        self.every = every
        self.ranges: list[tuple[int, float]] | None = None if spec is None else parse_steps(spec)

    def __contains__(self, step: int) -> bool:
        if step % self.every:
            return False
        if self.ranges is None:
            return True
        return any(lo <= step <= hi for lo, hi in self.ranges)

    def __repr__(self) -> str:
        return f"StepSelection({self.ranges!r}, every={self.every})"


def _integer(value: object) -> bool:
    """Whether ``value`` is a step number: an integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def parse_steps(spec: StepSpec) -> list[tuple[int, float]]:
    """Inclusive (first, last) ranges; ``last`` is infinity for open ranges like ``"100-"``."""
    if spec is None:
        return [(0, float("inf"))]
    if isinstance(spec, str):
        return [_parse_range(part.strip()) for part in spec.split(",") if part.strip()]
    n = int(spec) if isinstance(spec, numbers.Integral) and not isinstance(spec, bool) else 0
    if n > 0:  # "steps=5": step 5, or the first five? Ask.
        raise ConfigError(
            f"bad steps {n}: give [{n}] for step {n} alone, or range({n}) or '0-{n - 1}' "
            f"for the first {n} steps"
        )
    if not isinstance(spec, Iterable):
        raise ConfigError(
            f"bad steps {spec!r}: give step numbers such as [5], range(10) or '0-9,20'"
        )
    ranges: list[tuple[int, float]] = []
    for item in spec:
        if isinstance(item, bool):
            raise ConfigError(f"bad step {item!r}: give step numbers such as 5 or '0-10'")
        if isinstance(item, numbers.Integral):  # numpy's too
            ranges.append((int(item), int(item)))
        elif isinstance(item, range):
            if item.step != 1:
                ranges.extend((s, s) for s in item)
            elif len(item):
                ranges.append((item.start, item.stop - 1))
        elif isinstance(item, tuple) and len(item) == 2 and all(_integer(v) for v in item):
            ranges.append((int(item[0]), int(item[1])))
        elif isinstance(item, str):
            ranges.append(_parse_range(item))
        else:
            raise ConfigError(
                f"bad step {item!r}: give ints, ranges, (first, last) pairs or '0-10,20'"
            )
    for lo, hi in ranges:
        if lo < 0 or hi < lo:
            shown = f"step {lo}" if lo == hi else f"step range ({lo}, {hi})"
            raise ConfigError(f"bad {shown}: steps count from 0 and a range goes upwards")
    return ranges


def _parse_range(text: str) -> tuple[int, float]:
    first, dash, last = text.partition("-")
    try:
        lo = int(first)
        hi: float = (float("inf") if not last.strip() else int(last)) if dash else lo
    except ValueError:
        raise ConfigError(
            f"bad step range {text!r}: write steps as '5', '0-10' or '100-'"
        ) from None
    if lo < 0 or hi < lo:
        raise ConfigError(f"bad step range {text!r}: steps count from 0 and a range goes upwards")
    return lo, hi


def histogram_kinds(kinds: Collection[str] | str | None) -> frozenset[str]:
    """The kinds to histogram, checked: a collection of record kinds, or one comma-separated
    string of them; None, "" or "none" for none."""
    if kinds is None:
        return frozenset()
    if isinstance(kinds, str):
        kinds = [] if kinds.strip() in ("", "none") else kinds.split(",")
    if not isinstance(kinds, Iterable) or not all(isinstance(k, str) for k in kinds):
        raise ConfigError(
            f"histograms takes record kinds, such as ['param', 'grad_param'] or "
            f"'param,grad_param', or none (got {kinds!r})"
        )
    chosen = frozenset(k.strip() for k in kinds if k.strip())
    unknown = chosen - set(schema.KINDS)
    if unknown:
        raise ConfigError(
            f"unknown kind(s) to histogram: {', '.join(sorted(unknown))}; choose from "
            f"{', '.join(schema.KINDS)}, or none"
        )
    return chosen


class Sampling:
    """What each step records: whether it is recorded at all, whether its chosen modules'
    tensors are saved whole (a full step), and which kinds take a histogram."""

    def __init__(
        self,
        *,
        every: int,
        steps: StepSpec,
        full_every: int | None,
        full_steps: StepSpec,
        full_modules: ModuleFilter,
        histograms: Collection[str] | None,
        histogram_every: int,
    ) -> None:
        self.steps = StepSelection(steps, every=every)
        self.histogram_kinds = histogram_kinds(histograms)
        if histogram_every < 1:
            raise ConfigError(f"histogram_every must be 1 or more (got {histogram_every})")
        self.histogram_every = histogram_every
        full_wanted = full_every is not None or full_steps is not None or full_modules is not None
        self.full_steps = StepSelection(full_steps, every=full_every or 1) if full_wanted else None

    def recorded(self, step: int) -> bool:
        return step in self.steps

    def full(self, step: int) -> bool:
        return self.full_steps is not None and step in self.full_steps

    def histograms(self, step: int) -> frozenset[str]:
        return self.histogram_kinds if step % self.histogram_every == 0 else frozenset()
