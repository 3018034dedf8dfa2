"""The numerics of ``hooktrace diff``: align two runs' records and compare them. No torch.

One chunk of records from each run goes in (a few steps, as :func:`hooktrace.diff` reads
them); one row per aligned record comes out, with a ``status``:

- ``equal``: within tolerance;
- ``differs``: a statistic (or, where both runs saved it, the full tensor) is out of tolerance;
- ``changed``: the shape or the dtype differs (a structural difference; not the shape of a
  logical tensor pooled from local shards, which lists theirs, against one of as many values);
- ``only_a`` / ``only_b``: one run has no such record.

Tolerance is symmetric, ``|a - b| <= atol + rtol * scale``. For full tensors the scale of each
element is ``max(|a|, |b|)``; for statistics it is the size of the tensor's values, so that a
mean near zero is not judged relative to itself: ``max(rms_a, rms_b)`` (rms = norm / sqrt(numel))
for mean, std, min and max, ``max(norm_a, norm_b)`` for norm, 1 for zero_fraction. NaN equals
NaN (both runs NaN at the same place is no divergence) and inf equals an inf of the same sign.
numel, nan_count and inf_count must be equal (a record hooktrace could not summarise has no
counts: two such records match). A value missing in both runs (a column an older minor
version of the format lacks) matches; :mod:`hooktrace.analyze.diff.same` follows these rules
for the records both runs hold bit for bit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd

from hooktrace.errors import TraceError
from hooktrace.trace.schema import COUNT_COLUMNS, STAT_COLUMNS
from hooktrace.trace.tensors import decode_dataset

KEYS = ("rank", "step", "micro_step", "phase", "module", "call", "kind", "slot")
"""Records align on these columns."""

VALUES = ("seq", "dtype", "shape", "numel", *STAT_COLUMNS, *COUNT_COLUMNS, "segment", "tensor_key")
"""The columns read from each run besides the keys."""

TENSOR_METRICS = ("max_abs_error", "max_rel_error", "cosine", "mismatch_fraction")

STATUSES = ("equal", "differs", "changed", "only_a", "only_b")

TABLE_DTYPES: dict[str, str] = {
    **{k: "category" if k in ("phase", "module", "kind", "slot") else "int64" for k in KEYS},
    "seq": "int64",
    "status": "category",
    "exceeded": "category",
    "dtype_a": "category",
    "dtype_b": "category",
    "shape_a": "str",
    "shape_b": "str",
    "norm_a": "float64",
    "norm_b": "float64",
    **{f"d_{c}": "float64" for c in (*STAT_COLUMNS, "numel", *COUNT_COLUMNS)},
    "rel_diff": "float64",
    **dict.fromkeys(TENSOR_METRICS, "float64"),
}
"""The diff table's columns and dtypes. ``exceeded`` names what is out of tolerance
(statistics, ``tensor``, ``shape``, ``dtype``); ``rel_diff`` is the largest statistic
difference relative to its scale (inf where the records do not pair up)."""

_STAT_SCALE = {
    "mean": "rms",
    "std": "rms",
    "min": "rms",
    "max": "rms",
    "norm": "norm",
    "zero_fraction": "one",
}


def align(a: pd.DataFrame, b: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """An outer join of two runs' records on ``keys``: values get ``_a`` / ``_b`` suffixes and
    ``in_a`` / ``in_b`` say which run has the record. Equal layouts skip the join."""
    keys = list(keys)
    for col in keys:
        if isinstance(a[col].dtype, pd.CategoricalDtype) or isinstance(
            b[col].dtype, pd.CategoricalDtype
        ):
            categories = pd.Index(a[col].astype("category").cat.categories).union(
                b[col].astype("category").cat.categories
            )
            a = a.assign(**{col: pd.Categorical(a[col], categories=categories)})
            b = b.assign(**{col: pd.Categorical(b[col], categories=categories)})
    values_a = a.drop(columns=keys).add_suffix("_a")
    values_b = b.drop(columns=keys).add_suffix("_b")
    if len(a) == len(b) and all(_same(a[c], b[c]) for c in keys):
        merged = pd.concat(
            [
                a[keys].reset_index(drop=True),
                values_a.reset_index(drop=True),
                values_b.reset_index(drop=True),
            ],
            axis=1,
        )
        merged["in_a"] = True
        merged["in_b"] = True
        return merged
    left = pd.concat([a[keys], values_a], axis=1)
    right = pd.concat([b[keys], values_b], axis=1)
    if left.duplicated(keys).any() or right.duplicated(keys).any():
        # a record key seen twice (should not happen): pair the n-th with the n-th
        left["_n"] = left.groupby(keys, observed=True).cumcount()
        right["_n"] = right.groupby(keys, observed=True).cumcount()
        keys = [*keys, "_n"]
    merged = left.merge(right, on=keys, how="outer", indicator="_side", sort=False)
    merged["in_a"] = (merged["_side"] != "right_only").to_numpy()
    merged["in_b"] = (merged["_side"] != "left_only").to_numpy()
    return merged.drop(columns=[c for c in ("_side", "_n") if c in merged.columns])


def compare(
    merged: pd.DataFrame, *, rtol: float, atol: float, tensors: TensorPair | None
) -> pd.DataFrame:
    """One row per aligned record, in the diff table's columns, in execution order."""
    n = len(merged)
    in_a = merged["in_a"].to_numpy(bool)
    in_b = merged["in_b"].to_numpy(bool)
    both = in_a & in_b
    shapes_differ = _differ(merged["shape_a"], merged["shape_b"]) & ~_unplaced(merged)
    dtypes_differ = _differ(merged["dtype_a"], merged["dtype_b"])
    changed = both & (dtypes_differ | shapes_differ)
    comparable = both & ~changed

    def num(col: str) -> np.ndarray:
        return merged[col].to_numpy(dtype=np.float64, na_value=np.nan)

    norm_a, norm_b = num("norm_a"), num("norm_b")
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.fmax(norm_a / np.sqrt(num("numel_a")), norm_b / np.sqrt(num("numel_b")))
        scales = {"rms": rms, "norm": np.fmax(norm_a, norm_b), "one": np.ones(n)}
        out: dict[str, Any] = {}
        bad: dict[str, np.ndarray] = {}
        rel = np.zeros(n)
        for stat in STAT_COLUMNS:
            va, vb = num(f"{stat}_a"), num(f"{stat}_b")
            delta = vb - va
            scale = scales[_STAT_SCALE[stat]]
            scale = np.where(np.isfinite(scale), scale, 0.0)
            same = (va == vb) | (np.isnan(va) & np.isnan(vb))
            gap = np.where(same, 0.0, np.abs(delta))
            gap = np.where(np.isnan(gap), np.inf, gap)
            bad[stat] = gap > atol + rtol * scale
            rel = np.fmax(rel, np.where(gap == 0, 0.0, gap / scale))
            out[f"d_{stat}"] = delta
        for count in ("numel", *COUNT_COLUMNS):
            ca, cb = num(f"{count}_a"), num(f"{count}_b")
            delta = cb - ca
            bad[count] = (delta != 0) & ~(np.isnan(ca) & np.isnan(cb))  # both unknown: no gap
            out[f"d_{count}"] = delta
    stats_differ = np.zeros(n, dtype=bool)
    for mask in bad.values():
        stats_differ |= mask
    metrics = {m: np.full(n, np.nan) for m in TENSOR_METRICS}
    has_a = (merged["tensor_key_a"].fillna("") != "").to_numpy(dtype=bool)
    has_b = (merged["tensor_key_b"].fillna("") != "").to_numpy(dtype=bool)
    full = comparable & has_a & has_b
    if full.any() and tensors is not None:
        rows = np.flatnonzero(full)
        found = tensors.compare(merged.iloc[rows], rtol=rtol, atol=atol)
        for m in TENSOR_METRICS:
            metrics[m][rows] = found[m]
        decided = rows[~np.isnan(found["mismatch_fraction"])]
        # full tensors decide exactly; statistics are only what they summarise
        stats_differ[decided] = (
            found["mismatch_fraction"][~np.isnan(found["mismatch_fraction"])] > 0
        )
    differs = comparable & stats_differ
    code: np.ndarray = np.select([~in_b, ~in_a, changed, differs], [3, 4, 2, 1], default=0)
    rel = np.where(comparable, rel, np.inf)
    # what is out of tolerance, as bits (one per name, in the label's order), named once
    # per distinct combination: strings built per row cost more than the comparison itself
    names = ["tensor", *STAT_COLUMNS, "numel", *COUNT_COLUMNS, "shape", "dtype"]
    bits = np.zeros(n, dtype=np.int64)
    bits[differs & (metrics["mismatch_fraction"] > 0)] |= 1
    for i, name in enumerate((*STAT_COLUMNS, "numel", *COUNT_COLUMNS), start=1):
        bits[differs & bad[name]] |= 1 << i
    bits[changed & shapes_differ] = 1 << (len(names) - 2)
    bits[changed & dtypes_differ] |= 1 << (len(names) - 1)
    distinct, codes = np.unique(bits, return_inverse=True)
    named = [",".join(m for i, m in enumerate(names) if int(b) >> i & 1) for b in distinct]
    order = np.argsort(np.array(named, dtype=object), kind="stable")  # categories by name
    labels = [named[i] for i in order]
    codes = np.argsort(order)[codes]
    table = pd.DataFrame(
        {
            **{k: merged[k] for k in KEYS if k in merged.columns},
            "seq": np.where(in_a, num("seq_a"), num("seq_b")).astype(np.int64),
            "status": pd.Categorical.from_codes(code, categories=pd.Index(STATUSES)),
            "exceeded": pd.Categorical.from_codes(codes, categories=pd.Index(labels)),
            "dtype_a": merged["dtype_a"],
            "dtype_b": merged["dtype_b"],
            "shape_a": merged["shape_a"],
            "shape_b": merged["shape_b"],
            "norm_a": norm_a,
            "norm_b": norm_b,
            **out,
            "rel_diff": rel,
            **metrics,
        },
        copy=False,  # one block per column: stacking 30 float columns cost more than the rest
    )
    return table[list(TABLE_DTYPES)].astype(TABLE_DTYPES)


