"""Argument packing: turning Python launch arguments into ``cuLaunchKernel``'s ``void*[]``.

For each signature a :class:`ParamBuffer` is built once: a preallocated, 8-byte aligned
block laid out like the C argument list (each argument at a multiple of its size:
:func:`arguments_format`), and a ``void*[]``
whose entries point at each argument's bytes. Its address never changes, so a launch
only writes the new values into the block -- one ``Struct.pack_into`` call for all of
them -- and makes one driver call.

Structs and vectors passed by value (a structured dtype in the signature, laid out as
CUDA lays it out: :func:`~aiocuda._kernels.signature.cuda_struct`) each get a block of
their own, which the ``void*[]`` points at, packed with their own ``Struct.pack_into``
from the values of their fields (a tuple, taken by position, or a numpy record with the
struct's field names in its order: :func:`struct_value`). A nested struct's fields and
an array field's elements are packed one by one too
(:func:`~aiocuda._kernels.signature.struct_leaves`), so every field is checked as
strictly as a scalar argument, whatever type its value comes in (numpy's included): an
int beyond the field's range or of the wrong sign, a float for an int field, a finite
float beyond a float field's range, anything but True, False, 0 or 1 for a bool field
are refused. No Python frame runs per launch for a tuple (nested tuples are unpacked
inline); a record costs one call, the check of its field names, and an array field one
call.

:func:`build_launcher` generates, once per (signature, launch configuration), a plain
function specialised for that signature (the way :mod:`dataclasses` generates
``__init__``): no per-argument isinstance chains, no ctypes objects created per launch.
``struct`` does the type checking for free -- a float where an ``int`` is declared, a
value out of range, a string -- and the error path re-examines the arguments one by one
to say exactly which is wrong. Pointer positions accept, in this order of cost: ``int``
addresses (no conversion), then anything with an ``int`` ``.ptr`` (``DeviceBuffer``,
``DeviceArray``; ``_used_on(stream)`` is called when present so that stream-ordered
frees wait for the kernel), objects with ``__cuda_array_interface__``, ``None`` (NULL)
and numpy integers.

Thread safety: the driver reads a buffer during the launch call, with the GIL
released, so two threads must never pack into the same buffer at once. Each launcher
keeps a free list of buffers: a launch pops one (``list.pop``, atomic), packs, launches
and pushes it back. One thread always reuses the same buffer; a thread that finds the
list empty (another is mid-launch) makes a new buffer, which then joins the list, so
the list grows to the number of threads launching at once.

Lifetime pitfall: only aiocuda buffers are kept alive for the kernel (through their
stream-ordered free). A foreign array (CuPy, PyTorch, ``__cuda_array_interface__``)
passed to a launch must be kept alive by the caller until the stream's work is done,
e.g. with ``stream.hold(array)``.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import reprlib
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CaptureError, LaunchError
from ..managed import ManagedArray, ManagedPool
from .signature import Param, Signature, field_format, struct_format, struct_leaves

__all__ = ["ParamBuffer", "PreparedLaunch", "StructSlot", "build_launcher", "diagnose", "to_pointer"]

PreparedLaunch = tuple[Callable[..., tuple[Any, ...]], tuple[Any, ...], Callable[[Any], None]]
"""What ``Driver.prepare_launch`` returns: ``(fn, args, fail)``; a launch is
``err = fn(*args)[0]`` and, when ``err`` is truthy, ``fail(err)`` raises."""


def struct_value(dtype: np.dtype, value: Any) -> Any:
    """``value`` checked for a by-value struct of ``dtype``: a numpy record (or a 0-d
    structured array, taken as its record) must have ``dtype``'s field names in its order,
    nested structs' included, else TypeError naming both; it is returned as the tuple of
    its values (``record.item()``: nested tuples of Python numbers, arrays as they are).
    Its fields may have other types: their values are checked as a tuple's are. Anything
    else -- a tuple -- is returned as it is.
    """
    # Why: packing takes a record's fields by position (``*value``, and the unpacking of
    # nested structs likewise), so a record with ``n`` before ``x`` put ``n`` into ``x``.
    # Checked: the names, order and nesting of the record's fields against the dtype the
    # signature declares (a vector type's x, y, z, w). Not checkable here: that the
    # declared dtype is the C struct (no C struct is parsed: a kernel taking one by value
    # has no inferred signature and the caller declares a dtype, which is trusted), field
    # shapes (packing refuses a mismatch), and a tuple, which has no names. The values are
    # handed on as Python numbers, which struct packs faster than numpy's: a launch with
    # a record of a nested struct took 1.5 us so, about twice that unpacked into numpy
    # scalars, and 2.1 us when numpy assigned the record.
    given = getattr(value, "dtype", None)
    if given is None or given.names is None:
        return value
    if given is not dtype and field_names(given) != field_names(dtype):
        names = list(dtype.names or ())
        reorder = f" (record[{names}] reorders this one)" if sorted(given.names) == sorted(names) else ""
        raise TypeError(
            f"its fields {field_names(given)} are not the struct's {field_names(dtype)}: a record's fields are "
            f"packed by position, so it must have the struct's, in the struct's order{reorder}; or pass a tuple"
        )
    record = value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value
    return record.item() if isinstance(record, np.void) else record


@functools.lru_cache(maxsize=256)
def field_names(dtype: np.dtype) -> str:
    """A structured dtype's field names, nested ones after theirs: ``"(c, d, v(x, y))"``."""
    if dtype.subdtype is not None:
        return field_names(dtype.subdtype[0])
    if dtype.names is None:
        return ""
    return "(" + ", ".join(name + field_names(dtype.fields[name][0]) for name in dtype.names) + ")"  # type: ignore[index]


