"""Pictures of a run: :func:`hooktrace.plot`. Never imports torch; matplotlib is an optional
extra.

``plots.py`` is the function; ``tables.py`` the tables behind the pictures; ``figures.py``
draws them.

May import: findings, diff, histograms, checks.
"""
