"""Texts through V2 system shared memory, with tritonclient unchanged: the ``text`` input
read from a region of the caller's (serialised as tritonclient serialises a BYTES
tensor), and the answer's outputs (``input_ids``, ``lengths``, ``hidden_states``; a
tokenizer's ``offsets`` and ``special_tokens_mask``) written into regions of the
caller's, equal to the answer in the message and to the tokenizer's own ids. The
refusals: an output region too small (named with the sizes, nothing written), invalid
UTF-8 and a text over the token limit in a region, a BYTES input of the wrong shape, a
window that cannot hold its texts or holds other than its shape says, one over what a
request may carry, a model without a tokenizer: each a clear error, the region read only
where the request fitted the model (and not at all where it did not), and the server
serving on. The regions' own defences: test_v2_shared_memory*.py."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.utils.shared_memory as shm
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from tokembed.server.edge.v2 import shm_service

from support.fixtures import TEXT_D, TEXT_MAX_LENGTH
from support.shared_memory import SHM_ROOT, MakeRegion, made_regions, serve

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")

MODEL = "text"
STRINGS = ["hello world", "", "привет мир 😀", "the quick brown fox jumps"]
OFFSET = 64  # windows start here in their regions: the bytes before stay untouched
FILL = 0xAB


@pytest.fixture
def prefix() -> str:
    return f"tokembedx{secrets.token_hex(4)}"


@pytest.fixture
def regions(prefix: str) -> Iterator[MakeRegion]:
    with made_regions(prefix) as make:
        yield make


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the region reads the server made (its InRegion.read, counted)."""
    done: list[int] = []
    read = shm_service.InRegion.read

    async def counted(self: shm_service.InRegion) -> bytes:
        data = await read(self)
        done.append(len(data))
        return data

    monkeypatch.setattr(shm_service.InRegion, "read", counted)
    return done


@pytest.fixture
def server(text_model_dir: Path, small_model_dir: Path, start_server: Any, prefix: str) -> Any:
    return serve(start_server, (text_model_dir, small_model_dir), prefix)


@pytest.fixture
def triton(server: Any) -> Iterator[tc.InferenceServerClient]:
    with tc.InferenceServerClient(server.target) as client:
        yield client
        client.unregister_system_shared_memory()


def _serialized(texts: list[bytes]) -> np.ndarray:
    return serialize_byte_tensor(np.array(texts, dtype=np.object_))  # type: ignore[no-any-return]


def text_in_region(
    client: tc.InferenceServerClient,
    make: MakeRegion,
    texts: list[bytes],
    shape: list[int] | None = None,
    byte_size: int | None = None,
    suffix: str = "text",
) -> tc.InferInput:
    """``texts`` serialised into a new region at ``OFFSET`` (tritonclient's recipe for a
    BYTES tensor), registered, and the input ``text`` naming it."""
    serialized = _serialized(texts)
    size = len(serialized.item())
    name, key, handle = make(suffix, OFFSET + max(size, 1))
    shm.set_shared_memory_region(handle, [serialized], offset=OFFSET)
    client.register_system_shared_memory(name, key, max(size, 1), offset=OFFSET)
    tensor = tc.InferInput("text", shape or [len(texts)], "BYTES")
    tensor.set_shared_memory(name, size if byte_size is None else byte_size)
    return tensor


def output_in_region(
    client: tc.InferenceServerClient,
    make: MakeRegion,
    output: str,
    byte_size: int,
    suffix: str = "",
) -> tuple[tc.InferRequestedOutput, Any]:
    """A region of ``byte_size`` bytes at ``OFFSET``, every byte ``FILL``, registered, and
    the requested output naming it."""
    name, key, handle = make(suffix or output, OFFSET + byte_size)
    shm.set_shared_memory_region(handle, [np.full(OFFSET + byte_size, FILL, np.uint8)])
    client.register_system_shared_memory(name, key, byte_size, offset=OFFSET)
    requested = tc.InferRequestedOutput(output)
    requested.set_shared_memory(name, byte_size)
    return requested, handle


def untouched(handle: Any, byte_size: int) -> bool:
    return bool((shm.get_contents_as_numpy(handle, np.uint8, [OFFSET + byte_size]) == FILL).all())


def in_message(texts: list[bytes]) -> tc.InferInput:
    tensor = tc.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=np.object_))
    return tensor


def _refused(client: tc.InferenceServerClient, inputs: list[Any], outputs: Any = None,
             model: str = MODEL, code: str = "INVALID_ARGUMENT", **kwargs: Any) -> str:  # fmt: skip
    with pytest.raises(InferenceServerException) as refused:
        client.infer(model, inputs, outputs=outputs, **kwargs)
    assert refused.value.status() == f"StatusCode.{code}", refused.value
    return str(refused.value.message())


def _encoded(text_model_dir: Path) -> Any:
    return Tokenizer.from_file(str(text_model_dir / "tokenizer.json"))


