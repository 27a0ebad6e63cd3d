"""System shared memory in the V2 front end: the three RPCs, where inputs are read from,
and the sink that writes an answer into a region (the registry itself: ``shm``).

- ``SystemSharedMemoryRegister`` / ``Status`` / ``Unregister``: the registry's calls, in
  Triton's messages, for the caller's identity (``auth.Identities``: whose regions they
  are); a refusal is INVALID_ARGUMENT (through the V2 status table) with the registry's
  message.
- ``SharedMemoryInputs``: ModelInfer's input source (``requests.InputSource``). An input
  whose parameters name a ``shared_memory_region`` (``shared_memory_offset``, default 0,
  and ``shared_memory_byte_size``) is an ``InRegion``: nothing is read while parsing; the
  RPC's handler tells it its caller, and the data plane reads it from that caller's
  region once the request's inputs fit the model and its declared size is what its shape
  needs (a large read on a worker thread). Any other input is the request's own bytes.
  The region is held only while it is read.
- ``SharedMemorySink``: a ModelInfer whose requested output names a region gets this sink:
  the answer's bytes go into the region (on the thread that frames it, as a unary answer's
  join would), and the response carries the output's name, datatype and shape but no tensor
  bytes. The window is held from before the request is served until its RPC has ended
  (gRPC's done callback, whatever the ending), so unregistering waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tokembed.export.manifest import OUTPUT_NAME
from tokembed.server.core.calls import Call
from tokembed.server.core.dataplane import Refused, Sink
from tokembed.server.core.errors import EmbedError, Internal, InvalidInput
from tokembed.server.core.operations.embed_request import Unread
from tokembed.server.core.types import Answer
from tokembed.server.edge.auth import Identities
from tokembed.server.edge.v2.requests import CallersInput, InputSource, in_request
from tokembed.server.edge.v2.shm import SharedMemoryRegistry
from tokembed.server.edge.v2.shm_region import SharedMemoryError, Window
from tokembed.v2 import grpc_service_pb2 as pb

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"


def names_region(parameters: Mapping[str, pb.InferParameter]) -> bool:
    return REGION in parameters


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """The window a tensor's parameters name, not yet looked up."""

    region: str
    offset: int
    byte_size: int


def window_spec(tensor: str, parameters: Mapping[str, pb.InferParameter]) -> WindowSpec:
    """The window a tensor's parameters name, or ``InvalidInput``."""
    region = parameters[REGION]
    if region.WhichOneof("parameter_choice") != "string_param":
        raise InvalidInput(f"{tensor}: parameter {REGION} must be a string")
    if BYTE_SIZE not in parameters:
        raise InvalidInput(f"{tensor}: parameter {BYTE_SIZE} is missing beside {REGION}")
    byte_size = _integer(tensor, parameters, BYTE_SIZE)
    offset = _integer(tensor, parameters, OFFSET) if OFFSET in parameters else 0
    return WindowSpec(region.string_param, offset, byte_size)


def window_of(
    registry: SharedMemoryRegistry,
    tensor: str,
    parameters: Mapping[str, pb.InferParameter],
    owner: str,
) -> Window:
    """The window of ``owner``'s region a tensor's parameters name (held: release it), or
    ``InvalidInput``."""
    spec = window_spec(tensor, parameters)
    return registry.use(spec.region, spec.offset, spec.byte_size, owner=owner)


def _integer(tensor: str, parameters: Mapping[str, pb.InferParameter], name: str) -> int:
    parameter = parameters[name]
    kind = parameter.WhichOneof("parameter_choice")
    if kind == "int64_param":
        return int(parameter.int64_param)
    if kind == "uint64_param":
        return int(parameter.uint64_param)
    raise InvalidInput(f"{tensor}: parameter {name} must be an integer")


# Reads up to this size are done on the event loop (such a copy costs less than the hop
# to a thread); larger ones on a worker thread, so that no read holds the loop.
INLINE_READ_BYTES = 64 * 1024


