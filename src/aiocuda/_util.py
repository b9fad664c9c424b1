"""Small helpers every layer shares: factory-only classes, argument errors, byte sizes.

This module sits just above :mod:`aiocuda.errors` in the layer order, so the driver seam
may use it too; it imports nothing else from aiocuda.
"""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

__all__ = ["NoPublicConstructor"]

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
