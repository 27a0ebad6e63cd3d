"""A gRPC call's deadline, read once for every gRPC front end (``core.deadlines`` decides
everything else about it)."""

from __future__ import annotations

import grpc

from tokembed.server.core import deadlines


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on ``core.deadlines``' clock (None: none)."""
    return deadlines.after(context.time_remaining())
