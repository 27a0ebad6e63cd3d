"""The blocking client: ``EmbeddingClient``.

    with EmbeddingClient("127.0.0.1:50051") as client:
        hidden = client.embed([[5, 6, 7, 8, 9, 10, 11, 12]])   # [1, 8, D] float32

Thread-safe: one client (one channel, HTTP/2-multiplexed) can serve many threads. A thin
shell: what the two clients share (encoding, decoding, retries, the stream's bookkeeping,
error mapping) is in ``_config``, ``_shared``, ``codec`` and ``decode``; this module does
the blocking I/O around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import grpc
import numpy as np
import numpy.typing as npt

from tokembed.client import codec, decode
from tokembed.client._config import ClientBase
from tokembed.client._retry import Deadline
from tokembed.client._shared import Attempts, Health, Methods, StreamBook
from tokembed.client.errors import EmbeddingError
from tokembed.client.results import EmbedResult, ModelInfo, ModelList
from tokembed.v1 import embedding_pb2 as pb

if TYPE_CHECKING:
    from tokembed.client.shared_memory import SharedMemorySession

T = TypeVar("T")


class EmbeddingClient(ClientBase):
    """Blocking client of a tokembed server (see ``ClientBase.__init__`` for arguments)."""

    def _open(self) -> None:
        s = self._settings
        if s.credentials is not None:
            self._channel = grpc.secure_channel(s.target, s.credentials, options=s.options)
        else:
            self._channel = grpc.insecure_channel(s.target, options=s.options)
        self._methods = Methods(self._channel)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled. Idempotent."""
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def embed(
        self,
        ids: Any,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
        token_types: Any = None,
    ) -> npt.NDArray[np.floating]:
        """Embed ids; returns ``[B,S,D]`` (``[B,S_max,D]`` for ragged input, padded with
        the padding id's row) or ``[N,D]`` with ``layout="flat"``. With
        ``sequence_first=True`` a 2-D array of ids is ``[S,B]`` and the answer ``[S,B,D]``
        (``[S_max,B,D]`` for ragged input; see ``codec``).

        ``dtype``: "float32", "float16" or "bfloat16" (an ``ml_dtypes.bfloat16`` array).
        The array is a read-only view of the received bytes (zero-copy); ``.copy()`` it
        to write. ``model`` names the model for this call (None: the client's
        ``model_name``; "": the server's default). ``timeout_s`` overrides the client's
        default for this call. ``token_types``: for a model that takes them (a segment
        model, BERT's: ``info().inputs``), one token type id per id, in any form ``ids``
        takes and of their shape; None: every type is 0.
        """
        call, deadline, model_name = self._start_embed(
            ids, dtype, layout, model, timeout_s, request_id, sequence_first, token_types
        )
        if self._wants_chunked(model_name, call):
            result = self._with_retries("Embed", deadline, self._chunked_attempt(call))
            return decode.check_array_shape(result.hidden_states, call.leading_shape)
        raw = self._with_retries("Embed", deadline, self._unary_attempt(call))
        # The array alone: the result object around it is for embed_result's callers.
        hidden = decode.embed_answer(raw, call.leading_shape, call.output_itemsize)
        self._learnt(model_name, hidden.shape[-1])
        return hidden

    def embed_result(
        self,
        ids: Any,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
        token_types: Any = None,
    ) -> EmbedResult:
        """Like :meth:`embed`, with lengths, server timings and the model's name/version."""
        call, deadline, model_name = self._start_embed(
            ids, dtype, layout, model, timeout_s, request_id, sequence_first, token_types
        )
        if self._wants_chunked(model_name, call):
            result = self._with_retries("Embed", deadline, self._chunked_attempt(call))
        else:
            raw = self._with_retries("Embed", deadline, self._unary_attempt(call))
            result = decode.decode_response(raw)
            self._learnt(model_name, result.hidden_states.shape[-1])
        return decode.check_shape(result, call.leading_shape, call.sequence_first)

    def shared_memory(
        self,
        capacity_bytes: int = 64 << 20,
        *,
        prefix: str = "tokembed",
        mode: int = 0o600,
    ) -> SharedMemorySession:
        """A shared-memory region of this client's, registered with a server on this host
        (``--shared-memory system``): its ``embed`` answers are written by the server into
        the region and returned as arrays over it, with no socket in between. Use it as a
        context manager; see ``tokembed.client.shared_memory`` for the contract."""
        self._check_open()
        from tokembed.client.shared_memory import SharedMemorySession

        return SharedMemorySession(
            self._channel, target=self.target, metadata=self._metadata(),
            timeout_s=self._settings.timeout_s, model_name=self._settings.model_name,
            capacity_bytes=capacity_bytes, prefix=prefix, mode=mode,
        )  # fmt: skip

    def info(self, model: str | None = None, *, timeout_s: float | None = None) -> ModelInfo:
        """One served model and its limits: ``model`` (None: the client's ``model_name``;
        "": the server's default). Always asks the server."""
        self._check_open()
        return self._fetch_model_info(self._model(model), self._deadline(timeout_s))

    model_info = info  # the name of releases before several models; the same method

    def models(self, *, timeout_s: float | None = None) -> ModelList:
        """Every model the server serves, and its default (ListModels)."""
        self._check_open()
        list_models, metadata = self._methods.list_models, self._metadata()
        message = self._with_retries(
            "ListModels",
            self._deadline(timeout_s),
            lambda t: list_models(pb.ListModelsRequest(), timeout=t, metadata=metadata),
        )
        return ModelList.from_proto(message)

    def embed_stream(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[npt.NDArray[np.floating]]:
        """Embed each input over one EmbedStream; yields one array per input, in order.

        A failed input raises its typed error when its turn comes (answers before it have
        been yielded) and ends the stream. ``inputs`` is consumed by a gRPC thread.
        ``timeout_s`` bounds the whole stream; the default is no deadline. Streams are not
        retried (the inputs are consumed as they go). ``model``: as for :meth:`embed`, for
        every input of the stream.
        """
        results = self.embed_stream_results(
            inputs,
            dtype,
            layout=layout,
            sequence_first=sequence_first,
            model=model,
            timeout_s=timeout_s,
        )
        for result in results:
            yield result.hidden_states

    @overload
    def embed_stream_results(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        sequence_first: bool = ...,
        model: str | None = ...,
        timeout_s: float | None = ...,
        return_exceptions: Literal[False] = ...,
    ) -> Iterator[EmbedResult]: ...

    @overload
    def embed_stream_results(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        sequence_first: bool = ...,
        model: str | None = ...,
        timeout_s: float | None = ...,
        return_exceptions: Literal[True],
    ) -> Iterator[EmbedResult | EmbeddingError]: ...

    def embed_stream_results(
        self,
        inputs: Iterable[Any],
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
    ) -> Iterator[EmbedResult | EmbeddingError]:
        """Like :meth:`embed_stream`, yielding results; with ``return_exceptions=True`` a
        failed input yields its EmbeddingError in its place and the stream goes on."""
        self._check_open()
        book = StreamBook(dtype, layout, self._model(model), return_exceptions, sequence_first)

        def requests() -> Iterator[bytes]:
            try:
                for item in inputs:
                    request = book.request(item)
                    if book.stopped:
                        return  # half-close; the answers raise its error in its turn
                    if request is not None:
                        yield request
            except Exception as exc:
                book.failure = exc

        call = self._methods.embed_stream(requests(), timeout=timeout_s, metadata=self._metadata())
        try:
            try:
                for raw in call:
                    yield from book.answer(raw)
            except grpc.RpcError as exc:
                raise book.broken(exc) from exc
            yield from book.end()
            book.check_ended()
        finally:
            call.cancel()  # a no-op once the call has finished

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """The standard gRPC health status: "SERVING", "NOT_SERVING", "UNKNOWN", or
        "SERVICE_UNKNOWN" when the server knows no such service. Not retried: a health
        check reports the present. Needs the grpcio-health-checking package."""
        self._check_open()
        health = Health(self._channel)
        try:
            response = health.check(
                health.request(service),
                timeout=self._deadline(timeout_s).remaining_s(),
                metadata=self._metadata(),
            )
        except grpc.RpcError as exc:
            return health.failed(exc)
        return health.status(response)

    # ------------------------------------------------------------------ internals

    def _start_embed(
        self,
        ids: Any,
        dtype: Any,
        layout: str,
        model: str | None,
        timeout_s: float | None,
        request_id: str,
        sequence_first: bool,
        token_types: Any = None,
    ) -> tuple[codec.EmbedCall, Deadline, str]:
        """The call encoded, its deadline, and the model it is for."""
        self._check_open()
        call, deadline, model_name = self._embed_call(
            ids, dtype, layout, model, timeout_s, request_id, sequence_first, token_types
        )
        return call, deadline, model_name

    def _unary_attempt(self, call: codec.EmbedCall) -> Callable[[float | None], bytes]:
        """One Embed attempt with a given timeout: the answer's raw bytes."""
        embed, request, metadata = self._methods.embed, call.request, self._metadata()
        return lambda timeout: embed(request, timeout=timeout, metadata=metadata)

    def _chunked_attempt(self, call: codec.EmbedCall) -> Callable[[float | None], EmbedResult]:
        """One EmbedChunked attempt with a given timeout: the answer reassembled."""

        def attempt(timeout: float | None) -> EmbedResult:
            stream = self._methods.embed_chunked(
                call.request, timeout=timeout, metadata=self._metadata()
            )
            try:
                assembler = decode.ChunkAssembler()
                for raw in stream:
                    assembler.add(raw)
                return assembler.result()
            finally:
                stream.cancel()

        return attempt

    def _fetch_model_info(self, model_name: str, deadline: Deadline) -> ModelInfo:
        request = pb.GetModelInfoRequest(model_name=model_name)
        get, metadata = self._methods.get_model_info, self._metadata()
        message = self._with_retries(
            "GetModelInfo", deadline, lambda t: get(request, timeout=t, metadata=metadata)
        )
        info = ModelInfo.from_proto(message)
        self._learnt(model_name, info.d_model)
        return info

    def _with_retries(
        self, what: str, deadline: Deadline, attempt: Callable[[float | None], T]
    ) -> T:
        attempts = Attempts(what, self._settings.retry, deadline, self._is_open)
        while True:
            try:
                return attempt(attempts.timeout())
            except grpc.RpcError as exc:
                time.sleep(attempts.failed(exc))
