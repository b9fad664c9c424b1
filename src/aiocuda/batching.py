"""Dynamic batching: many concurrent requests, one batched stage on the GPU.

When each request's GPU work is small, launching it once per request costs more than the
work itself (a few microseconds of launch and copy overhead each, on the host and the
GPU). A :class:`Batcher` gathers the items of concurrent requests -- up to ``max_batch``
of them, waiting at most ``max_delay`` after the first -- runs your batched stage once
over all of them, and resolves each request with its own result::

    async def infer(items: list[np.ndarray]) -> list[np.ndarray]:
        batch = np.stack(items)
        async with lanes.lease() as lane:                # aiocuda.lanes
            x = lane.upload(batch)
            model_kernel.launch(grid, block, x, len(items), stream=lane.stream)
            out = lane.download(x)
            await lane
        return list(out)                                 # one result per item, in order

    async with aiocuda.Batcher(infer, max_batch=64, max_delay=0.002) as batcher:  # lifespan
        ...
        result = await batcher.submit(item)              # per request

Semantics a service relies on:

* **Cancellation** of one request never cancels its batch: an item whose batch has not
  started is taken out of the queue; otherwise the batch runs and that result is dropped.
* **Errors reach only the requests concerned**: an exception raised by the stage fails
  every request of that batch (and no other); an exception instance returned in place of
  one result fails that request alone.
* **Back-pressure**: with ``max_queue=n``, a submit that finds ``n`` items waiting for
  a batch raises :class:`~aiocuda.errors.QueueFullError` at once instead of waiting
  behind them (a web service answers 503 with ``Retry-After``); without it, the queue
  has no bound, and under overload every request waits longer.
* **Shutdown**: leaving the ``async with`` block refuses new items
  (:class:`~aiocuda.errors.ClosedError`), runs what is queued without waiting for
  ``max_delay``, and waits for every batch to finish. Leaving it with an exception (or
  cancelled) stops at once instead: running batches are cancelled, and their requests
  and the queued ones raise :class:`~aiocuda.errors.ClosedError`.
* **One event loop**: a batcher belongs to the loop that entered it, as asyncio's queues
  and locks do. ``submit`` from any task of that loop; from another loop or thread it
  raises ``RuntimeError`` at once (hand the call to the batcher's loop instead:
  ``asyncio.run_coroutine_threadsafe(batcher.submit(item), loop)``, or
  ``anyio.from_thread.run(batcher.submit, item)`` in a worker thread that loop started).

Choosing ``max_delay``: it is latency added to a request that arrives alone; under load
batches fill before it expires. A millisecond or two is typical for GPU inference.
"""

from __future__ import annotations

from ._executor.batcher import Batcher, BatcherStatistics, BatchFn

__all__ = ["BatchFn", "Batcher", "BatcherStatistics"]
