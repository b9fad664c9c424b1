"""aiocuda.peer.enable_peer_access: a failed or interrupted link check takes back the
access it enabled, and only that."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from aiocuda import _driver
from aiocuda._memory import copies
from aiocuda.device import Device
from aiocuda.errors import CudaError, ResultCode
from aiocuda.memory import MemoryPool
from aiocuda.peer import enable_peer_access
from aiocuda.stream import Stream

pytestmark = pytest.mark.multi_gpu


@pytest.fixture
def pair(backend: _driver.Driver) -> Iterator[tuple[Device, Device]]:
    """Devices 0 and 1 with no peer access between them (a GPU's context keeps what earlier
    tests enabled), left so again afterwards."""
    if backend.device_count() < 2 or not Device(0).can_access_peer(Device(1)):
        pytest.skip("needs two devices that can be peers")
    dev, other = Device(0), Device(1)
    _access_off(dev, other)
    yield dev, other
    _access_off(dev, other)


def _access_off(dev: Device, other: Device) -> None:
    MemoryPool.for_device(other).revoke_access(dev)
    try:
        dev.disable_peer_access(other)
    except CudaError as error:
        if error.code != ResultCode.PEER_ACCESS_NOT_ENABLED:
            raise


def _access_on(dev: Device, other: Device) -> bool:
    """Whether ``dev`` has context-level access to ``other`` (probed by disabling and
    enabling it again) and ``other``'s pool grants it."""
    pooled = MemoryPool.for_device(other).has_access(dev)
    try:
        dev.disable_peer_access(other)
    except CudaError as error:
        assert error.code == ResultCode.PEER_ACCESS_NOT_ENABLED
        assert not pooled, "the pool grants access that the context does not have"
        return False
    assert dev.enable_peer_access(other)
    assert pooled, "the context has access that the pool does not grant"
    return True


def _corrupt_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the check's copy over the link deliver the pattern one word out of place."""
    original = copies.copy_device

    def shifted(dst: int, src: int, nbytes: int, stream: Stream) -> None:
        original(dst, src + 4, nbytes - 4, stream)

    monkeypatch.setattr(copies, "copy_device", shifted)


async def test_a_check_that_returns_wrong_data_disables_the_access_it_enabled(
    pair: tuple[Device, Device], monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    dev, other = pair
    _corrupt_link(monkeypatch)
    with pytest.raises(CudaError, match="returned wrong data"):
        await enable_peer_access(dev, other)
    assert not _access_on(dev, other)
    monkeypatch.undo()
    assert await enable_peer_access(dev, other) is True
    assert _access_on(dev, other)


async def test_a_failed_check_leaves_access_enabled_before_the_call(
    pair: tuple[Device, Device], monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    dev, other = pair
    assert await enable_peer_access(dev, other) is True
    _corrupt_link(monkeypatch)
    with pytest.raises(CudaError, match="returned wrong data"):
        await enable_peer_access(dev, other)
    assert _access_on(dev, other)


async def test_a_check_that_raises_disables_the_pool_grant_it_made_alone(
    pair: tuple[Device, Device], monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    dev, other = pair
    dev.enable_peer_access(other)  # the context's access is on already, the pool's grant is not

    def failing(dst: int, src: int, nbytes: int, stream: Stream) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(copies, "copy_device", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        await enable_peer_access(dev, other)
    assert not MemoryPool.for_device(other).has_access(dev)
    dev.disable_peer_access(other)  # still on: raises if the call took it


async def test_a_check_cancelled_midway_disables_the_access_it_enabled(
    sim_backend: _driver.Driver, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    dev, other = Device(0), Device(1)
    sim: Any = sim_backend
    original = copies.copy_device
    held: list[Any] = []
    copying = anyio.Event()
    returned: list[bool] = []

    def held_copy(dst: int, src: int, nbytes: int, stream: Stream) -> None:
        sim.pause(stream.handle)  # the copy over the link never finishes: a hung link
        held.append(stream.handle)
        original(dst, src, nbytes, stream)
        copying.set()

    monkeypatch.setattr(copies, "copy_device", held_copy)
    with anyio.move_on_after(5) as deadline:
        async with anyio.create_task_group() as tg:

            async def check() -> None:
                returned.append(await enable_peer_access(dev, other))

            tg.start_soon(check)
            await copying.wait()
            assert _access_on(dev, other)  # mid-check: enabled by the call
            tg.cancel_scope.cancel()
    assert not deadline.cancelled_caught and not returned
    try:
        assert not _access_on(dev, other)
    finally:
        for handle in held:
            sim.resume(handle)
