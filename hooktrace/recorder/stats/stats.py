"""Statistics of tensors, computed on their own device without waiting for it.

Small CPU tensors (at most ``STAGED_MAX_VALUES`` values) are not summarised in the hook:
the hook copies their values aside (into a reused float64 buffer, ``staging.Staging``) and
the writer thread summarises all of a step's small tensors together, in float64
(:func:`summarize_staged`). For them, the fixed cost of a handful of reductions, each a
dispatch and a ``.item()``, outweighed the work. Where this process took the one-pass
route (below), which loads their compiled kernels too, the hook reads them in place
instead, with the very same float64 rows (:mod:`hooktrace.recorder.stats.staged_kernels`).

Larger contiguous CPU tensors with finite values take one pass for everything, the kernel
compiled by numba in :mod:`hooktrace.recorder.stats.kernel` (:func:`summarize_with_activity`).

The eager route remains for the rest (and for all of them where numba is missing). On an
accelerator, each function only queues tensor operations: nothing calls ``.item()`` or
``.cpu()`` or branches on a value, so hooks never synchronise the device; the results are
copied to the host once per step, in the background writer. On the CPU, reading a value is
not a synchronisation, and the statistics take a cheaper route that uses it: four
vectorised passes (mean, min/max, sum of squares, zero count) instead of ten, the standard
deviation derived from the sum of squares and the mean, and NaN/Inf counted only when min or
max says there is one.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.parameter import UninitializedTensorMixin as _LAZY  # type: ignore[attr-defined]

from hooktrace.recorder.stats import device_kernels, kernel_cache
from hooktrace.recorder.stats.torch_route import summarize_on_device
from hooktrace.trace import schema

STATS_WIDTH = 8
"""mean, std, min, max, norm, zero count, NaN count, Inf count (float64)."""

# Below this ratio of variance to mean square, var = E[x^2] - mean^2 loses too many digits
# to float32 rounding, and the CPU path takes the two-pass route instead.
_CANCELLATION = 1e-3

Stats = torch.Tensor | np.ndarray


_EXACT_F32_COUNT = 1 << 24
"""Sums of 0/1 values in float32 stay exact below this; above it, counts take integer kernels."""


STAGED_MAX_VALUES = 8192
"""CPU tensors up to this size are staged; larger ones are summarised in the hook."""


PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types summarised as they are; others go through :func:`unsupported` first."""


