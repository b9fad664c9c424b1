"""Small helpers every layer shares: factory-only classes, per-process singletons,
argument errors, byte sizes.

This module sits just above :mod:`aiocuda.errors` in the layer order, so the driver seam
may use it too; it imports nothing else from aiocuda.
"""

from __future__ import annotations

import atexit
import numbers
import operator
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, NoReturn, TypeVar

from .errors import ArgumentError, ResultCode

__all__ = [
    "NoPublicConstructor",
    "PerProcess",
    "byte_span",
    "c_strides",
    "format_bytes",
    "invalid_value",
    "outside_aiocuda",
    "shape_tuple",
]

T = TypeVar("T")


class NoPublicConstructor(type):
    """Metaclass of classes whose objects come only from factories.

    ``Cls(...)`` raises :class:`TypeError` naming the factories (the class attribute
    ``_factories``, a short phrase such as ``"MemoryPool.allocate() or aiocuda.empty()"``);
    aiocuda itself builds objects with ``Cls._create(...)``, which runs ``__init__`` as a
    normal call would. A hot path that fills a slots object's fields itself may take
    ``object.__new__(Cls)`` instead, skipping ``__init__``'s frame.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        factories = getattr(cls, "_factories", "")
        hint = f": use {factories}" if factories else ""
        raise TypeError(f"{cls.__qualname__} objects cannot be constructed directly{hint}")

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        instance: T = type.__call__(cls, *args, **kwargs)
        return instance


class PerProcess(Generic[T]):
    """One object per process, made by ``make()`` on first use (:meth:`get`) and made
    anew in a forked child, whose copy of the parent's threads and driver state is dead."""

    __slots__ = ("_lock", "_made", "_make")

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._made: tuple[int, T] | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        made = self._made
        if made is None or made[0] != os.getpid():
            with self._lock:
                made = self._made
                if made is None or made[0] != os.getpid():
                    made = self._made = (os.getpid(), self._make())
        return made[1]


def invalid_value(message: str) -> ArgumentError:
    """The :class:`~aiocuda.errors.ArgumentError` for a value aiocuda rejects before
    calling the driver, coded as the driver would (``CUDA_ERROR_INVALID_VALUE``)."""
    return ArgumentError(message, code=ResultCode.INVALID_VALUE, name="CUDA_ERROR_INVALID_VALUE")


def at_least(value: object, least: int, what: str) -> int:
    """``value`` as an int of at least ``least``: a ``TypeError`` if it is not an integer,
    a ``ValueError`` below ``least``, each naming ``what``."""
    try:
        if isinstance(value, bool):  # (an int to Python, a mistake here)
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None
    if number < least:
        raise ValueError(f"{what} must be >= {least}, got {number}")
    return number


def a_number(value: object, what: str, noun: str = "a number") -> float:
    """``value`` as a float: a ``TypeError`` naming ``what`` if it is not a real number
    (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be {noun}, not {type(value).__name__}")
    return float(value)


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``"512 B"``, ``"1.5 KiB"``, ... up to TiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def shape_tuple(shape: int | tuple[int, ...]) -> tuple[int, ...]:
    """A shape as a tuple of ints: an int or a tuple of integers (``TypeError`` saying
    so for anything else, such as a float, a list or a bool); ArgumentError for a
    negative dimension."""
    if type(shape) is int and shape >= 0:
        return (shape,)
    # map() and min() rather than generator expressions: each of those cost about
    # 0.2 us, and every new array and view comes through here.
    try:
        if isinstance(shape, bool):  # (an int to Python, a mistake here, as numpy says)
            raise TypeError
        dims = (operator.index(shape),) if not isinstance(shape, tuple) else tuple(map(operator.index, shape))
    except TypeError:
        # (operator.index's own message, "'list' object cannot be interpreted as an
        # integer", did not say that the shape was meant)
        raise TypeError(f"a shape must be an int or a tuple of ints, not {type(shape).__name__} {shape!r}") from None
    if dims and min(dims) < 0:
        raise invalid_value(f"negative dimension in shape {dims}")
    return dims


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The byte strides of a C-contiguous array of ``shape``."""
    # Filled in place from the end, without max(): a third of the time of a loop that
    # appends and reverses (0.14 us for one dimension, 0.6 us for four).
    ndim = len(shape)
    if ndim == 1:
        return (itemsize,)
    strides = [itemsize] * ndim
    step = itemsize
    for axis in range(ndim - 1, 0, -1):
        dim = shape[axis]
        if dim > 1:
            step *= dim
        strides[axis - 1] = step
    return tuple(strides)


def byte_span(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """``(lo, hi)``: the byte range, relative to the first element, that a view of
    ``shape`` and ``strides`` touches (``(0, 0)`` when it has no elements)."""
    if any(d == 0 for d in shape):
        return 0, 0
    lo = sum(s * (d - 1) for d, s in zip(shape, strides, strict=True) if s < 0)
    hi = sum(s * (d - 1) for d, s in zip(shape, strides, strict=True) if s > 0) + itemsize
    return lo, hi


def outside_aiocuda() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside aiocuda (call
    it in the ``warnings.warn`` call's arguments)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] == "aiocuda":
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level


_exiting = False


def exiting() -> bool:
    """Whether the interpreter is exiting: true from before the first finaliser that
    runs at exit (``weakref.finalize``'s), whose driver handles may be gone already."""
    return _exiting


def _mark_exiting() -> None:
    global _exiting
    _exiting = True


# atexit calls the last registered first. weakref.finalize's own exit hook, which runs
# every finaliser still pending (newest first: an Event made after an imported array is
# destroyed before the array's release waits for it), is registered when the first
# finalize is made: make one first, so that the exit is marked before any of them runs.
weakref.finalize(_mark_exiting, int).atexit = False
atexit.register(_mark_exiting)
