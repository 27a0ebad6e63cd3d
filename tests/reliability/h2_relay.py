"""A TCP relay between one gRPC client connection and the server that can tell a test when
the server's HTTP/2 transport has read every request sent so far.

Why a relay: a test of calls that wait inside gRPC while the server's event loop is busy
needs to know that they have reached the server. Nothing in the server can say so (its
handlers, its metrics and its log all need the blocked loop), and gRPC has no public count
of calls it holds. HTTP/2 can: a server answers a PING once it has read every frame sent
before it on the connection, in order. The relay counts the requests whose last frame it
has passed on (a frame with END_STREAM from the client), then sends a PING of its own
after them and keeps its answer from the client. The bytes of the client and the server
go through unchanged; only 127.0.0.1 is used.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from types import TracebackType

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what a client sends before its first frame
FRAME_HEADER = 9  # length (3 bytes), type, flags, stream id (4 bytes)
DATA, HEADERS, PING = 0x0, 0x1, 0x6
END_STREAM = ACK = 0x1  # the flag of DATA and HEADERS frames; the flag of a PING's answer
PROBE = b"tokembed"  # this relay's PING payload (8 bytes, as a PING carries)


class H2Relay:
    """``with H2Relay(server_port) as relay``: connect a client to ``relay.target``."""

    def __init__(self, server_port: int) -> None:
        self._server_port = server_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._to_server: socket.socket | None = None
        self._send_lock = threading.Lock()  # one writer of frames to the server at a time
        self._changed = threading.Condition()
        self._requests = 0  # client requests whose last frame went to the server
        self._answered = False  # the server has answered this relay's PING
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def __enter__(self) -> H2Relay:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close every socket, which ends the relay's threads, and wait for them."""
        _close(self._listener)
        self._threads[0].join(10)  # the accepting thread: no socket is added after it
        for sock in self._sockets:
            _close(sock)
        for thread in self._threads[1:]:
            thread.join(10)

    def wait_requests(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` requests have been passed on to the server in full."""
        with self._changed:
            return self._changed.wait_for(lambda: self._requests >= count, timeout_s)

    def server_has_read_all(self, timeout_s: float) -> bool:
        """Send the server a PING after everything passed on so far; True once it answers,
        i.e. once its transport has read every request before it."""
        assert self._to_server is not None, "no client connected through the relay"
        header = len(PROBE).to_bytes(3, "big") + bytes([PING, 0]) + bytes(4)  # stream 0
        with self._send_lock:
            self._to_server.sendall(header + PROBE)
        with self._changed:
            return self._changed.wait_for(lambda: self._answered, timeout_s)

    # --- the relay's threads

    def _accept(self) -> None:
        """One client connection (then no more), relayed to a connection of its own."""
        try:
            client, _ = self._listener.accept()
        except OSError:  # closed before a client came
            return
        self._listener.close()
        self._sockets.append(client)
        try:
            server = socket.create_connection(("127.0.0.1", self._server_port))
        except OSError:  # the server is gone: the client sees its connection close
            return
        self._sockets.append(server)
        self._to_server = server
        for target in (self._upstream, self._downstream):
            thread = threading.Thread(target=target, args=(client, server), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _upstream(self, client: socket.socket, server: socket.socket) -> None:
        """Client to server: the preface, then frame by frame, counting requests."""
        for index, frame in enumerate(_frames(client, len(PREFACE))):
            with self._send_lock:
                if not _send(server, frame):
                    return
            if index > 0 and frame[3] in (DATA, HEADERS) and frame[4] & END_STREAM:
                with self._changed:
                    self._requests += 1
                    self._changed.notify_all()
        _shut(server)

    def _downstream(self, client: socket.socket, server: socket.socket) -> None:
        """Server to client: frame by frame, keeping the answer to this relay's PING."""
        for frame in _frames(server, 0):
            if frame[3] == PING and frame[4] & ACK and frame[FRAME_HEADER:] == PROBE:
                with self._changed:
                    self._answered = True
                    self._changed.notify_all()
                continue
            if not _send(client, frame):
                return
        _shut(client)


def _frames(source: socket.socket, preface_bytes: int) -> Iterator[bytes]:
    """The preface's bytes (if ``preface_bytes``), then each whole frame read from
    ``source``, until it closes."""
    buffer = b""
    while True:
        if preface_bytes and len(buffer) >= preface_bytes:
            yield buffer[:preface_bytes]
            buffer, preface_bytes = buffer[preface_bytes:], 0
        while not preface_bytes and len(buffer) >= FRAME_HEADER:
            end = FRAME_HEADER + int.from_bytes(buffer[:3], "big")
            if len(buffer) < end:
                break
            yield buffer[:end]
            buffer = buffer[end:]
        try:
            data = source.recv(65536)
        except OSError:
            return
        if not data:
            return
        buffer += data


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def _shut(sock: socket.socket) -> None:
    """Pass an end of stream on: the other side sees the connection close."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def _close(sock: socket.socket) -> None:
    # shutdown first: close() alone does not wake a thread blocked in accept() or recv().
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
