"""The logical view of a run of several ranks: one record per logical tensor, as a run of one
process would have recorded it. Never imports torch.

Each rank records what it holds: a DTensor's local shard (FSDP2's parameters, tensor
parallelism's), its own replica of a parameter (DDP), its own part of the global batch's
activations. :func:`select` puts them back together, in one DuckDB query over any relation
of records (the ``records`` view, or an Arrow table of a few steps), grouping the ranks'
records of a tensor (same step, micro-step, phase, module, call, kind and slot):

1. **Replicas count once.** A parameter's, buffer's or parameter gradient's records with the
   same shard offset (the whole tensor's, "" for one that is not a DTensor) are copies of
   one tensor: the lowest rank's is taken. An activation's records that are identical (same
   shape, dtype and statistics; the same shard offset) on every rank that holds it, or,
   where the layout is known, on tensor-parallel peers (where it is not: on several ranks)
   are one tensor the ranks share (tensor parallelism's replicated activations, position
   embeddings): taken once.
2. **What is left is pooled**: shards of a DTensor, and the data-parallel ranks' parts of the
   global batch. Counts add up; min and max are taken over; the mean is weighted by the
   values each part holds and the variance is combined by Chan's formula (the records' std
   has no correction), so the pooled statistics equal the whole tensor's to float rounding;
   the L2 norm is the root of the sum of squares. An empty part (an uneven split's last
   shard, whose own statistics are NaN) adds none.
3. **The data-parallel degree** ``dp`` of an activation: the data-parallel ranks holding it,
   where the recording told each rank's place (the status's ``data_parallel``, from DDP or
   FSDP2); else its parts per distinct shard offset. Where the layout is known, the parts a
   data-parallel rank's peers (tensor parallelism's) hold of an activation that is no
   DTensor are its local shards: their values are pooled, but where they lie in the
   logical tensor is not recorded, so its shape lists theirs ("8,16+8,16"). The gradients of activations (``grad_output``, ``grad_tensor``) pooled over ``dp``
   parts are divided by ``dp``: each rank's gradient is of its own loss, and the gradient of
   the run's loss (the average the optimizer steps with) is that over ``dp``. A 0-d
   activation (a loss) pooled over ranks is their mean, not a batch of ``dp`` values.
4. **A partial sum** (a ``P(...)`` placement: a DTensor not yet reduced) is never pooled as if
   it were whole: each rank's record stays its own.

Each logical record keeps the record columns (``rank`` is the lowest rank behind it, ``shape``
the logical tensor's, the shard columns "" once pooled; a pooled record has no per-unit
activity and no full tensor, which stay in the per-rank records) and adds ``ranks`` (how
many ranks recorded the tensor), ``dp`` and ``merged``: "" (one rank's record), "replicas",
"shards", "batch", "shards, batch", "local shards", "local shards, batch", "partial", or
"incomplete shards" (a parameter whose shards do not add up to its logical shape: a rank's
records are missing).

The record of a whole tensor no other rank holds passes through bit for bit (a lone shard
takes its logical shape).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import pyarrow as pa

KEY: Final = ("step", "micro_step", "phase", "module", "call", "kind", "slot")
"""The columns that name one tensor of a step, across ranks."""

WEIGHT_KINDS: Final = ("param", "buffer", "grad_param")
"""Kinds whose records on several ranks are replicas (or shards) of one tensor."""

GRADIENT_KINDS: Final = ("grad_output", "grad_tensor")
"""Kinds of activation gradients: divided by the data-parallel degree when pooled."""

NEEDED: Final = (
    "rank", *KEY, "seq", "dtype", "shape", "numel", "mean", "std", "min", "max", "norm",
    "zero_fraction", "nan_count", "inf_count", "logical_shape", "placements", "shard_offset",
)  # fmt: skip
"""The columns :func:`select` reads; any other record column is passed through."""

ADDED: Final = ("ranks", "dp", "merged")
"""The columns a logical record adds."""


Layout = dict[int, int]
"""Each rank's data-parallel rank: the ranks of one hold the same part of the global batch."""


def _dp_rank(layout: Layout | None) -> str:
    """The expression of a record's data-parallel rank: NULL where the layout is not known."""
    if not layout:
        return "NULL::INTEGER"
    arms = " ".join(f"WHEN {int(rank)} THEN {int(dp)}" for rank, dp in sorted(layout.items()))
    return f"CASE rank {arms} END"


