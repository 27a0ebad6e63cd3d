"""End to end, with tritonclient unchanged: texts through ModelStreamInfer as through
ModelInfer (answers in order, each equal to ModelInfer's; a bad one answered with its
error while the stream goes on; texts from a shared-memory region too, answers in the
stream), and detokenizing through ModelInfer and the stream: ids in (``input_ids``
``[B, S]``, or ``[N]`` with ``lengths``), the requested output ``texts`` (BYTES ``[B]``)
out, equal to tokembed.v1's Detokenize and to the tokenizer's own decode; bad ids and
bad requests refused by name."""

from __future__ import annotations

import queue
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from tokembed.client import EmbeddingClient

from support.fixtures import TEXT_V
from support.shared_memory import SHM_ROOT, made_regions, serve

MODEL = "text"
STRINGS = ["hello world", "", "привет мир 😀", "the quick brown fox jumps"]
TIMEOUT_S = 30


@pytest.fixture
def prefix() -> str:
    return f"tokembeds{secrets.token_hex(4)}"


@pytest.fixture
def server(text_model_dir: Path, small_model_dir: Path, start_server: Any, prefix: str) -> Any:
    return serve(start_server, (text_model_dir, small_model_dir), prefix)


@pytest.fixture
def triton(server: Any) -> Iterator[tc.InferenceServerClient]:
    with tc.InferenceServerClient(server.target) as client:
        yield client


def text_input(texts: list[bytes]) -> tc.InferInput:
    tensor = tc.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=np.object_))
    return tensor


def ids_input(ids: np.ndarray, name: str = "input_ids") -> tc.InferInput:
    tensor = tc.InferInput(name, list(ids.shape), "INT64" if ids.dtype == np.int64 else "INT32")
    tensor.set_data_from_numpy(ids)
    return tensor


TEXTS_OUT = [tc.InferRequestedOutput("texts")]


def test_texts_in_a_stream_answer_in_order_as_model_infer_does(server: Any, triton: Any) -> None:
    texts = [s.encode() for s in STRINGS]
    embedded = triton.infer(MODEL, [text_input(texts)])
    tokenized_names = ("input_ids", "offsets")
    tokenized = triton.infer(
        MODEL, [text_input(texts)], outputs=[tc.InferRequestedOutput(n) for n in tokenized_names]
    )
    ids = np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int64)
    with EmbeddingClient(server.target) as client:
        rows = client.embed(ids, model=MODEL)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    sent = []
    for i in range(12):
        kind = i % 4
        if kind == 0:  # embedding from text
            triton.async_stream_infer(MODEL, [text_input(texts)], request_id=f"r{i}")
        elif kind == 1:  # tokenizing
            triton.async_stream_infer(
                MODEL, [text_input(texts)], request_id=f"r{i}",
                outputs=[tc.InferRequestedOutput(n) for n in tokenized_names],
            )  # fmt: skip
        elif kind == 2:  # ids, as before
            triton.async_stream_infer(MODEL, [ids_input(ids)], request_id=f"r{i}")
        elif i == 3:  # a bad one: not UTF-8
            triton.async_stream_infer(MODEL, [text_input([b"ok", b"\xff"])], request_id=f"r{i}")
        else:  # detokenizing
            triton.async_stream_infer(MODEL, [ids_input(ids)], request_id=f"r{i}",
                                      outputs=TEXTS_OUT)  # fmt: skip
        sent.append(kind)
    got = [answers.get(timeout=TIMEOUT_S) for _ in sent]
    triton.stop_stream()
    for i, ((result, error), kind) in enumerate(zip(got, sent, strict=True)):
        if i == 3:
            assert result is None and "texts[1] is not valid UTF-8" in error.message()
            continue
        assert error is None, error
        assert result.get_response().id == f"r{i}"
        if kind == 0:
            for name in ("input_ids", "lengths", "hidden_states"):
                np.testing.assert_array_equal(result.as_numpy(name), embedded.as_numpy(name))
        elif kind == 1:
            assert result.as_numpy("hidden_states") is None
            for name in tokenized_names:
                np.testing.assert_array_equal(result.as_numpy(name), tokenized.as_numpy(name))
        elif kind == 2:
            np.testing.assert_array_equal(result.as_numpy("hidden_states"), rows)
        else:
            assert result.as_numpy("texts").shape == (2,)
    v2_stream = {"protocol": "v2", "method": "ModelStreamInfer", "model": MODEL}
    for operation, count in (("embed_text", 3), ("tokenize", 3), ("embed", 3), ("detokenize", 2)):
        labels = {**v2_stream, "operation": operation, "code": "OK"}
        assert server.metric("tokembed_requests_total", labels) == count, operation


@pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")
def test_texts_from_a_region_in_a_stream_and_outputs_into_regions_refused(
    server: Any, triton: Any, prefix: str
) -> None:
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import serialize_byte_tensor

    texts = [s.encode() for s in STRINGS]
    expected = triton.infer(MODEL, [text_input(texts)])
    serialized = serialize_byte_tensor(np.array(texts, dtype=np.object_))
    size = len(serialized.item())
    with made_regions(prefix) as make:
        name, key, handle = make("text", size)
        shm.set_shared_memory_region(handle, [serialized])
        triton.register_system_shared_memory(name, key, size)
        out_name, out_key, _ = make("out", 1 << 16)
        triton.register_system_shared_memory(out_name, out_key, 1 << 16)
        in_region = tc.InferInput("text", [len(texts)], "BYTES")
        in_region.set_shared_memory(name, size)
        into_region = tc.InferRequestedOutput("hidden_states")
        into_region.set_shared_memory(out_name, 1 << 16)
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        triton.start_stream(callback=lambda result, error: answers.put((result, error)))
        triton.async_stream_infer(MODEL, [in_region], request_id="a")
        triton.async_stream_infer(MODEL, [in_region], request_id="b", outputs=[into_region])
        triton.async_stream_infer(MODEL, [in_region], request_id="c")
        got = [answers.get(timeout=TIMEOUT_S) for _ in range(3)]
        triton.stop_stream()
        triton.unregister_system_shared_memory()
    (a, a_error), (b, b_error), (c, c_error) = got
    assert a_error is None and c_error is None and b is None
    assert (
        "output hidden_states names a shared-memory region: ModelStreamInfer" in b_error.message()
    )
    for result in (a, c):
        np.testing.assert_array_equal(
            result.as_numpy("hidden_states"), expected.as_numpy("hidden_states")
        )


def test_detokenize_through_model_infer_equals_v1_and_the_tokenizer(
    server: Any, triton: Any, text_model_dir: Path
) -> None:
    own = Tokenizer.from_file(str(text_model_dir / "tokenizer.json"))
    encodings = own.encode_batch(STRINGS)
    flat = np.array([i for e in encodings for i in e.ids], dtype=np.int64)
    lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
    result = triton.infer(
        MODEL, [ids_input(flat), ids_input(lengths, "lengths")], outputs=TEXTS_OUT
    )
    output = result.get_response().outputs[0]
    assert output.name == "texts" and output.datatype == "BYTES"
    assert list(output.shape) == [len(STRINGS)]
    got = [text.decode() for text in result.as_numpy("texts")]
    assert got == own.decode_batch([e.ids for e in encodings], skip_special_tokens=False)
    with EmbeddingClient(server.target) as client:
        sequences = [e.ids for e in encodings]
        assert got == client.detokenize(sequences)
        skipped = client.detokenize(sequences, skip_special_tokens=True)
        padded = np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int32)
        rectangular = client.detokenize(padded)
    result = triton.infer(
        MODEL, [ids_input(flat), ids_input(lengths, "lengths")], outputs=TEXTS_OUT,
        parameters={"skip_special_tokens": True},
    )  # fmt: skip
    assert [text.decode() for text in result.as_numpy("texts")] == skipped
    assert skipped != got  # the WordPiece model adds [CLS] and [SEP]
    # [B, S] of INT32, no lengths.
    result = triton.infer(MODEL, [ids_input(padded)], outputs=TEXTS_OUT)
    assert [text.decode() for text in result.as_numpy("texts")] == rectangular
    v2 = {"protocol": "v2", "method": "ModelInfer", "operation": "detokenize", "code": "OK"}
    assert server.metric("tokembed_requests_total", v2) == 3


def _refused(client: tc.InferenceServerClient, inputs: list[Any], outputs: Any,
             model: str = MODEL, **kwargs: Any) -> str:  # fmt: skip
    with pytest.raises(InferenceServerException) as refused:
        client.infer(model, inputs, outputs=outputs, **kwargs)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value
    return str(refused.value.message())


def test_bad_detokenize_requests_are_refused_by_name(server: Any, triton: Any) -> None:
    ids = np.array([[5, 6, TEXT_V]], dtype=np.int64)
    message = _refused(triton, [ids_input(ids)], TEXTS_OUT)
    assert f"input_ids[2] = {TEXT_V} is outside the tokenizer's vocabulary" in message
    good = np.array([[5, 6, 7]], dtype=np.int64)
    both = [*TEXTS_OUT, tc.InferRequestedOutput("hidden_states")]
    message = _refused(triton, [ids_input(good)], both)
    assert "output 'hidden_states' cannot come with 'texts'" in message
    flat = np.array([5, 6, 7], dtype=np.int64)
    message = _refused(triton, [ids_input(flat), ids_input(np.array([2]), "lengths")], TEXTS_OUT)
    assert "lengths [2] must be >= 0 and sum to the 3 ids of input_ids" in message
    message = _refused(triton, [ids_input(flat)], TEXTS_OUT)
    assert "input_ids shape [3] must be [B, S] (or [N] with lengths)" in message
    message = _refused(triton, [ids_input(good)], TEXTS_OUT, model="small")
    assert "model 'small' has no tokenizer" in message
    fp = tc.InferInput("input_ids", [1, 3], "FP32")
    fp.set_data_from_numpy(np.zeros((1, 3), np.float32))
    assert "datatype FP32 is not supported" in _refused(triton, [fp], TEXTS_OUT)
    into_region = tc.InferRequestedOutput("texts")
    into_region.set_shared_memory("anything", 64)
    message = _refused(triton, [ids_input(good)], [into_region])
    assert "output 'texts' names a shared-memory region; detokenized texts come in" in message
    # Still serving.
    result = triton.infer(MODEL, [ids_input(good)], outputs=TEXTS_OUT)
    assert result.as_numpy("texts").shape == (1,)
