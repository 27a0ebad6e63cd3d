"""``/metrics`` on a port of its own."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

# How often the /metrics thread looks for a stop request: prometheus_client's own
# start_http_server polls every 0.5 s, which every drain (and every test's server stop)
# then waited for.
METRICS_STOP_POLL_S = 0.05


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not news: log none of them."""


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[Callable[[], None], int]:
    """Serve ``/metrics`` on its own port; return (stop, bound port). As
    prometheus_client's start_http_server, but stopped within METRICS_STOP_POLL_S."""
    family, *_, where = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingWSGIServer):
        address_family = family  # IPv6 hosts too

    httpd = make_server(
        str(where[0]), port, make_wsgi_app(registry), Server, handler_class=_QuietHandler
    )
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": METRICS_STOP_POLL_S},
        name="tokembed-metrics", daemon=True,
    )  # fmt: skip
    thread.start()

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        if thread is not threading.current_thread():
            thread.join(timeout=5)

    return stop, int(httpd.server_port)
