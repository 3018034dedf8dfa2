"""What a trace holds at a glance, and one step in execution order. Never imports torch.

``summary.py`` is :func:`hooktrace.summary`; ``timeline.py`` a step's timeline for the
analyses, and the events whose size changed most.

May import: findings.
"""
