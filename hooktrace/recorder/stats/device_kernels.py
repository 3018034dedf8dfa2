"""A GPU tensor's statistics and histogram, each in one Triton kernel compiled once per dtype.

torch's route (:mod:`hooktrace.recorder.stats.torch_route`) queues some 14 and 15
operations a tensor, a launch each, and the host pays for every launch: on a GPU that is
most of what recording a module call costs. Here each is a pass over the values by one
kernel (``triton_kernels.partials``, ``triton_kernels.bins``), then, for the statistics,
one program that combines the passes' partial results in float64 (``combine``): two
launches for the statistics, two for the histogram (its counts' fill, the kernel), nothing
waited for. A tensor of one block (up to ``BLOCK`` values, as most of a small model's are)
takes one launch for each: its statistics and their combination in one program
(``alone``, the same row), its histogram written whole by that block.

The numbers are torch's route's: each value read as float32, the statistics (mean,
population std, min, max, norm, zeros, NaNs, Infs) as one float64 row, equal to it up to
float32 rounding (the sums are taken in another order), with the CPU routes' NaN and Inf
rules (a NaN makes every statistic but the counts NaN, an Inf the std; the mean of values
holding an Inf is that Inf, where torch's ``var_mean`` on a device says NaN); the histogram's counts equal,
bin for bin. Each block's sums in a fixed order and one program combining them: the same
tensor gives the same row, bit for bit, every time.

Triton specialises a kernel on its arguments' values unless told not to: the sizes are
marked ``do_not_specialize``, so one compile serves every shape. Without Triton, or for
what the kernels do not take (float64 histograms, integers, tensors on devices Triton does
not drive), torch's route stands in: :func:`usable` says which.

``TRITON_INTERPRET=1`` runs the kernels on the CPU, in numpy: how the tests check them on
a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from hooktrace.recorder.stats import torch_route
from hooktrace.trace.histograms import WIDTH

BLOCK = 2048
"""Values a program of the first pass reads."""

PARTS = 1024
"""Partial results the combining program reads at a time."""

FIELDS = 9
"""A block's partial result: count, sum, centred sum of squares, sum of squares, min, max,
zeros, NaNs, Infs."""

HISTOGRAM_BINS = 1024
"""The histogram kernel's bins: ``WIDTH`` rounded up to a power of two, as Triton's
``tl.histogram`` wants."""

_OPTIONS = {"enable_fp_fusion": False}
"""Triton's options for every launch: each operation rounded as written (no fused
multiply-add), the same numbers whatever Triton's default (which 3.9 warns it will change:
a warning in the script's output otherwise)."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
"""What the kernels read (as float32, exactly); float64 for the statistics too, rounded to
float32 as torch's route rounds it."""


@functools.cache
def _triton() -> Any:
    """The kernels' module (``triton_kernels``: Triton compiles each at its first call), or
    None where Triton is missing, fails to import, or ``HOOKTRACE_DEVICE_KERNELS=0``."""
    if os.environ.get("HOOKTRACE_DEVICE_KERNELS", "1") == "0":
        return None
    try:
        from hooktrace.recorder.stats import triton_kernels
    except Exception:  # not installed, or an install that does not import
        return None
    return triton_kernels


def usable(x: torch.Tensor, *, histogram: bool = False) -> bool:
    """Whether the kernels take ``x``: a strided float tensor of some values, on a device
    Triton drives (a CPU tensor too where ``TRITON_INTERPRET=1``: the tests), where they
    gave torch's numbers on a probe of its dtype (:func:`_prove`). Never raises."""
    if type(x) not in _PLAIN or x.layout is not torch.strided or x.is_nested:
        return False  # (a subclass's data pointer is not its values')
    if x.numel() == 0 or (x.dtype not in _FLOATS and (histogram or x.dtype is not torch.float64)):
        return False
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not (x.is_cuda or (interpreted and x.is_cpu)):
        return False
    if _failed or _triton() is None:
        return False
    proven = _proven.get((x.device, x.dtype))
    return proven if proven is not None else _prove(x.device, x.dtype)


_failed: list[str] = []
"""Why the kernels were given up in this process (empty: they were not)."""

_proven: dict[tuple[torch.device, torch.dtype], bool] = {}


