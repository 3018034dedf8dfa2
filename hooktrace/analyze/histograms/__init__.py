"""Distributions over steps from the fixed exponent bins: :func:`hooktrace.hist`, and what
float16 and bfloat16 could not hold: :func:`hooktrace.precision`. Never imports torch.

``histograms.py`` is ``hist``; ``rows.py`` reads the stored spans as tidy rows;
``precision.py`` is ``precision`` and the ``fp16_*`` findings.

May import: findings.
"""
