"""Page-locked host memory: the cache of freed blocks, and unpinning off the loop."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiocuda import _driver
from aiocuda._memory import offloop as _offloop
from aiocuda._memory import pinned_cache as _pinned_cache
from aiocuda._memory.pinned import keep_spare
from aiocuda.device import Device
from aiocuda.errors import ArgumentError, OutOfMemoryError
from aiocuda.host import cached_bytes, empty_cache, is_pinned, pinned_empty, pinned_zeros, register_host

from ._control import forked_while_held, reserve_thread_done

pytestmark = pytest.mark.anyio


@pytest.fixture
def frees(backend: _driver.Driver, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The pointers the driver is asked to free, from an empty cache on."""
    gc.collect()  # earlier tests' pinned garbage gives its blocks back now, not mid-test
    empty_cache()
    assert _offloop.drain(timeout=30)
    freed: list[int] = []
    original = backend.mem_host_free

    def counting(ptr: int) -> None:
        freed.append(ptr)
        original(ptr)

    monkeypatch.setattr(backend, "mem_host_free", counting)
    yield freed
    empty_cache()
    assert _offloop.drain(timeout=30)


def _drop(*arrays: Any) -> list[int]:
    pointers = [int(a.ctypes.data) for a in arrays]
    del arrays
    gc.collect()
    return pointers


@pytest.mark.parametrize(
    ("nbytes", "block"),
    [(1, 4096), (4096, 4096), (4097, 8192), (1 << 20, 1 << 20), ((1 << 20) + 1, 2 << 20), (5 << 20, 5 << 20)],
)
def test_pinned_blocks_come_in_size_classes(nbytes: int, block: int) -> None:
    assert _pinned_cache.size_class(nbytes) == block


async def test_a_collected_pinned_array_lends_its_block_to_the_next(frees: list[int], anyio_backend: Any) -> None:
    (ptr,) = _drop(pinned_empty(3000, np.uint8))
    assert cached_bytes() == 4096 and frees == []
    again = pinned_empty((10, 100), np.float32)  # 4000 bytes: the same size class
    assert int(again.ctypes.data) == ptr and is_pinned(again)
    assert cached_bytes() == 0
    other = pinned_empty(5000, np.uint8)  # another class: a new block
    assert int(other.ctypes.data) != ptr


async def test_empty_cache_gives_the_blocks_back_off_the_loop(frees: list[int], anyio_backend: Any) -> None:
    pointers = _drop(pinned_empty(1 << 20, np.uint8), pinned_empty(3 << 20, np.uint8))
    assert cached_bytes() == 4 << 20
    assert empty_cache() == 4 << 20
    assert cached_bytes() == 0
    assert _offloop.drain(timeout=30)
    assert sorted(frees) == sorted(pointers)


async def test_blocks_beyond_the_limit_are_freed(
    frees: list[int], anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pinned_cache, "LIMIT", 3 << 20)
    first, second = _drop(pinned_empty(2 << 20, np.uint8), pinned_empty(2 << 20, np.uint8))
    assert cached_bytes() == 2 << 20
    assert _offloop.drain(timeout=30)
    assert len(frees) == 1 and frees[0] in (first, second)


async def test_blocks_of_a_previous_backend_are_not_reused(frees: list[int], anyio_backend: Any) -> None:
    _drop(pinned_empty(100, np.uint8))
    assert cached_bytes() == 4096
    _driver.use_backend("sim", devices=1)
    assert _pinned_cache.take(4096) is None  # dropped (and freed, if that backend still can)
    assert cached_bytes() == 0 and is_pinned(pinned_empty(100, np.uint8))


async def test_no_spare_is_pinned_that_the_cache_could_not_keep(
    backend: _driver.Driver, frees: list[int], anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare (keep_spare, pinned on the reserve thread for the next allocation of its
    size) was pinned even when the cache was full: the block was then freed at once, 1-40
    ms of pinning followed by a free that waits for the GPU while holding a driver lock
    the loop's calls need."""
    device = Device(0)
    pinned: list[int] = []
    original = backend.mem_host_alloc

    def noting(nbytes: int) -> int:
        pinned.append(nbytes)
        return original(nbytes)

    monkeypatch.setattr(backend, "mem_host_alloc", noting)
    monkeypatch.setattr(_pinned_cache, "LIMIT", 3 << 20)
    _drop(pinned_empty(2 << 20, np.uint8))
    pinned.clear()
    keep_spare(device, 2 << 20)  # held already: nothing to pin
    keep_spare(device, 3 << 20)  # beyond the limit, with the block held
    await reserve_thread_done()
    assert pinned == [] and cached_bytes() == 2 << 20
    keep_spare(device, 1 << 20)  # room for it: pinned
    await reserve_thread_done()
    assert pinned == [1 << 20] and cached_bytes() == 3 << 20
    assert _offloop.drain(timeout=30)
    assert frees == []


def test_bad_pinned_shapes_and_dtypes_raise_typed_errors(backend: _driver.Driver) -> None:
    with pytest.raises(ArgumentError, match="negative"):
        pinned_empty((-1, 2))
    with pytest.raises(TypeError):
        pinned_empty(1.5)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="more than numpy can address"):
        pinned_empty(2**62, np.float32)
    with pytest.raises(ArgumentError, match="more than numpy can address"):
        pinned_empty(2**63, np.uint8)  # (was a ValueError from numpy)
    with pytest.raises(ArgumentError, match="objects"):
        pinned_empty(4, object)


