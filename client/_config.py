"""What the sync and asyncio clients share: settings, channel options, the constructor.
The retry policy and a call's deadline: _retry.py.

Both clients take the same keyword arguments; :func:`make_settings` validates them once
and turns them into the pieces a channel needs (options, credentials, call metadata).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tokembed import __version__
from tokembed.client import codec, dtypes
from tokembed.client._retry import (
    DEFAULT_BACKOFF_MAX_S,
    DEFAULT_BACKOFF_S,
    DEFAULT_RETRIES,
    Deadline,
    RetryPolicy,
)
from tokembed.client.errors import (
    EmbeddingError,
    client_invalid_input,
)
from tokembed.v1 import embedding_pb2 as pb

logger = logging.getLogger("tokembed.client")

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 30.0
# Large enough for any reply a default server may send (its own limit follows its
# configured max output bytes; GetModelInfo reports it as limits.max_message_bytes).
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Above this many output bytes the client asks for the answer as a stream of ~1 MiB
# chunks: below it, unary and chunked measured even; above it, chunked is faster
# (docs/benchmarks/README.md has the figures).
DEFAULT_CHUNKED_THRESHOLD_BYTES = 16 * 1024 * 1024

LOAD_BALANCING_POLICIES = ("round_robin", "pick_first")

_SERVICE = pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name
METHOD_EMBED = f"/{_SERVICE}/Embed"
METHOD_EMBED_STREAM = f"/{_SERVICE}/EmbedStream"
METHOD_EMBED_CHUNKED = f"/{_SERVICE}/EmbedChunked"
METHOD_GET_MODEL_INFO = f"/{_SERVICE}/GetModelInfo"
METHOD_LIST_MODELS = f"/{_SERVICE}/ListModels"
METHOD_NEAREST = f"/{_SERVICE}/Nearest"
METHOD_NEAREST_CHUNKED = f"/{_SERVICE}/NearestChunked"
METHOD_TOKENIZE = f"/{_SERVICE}/Tokenize"
METHOD_DETOKENIZE = f"/{_SERVICE}/Detokenize"
METHOD_EMBED_TEXT = f"/{_SERVICE}/EmbedText"
METHOD_EMBED_TEXT_CHUNKED = f"/{_SERVICE}/EmbedTextChunked"

PemSource = str | os.PathLike[str] | bytes


@dataclass(frozen=True)
class Settings:
    target: str
    timeout_s: float | None
    retry: RetryPolicy
    max_message_bytes: int
    credentials: Any  # grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, Any], ...]
    chunked_threshold_bytes: int | None
    model_name: str


def _read_pem(source: PemSource | None, what: str) -> bytes | None:
    if source is None:
        return None
    if isinstance(source, bytes):
        return source
    try:
        with open(source, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise EmbeddingError(f"cannot read {what} {os.fspath(source)!r}: {exc}") from exc


def make_settings(
    target: str,
    *,
    timeout_s: float | None,
    retries: int,
    backoff_s: float,
    backoff_max_s: float,
    retry_on_overload: bool,
    max_message_bytes: int,
    tls: bool,
    root_certificates: PemSource | None,
    client_certificate: PemSource | None,
    client_key: PemSource | None,
    tls_server_name: str | None,
    token: str | None,
    load_balancing_policy: str | None,
    chunked_threshold_bytes: int | None,
    model_name: str,
    keepalive_time_s: float | None,
    channel_options: tuple[tuple[str, Any], ...],
) -> Settings:
    """Validate the client's arguments once; a bad one raises EmbeddingError."""
    if not target:
        raise EmbeddingError("target must not be empty (e.g. 127.0.0.1:50051)")
    if timeout_s is not None and not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise EmbeddingError(f"timeout_s must be a positive number or None, got {timeout_s}")
    if retries < 0:
        raise EmbeddingError(f"retries must be >= 0, got {retries}")
    if backoff_s < 0 or backoff_max_s < 0:
        raise EmbeddingError("backoff_s and backoff_max_s must be >= 0")
    if max_message_bytes <= 0:
        raise EmbeddingError(f"max_message_bytes must be positive, got {max_message_bytes}")
    if chunked_threshold_bytes is not None and chunked_threshold_bytes < 0:
        raise EmbeddingError("chunked_threshold_bytes must be >= 0, or None to never chunk")
    if load_balancing_policy is not None and load_balancing_policy not in LOAD_BALANCING_POLICIES:
        raise EmbeddingError(
            f"load_balancing_policy must be one of {LOAD_BALANCING_POLICIES} or None, "
            f"got {load_balancing_policy!r}"
        )
    if keepalive_time_s is not None and not keepalive_time_s > 0:
        raise EmbeddingError(f"keepalive_time_s must be positive or None, got {keepalive_time_s}")
    if (client_certificate is None) != (client_key is None):
        raise EmbeddingError("mutual TLS needs both client_certificate and client_key")

    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.primary_user_agent", f"tokembed-client/{__version__}"),
        # Reconnect quickly after a replica restarts, without hammering a dead one.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 5000),
    ]
    if keepalive_time_s is not None:
        # Pings only while calls are open (permit_without_calls=0): they find a dead peer
        # (a replica that vanished without closing its connection) without tripping the
        # server's too-many-pings guard on idle connections.
        options += [
            ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.keepalive_permit_without_calls", 0),
        ]
    if load_balancing_policy is not None:
        # With round_robin the channel connects to every address the name resolves to
        # (dns:///host:port, or ipv4:a:p1,b:p2) and spreads calls over them; the default,
        # pick_first, sends everything over one connection.
        config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing_policy: {}}]}
        options.append(("grpc.service_config", json.dumps(config)))
    if tls_server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    options += list(channel_options)

    credentials = None
    secure = tls or root_certificates is not None or client_certificate is not None
    if secure:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read_pem(root_certificates, "root certificates"),
            private_key=_read_pem(client_key, "client key"),
            certificate_chain=_read_pem(client_certificate, "client certificate"),
        )
    metadata: tuple[tuple[str, str], ...] = ()
    if token is not None:
        token = token.strip()
        if not token or any(c.isspace() or not c.isprintable() for c in token):
            raise EmbeddingError("token must be non-empty printable text without whitespace")
        if not secure and not _is_loopback(target) and target not in _WARNED_PLAINTEXT:
            # Once per target and process: a client made per request would say it per
            # request. Loopback never leaves the machine: nothing to say there.
            _WARNED_PLAINTEXT.add(target)
            logger.warning("sending a bearer token over a plaintext channel to %s", target)
        metadata = (("authorization", f"Bearer {token}"),)
    return Settings(
        target=target,
        timeout_s=timeout_s,
        retry=RetryPolicy(retries, backoff_s, backoff_max_s, retry_on_overload),
        max_message_bytes=max_message_bytes,
        credentials=credentials,
        metadata=metadata,
        options=tuple(options),
        chunked_threshold_bytes=chunked_threshold_bytes,
        model_name=model_name,
    )


