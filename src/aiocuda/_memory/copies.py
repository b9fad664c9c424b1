"""Every copy and memset aiocuda enqueues, in one place.

Two levels:

* Arrays: :func:`upload` and :func:`download` take a numpy array and decide, once for
  all of aiocuda, whether it can be copied directly: a pinned array is (the DMA is
  enqueued and the stream holds the array and its pinned owner until the DMA is done),
  a pageable one is not (they return False, enqueue nothing, and the caller stages it
  through :mod:`aiocuda._memory.staging`). Either side may be strided: the copy is then
  made of 2D/3D copies (:mod:`aiocuda._memory.strided` plans them). :func:`copy_strided`
  copies between two device layouts, on one device or between two, :func:`fill` sets a
  layout's elements with memsets.
* Addresses: :func:`enqueue_upload` and :func:`enqueue_download` enqueue one DMA
  between a pinned host address and device memory, for callers that keep the host
  memory alive themselves (staging slots, request lanes); :func:`copy_device` and
  :func:`copy_between` copy contiguous device memory.

Everything here only enqueues: nothing waits for the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from .._driver import PitchedCopy, PitchedSide
from .._util import byte_span, c_strides, invalid_value
from . import strided as _strided
from .pinned import host_address, pinned_ranges

if TYPE_CHECKING:
    from ..device import Device
    from ..stream import Stream

__all__ = [
    "Strided",
    "copy_between",
    "copy_device",
    "copy_strided",
    "download",
    "enqueue_download",
    "enqueue_upload",
    "fill",
    "gathers_span",
    "upload",
]


@dataclass(frozen=True, slots=True)
class Strided:
    """Where an array's elements lie: its first element's address, its byte strides, and
    the device whose memory holds it (None: page-locked host memory)."""

    address: int
    strides: tuple[int, ...]
    device: Device | None


def upload(
    dst: int,
    host: npt.NDArray[Any],
    stream: Stream,
    keep: list[Any] | None = None,
    *,
    strides: tuple[int, ...] | None = None,
) -> bool:
    """Enqueue the copy of ``host`` to the device layout at ``dst`` (its first element;
    byte ``strides``, default C-contiguous) on ``stream`` if ``host`` is pinned; True if
    enqueued. ``host`` may have any layout, but layouts walked in opposite directions
    (which would take one copy per row) are not copied: False.

    The array and its pinned memory are kept alive until the DMA is done: held by the
    stream, or appended to ``keep`` by a caller that keeps them until it has awaited the
    stream itself. False, with nothing enqueued, for pageable memory: stage it instead.
    An empty array needs no copy (True).
    """
    if strides is None and host.flags.c_contiguous:  # the common case: one DMA
        return _one_copy(host, dst, stream, keep, to_device=True)
    return _strided_copy(host, dst, strides, stream, keep, to_device=True)


def download(
    host: npt.NDArray[Any],
    src: int,
    stream: Stream,
    keep: list[Any] | None = None,
    *,
    strides: tuple[int, ...] | None = None,
) -> bool:
    """Enqueue the copy from the device layout at ``src`` (its first element; byte
    ``strides``, default C-contiguous) into ``host`` on ``stream`` if ``host`` is pinned;
    True if enqueued (``host`` holds the data once the stream has passed this point).
    ``host`` may have any layout, as for :func:`upload`.

    The array and its pinned memory are kept alive as by :func:`upload`. False, with
    nothing enqueued, for pageable memory: stage it instead. An empty array needs no copy
    (True).
    """
    if strides is None and host.flags.c_contiguous:  # the common case: one DMA
        return _one_copy(host, src, stream, keep, to_device=False)
    return _strided_copy(host, src, strides, stream, keep, to_device=False)


def _one_copy(
    host: npt.NDArray[Any],
    device_address: int,
    stream: Stream,
    keep: list[Any] | None,
    *,
    to_device: bool,
) -> bool:
    """:func:`upload` (``to_device``) or :func:`download` of a C-contiguous ``host``: the
    whole array in one DMA, whatever the strides of its axes of length 1."""
    # Every executor chunk's two copies come here. The general path (byte span, strides,
    # two layout descriptions, numpy's ctypes helper made twice) took 10.9 us of Python
    # per copy, this one 1.6 (the simulator, on a 2-core development machine).
    nbytes = host.nbytes
    if not nbytes:
        return True
    address = host_address(host)
    owner = pinned_ranges.owner(address, nbytes)
    if owner is None:
        return False
    if to_device:
        enqueue_upload(device_address, address, nbytes, stream)
    else:
        enqueue_download(address, device_address, nbytes, stream)
    _keep(stream, keep, owner, host)
    return True


def _strided_copy(
    host: npt.NDArray[Any],
    device_address: int,
    strides: tuple[int, ...] | None,
    stream: Stream,
    keep: list[Any] | None,
    *,
    to_device: bool,
) -> bool:
    """:func:`upload` (``to_device``) or :func:`download` of ``host`` in any layout,
    the device side at ``device_address`` with byte ``strides`` (default C-contiguous)."""
    if host.size == 0:
        return True
    owner = _pinned_owner(host)
    if owner is None:
        return False
    device_side = Strided(device_address, _device_strides(host, strides), stream.device)
    host_side = Strided(int(host.ctypes.data), host.strides, None)
    dst, src = (device_side, host_side) if to_device else (host_side, device_side)
    if not _copy(dst, src, host, stream):
        return False
    _keep(stream, keep, owner, host)
    return True


def _pinned_owner(host: npt.NDArray[Any]) -> Any:
    """The owner of the pinned memory under all of ``host``'s elements, or None."""
    lo, hi = byte_span(host.shape, host.strides, host.itemsize)
    return pinned_ranges.owner(int(host.ctypes.data) + lo, hi - lo)