class TensorPair:
    """Reads the full tensors of two runs, a few open HDF5 segments at a time."""

    def __init__(self, root_a: Path, root_b: Path, *, max_open: int = 8) -> None:
        self.roots = (root_a, root_b)
        self.max_open = max_open
        self._open: OrderedDict[Path, h5py.File] = OrderedDict()
        self.unreadable: list[str] = []  # "run A: segment:key (why)", one per tensor not read

    def compare(self, rows: pd.DataFrame, *, rtol: float, atol: float) -> dict[str, np.ndarray]:
        out = {m: np.full(len(rows), np.nan) for m in TENSOR_METRICS}
        order = np.lexsort(
            (_objects(rows["segment_b"]).astype(str), _objects(rows["segment_a"]).astype(str))
        )
        for i in order:
            row = rows.iloc[i]
            x = self._load(0, str(row["segment_a"]), str(row["tensor_key_a"]))
            y = self._load(1, str(row["segment_b"]), str(row["tensor_key_b"]))
            if x is None or y is None or x.shape != y.shape:
                continue
            for name, value in tensor_metrics(x, y, rtol=rtol, atol=atol).items():
                out[name][i] = value
        return out

    def close(self) -> None:
        while self._open:
            self._open.popitem(last=False)[1].close()

    def _load(self, side: int, segment: str, key: str) -> np.ndarray | None:
        """The tensor as float64 values, or None where it cannot be compared value by value:
        the record is then compared on its statistics, and a damaged tensor is noted."""
        root = self.roots[side]
        path = (root / segment).resolve()
        where = f"run {'AB'[side]}: {segment}:{key}"
        if not path.is_relative_to(root.resolve()) or not path.exists():
            self.unreadable.append(f"{where} (the segment is missing)")
            return None
        try:
            f = self._open.pop(path, None)
            if f is None:
                f = h5py.File(path, "r")
                if len(self._open) >= self.max_open:
                    self._open.popitem(last=False)[1].close()
            self._open[path] = f
            if key not in f:
                self.unreadable.append(f"{where} (not in the segment)")
                return None
            data = decode_dataset(f[key], f"{segment}:{key}")
        except (TraceError, OSError, KeyError, TypeError, ValueError, RuntimeError) as exc:
            self.unreadable.append(f"{where} ({type(exc).__name__})")
            return None
        if data.dtype.kind == "c":  # no order on complex values: statistics only, by design
            return None
        return data.astype(np.float64).reshape(-1)


