"""Every copy and memset aiocuda enqueues, in one place.

Two levels:

* Arrays: :func:`upload` and :func:`download` take a numpy array and decide, once for
  all of aiocuda, whether it can be copied directly: a pinned array is (the DMA is
  enqueued and the stream holds the array and its pinned owner until the DMA is done),
  a pageable one is not (they return False, enqueue nothing, and the caller stages it
  through :mod:`aiocuda._memory.staging`). :func:`copy_between` copies device memory on
  one device or between two, :func:`fill` sets bytes with a memset.
* Addresses: :func:`enqueue_upload` and :func:`enqueue_download` enqueue one DMA
  between a pinned host address and device memory, for callers that keep the host
  memory alive themselves (staging slots, request lanes); :func:`copy_device` copies
  between two device addresses the stream's device can reach.

Everything here only enqueues: nothing waits for the GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from .pinned import pinned_ranges

if TYPE_CHECKING:
    from ..device import Device
    from ..stream import Stream

__all__ = [
    "copy_between",
    "copy_device",
    "download",
    "enqueue_download",
    "enqueue_upload",
    "fill",
    "upload",
]


def upload(dst: int, host: npt.NDArray[Any], stream: Stream, keep: list[Any] | None = None) -> bool:
    """Enqueue the copy of C-contiguous ``host`` to device address ``dst`` on ``stream``
    if ``host`` is pinned; True if enqueued.

    The array and its pinned memory are kept alive until the DMA is done: held by the
    stream, or appended to ``keep`` by a caller that keeps them until it has awaited the
    stream itself. False, with nothing enqueued, for pageable memory: stage it instead.
    An empty array needs no copy (True).
    """
    nbytes = int(host.nbytes)
    if nbytes == 0:
        return True
    src = int(host.ctypes.data)
    owner = pinned_ranges.owner(src, nbytes)
    if owner is None:
        return False
    enqueue_upload(dst, src, nbytes, stream)
    _keep(stream, keep, owner, host)
    return True


def download(host: npt.NDArray[Any], src: int, stream: Stream, keep: list[Any] | None = None) -> bool:
    """Enqueue the copy of ``host.nbytes`` from device address ``src`` into C-contiguous
    ``host`` on ``stream`` if ``host`` is pinned; True if enqueued (``host`` holds the
    data once the stream has passed this point).

    The array and its pinned memory are kept alive as by :func:`upload`. False, with
    nothing enqueued, for pageable memory: stage it instead. An empty array needs no copy
    (True).
    """
    nbytes = int(host.nbytes)
    if nbytes == 0:
        return True
    dst = int(host.ctypes.data)
    owner = pinned_ranges.owner(dst, nbytes)
    if owner is None:
        return False
    enqueue_download(dst, src, nbytes, stream)
    _keep(stream, keep, owner, host)
    return True


def _keep(stream: Stream, keep: list[Any] | None, owner: Any, host: Any) -> None:
    if keep is None:
        stream.hold(owner, host)
    else:
        keep.append(owner)
        keep.append(host)


def enqueue_upload(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Enqueue the DMA of ``nbytes`` from page-locked host address ``src`` to device
    address ``dst`` on ``stream``; nothing else. The caller keeps the host memory alive
    (and unchanged) until the stream has passed the copy."""
    device = stream.device
    device.make_current()
    device._driver.memcpy_htod_async(dst, src, nbytes, stream.handle)


def enqueue_download(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Enqueue the DMA of ``nbytes`` from device address ``src`` to page-locked host
    address ``dst`` on ``stream``; nothing else. The caller keeps the host memory alive
    until the stream has passed the copy, and reads it only then."""
    device = stream.device
    device.make_current()
    device._driver.memcpy_dtoh_async(dst, src, nbytes, stream.handle)


def copy_device(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Enqueue a copy of ``nbytes`` between two device addresses that ``stream``'s
    device can reach (its own memory, or a peer's once peer access is enabled)."""
    device = stream.device
    device.make_current()
    device._driver.memcpy_dtod_async(dst, src, nbytes, stream.handle)


def copy_between(dst: int, dst_device: Device, src: int, src_device: Device, nbytes: int, stream: Stream) -> None:
    """Enqueue a copy of ``nbytes`` from ``src`` on ``src_device`` to ``dst`` on
    ``dst_device`` on ``stream``: a device copy on one device, a peer copy (which needs
    no peer access) between two."""
    if dst_device is src_device:
        copy_device(dst, src, nbytes, stream)
        return
    device = stream.device
    device.make_current()
    device._driver.memcpy_peer_async(dst, dst_device._context, src, src_device._context, nbytes, stream.handle)


def fill(dst: int, nbytes: int, pattern: bytes, stream: Stream) -> bool:
    """Enqueue a memset of ``nbytes`` at device address ``dst`` repeating ``pattern``
    (one element's bytes) if a memset can: a single repeated byte, or a repeated 4-byte
    word at a 4-byte aligned address. True if enqueued; False, with nothing enqueued,
    otherwise."""
    device = stream.device
    if pattern == pattern[:1] * len(pattern):
        device.make_current()
        device._driver.memset_d8_async(dst, pattern[0], nbytes, stream.handle)
        return True
    if len(pattern) in (4, 8) and pattern == pattern[:4] * (len(pattern) // 4) and dst % 4 == 0:
        device.make_current()
        word = int.from_bytes(pattern[:4], "little")
        device._driver.memset_d32_async(dst, word, nbytes // 4, stream.handle)
        return True
    return False
