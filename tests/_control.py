"""Controls for tests of timing and of races that must hold on a loaded CI machine.

A test that asserts "within 20 ms" breaks when the machine is busy: every thread then
runs late. :class:`ControlClock` is a thread that ticks every ``period`` seconds of
*sleep*, so it runs late exactly as the threads under test do; a bound counted in its
ticks stretches with the load instead of breaking.

A race test makes another thread act at one exact point and then waits until that thread
has finished or is blocked: :class:`WatchedLock` tells the second, with no sleep.

:func:`checkpoints` lets every other task run as far as it can, without time;
:func:`reserve_thread_done` waits for what aiocuda asked its reserve thread to make
(signal streams, events, spare pinned blocks) so far.

Fork tests run code in a forked child and read what it did (:func:`forked_outcomes`), or
fork while another thread holds a lock (:func:`forked_while_held`); a hung child fails
its test instead of the whole run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import anyio.lowlevel
import anyio.to_thread
import pytest

from aiocuda._completion.reserve import run_off_loop
from aiocuda.errors import NoDeviceError


class ControlClock:
    """A thread that counts ``time.sleep(period)`` calls; use as a context manager."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-clock", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.period)
            self.ticks += 1

    def __enter__(self) -> ControlClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class WatchedLock:
    """A lock that sets ``blocked`` when a thread has to wait for it."""

    def __init__(self, blocked: threading.Event) -> None:
        self._lock = threading.Lock()
        self._blocked = blocked

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._blocked.set()
            self._lock.acquire()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._lock.release()


async def checkpoints(n: int = 50) -> None:
    """Let every other task run as far as it can (no time involved)."""
    for _ in range(n):
        await anyio.lowlevel.checkpoint()


async def reserve_thread_done() -> None:
    """Wait until the jobs queued for aiocuda's reserve thread so far have run."""
    done = threading.Event()
    run_off_loop(done.set)
    await anyio.to_thread.run_sync(done.wait)


def unload_after(module: Any, backend: Any, call: str, monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """Make the next ``call`` of ``backend`` (a driver method) start ``module.unload()`` on
    another thread once it has returned, and return only once that unload finished or
    waits for the module's lock (a :class:`WatchedLock` from now on). The list returned
    gets the unloading thread."""
    progress = threading.Event()
    module._lock = WatchedLock(progress)
    unloaders: list[threading.Thread] = []
    original = getattr(type(backend), call)

    def unload_meanwhile(driver: Any, *args: Any) -> Any:
        found = original(driver, *args)
        if not unloaders:
            unloader = threading.Thread(target=lambda: (module.unload(), progress.set()))
            unloaders.append(unloader)
            unloader.start()
            assert progress.wait(10)
        return found

    monkeypatch.setattr(type(backend), call, unload_meanwhile)
    return unloaders


def forked_outcomes(*actions: Callable[[], object]) -> list[str]:
    """Run ``actions`` in turn in a child forked now and return what each did there: the
    string it returned (else ``"no error"``), the message of the ``NoDeviceError`` it
    raised, or ``"wrong error ..."`` for any other exception."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without cleanup
        outcomes = []
        for action in actions:
            try:
                result = action()
                outcomes.append(result if isinstance(result, str) else "no error")
            except NoDeviceError as exc:
                outcomes.append(str(exc))
            except BaseException as exc:
                outcomes.append(f"wrong error {type(exc).__name__}: {exc}")
        os.write(write_end, "\n".join(outcomes).encode())
        os._exit(0)
    os.close(write_end)
    status = _exit_status(pid)
    with os.fdopen(read_end) as reader:
        outcomes = reader.read().splitlines()
    assert status == 0
    return outcomes


def forked_while_held(lock: AbstractContextManager[object], action: Callable[[], object]) -> bool:
    """Whether ``action`` returns within 10 s in a child forked while another thread holds
    ``lock`` (a lock held at a fork stays held in the child, where no thread releases it)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: done within 10 s (exit 0) or not (exit 1), and leave without cleanup
            done = threading.Event()
            threading.Thread(target=lambda: (action(), done.set()), daemon=True).start()
            os._exit(0 if done.wait(10) else 1)
        status = _exit_status(pid)
    finally:
        release.set()
        holder.join()
    return os.waitstatus_to_exitcode(status) == 0


def _exit_status(pid: int) -> int:
    """The exit status of child ``pid``; a child still running after a minute (hung) is
    killed and the test fails, instead of the whole run waiting for it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")