def unpacking(dtype: np.dtype, name: str) -> tuple[list[str], list[str], dict[str, Any]]:
    """How generated code packs the value of the struct ``dtype`` held in the variable
    ``name``: statements that unpack it (a tuple, a record, any iterable of as many
    values as the struct has fields; nested structs likewise), the expressions of the
    values ``struct_format(dtype)`` packs, in its order, and the functions these call
    besides :func:`array_values` and :func:`struct_array_values`, by name."""
    lines: list[str] = []
    values: dict[tuple[int, ...], str] = {}
    called: dict[str, Any] = {}

    def unpack(struct: np.dtype, var: str, path: tuple[int, ...]) -> None:
        parts = [f"{var}_{index}" for index in range(len(struct.names or ()))]
        lines.append(f"{', '.join(parts)}, = {var}")
        for index, (field_name, part) in enumerate(zip(struct.names or (), parts, strict=True)):
            field = struct.fields[field_name][0]  # type: ignore[index]
            at = (*path, index)
            if field.names is not None:
                unpack(field, part, at)
            elif field.subdtype is not None and field.subdtype[0].names is not None:
                called[f"flatten_{part}"] = flattener(field.subdtype[0])
                values[at] = f"*struct_array_values({part}, {field.subdtype[1]!r}, flatten_{part})"
            elif field.subdtype is not None:
                values[at] = f"*array_values({part}, {field.subdtype[1]!r}, {field.subdtype[0].kind!r})"
            elif field.kind == "c":
                values[at] = f"{part}.real, {part}.imag"
            elif field.kind == "b":  # (struct's "?" takes any object, by its truth)
                called["as_bool"] = as_bool
                values[at] = f"({part} if {part} is True or {part} is False else as_bool({part}))"
            else:
                values[at] = part

    unpack(dtype, name, ())
    return lines, [values[path] for path, _, _ in struct_leaves(dtype)], called


@functools.lru_cache(maxsize=256)
def flattener(dtype: np.dtype) -> Callable[[Any], tuple[Any, ...]]:
    """A function turning a value of the struct ``dtype`` into the values
    ``struct_format(dtype)`` packs (generated once per dtype: :func:`unpacking`)."""
    lines, values, called = unpacking(dtype, "value")
    body = "".join(f"\n    {line}" for line in lines)
    source = f"def flatten(value):{body}\n    return ({', '.join(values)},)\n"
    namespace = {"array_values": array_values, "struct_array_values": struct_array_values, **called}
    exec(compile(source, f"<aiocuda struct {field_names(dtype)}>", "exec"), namespace)
    flatten: Callable[[Any], tuple[Any, ...]] = namespace["flatten"]
    return flatten


