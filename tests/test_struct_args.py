"""By-value struct and vector arguments: CUDA's layout rules for numpy structured
dtypes and vector types, packing, argument checking, and a kernel that reads every
field (both backends: on the GPU the kernel itself says where CUDA put each field)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiocuda import _driver
from aiocuda._kernels.packing import ParamBuffer
from aiocuda._kernels.signature import cuda_struct, parse_signature, source_signatures, vector_dtype
from aiocuda.array import to_device
from aiocuda.errors import LaunchError
from aiocuda.kernel import register_sim_kernel
from aiocuda.module import Module
from aiocuda.program import Program
from aiocuda.stream import Stream


def test_vector_types_have_cuda_sizes() -> None:
    sizes = {"char2": 2, "char3": 3, "short2": 4, "float2": 8, "float3": 12, "float4": 16, "int4": 16, "double2": 16}
    for name, size in sizes.items():
        assert vector_dtype(name).itemsize == size, name
    assert vector_dtype("float4").names == ("x", "y", "z", "w")
    with pytest.raises(KeyError):
        vector_dtype("float5")


def test_packed_dtypes_get_cuda_padding() -> None:
    packed = np.dtype([("c", "i1"), ("d", "f8"), ("i", "i4"), ("v", vector_dtype("float2"))])
    laid_out = cuda_struct(packed)
    assert [laid_out.fields[n][1] for n in laid_out.names] == [0, 8, 16, 24]
    assert laid_out.itemsize == 32
    aligned = np.dtype([("a", "i1"), ("b", "f4")], align=True)
    assert cuda_struct(aligned).itemsize == 8 and cuda_struct(aligned).fields["b"][1] == 4
    with_float4 = cuda_struct(np.dtype([("a", "f4"), ("v", vector_dtype("float4"))]))
    assert with_float4.fields["v"][1] == 16 and with_float4.itemsize == 32
    explicit = np.dtype({"names": ["a"], "formats": ["f4"], "offsets": [0], "itemsize": 16})  # __align__(16)
    assert cuda_struct(explicit).itemsize == 16
    misaligned = np.dtype({"names": ["a", "b"], "formats": ["i1", "f8"], "offsets": [0, 4], "itemsize": 16})
    with pytest.raises(TypeError, match="offset 4"):
        cuda_struct(misaligned)
    union = np.dtype({"names": ["i", "f"], "formats": ["i4", "f4"], "offsets": [0, 0], "itemsize": 4})
    with pytest.raises(TypeError, match="overlap"):  # (packed field by field, it would not fit)
        cuda_struct(union)
    with pytest.raises(TypeError, match=r"field name of .* is \|S8, which no kernel parameter is"):
        cuda_struct(np.dtype([("n", "i4"), ("name", "S8")]))


# Scalar field types and the ctypes type of the same size and alignment (float16 as a
# 2-byte integer: ctypes has no half): ctypes lays structures out by the platform's C rules.
_CTYPES = {
    "i1": ctypes.c_int8, "u1": ctypes.c_uint8, "?": ctypes.c_bool, "i2": ctypes.c_int16,
    "u2": ctypes.c_uint16, "f2": ctypes.c_uint16, "i4": ctypes.c_int32, "u4": ctypes.c_uint32,
    "f4": ctypes.c_float, "i8": ctypes.c_int64, "u8": ctypes.c_uint64, "f8": ctypes.c_double,
}  # fmt: skip

Field = tuple[np.dtype, Any]  # a field's numpy type (packed, numpy's default) and its ctypes type


def _struct(fields: list[Field]) -> Field:
    names = [f"f{i}" for i in range(len(fields))]
    c_struct = type("S", (ctypes.Structure,), {"_fields_": [(n, c) for n, (_, c) in zip(names, fields, strict=True)]})
    return np.dtype([(n, d) for n, (d, _) in zip(names, fields, strict=True)]), c_struct


def _array(element: Field, count: int) -> Field:
    return np.dtype((element[0], (count,))), element[1] * count


_SCALAR_FIELDS = st.sampled_from([(np.dtype(code), c_type) for code, c_type in _CTYPES.items()])
_FIELDS = st.recursive(
    _SCALAR_FIELDS,
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=5).map(_struct),
        st.builds(_array, inner.filter(lambda f: f[0].subdtype is None), st.integers(1, 3)),
    ),
    max_leaves=12,
)


def _c_offsets(c_type: Any, base: int = 0) -> list[tuple[int, int]]:
    """``(offset, size)`` of a ctypes type and of everything nested in it, in order."""
    found = [(base, ctypes.sizeof(c_type))]
    if hasattr(c_type, "_length_"):
        size = ctypes.sizeof(c_type._type_)
        for i in range(c_type._length_):
            found += _c_offsets(c_type._type_, base + i * size)
    for name, field_type in getattr(c_type, "_fields_", ()):
        found += _c_offsets(field_type, base + getattr(c_type, name).offset)
    return found


def _offsets(dtype: np.dtype, base: int = 0) -> list[tuple[int, int]]:
    """:func:`_c_offsets` of a numpy type."""
    found = [(base, dtype.itemsize)]
    if dtype.subdtype is not None:
        element, (count,) = dtype.subdtype
        for i in range(count):
            found += _offsets(element, base + i * element.itemsize)
    for name in dtype.names or ():
        field, offset = dtype.fields[name][:2]  # type: ignore[index]
        found += _offsets(field, base + offset)
    return found


@given(st.lists(_FIELDS, min_size=1, max_size=6).map(_struct))
def test_nested_structs_have_cs_layout(struct: Field) -> None:
    """Only the top level of a struct was laid out with C's padding: a nested struct (or
    an array of them) kept numpy's packed layout, so an inner {char; double} had its
    double at offset 1, where the kernel reads it at 8. Every level now has C's layout,
    here the one ctypes gives the same C struct; and a dtype given with that layout
    (explicit offsets) is kept as it is."""
    packed, c_type = struct
    laid_out = cuda_struct(packed)
    assert _offsets(laid_out) == _c_offsets(c_type)
    assert cuda_struct(laid_out) == laid_out
    explicit = np.dtype(
        {
            "names": list(laid_out.names or ()),
            "formats": [laid_out.fields[name][0] for name in laid_out.names or ()],  # type: ignore[index]
            "offsets": [getattr(c_type, name).offset for name in laid_out.names or ()],
            "itemsize": ctypes.sizeof(c_type),
        }
    )
    assert _offsets(cuda_struct(explicit)) == _c_offsets(c_type)


def test_a_layout_that_is_not_cs_is_refused() -> None:
    """A dtype laid out by the caller (align=True, offsets) whose fields are not where C
    puts them is refused, naming the field, where it was kept: numpy's align=True places
    a packed nested struct at any byte, and a field after it could sit in its C padding."""
    inner = np.dtype([("c", "i1"), ("d", "f8")])
    with pytest.raises(TypeError, match=r"field 'i' of .* is at offset 1, where C puts it at 8"):
        cuda_struct(np.dtype([("t", "i1"), ("i", inner), ("z", "f8")], align=True))
    gapped = np.dtype({"names": ["c", "d"], "formats": ["i1", "f8"], "offsets": [0, 16], "itemsize": 24})
    with pytest.raises(TypeError, match=r"field 'o\.d' of .* is at offset 16, where C puts it at 8"):
        cuda_struct(np.dtype([("n", "i4"), ("o", gapped)]))
    short = np.dtype({"names": ["c", "d"], "formats": ["i1", "f8"], "offsets": [0, 8], "itemsize": 20})
    with pytest.raises(TypeError, match=r"struct 'a\[\]' of .* has size 20, where C's is 16"):
        cuda_struct(np.dtype([("a", short, (2,))]))
    aligned = np.dtype([("w", "f4")], metadata={"cuda_align": 16})  # an __align__(16) struct
    outer = cuda_struct(np.dtype([("c", "i1"), ("w", aligned)]))
    assert outer.fields["w"][1] == 16 and outer.itemsize == 32  # type: ignore[index]


def test_signatures_with_vectors_and_structs() -> None:
    params = parse_signature("float2 a, const int4* p, int n")
    assert [p.describe() for p in params] == ["float2 a", "int4* p", "int32 n"]
    assert params[0].by_value_struct and not params[1].by_value_struct and params[1].pointee is None
    found = source_signatures('extern "C" __global__ void k(float4 v, double2* out) {}')
    assert found["k"] is not None and found["k"][0].dtype.itemsize == 16
    struct = np.dtype([("x", "f4"), ("n", "i4")])
    declared = parse_signature([struct, "float*"])
    assert declared[0].by_value_struct and declared[0].describe() == "struct(x, n)"


def test_struct_values_pack_where_cuda_reads_them() -> None:
    params = np.dtype([("c", "i1"), ("d", "f8"), ("i", "i4"), ("v", vector_dtype("float2"))])
    buffer = ParamBuffer(parse_signature([params, "float2", "int4", "int"]))
    buffer.pack(((7, 2.5, -3, (1.5, -1.5)), (0.25, 4.0), (1, 2, 3, 4), 9), None)
    record, pair, quad, n = buffer.values
    assert record["c"] == 7 and record["d"] == 2.5 and record["i"] == -3 and tuple(record["v"]) == (1.5, -1.5)
    assert tuple(pair) == (0.25, 4.0) and tuple(quad) == (1, 2, 3, 4) and n == 9
    raw = bytes(buffer.slots[0]._block)[:32]  # the bytes the driver copies for the struct
    assert raw[0] == 7 and np.frombuffer(raw[8:16], np.float64)[0] == 2.5
    assert np.frombuffer(raw[16:20], np.int32)[0] == -3 and tuple(np.frombuffer(raw[24:32], np.float32)) == (1.5, -1.5)


SOURCE = r"""
struct Params { char c; double d; int i; float2 v; };

