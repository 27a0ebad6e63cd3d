"""``NAME.nearest`` with system shared memory, through tritonclient unchanged: ``vectors``
read from a region of the caller's, and each requested output (``ids``, ``scores``,
``logits``) written into a region of its own, equal to the answer in the message. The
refusals: an output region too small (named, nothing written), a vectors window whose
declared size is not what the shape needs, or a request the model refuses (neither read:
checked before any byte is), ``k`` in a region, and a region on a server without shared
memory. The regions' defences themselves: test_v2_shared_memory*.py and
tests/server/test_shm_registry.py."""

from __future__ import annotations

import queue
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tokembed.export.head import add_head
from tokembed.server.edge.v2 import shm_service

from support.models import export_model_dir
from support.shared_memory import SHM_ROOT, MakeRegion, made_regions, serve

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")

V, D, N, K = 300, 24, 5, 3
OFFSET = 64  # windows start here in their regions: the bytes before stay untouched


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = export_model_dir(
        tmp_path_factory.mktemp("v2-nearest-shm") / "m", vocab_size=V, d_model=D, seed=6, name="m"
    )
    add_head(directory, output_table=None, output_key=None, norm=None)
    return directory


@pytest.fixture
def prefix() -> str:
    return f"tokembedn{secrets.token_hex(4)}"


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


def _k(k: int) -> tc.InferInput:
    tensor = tc.InferInput("k", [1], "INT64")
    tensor.set_data_from_numpy(np.array([k], dtype=np.int64))
    return tensor


def _vectors_in(client: tc.InferenceServerClient, make: MakeRegion, h: np.ndarray) -> tc.InferInput:
    """``h`` written into a new region at ``OFFSET``, registered, and an input naming it."""
    name, key, handle = make("vectors", OFFSET + h.nbytes)
    shm.set_shared_memory_region(handle, [h], offset=OFFSET)
    client.register_system_shared_memory(name, key, h.nbytes, offset=OFFSET)
    tensor = tc.InferInput("vectors", list(h.shape), "FP32")
    tensor.set_shared_memory(name, h.nbytes)
    return tensor


def _output_in(
    client: tc.InferenceServerClient, make: MakeRegion, output: str, byte_size: int
) -> tuple[tc.InferRequestedOutput, Any]:
    name, key, handle = make(output, OFFSET + byte_size)
    shm.set_shared_memory_region(handle, [np.full(OFFSET + byte_size, 0xAB, np.uint8)])
    client.register_system_shared_memory(name, key, byte_size, offset=OFFSET)
    requested = tc.InferRequestedOutput(output)
    requested.set_shared_memory(name, byte_size)
    return requested, handle


def test_vectors_from_a_region_and_outputs_into_regions_equal_the_message_answer(
    tied: Path, start_server: Any, regions: MakeRegion, prefix: str, reads: list[int]
) -> None:
    server = serve(start_server, tied, prefix)
    h = np.random.default_rng(12).standard_normal((N, D)).astype(np.float32)
    with tc.InferenceServerClient(server.target) as client:
        in_message = client.infer(
            "m.nearest",
            [_in_message(h), _k(K)],
            outputs=[tc.InferRequestedOutput(o) for o in ("ids", "scores", "logits")],
        )
        vectors = _vectors_in(client, regions, h)
        ids_out, ids_region = _output_in(client, regions, "ids", N * K * 8)
        scores_out, scores_region = _output_in(client, regions, "scores", N * K * 4)
        # The logits in the response: outputs in regions and in the message side by side.
        result = client.infer(
            "m.nearest", [vectors, _k(K)],
            outputs=[ids_out, scores_out, tc.InferRequestedOutput("logits")],
        )  # fmt: skip
        assert reads == [h.nbytes]  # the vectors, read once, at their declared size
        by_name = {o.name: o for o in result.get_response().outputs}
        assert list(by_name["ids"].shape) == [N, K] and by_name["ids"].datatype == "INT64"
        assert list(by_name["scores"].shape) == [N, K]
        ids = shm.get_contents_as_numpy(ids_region, np.int64, [N, K], offset=OFFSET)
        scores = shm.get_contents_as_numpy(scores_region, np.float32, [N, K], offset=OFFSET)
        untouched = shm.get_contents_as_numpy(ids_region, np.uint8, [OFFSET])
        client.unregister_system_shared_memory()
    np.testing.assert_array_equal(ids, in_message.as_numpy("ids"))
    np.testing.assert_array_equal(scores, in_message.as_numpy("scores"))
    np.testing.assert_array_equal(result.as_numpy("logits"), in_message.as_numpy("logits"))
    assert (untouched == 0xAB).all()
    # The answer itself is right, not only equal: the table's top-k of h.
    assert len({tuple(row) for row in ids.tolist()}) > 1


