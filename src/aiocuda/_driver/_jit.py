"""How the driver compiles and links code when it loads it: :class:`JitOptions`, shared by
the kernel layer and both backends."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any, Literal

from .._util import invalid_value

__all__ = ["Fallback", "JitOptions", "LinkInput"]

Fallback = Literal["prefer_ptx", "prefer_binary"]

LinkInput = tuple[str, bytes, str]
"""One input of ``Driver.link``: ``(kind, data, name)``, kind one of ``"ptx"``,
``"cubin"``, ``"fatbin"``, ``"object"``, ``"library"`` (and ``"sim"`` on the simulated
backend)."""

_TARGET = re.compile(r"^(?:sm_|compute_)?(\d{2,3})$")


def _optional_int(value: Any, what: str, lo: int, hi: int) -> int | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise invalid_value(f"{what} must be an int, got {value!r}") from None
    if not lo <= number <= hi:
        raise invalid_value(f"{what} must be between {lo} and {hi}, got {number}")
    return number


def _target(value: Any) -> int | None:
    """A compute capability as the driver numbers its JIT targets (``90`` for sm_90)."""
    if value is None:
        return None
    if isinstance(value, tuple) and len(value) == 2:
        major, minor = (_optional_int(v, "target", 0, 99) for v in value)
        assert major is not None and minor is not None
        return major * 10 + minor
    match = _TARGET.match(str(value)) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if match is None:
        raise invalid_value(f"target must be like 'sm_90', 'compute_90', 90 or (9, 0), got {value!r}")
    return int(match[1])


@dataclass(frozen=True, slots=True, init=False)
class JitOptions:
    """Options for the driver's JIT compiler and linker (``cuModuleLoadDataEx``,
    ``cuLink*``): how PTX in a module is compiled when it is loaded, and how inputs are
    linked.

    ::

        module = aiocuda.Module.from_file("kernels.ptx",
                                          jit_options=aiocuda.JitOptions(max_registers=64))
        print(module.jit_log(device))          # the JIT's info log of that load

    Args:
        optimization_level: 0 (none) to 4 (the default, most).
        max_registers: registers per thread at most (1..255).
        threads_per_block: compile for at least this many threads per block.
        target: the architecture PTX is compiled for (``"sm_90"``, ``90`` or
            ``(9, 0)``); default: the device's.
        generate_debug_info: device debug information (``-G``).
        generate_line_info: line numbers for profilers.
        log_verbose: a verbose info log.
        fallback: when a module holds both PTX and a matching binary, which to load.

    Options only affect PTX that the driver compiles: a cubin compiled for the device
    loads as it is. Bad values raise :class:`~aiocuda.errors.ArgumentError`.
    """

    optimization_level: int | None
    max_registers: int | None
    threads_per_block: int | None
    target: int | None
    generate_debug_info: bool
    generate_line_info: bool
    log_verbose: bool
    fallback: Fallback | None

    def __init__(
        self,
        *,
        optimization_level: int | None = None,
        max_registers: int | None = None,
        threads_per_block: int | None = None,
        target: str | int | tuple[int, int] | None = None,
        generate_debug_info: bool = False,
        generate_line_info: bool = False,
        log_verbose: bool = False,
        fallback: Fallback | None = None,
    ) -> None:
        init = object.__setattr__
        init(self, "optimization_level", _optional_int(optimization_level, "optimization_level", 0, 4))
        init(self, "max_registers", _optional_int(max_registers, "max_registers", 1, 255))
        init(self, "threads_per_block", _optional_int(threads_per_block, "threads_per_block", 1, 1024))
        init(self, "target", _target(target))
        for name, flag in (
            ("generate_debug_info", generate_debug_info),
            ("generate_line_info", generate_line_info),
            ("log_verbose", log_verbose),
        ):
            if not isinstance(flag, bool):
                raise invalid_value(f"{name} must be True or False, got {flag!r}")
            init(self, name, flag)
        if fallback not in (None, "prefer_ptx", "prefer_binary"):
            raise invalid_value(f"fallback must be 'prefer_ptx' or 'prefer_binary', got {fallback!r}")
        if self.target is not None and self.threads_per_block is not None:
            raise invalid_value("target and threads_per_block cannot be combined (the driver refuses it)")
        init(self, "fallback", fallback)
