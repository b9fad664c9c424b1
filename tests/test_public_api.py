"""The public surface: what users may construct."""

from __future__ import annotations

import pytest

import aiocuda
from aiocuda import _driver


def test_factory_only_classes_refuse_direct_construction(sim_backend: _driver.Driver) -> None:
    for cls, factory in [
        (aiocuda.DeviceBuffer, "MemoryPool.allocate"),
        (aiocuda.MemoryPool, "MemoryPool.for_device"),
        (aiocuda.Kernel, "Module.kernel"),
    ]:
        with pytest.raises(TypeError, match=f"cannot be constructed directly: use {factory}"):
            cls()
    with aiocuda.MemoryPool.for_device(0).allocate(16) as buffer:  # the factories still work
        assert buffer.size == 16 and type(buffer) is aiocuda.DeviceBuffer
