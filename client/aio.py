"""The clients' calls, written once: ``AsyncEmbeddingClient`` (client/aio.py, the source)
and ``EmbeddingClient`` (client/sync.py, generated from it by
``python scripts/gen_sync_client.py``).

    async with AsyncEmbeddingClient("127.0.0.1:50051") as client:
        hidden = await client.embed([[5, 6, 7, 8, 9, 10, 11, 12]])   # [1, 8, D] float32

    with EmbeddingClient("127.0.0.1:50051") as client:
        hidden = client.embed([[5, 6, 7, 8, 9, 10, 11, 12]])

The blocking client is thread-safe: one client (one channel, HTTP/2-multiplexed) serves
many threads. The asyncio client serves one event loop at a time (its ``Connection``
says why). Each is a thin shell: what is neither blocking nor awaited (encoding,
decoding, retries, the stream's bookkeeping, error mapping) is in ``_config``,
``_shared``, ``codec`` and ``decode``; what the two do differently (the channel, sleeping,
reading a stream's inputs) in ``_async_backend`` and ``_sync_backend``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import grpc
import numpy as np
import numpy.typing as npt

from tokembed.client import codec, decode, engines, text_codec
from tokembed.client._async_backend import Attempt, Connection, Inputs, iterate, sleep
from tokembed.client._config import ClientBase
from tokembed.client._retry import Deadline
from tokembed.client._shared import Attempts, Health, Methods, StreamBook, control_metadata
from tokembed.client.errors import EmbeddingError
from tokembed.client.results import (
    EmbedResult,
    ModelInfo,
    ModelList,
    NearestResult,
    RepositoryModel,
    TextEmbedResult,
    TokenizeResult,
)
from tokembed.client.vectors import nearest_request
from tokembed.v1 import embedding_pb2 as pb

if TYPE_CHECKING:
    from tokembed.client.shared_memory_aio import AsyncSharedMemorySession

T = TypeVar("T")


class AsyncEmbeddingClient(ClientBase):
    """A client of a tokembed server (see ``ClientBase.__init__`` for arguments)."""

    _connection: Connection

    def _open(self) -> None:
        self._connection = Connection(self._settings)

    # ------------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled. Idempotent."""
        self._closed = True
        await self._connection.close()

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ calls

    async def embed(
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
        methods = self._methods()
        call, deadline, model_name = self._embed_call(
            ids, dtype, layout, model, timeout_s, request_id, sequence_first, token_types
        )
        answer = await self._send(methods, call, deadline, model_name)
        if isinstance(answer, EmbedResult):
            return decode.check_array_shape(answer.hidden_states, call.leading_shape)
        # The array alone: the result object around it is for embed_result's callers.
        hidden = decode.embed_answer(answer, call.leading_shape, call.output_itemsize)
        self._learnt(model_name, hidden.shape[-1])
        return hidden

    async def embed_result(
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
        methods = self._methods()
        call, deadline, model_name = self._embed_call(
            ids, dtype, layout, model, timeout_s, request_id, sequence_first, token_types
        )
        result = await self._send(methods, call, deadline, model_name)
        if not isinstance(result, EmbedResult):
            result = decode.decode_response(result)
            self._learnt(model_name, result.hidden_states.shape[-1])
        return decode.check_shape(result, call.leading_shape, call.sequence_first)

    async def nearest(
        self,
        vectors: Any,
        k: int = 1,
        *,
        metric: str = "dot",
        logits: bool = False,
        apply_norm: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> NearestResult:
        """The way back: for each vector of ``vectors`` (``[N, D]`` or ``[B, S, D]``,
        float32, float16 or bfloat16), the ``k`` ids of the model's output table (its
        tied embedding table, or its exported output projection) that score highest by
        ``metric``: "dot" (the head's logits, transformers' ``lm_head(h)``) or "cosine".
        Returns ``ids`` and ``scores`` ``[..., k]`` (largest first, equal scores by the
        lower id), and ``logits`` ``[..., V]`` when ``logits=True``. ``apply_norm``: the
        model's final norm first (``lm_head(norm(h))``: the logit lens). ``model``,
        ``timeout_s``: as for :meth:`embed`. A large answer (above
        ``chunked_threshold_bytes``) comes as NearestChunked's stream of slices, each
        copied once into the arrays returned."""
        methods, metadata = self._methods(), self._metadata()
        model_name = self._model(model)
        request = nearest_request(vectors, k, metric, logits, apply_norm, model_name, request_id)
        deadline = self._deadline(timeout_s)
        if self._wants_chunked_nearest(model_name, request):

            async def chunked(timeout: float | None) -> NearestResult:
                stream = methods.nearest_chunked(request, timeout=timeout, metadata=metadata)
                try:
                    assembler = decode.TensorsChunkAssembler()
                    async for raw in stream:
                        assembler.add(raw)
                    return decode.nearest_result_of(*assembler.result())
                finally:
                    stream.cancel()

            result = await self._with_retries("Nearest", deadline, chunked)
        else:
            nearest = methods.nearest
            raw: bytes = await self._with_retries(
                "Nearest", deadline, lambda t: nearest(request, timeout=t, metadata=metadata)
            )
            result = decode.nearest_result(raw)
        if result.logits is not None:
            self._learnt_vocab(model_name, result.logits.shape[-1])
        return result

    async def tokenize(
        self,
        texts: str | bytes | Sequence[str | bytes],
        *,
        add_special_tokens: bool = True,
        truncation: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> TokenizeResult:
        """Texts (one, or several) tokenized by the model's own tokenizer, in one batch:
        ids, offsets and which tokens are special (``TokenizeResult``). A text longer than
        the model's limit (``info().tokenizer.max_length``) is refused (``TooLargeError``)
        unless ``truncation``; a model without a tokenizer refuses every text call."""
        tokenize, metadata = self._methods().tokenize, self._metadata()
        request = text_codec.tokenize_request(
            texts, add_special_tokens, truncation, self._model(model), request_id
        )
        raw: bytes = await self._with_retries(
            "Tokenize",
            self._deadline(timeout_s),
            lambda t: tokenize(request, timeout=t, metadata=metadata),
        )
        return text_codec.tokenize_result(raw)

    async def detokenize(
        self,
        ids: Any,
        *,
        skip_special_tokens: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> list[str]:
        """Token ids back to texts by the model's own tokenizer: one text per sequence
        (``ids``: one sequence of ints, sequences of any lengths, or a ``[B, S]`` array)."""
        detokenize, metadata = self._methods().detokenize, self._metadata()
        request = text_codec.detokenize_request(
            ids, skip_special_tokens, self._model(model), request_id
        )
        message = await self._with_retries(
            "Detokenize",
            self._deadline(timeout_s),
            lambda t: detokenize(request, timeout=t, metadata=metadata),
        )
        return list(message.texts)

    async def embed_text(
        self,
        texts: str | bytes | Sequence[str | bytes],
        dtype: codec.OutputDType | str = "float32",
        *,
        add_special_tokens: bool = True,
        truncation: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> TextEmbedResult:
        """Texts to vectors in one call: tokenized by the model's own tokenizer (as
        :meth:`tokenize`), then embedded. ``hidden_states [N, D]`` holds every text's rows
        one after another, ``lengths`` each text's tokens, ``input_ids`` their ids;
        ``sequences()`` gives each text's ``[len, D]``. A large answer (above
        ``chunked_threshold_bytes``, bounded before the texts are tokenized) comes as
        EmbedTextChunked's stream of slices, each copied once into the arrays returned."""
        methods, metadata = self._methods(), self._metadata()
        model_name = self._model(model)
        request = text_codec.embed_text_request(
            texts, dtype, add_special_tokens, truncation, model_name, request_id
        )
        deadline = self._deadline(timeout_s)
        if self._wants_chunked_text(model_name, request):

            async def chunked(timeout: float | None) -> TextEmbedResult:
                stream = methods.embed_text_chunked(request, timeout=timeout, metadata=metadata)
                try:
                    assembler = decode.TensorsChunkAssembler("EmbedTextChunked")
                    async for raw in stream:
                        assembler.add(raw)
                    return text_codec.embed_text_result_of(*assembler.result())
                finally:
                    stream.cancel()

            result = await self._with_retries("EmbedText", deadline, chunked)
        else:
            embed_text = methods.embed_text
            raw: bytes = await self._with_retries(
                "EmbedText", deadline, lambda t: embed_text(request, timeout=t, metadata=metadata)
            )
            result = text_codec.embed_text_result(raw)
        self._learnt(model_name, result.hidden_states.shape[-1])
        return result

    # ------------------------------------------------------------------ engine-ready answers

    async def embed_torch(
        self,
        ids: Any,
        dtype: codec.OutputDType | str = "float32",
        *,
        model: str | None = None,
        timeout_s: float | None = None,
    ) -> engines.TorchTensor:
        """:meth:`embed`'s answer as a torch tensor over the received bytes, without a
        copy (``torch.bfloat16`` for "bfloat16"): transformers' ``inputs_embeds``. Read-only
        like the array; ``.clone()`` it to write. Needs torch (the client's optional
        extra)."""
        hidden = await self.embed(ids, dtype, model=model, timeout_s=timeout_s)
        return engines.as_torch(hidden)

    async def vllm_prompt_embeds(
        self,
        ids: Any,
        dtype: str = "bfloat16",
        *,
        model: str | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """One prompt's ids (1-D) as vLLM's ``prompt_embeds``: base64 of ``torch.save`` of
        its ``[S, hidden]`` tensor in ``dtype`` ("float32", "bfloat16", "float16"), scaled
        as vLLM's model of this architecture expects (``ModelInfo.engine_scales``). Two
        calls: GetModelInfo, then Embed. Needs torch."""
        prompt = engines.one_prompt(ids)
        scale = engines.scale_for(await self.info(model, timeout_s=timeout_s), engines.VLLM)
        # Served in the dtype asked when nothing is to be scaled: the payload is then the
        # served tensor itself; else in float32, scaled once, then rounded.
        asked = dtype if scale == 1.0 and dtype in engines.VLLM_DTYPES else "float32"
        hidden = await self.embed([prompt], asked, model=model, timeout_s=timeout_s)
        return engines.vllm_prompt_embeds(hidden, dtype, scale=scale)

    async def sglang_input_embeds(
        self,
        ids: Any,
        *,
        model: str | None = None,
        timeout_s: float | None = None,
    ) -> list[list[float]]:
        """One prompt's ids (1-D) as SGLang's ``input_embeds``: ``[S, hidden]`` nested
        lists of floats, scaled as SGLang's model of this architecture expects
        (``ModelInfo.engine_scales``). Two calls: GetModelInfo, then Embed."""
        prompt = engines.one_prompt(ids)
        scale = engines.scale_for(await self.info(model, timeout_s=timeout_s), engines.SGLANG)
        hidden = await self.embed([prompt], model=model, timeout_s=timeout_s)
        return engines.sglang_input_embeds(hidden, scale=scale)

    async def shared_memory(
        self,
        capacity_bytes: int = 64 << 20,
        *,
        prefix: str = "tokembed",
        mode: int = 0o600,
    ) -> AsyncSharedMemorySession:
        """A shared-memory region of this client's, registered with a server on this host
        (``--shared-memory system``): its ``embed`` answers are written by the server into
        the region and returned as arrays over it, with no socket in between. Use it as a
        context manager; see ``tokembed.client.shared_memory`` for the contract."""
        channel = self._connected().channel()
        # Imported here: only the callers who use it load it (and the V2 messages).
        from tokembed.client.shared_memory_aio import AsyncSharedMemorySession

        session = AsyncSharedMemorySession(
            channel, target=self.target, metadata=self._metadata(),
            timeout_s=self._settings.timeout_s, model_name=self._settings.model_name,
            capacity_bytes=capacity_bytes, prefix=prefix, mode=mode,
        )  # fmt: skip
        await session._register()
        return session

    async def info(self, model: str | None = None, *, timeout_s: float | None = None) -> ModelInfo:
        """One served model and its limits: ``model`` (None: the client's ``model_name``;
        "": the server's default). Always asks the server."""
        get, metadata = self._methods().get_model_info, self._metadata()
        model_name = self._model(model)
        request = pb.GetModelInfoRequest(model_name=model_name)
        message = await self._with_retries(
            "GetModelInfo",
            self._deadline(timeout_s),
            lambda t: get(request, timeout=t, metadata=metadata),
        )
        info = ModelInfo.from_proto(message)
        self._learnt(model_name, info.d_model)
        self._learnt_vocab(model_name, info.vocab_size)
        return info

    model_info = info  # the name of releases before several models; the same method

    async def models(self, *, timeout_s: float | None = None) -> ModelList:
        """Every model the server serves, and its default (ListModels)."""
        list_models, metadata = self._methods().list_models, self._metadata()
        message = await self._with_retries(
            "ListModels",
            self._deadline(timeout_s),
            lambda t: list_models(pb.ListModelsRequest(), timeout=t, metadata=metadata),
        )
        return ModelList.from_proto(message)

    # ------------------------------------------------------------------ model control

    async def repository_index(
        self,
        *,
        ready_only: bool = False,
        control_token: str | None = None,
        timeout_s: float | None = None,
    ) -> list[RepositoryModel]:
        """Every model of the server's repository, each version with its state and the
        reason of a failure (RepositoryIndex). ``control_token``: the server's control
        token (``--control-token-file``), sent in place of the client's token."""
        control, metadata = self._methods().control(), self._control_metadata(control_token)
        request = control.v2.RepositoryIndexRequest(ready=ready_only)
        message = await self._with_retries(
            "RepositoryIndex",
            self._deadline(timeout_s),
            lambda t: control.index(request, timeout=t, metadata=metadata),
        )
        return [RepositoryModel(m.name, m.version, m.state, m.reason) for m in message.models]

    async def load_model(
        self,
        name: str,
        *,
        config: Mapping[str, Any] | None = None,
        force: bool = False,
        control_token: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Load ``name`` from the server's repository (RepositoryModelLoad); returns once
        its versions serve. ``config``: what the model's configuration may override (its
        ``version_policy``: ``{"latest": {"num_versions": 2}}``, ``{"all": {}}``,
        ``{"specific": {"versions": [1, 3]}}``); ``force``: load again even what is
        unchanged. A failed load raises ``ModelLoadError`` with its reason; what served
        before serves still."""
        control, metadata = self._methods().control(), self._control_metadata(control_token)
        request = control.load_request(name, config, force)
        await self._with_retries(
            "RepositoryModelLoad",
            self._deadline(timeout_s),
            lambda t: control.load(request, timeout=t, metadata=metadata),
        )

    async def unload_model(
        self, name: str, *, control_token: str | None = None, timeout_s: float | None = None
    ) -> None:
        """Unload ``name`` (RepositoryModelUnload): its new requests are refused at once,
        those admitted finish."""
        control, metadata = self._methods().control(), self._control_metadata(control_token)
        request = control.v2.RepositoryModelUnloadRequest(model_name=name)
        await self._with_retries(
            "RepositoryModelUnload",
            self._deadline(timeout_s),
            lambda t: control.unload(request, timeout=t, metadata=metadata),
        )

    def _control_metadata(self, control_token: str | None) -> tuple[tuple[str, str], ...]:
        return control_metadata(self._metadata(), control_token)

    async def embed_stream(
        self,
        inputs: Inputs,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[npt.NDArray[np.floating]]:
        """Embed each input over one EmbedStream; yields one array per input, in order.

        A failed input raises its typed error when its turn comes (answers before it have
        been yielded) and ends the stream. ``inputs``: an iterable (for the asyncio client,
        an async one too), read as the stream goes (the blocking client's, by a gRPC
        thread). ``timeout_s`` bounds the whole stream; the default is no deadline.
        Streams are not retried (the inputs are consumed as they go). ``model``: as for
        :meth:`embed`, for every input of the stream.
        """
        results = self.embed_stream_results(
            inputs,
            dtype,
            layout=layout,
            sequence_first=sequence_first,
            model=model,
            timeout_s=timeout_s,
        )
        async for result in results:
            yield result.hidden_states

    @overload
    def embed_stream_results(
        self,
        inputs: Inputs,
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        sequence_first: bool = ...,
        model: str | None = ...,
        timeout_s: float | None = ...,
        return_exceptions: Literal[False] = ...,
    ) -> AsyncIterator[EmbedResult]: ...

    @overload
    def embed_stream_results(
        self,
        inputs: Inputs,
        dtype: codec.OutputDType | str = ...,
        *,
        layout: codec.Layout = ...,
        sequence_first: bool = ...,
        model: str | None = ...,
        timeout_s: float | None = ...,
        return_exceptions: Literal[True],
    ) -> AsyncIterator[EmbedResult | EmbeddingError]: ...

    async def embed_stream_results(
        self,
        inputs: Inputs,
        dtype: codec.OutputDType | str = "float32",
        *,
        layout: codec.Layout = "padded",
        sequence_first: bool = False,
        model: str | None = None,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
    ) -> AsyncIterator[EmbedResult | EmbeddingError]:
        """Like :meth:`embed_stream`, yielding results; with ``return_exceptions=True`` a
        failed input yields its EmbeddingError in its place and the stream goes on."""
        embed_stream = self._methods().embed_stream
        book = StreamBook(dtype, layout, self._model(model), return_exceptions, sequence_first)

        async def requests() -> AsyncIterator[bytes]:
            try:
                async for item in iterate(inputs):
                    request = book.request(item)
                    if book.stopped:
                        return  # half-close; the answers raise its error in its turn
                    if request is not None:
                        yield request
            except Exception as exc:
                book.failure = exc

        call = embed_stream(requests(), timeout=timeout_s, metadata=self._metadata())
        try:
            try:
                async for raw in call:
                    for outcome in book.answer(raw):
                        yield outcome
            except grpc.RpcError as exc:
                raise book.broken(exc) from exc
            for outcome in book.end():
                yield outcome
            book.check_ended()
        finally:
            call.cancel()  # a no-op once the call has finished

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """The standard gRPC health status: "SERVING", "NOT_SERVING", "UNKNOWN", or
        "SERVICE_UNKNOWN" when the server knows no such service. Not retried: a health
        check reports the present. Needs the grpcio-health-checking package."""
        health = Health(self._connected().channel())
        try:
            response = await health.check(
                health.request(service),
                timeout=self._deadline(timeout_s).remaining_s(),
                metadata=self._metadata(),
            )
        except grpc.RpcError as exc:
            return health.failed(exc)
        return health.status(response)

    # ------------------------------------------------------------------ internals

    def _connected(self) -> Connection:
        """The connection, once the client is known to be open (a closed one raises)."""
        self._check_open()
        return self._connection

    def _methods(self) -> Methods:
        self._check_open()
        return self._connection.methods()

    async def _send(
        self, methods: Methods, call: codec.EmbedCall, deadline: Deadline, model_name: str
    ) -> EmbedResult | bytes:
        """One Embed call: its answer reassembled from EmbedChunked when it is large (see
        ``_wants_chunked``), else the raw bytes of Embed's answer."""
        request, metadata = call.request, self._metadata()
        if not self._wants_chunked(model_name, call):
            embed = methods.embed
            raw: bytes = await self._with_retries(
                "Embed", deadline, lambda t: embed(request, timeout=t, metadata=metadata)
            )
            return raw

        async def chunked(timeout: float | None) -> EmbedResult:
            stream = methods.embed_chunked(request, timeout=timeout, metadata=metadata)
            try:
                assembler = decode.ChunkAssembler()
                async for raw in stream:
                    assembler.add(raw)
                return assembler.result()
            finally:
                stream.cancel()

        return await self._with_retries("Embed", deadline, chunked)

    async def _with_retries(self, what: str, deadline: Deadline, attempt: Attempt[T]) -> T:
        attempts = Attempts(what, self._settings.retry, deadline, self._is_open)
        while True:
            try:
                return await attempt(attempts.timeout())
            except grpc.RpcError as exc:
                await sleep(attempts.failed(exc))