class SharedMemoryInputs:
    """ModelInfer's input source: a region where an input names one, else the request.
    Nothing is read here (``InRegion``)."""

    def __init__(
        self, registry: SharedMemoryRegistry, max_bytes: int, request: InputSource = in_request
    ) -> None:
        self._registry = registry
        self._max_bytes = max_bytes
        self._request = request

    def __call__(self, request: pb.ModelInferRequest, index: int) -> bytes | Unread:
        tensor = request.inputs[index]
        if not names_region(tensor.parameters):
            return self._request(request, index)
        if request.raw_input_contents:
            raise InvalidInput(
                f"input {tensor.name!r} names a shared-memory region and has "
                "raw_input_contents too; send one"
            )
        spec = window_spec(f"input {tensor.name!r}", tensor.parameters)
        return InRegion(self._registry, spec, self._max_bytes)


class InRegion(CallersInput):
    """An input's bytes in a window of its caller's region: the region is looked up and
    held only while they are read, when the data plane asks."""

    __slots__ = ("_max_bytes", "_registry", "_spec")

    def __init__(self, registry: SharedMemoryRegistry, spec: WindowSpec, max_bytes: int) -> None:
        super().__init__()
        self._registry = registry
        self._spec = spec
        self._max_bytes = max_bytes

    @property
    def nbytes(self) -> int:
        return self._spec.byte_size

    async def read(self) -> bytes:
        spec = self._spec
        if self.caller is None:
            raise Internal("this is a bug: a region's input was read before its caller was named")
        window = self._registry.use(spec.region, spec.offset, spec.byte_size, owner=self.caller)
        try:
            if spec.byte_size <= INLINE_READ_BYTES:
                return window.read(self._max_bytes)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, window.read, self._max_bytes)
        finally:
            window.release()  # a copy still running keeps the descriptor open (shm_region)


def output_window(
    registry: SharedMemoryRegistry,
    outputs: Sequence[pb.ModelInferRequest.InferRequestedOutputTensor],
    owner: Callable[[], str],
) -> Window | None:
    """The window of the caller's region the requested output names (held), None when it
    names none; ``owner()``: the caller (asked only then)."""
    for output in outputs:
        if names_region(output.parameters):
            return window_of(registry, f"output {output.name}", output.parameters, owner())
    return None


def output_windows(
    registry: SharedMemoryRegistry,
    outputs: Sequence[pb.ModelInferRequest.InferRequestedOutputTensor],
    owner: Callable[[], str],
) -> dict[str, Window]:
    """Per requested output that names a region of the caller's, its window (held; on a
    refusal, those taken already are let go): an answer of several named tensors."""
    windows: dict[str, Window] = {}
    try:
        for output in outputs:
            if names_region(output.parameters):
                windows[output.name] = window_of(
                    registry, f"output {output.name}", output.parameters, owner()
                )
    except BaseException:
        for window in windows.values():
            window.release()
        raise
    return windows


class SharedMemorySink(Sink[bytes]):
    """ModelInfer with its output in a region: the answer written there, the response
    without tensor bytes. ``window`` is released when the RPC ends."""

    def __init__(self, context: grpc.aio.ServicerContext, window: Window) -> None:
        self._window = window
        self.payload = b""
        context.add_done_callback(lambda _context: window.release())

    def frame(self, answer: Answer, call: Call) -> bytes:
        self._window.write(answer.pieces, answer.nbytes)
        return pb.ModelInferResponse(
            model_name=answer.model_name,
            model_version=answer.model_version,
            id=call.request_id,
            outputs=[
                pb.ModelInferResponse.InferOutputTensor(
                    name=OUTPUT_NAME, datatype=answer.dtype.v2, shape=list(answer.shape)
                )
            ],
        ).SerializeToString()

    async def send(self, framed: bytes, sent: Callable[[], None]) -> None:
        self.payload = framed
        sent()  # the answer is in the region already; the response is a few bytes


