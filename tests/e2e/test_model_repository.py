"""A model repository in explicit mode, driven by tritonclient unchanged: the index (every
model on disk, each version's state and a failure's reason), load (a new version beside
the old, the version policy from the load's config, an unchanged model a no-op unless
forced), unload (requests refused with a clear status, ModelReady false), and what cannot
be honoured refused with a message naming it. Every answer equals one version's rows.

Through the real server (``--model-repository``, ``--model-control-mode explicit``), on
loopback with no control token (control is open there).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tritonclient_grpc
from tritonclient.utils import InferenceServerException

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_SEED, SMALL_V
from support.models import export_model_dir, reference_rows
from support.repository import (
    broken_graph,
    half_copied,
    hash_mismatch,
    put_version,
)
from support.server import ServerThread, wait_for

MODEL = "small"
V2_SEED = SMALL_SEED + 10


@pytest.fixture(scope="module")
def version_2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model_dir(
        tmp_path_factory.mktemp("repo-v2") / "model",
        vocab_size=SMALL_V, d_model=SMALL_D, seed=V2_SEED, padding_idx=SMALL_PAD,
        name=MODEL, version="2",
    )  # fmt: skip


@pytest.fixture(scope="module")
def rows(small_rows: np.ndarray) -> dict[str, np.ndarray]:
    return {"1": small_rows, "2": reference_rows(SMALL_V, SMALL_D, V2_SEED, SMALL_PAD)}


def start_repository(start_server: Any, repository: Path, **overrides: Any) -> ServerThread:
    server: ServerThread = start_server((), model_repository=repository, **overrides)
    return server


def infer(client: Any, ids: np.ndarray, version: str = "") -> tuple[str, np.ndarray]:
    from tritonclient.grpc import InferInput

    tensor = InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids.astype(np.int64))
    result = client.infer(MODEL, [tensor], model_version=version)
    return result.get_response().model_version, result.as_numpy("hidden_states")


def index(client: Any) -> list[tuple[str, str, str, str]]:
    return [(m.name, m.version, m.state, m.reason)
            for m in client.get_model_repository_index().models]  # fmt: skip


def loads(server: ServerThread, outcome: str) -> float:
    return server.metric("tokembed_model_loads_total", {"model": MODEL, "outcome": outcome})


IDS = np.array([[1, 2, 3], [7, 8, 9]])


def force_load(target: str, name: str) -> None:
    """RepositoryModelLoad with tokembed's ``force`` parameter (tritonclient has no
    keyword for it)."""
    import grpc
    from tritonclient.grpc import service_pb2

    request = service_pb2.RepositoryModelLoadRequest(model_name=name)
    request.parameters["force"].bool_param = True
    with grpc.insecure_channel(target) as channel:
        channel.unary_unary(
            "/inference.GRPCInferenceService/RepositoryModelLoad",
            request_serializer=service_pb2.RepositoryModelLoadRequest.SerializeToString,
            response_deserializer=service_pb2.RepositoryModelLoadResponse.FromString,
        )(request, timeout=30)


def test_tritonclient_drives_index_load_and_unload(
    tmp_path: Path, small_model_dir: Path, version_2_dir: Path, start_server: Any,
    rows: dict[str, np.ndarray],
) -> None:  # fmt: skip
    put_version(tmp_path, MODEL, 1, small_model_dir)
    server = start_repository(start_server, tmp_path)
    client = tritonclient_grpc.InferenceServerClient(server.target)
    # On disk, not loaded (explicit mode, no --load-model): listed, not served.
    assert index(client) == [(MODEL, "1", "UNAVAILABLE", "")]
    assert client.is_server_ready()
    with pytest.raises(InferenceServerException, match="not served"):
        infer(client, IDS)

    client.load_model(MODEL)
    assert index(client) == [(MODEL, "1", "READY", "")]
    assert client.is_model_ready(MODEL)
    version, hidden = infer(client, IDS)
    assert version == "1"
    np.testing.assert_array_equal(hidden, rows["1"][IDS])

    # Version 2 copied in: the load serves it (the latest one, the default policy) and
    # retires version 1.
    put_version(tmp_path, MODEL, 2, version_2_dir)
    client.load_model(MODEL)
    version, hidden = infer(client, IDS)
    assert version == "2"
    np.testing.assert_array_equal(hidden, rows["2"][IDS])
    assert wait_for(lambda: index(client)[0][2] == "UNAVAILABLE", 10), index(client)
    assert index(client) == [
        (MODEL, "1", "UNAVAILABLE", "not among the versions served (the latest 1)"),
        (MODEL, "2", "READY", ""),
    ]
    assert not client.is_model_ready(MODEL, "1")

    # The metrics say the same: each version's state, and requests by the version that
    # answered them.
    def state(version: str, name: str) -> float:
        return server.metric("tokembed_model_state", {"version": version, "state": name})

    assert (state("1", "UNAVAILABLE"), state("2", "READY"), state("1", "READY")) == (1, 1, 0)
    for version in ("1", "2"):
        answered = {"protocol": "v2", "code": "OK", "model": MODEL, "version": version}
        assert server.metric("tokembed_requests_total", answered) == 1
    assert server.metric("tokembed_model_unloads_total", {"version": "1"}) == 1

    # Loading the unchanged model again does nothing; forced, it loads again.
    loaded = loads(server, "loaded")
    client.load_model(MODEL)
    assert loads(server, "loaded") == loaded
    force_load(server.target, MODEL)
    assert loads(server, "loaded") == loaded + 1
    assert infer(client, IDS)[0] == "2"

    # The load's config sets the version policy: both versions, each by name.
    client.load_model(MODEL, config=json.dumps({"version_policy": {"all": {}}}))
    assert [entry[2] for entry in index(client)] == ["READY", "READY"]
    for name in ("1", "2"):
        version, hidden = infer(client, IDS, name)
        assert version == name
        np.testing.assert_array_equal(hidden, rows[name][IDS])
    assert infer(client, IDS)[0] == "2"  # naming none: the latest

    # Unloaded: refused with a clear status, not ready, the index says so.
    client.unload_model(MODEL)
    assert not client.is_model_ready(MODEL)
    with pytest.raises(InferenceServerException, match="is unloaded") as refused:
        infer(client, IDS)
    assert refused.value.status() == "StatusCode.NOT_FOUND"
    assert wait_for(lambda: all(e[2] == "UNAVAILABLE" for e in index(client)), 10)
    assert {entry[3] for entry in index(client)} == {"unloaded"}
    client.close()


def test_what_a_load_cannot_honour_is_refused_naming_it(
    tmp_path: Path, small_model_dir: Path, start_server: Any
) -> None:
    put_version(tmp_path, MODEL, 1, small_model_dir)
    server = start_repository(start_server, tmp_path, load_model=(MODEL,))
    client = tritonclient_grpc.InferenceServerClient(server.target)
    assert index(client) == [(MODEL, "1", "READY", "")]
    cases = [
        ({"files": {"file:1/model.onnx": b"weights"}}, "INVALID_ARGUMENT", "file contents"),
        ({"config": json.dumps({"max_batch_size": 8})}, "INVALID_ARGUMENT",
         "cannot override 'max_batch_size'"),
        ({"config": "{not json"}, "INVALID_ARGUMENT", "not valid JSON"),
        ({"config": json.dumps({"version_policy": {"latest": {"num_versions": 0}}})},
         "INVALID_ARGUMENT", "num_versions must be >= 1"),
        ({"config": json.dumps({"version_policy": {"specific": {"versions": [7]}}})},
         "FAILED_PRECONDITION", "no version to load"),
    ]  # fmt: skip
    for kwargs, status, words in cases:
        with pytest.raises(InferenceServerException) as refused:
            client.load_model(MODEL, **kwargs)
        assert refused.value.status() == f"StatusCode.{status}", (kwargs, refused.value)
        assert words in refused.value.message(), refused.value.message()
    with pytest.raises(InferenceServerException, match="no model 'other' in the repository"):
        client.load_model("other")
    with pytest.raises(InferenceServerException, match="'other' is not loaded"):
        client.unload_model("other")
    assert index(client) == [(MODEL, "1", "READY", "")]  # what served serves still
    client.close()


FAULTS = {
    "hash mismatch": (hash_mismatch, "sha256"),
    "half copied": (half_copied, "still being copied, or cut short"),
    "graph that does not load": (broken_graph, "model.onnx"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_load_leaves_what_serves_untouched_and_says_why(
    fault: str, tmp_path: Path, small_model_dir: Path, version_2_dir: Path,
    start_server: Any, rows: dict[str, np.ndarray],
) -> None:  # fmt: skip
    make, words = FAULTS[fault]
    put_version(tmp_path, MODEL, 1, small_model_dir)
    server = start_repository(start_server, tmp_path, load_model=(MODEL,))
    client = tritonclient_grpc.InferenceServerClient(server.target)
    make(tmp_path, MODEL, 2, version_2_dir)
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as failed:
        client.load_model(MODEL, client_timeout=30)
    assert time.monotonic() - started < 20  # an answer, not a time-out
    assert failed.value.status() == "StatusCode.FAILED_PRECONDITION"
    assert "version 2" in failed.value.message() and words in failed.value.message()
    (v1, v2) = index(client)
    assert v1 == (MODEL, "1", "READY", "")
    assert v2[:3] == (MODEL, "2", "UNAVAILABLE") and words in v2[3], v2
    version, hidden = infer(client, IDS)
    assert version == "1"
    np.testing.assert_array_equal(hidden, rows["1"][IDS])
    assert loads(server, "failed") >= 1
    client.close()


def test_the_memory_bound_refuses_a_load_with_the_figures_and_shares_identical_tables(
    tmp_path: Path, small_model_dir: Path, version_2_dir: Path, start_server: Any
) -> None:
    # The small model's tables: float32, float16 and bfloat16 rows (V x D x (4 + 2 + 2)).
    tables = SMALL_V * SMALL_D * 8
    put_version(tmp_path, MODEL, 1, small_model_dir)
    server = start_repository(
        start_server, tmp_path, load_model=(MODEL,), max_model_memory_bytes=tables + tables // 2
    )
    client = tritonclient_grpc.InferenceServerClient(server.target)
    # A second table beside the first (a swap holds both until the old one goes): over.
    put_version(tmp_path, MODEL, 2, version_2_dir)
    with pytest.raises(InferenceServerException) as refused:
        client.load_model(MODEL)
    assert refused.value.status() == "StatusCode.FAILED_PRECONDITION"
    over = tables + tables - (tables + tables // 2)
    assert (
        f"needs {tables} bytes of tables; {tables} are held by the models loaded, and "
        f"--max-model-memory-bytes is {tables + tables // 2} ({over} bytes over)"
    ) in refused.value.message()
    assert infer(client, IDS)[0] == "1"
    # A version whose files are those of one loaded shares its tables: within the bound.
    put_version(tmp_path, MODEL, 3, small_model_dir)
    client.load_model(
        MODEL, config=json.dumps({"version_policy": {"specific": {"versions": [1, 3]}}})
    )
    assert [(m[1], m[2]) for m in index(client) if m[2] == "READY"] == [
        ("1", "READY"),
        ("3", "READY"),
    ]
    client.close()
