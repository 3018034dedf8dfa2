"""FrameWriter: the machine-readable output of ``diff`` and ``hist``, written chunk by chunk,
appears whole or not at all."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pandas as pd
import pytest

from hooktrace.cli.common import FrameWriter

CHUNKS = [pd.DataFrame({"step": [0, 1], "value": [0.5, 1.5]}), pd.DataFrame({"step": [2]})]


def write(output: Path, fmt: str = "json", *, fail: bool = False) -> None:
    with FrameWriter(fmt, output) as writer:
        for chunk in CHUNKS:
            writer.write(chunk.assign(value=1.0))
            if fail:
                raise RuntimeError("the command failed")


def test_the_output_appears_whole_with_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    out.write_text("earlier")
    out.chmod(0o640)
    write(out)
    assert [row["step"] for row in json.loads(out.read_text())] == [0, 1, 2]
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert list(tmp_path.iterdir()) == [out]


def test_a_failure_leaves_the_earlier_file_and_nothing_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    out.write_text("earlier")
    with pytest.raises(RuntimeError, match="the command failed"):
        write(out, "csv", fail=True)
    assert out.read_text() == "earlier" and list(tmp_path.iterdir()) == [out]


def test_a_failure_to_end_the_file_removes_what_was_written(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    writer = FrameWriter("json", out)
    with pytest.raises(IsADirectoryError), writer:
        writer.write(CHUNKS[0])
        out.mkdir()  # meanwhile: the rename at the end cannot happen
    assert list(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []


def test_a_link_is_written_through_not_replaced(tmp_path: Path) -> None:
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("earlier")
    link.symlink_to(target)
    write(link)
    assert link.is_symlink() and len(json.loads(target.read_text())) == 3


def test_a_pipe_is_written_where_it_is(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe.csv"
    os.mkfifo(pipe)
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.append(pipe.read_text()))
    reader.start()
    write(pipe, "csv")
    reader.join(timeout=10)
    assert read and read[0].splitlines()[0] == "step,value" and len(read[0].splitlines()) == 4
    assert stat.S_ISFIFO(pipe.stat().st_mode)