_WARNED_PLAINTEXT: set[str] = set()


def _is_loopback(target: str) -> bool:
    """Whether every address ``target`` names is this machine: 127.x, ::1, localhost, or
    a Unix socket (``unix:``); a DNS name other than localhost is not known to be."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6"):
        addresses = rest.split(",")
    elif target.startswith("dns:"):
        addresses = [target[len("dns:") :].lstrip("/").split("/")[-1]]
    else:
        addresses = [target]
    return all(_host_is_loopback(_host(address)) for address in addresses)


def _host(address: str) -> str:
    """The host of ``host:port``, ``[v6]:port`` or a bare host."""
    if address.startswith("["):
        return address[1:].partition("]")[0]
    if address.count(":") > 1:  # a bare IPv6 address
        return address
    return address.partition(":")[0]


def _host_is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ClientBase:
    """The constructor both clients share; each subclass makes its connection its own way."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
        retry_on_overload: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: bool = False,
        root_certificates: PemSource | None = None,
        client_certificate: PemSource | None = None,
        client_key: PemSource | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        load_balancing_policy: str | None = None,
        chunked_threshold_bytes: int | None = DEFAULT_CHUNKED_THRESHOLD_BYTES,
        model_name: str = "",
        keepalive_time_s: float | None = 60.0,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """Connect to a tokembed server.

        ``target``: ``host:port``, ``dns:///host:port`` (all resolved addresses, with
        ``load_balancing_policy="round_robin"``) or ``ipv4:a:p1,b:p2``.
        ``timeout_s``: the default overall time per call, retries included (None: none).
        ``retries``: extra attempts on UNAVAILABLE (and overload with
        ``retry_on_overload``), waiting ``backoff_s``·2^n (capped at ``backoff_max_s``,
        jittered) between them. ``tls``/``root_certificates``: TLS (system roots unless a
        CA file is given); ``client_certificate`` + ``client_key``: mutual TLS;
        ``tls_server_name`` overrides the name checked against the server's certificate.
        ``token``: sent as ``authorization: Bearer <token>``. ``chunked_threshold_bytes``:
        above this many output bytes use EmbedChunked (None: never). ``model_name``: the
        model for calls that name none with ``model=`` ("": the server's default model);
        a name the server does not serve raises ModelNotFoundError.
        """
        self._settings = make_settings(
            target,
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            backoff_max_s=backoff_max_s,
            retry_on_overload=retry_on_overload,
            max_message_bytes=max_message_bytes,
            tls=tls,
            root_certificates=root_certificates,
            client_certificate=client_certificate,
            client_key=client_key,
            tls_server_name=tls_server_name,
            token=token,
            load_balancing_policy=load_balancing_policy,
            chunked_threshold_bytes=chunked_threshold_bytes,
            model_name=model_name,
            keepalive_time_s=keepalive_time_s,
            channel_options=tuple(channel_options),
        )
        # Each model's D, learnt from GetModelInfo once per model, for the chunked choice:
        # keyed by the name as asked ("" for the server's default), not by info.name, so
        # that a call finds its D without knowing what the default resolves to.
        self._d_models: dict[str, int] = {}
        # And each model's V (the head's logits per vector), from a logits answer or info.
        self._vocab_sizes: dict[str, int] = {}
        self._closed = False
        self._open()

    def _open(self) -> None:
        """Make the connection (the asyncio one opens its channel in the event loop)."""

    @property
    def target(self) -> str:
        return self._settings.target

    def _deadline(self, timeout_s: float | None) -> Deadline:
        return Deadline(self._settings.timeout_s if timeout_s is None else timeout_s)

    def _model(self, model: str | None) -> str:
        """The model a call is for: its own ``model``, else the client's ``model_name``."""
        if model is None:
            return self._settings.model_name
        if not isinstance(model, str):
            raise client_invalid_input(f"model must be a str or None, got {type(model).__name__}")
        return model

    def _embed_call(
        self,
        ids: Any,
        dtype: Any,
        layout: str,
        model: str | None,
        timeout_s: float | None,
        request_id: str,
        sequence_first: bool = False,
        token_types: Any = None,
    ) -> tuple[codec.EmbedCall, Deadline, str]:
        """One Embed call's request, its deadline, and the model it is for."""
        model_name = self._model(model)
        call = codec.embed_call(
            ids,
            dtype,
            layout,
            model_name=model_name,
            request_id=request_id,
            sequence_first=sequence_first,
            token_types=token_types,
        )
        return call, self._deadline(timeout_s), model_name

    def _learnt(self, model: str, d_model: int) -> None:
        """Remember the D of ``model`` (the name as asked), from an answer or its info."""
        self._d_models[model] = d_model

    def _wants_chunked(self, model: str, call: codec.EmbedCall) -> bool:
        """Whether to ask for this answer in chunks: above ``chunked_threshold_bytes``.

        The size needs the model's D, learnt from its first answer (or ``info``): a call
        to a model not asked before goes unary. Asking GetModelInfo first would cost a
        round trip, and a call naming a model nobody serves would be refused (and
        counted by the server) as a GetModelInfo rather than as the Embed it was.
        """
        threshold = self._settings.chunked_threshold_bytes
        d_model = self._d_models.get(model)
        if threshold is None or d_model is None:
            return False
        return call.output_rows * d_model * call.output_itemsize > threshold

    def _learnt_vocab(self, model: str, vocab_size: int) -> None:
        """Remember the V of ``model`` (the name as asked), from logits or its info."""
        self._vocab_sizes[model] = vocab_size

    def _wants_chunked_nearest(self, model: str, request: pb.NearestRequest) -> bool:
        """Whether to ask for a nearest answer in chunks (NearestChunked): above
        ``chunked_threshold_bytes``, as for embed. Its ids and scores are ``k`` int64 and
        float32 per vector; its logits ``V`` float32 per vector, V learnt as D is (a call
        asking a model not asked before for logits goes unary)."""
        threshold = self._settings.chunked_threshold_bytes
        if threshold is None:
            return False
        vectors = math.prod(request.vectors.shape[:-1])
        size = vectors * request.k * (8 + 4)
        if request.logits:
            vocab_size = self._vocab_sizes.get(model)
            if vocab_size is None:
                return False
            size += vectors * vocab_size * 4
        return size > threshold

    def _wants_chunked_text(self, model: str, request: pb.EmbedTextRequest) -> bool:
        """Whether to ask for an EmbedText answer in chunks (EmbedTextChunked): above
        ``chunked_threshold_bytes``, as for embed. Its size is not known before the texts
        are tokenized, so this bounds it: a token per byte of a text, and two more (the
        server's own bound), each a row of D (learnt as for embed) and an int64 id."""
        threshold = self._settings.chunked_threshold_bytes
        d_model = self._d_models.get(model)
        if threshold is None or d_model is None:
            return False
        dtype = dtypes.BY_WIRE.get(request.output_dtype)
        itemsize = 4 if dtype is None else dtype.itemsize  # unspecified: float32
        tokens = sum(len(text) + 2 for text in request.texts)
        return tokens * (d_model * itemsize + 8) > threshold

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self._settings.metadata

    def _is_open(self) -> bool:
        return not self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EmbeddingError(f"the client for {self.target} is closed")
