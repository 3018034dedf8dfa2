"""The first NaN or Inf caught in the act: the call that made it saved in full, the aten
operation and the source line named.

``finite.py`` is the look on the hot path (the counts of the statistics queued anyway);
``capture.py`` decides when a call is an origin and runs it again; ``rerun.py`` runs a user's
model again unseen; ``first_nonfinite.py`` names the first operation that made the value;
``capture_store.py`` is what a capture holds and how it is written.

May import: stats, records.
"""