def tensor_metrics(a: np.ndarray, b: np.ndarray, *, rtol: float, atol: float) -> dict[str, float]:
    """max |a-b|, max |a-b| / max(|a|,|b|), cosine similarity, fraction out of tolerance."""
    if a.size == 0:
        return {"max_abs_error": 0.0, "max_rel_error": 0.0, "cosine": 1.0, "mismatch_fraction": 0.0}
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        gap = np.where(same, 0.0, np.abs(a - b))
        gap = np.where(np.isnan(gap), np.inf, gap)
        size = np.fmax(np.abs(a), np.abs(b))
        ok = same | (np.isfinite(gap) & (gap <= atol + rtol * size))
        rel = np.where(gap == 0, 0.0, gap / size)
        finite = np.isfinite(a) & np.isfinite(b)
        if finite.all():
            na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
            if na == 0 and nb == 0:
                cosine = 1.0
            elif na == 0 or nb == 0:
                cosine = 0.0
            else:
                cosine = float(np.dot(a / na, b / nb))
        else:
            cosine = float("nan")
    return {
        "max_abs_error": float(gap.max()),
        "max_rel_error": float(np.nan_to_num(rel, nan=np.inf).max()),
        "cosine": cosine,
        "mismatch_fraction": float(1.0 - ok.mean()),
    }


