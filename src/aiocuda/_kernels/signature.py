"""Kernel signatures: what each argument of a ``__global__`` function is.

A :class:`Signature` is a tuple of :class:`Param`: by-value scalars (a numpy dtype and
the ``struct`` code that packs it) or pointers (packed as 8-byte addresses; the pointee
dtype is kept for the simulated backend, which hands kernels typed numpy views).

Signatures come from three places, in this order of preference:

* declared by the caller, as a C-like string (``"const float*, float*, int n"``) or a
  sequence of items (numpy dtypes or type names, and ``"ptr"`` / ``"float*"``);
* parsed from CUDA C++ source (``extern "C" __global__ void name(...)`` and simple
  templates instantiated through name expressions such as ``"axpy<double>"``);
* parsed from PTX text (``.entry name(.param .u64 ..., ...)``).

Parsing is deliberately modest: it understands the builtin scalar types, fixed-width
typedefs, pointers and template type parameters. A kernel whose parameters it cannot
read (structs by value, nested templates) simply has no inferred signature, and
launching it asks for a declared one instead of guessing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Param", "Signature", "parse_signature", "ptx_signatures", "source_signatures", "strip_comments"]

_SCALARS: dict[str, str] = {
    "bool": "bool",
    "char": "int8",
    "signed char": "int8",
    "unsigned char": "uint8",
    "short": "int16",
    "short int": "int16",
    "unsigned short": "uint16",
    "unsigned short int": "uint16",
    "int": "int32",
    "signed": "int32",
    "signed int": "int32",
    "unsigned": "uint32",
    "unsigned int": "uint32",
    "long": "int64",
    "long int": "int64",
    "unsigned long": "uint64",
    "unsigned long int": "uint64",
    "long long": "int64",
    "long long int": "int64",
    "unsigned long long": "uint64",
    "unsigned long long int": "uint64",
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "__half": "float16",
    "int8_t": "int8",
    "uint8_t": "uint8",
    "int16_t": "int16",
    "uint16_t": "uint16",
    "int32_t": "int32",
    "uint32_t": "uint32",
    "int64_t": "int64",
    "uint64_t": "uint64",
    "size_t": "uint64",
    "ptrdiff_t": "int64",
    "ssize_t": "int64",
    "intptr_t": "int64",
    "uintptr_t": "uint64",
}
"""C/C++ type spellings (LP64, as on every Linux CUDA host) -> numpy dtype names."""

_STRUCT_CODES: dict[str, str] = {
    "bool": "?",
    "int8": "b",
    "uint8": "B",
    "int16": "h",
    "uint16": "H",
    "int32": "i",
    "uint32": "I",
    "int64": "q",
    "uint64": "Q",
    "float16": "e",
    "float32": "f",
    "float64": "d",
}

_QUALIFIERS = re.compile(r"\b(?:const|volatile|__restrict__|__restrict|restrict|struct|std::)\b|__align__\(\d+\)")
_POINTER_WORDS = {"ptr", "pointer", "void*"}


@dataclass(frozen=True, slots=True)
class Param:
    """One kernel parameter.

    ``pointer`` parameters take device arrays, buffers, objects with
    ``__cuda_array_interface__``, ``None`` (NULL) or ``int`` addresses; ``dtype`` is then
    the pointee type (``uint8`` for ``void*``). Scalars take Python or numpy numbers
    that fit ``dtype``.
    """

    dtype: np.dtype
    pointer: bool = False
    name: str = ""

    @property
    def code(self) -> str:
        """The ``struct`` format code the argument is packed with."""
        return "Q" if self.pointer else _STRUCT_CODES[self.dtype.name]

    @property
    def pointee(self) -> np.dtype | None:
        """The element type an array passed for this pointer must have, or None when any
        array will do: ``void*``, byte pointers (``char*``, ``uint8_t*``, ...), pointers
        to types the parser does not know, and scalars."""
        return self.dtype if self.pointer and self.dtype.itemsize > 1 else None

    def describe(self) -> str:
        kind = f"{self.dtype.name}*" if self.pointer else self.dtype.name
        return f"{kind} {self.name}".rstrip()


Signature = tuple[Param, ...]


def _scalar_dtype(spelling: str) -> np.dtype | None:
    name = _SCALARS.get(spelling)
    if name is None:
        try:
            dtype = np.dtype(spelling)
        except TypeError:
            return None
        return dtype if dtype.name in _STRUCT_CODES else None
    return np.dtype(name)


def _parse_c_param(text: str, types: dict[str, str] | None = None) -> Param | None:
    """One C parameter declaration (``"const float* __restrict__ x"``), or None."""
    text = " ".join(_QUALIFIERS.sub(" ", text).replace("&", " & ").split())
    if not text or "&" in text or "[" in text or "(" in text:
        return None
    pointer = "*" in text
    words = text.replace("*", " ").split()
    name = ""
    if len(words) > 1 and words[-1] not in _SCALARS and (_scalar_dtype(" ".join(words)) is None):
        name = words.pop()
    base = " ".join(words)
    if types is not None and base in types:
        base = types[base]
    if pointer:
        dtype = _scalar_dtype(base) if base != "void" else np.dtype("uint8")
        return Param(dtype if dtype is not None else np.dtype("uint8"), pointer=True, name=name)
    dtype = _scalar_dtype(base)
    return None if dtype is None else Param(dtype, name=name)


def parse_signature(spec: str | Sequence[object]) -> Signature:
    """A declared signature: ``"const float*, float* y, int n"`` or ``[np.float32, "ptr"]``.

    Raises :class:`TypeError` for an item that names no supported type.
    """
    items: Iterable[object] = _split_params(spec) if isinstance(spec, str) else spec
    params: list[Param] = []
    for index, item in enumerate(items):
        param: Param | None
        if isinstance(item, Param):
            param = item
        elif isinstance(item, str) and item.strip().lower() in _POINTER_WORDS:
            param = Param(np.dtype("uint8"), pointer=True)
        elif isinstance(item, str):
            param = _parse_c_param(item)
        else:
            try:
                dtype = np.dtype(item)  # type: ignore[call-overload]
            except TypeError:
                dtype = None
            param = Param(dtype) if dtype is not None and dtype.name in _STRUCT_CODES else None
        if param is None:
            raise TypeError(
                f"signature item {index} ({item!r}) is not a supported kernel parameter type: use a "
                f"scalar C type or numpy dtype ({', '.join(sorted(_STRUCT_CODES))}) or a pointer ('float*', 'ptr')"
            )
        params.append(param)
    return tuple(params)


def _split_params(text: str) -> list[str]:
    """Split a parameter list on top-level commas."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [p.strip() for p in out if p.strip() and p.strip() != "void"]


