"""`ProgressLine`: a logging handler that shows log records as one updating line.

The command line attaches it to the ``offload.load`` logger while a model loads: on a
terminal each record replaces the previous one in place (a carriage return, the message,
spaces over what is left of a longer previous message), and `end` finishes the line; on
anything else (a file, a pipe, a CI log) each record is a plain line of its own.
"""

from __future__ import annotations

import logging
from typing import TextIO, final

__all__ = ["ProgressLine"]


@final
class ProgressLine(logging.Handler):
    """Writes each record's message to `stream`, as one updating line on a terminal.

    Args:
        stream: where to write (the command line passes ``sys.stderr``).
        tty: whether `stream` is a terminal; default: ``stream.isatty()``.
    """

    def __init__(self, stream: TextIO, *, tty: bool | None = None) -> None:
        super().__init__()
        self._stream = stream
        self._tty = stream.isatty() if tty is None else tty
        self._width = 0  # characters of the line now shown (terminal only); 0: none

    @property
    def tty(self) -> bool:
        """Whether records update one line in place."""
        return self._tty

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record).replace("\n", " ")
            if self._tty:
                self._stream.write(f"\r{message}{' ' * max(0, self._width - len(message))}")
                self._width = len(message)
            else:
                self._stream.write(f"{message}\n")
            self._stream.flush()
        except Exception:  # logging's contract: report, never raise
            self.handleError(record)

    def end(self) -> None:
        """Finish the updating line with a newline, if one is shown (nothing otherwise)."""
        if self._tty and self._width:
            self._stream.write("\n")
            self._stream.flush()
            self._width = 0
