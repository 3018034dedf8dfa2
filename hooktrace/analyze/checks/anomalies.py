"""Gradient and numeric anomalies: :func:`anomalies`. Never imports torch.

Statistics are enough (no full tensors). DuckDB queries over the records
(:mod:`hooktrace.analyze.checks.anomaly_scan`: only the columns needed, on every core, spilling to
disk past its memory limit) reduce them to one number per module per step (the gradient and
activation norms the series checks need, modules as integer ids, read back sorted a few
modules at a time), per-module tallies, and the steps that hold a NaN or an Inf: only those
are read in full, by hooktrace's reader, for the non-finite origins. Where DuckDB cannot
read a part, the same queries run over the reader's chunks of whole steps instead.

The checks, and what each finding's numbers mean (``value`` / ``reference`` / ``count``):

- ``nonfinite_forward`` / ``nonfinite_backward`` (error): per step, the first record with a
  NaN or Inf in execution order (step, seq) of the forward pass (input, output, tensor) and of
  the backward pass (grad_output, grad_tensor, grad_param). Everything downstream of an
  origin is non-finite too, so only the origin is reported, with how many non-finite records
  followed. "fed by" is the latest finite record of the same pass before it. In the backward
  pass the gradient at a module's output is made by the backward of the module that consumed
  that output, so the finding names that module (the one whose grad_output was the last
  finite gradient), and the record where the value first shows is in the evidence. Steps in a
  row with the same origin are one finding. A backward origin whose module's forward was
  already non-finite in that micro-step (its saved values were) follows from the forward and
  is not reported. value: NaN + Inf count of the origin record; count: steps. Where the
  recorder captured the call that made the value (:mod:`hooktrace.analyze.checks.captured`), the
  finding's ``capture`` names the aten operation and the source line, with the command that
  shows the capture.
- ``nonfinite_param`` (error): parameters already non-finite when a step began (an update
  wrote them); the forward origins that those parameters explain are not reported again.
- ``exploding_gradient`` (error), ``gradient_spike`` (warning): each module's parameter
  gradient norm (the L2 norm over its parameters) per step, against a robust baseline: the
  median of the last ``window`` normal steps, in log scale, with the MAD. A step is *high*
  when it is ``spike_factor`` times the baseline (and, once 5 normal steps are known, 5 MADs
  above it); high steps stay out of the baseline, and high steps at most 2 steps apart form
  one episode. An episode that peaks at ``explode_factor`` times the baseline or above
  ``exploding_above``, and lasts more than one step or runs to the last step, is exploding,
  from its onset (its first high step, or the steps just before it that were already
  sqrt(spike_factor) times the baseline); other episodes are spikes. A norm above ``exploding_above`` is
  exploding even without a baseline. value: the peak norm; reference: the baseline (or the
  bound); count: high steps (spikes: episodes).
- ``replicas_differ`` (error): in a run of several ranks, a parameter recorded whole on every
  rank that agreed everywhere at its first recorded step (a data-parallel replica) and then
  came apart (:mod:`hooktrace.analyze.checks.replicas`). value: how far apart the norms are,
  relative; reference: the tolerance; count: the steps they differ; rank: the rank with the
  larger norm.
- ``activation_spike`` (warning): the same episodes on each module's output norm (root mean
  square over the step's records, train phase); a module whose outputs are exactly another's
  (a container returning its last child's output) is reported once.
- ``vanishing_gradient`` (warning): a gradient norm above zero and below ``vanishing_below``.
  Gradients that merely shrink as the loss goes down are not flagged.
- ``no_gradient`` (warning): a parameter whose ``.grad`` was None at every recorded step,
  though it requires one: unused in the forward pass, or cut off from the loss. A frozen
  parameter (requires_grad=False: a frozen backbone, an EMA copy) has no ``grad_param``
  record to miss.
- ``zero_gradient`` (info): parameter gradients exactly zero.
- ``saturated`` (info): Tanh, Hardtanh, Softsign (range -1..1) and Sigmoid, Hardsigmoid
  (0..1) outputs, mapped onto [-1, 1], with a mean square of at least ``saturation``: then at
  least (saturation - 0.81) / 0.19 of the values are beyond ±0.9 of the range.
- ``fp16_underflow`` (warning from 10% at the worst step, else info), ``fp16_overflow``
  (warning): from the histograms, where the run has them (:mod:`hooktrace.analyze.histograms.precision`
  defines both): a gradient of which more than ``underflow_above`` of the nonzero values lie
  below 2^-24, which float16 flushes to zero; a tensor of any kind with more than
  ``overflow_above`` at or above 2^16, which float16 makes Inf. value: that fraction at the
  worst step; reference: the bound; count: steps above it.

Non-finite norms are left to the non-finite checks, and exactly-zero ones to zero_gradient:
neither counts as high or normal in the series checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from hooktrace.analyze.checks import replicas, series
from hooktrace.analyze.checks.anomaly_scan import Scan
from hooktrace.analyze.checks.captured import (
    capture_column,
    failed_captures,
    read_captures,
    unmatched_note,
)
from hooktrace.analyze.findings import (
    Finding,
    StepsSpec,
    findings_frame,
    fmt,
    keys,
    step_filter,
)
from hooktrace.analyze.histograms import precision
from hooktrace.errors import ConfigError, TraceError
from hooktrace.trace.paths import one_line
from hooktrace.trace.reader import Trace, load


@dataclass
class Anomalies:
    """The result of :func:`anomalies`: ``findings`` (worst first, see
    :data:`hooktrace.analyze.findings.COLUMNS`, then ``capture``: the non-finite capture
    that explains a NaN/Inf origin, in words, else ""), what was read, notes on checks that
    could not run (e.g. no parameter gradients recorded), and the run's non-finite
    ``captures`` (the table of :meth:`Trace.nonfinite_captures`); ``logical``: whether the
    ranks' records were checked as logical tensors."""

    findings: pd.DataFrame
    steps: int
    modules: int
    notes: list[str] = field(default_factory=list)
    captures: pd.DataFrame = field(default_factory=pd.DataFrame)
    logical: bool = False

    def __len__(self) -> int:
        return len(self.findings)

    def __repr__(self) -> str:
        counts = self.findings["severity"].value_counts()
        parts = ", ".join(f"{counts[s]} {s}" for s in ("error", "warning", "info") if s in counts)
        return (
            f"<Anomalies: {len(self)} findings ({parts or 'none'}) in {self.steps} steps, "
            f"{self.modules} modules>"
        )