def test_texts_from_a_region_and_outputs_into_regions_equal_the_message_answer(
    server: Any, triton: Any, regions: MakeRegion, reads: list[int], text_model_dir: Path
) -> None:
    texts = [text.encode() for text in STRINGS]
    expected = triton.infer(MODEL, [in_message(texts)])
    ids = expected.as_numpy("input_ids")
    n = len(ids)
    # The tokenizer's own ids, one text after another.
    own = _encoded(text_model_dir).encode_batch(STRINGS)
    np.testing.assert_array_equal(ids, np.concatenate([e.ids for e in own]))
    text = text_in_region(triton, regions, texts)
    # Each region sized for the most this request may answer: its texts are under the
    # model's limit in tokens each.
    most = len(texts) * TEXT_MAX_LENGTH
    hidden_out, hidden_region = output_in_region(
        triton, regions, "hidden_states", most * TEXT_D * 4
    )
    ids_out, ids_region = output_in_region(triton, regions, "input_ids", most * 8)
    # lengths in the response: outputs in regions and in the message side by side.
    result = triton.infer(
        MODEL, [text], outputs=[ids_out, tc.InferRequestedOutput("lengths"), hidden_out]
    )
    assert reads == [len(_serialized(texts).item())]  # the texts, read once, at their size
    by_name = {o.name: o for o in result.get_response().outputs}
    assert list(by_name["hidden_states"].shape) == [n, TEXT_D]  # the rows written
    assert by_name["hidden_states"].datatype == "FP32"
    assert list(by_name["input_ids"].shape) == [n]
    got_ids = shm.get_contents_as_numpy(ids_region, np.int64, [n], offset=OFFSET)
    got_hidden = shm.get_contents_as_numpy(hidden_region, np.float32, [n, TEXT_D], offset=OFFSET)
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_hidden, expected.as_numpy("hidden_states"))
    np.testing.assert_array_equal(result.as_numpy("lengths"), expected.as_numpy("lengths"))
    # Nothing written before the window, nor past the answer's bytes in it.
    assert untouched(hidden_region, 0)
    tail = shm.get_contents_as_numpy(
        hidden_region, np.uint8, [most * TEXT_D * 4 - n * TEXT_D * 4],
        offset=OFFSET + n * TEXT_D * 4,
    )  # fmt: skip
    assert (tail == FILL).all()


def test_tokenizing_outputs_into_regions_and_the_datatype_asked(
    server: Any, triton: Any, regions: MakeRegion
) -> None:
    texts = [text.encode() for text in STRINGS]
    names = ("input_ids", "offsets", "special_tokens_mask")
    expected = triton.infer(
        MODEL, [in_message(texts)], outputs=[tc.InferRequestedOutput(n) for n in names]
    )
    n = len(expected.as_numpy("input_ids"))
    offsets_out, offsets_region = output_in_region(triton, regions, "offsets", 4096)
    mask_out, mask_region = output_in_region(triton, regions, "special_tokens_mask", 4096)
    result = triton.infer(
        MODEL, [text_in_region(triton, regions, texts)],
        outputs=[tc.InferRequestedOutput("input_ids"), offsets_out, mask_out],
    )  # fmt: skip
    np.testing.assert_array_equal(result.as_numpy("input_ids"), expected.as_numpy("input_ids"))
    offsets = shm.get_contents_as_numpy(offsets_region, np.int64, [n, 2], offset=OFFSET)
    mask = shm.get_contents_as_numpy(mask_region, np.int32, [n], offset=OFFSET)
    np.testing.assert_array_equal(offsets, expected.as_numpy("offsets"))
    np.testing.assert_array_equal(mask, expected.as_numpy("special_tokens_mask"))
    # hidden_states in FP16, into a region, from texts in the message.
    half_out, half_region = output_in_region(triton, regions, "hidden_states", 8192)
    half = triton.infer(MODEL, [in_message(texts)], outputs=[half_out],
                        parameters={"datatype": "FP16"})  # fmt: skip
    rows = int(half.get_response().outputs[0].shape[0])
    assert half.get_response().outputs[0].datatype == "FP16"
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(half_region, np.float16, [rows, TEXT_D], offset=OFFSET),
        triton.infer(MODEL, [in_message(texts)], parameters={"datatype": "FP16"}).as_numpy(
            "hidden_states"
        ),
    )


def test_an_output_region_too_small_is_refused_with_the_sizes_and_nothing_written(
    server: Any, triton: Any, regions: MakeRegion
) -> None:
    texts = [text.encode() for text in STRINGS]
    n = len(triton.infer(MODEL, [in_message(texts)]).as_numpy("input_ids"))
    need = n * TEXT_D * 4
    small, small_region = output_in_region(triton, regions, "hidden_states", need - 4)
    ids_out, ids_region = output_in_region(triton, regions, "input_ids", n * 8)
    message = _refused(triton, [text_in_region(triton, regions, texts)], [ids_out, small])
    assert f"output hidden_states is {need} bytes, over the shared_memory_byte_size " \
           f"{need - 4}" in message  # fmt: skip
    assert f"[{n}, {TEXT_D}] of FP32" in message and "nothing was written" in message
    assert untouched(small_region, need - 4) and untouched(ids_region, n * 8)
    # The server serves on: a region large enough gets the rows.
    big, big_region = output_in_region(triton, regions, "hidden_states", need, "big")
    result = triton.infer(MODEL, [text_in_region(triton, regions, texts, suffix="again")],
                          outputs=[big])  # fmt: skip
    assert result.get_response().outputs[0].shape == [n, TEXT_D]
    assert not untouched(big_region, need)


