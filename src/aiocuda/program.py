"""Compiling CUDA C++ with NVRTC into a :class:`~aiocuda.module.Module`.

::

    program = Program(source, options=ProgramOptions(std="c++17", fast_math=True),
                      name_expressions=["axpy<float>", "axpy<double>"])
    module = program.compile()              # for Device(0), cached on disk
    axpy_f = module.kernel("axpy<float>")   # name expressions resolve to mangled names

The target architecture is the device's own (``sm_90`` on an H100), compiled straight to
cubin; when the installed NVRTC is older than the device it compiles PTX for the newest
architecture it knows, which the driver then JIT-compiles. Compilation blocks the
calling thread for tens to hundreds of milliseconds on a miss: in a coroutine, run
``await anyio.to_thread.run_sync(program.compile)`` or compile at start-up.

Results are cached on disk (see :mod:`aiocuda._compile_cache`): a second process
compiling the same source with the same options for the same architecture and NVRTC
version reads the image instead of compiling.

On the simulated backend there is no compiler: ``compile`` records the kernel names the
source defines (plain ``__global__`` functions, and templates through their name
expressions) in a sim image; kernels then run through Python implementations
registered with ``SimDriver.register_kernel``.
"""

from __future__ import annotations

import importlib.util
import pathlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _compile_cache
from ._compile_cache import CachedImage, CompileCache
from ._signature import source_signatures
from .device import Device, as_device
from .errors import CudaError
from .module import Module

__all__ = ["CompileError", "Program", "ProgramOptions"]

_NVRTC_INSTALL = (
    "NVRTC (libnvrtc) was not found, so CUDA C++ cannot be compiled: pip install nvidia-cuda-nvrtc "
    "(or 'cuda-toolkit[nvrtc]'), or install the CUDA Toolkit"
)
_NVRTC_WHEEL_DIRS = ("cu13/lib", "cuda_nvrtc/lib")
"""Where the nvidia-cuda-nvrtc wheels (CUDA 13, CUDA 12) put libnvrtc, under ``nvidia/``
(as cuda-pathfinder searches them)."""


class CompileError(CudaError):
    """A program failed to compile; ``log`` holds NVRTC's full log (also in the message).

    Also raised, with an empty log, when NVRTC itself cannot be loaded (the message
    says which package to install).
    """

    def __init__(self, message: str, *, log: str = "", name: str = "AIOCUDA_COMPILE_ERROR") -> None:
        super().__init__(message, name=name)
        self.log = log


@dataclass(frozen=True, slots=True)
class ProgramOptions:
    """NVRTC options, in a form that cannot be misspelled.

    ``defines`` maps macro names to values (None for a bare ``-DNAME``). ``arch``
    overrides the device's architecture (``"sm_90"``, or ``"compute_90"`` for PTX).
    ``max_registers`` caps registers per thread (``--maxrregcount``). ``extra`` passes
    any other NVRTC option verbatim.
    """

    std: str | None = "c++17"
    defines: Mapping[str, str | None] = field(default_factory=dict)
    include_paths: Sequence[str] = ()
    fast_math: bool = False
    line_info: bool = False
    max_registers: int | None = None
    arch: str | None = None
    extra: Sequence[str] = ()

    def nvrtc_options(self) -> list[str]:
        """The option strings, without the architecture."""
        out: list[str] = []
        if self.std:
            out.append(f"--std={self.std}")
        out += [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in self.defines.items()]
        out += [f"--include-path={p}" for p in self.include_paths]
        if self.fast_math:
            out.append("--use_fast_math")
        if self.line_info:
            out.append("--generate-line-info")
        if self.max_registers is not None:
            out.append(f"--maxrregcount={int(self.max_registers)}")
        out += list(self.extra)
        return out


