"""numba's cache of the kernels (hooktrace.recorder.stats.kernel_cache): a recording on a machine
whose cache lacks them starts at once on the eager route, a process of its own fills the
cache, the recording takes the one-pass kernel once it has, and the next run loads it."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numba
import numpy as np
import pytest

import hooktrace
from hooktrace.recorder.stats import kernel_cache, omp
from hooktrace.recorder.stats.stats import route

_SCRIPT = """
import json, os, sys, threading, time
import torch, hooktrace
from torch import nn
from hooktrace.recorder.stats import numba_kernels
from hooktrace.recorder.stats import stats

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same tensors every step
x = torch.randn(64, 256)
routes, histograms, deadline = [], [], time.monotonic() + 300
with hooktrace.record(model, sys.argv[1], histograms="param,output") as rec:
    while True:
        model(x).sum().backward(); opt.step(); opt.zero_grad(); rec.step()
        routes.append(stats.route_taken().description)
        histograms.append(numba_kernels.histograms() is not None)
        if routes[-1].startswith("one-pass") and histograms[-1] or time.monotonic() > deadline:
            break
        if sys.argv[2] == "short":
            break
        time.sleep(0.2)
try:
    os.waitpid(-1, os.WNOHANG)
    children = True
except ChildProcessError:
    children = False
print(json.dumps({"routes": routes, "histograms": histograms, "children": children,
                  "threads": [t.name for t in threading.enumerate()]}))
"""


def _env(cache: Path, **more: str) -> dict[str, str]:
    """This suite's environment but for numba's cache, and hooktrace's default (no
    ``HOOKTRACE_ONE_PASS``, conftest.py's) unless ``more`` sets it."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), **more}
    if "HOOKTRACE_ONE_PASS" not in more:
        env.pop("HOOKTRACE_ONE_PASS", None)
    return env


