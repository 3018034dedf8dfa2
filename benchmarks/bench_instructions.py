"""What recording costs the training thread per module call, in instructions: a figure that
does not move with the machine's load.

``bench_host.py`` times the same steps, and on a shared machine its figures move by a third
from one run to the next (the plain step alone: 31 to 59 us a module call within one hour).
Here each variant runs once under valgrind's callgrind, which counts the instructions the
training thread executes: the same steps give the same count, to a fraction of a percent,
so a change of 1% in the hot path shows, and two commits compare without interleaving.

The model and the variants are ``bench_host.py``'s (200 ``nn.Linear(8, 8)``, batch 2, SGD,
one torch thread), and ``hooks only``: the recorder's process-wide hooks and its step's
bookkeeping, nothing recorded at a module call (:func:`hooks_only`). Each variant runs in a process of its own under callgrind: warm-up steps,
then the steps counted, between two dumps of the training thread's counters (a client
request, from a three-line C shim compiled here). Counted: everything the training thread
executes in those steps, torch's work included; not the writer thread's (its flushes follow
the wall clock, which callgrind slows fifty-fold: its share is in ``bench_host.py``).
Instructions are not time: the numba kernels and memory-bound work count less than they
cost, Python's interpreter about what it costs (on this machine's CPU, about 6 instructions
a nanosecond for the plain step, timed at its fastest).

numba's kernels are compiled for a generic x86-64 CPU in both the warm-up and the counted
processes (``NUMBA_CPU_NAME=generic``): valgrind's virtual CPU is not the machine's, and a
kernel cached for one would be compiled again, in the counted run, for the other. glibc's
string instructions are switched off (:data:`NO_REP_STRINGS`).

Needs valgrind (with its headers, ``valgrind/callgrind.h``) and a C compiler. Two variants
run at a time, a few minutes each.

Run: python benchmarks/bench_instructions.py [--steps 10] [--layers 200]
     [--variants plain,no-op hook,defaults,...]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve().parent
SHIM = r"""
#include <valgrind/callgrind.h>
void dump(const char *tag) { CALLGRIND_DUMP_STATS_AT(tag); }
"""
WARM_UP_STEPS = 12
GENERIC_CPU = {"NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": "", "HOOKTRACE_ONE_PASS": "wait"}
NO_REP_STRINGS = {
    "GLIBC_TUNABLES": "glibc.cpu.x86_rep_stosb_threshold=0xffffffffffff:"
    "glibc.cpu.x86_rep_movsb_threshold=0xffffffffffff"
}
"""glibc's memset and memcpy use ``rep stosb`` / ``rep movsb`` above a few kilobytes, which
callgrind counts as an instruction a byte: zeroing a 562-bin histogram counted 4,500
instructions, and memset made 6% of the defaults' count. With these, they use vector
stores, counted as the CPU runs them."""
SHARES = {
    "histograms": ("defaults", "no histograms"),
    "non-finite capture": ("no histograms", "no capture"),
    "parameters, their gradients": ("no capture", "outputs only"),
    "outputs, output gradients": ("outputs only", "plain"),
}


def hooks_only(model: Any, out: Path) -> contextlib.AbstractContextManager[Any]:
    """``outputs only`` with nothing recorded at a module call: the recorder's process-wide
    hooks, looking the module up and returning, and its step's bookkeeping (no output is
    summarised, no gradient hooked)."""
    import hooktrace
    from hooktrace.recorder.hooks.hooks import Hooks

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(Hooks, "_on_forward", lambda *args, **kwargs: None))
    stack.enter_context(
        hooktrace.record(
            model,
            out / "run",
            overwrite=True,
            histograms=None,
            capture_nonfinite=False,
            params=False,
        )
    )
    return stack


def variants() -> dict[str, Callable[[Any, Path], contextlib.AbstractContextManager[Any]]]:
    """bench_host.py's variants on the CPU, and :func:`hooks_only`."""
    sys.path.insert(0, str(HERE))
    from bench_host import ON_THE_CPU, VARIANTS

    return {**VARIANTS, **ON_THE_CPU, "hooks only": hooks_only}


