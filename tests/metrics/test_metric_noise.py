"""What /metrics must not show: ``_created`` series, series that can never move, and a
refusal counted under another method than the caller's. Scraped over HTTP from the real
server, parsed with prometheus_client's own parser."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokembed.client import EmbeddingClient, ModelNotFoundError

from support.server import ServerThread


def _scrape(server: ServerThread) -> str:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode("utf-8"))


def _requests_series(text: str) -> dict[tuple[str, str, str], float]:
    """tokembed_requests_total by (method, code, model)."""
    series: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokembed_requests_total":
                labels = sample.labels
                series[(labels["method"], labels["code"], labels["model"])] = sample.value
    return series


@pytest.fixture
def server(small_model_dir: Path, start_server: Any) -> ServerThread:
    started: ServerThread = start_server(small_model_dir)
    return started


def test_no_created_series(server: ServerThread) -> None:
    with EmbeddingClient(server.target) as client:
        client.embed([[1, 2, 3]])
    text = _scrape(server)
    assert "tokembed_requests_total" in text
    assert [line for line in text.splitlines() if "_created" in line] == []


def test_only_series_that_can_move_start_at_zero(server: ServerThread) -> None:
    series = _requests_series(_scrape(server))
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
    series = _requests_series(_scrape(server))
    assert series[("Embed", "NOT_FOUND", "")] == 1
    assert series[("GetModelInfo", "NOT_FOUND", "")] == 0
