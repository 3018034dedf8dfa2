"""A trace in TensorBoard: :func:`hooktrace.export_tensorboard`. Never imports torch (nor
TensorFlow).

``tensorboard.py`` is the function; ``writer.py`` writes the records as events, a run per
(rank, phase); ``events.py`` is TensorBoard's side (event files of scalars, histograms, text);
``text.py`` the export's text; ``directory.py`` where an export goes, put in place whole.

May import: findings.
"""
