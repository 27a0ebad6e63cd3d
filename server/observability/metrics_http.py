"""``/metrics`` on a port of its own: that path alone (404 for any other, so that an HTTP
probe pointed here by mistake fails rather than passes), a read timeout, and a bounded
number of connections, so that idle connections cannot pile up threads or keep a scrape
out.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

# How often the /metrics thread looks for a stop request: prometheus_client's own
# start_http_server polls every 0.5 s, which every drain (and every test's server stop)
# then waited for.
METRICS_STOP_POLL_S = 0.05
# A connection that sends nothing (or stops reading the answer) for this long is closed;
# Prometheus sends its request at once.
METRICS_READ_TIMEOUT_S = 5.0
# Connections kept at once, each on a thread of its own. A new connection past it closes
# the oldest one that has not sent a whole request yet, so that idle connections never
# keep a scrape out.
METRICS_MAX_CONNECTIONS = 64
METRICS_PATH = "/metrics"


class _Connections:
    """The connections being served, and which of them still wait for their request."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, None] = {}  # in arrival order: oldest first
        self._answering: set[socket.socket] = set()

    def admit(self, connection: socket.socket) -> bool:
        """Take ``connection`` in, closing the oldest waiting one when at the limit;
        False when every connection kept is being answered (``connection`` is refused)."""
        with self._lock:
            if len(self._waiting) + len(self._answering) >= self._limit:
                if not self._waiting:
                    return False
                oldest = next(iter(self._waiting))
                del self._waiting[oldest]
                _hang_up(oldest)  # its thread's read returns at once, and the thread ends
            self._waiting[connection] = None
            return True

    def answering(self, connection: socket.socket) -> None:
        with self._lock:
            if connection in self._waiting:  # else it was closed to make room
                del self._waiting[connection]
                self._answering.add(connection)

    def done(self, connection: socket.socket) -> None:
        with self._lock:
            self._waiting.pop(connection, None)
            self._answering.discard(connection)

    def hang_up_all(self) -> None:
        with self._lock:
            for connection in (*self._waiting, *self._answering):
                _hang_up(connection)


def _hang_up(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already gone
        connection.shutdown(socket.SHUT_RDWR)


class _Server(ThreadingWSGIServer):
    connections: _Connections
    # socketserver's default backlog (5) drops the connections that arrive in a burst
    # faster than they are accepted, and their clients retry only a second later.
    request_queue_size = socket.SOMAXCONN

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.connections.admit(request):
            super().process_request(request, client_address)
        else:
            super().shutdown_request(request)

    def shutdown_request(self, request: Any) -> None:
        self.connections.done(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or was closed is not news; anything else is."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(WSGIRequestHandler):
    timeout = METRICS_READ_TIMEOUT_S

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:
            server = self.server
            assert isinstance(server, _Server), "This is a bug."
            server.connections.answering(self.connection)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not news: log none of them."""


def _metrics_only(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"not found: this port serves {METRICS_PATH} only\n".encode()]
        return app(environ, start_response)

    return serve


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[Callable[[], None], int]:
    """Serve ``/metrics`` on its own port; return (stop, bound port). As
    prometheus_client's start_http_server, but stopped within METRICS_STOP_POLL_S."""
    family, *_, where = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    connections = _Connections(METRICS_MAX_CONNECTIONS)

    class Server(_Server):
        address_family = family  # IPv6 hosts too

    Server.connections = connections

    httpd = make_server(
        str(where[0]), port, _metrics_only(make_wsgi_app(registry)), Server, handler_class=_Handler
    )
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": METRICS_STOP_POLL_S},
        name="tokembed-metrics", daemon=True,
    )  # fmt: skip
    thread.start()

    def stop() -> None:
        httpd.shutdown()
        connections.hang_up_all()
        httpd.server_close()
        if thread is not threading.current_thread():
            thread.join(timeout=5)

    return stop, int(httpd.server_port)