def test_bad_texts_in_a_region_are_refused_by_name_and_write_nothing(
    server: Any, triton: Any, regions: MakeRegion, reads: list[int]
) -> None:
    hidden_out, hidden_region = output_in_region(triton, regions, "hidden_states", 1 << 16)
    bad = [b"ok", b"ab\xfe"]
    message = _refused(triton, [text_in_region(triton, regions, bad, suffix="bad")], [hidden_out])
    assert "texts[1] is not valid UTF-8: byte 0xfe at offset 2" in message
    long = [b"word " * 200]
    message = _refused(
        triton, [text_in_region(triton, regions, long, suffix="long")], [hidden_out],
        code="RESOURCE_EXHAUSTED",
    )  # fmt: skip
    assert f"over the model's limit of {TEXT_MAX_LENGTH}" in message
    assert untouched(hidden_region, 1 << 16)
    # Both were read (only tokenizing tells what they hold), each once at its size.
    assert reads == [len(_serialized(bad).item()), len(_serialized(long).item())]
    # Truncation asked: the long text is answered, its rows into the region.
    result = triton.infer(
        MODEL, [text_in_region(triton, regions, long, suffix="long2")], outputs=[hidden_out],
        parameters={"truncate": True},
    )  # fmt: skip
    assert result.get_response().outputs[0].shape == [TEXT_MAX_LENGTH, TEXT_D]


def test_refusals_before_the_region_is_read(
    server: Any, triton: Any, regions: MakeRegion, reads: list[int], prefix: str
) -> None:
    texts = [text.encode() for text in STRINGS]
    size = len(_serialized(texts).item())
    text = text_in_region(triton, regions, texts)
    region = f"{prefix}_text"

    def naming(shape: list[int], byte_size: int) -> tc.InferInput:
        tensor = tc.InferInput("text", shape, "BYTES")
        tensor.set_shared_memory(region, byte_size)
        return tensor

    # A BYTES input of the wrong shape.
    message = _refused(triton, [naming([2, 2], size)])
    assert "input 'text' shape [2, 2] must be [B]: one text per element" in message
    # A window too small for the count its shape declares.
    message = _refused(triton, [naming([100], size)])
    assert f"shared_memory_byte_size {size} cannot hold 100 texts" in message
    # A model without a tokenizer: checked against the model before anything is read.
    assert "model 'small' has no tokenizer" in _refused(triton, [text], model="small")
    # An output the request of texts does not answer.
    message = _refused(triton, [text], [tc.InferRequestedOutput("logits")])
    assert "unexpected output 'logits'" in message
    assert reads == []
    # A shape that says fewer texts than the window holds: found once it is read.
    message = _refused(triton, [naming([3], size)])
    assert "holds 4 texts in its shared-memory window, but its shape [3] says 3" in message
    assert reads == [size]
    # A window cut inside an element: its length prefix overruns what was declared.
    message = _refused(triton, [naming([4], size - 3)])
    assert "element 3 claims" in message and "remain in its shared-memory window" in message
    assert reads == [size, size - 3]
    # Each refusal harmed nothing: the same input is answered.
    lengths = triton.infer(MODEL, [text]).as_numpy("lengths")
    assert lengths.tolist() == triton.infer(MODEL, [in_message(texts)]).as_numpy("lengths").tolist()


def test_a_window_over_what_a_request_may_carry_is_refused_unread(
    text_model_dir: Path, start_server: Any, regions: MakeRegion, reads: list[int], prefix: str
) -> None:
    # max_request_bytes = max_tokens_per_request * 18 + 1 MiB
    server = serve(start_server, text_model_dir, prefix, max_tokens_per_request=64)
    limit = 64 * 18 + (1 << 20)
    with tc.InferenceServerClient(server.target) as client:
        name, key, _ = regions("huge", limit + 1)
        client.register_system_shared_memory(name, key, limit + 1)
        tensor = tc.InferInput("text", [1], "BYTES")
        tensor.set_shared_memory(name, limit + 1)
        message = _refused(client, [tensor])
        client.unregister_system_shared_memory()
    assert f"shared_memory_byte_size {limit + 1} is over the {limit} bytes a request" in message
    assert reads == []


def test_texts_in_a_region_on_a_server_without_shared_memory_are_refused(
    text_model_dir: Path, start_server: Any
) -> None:
    server = start_server(text_model_dir)
    with tc.InferenceServerClient(server.target) as client:
        tensor = tc.InferInput("text", [1], "BYTES")
        tensor.set_shared_memory("anything", 64)
        assert "shared memory is off on this server" in _refused(client, [tensor])
        rows = tc.InferRequestedOutput("hidden_states")
        rows.set_shared_memory("anything", 64)
        message = _refused(client, [in_message([b"hello"])], [rows])
        assert "shared memory is off on this server" in message
