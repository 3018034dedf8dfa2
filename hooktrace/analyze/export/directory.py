"""Where an export goes: a directory of its own, written beside it and put in place whole.

An export writes into a hidden directory beside its target and renames it into place once
every file is written, leaving ``hooktrace-export.json`` (what run, when, which options)
in it. So the target never holds half an export, nor two; and an earlier export is replaced
only when asked, by the same renames, while a directory hooktrace did not write is never
replaced. Never imports torch.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from hooktrace.errors import ConfigError

MARKER = "hooktrace-export.json"
"""The file an export leaves in its directory, saying what it holds (and that it may be
replaced)."""


def check(target: Path, run: Path, *, overwrite: bool) -> None:
    """ConfigError unless ``target`` is new, empty, or an earlier export that ``overwrite``
    lets go; and unless replacing it by a rename would be harmless (not the run, nor the
    current directory, nor a link)."""
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target} is a file: give a directory for the export")
    if target.is_symlink():  # the rename that puts an export in place would replace the link
        raise ConfigError(f"{target} is a symbolic link: give the directory it points to")
    resolved, source = target.resolve(), run.resolve()
    if source == resolved or resolved in source.parents:
        raise ConfigError(
            f"{target} holds the run {run}: give a directory of its own for the export"
        )
    here = Path.cwd().resolve()
    if resolved == here or resolved in here.parents:
        raise ConfigError(
            f"{target} is the current directory or holds it, which the export would replace: "
            "give a directory below it (e.g. tb/NAME)"
        )
    if not target.is_dir() or not any(target.iterdir()):
        return
    marker = target / MARKER
    if not marker.is_file():
        raise ConfigError(
            f"{target} is not empty and holds no hooktrace export: give a new directory, one "
            "per run (e.g. tb/NAME, then `tensorboard --logdir tb` compares them)"
        )
    if not overwrite:
        try:
            earlier = json.loads(marker.read_text()).get("run", "a run")
        except (OSError, ValueError, AttributeError):
            earlier = "a run"
        raise ConfigError(
            f"{target} holds an earlier export (of {earlier}): give --overwrite to replace it, "
            "or a new directory"
        )


class Staging:
    """The hidden directory beside ``target`` that an export is written into."""

    def __init__(self, target: Path) -> None:
        self.target = target
        target.parent.mkdir(parents=True, exist_ok=True)
        self.path = target.parent / f".{target.name}.hooktrace-export-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()

    def publish(self, run: Path, **facts: Any) -> None:
        """Leave the marker (the run, the time, ``facts``) and put the export in place of
        ``target`` (an empty directory or an earlier export) by renames: a reader sees the
        old export or the new one, never a mix."""
        from hooktrace.package import __version__

        marker = {"run": str(run.resolve()), "exported_at": time.time()}
        marker |= {"hooktrace_version": __version__, **facts}
        (self.path / MARKER).write_text(json.dumps(marker, indent=2, default=str) + "\n")
        if not self.target.exists():
            self.path.rename(self.target)
            return
        old = self.target.parent / f".{self.target.name}.hooktrace-replaced-{uuid.uuid4().hex[:12]}"
        self.target.rename(old)
        try:
            self.path.rename(self.target)
        except BaseException:
            old.rename(self.target)
            raise
        shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
