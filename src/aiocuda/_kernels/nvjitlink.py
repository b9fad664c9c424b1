"""nvJitLink: linking LTO-IR (and anything else) into a cubin, for link-time optimisation.

The driver's own linker (``cuLink*``, behind the seam) links PTX, cubins, objects and
libraries; only nvJitLink links LTO-IR, which NVRTC produces with ``-dlto``. It comes
from the ``nvidia-nvjitlink`` wheel (or a CUDA toolkit) and is loaded on first use.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from .._driver import JitOptions
from ..errors import CompileError

__all__ = ["link", "load"]

_INSTALL = (
    "nvJitLink (libnvJitLink) was not found, so LTO-IR cannot be linked: pip install nvidia-nvjitlink "
    "(or 'cuda-toolkit[nvjitlink]'), or install the CUDA Toolkit"
)
_INPUT_TYPES = {
    "ltoir": "LTOIR",
    "cubin": "CUBIN",
    "ptx": "PTX",
    "fatbin": "FATBIN",
    "object": "OBJECT",
    "library": "LIBRARY",
}

_lock = threading.Lock()
_module: Any = None


def _after_fork_in_child() -> None:
    # A fork while another thread was inside load() left this lock held in the child,
    # where no thread will release it: the child's first load() waited forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def load() -> Any:
    """``cuda.bindings.nvjitlink`` once its library is known to load; CompileError otherwise."""
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                try:
                    from cuda.bindings import nvjitlink

                    nvjitlink.version()
                except Exception as exc:  # ImportError, cuda.pathfinder's DynamicLibNotFoundError, ...
                    raise CompileError(
                        f"{_INSTALL} ({type(exc).__name__}: {exc})", name="AIOCUDA_NO_NVJITLINK"
                    ) from exc
                _module = nvjitlink
    return _module


def _options(arch: str, options: JitOptions | None, lto: bool) -> list[str]:
    out = [f"-arch={arch}"]
    if lto:
        out.append("-lto")
    if options is not None:
        if options.optimization_level is not None:
            out.append(f"-O{options.optimization_level}")
        if options.max_registers is not None:
            out.append(f"-maxrregcount={options.max_registers}")
        if options.generate_debug_info:
            out.append("-g")
        if options.generate_line_info:
            out.append("-lineinfo")
        if options.log_verbose:
            out.append("-verbose")
    return out


def _log(nvjitlink: Any, handle: int, which: str) -> str:
    size = getattr(nvjitlink, f"get_{which}_log_size")(handle)
    if not size:
        return ""
    buffer = bytearray(size)
    getattr(nvjitlink, f"get_{which}_log")(handle, buffer)
    return bytes(buffer).rstrip(b"\0").decode(errors="replace").strip()


def link(inputs: Sequence[tuple[str, bytes, str]], arch: str, options: JitOptions | None) -> tuple[bytes, str]:
    """Link ``(kind, data, name)`` inputs for ``arch`` (``"sm_90"``): ``(cubin, info_log)``.
    CompileError with nvJitLink's log on failure."""
    nvjitlink = load()
    lto = any(kind == "ltoir" for kind, _, _ in inputs)
    if options is not None and options.target is not None:
        arch = f"sm_{options.target}"
    flags = _options(arch, options, lto)
    handle = nvjitlink.create(len(flags), flags)
    try:
        try:
            for kind, data, name in inputs:
                input_type = getattr(nvjitlink.InputType, _INPUT_TYPES[kind])
                nvjitlink.add_data(handle, input_type, data, len(data), name)
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as exc:
            log = _log(nvjitlink, handle, "error")
            raise CompileError(f"linking failed ({' '.join(flags)}): {exc}\n{log}".rstrip(), log=log) from exc
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        return bytes(cubin), _log(nvjitlink, handle, "info")
    finally:
        nvjitlink.destroy(handle)
