"""What the sync and asyncio clients share beyond their settings: the methods on a
channel, the attempts of a retried call, the bookkeeping of an EmbedStream, and the
health check's messages. Each client is then a thin shell that does the I/O (blocking,
or awaited) around these, as httpx's Client and AsyncClient are around its models.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from tokembed.client import codec, decode
from tokembed.client._config import (
    METHOD_DETOKENIZE,
    METHOD_EMBED,
    METHOD_EMBED_CHUNKED,
    METHOD_EMBED_STREAM,
    METHOD_EMBED_TEXT,
    METHOD_EMBED_TEXT_CHUNKED,
    METHOD_GET_MODEL_INFO,
    METHOD_LIST_MODELS,
    METHOD_NEAREST,
    METHOD_NEAREST_CHUNKED,
    METHOD_TOKENIZE,
)
from tokembed.client._retry import Deadline, RetryPolicy, give_up
from tokembed.client.errors import EmbeddingError, from_rpc_error, protocol_error
from tokembed.client.results import EmbedResult
from tokembed.v1 import embedding_pb2 as pb

logger = logging.getLogger("tokembed.client")


class Methods:
    """tokembed.v1's methods on one channel, a blocking or an asyncio one alike.

    Bytes both ways for the Embed methods: requests are encoded by ``codec``, answers
    decoded by ``decode`` from the raw bytes, pointing the array at them (no copy).
    """

    def __init__(self, channel: Any) -> None:
        self.embed = channel.unary_unary(METHOD_EMBED)
        self.embed_chunked = channel.unary_stream(METHOD_EMBED_CHUNKED)
        self.embed_stream = channel.stream_stream(METHOD_EMBED_STREAM)
        self.get_model_info = channel.unary_unary(
            METHOD_GET_MODEL_INFO,
            request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.ModelInfo.FromString,
        )
        self.list_models = channel.unary_unary(
            METHOD_LIST_MODELS,
            request_serializer=pb.ListModelsRequest.SerializeToString,
            response_deserializer=pb.ListModelsResponse.FromString,
        )
        # Answers of several named tensors (Tokenize, EmbedText, Nearest) come as raw
        # bytes, decoded in place (``text_codec.named_tensors``).
        self.tokenize = channel.unary_unary(
            METHOD_TOKENIZE, request_serializer=pb.TokenizeRequest.SerializeToString
        )
        self.detokenize = channel.unary_unary(
            METHOD_DETOKENIZE,
            request_serializer=pb.DetokenizeRequest.SerializeToString,
            response_deserializer=pb.DetokenizeResponse.FromString,
        )
        self.embed_text = channel.unary_unary(
            METHOD_EMBED_TEXT, request_serializer=pb.EmbedTextRequest.SerializeToString
        )
        self.embed_text_chunked = channel.unary_stream(
            METHOD_EMBED_TEXT_CHUNKED, request_serializer=pb.EmbedTextRequest.SerializeToString
        )
        self.nearest = channel.unary_unary(
            METHOD_NEAREST, request_serializer=pb.NearestRequest.SerializeToString
        )
        self.nearest_chunked = channel.unary_stream(
            METHOD_NEAREST_CHUNKED, request_serializer=pb.NearestRequest.SerializeToString
        )
        self._channel = channel
        self._control: ControlMethods | None = None

    def control(self) -> ControlMethods:
        """The model repository's methods (made on first use: most clients never load)."""
        if self._control is None:
            self._control = ControlMethods(self._channel)
        return self._control


class ControlMethods:
    """The Open Inference Protocol's model repository methods (load, unload, the index),
    which tokembed serves under Triton's service name."""

    def __init__(self, channel: Any) -> None:
        from tokembed.v2 import grpc_service_pb2 as v2

        self.v2 = v2
        service = "/inference.GRPCInferenceService/"
        self.index = channel.unary_unary(
            service + "RepositoryIndex",
            request_serializer=v2.RepositoryIndexRequest.SerializeToString,
            response_deserializer=v2.RepositoryIndexResponse.FromString,
        )
        self.load = channel.unary_unary(
            service + "RepositoryModelLoad",
            request_serializer=v2.RepositoryModelLoadRequest.SerializeToString,
            response_deserializer=v2.RepositoryModelLoadResponse.FromString,
        )
        self.unload = channel.unary_unary(
            service + "RepositoryModelUnload",
            request_serializer=v2.RepositoryModelUnloadRequest.SerializeToString,
            response_deserializer=v2.RepositoryModelUnloadResponse.FromString,
        )

    def load_request(self, name: str, config: Mapping[str, Any] | None, force: bool) -> Any:
        request = self.v2.RepositoryModelLoadRequest(model_name=name)
        if config is not None:
            request.parameters["config"].string_param = json.dumps(dict(config))
        if force:
            request.parameters["force"].bool_param = True
        return request


def control_metadata(
    metadata: tuple[tuple[str, str], ...], control_token: str | None
) -> tuple[tuple[str, str], ...]:
    """A control call's metadata: the control token in place of the data token, when one
    is given."""
    if control_token is None:
        return metadata
    kept = tuple((key, value) for key, value in metadata if key != "authorization")
    return (*kept, ("authorization", f"Bearer {control_token}"))


