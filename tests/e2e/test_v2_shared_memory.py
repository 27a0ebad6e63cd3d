"""End to end, V2 system shared memory: the real server, tritonclient's shared-memory
utilities and clients (sync and asyncio), and tokembed's own client session; answers exact
against the model's reference rows.

The registry's defences are each tried in tests/server/test_shm_registry.py; here, what
only the running server can show: the extension off by default, registration behind the
bearer token, the three RPCs in Triton's messages, inputs read from and answers written
into regions (and no tensor bytes in the response), a request refused alone and counted,
a stream's shared-memory request refused while the stream goes on, unregistering that
waits for the request using the region (and closes it when that request ends even if
the Unregister's deadline passed first), every region let go at shutdown, and no object
made by the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tokembed.client import (
    AuthenticationError,
    EmbeddingClient,
    InvalidInputError,
    SharedMemoryUnavailableError,
)

from support.backends import HookedLoader
from support.fixtures import SMALL_D, SMALL_V
from support.shared_memory import SHM_ROOT, MakeRegion, made_regions, serve

MODEL = "small"
pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")


@pytest.fixture
def prefix() -> str:
    """A prefix of this test's own: objects under it are this test's (or the server's)."""
    return f"tokembedt{secrets.token_hex(4)}"


@pytest.fixture
def regions(prefix: str) -> Iterator[MakeRegion]:
    with made_regions(prefix) as make:
        yield make


def ids_input(ids: np.ndarray, module: Any = tc) -> Any:
    return module.InferInput("input_ids", list(ids.shape), "INT64")


def open_descriptors(path: Path) -> int:
    """Descriptors of this process (the server's, in its thread, and tritonclient's own,
    which keeps one per region it made) open on ``path``'s object."""
    count = 0
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(entry).removesuffix(" (deleted)") == str(path):
                count += 1
    return count


def v2_requests(server: Any, code: str) -> float:
    return float(
        server.metric("tokembed_requests_total",
                      {"protocol": "v2", "method": "ModelInfer", "code": code})
    )  # fmt: skip


IDS = np.array([[0, 1, SMALL_V - 1, 17, 5], [999, 3, 0, 2, 400]], dtype=np.int64)


def test_ids_and_answer_through_regions_with_tritonclient(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    in_bytes, out_bytes = IDS.nbytes, IDS.size * SMALL_D * 4
    in_name, in_key, in_handle = regions("in", in_bytes)
    out_name, out_key, out_handle = regions("out", out_bytes + 4096)
    shm.set_shared_memory_region(in_handle, [IDS])
    with tc.InferenceServerClient(server.target) as client:
        assert "system_shared_memory" in client.get_server_metadata().extensions
        client.register_system_shared_memory(in_name, in_key, in_bytes)
        # Registered 4096 bytes in: the window starts there, counted once (triton#8330).
        client.register_system_shared_memory(out_name, out_key, out_bytes, offset=4096)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status[in_name] == {"name": in_name, "key": in_key, "byte_size": str(in_bytes)}
        assert status[out_name]["offset"] == "4096"

        given = ids_input(IDS)
        given.set_shared_memory(in_name, in_bytes)
        wanted = tc.InferRequestedOutput("hidden_states")
        wanted.set_shared_memory(out_name, out_bytes)
        result = client.infer(MODEL, [given], outputs=[wanted], request_id="shm-1")
        response = result.get_response()
        assert list(response.raw_output_contents) == []  # no tensor bytes on the wire
        assert response.id == "shm-1"
        output = result.get_output("hidden_states")
        assert (output.datatype, list(output.shape)) == ("FP32", [2, 5, SMALL_D])
        answer = shm.get_contents_as_numpy(out_handle, np.float32, output.shape, offset=4096)
        np.testing.assert_array_equal(answer, small_rows[IDS])
        # Nothing before the window was written.
        head = shm.get_contents_as_numpy(out_handle, np.uint8, [4096])
        assert not head.any()

        # Input from the region, FP16 answer in the response: each side on its own.
        result = client.infer(MODEL, [given], parameters={"datatype": "FP16"})
        np.testing.assert_array_equal(
            result.as_numpy("hidden_states"), small_rows[IDS].astype(np.float16)
        )
        client.unregister_system_shared_memory(in_name)
        assert list(client.get_system_shared_memory_status(as_json=True)["regions"]) == [out_name]
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
    assert v2_requests(server, "OK") == 2


def test_asyncio_tritonclient_through_regions(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    out_bytes = IDS.size * SMALL_D * 2
    out_name, out_key, out_handle = regions("out", out_bytes)

    async def scenario() -> np.ndarray:
        client = tc_aio.InferenceServerClient(server.target)
        try:
            await client.register_system_shared_memory(out_name, out_key, out_bytes)
            given = ids_input(IDS, tc_aio)
            given.set_data_from_numpy(IDS)
            wanted = tc_aio.InferRequestedOutput("hidden_states")
            wanted.set_shared_memory(out_name, out_bytes)
            result = await client.infer(
                MODEL, [given], outputs=[wanted], parameters={"datatype": "FP16"}
            )
            output = result.get_output("hidden_states")
            assert output.datatype == "FP16"
            answer = shm.get_contents_as_numpy(out_handle, np.float16, output.shape).copy()
            await client.unregister_system_shared_memory(out_name)
            return answer
        finally:
            await client.close()

    answer = asyncio.run(scenario())
    np.testing.assert_array_equal(answer, small_rows[IDS].astype(np.float16))


def test_off_by_default(
    start_server: Any, small_model_dir: Path, prefix: str, regions: Any
) -> None:
    server = start_server(small_model_dir, shared_memory_prefix=prefix)
    name, key, _ = regions("a", 4096)
    clients_own = open_descriptors(SHM_ROOT / name)
    with tc.InferenceServerClient(server.target) as client:
        assert "system_shared_memory" not in client.get_server_metadata().extensions
        with pytest.raises(InferenceServerException, match="shared memory is off") as caught:
            client.register_system_shared_memory(name, key, 4096)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        wanted = tc.InferRequestedOutput("hidden_states")
        wanted.set_shared_memory(name, 4096)
        given = ids_input(IDS)
        given.set_data_from_numpy(IDS)
        with pytest.raises(InferenceServerException, match="shared memory is off"):
            client.infer(MODEL, [given], outputs=[wanted])
    assert open_descriptors(SHM_ROOT / name) == clients_own
    assert v2_requests(server, "INVALID_ARGUMENT") == 1


def test_registration_needs_the_bearer_token(
    start_server: Any, small_model_dir: Path, prefix: str, regions: Any, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    server = serve(start_server, small_model_dir, prefix, auth_token_file=token_file)
    name, key, _ = regions("a", 4096)
    clients_own = open_descriptors(SHM_ROOT / name)
    with tc.InferenceServerClient(server.target) as client:
        for call in (
            lambda: client.register_system_shared_memory(name, key, 4096),
            lambda: client.get_system_shared_memory_status(),
            lambda: client.unregister_system_shared_memory(name),
        ):
            with pytest.raises(InferenceServerException) as caught:
                call()
            assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
        assert open_descriptors(SHM_ROOT / name) == clients_own
        headers = {"authorization": "Bearer s3cret-token"}
        client.register_system_shared_memory(name, key, 4096, headers=headers)
        status = client.get_system_shared_memory_status(headers=headers, as_json=True)
        assert list(status["regions"]) == [name]


def test_refusals_are_alone_counted_and_name_only_the_request_s_own(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    secret_name, secret_key, _ = regions("secret7f3a", 1 << 16)
    small_name, small_key, small_handle = regions("small", 64)
    shm.set_shared_memory_region(small_handle, [np.full(64, 0xEE, dtype=np.uint8)])
    with tc.InferenceServerClient(server.target) as client:
        client.register_system_shared_memory(secret_name, secret_key, 1 << 16)
        client.register_system_shared_memory(small_name, small_key, 64)
        messages = []
        for attempt in (
            lambda: client.register_system_shared_memory("x", "/elsewhere", 64),
            lambda: client.register_system_shared_memory("x", f"/{prefix}_nothing", 64),
            lambda: client.register_system_shared_memory("x", small_key, 2**63, offset=2**63),
            lambda: client.register_system_shared_memory(small_name, small_key, 8),
        ):
            with pytest.raises(InferenceServerException) as caught:
                attempt()
            assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
            messages.append(caught.value.message())
        given = ids_input(IDS)
        given.set_data_from_numpy(IDS)
        for region, size in (("nope", 64), (small_name, 64), (small_name, 65)):
            wanted = tc.InferRequestedOutput("hidden_states")
            wanted.set_shared_memory(region, size)
            with pytest.raises(InferenceServerException) as caught:
                client.infer(MODEL, [given], outputs=[wanted])
            assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
            messages.append(caught.value.message())
        # The answer too large for its window wrote nothing.
        assert (shm.get_contents_as_numpy(small_handle, np.uint8, [64]) == 0xEE).all()
        assert "output is 2560 bytes, over the shared_memory_byte_size 64" in messages[5]
        for message in messages:
            assert "7f3a" not in message, message
        # The server goes on, exactly.
        result = client.infer(MODEL, [given])
        np.testing.assert_array_equal(result.as_numpy("hidden_states"), small_rows[IDS])
    assert v2_requests(server, "INVALID_ARGUMENT") == 3
    assert v2_requests(server, "OK") == 1


def test_a_shrunk_region_is_a_clear_error_not_a_crash(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    out_bytes = IDS.size * SMALL_D * 4
    name, key, _ = regions("out", out_bytes)
    in_name, in_key, in_handle = regions("in", IDS.nbytes)
    shm.set_shared_memory_region(in_handle, [IDS])
    with tc.InferenceServerClient(server.target) as client:
        client.register_system_shared_memory(name, key, out_bytes)
        client.register_system_shared_memory(in_name, in_key, IDS.nbytes)
        os.truncate(SHM_ROOT / name, 100)
        os.truncate(SHM_ROOT / in_name, 0)
        given = ids_input(IDS)
        given.set_data_from_numpy(IDS)
        wanted = tc.InferRequestedOutput("hidden_states")
        wanted.set_shared_memory(name, out_bytes)
        with pytest.raises(InferenceServerException, match="register it again"):
            client.infer(MODEL, [given], outputs=[wanted])
        from_region = ids_input(IDS)
        from_region.set_shared_memory(in_name, IDS.nbytes)
        with pytest.raises(InferenceServerException, match="register it again"):
            client.infer(MODEL, [from_region])
        result = client.infer(MODEL, [given])
        np.testing.assert_array_equal(result.as_numpy("hidden_states"), small_rows[IDS])


def test_a_stream_refuses_shared_memory_answers_and_goes_on(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    name, key, _ = regions("out", 1 << 16)
    answers: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        answers.append(error if error is not None else result)
        if len(answers) == 2:
            done.set()

    with tc.InferenceServerClient(server.target) as client:
        client.register_system_shared_memory(name, key, 1 << 16)
        client.start_stream(callback)
        given = ids_input(IDS)
        given.set_data_from_numpy(IDS)
        wanted = tc.InferRequestedOutput("hidden_states")
        wanted.set_shared_memory(name, 1 << 16)
        client.async_stream_infer(MODEL, [given], outputs=[wanted], request_id="a")
        client.async_stream_infer(MODEL, [given], request_id="b")
        assert done.wait(30)
        client.stop_stream()
    refused, served = answers
    assert isinstance(refused, InferenceServerException)
    assert "use ModelInfer for answers in shared memory" in refused.message()
    np.testing.assert_array_equal(served.as_numpy("hidden_states"), small_rows[IDS])


def test_unregister_waits_for_the_request_using_the_region(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    loader = HookedLoader(open_look_ups=False)
    server = serve(
        start_server, small_model_dir, prefix, loader=loader, inline_compute_max_tokens=0
    )
    out_bytes = IDS.size * SMALL_D * 4
    name, key, handle = regions("out", out_bytes)
    clients_own = open_descriptors(SHM_ROOT / name)
    with tc.InferenceServerClient(server.target) as client, ThreadPoolExecutor(2) as pool:
        client.register_system_shared_memory(name, key, out_bytes)
        given = ids_input(IDS)
        given.set_data_from_numpy(IDS)
        wanted = tc.InferRequestedOutput("hidden_states")
        wanted.set_shared_memory(name, out_bytes)
        inferring = pool.submit(client.infer, MODEL, [given], outputs=[wanted])
        assert loader.look_up_gate.held.wait(30), "the request never reached the gate"
        with tc.InferenceServerClient(server.target) as other:
            unregistering = pool.submit(other.unregister_system_shared_memory, name)
            # The region leaves the status as soon as the unregistration has begun; from
            # then on it waits for the request held at the gate.
            for _ in range(10_000):
                status = other.get_system_shared_memory_status(as_json=True)
                if name not in status.get("regions", {}):
                    break
            else:
                raise AssertionError("the unregistration never began")
            assert not unregistering.done()
            assert open_descriptors(SHM_ROOT / name) == clients_own + 1
            loader.look_up_gate.open()
            inferring.result(30)
            unregistering.result(30)
        answer = shm.get_contents_as_numpy(handle, np.float32, (*IDS.shape, SMALL_D))
        np.testing.assert_array_equal(answer, small_rows[IDS])
    assert open_descriptors(SHM_ROOT / name) == clients_own


def test_an_unregistration_past_its_deadline_leaks_nothing(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    """The Unregister's deadline passes while a request writes into the region: the
    region is gone for new requests at once, and closed when that request ends."""
    loader = HookedLoader(open_look_ups=False)
    server = serve(
        start_server, small_model_dir, prefix, loader=loader, inline_compute_max_tokens=0
    )
    out_bytes = IDS.size * SMALL_D * 4
    name, key, handle = regions("out", out_bytes)
    clients_own = open_descriptors(SHM_ROOT / name)
    with tc.InferenceServerClient(server.target) as client, ThreadPoolExecutor(1) as pool:
        client.register_system_shared_memory(name, key, out_bytes)
        given = ids_input(IDS)
        given.set_data_from_numpy(IDS)
        wanted = tc.InferRequestedOutput("hidden_states")
        wanted.set_shared_memory(name, out_bytes)
        inferring = pool.submit(client.infer, MODEL, [given], outputs=[wanted])
        assert loader.look_up_gate.held.wait(30), "the request never reached the gate"
        with pytest.raises(InferenceServerException) as caught:
            client.unregister_system_shared_memory(name, client_timeout=0.2)
        assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert name not in client.get_system_shared_memory_status(as_json=True).get("regions", {})
        assert open_descriptors(SHM_ROOT / name) == clients_own + 1
        loader.look_up_gate.open()
        inferring.result(30)
        answer = shm.get_contents_as_numpy(handle, np.float32, (*IDS.shape, SMALL_D))
        np.testing.assert_array_equal(answer, small_rows[IDS])
    # The window is let go when the request's RPC has ended, just after its answer left.
    for _ in range(200):
        if open_descriptors(SHM_ROOT / name) == clients_own:
            break
        threading.Event().wait(0.05)
    assert open_descriptors(SHM_ROOT / name) == clients_own


def test_every_region_goes_at_shutdown_and_the_server_made_none(
    start_server: Any, small_model_dir: Path, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    made = [regions(f"r{index}", 4096) for index in range(3)]
    paths = [SHM_ROOT / name for name, _, _ in made]
    clients_own = [open_descriptors(path) for path in paths]
    with tc.InferenceServerClient(server.target) as client:
        for name, key, _ in made:
            client.register_system_shared_memory(name, key, 4096)
        given = ids_input(IDS[:1, :1])
        given.set_data_from_numpy(IDS[:1, :1])
        wanted = tc.InferRequestedOutput("hidden_states")
        wanted.set_shared_memory(made[0][0], 4096)
        client.infer(MODEL, [given], outputs=[wanted])
    assert [open_descriptors(path) for path in paths] == [n + 1 for n in clients_own]
    server.stop()
    assert [open_descriptors(path) for path in paths] == clients_own
    # Under the prefix, only what this test made: the server creates no object.
    assert sorted(p.name for p in SHM_ROOT.glob(f"{prefix}*")) == sorted(
        name for name, _, _ in made
    )


# --- tokembed's own client


def test_the_client_session_answers_through_its_region(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    with EmbeddingClient(server.target) as client:
        with client.shared_memory(capacity_bytes=1 << 20, prefix=prefix) as session:
            path = SHM_ROOT / session.name
            assert path.is_file() and (path.stat().st_mode & 0o777) == 0o600
            first = session.embed(IDS)
            np.testing.assert_array_equal(first, small_rows[IDS])
            assert not first.flags.writeable
            kept = first.copy()
            half = session.embed(IDS[:, :2], "float16")
            np.testing.assert_array_equal(half, small_rows[IDS[:, :2]].astype(np.float16))
            # The contract: the next call writes into the same bytes.
            assert not np.array_equal(first, kept)
            with pytest.raises(InvalidInputError, match="over the shared_memory_byte_size"):
                session.embed(np.zeros((64, 128), dtype=np.int64))
            ids32 = IDS.astype(np.int32)
            np.testing.assert_array_equal(session.embed(ids32), small_rows[IDS])
        assert not path.exists()
        assert v2_requests(server, "OK") == 3
        # One array held past the session keeps its pages, and its values.
        with client.shared_memory(capacity_bytes=1 << 20, prefix=prefix) as session:
            held = session.embed(IDS)
        np.testing.assert_array_equal(held, small_rows[IDS])


def test_the_client_session_says_why_it_cannot_be_had(
    start_server: Any, small_model_dir: Path, prefix: str
) -> None:
    off = start_server(small_model_dir, shared_memory_prefix=prefix)
    with (
        EmbeddingClient(off.target) as client,
        pytest.raises(SharedMemoryUnavailableError, match="shared memory is off"),
    ):
        client.shared_memory(prefix=prefix)
    on = serve(start_server, small_model_dir, prefix)
    with (
        EmbeddingClient(on.target) as client,
        pytest.raises(SharedMemoryUnavailableError, match="must be '/' and then a name"),
    ):
        client.shared_memory(prefix="other")
    # Neither left an object behind.
    assert list(SHM_ROOT.glob(f"{prefix}*")) == [] and list(SHM_ROOT.glob("other_*")) == []


def test_the_client_session_sends_the_token(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken")
    server = serve(start_server, small_model_dir, prefix, auth_token_file=token_file)
    with (
        EmbeddingClient(server.target, token="t0ken") as client,
        client.shared_memory(capacity_bytes=1 << 20, prefix=prefix) as session,
    ):
        np.testing.assert_array_equal(session.embed(IDS), small_rows[IDS])
    with (
        EmbeddingClient(server.target, token="wrong") as client,
        pytest.raises(AuthenticationError) as caught,
    ):
        client.shared_memory(prefix=prefix)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert list(SHM_ROOT.glob(f"{prefix}*")) == []