def strip_comments(source: str) -> str:
    """CUDA C++ source without ``//`` and ``/* */`` comments (string literals are rare in kernels)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.DOTALL)


_KERNEL = re.compile(
    r"(?P<template>template\s*<(?P<tparams>[^<>]*)>\s*)?"
    r"(?P<extern>extern\s+\"C\"\s+)?"
    r"(?:static\s+|inline\s+|__launch_bounds__\([^)]*\)\s*)*"
    r"__global__\s+(?:__launch_bounds__\([^)]*\)\s*)?void\s+"
    r"(?:__launch_bounds__\([^)]*\)\s*)?(?P<name>[A-Za-z_]\w*)\s*\((?P<params>[^)]*)\)"
)


def source_signatures(source: str, name_expressions: Sequence[str] = ()) -> dict[str, Signature | None]:
    """Kernels defined in CUDA C++ ``source``: name (or name expression) -> signature.

    Plain kernels are keyed by their name; each template kernel only through the
    ``name_expressions`` that instantiate it (``"axpy<float>"``), with the template's type
    parameters substituted. A value of None means "a kernel of that name exists but its
    parameters could not be read".
    """
    found: dict[str, Signature | None] = {}
    templates: dict[str, tuple[list[str], str]] = {}
    for match in _KERNEL.finditer(strip_comments(source)):
        name, params = match["name"], match["params"]
        if match["template"]:
            tnames = [p.split()[-1] for p in _split_params(match["tparams"]) if p.split()]
            templates[name] = (tnames, params)
        else:
            found[name] = _parse_params(params, {})
    for expression in name_expressions:
        base, _, rest = expression.partition("<")
        base = base.strip()
        if base not in templates:
            if base in found:
                found[expression] = found[base]
            continue
        tnames, params = templates[base]
        targs = _split_params(rest.rsplit(">", 1)[0]) if rest else []
        mapping = dict(zip(tnames, targs, strict=False)) if len(targs) == len(tnames) else None
        found[expression] = None if mapping is None else _parse_params(params, mapping)
    return found


def _parse_params(params: str, types: dict[str, str]) -> Signature | None:
    parsed = [_parse_c_param(p, types) for p in _split_params(params)]
    if any(p is None for p in parsed):
        return None
    return tuple(p for p in parsed if p is not None)


_PTX_ENTRY = re.compile(r"\.entry\s+(?P<name>[\w$]+)\s*\((?P<params>[^)]*)\)", re.DOTALL)
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(?P<type>[a-z]\d+)\s+(?P<name>[\w$]+)(?P<array>\[\d+\])?")
_PTX_TYPES = {
    "u8": "uint8", "s8": "int8", "b8": "uint8",
    "u16": "uint16", "s16": "int16", "b16": "uint16", "f16": "float16",
    "u32": "uint32", "s32": "int32", "b32": "uint32", "f32": "float32",
    "u64": "uint64", "s64": "int64", "b64": "uint64", "f64": "float64",
}  # fmt: skip


def ptx_signatures(ptx: str) -> dict[str, Signature | None]:
    """Entry points of PTX text -> signatures (64-bit integers stand for pointers too).

    PTX does not distinguish a pointer from a 64-bit integer, so ``.u64`` parameters
    become ``uint64`` scalars, which accept device arrays and buffers as well (see
    :mod:`aiocuda._kernels.packing`). Byte-array parameters (structs by value) give None.
    """
    out: dict[str, Signature | None] = {}
    for entry in _PTX_ENTRY.finditer(ptx):
        params: list[Param] = []
        ok = True
        for param in _PTX_PARAM.finditer(entry["params"]):
            dtype = _PTX_TYPES.get(param["type"])
            if dtype is None or param["array"]:
                ok = False
                break
            params.append(Param(np.dtype(dtype), name=param["name"]))
        out[entry["name"]] = tuple(params) if ok else None
    return out
