"""The trace format: the contract between the recorder and the analyzer.

docs/FORMAT.md describes the same thing for people; this module is its single source in code.
Nothing here imports torch.

A run directory::

    manifest.json                         run-level facts, written once when recording starts
    status/rank=R.json                    per-rank status, replaced atomically as recording goes
    records/rank=R/part-NNNNNN.parquet    one row per recorded tensor per call per step
    steps/rank=R/part-NNNNNN.parquet      one row per recorded step
    modules/rank=R/part-NNNNNN.parquet    one row per module, written when first seen
    tensors/rank=R/seg-NNNNNN.h5          per-unit activity and full tensors of one flush
    captures/rank=R/capture-NNN.h5        since 1.2: a call where a NaN or Inf began, in full
                                          (hooktrace.trace.captures)
    histograms/rank=R/part-NNNNNN.parquet since 1.3: fixed-bin histograms of chosen records
                                          (hooktrace.trace.histograms)

Every file appears under its final name only once it is complete (written under a dot-prefixed
temporary name, closed, then renamed), and a records part is renamed only after the HDF5
segment it points into. So whatever a reader sees is whole.
"""

from __future__ import annotations

from typing import Final

import pyarrow as pa

FORMAT_NAME: Final = "hooktrace"
FORMAT_VERSION: Final = "1.4"
"""major.minor: a reader reads every minor version of its own major version."""

TENSOR_CHECKSUM: Final = "crc32"
"""Attribute of each full tensor's dataset: zlib.crc32 of its data bytes as stored."""

MANIFEST: Final = "manifest.json"
STATUS_DIR: Final = "status"
RECORDS_DIR: Final = "records"
STEPS_DIR: Final = "steps"
MODULES_DIR: Final = "modules"
TENSORS_DIR: Final = "tensors"

KINDS: Final = (
    "input",
    "output",
    "grad_output",
    "param",
    "buffer",
    "grad_param",
    "tensor",
    "grad_tensor",
)
GRAD_KINDS: Final = frozenset({"grad_output", "grad_param", "grad_tensor"})
PHASES: Final = ("train", "eval")

STATUS_RECORDING: Final = "recording"
STATUS_COMPLETE: Final = "complete"
STATUS_FAILED: Final = "failed"
STATUS_INCOMPLETE: Final = "incomplete"
STATUSES: Final = (STATUS_RECORDING, STATUS_COMPLETE, STATUS_FAILED, STATUS_INCOMPLETE)

NO_GRADIENT_DTYPE: Final = "None"
"""dtype of a record with no value: a grad_param row whose parameter had no gradient
(``p.grad is None``), or a param/buffer row whose module set it to None."""

STAT_COLUMNS: Final = ("mean", "std", "min", "max", "norm", "zero_fraction")
COUNT_COLUMNS: Final = ("nan_count", "inf_count")

_dict_str = pa.dictionary(pa.int32(), pa.string())

