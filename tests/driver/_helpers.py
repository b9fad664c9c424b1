"""Helpers of the driver tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiocuda._driver.sim import SimDriver

WAIT = 5.0  # generous bound for things that should take milliseconds


def on_device(sim: SimDriver, ordinal: int) -> None:
    sim.set_current(sim.primary_context_retain(sim.device_get(ordinal)))


def recorder() -> tuple[list[Any], Callable[[Any], Callable[[], None]]]:
    log: list[Any] = []

    def op(tag: Any) -> Callable[[], None]:
        return lambda: log.append(tag)

    return log, op


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
