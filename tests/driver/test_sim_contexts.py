"""The simulated driver's contexts, module variables and links: the semantics the layers
above rely on, checked on the seam itself."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from aiocuda._driver import JitOptions, sim_image
from aiocuda._driver.sim import SimDriver
from aiocuda.errors import ArgumentError, CompileError, CudaError, ResultCode


def test_the_context_stack(fresh: SimDriver) -> None:
    dev = fresh.device_get(0)
    primary = fresh.primary_context_retain(dev)
    user = fresh.context_create(dev, 0)
    assert fresh.context_current_value() == 0
    fresh.set_current(primary)  # on an empty stack: pushes
    fresh.context_push(user)
    assert fresh.context_current_value() == user.value
    fresh.set_current(primary)  # replaces the top
    assert fresh.context_current_value() == primary.value
    fresh.context_pop()
    assert fresh.context_current_value() == primary.value  # the one below
    fresh.context_pop()
    assert fresh.context_current_value() == 0
    with pytest.raises(ArgumentError) as info:
        fresh.context_pop()
    assert info.value.code == ResultCode.INVALID_CONTEXT
    fresh.context_destroy(user)


def test_destroying_a_context_waits_for_its_streams_and_invalidates_it(fresh: SimDriver) -> None:
    dev = fresh.device_get(0)
    user = fresh.context_create(dev, 0)
    fresh.context_push(user)
    stream = fresh.stream_create(True, 0)
    ran = threading.Event()
    fresh.enqueue(stream, ran.set, "kernel")
    fresh.context_destroy(user)  # current here: popped too
    assert ran.is_set() and stream.destroyed
    assert fresh.context_current_value() == 0
    with pytest.raises(ArgumentError):
        fresh.context_push(user)
    fresh.context_push(fresh.primary_context_retain(dev))
    with pytest.raises(ArgumentError, match="primary"):
        fresh.context_destroy(fresh.primary_context_retain(dev))


def test_a_destroyed_context_left_current_on_another_thread(fresh: SimDriver) -> None:
    dev = fresh.device_get(0)
    user = fresh.context_create(dev, 0)
    errors: list[BaseException] = []
    pushed, destroyed = threading.Event(), threading.Event()

    def other() -> None:
        fresh.context_push(user)
        pushed.set()
        destroyed.wait()
        try:
            fresh.mem_get_info()
        except CudaError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    pushed.wait()
    fresh.context_destroy(user)
    destroyed.set()
    thread.join()
    assert [e.code for e in errors] == [ResultCode.CONTEXT_IS_DESTROYED]  # type: ignore[attr-defined]


def test_flags_are_checked_and_reported(fresh: SimDriver) -> None:
    dev = fresh.device_get(0)
    assert fresh.primary_context_get_state(dev) == (0, False)
    fresh.primary_context_set_flags(dev, 4)
    fresh.primary_context_retain(dev)
    assert fresh.primary_context_get_state(dev) == (4, True)
    for bad in (3, 5, 0x100, -1):
        with pytest.raises(ArgumentError):
            fresh.primary_context_set_flags(dev, bad)
        with pytest.raises(ArgumentError):
            fresh.context_create(dev, bad)
    user = fresh.context_create(dev, 1)
    fresh.context_push(user)
    assert fresh.context_get_flags() == 1 | 0x8  # MAP_HOST, as drivers report it
    fresh.context_pop()


def test_limits_are_checked(fresh: SimDriver) -> None:
    fresh.set_current(fresh.primary_context_retain(fresh.device_get(0)))
    assert set(fresh.context_limit_names()) >= {"stack_size", "persisting_l2_cache_size"}
    fresh.context_set_limit("max_l2_fetch_granularity", 128)
    for name, value in (("max_l2_fetch_granularity", 100), ("persisting_l2_cache_size", 1 << 40), ("stack_size", -1)):
        with pytest.raises(ArgumentError):
            fresh.context_set_limit(name, value)
    with pytest.raises(ArgumentError):
        fresh.context_get_limit("bogus")
    with pytest.raises(ArgumentError):
        fresh.context_set_cache_config("prefer_everything")


def test_module_variables_live_in_device_memory(fresh: SimDriver) -> None:
    fresh.set_current(fresh.primary_context_retain(fresh.device_get(0)))
    module, log = fresh.module_load_data(sim_image(["k"], {"table": (16, "<f4"), "blob": (3, "-")}))
    assert log == ""
    ptr, size = fresh.module_get_global(module, "table")
    assert size == 16 and fresh.pointer_device_ordinal(ptr) == 0
    with pytest.raises(ArgumentError):
        fresh.mem_free_async(ptr, 0)  # not a pool's allocation
    with pytest.raises(ArgumentError):
        fresh.module_get_global(module, "missing")
    assert fresh.module_function_names(module) == ["k"]
    fresh.module_unload(module)
    with pytest.raises(ArgumentError):
        fresh.pointer_device_ordinal(ptr)
    module, log = fresh.module_load_data(sim_image(["k"]), JitOptions(max_registers=8, log_verbose=True))
    assert "1 kernel" in log and fresh.function_get_attribute(fresh.module_get_function(module, "k"), "num_regs") == 8


def test_links_merge_images_and_refuse_duplicates(fresh: SimDriver) -> None:
    fresh.set_current(fresh.primary_context_retain(fresh.device_get(0)))
    a = sim_image(["one"], {"shared": (4, "<i4")})
    b = sim_image(["two"])
    image, _ = fresh.link([("sim", a, "a"), ("sim", b, "b"), ("cubin", b"\x7fELF", "c")])
    module, _ = fresh.module_load_data(image)
    assert fresh.module_function_names(module) == ["one", "two"]
    assert fresh.module_get_global(module, "shared")[1] == 4
    with pytest.raises(CompileError, match="multiple definition of 'one'"):
        fresh.link([("sim", a, "a"), ("sim", a, "again")])
    with pytest.raises(CompileError, match="nothing to link"):
        fresh.link([])


def test_nvtx_and_profiler_logs(fresh: SimDriver) -> None:
    first = fresh.nvtx_range_start("a", None)
    second = fresh.nvtx_range_start("b", 0xFF000000)
    fresh.nvtx_range_end(first)
    fresh.nvtx_range_end(second)
    assert [e[:2] for e in fresh.nvtx_events()] == [
        ("start", first),
        ("start", second),
        ("end", first),
        ("end", second),
    ]
    with pytest.raises(ArgumentError, match="not open"):
        fresh.nvtx_range_end(first)
    fresh.profiler_start()
    fresh.profiler_start()
    assert fresh.profiling
    fresh.profiler_stop()
    assert not fresh.profiling


def test_new_calls_take_injected_faults(fresh: SimDriver) -> None:
    fresh.set_current(fresh.primary_context_retain(fresh.device_get(0)))
    stream = fresh.stream_create(True, 0)
    event = fresh.event_create(False, False)
    fresh.inject_fault(ResultCode.INVALID_VALUE, call="event_record_external")
    with pytest.raises(ArgumentError):
        fresh.event_record_external(event, stream)
    fresh.event_record_external(event, stream)
    fresh.inject_fault(ResultCode.OUT_OF_MEMORY, call="context_create")
    with pytest.raises(CudaError):
        fresh.context_create(fresh.device_get(0), 0)
    assert np.isfinite(fresh.stream_get_priority(stream))
