"""Fixtures for the client's tests: fake servers on loopback (see client_fakes.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from client_fakes import FakeServer, FakeService, start_fake_server


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = start_fake_server()
    yield server
    server.stop()


@pytest.fixture
def fake_factory() -> Iterator[Callable[..., FakeServer]]:
    started: list[FakeServer] = []

    def make(service: FakeService | None = None, **kwargs: Any) -> FakeServer:
        server = start_fake_server(service, **kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
