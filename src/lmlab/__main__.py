"""``python -m lmlab ...``: the ``lmlab`` command, for environments without the script on PATH."""

import sys

from .cli import main

sys.exit(main())
