"""Counters of the completion engine's work in a server process, for ``scripts/ab serve
--counters``: on the path of the server only, with ``AB_COUNTERS`` naming the file that a
thread of the server rewrites every 0.1 s with the totals so far (JSON).

* ``select``, ``select_sleep``, ``blocked_s``: the asyncio loop's iterations (its
  selector's calls), those that could sleep, and the seconds spent in them (uvloop has
  no Python selector: these stay 0);
* ``query``: the engine's event queries; ``passes``: poller passes; ``arms``: timer
  armings; ``wakes``: tasks woken to poll their own wait; ``rings``: doorbells;
  ``waiters``: waits handed to the poller (a ``Waiter`` each);
* ``overdue``: waits the poller found done after their poll window had passed;
  ``past_prediction_s``: the seconds by which the poller found waits done after their
  predicted end (negative: before it), summed.

It wraps private functions of the engine: a probe for A/Bs, not an API.
"""

from __future__ import annotations

import json
import os
import selectors
import threading
import time
from collections.abc import Callable
from typing import Any

_COUNTS: dict[str, float] = dict.fromkeys(
    (
        "select",
        "select_sleep",
        "blocked_s",
        "query",
        "passes",
        "arms",
        "wakes",
        "rings",
        "waiters",
        "overdue",
        "past_prediction_s",
    ),
    0,
)


def _count_calls(owner: Any, name: str, key: str) -> None:
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        _COUNTS[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def _count_selects() -> None:
    original = selectors.EpollSelector.select

    def select(self: selectors.EpollSelector, timeout: float | None = None) -> Any:
        _COUNTS["select"] += 1
        if timeout is not None and timeout <= 0:
            return original(self, timeout)
        _COUNTS["select_sleep"] += 1
        start = time.perf_counter()
        try:
            return original(self, timeout)
        finally:
            _COUNTS["blocked_s"] += time.perf_counter() - start

    selectors.EpollSelector.select = select  # type: ignore[method-assign, assignment]


def _counting_query(query: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def counted(event: Any) -> bool:
        _COUNTS["query"] += 1
        return query(event)

    return counted


def _count_engine() -> None:
    from aiocuda._completion import engine, loops, poller

    _count_calls(poller.Poller, "run", "passes")
    _count_calls(poller.Poller, "_arm", "arms")
    _count_calls(engine.CompletionEngine, "ring", "rings")
    _count_calls(engine.Waiter, "__init__", "waiters")
    _count_calls(loops.AsyncioAdapter, "wake", "wakes")
    complete = engine.CompletionEngine.complete

    def completing(self: Any, waiter: Any, now: float, *, polled: bool = True) -> None:
        history = self._history(waiter)
        if not waiter.done and waiter.head_since is not None and history is not None:
            _COUNTS["past_prediction_s"] += now - (waiter.head_since + history.expected)
            _COUNTS["overdue"] += now > waiter.poll_until
        complete(self, waiter, now, polled=polled)

    engine.CompletionEngine.complete = completing  # type: ignore[method-assign]
    made = engine.CompletionEngine.__init__

    def init(self: Any, backend: Any) -> None:
        made(self, backend)
        self.query = _counting_query(self.query)

    engine.CompletionEngine.__init__ = init  # type: ignore[method-assign]
    if engine._engine is not None:  # made before these counters: count its queries too
        engine._engine.query = _counting_query(engine._engine.query)  # type: ignore[assignment]


def _dump(path: str) -> None:
    _count_engine()
    while True:
        with open(path + ".tmp", "w") as f:
            json.dump(_COUNTS, f)
        os.replace(path + ".tmp", path)
        time.sleep(0.1)


if os.environ.get("AB_COUNTERS"):
    _count_selects()
    threading.Thread(target=_dump, args=(os.environ["AB_COUNTERS"],), daemon=True, name="ab-counters").start()