class Program:
    """CUDA C++ source to compile, with its options and template name expressions.

    Args:
        source: the CUDA C++ text. Kernels meant to be fetched by plain name should be
            ``extern "C"`` (C++ mangles the others' names).
        options: :class:`ProgramOptions`.
        name_expressions: template instantiations to compile and be able to fetch by
            that spelling, e.g. ``"axpy<float>"``.
        name: the file name NVRTC uses in its messages.
        cache: the on-disk cache: True for the default location (``AIOCUDA_CACHE_DIR``),
            False for none, or a :class:`~aiocuda._compile_cache.CompileCache`.
    """

    __slots__ = ("_cache", "name", "name_expressions", "options", "source")

    def __init__(
        self,
        source: str,
        *,
        options: ProgramOptions | None = None,
        name_expressions: Sequence[str] = (),
        name: str = "program.cu",
        cache: bool | CompileCache = True,
    ) -> None:
        self.source = source
        self.options = options or ProgramOptions()
        self.name_expressions = tuple(name_expressions)
        self.name = name
        self._cache: CompileCache | None = (
            cache if isinstance(cache, CompileCache) else (_compile_cache.default_cache() if cache else None)
        )

    def __repr__(self) -> str:
        return f"<Program {self.name!r} {len(self.source)} chars, names={list(self.name_expressions)}>"

    def compile(self, device: Device | int | None = None) -> Module:
        """Compile (or fetch from the cache) for ``device`` (default 0) and return the Module.

        The module loads lazily on each device that launches its kernels; compiled for
        one architecture, it only runs on devices of that architecture (or newer, for
        PTX). Raises :class:`CompileError` with NVRTC's log on failure.
        """
        dev = as_device(device)
        signatures = source_signatures(self.source, self.name_expressions)
        if dev._driver.name == "sim":
            return Module(self._sim_image(signatures), kind="sim", signatures=signatures, name=self.name)
        entry = self._compile_real(dev)
        return Module(
            entry.image,
            kind=entry.kind,
            signatures=signatures,
            lowered_names=entry.lowered_names,
            name=self.name,
            log=entry.log,
        )

    def _sim_image(self, signatures: Mapping[str, Any]) -> bytes:
        from ._driver.sim._modules import SIM_IMAGE_MAGIC

        missing = [e for e in self.name_expressions if e not in signatures]
        if missing:
            raise CompileError(
                f"{self.name}: name expression(s) {missing} name no __global__ function (or template) in the "
                f"source; it defines {sorted(signatures) or 'no kernels'}"
            )
        return SIM_IMAGE_MAGIC + "".join(f"{name}\n" for name in signatures).encode()

    def _compile_real(self, device: Device) -> CachedImage:
        # The key names the device's architecture rather than the one NVRTC will be asked
        # for, and the compiler by its wheel's version: a cache hit loads no NVRTC at all.
        major, minor = device.compute_capability
        target = self.options.arch or f"sm_{major}{minor}"
        options = self.options.nvrtc_options()

        def compile_now() -> CachedImage:
            nvrtc = _load_nvrtc()
            arch = self.options.arch or _device_arch(nvrtc, device)
            nvrtc_options = [f"--gpu-architecture={arch}", *options]
            return _nvrtc_compile(nvrtc, self.source, self.name, nvrtc_options, self.name_expressions, arch)

        return cached_compile(
            self._cache, self.source, options, self.name_expressions, target, _compiler_identity(), compile_now
        )


def cached_compile(
    cache: CompileCache | None,
    source: str,
    options: Sequence[str],
    name_expressions: Sequence[str],
    arch: str,
    compiler: str,
    compile_fn: Callable[[], CachedImage],
) -> CachedImage:
    """``compile_fn()``'s result, read from ``cache`` when an identical compile is stored."""
    if cache is None:
        return compile_fn()
    key = _compile_cache.cache_key(source, options, name_expressions, arch, compiler)
    found = cache.get(key)
    if found is not None:
        return found
    entry = compile_fn()
    cache.put(key, entry)
    return entry


# -- NVRTC ------------------------------------------------------------------------------------
_nvrtc_lock = threading.Lock()
_nvrtc_module: Any = None
_identity: str | None = None


def _load_nvrtc() -> Any:
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
                raise CompileError(f"{_NVRTC_INSTALL} ({type(exc).__name__}: {exc})", name="AIOCUDA_NO_NVRTC") from exc
            _nvrtc_module = nvrtc
    return _nvrtc_module


def _compiler_identity() -> str:
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
        nvrtc = _load_nvrtc()
        major, minor = _check(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
        _identity = f"nvrtc {major}.{minor}"
    return _identity


def _check(nvrtc: Any, result: tuple[Any, ...], call: str) -> Any:
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        text = nvrtc.nvrtcGetErrorString(err)[1]
        raise CompileError(f"{call}: {err.name}: {text.decode() if isinstance(text, bytes) else text}")
    return result[1] if len(result) == 2 else result[1:]


def _device_arch(nvrtc: Any, device: Device) -> str:
    """``sm_XY`` for the device, or ``compute_NN`` (PTX) of the newest architecture this
    NVRTC supports when it predates the device."""
    major, minor = device.compute_capability
    wanted = major * 10 + minor
    supported = [int(a) for a in _check(nvrtc, nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")]
    if wanted in supported or not supported:
        return f"sm_{wanted}"
    older = [a for a in supported if a <= wanted]
    return f"compute_{max(older) if older else min(supported)}"


def _output_buffer(size: int) -> bytearray:
    """A writable buffer for NVRTC to fill (its log, PTX or cubin).

    Never ``b" " * size``, the idiom of many cuda-bindings examples: NVRTC writes into the
    object it is given, and CPython shares every one-byte ``bytes`` object process-wide.
    An empty log has size 1, so ``b" " * 1`` *is* the interpreter's cached ``b" "``, and
    writing the log's NUL into it turned every ``b" "`` in the process into ``b"\\0"``
    (PyTorch then failed to import: its operator schemas lost their spaces).
    """
    return bytearray(size)


def _nvrtc_compile(
    nvrtc: Any, source: str, name: str, options: Sequence[str], name_expressions: Sequence[str], arch: str
) -> CachedImage:
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
        if arch.startswith("sm_"):
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