def usual(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be summarised as it is (the hot path's one question): a plain
    dense tensor of real values, not a subclass, nested, meta, quantized or complex one."""
    return (
        type(tensor) in PLAIN
        and not tensor.is_nested
        and not tensor.is_meta
        and not tensor.is_quantized
        and not tensor.is_complex()
    )


def python_subclass(tensor: torch.Tensor) -> bool:
    """A subclass defined in Python over a tensor's own values (no ``__torch_dispatch__`` of
    its own): summarised as the plain tensor it holds (:func:`plain`)."""
    kind = type(tensor)
    return (
        kind not in PLAIN
        and kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__
        and not isinstance(tensor, _LAZY)
        and not tensor.is_nested
    )


def unsupported(tensor: torch.Tensor) -> str | None:
    """Why hooktrace does not summarise ``tensor`` (the record's note says it), or None for
    a tensor that is summarised, if not as it is: a nested one over its values
    (:func:`nested_values`)."""
    kind = type(tensor)
    if isinstance(tensor, _LAZY):
        return "uninitialized (a lazy module's, before its first call)"
    if tensor.is_nested:
        return None
    if kind not in PLAIN:
        # a wrapper subclass (FakeTensor, FunctionalTensor, DTensor, ...): its operations
        # may run anything, a collective included; its values are not this process's
        return f"tensor subclass {kind.__module__}.{kind.__qualname__}"
    if tensor.is_meta:
        return "meta tensor (a shape, no values)"
    if tensor.is_quantized:
        return "quantized tensor"
    if tensor.is_complex():
        return "complex tensor"
    return None


def nested_values(tensor: torch.Tensor) -> torch.Tensor:
    """A nested tensor's values, its components flattened one after the other (1-D)."""
    with torch.no_grad():
        return torch.cat([part.detach().reshape(-1) for part in tensor.unbind()])


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A Python subclass's tensor as a plain one (the same memory): the statistics' operations
    must not reach the subclass's ``__torch_function__``, where the script would see them."""
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def shape_of(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape, or () for a tensor that has none to give (an uninitialized parameter)."""
    try:
        return tuple(tensor.shape)
    except (RuntimeError, ValueError):
        return ()


def stageable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a small CPU tensor whose statistics can wait for the writer."""
    return (
        type(tensor) in PLAIN
        and not tensor.is_nested
        and tensor.is_cpu
        and 0 < tensor.numel() <= STAGED_MAX_VALUES
        and tensor.layout == torch.strided
        and not tensor.is_complex()
        and not tensor.is_quantized
    )


def summarize_staged(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The statistics of consecutive segments of ``values``, one row per segment.

    ``values`` is float64, the staged tensors one after the other; ``lengths`` their sizes
    (each at least 1). Rows as :func:`summarize` returns them; here the standard deviation
    always takes two passes, in float64.
    """
    if len(lengths) == 0:
        return np.zeros((0, STATS_WIDTH))
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    n = lengths.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf propagate as they should
        mean = np.add.reduceat(values, starts) / n
        lo = np.minimum.reduceat(values, starts)
        hi = np.maximum.reduceat(values, starts)
        norm = np.sqrt(np.add.reduceat(values * values, starts))
        deviation = values - np.repeat(mean, lengths)
        std = np.sqrt(np.add.reduceat(deviation * deviation, starts) / n)
    zeros = np.add.reduceat(values == 0, starts, dtype=np.int64)
    nans = np.add.reduceat(np.isnan(values), starts, dtype=np.int64)
    infs = np.add.reduceat(np.isinf(values), starts, dtype=np.int64)
    std[(nans > 0) | (infs > 0)] = np.nan
    return np.stack([mean, std, lo, hi, norm, zeros, nans, infs], axis=1)


def activity_staged(values: np.ndarray, shape: tuple[int, ...], dim: int) -> np.ndarray:
    """:func:`activity` of a staged tensor: ``values`` is its flat float64 copy."""
    positive = values.reshape(shape) > 0
    others = tuple(d for d in range(len(shape)) if d != dim)
    return positive.sum(axis=others, dtype=np.int64) if others else positive.astype(np.int64)


def scratch_view(scratch: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A float32 view of ``scratch`` shaped like ``like``, where one fits (CPU counts only)."""
    if scratch is None or not like.is_cpu or scratch.numel() < like.numel():
        return None
    if like.numel() >= _EXACT_F32_COUNT:
        return None
    return scratch[: like.numel()].view(like.shape)


def summarize(tensor: torch.Tensor, *, scratch: torch.Tensor | None = None) -> Stats | None:
    """The statistics vector of ``tensor``: float64, ``STATS_WIDTH`` long.

    Computed in float32 (float64 inputs are rounded to float32 first); ``std`` is the
    population standard deviation (numpy's default, ddof=0). A numpy array on the CPU, a
    tensor on the tensor's device elsewhere. None for tensors that hold no values to
    summarise (empty, complex, quantized, meta).
    """
    if not tensor.is_cpu and device_kernels.usable(tensor):
        row = device_kernels.summarize(tensor)  # one pass, two launches
        if row is not None:
            return row
    x = _values(tensor)
    if x is None:
        return None
    if x.is_cpu:
        return _summarize_on_host(x, scratch_view(scratch, x))
    return summarize_on_device(x)


def summarize_with_activity(
    tensor: torch.Tensor, dim: int | None, *, scratch: torch.Tensor | None = None
) -> tuple[Stats | None, torch.Tensor | np.ndarray | None]:
    """:func:`summarize` and, where ``dim`` is given, :func:`activity` of ``tensor``.

    A CPU tensor with finite values takes one pass for both (the compiled kernel, where
    numba is installed; its counts are a numpy int64 array); anything else takes
    :func:`summarize` and :func:`activity` (counts as a tensor).
    """
    if tensor.dtype is torch.float32 and tensor.is_cpu and tensor.layout is torch.strided:
        x: torch.Tensor | None = tensor.detach()  # what _values would make of it, sooner
    else:
        x = _values(tensor)
    n = x.numel() if x is not None else 0
    one_pass = route().one_pass if x is not None and x.is_cpu and 0 < n < 1 << 31 else None
    if x is not None and one_pass is not None:
        dense, dense_dim = _in_memory_order(x, dim)  # dim as it lies in ``dense``
        sums = one_pass(dense, dense_dim)
        if sums is not None:
            total, squares, lo, hi, zeros, counts = sums
            mean = total / n
            row = [mean, _std(x, mean, squares), lo, hi, math.sqrt(squares), zeros, 0, 0]
            return np.array(row, dtype=np.float64), counts
    stats = summarize(tensor, scratch=scratch)
    return stats, activity(tensor, dim, scratch=scratch) if dim is not None else None


@dataclass(frozen=True)
class Route:
    """How this process summarises CPU tensors: the one-pass kernel (and the small tensors'
    kernels beside it), or the eager route where it is missing or switched off (``one_pass``
    None)."""

    description: str
    warmup_s: float
    one_pass: Callable[..., Any] | None
    filling: bool = False
    """numba's cache lacked the kernels and a process of their own compiles them into it:
    :func:`route` loads them once it has ended."""


_route: Route | None = None
_route_lock = threading.Lock()
_first_asked = 0.0


def route() -> Route:
    """The route, decided on first use and kept for the life of the process; on first use it
    also loads the kernels from numba's cache (the one-pass kernel, the small tensors' and
    the histograms'), which :attr:`Route.warmup_s` reports.

    Where the cache lacks them, large tensors take the eager route while a process of their
    own compiles them (:mod:`hooktrace.recorder.stats.kernel_cache`), and the route changes once,
    to the one-pass kernel, when it has ended: a first recording starts at once, and its
    statistics on either side agree to float32 rounding. ``HOOKTRACE_ONE_PASS=0`` keeps to
    the eager route; ``HOOKTRACE_ONE_PASS=wait`` compiles here, before the first large
    tensor, after any other process compiling them (benchmarks, and tests that check the
    kernel).
    """
    global _route
    taken = _route
    if taken is None or (taken.filling and kernel_cache.filled()):
        with _route_lock:  # hooks may fire in several threads; load once
            if _route is None or (_route.filling and kernel_cache.filled()):
                _route = _decide(_route)
            taken = _route
    return taken


def _decide(before: Route | None) -> Route:
    """The route now: ``before`` is the eager route taken while the kernels compiled aside."""
    global _first_asked
    if os.environ.get("HOOKTRACE_ONE_PASS", "1") == "0":
        return Route("eager (HOOKTRACE_ONE_PASS=0)", 0.0, None)
    start = time.perf_counter()
    _first_asked = _first_asked or start
    try:
        from hooktrace.recorder.stats import kernel

        def load() -> None:
            threads.append(kernel_cache.warm_up())

        threads: list[str | None] = []  # why the kernel keeps to one thread, if it does
        if kernel_cache.compile_here():
            kernel_cache.compile_in_turn(load)
        elif not kernel_cache.load(load):
            if before is not None:
                why = (
                    "numba's cache lacked the kernels even once compiled"
                    if kernel_cache.succeeded()
                    else "compiling the kernels failed: python -m hooktrace.recorder.stats.kernel_cache"
                    " says why"
                )
                return Route(f"eager ({why})", 0.0, None)
            if not kernel_cache.fill():
                return Route(
                    "eager (numba's cache lacked the kernels; none could compile)", 0, None
                )
            return Route(
                schema.COLD_ROUTE,
                0.0,
                None,
                filling=True,
            )
    except Exception as exc:  # numba missing, or unable to compile here
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Route(f"eager (no one-pass kernel: {reason})", 0.0, None)
    version = kernel.numba.__version__
    on = "on torch's OpenMP threads" if threads[0] is None else f"one thread: {threads[0]}"
    if before is not None:
        on += f", from {start - _first_asked:.1f} s after the first large tensor, eager before"
    return Route(f"one-pass (numba {version}, {on})", time.perf_counter() - start, kernel.one_pass)


def route_taken() -> Route | None:
    """The route if this process has summarised a CPU tensor yet, else None."""
    return _route


def numba_loaded() -> bool:
    """Whether this process took the one-pass route, and so loaded numba: other compiled
    kernels (the histograms') may then be loaded too. A run with no CPU tensor (a GPU model)
    never imports numba."""
    return _route is not None and _route.one_pass is not None


def _in_memory_order(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, int | None]:
    """``x`` as a contiguous tensor, and where ``dim`` went: a transposed or permuted tensor
    (a sequence model's (time, batch, features) activations) is viewed with its dimensions in
    the order they lie in memory; anything else (slices, broadcasts) is copied."""
    if x.is_contiguous():
        return x, dim
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: -strides[d])
    view = x.permute(order)
    if not view.is_contiguous():
        return x.contiguous(), dim
    return view, order.index(dim) if dim is not None else None


def _summarize_on_host(x: torch.Tensor, scratch: torch.Tensor | None) -> np.ndarray:
    n = x.numel()
    lo_t, hi_t = torch.aminmax(x)
    lo, hi = lo_t.item(), hi_t.item()
    mean = x.mean().item()
    if x.is_contiguous():  # BLAS: twice as fast as vector_norm here, and more accurate
        flat = x.view(-1)
        norm = math.sqrt(torch.dot(flat, flat).item())
    else:
        norm = torch.linalg.vector_norm(x).item()
    if scratch is not None:  # 0/1 as float32, summed by the vectorised float kernel
        zeros = int(torch.eq(x, 0, out=scratch).sum().item())
    else:
        zeros = n - int(torch.count_nonzero(x))
    nans = infs = 0
    if not (math.isfinite(lo) and math.isfinite(hi)):  # NaN propagates into min and max
        nans = int(torch.count_nonzero(torch.isnan(x)))
        infs = int(torch.count_nonzero(torch.isinf(x)))
    std = math.nan if nans or infs else _std(x, mean, norm * norm)
    return np.array([mean, std, lo, hi, norm, zeros, nans, infs], dtype=np.float64)


def _std(x: torch.Tensor, mean: float, squares: float) -> float:
    """The population standard deviation of ``x``, from its mean and its sum of squares."""
    n = x.numel()
    mean_square = squares / n
    var = mean_square - mean * mean
    if var <= _CANCELLATION * mean_square:  # spread small against the offset: two passes
        # the deviations' own mean takes out the error of the float32 mean they are taken
        # from (half a float32 step of the offset: 3% of the spread of 1000 + 1e-3 * randn)
        deviations = x - mean
        shift = deviations.mean().item()
        var = (torch.linalg.vector_norm(deviations).item() ** 2) / n - shift * shift
    return math.sqrt(max(var, 0.0))


def unit_dim(tensor: torch.Tensor, *, channels_first: bool) -> int | None:
    """The dimension whose entries are units (channels or neurons), or None for scalars.

    (N, C, ...) conv-shaped activations count per channel (dim 1); everything else per entry
    of the last dimension. ``channels_first`` decides for 3-D tensors, which are (N, C, L)
    after a Conv1d but (batch, time, features) in a sequence model.
    """
    if tensor.dim() == 0:
        return None
    if tensor.dim() >= 4 or (tensor.dim() == 3 and channels_first):
        return 1
    return tensor.dim() - 1


def activity(
    tensor: torch.Tensor, dim: int, *, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """How many values of each unit along ``dim`` were positive (one count per unit).

    int64; on the CPU, float32 holding whole numbers (exact: a unit counts fewer than 2**24
    values wherever the scratch buffer is used), which the writer turns into int64.
    """
    x = tensor.detach()
    others = [d for d in range(x.dim()) if d != dim]
    if not others:
        return (x > 0).to(torch.int64)
    view = scratch_view(scratch, x) if x.dtype == torch.float32 else None
    if view is not None:  # a bool tensor summed into int64 is first copied whole to int64
        return torch.gt(x, 0, out=view).sum(dim=others)
    return (x > 0).sum(dim=others, dtype=torch.int64)


def _values(tensor: torch.Tensor) -> torch.Tensor | None:
    if tensor.is_meta or tensor.is_quantized or tensor.is_complex():
        return None
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    if tensor.numel() == 0:
        return None
    x = tensor.detach()
    return x if x.dtype == torch.float32 else x.float()
