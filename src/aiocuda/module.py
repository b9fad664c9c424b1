"""Modules: compiled code (PTX, cubin, fatbin), loaded lazily on each device that uses it.

A :class:`Module` holds an image, not a driver handle: the image is loaded into a
device's context (``cuModuleLoadDataEx``, with the module's :class:`JitOptions`) the
first time it is used on that device, so one module serves every GPU of its
architecture. Loading failures carry the driver's JIT log in the message;
:meth:`Module.jit_log` gives the info log of a load that succeeded.

Variables: ``module.get_global("coeffs")`` is a :class:`~aiocuda.DeviceArray` over a
``__constant__`` or ``__device__`` variable (``cuModuleGetGlobal``), read and written
with the array's awaitable copies::

    coeffs = module.get_global("coeffs", device=0)      # float[16], from the source
    await coeffs.copy_from(np.arange(16, dtype=np.float32))
    kernel.launch(grid, block, x, n, stream=s)           # reads the new values
    values = await coeffs.to_host()

Linking: :meth:`Module.link` links relocatable modules (``ProgramOptions(
relocatable_device_code=True)``), LTO-IR (``ProgramOptions(lto=True)``), objects and
libraries (``Module.from_file("libfoo.a")``) into one loadable module, so kernels can
call device functions defined in other programs.

``unload()`` (or collecting the module) unloads it from every device. Pitfall: kernels
and launchers keep their module alive, but an explicit ``unload()`` while launchers of
it are still used makes those launches fail -- unload only what you are done with.
"""

from __future__ import annotations

import math
import os
import pathlib
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from . import _driver
from ._driver import JitOptions
from ._kernels import linking as _linking
from ._kernels.signature import Signature, parse_signature, ptx_signatures
from ._kernels.symbols import Variable, ptx_variables
from ._memory import offloop as _offloop
from ._memory.buffers import OwnedBuffer
from ._util import invalid_value
from .array import DeviceArray, _device_of
from .device import Device, _as_device
from .errors import ArgumentError, CompileError
from .stream import Stream, _stream_for_new

if TYPE_CHECKING:
    from .kernel import Kernel

__all__ = ["JitOptions", "Module"]

_LOADABLE = ("ptx", "cubin", "fatbin", "sim")
_KINDS = (*_LOADABLE, "ltoir", "object", "library")
_SUFFIXES = {"ptx": "ptx", "cubin": "cubin", "fatbin": "fatbin", "ltoir": "ltoir", "o": "object", "a": "library"}


def _unload_all(handles: dict[tuple[int, int], tuple[Device, Any]]) -> None:
    # Off the loop: the driver unloads a module only once the device is idle.
    for device, handle in handles.values():
        _offloop.dispose(device, device._driver.module_unload, handle)
    handles.clear()


def _guess_kind(image: bytes) -> str:
    if image.startswith(b"\x7fELF"):
        return "cubin"
    if image[:4] == b"\x50\xed\x55\xba":  # fatbin magic (little endian 0xBA55ED50)
        return "fatbin"
    return "ptx"


