"""Modules beyond their kernels: ``__constant__``/``__device__`` variables as device
arrays, the kernels a module lists, JIT options and logs, and linking several programs
(relocatable device code and LTO-IR). Both backends; on the simulated one, kernel
implementations read the module's variables through ``launch.globals``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiocuda import _driver
from aiocuda.array import to_device
from aiocuda.device import Device
from aiocuda.errors import ArgumentError, CompileError
from aiocuda.kernel import register_sim_kernel
from aiocuda.module import JitOptions, Module
from aiocuda.program import Program, ProgramOptions
from aiocuda.stream import Stream, use_stream

from ._control import unload_after

SOURCE = r"""
__constant__ float coeffs[4];
__device__ unsigned int calls;

extern "C" __global__ void poly(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = coeffs[0] + v * (coeffs[1] + v * (coeffs[2] + v * coeffs[3]));
    }
    if (i == 0) atomicAdd(&calls, 1u);
}

template <typename T>
__global__ void twice(T* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 2 * x[i];
}
"""


def _poly(launch: Any, x: np.ndarray, y: np.ndarray, n: np.int32) -> None:
    c = launch.globals["coeffs"]
    v = x[:n]
    y[:n] = c[0] + v * (c[1] + v * (c[2] + v * c[3]))
    launch.globals["calls"][0] += 1


@pytest.fixture
def module(backend: _driver.Driver, tmp_path: Any) -> Iterator[Module]:
    register_sim_kernel("poly", _poly)
    yield Program(SOURCE, name_expressions=["twice<float>"], cache=tmp_path).compile()
    register_sim_kernel("poly", None)


@pytest.mark.anyio
async def test_kernel_reads_a_constant_set_from_python(module: Module, anyio_backend: object) -> None:
    coeffs = module.get_global("coeffs")
    assert coeffs.shape == (4,) and coeffs.dtype == np.float32
    values = np.array([1.0, -2.0, 0.5, 0.25], dtype=np.float32)
    await coeffs.copy_from(values)
    np.testing.assert_array_equal(await coeffs.to_host(), values)
    n = 1000
    x = np.linspace(-2, 2, n, dtype=np.float32)
    with Stream(0) as s:
        dx = await to_device(x, stream=s)
        dy = await to_device(np.zeros(n, np.float32), stream=s)
        module.kernel("poly").launch((n + 255) // 256, 256, dx, dy, n, stream=s)
        result = await dy.to_host(stream=s)
        expected = values[0] + x * (values[1] + x * (values[2] + x * values[3]))
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)
        calls = module.get_global("calls")
        assert calls.dtype == np.uint32 and calls.shape == ()
        assert int((await calls.to_host())[()]) == 1
        await coeffs.copy_from(np.zeros(4, np.float32))  # a second write is seen by the next launch
        module.kernel("poly").launch(4, 256, dx, dy, n, stream=s)
        np.testing.assert_array_equal(await dy.to_host(stream=s), np.zeros(n, np.float32))


@pytest.mark.anyio
async def test_global_views_by_dtype_and_shape(module: Module, anyio_backend: object) -> None:
    raw = module.get_global("coeffs", dtype=np.uint8)
    assert raw.shape == (16,)
    pairs = module.get_global("coeffs", dtype=np.float32, shape=(2, 2))
    await pairs.copy_from(np.array([[1, 2], [3, 4]], np.float32))
    np.testing.assert_array_equal(await raw.to_host(), np.array([1, 2, 3, 4], np.float32).view(np.uint8))
    with pytest.raises(ArgumentError, match="does not fit"):
        module.get_global("coeffs", dtype=np.float32, shape=5)
    with pytest.raises(ArgumentError, match="whole number"):
        module.get_global("coeffs", dtype=np.dtype("V3"))
    with pytest.raises(ArgumentError) as info:
        module.get_global("nothing")
    assert info.value.name == "CUDA_ERROR_NOT_FOUND"


@pytest.mark.anyio
@pytest.mark.multi_gpu
async def test_a_global_follows_the_current_stream(module: Module, anyio_backend: object) -> None:
    """The variable a kernel launched inside ``use_stream(s)`` reads is ``s.device``'s
    copy: ``get_global`` without ``device=`` gives that one (it gave device 0's), and
    with ``stream=`` the stream's device's."""
    values = np.array([1.0, 2.0, 0.0, 0.0], np.float32)
    n = 8
    with Stream(1) as s, use_stream(s):
        coeffs = module.get_global("coeffs")
        assert (coeffs.device.ordinal, coeffs.buffer.stream) == (1, s)
        await coeffs.copy_from(values)
        dx = await to_device(np.ones(n, np.float32))
        dy = await to_device(np.zeros(n, np.float32))
        module.kernel("poly").launch(1, 32, dx, dy, n)
        np.testing.assert_array_equal(await dy.to_host(), np.full(n, 3.0, np.float32))
        with pytest.raises(ArgumentError, match=r"device 0 .*current stream .*device 1"):
            module.get_global("coeffs", device=0)
    with Stream(1) as s:
        assert module.get_global("coeffs", stream=s).device.ordinal == 1
        with pytest.raises(ArgumentError, match="device 0 and a stream of device 1"):
            module.get_global("coeffs", device=0, stream=s)


def test_kernel_names(module: Module) -> None:
    assert module.kernel_names() == ["poly", "twice<float>"]


def test_jit_options_are_checked() -> None:
    JitOptions(optimization_level=3, max_registers=32, target="sm_90", log_verbose=True)
    assert JitOptions(target=(9, 0)).target == 90 and JitOptions(target="compute_90").target == 90
    for bad in (
        {"optimization_level": 5},
        {"max_registers": 0},
        {"max_registers": 1.5},
        {"target": "sm90x"},
        {"log_verbose": 1},
        {"fallback": "prefer_neither"},
        {"target": 90, "threads_per_block": 128},
    ):
        with pytest.raises(ArgumentError):
            JitOptions(**bad)
    with pytest.raises(TypeError, match="JitOptions"):
        Module(b"ptx", kind="ptx", jit_options={"max_registers": 8})  # type: ignore[arg-type]


def test_jit_options_reach_the_driver(backend: _driver.Driver, tmp_path: Any) -> None:
    """PTX loaded with a register cap and a verbose log: the cap holds and the log says something."""
    options = ProgramOptions(arch="compute_90") if backend.name == "cuda" else ProgramOptions()
    compiled = Program(SOURCE, options=options, cache=tmp_path).compile()
    module = Module(
        compiled.image,
        kind=compiled.kind,
        signatures=compiled.signatures,
        variables=compiled.variables,
        jit_options=JitOptions(max_registers=16, log_verbose=True, optimization_level=2),
    )
    register_sim_kernel("poly", _poly)
    try:
        assert module.kernel("poly").attribute("num_regs") <= 16
        assert module.jit_log(Device(0))
    finally:
        register_sim_kernel("poly", None)


def test_unloadable_kinds_must_be_linked(backend: _driver.Driver) -> None:
    module = Module(b"\x00lto", kind="ltoir")
    with pytest.raises(CompileError, match="link it"):
        module.kernel("k").function()


# -- linking ------------------------------------------------------------------------------------
LIBRARY = r"""
__device__ float offset = 1.0f;
extern "C" __device__ float scale(float x) { return 3.0f * x + offset; }
"""

USER = r"""
extern __device__ float offset;
extern "C" __device__ float scale(float x);
extern "C" __global__ void apply(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = scale(x[i]);
}
"""


def _apply(launch: Any, x: np.ndarray, n: np.int32) -> None:
    x[:n] = 3.0 * x[:n] + launch.globals["offset"][0]


@pytest.fixture
def apply_impl() -> Iterator[None]:
    register_sim_kernel("apply", _apply)
    yield
    register_sim_kernel("apply", None)


@pytest.mark.anyio
@pytest.mark.parametrize("lto", [False, True], ids=["rdc", "lto"])
async def test_linking_two_programs(
    backend: _driver.Driver, apply_impl: None, anyio_backend: object, lto: bool, tmp_path: Any
) -> None:
    options = ProgramOptions(relocatable_device_code=True, lto=lto)
    library = Program(LIBRARY, options=options, name="library.cu", cache=tmp_path).compile()
    user = Program(USER, options=options, name="user.cu", cache=tmp_path).compile()
    if backend.name == "cuda":
        assert library.kind == ("ltoir" if lto else "cubin")
    linked = Module.link([library, user], options=JitOptions(optimization_level=3))
    assert "apply" in linked.kernel_names()
    await linked.get_global("offset").copy_from(np.array(0.5, np.float32))
    x = np.arange(64, dtype=np.float32)
    with Stream(0) as s:
        dx = await to_device(x, stream=s)
        linked.kernel("apply").launch(1, 64, dx, 64, stream=s)
        np.testing.assert_allclose(await dx.to_host(stream=s), 3.0 * x + 0.5)


def test_a_symbol_defined_twice_fails_to_link(backend: _driver.Driver, tmp_path: Any) -> None:
    options = ProgramOptions(relocatable_device_code=True)
    one = Program(LIBRARY + USER.replace("extern __device__ float offset;", ""), options=options, cache=tmp_path)
    two = Program(USER.replace("extern __device__ float offset;", "__device__ float offset;"), options=options)
    with pytest.raises(CompileError):
        Module.link([one.compile(), Program(USER, options=options, cache=tmp_path).compile(), two.compile()])


def test_link_needs_inputs(backend: _driver.Driver) -> None:
    with pytest.raises(ArgumentError, match="at least one"):
        Module.link([])
    with pytest.raises(TypeError, match="JitOptions"):
        Module.link([Module(b"x", kind="ptx")], options="fast")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_variable_of_an_unloaded_module_raises_when_used(module: Module, anyio_backend: object) -> None:
    """Its copies wrote freed device memory: the simulator poisoned the device."""
    coeffs = module.get_global("coeffs")
    await coeffs.copy_from(np.ones(4, dtype=np.float32))
    module.unload()
    with pytest.raises(ArgumentError, match=r"a variable of module 'program\.cu', which was unloaded"):
        await coeffs.to_host()
    with pytest.raises(ArgumentError, match="which was unloaded"):
        await coeffs.copy_from(np.zeros(4, dtype=np.float32))
    again = module.get_global("coeffs")  # the reloaded module's variable works
    await again.copy_from(np.full(4, 2, dtype=np.float32))
    assert (await again.to_host()).tolist() == [2.0] * 4


def test_an_unload_racing_get_global_leaves_no_usable_array(
    module: Module, backend: _driver.Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unload() on another thread between get_global's look-up of the variable and
    the registration of its memory cleared the registry before the new memory joined
    it: that array kept working, on the unloaded module's memory. Here the unload comes
    exactly there, and runs to its end or waits for get_global."""
    module.get_global("coeffs")  # (loaded here, so that the unload below has something to unload)
    unloaders = unload_after(module, backend, "module_get_global", monkeypatch)
    coeffs = module.get_global("coeffs")
    unloaders[0].join(10)
    with pytest.raises(ArgumentError, match="which was unloaded"):
        coeffs.ptr  # noqa: B018
