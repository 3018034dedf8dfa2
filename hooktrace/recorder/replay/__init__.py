"""A recorded call run again, in isolation: :func:`hooktrace.replay_module`.

``replay.py`` finds the call saved in full and runs the module on its inputs; ``capture.py``
does the same for a non-finite capture; ``compare.py`` compares what ran with what was
recorded.

May import: stats, records, nonfinite, hooks, recording.
"""
