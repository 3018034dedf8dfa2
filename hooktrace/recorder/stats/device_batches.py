"""Many small tensors on one device summarised together: their statistics and histograms in
a fixed number of launches, whatever their number.

A step's parameters, buffers and gradients are hundreds of tensors, most of them small (biases,
norms' scales); one by one, each costs the host two launches for its statistics and two for
its histogram with the Triton kernels (:mod:`hooktrace.recorder.stats.device_kernels`), 14 and
15 with torch's operations, and a small tensor's launches cost far more than its reading.
Here a batch of them is copied into one row (``torch.cat``) and reduced segment by segment
(``torch.segment_reduce``): 35 operations a batch for the statistics, 28 for the
histograms, 60 for both from one copy of the values (:func:`both`), of up to
:data:`BATCH_VALUES` values (on a GPU some 16 more launches: CUDA's ``segment_reduce`` is 3
for each of the 8). Tensors larger than :data:`MAX_VALUES` keep
their own route.
``torch.segment_reduce`` is kept public by torch for compatibility: where a torch lacks it,
the first use fails and gives the batches up, with a warning.

The numbers are the per-tensor routes': each value read as float32, the statistics as one
float64 row (mean, population std, min, max, norm, zeros, NaNs, Infs) with their NaN and Inf
rules, summed here in float64 from the float32 values and rounded to float32 as those routes'
float32 sums are: equal to them up to float32 rounding; the histograms' counts equal bin for
bin. Each (device, dtype) is checked against torch's per-tensor route on a probe at its first
use; a failure or a disagreement gives the batches up for the process with a warning, and the
tensors take their own routes: never a wrong record, never a recording stopped.
``HOOKTRACE_DEVICE_BATCHES=0`` switches the batches off.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch._utils import _flatten_dense_tensors

from hooktrace.recorder.stats.torch_route import _bins, histogram_torch, summarize_on_device
from hooktrace.trace.histograms import WIDTH

MAX_VALUES = 1 << 16
"""Values of the largest tensor batched: a larger one takes its own route, where its few
launches are nothing against its reading (and a segmented reduction gives each tensor one
block of threads: a large one would keep a GPU's multiprocessor busy alone)."""

BATCH_VALUES = 1 << 22
"""Values a batch holds at most (one tensor over it is a batch of its own): its scratch is a
few float64 and int64 copies of them, some 200 MB at most."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

_EXACT_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)

_failed: list[str] = (
    ["HOOKTRACE_DEVICE_BATCHES=0"] if os.environ.get("HOOKTRACE_DEVICE_BATCHES") == "0" else []
)
"""Why the batches were given up in this process (empty: they were not)."""

_proven: dict[tuple[torch.device, torch.dtype], bool] = {}


def batchable(x: torch.Tensor | None) -> bool:
    """Whether ``x`` is summarised in a batch: a plain strided float tensor of some values,
    at most :data:`MAX_VALUES`, on a device other than the CPU (whose small tensors have a
    kernel that reads a list of them where they lie). Never raises."""
    if x is None or type(x) not in _PLAIN or x.layout is not torch.strided or x.is_nested:
        return False
    if x.is_cpu or x.is_meta or x.dtype not in _FLOATS or not 0 < x.numel() <= MAX_VALUES:
        return False
    return not _failed


class Batches:
    """How tensors of the given sizes are batched on ``device``: consecutive runs of them of
    at most :data:`BATCH_VALUES` values, each with its tensors' sizes on the device. One per
    list of sizes (:meth:`of`, which keeps the last few): the copy of the sizes to the
    device, from pinned memory, not waited for, is made once, not every step."""

    _made: ClassVar[dict[tuple[torch.device, tuple[int, ...]], Batches]] = {}
    _KEEP = 64

    @classmethod
    def of(cls, sizes: tuple[int, ...], device: torch.device) -> Batches:
        batches = cls._made.get((device, sizes))
        if batches is None:
            if len(cls._made) >= cls._KEEP:
                cls._made.clear()
            batches = cls._made[(device, sizes)] = cls(sizes, device)
        return batches

    def __init__(self, sizes: Sequence[int], device: torch.device) -> None:
        self.runs: list[tuple[int, int, int]] = []  # (first, end, values) of each batch
        first = total = 0
        for i, size in enumerate(sizes):
            if total and total + size > BATCH_VALUES:
                self.runs.append((first, i, total))
                first, total = i, 0
            total += size
        if sizes:
            self.runs.append((first, len(sizes), total))
        self.lengths: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []  # the lengths as float64
        self.positions: list[torch.Tensor] = []  # 0, 1, ... a batch's tensors
        pinned = device.type == "cuda"
        for first, end, _ in self.runs:
            host = torch.tensor(sizes[first:end], dtype=torch.int64)
            lengths = host.pin_memory().to(device, non_blocking=True) if pinned else host.to(device)
            self.lengths.append(lengths)
            self.counts.append(lengths.double())
            self.positions.append(torch.arange(end - first, device=device))

    def segments(self, k: int) -> torch.Tensor:
        """Each value's tensor, in batch ``k`` (made when needed: int64 a value is more than
        the values themselves, not to be kept)."""
        return torch.repeat_interleave(
            self.positions[k], self.lengths[k], output_size=self.runs[k][2]
        )


def summarize(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The statistics of ``tensors`` (:func:`batchable`, on one device): one float64 row of
    8 each, queued on their device."""
    return _each_batch(tensors, histograms=False)[0]


