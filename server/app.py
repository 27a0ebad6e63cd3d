"""The server's lifecycle: bind, load, warm, serve, drain.

    start()       bind the gRPC port (health NOT_SERVING) and the metrics port,
                  then load and warm the model in a thread
    wait_ready()  health SERVING once the model answers; raises if loading failed
    stop()        health NOT_SERVING, refuse new requests (UNAVAILABLE), let the
                  in-flight ones finish within the grace period, close

Tests and embedders use ``TokembedServer`` directly, on port 0; ``tokembed serve``
adds signal handling around it (``serve``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from tokembed.export.errors import ModelDirError
from tokembed.export.model_dir import ModelDir, load_model_dir
from tokembed.server import inplace_bytes
from tokembed.server.answer_arrays import AnswerArrays
from tokembed.server.auth import BearerTokenInterceptor, read_token
from tokembed.server.default_model import ensure_default_model
from tokembed.server.errors import ServerConfigError
from tokembed.server.kept_answers import KeptAnswers
from tokembed.server.memory import release_free_memory, tune_malloc
from tokembed.server.metrics import Metrics, ModelLabels, start_metrics_server
from tokembed.server.runtime import CPU, EmbeddingRuntime, RuntimeOptions, expects_cpu
from tokembed.server.service import EmbeddingService
from tokembed.server.servicer import SERVICE_NAME, EmbeddingServicer, generic_handler
from tokembed.server.serving_state import ServingState
from tokembed.server.settings import Settings
from tokembed.v1 import embedding_pb2

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DRAIN_QUIET_S = 0.1
DRAIN_SETTLE_MAX_S = 1.0


@dataclass(frozen=True)
class LoadedModel:
    model: ModelDir
    runtime: EmbeddingRuntime
    warm_up_s: float
    # What padded positions of ragged answers hold: the padding id's row as the model
    # computes it, zeros when the model has no padding id.
    pad_row: np.ndarray
    # float16 answers come from this [V, D] table when present (see settings).
    float16_table: np.ndarray | None = None
    # The float32 table the runtime answers look-ups from (None: onnxruntime answers);
    # large answers are gathered from it by the service itself (see EmbeddingService).
    float32_table: np.ndarray | None = None

    @property
    def float32_table_bytes(self) -> int:
        return 0 if self.float32_table is None else int(self.float32_table.nbytes)


ModelLoader = Callable[[Settings], LoadedModel]


def load_model(settings: Settings) -> LoadedModel:
    """Validate the model directory, open the session, warm it up (blocking)."""
    directory = settings.model_dir
    if directory is None:
        directory = ensure_default_model(settings.default_model_dir)
    try:
        model = load_model_dir(directory)
    except ModelDirError as exc:
        raise ServerConfigError(f"invalid model directory: {exc}") from exc
    shape = (model.manifest.vocab_size, model.manifest.d_model)
    float32_table_fits = settings.float32_table_bytes(*shape) > 0
    try:
        runtime = EmbeddingRuntime(
            model,
            RuntimeOptions(
                device=settings.device,
                intra_op_threads=settings.intra_op_threads,
                inter_op_threads=settings.inter_op_threads,
                batch_output_bytes=settings.max_batch_tokens * model.manifest.d_model * 4,
                # On CPU with the float32 table, onnxruntime only computes the row tables
                # at load: no arena then, so what it allocates is given back (16-32 MB
                # stayed resident).
                cpu_arena=not (float32_table_fits and expects_cpu(settings.device)),
            ),
        )
        started = time.perf_counter()
        if runtime.provider == CPU and float32_table_fits:
            # The table's chunked runs warm the session; a full-batch warm-up would make
            # an arena region resident (2 batches) that no look-up uses afterwards.
            runtime.keep_float32_table()
        else:
            runtime.warm_up()
        warm_up_s = time.perf_counter() - started
    except ServerConfigError:
        raise
    except Exception as exc:
        # Fix: onnxruntime can still refuse a directory the checks above accept (external
        # weights cut short before the manifest was written): say so in one line, not
        # with a traceback.
        message = " ".join(str(exc).split())
        raise ServerConfigError(
            f"onnxruntime cannot load the model in {directory}: {message}"
        ) from exc
    padding_id = model.manifest.padding_idx
    pad_row = (
        runtime.run(np.array([padding_id], dtype=np.int64))[0]
        if padding_id is not None
        else np.zeros(model.manifest.d_model, dtype=np.float32)
    )
    float16_table = None
    if runtime.provider == CPU and settings.float16_table_bytes(*shape):
        float16_table = runtime.float16_table()
    return LoadedModel(
        model=model, runtime=runtime, warm_up_s=warm_up_s, pad_row=pad_row,
        float16_table=float16_table, float32_table=runtime.float32_table,
    )  # fmt: skip


class TokembedServer:
    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        loader: ModelLoader = load_model,
    ) -> None:
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.state = ServingState()
        self.metrics.track_inflight(lambda: self.state.active_requests)
        self._loader = loader
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._stop_metrics: Callable[[], None] | None = None
        self._loading: asyncio.Task[None] | None = None
        self._trimmer: asyncio.Future[None] | None = None
        self._kept = KeptAnswers(self.settings.memory_trim_interval_s)
        self._stopped = asyncio.Event()

    @property
    def spare_bytes(self) -> inplace_bytes.SpareBytes | None:
        """The bytes kept for the next in-place answer (None: not kept here)."""
        return self._kept.spare_bytes

    @property
    def answer_arrays(self) -> AnswerArrays | None:
        """The arrays kept for EmbedChunked's next answers (None: not kept here)."""
        return self._kept.answer_arrays

    # --- start

    async def start(self) -> None:
        settings = self.settings
        interceptors = []
        if settings.auth_token_file is not None:
            token = read_token(settings.auth_token_file)
            rejected = self.metrics.rejections.labels(reason="unauthenticated")
            interceptors.append(BearerTokenInterceptor(token, on_reject=rejected.inc))
        options: list[tuple[str, int]] = []
        if settings.max_connection_age_s > 0:
            # GOAWAY after this age; calls in flight get the grace period to finish.
            options.append(
                ("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000))
            )
            options.append(("grpc.max_connection_age_grace_ms", int(settings.grace_s * 1000)))
        self._server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                *options,
                ("grpc.max_send_message_length", settings.max_message_bytes),
                ("grpc.max_receive_message_length", settings.max_request_bytes),
                # Several processes may share one port only when asked (--workers).
                ("grpc.so_reuseport", 1 if settings.workers > 1 else 0),
                # Clients keep long streams alive with a ping a minute; gRPC's default
                # server policy (one per 5 minutes) would close them for "too many pings".
                ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
            ],
        )
        self._server.add_generic_rpc_handlers(
            [
                generic_handler(
                    EmbeddingServicer(
                        self.state,
                        self.metrics,
                        self._kept.spare_bytes,
                        self._kept.answer_arrays,
                    )
                )
            ]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            [
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self._server,
        )
        _ = embedding_pb2  # the descriptor pool must hold our service for reflection
        await self._set_health(NOT_SERVING)
        self.port = self._bind(self._server, settings)
        await self._server.start()
        if settings.metrics_port >= 0:
            self._stop_metrics, self.metrics_port = start_metrics_server(
                self.registry, settings.metrics_host, settings.metrics_port
            )
        logger.info(
            "listening on %s:%d (gRPC%s), metrics on %s",
            settings.host, self.port, ", TLS" if settings.tls_cert else "",
            f"http://{settings.metrics_host}:{self.metrics_port}/metrics"
            if self.metrics_port is not None else "(disabled)",
        )  # fmt: skip
        self._loading = asyncio.ensure_future(self._load())

    def _bind(self, server: grpc.aio.Server, settings: Settings) -> int:
        address = f"{settings.host}:{settings.port}"
        if settings.tls_cert is not None and settings.tls_key is not None:
            client_ca = settings.tls_client_ca.read_bytes() if settings.tls_client_ca else None
            credentials = grpc.ssl_server_credentials(
                [(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())],
                root_certificates=client_ca,
                require_client_auth=client_ca is not None,
            )
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise ServerConfigError(f"cannot bind the gRPC port at {address}")
        return int(port)

    async def _load(self) -> None:
        started = time.perf_counter()
        loaded = await asyncio.get_running_loop().run_in_executor(None, self._loader, self.settings)
        manifest = loaded.model.manifest
        service = EmbeddingService(
            loaded.model, loaded.runtime.run, loaded.runtime.provider, self.settings,
            observer=self.metrics, to_float16=loaded.runtime.to_float16, pad_row=loaded.pad_row,
            float16_table=loaded.float16_table, float32_table=loaded.float32_table,
            # A table gather costs the same per row in one call or many: give each answer
            # its own rows (see Batcher), freed as soon as it is sent.
            rows_per_request=loaded.float32_table_bytes > 0,
        )  # fmt: skip
        self.metrics.track_queue(lambda: service.batcher.queued_tokens)
        self.metrics.inflight_output_bytes.set_function(
            lambda: float(service.admission.inflight_output_bytes)
        )
        self.metrics.set_model(
            ModelLabels(
                name=manifest.name, version=manifest.version, vocab_size=manifest.vocab_size,
                d_model=manifest.d_model, dtype=manifest.weight_dtype,
                execution_provider=loaded.runtime.provider,
            )
        )  # fmt: skip
        self.state.service = service
        release_free_memory()  # what loading allocated and dropped, before serving
        if self.settings.memory_trim_interval_s > 0:
            self._trimmer = asyncio.ensure_future(self._kept.trim_forever())
        if self.state.draining:
            return
        await self._set_health(SERVING)
        self.metrics.ready.set(1)
        settings = self.settings
        logger.info(
            "serving model %s v%s (V=%d D=%d scale=%g %s, sha256 %s) from %s on %s; "
            "loaded and warmed in %.2fs; limits: %d tokens and %d output bytes per request, "
            "batches of %d tokens after at most %.1f ms, %d queued tokens, %d in-flight "
            "output bytes",
            manifest.name, manifest.version, manifest.vocab_size, manifest.d_model,
            manifest.scale, manifest.weight_dtype, loaded.model.model_sha256,
            loaded.model.path, loaded.runtime.provider, time.perf_counter() - started,
            settings.max_tokens_per_request, settings.max_output_bytes_per_request,
            settings.max_batch_tokens, settings.max_delay_ms, settings.max_queued_tokens,
            settings.max_inflight_output_bytes,
        )  # fmt: skip
        float16_bytes = 0 if loaded.float16_table is None else loaded.float16_table.nbytes
        logger.info(
            "row tables in memory: float16 %d bytes (float16 answers), float32 %d bytes "
            "(float32 look-ups); 0: not kept, onnxruntime answers",
            float16_bytes, loaded.float32_table_bytes,
        )  # fmt: skip

    async def wait_ready(self) -> None:
        """Return once SERVING; raise ``ServerConfigError`` if the model failed to load."""
        if self._loading is None:
            raise RuntimeError("this is a bug: wait_ready() before start()")
        await self._loading

    async def _set_health(self, status: int) -> None:
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    # --- stop

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: NOT_SERVING, UNAVAILABLE for new requests, in-flight ones finish."""
        if self._stopped.is_set():
            return
        grace = self.settings.grace_s if grace_s is None else grace_s
        drain_started = time.monotonic()
        deadline = drain_started + grace
        self.state.draining = True
        self.metrics.ready.set(0)
        await self._set_health(NOT_SERVING)
        if self.state.service is not None:
            self.state.service.draining = True
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self._trimmer is not None:
            self._trimmer.cancel()
        finished = await self.state.wait_idle(max(0.0, deadline - time.monotonic()))
        if not finished:
            logger.warning(
                "grace period of %.1fs over with %d requests in flight; cancelling them",
                grace, self.state.active_requests,
            )  # fmt: skip
        # Fix: calls gRPC has taken in but not yet handed to a handler (the event loop was
        # busy) are CANCELLED by server.stop() (grpc/grpc#41785), where a drain should
        # answer UNAVAILABLE. Keep refusing until no call has come for DRAIN_QUIET_S since
        # the drain began (at most DRAIN_SETTLE_MAX_S, within the grace), so that few are
        # left waiting inside gRPC when it stops.
        settle_until = min(deadline, time.monotonic() + DRAIN_SETTLE_MAX_S)
        await self.state.wait_quiet(DRAIN_QUIET_S, drain_started, settle_until)
        if self._server is not None:
            await self._server.stop(max(0.0, deadline - time.monotonic()))
        if self.state.service is not None:
            await self.state.service.close()
        self._kept.release()  # the trimmer that let idle ones go is stopped
        if self._stop_metrics is not None:
            self._stop_metrics()
        self._stopped.set()
        logger.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(settings: Settings) -> int:
    """``tokembed serve``: run until SIGTERM/SIGINT, then drain and return 0."""
    tune_malloc(settings.malloc_mmap_threshold_bytes)
    server = TokembedServer(settings)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    await server.start()
    ready = asyncio.ensure_future(server.wait_ready())
    stop_wait = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait({ready, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and not ready.cancelled() and ready.exception() is not None:
        stop_wait.cancel()
        await server.stop(0)
        error = ready.exception()
        assert error is not None
        raise error
    await stop_wait
    logger.info("signal received: draining (grace %.1fs)", settings.grace_s)
    await server.stop()
    if not ready.done():
        ready.cancel()
    return 0
