"""Reading ``manifest.json`` and each rank's ``status/rank=R.json``, field by field. Never
imports torch.

Apart from the reader because it is the one part of reading that is JSON, not Parquet or
HDF5: the version check that refuses a trace of another major format, and the field checks
that leave a damaged value out (with a warning, through ``leave_out``) rather than stop the
reading or hand an analysis the wrong type.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hooktrace.errors import FormatVersionError, TraceError, TraceNotFound
from hooktrace.trace import schema
from hooktrace.trace.paths import LeaveOut, one_line, rank_of, regular


def read_manifest(path: Path, leave_out: LeaveOut) -> dict[str, Any]:
    if not path.exists():
        raise TraceNotFound(
            f"{path.parent} is not a hooktrace run (no {schema.MANIFEST}): give a directory "
            "that `hooktrace record` or hooktrace.record() wrote"
        )
    try:
        if not regular(path):
            raise OSError(f"{schema.MANIFEST} is not a regular file")
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise TraceError(
            f"{path} is unreadable ({one_line(exc)}): the trace's manifest is damaged"
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != schema.FORMAT_NAME:
        raise TraceError(
            f"{path} is not a hooktrace manifest: give a run directory hooktrace wrote"
        )
    try:
        major, _ = schema.parse_version(str(manifest["format_version"]))
    except (KeyError, ValueError) as exc:
        raise TraceError(f"{path} has no valid format_version: the manifest is damaged") from exc
    ours, _ = schema.parse_version(schema.FORMAT_VERSION)
    if major > ours:
        raise FormatVersionError(
            f"{path.parent} has trace format {manifest['format_version']}, newer than this "
            f"hooktrace reads ({schema.FORMAT_VERSION}): upgrade hooktrace"
        )
    if major < ours:
        raise FormatVersionError(
            f"{path.parent} has trace format {manifest['format_version']}, older than this "
            f"hooktrace reads ({schema.FORMAT_VERSION}): read it with an older hooktrace"
        )
    return _valid_fields(manifest, _MANIFEST_FIELDS, schema.MANIFEST, leave_out)


def read_statuses(directory: Path, leave_out: LeaveOut) -> dict[int, dict[str, Any]]:
    statuses: dict[int, dict[str, Any]] = {}
    if not directory.is_dir():
        return statuses
    for path in sorted(directory.glob("rank=*.json")):
        try:
            rank = rank_of(path)
            if not regular(path):
                raise ValueError("not a regular file")
            payload = json.loads(path.read_bytes())
            if not isinstance(payload, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            leave_out(path, exc)
            continue
        where = f"{schema.STATUS_DIR}/{path.name}"
        statuses[rank] = _valid_fields(payload, _STATUS_FIELDS, where, leave_out)
        if statuses[rank].get("status") not in schema.STATUSES:
            leave_out(where, f"unknown status {payload.get('status')!r}: read as incomplete")
            statuses[rank]["status"] = schema.STATUS_INCOMPLETE
    return statuses


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _optional(check: Any) -> Any:
    return lambda value: value is None or check(value)


# field -> (what it must be, test): fields that fail are left out with a warning, so that one
# damaged value neither stops the reading nor reaches an analysis as the wrong type
_MANIFEST_FIELDS = {
    "world_size": ("a positive integer", lambda v: _count(v) and v > 0),
    "start_time": ("a number", _number),
    "command": ("a list of strings", _strings),
    "roots": ("a list of strings", _strings),
    "config": ("an object", lambda v: isinstance(v, dict)),
    **{
        key: ("a string", lambda v: isinstance(v, str))
        for key in ("hooktrace_version", "torch_version", "python_version", "platform")
    },
}


def _place(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"size", "rank"}
        and all(type(v) is int for v in value.values())
        and 0 <= value["rank"] < value["size"]
    )


_STATUS_FIELDS = {  # "status" itself is checked against schema.STATUSES
    "error": ("a string or null", _optional(lambda v: isinstance(v, str))),
    "start_time": ("a number", _optional(_number)),
    "end_time": ("a number or null", _optional(_number)),
    "writer_blocked_seconds": ("a number", _number),
    "stats_route": ("a string", lambda v: isinstance(v, str)),
    "stats_warmup_seconds": ("a number", _number),
    "data_parallel": ("an object of a size and a rank", _place),
    "notes": ("a list of strings", _strings),
    **{
        key: ("a count", _count)
        for key in ("steps_written", "records_written", "tensors_written", "steps_lost")
    },
}


def _valid_fields(
    payload: dict[str, Any], fields: dict[str, Any], where: str, leave_out: LeaveOut
) -> dict[str, Any]:
    valid = dict(payload)
    for key, (meaning, test) in fields.items():
        if key in valid and not test(valid[key]):
            leave_out(where, f"{key} is not {meaning} (got {_short(valid.pop(key))}): ignored")
    return valid


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
