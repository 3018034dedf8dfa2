"""``python -m hooktrace``: the same as the ``hooktrace`` command."""

import sys

from hooktrace.cli import main

sys.exit(main())
