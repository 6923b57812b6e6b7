"""The `offload` command line, one module per command: `env`, `plan` (with the fit),
`demo`, `load`; `parser` (flags and their types), `progress` (the progress line of long
loads), `main` (the entry point: ``offload = "offload.cli:main"``)."""

from offload.cli._shared import EXIT_INTERRUPTED, EXIT_USER_ERROR, one_line
from offload.cli.main import main
from offload.cli.parser import DEFAULT_PREFETCH, LOAD_PREFETCH, build_parser

__all__ = ["DEFAULT_PREFETCH", "EXIT_INTERRUPTED", "EXIT_USER_ERROR", "LOAD_PREFETCH", "build_parser", "main", "one_line"]
