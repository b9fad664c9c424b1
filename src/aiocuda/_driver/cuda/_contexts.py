"""Real-driver contexts: primary-context flags, user contexts, the context stack, limits,
cache configuration, device synchronisation and peer attributes (see _driver/_protocol.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from ...errors import ResultCode, error_for_code
from . import _core
from ._core import check

__all__ = ["CudaContexts"]


def _members(prefix: str, enum: Any) -> dict[str, Any]:
    return {
        member.name[len(prefix) :].lower(): member
        for member in enum
        if member.name.startswith(prefix) and not member.name.endswith("_MAX")
    }


def _unknown(kind: str, name: str, call: str, known: Sequence[str]) -> Exception:
    return error_for_code(
        ResultCode.INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE",
        f"unknown {kind} {name!r} (one of {', '.join(sorted(known))})",
        call,
    )


class CudaContexts:
    """Mixin of CudaDriver: contexts and what belongs to them."""

    _tables: ClassVar[dict[str, dict[str, Any]]] = {}

    def _table(self, kind: str) -> dict[str, Any]:
        table = CudaContexts._tables.get(kind)
        if table is None:
            drv = _core.drv
            prefix, enum = {
                "limit": ("CU_LIMIT_", drv.CUlimit),
                "cache configuration": ("CU_FUNC_CACHE_", drv.CUfunc_cache),
                "peer attribute": ("CU_DEVICE_P2P_ATTRIBUTE_", drv.CUdevice_P2PAttribute),
            }[kind]
            table = CudaContexts._tables[kind] = _members(prefix, enum)
        return table

    def _member(self, kind: str, name: str, call: str) -> Any:
        table = self._table(kind)
        member = table.get(name)
        if member is None:
            raise _unknown(kind, name, call, list(table))
        return member

    # -- primary contexts ---------------------------------------------------------------------
    def primary_context_get_state(self, dev: Any) -> tuple[int, bool]:
        flags, active = check(_core.drv.cuDevicePrimaryCtxGetState(dev), "cuDevicePrimaryCtxGetState")
        return int(flags), bool(active)

    def primary_context_set_flags(self, dev: Any, flags: int) -> None:
        check(_core.drv.cuDevicePrimaryCtxSetFlags(dev, flags), "cuDevicePrimaryCtxSetFlags")

    # -- user contexts and the stack ---------------------------------------------------------
    def context_create(self, dev: Any, flags: int) -> Any:
        drv = _core.drv
        try:  # cuda-bindings 13: cuCtxCreate(params, flags, dev); 12: cuCtxCreate(flags, dev)
            result = drv.cuCtxCreate(None, flags, dev)
        except TypeError:
            result = drv.cuCtxCreate(flags, dev)
        ctx = check(result, "cuCtxCreate")
        check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")  # cuCtxCreate pushed it
        return ctx

    def context_destroy(self, ctx: Any) -> None:
        check(_core.drv.cuCtxDestroy(ctx), "cuCtxDestroy")

    def context_push(self, ctx: Any) -> None:
        check(_core.drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")

    def context_pop(self) -> None:
        check(_core.drv.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def context_current_value(self) -> int:
        return int(check(_core.drv.cuCtxGetCurrent(), "cuCtxGetCurrent"))

    def context_get_flags(self) -> int:
        return int(check(_core.drv.cuCtxGetFlags(), "cuCtxGetFlags"))

    # -- limits and cache configuration ------------------------------------------------------
    def context_set_limit(self, limit: str, value: int) -> None:
        member = self._member("limit", limit, "cuCtxSetLimit")
        check(_core.drv.cuCtxSetLimit(member, value), "cuCtxSetLimit")

    def context_get_limit(self, limit: str) -> int:
        member = self._member("limit", limit, "cuCtxGetLimit")
        return int(check(_core.drv.cuCtxGetLimit(member), "cuCtxGetLimit"))

    def context_limit_names(self) -> Sequence[str]:
        return sorted(self._table("limit"))

    def context_set_cache_config(self, config: str) -> None:
        member = self._member("cache configuration", config, "cuCtxSetCacheConfig")
        check(_core.drv.cuCtxSetCacheConfig(member), "cuCtxSetCacheConfig")

    def context_get_cache_config(self) -> str:
        member = check(_core.drv.cuCtxGetCacheConfig(), "cuCtxGetCacheConfig")
        return str(member.name[len("CU_FUNC_CACHE_") :].lower())

    def function_set_cache_config(self, func: Any, config: str) -> None:
        member = self._member("cache configuration", config, "cuFuncSetCacheConfig")
        check(_core.drv.cuFuncSetCacheConfig(func, member), "cuFuncSetCacheConfig")

    # -- peers ---------------------------------------------------------------------------------
    def device_p2p_attribute(self, dev: Any, peer: Any, attribute: str) -> int:
        member = self._member("peer attribute", attribute, "cuDeviceGetP2PAttribute")
        if int(dev) == int(peer):
            raise error_for_code(
                ResultCode.INVALID_DEVICE,
                "CUDA_ERROR_INVALID_DEVICE",
                f"device {int(dev)} has no peer link to itself",
                "cuDeviceGetP2PAttribute",
            )
        return int(check(_core.drv.cuDeviceGetP2PAttribute(member, dev, peer), "cuDeviceGetP2PAttribute"))
