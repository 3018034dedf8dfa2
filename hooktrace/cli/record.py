"""``hooktrace record SCRIPT [ARGS]...``: record an unmodified training script."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from hooktrace.cli.common import CommandError
from hooktrace.trace.schema import COLD_ROUTE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# option name -> recorder keyword; the same keys are accepted in a --config TOML file
_KEYS = {
    "out": None,
    "modules": "modules",
    "exclude": "exclude",
    "every": "every",
    "steps": "steps",
    "full_every": "full_every",
    "full_steps": "full_steps",
    "full_modules": "full_modules",
    "inputs": "inputs",
    "params": "params",
    "max_tensor_mb": "max_tensor_mb",
    "compression": "compression",
    "strict": "strict",
    "overwrite": "overwrite",
    "capture_nonfinite": "capture_nonfinite",
    "capture_limit": "capture_limit",
    "capture_max_mb": "capture_max_mb",
    "histograms": "histograms",
    "histogram_every": "histogram_every",
}


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("script", type=click.Path())  # as typed: the script's sys.argv[0]
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--out",
    "-o",
    type=click.Path(path_type=Path),
    help="Run directory, e.g. -o runs/baseline. [default: runs/SCRIPT-TIMESTAMP]",
)
@click.option(
    "--modules",
    multiple=True,
    help="Record only modules whose name matches this regex (repeatable), e.g. --modules '^encoder\\.'.",
)
@click.option(
    "--exclude",
    multiple=True,
    help="Skip modules whose name matches this regex (repeatable), e.g. --exclude dropout.",
)
@click.option(
    "--every",
    type=click.IntRange(min=1),
    help="Record every N-th step, e.g. --every 10. [default: 1]",
)
@click.option("--steps", help="Record only these steps, e.g. '0-100,500,1000-'.")
@click.option(
    "--full-every",
    type=click.IntRange(min=1),
    help="Save full tensors every N-th step, e.g. --full-every 100.",
)
@click.option("--full-steps", help="Save full tensors at these steps, e.g. '0,10-12'.")
@click.option(
    "--full-modules",
    multiple=True,
    help="Save full tensors only of modules matching this regex (repeatable), e.g. --full-modules 'blocks\\.0'.",
)
@click.option(
    "--inputs/--no-inputs",
    default=None,
    help="Also record module inputs (needed for replay), e.g. --inputs. [default: no]",
)
@click.option(
    "--params/--no-params",
    default=None,
    help="Record parameters, buffers and gradients, e.g. --no-params to skip them. [default: yes]",
)
@click.option(
    "--max-tensor-mb",
    type=click.FloatRange(min=0),
    help="Do not save full tensors larger than this many MB, e.g. --max-tensor-mb 64. [default: 256]",
)
@click.option(
    "--compression",
    type=click.Choice(["none", "gzip", "lzf"]),
    help="Compress full tensors, e.g. --compression lzf. [default: none]",
)
@click.option(
    "--capture-nonfinite/--no-capture-nonfinite",
    default=None,
    help="Save in full the call where a NaN or Inf first appears and name the operation and line that made it, e.g. --no-capture-nonfinite to skip. [default: yes]",
)
@click.option(
    "--capture-limit",
    type=click.IntRange(min=0),
    help="Keep at most this many non-finite captures, e.g. --capture-limit 1. [default: 3]",
)
@click.option(
    "--capture-max-mb",
    type=click.FloatRange(min=0),
    help="Save at most this many MB of tensors per capture, e.g. --capture-max-mb 64; the rest are only named. [default: 256]",
)
@click.option(
    "--histograms",
    metavar="KINDS",
    help="Histogram these record kinds by binary exponent, e.g. --histograms grad_param,grad_output, or none. [default: param,grad_param]",
)
@click.option(
    "--histogram-every",
    type=click.IntRange(min=1),
    help="Histogram every N-th step (those with step % N == 0), e.g. --histogram-every 10. [default: 1]",
)
@click.option(
    "--strict",
    is_flag=True,
    default=None,
    help="A fault inside hooktrace stops training instead of only the recording, e.g. in CI.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    default=None,
    help="Replace a trace already in --out, e.g. --overwrite -o runs/demo.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path),
    help="TOML file with the same keys as the options, e.g. every = 10 (the command line wins).",
)
@click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="Say nothing on stderr before and after the run (the script's own output stays).",
)
def record(
    script: str, args: tuple[str, ...], config_file: Path | None, quiet: bool, **given: Any
) -> None:
    """Run SCRIPT with ARGS as `python SCRIPT ARGS` would, recording every model it trains.

    Every module of every model is recorded (statistics each step); the script's output,
    exceptions and exit code are its own. Options go before SCRIPT; everything after it is
    the script's.

    \b
    Example:
      hooktrace record --every 10 --full-steps 0,100 train.py --epochs 3
      hooktrace summary runs/train-20261120-101500
    """
    if args[:1] == ("--",):  # `hooktrace record train.py -- --lr 0.1`: the separator is ours
        args = args[1:]
    settings = _settings(config_file, given)
    if not Path(script).exists():
        if Path(script).name == "torchrun":  # a launcher, not a script
            raise CommandError(
                f"{script}: no such script; hooktrace record runs a Python script, and a launcher "
                "runs hooktrace: torchrun --nproc-per-node N -m hooktrace record [OPTIONS] SCRIPT"
            )
        if Path(script).name in ("python", "python3"):
            raise CommandError(
                f"{script}: no such script; hooktrace record runs the script itself: hooktrace "
                "record [OPTIONS] SCRIPT [ARGS]"
            )
        if script.startswith("-"):  # an option click did not know, taken for the script
            raise CommandError(
                f"no such option: {script} (hooktrace record --help lists them; the script's "
                "own options go after the script)"
            )
        raise CommandError(f"{script}: no such script; give the path of a Python training script")
    if not Path(script).is_file():
        raise CommandError(f"{script} is not a file; give the path of a Python training script")
    out = settings.pop("out", None)
    out = Path(out) if out else _default_out(Path(script))
    options = _recorder_options(settings)

    from hooktrace.errors import HooktraceError
    from hooktrace.recorder.hooks.select import (
        StepSelection,
        check_options,
        histogram_kinds,
        module_matcher,
    )

    try:  # every bad value is reported before the script starts, and before torch loads
        check_options(options)
        StepSelection(options.get("steps"), every=options.get("every", 1))
        StepSelection(options.get("full_steps"), every=options.get("full_every") or 1)
        for key in ("modules", "exclude", "full_modules"):
            typed = settings.get(key)
            for pattern in [typed] if isinstance(typed, str) else list(typed or ()):
                module_matcher(pattern, default=True)  # a bad one named as it was typed
            module_matcher(options.get(key), default=True)
        histogram_kinds(options.get("histograms"))
    except HooktraceError as exc:
        raise CommandError(str(exc)) from exc

    try:
        from hooktrace.recorder.recording.launch import run_script
    except ImportError as exc:
        raise CommandError(f"hooktrace record needs PyTorch ({exc}): pip install torch") from exc

    def started() -> None:  # once the output is found usable: an error there is one line
        if not quiet:
            click.echo(f"hooktrace: recording {script} into {out}", err=True)

    command = (
        ["hooktrace", *sys.argv[1:]]
        if sys.argv and sys.argv[0]
        else ["hooktrace", "record", str(script), *args]
    )
    recording_pid = os.getpid()
    try:
        code = run_script(
            script, list(args), out=out, options=options, command=command, started=started
        )
    except HooktraceError as exc:  # setting up failed, or --strict: finishing the trace did
        raise CommandError(str(exc)) from exc
    if not quiet and os.getpid() == recording_pid:  # not a child the script forked
        _report(out)
    sys.exit(code)


def _settings(config_file: Path | None, given: dict[str, Any]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if config_file is not None:
        try:
            loaded = tomllib.loads(config_file.read_text())
        except OSError as exc:
            raise CommandError(f"cannot read --config {config_file}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise CommandError(f"--config {config_file} is not valid TOML: {exc}") from exc
        unknown = sorted(set(loaded) - set(_KEYS))
        if unknown:
            raise CommandError(
                f"--config {config_file}: unknown key(s) {', '.join(unknown)}; use {', '.join(_KEYS)}"
            )
        settings.update(loaded)
    for key, value in given.items():
        if value is None or value == ():
            continue
        settings[key] = value
    return settings


def _recorder_options(settings: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in settings.items():
        target = _KEYS[key]
        if target is None:
            continue
        if key in ("modules", "exclude", "full_modules"):
            patterns = [value] if isinstance(value, str) else value
            if not isinstance(patterns, (list, tuple)) or not all(
                isinstance(p, str) for p in patterns
            ):  # (a TOML value of another kind)
                raise CommandError(
                    f"{key} is a regex or a list of regexes, such as 'blocks\\.0' (got {value!r})"
                )
            value = "|".join(f"(?:{p})" for p in patterns)  # regexes, searched in the name
        if key == "compression" and value == "none":
            value = None
        if key in ("steps", "full_steps") and isinstance(value, int):
            value = str(value)
        options[target] = value
    return options


def _report_captures(trace: Any, out: Path, rank: int) -> None:
    """The first capture of this rank, in a line, and the command that shows them all."""
    failed = int(trace.manifest["ranks"].get(str(rank), {}).get("nonfinite_captures_failed", 0))
    captures = trace.nonfinite_captures(rank=rank)
    if len(captures):
        first = captures.iloc[0]
        more = f" (and {len(captures) - 1} more)" if len(captures) > 1 else ""
        click.echo(
            f"hooktrace: a non-finite value began at step {first['step']} in {first['module']} "
            f"({first['pass']}){more}: {first['explanation']}; see "
            f"`hooktrace replay {out} --nonfinite`",
            err=True,
        )
    if failed:
        click.echo(f"hooktrace: {failed} non-finite capture(s) failed (warned above)", err=True)


def _default_out(script: Path) -> Path:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if run_id in ("", "none"):
            raise CommandError(
                "under torchrun every rank must write into one run: give --out DIR (or run "
                "torchrun with --rdzv-id or --standalone)"
            )
        return Path("runs") / f"{script.stem}-{run_id[:12]}"
    return Path("runs") / f"{script.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _route_said(route: str, warmup: float) -> str:
    """How the statistics were computed, as the final report says it: on a first run (numba's
    cache without hooktrace's kernels, a fresh install), in words that say what happens next
    rather than the route's description (which the trace's status keeps)."""
    if route.startswith("one-pass"):
        return f"{route}, {warmup:.2f} s to load, once"
    if route == COLD_ROUTE:
        return (
            "computed by torch's own operations this time: hooktrace's faster kernels were "
            "not compiled yet on this machine (a fresh install); a process at idle priority "
            "compiles them, once, and the next runs load them"
        )
    return route


def _many(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _why_empty(trace: Any) -> str:
    """Why a recording holds no record: what a newcomer checks first."""
    if trace.modules.empty:
        return "no nn.Module was called: hooktrace records the models the script calls"
    return (
        "modules were called, but no step ended: a step ends at an optimizer's step() over "
        "a recorded model's parameters"
    )


def _report(out: Path) -> None:
    try:
        from hooktrace.analyze.overview.summary import ended_in_training
        from hooktrace.trace.reader import load

        trace = load(out)
        steps = trace.steps
        # this process's rank only: each rank says its own, while others may still write
        rank = int(os.environ.get("RANK", "0"))
        if "rank" in steps.columns:
            steps = steps[steps["rank"] == rank]
        status = trace.manifest["ranks"].get(str(rank), {}).get("status", trace.status)
        who = f"rank {rank}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        trained = int((steps["micro_steps"] > 0).sum())  # the steps the script's log counts
        counted = _many(trained or len(steps), "step")
        if trained and trained < len(steps):
            untrained = sorted(int(n) for n in steps.loc[steps["micro_steps"] == 0, "step"])
            ended = ended_in_training(trace, untrained, status)
            others = len(untrained) - (ended is not None)
            if others:
                counted += (
                    f" and {others} of evaluation only" if others > 1 else " and an evaluation"
                )
            if ended is not None:
                counted += f" (step {ended} ended before its backward)"
        records = int(steps["records"].sum()) if len(steps) else 0
        why = ""
        if not records and status == "complete":
            why = f" ({_why_empty(trace)})"
        elif not records and status == "incomplete":  # (a failed script showed its own error)
            error = trace.manifest["ranks"].get(str(rank), {}).get("error")
            why = f": {error}" if error else ""
        click.echo(
            f"hooktrace: {who}{status}: {counted}, {_many(records, 'record')} in {out}{why}",
            err=True,
        )
        routes = {
            (s["stats_route"], s.get("stats_warmup_seconds", 0.0))
            for s in trace.manifest["ranks"].values()
            if "stats_route" in s
        }
        for route, warmup in sorted(routes)[:1]:  # ranks on one machine agree
            click.echo(f"hooktrace: statistics: {_route_said(route, warmup)}", err=True)
        _report_captures(trace, out, rank)
    except Exception as exc:  # the report is a courtesy; the script's exit code matters
        click.echo(f"hooktrace: wrote {out} ({exc})", err=True)
