"""The `offload` command line: ``offload env``, ``offload plan``, ``offload demo`` and
``offload load`` (one module per command in `offload.cli`).

User errors (a junk environment variable, a bad flag value, a missing or corrupt
checkpoint, a number out of range) exit with status 2 and one line on stderr naming the
flag and the value, escaped to stay one line whatever the names contain; so do torch
failures in the demo and in `load`'s forward. Ctrl-C exits with status 130 and one line.
Nothing the user can cause prints a traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from offload.cli._shared import EXIT_INTERRUPTED, EXIT_USER_ERROR, UserError, say
from offload.cli.env import cmd_env
from offload.cli.load import cmd_load
from offload.cli.parser import build_parser
from offload.cli.plan import cmd_plan
from offload.errors import OffloadError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
            format="%(levelname)s %(name)s: %(message)s",
        )
        if args.command == "env":
            return cmd_env(args)
        if args.command == "demo":
            from offload.cli.demo import cmd_demo  # the demo's model needs torch: only when it runs

            return cmd_demo(args)
        if args.command == "load":
            return cmd_load(args)
        return cmd_plan(args)
    except UserError as exc:
        say(str(exc))
        return EXIT_USER_ERROR
    except OffloadError as exc:
        say(f"offload: error: {exc.message}")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        # Ctrl-C: the `finally` blocks on the way out have run; a traceback adds nothing.
        say("offload: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `offload plan | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return 0
