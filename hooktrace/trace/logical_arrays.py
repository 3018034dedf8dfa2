"""The logical view of a chunk of records, in numpy: what :func:`hooktrace.trace.logical.select`
computes in DuckDB, by the same rules (:mod:`hooktrace.trace.logical` states them) and to the
same answer, about ten times faster on the few steps of every rank that ``diff`` and
``query`` hand it: the records are numbered by tensor once, and every statistic is then a
sum, a minimum or a maximum over those numbers. ``tests/trace/test_logical.py`` holds the two
to the same answers. Never imports torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from hooktrace.trace.logical import GRADIENT_KINDS, KEY, NEEDED, WEIGHT_KINDS, Layout

_STATS = ("mean", "std", "min", "max", "norm", "zero_fraction")
_COUNTS = ("numel", "nan_count", "inf_count")
_PER_PART = {  # kept where one part stands alone, else what a pooled record holds
    "units": 0, "unit_size": 0, "activity_offset": 0, "segment": None, "tensor_key": "",
    "call_spec": "", "mesh_shape": "", "mesh_coord": "",
}  # fmt: skip


def logical_table(table: pa.Table, layout: Layout | None = None) -> pa.Table:
    """The logical records of ``table`` (records of whole steps of every rank, holding
    :data:`~hooktrace.trace.logical.NEEDED`): its columns, in its order, then ``ranks``,
    ``dp`` and ``merged``; in step and execution order."""
    missing = [c for c in NEEDED if c not in table.column_names]
    if missing:
        raise ValueError(f"the logical view needs the record columns {', '.join(missing)}")
    rank = _numbers(table, "rank").astype(np.int64)
    text = {c: _text(table, c) for c in ("kind", "shape", "logical_shape", "placements",
                                         "shard_offset")}  # fmt: skip
    partial = np.char.find(text["placements"].astype(str), "P(") >= 0
    sharded = np.char.find(text["placements"].astype(str), "S(") >= 0
    weight = np.isin(text["kind"], WEIGHT_KINDS)
    base = np.where(text["logical_shape"] != "", text["logical_shape"], text["shape"])
    tensor = _ids([_column(table, c) for c in KEY])
    group = _ids([tensor, np.where(partial, rank, -1)])
    ranks = np.bincount(tensor)[tensor]  # every rank's records of the tensor

    # replicas once: the lowest rank's record of each part (weights: per shard offset;
    # activations: per shard offset and identical shape, dtype and statistics)
    same = [_column(table, c) for c in ("shape", "dtype", *_COUNTS, *_STATS)]
    alike = _ids([group, text["shard_offset"], *(np.where(weight, 0, _ids([c])) for c in same)])
    order = np.lexsort((rank, alike))
    firsts = order[np.r_[True, alike[order][1:] != alike[order][:-1]]]
    kept = firsts[np.lexsort((rank[firsts], group[firsts]))]  # by group, lowest rank first
    g = _ids([group[kept]])  # dense, in that order
    parts = np.bincount(g)
    at = np.r_[0, np.cumsum(parts)[:-1]].astype(np.int64)  # each group's lowest rank's row
    lead = kept[at]

    dp_rank = np.array([(layout or {}).get(int(r), -1) for r in rank[kept]], dtype=np.int64)
    known = np.minimum.reduceat(dp_rank >= 0, at)
    offsets = _distinct(g, text["shard_offset"][kept])
    dps = _distinct(g, dp_rank)
    any_weight = np.maximum.reduceat(weight[kept], at)
    alone_partial = partial[lead]
    dp = np.where(any_weight | alone_partial, 1, np.where(known, dps, parts // offsets))
    local = ~any_weight & ~alone_partial & known & (parts > dps * offsets)
    scalar = (dp > 1) & np.minimum.reduceat(base[kept] == "", at)
    gradient = (dp > 1) & ~scalar & np.isin(text["kind"][lead], GRADIENT_KINDS)
    pooled = parts > 1

    out = table.take(pa.array(lead))
    values = _pooled(table, kept, g, at)
    per_dp = np.where(gradient, dp, 1)
    unsummarised = values["unsummarised"]
    empty = values["numel"] == 0  # no values in any part: no mean (DuckDB's answer too)
    for name in _STATS:
        mine = values[name] if name == "zero_fraction" else values[name] / per_dp
        mine = np.where(scalar, values[f"scalar_{name}"], mine)
        hollow = empty & np.isin(name, ("mean", "std", "zero_fraction"))
        out = _replace(out, name, pooled, mine, null=unsummarised | hollow)
    for name in _COUNTS:
        mine = np.where(scalar, values[f"scalar_{name}"], values[name])
        null = None if name == "numel" else values[f"null_{name}"]
        out = _replace(out, name, pooled, mine, null=null)
    shape = _shapes(base, kept, g, at, dp, scalar, local, dp_rank, offsets)
    out = _replace(out, "shape", pooled | (base[lead] != text["shape"][lead]), shape)
    alone = ~pooled & (~sharded[lead] | alone_partial)
    for name in ("logical_shape", "placements", "shard_offset"):
        out = _replace(out, name, ~alone, np.full(len(lead), "", dtype=object))
    for name, empty in _PER_PART.items():
        if name in out.column_names:
            out = _replace(out, name, pooled, np.full(len(lead), empty, dtype=object),
                           null=None if empty is not None else pooled)  # fmt: skip
    if "note" in out.column_names:  # a part's "skipped: ..." or "nested: ..." outweighs ""
        notes = pd.Series(_text(table, "note")[kept]).groupby(g).max().to_numpy(object)
        out = _replace(out, "note", pooled, notes)
    complete = values["numel"] == _logical_numel(base[lead])
    merged = _labels(pooled, alone_partial, ranks[lead], any_weight, complete, dp, local,
                     np.maximum.reduceat(sharded[kept], at))  # fmt: skip
    out = out.append_column("ranks", pa.array(ranks[lead], pa.int32()))
    out = out.append_column("dp", pa.array(dp, pa.int32()))
    out = out.append_column("merged", pa.array(merged, pa.string()))
    return out.sort_by([("step", "ascending"), ("seq", "ascending"), ("rank", "ascending")])


def _pooled(table: pa.Table, kept: np.ndarray, g: np.ndarray, at: np.ndarray) -> dict[str, Any]:
    """Each group's pooled statistics (Chan's formula for the variance; extremes NaN where a
    part's are), a 0-d activation's mean over ranks, and where a part is not summarised."""
    numbers = {c: _numbers(table, c)[kept] for c in (*_COUNTS, *_STATS)}
    numel = numbers["numel"]
    n = np.bincount(g, numel)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(g, np.where(numel > 0, numel * numbers["mean"], 0.0)) / n
        deviation = numbers["mean"] - mean[g]
        squares = numel * (numbers["std"] ** 2 + deviation**2)
        std = np.sqrt(np.bincount(g, np.where(numel > 0, squares, 0.0)) / n)
        top = np.maximum.reduceat(numbers["norm"], at)
        scaled = np.bincount(g, (numbers["norm"] / top[g]) ** 2)
        norm = np.where((top == 0) | np.isinf(top), top, top * np.sqrt(scaled))
        norm = np.where(np.isnan(top), np.nan, norm)
        zeros = np.bincount(g, np.round(numbers["zero_fraction"] * numel)) / n
        scalar = np.bincount(g, numbers["mean"]) / np.bincount(g)

    def any_null(name: str) -> np.ndarray:
        return np.bincount(g, _nulls(table, name)[kept].astype(np.float64)) > 0

    nulls = any_null("mean")
    return {
        "null_nan_count": any_null("nan_count"), "null_inf_count": any_null("inf_count"),
        "numel": n.astype(np.int64), "mean": mean, "std": std, "norm": norm,
        "min": np.minimum.reduceat(numbers["min"], at),
        "max": np.maximum.reduceat(numbers["max"], at), "zero_fraction": zeros,
        "nan_count": np.bincount(g, numbers["nan_count"]).astype(np.int64),
        "inf_count": np.bincount(g, numbers["inf_count"]).astype(np.int64),
        "scalar_mean": scalar, "scalar_std": np.where(np.isnan(scalar), np.nan, 0.0),
        "scalar_min": scalar, "scalar_max": scalar, "scalar_norm": np.abs(scalar),
        "scalar_zero_fraction": (scalar == 0).astype(np.float64), "scalar_numel": 1,
        "scalar_nan_count": np.isnan(scalar).astype(np.int64),
        "scalar_inf_count": np.isinf(scalar).astype(np.int64), "unsummarised": nulls,
    }  # fmt: skip


def _shapes(
    base: np.ndarray, kept: np.ndarray, g: np.ndarray, at: np.ndarray, dp: np.ndarray,
    scalar: np.ndarray, local: np.ndarray, dp_rank: np.ndarray, offsets: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """A pooled record's shape: the logical shape; over data-parallel parts of equal trailing
    dimensions the batch dimension summed; local shards' shapes joined by "+" (the lowest
    data-parallel rank's, in rank order); else the distinct shapes joined by "+"."""
    shapes = np.array(base[kept[at]], dtype=object)
    for i in np.flatnonzero(local | ((dp > 1) & ~scalar)):
        mine = base[kept][g == i]
        if local[i]:
            ranks_here = dp_rank[g == i]
            shapes[i] = "+".join(mine[ranks_here == ranks_here.min()])
            continue
        rests = {s.partition(",")[2] for s in mine}
        if len(rests) == 1 and all(s.partition(",")[0].isdigit() for s in mine):
            first = sum(int(s.partition(",")[0]) for s in mine) // int(offsets[i])
            rest = rests.pop()
            shapes[i] = f"{first},{rest}" if rest else str(first)
        else:
            shapes[i] = "+".join(sorted(set(mine)))
    return shapes


