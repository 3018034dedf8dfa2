"""Non-finite captures: the call where a NaN or Inf first appeared, saved in full. No torch.

The recorder writes one HDF5 file per capture, ``captures/rank=R/capture-NNN.h5`` (under a
temporary name first, renamed once whole, as every file of a trace). The file holds:

- the attribute ``capture``: JSON, what :data:`FIELDS` lists (where, what triggered it, the
  call spec replay needs, what was left out and why, and the ``analysis``: the first aten
  operation that made a non-finite value when the call was run again, and the source line
  that called it);
- groups ``inputs``, ``outputs``, ``grad_outputs`` (a backward capture) and ``state`` (the
  parameters and buffers of the module and every module inside it, by qualified name), one
  dataset a tensor, named by its position, with the attribute ``name`` (the slot or
  qualname) and the ``dtype`` and ``crc32`` attributes of a full tensor in a segment.

docs/FORMAT.md describes the same thing for people.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd

from hooktrace.errors import TensorNotRecorded, TraceError
from hooktrace.trace import schema
from hooktrace.trace.tensors import decode_dataset

CAPTURES_DIR = "captures"
GROUPS = ("inputs", "outputs", "grad_outputs", "state")
"""The tensors of a capture, by group: a dataset per tensor, named by slot or by qualname."""

FIELDS = (
    "rank", "capture", "step", "micro_step", "phase", "pass", "module", "module_type", "call",
    "trigger", "op", "node", "file", "line", "function", "code", "reproduces", "analysis",
    "explanation", "left_out",
)  # fmt: skip
"""The columns of :func:`capture_table`: one row per capture."""

_NAME = re.compile(r"capture-(\d{3,})\.h5")


def capture_name(index: int) -> str:
    return f"capture-{index:03d}.h5"


def write_capture(
    directory: Path,
    index: int,
    meta: Mapping[str, Any],
    tensors: Mapping[str, list[tuple[str, np.ndarray, str]]],
) -> Path:
    """Write one capture: ``tensors`` maps a group of :data:`GROUPS` to (name, array, dtype
    name) triples, arrays as :func:`hooktrace.recorder.records.pending.to_numpy` makes them."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / capture_name(index)
    tmp = final.with_name(schema.temporary_name(final.name))
    try:
        with h5py.File(tmp, "w", libver=("v110", "latest")) as f:
            f.attrs["format"] = schema.FORMAT_NAME
            f.attrs["format_version"] = schema.FORMAT_VERSION
            f.attrs["capture"] = json.dumps(dict(meta), default=str)
            for group_name in GROUPS:
                group = f.create_group(group_name)
                for i, (name, array, dtype) in enumerate(tensors.get(group_name, ())):
                    dataset = group.create_dataset(str(i), data=array)  # no user name in a path
                    dataset.attrs["dtype"] = dtype
                    dataset.attrs["name"] = name
                    dataset.attrs[schema.TENSOR_CHECKSUM] = np.uint32(zlib.crc32(array.data))
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def capture_paths(run: Path, rank: int | None = None) -> list[tuple[int, int, Path]]:
    """(rank, index, path) of each capture of the run, in order."""
    root = run / CAPTURES_DIR
    found: list[tuple[int, int, Path]] = []
    if not root.is_dir():
        return found
    for rank_directory in sorted(root.glob("rank=*")):
        try:
            r = int(rank_directory.name.partition("=")[2])
        except ValueError:
            continue
        if (rank is not None and r != rank) or not rank_directory.is_dir():
            continue  # (a file in a rank's place holds no capture)
        for path in rank_directory.iterdir():
            match = _NAME.fullmatch(path.name)
            if match:
                found.append((r, int(match.group(1)), path))
    return sorted(found)


def capture_path(run: Path, capture: int, rank: int) -> Path:
    """The file of capture ``capture`` of ``rank``; TensorNotRecorded says which it holds."""
    for _, index, path in capture_paths(run, rank):
        if index == capture:
            return path
    held = [index for _, index, _ in capture_paths(run, rank)]
    have = f"it holds {', '.join(map(str, held))}" if held else "it holds none"
    raise TensorNotRecorded(
        f"{run} has no non-finite capture {capture} on rank {rank} ({have}); "
        "`hooktrace replay RUN --nonfinite` lists them"
    )


def read_meta(path: Path) -> dict[str, Any]:
    """The JSON attribute of one capture file; TraceError when it cannot be read."""
    try:
        with h5py.File(path, "r") as f:
            raw = f.attrs["capture"]
    except (OSError, KeyError) as exc:
        raise TraceError(f"cannot read the capture {path}: {exc}; run `hooktrace check`") from exc
    try:
        meta = json.loads(raw if isinstance(raw, str) else bytes(raw).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceError(f"the capture {path} holds no valid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise TraceError(f"the capture {path} holds no capture description")
    return meta


def capture_table(run: Path, rank: int | None = None) -> pd.DataFrame:
    """One row per capture (:data:`FIELDS`), in (rank, capture) order."""
    rows = []
    for r, index, path in capture_paths(run, rank):
        meta = read_meta(path)
        analysis = meta.get("analysis") or {}
        rows.append(
            {
                "rank": r,
                "capture": index,
                **{key: meta.get(key) for key in FIELDS[2:10]},
                **{key: analysis.get(key) for key in ("op", "node", "file", "line")},
                **{key: analysis.get(key) for key in ("function", "code", "reproduces")},
                "analysis": analysis.get("status"),
                "explanation": explain(meta),
                "left_out": len(meta.get("left_out") or []),
            }
        )
    frame = pd.DataFrame(rows, columns=list(FIELDS))
    for column in ("rank", "capture", "step", "micro_step", "call"):
        frame[column] = frame[column].astype("int64")
    frame["line"] = frame["line"].astype("Int64")
    return frame


def read_tensors(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every tensor of one capture, by group and name, with exact dtypes (bfloat16 and float8
    as ml_dtypes)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    try:
        with h5py.File(path, "r") as f:
            for group_name in GROUPS:
                group = f.get(group_name)
                tensors: dict[str, np.ndarray] = {}
                for key in group.keys() if group is not None else ():
                    dataset = group[key]
                    name = dataset.attrs.get("name", key)
                    name = name.decode() if isinstance(name, bytes) else str(name)
                    tensors[name] = decode_dataset(dataset, f"{path}:{group_name}/{key}")
                out[group_name] = tensors
    except OSError as exc:
        raise TraceError(f"cannot read the capture {path}: {exc}; run `hooktrace check`") from exc
    return out


def explain(meta: Mapping[str, Any]) -> str:
    """One sentence: the operation and line that made the first non-finite value, or why the
    capture could not tell."""
    analysis = meta.get("analysis") or {}
    status = analysis.get("status")
    if status == "found":
        where = f" in {analysis['node']}" if analysis.get("node") else ""
        line = ""
        if analysis.get("file"):
            line = f" at {analysis['file']}:{analysis['line']}"
            if analysis.get("code"):
                line += f" ({analysis['code']})"
        standalone = (
            "reproduces standalone"
            if analysis.get("reproduces")
            else "did not reproduce standalone"
        )
        return f"{analysis['op']}{where}{line}; {standalone}"
    message = analysis.get("message") or "not analysed"
    return f"{status or 'not analysed'}: {message}"
