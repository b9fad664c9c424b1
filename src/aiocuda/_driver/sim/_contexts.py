"""Simulated contexts: primary-context flags, user contexts, the context stack, limits,
cache configuration, device synchronisation and peer attributes.

Departures from the driver, kept on purpose:

* Scheduling flags are recorded, not obeyed: every host wait of the sim sleeps on a
  condition variable (what ``CU_CTX_SCHED_BLOCKING_SYNC`` asks for).
* A user context shares its device's memory, modules and streams with the primary
  context (the sim keeps them per device); what it has of its own is its flags, limits,
  cache configuration and the streams created while it was current, which
  ``context_destroy`` lets finish and then destroys.
* Limits are kept as set (the driver may round some up); the ones the driver checks
  are checked: values must be >= 0, ``max_l2_fetch_granularity`` is 0, 32, 64 or 128,
  and ``persisting_l2_cache_size`` at most the device's ``max_persisting_l2_cache_size``.
* Every pair of distinct devices is linked as NVLink peers are: access and native
  atomics supported, performance rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...errors import ResultCode
from ._attributes import H100_ATTRIBUTES
from ._codes import sim_error
from ._objects import DEFAULT_LIMITS, SimContext, SimDevice, SimPoint, SimStream

__all__ = ["CACHE_CONFIGS", "SimContexts"]

_SCHED_MASK = 0x07
_FLAGS_MASK = 0xFF
_MAP_HOST = 0x08
"""Set on every context by drivers since CUDA 3.2 (``cuCtxGetFlags`` reports it)."""
CACHE_CONFIGS = ("prefer_none", "prefer_shared", "prefer_l1", "prefer_equal")
_PEER_ATTRIBUTES = {
    "performance_rank": 0,
    "access_supported": 1,
    "native_atomic_supported": 1,
    "access_access_supported": 1,
    "only_partial_native_atomic_supported": 0,
}


def _check_flags(flags: int, call: str) -> int:
    if not isinstance(flags, int) or flags < 0 or flags & ~_FLAGS_MASK or (flags & _SCHED_MASK) not in (0, 1, 2, 4):
        raise sim_error(ResultCode.INVALID_VALUE, call, f"invalid context flags {flags!r}")
    return flags


class SimContexts:
    """Mixin of SimDriver: contexts (see the module docstring)."""

    # Provided by SimCore.
    _api: Callable[..., None]
    _counted: Callable[[str], None]
    _device: Callable[[Any], SimDevice]
    _devices: tuple[SimDevice, ...]
    _context: Callable[[Any, str], SimContext]
    _context_stack: Callable[[], list[SimContext]]
    _current_context: Callable[[], SimContext | None]
    _device_of_current: Callable[[], int]
    _wait_for: Callable[[SimPoint, str], None]
    _streams: dict[int, SimStream]

    def _current(self, call: str) -> SimContext:
        """The calling thread's current context (its device's primary one when none is)."""
        ordinal = self._device_of_current()
        self._api(call, ordinal)
        return self._current_context() or self._devices[ordinal].context

    # -- primary contexts ---------------------------------------------------------------------
    def primary_context_get_state(self, dev: Any) -> tuple[int, bool]:
        self._counted("primary_context_get_state")
        context = self._device(dev).context
        return context.flags, context.retain_count > 0

    def primary_context_set_flags(self, dev: Any, flags: int) -> None:
        device = self._device(dev)
        self._api("primary_context_set_flags", device.ordinal)
        device.context.flags = _check_flags(flags, "primary_context_set_flags")

    # -- user contexts and the stack ---------------------------------------------------------
    def context_create(self, dev: Any, flags: int) -> SimContext:
        device = self._device(dev)
        self._api("context_create", device.ordinal)
        return SimContext(device.ordinal, primary=False, flags=_check_flags(flags, "context_create"))

    def context_destroy(self, ctx: Any) -> None:
        context = self._context(ctx, "context_destroy")
        self._api("context_destroy", context.device_ordinal)
        if context.primary:
            raise sim_error(
                ResultCode.INVALID_CONTEXT, "context_destroy", "a primary context is released, not destroyed"
            )
        for stream in self._devices[context.device_ordinal].streams():
            if stream.context is context and not stream.destroyed:
                self._wait_for(SimPoint(stream, stream.submitted), "context_destroy")
                self._streams.pop(stream.value, None)
                stream.destroy()
        context.destroyed = True
        stack = self._context_stack()
        if stack and stack[-1] is context:
            stack.pop()

    def context_push(self, ctx: Any) -> None:
        context = self._context(ctx, "context_push")
        self._api("context_push", context.device_ordinal)
        self._context_stack().append(context)

    def context_pop(self) -> None:
        self._counted("context_pop")
        stack = self._context_stack()
        if not stack:
            raise sim_error(ResultCode.INVALID_CONTEXT, "context_pop", "no context is current on this thread")
        stack.pop()

    def context_current_value(self) -> int:
        self._counted("context_current_value")
        context = self._current_context()
        return 0 if context is None else context.value

    def context_get_flags(self) -> int:
        return self._current("context_get_flags").flags | _MAP_HOST

    # -- limits and cache configuration ------------------------------------------------------
    def context_set_limit(self, limit: str, value: int) -> None:
        context = self._current("context_set_limit")
        if limit not in DEFAULT_LIMITS:
            raise sim_error(ResultCode.INVALID_VALUE, "context_set_limit", f"unknown limit {limit!r}")
        value = int(value)
        bad = value < 0
        if limit == "max_l2_fetch_granularity":
            bad = bad or value not in (0, 32, 64, 128)
        if limit == "persisting_l2_cache_size":
            bad = bad or value > H100_ATTRIBUTES["max_persisting_l2_cache_size"]
        if bad:
            raise sim_error(ResultCode.INVALID_VALUE, "context_set_limit", f"{value} is not a valid {limit}")
        context.limits[limit] = value

    def context_get_limit(self, limit: str) -> int:
        context = self._current("context_get_limit")
        if limit not in DEFAULT_LIMITS:
            raise sim_error(ResultCode.INVALID_VALUE, "context_get_limit", f"unknown limit {limit!r}")
        return context.limits[limit]

    def context_limit_names(self) -> Sequence[str]:
        self._counted("context_limit_names")
        return sorted(DEFAULT_LIMITS)

    def context_set_cache_config(self, config: str) -> None:
        context = self._current("context_set_cache_config")
        if config not in CACHE_CONFIGS:
            raise sim_error(
                ResultCode.INVALID_VALUE, "context_set_cache_config", f"unknown cache configuration {config!r}"
            )
        context.cache_config = config

    def context_get_cache_config(self) -> str:
        return self._current("context_get_cache_config").cache_config

    # -- peers ---------------------------------------------------------------------------------
    def device_p2p_attribute(self, dev: Any, peer: Any, attribute: str) -> int:
        self._counted("device_p2p_attribute")
        if self._device(dev) is self._device(peer):
            raise sim_error(
                ResultCode.INVALID_DEVICE,
                "device_p2p_attribute",
                f"device {self._device(dev).ordinal} has no peer link to itself",
            )
        value = _PEER_ATTRIBUTES.get(attribute)
        if value is None:
            raise sim_error(ResultCode.INVALID_VALUE, "device_p2p_attribute", f"unknown peer attribute {attribute!r}")
        return value
