"""``hooktrace anomalies`` on a run of several ranks checks its logical tensors: on the
committed samples of examples/distributed.py (the same training in one process, under FSDP2
and under DDP on 2 ranks), a bound that the whole gradient passes and no rank's shard does
is found as in the one process, at the same steps; rank by rank (``--per-rank``), it is not.
"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

import hooktrace
from hooktrace.cli import cli

SAMPLES = Path(__file__).resolve().parents[3] / "sample_traces" / "distributed"
BOUND = 0.8
"""fc2's gradient norm (its weight's and bias's together) passes 0.8 at its largest (0.837):
each FSDP2 shard's stays under it (0.76 at most)."""


def _exploding(run: str, **options: object) -> list[tuple[str, int, int]]:
    found = hooktrace.anomalies(SAMPLES / run, exploding_above=BOUND, **options).findings
    chosen = found[found["kind"] == "exploding_gradient"]
    return list(zip(chosen["module"], chosen["step"], chosen["count"], strict=True))


def test_a_bound_on_the_whole_gradient_is_found_as_in_one_process() -> None:
    one = _exploding("one")
    assert one and {module for module, *_ in one} == {"fc2"}
    assert _exploding("fsdp2") == one
    assert _exploding("ddp") == one  # a replica's gradient is the whole: once
    assert _exploding("fsdp2", per_rank=True) == []  # each shard's norm is smaller


def test_the_cli_says_which_it_checked() -> None:
    bound = ["--exploding-above", str(BOUND)]
    logical = CliRunner().invoke(cli, ["anomalies", str(SAMPLES / "fsdp2"), *bound])
    assert logical.exit_code == 0, logical.output
    assert "the ranks' records as logical tensors" in logical.output
    assert "exploding_gradient" in logical.output
    apart = CliRunner().invoke(cli, ["anomalies", str(SAMPLES / "fsdp2"), *bound, "--per-rank"])
    assert apart.exit_code == 0 and "logical" not in apart.output
    assert "exploding_gradient" not in apart.output


def test_steps_the_run_does_not_hold_are_a_note_not_a_crash() -> None:
    """Chunks with no records (steps past the run's, a phase it never ran): the logical
    reads once raised IndexError on them."""
    found = hooktrace.anomalies(SAMPLES / "ddp", steps="100-200")
    assert found.logical and len(found) == 0
    assert "no records in the steps read" in " ".join(found.notes)
    for options in ({"steps": "100-200"}, {"phases": ["eval"]}):
        dead = hooktrace.dead_relus(SAMPLES / "ddp", **options)  # type: ignore[arg-type]
        assert dead.layers.empty and dead.notes
