"""``python -m offload``: the same as the ``offload`` command."""

import sys

from offload.cli import main

sys.exit(main())
