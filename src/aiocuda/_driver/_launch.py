"""How a kernel is launched: :class:`LaunchConfig`, shared by the kernel layer and both backends."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from ..errors import LaunchError

__all__ = ["Dim3", "LaunchConfig"]

Dim3 = int | tuple[int] | tuple[int, int] | tuple[int, int, int]
"""Grid, block or cluster dimensions: an int or a tuple of 1 to 3 ints (missing ones are 1)."""


def _bad(message: str) -> LaunchError:
    return LaunchError(message, name="AIOCUDA_BAD_CONFIG")


def _integer(value: Any) -> int:
    """``value`` as an int if it is an integer (numpy integers included), not a bool."""
    if isinstance(value, bool):
        raise TypeError("a bool is not a size")
    return operator.index(value)


def _dim3(value: Any, what: str) -> tuple[int, int, int]:
    dims = value if isinstance(value, tuple) else (value,)
    try:
        if not 1 <= len(dims) <= 3:
            raise TypeError
        ints = tuple(_integer(d) for d in dims)
    except TypeError:
        raise _bad(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}") from None
    if any(d < 1 for d in ints):
        raise _bad(f"{what} dimensions must be >= 1, got {value!r}")
    x, y, z = (*ints, 1, 1)[:3]
    return x, y, z


@dataclass(frozen=True, slots=True, init=False)
class LaunchConfig:
    """The launch parameters of a kernel, checked once: grid, block, dynamic shared
    memory, thread-block cluster and cooperative launch.

    ::

        config = aiocuda.LaunchConfig(grid=(64, 64), block=(16, 16), shared_mem=4096)
        kernel.launch(config, x, y, n, stream=s)
        go = kernel.bind(config, stream=s)     # or kernel[config, s]

    Dimensions are an int or a tuple of 1 to 3 ints, each at least 1, and are stored as
    3-tuples (``grid=128`` becomes ``(128, 1, 1)``). ``shared_mem`` is the dynamic shared
    memory per block in bytes (more than 48 KiB needs the kernel's
    ``max_dynamic_shared_size_bytes`` attribute raised first). ``cluster`` (compute
    capability 9.0+) must divide the grid; a ``cooperative`` launch needs a grid whose
    blocks can all be resident at once. Anything else raises
    :class:`~aiocuda.errors.LaunchError`; what the device cannot run is reported by the
    driver when launching.
    """

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    cluster: tuple[int, int, int] | None
    cooperative: bool

    def __init__(
        self,
        grid: Dim3,
        block: Dim3,
        *,
        shared_mem: int = 0,
        cluster: Dim3 | None = None,
        cooperative: bool = False,
    ) -> None:
        try:
            shared = _integer(shared_mem)
        except TypeError:
            raise _bad(f"shared_mem must be an int number of bytes, got {shared_mem!r}") from None
        if shared < 0:
            raise _bad(f"shared_mem must be >= 0, got {shared_mem!r}")
        if not isinstance(cooperative, bool):
            raise _bad(f"cooperative must be True or False, got {cooperative!r}")
        init = object.__setattr__
        init(self, "grid", _dim3(grid, "grid"))
        init(self, "block", _dim3(block, "block"))
        init(self, "shared_mem", shared)
        init(self, "cluster", None if cluster is None else _dim3(cluster, "cluster"))
        init(self, "cooperative", cooperative)

    @property
    def extended(self) -> bool:
        """True when the launch needs ``cuLaunchKernelEx`` (a cluster or cooperative)."""
        return self.cooperative or self.cluster is not None
