"""NVTX, called through ctypes: start/end ranges in aiocuda's own domain.

NVTX is a C API whose calls do nothing unless a tool (Nsight Systems) is attached. The
library comes from the ``nvidia-nvtx`` wheel (``libnvtx3interop.so.1``, CUDA 13), the
``nvidia-nvtx-cu12`` wheel or a CUDA toolkit (``libnvToolsExt.so.1``); without one,
:func:`load` returns None and ranges are not emitted.

Only start/end ranges are used: push/pop ranges form a per-thread stack, and tasks of an
event loop interleave on one thread, so a range pushed by one task would be popped by
another.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pathlib
import threading

__all__ = ["Nvtx", "load"]

_WHEEL_LIBRARIES = ("cu13/lib/libnvtx3interop.so.1", "nvtx/lib/libnvToolsExt.so.1")
_SYSTEM_LIBRARIES = ("libnvtx3interop.so.1", "libnvToolsExt.so.1")
_NVTX_VERSION = 3
_COLOR_ARGB = 1
_MESSAGE_ASCII = 1


class _EventAttributes(ctypes.Structure):
    """``nvtxEventAttributes_v2``."""

    _fields_ = (
        ("version", ctypes.c_uint16),
        ("size", ctypes.c_uint16),
        ("category", ctypes.c_uint32),
        ("color_type", ctypes.c_int32),
        ("color", ctypes.c_uint32),
        ("payload_type", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
        ("payload", ctypes.c_uint64),
        ("message_type", ctypes.c_int32),
        ("message", ctypes.c_char_p),
    )


class Nvtx:
    """The loaded library and aiocuda's domain in it."""

    __slots__ = ("_domain", "_end", "_start", "path")

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        create = lib.nvtxDomainCreateA
        create.restype = ctypes.c_void_p
        create.argtypes = (ctypes.c_char_p,)
        self._domain = create(b"aiocuda")
        self._start = lib.nvtxDomainRangeStartEx
        self._start.restype = ctypes.c_uint64
        self._start.argtypes = (ctypes.c_void_p, ctypes.POINTER(_EventAttributes))
        self._end = lib.nvtxDomainRangeEnd
        self._end.restype = None
        self._end.argtypes = (ctypes.c_void_p, ctypes.c_uint64)

    def start(self, message: str, color: int | None) -> int:
        attributes = _EventAttributes(
            version=_NVTX_VERSION,
            size=ctypes.sizeof(_EventAttributes),
            color_type=0 if color is None else _COLOR_ARGB,
            color=0 if color is None else color & 0xFFFFFFFF,
            message_type=_MESSAGE_ASCII,
            message=message.encode(errors="replace"),
        )
        return int(self._start(self._domain, ctypes.byref(attributes)))

    def end(self, range_id: int) -> None:
        self._end(self._domain, range_id)


_lock = threading.Lock()
_loaded: list[Nvtx | None] = []


def _after_fork_in_child() -> None:
    # A fork while another thread was inside load() left this lock held in the child,
    # where no thread will release it: the child's first load() waited forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _candidates() -> list[str]:
    found: list[str] = []
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        found += [str(path) for sub in _WHEEL_LIBRARIES if (path := pathlib.Path(base, sub)).exists()]
    return [*found, *_SYSTEM_LIBRARIES]


def load() -> Nvtx | None:
    """The NVTX library (loaded once), or None where none is installed."""
    if not _loaded:
        with _lock:
            if not _loaded:
                nvtx: Nvtx | None = None
                for path in _candidates():
                    try:
                        nvtx = Nvtx(ctypes.CDLL(path), path)
                        break
                    except (OSError, AttributeError):
                        continue
                _loaded.append(nvtx)
    return _loaded[0]