def histograms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The histograms of ``tensors`` (:func:`batchable`, on one device): ``WIDTH`` int64
    counts each, queued on their device."""
    return _each_batch(tensors, statistics=False)[1]


def both(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`summarize` and :func:`histograms` of ``tensors``, each batch's values copied
    once for the two (a step that histograms its parameters)."""
    rows, counts = _each_batch(tensors)
    return rows, counts


def _each_batch(
    tensors: Sequence[torch.Tensor], *, statistics: bool = True, histograms: bool = True
) -> tuple[Any, Any]:
    """The statistics and the histograms asked for, of each batch of ``tensors``, joined."""
    batches = _batches(tensors)  # the sizes as they are now (a stale one reads past them)
    rows, counts = [], []
    for k, (first, end, _) in enumerate(batches.runs):
        with torch.no_grad():  # one row, joined in one call into torch's C++
            values = _flatten_dense_tensors(list(tensors[first:end]))
        segments = batches.segments(k)  # each value's tensor
        if statistics:
            rows.append(_summarize(values, batches, k, segments))
        if histograms:
            counts.append(_histograms(values, end - first, segments))
    return _joined(rows), _joined(counts)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _batches(tensors: Sequence[torch.Tensor]) -> Batches:
    return Batches.of(tuple(t.numel() for t in tensors), tensors[0].device)


def _summarize(
    values: torch.Tensor, batches: Batches, k: int, segments: torch.Tensor
) -> torch.Tensor:
    x = values.float().double()  # each value as float32, as every route reads it
    lengths, n = batches.lengths[k], batches.counts[k]

    def total(values: torch.Tensor) -> torch.Tensor:
        return torch.segment_reduce(values, "sum", lengths=lengths, unsafe=True)

    mean = total(x) / n  # an Inf's mean is that Inf; a NaN's, NaN
    centred = x - mean[segments]  # two passes: no cancellation (NaN where an Inf is)
    std = _float32(total(centred * centred) / n).sqrt()
    lo = torch.segment_reduce(x, "min", lengths=lengths, unsafe=True)  # NaN where a NaN is
    hi = torch.segment_reduce(x, "max", lengths=lengths, unsafe=True)
    norm = _float32(total(x * x)).sqrt()
    measures = _float32(torch.stack([mean, std, lo, hi, norm], dim=1))
    counted = [total((x == 0).double()), total(x.isnan().double()), total(x.isinf().double())]
    return torch.cat([measures, torch.stack(counted, dim=1)], dim=1)


def _float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to float32, as the per-tensor routes' float32 sums are: a sum of squares
    past float32's range is Inf there (the norm of values near 1e38), and so here."""
    return x.float().double()


def _histograms(values: torch.Tensor, tensors: int, segments: torch.Tensor) -> torch.Tensor:
    # each value binned as its own route bins it: float64 as float64
    values = values.float() if values.dtype in _EXACT_IN_FLOAT32 else values.double()
    where = _bins(values) + segments * WIDTH
    counts = torch.zeros(tensors * WIDTH, dtype=torch.int64, device=values.device)
    counts.index_add_(0, where, torch.ones_like(where))
    return counts.view(tensors, WIDTH)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the batches take tensors of ``dtype`` on ``device``: they gave the per-tensor
    route's numbers on a probe there (:func:`_prove`), and no CUDA graph is being captured
    (whose replays would not run the batches' copy of their sizes). Never raises."""
    if _failed or _capturing(device):
        return False
    proven = _proven.get((device, dtype))
    return proven if proven is not None else _prove(device, dtype)


def _capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
    except Exception:  # a device that cannot say: take no chance
        return True


def _prove(device: torch.device, dtype: torch.dtype) -> bool:
    """A first use on ``device`` and ``dtype``: three probes batched (zeros, both signs,
    subnormals; a NaN; an Inf) against torch's per-tensor route. It waits for the device,
    once; not where the device lacks the memory (a later use proves them)."""
    try:
        probe = torch.linspace(-3.0, 5.0, 999, dtype=torch.float64).pow(5)
        probe[::7] = 0.0
        probe[1::11] *= 1e-40  # subnormal in float32 and bfloat16 (zero in float16)
        with_nan, with_inf = probe[:300].clone(), probe[300:].clone()
        with_nan[4], with_inf[9] = float("nan"), float("inf")
        tensors = [t.to(dtype).to(device) for t in (probe, with_nan, with_inf)]
        rows, counts = summarize(tensors), histograms(tensors)
        expected = torch.stack([summarize_on_device(t.float()) for t in tensors])
        expected[2, 0] = float("inf")  # the mean of values with an Inf (a device's var_mean: NaN)
        same = torch.allclose(rows, expected, rtol=1e-5, atol=1e-6, equal_nan=True)
        for i, t in enumerate(tensors):
            same = same and bool(torch.equal(counts[i], torch.as_tensor(histogram_torch(t))))
    except torch.cuda.OutOfMemoryError:
        return False  # not the batches' fault: a later use proves them
    except Exception as exc:  # a device that lacks an operation: the tensors' own routes
        give_up(exc)
        return False
    if not same:
        give_up(f"they disagreed with torch's operations on a {dtype} probe")
        return False
    _proven[(device, dtype)] = True
    return True


def give_up(why: str | Exception) -> None:
    """No more batches in this process: each tensor takes its own route from now on."""
    if isinstance(why, Exception):
        why = f"{type(why).__name__}: {(str(why).splitlines() or [''])[0]}"
    _failed.append(why)
    with contextlib.suppress(Exception):  # warnings made errors (-W error): it goes on
        warnings.warn(
            f"hooktrace: parameters on a device are summarised one by one ({why}); the same "
            "statistics, a few more launches a tensor",
            RuntimeWarning,
            stacklevel=3,
        )
