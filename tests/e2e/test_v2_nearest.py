"""nearest on the Open Inference Protocol, through tritonclient unchanged: a model with a
head is also served as ``NAME.nearest`` (``edge/v2/nearest.py``), described by
ModelMetadata and ModelConfig, ready, and answering ModelInfer with the outputs ``ids``,
``scores`` (and ``logits`` when requested) equal to tokembed.v1's Nearest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from tokembed.client import EmbeddingClient
from tokembed.export.head import add_head

from support.models import export_model_dir

V, D = 500, 32


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = export_model_dir(
        tmp_path_factory.mktemp("v2-nearest") / "m", vocab_size=V, d_model=D, seed=4, name="m"
    )
    add_head(directory, output_table=None, output_key=None, norm=None)
    return directory


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model_dir(
        tmp_path_factory.mktemp("v2-plain") / "p", vocab_size=V, d_model=D, name="plain"
    )


def _inputs(vectors: np.ndarray, k: int | None, datatype: str = "FP32") -> list[Any]:
    tensor = tc.InferInput("vectors", list(vectors.shape), datatype)
    tensor.set_data_from_numpy(vectors)
    inputs = [tensor]
    if k is not None:
        count = tc.InferInput("k", [1], "INT64")
        count.set_data_from_numpy(np.array([k], dtype=np.int64))
        inputs.append(count)
    return inputs


def test_tritonclient_reaches_nearest(tied: Path, plain: Path, start_server: Any) -> None:
    server = start_server((tied, plain))
    h = np.random.default_rng(8).standard_normal((6, D)).astype(np.float32)
    with tc.InferenceServerClient(server.target) as client:
        assert client.is_model_ready("m.nearest")
        assert not client.is_model_ready("plain.nearest")
        metadata = client.get_model_metadata("m.nearest", as_json=True)
        assert [i["name"] for i in metadata["inputs"]] == ["vectors", "k"]
        assert [o["name"] for o in metadata["outputs"]] == ["ids", "scores", "logits"]
        assert metadata["inputs"][0]["shape"] == ["-1", str(D)]
        config = client.get_model_config("m.nearest", as_json=True)["config"]
        assert config["parameters"]["table"]["string_value"] == "embedding"
        assert config["parameters"]["max_k"]["string_value"] == str(V)

        outputs = [tc.InferRequestedOutput(name) for name in ("ids", "scores", "logits")]
        result = client.infer("m.nearest", _inputs(h, 4), outputs=outputs)
        cosine = client.infer(
            "m.nearest", _inputs(h, 2), parameters={"metric": "cosine"}, request_id="c1"
        )
        with pytest.raises(InferenceServerException) as no_head:
            client.infer("plain.nearest", _inputs(h, 1))
        with pytest.raises(InferenceServerException) as zero:
            client.infer("m.nearest", _inputs(h, 0))
        with pytest.raises(InferenceServerException) as narrow:
            client.infer("m.nearest", _inputs(h[:, :5].copy(), 1))
    with EmbeddingClient(server.target) as v1:
        want = v1.nearest(h, k=4, logits=True, model="m")
        want_cosine = v1.nearest(h, k=2, metric="cosine", model="m")
    np.testing.assert_array_equal(result.as_numpy("ids"), want.ids)
    np.testing.assert_array_equal(result.as_numpy("scores"), want.scores)
    np.testing.assert_array_equal(result.as_numpy("logits"), want.logits)
    np.testing.assert_array_equal(cosine.as_numpy("ids"), want_cosine.ids)
    assert cosine.as_numpy("logits") is None and cosine.get_response().id == "c1"
    assert no_head.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "model 'plain' cannot answer nearest" in no_head.value.message()
    assert "k = 0 is outside [1, 500]" in zero.value.message()
    assert "has D = 5, but model 'm' has d_model 32" in narrow.value.message()


def test_half_precision_vectors_and_refusals(tied: Path, start_server: Any) -> None:
    server = start_server(tied)
    h = np.random.default_rng(9).standard_normal((3, D)).astype(np.float16)
    with tc.InferenceServerClient(server.target) as client:
        result = client.infer("m.nearest", _inputs(h, 3, "FP16"))
        with pytest.raises(InferenceServerException) as wrong_output:
            client.infer("m.nearest", _inputs(h, 3, "FP16"),
                         outputs=[tc.InferRequestedOutput("hidden_states")])  # fmt: skip
        with pytest.raises(InferenceServerException) as ints:
            client.infer("m.nearest", _inputs(np.zeros((1, D), np.int32), 1, "INT32"))
    with EmbeddingClient(server.target) as v1:
        want = v1.nearest(h, k=3)
    np.testing.assert_array_equal(result.as_numpy("ids"), want.ids)
    assert "unexpected output 'hidden_states'" in wrong_output.value.message()
    assert "input 'vectors' datatype INT32 is not supported" in ints.value.message()
