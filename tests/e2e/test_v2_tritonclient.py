"""End to end, the Open Inference Protocol: the real server, tritonclient's synchronous gRPC
client (the real one users have), answers exact against the model's reference rows.

Every call tritonclient makes for these models is made here: the probes, the server's and
the model's metadata, the model's configuration, statistics, the repository index, and
inference in each form the protocol allows (raw and typed contents, INT64 and INT32 ids,
ragged input, FP16 answers, versions, ids echoed), with each error's status code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tokembed.client import EmbeddingClient

from support.fixtures import SMALL_D, SMALL_V

MODEL = "small"


def ids_input(ids: np.ndarray, name: str = "input_ids") -> tc.InferInput:
    tensor = tc.InferInput(name, list(ids.shape), "INT64" if ids.dtype == np.int64 else "INT32")
    tensor.set_data_from_numpy(ids)
    return tensor


@pytest.fixture
def server(small_model_dir: Path, start_server: Any) -> Any:
    return start_server(small_model_dir)


@pytest.fixture
def client(server: Any) -> Any:
    with tc.InferenceServerClient(server.target) as client:
        yield client


def test_probes_and_server_metadata(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert client.is_model_ready(MODEL, "1")
    metadata = client.get_server_metadata()
    assert metadata.name == "tokembed"
    assert "model_configuration" in metadata.extensions
    assert "statistics" in metadata.extensions


def test_model_metadata_describes_the_model(client: Any, small_model_dir: Path) -> None:
    metadata = client.get_model_metadata(MODEL, as_json=True)
    assert metadata["name"] == MODEL
    assert metadata["versions"] == ["1"]
    assert metadata["platform"] == "tokembed_table"  # the table backend serves it
    assert metadata["inputs"] == [{"name": "input_ids", "datatype": "INT64", "shape": ["-1", "-1"]}]
    assert metadata["outputs"] == [
        {"name": "hidden_states", "datatype": "FP32", "shape": ["-1", "-1", str(SMALL_D)]}
    ]


def test_model_config_names_backend_and_facts(client: Any, small_model_dir: Path) -> None:
    config = client.get_model_config(MODEL).config
    assert (config.name, config.backend, config.max_batch_size) == (MODEL, "table", 0)
    assert [(i.name, list(i.dims)) for i in config.input] == [("input_ids", [-1, -1])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("hidden_states", [-1, -1, 64])]
    facts = {key: value.string_value for key, value in config.parameters.items()}
    assert facts["vocab_size"] == str(SMALL_V)
    assert facts["d_model"] == str(SMALL_D)
    assert facts["padding_id"] == "0"
    assert facts["output_datatypes"].split(",")[:2] == ["FP32", "FP16"]
    assert not config.HasField("dynamic_batching")  # a table look-up does not batch


def test_onnxruntime_backend_is_described_as_onnx_with_dynamic_batching(
    small_model_dir: Path, start_server: Any
) -> None:
    server = start_server(small_model_dir, float32_table_max_bytes=0, max_delay_ms=2)
    with tc.InferenceServerClient(server.target) as client:
        assert client.get_model_metadata(MODEL).platform == "onnxruntime_onnx"
        config = client.get_model_config(MODEL).config
        assert config.backend == "onnxruntime"
        assert config.dynamic_batching.max_queue_delay_microseconds == 2000
        ids = np.array([[1, 2, 999]], dtype=np.int64)
        got = client.infer(MODEL, [ids_input(ids)]).as_numpy("hidden_states")
    np.testing.assert_array_equal(got, _rows()[ids])


def test_infer_is_exact_and_echoes_model_version_and_id(client: Any, small_rows: Any) -> None:
    ids = np.arange(24, dtype=np.int64).reshape(3, 8) * 41 % SMALL_V
    result = client.infer(
        MODEL, [ids_input(ids)], outputs=[tc.InferRequestedOutput("hidden_states")],
        request_id="req-7",
    )  # fmt: skip
    got = result.as_numpy("hidden_states")
    assert got.dtype == np.float32 and got.shape == (3, 8, SMALL_D)
    np.testing.assert_array_equal(got, small_rows[ids])
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (MODEL, "1", "req-7")


def test_int32_ids_and_the_version_named(client: Any, small_rows: Any) -> None:
    ids = np.array([[999, 0, 5]], dtype=np.int32)
    got = client.infer(MODEL, [ids_input(ids)], model_version="1").as_numpy("hidden_states")
    np.testing.assert_array_equal(got, small_rows[ids.astype(np.int64)])


def test_float16_asked_on_the_request_or_on_the_output(server: Any, small_rows: Any) -> None:
    ids = np.array([[3, 4, 5, 6]], dtype=np.int64)
    with tc.InferenceServerClient(server.target) as client:
        half = client.infer(MODEL, [ids_input(ids)], parameters={"datatype": "FP16"})
    assert half.get_output("hidden_states").datatype == "FP16"
    np.testing.assert_array_equal(
        half.as_numpy("hidden_states"), small_rows[ids].astype(np.float16)
    )
    # The requested output's own parameter, as V2 defines it (tritonclient has no setter
    # for it: the message is built with its generated classes and sent by its stub).
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
    request.raw_input_contents.append(ids.tobytes())
    output = request.outputs.add(name="hidden_states")
    output.parameters["datatype"].string_param = "FP16"
    with grpc.insecure_channel(server.target) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert tensor.name == "input_ids" and response.outputs[0].datatype == "FP16"
    got = np.frombuffer(response.raw_output_contents[0], np.float16).reshape(1, 4, SMALL_D)
    np.testing.assert_array_equal(got, small_rows[ids].astype(np.float16))


@pytest.mark.parametrize("datatype", ["INT64", "INT32"])
def test_typed_contents_instead_of_raw(server: Any, small_rows: Any, datatype: str) -> None:
    ids = np.array([[7, 8], [9, 999]])
    request = service_pb2.ModelInferRequest(model_name=MODEL, id="typed")
    tensor = request.inputs.add(name="input_ids", datatype=datatype, shape=[2, 2])
    if datatype == "INT64":
        tensor.contents.int64_contents.extend(ids.ravel().tolist())
    else:
        tensor.contents.int_contents.extend(ids.ravel().tolist())
    with grpc.insecure_channel(server.target) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    got = tc.InferResult(response).as_numpy("hidden_states")
    np.testing.assert_array_equal(got, small_rows[ids])
    assert response.id == "typed"


def test_ragged_input_padded_and_flat(client: Any, small_rows: Any) -> None:
    flat = np.array([1, 2, 3, 4, 5, 6], dtype=np.int64)
    lengths = np.array([3, 1, 2], dtype=np.int64)
    inputs = [ids_input(flat), ids_input(lengths, "lengths")]
    padded = client.infer(MODEL, inputs).as_numpy("hidden_states")
    assert padded.shape == (3, 3, SMALL_D)
    pad = small_rows[0]  # padding id 0's row fills each sequence's tail
    expected = np.stack([
        small_rows[[1, 2, 3]], np.stack([small_rows[4], pad, pad]), np.stack([small_rows[5],
        small_rows[6], pad]),
    ])  # fmt: skip
    np.testing.assert_array_equal(padded, expected)
    rows = client.infer(MODEL, inputs, parameters={"ragged_layout": "flat"}).as_numpy(
        "hidden_states"
    )
    np.testing.assert_array_equal(rows, small_rows[flat])


def test_repository_index_and_statistics(client: Any, small_rows: Any) -> None:
    index = client.get_model_repository_index(as_json=True)
    assert index["models"] == [{"name": MODEL, "version": "1", "state": "READY"}]
    ids = np.array([[1, 2]], dtype=np.int64)
    for _ in range(3):
        client.infer(MODEL, [ids_input(ids)])
    with pytest.raises(InferenceServerException):
        client.infer(MODEL, [ids_input(np.array([[SMALL_V]], dtype=np.int64))])
    stats = client.get_inference_statistics(MODEL).model_stats
    assert [s.name for s in stats] == [MODEL]
    inference = stats[0].inference_stats
    assert inference.success.count == 3 and inference.success.ns > 0
    assert inference.fail.count == 1
    assert inference.queue.count == 3
    assert stats[0].execution_count == 3  # the table looks each request up alone
    assert stats[0].last_inference > 0
    every = client.get_inference_statistics().model_stats
    assert [s.name for s in every] == [MODEL]


def _status(error: InferenceServerException) -> str:
    return str(error.status())


@pytest.mark.parametrize(
    ("ids", "model", "version", "status", "words"),
    [
        (np.array([[1, SMALL_V]]), MODEL, "", "INVALID_ARGUMENT", "input_ids[0,1] = 1000"),
        (np.array([[-1]]), MODEL, "", "INVALID_ARGUMENT", "outside the vocabulary"),
        (np.array([[1]]), "nope", "", "NOT_FOUND", "'nope' is not served"),
        (np.array([[1]]), MODEL, "9", "NOT_FOUND", "no version '9'"),
        (np.zeros((1, 5000), dtype=np.int64), MODEL, "", "RESOURCE_EXHAUSTED", "over the limit"),
    ],
)
def test_errors_have_the_status_v2_clients_expect(
    small_model_dir: Path, start_server: Any, ids: Any, model: str, version: str, status: str,
    words: str,
) -> None:  # fmt: skip
    server = start_server(small_model_dir, max_tokens_per_request=4096)
    with tc.InferenceServerClient(server.target) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.infer(model, [ids_input(ids.astype(np.int64))], model_version=version)
        assert _status(raised.value) == f"StatusCode.{status}"
        assert words in raised.value.message()
        if model != MODEL:
            with pytest.raises(InferenceServerException) as raised:
                client.is_model_ready(model)
            assert _status(raised.value) == "StatusCode.NOT_FOUND"
            with pytest.raises(InferenceServerException) as raised:
                client.get_model_metadata(model)
            assert _status(raised.value) == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda r: setattr(r.inputs[0], "datatype", "FP32"), "datatype FP32 is not supported"),
        (lambda r: setattr(r.inputs[0], "name", "ids"),
         "unexpected input 'ids': model 'small' (token kind) takes input_ids"),
        (lambda r: setattr(r.inputs[0], "name", "lengths"), "input input_ids is missing"),
        (lambda r: r.outputs.add(name="logits"), "unexpected inference output 'logits'"),
        (lambda r: r.raw_input_contents.append(b"\0" * 8), "2 raw_input_contents"),
        (lambda r: r.inputs[0].shape.__setitem__(1, 3), "data is 16 bytes, but shape [1, 3]"),
        (lambda r: r.parameters["datatype"].__setattr__("string_param", "FP64"),
         "datatype FP64 is not supported for hidden_states; ask for FP32 or FP16"),
    ],
)  # fmt: skip
def test_malformed_requests_are_invalid_arguments(server: Any, mutate: Any, words: str) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="input_ids", datatype="INT64", shape=[1, 2])
    request.raw_input_contents.append(np.array([1, 2], dtype=np.int64).tobytes())
    mutate(request)
    with grpc.insecure_channel(server.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request)
        # Bytes that are no ModelInferRequest at all are refused the same way.
        garbage = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as not_a_message:
            garbage(b"\xff\xff\xff")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in str(raised.value.details())
    assert not_a_message.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_metrics_name_the_protocol_and_v1_is_unaffected(server: Any, small_rows: Any) -> None:
    ids = np.array([[10, 11, 12]], dtype=np.int64)
    with tc.InferenceServerClient(server.target) as client:
        for _ in range(2):
            client.infer(MODEL, [ids_input(ids)])
        client.get_model_metadata(MODEL)
        with pytest.raises(InferenceServerException):
            client.infer(MODEL, [ids_input(np.array([[-5]], dtype=np.int64))])
    with EmbeddingClient(server.target) as v1:
        np.testing.assert_array_equal(v1.embed(ids), small_rows[ids])
    v2 = {"protocol": "v2", "model": MODEL}
    assert (
        server.metric("tokembed_requests_total", {**v2, "method": "ModelInfer", "code": "OK"}) == 2
    )
    assert (
        server.metric(
            "tokembed_requests_total",
            {**v2, "method": "ModelInfer", "operation": "embed", "code": "INVALID_ARGUMENT"},
        )
        == 1
    )
    assert (
        server.metric(
            "tokembed_requests_total",
            {**v2, "method": "ModelMetadata", "operation": "model_info", "code": "OK"},
        )
        == 1
    )
    v1_ok = {"protocol": "tokembed.v1", "method": "Embed", "code": "OK", "model": MODEL}
    assert server.metric("tokembed_requests_total", v1_ok) == 1
    # Series of both protocols exist from the start (at 0 until a call moves them).
    assert server.metric(
        "tokembed_request_duration_seconds_count", {**v2, "method": "ModelStreamInfer"}
    ) == 0  # fmt: skip


def _rows() -> np.ndarray:
    from support.fixtures import SMALL_PAD, SMALL_SEED
    from support.models import reference_rows

    return reference_rows(SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD)


def test_bearer_token_guards_the_v2_service(
    small_model_dir: Path, start_server: Any, tmp_path: Path, small_rows: Any
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    server = start_server(small_model_dir, auth_token_file=token_file)
    ids = np.array([[1, 2]], dtype=np.int64)
    with tc.InferenceServerClient(server.target) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.infer(MODEL, [ids_input(ids)])
        assert _status(raised.value) == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as raised:
            client.is_server_ready()
        assert _status(raised.value) == "StatusCode.UNAUTHENTICATED"
        headers = {"authorization": "Bearer s3cret"}
        assert client.is_server_ready(headers=headers)
        got = client.infer(MODEL, [ids_input(ids)], headers=headers).as_numpy("hidden_states")
    np.testing.assert_array_equal(got, small_rows[ids])
    refused = {"protocol": "v2", "method": "ModelInfer", "code": "UNAUTHENTICATED", "model": ""}
    assert server.metric("tokembed_requests_total", refused) == 1
    # A probe is no counted method: its refusal is counted as a rejection alone.
    assert server.metric("tokembed_rejections_total", {"reason": "unauthenticated"}) == 2
