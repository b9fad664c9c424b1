"""Tasks for tests of an executor left while other tasks use it: a lifespan that holds
the executor open until told to leave (:func:`lifespan`), and a map's reader
(:func:`read_map`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import numpy as np

from aiocuda.errors import ClosedError
from aiocuda.executor import Executor


async def lifespan(
    leave: anyio.Event,
    exited: anyio.Event,
    *,
    warm_up: Callable[[Executor], Awaitable[object]] | None = None,
    task_status: anyio.abc.TaskStatus[Executor] = anyio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """``async with Executor([0], **options)``, started (``tg.start``) once entered and
    ``warm_up`` awaited; the block is left when ``leave`` is set, then ``exited`` is set."""
    async with Executor([0], **options) as ex:
        if warm_up is not None:
            await warm_up(ex)
        task_status.started(ex)
        await leave.wait()
    exited.set()


async def read_map(
    ex: Executor,
    stage: Any,
    inputs: Sequence[np.ndarray],
    got: list[Any],
    reading: anyio.Event | None = None,
    **options: Any,
) -> None:
    """Read ``ex.map(stage, inputs, in_flight=len(inputs), **options)`` into ``got``, once
    ``reading`` is set if given; a ClosedError ending the map is appended last."""
    try:
        async with ex.map(stage, inputs, in_flight=len(inputs), **options) as results:
            if reading is not None:
                await reading.wait()
            async for r in results:
                got.append(r)
    except ClosedError as exc:
        got.append(exc)
