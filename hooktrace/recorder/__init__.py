"""The recorder: the torch side of hooktrace, which hooks a training run and writes its trace.

Six rooms, each importing only the rooms listed before it (and :mod:`hooktrace.trace`,
:mod:`hooktrace.errors`, :mod:`hooktrace.package`; never :mod:`hooktrace.analyze`):

- ``stats/``: the statistics of one tensor, and the numba kernels that compute them;
- ``records/``: a step's records, from a tensor a hook sees to the writer thread;
- ``nonfinite/``: the first NaN or Inf caught in the act, and the call that made it captured;
- ``hooks/``: hooks on modules, tensors and optimizers, the names modules are recorded under,
  and which modules, steps and kinds are recorded;
- ``recording/``: a recording from start to end: the :class:`Recorder`, what it patches in
  torch, a script nobody edited, the run directory, its faults;
- ``replay/``: a recorded call run again, in isolation.

Each room's ``__init__.py`` says what it holds and, on its line ``May import:``, which of the
rooms before it it imports (``tests/test_architecture.py`` holds it to that). Importing a room
imports nothing: its ``__init__.py`` is this text only.
"""