extern "C" __global__ void unpack(Params p, float2 w, int4 q, double* out) {
    out[0] = p.c; out[1] = p.d; out[2] = p.i; out[3] = p.v.x; out[4] = p.v.y;
    out[5] = w.x; out[6] = w.y; out[7] = q.x; out[8] = q.y; out[9] = q.z; out[10] = q.w;
    out[11] = sizeof(Params);
}

struct Inner { char c; double d; };
struct __align__(16) Wide { float w; };
struct Outer { char tag; Inner inner; Inner pair[2]; short s; Wide wide; int n; };

extern "C" __global__ void nested(Outer o, double* out) {
    const char* at = (const char*)&o;
    out[0] = o.tag; out[1] = o.inner.c; out[2] = o.inner.d; out[3] = o.pair[0].c; out[4] = o.pair[0].d;
    out[5] = o.pair[1].c; out[6] = o.pair[1].d; out[7] = o.s; out[8] = o.wide.w; out[9] = o.n;
    out[10] = sizeof(Outer); out[11] = (const char*)&o.inner - at; out[12] = (const char*)&o.inner.d - at;
    out[13] = (const char*)&o.pair[1].d - at; out[14] = (const char*)&o.wide - at; out[15] = (const char*)&o.n - at;
}
"""

PARAMS = np.dtype([("c", "i1"), ("d", "f8"), ("i", "i4"), ("v", vector_dtype("float2"))])  # packed: relaid out


def _unpack(launch: Any, p: np.void, w: np.void, q: np.void, out: np.ndarray) -> None:
    out[:12] = [p["c"], p["d"], p["i"], p["v"]["x"], p["v"]["y"], w["x"], w["y"], *q.tolist(), p.dtype.itemsize]


INNER = np.dtype([("c", "i1"), ("d", "f8")])
OUTER = np.dtype(  # packed, numpy's default: laid out by C's rules at every level
    [
        ("tag", "i1"),
        ("inner", INNER),
        ("pair", INNER, (2,)),
        ("s", "i2"),
        ("wide", np.dtype([("w", "f4")], metadata={"cuda_align": 16})),
        ("n", "i4"),
    ]
)


def _nested(launch: Any, o: np.void, out: np.ndarray) -> None:
    layout = o.dtype
    pair = layout.fields["pair"]
    element = pair[0].subdtype[0]
    out[:16] = [
        *(o["tag"], o["inner"]["c"], o["inner"]["d"], o["pair"][0]["c"], o["pair"][0]["d"]),
        *(o["pair"][1]["c"], o["pair"][1]["d"], o["s"], o["wide"]["w"], o["n"], layout.itemsize),
        *(layout.fields["inner"][1], layout.fields["inner"][1] + layout.fields["inner"][0].fields["d"][1]),
        *(pair[1] + element.itemsize + element.fields["d"][1], layout.fields["wide"][1], layout.fields["n"][1]),
    ]


@pytest.fixture
def module(backend: _driver.Driver, tmp_path: Any) -> Iterator[Module]:
    register_sim_kernel("unpack", _unpack)
    register_sim_kernel("nested", _nested)
    yield Program(SOURCE, cache=tmp_path).compile()
    register_sim_kernel("unpack", None)
    register_sim_kernel("nested", None)


@pytest.mark.anyio
async def test_a_kernel_reads_every_field(module: Module, anyio_backend: object) -> None:
    kernel = module.kernel("unpack", signature=[PARAMS, "float2", "int4", "double*"])
    record = np.array((-5, 1e300, 123456, (0.5, -0.25)), dtype=cuda_struct(PARAMS))[()]
    with Stream(0) as s:
        out = await to_device(np.zeros(12), stream=s)
        kernel.launch(1, 1, (-5, 1e300, 123456, (0.5, -0.25)), (3.5, 4.5), (1, -2, 3, -4), out, stream=s)
        first = await out.to_host(stream=s)
        go = kernel.bind(1, 1, stream=s)
        go(record, np.array((3.5, 4.5), vector_dtype("float2"))[()], np.int32([1, -2, 3, -4]), out)
        second = await out.to_host(stream=s)
    expected = [-5, 1e300, 123456, 0.5, -0.25, 3.5, 4.5, 1, -2, 3, -4, 32]
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(second, expected)


@pytest.mark.anyio
async def test_a_kernel_reads_every_field_of_nested_structs(module: Module, anyio_backend: object) -> None:
    """A nested struct, an array of them and an __align__(16) one, declared as a packed
    dtype: the kernel reads each field where the C struct has it (on a GPU it also says
    where that is: sizeof and the offsets of the fields, compared with C's rules here)."""
    kernel = module.kernel("nested", signature=[OUTER, "double*"])
    value = (-3, (5, 2.5), [(6, -1.25), (7, 1e300)], -300, (0.75,), 123456)
    record = np.array(value, OUTER)[()]  # (the caller's packed layout: taken by its fields' names)
    expected = [-3, 5, 2.5, 6, -1.25, 7, 1e300, -300, 0.75, 123456, 96, 8, 16, 48, 64, 80]
    with Stream(0) as s:
        out = await to_device(np.zeros(16), stream=s)
        for given in (value, record):
            kernel.launch(1, 1, given, out, stream=s)
            np.testing.assert_array_equal(await out.to_host(stream=s), expected)


@pytest.mark.anyio
async def test_bad_struct_arguments_name_the_argument(module: Module, anyio_backend: object) -> None:
    kernel = module.kernel("unpack", signature=[PARAMS, "float2", "int4", "double*"])
    good = ((1, 2.0, 3, (4.0, 5.0)), (1.0, 2.0), (1, 2, 3, 4))
    with Stream(0) as s:
        for index, bad in (
            (1, (1.0, 2.0, 3.0)),  # too many fields
            (2, (1.5, 2, 3, 4)),  # a float for an int field
            (2, 7),  # not a struct at all
            (0, (1, 2.0, 3)),  # a field missing
            (1, (1e300, 2.0)),  # a float field's range, packed by struct
            (0, (1, 2.0, 3, (4.0, -1e300))),  # ... and in a nested vector
        ):
            args = list(good)
            args[index] = bad
            with pytest.raises(LaunchError, match=f"argument {index}"):
                kernel.launch(1, 1, *args, 0, stream=s)  # refused before the driver sees the NULL
        out = await to_device(np.zeros(12), stream=s)  # (a real one: the kernel writes it)
        kernel.launch(1, 1, (1, 2.0, 3, (np.inf, np.nan)), (-np.inf, 1e-50), good[2], out, stream=s)
        values = await out.to_host(stream=s)
    np.testing.assert_array_equal(values[3:7], [np.inf, np.nan, -np.inf, 0.0])  # inf and nan as they are, 1e-50 rounded


def test_nested_fields_are_checked_as_scalar_arguments(module: Module) -> None:
    """A struct with a nested struct or an array field was assigned through numpy, which
    wraps integers it converts from numpy values: a record's 300 became 44 in a uint8
    field, -1 became 255 in an unsigned one, an int64 array's 70000 became 4464 in a
    uint16 array, and a float was cut to an int, where a scalar argument of those types
    is refused. Every field now is, the error naming its path."""
    inner = np.dtype([("count", "u1"), ("scale", "f4")])
    outer = np.dtype([("id", "i4"), ("inner", inner), ("taps", "u2", (3,))])
    wide = np.dtype([("id", "i8"), ("inner", [("count", "i8"), ("scale", "f8")]), ("taps", "i8", (3,))])
    buffer = ParamBuffer(parse_signature([outer, "float2"]))
    kernel = module.kernel("unpack", signature=[outer, "float2"])
    pair = (1.0, 2.0)
    with Stream(0) as s:
        go = kernel.bind(1, 1, stream=s)
        for bad, field in (
            (np.array((1, (300, 0.5), (1, 2, 3)), wide)[()], r"arg0\.inner\.count \(uint8\) cannot take int 300"),
            (np.array((1, (-1, 0.5), (1, 2, 3)), wide)[()], r"arg0\.inner\.count \(uint8\) cannot take int -1"),
            (np.array((1, (2, 0.5), (1, 70000, 3)), wide)[()], r"arg0\.taps\[1\] \(uint16\) cannot take int 70000"),
            ((1, (2, 0.5), np.array([1, 2, -1])), r"arg0\.taps\[2\] \(uint16\) cannot take int -1"),
            ((1, (2.5, 0.5), (1, 2, 3)), r"arg0\.inner\.count \(uint8\) cannot take float 2\.5"),
            ((1, (2, 0.5), (1, 2)), r"arg0\.taps \(uint16\[3\]\) cannot take tuple"),
        ):
            for launch in (lambda *a: buffer.pack(a, None), lambda *a: kernel.launch(1, 1, *a, stream=s), go):
                with pytest.raises(LaunchError, match=rf"argument 0 \(struct\(id, inner, taps\)\) .*: {field}"):
                    launch(bad, pair)  # (refused before the driver sees the kernel)
    buffer.pack((np.array((-7, (255, 0.5), (0, 65535, 9)), wide)[()], pair), None)  # in range: packed as given
    packed = buffer.values[0]
    assert (packed["id"], packed["inner"]["count"], packed["inner"]["scale"], packed["taps"].tolist()) == (
        -7,
        255,
        0.5,
        [0, 65535, 9],
    )


def test_bool_fields_take_what_a_bool_parameter_takes(module: Module) -> None:
    """A bool field of a struct took any object by its truth (struct's "?" does: "no",
    0.5, 2 and [] packed as true or false), where a bool parameter takes only True,
    False, 0 or 1. Every bool field -- top-level, nested, an array's element -- now does,
    the error naming its path."""
    flags = np.dtype([("on", "?"), ("inner", [("n", "i4"), ("off", "?")]), ("mask", "?", (3,))])
    plain = np.dtype([("n", "i4"), ("on", "?")])  # (scalar fields only: packed straight from the tuple, before)
    buffer = ParamBuffer(parse_signature([flags, plain]))
    kernel = module.kernel("unpack", signature=[flags, plain])
    good = ((True, (1, False), (True, False, True)), (7, True))
    with Stream(0) as s:
        go = kernel.bind(1, 1, stream=s)
        for wrong in ("no", 0.5, 2, [], None, np.int8(-1)):
            given = type(wrong).__name__
            for index, args, path in (
                (0, ((wrong, (1, False), (True,) * 3), good[1]), r"arg0\.on"),
                (0, ((True, (1, wrong), (True,) * 3), good[1]), r"arg0\.inner\.off"),
                (0, ((True, (1, False), (True, wrong, True)), good[1]), r"arg0\.mask\[1\]"),
                (1, (good[0], (7, wrong)), r"arg1\.on"),
            ):
                message = (
                    rf"argument {index} .*: {path} \(bool\) cannot take {given} .*: a bool field takes True, False"
                )
                for launch in (lambda *a: buffer.pack(a, None), lambda *a: kernel.launch(1, 1, *a, stream=s), go):
                    with pytest.raises(LaunchError, match=message):
                        launch(*args)  # (refused before the driver sees the kernel)
    for on, off, mask in ((True, False, [True, False, True]), (np.bool_(False), 1, np.array([1, 0, 1]))):
        buffer.pack(((on, (3, off), mask), (4, on)), None)
        record, pair = buffer.values
        assert (record["on"], record["inner"]["off"], record["mask"].tolist(), pair["on"]) == (
            bool(on),
            bool(off),
            [bool(m) for m in mask],
            bool(on),
        )


def test_a_record_must_have_the_structs_fields(module: Module) -> None:
    """A numpy record was packed by position: its fields in its own order, whatever their
    names, so a record with ``n`` before ``x`` put ``n``'s value in ``x``. One whose field
    names (nested ones included) are not the struct's, in the struct's order, is refused
    naming both; same names with other types convert, and tuples stay positional."""
    pair = np.dtype([("x", "f4"), ("n", "i4")])  # scalar fields: packed by struct
    buffer = ParamBuffer(parse_signature([pair, PARAMS, "float2"]))
    good = ((1.5, 2), (1, 2.0, 3, (4.0, 5.0)), (6.0, 7.0))
    swapped = np.array((2, 1.5), np.dtype([("n", "i4"), ("x", "f4")]))[()]
    renamed = np.array((1.5, 2), np.dtype([("a", "f4"), ("b", "i4")]))[()]
    inner = np.dtype([("c", "i1"), ("d", "f8"), ("i", "i4"), ("v", [("re", "f4"), ("im", "f4")])])
    yx = np.array((7.0, 6.0), np.dtype([("y", "f4"), ("x", "f4")]))[()]
    for index, bad, names in (
        (0, swapped, r"\(n, x\).*\(x, n\)"),
        (0, renamed, r"\(a, b\).*\(x, n\)"),
        (1, np.array((1, 2.0, 3, (4.0, 5.0)), inner)[()], r"v\(re, im\).*v\(x, y\)"),
        (1, np.array((1, 2.0, 3, (4.0, 5.0)), inner), r"v\(re, im\).*v\(x, y\)"),  # a 0-d array too
        (2, yx, r"\(y, x\).*\(x, y\)"),
    ):
        args = list(good)
        args[index] = bad
        with pytest.raises(LaunchError, match=rf"argument {index} .*fields .*{names}"):
            buffer.pack(tuple(args), None)
    wider = np.array((1.5, 2), np.dtype([("x", "f8"), ("n", "i8")]))[()]  # the struct's names, other types
    buffer.pack(
        (wider, np.array((1, 2.0, 3, (4.0, 5.0)), PARAMS)[()], np.array((6.0, 7.0), vector_dtype("float2"))), None
    )
    record, nested, vector = buffer.values
    assert (record["x"], record["n"], nested["v"]["y"], vector["y"]) == (1.5, 2, 5.0, 7.0)
    buffer.pack((swapped[["x", "n"]], good[1], yx[["x", "y"]]), None)  # reordered by name: the way to pass them
    assert (buffer.values[0]["x"], buffer.values[0]["n"], buffer.values[2]["x"]) == (1.5, 2, 6.0)

    kernel = module.kernel("unpack", signature=[PARAMS, "float2", "int4", "double*"])
    with Stream(0) as s:
        go = kernel.bind(1, 1, stream=s)
        for launch in (lambda *a: kernel.launch(1, 1, *a, stream=s), go):
            with pytest.raises(LaunchError, match=r"argument 0 .*fields .*v\(re, im\)"):
                launch(np.array((1, 2.0, 3, (4.0, 5.0)), inner)[()], (1.0, 2.0), (1, 2, 3, 4), 0)
            with pytest.raises(LaunchError, match=r"argument 1 .*fields \(y, x\)"):
                launch(good[1], yx, (1, 2, 3, 4), 0)
