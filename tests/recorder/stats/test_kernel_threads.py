"""The one-pass kernel on torch's OpenMP threads (hooktrace.recorder.stats.omp): that it joins them
here, that the results do not depend on how many threads ran, that starting numba's threads
leaves torch's settings as they were, and that a forked child keeps to one thread."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from hooktrace.recorder.stats import kernel, omp
from hooktrace.recorder.stats.stats import route


@pytest.mark.skipif(sys.platform != "linux", reason="torch's wheels use GNU OpenMP on Linux")
def test_large_tensors_are_read_on_torchs_threads_here() -> None:
    # the test set-up installs torch's wheel and numba: a failure to join must show here
    taken = route()
    assert taken.description.endswith(", on torch's OpenMP threads)"), taken.description
    limit = omp._limit
    assert omp.threads() == min(torch.get_num_threads(), limit)


def _spread(shape: tuple[int, ...]) -> torch.Tensor:
    """Runs of 1,000 values of magnitudes 2**-40 to 2**40 apart. Block sums of such values
    differ so much in scale that float64 sums of them round, and a change in the order the
    chunks' sums are added in shows in the last bits (random values of one scale sum
    exactly in float64, whatever the order)."""
    n = math.prod(shape)
    scales = 2.0 ** torch.randint(-40, 40, (n // 1000 + 1,)).repeat_interleave(1000)[:n]
    return (torch.randn(n) * scales).reshape(shape)


def _sums(x: torch.Tensor, dim: int | None) -> tuple[object, ...]:
    result = kernel.one_pass(x, dim)
    assert result is not None
    *sums, counts = result
    return (*sums, None if counts is None else counts.tolist())


@pytest.mark.parametrize(
    ("shape", "dim"),
    [
        ((1 << 17,), None),  # the smallest tensor that takes threads: 4 chunks, one row
        ((3, 70001), None),  # chunks end within blocks of a row
        ((2, 3, 70000), 1),  # rows of 137 blocks: chunks end within rows, units cut across
        ((32, 16, 32, 32), 1),  # a conv activation: rows of 1,024
        ((64, 16, 128), 2),  # units last: counted per column, rows folded 4 at a time
        ((256, 1000), 1),  # 1,000 columns a row, 32 rows a chunk
    ],
)
def test_threads_do_not_change_a_single_bit(
    shape: tuple[int, ...], dim: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    route()
    if omp.threads() < 2:
        pytest.skip("torch runs on one thread here")
    torch.manual_seed(0)
    spread = _spread(shape)
    for x in (torch.randn(shape), torch.relu(torch.randn(shape)), -torch.rand(shape) - 1, spread):
        assert x.numel() >= kernel._THREADS_FROM
        threaded = _sums(x, dim)
        # the same chunks one after another, as when torch is told to use one thread
        with monkeypatch.context() as m:
            m.setattr(omp, "threads", lambda: 1)
            single = _sums(x, dim)
        assert threaded == single
        # and against numpy in float64: exact extremes and counts, sums to float32 rounding
        x64 = x.numpy().astype(np.float64)
        total, squares, lo, hi, zeros, counts = threaded
        assert (lo, hi, zeros) == (x64.min(), x64.max(), int((x64 == 0).sum()))
        np.testing.assert_allclose([total, squares], [x64.sum(), (x64 * x64).sum()], rtol=1e-4)
        if dim is not None:
            others = tuple(d for d in range(x.dim()) if d != dim)
            assert counts == (x64 > 0).sum(axis=others).tolist()


def test_a_smaller_team_gives_the_same_result() -> None:
    route()
    if omp.threads() < 2:
        pytest.skip("torch runs on one thread here")
    x = _spread((32, 16, 32, 32))
    args = (x.data_ptr(), x.numel(), 32, 16, 1024, 1, False)
    both = omp.run(kernel._one_pass_threads, omp._limit, *args)
    one = omp.run(kernel._one_pass_threads, 1, *args)
    assert both[:-1] == one[:-1]  # finite, sums, extremes, zeros: to the last bit
    assert np.array_equal(both[-1], one[-1])  # positives per unit


def test_torch_on_more_threads_than_numba_started_with_reads_on_one() -> None:
    """A team smaller than torch's makes libgomp end torch's extra threads after each kernel
    call, and torch's next operator start them again."""
    route()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(omp._limit + 1)
        assert omp.threads() == 1
        torch.set_num_threads(1)
        assert omp.threads() == 1
    finally:
        torch.set_num_threads(before)


_SETTINGS = """
import json, torch
torch.set_num_threads(1)
from hooktrace.recorder.stats import omp
from hooktrace.recorder.stats.stats import route
gomp = omp._torch_openmp()
def settings():
    return [torch.get_num_threads(), gomp.omp_get_max_active_levels(), gomp.omp_get_nested()]
before = settings()
description = route().description
after = settings()
at_one = omp.threads()
torch.set_num_threads(2)
print(json.dumps([description, before, after, at_one, omp.threads()]))
"""


