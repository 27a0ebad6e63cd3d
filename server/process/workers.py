"""``--workers N``: N server processes sharing one port through SO_REUSEPORT.

The kernel spreads new connections over the processes, so a machine with more cores
than one Python process can use serves more. gRPC keeps connections open, so each
client connection sticks to one worker: spreading needs many connections (many
clients, or a client pool). Each worker exposes its own metrics on metrics_port + i.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from types import FrameType

from tokembed.server.process.settings import Settings

logger = logging.getLogger(__name__)


def _worker_main(settings: Settings, index: int) -> None:
    from tokembed.server.app import run
    from tokembed.server.observability.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    logging.getLogger(__name__).info("worker %d starting", index)
    run(settings)


def run_workers(settings: Settings) -> int:
    if not settings.model_dir and settings.model_repository is None:
        # Create the default model once, here, not N times in a race.
        from tokembed.server.models.default_model import ensure_default_model

        settings = settings.replace(model_dir=ensure_default_model(settings.default_model_dir))
    context = multiprocessing.get_context("spawn")
    processes = []
    for index in range(settings.workers):
        metrics_port = settings.metrics_port
        if metrics_port > 0:
            metrics_port += index
        worker_settings = settings.replace(metrics_port=metrics_port)
        process = context.Process(
            target=_worker_main, args=(worker_settings, index), name=f"tokembed-worker-{index}"
        )
        process.start()
        processes.append(process)
    logger.info("started %d workers on port %d", len(processes), settings.port)

    def forward(signum: int, frame: FrameType | None) -> None:
        for process in processes:
            if process.pid is not None and process.is_alive():
                process.terminate() if signum == signal.SIGTERM else _interrupt(process.pid)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for process in processes:
        process.join()
    codes = [process.exitcode or 0 for process in processes]
    return max(codes)


def _interrupt(pid: int) -> None:
    import os

    os.kill(pid, signal.SIGINT)
