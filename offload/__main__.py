"""``python -m offload``: the same as the ``offload`` command."""

import sys

try:
    from offload.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line was still being imported
    print("offload: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