def test_a_subarray_dtype_makes_a_pinned_array_as_numpy_does(backend: _driver.Driver) -> None:
    """numpy's ``np.empty(3, ("f4", (2, 2)))`` is a (3, 2, 2) float32 array; pinned_empty
    failed with numpy's ValueError (cannot reshape) instead."""
    array = pinned_zeros(3, ("f4", (2, 2)))
    expected = np.zeros(3, ("f4", (2, 2)))
    assert array.shape == (3, 2, 2) == tuple(map(int, expected.shape)) and array.dtype == expected.dtype
    assert is_pinned(array) and not array.any()


def test_views_of_pinned_memory_are_pinned_whatever_their_strides(backend: _driver.Driver) -> None:
    block = pinned_empty((4, 6), np.float32)
    for view in (block, block[::2], block.T, block[::-1], block[:, ::-1], block[1:3, 2:]):
        assert is_pinned(view), view.strides
    assert not is_pinned(np.zeros(4))
    with pytest.raises(TypeError, match="numpy array"):
        is_pinned([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="no bytes"):
        pinned_empty(3, np.dtype("V0"))


def test_registering_memory_already_pinned_says_so_without_asking_the_driver(
    backend: _driver.Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pinned array, a registered one, or a view of either: the driver was asked (after
    waiting for every queued unpin), and its answer, if it took the range, left two
    owners at one address in the registry of pinned ranges."""
    block = pinned_empty(100, np.float32)
    array = np.zeros(100)
    with register_host(array):
        asked: list[tuple[int, int]] = []
        monkeypatch.setattr(backend, "mem_host_register", lambda ptr, size: asked.append((ptr, size)))
        for pinned in (block, block[10:20], array, array[5:]):
            with pytest.raises(ArgumentError, match="already page-locked"):
                register_host(pinned)
        assert asked == []
        assert is_pinned(array)
    assert is_pinned(block)


def test_more_than_the_host_can_lock_is_an_out_of_memory_error(sim_backend: _driver.Driver) -> None:
    with pytest.raises(OutOfMemoryError, match="cuMemHostAlloc"):  # (was numpy's MemoryError)
        pinned_empty(2**61, np.uint8)


def test_a_pinned_array_collected_while_its_thread_holds_the_cache_lock(frees: list[int]) -> None:
    """The garbage collector may run a pinned array's finaliser on a thread that is
    inside the cache (taking a block, say): the block is filed later, not deadlocked on."""
    array = pinned_empty(3000, np.uint8)
    ptr = int(array.ctypes.data)
    with _pinned_cache._cache.lock:
        del array
        gc.collect()  # the finaliser gives the block back here
    again = pinned_empty(3000, np.uint8)
    assert int(again.ctypes.data) == ptr and frees == []


def test_a_pinned_array_collected_while_its_thread_holds_the_ranges_lock(frees: list[int]) -> None:
    """The collector may equally run the finaliser inside the registry of pinned ranges
    (while it adds a new array's range: seen hanging a GPU run): it removes the range
    there, not deadlocked on."""
    from aiocuda._memory.pinned import pinned_ranges

    array = pinned_empty(3000, np.uint8)
    ptr = int(array.ctypes.data)
    with pinned_ranges._lock:
        del array
        gc.collect()  # the finaliser removes the range here
    assert pinned_ranges.owner(ptr, 1) is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_another_thread_uses_the_pinned_cache_has_one_of_its_own() -> None:
    """A fork while another thread held the pinned cache's lock left it held in the
    child, where no thread would release it: the child's first pinned allocation waited
    forever. The child starts with an empty cache of its own."""

    def take() -> None:
        assert _pinned_cache.take(4096) is None  # (the parent's blocks are not the child's)

    assert forked_while_held(_pinned_cache._cache.lock, take), (
        "the child's pinned cache waited for a lock no thread would release"
    )
