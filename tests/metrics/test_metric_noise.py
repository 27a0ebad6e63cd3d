"""What /metrics must not show: ``_created`` series, series that can never move, and a
refusal counted under another method than the caller's. Scraped over HTTP from the real
server, parsed with prometheus_client's own parser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokembed.client import EmbeddingClient, ModelNotFoundError

from support.metrics import matching, scrape
from support.server import ServerThread


def _requests_series(text: str) -> dict[tuple[str, str, str], float]:
    """tokembed_requests_total by (method, code, model)."""
    return {
        (s.labels["method"], s.labels["code"], s.labels["model"]): s.value
        for s in matching(text, "tokembed_requests_total")
    }


@pytest.fixture
def server(small_model_dir: Path, start_server: Any) -> ServerThread:
    started: ServerThread = start_server(small_model_dir)
    return started


def test_no_created_series(server: ServerThread) -> None:
    with EmbeddingClient(server.target) as client:
        client.embed([[1, 2, 3]])
    text = scrape(server.metrics_port)
    assert "tokembed_requests_total" in text
    assert [line for line in text.splitlines() if "_created" in line] == []


def test_only_series_that_can_move_start_at_zero(server: ServerThread) -> None:
    series = _requests_series(scrape(server.metrics_port))
    # A served call always names its model; a listing never does; a model's info is
    # answered or refused before a model is found.
    assert ("Embed", "OK", "") not in series
    assert ("EmbedChunked", "OK", "") not in series
    assert ("ListModels", "OK", "") in series and ("ListModels", "OK", "small") not in series
    assert ("GetModelInfo", "OK", "small") in series
    assert ("GetModelInfo", "INVALID_ARGUMENT", "small") not in series
    assert ("Embed", "NOT_FOUND", "small") not in series
    # What can happen is there from the start, at 0.
    assert series[("Embed", "OK", "small")] == 0
    assert series[("Embed", "INVALID_ARGUMENT", "small")] == 0
    assert series[("Embed", "NOT_FOUND", "")] == 0
    assert series[("Embed", "UNAVAILABLE", "")] == 0


def test_an_embed_naming_an_unknown_model_is_counted_as_the_embed_it_was(
    server: ServerThread,
) -> None:
    with EmbeddingClient(server.target) as client, pytest.raises(ModelNotFoundError):
        client.embed([[1, 2, 3]], model="nope")
    series = _requests_series(scrape(server.metrics_port))
    assert series[("Embed", "NOT_FOUND", "")] == 1
    assert series[("GetModelInfo", "NOT_FOUND", "")] == 0
