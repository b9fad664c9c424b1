"""Kernel signatures: what each argument of a ``__global__`` function is.

A :class:`Signature` is a tuple of :class:`Param`: by-value scalars (a numpy dtype and
the ``struct`` code that packs it), by-value structs and vectors (a numpy structured
dtype laid out as CUDA lays out the struct: :func:`cuda_struct`, :func:`vector_dtype`)
or pointers (packed as 8-byte addresses; the pointee dtype is kept for the simulated
backend, which hands kernels typed numpy views).

Signatures come from three places, in this order of preference:

* declared by the caller, as a C-like string (``"const float*, float*, int n"``) or a
  sequence of items (numpy dtypes or type names, and ``"ptr"`` / ``"float*"``);
* parsed from CUDA C++ source (``extern "C" __global__ void name(...)`` and simple
  templates instantiated through name expressions such as ``"axpy<double>"``);
* parsed from PTX text (``.entry name(.param .u64 ..., ...)``).

Parsing is deliberately modest: it understands the builtin scalar types, fixed-width
typedefs, CUDA's vector types (``float2``, ``int4``, ...), pointers and template type
parameters. A kernel whose parameters it cannot read (user structs by value, nested
templates) simply has no inferred signature, and launching it asks for a declared one
(a numpy structured dtype for a struct) instead of guessing.

CUDA's layout rules for a struct passed by value (C's): each field at the next offset
that is a multiple of its alignment (a scalar's size; a vector type's own alignment, e.g.
8 for ``float2``, 16 for ``float4`` and ``int4``, but 4 for ``float3``; a nested struct's
largest alignment), the struct's size rounded up to its largest alignment; nested structs
and the elements of arrays of structs are laid out by the same rules.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "VECTOR_TYPES",
    "Param",
    "Signature",
    "cuda_alignment",
    "cuda_struct",
    "field_format",
    "parse_signature",
    "ptx_signatures",
    "source_signatures",
    "strip_comments",
    "struct_format",
    "struct_leaves",
    "vector_dtype",
]

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
    "uint": "uint32",  # (sys/types.h's: C's meaning, not numpy's)
    "ushort": "uint16",
    "uchar": "uint8",
    "ulong": "uint64",
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

_VECTOR_BASES: dict[str, str] = {
    "char": "int8", "uchar": "uint8", "short": "int16", "ushort": "uint16",
    "int": "int32", "uint": "uint32", "long": "int64", "ulong": "uint64",
    "longlong": "int64", "ulonglong": "uint64", "float": "float32", "double": "float64",
}  # fmt: skip
# Alignment of vectors, from vector_types.h: 2 and 4 components align to their whole
# size (at most 16 bytes), 1 and 3 components to one element.

VECTOR_TYPES: tuple[str, ...] = tuple(f"{base}{n}" for base in _VECTOR_BASES for n in (1, 2, 3, 4))
"""CUDA's built-in vector type names (``char1`` .. ``double4``)."""

_FIELDS = "xyzw"
_ALIGN = "cuda_align"
_NAME = "cuda_name"


