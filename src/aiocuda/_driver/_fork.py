"""Fork detection: CUDA state does not survive ``fork``; the child gets a clear error."""

from __future__ import annotations

import os

from ..errors import NoDeviceError

__all__ = ["check_not_forked", "fork_error", "was_forked"]

_parent_pid = os.getpid()
_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def was_forked() -> bool:
    """True in a child process forked after aiocuda was imported."""
    return _forked


def fork_error() -> NoDeviceError:
    return NoDeviceError(
        f"CUDA cannot be used in a process forked from one that imported aiocuda "
        f"(parent pid {_parent_pid}, this pid {os.getpid()}): the driver's state does not "
        f"survive fork. Start workers with multiprocessing's 'spawn' or 'forkserver' "
        f"method instead.",
        name="AIOCUDA_FORKED",
    )


def check_not_forked() -> None:
    if _forked:
        raise fork_error()
