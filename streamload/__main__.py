"""``python -m streamload``: the ``streamload`` command."""

import sys

from .cli import main

sys.exit(main())