def _one(column: str) -> str:
    """The lowest rank's value of ``column`` (where one part stands alone: its own)."""
    return f"arg_min({column}, rank)"


def _in(values: Iterable[str]) -> str:
    return ", ".join(f"'{v}'" for v in values)


PER_PART: Final[dict[str, int | str | None]] = {
    # kept where one part stands alone, else what a pooled record holds (None: null)
    "units": 0,
    "unit_size": 0,
    "activity_offset": 0,
    "segment": None,
    "tensor_key": "",
    "call_spec": "",
    "mesh_shape": "",
    "mesh_coord": "",
}
"""The per-rank columns of a record (its activity, its full tensor, its mesh coordinate)
and what a pooled record holds in them."""


def select(source: str, columns: Iterable[str], layout: Layout | None = None) -> str:
    """A query of the logical records of ``source`` (a table, a view or a parenthesised
    query holding ``columns``, which include :data:`NEEDED`): the columns of ``source``, in
    its order, then :data:`ADDED`. ``layout``: each rank's data-parallel rank, where the
    recording told it (the ranks' statuses): else the records tell it (see the module)."""
    columns = list(columns)
    missing = [c for c in NEEDED if c not in columns]
    if missing:
        raise ValueError(f"the logical view needs the record columns {', '.join(missing)}")
    key = ", ".join(KEY)
    # the grouping columns as they are (not an aggregate of them): a filter on them over the
    # view is pushed down to the Parquet scan
    out = {c: c if c in KEY else _one(c) for c in columns}
    out.update(_pooled())
    out["rank"] = "min(rank)::INTEGER"
    out["seq"] = "arg_min(seq, rank)"
    for column, empty in PER_PART.items():
        if column in out:
            value = "NULL" if empty is None else repr(empty)  # 0, or '' (SQL's quotes too)
            out[column] = f"CASE WHEN count(*) = 1 THEN {_one(column)} ELSE {value} END"
    if "note" in out:  # a part's "skipped: ..." or "nested: ..." outweighs another's ""
        out["note"] = "max(note)"
    for column in ("logical_shape", "placements", "shard_offset"):
        out[column] = f"CASE WHEN {_STANDS_ALONE} THEN {_one(column)} ELSE '' END"
    fields = ",\n    ".join(f"{expr} AS {name}" for name, expr in out.items())
    return f"""{_kept(source, layout)},
pooled AS (
    SELECT *,
        sum(numel) OVER part_ AS n_,
        sum(CASE WHEN numel > 0 THEN numel * mean ELSE 0 END) OVER part_
            / nullif(sum(numel) OVER part_, 0) AS mean_,
        max(CASE WHEN numel > 0 THEN norm END) OVER part_ AS top_
    FROM kept
    WINDOW part_ AS (PARTITION BY {key}, partial_)
),
merged AS (
    SELECT *,
        CASE WHEN bool_or(weight_) OVER part_ OR partial_ IS NOT NULL THEN 1
             WHEN bool_and(dp_rank_ IS NOT NULL) OVER part_
                THEN count(DISTINCT dp_rank_) OVER part_
             ELSE (count(*) OVER part_) // count(DISTINCT shard_offset) OVER part_
        END AS dp_,
        NOT bool_or(weight_) OVER part_ AND partial_ IS NULL
            AND bool_and(dp_rank_ IS NOT NULL) OVER part_
            AND count(*) OVER part_ > count(DISTINCT dp_rank_) OVER part_
                * count(DISTINCT shard_offset) OVER part_ AS local_,
        min(dp_rank_) OVER part_ AS first_dp_
    FROM pooled
    WINDOW part_ AS (PARTITION BY {key}, partial_)
)
SELECT
    {fields},
    max(ranks_)::INTEGER AS ranks,
    max(dp_)::INTEGER AS dp,
    {_MERGED} AS merged
FROM merged
GROUP BY {key}, partial_
"""


def parts(source: str, layout: Layout | None = None) -> str:
    """A query of the records of ``source`` (as :func:`select` takes it) that the logical
    records pool: ``rank``, ``step`` and ``seq`` of each, with the ``logical_rank`` and
    ``logical_seq`` of the logical record it is part of (its lowest rank's). A replica's
    copies are left out, but one. What a logical record adds up from its parts (histograms,
    counts) is the sum over these."""
    return f"""{_kept(source, layout)}
SELECT rank, step, seq,
    min(rank) OVER part_ AS logical_rank,
    arg_min(seq, rank) OVER part_ AS logical_seq
FROM kept
WINDOW part_ AS (PARTITION BY {", ".join(KEY)}, partial_)
"""


