"""Device memory that does not come from an aiocuda pool, behind a ``DeviceArray``.

Foreign arrays (CuPy, PyTorch, Numba), managed allocations and memory imported from
another process are all "memory someone else gives back": an *owner* object whose
release (a library's deleter, a ``cuMemFree`` off the loop, a message to the exporting
process) must wait until the work aiocuda enqueued on the memory has completed.
:class:`OwnedBuffer` does exactly that: freed or collected, it hands the owner to its
last-use stream's ``hold``, and the owner goes once that stream's work so far is done.
Captured uses are the capture's to order and keep, as for a pool buffer: the graph keeps
the buffer, and so its owner, while it can replay (see ``aiocuda._graph.capture``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any

from .._util import exiting, invalid_value
from ..errors import CudaError
from ..stream import Stream, current_stream

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["OwnedBuffer"]

_after_lock = threading.Lock()
"""Guards the events an :class:`OwnedBuffer`'s release waits for as they are added."""


class OwnedBuffer:
    """Memory at ``ptr`` kept by ``owner``, seen through aiocuda (see the module docstring).

    Work on several streams is ordered as for pool buffers: a use on a new stream waits,
    on the GPU, for the previous stream, so the last-use stream comes after all of it.
    """

    __slots__ = ("__weakref__", "_finalizer", "_ptr", "_state", "_unusable", "device", "size")

    def __init__(self, ptr: int, size: int, device: Device, stream: Stream, owner: Any) -> None:
        self._ptr = ptr
        self.size = size
        self.device = device
        self._unusable: CudaError | None = None
        self._state = [stream, owner]  # then the events its release waits for (_free_after)
        self._finalizer = weakref.finalize(self, _hand_over, self._state)

    @property
    def ptr(self) -> int:
        """The address (raises once the memory was freed or lost)."""
        if self._unusable is not None:
            raise self._unusable
        return self._ptr

    @property
    def owner(self) -> Any:
        return self._state[1]

    @property
    def stream(self) -> Stream:
        """The stream of the last recorded use."""
        stream: Stream = self._state[0]
        return stream

    @property
    def freed(self) -> bool:
        return self._unusable is not None

    def _used_on(self, stream: Stream) -> None:
        """Record that work about to be enqueued on ``stream`` (same device) uses the memory:
        ordered after the work on the previous stream, as a pool buffer's uses are.

        Captured work is ordered by the capture, exactly as for a pool buffer (see
        ``aiocuda._graph.capture``): inside the graph, after the memory's previous captured
        use; the graph keeps the buffer (and so its owner) while it can replay, and each
        launch orders the replay after the memory's other work. The record of the last-use
        stream stays about the work outside the graph.
        """
        if self._unusable is not None:
            raise self._unusable
        state = self._state
        previous: Stream = state[0]
        if stream is previous:
            if stream._capture is not None:  # captured work (see aiocuda.graph): the capture orders it
                stream._capture.use(self, stream)
            return
        capture = stream._capture or previous._capture
        if capture is None:
            stream.wait(previous)
        else:  # a capture is involved: a capturing stream cannot wait for work outside it
            crossing = capture.crossing(self, previous, stream)
            if crossing is None:  # a captured use, ordered by the capture
                return
            stream.wait(crossing)  # the point before the capture: the captured work is the graph's
        state[0] = stream

    def _free_after(self, event: Any) -> None:
        """Release the owner only once ``event`` has completed, besides the work on the
        last-use stream (the end of another stream's use: a DLPack consumer's)."""
        state = self._state
        with _after_lock:  # (consumers' deleters may run on several threads)
            if len(state) >= 10:  # (an array exported over and over: keep the pending ones)
                state[2:] = [e for e in state[2:] if not e.query()]
            state.append(event)

    def free(self) -> None:
        """Let the memory go now: its owner is released once the work aiocuda enqueued
        on it has completed. Idempotent; the address raises afterwards."""
        if self._unusable is None:
            self._unusable = invalid_value("use of freed memory")
        self._finalizer()

    def lose(self, error: CudaError) -> None:
        """Mark the memory unusable for a reason other than a free (its exporter ended):
        the address raises ``error`` from now on."""
        self._unusable = error

    def __repr__(self) -> str:
        state = "freed" if self._unusable is not None else f"ptr={self._ptr:#x}"
        return f"<OwnedBuffer {state} size={self.size} owner={type(self._state[1]).__name__}>"


def _hand_over(state: list[Any]) -> None:
    stream, owner, *after = state
    state[1] = None
    if exiting():
        # Let go now, before the owner's library is torn down: the finalisers that ran
        # before this one at exit may have destroyed the events and streams a hold
        # would wait for (a wait for a destroyed event crashed the process).
        return
    capture = stream._capture
    if capture is not None:
        # Freed or collected while its last-use stream captures: a hold now would be
        # the graph's, dropped at once by a capture that fails while the stream's work
        # from before it may still use the memory. The capture releases the owner once
        # it has ended, as it frees a pool buffer let go meanwhile (Capture.releasing).
        # (A buffer captured work uses is kept by the graph: never collected meanwhile.)
        capture.releasing(functools.partial(_release, stream, owner, after))
        return
    _release(stream, owner, after)


def _release(stream: Stream, owner: Any, after: list[Any]) -> None:
    """Hold ``owner`` on ``stream``, after its work so far and the events ``after``."""
    with contextlib.suppress(Exception):  # the context is gone: nothing is in flight
        if after and stream.closed:
            # A closed stream takes no waits: the device's current stream keeps the
            # owner instead, after the closed stream's last work and the events.
            keeper = current_stream(stream.device)
            keeper.wait(stream)
            stream = keeper
        for event in after:
            stream.wait(event)
        stream.hold(owner)
