"""The checks that find what went wrong: :func:`hooktrace.anomalies` and
:func:`hooktrace.dead_relus`. Never imports torch.

``anomalies.py`` is the function and its definitions; ``anomaly_scan.py`` its one pass over
the records, as DuckDB queries; ``nonfinite.py`` where the first NaN or Inf came from;
``captured.py`` what the non-finite captures add; ``series.py`` norms against a robust
baseline (exploding, vanishing, spikes); ``replicas.py`` data-parallel replicas that came
apart; ``series_store.py`` and ``grouped.py`` the numpy
reductions behind them. ``dead_units.py`` is ``dead_relus``, ``unit_state.py`` its running
per-unit state.

May import: findings, histograms.
"""