def _kept(source: str, layout: Layout | None) -> str:
    """The common table expressions up to ``kept``: the records of ``source`` with what
    groups them (``partial_``, ``base_``, ``weight_``, ``dp_rank_``, ``print_``), a
    replica's copies left out but the lowest rank's (rules 1 and 4 of the module)."""
    weights = _in(WEIGHT_KINDS)
    key = ", ".join(KEY)
    return f"""
WITH parted AS (
    SELECT *,
        count(*) OVER (PARTITION BY {key}) AS ranks_,
        CASE WHEN contains(placements, 'P(') THEN rank END AS partial_,
        CASE WHEN logical_shape <> '' THEN logical_shape ELSE shape END AS base_,
        kind IN ({weights}) AS weight_,
        {_dp_rank(layout)} AS dp_rank_,
        hash(shape, dtype, numel, mean, std, min, max, norm, zero_fraction, nan_count,
             inf_count) AS print_
    FROM {source}
),
alike AS (
    SELECT *,
        min(print_) OVER offset_ = max(print_) OVER offset_ AS same_
    FROM parted
    WINDOW offset_ AS (PARTITION BY {key}, partial_, shard_offset)
),
kept AS (
    SELECT * FROM alike
    QUALIFY row_number() OVER (
        PARTITION BY {key}, partial_, shard_offset, CASE
            WHEN weight_ THEN NULL
            WHEN dp_rank_ IS NULL OR same_ THEN print_
            ELSE hash(print_, dp_rank_)
        END
        ORDER BY rank) = 1
)
"""


def query_table(table: pa.Table, layout: Layout | None = None) -> pa.Table:
    """What the SQL view ``logical_records`` answers for ``table`` (records of whole steps of
    every rank, holding :data:`NEEDED`), in step and execution order: DuckDB reads the table
    where it lies. The analyzer's own chunks go through the faster
    :func:`hooktrace.trace.logical_arrays.logical_table`, which gives the same answer."""
    import duckdb

    from hooktrace.trace.tables import arrow_of

    for name in ("logical_shape", "placements", "shard_offset"):  # null before format 1.4
        column = table.column(name)
        if column.null_count:
            table = table.set_column(
                table.schema.get_field_index(name), name, column.cast(pa.string()).fill_null("")
            )
    con = duckdb.connect()
    try:
        con.register("records_", table)
        query = f"SELECT * FROM ({select('records_', table.column_names, layout)}) "
        query += "ORDER BY step, seq, rank"
        return arrow_of(con.sql(query))
    finally:
        con.close()


_STANDS_ALONE = "(count(*) = 1 AND bool_and(partial_ IS NOT NULL OR placements NOT LIKE '%S(%'))"
"""One part that is not a shard of something larger: a whole tensor, a replica, a partial
sum. Its shard columns stay; a pooled record (or a lone shard) is whole: they are ""."""

_SCALAR = "(max(dp_) > 1 AND bool_and(base_ = ''))"
"""A 0-d activation pooled over data-parallel ranks (a loss): their mean."""

_GRADIENT = f"(max(dp_) > 1 AND NOT {_SCALAR} AND any_value(kind) IN ({_in(GRADIENT_KINDS)}))"
"""An activation gradient pooled over data-parallel ranks: divided by ``dp``."""


def _logical_numel() -> str:
    """The values a part's logical tensor holds: the product of its logical shape."""
    dims = "list_transform(string_split(base_, ','), lambda d: try_cast(d AS BIGINT))"
    return f"CASE WHEN base_ = '' THEN 1 ELSE list_reduce({dims}, lambda a, b: a * b) END"


_MERGED = f"""CASE
        WHEN bool_or(partial_ IS NOT NULL) THEN 'partial'
        WHEN bool_or(local_) AND max(dp_) > 1 THEN 'local shards, batch'
        WHEN bool_or(local_) THEN 'local shards'
        WHEN count(*) = 1 AND bool_and(placements NOT LIKE '%S(%')
            THEN CASE WHEN max(ranks_) > 1 THEN 'replicas' ELSE '' END
        WHEN bool_or(weight_) AND sum(numel) <> max({_logical_numel()}) THEN 'incomplete shards'
        WHEN bool_or(weight_) THEN 'shards'
        WHEN max(dp_) > 1 AND bool_or(placements LIKE '%S(%') THEN 'shards, batch'
        WHEN max(dp_) > 1 THEN 'batch'
        ELSE 'shards'
    END"""