class TensorsSharedMemorySink(Sink[bytes]):
    """ModelInfer of an answer of several named tensors (NAME.nearest's, texts in) with some of its
    outputs in regions: each of those written into its own window (every size checked
    before any is written), the others in the response; the response lists every output,
    with an empty raw content for one in a region (the contents are by output index).
    The windows are released when the RPC ends."""

    def __init__(self, context: grpc.aio.ServicerContext, windows: dict[str, Window]) -> None:
        self._windows = windows
        self.payload = b""

        def release(_context: Any) -> None:
            for window in windows.values():
                window.release()

        context.add_done_callback(release)

    def frame(self, answer: Answer, call: Call) -> bytes:
        windows = self._windows
        for tensor in answer.tensors:
            window = windows.get(tensor.name)
            if window is not None and tensor.nbytes > window.byte_size:
                raise SharedMemoryError(
                    f"output {tensor.name} is {tensor.nbytes} bytes, over the "
                    f"shared_memory_byte_size {window.byte_size} given for it in region "
                    f"{window.name!r} (its shape is {list(tensor.shape)} of "
                    f"{tensor.dtype.v2}); nothing was written"
                )
        for tensor in answer.tensors:
            window = windows.get(tensor.name)
            if window is not None:
                window.write(tensor.pieces, tensor.nbytes)
        in_response = [t for t in answer.tensors if t.name not in windows]
        return pb.ModelInferResponse(
            model_name=answer.model_name,
            model_version=answer.model_version,
            id=call.request_id,
            outputs=[
                pb.ModelInferResponse.InferOutputTensor(
                    name=t.name, datatype=t.dtype.v2, shape=list(t.shape)
                )
                for t in answer.tensors
            ],
            raw_output_contents=(
                [b"" if t.name in windows else b"".join(t.pieces) for t in answer.tensors]
                if in_response
                else []
            ),
        ).SerializeToString()

    async def send(self, framed: bytes, sent: Callable[[], None]) -> None:
        self.payload = framed
        sent()  # the region's outputs are written already; the rest is the response


# --- the RPCs


class SharedMemoryService:
    """SystemSharedMemoryRegister, Status and Unregister over the registry, each for the
    caller's identity. ``abort``: the front end's way to end a call with a domain error
    (its status table)."""

    def __init__(
        self,
        registry: SharedMemoryRegistry,
        abort: Callable[[grpc.aio.ServicerContext, EmbedError], Awaitable[Any]],
        identities: Identities,
    ) -> None:
        self._registry = registry
        self._abort = abort
        self._identities = identities

    async def SystemSharedMemoryRegister(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.SystemSharedMemoryRegisterResponse:
        try:
            asked = _parsed(request)
            self._registry.register(
                asked.name, asked.key, asked.offset, asked.byte_size,
                owner=self._identities.of(context),
            )  # fmt: skip
        except EmbedError as error:
            await self._abort(context, error)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryStatus(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.SystemSharedMemoryStatusResponse:
        try:
            regions = self._registry.status(
                _parsed(request).name, owner=self._identities.of(context)
            )
        except EmbedError as error:
            await self._abort(context, error)
        response = pb.SystemSharedMemoryStatusResponse()
        for region in regions:
            entry = response.regions[region.name]
            entry.name = region.name
            entry.key = region.key
            entry.offset = region.offset
            entry.byte_size = region.byte_size
        return response

    async def SystemSharedMemoryUnregister(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        try:
            await self._registry.unregister(
                _parsed(request).name, owner=self._identities.of(context)
            )
        except EmbedError as error:
            await self._abort(context, error)
        return pb.SystemSharedMemoryUnregisterResponse()

    def handlers(
        self, parse: Callable[[Any], Callable[[bytes], Any]]
    ) -> dict[str, grpc.RpcMethodHandler]:
        """The three methods, for the V2 front end's generic handler; ``parse``: a
        message class's deserializer (``requests.parse_message``)."""
        methods: dict[str, tuple[Callable[..., Awaitable[Any]], Any, Any]] = {
            "SystemSharedMemoryRegister": (
                self.SystemSharedMemoryRegister, pb.SystemSharedMemoryRegisterRequest,
                pb.SystemSharedMemoryRegisterResponse,
            ),
            "SystemSharedMemoryStatus": (
                self.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest,
                pb.SystemSharedMemoryStatusResponse,
            ),
            "SystemSharedMemoryUnregister": (
                self.SystemSharedMemoryUnregister, pb.SystemSharedMemoryUnregisterRequest,
                pb.SystemSharedMemoryUnregisterResponse,
            ),
        }  # fmt: skip
        return {
            name: grpc.unary_unary_rpc_method_handler(
                handler, parse(request), response.SerializeToString
            )
            for name, (handler, request, response) in methods.items()
        }


def _parsed(request: Any) -> Any:
    """The request, or the error its bytes were refused with (``parse_message``)."""
    if isinstance(request, Refused):
        raise request.error
    return request
