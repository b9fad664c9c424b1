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

_held: list[Any] = []
"""Streams this actor process holds (simulated backend)."""
_holding = True
"""Whether :func:`hold_all` holds (until :func:`stop_holding`)."""


def identity(ctx: ChunkContext, x: DeviceArray) -> None:
    """Download the input as it is."""


def fail_on_marked(ctx: ChunkContext, x: DeviceArray) -> None:
    if ctx.host.flat[0] < 0:
        raise ValueError("marked chunk rejected")


def hold_marked(ctx: ChunkContext, x: DeviceArray) -> None:
    """Hold the compute stream of a marked chunk: it (and what waits for it on the
    actor's download stream) stays unfinished until :func:`release_held`."""
    if ctx.host.flat[0] < 0:
        hold(ctx)


def hold_all(ctx: ChunkContext, x: DeviceArray) -> None:
    """Hold every chunk's compute stream, until :func:`stop_holding`."""
    if _holding:
        hold(ctx)


def hold(ctx: ChunkContext) -> None:
    if not any(stream is ctx.stream for stream in _held):
        _driver.driver().hold(ctx.stream.handle)  # type: ignore[attr-defined]
        _held.append(ctx.stream)


def stop_holding(executor: Executor) -> int:
    """Hold no more streams, and release the held ones; how many there were."""
    global _holding
    _holding = False
    return release_held(executor)


def release_held(executor: Executor) -> int:
    """Release every held stream of this actor; how many there were."""
    count = len(_held)
    for stream in _held:
        _driver.driver().release(stream.handle)  # type: ignore[attr-defined]
    _held.clear()
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