def anomalies(
    run: str | os.PathLike[str] | Trace,
    *,
    steps: StepsSpec = None,
    window: int = 20,
    spike_factor: float = 10.0,
    explode_factor: float = 100.0,
    exploding_above: float = 1e6,
    vanishing_below: float = 1e-7,
    saturation: float = 0.95,
    underflow_above: float = 0.01,
    overflow_above: float = 0.0,
    chunk_rows: int = 250_000,
    per_rank: bool = False,
) -> Anomalies:
    """Find non-finite origins, exploding, vanishing and spiking gradients, activation spikes,
    parameters without gradients, zero gradients, saturated tanh/sigmoid outputs and, from
    the histograms where there are any, values float16 would flush to zero or make Inf in
    ``run`` (see the module docstring for every definition). ``steps`` limits the steps read
    (``"0-100"``, ``(first, last)`` or step numbers); ``chunk_rows`` bounds the records held
    at once.

    A run of several ranks is checked as its logical tensors (:mod:`hooktrace.trace.logical`:
    shards and the data-parallel ranks' batches pooled, a replica once), each finding under
    the lowest rank behind its tensor; ``replicas_differ`` compares the ranks' own records.
    ``per_rank=True`` checks each rank's records apart. ``result.logical`` says which."""
    if window < 2 or spike_factor <= 1 or explode_factor < spike_factor:
        raise ConfigError(
            "need window >= 2, spike_factor > 1 and explode_factor >= spike_factor "
            f"(got {window}, {spike_factor}, {explode_factor})"
        )
    if vanishing_below < 0 or exploding_above <= 0 or not 0 < saturation <= 1:
        raise ConfigError(
            "need vanishing_below >= 0, exploding_above > 0 and 0 < saturation <= 1 "
            f"(got {vanishing_below}, {exploding_above}, {saturation})"
        )
    precision.check_bounds(underflow_above, overflow_above)
    trace = run if isinstance(run, Trace) else load(run)
    logical = not per_rank and trace.logical_by_default()
    config = series.Config(window, spike_factor, explode_factor, exploding_above)
    scan, found = _scan(
        trace, step_filter(steps), saturation, chunk_rows, config, vanishing_below, logical
    )
    found += _parameter_findings(scan)
    found += replicas.findings(trace, step_filter(steps))
    found += _saturation_findings(scan, saturation)
    low, low_notes = precision.findings(
        trace, steps=steps, underflow_above=underflow_above, overflow_above=overflow_above,
        logical=logical,
    )  # fmt: skip
    found += low
    notes = []
    if scan.steps == 0:
        notes.append("the trace holds no records in the steps read")
    elif not scan.per_slot:
        notes.append("no parameter gradients recorded (params=False?): gradient checks skipped")
    notes += low_notes if scan.steps else []
    frame = findings_frame(found)
    captures = read_captures(trace, notes)
    frame["capture"] = capture_column(frame, captures, trace.path).astype(str)  # as the others
    note = unmatched_note(frame, captures, trace.path)
    notes += [note] if note else []
    failed = failed_captures(trace)
    if failed:
        notes.append(
            f"{failed} non-finite capture(s) failed while the run was recorded (its warnings "
            "say why)"
        )
    return Anomalies(frame, scan.steps, len(scan.names), notes, captures, logical)


