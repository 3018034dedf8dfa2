"""One self-contained HTML page about a run, or two: :func:`hooktrace.report`. Never imports
torch.

``report.py`` is the function; ``distributions.py`` the distributions of the flagged modules;
``html.py`` the page's pieces.

May import: findings, overview, histograms, checks, plots.
"""
