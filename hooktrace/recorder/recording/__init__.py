"""A recording from start to end.

``recorder.py`` is the :class:`Recorder`, the context manager behind :func:`hooktrace.record`;
``patches.py`` what it changes in torch while it records, put back when it ends;
``discover.py`` the roots and steps of a script nobody edited; ``launch.py`` runs such a
script as ``python`` would (``hooktrace record``); ``rundir.py`` the run directory made
ready; ``faults.py`` how the recorder tells of its own faults.

May import: stats, records, nonfinite, hooks, graphs.
"""