def _labels(
    pooled: np.ndarray, partial: np.ndarray, ranks: np.ndarray, weight: np.ndarray,
    complete: np.ndarray, dp: np.ndarray, local: np.ndarray, sharded: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """The ``merged`` column: how each logical record was made."""
    return np.select(
        [partial, local & (dp > 1), local, ~pooled & ~sharded & (ranks > 1), ~pooled & ~sharded,
         weight & ~complete, weight, (dp > 1) & sharded, dp > 1],
        ["partial", "local shards, batch", "local shards", "replicas", "", "incomplete shards",
         "shards", "shards, batch", "batch"],
        "shards",
    ).astype(object)  # fmt: skip


def _logical_numel(shapes: np.ndarray) -> np.ndarray:
    """The values each logical shape holds (1 for a 0-d tensor's "")."""
    return np.array(
        [int(np.prod([int(d) for d in s.split(",")])) if s else 1 for s in shapes],
        dtype=np.int64,
    )


def _replace(
    table: pa.Table, name: str, where: np.ndarray, values: Any, *, null: np.ndarray | None = None
) -> pa.Table:
    """``table`` with column ``name`` set to ``values`` where ``where`` (null where ``null``),
    kept elsewhere, in the column's own type."""
    if not where.any():
        return table
    index = table.schema.get_field_index(name)
    field = table.schema.field(index)
    old = table.column(index)
    plain = old.type.value_type if pa.types.is_dictionary(old.type) else old.type
    current = old.cast(plain).to_numpy(zero_copy_only=False)
    mixed = np.where(where, values, current)
    mask = old.is_null().to_numpy(zero_copy_only=False) & ~where
    if null is not None:
        mask = mask | (where & null)
    if pa.types.is_string(plain):
        mixed = np.array([v if isinstance(v, str) else "" for v in mixed], dtype=object)
    array = pa.array(mixed, type=plain, mask=mask, from_pandas=False)
    return table.set_column(index, field, array.cast(field.type))


def _ids(columns: list[Any]) -> np.ndarray:
    """Dense int64 ids of the rows' combinations of ``columns`` (NaN equals NaN)."""
    codes = [pd.factorize(np.asarray(c), use_na_sentinel=False)[0] for c in columns]
    if len(codes) == 1:
        return codes[0].astype(np.int64)
    sizes = [int(c.max()) + 1 if len(c) else 1 for c in codes]
    if float(np.prod([float(s) for s in sizes])) < 2.0**62:
        combined = np.ravel_multi_index(codes, sizes)
    else:
        combined = np.unique(np.stack(codes, axis=1), axis=0, return_inverse=True)[1].ravel()
    return pd.factorize(combined)[0].astype(np.int64)


def _distinct(g: np.ndarray, values: np.ndarray) -> np.ndarray:
    """How many distinct ``values`` each group of ``g`` holds."""
    pairs = _ids([g, values])
    firsts = np.unique(pairs, return_index=True)[1]
    return np.bincount(g[firsts], minlength=int(g.max()) + 1 if len(g) else 0)


def _column(table: pa.Table, name: str) -> np.ndarray:
    column = table.column(name)
    if pa.types.is_dictionary(column.type) or pa.types.is_string(column.type):
        return _text(table, name)
    return column.to_numpy(zero_copy_only=False)


def _text(table: pa.Table, name: str) -> np.ndarray:
    """A text column as an object array, "" where null (a column older traces lack)."""
    column = table.column(name)
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    return np.array(column.fill_null("").to_pylist(), dtype=object)


def _numbers(table: pa.Table, name: str) -> np.ndarray:
    """A numeric column as float64 (int64 for ints), NaN (0) where null."""
    column = table.column(name)
    if pa.types.is_integer(column.type):
        return column.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    return column.to_numpy(zero_copy_only=False).astype(np.float64)


def _nulls(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).is_null().to_numpy(zero_copy_only=False)
