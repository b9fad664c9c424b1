"""The on-disk cache of compiled kernels, so that a service's second start compiles nothing.

An entry is keyed by the SHA-256 of everything that determines NVRTC's output: the
source, the program's name, the options in their order, the headers it includes from
disk (their paths and contents, found as NVRTC finds them: ``includes.py``), the name
expressions, the target architecture, the compiler's version and this cache's format
version. It stores the image (cubin or PTX), its kind and the lowered (mangled) names
of the name expressions, in one file written atomically (a temporary file in the same directory,
then ``os.replace``), so concurrent processes never read a half-written entry. Its
header holds the image's SHA-256: a file that cannot be read or decoded, or whose image
does not match it (truncated, a flipped bit), counts as a miss and is overwritten.

Location: ``$AIOCUDA_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiocuda``, else
``~/.cache/aiocuda``. Set ``AIOCUDA_CACHE_DIR=off`` to disable it. Delete the folder to
clear it; nothing else refers to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import includes

__all__ = ["CachedImage", "CompileCache", "cache_key", "cached_compile", "default_cache"]

FORMAT_VERSION = 2
_HEADER_END = b"\n"
_IMAGE_KINDS = ("cubin", "ptx", "ltoir", "sim")  # CachedImage.kind


@dataclass(frozen=True, slots=True)
class CachedImage:
    """A compiled module image and what is needed to use it."""

    image: bytes
    kind: str
    """``"cubin"``, ``"ptx"``, ``"ltoir"`` (``-dlto``) or ``"sim"``."""
    lowered_names: dict[str, str]
    """Name expression (``"axpy<float>"``) -> the symbol the module exports."""
    log: str = ""
    """The compiler's warnings, if any."""


def cache_key(
    source: str,
    options: Sequence[str],
    name_expressions: Sequence[str],
    arch: str,
    compiler_version: str,
    *,
    name: str = "",
    headers: str = "",
) -> str:
    """The hex SHA-256 identifying one compilation of ``source`` named ``name``;
    ``headers`` is the fingerprint of the headers it includes (``includes.fingerprint``)."""
    doc = {
        "format": FORMAT_VERSION,
        "source": source,
        # The name is __FILE__, the file named in the log and the line info, and the
        # folder that quoted includes are looked up in.
        "name": name,
        # In their order: the first include path holding a header wins, and of -DX=1 and
        # -DX=2 (or -DX and -UX) the last one.
        "options": list(options),
        "headers": headers,
        "names": sorted(name_expressions),
        "arch": arch,
        "compiler": compiler_version,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class CompileCache:
    """A folder of compiled images, one file per key."""

    __slots__ = ("directory",)

    def __init__(self, directory: os.PathLike[str] | str) -> None:
        self.directory = pathlib.Path(directory)

    def __repr__(self) -> str:
        return f"<CompileCache {str(self.directory)!r}>"

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / key[:2] / f"{key}.bin"

    def get(self, key: str) -> CachedImage | None:
        """The entry for ``key``, or None (missing, unreadable or corrupt)."""
        try:
            data = self._path(key).read_bytes()
            header, _, image = data.partition(_HEADER_END)
            meta = json.loads(header)
            if (
                meta.get("format") != FORMAT_VERSION
                or meta.get("size") != len(image)
                or meta.get("kind") not in _IMAGE_KINDS
                # A damaged image of the right size would reach the driver as code.
                or meta.get("sha256") != hashlib.sha256(image).hexdigest()
            ):
                return None
            return CachedImage(image, str(meta["kind"]), dict(meta["lowered_names"]), str(meta.get("log", "")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, entry: CachedImage) -> None:
        """Store ``entry`` atomically; failures (read-only disk, full disk) are ignored --
        the cache is an optimisation, never a reason to fail a compile."""
        meta = {
            "format": FORMAT_VERSION,
            "kind": entry.kind,
            "lowered_names": entry.lowered_names,
            "log": entry.log,
            "size": len(entry.image),
            "sha256": hashlib.sha256(entry.image).hexdigest(),
        }
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".bin")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(json.dumps(meta).encode() + _HEADER_END + entry.image)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            return


def default_cache() -> CompileCache | None:
    """The cache at the configured location, or None when ``AIOCUDA_CACHE_DIR=off``."""
    configured = os.environ.get("AIOCUDA_CACHE_DIR", "").strip()
    if configured.lower() in ("off", "0", "none", "disabled"):
        return None
    if configured:
        return CompileCache(configured)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache"
    return CompileCache(base / "aiocuda")


def cached_compile(
    cache: CompileCache | None,
    source: str,
    options: Sequence[str],
    name_expressions: Sequence[str],
    arch: str,
    compiler: str,
    compile_fn: Callable[[], CachedImage],
    *,
    name: str = "",
) -> CachedImage:
    """``compile_fn()``'s result, read from ``cache`` when an identical compile is stored."""
    if cache is None:
        return compile_fn()
    headers = includes.fingerprint(source, name, options)
    key = cache_key(source, options, name_expressions, arch, compiler, name=name, headers=headers)
    found = cache.get(key)
    if found is not None:
        return found
    entry = compile_fn()
    cache.put(key, entry)
    return entry