# One row per recorded tensor per call per step. ``rank`` is not stored in the files: it is
# the hive partition key of the directory (records/rank=R/...).
RECORD_SCHEMA: Final = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("micro_step", pa.int32(), nullable=False),
        pa.field("phase", _dict_str, nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("module", _dict_str, nullable=False),
        pa.field("call", pa.int32(), nullable=False),
        pa.field("kind", _dict_str, nullable=False),
        pa.field("slot", _dict_str, nullable=False),
        pa.field("dtype", _dict_str, nullable=False),
        pa.field("shape", pa.string(), nullable=False),
        pa.field("numel", pa.int64(), nullable=False),
        pa.field("mean", pa.float64()),
        pa.field("std", pa.float64()),
        pa.field("min", pa.float64()),
        pa.field("max", pa.float64()),
        pa.field("norm", pa.float64()),
        pa.field("zero_fraction", pa.float64()),
        pa.field("nan_count", pa.int64()),
        pa.field("inf_count", pa.int64()),
        # per-unit activity: `units` positive-counts at `activity_offset` in the segment's
        # /activity array, each counted over `unit_size` values; units == 0 when not recorded.
        pa.field("units", pa.int32(), nullable=False),
        pa.field("unit_size", pa.int64(), nullable=False),
        pa.field("activity_offset", pa.int64(), nullable=False),
        # where the activity and the full tensor live: a path relative to the run directory,
        # and the dataset inside it ("" when no full tensor was saved).
        pa.field("segment", _dict_str),
        pa.field("tensor_key", pa.string(), nullable=False),
        # how the module was called (JSON: args and kwargs with tensors as slots, plain
        # values kept, mode and RNG state), on a call's first input row when its inputs were
        # saved in full; "" elsewhere. What replay needs.
        pa.field("call_spec", pa.string(), nullable=False),
        # since 1.1: why a record holds no statistics, or how they were taken, where that is
        # not the usual way ("skipped: ..." for a tensor hooktrace cannot summarise, whose
        # statistics are null; "nested: ..."); "" otherwise. Null in 1.0 traces.
        pa.field("note", _dict_str),
        # since 1.4: what a record of a distributed tensor's local shard (a DTensor's: FSDP2's
        # parameters and gradients, tensor parallelism's) is a part of; "" for a whole
        # tensor. The logical tensor's shape, the device mesh's shape and this rank's
        # coordinate in it ("2,2", "0,1"), the placements one per mesh dimension ("S(0)": a
        # shard along dimension 0, "R": a replica, "P(sum)": a partial sum not yet reduced),
        # and the shard's offset in the logical tensor ("32,0"). The statistics are the
        # shard's own, ``shape`` and ``numel`` its own.
        pa.field("logical_shape", _dict_str),
        pa.field("mesh_shape", _dict_str),
        pa.field("mesh_coord", _dict_str),
        pa.field("placements", _dict_str),
        pa.field("shard_offset", _dict_str),
    ]
)

SHARD_COLUMNS: Final = ("logical_shape", "mesh_shape", "mesh_coord", "placements", "shard_offset")
"""The columns that say what a shard is a part of (since 1.4)."""

EMPTY_WHEN_ABSENT: Final = ("note", *SHARD_COLUMNS)
"""Text columns that read "" in parts of an older minor version, which lack them."""

NOTE_SKIPPED: Final = "skipped: "
"""The prefix of the note of a record whose tensor was not summarised; the reason follows."""

COLD_ROUTE: Final = "eager (numba's cache lacked the one-pass kernel; compiling it for later)"
"""A rank status's ``stats_route`` on a first run, whose numba cache lacked hooktrace's
kernels: torch's reductions, while a process aside compiles the kernels for later runs."""

STEP_SCHEMA: Final = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("micro_steps", pa.int32(), nullable=False),
        pa.field("skipped", pa.bool_(), nullable=False),
        pa.field("records", pa.int64(), nullable=False),
        pa.field("full_tensors", pa.int64(), nullable=False),
        pa.field("dropped", pa.int64(), nullable=False),
        pa.field("start_time", pa.float64(), nullable=False),
        pa.field("end_time", pa.float64(), nullable=False),
    ]
)

MODULE_SCHEMA: Final = pa.schema(
    [
        pa.field("module", pa.string(), nullable=False),
        pa.field("type", pa.string(), nullable=False),
        pa.field("root", pa.string(), nullable=False),
        pa.field("parent", pa.string(), nullable=False),
        pa.field("depth", pa.int32(), nullable=False),
        pa.field("parameters", pa.int64(), nullable=False),
        pa.field("first_step", pa.int64(), nullable=False),
    ]
)

PARTITIONING: Final = pa.schema([pa.field("rank", pa.int32())])


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


def segment_name(index: int) -> str:
    return f"seg-{index:06d}.h5"


def rank_dir(kind_dir: str, rank: int) -> str:
    return f"{kind_dir}/rank={rank}"


def temporary_name(final_name: str) -> str:
    """Dot-prefixed: pyarrow, DuckDB and hooktrace's reader all skip such files."""
    return f".{final_name}.tmp"


def parse_version(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    return int(major), int(minor or 0)
