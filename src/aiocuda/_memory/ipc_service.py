"""The process's side of sharing device memory with other processes.

Both directions go through one daemon thread per process (started at first use, and
again in a forked child, which first closes its copy of the parent's sockets: else the
other processes would not see the parent's end), serving Unix sockets of type
``SOCK_SEQPACKET`` (one message per send, and an end of file when the other process
goes):

* **Exporting.** A listening socket in the abstract namespace (no file to clean up),
  named in every descriptor this process hands out. Each export -- an allocation of an
  IPC pool, the event marking the end of its producer's work, and a random token -- is
  *pinned*: the export keeps the buffer, so the memory cannot be freed, until it has
  been imported the number of times it was shared for and every import was released.
  An importer asks for an export by its token (``A``); the answer names the pool and,
  the first time this connection sees that pool, carries the pool's POSIX file
  descriptor (``SCM_RIGHTS``). ``R`` releases one import; ``U`` undoes one (a grant
  that came after its requester gave up: the export may be imported once more). A
  connection that ends releases everything it held: a process that dies lets go of its
  imports.
* **Importing.** One connection per exporting process, kept open: it carries the
  requests, and its end of file says that the exporter is gone. Then every buffer
  imported from it is marked lost, so using it raises
  :class:`~aiocuda.errors.ExporterLostError` instead of touching memory that process
  no longer owns, and once those imports have ended, the pools imported through the
  connection are destroyed. An import ends once its buffer is freed and the work on it
  is done: the pointer is freed (``cuMemFree``, off the loop) and ``R`` is sent -- in
  that order, since the driver requires the importer's free to complete before the
  exporter's.

Requests block the calling thread for one round trip (the caller runs them in a worker
thread, never on an event loop's thread), at most :data:`REPLY_TIMEOUT` seconds: an
exporter that does not answer in time fails that request, not its connection (answers
come in the order of the requests; a grant to a request given up is undone when it
comes). Only the service thread closes the sockets it watches. Messages are fixed byte
layouts, never pickles: any local process may connect, but only a token's holder gets
anything.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import selectors
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._util import PerProcess
from ..errors import ExporterLostError
from . import offloop as _offloop

if TYPE_CHECKING:
    from ..device import Device
    from ..memory import MemoryPool

__all__ = [
    "REPLY_TIMEOUT",
    "Connection",
    "Export",
    "GivenUp",
    "Import",
    "LocalUse",
    "Request",
    "Service",
    "Use",
    "service",
]

REPLY_TIMEOUT = 30.0
"""Seconds an import waits for the exporting process to answer before it fails with a
:class:`TimeoutError` (the exporter is not known to be gone: its connection stays)."""

TOKEN_BYTES = 32
POOL_KEY_BYTES = 16
_ACQUIRE, _RELEASE, _UNDO, _GRANTED, _REFUSED = b"A", b"R", b"U", b"K", b"N"


@dataclass
class Export:
    """One shared allocation, pinned in the exporting process (see the module docstring)."""

    token: bytes
    buffer: Any
    """The :class:`~aiocuda.memory.DeviceBuffer`: kept and pinned, so the memory stays
    allocated even if the producer frees the buffer meanwhile."""
    ptr: int
    """Its address (the buffer's own raises once the producer freed it)."""
    event: Any
    """The interprocess :class:`~aiocuda.event.Event` marking the end of the producer's work."""
    pool_key: bytes
    imports_left: int
    held: int = 0
    """Imports acquired and not yet released (this process's own too: :class:`LocalUse`)."""
    revoked: bool = False
    """No more imports, whatever is undone."""


@dataclass
class _Peer:
    """A connection from an importing process, as the exporter sees it."""

    sock: socket.socket
    pools_sent: set[bytes] = field(default_factory=set)
    held: collections.Counter[bytes] = field(default_factory=collections.Counter)


class GivenUp(Exception):
    """A :class:`Request` was given up (raised in the thread that made it, whose caller
    has gone)."""


class Request:
    """An importer's request for the export ``token`` names, waiting for the
    exporter's answer (:meth:`Connection.request`)."""

    __slots__ = ("abandoned", "connection", "data", "done", "given_up", "token")

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.done = threading.Event()
        self.data = b""
        self.connection: Connection | None = None
        """Where it is made (set first, under that connection's lock)."""
        self.given_up = False
        self.abandoned = False
        """(The connection's lock guards it.) Nobody waits for the answer any more: a
        grant that comes is undone at once, or goes to a new request for the same export."""

    def give_up(self) -> None:
        """Stop waiting for the answer (from any thread: a cancelled ``open_array``):
        the request raises :class:`GivenUp`, and a grant is undone when it comes. Once
        this returns, a new request for the export takes this one's place."""
        self.given_up = True
        connection = self.connection
        if connection is not None:  # else Connection.request sees given_up before sending
            with connection.lock:
                self.abandoned = not self.data
        self.done.set()


class Connection:
    """This process's connection to one exporting process."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.sock.connect(address)
        except OSError as exc:
            self.sock.close()
            raise ExporterLostError(
                f"the process that shared this memory cannot be reached ({exc}): it has ended", name="AIOCUDA_IPC_LOST"
            ) from None
        self.lock = threading.Lock()
        self.waiting: collections.deque[Request] = collections.deque()
        """Requests in the order they were sent, which is the order of the answers."""
        self.lost: ExporterLostError | None = None
        self.pools: dict[bytes, tuple[Any, Device]] = {}
        """Pools of the exporter imported into this process (handle, device), by the
        exporter's key; destroyed once the connection is lost and its imports ended."""
        self.pool_fds: dict[bytes, int] = {}
        """Descriptors of the exporter's pools received and not imported yet, by key:
        kept here, not by the request whose answer carried one, as that request may be
        given up, or another request for the same pool may get to the import first."""
        self.imports: weakref.WeakSet[Import] = weakref.WeakSet()

    def request(self, request: Request) -> bytes:
        """Acquire the export ``request`` names: the key of its pool (see
        :attr:`pool_fds`). A :class:`TimeoutError` after :data:`REPLY_TIMEOUT` seconds
        without an answer, :class:`GivenUp` once given up (a grant that comes later is
        undone). A request for an export whose last request was given up and not
        answered yet takes that one's place instead of asking again: the exporter may
        have only that import left, granted to the first request."""
        with self.lock:
            if self.lost is not None:
                raise self.lost
            request.connection = self
            if request.given_up:
                raise GivenUp
            for place, waiting in enumerate(self.waiting):
                if waiting.abandoned and waiting.token == request.token:
                    self.waiting[place] = request
                    break
            else:
                self.waiting.append(request)
                try:
                    self.sock.send(_ACQUIRE + request.token)
                except OSError as exc:
                    self.waiting.remove(request)
                    raise ExporterLostError(
                        f"the exporting process went away ({exc})", name="AIOCUDA_IPC_LOST"
                    ) from None
        request.done.wait(REPLY_TIMEOUT)
        with self.lock:
            if not request.data and self.lost is None:
                # Given up, or stopped or stalled (not known to be gone): this request
                # fails; the connection and what was imported through it stay.
                request.abandoned = True
                if request.given_up:
                    raise GivenUp
                raise TimeoutError(
                    f"the process that shared this memory did not answer within {REPLY_TIMEOUT:g} s "
                    "(stopped or stalled); nothing was imported"
                )
        if not request.data:
            assert self.lost is not None
            raise self.lost
        if request.data[:1] != _GRANTED:
            reason = request.data[1:].decode(errors="replace")
            raise ExporterLostError(f"the exporting process refused the import: {reason}", name="AIOCUDA_IPC_REFUSED")
        if request.given_up:  # granted as it was given up: nobody will use the import
            self.release(request.token, undo=True)
            raise GivenUp
        return request.data[1 : 1 + POOL_KEY_BYTES]

    def release(self, token: bytes, *, undo: bool = False) -> None:
        """Release one import of ``token``; with ``undo``, one never used, which the
        exporter counts as not made (nothing if the exporter is gone)."""
        with self.lock:
            self._release(token, undo)

    def _release(self, token: bytes, undo: bool) -> None:
        """(Lock held.)"""
        if self.lost is None:
            with contextlib.suppress(OSError):
                self.sock.send((_UNDO if undo else _RELEASE) + token)

    def answer(self, data: bytes, fds: list[int]) -> None:
        """The service thread received the exporter's next answer."""
        granted = data[:1] == _GRANTED
        with self.lock:
            key = data[1 : 1 + POOL_KEY_BYTES]
            if granted and fds and key not in self.pool_fds:  # the first grant of a pool carries it
                self.pool_fds[key] = fds.pop(0)
            request = self.waiting.popleft() if self.waiting else None
            if request is not None and not request.abandoned:
                request.data = data
                request.done.set()
            elif request is not None and granted:
                # Undone before the lock goes: nothing sent after the request left
                # ``waiting`` overtakes the undo.
                self._release(request.token, undo=True)
        for fd in fds:
            os.close(fd)

    def fail(self, error: ExporterLostError) -> None:
        """(The service thread, which has stopped watching the socket.) The exporter is
        gone: fail waiting requests, mark every import lost, close the socket."""
        with self.lock:
            if self.lost is not None:
                return
            self.lost = error
            waiting, self.waiting = self.waiting, collections.deque()
        for request in waiting:
            request.done.set()
        for imported in list(self.imports):
            imported.lose(error)
        with contextlib.suppress(OSError):
            self.sock.close()


class Import:
    """One allocation imported from another process, shared by every buffer this
    process opened over it (each through a :class:`Use`).

    Kept by the service while it is in use. When its last use ends, ending it is handed
    to the off-loop thread, which -- under the service's import lock, so that no new
    open can import the same allocation meanwhile -- frees the pointer if no new use
    came, and then releases the tokens of the uses that ended (see the module
    docstring): the free completes before the exporter hears of it."""

    def __init__(self, key: tuple[str, bytes], connection: Connection, device: Device, ptr: int) -> None:
        self.key = key
        self.connection = connection
        self.device = device
        self.ptr = ptr
        self.users = 0
        self.ended: list[bytes] = []
        """Tokens of uses that ended, to release once the pointer is freed (or kept)."""
        self.ending = False
        self.buffers: weakref.WeakSet[Any] = weakref.WeakSet()
        connection.imports.add(self)

    def lose(self, error: ExporterLostError) -> None:
        for buffer in list(self.buffers):
            buffer.lose(error)


class Use:
    """One open of a shared allocation: the owner of the buffer it gave (an
    :class:`~aiocuda._memory.buffers.OwnedBuffer`, which lets it go once the work on
    the buffer is done)."""

    def __init__(self, service: Service, imported: Import, token: bytes) -> None:
        self.imported = imported
        weakref.finalize(self, service._use_ended, imported, token).atexit = False


class LocalUse:
    """An open of an export by the exporting process itself: the owner of the buffer it
    gave (an :class:`~aiocuda._memory.buffers.OwnedBuffer` of its own over the export's
    memory, which lets it go once the work on the buffer is done). Until it goes, the
    export stays pinned, whatever the producer does with its own buffer."""

    def __init__(self, service: Service, export: Export) -> None:
        weakref.finalize(self, service._local_use_ended, export).atexit = False


class Service:
    """This process's sharing thread (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.address = f"\0aiocuda-ipc-{self.pid}-{secrets.token_hex(8)}"
        # Reentrant: a finaliser (a pool's, closing its descriptor) may run on a thread
        # that holds it.
        self._lock = threading.RLock()
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._todo: list[Callable[[], object]] = []
        self._listener: socket.socket | None = None
        self._exports: dict[bytes, Export] = {}
        self._pool_keys: weakref.WeakKeyDictionary[MemoryPool, bytes] = weakref.WeakKeyDictionary()
        self._pool_fds: dict[bytes, int] = {}
        self._connections: dict[str, Connection] = {}
        self._imports: dict[tuple[str, bytes], Import] = {}
        self._import_lock = threading.RLock()  # (reentrant for the same reason)
        self._thread = threading.Thread(target=self._serve, name="aiocuda-ipc", daemon=True)
        self._thread.start()
        _services.add(self)

    def _close_in_child(self) -> None:
        """(In a child forked from this service's process.) Close this copy of the
        parent's sockets and descriptors: kept open, they would hide the parent's end
        from the processes it shares with -- an importer would never learn that its
        exporter ended, an exporter never get back what a dead importer held -- and a
        finaliser here could speak for the parent. Closed only: a shutdown, or a change
        of the selector (the parent's epoll instance), would reach the parent."""
        # The locks may have been held by threads that do not exist here.
        self._lock = threading.RLock()
        self._import_lock = threading.RLock()
        connections = list(self._connections.values())
        sockets: list[object] = [key.fileobj for key in self._selector.get_map().values()]
        sockets += [self._wake_write, self._listener, *(connection.sock for connection in connections)]
        fds = list(self._pool_fds.values())
        self._pool_fds = {}
        for connection in connections:
            connection.lock = threading.Lock()
            fds += connection.pool_fds.values()
            connection.pool_fds = {}
        for sock in sockets:
            if isinstance(sock, socket.socket):
                sock.close()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._selector.close()

    # -- exporting ----------------------------------------------------------------------------
    def export(self, buffer: Any, event: Any, imports: int) -> Export:
        """Pin ``buffer`` (an allocation of an IPC pool) for ``imports`` imports."""
        pool = buffer.pool
        with self._lock:
            key = self._pool_keys.get(pool)
        if key is None:
            device = pool.device
            device.make_current()
            fd = device._driver.mempool_export_fd(pool.handle)
            with self._lock:
                key = self._pool_keys.get(pool)
                if key is None:
                    key = secrets.token_bytes(POOL_KEY_BYTES)
                    self._pool_keys[pool] = key
                    self._pool_fds[key] = fd
                    weakref.finalize(pool, self._forget_pool, key)
                    fd = -1
            if fd >= 0:
                os.close(fd)  # another thread exported the pool meanwhile
        self._listen()
        buffer._pin()
        export = Export(secrets.token_bytes(TOKEN_BYTES), buffer, int(buffer.ptr), event, key, imports)
        with self._lock:
            self._exports[export.token] = export
        return export

    def _forget_pool(self, key: bytes) -> None:
        """A pool is gone (and every export of it, which kept it): close its descriptor."""
        with self._lock:
            fd = self._pool_fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def take_local(self, token: bytes) -> tuple[Export, LocalUse] | None:
        """An import of ``token`` by this very process: the export and the use that
        holds it (held as another process's import is, until the use goes), or None if
        it is gone or used up."""
        with self._lock:
            export = self._exports.get(token)
            if export is None or export.imports_left <= 0:
                return None
            export.imports_left -= 1
            export.held += 1
        return export, LocalUse(self, export)

    def _local_use_ended(self, export: Export) -> None:
        """A :class:`LocalUse` went (a finaliser, on any thread)."""
        with self._lock:
            export.held -= 1
            self._settle(export)

    def revoke(self, token: bytes) -> None:
        """Stop waiting for imports of ``token`` not made yet."""
        with self._lock:
            export = self._exports.get(token)
            if export is not None:
                export.imports_left = 0
                export.revoked = True
                self._settle(export)

    def _settle(self, export: Export) -> None:
        """(Lock held.) Unpin an export nobody holds or will import any more; its buffer
        is unpinned (freed, if the producer freed it meanwhile) and let go with the event
        on the off-loop thread, where the device's context is bound."""
        if export.imports_left <= 0 and export.held <= 0 and self._exports.pop(export.token, None) is not None:
            buffer, event, export.buffer, export.event = export.buffer, export.event, None, None
            _offloop.dispose(buffer.device, buffer._unpin, keep=event)

    def _listen(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            listener.bind(self.address)
            listener.listen(64)
            listener.setblocking(False)
            self._listener = listener
        self._call_soon(lambda: self._selector.register(listener, selectors.EVENT_READ, "listen"))

    # -- importing ----------------------------------------------------------------------------
    def connection(self, address: str) -> Connection:
        """The connection to the exporter at ``address`` (made on first use)."""
        with self._lock:
            connection = self._connections.get(address)
            if connection is not None and connection.lost is None:
                return connection
        connection = Connection(address)
        with self._lock:
            self._connections[address] = connection
        self._call_soon(lambda: self._selector.register(connection.sock, selectors.EVENT_READ, connection))
        return connection

    def open_import(self, connection: Connection, pool_key: bytes, pointer: bytes, token: bytes, device: Device) -> Use:
        """A use of the allocation ``pointer`` names, importing the pool (from the
        descriptor the connection received) and the pointer the first time; ``token``
        is the export the exporter granted, released when the use ends."""
        driver = device._driver
        key = (connection.address, pointer)
        with self._import_lock:
            if connection.lost is not None:  # its pools are being let go (_let_go)
                raise connection.lost
            imported = self._imports.get(key)
            if imported is None:
                found = connection.pools.get(pool_key)
                if found is not None:
                    handle = found[0]
                else:
                    fd = connection.pool_fds.get(pool_key)
                    if fd is None:
                        raise ExporterLostError("the pool's descriptor did not arrive", name="AIOCUDA_IPC_REFUSED")
                    device.make_current()
                    handle = driver.mempool_import_fd(fd)
                    if not driver.mempool_get_access(handle, device.ordinal):  # as NVIDIA's IPC sample does
                        driver.mempool_set_access(handle, device.ordinal)
                    connection.pools[pool_key] = (handle, device)
                    with connection.lock:
                        del connection.pool_fds[pool_key]
                    os.close(fd)
                device.make_current()
                ptr = driver.mempool_import_pointer(handle, pointer)
                imported = self._imports[key] = Import(key, connection, device, ptr)
            imported.users += 1
            return Use(self, imported, token)

    def _use_ended(self, imported: Import, token: bytes) -> None:
        """A :class:`Use` went (a finaliser, on any thread)."""
        with self._import_lock:
            imported.users -= 1
            imported.ended.append(token)
            if imported.users or imported.ending:
                return
            imported.ending = True
        _offloop.submit(self._end_import, imported)

    def _end_import(self, imported: Import) -> None:
        """(The off-loop thread.) Free an import nobody uses, then release its tokens."""
        with self._import_lock:
            imported.ending = False
            tokens, imported.ended = imported.ended, []
            if not imported.users and self._imports.get(imported.key) is imported:
                del self._imports[imported.key]
                with contextlib.suppress(Exception):  # the exporter gone, the context poisoned...
                    imported.device.make_current()
                    imported.device._driver.mem_free(imported.ptr)
        for token in tokens:
            imported.connection.release(token)
        if imported.connection.lost is not None:
            self._let_go(imported.connection)

    def _let_go(self, connection: Connection) -> None:
        """(The off-loop thread.) Once a lost connection's imports have all ended,
        destroy the pools imported through it and close the descriptors it received
        and did not import."""
        with self._import_lock:
            if any(imported.connection is connection for imported in self._imports.values()):
                return  # the last one's end comes back here
            pools, connection.pools = connection.pools, {}
            fds, connection.pool_fds = list(connection.pool_fds.values()), {}
        for fd in fds:
            os.close(fd)
        for handle, device in pools.values():
            with contextlib.suppress(Exception):  # the context poisoned or gone: the pool went with it
                device.make_current()
                device._driver.mempool_destroy(handle)

    # -- the thread -----------------------------------------------------------------------------
    def _call_soon(self, fn: Callable[[], object]) -> None:
        with self._lock:
            self._todo.append(fn)
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")

    def _serve(self) -> None:
        while True:
            for key, _ in self._selector.select():
                with contextlib.suppress(Exception):  # one bad peer must not stop the service
                    self._ready(key)

    def _ready(self, key: selectors.SelectorKey) -> None:
        if key.data is None:  # woken: run what other threads queued
            self._wake_read.recv(4096)
            with self._lock:
                todo, self._todo = self._todo, []
            for fn in todo:
                fn()
        elif key.data == "listen":
            assert self._listener is not None
            sock, _ = self._listener.accept()
            sock.setblocking(True)
            self._selector.register(sock, selectors.EVENT_READ, _Peer(sock))
        elif isinstance(key.data, Connection):
            self._from_exporter(key.data)
        else:
            self._from_importer(key.data)

    def _from_exporter(self, connection: Connection) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(connection.sock, 256, 1)
        except OSError:
            data, fds = b"", []
        if data:
            connection.answer(data, fds)
            return
        self._selector.unregister(connection.sock)
        connection.fail(ExporterLostError("the process that shared this memory has ended", name="AIOCUDA_IPC_LOST"))
        with self._lock:
            if self._connections.get(connection.address) is connection:
                del self._connections[connection.address]
        _offloop.submit(self._let_go, connection)

    def _from_importer(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(256)
        except OSError:
            data = b""
        if not data:
            self._selector.unregister(peer.sock)
            peer.sock.close()
            with self._lock:
                for token, count in peer.held.items():
                    export = self._exports.get(token)
                    if export is not None:
                        export.held -= count
                        self._settle(export)
            return
        op, token = data[:1], data[1 : 1 + TOKEN_BYTES]
        if op in (_RELEASE, _UNDO):
            with self._lock:
                export = self._exports.get(token)
                if peer.held[token] > 0:
                    peer.held[token] -= 1
                    if export is not None:
                        export.held -= 1
                        if op == _UNDO and not export.revoked:
                            export.imports_left += 1
                        self._settle(export)
            return
        with self._lock:
            export = self._exports.get(token)
            if export is None or export.imports_left <= 0:
                reply, fd = _REFUSED + b"no such export, or every import it was shared for was made", None
            else:
                export.imports_left -= 1
                export.held += 1
                peer.held[token] += 1
                reply = _GRANTED + export.pool_key
                fd = None if export.pool_key in peer.pools_sent else self._pool_fds[export.pool_key]
                peer.pools_sent.add(export.pool_key)
        with contextlib.suppress(OSError):
            if fd is None:
                peer.sock.send(reply)
            else:
                socket.send_fds(peer.sock, [reply], [fd])


_services: weakref.WeakSet[Service] = weakref.WeakSet()
"""Every service of this process (tests make more than one)."""


def _after_fork_in_child() -> None:
    for sharing in list(_services):
        if sharing.pid != os.getpid():
            _services.discard(sharing)
            sharing._close_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

_service = PerProcess(Service)


def service() -> Service:
    """This process's sharing service (a new one after ``fork``)."""
    return _service.get()