def _in_message(h: np.ndarray) -> tc.InferInput:
    tensor = tc.InferInput("vectors", list(h.shape), "FP32")
    tensor.set_data_from_numpy(h)
    return tensor


def _refused(client: tc.InferenceServerClient, inputs: list[Any], outputs: Any = None) -> str:
    with pytest.raises(InferenceServerException) as refused:
        client.infer("m.nearest", inputs, outputs=outputs)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value
    return str(refused.value.message())


def test_refusals_name_what_is_wrong_and_read_nothing_they_need_not(
    tied: Path, start_server: Any, regions: MakeRegion, prefix: str, reads: list[int]
) -> None:
    server = serve(start_server, tied, prefix)
    h = np.random.default_rng(13).standard_normal((N, D)).astype(np.float32)
    with tc.InferenceServerClient(server.target) as client:
        vectors = _vectors_in(client, regions, h)
        # An output region too small for its tensor: named, and nothing written into any.
        small, small_region = _output_in(client, regions, "ids", N * K * 8 - 8)
        scores_out, scores_region = _output_in(client, regions, "scores", N * K * 4)
        message = _refused(client, [vectors, _k(K)], [small, scores_out])
        assert f"output ids is {N * K * 8} bytes, over the shared_memory_byte_size" in message
        assert f"{N * K * 8 - 8}" in message and f"{prefix}_ids" in message
        for region, size in ((small_region, N * K * 8 - 8), (scores_region, N * K * 4)):
            after = shm.get_contents_as_numpy(region, np.uint8, [OFFSET + size])
            assert (after == 0xAB).all()
        reads.clear()
        # A window declared for other than the shape's bytes: refused before it is read.
        wrong = tc.InferInput("vectors", [N - 1, D], "FP32")
        wrong.set_shared_memory(f"{prefix}_vectors", h.nbytes)
        message = _refused(client, [wrong, _k(K)])
        assert f"vectors is declared as {h.nbytes} bytes" in message
        assert f"needs {(N - 1) * D * 4}" in message
        # A request the model refuses (k over V): its vectors are not read either.
        assert "k = 301" in _refused(client, [vectors, _k(V + 1)])
        assert reads == []
        # k comes in the request itself.
        k_name, k_key, _ = regions("k", 8)
        client.register_system_shared_memory(k_name, k_key, 8)
        k_in = tc.InferInput("k", [1], "INT64")
        k_in.set_shared_memory(k_name, 8)
        assert "input 'k' names a shared-memory region" in _refused(client, [vectors, k_in])
        client.unregister_system_shared_memory()


def test_a_region_on_a_server_without_shared_memory_is_refused(
    tied: Path, start_server: Any
) -> None:
    server = start_server(tied)
    with tc.InferenceServerClient(server.target) as client:
        vectors = tc.InferInput("vectors", [N, D], "FP32")
        vectors.set_shared_memory("anything", N * D * 4)
        message = _refused(client, [vectors, _k(K)])
        assert "shared memory is off on this server" in message, message


def test_vectors_from_a_region_in_a_stream(
    tied: Path, start_server: Any, regions: MakeRegion, prefix: str, reads: list[int]
) -> None:
    """ModelStreamInfer reads a nearest request's vectors from the caller's region as
    ModelInfer does (its answers stay in the stream)."""
    server = serve(start_server, tied, prefix)
    h = np.random.default_rng(13).standard_normal((N, D)).astype(np.float32)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with tc.InferenceServerClient(server.target) as client:
        in_message = client.infer("m.nearest", [_in_message(h), _k(K)])
        vectors = _vectors_in(client, regions, h)
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("m.nearest", [vectors, _k(K)], request_id="from-region")
        result, error = answers.get(timeout=30)
        client.stop_stream()
        client.unregister_system_shared_memory()
    assert error is None, error
    assert result.get_response().id == "from-region" and reads == [h.nbytes]
    np.testing.assert_array_equal(result.as_numpy("ids"), in_message.as_numpy("ids"))
    np.testing.assert_array_equal(result.as_numpy("scores"), in_message.as_numpy("scores"))