def _flat(dtype: np.dtype) -> bool:
    """Whether the values of the struct ``dtype``'s fields, in order, are what its
    ``struct_format`` packs: its fields are scalars (not complex, not bool: each is
    checked), in memory order."""
    leaves = struct_leaves(dtype)
    return [path for path, _, _ in leaves] == [(i,) for i in range(len(leaves))] and all(
        field.subdtype is None and field.kind not in ("b", "c") for _, _, field in leaves
    )


def array_values(value: Any, shape: tuple[int, ...], kind: str) -> Any:
    """The values packing an array field of scalars of ``shape`` and numpy ``kind`` from
    ``value`` (a sequence, nested for more dimensions, an array, or one scalar for every
    element, as numpy broadcasts it): its elements in C order, a complex one as its two
    parts, a bool one checked as a bool parameter is (:func:`as_bool`)."""
    if type(value) in (tuple, list) and len(shape) == 1 and len(value) == shape[0]:
        elements = value
    else:
        elements = array_elements(value, shape, structs=False)
    if kind == "c":
        return [part for z in elements for part in (z.real, z.imag)]
    if kind == "b":  # (checked: struct's "?" packs any object; 0.2 us more for a bool[4] from a tuple)
        return [b if b is True or b is False else as_bool(b, "field") for b in elements]
    return elements


def struct_array_values(value: Any, shape: tuple[int, ...], flatten: Callable[[Any], tuple[Any, ...]]) -> list[Any]:
    """The values packing an array field of structs of ``shape`` from ``value``: each
    element's, in C order, by ``flatten`` (the element struct's :func:`flattener`)."""
    return [part for element in array_elements(value, shape, structs=True) for part in flatten(element)]


def array_elements(value: Any, shape: tuple[int, ...], *, structs: bool) -> Any:
    """The elements of ``value`` for an array field of ``shape``, in C order; ValueError
    when it has another shape. Scalars broadcast as numpy broadcasts them (numpy's
    become Python numbers, which ``struct`` checks alike); elements that are structs
    come from a structured array (broadcast) or nested sequences of ``shape``."""
    if not structs or isinstance(value, np.ndarray):
        given = value if structs else np.asarray(value, dtype=object)
        try:
            return np.broadcast_to(given, shape).reshape(-1)
        except ValueError:
            raise ValueError(f"its shape {given.shape} is not the array's {shape}, nor broadcasts to it") from None
    if not shape:
        return [value]
    items = list(value)
    if len(items) != shape[0]:
        raise ValueError(f"{len(items)} elements where the array has {shape[0]}")
    return [element for item in items for element in array_elements(item, shape[1:], structs=True)]


