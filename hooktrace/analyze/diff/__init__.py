"""Where and when two runs first diverge, and how far apart they are: :func:`hooktrace.diff`.
Never imports torch.

``diff.py`` is the function; ``read.py`` reads both runs a chunk of whole steps at a time;
``same.py`` finds the records held bit for bit in Arrow; ``compare.py`` aligns and compares
the rest; ``result.py`` is the answer, gathered chunk by chunk.

May import: findings.
"""