def _device_strides(host: npt.NDArray[Any], strides: tuple[int, ...] | None) -> tuple[int, ...]:
    return c_strides(host.shape, host.itemsize) if strides is None else strides


_MAX_DIRECT_COPIES = 16
"""Most copies a pinned array's direct DMA may take; beyond, the caller stages it."""


def _copy(dst: Strided, src: Strided, host: npt.NDArray[Any], stream: Stream) -> bool:
    if host.flags.c_contiguous and dst.strides == src.strides:  # the common case: one DMA
        if dst.device is None:
            enqueue_download(dst.address, src.address, int(host.nbytes), stream)
        else:
            enqueue_upload(dst.address, src.address, int(host.nbytes), stream)
        return True
    plan = _strided.plan(host.shape, host.itemsize, dst.strides, src.strides)
    if plan.count > _MAX_DIRECT_COPIES:
        return False
    _enqueue_plan(plan, dst, src, stream)
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


def copy_strided(dst: Strided, src: Strided, shape: tuple[int, ...], itemsize: int, stream: Stream) -> None:
    """Enqueue the copy of the elements of ``shape`` from one layout to the other on
    ``stream``: as few 2D/3D copies as :func:`aiocuda._memory.strided.plan` finds, or 1D
    copies where a run is contiguous on both sides. Device sides must be reachable from
    ``stream``'s device, or be on two devices (a peer copy, which needs no peer access);
    host sides must be page-locked and kept alive by the caller.

    An axis walked forwards on one side and backwards on the other takes one copy per
    row along it: a DMA copy cannot reverse.
    """
    if dst.device is None and src.device is None:
        raise invalid_value("a copy between two host layouts is not a GPU copy")
    _enqueue_plan(_strided.plan(shape, itemsize, dst.strides, src.strides), dst, src, stream)


def _enqueue_plan(plan: _strided.Plan, dst: Strided, src: Strided, stream: Stream) -> None:
    device = stream.device
    device.make_current()
    if plan.layout.contiguous:
        for dst_offset, src_offset in plan.starts():
            _copy_run(dst, dst.address + dst_offset, src, src.address + src_offset, plan.layout.width, stream)
        return
    layout = plan.layout
    peer = dst.device is not None and src.device is not None and dst.device is not src.device
    dst_context = dst.device._context if peer and dst.device is not None else None
    src_context = src.device._context if peer and src.device is not None else None
    enqueue = device._driver.memcpy_pitched_async
    handle = stream.handle
    for dst_offset, src_offset in plan.starts():
        copy = PitchedCopy(
            PitchedSide(dst.address + dst_offset, layout.dst_pitch, layout.dst_rows, dst.device is None, dst_context),
            PitchedSide(src.address + src_offset, layout.src_pitch, layout.src_rows, src.device is None, src_context),
            layout.width,
            layout.height,
            layout.depth,
        )
        enqueue(copy, handle)


