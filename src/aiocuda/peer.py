"""Peer access between devices, enabled only where the driver allows it and proven by a copy.

``cuDeviceCanAccessPeer`` can say yes for a pair whose link is misconfigured (IOMMU,
virtualisation, ACS settings) and copies then silently corrupt data or hang. So
:func:`enable_peer_access` enables access, grants the peer's memory pool to the device,
then copies a known pattern over the link and checks it before reporting success; where
the check fails or is interrupted, it takes back the access it enabled.

Peer copies (:func:`aiocuda.array.copy` between devices) work without peer access (the
driver stages them); peer access is what lets kernels on one device dereference the
other's memory and makes those copies direct.
"""

from __future__ import annotations

import numpy as np

from . import array as _array
from ._memory import copies
from .device import Device, _as_device
from .errors import CudaError, ResultCode
from .memory import MemoryPool
from .stream import Stream

__all__ = ["enable_peer_access"]

_PROBE_WORDS = 4096


async def enable_peer_access(device: Device | int, peer: Device | int) -> bool:
    """Let ``device`` access ``peer``'s memory, if ``cuDeviceCanAccessPeer`` allows it.

    Returns False (changing nothing) where the driver says the pair cannot be peers, and
    True once access is enabled -- for the context and for ``peer``'s default aiocuda
    pool -- and a real copy from ``peer`` to ``device`` over it returned the right bytes.
    Idempotent.

    Raises :class:`~aiocuda.errors.CudaError` if that check returns wrong data. Then, as
    when the check raises or is cancelled, the access this call enabled is disabled again
    (``cuCtxDisablePeerAccess``, and ``cuMemPoolSetAccess`` revoking the pool's grant);
    access that was on before the call stays on.
    """
    dev = _as_device(device)
    other = peer if isinstance(peer, Device) else Device(peer)
    if dev is other or not dev.can_access_peer(other):
        return False
    pool = MemoryPool.for_device(other)
    enabled = dev.enable_peer_access(other)
    granted = False
    try:
        granted = not pool.has_access(dev)
        if granted:
            pool.grant_access(dev)
        await _check_link(dev, other)
    except BaseException:
        # The undo makes the same two driver calls as the enable, on the loop as those
        # did; it does not wait for a cancelled check's copy: on a link that hangs, that
        # copy never ends. The pool first: its grant rests on the context's access.
        try:
            if granted:
                pool.revoke_access(dev)
        finally:
            if enabled:
                dev.disable_peer_access(other)
        raise
    return True


async def _check_link(dev: Device, other: Device) -> None:
    """Copy a known pattern from ``other`` to ``dev`` over the link; CudaError if it
    arrives changed."""
    pattern = np.arange(_PROBE_WORDS, dtype=np.uint32) * np.uint32(2654435761)
    with Stream(other) as peer_stream, Stream(dev) as stream:
        source = await _array.to_device(pattern, stream=peer_stream)
        target = _array.empty(_PROBE_WORDS, np.uint32, stream=stream)
        stream.wait(peer_stream)
        copies.copy_device(target.ptr, source.ptr, pattern.nbytes, stream)  # over the link: no peer copy
        peer_stream.wait(stream)
        source.buffer.free()  # on its own device's stream, ordered after the copy
        result = await target.to_host(stream=stream)
        target.buffer.free()
    if not np.array_equal(result, pattern):
        raise CudaError(
            f"peer access from device {dev.ordinal} to device {other.ordinal} is enabled but a copy over "
            "it returned wrong data: do not use this pair as peers (check IOMMU/ACS settings)",
            code=ResultCode.PEER_ACCESS_UNSUPPORTED,
            name="CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        )
