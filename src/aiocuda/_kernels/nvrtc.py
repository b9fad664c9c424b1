"""NVRTC: loading the runtime compiler and compiling CUDA C++ to cubin or PTX."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import threading
from collections.abc import Sequence
from typing import Any

from .._util import invalid_value
from ..errors import CompileError
from .compile_cache import CachedImage

__all__ = ["NO_NVRTC", "check_arch", "compile_program", "compiler_identity", "device_arch", "load", "split_arch"]

NO_NVRTC = "AIOCUDA_NO_NVRTC"
"""The ``name`` of the CompileError raised when NVRTC itself cannot be loaded."""

_NVRTC_INSTALL = (
    "NVRTC (libnvrtc) was not found, so CUDA C++ cannot be compiled: pip install nvidia-cuda-nvrtc "
    "(or 'cuda-toolkit[nvrtc]'), or install the CUDA Toolkit"
)
_NVRTC_WHEEL_DIRS = ("cu13/lib", "cuda_nvrtc/lib")
"""Where the nvidia-cuda-nvrtc wheels (CUDA 13, CUDA 12) put libnvrtc, under ``nvidia/``
(as cuda-pathfinder searches them)."""

_nvrtc_lock = threading.Lock()
_nvrtc_module: Any = None
_identity: str | None = None


def _after_fork_in_child() -> None:
    # A fork while another thread was inside load() left this lock held in the child,
    # where no thread will release it: the child's first load() waited forever.
    global _nvrtc_lock
    _nvrtc_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def load() -> Any:
    """``cuda.bindings.nvrtc`` once its library is known to load; CompileError otherwise."""
    global _nvrtc_module
    if _nvrtc_module is not None:
        return _nvrtc_module
    with _nvrtc_lock:
        if _nvrtc_module is None:
            try:
                from cuda.bindings import nvrtc

                _check(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
            except CompileError:
                raise
            except Exception as exc:  # ImportError, cuda.pathfinder's DynamicLibNotFoundError, ...
                raise CompileError(f"{_NVRTC_INSTALL} ({type(exc).__name__}: {exc})", name=NO_NVRTC) from exc
            _nvrtc_module = nvrtc
    return _nvrtc_module


def compiler_identity() -> str:
    """What identifies the compiler for the cache key, found without loading NVRTC where
    possible: the NVRTC wheel's library file (path, size, modification time) -- the one
    cuda-bindings loads first -- else the loaded library's own version."""
    global _identity
    if _identity is None:
        spec = importlib.util.find_spec("nvidia")
        for base in (spec.submodule_search_locations or []) if spec is not None else []:
            for sub in _NVRTC_WHEEL_DIRS:
                for lib in sorted(pathlib.Path(base, sub).glob("libnvrtc.so*")):
                    st = lib.stat()
                    _identity = f"{lib}:{st.st_size}:{st.st_mtime_ns}"
                    return _identity
        nvrtc = load()
        major, minor = _check(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
        _identity = f"nvrtc {major}.{minor}"
    return _identity


def _check(nvrtc: Any, result: tuple[Any, ...], call: str) -> Any:
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        text = nvrtc.nvrtcGetErrorString(err)[1]
        raise CompileError(f"{call}: {err.name}: {text.decode() if isinstance(text, bytes) else text}")
    return result[1] if len(result) == 2 else result[1:]


def device_arch(compute_capability: tuple[int, int]) -> str:
    """``sm_XY`` for the device, or ``compute_NN`` (PTX) of the newest architecture this
    NVRTC supports when it predates the device."""
    nvrtc = load()
    major, minor = compute_capability
    wanted = major * 10 + minor
    supported = [int(a) for a in _check(nvrtc, nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")]
    if wanted in supported or not supported:
        return f"sm_{wanted}"
    older = [a for a in supported if a <= wanted]
    return f"compute_{max(older) if older else min(supported)}"


_ARCH_FLAGS = ("-arch", "--gpu-architecture")
_ARCH = re.compile(r"(?:sm|compute)_[1-9][0-9]{1,2}[af]?")
_ARCH_FORMS = (
    "sm_XY (a cubin for GPUs of that architecture) or compute_XY (PTX, which the driver compiles for the "
    "GPU it loads on), e.g. sm_90 or compute_90, with 'a' or 'f' after the number for architecture- or "
    "family-specific features (sm_90a)"
)


def split_arch(options: Sequence[str]) -> tuple[str | None, list[str]]:
    """The architecture NVRTC ``options`` name (``-arch=compute_90``,
    ``--gpu-architecture=sm_90``, or either flag followed by the architecture as the
    next item), and the other options, in their order.

    ArgumentError for a flag without an architecture, an architecture NVRTC's option
    does not take the form of, or two that differ (NVRTC would compile for the last,
    with a warning)."""
    found: str | None = None
    rest: list[str] = []
    items = iter(options)
    for option in items:
        flag, equals, value = option.partition("=")
        if flag not in _ARCH_FLAGS:
            rest.append(option)
            continue
        if not equals:
            value = next(items, "")
            if not value:
                raise invalid_value(f"{flag!r} ends the program's options without an architecture: {_ARCH_FORMS}")
        arch = check_arch(value)
        if found is not None and arch != found:
            raise invalid_value(
                f"the program's options name two architectures, {found!r} and {arch!r}: keep one "
                "(ProgramOptions(arch=...), or one -arch option)"
            )
        found = arch
    return found, rest


def check_arch(arch: str) -> str:
    """``arch`` when it has the form of an architecture NVRTC compiles for (``sm_90``,
    ``compute_90a``); ArgumentError otherwise. Whether this NVRTC knows it, NVRTC says."""
    if not isinstance(arch, str) or not _ARCH.fullmatch(arch):
        raise invalid_value(f"{arch!r} is not an architecture: {_ARCH_FORMS}")
    return arch


def _output_buffer(size: int) -> bytearray:
    """A writable buffer for NVRTC to fill (its log, PTX or cubin).

    Never ``b" " * size``, the idiom of many cuda-bindings examples: NVRTC writes into the
    object it is given, and CPython shares every one-byte ``bytes`` object process-wide.
    An empty log has size 1, so ``b" " * 1`` *is* the interpreter's cached ``b" "``, and
    writing the log's NUL into it turned every ``b" "`` in the process into ``b"\\0"``
    (PyTorch then failed to import: its operator schemas lost their spaces).
    """
    return bytearray(size)


def compile_program(
    source: str, name: str, options: Sequence[str], name_expressions: Sequence[str], arch: str
) -> CachedImage:
    """Compile ``source`` with NVRTC for ``arch`` (``sm_XY``: cubin, ``compute_XY``: PTX;
    with ``-dlto`` among the options: LTO-IR); CompileError with NVRTC's log on failure."""
    nvrtc = load()
    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for expression in name_expressions:
            _check(nvrtc, nvrtc.nvrtcAddNameExpression(prog, expression.encode()), "nvrtcAddNameExpression")
        encoded = [o.encode() for o in options]
        result = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        raw_log = _output_buffer(_check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize"))
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, raw_log), "nvrtcGetProgramLog")
        log = bytes(raw_log).rstrip(b"\0 ").decode(errors="replace").strip()
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"{name}: compilation failed ({' '.join(options)}):\n{log}", log=log)
        if "-dlto" in options:
            image = _output_buffer(_check(nvrtc, nvrtc.nvrtcGetLTOIRSize(prog), "nvrtcGetLTOIRSize"))
            _check(nvrtc, nvrtc.nvrtcGetLTOIR(prog, image), "nvrtcGetLTOIR")
            kind = "ltoir"
        elif arch.startswith("sm_"):
            image = _output_buffer(_check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize"))
            _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
            kind = "cubin"
        else:
            image = _output_buffer(_check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize"))
            _check(nvrtc, nvrtc.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
            kind = "ptx"
        lowered = {}
        for expression in name_expressions:
            symbol = _check(nvrtc, nvrtc.nvrtcGetLoweredName(prog, expression.encode()), "nvrtcGetLoweredName")
            lowered[expression] = symbol.decode() if isinstance(symbol, bytes) else str(symbol)
        return CachedImage(bytes(image), kind, lowered, log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
