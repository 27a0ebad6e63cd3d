"""End to end, texts through the Open Inference Protocol: tritonclient as users have it,
unchanged, sends a BYTES input ``text`` to a model exported with its own tokenizer; the
answers equal tokembed.v1's (Tokenize, EmbedText) and transformers' tokenizer; a bad BYTES
input is refused by name and nothing else is harmed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from tokembed.client import EmbeddingClient

from support.fixtures import TEXT_D

MODEL = "text"
STRINGS = ["hello world", "", "привет мир 😀", "the quick brown fox"]


def text_input(texts: list[str] | np.ndarray) -> tc.InferInput:
    """The texts (str, or an array of bytes objects) as tritonclient's BYTES input."""
    array = texts if isinstance(texts, np.ndarray) else _objects(texts)
    tensor = tc.InferInput("text", list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    return tensor


def _objects(texts: list[str]) -> np.ndarray:
    return np.array([text.encode() for text in texts], dtype=np.object_)


@pytest.fixture
def server(text_model_dir: Path, small_model_dir: Path, start_server: Any) -> Any:
    return start_server((text_model_dir, small_model_dir))


@pytest.fixture
def triton(server: Any) -> Any:
    with tc.InferenceServerClient(server.target) as client:
        yield client


def test_text_in_vectors_out_as_embed_text(server: Any, triton: Any) -> None:
    result = triton.infer(MODEL, [text_input(STRINGS)])
    with EmbeddingClient(server.target) as client:
        expected = client.embed_text(STRINGS)
    np.testing.assert_array_equal(result.as_numpy("hidden_states"), expected.hidden_states)
    np.testing.assert_array_equal(result.as_numpy("input_ids"), expected.input_ids)
    np.testing.assert_array_equal(result.as_numpy("lengths"), expected.lengths)
    assert result.as_numpy("hidden_states").shape == (int(expected.lengths.sum()), TEXT_D)


def test_requested_outputs_choose_tokenizing_or_vectors_and_their_dtype(
    server: Any, triton: Any
) -> None:
    with EmbeddingClient(server.target) as client:
        tokenized = client.tokenize(STRINGS, add_special_tokens=False)
        half = client.embed_text(STRINGS, "float16")
    outputs = [tc.InferRequestedOutput(name) for name in ("input_ids", "offsets",
                                                           "special_tokens_mask")]  # fmt: skip
    result = triton.infer(
        MODEL, [text_input(STRINGS)], outputs=outputs, parameters={"add_special_tokens": False}
    )
    assert result.as_numpy("hidden_states") is None and result.as_numpy("lengths") is None
    np.testing.assert_array_equal(result.as_numpy("input_ids"), tokenized.input_ids)
    np.testing.assert_array_equal(result.as_numpy("offsets"), tokenized.offsets)
    np.testing.assert_array_equal(
        result.as_numpy("special_tokens_mask").astype(bool), tokenized.special_tokens_mask
    )
    wanted = tc.InferRequestedOutput("hidden_states")
    result = triton.infer(
        MODEL, [text_input(STRINGS)], outputs=[wanted], parameters={"datatype": "FP16"}
    )
    assert result.as_numpy("input_ids") is None
    np.testing.assert_array_equal(result.as_numpy("hidden_states"), half.hidden_states)
    # Each ModelInfer is counted under the operation that served it.
    v2 = {"protocol": "v2", "method": "ModelInfer", "code": "OK"}
    for operation in ("tokenize", "embed_text"):
        labels = {**v2, "operation": operation}
        assert server.metric("tokembed_requests_total", labels) == 1, operation
    assert server.metric("tokembed_requests_total", {**v2, "operation": "embed"}) == 0


def test_metadata_and_config_describe_the_text_input(triton: Any) -> None:
    metadata = triton.get_model_metadata(MODEL, as_json=True)
    assert {"name": "text", "datatype": "BYTES", "shape": ["-1"]} in metadata["inputs"]
    names = [output["name"] for output in metadata["outputs"]]
    assert names == ["hidden_states", "input_ids", "lengths", "offsets", "special_tokens_mask",
                     "texts"]  # fmt: skip
    assert {"name": "texts", "datatype": "BYTES", "shape": ["-1"]} in metadata["outputs"]
    config = triton.get_model_config(MODEL).config
    assert [i.name for i in config.input] == ["input_ids", "text"]
    texts = [o for o in config.output if o.name == "texts"]
    assert len(texts) == 1 and texts[0].data_type == model_config_pb2.TYPE_STRING
    assert config.parameters["tokenizer"].string_value == "WordPiece"
    small = triton.get_model_metadata("small", as_json=True)
    assert [i["name"] for i in small["inputs"]] == ["input_ids"]


def test_a_bytes_input_of_the_wrong_shape_is_refused(server: Any, triton: Any) -> None:
    square = _objects(STRINGS).reshape(2, 2)
    with pytest.raises(InferenceServerException, match=r"input 'text' shape \[2, 2\] must be "
                       r"\[B\]: one text per element") as caught:  # fmt: skip
        triton.infer(MODEL, [text_input(square)])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    # A shape that says fewer texts than the content holds (tritonclient checks its own).
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[3])
    serialized = serialize_byte_tensor(_objects(STRINGS))
    request.raw_input_contents.append(serialized.item())
    with grpc.insecure_channel(server.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'text' holds 4 texts, but its shape [3] says 3" in str(refused.value.details())
    assert triton.infer(MODEL, [text_input(["still serving"])]).as_numpy("lengths").tolist()


def test_bad_texts_are_refused_by_name(server: Any, triton: Any) -> None:
    cases = [
        (np.array([b"ok", b"ab\xfe"], dtype=np.object_), r"texts\[1\] is not valid UTF-8"),
    ]
    for array, message in cases:
        with pytest.raises(InferenceServerException, match=message):
            triton.infer(MODEL, [text_input(array)])
    with pytest.raises(InferenceServerException, match="model 'small' has no tokenizer"):
        triton.infer("small", [text_input(["hello"])])
    with pytest.raises(InferenceServerException, match="over the model's limit"):
        triton.infer(MODEL, [text_input(["word " * 200])])
    result = triton.infer(MODEL, [text_input(["word " * 200])], parameters={"truncate": True})
    assert result.as_numpy("lengths").tolist() == [64]


def test_raw_bytes_that_are_not_bytes_elements_are_refused(server: Any) -> None:
    """A raw content whose length prefixes overrun it: refused naming the element."""
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(b"\x10\x00\x00\x00abc")
    with grpc.insecure_channel(server.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "element 0 claims 16 bytes, but 3 remain" in str(caught.value.details())
        typed = service_pb2.ModelInferRequest(model_name=MODEL)
        text = typed.inputs.add(name="text", datatype="BYTES", shape=[2])
        text.contents.bytes_contents.extend([b"hello", b"world"])
        answer = stub.ModelInfer(typed)
    assert [output.name for output in answer.outputs] == ["input_ids", "lengths", "hidden_states"]
