"""End to end, whose shared-memory regions are whose: a region belongs to the identity that
registered it (the mutual-TLS client certificate; the bearer token; one identity shared by
every caller when neither is configured). Another identity can neither see it in
``SystemSharedMemoryStatus``, use it in ``ModelInfer`` or ``ModelStreamInfer``, unregister
it, nor register the same name over it, and every refusal reads as for a region that was
never registered. The real server, tritonclient over TLS with client certificates made
here (two of them with the same common name: the certificate is the identity).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from support.certs import Authority, Issued
from support.fixtures import SMALL_D

MODEL = "small"
SHM_ROOT = Path("/dev/shm")
TOKEN = "0wner-t0ken"
IDS = np.array([[0, 1, 17, 5], [999, 3, 0, 2]], dtype=np.int64)
OUT_BYTES = IDS.size * SMALL_D * 4
pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One CA; the server's certificate; clients alice, bob, and a second alice (the same
    common name, another certificate)."""
    ca = Authority(tmp_path_factory.mktemp("owners-pki"), "owners-ca")
    first = ca.client("alice")  # its files are named after it: moved aside for the second
    alice = Issued(first.cert.rename(first.cert.with_stem("alice-1")),
                   first.key.rename(first.key.with_stem("alice-1")))  # fmt: skip
    return SimpleNamespace(
        ca=ca.cert,
        server=ca.server("server", dns=["localhost"], ips=["127.0.0.1"]),
        alice=alice,
        bob=ca.client("bob"),
        alice_again=ca.client("alice"),
    )


@pytest.fixture
def objects(tmp_path: Path) -> Iterator[Any]:
    """Make objects as a tritonclient user does; removed at the end."""
    prefix = f"tokembedo{tmp_path.name[-12:].replace('_', '')}"
    made: list[Any] = []

    def make(suffix: str, byte_size: int) -> tuple[str, Any]:
        name = f"{prefix}_{suffix}"
        handle = shm.create_shared_memory_region(name, f"/{name}", byte_size, create_only=True)
        made.append(handle)
        return f"/{name}", handle

    make.prefix = prefix  # type: ignore[attr-defined]
    yield make
    for handle in made:
        with contextlib.suppress(Exception):
            shm.destroy_shared_memory_region(handle)
    for path in SHM_ROOT.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def tls_client(server: Any, pki: SimpleNamespace, who: str) -> tc.InferenceServerClient:
    issued = getattr(pki, who)
    return tc.InferenceServerClient(
        server.target, ssl=True, root_certificates=str(pki.ca),
        private_key=str(issued.key), certificate_chain=str(issued.cert),
    )  # fmt: skip