def _pooled() -> dict[str, str]:
    """The statistics of a pooled record; where one part stands alone, its own bit for bit."""
    nan = "'NaN'::DOUBLE"
    per_dp = f"CASE WHEN {_GRADIENT} THEN max(dp_) ELSE 1 END"

    def stat(name: str, pooled: str, scalar: str, *, divided: bool = True) -> str:
        pooled = f"({pooled}) / {per_dp}" if divided else pooled
        return (
            f"CASE WHEN count(*) = 1 THEN {_one(name)} "
            "WHEN count(mean) < count(*) THEN NULL "  # a part hooktrace could not summarise
            f"WHEN {_SCALAR} THEN {scalar} ELSE {pooled} END"
        )

    def extreme(fn: str) -> str:  # an empty part has no extremes (its own are NaN)
        of = f"{fn}(CASE WHEN numel > 0 THEN {fn} END)"
        found = f"CASE WHEN bool_or(numel > 0 AND isnan({fn})) THEN {nan} ELSE {of} END"
        return stat(fn, f"coalesce({found}, {nan})", "avg(mean)")

    def count(name: str, scalar: str) -> str:
        return (
            f"CASE WHEN count(*) = 1 THEN {_one(name)} "
            f"WHEN count({name}) < count(*) THEN NULL "  # a part not summarised: unknown
            f"WHEN {_SCALAR} THEN {scalar} ELSE sum({name}) END::BIGINT"
        )

    variance = (
        "sum(CASE WHEN numel > 0 THEN numel * (std * std + (mean - mean_) * (mean - mean_)) "
        "ELSE 0 END) / nullif(max(n_), 0)"
    )
    norm = (
        f"CASE WHEN max(top_) IS NULL THEN {nan} WHEN bool_or(numel > 0 AND isnan(norm)) "
        f"THEN {nan} WHEN max(top_) = 0 OR isinf(max(top_)) THEN max(top_) "
        "ELSE max(top_) * sqrt(sum(CASE WHEN numel > 0 THEN (norm / top_) * (norm / top_) "
        "ELSE 0 END)) END"
    )
    return {
        "dtype": _one("dtype"),
        "shape": f"CASE WHEN count(*) = 1 THEN {_one('base_')} ELSE {_shape()} END",
        "numel": count("numel", "1"),
        "mean": stat("mean", "max(mean_)", "avg(mean)"),
        "std": stat(
            "std", f"sqrt({variance})", f"CASE WHEN isnan(avg(mean)) THEN {nan} ELSE 0 END"
        ),
        "min": extreme("min"),
        "max": extreme("max"),
        "norm": stat("norm", norm, "abs(avg(mean))"),
        "zero_fraction": stat(
            "zero_fraction",
            "sum(CASE WHEN numel > 0 THEN round(zero_fraction * numel) ELSE 0 END) "
            "/ nullif(max(n_), 0)",
            "(avg(mean) = 0)::DOUBLE",
            divided=False,
        ),
        "nan_count": count("nan_count", "isnan(avg(mean))::BIGINT"),
        "inf_count": count("inf_count", "isinf(avg(mean))::BIGINT"),
    }


def _shape() -> str:
    """A pooled record's shape: the logical shape; over data-parallel parts of equal trailing
    dimensions, the batch dimension (the first) is the parts' sum; else the distinct shapes
    joined by "+"."""
    rest = "regexp_replace(base_, '^[^,]*', '')"
    first = "try_cast(split_part(base_, ',', 1) AS BIGINT)"
    return (
        "CASE WHEN bool_or(local_) "
        "THEN string_agg(base_, '+' ORDER BY rank) FILTER (WHERE dp_rank_ = first_dp_) "
        f"WHEN max(dp_) = 1 OR {_SCALAR} THEN {_one('base_')} "
        f"WHEN count(DISTINCT {rest}) = 1 "
        f"THEN (sum({first}) // count(DISTINCT shard_offset))::VARCHAR || any_value({rest}) "
        "ELSE string_agg(DISTINCT base_, '+' ORDER BY base_) END"
    )