def _recording(out: Path, cache: Path, length: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(out), length], env=_env(cache, **env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _seen(recording: subprocess.Popen[str]) -> dict[str, list]:
    said, stderr = recording.communicate(timeout=400)
    assert recording.returncode == 0, stderr
    return json.loads(said)


def _fillers(cache: Path, called: bytes = b"c.main(") -> list[int]:
    """The fillers at work on ``cache``, by their command line and environment."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes()
            environment = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if called in command and f"NUMBA_CACHE_DIR={cache}".encode() in environment:
            found.append(int(proc.name))
    return found


_STAND_IN = (
    "import os, sys, time; sys.path.insert(0, sys.argv[1]);"
    "import hooktrace.recorder.stats.kernel_cache as c; c._end_with(int(sys.argv[2]));"
    "time.sleep({seconds}); open({marker!r}, 'w').close(); os.write(int(sys.argv[2]), b'ok')"
)
"""A filler that takes ``seconds`` to compile and leaves a marker where it has."""

_EXITS_AT_ONCE = """
import sys
from hooktrace.recorder.stats import kernel_cache
kernel_cache._FILL = sys.argv[1]
assert kernel_cache.fill()
print("started", flush=True)
"""


def _start(tmp_path: Path, seconds: float) -> tuple[subprocess.Popen[str], Path]:
    """A process that starts a stand-in filler and exits at once."""
    marker = tmp_path / "filled"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    stand_in = _STAND_IN.format(seconds=seconds, marker=str(marker))
    script = subprocess.Popen(
        [sys.executable, "-c", _EXITS_AT_ONCE, stand_in],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return script, marker


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_a_process_exits_once_its_filler_has_filled_the_cache(tmp_path: Path) -> None:
    """A first run shorter than the compile still fills the cache: its exit waits for the
    filler, and says why; once it has returned, nothing of hooktrace's runs (a CI job or a
    batch scheduler would wait for it or kill it). The compile is a stand-in of 4 s."""
    began = time.monotonic()
    script, marker = _start(tmp_path, 4)
    _, said = script.communicate(timeout=60)
    assert script.returncode == 0, said
    assert time.monotonic() - began >= 4
    assert marker.exists()
    assert said.startswith("hooktrace: compiling its faster statistics kernels for this machine")
    assert "Ctrl-C skips it" in said and "not compiled" not in said
    assert _fillers(tmp_path, b"c._end_with(") == []


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_ctrl_c_at_exit_skips_the_wait_and_ends_the_filler(tmp_path: Path) -> None:
    script, marker = _start(tmp_path, 120)
    assert script.stderr is not None
    assert "compiling its faster statistics kernels" in script.stderr.readline()
    script.send_signal(signal.SIGINT)
    _, said = script.communicate(timeout=20)
    assert script.returncode == 0, said
    assert said.strip() == "hooktrace: the kernels were not compiled; the next run starts again"
    deadline = time.monotonic() + 20
    while _fillers(tmp_path, b"c._end_with("):
        assert time.monotonic() < deadline, "the filler outlived the skipped wait"
        time.sleep(0.1)
    assert not marker.exists()


_STARTS_A_FILLER = """
import time
from hooktrace.recorder.stats import kernel_cache
assert kernel_cache.fill()
print("started", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_the_filler_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    """Killed by a scheduler or a timeout (no exit handler runs), the recording's process
    takes its filler with it, though the filler is in a session of its own."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("HOOKTRACE_ONE_PASS")
    script = subprocess.Popen(
        [sys.executable, "-c", _STARTS_A_FILLER], env=env, stdout=subprocess.PIPE, text=True
    )
    assert script.stdout is not None and script.stdout.readline() == "started\n"
    deadline = time.monotonic() + 60
    while not _fillers(tmp_path):
        assert time.monotonic() < deadline, "no filler started"
        time.sleep(0.1)
    script.kill()
    script.wait()
    deadline = time.monotonic() + 20
    while _fillers(tmp_path):
        assert time.monotonic() < deadline, "the filler outlived the process that started it"
        time.sleep(0.1)


def test_load_runs_a_warm_up_only_where_nothing_needs_compiling() -> None:
    @numba.njit
    def twice(x: float) -> float:
        return 2 * x

    assert kernel_cache.load(lambda: twice(1.0)) is False
    assert twice.signatures == []  # stopped before compiling
    assert twice(1.0) == 2.0  # outside load, numba compiles as ever
    assert kernel_cache.load(lambda: twice(3.0)) is True


def test_load_refuses_compiles_in_its_own_thread_only() -> None:
    @numba.njit
    def elsewhere(x: float) -> float:
        return x + 1

    @numba.njit
    def here(x: float) -> float:
        return x - 1

    results: list[float] = []

    def warm_up() -> None:
        other = threading.Thread(target=lambda: results.append(elsewhere(1.0)))
        other.start()
        other.join()
        here(1.0)

    assert kernel_cache.load(warm_up) is False
    assert results == [2.0]  # the script's own numba code, compiled in another thread
    assert here.signatures == []


def test_other_exceptions_of_a_warm_up_propagate() -> None:
    def broken() -> None:
        raise ImportError("no numba here")

    with pytest.raises(ImportError):
        kernel_cache.load(broken)


def _lock_path_for(env: dict[str, str]) -> str:
    probe = "from hooktrace.recorder.stats import kernel_cache as c; print(c._lock_path())"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    return done.stdout.strip()


def test_a_forked_child_neither_waits_for_nor_starts_a_filler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read, write = os.pipe()
    monkeypatch.setattr(kernel_cache, "_state", "running")
    monkeypatch.setattr(kernel_cache, "_report", read)
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say
        quiet = kernel_cache._state == "off" and not kernel_cache.fill()
        os._exit(0 if quiet and not kernel_cache.filled() else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert kernel_cache._state == "running"  # the parent still waits for its filler
    os.close(write)
    os.close(read)


def test_a_load_stopped_inside_join_leaves_the_threads_count_at_numbas_limit() -> None:
    """numba's thread count is per thread: a load stopped at a compile inside omp.join must
    not leave this thread's kernels on one thread (found in review)."""
    route()
    if omp.started() < 2:
        pytest.skip("numba's threads run on one thread here")

    class Stop(BaseException):
        pass

    def start() -> None:
        raise Stop

    with pytest.raises(Stop):
        omp.join(start)
    assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS


_NO_PROCESS = """
import os, sys, torch, hooktrace
from torch import nn
from hooktrace.recorder.stats import kernel_cache
from hooktrace.recorder.stats import stats

def refuse(*args, **kwargs):
    raise OSError("no more processes")

os.posix_spawn = refuse  # as where a process limit is reached
model = nn.Linear(256, 256)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with hooktrace.record(model, sys.argv[1], histograms="param,output"):
    for _ in range(3):
        model(torch.randn(64, 256)).sum().backward(); opt.step(); opt.zero_grad()
print(stats.route_taken().description, kernel_cache._state)
"""


def test_no_process_to_fill_the_cache_leaves_the_eager_routes_at_work(tmp_path: Path) -> None:
    """Where the filler cannot start, nothing raises into the hooks or the writer (the case
    that once raised from a thread that could not start): torch and numpy give the numbers."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "empty")}
    env.pop("HOOKTRACE_ONE_PASS")
    done = subprocess.run(
        [sys.executable, "-c", _NO_PROCESS, str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = "eager (numba's cache lacked the kernels; none could compile) off"
    assert done.stdout.split() == said.split()
    trace = hooktrace.load(tmp_path / "run")
    assert hooktrace.check(trace).whole
    counts = trace.histograms()
    assert len(counts) == 3 * 3  # weight, bias, output at each of 3 steps
    counted = counts[["zero", "nan", "pos_inf", "neg_inf"]].sum(axis=1)
    counted += np.stack(counts["pos"]).sum(axis=1) + np.stack(counts["neg"]).sum(axis=1)
    assert (counted == counts["numel"]).all()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_the_filler_yields_every_core_a_training_wants() -> None:
    probe = (
        "import os; from hooktrace.recorder.stats import kernel_cache as c; c._yield_to_training();"
        "print(os.sched_getscheduler(0) == os.SCHED_IDLE, os.nice(0))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "19"]


_CLOSED_STDIO = """
import os, sys, time
from hooktrace.recorder.stats import kernel_cache
os.close(0)
os.close(1)  # a daemon's: the report pipe's descriptors may take these numbers
started = kernel_cache.fill()
seen = []
deadline = time.monotonic() + 400
while not kernel_cache.filled() and time.monotonic() < deadline:
    seen.append(time.monotonic())
    time.sleep(0.5)
print(started, len(seen) > 10, kernel_cache.succeeded(), file=sys.stderr)
"""

_WAITER = "from hooktrace.recorder.stats import stats; print(stats.route().description)"


def test_a_cold_cache_is_compiled_once_and_every_process_takes_the_kernels(
    tmp_path: Path,
) -> None:
    """Whoever compiles holds the lock (another rank's filler, say): nothing is compiled
    beside it. Three processes wait for it: a recording, which starts at once on the eager
    route and whose own filler waits; a filler started from a process whose descriptors 0
    and 1 are closed (the report pipe may take those numbers: found in review); and a
    process that compiles in its own (``HOOKTRACE_ONE_PASS=wait``, as another rank may).
    Once the lock is let go, the first of them compiles, the others load what it compiled,
    and the recording takes the one-pass kernel. One cold compile serves them all (about a
    minute on a free core). Every process here has torch on one thread (torchrun's
    ``OMP_NUM_THREADS=1``), and whichever compiled, it compiled what a run on two threads
    loads (found in review: the threaded histogram kernel was left out)."""
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    one_thread = {"OMP_NUM_THREADS": "1"}
    processes: list[subprocess.Popen[str]] = []
    try:
        with open(_lock_path_for(_env(cache)), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            recording = _recording(tmp_path / "cold", cache, "long", **one_thread)
            processes.append(recording)
            starter = subprocess.Popen(
                [sys.executable, "-c", _CLOSED_STDIO], env=_env(cache, **one_thread),
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            processes.append(starter)
            waiter = subprocess.Popen(
                [sys.executable, "-c", _WAITER],
                env=_env(cache, HOOKTRACE_ONE_PASS="wait", **one_thread),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            processes.append(waiter)
            with pytest.raises(subprocess.TimeoutExpired):
                starter.wait(timeout=8)  # long enough to have compiled something, unlocked
            assert waiter.poll() is None, waiter.communicate()
            assert recording.poll() is None, recording.communicate()
            assert not any(cache.rglob("*.nbi"))
        _, stderr = starter.communicate(timeout=500)
        assert starter.returncode == 0, stderr
        assert stderr.split()[-3:] == ["True", "True", "True"], stderr  # seen running, then filled
        said, stderr = waiter.communicate(timeout=500)
        assert waiter.returncode == 0, stderr
        assert said.startswith("one-pass (numba "), said

        seen = _seen(recording)
    finally:  # a failed assertion leaves nothing running on CI's cores
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    routes = seen["routes"]
    assert routes[0] == "eager (numba's cache lacked the one-pass kernel; compiling it for later)"
    assert routes[-1].startswith("one-pass (numba ") and "eager before" in routes[-1]
    assert seen["histograms"][0] is False and seen["histograms"][-1] is True
    # nothing of hooktrace's outlives the recording: no thread in the middle of a compile
    # when the interpreter exits (that ended cold runs with SIGABRT)
    assert seen["threads"] == ["MainThread"]
    assert seen["children"] is False  # the filler is no child a script's os.wait() could meet
    trace = hooktrace.load(tmp_path / "cold")
    assert trace.manifest["ranks"]["0"]["stats_route"] == routes[-1]
    # the same tensors every step, summarised on both routes: the same within the last bits
    weight = trace.query(modules=["0"], kinds=["param"], columns=["step", "slot", "norm", "mean"])
    weight = weight[weight["slot"] == "weight"]
    assert len(weight) == len(routes) > 1
    np.testing.assert_allclose(weight["norm"], weight["norm"].iloc[0], rtol=1e-6)
    np.testing.assert_allclose(weight["mean"], weight["mean"].iloc[0], rtol=1e-5, atol=1e-9)
    counts = trace.histograms()
    first, last = counts[counts["step"] == 0], counts[counts["step"] == counts["step"].max()]
    assert len(first) == len(last) > 0
    np.testing.assert_array_equal(np.stack(first["pos"]), np.stack(last["pos"]))

    warm = _seen(_recording(tmp_path / "warm", cache, "short"))  # the next run loads it
    assert warm["routes"][0].startswith("one-pass (numba ")
    assert "eager before" not in warm["routes"][0]
    assert warm["histograms"] == [True]
    probe = (
        "import torch; torch.set_num_threads(2); from hooktrace.recorder.stats import kernel_cache as c;"
        "print(c.load(c.warm_up))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], env=_env(cache), capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "True"
