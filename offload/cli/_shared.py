"""What the commands share: the one-line user error, the one capture of the machine, the exit
statuses, and the one-line messages on stderr."""

from __future__ import annotations

import sys

from offload.pure.env.snapshot import EnvSnapshot


class UserError(Exception):
    """A mistake in the command line; reported in one line, exit status 2."""


def shown(text: str) -> str:
    """`text` quoted for a one-line message, cut when long."""
    return repr(text) if len(text) <= 40 else f"{text[:24]!r}... ({len(text)} characters)"


def capture() -> EnvSnapshot:
    """The machine, read once (`offload.capture.capture_env`)."""
    from offload.capture import capture_env  # imports torch: only when a command needs it

    return capture_env()


def count_of(number: int, noun: str) -> str:
    """``"1 layer"``, ``"2 layers"``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def one_line(text: str) -> str:
    """`text` with every character that is not printable (a newline, a carriage return,
    another control character) written as its escape, so that it is one line whatever the
    names in it contain."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def say(text: str) -> None:
    """Write `text` to stderr as one line."""
    print(one_line(text), file=sys.stderr)


EXIT_USER_ERROR = 2


#: The status of a command stopped by Ctrl-C (SIGINT), as shells report it: 128 + 2.
EXIT_INTERRUPTED = 130
