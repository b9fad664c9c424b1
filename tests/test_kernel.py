"""Kernels: correctness against numpy, launch paths, argument checking, attributes, occupancy.

Every test runs on the simulated backend (kernels through registered Python
implementations) and on a real GPU where one is present (the same CUDA source, compiled).
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiocuda import _driver
from aiocuda.array import empty, to_device
from aiocuda.device import Device
from aiocuda.errors import ArgumentError, CudaError, LaunchError
from aiocuda.kernel import Kernel, LaunchConfig, register_sim_kernel
from aiocuda.module import Module
from aiocuda.program import Program
from aiocuda.stream import Stream, use_stream

from ._control import unload_after

SOURCE = r"""
extern "C" __global__ void saxpy(float a, const float* __restrict__ x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

template <typename T>
__global__ void axpy(T a, const T* x, T* y, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" __global__ void fill(int* out, int value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}

extern "C" __global__ void empty_kernel(float* a, float* b, int n) { }

extern "C" __global__ void unimplemented(int* out) { }
"""


def _saxpy(launch: Any, a: np.float32, x: np.ndarray, y: np.ndarray, n: np.int32) -> None:
    y[:n] = a * x[:n] + y[:n]


def _axpy(launch: Any, a: Any, x: np.ndarray, y: np.ndarray, n: np.uint64) -> None:
    y[: int(n)] = a * x[: int(n)] + y[: int(n)]


def _fill(launch: Any, out: np.ndarray, value: np.int32, n: np.int32) -> None:
    out[:n] = value


@pytest.fixture
def module(backend: _driver.Driver, tmp_path: Any) -> Iterator[Module]:
    impls = {"saxpy": _saxpy, "axpy": _axpy, "fill": _fill, "empty_kernel": lambda launch, *args: None}
    for name, impl in impls.items():
        register_sim_kernel(name, impl)
    program = Program(SOURCE, name_expressions=["axpy<float>", "axpy<double>"], cache=tmp_path)
    yield program.compile()
    for name in impls:
        register_sim_kernel(name, None)


def _data(n: int, dtype: Any = np.float32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random(n).astype(dtype), rng.random(n).astype(dtype)


# -- correctness ---------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_saxpy_matches_numpy(module: Module, anyio_backend: object) -> None:
    n = 10_000
    x, y = _data(n)
    with Stream(0) as s:
        dx, dy = await to_device(x, stream=s), await to_device(y, stream=s)
        saxpy = module.kernel("saxpy")
        saxpy.launch((n + 255) // 256, 256, 2.5, dx, dy, n, stream=s)
        await s
        out = await dy.to_host(stream=s)
    # float32 on the GPU contracts a*x+y into one FMA: last-bit differences from numpy.
    np.testing.assert_allclose(out, np.float32(2.5) * x + y, rtol=1e-5, atol=1e-6)


@pytest.mark.anyio
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
async def test_template_kernel_matches_numpy(module: Module, anyio_backend: object, dtype: Any) -> None:
    n = 4097
    x, y = _data(n, dtype, seed=1)
    name = "axpy<float>" if dtype == np.float32 else "axpy<double>"
    kernel = module.kernel(name)
    assert [p.dtype for p in kernel.signature or ()] == [np.dtype(dtype)] * 3 + [np.dtype(np.uint64)]
    with Stream(0) as s:
        dx, dy = await to_device(x, stream=s), await to_device(y, stream=s)
        kernel[(n + 127) // 128, 128, s](dtype(-1.5), dx, dy, n)
        out = await dy.to_host(stream=s)
    np.testing.assert_allclose(out, dtype(-1.5) * x + y, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


@pytest.mark.anyio
async def test_bound_launcher_reused_with_new_values(module: Module, anyio_backend: object) -> None:
    n = 1000
    with Stream(0) as s:
        outs = [empty(n, np.int32, stream=s) for _ in range(3)]
        go = module.kernel("fill").bind(4, 256, stream=s)
        for value, out in enumerate(outs):
            go(out, value * 7, n)
        results = [await out.to_host(stream=s) for out in outs]
    for value, result in enumerate(results):
        assert (result == value * 7).all()


@pytest.mark.anyio
async def test_pointer_forms(module: Module, anyio_backend: object) -> None:
    n = 256
    fill = module.kernel("fill")

    class Foreign:
        def __init__(self, ptr: int) -> None:
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": "<i4", "version": 3}

    with Stream(0) as s:
        arrays = [empty(n, np.int32, stream=s) for _ in range(4)]
        forms = [arrays[0], arrays[1].buffer, Foreign(arrays[2].ptr), arrays[3].ptr]
        for value, form in enumerate(forms):
            fill.launch(1, 256, form, value + 1, n, stream=s)
        results = [await a.to_host(stream=s) for a in arrays]
    for value, result in enumerate(results):
        assert (result == value + 1).all()


def test_concurrent_launches_from_threads(module: Module) -> None:
    n, rounds, workers = 64, 50, 4
    with Stream(0) as s:
        outs = [empty(n, np.int32, stream=s) for _ in range(workers)]
        s.synchronize()
        go = module.kernel("fill").bind(1, 64, stream=s)
        errors: list[BaseException] = []

        def worker(index: int) -> None:
            try:
                for _ in range(rounds):
                    go(outs[index], index + 100, n)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s.synchronize()
        host = [np.empty(n, np.int32) for _ in range(workers)]
        for out, h in zip(outs, host, strict=True):
            out.buffer.device._driver.memcpy_dtoh_async(h.ctypes.data, out.ptr, h.nbytes, s.handle)
        s.synchronize()
    assert not errors
    for index, h in enumerate(host):
        assert (h == index + 100).all()


# -- argument checking ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2.0, 0, 0), "takes 4 argument(s)"),
        ((2.0, 0, 0, 1, 2), "takes 4 argument(s)"),
        ((2.0, 0, 0, 1.5), "argument 3 (int32 n)"),
        ((2.0, 0, 0, 2**40), "argument 3 (int32 n)"),
        (("a", 0, 0, 1), "argument 0 (float32 a)"),
        ((2.0, np.zeros(4, np.float32), 0, 1), "host ndarray"),
        ((2.0, 0, 1.0, 1), "argument 2 (float32* y)"),
        ((2.0, 0, True, 1), "argument 2 (float32* y)"),
        ((2.0, -1, 0, 1), "argument 1 (float32* x)"),
    ],
)
def test_bad_arguments_raise_before_the_driver(module: Module, args: tuple[Any, ...], message: str) -> None:
    calls: list[Any] = []
    register_sim_kernel("saxpy", lambda launch, *a: calls.append(a))
    with Stream(0) as s:
        saxpy = module.kernel("saxpy")
        with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
            saxpy.launch(1, 32, *args, stream=s)
        go = saxpy.bind(1, 32, stream=s)
        with pytest.raises(LaunchError):
            go(*args)
        s.synchronize()
        assert s.query()
    assert calls == []


def test_scalar_widths_and_numpy_scalars_pack_exactly() -> None:
    from aiocuda._kernels.packing import ParamBuffer
    from aiocuda._kernels.signature import parse_signature

    sig = parse_signature(
        "bool, int8_t, unsigned char, short, unsigned short, int, unsigned int, long long, "
        "unsigned long long, __half, float, double, float*"
    )
    values = (True, -5, 250, -30000, 60000, -(2**31), 2**32 - 1, -(2**63), 2**64 - 1, 0.5, 1.25, -2.5, 0xDEAD00)
    buffer = ParamBuffer(sig)
    buffer.pack(values, None)
    assert buffer.values == values
    np_values = tuple(p.dtype.type(v) if not p.pointer else np.uint64(v) for p, v in zip(sig, values, strict=True))
    buffer.pack(np_values, None)
    assert buffer.values == values
    # each void* entry points at its argument's own bytes
    import ctypes

    pointers = (ctypes.c_void_p * len(sig)).from_address(buffer.address)
    for param, pointer, value in zip(sig, pointers, values, strict=True):
        raw = ctypes.string_at(pointer, param.dtype.itemsize if not param.pointer else 8)
        expected = np.array(value, dtype=np.uint64 if param.pointer else param.dtype).tobytes()
        assert raw == expected, param


def test_floats_beyond_a_parameters_range_are_refused(module: Module) -> None:
    """A finite float too large for a ``float`` parameter (1e300, a Python float or numpy's
    float64) was packed as inf; it is refused like an int that does not fit, naming the
    argument. inf, -inf and nan pass as they are, values that only round pass rounded;
    ``__half`` likewise (65504 is its largest finite value)."""
    from aiocuda._kernels.packing import ParamBuffer
    from aiocuda._kernels.signature import parse_signature

    calls: list[Any] = []
    register_sim_kernel("saxpy", lambda launch, *a: calls.append(a))
    with Stream(0) as s:
        saxpy = module.kernel("saxpy")  # float a, const float* x, float* y, int n
        go = saxpy.bind(1, 32, stream=s)
        for wrong in (1e300, -1e300, np.float64(1e300), 3.5e38):
            with pytest.raises(LaunchError, match=r"argument 0 \(float32 a\).*float32") as info:
                saxpy.launch(1, 32, wrong, 0, 0, 1, stream=s)
            assert info.value.name == "AIOCUDA_BAD_ARGUMENT"
            with pytest.raises(LaunchError, match=r"argument 0 \(float32 a\)"):
                go(wrong, 0, 0, 1)
        s.synchronize()
    assert calls == []

    buffer = ParamBuffer(parse_signature("float, __half, double, int"))
    for wrong in ((1e300, 0.0, 0.0, 1), (0.0, 65520.0, 0.0, 1), (0.0, np.float64(-1e6), 0.0, 1)):
        with pytest.raises(LaunchError, match=r"argument [01]"):
            buffer.pack(wrong, None)
    buffer.pack((float("inf"), float("-inf"), 1e300, 1), None)
    assert buffer.values == (float("inf"), float("-inf"), 1e300, 1)
    buffer.pack((float("nan"), float("nan"), 0.0, 1), None)
    assert all(np.isnan(v) for v in buffer.values[:2])
    buffer.pack((1e-50, 65504.0, 0.1, 1), None)
    assert buffer.values == (0.0, 65504.0, 0.1, 1)
    buffer.pack((0.1, np.float64(0.1), np.float64(-3.4e38), 1), None)
    assert buffer.values[:2] == (float(np.float32(0.1)), float(np.float16(0.1)))


def test_unknown_signature_asks_for_a_declared_one(module: Module) -> None:
    bare = Module(module.image, kind=module.kind)  # no signatures known
    kernel = bare.kernel("saxpy")
    with Stream(0) as s, pytest.raises(LaunchError, match="declare them"):
        kernel.launch(1, 32, 1.0, 0, 0, 1, stream=s)
    declared = bare.kernel("saxpy", signature="float a, const float* x, float* y, int n")
    assert declared.signature == module.kernel("saxpy").signature


def test_bad_launch_configuration(module: Module) -> None:
    saxpy = module.kernel("saxpy")
    with Stream(0) as s:
        for grid, block in [(0, 32), (1, (32, 0)), (1, (1, 1, 1, 1)), (1.5, 32)]:
            with pytest.raises(LaunchError):
                saxpy.launch(grid, block, 1.0, 0, 0, 0, stream=s)
        with pytest.raises(CudaError):
            saxpy.launch(1, 2048, 1.0, 0, 0, 0, stream=s)  # more threads than a block may have


def test_launch_config_checks_and_normalises() -> None:
    config = LaunchConfig((4, np.int64(2)), 128, shared_mem=64, cluster=2)
    assert (config.grid, config.block, config.shared_mem, config.cluster, config.cooperative) == (
        (4, 2, 1),
        (128, 1, 1),
        64,
        (2, 1, 1),
        False,
    )
    assert config == LaunchConfig((4, 2, 1), (128,), shared_mem=64, cluster=(2, 1, 1)) and len({config, config}) == 1
    with pytest.raises(AttributeError):
        config.grid = (1, 1, 1)  # type: ignore[misc]
    for bad in [
        {"grid": 1.0},
        {"grid": True},
        {"grid": (1, 2.0)},
        {"grid": ()},
        {"grid": [1]},
        {"block": 0},
        {"shared_mem": -1},
        {"shared_mem": 1.0},
        {"cooperative": 1},
        {"cluster": (2, 0)},
    ]:
        kwargs: dict[str, Any] = {"grid": 1, "block": 32, **bad}
        with pytest.raises(LaunchError) as info:
            LaunchConfig(**kwargs)
        assert info.value.name == "AIOCUDA_BAD_CONFIG", bad


@pytest.mark.anyio
async def test_launch_config_call_forms(module: Module, anyio_backend: object) -> None:
    n = 64
    fill = module.kernel("fill")
    config = LaunchConfig(1, 64)
    with Stream(0) as s:
        out = empty(n, np.int32, stream=s)
        fill.launch(config, out, 1, n, stream=s)
        assert (await out.to_host(stream=s) == 1).all()
        fill.bind(config, stream=s)(out, 2, n)
        assert (await out.to_host(stream=s) == 2).all()
        fill[config, s](out, 3, n)
        assert (await out.to_host(stream=s) == 3).all()
        with use_stream(s):
            fill[config](out, 4, n)
        assert (await out.to_host(stream=s) == 4).all()
        with pytest.raises(LaunchError, match="LaunchConfig carries"):
            fill.bind(config, 64, stream=s)
        with pytest.raises(LaunchError, match="LaunchConfig carries"):
            fill.launch(config, out, 5, n, stream=s, shared_mem=16)


def test_cached_launchers_do_not_accept_what_a_new_one_refuses(module: Module) -> None:
    """1.0 == 1 and True == 1: the launcher cache must not let them past the checks."""
    fill = module.kernel("fill")
    with Stream(0) as s:
        out = empty(32, np.int32, stream=s)
        fill.launch(1, 32, out, 1, 32, stream=s)
        fill.launch((1, 1), 32, out, 1, 32, stream=s)
        fill[1, 32, s](out, 1, 32)
        fill[1, 32, s, 0](out, 1, 32)
        for grid, block, options in [
            (1.0, 32, {}),
            (True, 32, {}),
            (1, 32.0, {}),
            ((1.0, 1), 32, {}),
            (1, 32, {"shared_mem": 0.0}),
            (1, 32, {"cooperative": 0}),
        ]:
            with pytest.raises(LaunchError, match="must be"):
                fill.launch(grid, block, out, 1, 32, stream=s, **options)
        for subscript in [(1.0, 32, s), (1, True, s), (1, 32, s, 0.0)]:
            with pytest.raises(LaunchError, match="must be"):
                fill[subscript]
        with pytest.raises(LaunchError, match="grid must be"):
            fill.launch([1], 32, out, 1, 32, stream=s)  # unhashable
        s.synchronize()


def test_every_spelling_of_a_configuration_shares_one_launcher(module: Module, monkeypatch: pytest.MonkeyPatch) -> None:
    fill = module.kernel("fill")
    binds: list[Any] = []
    bind = Kernel.bind
    monkeypatch.setattr(Kernel, "bind", lambda self, *a, **k: binds.append(a) or bind(self, *a, **k))
    with Stream(0) as s:
        out = empty(64, np.int32, stream=s)
        for grid in (np.int64(2), np.int32(2), 2, (2,), (2, 1, 1), LaunchConfig(2, 32)):
            if isinstance(grid, LaunchConfig):
                fill.launch(grid, out, 1, 64, stream=s)
                fill[grid, s](out, 1, 64)
            else:
                fill.launch(grid, 32, out, 1, 64, stream=s)
                fill[grid, 32, s](out, 1, 64)
        s.synchronize()
    assert len(binds) == 1


@pytest.mark.anyio
async def test_load_happens_off_the_loop_and_the_first_launch_loads_nothing(
    module: Module, backend: _driver.Driver, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    calls: list[tuple[str, int]] = []
    for name in ("module_load_data", "module_get_function"):
        original = getattr(backend, name)

        def spy(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            calls.append((_name, threading.get_ident()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(backend, name, spy)
    fill = module.kernel("fill")
    await fill.load(0)
    assert {name for name, _ in calls} == {"module_load_data", "module_get_function"}
    assert threading.get_ident() not in {thread for _, thread in calls}
    calls.clear()
    await fill.load(0)  # loaded: nothing to do
    with Stream(0) as s:
        out = empty(32, np.int32, stream=s)
        fill.launch(1, 32, out, 1, 32, stream=s)
        await s
    assert calls == []


def test_launchers_of_many_streams_stay_cached(module: Module, monkeypatch: pytest.MonkeyPatch) -> None:
    # A service launches one kernel on each of its lanes' streams in turn (33 lanes on an
    # H100): a cache that held 32 streams was emptied and rebuilt every round.
    fill = module.kernel("fill")
    binds: list[Any] = []
    bind = Kernel.bind
    monkeypatch.setattr(Kernel, "bind", lambda self, *a, **k: binds.append(a) or bind(self, *a, **k))
    streams = [Stream(0) for _ in range(3 * 64)]
    try:
        out = empty(32, np.int32, stream=streams[0])
        for _ in range(3):
            for s in streams:
                fill.launch(1, 32, out, 1, 32, stream=s)
        assert len(binds) == len(streams)
        for s in streams[: len(streams) // 2]:
            s.close()
        for s in streams[len(streams) // 2 :]:
            fill[1, 64, s](out, 1, 32)  # new entries: the closed streams' make room
            fill.launch(1, 32, out, 1, 32, stream=s)
        assert len(binds) == len(streams) + len(streams) // 2
    finally:
        for s in streams:
            s.close()


def test_stream_must_be_a_stream(module: Module) -> None:
    fill = module.kernel("fill")
    with Stream(0) as s:
        out = empty(32, np.int32, stream=s)
        with pytest.raises(LaunchError, match="stream must be an aiocuda Stream, got str"):
            fill.launch(1, 32, out, 1, 32, stream="x")  # type: ignore[arg-type]
        with pytest.raises(LaunchError, match="stream must be an aiocuda Stream"):
            fill.bind(1, 32, stream=s.handle)
        with pytest.raises(LaunchError, match="stream must be an aiocuda Stream"):
            fill[1, 32, "x"]
        with pytest.raises(LaunchError, match=r"Stream\.wrap"):
            fill.launch(LaunchConfig(1, 32), out, 1, 32, stream=_ForeignStream(s))  # type: ignore[arg-type]
        s.synchronize()


class _ForeignStream:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return self.stream.__cuda_stream__()


def test_arrays_must_have_the_pointee_type(module: Module) -> None:
    saxpy = module.kernel("saxpy")  # float a, const float* x, float* y, int n

    class Foreign:
        def __init__(self, ptr: int, typestr: str) -> None:
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (8,), "typestr": typestr, "version": 3}

    with Stream(0) as s:
        x32, x64 = empty(8, np.float32, stream=s), empty(8, np.float64, stream=s)
        y = empty(8, np.float32, stream=s)
        go = saxpy.bind(1, 32, stream=s)
        for wrong in (x64, Foreign(x64.ptr, "<f8"), empty(8, np.int32, stream=s)):
            for launch in (go, saxpy[1, 32, s], lambda *a: saxpy.launch(1, 32, *a, stream=s)):
                with pytest.raises(LaunchError, match=r"argument 1 \(float32\* x\).*the kernel reads float32"):
                    launch(2.0, wrong, y, 8)
        go(2.0, x32, y, 8)  # the right type, and every form an array is not checked as
        go(2.0, Foreign(x32.ptr, "<f4"), y, 8)
        go(2.0, x64.buffer, y, 8)
        go(2.0, x64.ptr, y, 8)
        untyped = module.kernel("fill", signature="void*, int, int")
        untyped.launch(1, 8, x64, 0, 16, stream=s)  # void* takes any array
        s.synchronize()


def test_strided_views_and_memory_of_another_device_are_refused(module: Module) -> None:
    """A kernel gets an array's first address only: a strided view would be read as if
    contiguous, and memory of another device was not kept alive for the kernel (freed and
    reused under it)."""
    from aiocuda.device import devices

    saxpy = module.kernel("saxpy")  # float a, const float* x, float* y, int n
    with Stream(0) as s:
        x, y = empty(16, np.float32, stream=s), empty(8, np.float32, stream=s)
        go = saxpy.bind(1, 32, stream=s)
        for launch in (go, saxpy[1, 32, s], lambda *a: saxpy.launch(1, 32, *a, stream=s)):
            with pytest.raises(LaunchError, match=r"argument 1 .*strided view"):
                launch(2.0, x[::2], y, 8)
            launch(2.0, x[8:], y, 8)  # a contiguous slice is what it looks like
        if len(devices()) > 1:
            with Stream(1) as other:
                far = empty(8, np.float32, stream=other)
                for wrong in (far, far.buffer):
                    with pytest.raises(LaunchError, match="on device 1, the kernel runs on device 0"):
                        go(2.0, wrong, y, 8)
                other.synchronize()
        s.synchronize()


def test_scalars_take_numbers_not_arrays_or_truthy_objects(module: Module) -> None:
    """A bool parameter took any object (its truthiness), a size_t one an array (its
    address): both are refused, naming the argument."""
    axpy = module.kernel("axpy<float>")  # float a, const float* x, float* y, size_t n
    flag = module.kernel("fill", signature="int*, bool, int")
    with Stream(0) as s:
        x, y = empty(8, np.float32, stream=s), empty(8, np.int32, stream=s)
        for wrong in (x, None, -1):
            with pytest.raises(LaunchError, match=r"argument 3 \(uint64 n\)"):
                axpy.launch(1, 8, 2.0, x, x, wrong, stream=s)
        for wrong in ("no", 0.5, x, 2):
            with pytest.raises(LaunchError, match=r"argument 1 \(bool\).*True, False, 0 or 1"):
                flag.launch(1, 8, y, wrong, 8, stream=s)
        for right in (True, np.bool_(False), 1):
            flag.launch(1, 8, y, right, 8, stream=s)
        s.synchronize()


def test_missing_kernel_is_a_clear_error(module: Module) -> None:
    with pytest.raises(ArgumentError, match="nope"):
        module.kernel("nope").function(0)


def test_sim_kernel_without_implementation(backend: _driver.Driver, module: Module) -> None:
    if backend.name != "sim":
        pytest.skip("sim-only: a real GPU runs the compiled kernel")
    with Stream(0) as s, pytest.raises(LaunchError, match="register_kernel"):
        module.kernel("unimplemented").launch(1, 1, 0, stream=s)


# -- attributes, occupancy, cooperative and cluster launches -------------------------------------
def test_attributes_and_occupancy(module: Module) -> None:
    kernel = module.kernel("saxpy")
    attrs = kernel.attributes(0)
    assert attrs.num_regs > 0
    assert attrs.max_threads_per_block >= 256
    assert attrs.binary_version >= 50
    blocks = kernel.max_active_blocks(256)
    assert 1 <= blocks <= 32
    min_grid, block = kernel.suggested_block_size()
    assert block % 32 == 0 and 32 <= block <= 1024 and min_grid >= 1
    kernel.set_attribute("max_dynamic_shared_size_bytes", 64 * 1024)
    assert kernel.attribute("max_dynamic_shared_size_bytes") == 64 * 1024
    with pytest.raises(ArgumentError):
        kernel.set_attribute("num_regs", 8)


@pytest.mark.anyio
async def test_cooperative_and_cluster_launches(module: Module, anyio_backend: object) -> None:
    fill = module.kernel("fill")
    n = 256
    with Stream(0) as s:
        out = empty(n, np.int32, stream=s)
        fill.launch(2, 128, out, 3, n, stream=s, cooperative=True)
        assert (await out.to_host(stream=s) == 3).all()
        fill.launch(4, 64, out, 4, n, stream=s, cluster=2)
        assert (await out.to_host(stream=s) == 4).all()
        with pytest.raises(LaunchError):
            fill.launch(1_000_000, 1024, out, 5, n, stream=s, cooperative=True)
        with pytest.raises(CudaError):
            fill.launch(3, 64, out, 5, n, stream=s, cluster=2)  # the cluster must divide the grid


@pytest.mark.anyio
async def test_module_from_ptx_text(backend: _driver.Driver, anyio_backend: object) -> None:
    ptx = _PTX
    register_sim_kernel("set_one", lambda launch, out: out.__setitem__(slice(0, 1), 1))
    try:
        module = Module.from_bytes(ptx)
        parsed = module.kernel("set_one").signature
        assert parsed is not None and [p.dtype.name for p in parsed] == ["uint64"]
        # PTX cannot tell a pointer from a u64; declaring it gives the sim a typed array
        kernel = module.kernel("set_one", signature="unsigned int* out")
        with Stream(0) as s:
            out = empty(4, np.uint32, stream=s)
            await out.fill(0, stream=s)
            kernel.launch(1, 1, out, stream=s)
            assert (await out.to_host(stream=s))[0] == 1
        module.unload()
    finally:
        register_sim_kernel("set_one", None)


_PTX = """
.version 7.0
.target sm_70
.address_size 64

.visible .entry set_one(
    .param .u64 set_one_param_0
)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<3>;
    ld.param.u64 %rd1, [set_one_param_0];
    cvta.to.global.u64 %rd2, %rd1;
    mov.u32 %r1, 1;
    st.global.u32 [%rd2], %r1;
    ret;
}
"""


def test_kernel_repr(module: Module) -> None:
    assert repr(module.kernel("saxpy")) == "<Kernel saxpy(float32 a, float32* x, float32* y, int32 n)>"
    assert isinstance(module.kernel("fill"), Kernel)


@pytest.mark.anyio
async def test_current_stream_is_the_default(module: Module, anyio_backend: object) -> None:
    from aiocuda.stream import use_stream

    n = 64
    with Stream(0) as s, use_stream(s):
        out = empty(n, np.int32, stream=s)
        module.kernel("fill")[1, 64](out, 9, n)
        assert (await out.to_host(stream=s) == 9).all()
        module.kernel("fill").launch((1, 1), (64, 1, 1), out, 10, n)
        assert (await out.to_host(stream=s) == 10).all()


def test_sim_implementation_sees_the_launch(sim_backend: _driver.Driver) -> None:
    seen: list[Any] = []
    register_sim_kernel("probe", lambda launch, x, v: seen.append((launch, x, v)))
    try:
        module = Program('extern "C" __global__ void probe(double* x, short v) {}').compile()
        with Stream(0) as s:
            module.kernel("probe").launch((2, 3), 32, None, 7, stream=s, shared_mem=128)
            s.synchronize()
    finally:
        register_sim_kernel("probe", None)
    ((launch, x, v),) = seen
    assert (launch.name, launch.grid, launch.block, launch.shared_mem) == ("probe", (2, 3, 1), (32, 1, 1), 128)
    assert x is None and v == 7 and isinstance(v, np.int16)


@pytest.mark.anyio
@pytest.mark.multi_gpu
async def test_module_loads_lazily_on_each_device(module: Module, anyio_backend: object) -> None:
    n = 32
    fill = module.kernel("fill")
    for ordinal in (0, 1):
        with Stream(ordinal) as s:
            out = empty(n, np.int32, stream=s)
            fill.launch(1, 32, out, ordinal + 1, n, stream=s)
            assert (await out.to_host(stream=s) == ordinal + 1).all()
    assert "loaded on devices [0, 1]" in repr(module)
    module.unload()
    assert "loaded on devices []" in repr(module)


def test_kernels_are_shared_and_reload_after_unload(module: Module) -> None:
    fill = module.kernel("fill")
    assert module.kernel("fill") is fill
    assert module.kernel("fill", signature="int*, int, int") is not fill
    with Stream(0) as s:
        out = empty(32, np.int32, stream=s)
        fill.launch(1, 32, out, 1, 32, stream=s)
        s.synchronize()
        module.unload()
        fill.launch(1, 32, out, 2, 32, stream=s)  # loads the module again
        s.synchronize()


def test_an_unload_racing_a_functions_look_up_leaves_no_stale_function(
    module: Module, backend: _driver.Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unload() on another thread between Kernel.function's look-up of the function
    and its caching forgot the kernel's functions before this one joined them: the
    unloaded module's function stayed cached, and the kernel's every later use failed
    (or, on a GPU, launched a function the driver had dropped). Here the unload comes
    exactly there, and runs to its end or waits for the look-up."""
    fill = module.kernel("fill")
    module.handle(Device(0))  # (loaded here, so that the unload below has something to unload)
    unloaders = unload_after(module, backend, "module_get_function", monkeypatch)
    fill.function(0)
    unloaders[0].join(10)
    assert fill.attribute("num_regs") > 0  # the function of the module loaded again
    with Stream(0) as s:
        out = empty(32, np.int32, stream=s)
        fill.launch(1, 32, out, 3, 32, stream=s)
        s.synchronize()


def test_an_unload_racing_a_launchers_making_leaves_no_stale_launcher(
    module: Module, backend: _driver.Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unload() on another thread while a launcher was made (from the function
    looked up before the unload) forgot the kernel's launchers before the new one was
    cached: every later launch of that configuration and stream took it, and launched
    the unloaded module's function. Here the unload comes while the launcher is made."""
    unloaders: list[threading.Thread] = []
    prepare = type(backend).prepare_launch

    def unload_meanwhile(driver: _driver.Driver, *args: Any) -> Any:
        if not unloaders:
            unloader = threading.Thread(target=module.unload)
            unloaders.append(unloader)
            unloader.start()
            unloader.join(10)  # (nothing it waits for is held here)
        return prepare(driver, *args)  # type: ignore[arg-type]

    fill = module.kernel("fill")
    with Stream(0) as s:
        out = empty(32, np.int32, stream=s)
        fill.function(0)  # (looked up before the unload, as a kernel launched before it is)
        monkeypatch.setattr(type(backend), "prepare_launch", unload_meanwhile)
        fill[1, 32, s]  # made across the unload; not to be used (Module.unload says so)
        monkeypatch.undo()
        assert not unloaders[0].is_alive()
        fill[1, 32, s](out, 4, 32)
        fill.launch(1, 32, out, 5, 32, stream=s)  # (under another spelling, the same launcher cache)
        s.synchronize()


def test_seam_launch_calls(backend: _driver.Driver, module: Module) -> None:
    from aiocuda._kernels.packing import ParamBuffer

    fill = module.kernel("fill")
    assert fill.signature is not None
    func = fill.function(0)
    with Stream(0) as s:
        out = empty(32, np.int32, stream=s)
        host = np.zeros(32, np.int32)
        params = ParamBuffer(fill.signature)
        for value, config in [(5, LaunchConfig(1, 32)), (6, LaunchConfig(1, 32, cooperative=True))]:
            params.pack((out, value, 32), s)
            backend.launch_kernel(func, config, s.handle, params)
            backend.memcpy_dtoh_async(host.ctypes.data, out.ptr, host.nbytes, s.handle)
            s.synchronize()
            assert (host == value).all()


def test_launch_on_a_closed_stream_is_refused(module: Module) -> None:
    fill = module.kernel("fill")
    s = Stream(0)
    out = empty(32, np.int32, stream=s)
    fill.launch(1, 32, out, 1, 32, stream=s)
    s.synchronize()
    s.close()
    with pytest.raises(ArgumentError, match="closed"):
        fill.launch(1, 32, out, 1, 32, stream=s)
    with pytest.raises(ArgumentError, match="closed"):
        fill[1, 32, s](out, 1, 32)


def test_more_occupancy_queries_and_cache_config(module: Module) -> None:
    kernel = module.kernel("saxpy")
    assert kernel.max_active_blocks(256, caching_override=False) >= 1
    _, block = kernel.suggested_block_size(max_block_size=128)
    assert 32 <= block <= 128
    one, four = kernel.available_shared_memory(1, 128), kernel.available_shared_memory(4, 128)
    assert one >= four > 0  # (an H100 gives 48 KiB to both without an opt-in)
    assert kernel.available_shared_memory(1, 128) >= 48 * 1024
    config = LaunchConfig(16, 128, cluster=2)
    assert kernel.max_active_clusters(config) >= 1
    assert kernel.max_cluster_size(LaunchConfig(16, 128)) >= 8
    with pytest.raises(LaunchError, match="LaunchConfig"):
        kernel.max_active_clusters((16, 128))  # type: ignore[arg-type]
    kernel.set_cache_config("prefer_shared")
    with pytest.raises(ArgumentError):
        kernel.set_cache_config("prefer_everything")  # type: ignore[arg-type]


# -- modules from a fatbin ------------------------------------------------------------------------
FATBIN = pathlib.Path(__file__).with_name("data") / "fill.fatbin"  # tests/data/make_fill_fatbin.py


@pytest.mark.anyio
async def test_a_fatbin_module_loads_and_runs(backend: _driver.Driver, anyio_backend: object) -> None:
    """A fatbin (here an sm_90 cubin in its container, as nvfatbin writes it) is
    recognised by its magic, loaded and launched."""
    if backend.name == "cuda" and Device(0).compute_capability != (9, 0):
        pytest.skip("fill.fatbin holds an sm_90 cubin only")
    register_sim_kernel("fill", _fill)
    try:
        module = Module(FATBIN.read_bytes())
        assert module.kind == "fatbin"
        fill = module.kernel("fill", signature="int* out, int value, int n")
        n = 1000
        with Stream(0) as s:
            out = empty(n, np.int32, stream=s)
            fill.launch((n + 127) // 128, 128, out, 7, n, stream=s)
            assert (await out.to_host(stream=s) == 7).all()
    finally:
        register_sim_kernel("fill", None)