def test_starting_numbas_threads_leaves_torchs_settings_as_they_were() -> None:
    """numba's OpenMP layer sets the thread count to the CPU count and allows nesting as it
    starts, in the library torch runs on: a training told to use one thread would run on
    all of them after its first recorded step."""
    done = subprocess.run([sys.executable, "-c", _SETTINGS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    description, before, after, at_one, at_two = json.loads(done.stdout)
    assert description.endswith(", on torch's OpenMP threads)")
    assert after == before
    assert at_one == 1  # torch on one thread: so is the kernel
    assert at_two == 2


_FORK = """
import os, sys, torch
from hooktrace.recorder.stats import kernel
from hooktrace.recorder.stats import omp
from hooktrace.recorder.stats.stats import route
route()
assert omp.threads() > 1, omp.threads()
x = torch.randn(32, 16, 32, 32)
want = kernel.one_pass(x, 1)
pid = os.fork()
if pid == 0:  # numba stops a forked child that starts its OpenMP threads: one thread here
    got = kernel.one_pass(x, 1)
    same = got[:5] == want[:5] and (got[5] == want[5]).all()
    os._exit(0 if same and omp.threads() == 1 else 3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs on one thread here")
def test_a_forked_child_reads_on_one_thread() -> None:
    done = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0", done.stderr  # -15: the child was terminated


_MANY_UNITS = """
import resource, sys, torch
from hooktrace.recorder.stats import kernel
from hooktrace.recorder.stats.stats import route
route()
rows, units = int(sys.argv[1]), int(sys.argv[2])
x = torch.full((rows, units), 0.5)  # units of one value a row
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
total, squares, lo, hi, zeros, counts = kernel.one_pass(x, 1)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert counts.tolist() == [rows] * units and total == 0.5 * rows * units
print((after - before) // 1024)
"""


@pytest.mark.parametrize(("rows", "units"), [(2048, 32768), (16, 1 << 20)])  # 256 and 64 MB
def test_a_tensor_of_many_units_keeps_few_counts(rows: int, units: int) -> None:
    """Each chunk counts per column. With a chunk a row, the first tensor's counts took as
    much memory as its values; with a chunk a row up to 16 rows, the second's did."""
    done = subprocess.run(
        [sys.executable, "-c", _MANY_UNITS, str(rows), str(units)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < rows * units * 4 / 2**20 / 4  # MB over the peak before the call


_FORKED_FIRST = """
import os, sys, numba, torch, hooktrace
from hooktrace.recorder.stats.stats import summarize_with_activity

@numba.njit(parallel=True)
def own(n):  # the parent's own parallel code: numba's OpenMP layer started here
    total = 0
    for i in numba.prange(n):
        total += i
    return total

if sys.argv[1] == "numba":
    own(1000)
else:  # torch's OpenMP team started here
    torch.nn.functional.conv2d(torch.randn(8, 3, 32, 32), torch.randn(8, 3, 3, 3))
x = torch.relu(torch.randn(32, 16, 32, 32))
pid = os.fork()
if pid == 0:  # the child's first large tensor: its route is decided here
    torch.set_num_threads(1)  # GNU OpenMP's team did not survive the fork
    stats, counts = summarize_with_activity(x, 1)
    ok = counts.tolist() == (x > 0).sum(dim=(0, 2, 3)).tolist()
    os._exit(0 if ok else 3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.parametrize("started", ["numba", "torch"])
def test_a_process_forked_before_its_first_large_tensor_records_it(started: str) -> None:
    """The kernel's threads are started at the first large tensor. A child forked before it,
    from a parent whose OpenMP threads were running, was stopped by numba (SIGTERM) or hung
    in a parallel region waiting for threads the fork did not copy."""
    done = subprocess.run(
        [sys.executable, "-c", _FORKED_FIRST, started], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0", done.stderr  # -15: the child was terminated


_IMPORTED_IN_THE_CHILD = """
import os, torch
torch.nn.functional.conv2d(torch.randn(8, 3, 32, 32), torch.randn(8, 3, 3, 3))
x = torch.relu(torch.randn(32, 16, 32, 32))
pid = os.fork()
if pid == 0:  # hooktrace is imported here, in the child: its pid is the importer's
    torch.set_num_threads(1)  # GNU OpenMP's team did not survive the fork
    from hooktrace.recorder.stats.stats import summarize_with_activity
    stats, counts = summarize_with_activity(x, 1)
    os._exit(0 if counts.tolist() == (x > 0).sum(dim=(0, 2, 3)).tolist() else 3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_forked_child_that_imports_hooktrace_itself_records() -> None:
    """Such a child cannot tell it was forked, and starts numba's layer: on a team of one,
    which waits for no thread of the team the fork did not copy."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTED_IN_THE_CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0", done.stderr
