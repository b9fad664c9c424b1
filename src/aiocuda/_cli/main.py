"""The top-level parser and what surrounds every command (see :mod:`.common` for exit codes).

Expected failures end in one line on stderr, never a traceback: a missing GPU where one
is required, a bad setting, a driver or compile error, an unwritable file. A closed
output pipe (``aiocuda info | head -2``) ends quietly. The simulator's fall-back warning
is one line too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

from .. import __version__
from ..errors import BackendError, CudaError, SimulatedBackendWarning
from . import bench, demo, info
from .common import EXIT_BROKEN_PIPE, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, prog_name

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command, named as the user ran us."""
    parser = argparse.ArgumentParser(
        prog=prog_name(),
        description="aiocuda: await NVIDIA GPU work from asyncio, uvloop and trio. Without a GPU, the commands "
        "run on the simulated backend and say so.",
    )
    parser.add_argument("--version", action="version", version=f"aiocuda {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{info,demo,bench}")
    for command in (info, demo, bench):
        command.add_parser(commands)
    for name, sub in commands.choices.items():
        sub.set_defaults(parser=sub, command_name=name)
    return parser


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Show the simulator's fall-back warning as one line, without a source location."""
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if issubclass(category, SimulatedBackendWarning):
                print(f"{prog_name()}: {message}", file=sys.stderr)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def _quiet_stdout() -> None:
    """After a broken pipe: send what is left of stdout nowhere (flushing at exit would
    raise again)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (see :mod:`aiocuda._cli.common`)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)  # usage errors exit 2 here; --help and --version exit 0
    if unknown:  # told with the command's usage, not the top level's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    where = f"{prog_name()} {args.command_name}"
    try:
        with _one_line_warnings():
            return int(args.run(args))
    except UsageError as exc:
        command: argparse.ArgumentParser = args.parser
        command.error(str(exc))  # exits 2, with the command's usage
    except BackendError as exc:  # AIOCUDA_BACKEND or AIOCUDA_SIM_DEVICES is wrong
        print(f"{where}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        lead = "\n" if sys.stderr.isatty() else ""  # after the terminal's ^C
        print(f"{lead}{where}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except (CudaError, OSError) as exc:
        print(f"{where}: error: {_describe(exc)}", file=sys.stderr)
        return EXIT_FAILURE


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or exc}: {exc.filename}"
    return str(exc)
