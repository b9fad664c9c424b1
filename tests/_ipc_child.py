"""Other processes for the IPC tests (started with multiprocessing's spawn).

Each function selects the backend the test runs on, then plays one side of an exchange
through two queues: ``inbox`` from the test, ``outbox`` to it. Failures are reported as
``("error", text)`` so the test shows them.
"""

from __future__ import annotations

import os
import signal
import traceback
from typing import Any

import anyio
import numpy as np


def _use(backend: str) -> None:
    from aiocuda import _driver

    if backend == "sim":
        _driver.use_backend("sim", devices=2)
    else:
        _driver.use_backend(backend)


def _report(outbox: Any, fn: Any) -> None:
    try:
        anyio.run(fn)
    except BaseException:
        outbox.put(("error", traceback.format_exc()))


def consume(backend: str, inbox: Any, outbox: Any) -> None:
    """Open the array the test shares, read it (after the test's work, on the GPU), add
    one to it, share an interprocess event marking that, and wait for "done"."""
    _use(backend)

    async def main() -> None:
        import aiocuda
        from aiocuda import ipc

        shared = await anyio.to_thread.run_sync(inbox.get)
        stream = aiocuda.Stream(0)
        array = await ipc.open_array(shared, stream=stream)
        outbox.put(("opened", None))
        seen = await array.to_host(stream=stream)
        await array.copy_from(seen + 1, stream=stream)
        written = aiocuda.Event(0, interprocess=True)
        stream.record(written)
        outbox.put(("seen", (seen.copy(), ipc.share_event(written))))
        assert await anyio.to_thread.run_sync(inbox.get) == "done"
        del array
        await stream
        outbox.put(("finished", None))

    _report(outbox, main)


def produce(backend: str, inbox: Any, outbox: Any) -> None:
    """Share an array of 0..n-1, then end when told to ("exit"), or wait for "done"."""
    _use(backend)

    async def main() -> None:
        import aiocuda
        from aiocuda import ipc

        stream = aiocuda.Stream(0)
        host = np.arange(4096, dtype=np.int32)
        array = await aiocuda.to_device(host, stream=stream, pool=ipc.pool(0))
        outbox.put(("shared", ipc.share_array(array)))
        del array  # the export keeps the memory
        await anyio.to_thread.run_sync(inbox.get)

    _report(outbox, main)


def reopen(backend: str, inbox: Any, outbox: Any) -> None:
    """Open each descriptor the test sends, answer the first value read, drop the array;
    until None."""
    _use(backend)

    async def main() -> None:
        import aiocuda
        from aiocuda import ipc

        stream = aiocuda.Stream(0)
        while (shared := await anyio.to_thread.run_sync(inbox.get)) is not None:
            array = await ipc.open_array(shared, stream=stream)
            outbox.put(("read", int((await array.to_host(stream=stream))[0])))
            del array

    _report(outbox, main)


def _fork_helper() -> int:
    """Fork a process that does nothing with aiocuda until it is killed (as a helper
    started by fork, or multiprocessing's fork start method, does): its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            while True:
                signal.pause()
        finally:
            os._exit(0)
    return pid


def produce_and_fork(backend: str, inbox: Any, outbox: Any) -> None:
    """Share an array of 0..n-1; when told, fork a helper (its pid to the test) and end."""
    _use(backend)

    async def main() -> None:
        import aiocuda
        from aiocuda import ipc

        stream = aiocuda.Stream(0)
        array = await aiocuda.to_device(np.arange(4096, dtype=np.int32), stream=stream, pool=ipc.pool(0))
        outbox.put(("shared", ipc.share_array(array)))
        await anyio.to_thread.run_sync(inbox.get)
        outbox.put(("forked", _fork_helper()))

    _report(outbox, main)


def consume_and_fork(backend: str, inbox: Any, outbox: Any) -> None:
    """Open the array the test shares (for two imports), fork a helper, open it again
    (the fork left this process's sharing alone), report the helper's pid, and wait to
    be killed."""
    _use(backend)

    async def main() -> None:
        import aiocuda
        from aiocuda import ipc

        shared = await anyio.to_thread.run_sync(inbox.get)
        stream = aiocuda.Stream(0)
        first = await ipc.open_array(shared, stream=stream)
        helper = _fork_helper()
        second = await ipc.open_array(shared, stream=stream)
        await first.to_host(stream=stream)
        await second.to_host(stream=stream)
        outbox.put(("forked", helper))
        await anyio.to_thread.run_sync(inbox.get)

    _report(outbox, main)
