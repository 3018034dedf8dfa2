"""``python -m hooktrace``: the same as the ``hooktrace`` command."""

from hooktrace.cli import run

run()
