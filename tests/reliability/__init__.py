"""The reliability suite: faults, bad input and awkward models, each group reporting figures.

Run it with the rest of the tests (``python -m pytest``), or through
``python benchmarks/reliability_report.py``, which also rewrites docs/RELIABILITY.md from the
figures the groups report.
"""
