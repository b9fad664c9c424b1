"""Host-to-host copies of request-sized data on the event loop's thread."""

from __future__ import annotations

import ctypes
from typing import cast

__all__ = ["HOLD_GIL_BYTES", "memmove"]

HOLD_GIL_BYTES = 1 << 20
"""Copies up to this size keep the GIL; larger ones release it."""

_MEMMOVE_ADDRESS = cast(int, ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)  # (a function's: never null)
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    _MEMMOVE_ADDRESS
)


def memmove(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to ``dst``, keeping the GIL for copies up to
    :data:`HOLD_GIL_BYTES`: for the copies the loop's thread makes itself (staging a
    request's data, copying a download out). The copier threads, which copy in
    parallel, use ``ctypes.memmove``."""
    # Why: ``ctypes.memmove`` releases the GIL for the call and takes it back after. With a
    # thread of the process waiting for the GIL, taking it back is a hand-over through the
    # kernel: on the H200 machine, 64 tasks each uploading and downloading 64 KiB through
    # a request lane spent 68-71 us of the loop's CPU per request with ctypes.memmove,
    # 51 us holding the GIL (Executor.submit, two copies per request: 104-128 and
    # 85-90 us). A 64 KiB copy takes 2-5 us, 1 MiB about 50 us: far below the
    # interpreter's switch interval (5 ms).
    if nbytes <= HOLD_GIL_BYTES:
        _memmove_holding_gil(dst, src, nbytes)
    else:
        ctypes.memmove(dst, src, nbytes)
