"""Stages and actor-side helpers for the Ray tests (importable by the actors).

Chunks whose first element is negative are "marked": the stages below act on them.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from aiocuda import _driver
from aiocuda.array import DeviceArray
from aiocuda.executor import ChunkContext, Executor

_paused: list[Any] = []
"""Streams this actor process paused (simulated backend)."""
_reached = 0
"""Chunks that reached :func:`pause` in this actor process."""
_pausing = True
"""Whether :func:`pause_all` pauses (until :func:`stop_pausing`)."""


def identity(ctx: ChunkContext, x: DeviceArray) -> None:
    """Download the input as it is."""


def fail_on_marked(ctx: ChunkContext, x: DeviceArray) -> None:
    if ctx.host.flat[0] < 0:
        raise ValueError("marked chunk rejected")


def pause_marked(ctx: ChunkContext, x: DeviceArray) -> None:
    """Hold the compute stream of a marked chunk: it (and what waits for it on the
    actor's download stream) stays unfinished until :func:`resume_paused`."""
    if ctx.host.flat[0] < 0:
        pause(ctx)


def pause_all(ctx: ChunkContext, x: DeviceArray) -> None:
    """Pause every chunk's compute stream, until :func:`stop_pausing`."""
    if _pausing:
        pause(ctx)


def pause(ctx: ChunkContext) -> None:
    """Pause the chunk's stream (once; streams may be shared by chunks)."""
    global _reached
    _reached += 1
    if not any(stream is ctx.stream for stream in _paused):
        _driver.driver().pause(ctx.stream.handle)  # type: ignore[attr-defined]
        _paused.append(ctx.stream)


def reached(executor: Executor) -> int:
    """How many chunks reached :func:`pause` in this actor."""
    return _reached


def stop_pausing(executor: Executor) -> int:
    """Pause no more streams, and resume the paused ones; how many there were."""
    global _pausing
    _pausing = False
    return resume_paused(executor)


def resume_paused(executor: Executor) -> int:
    """Resume every paused stream of this actor; how many there were."""
    count = len(_paused)
    for stream in _paused:
        _driver.driver().resume(stream.handle)  # type: ignore[attr-defined]
    _paused.clear()
    return count


class DieOnMarked:
    """Ends its actor's process on a marked chunk; with ``once``, only the first time
    on the machine (a file records it), so a retry elsewhere succeeds."""

    def __init__(self, flag: str, once: bool) -> None:
        self.flag = pathlib.Path(flag)
        self.once = once

    def __call__(self, ctx: ChunkContext, x: DeviceArray) -> None:
        if ctx.host.flat[0] >= 0:
            return
        if self.once:
            try:
                self.flag.touch(exist_ok=False)
            except FileExistsError:
                return
        os._exit(1)


def device_view(executor: Executor) -> tuple[str, int, str]:
    """(backend, devices the executor uses, CUDA_VISIBLE_DEVICES) in the actor."""
    return _driver.driver().name, len(executor.devices), os.environ.get("CUDA_VISIBLE_DEVICES", "")


def record_setup(path: str) -> None:
    """A pool's ``setup`` (with ``functools.partial``): appends the actor's pid to ``path``."""
    with pathlib.Path(path).open("a") as f:
        f.write(f"{os.getpid()}\n")
