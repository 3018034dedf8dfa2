"""What float16 and bfloat16 could not hold of each recorded tensor: :func:`precision`, and the
``fp16_underflow`` / ``fp16_overflow`` findings of :func:`hooktrace.anomalies`. Never imports
torch.

Read from the histograms' fixed exponent bins (docs/FORMAT.md, "histograms"): every bound
below is a power of two and so a bin boundary, and the counts are exact, not estimated. Each
fraction is of a tensor's nonzero finite values (a zero is held exactly by every format; NaN
and Inf are already the non-finite checks' business):

    format     underflow        subnormal                overflow
    float16    |x| < 2^-24      2^-24 <= |x| < 2^-14     |x| >= 2^16
    bfloat16   |x| < 2^-133     2^-133 <= |x| < 2^-126   |x| >= 2^128

- underflow: below the format's smallest subnormal. Cast to the format, such a value becomes
  zero (at or below half of it: 2^-25 in float16) or that smallest subnormal itself: nothing
  of it survives. NVIDIA's mixed-precision guide draws the line at 2^-24 too. Gradients
  there are what loss scaling (``torch.amp.GradScaler``) saves.
- subnormal: kept, with fewer significant bits (float16: 10 at 2^-15, 1 at 2^-24, against 11
  for its normal values): the value survives, its precision does not.
- overflow: past the format's largest binade, so Inf once cast. float16's largest finite
  value is 65504, and values from 65520 up round to Inf too, which the bins (counting from
  65536) cannot tell apart; likewise float32 values from (2 - 2^-8) * 2^127 up round to
  Inf in bfloat16. bfloat16 shares float32's exponent range, so only float64 values reach
  its overflow, and only float32 subnormals (or float64 values) its underflow.

Everything is computed in DuckDB over the ``rank_histogram_spans`` view of :meth:`Trace.sql` (the
spans as stored), grouped there: what comes back is one row per tensor (module, kind, slot) or per module and kind, so
memory stays bounded whatever the trace's size.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import pandas as pd

from hooktrace.analyze.findings import Finding, StepsSpec, module_pattern, step_filter
from hooktrace.errors import ConfigError, TraceError
from hooktrace.trace.histograms import HISTOGRAMS_DIR, MAGNITUDE_BINS, bin_of_exponent
from hooktrace.trace.reader import Trace, load
from hooktrace.trace.sql import logical_spans


@dataclass(frozen=True)
class Format:
    """A floating-point format by the powers of two that bound it."""

    name: str  # the prefix of its columns: fp16, bf16
    smallest_subnormal: int  # 2^this is the smallest value above zero
    smallest_normal: int
    overflow: int  # 2^this and above is beyond its largest finite value: Inf

    def bins(self, measure: str) -> tuple[int, int]:
        """The magnitude bins ``[first, end)`` that ``measure`` counts."""
        if measure == "underflow":
            return 0, bin_of_exponent(self.smallest_subnormal)
        if measure == "subnormal":
            return bin_of_exponent(self.smallest_subnormal), bin_of_exponent(self.smallest_normal)
        return bin_of_exponent(self.overflow), MAGNITUDE_BINS


FP16: Final = Format("fp16", -24, -14, 16)
BF16: Final = Format("bf16", -133, -126, 128)
FORMATS: Final = (FP16, BF16)
MEASURES: Final = ("underflow", "subnormal", "overflow")
FRACTIONS: Final = tuple(f"{f.name}_{m}" for f in FORMATS for m in MEASURES)
"""The fraction columns of :func:`precision`: fp16_underflow, ..., bf16_overflow."""

COLUMNS: Final = (
    "rank", "module", "kind", "slot", "steps", "first_step", "last_step", "numel", "nonzero",
    *FRACTIONS, "worst_step", "worst_fraction",
)  # fmt: skip

NO_HISTOGRAMS: Final = (
    "no histograms recorded, so no low-precision check was made: record with --histograms "
    "param,grad_param to see what float16 would flush to zero or make Inf"
)
"""The note of :func:`hooktrace.anomalies` on a trace without histograms."""

GRADIENT_KINDS: Final = ("grad_output", "grad_param", "grad_tensor")
"""The kinds whose float16 underflow is a finding: a gradient lost is a weight not trained."""
WARN_UNDERFLOW: Final = 0.1
"""Underflow findings are warnings from this fraction at their worst step, info below it."""


def precision(
    run: str | os.PathLike[str] | Trace,
    *,
    steps: StepsSpec = None,
    modules: str | Iterable[str] | None = None,
    kinds: Iterable[str] | None = None,
    per_rank: bool = False,
) -> pd.DataFrame:
    """Per recorded tensor (rank, module, kind, slot), over the histograms of the steps read:
    the fractions of its nonzero finite values that float16 and bfloat16 would underflow,
    hold as subnormals and overflow (the module docstring defines each), pooled over steps
    (all the counts, then one division), and the step at which float16 could hold least of
    it (``worst_step``, the earliest of equals, null where it loses nothing at any step;
    ``worst_fraction``: what it underflowed plus overflowed there). Worst first.

    ``steps`` is ``"0-100"``, ``(first, last)`` or step numbers; ``modules`` a regex
    searched in module names or a list of exact names; ``kinds`` names. A run of several
    ranks is answered per logical tensor (its parts' histograms summed, a replica once, under
    the lowest rank behind it: :func:`hooktrace.trace.sql.logical_spans`;
    ``frame.attrs["logical"]`` says so); ``per_rank=True``: per rank. Raises
    :class:`TraceError` when the run has no histograms, as :meth:`Trace.histograms` does."""
    trace = run if isinstance(run, Trace) else load(run)
    if not trace.has_histograms:
        raise TraceError(
            f"{trace.path} holds no histograms: record with `hooktrace record --histograms "
            "param,grad_param` (or hooktrace.record(..., histograms=('param', 'grad_param')))"
        )
    names = _module_names(trace, modules) if isinstance(modules, str) else modules
    logical = not per_rank and trace.logical_by_default()
    (table,) = _query(trace, [SLOT_KEYS], steps, names, kinds, logical=logical)
    trouble = table["fp16_underflow"] + table["fp16_overflow"]
    order = table.assign(_t=-trouble).sort_values(
        ["rank", "_t", "module", "kind", "slot"], kind="stable"
    )
    out = order[list(COLUMNS)].reset_index(drop=True)
    out.attrs["logical"] = logical
    return out


def _module_names(trace: Trace, pattern: str) -> list[str]:
    compiled = module_pattern(pattern)
    names: list[str] = sorted(set(trace.modules["module"].astype(str)))
    return [name for name in names if compiled.search(name)]


# --- the findings -----------------------------------------------------------------------------


def findings(
    trace: Trace,
    *,
    steps: StepsSpec,
    underflow_above: float,
    overflow_above: float,
    logical: bool = False,
) -> tuple[list[Finding], list[str]]:
    """``fp16_underflow`` findings for gradients and ``fp16_overflow`` findings for every kind,
    per rank, module and kind (its slots together), with notes on what could not be checked.
    An activation or activation gradient with the same counts at every step as one recorded
    before it is the same tensor (a container's output, a skip connection's gradient), and
    is reported once, as ``activation_spike`` does.

    A step counts when more than ``underflow_above`` (``overflow_above``) of the module's
    nonzero values of that kind underflow (overflow) in float16 at that step. value: the
    fraction at the worst such step; reference: the bound; step, last_step: the first and
    last step that counted; count: the steps that counted. ``logical``: of the logical
    tensors of a run of several ranks (:func:`precision`'s)."""
    check_bounds(underflow_above, overflow_above)
    if not trace.has_histograms:
        if trace.damaged(HISTOGRAMS_DIR):  # written, and damaged: not "record them"
            return [], [f"no low-precision check was made: {trace.no_histograms_because}"]
        return [], [NO_HISTOGRAMS]
    bounds = {"underflow": underflow_above, "overflow": overflow_above}
    table, per_slot = _query(
        trace, [MODULE_KEYS, SLOT_KEYS], steps, None, None, bounds, logical=logical
    )
    if table.empty:
        return [], ["no histograms in the steps read: no low-precision check was made"]
    found: list[Finding] = []
    slots = _slots(per_slot, bounds)
    seen: set[tuple[Any, ...]] = set()
    for row in table.sort_values(["rank", "seq"], kind="stable").to_dict("records"):
        if row["kind"] not in ("param", "grad_param"):
            # an activation or its gradient equal to one recorded before it (a container's
            # output is its last child's; a skip connection passes its gradient on as it is)
            key = (row["rank"], row["kind"], row["digest"])
            if key in seen:
                continue
            seen.add(key)
        if row["kind"] in GRADIENT_KINDS and row["underflow_steps"] > 0:
            found.append(_underflow(row, slots, underflow_above))
        if row["overflow_steps"] > 0:
            found.append(_overflow(row, slots, overflow_above))
    notes = []
    if not table["kind"].isin(GRADIENT_KINDS).any():
        kinds = ", ".join(sorted(set(table["kind"])))
        notes.append(
            f"histograms recorded of {kinds} only: float16 underflow of gradients not checked "
            "(record with --histograms grad_param)"
        )
    return found, notes


def check_bounds(underflow_above: float, overflow_above: float) -> None:
    """Raise ConfigError unless both bounds are fractions, 0 <= bound < 1."""
    for name, bound in (("underflow_above", underflow_above), ("overflow_above", overflow_above)):
        if not 0 <= bound < 1:
            raise ConfigError(f"{name} is a fraction of values: need 0 <= it < 1 (got {bound})")


def _underflow(
    row: dict[Any, Any], slots: dict[tuple[Any, ...], list[str]], bound: float
) -> Finding:
    worst, at, n = row["underflow_worst"], row["underflow_worst_step"], row["underflow_steps"]
    where = _slots_text(row, slots, "underflow")
    bf16 = row["bf16_underflow"]
    remedy = (
        "scale the loss (torch.amp.GradScaler), or train in bfloat16, which keeps float32's range"
        if bf16 <= bound
        else "scale the loss (torch.amp.GradScaler): bfloat16 would lose them too"
    )
    return Finding(
        "fp16_underflow", "warning" if worst >= WARN_UNDERFLOW else "info", row["module"],
        int(row["underflow_first"]), rank=int(row["rank"]), slot=where,
        last_step=int(row["underflow_last"]), value=float(worst), reference=bound, count=int(n),
        evidence=f"{row['kind']} {where}: {percent(worst)} of the nonzero values below 2^-24 "
        f"at step {at}, the worst; {_above(bound)} at {n} of {row['steps']} step(s); "
        f"{percent(row['fp16_underflow'])} over all {row['steps']}; below bfloat16's 2^-133: "
        f"{percent(bf16)}",
        explanation="float16 flushes values below 2^-24 to zero: in float16 (autocast) these "
        f"gradients would be lost without loss scaling; {remedy}",
    )  # fmt: skip


def _overflow(
    row: dict[Any, Any], slots: dict[tuple[Any, ...], list[str]], bound: float
) -> Finding:
    worst, at, n = row["overflow_worst"], row["overflow_worst_step"], row["overflow_steps"]
    where = _slots_text(row, slots, "overflow")
    gradient = row["kind"] in GRADIENT_KINDS
    remedy = (
        "lower the loss scale, or train in bfloat16, which keeps float32's range"
        if gradient
        else "keep this module in float32 (autocast does so for some operations), normalise "
        "its input, or train in bfloat16, which keeps float32's range"
    )
    return Finding(
        "fp16_overflow", "warning", row["module"], int(row["overflow_first"]),
        rank=int(row["rank"]), slot=where, last_step=int(row["overflow_last"]), value=float(worst),
        reference=bound, count=int(n),
        evidence=f"{row['kind']} {where}: {percent(worst)} of the nonzero values 2^16 or more "
        f"at step {at}, the worst; {_above(bound)} at {n} of {row['steps']} step(s)",
        explanation="float16's largest value is 65504: in float16 these values would be Inf, "
        f"and what is computed from them Inf or NaN; {remedy}",
    )  # fmt: skip


def _slots(table: pd.DataFrame, bounds: dict[str, float]) -> dict[tuple[Any, ...], list[str]]:
    """(rank, module, kind, measure) -> the slots with a step above the bound, by name."""
    found: dict[tuple[Any, ...], list[str]] = {}
    for row in table.sort_values("slot").to_dict("records"):
        for measure in bounds:
            if row[f"{measure}_steps"] > 0:
                key = (row["rank"], row["module"], row["kind"], measure)
                found.setdefault(key, []).append(str(row["slot"]))
    return found


def _slots_text(row: dict[Any, Any], slots: dict[tuple[Any, ...], list[str]], measure: str) -> str:
    """The slots that had a step above the bound on their own; where none did (the module's
    slots only together), every slot."""
    chosen = slots.get((row["rank"], row["module"], row["kind"], measure))
    return ", ".join(chosen) if chosen else "all slots"


def _above(bound: float) -> str:
    return f"over {percent(bound)}" if bound else "some"


def percent(fraction: float) -> str:
    """0%, <0.01%, 1.23%, 37.5%, 100%: three digits, and never 0% or 100% when not exact."""
    value = fraction * 100
    if fraction in (0, 1):
        return f"{value:.0f}%"
    if value < 0.01:
        return "<0.01%"
    return f"{value:.3g}%" if value < 10 else f"{min(value, 99.9):.1f}%"


# --- the query --------------------------------------------------------------------------------

SLOT_KEYS: Final = ("rank", "module", "kind", "slot")
MODULE_KEYS: Final = ("rank", "module", "kind")


def _count(fmt: Format, measure: str) -> str:
    """SQL: how many of a histogram's nonzero finite values ``measure`` counts in ``fmt``, from
    the stored spans (``bins_sum`` of :mod:`hooktrace.trace.sql`: a few dozen counts a row,
    where whole rows are 279)."""
    first, end = fmt.bins(measure)
    return f"bins_sum(pos_start, pos, {first}, {end}) + bins_sum(neg_start, neg, {first}, {end})"


def _query(
    trace: Trace,
    groupings: Sequence[Sequence[str]],
    steps: StepsSpec,
    modules: Iterable[str] | None,
    kinds: Iterable[str] | None,
    bounds: dict[str, float] | None = None,
    *,
    logical: bool = False,
) -> list[pd.DataFrame]:
    """For each of ``groupings`` (:data:`SLOT_KEYS` or :data:`MODULE_KEYS`), one row per
    group: its first ``seq`` (where it comes in execution order), the pooled fractions, the
    worst step of float16, and, with ``bounds``, per float16 measure: the steps above its
    bound (``<measure>_steps``, first, last) and the worst of them (``<measure>_worst``,
    ``<measure>_worst_step``). A step's counts are the sums over the group's histograms at
    that step (slots, calls, micro-steps). One scan of the histograms, whatever the
    groupings: their bins are summed per tensor and step once, and grouped from there.
    ``logical``: the logical tensors' histograms (:func:`logical_spans`) for the ranks'."""
    where, parameters = _where(steps, modules, kinds)
    source = (
        f"{logical_spans(where, trace.layout)} AS spans_"
        if logical
        else f"rank_histogram_spans {where}"
    )
    measures = [f"{f.name}_{m}" for f in FORMATS for m in MEASURES]
    counts = ", ".join(f"sum({_count(f, m)}) AS {f.name}_{m}" for f in FORMATS for m in MEASURES)
    slot_steps = f"""
        per_slot_step AS MATERIALIZED (
            SELECT rank, module, kind, slot, step, min(seq) AS seq, sum(numel) AS numel,
                sum(numel - zero - nan - pos_inf - neg_inf) AS nonzero, {counts},
                bit_xor(hash(pos_start, pos, neg_start, neg, zero, nan, pos_inf, neg_inf))
                    AS bins
            FROM (
                -- a parameter or buffer recorded twice in a step (an evaluation's forward,
                -- then training's) counts once: its last record, as hist has it
                SELECT * FROM {source}
                QUALIFY kind NOT IN ('param', 'buffer')
                    OR seq = max(seq) OVER (PARTITION BY rank, module, kind, slot, step)
            )
            GROUP BY rank, module, kind, slot, step
        )"""
    selects = []
    for i, by in enumerate(groupings):
        keys = ", ".join(by)
        source = "per_slot_step"
        if "slot" not in by:
            sums = ", ".join(f"sum({c}) AS {c}" for c in ["numel", "nonzero", *measures])
            sums += ", bit_xor(bins) AS bins"
            source = (
                f"(SELECT {keys}, step, min(seq) AS seq, {sums} FROM per_slot_step "
                f"GROUP BY {keys}, step)"
            )
        slot = "slot" if "slot" in by else "CAST(NULL AS VARCHAR) AS slot"
        selects.append(
            f"SELECT {i} AS grouping, rank, module, kind, {slot}, {_aggregates(bounds)} "
            f"FROM {source} GROUP BY {keys}"
        )
    sql = f"WITH {slot_steps}\n" + "\nUNION ALL\n".join(selects) + "\nORDER BY ALL"
    frame = trace.sql(sql, parameters)
    frame["worst_step"] = frame["worst_step"].astype("Int64")
    for name in ("module", "kind", "slot"):
        frame[name] = frame[name].astype(str)
    return [
        frame[frame["grouping"] == i].drop(columns="grouping").reset_index(drop=True)
        for i in range(len(groupings))
    ]


def _aggregates(bounds: dict[str, float] | None) -> str:
    """SQL: what :func:`_query` gives of a group, from its rows, one a step."""
    pooled = ", ".join(
        f"coalesce(sum({c}) / nullif(sum(nonzero), 0), 0.0) AS {c}" for c in FRACTIONS
    )
    trouble = "coalesce((fp16_underflow + fp16_overflow) / nullif(nonzero, 0), 0.0)"
    found = [
        "min(seq) AS seq, count(*) AS steps, min(step) AS first_step, max(step) AS last_step",
        # the same histograms, bin for bin, at the same steps: the same tensor, recorded
        # under two modules (equal shares alone also matched two layers that overflow whole)
        "bit_xor(hash(step, bins)) AS digest",
        "CAST(sum(numel) AS BIGINT) AS numel, CAST(sum(nonzero) AS BIGINT) AS nonzero",
        pooled,
        f"CASE WHEN max({trouble}) > 0 THEN arg_max(step, ({trouble}, -step)) END AS worst_step",
        f"max({trouble}) AS worst_fraction",
    ]
    for measure, bound in (bounds or {}).items():
        column = f"fp16_{measure}"
        fraction = f"coalesce({column} / nullif(nonzero, 0), 0.0)"
        hit = f"{column} > {float(bound)!r} * nonzero"
        found += [
            f"count(*) FILTER (WHERE {hit}) AS {measure}_steps",
            f"min(step) FILTER (WHERE {hit}) AS {measure}_first",
            f"max(step) FILTER (WHERE {hit}) AS {measure}_last",
            f"max({fraction}) AS {measure}_worst",
            f"arg_max(step, ({fraction}, -step)) AS {measure}_worst_step",
        ]
    return ", ".join(found)


def _where(
    steps: StepsSpec, modules: Iterable[str] | None, kinds: Iterable[str] | None
) -> tuple[str, list[Any]]:
    conditions: list[str] = []
    parameters: list[Any] = []
    chosen = step_filter(steps)
    if isinstance(chosen, tuple):
        conditions.append("step BETWEEN ? AND ?")
        parameters += [chosen[0], chosen[1]]
    elif chosen is not None:
        conditions.append("list_contains(?::BIGINT[], step)")
        parameters.append(chosen)
    for column, values in (("module", modules), ("kind", kinds)):
        if values is not None:
            conditions.append(f"list_contains(?::VARCHAR[], {column})")
            parameters.append([str(v) for v in values])
    return ("WHERE " + " AND ".join(conditions) if conditions else ""), parameters