class StructSlot:
    """The block one by-value struct argument is packed into:
    ``pack_into(block, 0, *values)``, the values of the struct's fields in the order
    of its ``struct_format`` (:func:`flattener`)."""

    __slots__ = ("_block", "address", "dtype", "pack_into")

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self._block = (ctypes.c_uint64 * max(1, -(-dtype.itemsize // 8)))()
        self.address = ctypes.addressof(self._block)
        self.pack_into: Callable[..., None] = struct.Struct(struct_format(dtype)).pack_into

    @property
    def block(self) -> Any:
        """The writable block the struct is packed into."""
        return self._block

    def write(self, value: Any) -> None:
        self.pack_into(self._block, 0, *flattener(self.dtype)(struct_value(self.dtype, value)))

    @property
    def value(self) -> Any:
        """The packed struct as a numpy record (a copy)."""
        return np.frombuffer(bytes(self._block)[: self.dtype.itemsize], self.dtype)[0]


class ParamBuffer:
    """A :class:`~aiocuda._driver.KernelParams`: preallocated storage for one signature.

    ``address`` is the ``void*[]`` for ``kernelParams``; ``values`` decodes the current
    contents (pointers as ``int``, structs as numpy records), which is what the
    simulated backend reads. ``slots`` are the blocks of by-value structs, in order.
    """

    __slots__ = ("_pointers", "_storage", "address", "pack_into", "signature", "slots", "struct")

    def __init__(self, signature: Signature) -> None:
        self.signature = signature
        self.struct = struct.Struct(arguments_format(signature))
        self._storage = (ctypes.c_uint64 * max(1, -(-self.struct.size // 8)))()
        self.slots = tuple(StructSlot(p.dtype) for p in signature if p.by_value_struct)
        base = ctypes.addressof(self._storage)
        slots = iter(self.slots)
        scalars = iter(_scalar_layout(signature))
        offsets = [next(slots).address if p.by_value_struct else base + next(scalars)[0] for p in signature]
        self._pointers = (ctypes.c_void_p * max(1, len(signature)))(*offsets)
        self.address = ctypes.addressof(self._pointers)
        self.pack_into = self.struct.pack_into

    @property
    def storage(self) -> Any:
        """The writable block the scalar and pointer arguments are packed into."""
        return self._storage

    @property
    def values(self) -> tuple[Any, ...]:
        packed = iter(self.struct.unpack_from(self._storage))
        slots = iter(self.slots)
        return tuple(next(slots).value if p.by_value_struct else next(packed) for p in self.signature)

    def pack(self, args: tuple[Any, ...], stream: Any) -> None:
        """Pack ``args`` (any accepted form) the slow, general way; raises LaunchError."""
        if len(args) != len(self.signature):
            raise diagnose(self.signature, args, "", stream)
        try:
            self.pack_into(self._storage, 0, *_convert(self.signature, args, stream))
            structs = (a for p, a in zip(self.signature, args, strict=True) if p.by_value_struct)
            for slot, value in zip(self.slots, structs, strict=True):
                slot.write(value)
        except (struct.error, OverflowError, TypeError, ValueError, AttributeError):
            raise diagnose(self.signature, args, "", stream) from None


def arguments_format(signature: Signature) -> str:
    """The ``struct`` format packing ``signature``'s scalar and pointer arguments (not its
    by-value structs) in order, each at a multiple of its size, as C aligns them."""
    # Standard sizes ("="), not native ("@"): the native "f" code casts a double to a C
    # float unchecked, so 1e300 became inf; the standard one raises OverflowError for a
    # finite value beyond float32's range (inf, -inf and nan pass as they are, a value
    # that only rounds is rounded), as "e" does in both modes. The sizes are the same on
    # every Linux CUDA host (LP64, little-endian); the alignment "=" drops is padded in
    # here. Packing costs the same (0.12 us for "fQQi" either way).
    parts, end = ["="], 0
    for start, size, code in _scalar_layout(signature):
        parts.append("x" * (start - end) + code)
        end = start + size
    return "".join(parts)


def _scalar_layout(signature: Signature) -> list[tuple[int, int, str]]:
    """``(offset, size, struct code)`` of each of ``signature``'s scalar and pointer
    arguments (not its by-value structs) in the block, each at a multiple of its size."""
    layout: list[tuple[int, int, str]] = []
    end = 0
    for param in signature:
        if param.by_value_struct:
            continue
        size = struct.calcsize("=" + param.code)
        start = -(-end // size) * size
        layout.append((start, size, param.code))
        end = start + size
    return layout


def _convert(signature: Signature, args: tuple[Any, ...], stream: Any) -> list[Any]:
    return [_scalar(p, a, stream) for p, a in zip(signature, args, strict=True) if not p.by_value_struct]


def _scalar(param: Param, arg: Any, stream: Any) -> Any:
    """What ``struct`` packs for ``arg`` (not a by-value struct), the slow general way."""
    if param.takes_address and type(arg) is not int:
        return to_pointer(arg, stream, param.pointee)
    if param.code == "?":
        return as_bool(arg)
    if param.either_sign:
        return two_s_complement(arg, 8 * param.dtype.itemsize)
    return arg


def two_s_complement(value: Any, bits: int) -> Any:
    """A negative integer of ``bits`` as the unsigned one of the same bits; anything else
    as it is (and out of range, as struct then says)."""
    if isinstance(value, (int, np.integer)) and -(1 << (bits - 1)) <= value < 0:
        return value + (1 << bits)
    return value


def to_pointer(arg: Any, stream: Any, pointee: np.dtype | None = None) -> int:
    """The device address behind a pointer argument; marks aiocuda buffers used on ``stream``.

    An array (``DeviceArray`` or ``__cuda_array_interface__``) must have elements of
    type ``pointee`` when that is given (:attr:`Param.pointee`); a TypeError says so.
    The way to read an address is decided once per argument type and cached.
    """
    convert = _converters.get(arg.__class__)
    if convert is None:
        convert = _converter_for(arg)
        if convert is not _not_a_pointer:  # failures are not cached: another instance may differ
            _converters[arg.__class__] = convert
    return convert(arg, stream, pointee)


def _buffer_pointer(arg: Any, stream: Any, pointee: np.dtype | None) -> int:
    if stream is not None:
        if arg.device is not stream.device:
            if not isinstance(getattr(arg, "pool", None), ManagedPool):
                raise _wrong_device(arg.device, stream.device)
        else:
            arg._used_on(stream)
    return arg.ptr  # type: ignore[no-any-return]


def _array_pointer(arg: Any, stream: Any, pointee: np.dtype | None) -> int:
    if pointee is not None and arg.dtype is not pointee and arg.dtype != pointee:
        raise _wrong_elements(arg.dtype, pointee)
    buffer = arg.buffer
    if stream is not None:
        device = getattr(buffer, "device", None)
        if device is stream.device:
            buffer._used_on(stream)
        elif device is not None and not isinstance(arg, ManagedArray):
            raise _wrong_device(device, stream.device)
    strides = arg.strides
    if not (len(strides) == 1 and strides[0] == arg.dtype.itemsize) and not arg.is_c_contiguous:
        raise TypeError(
            f"it is a strided view (strides {strides}), and a kernel gets only the address of its first "
            "element: copy it into a C-contiguous array first (aiocuda.copy_array), or pass its .ptr if "
            "the kernel walks the strides itself"
        )
    return arg.ptr  # type: ignore[no-any-return]


def _wrong_device(device: Any, launched_on: Any) -> TypeError:
    # (nothing would keep its memory from being freed and reused under the kernel, and
    # the kernel's device may not reach it: managed memory is what every device reaches)
    return TypeError(
        f"it is on device {device.ordinal}, the kernel runs on device {launched_on.ordinal}: copy it "
        "there first (aiocuda.copy_array, ChunkContext.move), or use managed memory (aiocuda.managed)"
    )


def _cai_pointer(arg: Any, stream: Any, pointee: np.dtype | None) -> int:
    interface = arg.__cuda_array_interface__
    if pointee is not None and np.dtype(interface["typestr"]) != pointee:
        raise _wrong_elements(np.dtype(interface["typestr"]), pointee)
    return int(interface["data"][0])


def as_bool(value: Any, what: str = "parameter") -> bool:
    """``value`` for a ``bool`` parameter (or struct field, ``what``): a bool, numpy's, or
    the int 0 or 1; TypeError otherwise (``struct`` packs any object by its truth)."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"a bool {what} takes True, False, 0 or 1")


def _wrong_elements(given: np.dtype, pointee: np.dtype) -> TypeError:
    return TypeError(f"its elements are {given}, the kernel reads {pointee} (convert it, or view() its bytes)")


def _index_pointer(arg: Any, stream: Any, pointee: np.dtype | None) -> int:
    return operator.index(arg)


def _null_pointer(arg: Any, stream: Any, pointee: np.dtype | None) -> int:
    return 0


def _converter_for(arg: Any) -> Callable[[Any, Any, np.dtype | None], int]:
    cls = type(arg)
    if hasattr(cls, "ptr") and hasattr(cls, "_used_on"):
        return _buffer_pointer
    if hasattr(cls, "ptr") and hasattr(cls, "buffer"):
        return _array_pointer
    if hasattr(arg, "__cuda_array_interface__"):
        return _cai_pointer
    if arg is None:
        return _null_pointer
    if issubclass(cls, (int, np.integer)) and not issubclass(cls, (bool, np.bool_)):
        return _index_pointer
    return _not_a_pointer


def _not_a_pointer(arg: Any, stream: Any, pointee: np.dtype | None) -> int:
    if hasattr(arg, "__array_interface__") or isinstance(arg, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"a host {type(arg).__name__} was passed where a device pointer is expected: "
            f"copy it to the device first (await aiocuda.to_device(...))"
        )
    raise TypeError(
        f"{type(arg).__name__} is not a device pointer: pass a DeviceArray, DeviceBuffer, an object "
        f"with __cuda_array_interface__, an int address or None"
    )


_converters: dict[type, Callable[[Any, Any, np.dtype | None], int]] = {}

# Why a free list of buffers rather than a lock around one: popping and pushing a list
# cost about 40 ns per launch, a lock (acquire, release, try/finally) about 180 ns.


def diagnose(signature: Signature, args: tuple[Any, ...], kernel: str, stream: Any = None) -> LaunchError:
    """The LaunchError that says which argument does not fit ``signature`` (launched on
    ``stream``) and why."""
    where = f"kernel {kernel!r}" if kernel else "the kernel"
    declared = ", ".join(p.describe() for p in signature) or "no arguments"
    if len(args) != len(signature):
        return LaunchError(
            f"{where} takes {len(signature)} argument(s) ({declared}), got {len(args)}",
            name="AIOCUDA_BAD_ARGUMENT",
        )
    for index, (param, arg) in enumerate(zip(signature, args, strict=True)):
        try:
            if param.by_value_struct:
                reason = _struct_fault(param.dtype, struct_value(param.dtype, arg), param.name or f"arg{index}")
            else:
                struct.pack("=" + param.code, _scalar(param, arg, stream))
                reason = ""
        except (struct.error, OverflowError, TypeError, ValueError) as exc:
            reason = _reason(exc, None if param.takes_address else param.dtype)
        if reason:
            return LaunchError(
                f"{where}: argument {index} ({param.describe()}) "
                f"cannot take {type(arg).__name__} {reprlib.repr(arg)}: {reason}",
                name="AIOCUDA_BAD_ARGUMENT",
            )
    return LaunchError(f"{where}: arguments do not match ({declared})", name="AIOCUDA_BAD_ARGUMENT")


def _struct_fault(dtype: np.dtype, value: Any, path: str) -> str:
    """Why ``value`` does not pack as the struct ``dtype`` (the argument or field named
    ``path``): the first of its fields at fault, named by its path
    (``"params.inner.count"``), and why; "" when it packs."""
    names = dtype.names or ()
    try:
        items = list(value)
    except TypeError:
        return f"{path} is a struct {field_names(dtype)}: pass a tuple of its fields' values, or a numpy record"
    if len(items) != len(names):
        return f"{path} is a struct {field_names(dtype)} of {len(names)} fields, given {len(items)} values"
    for name, item in zip(names, items, strict=True):
        fault = _field_fault(dtype.fields[name][0], item, f"{path}.{name}")  # type: ignore[index]
        if fault:
            return fault
    return ""


def _field_fault(field: np.dtype, value: Any, path: str) -> str:
    """:func:`_struct_fault` for one field, of type ``field``."""
    if field.names is not None:
        return _struct_fault(field, value, path)
    given = f"{type(value).__name__} {reprlib.repr(value)}"
    if field.subdtype is not None:
        element, shape = field.subdtype
        try:
            elements = array_elements(value, shape, structs=element.names is not None)
        except (TypeError, ValueError) as exc:
            kind = element.name if element.names is None else f"struct {field_names(element)}"
            return f"{path} ({kind}{list(shape)}) cannot take {given}: {exc}"
        for at, item in zip(np.ndindex(*shape), elements, strict=True):
            fault = _field_fault(element, item, f"{path}[{', '.join(map(str, at))}]")
            if fault:
                return fault
        return ""
    try:
        if field.kind == "b":
            as_bool(value, "field")
        struct.pack("=" + field_format(field), *((value.real, value.imag) if field.kind == "c" else (value,)))
    except (struct.error, OverflowError, TypeError, ValueError, AttributeError) as exc:
        return f"{path} ({field.name}) cannot take {given}: {_reason(exc, field)}"
    return ""


def _reason(exc: Exception, dtype: np.dtype | None) -> str:
    """Why a value for ``dtype`` (None for an address) was refused, from the exception
    packing it raised."""
    if isinstance(exc, OverflowError) and dtype is not None and dtype.kind in "fc":
        # (struct's own words, "float too large to pack with f format", name no type)
        largest = f"{float(np.finfo(dtype).max):.8g}"
        return f"it is beyond {dtype.name}'s range (finite values up to ±{largest}; inf and nan pass as they are)"
    return str(exc)


def build_launcher(
    kernel: str,
    signature: Signature,
    prepare: Callable[[ParamBuffer], PreparedLaunch],
    stream: Any,
    fail: Callable[[Any, tuple[Any, ...]], None],
) -> Callable[..., None]:
    """A function ``launch(*args)`` that packs ``args`` into a free buffer and launches.

    ``prepare(buffer)`` is the backend's ``(fn, args, _)`` for one buffer (every buffer
    of a launcher shares ``fn``); a truthy result code goes to ``fail(err, args)``,
    which raises (or retries, e.g. after binding the context to the thread).
    """
    names = [f"a{i}" for i in range(len(signature))]
    pointees = {f"p{i}": p.pointee for i, p in enumerate(signature) if p.pointee is not None}

    def value(i: int, param: Param) -> str:
        if param.code == "?":
            return f"(a{i} if a{i} is True or a{i} is False else as_bool(a{i}))"
        if param.either_sign:
            return f"two_s_complement(a{i}, {8 * param.dtype.itemsize})"
        if not param.takes_address:
            return f"a{i}"
        pointee = f", p{i}" if param.pointee is not None else ""
        return f"(a{i} if type(a{i}) is int else to_pointer(a{i}, stream{pointee}))"

    values = ", ".join(value(i, p) for i, p in enumerate(signature) if not p.by_value_struct)
    unpack = f"{', '.join(names)}, = args" if names else "if args: raise ValueError"
    pack = f"pack_into(item[0], 0, {values})" if values else "pass"
    # Each by-value struct is packed by its own pack_into: a struct of scalar fields in
    # their order, none bool, straight from its value, others from the values unpacked
    # inline (a launch with a nested struct given as a tuple: 0.55 us; 1.9 us when numpy
    # assigned it, under np.errstate to refuse floats beyond range, and wrapped its
    # integers). A bool field is checked inline as a bool argument is (struct's "?"
    # packs any object by its truth): a struct of scalars with one launches no slower
    # so than straight from its value (0.5 us either way, measured side by side).
    structs = [i for i, p in enumerate(signature) if p.by_value_struct]
    first = ParamBuffer(signature)
    packers = {f"s{i}": slot.pack_into for i, slot in zip(structs, first.slots, strict=True)}
    checks = {f"c{i}": functools.partial(struct_value, signature[i].dtype) for i in structs}
    called: dict[str, Any] = {}
    statements: list[str] = []
    for k, i in enumerate(structs):
        # (a tuple goes straight in; anything else, a record, is checked by name first: about 1 us)
        checked = f"(a{i} if type(a{i}) is tuple else c{i}(a{i}))"
        if _flat(signature[i].dtype):
            statements.append(f"s{i}(item[3][{k}], 0, *{checked})")
            continue
        lines, leaves, helpers = unpacking(signature[i].dtype, f"a{i}")
        called.update(helpers)
        statements += [f"a{i} = {checked}", *lines, f"s{i}(item[3][{k}], 0, {', '.join(leaves)})"]
    writes = "".join(f"\n        {statement}" for statement in statements)
    source = f"""
def launch(*args):
    try:
        item = take()
    except IndexError:
        item = grow()
    try:
        {unpack}
        {pack}{writes}
    except CaptureError:
        give(item)
        raise
    except Exception:
        give(item)
        raise diagnose(signature, args, kernel, stream) from None
    err = fn(*item[1])[0]
    give(item)
    if err:
        fail(err, args)
"""
    fn, first_args, _ = prepare(first)
    free: list[tuple[Any, tuple[Any, ...], ParamBuffer, tuple[Any, ...]]] = []

    def grow() -> tuple[Any, tuple[Any, ...], ParamBuffer, tuple[Any, ...]]:
        buffer = ParamBuffer(signature)
        return (buffer.storage, prepare(buffer)[1], buffer, tuple(slot.block for slot in buffer.slots))

    free.append((first.storage, first_args, first, tuple(slot.block for slot in first.slots)))
    namespace: dict[str, Any] = {
        "take": free.pop,
        "give": free.append,
        "grow": grow,
        "pack_into": first.pack_into,
        "to_pointer": to_pointer,
        "as_bool": as_bool,
        "two_s_complement": two_s_complement,
        "array_values": array_values,
        "struct_array_values": struct_array_values,
        "stream": stream,
        "diagnose": diagnose,
        "CaptureError": CaptureError,
        "signature": signature,
        "kernel": kernel,
        "fn": fn,
        "fail": fail,
        **pointees,
        **packers,
        **checks,
        **called,
    }
    exec(compile(source, f"<aiocuda launcher {kernel}>", "exec"), namespace)
    launch: Callable[..., None] = namespace["launch"]
    launch.__qualname__ = launch.__name__ = f"launch_{kernel}"
    return launch
