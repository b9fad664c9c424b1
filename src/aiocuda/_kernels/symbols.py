"""Module variables: the ``__device__`` and ``__constant__`` variables a source or PTX
defines, with the element type and shape that :meth:`aiocuda.Module.get_global` gives
their arrays by default.

Like signature parsing, this is modest: builtin scalar types, fixed-width typedefs and
CUDA vector types, with fixed array dimensions. A variable of another type (a struct)
is listed with no dtype; its array is then bytes unless a dtype is given. ``extern``
declarations define nothing (the linker finds the definition in another input).
"""

from __future__ import annotations

import math
import re

import numpy as np

from .signature import _scalar_dtype, strip_comments

__all__ = ["Variable", "Variables", "ptx_variables", "sim_variables", "source_variables"]

Variable = tuple[np.dtype | None, tuple[int, ...]]
"""A variable's element type (None when unknown) and shape (``()`` for a scalar)."""
Variables = dict[str, Variable]

_SOURCE_VARIABLE = re.compile(
    r"(?P<extern>\bextern\s+(?:\"C\"\s+)?)?(?:\bstatic\s+)?"
    r"(?:__device__\s+__constant__|__constant__\s+__device__|__constant__|__device__(?:\s+__managed__)?)\s+"
    r"(?:(?:const|volatile)\s+)*"
    r"(?P<type>(?:unsigned\s+|signed\s+)?[A-Za-z_][\w:]*(?:\s+(?:int|long|char|short))*)\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[\s*\d+\s*\]\s*)*)[;=]"
)
_PTX_VARIABLE = re.compile(
    r"^(?P<prefix>[^\n;]*?)\.(?:global|const)\s+(?:\.align\s+\d+\s+)?\.(?P<type>[a-z]+\d+)\s+"
    r"(?P<name>[\w$]+)(?:\[(?P<count>\d*)\])?",
    re.MULTILINE,
)
_PTX_TYPES = {
    "u8": "uint8", "s8": "int8", "u16": "uint16", "s16": "int16", "f16": "float16",
    "u32": "uint32", "s32": "int32", "f32": "float32", "u64": "uint64", "s64": "int64", "f64": "float64",
}  # fmt: skip


def source_variables(source: str) -> Variables:
    """The variables CUDA C++ ``source`` defines (not those it declares ``extern``)."""
    found: Variables = {}
    for match in _SOURCE_VARIABLE.finditer(strip_comments(source)):
        if match["extern"]:
            continue
        dims = tuple(int(d) for d in re.findall(r"\d+", match["dims"]))
        found[match["name"]] = (_scalar_dtype(" ".join(match["type"].split())), dims)
    return found


def ptx_variables(ptx: str) -> Variables:
    """The ``.global`` and ``.const`` variables PTX text defines (``.b8`` ones as bytes)."""
    found: Variables = {}
    for match in _PTX_VARIABLE.finditer(ptx):
        if ".extern" in match["prefix"]:
            continue
        name = _PTX_TYPES.get(match["type"])
        count = int(match["count"]) if match["count"] else None
        if name is None:  # .b8 / .b32 ...: raw bits
            bits = int(re.sub(r"\D", "", match["type"]))
            found[match["name"]] = (None, ((bits // 8) * (count or 1),))
        else:
            found[match["name"]] = (np.dtype(name), () if count is None else (count,))
    return found


def sim_variables(variables: Variables) -> dict[str, tuple[int, str]]:
    """What a simulated module image records of each variable whose size is known:
    name -> (bytes, numpy type string, or ``"-"`` for a struct or vector)."""
    out: dict[str, tuple[int, str]] = {}
    for name, (dtype, shape) in variables.items():
        if dtype is not None:
            plain = dtype.fields is None
            out[name] = (dtype.itemsize * math.prod(shape), dtype.str if plain else "-")
    return out
