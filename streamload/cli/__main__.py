"""``python -m streamload.cli``: the ``streamload`` command."""

import sys

from .main import main

sys.exit(main())