def refusal(call: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    """The status and message ``call(*args, **kwargs)`` is refused with."""
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    return caught.value.status(), caught.value.message()


def infer_with(
    client: Any, headers: Any, *, input_region: str = "", output_region: str = ""
) -> Any:
    given = tc.InferInput("input_ids", list(IDS.shape), "INT64")
    if input_region:
        given.set_shared_memory(input_region, IDS.nbytes)
    else:
        given.set_data_from_numpy(IDS)
    wanted = tc.InferRequestedOutput("hidden_states")
    if output_region:
        wanted.set_shared_memory(output_region, OUT_BYTES)
    return client.infer(MODEL, [given], outputs=[wanted], headers=headers)


def regions_of(client: Any, headers: Any) -> dict[str, Any]:
    status = client.get_system_shared_memory_status(headers=headers, as_json=True)
    return {name: entry["key"] for name, entry in status.get("regions", {}).items()}


@pytest.mark.parametrize("token", [False, True], ids=["mtls", "mtls-and-token"])
def test_a_region_belongs_to_the_certificate_that_registered_it(
    start_server: Any,
    small_model_dir: Path,
    small_rows: np.ndarray,
    pki: SimpleNamespace,
    objects: Any,
    tmp_path: Path,
    token: bool,
) -> None:
    settings: dict[str, Any] = {}
    headers = None
    if token:  # one token for both: the certificates still tell them apart
        (tmp_path / "token").write_text(TOKEN)
        settings["auth_token_file"] = tmp_path / "token"
        headers = {"authorization": f"Bearer {TOKEN}"}
    server = start_server(
        small_model_dir, shared_memory="system", shared_memory_prefix=objects.prefix,
        tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca, **settings,
    )  # fmt: skip
    in_key, in_handle = objects("in", IDS.nbytes)
    out_key, out_handle = objects("out", OUT_BYTES)
    bobs_key, bobs_handle = objects("bobs", OUT_BYTES)
    shm.set_shared_memory_region(in_handle, [IDS])
    with (
        tls_client(server, pki, "alice") as alice,
        tls_client(server, pki, "bob") as bob,
        tls_client(server, pki, "alice_again") as alice_again,
    ):
        alice.register_system_shared_memory("in", in_key, IDS.nbytes, headers=headers)
        alice.register_system_shared_memory("out", out_key, OUT_BYTES, headers=headers)
        assert regions_of(alice, headers) == {"in": in_key, "out": out_key}

        for other in (bob, alice_again):
            # Not listed, and asked by name, refused as a name never registered.
            assert regions_of(other, headers) == {}
            status = other.get_system_shared_memory_status
            never = refusal(status, "never", headers)
            assert refusal(status, "out", headers) == (never[0], never[1].replace("never", "out"))
            # Not used: an input read from it, an answer written into it.
            for side in ("input_region", "output_region"):
                never = refusal(infer_with, other, headers, **{side: "never"})
                assert refusal(infer_with, other, headers, **{side: "in"}) == (
                    never[0], never[1].replace("never", "in")
                )  # fmt: skip
            # Not unregistered, by name or with every region.
            other.unregister_system_shared_memory("out", headers=headers)
            other.unregister_system_shared_memory(headers=headers)
            assert regions_of(alice, headers) == {"in": in_key, "out": out_key}

        # Not replaced: bob's "out" is bob's own, beside alice's.
        bob.register_system_shared_memory("out", bobs_key, OUT_BYTES, headers=headers)
        assert regions_of(bob, headers) == {"out": bobs_key}
        assert regions_of(alice, headers) == {"in": in_key, "out": out_key}
        infer_with(alice, headers, input_region="in", output_region="out")
        answer = shm.get_contents_as_numpy(out_handle, np.float32, (*IDS.shape, SMALL_D))
        np.testing.assert_array_equal(answer, small_rows[IDS])
        assert not shm.get_contents_as_numpy(bobs_handle, np.uint8, [OUT_BYTES]).any()

        # A stream: bob's request naming alice's input region fails alone.
        answers: list[Any] = []
        done = threading.Event()

        def callback(result: Any, error: Any) -> None:
            answers.append(error if error is not None else result)
            if len(answers) == 2:
                done.set()

        bob.start_stream(callback, headers=headers)
        given = tc.InferInput("input_ids", list(IDS.shape), "INT64")
        given.set_shared_memory("in", IDS.nbytes)
        bob.async_stream_infer(MODEL, [given], request_id="theirs")
        plain = tc.InferInput("input_ids", list(IDS.shape), "INT64")
        plain.set_data_from_numpy(IDS)
        bob.async_stream_infer(MODEL, [plain], request_id="own")
        assert done.wait(30)
        bob.stop_stream()
        refused, served = answers
        assert isinstance(refused, InferenceServerException)
        assert "no shared-memory region named 'in' is registered" in refused.message()
        np.testing.assert_array_equal(served.as_numpy("hidden_states"), small_rows[IDS])

    # The identity is the certificate, not the connection: a new one sees alice's regions.
    with tls_client(server, pki, "alice") as alice:
        assert regions_of(alice, headers) == {"in": in_key, "out": out_key}
        alice.unregister_system_shared_memory(headers=headers)
        assert regions_of(alice, headers) == {}
    with tls_client(server, pki, "bob") as bob:
        assert regions_of(bob, headers) == {"out": bobs_key}


@pytest.mark.parametrize("token", [False, True], ids=["no-auth", "token"])
def test_without_client_certificates_callers_share_one_identity(
    start_server: Any, small_model_dir: Path, objects: Any, tmp_path: Path, token: bool
) -> None:
    """No client certificates: every caller (with the one bearer token, when one is set)
    is one identity, and regions are server-wide as in Triton."""
    settings: dict[str, Any] = {}
    headers = None
    if token:
        (tmp_path / "token").write_text(TOKEN)
        settings["auth_token_file"] = tmp_path / "token"
        headers = {"authorization": f"Bearer {TOKEN}"}
    server = start_server(
        small_model_dir, shared_memory="system", shared_memory_prefix=objects.prefix, **settings
    )
    key, _ = objects("a", OUT_BYTES)
    with (
        tc.InferenceServerClient(server.target) as first,
        tc.InferenceServerClient(server.target) as second,
    ):
        first.register_system_shared_memory("a", key, OUT_BYTES, headers=headers)
        assert regions_of(second, headers) == {"a": key}
        infer_with(second, headers, output_region="a")
        second.unregister_system_shared_memory("a", headers=headers)
        assert regions_of(first, headers) == {}


def test_texts_and_their_outputs_use_the_callers_regions_alone(
    start_server: Any, text_model_dir: Path, pki: SimpleNamespace, objects: Any
) -> None:
    """The text input in a region, and a text answer's output into one, as the ids are:
    another certificate naming alice's regions is refused as for a name never registered,
    and reads or writes nothing; alice's own request is answered into her region."""
    from tritonclient.utils import serialize_byte_tensor

    server = start_server(
        text_model_dir, shared_memory="system", shared_memory_prefix=objects.prefix,
        tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca,
    )  # fmt: skip
    serialized = serialize_byte_tensor(np.array([b"hello world", b"owners"], dtype=np.object_))
    size = len(serialized.item())
    text_key, text_handle = objects("text", size)
    shm.set_shared_memory_region(text_handle, [serialized])
    out_key, out_handle = objects("hidden", 1 << 14)

    def texts_with(client: Any, *, text_region: str = "", output_region: str = "") -> Any:
        given = tc.InferInput("text", [2], "BYTES")
        if text_region:
            given.set_shared_memory(text_region, size)
        else:
            given.set_data_from_numpy(np.array([b"hello world", b"owners"], dtype=np.object_))
        wanted = tc.InferRequestedOutput("hidden_states")
        if output_region:
            wanted.set_shared_memory(output_region, 1 << 14)
        return client.infer("text", [given], outputs=[wanted])

    with tls_client(server, pki, "alice") as alice, tls_client(server, pki, "bob") as bob:
        alice.register_system_shared_memory("text", text_key, size)
        alice.register_system_shared_memory("hidden", out_key, 1 << 14)
        for side, name in (("text_region", "text"), ("output_region", "hidden")):
            status, message = refusal(texts_with, bob, **{side: name})
            assert status == "StatusCode.INVALID_ARGUMENT"
            assert f"no shared-memory region named {name!r} is registered" in message
        assert not shm.get_contents_as_numpy(out_handle, np.uint8, [1 << 14]).any()
        expected = texts_with(alice).as_numpy("hidden_states")
        result = texts_with(alice, text_region="text", output_region="hidden")
        rows = result.get_response().outputs[0].shape
        got = shm.get_contents_as_numpy(out_handle, np.float32, list(rows))
        np.testing.assert_array_equal(got, expected)
        alice.unregister_system_shared_memory()
