"""Compiling CUDA C++ with NVRTC into a :class:`~aiocuda.module.Module`.

::

    program = Program(source, options=ProgramOptions(std="c++17", fast_math=True),
                      name_expressions=["axpy<float>", "axpy<double>"])
    module = program.compile()              # for Device(0), cached on disk
    axpy_f = module.kernel("axpy<float>")   # name expressions resolve to mangled names

The target architecture is the device's own (``sm_90`` on an H100), compiled straight to
cubin; when the installed NVRTC is older than the device it compiles PTX for the newest
architecture it knows, which the driver then JIT-compiles. An architecture the options
name (``ProgramOptions(arch="compute_80")``, or ``-arch=compute_80`` among their
``extra`` options) is compiled for instead: ``sm_XY`` to a cubin, ``compute_XY`` to PTX.
Compilation blocks the
calling thread for tens to hundreds of milliseconds on a miss: in a coroutine, run
``await anyio.to_thread.run_sync(program.compile)`` or compile at start-up.

Results are cached on disk (``Program(cache=...)``): a second process compiling the same
source with the same name, options and included headers (their contents) for the same
architecture and NVRTC version reads the image instead of compiling. An entry is a
file in the cache folder, written atomically; delete the folder to clear the cache.

On the simulated backend, ``compile`` still compiles with NVRTC where it is installed
(NVRTC needs no GPU), for the simulated device's architecture, so a bad program fails
there too with :class:`CompileError`; without NVRTC it skips that check. The module it
returns records the kernel names the source defines (plain ``__global__`` functions, and
templates through their name expressions), and the kernels run as the Python
implementations registered for them (:func:`aiocuda.testing.Simulator.register_kernel`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _driver
from ._kernels import compile_cache as _compile_cache
from ._kernels import nvrtc
from ._kernels.compile_cache import CachedImage, CompileCache, cached_compile
from ._kernels.signature import cpp_linkage_kernels, source_signatures
from ._kernels.symbols import sim_variables, source_variables
from ._util import invalid_value
from .device import Device, _as_device
from .errors import CompileError
from .module import Module

__all__ = ["Program", "ProgramOptions"]


@dataclass(frozen=True, slots=True)
class ProgramOptions:
    """NVRTC options, in a form that cannot be misspelled.

    ``defines`` maps macro names to values (None for a bare ``-DNAME``). ``arch``
    overrides the device's architecture (``"sm_90"`` for a cubin, or ``"compute_90"``
    for PTX, which the driver compiles when it loads the module).
    ``max_registers`` caps registers per thread (``--maxrregcount``).
    ``relocatable_device_code`` (``-rdc=true``) compiles code that may call ``extern``
    device functions and use ``extern`` variables defined in other programs: link such
    modules with :meth:`~aiocuda.Module.link`. ``lto`` (``-dlto``) compiles to LTO-IR
    for link-time optimisation, which only :meth:`~aiocuda.Module.link` (through
    nvJitLink) can turn into a loadable module. ``extra`` passes any other NVRTC option
    verbatim; an architecture among them (``-arch=compute_90``,
    ``--gpu-architecture=sm_90``, or the flag and the architecture as two items) counts
    as ``arch`` does. ArgumentError for an architecture of another form, or for two that
    differ (``arch`` and one in ``extra``, or two in ``extra``).
    """

    std: str | None = "c++17"
    defines: Mapping[str, str | None] = field(default_factory=dict)
    include_paths: Sequence[str] = ()
    fast_math: bool = False
    line_info: bool = False
    max_registers: int | None = None
    arch: str | None = None
    relocatable_device_code: bool = False
    lto: bool = False
    extra: Sequence[str] = ()

    def __post_init__(self) -> None:
        self.architecture()  # (refuses a malformed or conflicting architecture now)

    def architecture(self) -> str | None:
        """The architecture these options compile for: ``arch``, or the one ``extra``
        names; None for the device's own."""
        named, _ = nvrtc.split_arch(self.extra)
        if self.arch is None:
            return named
        arch = nvrtc.check_arch(self.arch)
        if named is not None and named != arch:
            raise invalid_value(
                f"ProgramOptions(arch={arch!r}) and {named!r} among the extra options name two architectures: keep one"
            )
        return arch

    def nvrtc_options(self) -> list[str]:
        """The option strings, without the architecture (:meth:`architecture`)."""
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
        if self.relocatable_device_code:
            out.append("-rdc=true")
        if self.lto:
            out.append("-dlto")
        out += nvrtc.split_arch(self.extra)[1]
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
        cache: where compiled images are cached on disk: True for the default folder
            (``$AIOCUDA_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiocuda``, else
            ``~/.cache/aiocuda``; ``AIOCUDA_CACHE_DIR=off`` turns it off), a folder
            path, or False for no cache.
    """

    __slots__ = ("_cache", "name", "name_expressions", "options", "source")

    def __init__(
        self,
        source: str,
        *,
        options: ProgramOptions | None = None,
        name_expressions: Sequence[str] = (),
        name: str = "program.cu",
        cache: bool | str | os.PathLike[str] = True,
    ) -> None:
        if not isinstance(source, str):
            raise TypeError(f"source must be str (CUDA C++ text), not {type(source).__name__}")
        # NVRTC takes the source as a C string: it compiled the text before a NUL and
        # silently dropped the rest; a lone surrogate cannot be encoded for it at all.
        if "\0" in source:
            raise invalid_value(f"{name}: the source contains a NUL character (at offset {source.index(chr(0))})")
        try:
            source.encode()
        except UnicodeEncodeError as exc:
            raise invalid_value(f"{name}: the source is not valid text at offset {exc.start}: {exc.reason}") from None
        self.source = source
        self.options = options or ProgramOptions()
        self.name_expressions = tuple(name_expressions)
        self.name = name
        self._cache: CompileCache | None
        if isinstance(cache, bool):
            self._cache = _compile_cache.default_cache() if cache else None
        elif isinstance(cache, (str, os.PathLike)):
            self._cache = CompileCache(cache)
        else:
            raise TypeError(f"cache must be True, False or a folder path, not {type(cache).__name__}")

    def __repr__(self) -> str:
        return f"<Program {self.name!r} {len(self.source)} chars, names={list(self.name_expressions)}>"

    def compile(self, device: Device | int | None = None) -> Module:
        """Compile (or fetch from the cache) for ``device`` (default 0) and return the Module.

        The module loads lazily on each device that launches its kernels; compiled for
        one architecture, it only runs on devices of that architecture (or newer, for
        PTX). Raises :class:`CompileError` with NVRTC's log on failure.
        """
        dev = _as_device(device)
        signatures = source_signatures(self.source, self.name_expressions)
        variables = source_variables(self.source)
        mangled = cpp_linkage_kernels(self.source) - set(self.name_expressions)
        if dev._driver.name == "sim":
            image = self._sim_image(signatures, variables)
            self._compile_where_nvrtc_is(dev)
            return Module(
                image, kind="sim", signatures=signatures, name=self.name, variables=variables, cpp_kernels=mangled
            )
        entry = self._compile_real(dev)
        return Module(
            entry.image,
            kind=entry.kind,
            signatures=signatures,
            lowered_names=entry.lowered_names,
            name=self.name,
            log=entry.log,
            variables=variables,
            cpp_kernels=mangled,
        )

    def _sim_image(self, signatures: Mapping[str, Any], variables: Any) -> bytes:
        missing = [e for e in self.name_expressions if e not in signatures]
        if missing:
            raise CompileError(
                f"{self.name}: name expression(s) {missing} name no __global__ function (or template) in the "
                f"source; it defines {sorted(signatures) or 'no kernels'}"
            )
        return _driver.sim_image(signatures, sim_variables(variables))

    def _compile_where_nvrtc_is(self, device: Device) -> None:
        """On the simulator: compile (through the cache) to report errors in the source,
        unless NVRTC is not installed."""
        try:
            self._compile_real(device)
        except CompileError as exc:
            if exc.name != nvrtc.NO_NVRTC:
                raise

    def _compile_real(self, device: Device) -> CachedImage:
        # The key names the architecture the options ask for, else the device's rather
        # than the one NVRTC will be asked for (older than the device, it compiles PTX),
        # and the compiler by its wheel's version: a cache hit loads no NVRTC at all. The
        # architecture is passed once, first, and left out of the options: -arch=compute_80
        # in extra once followed the device's --gpu-architecture=sm_90; NVRTC warned,
        # compiled for compute_80 (making an sm_80 cubin too), and that cubin, which an
        # sm_90 GPU cannot load, was kept under the device's key where PTX was asked for.
        major, minor = device.compute_capability
        chosen = self.options.architecture()
        target = chosen or f"sm_{major}{minor}"
        options = self.options.nvrtc_options()

        def compile_now() -> CachedImage:
            arch = chosen or nvrtc.device_arch(device.compute_capability)
            return nvrtc.compile_program(
                self.source, self.name, [f"--gpu-architecture={arch}", *options], self.name_expressions, arch
            )

        return cached_compile(
            self._cache,
            self.source,
            options,
            self.name_expressions,
            target,
            nvrtc.compiler_identity(),
            compile_now,
            name=self.name,
        )
