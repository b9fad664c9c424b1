"""Modules: compiled code (PTX, cubin, fatbin), loaded lazily on each device that uses it.

A :class:`Module` holds an image, not a driver handle: the image is loaded into a
device's context (``cuModuleLoadData``) the first time a kernel of it is used on that
device, so one module serves every GPU of its architecture. Loading failures carry the
driver's JIT log in the message.

``unload()`` (or collecting the module) unloads it from every device. Pitfall: kernels
and launchers keep their module alive, but an explicit ``unload()`` while launchers of
it are still used makes those launches fail -- unload only what you are done with.
"""

from __future__ import annotations

import os
import pathlib
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import _driver
from ._kernels.signature import Signature, parse_signature, ptx_signatures
from ._memory import offloop as _offloop
from ._util import invalid_value
from .device import Device
from .errors import ArgumentError

if TYPE_CHECKING:
    from .kernel import Kernel

__all__ = ["Module"]

_KINDS = ("ptx", "cubin", "fatbin", "sim")


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
        image: PTX (text, NUL-terminated or not), cubin or fatbin bytes.
        kind: ``"ptx"``, ``"cubin"``, ``"fatbin"`` (or ``"sim"``); guessed when None.
        signatures: kernel name -> its parameters, in any form :meth:`kernel` takes
            (``"const float*, float*, int"``), or None if unknown; used when a kernel is
            fetched without a declared signature. PTX images supply their own.
        lowered_names: name expression -> exported symbol (template kernels).
    """

    __slots__ = (
        "__weakref__",
        "_finalizer",
        "_handles",
        "_kernels",
        "_lock",
        "image",
        "kind",
        "log",
        "lowered_names",
        "name",
        "signatures",
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
        self.name = name
        self.log = log
        self._lock = threading.Lock()
        self._handles: dict[tuple[int, int], tuple[Device, Any]] = {}
        self._kernels: weakref.WeakValueDictionary[Any, Kernel] = weakref.WeakValueDictionary()
        self._finalizer = weakref.finalize(self, _unload_all, self._handles)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, kind: str | None = None, **kwargs: Any) -> Module:
        """Load ``.ptx``, ``.cubin`` or ``.fatbin`` from disk (kind from the suffix or contents)."""
        p = pathlib.Path(path)
        suffix = p.suffix.lstrip(".").lower()
        return cls(p.read_bytes(), kind=kind or (suffix if suffix in _KINDS else None), name=p.name, **kwargs)

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
        key = (_driver.backend_generation(), device.ordinal)
        found = self._handles.get(key)
        if found is not None:
            return found[1]
        with self._lock:
            found = self._handles.get(key)
            if found is None:
                device.make_current()
                found = self._handles[key] = (device, device._driver.module_load_data(self.image))
        return found[1]

    def unload(self) -> None:
        """Unload from every device it was loaded on (it reloads if used again).

        Kernels obtained from it forget their functions and cached launchers; launchers
        returned earlier by ``Kernel.bind`` must not be used afterwards."""
        with self._lock:
            _unload_all(self._handles)
            for kernel in list(self._kernels.values()):
                kernel._forget()