class Module:
    """A loadable image and what is known about its kernels.

    Prefer the factories: :meth:`from_file`, :meth:`from_bytes`, or
    :meth:`aiocuda.Program.compile`.

    Args:
        image: PTX (text, NUL-terminated or not), cubin or fatbin bytes; or, for
            :meth:`link` only, LTO-IR (``"ltoir"``), a relocatable object (``"object"``)
            or a library (``"library"``).
        kind: ``"ptx"``, ``"cubin"``, ``"fatbin"``, ``"ltoir"``, ``"object"``,
            ``"library"`` (or ``"sim"``); guessed when None.
        signatures: kernel name -> its parameters, in any form :meth:`kernel` takes
            (``"const float*, float*, int"``), or None if unknown; used when a kernel is
            fetched without a declared signature. PTX images supply their own.
        lowered_names: name expression -> exported symbol (template kernels).
        jit_options: how the driver compiles PTX in the image when it loads it
            (:class:`JitOptions`); default the driver's.
        variables: ``__device__``/``__constant__`` variable name -> ``(dtype, shape)``,
            the default view :meth:`get_global` gives (a dtype of None means bytes).
            PTX images and :class:`~aiocuda.Program` supply their own.
        cpp_kernels: kernels of the source with C++ linkage and no name expression:
            their symbols are mangled, and :meth:`kernel` refuses them with an error that
            says so (:class:`~aiocuda.Program` supplies these).
    """

    __slots__ = (
        "__weakref__",
        "_cpp_kernels",
        "_finalizer",
        "_globals",
        "_handles",
        "_jit_logs",
        "_kernels",
        "_lock",
        "image",
        "jit_options",
        "kind",
        "log",
        "lowered_names",
        "name",
        "signatures",
        "variables",
    )

    def __init__(
        self,
        image: bytes,
        *,
        kind: str | None = None,
        signatures: Mapping[str, str | Sequence[Any] | None] | None = None,
        lowered_names: Mapping[str, str] | None = None,
        name: str = "",
        log: str = "",
        jit_options: JitOptions | None = None,
        variables: Mapping[str, Variable] | None = None,
        cpp_kernels: Iterable[str] = (),
    ) -> None:
        image = bytes(image)
        if not image:
            raise ArgumentError("a module image cannot be empty", name="CUDA_ERROR_INVALID_IMAGE")
        self.kind = kind or _guess_kind(image)
        if self.kind not in _KINDS:
            raise invalid_value(f"unknown module kind {self.kind!r}: one of {_KINDS}")
        if self.kind == "ptx" and not image.endswith(b"\0"):
            image += b"\0"  # the driver reads PTX as a C string
        self.image = image
        known = dict(ptx_signatures(image.decode(errors="replace"))) if self.kind == "ptx" else {}
        known.update({k: None if v is None else parse_signature(v) for k, v in (signatures or {}).items()})
        self.signatures: dict[str, Signature | None] = known
        self.lowered_names = dict(lowered_names or {})
        self._cpp_kernels = frozenset(cpp_kernels) - self.lowered_names.keys()
        self.name = name
        self.log = log
        if jit_options is not None and not isinstance(jit_options, JitOptions):
            raise TypeError(f"jit_options must be JitOptions, not {type(jit_options).__name__}")
        self.jit_options = jit_options
        found = ptx_variables(image.decode(errors="replace")) if self.kind == "ptx" else {}
        found.update(variables or {})
        self.variables: dict[str, Variable] = found
        self._jit_logs: dict[tuple[int, int], str] = {}
        # Held by unload() and from a handle's look-up to what is made from it (a
        # variable's memory, a kernel's function): an unload in between forgot what was
        # made from the handle before it was registered.
        self._lock = threading.Lock()
        self._handles: dict[tuple[int, int], tuple[Device, Any]] = {}
        self._kernels: weakref.WeakValueDictionary[Any, Kernel] = weakref.WeakValueDictionary()
        # The memory of get_global's arrays, made unusable by unload(): a copy into a
        # variable of an unloaded module wrote freed device memory (on the simulator it
        # poisoned the device).
        self._globals: weakref.WeakSet[OwnedBuffer] = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _unload_all, self._handles)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, kind: str | None = None, **kwargs: Any) -> Module:
        """Load ``.ptx``, ``.cubin`` or ``.fatbin`` from disk (kind from the suffix or contents)."""
        p = pathlib.Path(path)
        suffix = p.suffix.lstrip(".").lower()
        return cls(p.read_bytes(), kind=kind or _SUFFIXES.get(suffix), name=p.name, **kwargs)

    @classmethod
    def from_bytes(cls, image: bytes | str, *, kind: str | None = None, **kwargs: Any) -> Module:
        """An image in memory; ``str`` is taken as PTX text."""
        if isinstance(image, str):
            return cls(image.encode(), kind=kind or "ptx", **kwargs)
        return cls(image, kind=kind, **kwargs)

    def __repr__(self) -> str:
        loaded = sorted(ordinal for _, ordinal in self._handles)
        return f"<Module {self.name or self.kind!r} {len(self.image)} bytes, loaded on devices {loaded}>"

    def kernel(self, name: str, *, signature: str | Sequence[Any] | None = None) -> Kernel:
        """The kernel ``name`` (a plain name or a compiled name expression such as
        ``"axpy<float>"``). ``signature`` declares its parameters: C-like text
        (``"float a, const float* x, float* y, int n"``) or a sequence of numpy dtypes and
        pointer items (``[np.float32, "float*", "ptr"]``); a TypeError names an item it
        cannot read. Without it the signature parsed from the source or PTX is used, if
        any. The function is looked up on first use.

        Returns the same :class:`~aiocuda.kernel.Kernel` (and so its cached launchers)
        for the same name and signature while it is alive."""
        from .kernel import Kernel

        if name in self._cpp_kernels:  # (the driver would say "not found", on a GPU only)
            raise invalid_value(
                f"kernel {name!r} has C++ linkage, so its symbol in the module is mangled: declare it "
                f'extern "C", or compile it with Program(..., name_expressions=[{name!r}])'
            )
        key = (name, None if signature is None else parse_signature(signature))
        found = self._kernels.get(key)
        if found is None:
            found = self._kernels[key] = Kernel._create(self, name, key[1])
        return found

    def symbol(self, name: str) -> str:
        """The exported symbol of kernel ``name`` (mangled for name expressions)."""
        return self.lowered_names.get(name, name)

    def handle(self, device: Device) -> Any:
        """The module loaded on ``device`` (loading it now if needed)."""
        found = self._handles.get((_driver.backend_generation(), device.ordinal))
        if found is not None:
            return found[1]
        with self._lock:
            return self._handle_locked(device)

    def _handle_locked(self, device: Device) -> Any:
        """:meth:`handle`, for a caller holding the module's lock."""
        key = (_driver.backend_generation(), device.ordinal)
        found = self._handles.get(key)
        if found is None:
            if self.kind not in _LOADABLE:
                raise CompileError(
                    f"module {self.name or self.kind!r} is {self.kind}, which cannot be loaded: link it into a "
                    f"loadable module first (aiocuda.Module.link([...]))",
                    name="AIOCUDA_NOT_LOADABLE",
                )
            device.make_current()
            handle, log = device._driver.module_load_data(self.image, self.jit_options)
            self._jit_logs[key] = log
            found = self._handles[key] = (device, handle)
        return found[1]

    def jit_log(self, device: Device | int | None = None) -> str:
        """The driver JIT's info log of loading this module on ``device`` (default 0;
        loading it now if needed): empty for a cubin, and often for PTX unless
        ``JitOptions(log_verbose=True)``."""
        dev = _as_device(device)
        self.handle(dev)
        return self._jit_logs.get((_driver.backend_generation(), dev.ordinal), "")

    def kernel_names(self, device: Device | int | None = None) -> list[str]:
        """The kernels the module defines, as the driver lists them on ``device``
        (default 0; loading the module there if needed). Template kernels compiled from
        name expressions are listed by their expression (``"axpy<float>"``), other C++
        kernels by their mangled name."""
        dev = _as_device(device)
        handle = self.handle(dev)
        dev.make_current()
        expressions = {symbol: expression for expression, symbol in self.lowered_names.items()}
        return sorted(expressions.get(name, name) for name in dev._driver.module_function_names(handle))

    def get_global(
        self,
        name: str,
        *,
        device: Device | int | None = None,
        dtype: npt.DTypeLike | None = None,
        shape: int | tuple[int, ...] | None = None,
        stream: Stream | None = None,
    ) -> DeviceArray:
        """A :class:`~aiocuda.DeviceArray` over the ``__device__`` or ``__constant__``
        variable ``name`` on ``device`` (default: the device of ``stream``, or of the
        current stream, else 0; the module is loaded there if needed).

        Its element type and shape are the variable's as declared in the source or PTX
        (a ``float coeffs[16]`` gives 16 float32), or ``dtype`` and ``shape`` (which must
        fit the variable's bytes); a variable of unknown type is bytes. Read and write it
        with the array's copies (``await array.copy_from(host)``, ``await
        array.to_host()``), enqueued on ``stream`` (default: the device's current stream).
        Kernels launched after a write has been awaited see the new values.

        The array keeps the module alive; after :meth:`unload` it raises ArgumentError
        when used (ask again for the variable of the reloaded module).
        ArgumentError (``CUDA_ERROR_NOT_FOUND``) when the module has no such variable.
        """
        # The device of the stream given, or else of the current stream: the copy of the
        # variable that kernels launched there read.
        s = stream if stream is not None else _stream_for_new(device)
        dev = _device_of(device, s)
        # Under the module's lock, from the handle to the buffer's registration: an
        # unload() on another thread in between cleared the registry before this buffer
        # joined it, and the array kept the address of the unloaded module's variable
        # (or the driver was asked for a variable of a module it had unloaded).
        with self._lock:
            handle = self._handle_locked(dev)
            dev.make_current()
            ptr, size = dev._driver.module_get_global(handle, name)
            buffer = OwnedBuffer(ptr, size, dev, s, self)
            self._globals.add(buffer)
        declared_dtype, declared_shape = self.variables.get(name, (None, None))
        element = np.dtype(dtype if dtype is not None else declared_dtype if declared_dtype is not None else np.uint8)
        if shape is None:
            if dtype is None and declared_shape is not None and declared_dtype is not None:
                shape = declared_shape
            elif size % element.itemsize:
                raise invalid_value(f"variable {name!r} has {size} bytes, not a whole number of {element} elements")
            else:
                shape = (size // element.itemsize,)
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if math.prod(dims) * element.itemsize > size:
            raise invalid_value(f"variable {name!r} has {size} bytes; shape {dims} of {element} does not fit")
        return DeviceArray(dims, element, buffer=buffer)

    @classmethod
    def link(
        cls,
        modules: Sequence[Module],
        *,
        device: Device | int | None = None,
        options: JitOptions | None = None,
        name: str = "linked",
    ) -> Module:
        """Link ``modules`` into one loadable module for ``device``'s architecture
        (default device 0).

        Inputs: modules compiled relocatable (``ProgramOptions(relocatable_device_code=
        True)``) or to LTO-IR (``ProgramOptions(lto=True)``), PTX, cubins, fatbins,
        objects and libraries (``Module.from_file("libfoo.a")``). With any LTO-IR input
        nvJitLink links (link-time optimisation; the ``nvidia-nvjitlink`` package), else
        the driver's linker. ``options`` are the linker's (optimisation level, registers,
        logs); the linker's info log is the new module's :attr:`log`. The result knows
        every input's kernel signatures, template names and variables. CompileError with
        the linker's log on failure (an undefined or twice-defined symbol).
        """
        if not modules:
            raise invalid_value("Module.link needs at least one module")
        if options is not None and not isinstance(options, JitOptions):
            raise TypeError(f"options must be JitOptions, not {type(options).__name__}")
        dev = _as_device(device)
        image, kind, log = _linking.link([(m.kind, m.image, m.name or m.kind) for m in modules], dev, options)
        signatures: dict[str, Any] = {}
        lowered: dict[str, str] = {}
        variables: dict[str, Variable] = {}
        for m in modules:
            signatures.update(m.signatures)
            lowered.update(m.lowered_names)
            variables.update(m.variables)
        linked = cls(image, kind=kind, lowered_names=lowered, name=name, log=log, variables=variables)
        linked.signatures.update(signatures)
        return linked

    def unload(self) -> None:
        """Unload from every device it was loaded on (it reloads if used again).

        Kernels obtained from it forget their functions and cached launchers; launchers
        returned earlier by ``Kernel.bind`` must not be used afterwards. Arrays from
        :meth:`get_global` raise ArgumentError when used afterwards."""
        with self._lock:
            for buffer in list(self._globals):
                buffer.lose(invalid_value(f"a variable of module {self.name or self.kind!r}, which was unloaded"))
            self._globals.clear()
            _unload_all(self._handles)
            for kernel in list(self._kernels.values()):
                kernel._forget()
