"""The command-line tools' standard output: any name printable, and a reader that goes away early.

`galahad-format` and `galahad-licence` print file names and licensees they did not choose. A name
that is not UTF-8 (read as surrogates) is printed escaped (`caf\\udce9.txt`) where a strict UTF-8
or ASCII standard output would raise `UnicodeEncodeError`. Output piped to a reader that stops early
(`| head`) ends the tool quietly with the status a shell gives a program SIGPIPE stopped (141), as
`grep` or `cat` would end: not 1, which each tool gives a meaning of its own.
"""

from __future__ import annotations

import io
import os
import signal
import sys

__all__ = ["STDOUT_CLOSED", "print_any_name", "stdout_closed"]

STDOUT_CLOSED = 128 + int(signal.SIGPIPE)


def print_any_name() -> None:
    """Make standard output escape what it cannot encode instead of raising."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


def stdout_closed() -> int:
    """After `BrokenPipeError` on standard output: point it at /dev/null, so that Python's flush at
    exit finds nothing to complain of, and return `STDOUT_CLOSED`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):  # no descriptor behind it (a test's capture): nothing to flush
        pass
    return STDOUT_CLOSED
