"""Who may load and unload: the control methods take their own credential
(``--control-token-file``), not the data token, and the data methods do not take it;
without one, control is refused unless the server listens on loopback only."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tritonclient_grpc
from tritonclient.utils import InferenceServerException

from tokembed.server.core.errors import ServerConfigError
from tokembed.server.edge.control_access import (
    ControlAccessInterceptor,
    is_loopback,
)
from tokembed.server.process.settings import Settings

from support.repository import put_version
from support.server import ServerThread

MODEL = "small"
DATA_TOKEN, CONTROL_TOKEN = "data-secret", "control-secret"


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _infer(client: Any, headers: dict[str, str]) -> np.ndarray:
    from tritonclient.grpc import InferInput

    tensor = InferInput("input_ids", [1, 2], "INT64")
    tensor.set_data_from_numpy(np.array([[3, 4]], dtype=np.int64))
    return client.infer(MODEL, [tensor], headers=headers).as_numpy("hidden_states")


def test_control_takes_its_own_token_and_data_calls_do_not_take_it(
    tmp_path: Path, small_model_dir: Path, start_server: Any, small_rows: Any
) -> None:
    repository = tmp_path / "models"
    put_version(repository, MODEL, 1, small_model_dir)
    (tmp_path / "data").write_text(DATA_TOKEN)
    (tmp_path / "control").write_text(CONTROL_TOKEN)
    server = start_server(
        (), model_repository=repository, auth_token_file=tmp_path / "data",
        control_token_file=tmp_path / "control",
    )  # fmt: skip
    client = tritonclient_grpc.InferenceServerClient(server.target)
    for headers in ({}, _bearer(DATA_TOKEN), _bearer("wrong")):
        with pytest.raises(InferenceServerException, match="control token") as refused:
            client.load_model(MODEL, headers=headers)
        assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException, match="control token"):
            client.get_model_repository_index(headers=headers)
    client.load_model(MODEL, headers=_bearer(CONTROL_TOKEN))
    assert [m.state for m in client.get_model_repository_index(
        headers=_bearer(CONTROL_TOKEN)).models] == ["READY"]  # fmt: skip
    with pytest.raises(InferenceServerException, match="bearer token") as refused:
        _infer(client, _bearer(CONTROL_TOKEN))  # the control token is no data token
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    np.testing.assert_array_equal(_infer(client, _bearer(DATA_TOKEN)), small_rows[[[3, 4]]])
    with pytest.raises(InferenceServerException, match="control token"):
        client.unload_model(MODEL, headers=_bearer(DATA_TOKEN))
    client.unload_model(MODEL, headers=_bearer(CONTROL_TOKEN))
    client.close()


def test_one_token_for_both_is_refused_at_start(tmp_path: Path, small_model_dir: Path) -> None:
    repository = tmp_path / "models"
    put_version(repository, MODEL, 1, small_model_dir)
    (tmp_path / "token").write_text(DATA_TOKEN)
    settings = Settings(
        model_repository=repository, port=0, metrics_port=-1,
        auth_token_file=tmp_path / "token", control_token_file=tmp_path / "token",
    ).validate()  # fmt: skip
    server = ServerThread(settings)
    with pytest.raises(ServerConfigError, match="hold the same token"):
        server.start()
    server.stop()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True),
     ("[::1]", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
     ("example.org", False)],
)  # fmt: skip
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_without_a_control_token_beyond_loopback_control_is_refused() -> None:
    """The interceptor as a server listening beyond loopback holds it (the test itself
    listens on 127.0.0.1): control refused with PERMISSION_DENIED, other methods pass."""

    async def run() -> None:
        interceptor = ControlAccessInterceptor(
            ["/test.Service/Load"], token=None, loopback_only=False
        )
        server = grpc.aio.server(interceptors=[interceptor])

        async def echo(request: bytes, context: Any) -> bytes:
            return request

        handler = grpc.unary_unary_rpc_method_handler(echo)
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("test.Service", {"Load": handler,
                                                                    "Infer": handler})]
        )  # fmt: skip
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert await channel.unary_unary("/test.Service/Infer")(b"x", timeout=10) == b"x"
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await channel.unary_unary("/test.Service/Load")(b"x", timeout=10)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "--control-token-file" in (refused.value.details() or "")
        finally:
            await server.stop(0)

    asyncio.run(run())
