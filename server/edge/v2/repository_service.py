"""The Open Inference Protocol's model repository extension (Triton's): RepositoryIndex,
RepositoryModelLoad, RepositoryModelUnload, translated to the control plane
(``core.control.ModelControl``), so that tritonclient's ``get_model_repository_index``,
``load_model`` and ``unload_model`` drive tokembed unchanged.

RepositoryModelLoad's parameters, as tritonclient sends them: ``config`` (a string: the
model configuration as JSON, of which the control plane honours what it can, such as
``version_policy``); ``file:<path>`` (bytes: a file's contents to load the model from)
is refused, since tokembed loads only what its repository holds; tokembed's own
``force`` (a bool: load again even what is unchanged). RepositoryModelUnload's
``unload_dependents`` (no tokembed model depends on another) is accepted.

Who may call these is the edge's business too (``control_access``): they take their own
credential, not the data token.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from tokembed.server.core.control import ModelControl
from tokembed.server.core.dataplane import Refused
from tokembed.server.core.errors import EmbedError, InvalidInput
from tokembed.server.edge.v2.status import V2
from tokembed.v2 import grpc_service_pb2 as pb

CONTROL_METHODS = ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
FILE_PREFIX = "file:"


class RepositoryService:
    def __init__(self, control: ModelControl) -> None:
        self._control = control

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest | Refused, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        try:
            query = _parsed(request)
            entries = self._control.index(ready_only=query.ready)
        except EmbedError as error:
            await V2.abort(context, error)
        index = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(
            models=[
                index(name=e.name, version=e.version, state=e.state, reason=e.reason)
                for e in entries
            ]
        )

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest | Refused, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        try:
            load = _parsed(request)
            config, force = load_parameters(load.model_name, load.parameters)
            await self._control.load(_named(load.model_name), config=config, force=force)
        except EmbedError as error:
            await V2.abort(context, error)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self,
        request: pb.RepositoryModelUnloadRequest | Refused,
        context: grpc.aio.ServicerContext,
    ) -> pb.RepositoryModelUnloadResponse:
        try:
            unload = _parsed(request)
            for key, value in unload.parameters.items():
                if key != "unload_dependents" or value.WhichOneof("parameter_choice") != (
                    "bool_param"
                ):
                    raise InvalidInput(
                        f"RepositoryModelUnload: unknown parameter {key!r} (tokembed takes "
                        "unload_dependents, a bool, alone)"
                    )
            await self._control.unload(_named(unload.model_name))
        except EmbedError as error:
            await V2.abort(context, error)
        return pb.RepositoryModelUnloadResponse()

    def handlers(
        self, parse: Callable[[Any], Callable[[bytes], Any]]
    ) -> dict[str, grpc.RpcMethodHandler]:
        """The three methods, for the V2 front end's generic handler; ``parse``: a
        message class's deserializer (``requests.parse_message``)."""
        methods: dict[str, tuple[Callable[..., Awaitable[Any]], Any, Any]] = {
            "RepositoryIndex": (
                self.RepositoryIndex, pb.RepositoryIndexRequest, pb.RepositoryIndexResponse,
            ),
            "RepositoryModelLoad": (
                self.RepositoryModelLoad, pb.RepositoryModelLoadRequest,
                pb.RepositoryModelLoadResponse,
            ),
            "RepositoryModelUnload": (
                self.RepositoryModelUnload, pb.RepositoryModelUnloadRequest,
                pb.RepositoryModelUnloadResponse,
            ),
        }  # fmt: skip
        return {
            name: grpc.unary_unary_rpc_method_handler(
                handler, parse(request), response.SerializeToString
            )
            for name, (handler, request, response) in methods.items()
        }


def load_parameters(
    name: str, parameters: Mapping[str, pb.ModelRepositoryParameter]
) -> tuple[dict[str, Any] | None, bool]:
    """RepositoryModelLoad's parameters as (the config's JSON object, force);
    ``InvalidInput`` naming what cannot be honoured."""
    config: dict[str, Any] | None = None
    force = False
    files = sorted(key for key in parameters if key.startswith(FILE_PREFIX))
    if files:
        raise InvalidInput(
            f"RepositoryModelLoad of {name!r}: file contents ({', '.join(files)}) cannot be "
            "loaded: tokembed serves what its repository holds; copy the version's model "
            "directory into the repository (DIR/<model>/<version>/), then load it"
        )
    for key, value in parameters.items():
        kind = value.WhichOneof("parameter_choice")
        if key == "config" and kind == "string_param":
            try:
                parsed = json.loads(value.string_param) if value.string_param else {}
            except ValueError as exc:
                raise InvalidInput(
                    f"RepositoryModelLoad of {name!r}: config is not valid JSON: {exc}"
                ) from exc
            if not isinstance(parsed, dict):
                raise InvalidInput(
                    f"RepositoryModelLoad of {name!r}: config must be a JSON object, got "
                    f"{type(parsed).__name__}"
                )
            config = parsed
        elif key == "force" and kind == "bool_param":
            force = value.bool_param
        else:
            raise InvalidInput(
                f"RepositoryModelLoad of {name!r}: unknown parameter {key!r} ({kind}); "
                "tokembed takes config (a JSON string) and force (a bool)"
            )
    return config, force


def _named(name: str) -> str:
    if not name:
        raise InvalidInput("the request names no model (model_name is empty)")
    return name


def _parsed(request: Any) -> Any:
    if isinstance(request, Refused):
        raise request.error
    return request
