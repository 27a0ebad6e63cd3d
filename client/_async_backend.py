"""What the asyncio client does its own way: its channel (grpc.aio, opened in the running
event loop), sleeping, taking turns, and reading a stream's inputs.

client/aio.py and client/shared_memory_aio.py are written over these names;
scripts/gen_sync_client.py turns them into the blocking client, where the same names come
from ``_sync_backend``. Each name here has its blocking twin there, with the same meaning.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeAlias, TypeVar

import grpc

from tokembed.client._config import Settings
from tokembed.client._shared import Methods
from tokembed.client.errors import EmbeddingError

T = TypeVar("T")

sleep = asyncio.sleep
Lock = asyncio.Lock
# One attempt of a retried call, given its timeout.
Attempt: TypeAlias = Callable[[float | None], Awaitable[T]]
# A stream's inputs: an async iterable too.
Inputs: TypeAlias = Iterable[Any] | AsyncIterable[Any]


async def iterate(inputs: Inputs) -> AsyncIterator[Any]:
    if isinstance(inputs, AsyncIterable):
        async for item in inputs:
            yield item
    else:
        for item in inputs:
            yield item


class Connection:
    """The client's channel and its methods, opened on first use inside the running loop.

    A grpc.aio channel belongs to the loop it was created in, so one created in the
    client's ``__init__`` outside ``asyncio.run`` would fail with "attached to a different
    loop". A client therefore serves one event loop at a time (after that loop ends, the
    next one gets a new channel).
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._channel: Any = None  # grpc.aio.Channel
        self._methods: Methods | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def channel(self) -> Any:
        self.methods()
        return self._channel

    def methods(self) -> Methods:
        if self._methods is None or asyncio.get_running_loop() is not self._loop:
            self._methods = self._open()
        return self._methods

    async def close(self) -> None:
        channel, self._channel, self._methods = self._channel, None, None
        if channel is not None:
            await channel.close()

    def _open(self) -> Methods:
        loop = asyncio.get_running_loop()
        if self._channel is not None:
            if self._loop is not None and not self._loop.is_closed():
                raise EmbeddingError(
                    "an AsyncEmbeddingClient serves one event loop at a time, and the loop "
                    "it was first used in is still open; create one client per event loop"
                )
            # Its loop has ended (e.g. a second asyncio.run): that channel is unusable and
            # cannot be closed any more; open a new one in this loop.
            self._channel = None
        s = self._settings
        if s.credentials is not None:
            channel = grpc.aio.secure_channel(s.target, s.credentials, options=s.options)
        else:
            channel = grpc.aio.insecure_channel(s.target, options=s.options)
        self._channel, self._loop = channel, loop
        return Methods(channel)
