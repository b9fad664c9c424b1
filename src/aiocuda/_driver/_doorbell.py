"""A POSIX-semaphore doorbell that the GPU rings without touching Python.

``cuLaunchHostFunc`` takes ``void (*)(void*)``; ``sem_post(sem_t*)`` has exactly that
shape. Enqueuing libc's ``sem_post`` with the address of a semaphore we own means the
driver's callback thread runs a few instructions of libc and never needs the GIL, so it
cannot deadlock against a thread that holds the GIL while it waits on the driver. The
waiting side blocks in ``sem_timedwait`` through ctypes, which releases the GIL while it
waits.
"""

# Why no Python host function: cuda-bindings' cuLaunchHostFunc wrapper takes the GIL on
# the driver's callback thread, and numba-cuda disabled its async_done tests for the
# deadlock that follows (numba-cuda issue 317; tests/test_completion.py reproduces it).

from __future__ import annotations

import ctypes
import ctypes.util
import math
import time
import weakref

__all__ = ["SemaphoreDoorbell"]

_SEM_T_SIZE = 64  # glibc's sem_t is 32 bytes on x86-64 and aarch64; leave headroom.


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for name in ("sem_init", "sem_post", "sem_timedwait", "sem_trywait", "sem_destroy"):
        getattr(libc, name).restype = ctypes.c_int
    libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    libc.sem_post.argtypes = [ctypes.c_void_p]
    libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    libc.sem_trywait.argtypes = [ctypes.c_void_p]
    libc.sem_destroy.argtypes = [ctypes.c_void_p]
    return libc


_libc = _load_libc()
_SEM_POST_ADDRESS = ctypes.cast(_libc.sem_post, ctypes.c_void_p).value or 0


def _destroy(sem: ctypes.Array[ctypes.c_char]) -> None:
    _libc.sem_destroy(ctypes.addressof(sem))


class SemaphoreDoorbell:
    """A counting semaphore; each ring adds one, :meth:`wait` consumes them all.

    ``c_function``/``c_argument`` are what a backend passes to ``cuLaunchHostFunc``.
    The semaphore's memory lives as long as this object; keep the doorbell alive while
    rings are enqueued (the completion engine owns one for the life of the process).
    """

    __slots__ = ("__weakref__", "_address", "_sem")

    def __init__(self) -> None:
        self._sem = ctypes.create_string_buffer(_SEM_T_SIZE)
        self._address = ctypes.addressof(self._sem)
        if _libc.sem_init(self._address, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        weakref.finalize(self, _destroy, self._sem)

    @property
    def c_function(self) -> int:
        return _SEM_POST_ADDRESS

    @property
    def c_argument(self) -> int:
        return self._address

    def ring(self) -> None:
        """Ring from Python (the simulated backend's host-function thread does this)."""
        _libc.sem_post(self._address)

    def wait(self, timeout: float) -> bool:
        """Block (GIL released) until rung or ``timeout`` seconds pass.

        Returns True if at least one ring was consumed. Every pending ring is drained, so
        many completions in one interval cost one wake-up.
        """
        deadline = time.clock_gettime(time.CLOCK_REALTIME) + timeout
        frac, whole = math.modf(deadline)
        spec = _Timespec(int(whole), int(frac * 1e9))
        rung = False
        while True:
            if _libc.sem_timedwait(self._address, ctypes.byref(spec)) == 0:
                rung = True
                break
            errno = ctypes.get_errno()
            if errno != 4:  # EINTR: retry; ETIMEDOUT (110) or other: give up
                break
        while _libc.sem_trywait(self._address) == 0:
            rung = True
        return rung