def _same(x: pd.Series, y: pd.Series) -> bool:
    if isinstance(x.dtype, pd.CategoricalDtype):
        return bool(np.array_equal(x.cat.codes.to_numpy(), y.cat.codes.to_numpy()))
    return bool(np.array_equal(x.to_numpy(), y.to_numpy()))


def _unplaced(merged: pd.DataFrame) -> np.ndarray:
    """Where a run's record is a logical tensor pooled from local shards whose places it
    does not know (its shape lists theirs, "8,16+8,16": hooktrace.trace.logical) and holds
    as many values as the other run's: its shape is no difference, its values are compared."""
    listed = np.zeros(len(merged), dtype=bool)
    for side in ("shape_a", "shape_b"):
        listed |= merged[side].astype("str").str.contains("+", regex=False).to_numpy(bool)
    if not listed.any():
        return listed
    numel_a = merged["numel_a"].to_numpy(dtype=np.float64, na_value=np.nan)
    return listed & (numel_a == merged["numel_b"].to_numpy(dtype=np.float64, na_value=np.nan))


def _differ(a: pd.Series, b: pd.Series) -> np.ndarray:
    """Element-wise inequality of two string columns (categoricals too), a missing value (a
    column a trace of an older minor version lacks) equal to a missing one."""
    missing_a, missing_b = a.isna().to_numpy(), b.isna().to_numpy()
    if isinstance(a.dtype, pd.CategoricalDtype) and isinstance(b.dtype, pd.CategoricalDtype):
        names = a.cat.categories.union(b.cat.categories)
        unequal = a.cat.set_categories(names).cat.codes.to_numpy() != (
            b.cat.set_categories(names).cat.codes.to_numpy()
        )
    else:
        unequal = (a.astype("str") != b.astype("str")).to_numpy(dtype=bool, na_value=True)
    return np.asarray((unequal & ~(missing_a & missing_b)) | (missing_a != missing_b))


def _objects(column: pd.Series) -> np.ndarray:
    """A column as an object array (categoricals decoded through their categories)."""
    return np.asarray(column.astype(object).to_numpy(), dtype=object)
