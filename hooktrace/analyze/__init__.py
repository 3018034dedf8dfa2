"""The analyzer: questions asked of a trace, answered as pandas DataFrames. Never imports torch.

``findings.py`` is the floor every room stands on: :class:`Finding`, its table, and the step
and module selections the analyses share. Above it, each room importing only those listed
before it (and :mod:`hooktrace.trace`, :mod:`hooktrace.errors`, :mod:`hooktrace.package`;
never :mod:`hooktrace.recorder`):

- ``overview/``: what a trace holds at a glance (:func:`summary`), a step's timeline;
- ``diff/``: where two runs first diverge (:func:`diff`);
- ``histograms/``: distributions over steps (:func:`hist`) and what float16 and bfloat16
  could not hold (:func:`precision`);
- ``export/``: a trace in TensorBoard (:func:`export_tensorboard`);
- ``checks/``: the findings of :func:`anomalies` and :func:`dead_relus`;
- ``plots/``: pictures of a run (:func:`plot`);
- ``report/``: one HTML page about a run, or two (:func:`report`).

Each room's ``__init__.py`` says what it holds and, on its line ``May import:``, which other
rooms it imports (``tests/test_architecture.py`` holds it to that). Importing a room imports
nothing: its ``__init__.py`` is this text only.
"""