def child(variant: str, steps: int, layers: int, shim: str) -> None:
    """Runs under callgrind: warm-up steps, then ``steps`` counted between two dumps."""
    import torch
    from torch import nn

    chosen = variants()[variant]  # (puts bench_host.py on the path)
    from bench_host import make_model

    torch.set_num_threads(1)
    dump = ctypes.CDLL(shim).dump
    model = make_model(layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=generator)
    target = torch.randn(2, 8, generator=generator)

    def step() -> None:
        nn.functional.mse_loss(model(x), target).backward()
        opt.step()
        opt.zero_grad()

    with tempfile.TemporaryDirectory() as out, chosen(model, Path(out)):
        for _ in range(WARM_UP_STEPS):
            step()
        dump(b"warm")
        for _ in range(steps):
            step()
        dump(b"counted")


def counted(out_dir: Path) -> int:
    """The training thread's instructions between the two dumps, from callgrind's files."""
    for path in out_dir.glob("callgrind.out*"):
        text = path.read_text(errors="replace")
        if re.search(r"^desc: Trigger: Client Request: counted$", text, re.M):
            found = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            if found:
                return int(found.group(1))
    raise RuntimeError(f"no counted dump in {out_dir}")


def run_variant(variant: str, steps: int, layers: int, shim: str, work: Path) -> int:
    out_dir = work / re.sub(r"\W+", "_", variant)
    out_dir.mkdir()
    python = os.path.realpath(sys.executable)  # not a shim script: valgrind follows no exec
    command = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes",
        f"--callgrind-out-file={out_dir}/callgrind.out",
        python, __file__, "--child", variant, "--steps", str(steps), "--layers", str(layers),
        "--shim", shim,
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **GENERIC_CPU, **NO_REP_STRINGS}
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise RuntimeError(f"{variant!r} failed under callgrind (exit {done.returncode}):\n{tail}")
    return counted(out_dir)


def build_shim(work: Path) -> str:
    source, library = work / "shim.c", work / "libshim.so"
    source.write_text(SHIM)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return str(library)


def missing() -> str | None:
    """What this machine lacks to count instructions, or None."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (apt install valgrind)"
    if shutil.which("cc") is None:
        return "no C compiler (cc) to build the client-request shim"
    if not Path("/usr/include/valgrind/callgrind.h").exists():
        return "valgrind's headers are missing (valgrind/callgrind.h)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps counted a variant")
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--variants", default="plain,no-op hook,defaults,no histograms,"
                        "no capture,outputs only,hooks only,no collector")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--shim", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.layers, args.shim)
        return
    known = variants()
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in known]
    if unknown:
        raise SystemExit(
            f"bench_instructions: unknown variant(s) {unknown}; choose from {list(known)}"
        )
    lacking = missing()
    if lacking:
        raise SystemExit(f"bench_instructions: {lacking}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shim = build_shim(work)
        # numba's cache for the generic CPU, filled natively (a compile under valgrind is slow)
        warm = "from hooktrace.recorder.stats import kernel_cache; kernel_cache.warm_up()"
        subprocess.run([sys.executable, "-c", warm], check=True, env={**os.environ, **GENERIC_CPU})
        start = time.perf_counter()
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {
                v: pool.submit(run_variant, v, args.steps, args.layers, shim, work) for v in chosen
            }
            counts = {v: f.result() / args.steps / args.layers for v, f in futures.items()}
    print(
        f"training thread's instructions per module call: {args.layers} x nn.Linear(8, 8), "
        f"batch 2, SGD, {args.steps} steps counted after {WARM_UP_STEPS} "
        f"({time.perf_counter() - start:.0f} s under callgrind)"
    )
    plain = counts.get("plain")
    print(f"{'variant':<16}{'instructions':>14}{'x plain':>9}{'extra':>10}")
    for name, n in counts.items():
        ratio = f"{n / plain:>8.2f}x" if plain else f"{'':>9}"
        extra = f"{n - plain:>+10,.0f}" if plain and name != "plain" else f"{'':>10}"
        print(f"{name:<16}{n:>14,.0f}{ratio}{extra}")
    shares = {w: (a, b) for w, (a, b) in SHARES.items() if a in counts and b in counts}
    if "hooks only" in counts and "outputs only" in counts and "plain" in counts:
        shares["  of which hooks, bookkeeping"] = ("hooks only", "plain")
    if "no collector" in counts and "defaults" in counts:
        shares["Python's collector"] = ("defaults", "no collector")
    if shares:
        print("\neach option's share of the defaults, instructions per module call:")
        for what, (this, less) in shares.items():
            print(f"  {what:<30}{counts[this] - counts[less]:>+10,.0f}")


if __name__ == "__main__":
    main()
