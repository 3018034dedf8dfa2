"""What hooktrace knows of itself: its version, its folder, and the process that imported it.

At the bottom, beside :mod:`hooktrace.errors`: any room may import it, and it imports nothing
of hooktrace. The package root re-exports ``__version__``; the rooms take it from here, so
that none of them imports the root (which forwards to every room).
"""

from __future__ import annotations

import os
from pathlib import Path

__version__ = "0.1.0"

FOLDER = Path(os.path.abspath(__file__)).parent
"""The installed package's folder (``.../hooktrace``)."""

imported_in = os.getpid()
"""The process that imported hooktrace (the root imports this module first). One forked from
it keeps the recorder's kernel to one thread, whatever its parent did with OpenMP threads
(:mod:`hooktrace.recorder.stats.omp`)."""