def _scan(
    trace: Trace,
    steps: tuple[int, int] | list[int] | None,
    saturation: float,
    chunk_rows: int,
    config: series.Config,
    vanishing_below: float,
    logical: bool,
) -> tuple[Scan, list[Finding]]:
    """The records of ``steps`` reduced, and the non-finite and series findings: in DuckDB
    over the rank_records view; where DuckDB fails on a part, or hooktrace's reader finds one
    damaged, the same reductions again chunk by chunk over what the reader reads (which
    leaves the damaged parts out, and says so). ``logical``: chunk by chunk over the logical
    records."""
    import duckdb

    if logical:
        scan = Scan(trace, saturation)
        read = functools.partial(scan.read_chunks, logical=True)
        try:
            found = _findings(scan, read, steps, chunk_rows, config, vanishing_below)
            return scan, _across_ranks(found)
        except duckdb.Error as exc:
            raise TraceError(f"cannot read the records of {trace.path}: {one_line(exc)}") from exc
    skipped = len(trace.skipped)
    with contextlib.suppress(duckdb.Error):
        scan = Scan(trace, saturation)
        found = _findings(scan, scan.read, steps, chunk_rows, config, vanishing_below)
        if len(trace.skipped) == skipped:
            return scan, found
    scan = Scan(trace, saturation)
    try:
        return scan, _findings(scan, scan.read_chunks, steps, chunk_rows, config, vanishing_below)
    except duckdb.Error as exc:
        raise TraceError(f"cannot read the records of {trace.path}: {one_line(exc)}") from exc


def _across_ranks(found: list[Finding]) -> list[Finding]:
    """The non-finite origins that several ranks found alike (kind, module, slot and step):
    once, under the lowest rank, the evidence naming the ranks."""
    kept: dict[tuple[str, str, str, int], Finding] = {}
    ranks: dict[tuple[str, str, str, int], list[int]] = {}
    out: list[Finding] = []
    for finding in found:
        if not finding.kind.startswith("nonfinite"):
            out.append(finding)
            continue
        key = (finding.kind, finding.module, finding.slot, finding.step)
        ranks.setdefault(key, []).append(finding.rank)
        if key not in kept or finding.rank < kept[key].rank:
            kept[key] = finding
    for key, finding in kept.items():
        on = sorted(ranks[key])
        if len(on) > 1:
            named = ", ".join(map(str, on))
            finding = dataclasses.replace(finding, evidence=f"{finding.evidence}; on ranks {named}")
        out.append(finding)
    return out