def _copy_run(dst: Strided, dst_address: int, src: Strided, src_address: int, nbytes: int, stream: Stream) -> None:
    """One contiguous run of a strided copy."""
    if dst.device is None:
        enqueue_download(dst_address, src_address, nbytes, stream)
    elif src.device is None:
        enqueue_upload(dst_address, src_address, nbytes, stream)
    else:
        copy_between(dst_address, dst.device, src_address, src.device, nbytes, stream)


_GATHER_BYTES_PER_COPY = 64 << 10
"""A strided download whose plan takes more than one copy per this many bytes the whole
span would copy in vain is cheaper gathered (see :func:`gathers_span`)."""

_NARROW_ROW = 32
"""Rows this narrow (bytes) make a DMA engine's 2D copy slow (see :func:`gathers_span`)."""


def gathers_span(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether reading the device layout ``shape``/``strides`` into a contiguous array
    is cheaper by copying its whole byte span and gathering the elements on the host
    than by a strided copy: for narrow rows in a span little larger than the elements
    (a colour channel of an image), and for plans of very many copies."""
    # A 2D copy moves each row as its own burst, so rows of a few bytes crawl while the
    # whole span goes at full bandwidth; and each copy costs a driver call (~2 us).
    lo, hi = byte_span(shape, strides, itemsize)
    nbytes = itemsize
    for n in shape:
        nbytes *= n
    plan = _strided.plan(shape, itemsize, c_strides(shape, itemsize), strides)
    wasted = hi - lo - nbytes
    if plan.count > max(1, wasted // _GATHER_BYTES_PER_COPY):
        return True
    return plan.layout.width < _NARROW_ROW and hi - lo <= 8 * nbytes


def cheaper_through_host(
    shape: tuple[int, ...], itemsize: int, dst_strides: tuple[int, ...], src_strides: tuple[int, ...]
) -> bool:
    """Whether a copy between two device layouts is cheaper through the host (one
    download, a reorder there, one upload) than as :func:`copy_strided` plans it: when
    the plan takes more than one driver copy per :data:`_GATHER_BYTES_PER_COPY` bytes of
    the elements (at least :data:`_MAX_DIRECT_COPIES`). An axis walked forwards on one
    side and backwards on the other takes a copy per row along it: a DMA cannot reverse."""
    plan = _strided.plan(shape, itemsize, dst_strides, src_strides)
    return plan.count > max(_MAX_DIRECT_COPIES, itemsize * math.prod(shape) // _GATHER_BYTES_PER_COPY)


def fill(dst: Strided, shape: tuple[int, ...], itemsize: int, pattern: bytes, stream: Stream) -> bool:
    """Enqueue memsets setting every element of the device layout ``dst`` to
    ``pattern`` (one element's bytes) if memsets can: the pattern repeats a 1, 2 or
    4-byte word, and (for 2 and 4) the layout's addresses and pitches are aligned to it.
    True if enqueued; False, with nothing enqueued, otherwise."""
    word = next(
        (k for k in (1, 2, 4) if itemsize % k == 0 and pattern == pattern[:k] * (itemsize // k)),
        0,
    )
    if not word:
        return False
    plan = _strided.plan(shape, itemsize, dst.strides, dst.strides)
    layout = plan.layout
    rows = [dst.address + offset for offset, _ in plan.starts()]
    if any(address % word for address in rows) or layout.dst_pitch % word:
        return False
    device = stream.device
    device.make_current()
    driver, handle = device._driver, stream.handle
    value = int.from_bytes(pattern[:word], "little")
    count = layout.width // word
    for address in rows:
        if layout.contiguous:
            memset = {1: driver.memset_d8_async, 2: driver.memset_d16_async, 4: driver.memset_d32_async}[word]
            memset(address, value, count, handle)
            continue
        for z in range(layout.depth):
            start = address + z * layout.dst_rows * layout.dst_pitch
            driver.memset_2d_async(start, layout.dst_pitch, value, word, count, layout.height, handle)
    return True
