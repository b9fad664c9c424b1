"""Contexts: primary-context flags, user contexts, ``with device:``/``with context:``,
limits, cache configuration, the awaitable device synchronize, and what ``make_current``
does when other code changed the current context. Both backends; GPU-only tests at the
end (CPU of a blocking synchronize under SPIN and BLOCKING_SYNC, PyTorch's and CuPy's
current context restored)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiocuda
from aiocuda import _driver
from aiocuda.context import Context, ContextFlags
from aiocuda.device import Device
from aiocuda.errors import ArgumentError
from aiocuda.stream import Stream

from .test_device import run_python


def _current(backend: _driver.Driver) -> int:
    return backend.context_current_value()


@pytest.fixture
def primary_flags(backend: _driver.Driver) -> Iterator[Device]:
    """Device 0, with its primary context's flags put back afterwards."""
    device = Device(0)
    before = device.context_flags()
    yield device
    device.set_context_flags(schedule=before.schedule, lmem_resize_to_max=before.lmem_resize_to_max)


# -- flags ---------------------------------------------------------------------------------------
def test_context_flags_values_round_trip() -> None:
    for schedule, value in (("auto", 0), ("spin", 1), ("yield", 2), ("blocking_sync", 4)):
        flags = ContextFlags(schedule)  # type: ignore[arg-type]
        assert flags.value == value and ContextFlags.from_value(value) == flags
    assert ContextFlags("spin", True).value == 0x11
    assert ContextFlags.from_value(0x8 | 0x4) == ContextFlags("blocking_sync")  # MAP_HOST ignored
    with pytest.raises(ArgumentError, match="schedule"):
        ContextFlags("sleepy")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="lmem_resize_to_max"):
        ContextFlags("auto", 1)  # type: ignore[arg-type]


def test_primary_context_flags_are_set_and_kept(backend: _driver.Driver, primary_flags: Device) -> None:
    device = primary_flags
    device.set_context_flags(schedule="blocking_sync")
    assert device.context_flags().schedule == "blocking_sync"
    device.set_context_flags(lmem_resize_to_max=True)  # the schedule stays
    assert device.context_flags().schedule == "blocking_sync"
    if backend.name == "sim":  # drivers may drop the bit: its behaviour is now always on
        assert device.context_flags().lmem_resize_to_max
    device.set_context_flags(schedule="spin", lmem_resize_to_max=False)
    assert device.context_flags() == ContextFlags("spin", False)
    with pytest.raises(ArgumentError):
        device.set_context_flags(schedule="never")  # type: ignore[arg-type]


def test_primary_context_is_retained_at_first_use(sim_backend: _driver.Driver) -> None:
    device = Device(0)
    assert not device.context_active  # creating the Device does not start the context
    device.set_context_flags(schedule="blocking_sync")  # so flags can still be chosen
    Stream(device).close()
    assert device.context_active
    assert device.context.flags.schedule == "blocking_sync"


# -- user contexts and the stack ---------------------------------------------------------------
def test_user_context_has_its_own_flags_and_leaves_the_thread_alone(backend: _driver.Driver) -> None:
    device = Device(0)
    device.make_current()
    before = _current(backend)
    context = device.create_context(schedule="spin")
    try:
        assert isinstance(context, Context) and not context.primary
        assert _current(backend) == before  # creating it did not make it current
        assert context.flags.schedule == "spin"
        assert _current(backend) == before  # nor did reading its flags
        with context as entered:
            assert entered is context
            assert _current(backend) == backend.handle_value(context.handle)
        assert _current(backend) == before
    finally:
        context.close()
    assert context.closed
    context.close()  # twice is fine
    with pytest.raises(ArgumentError, match="closed"):
        _ = context.handle
    assert "closed" in repr(context)


def test_contexts_come_from_factories(backend: _driver.Driver) -> None:
    with pytest.raises(TypeError, match="cannot be constructed directly"):
        Context()
    primary = Device(0).context
    assert primary is Device(0).context and primary.primary and primary.device is Device(0)
    primary.close()  # a primary context is never destroyed
    assert not primary.closed


def test_with_device_restores_what_another_library_had_current(backend: _driver.Driver) -> None:
    device = Device(0)
    foreign = device.create_context()  # stands for another library's own context
    try:
        with foreign:
            outer = _current(backend)
            with device as entered:
                assert entered is device
                assert _current(backend) == backend.handle_value(device.context.handle)
                Stream(device).close()  # aiocuda works inside the block
            assert _current(backend) == outer
            with device, device.context:  # nested blocks unwind in order
                pass
            assert _current(backend) == outer
    finally:
        foreign.close()


