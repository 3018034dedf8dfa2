"""Gradient and numeric anomalies: :func:`anomalies`. Never imports torch.

Statistics are enough (no full tensors). The records are read in chunks of whole steps, so
memory stays bounded; what is kept between chunks is one number per module per step (the
gradient and activation norms the series checks need) and the non-finite origins found.

The checks, and what each finding's numbers mean (``value`` / ``reference`` / ``count``):

- ``nonfinite_forward`` / ``nonfinite_backward`` (error): per step, the first record with a
  NaN or Inf in execution order (step, seq) of the forward pass (input, output, tensor) and of
  the backward pass (grad_output, grad_tensor, grad_param). Everything downstream of an
  origin is non-finite too, so only the origin is reported, with how many non-finite records
  followed. "fed by" is the latest finite record of the same pass before it. In the backward
  pass the gradient at a module's output is made by the backward of the module that consumed
  that output, so the finding names that module (the one whose grad_output was the last
  finite gradient), and the record where the value first shows is in the evidence. Steps in a
  row with the same origin are one finding. A backward pass whose very first gradient is
  already non-finite, after a non-finite forward, is its consequence and not reported.
  value: NaN + Inf count of the origin record; count: steps.
- ``nonfinite_param`` (error): parameters already non-finite when a step began (an update
  wrote them); the forward origins that those parameters explain are not reported again.
- ``exploding_gradient`` (error), ``gradient_spike`` (warning): each module's parameter
  gradient norm (the L2 norm over its parameters) per step, against a robust baseline: the
  median of the last ``window`` normal steps, in log scale, with the MAD. A step is *high*
  when it is ``spike_factor`` times the baseline and 5 MADs above it; high steps stay out of
  the baseline, and high steps at most 2 steps apart form one episode. An episode that peaks
  at ``explode_factor`` times the baseline, above ``exploding_above``, and lasts more than one
  step or runs to the last step, is exploding, from its first step; other episodes are
  spikes. value: the peak norm; reference: the baseline; count: high steps.
- ``activation_spike`` (warning): the same episodes on each module's output norm (root mean
  square over the step's records, train phase); a module whose outputs are exactly another's
  (a container returning its last child's output) is reported once.
- ``vanishing_gradient`` (warning): a gradient norm above zero and below ``vanishing_below``.
  Gradients that merely shrink as the loss goes down are not flagged.
- ``no_gradient`` (warning): a parameter whose ``.grad`` was None at every recorded step:
  frozen (requires_grad=False) or unused in the forward pass.
- ``zero_gradient`` (info): parameter gradients exactly zero.
- ``saturated`` (info): Tanh, Hardtanh, Softsign (range -1..1) and Sigmoid, Hardsigmoid
  (0..1) outputs, mapped onto [-1, 1], with a mean square of at least ``saturation``: then at
  least (saturation - 0.81) / 0.19 of the values are beyond ±0.9 of the range.

Non-finite norms are left to the non-finite checks, and exactly-zero ones to zero_gradient:
neither counts as high or normal in the series checks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from hooktrace.analyze import series
from hooktrace.analyze.findings import (
    Finding,
    StepsSpec,
    findings_frame,
    fmt,
    keys,
    modules_of_type,
    step_filter,
)
from hooktrace.analyze.nonfinite import NonFinite
from hooktrace.errors import ConfigError
from hooktrace.trace.reader import Trace, load

TANH_RANGE = ("Tanh", "Hardtanh", "Softsign")
SIGMOID_RANGE = ("Sigmoid", "Hardsigmoid")
_COLUMNS = ["rank", "step", "micro_step", "phase", "seq", "module", "kind", "slot", "dtype",
            "numel", "mean", "std", "norm", "nan_count", "inf_count"]  # fmt: skip


@dataclass
class Anomalies:
    """The result of :func:`anomalies`: ``findings`` (worst first, see
    :data:`hooktrace.analyze.findings.COLUMNS`), what was read, and notes on checks that could
    not run (e.g. no parameter gradients recorded)."""

    findings: pd.DataFrame
    steps: int
    modules: int
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.findings)

    def __repr__(self) -> str:
        counts = self.findings["severity"].value_counts()
        parts = ", ".join(f"{counts[s]} {s}" for s in ("error", "warning", "info") if s in counts)
        return f"<Anomalies: {len(self)} findings ({parts or 'none'}) in {self.steps} steps, {self.modules} modules>"


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
    chunk_rows: int = 250_000,
) -> Anomalies:
    """Find non-finite origins, exploding, vanishing and spiking gradients, activation spikes,
    parameters without gradients, zero gradients and saturated tanh/sigmoid outputs in
    ``run`` (see the module docstring for every definition). ``steps`` limits the steps read
    (``"0-100"``, ``(first, last)`` or step numbers); ``chunk_rows`` bounds the records held
    at once."""
    if window < 2 or spike_factor <= 1 or explode_factor < spike_factor:
        raise ConfigError(
            "need window >= 2, spike_factor > 1 and explode_factor >= spike_factor "
            f"(got {window}, {spike_factor}, {explode_factor})"
        )
    if vanishing_below < 0 or exploding_above <= 0 or not 0 < saturation <= 1:
        raise ConfigError(
            "vanishing_below >= 0, exploding_above > 0 and 0 < saturation <= 1, please"
        )
    trace = run if isinstance(run, Trace) else load(run)
    scan = _Scan(trace)
    n_steps = 0
    for chunk in _chunks(trace, step_filter(steps), chunk_rows):
        frame = trace.query(columns=_COLUMNS, steps=chunk)
        n_steps += int(frame[["rank", "step"]].drop_duplicates().shape[0])
        scan.add(frame)
    config = series.Config(window, spike_factor, explode_factor, exploding_above)
    found = scan.nonfinite.findings()
    found += series.gradient_findings(scan.grads, config, vanishing_below)
    found += series.activation_findings(scan.outputs, config)
    found += _parameter_findings(scan.params)
    found += _saturation_findings(scan.saturation, saturation)
    notes = []
    if not scan.params:
        notes.append("no parameter gradients recorded (params=False?): gradient checks skipped")
    return Anomalies(findings_frame(found), n_steps, len(scan.modules_seen), notes)


def _chunks(
    trace: Trace, steps: tuple[int, int] | list[int] | None, chunk_rows: int
) -> Iterator[tuple[int, int] | list[int]]:
    """Step selections of about ``chunk_rows`` records each, whole steps, in step order."""
    per_step = trace.query(columns=["step"], steps=steps)["step"].value_counts().sort_index()
    if per_step.empty:
        return
    group = (per_step.cumsum() - 1) // max(chunk_rows, 1)
    for _, members in per_step.groupby(group.to_numpy(), sort=True):
        chosen = members.index.to_numpy()
        if isinstance(steps, list):
            yield [int(s) for s in chosen]
        else:
            yield int(chosen[0]), int(chosen[-1])


class _Scan:
    """What one pass over the records keeps: non-finite origins and small per-step tables."""

    def __init__(self, trace: Trace) -> None:
        modules = trace.modules.drop_duplicates("module")
        names = modules["module"].astype(str)
        self.nonfinite = NonFinite(
            dict(zip(names, modules["parent"].astype(str), strict=True)),
            dict(zip(names, modules["root"].astype(str), strict=True)),
        )
        self.ranges = {
            **dict.fromkeys(modules_of_type(trace.modules, TANH_RANGE), "tanh"),
            **dict.fromkeys(modules_of_type(trace.modules, SIGMOID_RANGE), "sigmoid"),
        }
        self.grads: list[pd.DataFrame] = []
        self.params: list[pd.DataFrame] = []
        self.outputs: list[pd.DataFrame] = []
        self.saturation: list[pd.DataFrame] = []
        self.modules_seen: set[str] = set()

    def add(self, frame: pd.DataFrame) -> None:
        self.modules_seen.update(frame["module"].astype(str).unique())
        kind = frame["kind"].astype(str)
        self.nonfinite.add(frame, kind)
        grad_param = frame[kind == "grad_param"]
        if not grad_param.empty:
            params = pd.DataFrame(
                {"rank": grad_param["rank"].to_numpy(), "step": grad_param["step"].to_numpy(),
                 "module": grad_param["module"].astype(str).to_numpy(),
                 "slot": grad_param["slot"].astype(str).to_numpy(),
                 "none": grad_param["dtype"].astype(str).eq("None").to_numpy(),
                 "zero": grad_param["norm"].eq(0).to_numpy()}
            )  # fmt: skip
            self.params.append(params)
            has = grad_param[~params["none"].to_numpy()]
            self.grads.append(_norms(has, how="sum"))
        train_out = frame[(kind == "output") & (frame["phase"].astype(str) == "train")]
        if not train_out.empty:
            self.outputs.append(_norms(train_out, how="mean"))
            names = train_out["module"].astype(str)
            ranged = train_out[names.isin(list(self.ranges)).to_numpy()]
            if not ranged.empty:
                self.saturation.append(self._mean_square(ranged))

    def _mean_square(self, rows: pd.DataFrame) -> pd.DataFrame:
        """Per (rank, module, step): the numel-weighted mean square of the output on [-1, 1]."""
        square = rows["std"] ** 2 + rows["mean"] ** 2
        sigmoid = rows["module"].astype(str).map(self.ranges).eq("sigmoid")
        scaled = square.where(~sigmoid, 4 * square - 4 * rows["mean"] + 1)
        weighted = rows.assign(module=rows["module"].astype(str), w=scaled * rows["numel"])
        sums = weighted.groupby(["rank", "module", "step"])[["w", "numel"]].sum()
        return (sums["w"] / sums["numel"]).rename("value").reset_index()


def _norms(rows: pd.DataFrame, *, how: str) -> pd.DataFrame:
    """Per (rank, module, step): the norm of all of ``rows``' values together (``how="sum"``:
    the root of the summed squares) or their root mean square over records (``"mean"``),
    NaN if any norm was; with the first seq, to order modules by execution."""
    squares = rows["norm"].to_numpy(dtype=np.float64) ** 2
    frame = pd.DataFrame(
        {"rank": rows["rank"].to_numpy(), "module": rows["module"].astype(str).to_numpy(),
         "step": rows["step"].to_numpy(), "sq": squares, "nan": np.isnan(squares),
         "seq": rows["seq"].to_numpy()}
    )  # fmt: skip
    grouped = frame.groupby(["rank", "module", "step"])
    total = grouped["sq"].sum() if how == "sum" else grouped["sq"].mean()
    total[grouped["nan"].any()] = np.nan
    return pd.DataFrame({"value": np.sqrt(total), "seq": grouped["seq"].min()}).reset_index()


def _parameter_findings(frames: list[pd.DataFrame]) -> list[Finding]:
    """no_gradient (.grad None at every recorded step) and zero_gradient, per module."""
    if not frames:
        return []
    table = pd.concat(frames, ignore_index=True)
    found: list[Finding] = []
    per_slot = table.groupby(["rank", "module", "slot"], sort=True).agg(
        steps=("step", "nunique"), none=("none", "sum"), first=("step", "min"), last=("step", "max")
    )
    never = per_slot[per_slot["none"] >= per_slot["steps"]].reset_index()
    for key, group in never.groupby(["rank", "module"], sort=True):
        rank, module = keys(key)
        slots = ", ".join(group["slot"])
        steps = int(group["steps"].max())
        found.append(
            Finding(
                "no_gradient", "warning", str(module), int(group["first"].min()), rank=int(rank),
                slot=slots, last_step=int(group["last"].max()), count=steps,
                evidence=f"{slots}: .grad was None at all {steps} recorded step(s)",
                explanation="never gets a gradient: the parameter is frozen (requires_grad=False) "
                "or not used in the forward pass",
            )
        )  # fmt: skip
    zero = table[table["zero"] & ~table["none"]]
    for key, group in zero.groupby(["rank", "module"], sort=True):
        rank, module = keys(key)
        slots = ", ".join(sorted(group["slot"].unique()))
        total = int(table[(table["rank"] == rank) & (table["module"] == module)]["step"].nunique())
        n = int(group["step"].nunique())
        found.append(
            Finding(
                "zero_gradient", "info", str(module), int(group["step"].min()), rank=int(rank),
                slot=slots, last_step=int(group["step"].max()), count=n, value=0.0,
                evidence=f"{slots}: gradient exactly zero at {n} of {total} step(s), from step "
                f"{group['step'].min()}",
                explanation="no gradient flows to these parameters: dead units downstream, a "
                "detached path, or a zero mask",
            )
        )  # fmt: skip
    return found


def _saturation_findings(frames: list[pd.DataFrame], saturation: float) -> list[Finding]:
    if not frames:
        return []
    table = pd.concat(frames, ignore_index=True)
    share = max((saturation - 0.81) / 0.19, 0.0)
    found: list[Finding] = []
    for key, group in table.groupby(["rank", "module"], sort=True):
        rank, module = keys(key)
        hit = group[group["value"] >= saturation]
        if hit.empty:
            continue
        found.append(
            Finding(
                "saturated", "info", str(module), int(hit["step"].min()), rank=int(rank),
                last_step=int(hit["step"].max()), value=float(hit["value"].max()),
                reference=saturation, count=len(hit),
                evidence=f"mean square of the output on [-1, 1] at least {fmt(saturation)} at "
                f"{len(hit)} of {len(group)} step(s), from step {hit['step'].min()} (so at "
                f"least {share:.0%} of values within 10% of the ends)",
                explanation="a saturated tanh/sigmoid passes almost no gradient: check the scale "
                "of its input (initialisation, normalisation, learning rate)",
            )
        )  # fmt: skip
    return found
