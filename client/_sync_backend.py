"""What the blocking client does its own way: its channel, sleeping, taking turns, and
reading a stream's inputs; the twin of ``_async_backend``, name for name (the blocking
client is generated from the asyncio one, with this module in place of that one)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeAlias, TypeVar

import grpc

from tokembed.client._config import Settings
from tokembed.client._shared import Methods

T = TypeVar("T")

sleep = time.sleep
Lock = threading.Lock
# One attempt of a retried call, given its timeout.
Attempt: TypeAlias = Callable[[float | None], T]
# A stream's inputs, consumed by a gRPC thread.
Inputs: TypeAlias = Iterable[Any]


def iterate(inputs: Inputs) -> Iterator[Any]:
    return iter(inputs)


class Connection:
    """The client's channel and its methods, opened at once: a blocking channel serves
    any thread (one channel, HTTP/2-multiplexed, for all of them)."""

    def __init__(self, settings: Settings) -> None:
        if settings.credentials is not None:
            channel = grpc.secure_channel(
                settings.target, settings.credentials, options=settings.options
            )
        else:
            channel = grpc.insecure_channel(settings.target, options=settings.options)
        self._channel: grpc.Channel | None = channel
        self._methods = Methods(channel)

    def channel(self) -> Any:
        return self._channel

    def methods(self) -> Methods:
        return self._methods

    def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