def test_make_current_notices_when_other_code_changed_the_context(backend: _driver.Driver) -> None:
    device = Device(0)
    primary = backend.handle_value(device.context.handle)
    device.make_current()
    assert _current(backend) == primary
    other = device.create_context()
    try:
        backend.set_current(other.handle)  # what a library switching contexts does
        assert _current(backend) != primary
        device.make_current()  # a per-thread cache alone would skip this
        assert _current(backend) == primary
        with Stream(device) as stream:
            stream.synchronize()
    finally:
        other.close()


def test_context_stack_is_per_thread(backend: _driver.Driver) -> None:
    device = Device(0)
    seen: list[int] = []

    def other_thread() -> None:
        seen.append(_current(backend))

    with device:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == [0]  # a new thread has nothing current, whatever this one pushed


# -- limits and cache configuration -------------------------------------------------------------
def test_limits_of_user_and_primary_contexts(backend: _driver.Driver) -> None:
    device = Device(0)
    primary = device.context
    limits = primary.limits()
    assert {"stack_size", "printf_fifo_size", "malloc_heap_size"} <= set(limits)
    context = device.create_context()
    try:
        context.set_limit("stack_size", limits["stack_size"] + 4096)
        assert context.limit("stack_size") >= limits["stack_size"] + 4096  # the driver may round up
        assert primary.limit("stack_size") == limits["stack_size"]  # each context has its own
        with pytest.raises(ArgumentError):
            context.limit("no_such_limit")  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="int >= 0"):
            context.set_limit("stack_size", -1)
        with pytest.raises(ArgumentError, match="int >= 0"):
            context.set_limit("stack_size", 1.5)  # type: ignore[arg-type]
    finally:
        context.close()


def test_malloc_heap_limit_on_the_primary_context(backend: _driver.Driver) -> None:
    primary = Device(0).context
    before = primary.limit("malloc_heap_size")
    try:
        primary.set_limit("malloc_heap_size", 64 << 20)
        assert primary.limit("malloc_heap_size") >= 64 << 20
    finally:
        primary.set_limit("malloc_heap_size", before)


def test_cache_configuration(backend: _driver.Driver) -> None:
    context = Device(0).create_context()
    try:
        assert context.cache_config == "prefer_none"
        context.set_cache_config("prefer_shared")
        assert context.cache_config == "prefer_shared"
        with pytest.raises(ArgumentError, match="cache config"):
            context.set_cache_config("prefer_everything")  # type: ignore[arg-type]
    finally:
        context.close()


