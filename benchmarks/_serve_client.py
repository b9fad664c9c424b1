"""The client side of ``benchmarks/serve.py``: a process that sends HTTP/1.1 requests over
keep-alive connections on loopback, closed-loop or open-loop, on command.

Connections are opened by a ``connect`` command before a window (each answering one
request, so that the server has accepted and set it up) and kept for the later windows
against the same server: a window measures requests, not a burst of connection set-ups
(128 accepts at once held a fresh server's loop for 40 ms on the GPU machine).

A minimal hand-written client (a request is one write and two reads), so that a few
client processes saturate the server with room to spare: a general-purpose HTTP client
in Python would itself be the bottleneck.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def post(self, path: bytes, body: bytes) -> int:
        self.writer.write(
            b"POST " + path + b" HTTP/1.1\r\nHost: bench\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        self.writer.write(body)
        return await self._response()

    async def get(self, path: bytes) -> int:
        self.writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: bench\r\n\r\n")
        return await self._response()

    async def _response(self) -> int:
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        at = head.lower().find(b"content-length:")
        length = int(head[at + 15 : head.index(b"\r\n", at)]) if at >= 0 else 0
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


_pools: dict[int, list[Connection]] = {}
"""Open connections, by the server's port."""


async def connect(port: int, connections: int) -> dict[str, Any]:
    """Have ``connections`` open to ``port``, each having answered a request; close those
    to other ports (servers gone)."""
    for other in [p for p in _pools if p != port]:
        for conn in _pools.pop(other):
            conn.close()
    pool = _pools.setdefault(port, [])
    while len(pool) < connections:
        conn = await Connection.open(port)
        if await conn.get(b"/health") != 200:
            raise RuntimeError("the server's /health failed")
        pool.append(conn)
    return {"connections": len(pool)}


async def closed_loop(port: int, path: str, body: bytes, connections: int, seconds: float) -> dict[str, Any]:
    """``connections`` requests in flight at all times for ``seconds``."""
    await connect(port, connections)
    conns = _pools[port][:connections]
    target = path.encode()
    done = 0
    failed = 0
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(conn: Connection) -> None:
        nonlocal done, failed
        while True:
            start = time.perf_counter()
            if start >= deadline:
                return
            status = await conn.post(target, body)
            latencies.append(time.perf_counter() - start)
            if status == 200:
                done += 1
            else:
                failed += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - started
    return {"done": done, "failed": failed, "seconds": elapsed, "latencies": latencies}


async def open_loop(port: int, path: str, body: bytes, rate: float, seconds: float, pool: int) -> dict[str, Any]:
    """Requests sent at ``rate`` per second (evenly spaced) for ``seconds``; a request's
    latency counts from when it was due, so a slow server cannot hide queueing."""
    await connect(port, pool)
    conns: asyncio.Queue[Connection] = asyncio.Queue()
    for conn in _pools[port][:pool]:
        conns.put_nowait(conn)
    target = path.encode()
    latencies: list[float] = []
    failed = 0

    async def one(due: float) -> None:
        nonlocal failed
        conn = await conns.get()
        try:
            status = await conn.post(target, body)
        finally:
            conns.put_nowait(conn)
        latencies.append(time.perf_counter() - due)
        if status != 200:
            failed += 1

    start = time.perf_counter() + 0.01
    count = int(rate * seconds)
    tasks = []
    for k in range(count):
        due = start + k / rate
        await until(due)
        tasks.append(asyncio.ensure_future(one(due)))
    await asyncio.gather(*tasks)
    return {"done": len(latencies) - failed, "failed": failed, "seconds": seconds, "latencies": latencies}


SPIN_BEFORE = 0.002
"""Seconds before a request is due from which the client spins instead of sleeping."""


async def until(due: float) -> None:
    """Return at ``due`` (``time.perf_counter()`` seconds), on time: a loop's timers are a
    millisecond coarse (uvloop rounds delays to whole milliseconds, asyncio rounds them
    up), and a request sent late would count the client's lateness as the server's
    latency. So the last stretch spins, running the client's other tasks meanwhile (its
    CPUs are its own)."""
    left = due - time.perf_counter()
    if left > SPIN_BEFORE:
        await asyncio.sleep(left - SPIN_BEFORE)  # (wakes up to a millisecond either side)
    while time.perf_counter() < due:  # noqa: ASYNC110 - a spin, on purpose
        await asyncio.sleep(0)


def serve_commands(pipe: Any, cpus: list[int]) -> None:
    """A client process's main: run each command received on ``pipe``, send the result."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # one loop for every command: the connections outlive them
    commands = {"connect": connect, "closed": closed_loop, "open": open_loop}
    while True:
        command = pipe.recv()
        if command is None:
            for pool in _pools.values():
                for conn in pool:
                    conn.close()
            return
        kind, args = command
        try:
            result = loop.run_until_complete(commands[kind](**args))
        except Exception as exc:  # report, don't die: the parent decides
            result = {"error": repr(exc)}
        pipe.send(result)