def vector_dtype(name: str) -> np.dtype:
    """The numpy dtype of a CUDA vector type (``"float2"``, ``"int4"``, ``"uchar3"``, ...):
    fields ``x``, ``y``, ``z``, ``w``, with CUDA's size and alignment
    (``vector_dtype("float4").itemsize == 16``). KeyError for an unknown name."""
    base, count = name[:-1], int(name[-1]) if name[-1:].isdigit() else 0
    if base not in _VECTOR_BASES or not 1 <= count <= 4:
        raise KeyError(f"{name!r} is not a CUDA vector type ({', '.join(VECTOR_TYPES)})")
    element = np.dtype(_VECTOR_BASES[base])
    align = min(16, element.itemsize * count) if count in (2, 4) else element.itemsize
    size = -(-element.itemsize * count // align) * align
    return np.dtype(
        {
            "names": list(_FIELDS[:count]),
            "formats": [element] * count,
            "offsets": [i * element.itemsize for i in range(count)],
            "itemsize": size,
        },
        metadata={_ALIGN: align, _NAME: name},
    )


def _metadata(dtype: np.dtype) -> dict[str, Any]:
    return dict(dtype.metadata or {})


def cuda_alignment(dtype: np.dtype) -> int:
    """The alignment CUDA gives a field or argument of this numpy type."""
    if dtype.subdtype is not None:
        return cuda_alignment(dtype.subdtype[0])
    align = _metadata(dtype).get(_ALIGN)
    if align is not None:
        return int(align)
    if dtype.fields is not None:
        return max((cuda_alignment(dtype.fields[name][0]) for name in dtype.names or ()), default=1)
    return dtype.itemsize


def cuda_struct(dtype: np.dtype) -> np.dtype:
    """``dtype`` (a numpy structured dtype) as CUDA lays out the struct by value: by C's
    rules, at every level of nesting (nested structs, arrays of structs).

    C's rules: each field at the next offset that is a multiple of its alignment, the
    struct's alignment its fields' largest, its size rounded up to that. A packed dtype
    (numpy's default) is laid out so; one laid out already (``np.dtype(..., align=True)``
    with aligned nested structs, a vector type, explicit offsets) must have C's offsets,
    and may have a larger size (trailing padding) that is a multiple of its alignment.
    An ``__align__(N)`` struct's dtype says so in its metadata:
    ``np.dtype([...], metadata={"cuda_align": N})``.

    TypeError for a layout the kernel's struct does not have (a field at another offset
    than C's: the kernel would read other bytes), fields that overlap, and a field of a
    type no kernel parameter has (:func:`struct_leaves`).
    """
    if dtype.fields is None or not dtype.names:
        raise TypeError(f"{dtype} is not a structured dtype with fields")
    if dtype.hasobject:
        raise TypeError(f"{dtype} holds Python objects, which cannot be kernel arguments")
    struct_leaves(dtype)  # (refuses overlapping fields and types no kernel takes, in their own words)
    return _c_struct(dtype, dtype, "")


def _c_struct(struct: np.dtype, whole: np.dtype, path: str) -> np.dtype:
    """:func:`cuda_struct` of ``struct``, the struct at ``path`` (``"inner."``, ``""`` for
    the whole) in ``whole``, which error messages name."""
    names = list(struct.names or ())
    given = [struct.fields[name][:2] for name in names]  # type: ignore[index]
    formats = [_c_field(field, whole, f"{path}{name}") for name, (field, _) in zip(names, given, strict=True)]
    offsets: list[int] = []
    end = 0
    align = int(_metadata(struct).get(_ALIGN, 1))  # (a vector type's, or an __align__(N) struct's)
    for field in formats:
        field_align = cuda_alignment(field)
        align = max(align, field_align)
        end = -(-end // field_align) * field_align
        offsets.append(end)
        end += field.itemsize
    itemsize = -(-end // align) * align
    sizes = [field.itemsize for field, _ in given]
    packed = [int(offset) for _, offset in given] == [sum(sizes[:i]) for i in range(len(sizes))]
    if not (packed and struct.itemsize == sum(sizes)):  # laid out by the caller: it must be C's layout
        for name, (_, offset), c_offset in zip(names, given, offsets, strict=True):
            if offset != c_offset:
                raise TypeError(
                    f"field '{path}{name}' of {whole} is at offset {offset}, where C puts it at {c_offset} "
                    f"(each field at the next multiple of its alignment): the kernel's struct has C's layout. "
                    f"Pass the dtype packed (numpy's default), which is laid out so for you; an __align__(N) "
                    f"struct's dtype takes metadata={{{_ALIGN!r}: N}}"
                )
        if struct.itemsize < itemsize or struct.itemsize % align:
            what = f"struct '{path[:-1]}' of {whole}" if path else str(whole)
            raise TypeError(
                f"{what} has size {struct.itemsize}, where C's is {itemsize}: a struct's size is a multiple "
                f"of its alignment ({align}) and reaches at least its fields' end"
            )
        itemsize = struct.itemsize
    metadata = _metadata(struct)
    metadata[_ALIGN] = align
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize}, metadata=metadata)


def _c_field(field: np.dtype, whole: np.dtype, path: str) -> np.dtype:
    """A field's type with C's layout: a struct's or an array of structs' laid out
    (:func:`_c_struct`), any other as it is."""
    if field.names is not None:
        return _c_struct(field, whole, f"{path}.")
    if field.subdtype is not None and field.subdtype[0].names is not None:
        element, shape = field.subdtype
        return np.dtype((_c_struct(element, whole, f"{path}[]."), shape))
    return field


def struct_leaves(dtype: np.dtype) -> list[tuple[tuple[int, ...], int, np.dtype]]:
    """The fields of the struct ``dtype`` that hold values, in memory order: scalars and
    arrays, a nested struct standing for its own fields. Each is ``(path, offset,
    dtype)``: its field's index at each level of nesting (``(3, 1)``: the second field
    of the fourth), and its offset from the start of the struct.

    TypeError for a field whose type no kernel parameter has (bytes, strings, dates) and
    for fields that overlap (a union), which no CUDA struct is.
    """
    leaves: list[tuple[tuple[int, ...], int, np.dtype]] = []

    def walk(struct: np.dtype, path: tuple[int, ...], dotted: str, base: int) -> None:
        for index, name in enumerate(struct.names or ()):
            field, offset = struct.fields[name][:2]  # type: ignore[index]
            if field.names is not None:
                walk(field, (*path, index), f"{dotted}{name}.", base + offset)
                continue
            element = field.subdtype[0] if field.subdtype is not None else field
            if element.names is None and _scalar_codes(element) is None:
                raise TypeError(
                    f"field {dotted}{name} of {dtype} is {element}, which no kernel parameter is: use the C "
                    f"type's numpy dtype ({', '.join(sorted(_STRUCT_CODES))}, complex64 for cuFloatComplex)"
                )
            leaves.append(((*path, index), base + offset, field))

    walk(dtype, (), "", 0)
    leaves.sort(key=lambda leaf: leaf[1])
    end = 0
    for _, offset, field in leaves:
        if offset < end:
            raise TypeError(f"{dtype} has fields that overlap (at offset {offset}): no CUDA struct has that layout")
        end = offset + field.itemsize
    return leaves


@functools.lru_cache(maxsize=256)
def struct_format(dtype: np.dtype) -> str:
    """The ``struct`` format (``"="``, explicit padding) packing the struct ``dtype`` from
    the values of its :func:`struct_leaves`, in that order: a scalar is one value, a
    complex number two (its real and imaginary parts), an array its elements in C order
    (a struct's each as its own leaves). TypeError as :func:`struct_leaves` says."""
    parts = ["="]
    end = 0
    for _, offset, field in struct_leaves(dtype):
        parts.append("x" * (offset - end) + field_format(field))
        end = offset + field.itemsize
    parts.append("x" * (dtype.itemsize - end))
    return "".join(parts)


def field_format(field: np.dtype) -> str:
    """The ``struct`` codes (no ``"="``) packing one of :func:`struct_leaves` from its
    values: a scalar from one, a complex number from its two parts, an array from its
    elements (a struct's each from its own leaves)."""
    if field.subdtype is not None:
        element, shape = field.subdtype
        count = math.prod(shape)
        return struct_format(element)[1:] * count if element.names is not None else f"{count}{field_format(element)}"
    codes = _scalar_codes(field)
    assert codes is not None  # (struct_leaves refused the others)
    return codes


def _scalar_codes(dtype: np.dtype) -> str | None:
    """The ``struct`` codes of a scalar field, two for a complex one; None for a type no
    kernel parameter has."""
    if dtype.kind == "c":
        return {8: "ff", 16: "dd"}.get(dtype.itemsize)
    return _STRUCT_CODES.get(dtype.name)


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
    address: bool = False
    """A 64-bit integer that may hold an address (PTX's ``.u64``, which does not tell a
    pointer from an integer): it takes what a pointer takes, too."""
    either_sign: bool = False
    """An unsigned integer that may be a signed one (PTX's ``.u32``, ``.b32``, ``.u16``,
    ...: NVRTC writes an ``int`` so): it takes negative values too, as their two's
    complement."""

    @property
    def takes_address(self) -> bool:
        """Whether device arrays and buffers are taken (as their addresses)."""
        return self.pointer or self.address

    @property
    def by_value_struct(self) -> bool:
        """A struct or vector passed by value (``dtype`` is structured)."""
        return not self.pointer and self.dtype.fields is not None

    @property
    def code(self) -> str:
        """The ``struct`` format code a pointer or scalar argument is packed with ("" for
        a struct, which is packed on its own)."""
        if self.pointer:
            return "Q"
        return "" if self.dtype.fields is not None else _STRUCT_CODES[self.dtype.name]

    @property
    def pointee(self) -> np.dtype | None:
        """The element type an array passed for this pointer must have, or None when any
        array will do: ``void*``, byte pointers (``char*``, ``uint8_t*``, ...), pointers
        to structs and vectors, to types the parser does not know, and scalars."""
        return self.dtype if self.pointer and self.dtype.itemsize > 1 and self.dtype.fields is None else None

    def describe(self) -> str:
        base = self.dtype.name
        if self.dtype.fields is not None:
            base = _metadata(self.dtype).get(_NAME) or f"struct({', '.join(self.dtype.names or ())})"
        kind = f"{base}*" if self.pointer else base
        return f"{kind} {self.name}".rstrip()


Signature = tuple[Param, ...]


def _scalar_dtype(spelling: str) -> np.dtype | None:
    if spelling in VECTOR_TYPES:
        return vector_dtype(spelling)
    name = _SCALARS.get(spelling)
    if name is None:
        # numpy's own names ("float32", "int64") read as themselves; not its other
        # spellings, which say something else in C ("uint" is 64-bit to numpy, "I" a code)
        try:
            dtype = np.dtype(spelling)
        except TypeError:
            return None
        return dtype if dtype.name == spelling and dtype.name in _STRUCT_CODES else None
    return np.dtype(name)


def _parse_c_param(text: str, types: dict[str, str] | None = None) -> Param | None:
    """One C parameter declaration (``"const float* __restrict__ x"``), or None."""
    text = " ".join(_QUALIFIERS.sub(" ", text).replace("&", " & ").split())
    if not text or "&" in text or "[" in text or "(" in text:
        return None
    stars = text.count("*")
    pointer = stars > 0
    words = text.replace("*", " ").split()
    name = ""
    if len(words) > 1 and words[-1] not in _SCALARS and (_scalar_dtype(" ".join(words)) is None):
        name = words.pop()
    base = " ".join(words)
    if types is not None and base in types:
        base = types[base]
    if pointer:  # (to a pointer, void or an unknown type: any array; see Param.pointee)
        dtype = _scalar_dtype(base) if base != "void" and stars == 1 else None
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
            if dtype is not None and dtype.fields is not None:
                param = Param(cuda_struct(dtype))
            else:
                param = Param(dtype) if dtype is not None and dtype.name in _STRUCT_CODES else None
        if param is None:
            raise TypeError(
                f"signature item {index} ({item!r}) is not a supported kernel parameter type: use a "
                f"scalar C type or numpy dtype ({', '.join(sorted(_STRUCT_CODES))}), a CUDA vector type "
                f"('float2'), a numpy structured dtype (a struct) or a pointer ('float*', 'ptr')"
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
            # (a parameter's name, not its default: "typename I = int")
            tnames = [p.partition("=")[0].split()[-1] for p in _split_params(match["tparams"]) if p.split()]
            templates[name] = (tnames, params)
            continue
        signature = _parse_params(params, {})
        if name in found and found[name] != signature:
            # defined twice with other parameters (#ifdef variants): which one the compile
            # keeps depends on its defines, which this reading does not know
            signature = None
        found[name] = signature
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


_EXTERN_C_BLOCK = re.compile(r'extern\s+"C"\s*\{')


def cpp_linkage_kernels(source: str) -> set[str]:
    """The plain (not template) kernels of CUDA C++ ``source`` with C++ linkage: neither
    declared ``extern "C"`` nor inside an ``extern "C" { }`` block. Their symbols are
    mangled, so only a name expression (``Program(name_expressions=[...])``) finds them
    in the compiled module."""
    text = strip_comments(source)
    blocks = []
    for opening in _EXTERN_C_BLOCK.finditer(text):
        depth = 0
        for at in range(opening.end() - 1, len(text)):
            depth += (text[at] == "{") - (text[at] == "}")
            if depth == 0:
                blocks.append((opening.start(), at))
                break
    c_linkage: set[str] = set()
    plain: set[str] = set()
    for match in _KERNEL.finditer(text):
        if match["template"]:
            continue
        inside = any(start <= match.start() <= end for start, end in blocks)
        (c_linkage if match["extern"] or inside else plain).add(match["name"])
    return plain - c_linkage  # (a declaration with extern "C" gives its later definition C linkage)


def _parse_params(params: str, types: dict[str, str]) -> Signature | None:
    parsed = [_parse_c_param(p, types) for p in _split_params(params)]
    if any(p is None for p in parsed):
        return None
    return tuple(p for p in parsed if p is not None)


_PTX_ENTRY = re.compile(r"\.entry\s+(?P<name>[\w$]+)\s*\((?P<params>[^)]*)\)", re.DOTALL)
_PTX_PARAM = re.compile(
    r"\.param\s+(?:\.align\s+\d+\s+)?\.(?P<type>[a-z]\d+)\s+"
    r"(?:\.ptr\s+(?:\.(?:global|const|shared|local)\s+)?(?:\.align\s+\d+\s+)?)?"  # (LLVM's pointer attributes)
    r"(?P<name>[\w$]+)(?P<array>\[\d+\])?"
)
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
        declared = [d.strip() for d in entry["params"].split(",") if d.strip()]
        ok = True
        for text in declared:  # (one that does not parse spoils the signature, not shortens it)
            param = _PTX_PARAM.fullmatch(text)
            dtype = None if param is None else _PTX_TYPES.get(param["type"])
            if param is None or dtype is None or param["array"]:
                ok = False
                break
            element = np.dtype(dtype)
            params.append(
                Param(
                    element,
                    name=param["name"],
                    address=element.itemsize == 8,
                    either_sign=element.kind == "u" and element.itemsize < 8 and param["type"][0] in "ub",
                )
            )
        out[entry["name"]] = tuple(params) if ok else None
    return out