# -- awaitable synchronize ----------------------------------------------------------------------
@pytest.mark.anyio
async def test_device_synchronize_waits_without_blocking_the_loop(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    device = Device(0)
    stream = Stream(device)
    sim: Any = sim_backend
    sim.pause(stream.handle)
    sim.enqueue(stream.handle, lambda: None, "kernel")
    done = anyio.Event()
    ticks = 0

    async def synchronize() -> None:
        await device.synchronize()
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(synchronize)
        for _ in range(20):  # the loop runs while the device is busy (the stream is paused)
            await anyio.sleep(0.001)
            ticks += 1
        assert not done.is_set() and ticks == 20
        sim.resume(stream.handle)
        with anyio.fail_after(30):
            await done.wait()
    assert stream.query()
    stream.close()


@pytest.mark.anyio
async def test_device_synchronize_after_work(backend: _driver.Driver, anyio_backend: object) -> None:
    device = Device(0)
    array = await aiocuda.to_device(np.arange(1 << 16, dtype=np.float32))
    await array.fill(3.0)
    await device.synchronize()
    context = device.create_context()
    try:
        await context.synchronize()
    finally:
        context.close()


# -- peers --------------------------------------------------------------------------------------
def test_peer_attributes(sim_backend: _driver.Driver) -> None:
    a, b = Device(0), Device(1)
    attributes = a.peer_attributes(b)
    assert attributes == aiocuda.PeerAttributes(True, True, True, 0)
    assert attributes.access_supported == a.can_access_peer(b)
    with pytest.raises(ArgumentError, match="itself"):
        a.peer_attributes(a)


@pytest.mark.multi_gpu
def test_peer_attributes_on_gpus(backend: _driver.Driver) -> None:
    if aiocuda.device_count() < 2:
        pytest.skip("needs two devices")
    a, b = Device(0), Device(1)
    attributes = a.peer_attributes(b)
    assert attributes.access_supported == a.can_access_peer(b)
    assert attributes.performance_rank >= 0


# -- GPU only -----------------------------------------------------------------------------------
_SPIN_PROGRAM = r"""
import json, sys, time
import aiocuda
schedule = sys.argv[1]
device = aiocuda.Device(0)
device.set_context_flags(schedule=schedule)       # before the context is first used
source = '''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
'''
kernel = aiocuda.Program(source, cache=False).compile(device).kernel("spin")
cycles = int(device.attribute("clock_rate") * 1000 * 0.4)   # about 0.4 s at the base clock
with aiocuda.Stream(device) as stream:
    kernel.launch(1, 1, 1000, stream=stream)
    stream.synchronize()                                     # warm up
    kernel.launch(1, 1, cycles, stream=stream)
    wall, cpu = time.perf_counter(), time.process_time()
    stream.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"schedule": device.context.flags.schedule, "wall": wall, "cpu": cpu}))
"""


@pytest.mark.gpu
def test_blocking_sync_lowers_the_cpu_of_a_blocking_synchronize(backend: _driver.Driver) -> None:
    """Each schedule in a fresh process (flags set before the context exists), SPIN as
    the control, in the same test run."""
    if backend.name != "cuda":
        pytest.skip("the simulator does not spin")
    results = {}
    for schedule in ("spin", "blocking_sync"):
        done = run_python(f"import sys; sys.argv[1:] = [{schedule!r}]\n" + _SPIN_PROGRAM)
        assert done.returncode == 0, done.stderr
        results[schedule] = json.loads(done.stdout.strip().splitlines()[-1])
    print(results)
    spin, blocking = results["spin"], results["blocking_sync"]
    assert spin["schedule"] == "spin" and blocking["schedule"] == "blocking_sync"
    assert spin["wall"] > 0.2 and blocking["wall"] > 0.2  # the kernel really ran that long
    assert spin["cpu"] > 0.5 * spin["wall"]  # spinning: a core busy while waiting
    assert blocking["cpu"] < 0.25 * spin["cpu"]  # sleeping: a small fraction of that


@pytest.mark.gpu
def test_with_device_restores_a_raw_driver_context(backend: _driver.Driver) -> None:
    """Another library's own context (made with cuda.bindings directly) stays current
    around ``with device:``."""
    if backend.name != "cuda":
        pytest.skip("needs the real driver")
    from cuda.bindings import driver as cu

    err, dev = cu.cuDeviceGet(0)
    try:
        err, ctx = cu.cuCtxCreate(None, 0, dev)
    except TypeError:
        err, ctx = cu.cuCtxCreate(0, dev)
    assert err == cu.CUresult.CUDA_SUCCESS
    try:
        with Device(0):
            assert int(cu.cuCtxGetCurrent()[1]) == backend.handle_value(Device(0).context.handle)
        assert int(cu.cuCtxGetCurrent()[1]) == int(ctx)
    finally:
        cu.cuCtxDestroy(ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_with_device_restores_what_torch_or_cupy_had_current(backend: _driver.Driver, library: str) -> None:
    if backend.name != "cuda":
        pytest.skip("needs the real driver")
    pytest.importorskip(library)
    count = aiocuda.device_count()
    code = f"""
import aiocuda, {library}
from cuda.bindings import driver as cu
other = {count} - 1                                 # the library's device: the last one
if "{library}" == "torch":
    import torch
    torch.cuda.set_device(other); torch.zeros(1, device="cuda").sum().item()
    current_device = torch.cuda.current_device
    work = lambda: torch.ones(4, device="cuda").sum().item()
else:
    import cupy
    cupy.cuda.Device(other).use(); cupy.zeros(1).sum().get()
    current_device = lambda: cupy.cuda.runtime.getDevice()
    work = lambda: float(cupy.ones(4).sum().get())
theirs = int(cu.cuCtxGetCurrent()[1])
assert theirs != 0
device = aiocuda.Device(0)
with device:
    assert int(cu.cuCtxGetCurrent()[1]) == int(device.context.handle)
    with aiocuda.Stream(device) as s:
        s.synchronize()
assert int(cu.cuCtxGetCurrent()[1]) == theirs, "the library's context was not restored"
assert current_device() == other
assert work() == 4.0
print("ok")
"""
    done = run_python(code)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr
