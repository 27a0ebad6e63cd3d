"""``tokembed serve``: the command line of the server (heavy imports deferred)."""

from __future__ import annotations

import argparse
import os


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Settings imports nothing heavy; the server itself is imported in run().
    from tokembed.server.process.settings import Settings

    parser = subparsers.add_parser(
        "serve",
        help="serve a model directory over gRPC, with Prometheus metrics",
        description=(
            "Serve the embedding look-up over gRPC (tokembed.v1.EmbeddingService, health, "
            "reflection) with a dynamic batcher and Prometheus metrics. Every flag is also "
            "an environment variable TOKEMBED_<FLAG>; flags win."
        ),
    )
    Settings.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tokembed.server.observability.logs import configure_logging
    from tokembed.server.process.settings import Settings

    settings = Settings.from_args(args, os.environ)
    configure_logging(settings.log_level, settings.log_format)
    if settings.workers > 1:
        from tokembed.server.process.workers import run_workers

        return run_workers(settings)
    from tokembed.server.app import run as run_server

    return run_server(settings)
