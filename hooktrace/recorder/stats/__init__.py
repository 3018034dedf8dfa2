"""The statistics of one tensor, computed on its own device without waiting for it.

``stats.py`` decides a tensor's route (on its device, staged for the writer, or numba's
one-pass kernel) and computes its statistics and per-unit activity; ``histogram.py`` its
histogram over the fixed exponent bins (``histogram_bits.py``: where a float's bits put it).
The numba kernels: ``kernel.py`` (one pass over a CPU tensor), ``staged_kernels.py`` (small
tensors' rows, bit for bit as numpy), ``histogram_kernel.py``; ``numba_kernels.py`` hands them
out once loaded; ``kernel_cache.py`` fills numba's cache in another process; ``omp.py`` runs
the kernel on torch's own OpenMP threads. ``host.py`` gives numpy's view of a CPU tensor
without ``Tensor.numpy()``, which would mark the script's storage as never resizable again.
On a GPU: ``device_kernels.py`` (statistics and histograms in Triton kernels, defined in
``triton_kernels.py``, each checked at its first call), or ``torch_route.py`` (torch's own
operations, queued) where Triton is not.

May import: nothing of the recorder.
"""
