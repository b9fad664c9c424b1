"""What every command shares: exit codes, argument types, messages, Ctrl-C.

Exit codes: 0 done; 1 failed (no GPU where one is required, a driver error, results
that differ); 2 a usage error (a bad argument or setting), found before anything is
printed; 130 interrupted (Ctrl-C); 141 the output was closed early (``| head``), as for
a process that SIGPIPE ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import signal
import sys
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "UsageError",
    "exit_at_once_on_interrupt",
    "positive_float",
    "positive_int",
    "prog_name",
    "writable_file",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a process Ctrl-C ended
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


class UsageError(Exception):
    """A bad argument found after parsing (a device count the backend does not have):
    reported with the command's usage, exit code 2."""


def prog_name() -> str:
    """How the user ran us: ``python -m aiocuda`` or the ``aiocuda`` command."""
    return "python -m aiocuda" if pathlib.Path(sys.argv[0]).name == "__main__.py" else "aiocuda"


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, not {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, not {text!r}")
    return value


def writable_file(text: str) -> pathlib.Path:
    """An argparse type: a file that can be created or replaced (checked before any work)."""
    path = pathlib.Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: directory {folder} is not writable")
    return path


@contextlib.contextmanager
def exit_at_once_on_interrupt(cleanup: Callable[[], None], command: str) -> Iterator[None]:
    """While inside: Ctrl-C (SIGINT) ends the process at once, with one line on stderr
    and exit code 130, after ``cleanup()`` (which removes half-written files).

    Unwinding instead would wait for the GPU work in flight and print the tracebacks of
    every task it cancels; the driver reclaims the process's GPU resources at exit.
    """

    def interrupted(signum: int, frame: FrameType | None) -> None:
        try:
            cleanup()
        finally:
            if sys.stdout.isatty():
                os.write(sys.stdout.fileno(), b"\x1b[?25h")  # a progress bar hides the cursor
            lead = "\n" if sys.stderr.isatty() else ""  # after the terminal's ^C
            os.write(sys.stderr.fileno(), f"{lead}{prog_name()} {command}: interrupted\n".encode())
            os._exit(EXIT_INTERRUPTED)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
