"""Compiled models recorded from the inside: statistics computed in the graphs they compile.

``plan.py`` reads a graph dynamo captured, finds where each module call returns, and adds
the statistics of those values to it; ``ops.py`` holds what is added (the statistics, the
per-unit counts, the taps that summarise gradients in the backward); ``backend.py`` hands
the instrumented graph to the script's own backend and the statistics to the recorder.

A DTensor's record is placed by ``records/shards.py``, as the hooks place one.

May import: stats, records.
"""
