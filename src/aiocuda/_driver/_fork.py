"""Fork detection: CUDA state does not survive ``fork``; the child gets a clear error.

Only a fork after a backend was made counts: a process that merely imported aiocuda
(a pre-forking server's master, ``gunicorn --preload``) forks children that start
their own backend as if fresh."""

from __future__ import annotations

import os

from ..errors import NoDeviceError

__all__ = ["check_not_forked", "fork_error", "mark_used", "was_forked"]

_parent_pid = os.getpid()
_used = False
"""Whether this process has made a backend (initialised the driver, or started the
simulator's threads): what a forked child cannot inherit."""
_forked = False


def _after_fork_in_child() -> None:
    global _forked, _parent_pid
    if _used:
        _forked = True
    else:
        _parent_pid = os.getpid()


def mark_used() -> None:
    """This process is making a backend: children forked from now on cannot use CUDA."""
    global _used
    _used = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def was_forked() -> bool:
    """True in a child process forked after its parent made a backend."""
    return _forked


def fork_error() -> NoDeviceError:
    return NoDeviceError(
        f"CUDA cannot be used in a process forked from one that had used it "
        f"(parent pid {_parent_pid}, this pid {os.getpid()}): the driver's state does not "
        f"survive fork. Start workers with multiprocessing's 'spawn' or 'forkserver' "
        f"method instead.",
        name="AIOCUDA_FORKED",
    )


def check_not_forked() -> None:
    if _forked:
        raise fork_error()
