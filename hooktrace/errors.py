"""The library's exception types.

Every message says what to do. Only the CLI turns these into exit codes; the library never
calls ``sys.exit``.
"""

from __future__ import annotations


class HooktraceError(Exception):
    """Base class of every error hooktrace raises on purpose."""


class TraceError(HooktraceError):
    """A trace cannot be read: missing, not a trace, corrupt, or of an unknown format."""


class TraceNotFound(TraceError):
    """The path given as a run does not exist or is not a run directory."""


class FormatVersionError(TraceError):
    """The trace was written by a newer format than this hooktrace reads."""


class TraceTooLarge(TraceError):
    """The trace holds more records than ``Trace.records`` loads into memory
    (``Trace.max_records``): read a part with ``Trace.query`` or ask ``Trace.sql``."""


class TensorNotRecorded(HooktraceError, LookupError):
    """A full tensor or record that the trace does not hold was asked for."""


class RecordingError(HooktraceError):
    """Recording was misconfigured or failed (raised at once only with ``strict=True``)."""


class ConfigError(HooktraceError, ValueError):
    """An option has a bad value."""


class TraceWarning(UserWarning):
    """Part of a trace was damaged and left out; the rest was read. The CLI prints each as
    one ``hooktrace: warning:`` line."""
