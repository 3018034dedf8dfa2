"""``replicas_differ``: data-parallel replicas of a parameter that stopped being equal.

Under DDP (and any data parallelism that keeps a whole copy of the model on each rank) every
rank's copy of a parameter is meant to be bit-identical after every step: the gradients are
averaged before the optimizer steps. A rank whose copy drifts (a desynchronised rank, a
missed all-reduce, silent data corruption) trains a different model, which no loss curve
shows.

A parameter is taken for a replica where it is recorded whole (no shard columns) on every
rank, under one name and shape, and its records agree on every rank at its first recorded
step: a shard of a hand-written tensor parallelism differs there already, and is left out.
A DTensor parameter's records of one shard offset on several ranks are replicas by their
placements (HSDP's replicate dimension, a ``Replicate`` placement of tensor parallelism,
FSDP2's shard replicated over tensor-parallel peers), from its first recorded step on.
Replicas' records then differ where their minimum or maximum differs at all, or their norms
by more than float rounding of a sum taken in another order (:data:`NORM_TOLERANCE`). All
in one DuckDB query over the parameter records: the trace is not loaded.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Final

from hooktrace.analyze.findings import Finding
from hooktrace.trace.reader import Trace

NORM_TOLERANCE: Final = 1e-6
"""Relative difference of two replicas' norms taken as rounding (ranks that sum over other
thread counts); the minimum and maximum are compared exactly."""

_QUERY = """
WITH per_step AS (
    SELECT step, phase, module, slot, shard_offset, bool_or(logical_shape <> '') AS dtensor,
           count(DISTINCT rank) AS ranks, count(DISTINCT shape) AS shapes,
           count(DISTINCT min) AS mins, count(DISTINCT max) AS maxs,
           min(norm) AS low, max(norm) AS high,
           arg_min(rank, norm) AS low_rank, arg_max(rank, norm) AS high_rank
    FROM rank_records
    WHERE kind = 'param' AND norm IS NOT NULL AND NOT contains(placements, 'P(')
    GROUP BY ALL
), judged AS (
    SELECT *,
           CASE WHEN dtensor THEN ranks > 1 ELSE ranks = $world AND shapes = 1 END AS everywhere,
           mins > 1 OR maxs > 1 OR high - low > $tolerance * high AS apart,
           row_number() OVER (PARTITION BY phase, module, slot, shard_offset ORDER BY step) AS nth
    FROM per_step
), replicas AS (
    SELECT phase, module, slot, shard_offset FROM judged
    WHERE nth = 1 AND everywhere AND (dtensor OR NOT apart)
)
SELECT j.phase, j.module, j.slot, min(j.step) AS step, count(DISTINCT j.step) AS steps,
       arg_min(j.low, (j.step, j.shard_offset)) AS low,
       arg_min(j.high, (j.step, j.shard_offset)) AS high,
       arg_min(j.low_rank, (j.step, j.shard_offset)) AS low_rank,
       arg_min(j.high_rank, (j.step, j.shard_offset)) AS high_rank,
       arg_min(j.mins > 1 OR j.maxs > 1, (j.step, j.shard_offset)) AS extremes
FROM judged j JOIN replicas USING (phase, module, slot, shard_offset)
WHERE j.everywhere AND j.apart {steps}
GROUP BY ALL
ORDER BY step, module, slot
"""


def findings(trace: Trace, steps: tuple[int, int] | list[int] | None) -> list[Finding]:
    """One ``replicas_differ`` finding per parameter whose replicas came apart, at the first
    of ``steps`` they differ in; none for a run of one rank. Whether a parameter is a
    replica is decided at its first recorded step, whatever ``steps`` says."""
    world = trace.ranks
    if len(world) < 2:
        return []
    where, parameters = "", []
    if isinstance(steps, tuple):
        where, parameters = "AND j.step BETWEEN ? AND ?", [steps[0], steps[1]]
    elif steps is not None:
        where = f"AND j.step IN ({', '.join('?' * len(steps))})" if steps else "AND false"
        parameters = list(steps)
    query = _QUERY.format(steps=where).replace("$world", str(len(world)))
    query = query.replace("$tolerance", repr(NORM_TOLERANCE))
    return [_finding(row) for row in trace.sql(query, parameters).to_dict("records")]


def _finding(row: dict[Hashable, Any]) -> Finding:
    how = "their minimum or maximum differ" if row["extremes"] else "their norms differ"
    low, high = float(row["low"]), float(row["high"])
    relative = (high - low) / high if high else float("inf")
    evidence = (
        f"{row['module']}.{row['slot']} is not the same on every rank from step {row['step']}: "
        f"{how} (norm {low:.7g} on rank {row['low_rank']}, {high:.7g} on rank "
        f"{row['high_rank']}, {relative:.2g} apart), in {row['steps']} recorded step(s)"
    )
    explanation = (
        "data-parallel replicas of a parameter must stay bit-identical: a rank has fallen out "
        "of step (a missed all-reduce, a rank that updates on its own, silent data "
        "corruption), unless the ranks train apart on purpose (local SGD)"
    )
    return Finding(
        "replicas_differ", "error", str(row["module"]), int(row["step"]), evidence, explanation,
        slot=str(row["slot"]), rank=int(row["high_rank"]), value=relative,
        reference=NORM_TOLERANCE, count=int(row["steps"]),
    )  # fmt: skip