def _findings(
    scan: Scan,
    read: Callable[[tuple[int, int] | list[int] | None, int], None],
    steps: tuple[int, int] | list[int] | None,
    chunk_rows: int,
    config: series.Config,
    vanishing_below: float,
) -> list[Finding]:
    """``read`` the records into ``scan``, then the non-finite and series findings (the norms
    may be read only now)."""
    try:
        read(steps, chunk_rows)
        found = scan.nonfinite.findings()
        found += series.gradient_findings(scan.series("grads"), config, vanishing_below)
        found += series.activation_findings(scan.series("outputs"), config)
        return found
    finally:
        scan.close()


def _parameter_findings(scan: Scan) -> list[Finding]:
    """no_gradient (.grad None at every recorded step) and zero_gradient, per module."""
    if not scan.per_slot:
        return []
    per_slot = (
        pd.concat(scan.per_slot)
        .groupby(level=["rank", "module", "slot"])
        .agg({"steps": "sum", "none": "sum", "first": "min", "last": "max"})
    )
    found: list[Finding] = []
    never = per_slot[per_slot["none"] >= per_slot["steps"]].reset_index()
    for key, group in never.groupby(["rank", "module"], sort=True):
        rank, module = keys(key)
        slots = ", ".join(sorted(group["slot"]))
        steps = int(group["steps"].max())
        found.append(
            Finding(
                "no_gradient", "warning", scan.names[module], int(group["first"].min()),
                rank=int(rank), slot=slots, last_step=int(group["last"].max()), count=steps,
                evidence=f"{slots}: .grad was None at all {steps} recorded step(s)",
                explanation="never gets a gradient, though it requires one: it is not used in "
                "the forward pass, or the loss does not depend on it (a detach, a no_grad block)",
            )
        )  # fmt: skip
    if not scan.zero:
        return found
    totals = per_slot.groupby(level=["rank", "module"])["steps"].max()
    zero = (
        pd.concat(scan.zero)
        .groupby(level=["rank", "module"])
        .agg({"steps": "sum", "first": "min", "last": "max", "slots": _union})
    )
    for index, row in zero.iterrows():
        rank, module = keys(index)
        slots = ", ".join(sorted(row["slots"]))
        n, total = int(row["steps"]), int(totals[(rank, module)])
        found.append(
            Finding(
                "zero_gradient", "info", scan.names[module], int(row["first"]), rank=int(rank),
                slot=slots, last_step=int(row["last"]), count=n, value=0.0,
                evidence=f"{slots}: gradient exactly zero at {n} of {total} step(s), from step "
                f"{row['first']}",
                explanation="no gradient flows to these parameters: dead units downstream, a "
                "detached path, or a zero mask",
            )
        )  # fmt: skip
    return found


def _saturation_findings(scan: Scan, saturation: float) -> list[Finding]:
    if not scan.saturated:
        return []
    table = (
        pd.concat(scan.saturated)
        .groupby(level=["rank", "module"])
        .agg({"steps": "sum", "hit": "sum", "first": "min", "last": "max", "value": "max"})
    )
    share = max((saturation - 0.81) / 0.19, 0.0)
    found: list[Finding] = []
    for index, row in table[table["hit"] > 0].iterrows():
        rank, module = keys(index)
        found.append(
            Finding(
                "saturated", "info", scan.names[module], int(row["first"]), rank=int(rank),
                last_step=int(row["last"]), value=float(row["value"]), reference=saturation,
                count=int(row["hit"]),
                evidence=f"mean square of the output on [-1, 1] at least {fmt(saturation)} at "
                f"{int(row['hit'])} of {int(row['steps'])} step(s), from step {int(row['first'])} "
                f"(so at least {share:.0%} of values within 10% of the ends)",
                explanation="a saturated tanh/sigmoid passes almost no gradient: check the scale "
                "of its input (initialisation, normalisation, learning rate)",
            )
        )  # fmt: skip
    return found


def _union(values: pd.Series) -> set[str]:
    """Slot names, or sets of them, as one set."""
    found: set[str] = set()
    for value in values:
        found |= value if isinstance(value, set) else {value}
    return found