def _prove(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernels' first call on a device and dtype: compiled, and checked against torch's
    route on a probe that holds zeros, both signs, subnormals and a NaN. Where Triton
    fails or disagrees (another version, another device), they are given up for the
    process with a warning, and torch's route takes every tensor: never a wrong record,
    never a recording stopped. It waits for the device, once; not while a CUDA graph is
    captured (which forbids that) nor where the device lacks the memory: those tensors
    take torch's route, and a later one proves the kernels."""
    try:
        with _on(device):
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return False
            probe = torch.linspace(-3.0, 5.0, 5000, dtype=torch.float64).pow(5)
            probe[::7] = 0.0
            probe[1::11] *= 1e-40  # subnormal in float32 and bfloat16 (zero in float16)
            probe[4] = float("nan")
            x = probe.to(dtype).to(device)
            row = _summarize(x)
            expected = torch_route.summarize_on_device(x.float())
            same = torch.allclose(row, expected, rtol=1e-5, atol=1e-6, equal_nan=True)
            finite = x[~torch.isnan(x)]  # (the row's NaN leaves little to compare)
            one_block = x[:BLOCK]  # the one-launch kernels
            for values in (finite, one_block, one_block[one_block == one_block]):
                same = same and torch.allclose(
                    _summarize(values),
                    torch_route.summarize_on_device(values.float()),
                    rtol=1e-5,
                    atol=1e-6,
                    equal_nan=True,
                )
            if dtype is not torch.float64:
                for values in (x, one_block):
                    counts = torch.as_tensor(torch_route.histogram_torch(values))
                    same = same and bool(torch.equal(_histogram(values), counts))
    except torch.cuda.OutOfMemoryError:
        return False  # not the kernels' fault: a later tensor proves them
    except Exception as exc:  # any failure of Triton's: torch's route from now on
        _give_up(exc)
        return False
    if not same:
        _give_up(f"they disagreed with torch's operations on a {dtype} probe")
        return False
    _proven[(device, dtype)] = True
    return True


def _give_up(why: str | Exception) -> None:
    import warnings

    if isinstance(why, Exception):
        why = f"Triton failed: {type(why).__name__}: {(str(why).splitlines() or [''])[0]}"
    _failed.append(why)
    with contextlib.suppress(Exception):  # warnings made errors (-W error): it goes on
        warnings.warn(
            f"hooktrace: the GPU statistics kernels are not used ({why}); torch's operations "
            "compute the same statistics, a few more launches a tensor",
            RuntimeWarning,
            stacklevel=3,
        )


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as one contiguous row, in memory order: a view where they fill their
    memory without gaps (contiguous, transposed, channels-last), else a copy. Order does
    not matter to the kernels."""
    if x.is_contiguous():
        return x.view(-1)
    if _dense(x):
        return x.as_strided((x.numel(),), (1,))
    return x.contiguous().view(-1)


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s values fill ``numel`` elements of memory from its first, in some order
    of its dimensions (strides of a permutation of a contiguous shape)."""
    expected = 1
    pairs = zip(x.stride(), x.shape, strict=True)
    for stride, size in sorted((st, sz) for st, sz in pairs if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def summarize(x: torch.Tensor) -> torch.Tensor | None:
    """``torch_route.summarize_on_device``'s row of ``x`` (where :func:`usable`), queued; None
    where Triton failed (the kernels are then given up, and torch's route takes it)."""
    return _guarded(_summarize, x)


def histogram(x: torch.Tensor) -> torch.Tensor | None:
    """``torch_route.histogram_torch``'s counts of ``x`` (where :func:`usable` with
    ``histogram``), queued: ``WIDTH`` int64 counts on ``x``'s device; None where Triton
    failed, as :func:`summarize`."""
    return _guarded(_histogram, x)


def _guarded(
    kernel: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor | None:
    """``kernel(x)``, or None where it failed: out of memory leaves the kernels in use
    (torch's route, which copies nothing, may fit); any other failure gives them up."""
    try:
        return kernel(x)
    except torch.cuda.OutOfMemoryError:
        return None
    except Exception as exc:
        _give_up(exc)
        return None


def _summarize(x: torch.Tensor) -> torch.Tensor:
    flat = _flat(x.detach())
    if flat.numel() > BLOCK:
        return _in_blocks(flat)
    row = torch.empty(8, dtype=torch.float64, device=flat.device)
    with _on(flat.device):
        _triton().alone[(1,)](flat, row, flat.numel(), BLOCK=BLOCK, **_OPTIONS)
    return row


def _in_blocks(flat: torch.Tensor) -> torch.Tensor:
    """The statistics of ``flat`` (a contiguous row) by blocks, then their partial results
    combined: two launches. A tensor of one block takes one (``alone``), the same row."""
    kernels = _triton()
    n = flat.numel()
    blocks = -(-n // BLOCK)
    partials = torch.empty((blocks, FIELDS), dtype=torch.float32, device=flat.device)
    row = torch.empty(8, dtype=torch.float64, device=flat.device)
    with _on(flat.device):
        kernels.partials[(blocks,)](flat, partials, n, BLOCK=BLOCK, **_OPTIONS)
        kernels.combine[(1,)](partials, blocks, n, row, PARTS=PARTS, **_OPTIONS)
    return row


def _histogram(x: torch.Tensor) -> torch.Tensor:
    kernels = _triton()
    flat = _flat(x.detach())
    n = flat.numel()
    blocks = -(-n // BLOCK)
    alone = blocks == 1  # one block writes every count: nothing to fill first, no atomics
    make = torch.empty if alone else torch.zeros
    counts = make(HISTOGRAM_BINS, dtype=torch.int64, device=flat.device)
    with _on(flat.device):
        kernels.bins[(blocks,)](
            flat, counts, n, BLOCK=BLOCK, BINS=HISTOGRAM_BINS, ALONE=alone, **_OPTIONS
        )
    return counts[:WIDTH]


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Triton launches on the current device: ``device``, for the launch."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