class Attempts:
    """The attempts of one retried call: the time each may take (what is left of the
    call's deadline), and, after a failure, how long to wait before the next one, or the
    typed error that ends the call."""

    def __init__(
        self, what: str, policy: RetryPolicy, deadline: Deadline, is_open: Callable[[], bool]
    ) -> None:
        """``is_open``: whether the client is still open (a call cancelled by closing
        the client is the caller's own doing, and never retried)."""
        self._what = what
        self._policy = policy
        self._deadline = deadline
        self._is_open = is_open
        self._made = 0

    def timeout(self) -> float | None:
        """The next attempt's timeout (None: no deadline)."""
        self._made += 1
        return self._deadline.remaining_s()

    def failed(self, exc: grpc.RpcError) -> float:
        """The seconds to wait before trying again; raises the typed error instead when
        the policy, the attempts made or the time left say the call is over."""
        error = from_rpc_error(exc)
        if not self._is_open() or not self._policy.should_retry(error, self._made):
            raise give_up(error, self._made) from exc
        delay = self._policy.delay_s(self._made - 1)
        if not self._deadline.allows_sleep(delay):
            raise give_up(error, self._made) from exc
        logger.info("%s failed (%s); retry %d in %.3f s", self._what, error, self._made, delay)
        return delay


class StreamBook:
    """One EmbedStream's bookkeeping: each input encoded (or refused before sending), and
    each answer matched, in order, with the input it answers.

    ``request(item)`` gives an input's request bytes, or ``None`` for one refused before
    sending (its error takes its turn among the answers); ``stopped`` then says whether
    the stream must end there (a refused input, without ``return_exceptions``).
    ``answer(raw)`` and
    ``end()`` give the outcomes due, in order: results, or errors where
    ``return_exceptions`` (without it, an error is raised in its turn).
    """

    def __init__(
        self,
        dtype: Any,
        layout: str,
        model_name: str,
        return_exceptions: bool,
        sequence_first: bool = False,
    ) -> None:
        self._layout = codec.check_layout(layout, sequence_first)
        codec.output_dtype(dtype)  # refused here, before anything is sent
        self._dtype = dtype
        self._sequence_first = sequence_first
        self._model_name = model_name
        self._return_exceptions = return_exceptions
        # Per input, in order: the answer's expected leading shape (the request went out)
        # or the error that kept the input from being sent.
        self._slots: collections.deque[tuple[int, ...] | EmbeddingError] = collections.deque()
        # A failure of the caller's input iterator (gRPC would log it and cancel the
        # call; it is kept for the caller instead).
        self.failure: BaseException | None = None
        self.stopped = False

    def request(self, item: Any) -> bytes | None:
        try:
            call = codec.embed_call(
                item,
                self._dtype,
                self._layout,
                model_name=self._model_name,
                sequence_first=self._sequence_first,
            )
        except EmbeddingError as error:
            self._slots.append(error)
            self.stopped = not self._return_exceptions
            return None
        # The slot goes in before the request goes out, so it is there when the answer
        # comes back.
        self._slots.append(call.leading_shape)
        return call.request

    def answer(self, raw: bytes) -> list[EmbedResult | EmbeddingError]:
        outcomes = self._refused()
        if not self._slots:
            raise protocol_error("EmbedStream sent more answers than requests")
        leading = self._slots.popleft()
        assert isinstance(leading, tuple), "This is a bug."
        outcome = decode.decode_stream_response(raw)
        if isinstance(outcome, EmbedResult):
            outcome = decode.check_shape(outcome, leading, self._sequence_first)
        outcomes.append(outcome)
        return [self._emit(each) for each in outcomes]

    def end(self) -> list[EmbedResult | EmbeddingError]:
        """The outcomes left once the stream ended (inputs refused after the last answer)."""
        return [self._emit(each) for each in self._refused()]

    def check_ended(self) -> None:
        """Raise what ended the stream early, once every outcome before it is out."""
        if self.failure is not None:
            raise self.failure
        if self._slots:
            raise protocol_error("EmbedStream ended with requests unanswered")

    def broken(self, exc: grpc.RpcError) -> BaseException:
        """What to raise when the stream itself failed."""
        return self.failure if self.failure is not None else from_rpc_error(exc)

    def _refused(self) -> list[EmbedResult | EmbeddingError]:
        """The inputs at the front refused before sending (no answer comes for them)."""
        refused: list[EmbedResult | EmbeddingError] = []
        while self._slots and isinstance(self._slots[0], EmbeddingError):
            slot = self._slots.popleft()
            assert isinstance(slot, EmbeddingError), "This is a bug."
            refused.append(slot)
        return refused

    def _emit(self, outcome: EmbedResult | EmbeddingError) -> EmbedResult | EmbeddingError:
        if isinstance(outcome, EmbeddingError) and not self._return_exceptions:
            raise outcome
        return outcome


class Health:
    """The standard gRPC health check's messages (grpcio-health-checking, imported on
    use: only health-minded callers need the package)."""

    def __init__(self, channel: Any) -> None:
        try:
            from grpc_health.v1 import health_pb2, health_pb2_grpc
        except ImportError as exc:
            raise EmbeddingError(
                "health checks need the grpcio-health-checking package "
                "(pip install 'tokembed[server]', whose pin of it installs beside tritonclient)"
            ) from exc
        self._pb = health_pb2
        self.check: Callable[..., Any] = health_pb2_grpc.HealthStub(channel).Check

    def request(self, service: str) -> Any:
        return self._pb.HealthCheckRequest(service=service)

    def status(self, response: Any) -> str:
        return str(self._pb.HealthCheckResponse.ServingStatus.Name(response.status))

    @staticmethod
    def failed(exc: grpc.RpcError) -> str:
        """A check that failed: "SERVICE_UNKNOWN" when the server knows no such service;
        anything else raises its typed error."""
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return "SERVICE_UNKNOWN"
        raise from_rpc_error(exc) from exc
