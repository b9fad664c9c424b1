"""The headers a program includes from disk, fingerprinted for the compile cache's key.

NVRTC reads ``#include`` files from disk: a quoted one from the folder of the including
file (for the program itself, the folder of its name, relative to the working
directory), then from the include paths in order; an angled one from the include paths
only. A header edited between two runs changes the compiled code, so the key must hold
the headers' contents -- but NVRTC cannot list the files it opened (no ``-M`` or
``-MD``), and a cache hit should not have to run it.

So the includes are found as NVRTC would find them, transitively, by scanning each file
for ``#include`` lines. The scan over-approximates rather than misses: an include inside
``#if 0`` or a comment counts too (a header that is not used then only costs a
recompile when it changes). A name that no folder holds (NVRTC's built-in headers, such
as ``cuda_fp16.h``) counts by its spelling, so a file of that name appearing later also
changes the key. ``#include MACRO`` cannot be followed; its spelling counts.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import deque
from collections.abc import Iterator, Sequence

__all__ = ["fingerprint", "search_options"]

_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*("[^"\n]*"|<[^>\n]*>|[^\n]*)', re.MULTILINE)

_PATH_OPTIONS = ("--include-path", "-I")
_PRE_INCLUDE_OPTIONS = ("--pre-include", "-include")


def _values(options: Sequence[str], spellings: tuple[str, str]) -> Iterator[str]:
    """The values of an option spelled ``--long=V``, ``--long V``, ``-sV`` or ``-s V``."""
    long_form, short_form = spellings
    it = iter(options)
    for option in it:
        if option in spellings:
            value = next(it, None)
            if value is not None:
                yield value
        elif option.startswith(long_form + "="):
            yield option[len(long_form) + 1 :]
        elif option.startswith(short_form) and not option.startswith("--") and len(option) > len(short_form):
            value = option[len(short_form) :]
            yield value[1:] if value.startswith("=") else value


def search_options(options: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(include paths, pre-included headers)`` named by NVRTC ``options``, in order."""
    return list(_values(options, _PATH_OPTIONS)), list(_values(options, _PRE_INCLUDE_OPTIONS))


def fingerprint(source: str, name: str, options: Sequence[str]) -> str:
    """A hex SHA-256 of every header ``source`` (compiled as ``name`` with ``options``)
    includes from disk, directly or through other headers: each one's path and contents,
    in the order they are found; empty when it includes nothing."""
    paths, pre_included = search_options(options)
    main_folder = os.path.dirname(name) or "."
    # Breadth first over (the include as spelled, the folder of the file that has it).
    queue = deque((b'"' + os.fsencode(header) + b'"', main_folder) for header in pre_included)
    queue.extend((spelled, main_folder) for spelled in _includes(source.encode(errors="surrogatepass")))
    if not queue:
        return ""
    digest = hashlib.sha256()
    seen: set[str] = set()
    while queue:
        spelled, here = queue.popleft()
        path = _resolve(spelled, here, paths)
        if path is None:
            digest.update(b"missing\0" + spelled + b"\0")
            continue
        real = os.path.realpath(path)
        digest.update(b"file\0" + os.fsencode(real) + b"\0")
        if real in seen:
            continue
        seen.add(real)
        try:
            with open(real, "rb") as f:
                contents = f.read()
        except OSError as exc:  # NVRTC will fail to read it too; key on the reason
            digest.update(f"unreadable {exc.errno}\0".encode())
            continue
        digest.update(hashlib.sha256(contents).digest())
        queue.extend((spelled, os.path.dirname(real)) for spelled in _includes(contents))
    return digest.hexdigest()


def _includes(text: bytes) -> list[bytes]:
    """What each ``#include`` line of ``text`` names: ``"x.h"``, ``<x.h>`` or a macro."""
    return [m.group(1).strip() for m in _INCLUDE.finditer(text)]


def _resolve(spelled: bytes, here: str, paths: Sequence[str]) -> str | None:
    """The file an include spelled ``"x.h"`` or ``<x.h>`` opens from ``here``, or None."""
    if len(spelled) > 1 and spelled[:1] == b'"' and spelled[-1:] == b'"':
        folders = [here, *paths]
    elif len(spelled) > 1 and spelled[:1] == b"<" and spelled[-1:] == b">":
        folders = list(paths)
    else:
        return None  # #include MACRO: keyed by its spelling
    header = os.fsdecode(spelled[1:-1])
    if os.path.isabs(header):
        return header if os.path.isfile(header) else None
    for folder in folders:
        candidate = os.path.join(folder, header)
        if os.path.isfile(candidate):
            return candidate
    return None
