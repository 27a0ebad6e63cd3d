"""The server's lifecycle: bind, load, serve, drain; and the wiring of its rooms.

    start()       bind the gRPC port (health NOT_SERVING) and the metrics port, then load
                  every model in a thread, one after the other; each model's own health
                  name is SERVING once it is loaded
    wait_ready()  the whole server SERVING once every model answers; raises if one failed
    load(dir)     serve a model directory beside those served (a new model, or a new
                  version of one: requests naming no version go to it from then on)
    unload(...)   stop routing to a model version; returns once its last request is
                  answered and it is let go
    control       the control plane (server/models/control_plane.py): the one owner of the set
                  of models, which start-up, load, unload and the V2 repository methods
                  all go through
    stop()        health NOT_SERVING, refuse new requests (UNAVAILABLE), let the
                  in-flight ones finish within the grace period, close

Tests and embedders use ``TokembedServer`` directly, on port 0; ``tokembed serve``
adds signal handling around it (``serve``). What the gRPC server holds and where it
listens: edge/grpc_server.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry

from tokembed.server.core.admission import OutputBudget
from tokembed.server.core.calls import Calls
from tokembed.server.core.dataplane import DataPlane
from tokembed.server.core.errors import ServerConfigError, Unauthenticated
from tokembed.server.core.policy import Policy
from tokembed.server.core.repository import ModelHandle, Repository
from tokembed.server.core.scheduler import Scheduler
from tokembed.server.core.served import BatchLimits, Limits, ServedModel
from tokembed.server.edge.grpc_server import GrpcOptions, bind, build_grpc_server
from tokembed.server.edge.v1.servicer import (
    FRONT_END,
    SERVICE_NAME,
)
from tokembed.server.edge.v2 import servicer as v2
from tokembed.server.edge.v2.shm import SharedMemoryRegistry
from tokembed.server.models.control_plane import ControlPlane
from tokembed.server.models.load_threads import loads_under_way
from tokembed.server.models.loading import LoadedModel, ModelLoader, load_model
from tokembed.server.observability.metrics import Metrics
from tokembed.server.observability.metrics_http import start_metrics_server
from tokembed.server.observability.model_metrics import ModelLabels
from tokembed.server.process.memory import release_free_memory, trim_forever
from tokembed.server.process.settings import Settings

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DRAIN_QUIET_S = 0.1
DRAIN_SETTLE_MAX_S = 1.0
# Of the grace, what is kept for closing down after gRPC has stopped (at most a quarter).
CLOSE_RESERVE_S = 1.0
# Threads for off-loop look-ups and encodes, shared by every model: the large ones are
# memory-bound copies, so more threads than this only queue behind each other here.
WORKER_THREADS = 2


def grpc_options(settings: Settings) -> GrpcOptions:
    """What the gRPC server takes from ``settings``: the edge reads no settings itself."""
    return GrpcOptions(
        **{field.name: getattr(settings, field.name) for field in dataclasses.fields(GrpcOptions)}
    )


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
        self.repository = Repository(settings.default_model)
        self.calls = Calls(self.metrics, summary_interval_s=settings.log_summary_interval_s)
        self.dataplane = DataPlane(self.repository, self.calls)
        self.metrics.track_inflight(lambda: self.calls.active)
        self.metrics.track_models(self._model_series, lambda: self.repository.ready)
        self.metrics.add_front_end(FRONT_END)
        self.metrics.add_front_end(v2.FRONT_END)
        self._budget = OutputBudget(settings.max_inflight_output_bytes)
        self.metrics.inflight_output_bytes.set_function(lambda: float(self._budget.inflight_bytes))
        self._workers = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="tokembed-work")
        self.control = ControlPlane(
            settings, self.repository, loader=loader, scheduler_for=self._scheduler,
            observer=self.metrics,
        )  # fmt: skip
        self.metrics.track_model_states(self.control.index)
        # V2 system shared memory: the regions callers on this host register (refused
        # unless --shared-memory system).
        self.shared_memory = SharedMemoryRegistry(
            enabled=settings.shared_memory == "system", prefix=settings.shared_memory_prefix,
            max_regions=settings.shared_memory_max_regions,
        )  # fmt: skip
        self.health = health.aio.HealthServicer()
        self.repository.listen(self._model_health)
        self._health_updates: set[asyncio.Task[None]] = set()
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._stop_metrics: Callable[[], None] | None = None
        self._loading: asyncio.Task[None] | None = None
        self._trimmer: asyncio.Future[None] | None = None
        self._stopped = asyncio.Event()

    # --- start

    async def start(self) -> None:
        settings = self.settings
        # The model directories (or the repository) first: a bad one is one line, before
        # anything listens.
        await asyncio.get_running_loop().run_in_executor(None, self.control.check)
        options = grpc_options(settings)
        self._server = build_grpc_server(
            options, self.dataplane, self.shared_memory, self.metrics.model_totals, self.health,
            on_unauthenticated=self._unauthenticated, control=self.control,
        )  # fmt: skip
        await self._set_health(NOT_SERVING)
        self.port = bind(self._server, options)
        await self._server.start()
        if settings.metrics_port >= 0:
            try:
                self._stop_metrics, self.metrics_port = start_metrics_server(
                    self.registry, settings.metrics_host, settings.metrics_port
                )
            except OSError as exc:
                await self._server.stop(0)  # not left for the loop's end to find running
                raise ServerConfigError(
                    f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
                    f"{exc.strerror or exc}; choose another --metrics-port (0 picks a free "
                    "one, -1 turns metrics off)"
                ) from exc
        logger.info(
            "listening on %s:%d (gRPC%s), metrics on %s%s",
            settings.host, self.port, ", TLS" if settings.tls_cert else "",
            f"http://{settings.metrics_host}:{self.metrics_port}/metrics"
            if self.metrics_port is not None else "(disabled)",
            f"; V2 system shared memory on (keys /{settings.shared_memory_prefix}*)"
            if self.shared_memory.enabled else "",
        )  # fmt: skip
        self._loading = asyncio.ensure_future(self._load_all())

    async def _load_all(self) -> None:
        started = time.perf_counter()
        await self.control.start()
        release_free_memory()  # what loading allocated and dropped, before serving
        if self.settings.memory_trim_interval_s > 0:
            self._trimmer = asyncio.ensure_future(
                trim_forever(self.settings.memory_trim_interval_s)
            )
        if self.repository.draining:
            return
        await self._set_health(SERVING)
        settings = self.settings
        names = [served.name for served in self.repository.serving()]
        logger.info(
            "serving model%s %s (default %s), loaded in %.2fs; limits: %d tokens and %d "
            "output bytes per request, batches of %d tokens after at most %.1f ms, %d queued "
            "tokens per model, %d in-flight output bytes",
            "" if len(names) == 1 else "s", ", ".join(names), self.repository.default_name,
            time.perf_counter() - started, settings.max_tokens_per_request,
            settings.max_output_bytes_per_request, settings.max_batch_tokens,
            settings.max_delay_ms, settings.max_queued_tokens,
            settings.max_inflight_output_bytes,
        )  # fmt: skip

    async def load(self, directory: Path) -> ModelHandle:
        """Load ``directory`` (in a thread) and serve it: a new model, or a new version of
        one served (requests naming no version go to it from now on). Raises
        ``ServerConfigError`` for a directory that cannot be served."""
        return await self.control.load_directory(directory)

    async def unload(self, name: str, version: str) -> None:
        """Stop routing to ``version`` of ``name``; return once its last admitted request
        is answered and it is let go."""
        await self.control.unload_version(name, version)

    def _scheduler(self, loaded: LoadedModel) -> Scheduler:
        settings = self.settings
        served = ServedModel(
            model=loaded.model,
            backend=loaded.backend,
            limits=Limits(
                max_tokens_per_request=settings.max_tokens_per_request,
                max_output_bytes_per_request=settings.max_output_bytes_per_request,
                max_nearest_k=settings.max_nearest_k,
                max_nearest_flops_per_request=settings.max_nearest_flops_per_request,
            ),
            batch=BatchLimits(
                max_batch_tokens=settings.max_batch_tokens,
                max_delay_s=settings.max_delay_s,
                max_concurrent_batches=settings.max_concurrent_batches,
                max_queued_tokens=settings.max_queued_tokens,
                nearest_max_batch_rows=settings.nearest_max_batch_rows,
                max_queued_nearest_flops=settings.max_queued_nearest_flops,
            ),
            tokenizer=loaded.tokenizer,
        )
        return Scheduler(
            served,
            policy=Policy(
                batches=loaded.backend.batches,
                inline_max_tokens=settings.inline_compute_max_tokens,
            ),
            budget=self._budget,
            workers=self._workers,
            observer=self.metrics,
        )

    def _model_series(self) -> list[tuple[ModelLabels, int]]:
        """Every model version served, as the metrics label it, and its queued tokens."""
        return [(_labels(handle.served), handle.scheduler.queued_tokens())
                for handle in self.repository]  # fmt: skip

    def _model_health(self, name: str, serving: bool) -> None:
        """The repository says ``name`` starts (or stops) being served: its health name."""
        update = asyncio.ensure_future(self.health.set(name, SERVING if serving else NOT_SERVING))
        self._health_updates.add(update)
        update.add_done_callback(self._health_updates.discard)

    def _unauthenticated(self, method: str) -> None:
        """The bearer-token check refused ``method`` (a full gRPC method name)."""
        service, _, name = method.lstrip("/").partition("/")
        front_end = {SERVICE_NAME: FRONT_END, v2.SERVICE_NAME: v2.FRONT_END}.get(service)
        if front_end is not None and name in front_end.methods:
            self.dataplane.refuse(front_end, name, Unauthenticated("missing or wrong bearer token"))
        else:  # another service's method (reflection, a probe): counted as a rejection alone
            self.metrics.rejected(Unauthenticated.reason)

    async def wait_ready(self) -> None:
        """Return once SERVING; raise ``ServerConfigError`` if a model failed to load."""
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
        # The process is to be gone within the grace (an orchestrator's kill comes after
        # its own): the end of it is kept for closing down once gRPC has stopped. gRPC
        # may hold the drain to the deadline (calls it took in but never handed over
        # are only cancelled then), and closing down under load takes a moment after it.
        deadline = drain_started + grace - min(CLOSE_RESERVE_S, grace / 4)
        self.repository.drain()
        await self.control.close()
        await self._set_health(NOT_SERVING)
        if self._health_updates:
            await asyncio.gather(*self._health_updates, return_exceptions=True)
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self._trimmer is not None:
            self._trimmer.cancel()
        finished = await self.calls.wait_idle(max(0.0, deadline - time.monotonic()))
        if not finished:
            logger.warning(
                "grace period of %.1fs over with %d requests in flight; cancelling them",
                grace, self.calls.active,
            )  # fmt: skip
        # Calls gRPC has taken in but not yet handed to a handler (the event loop was
        # busy) are CANCELLED by server.stop() (grpc/grpc#41785), where a drain should
        # answer UNAVAILABLE. Keep refusing until no call has come for DRAIN_QUIET_S since
        # the drain began (at most DRAIN_SETTLE_MAX_S, within the grace), so that few are
        # left waiting inside gRPC when it stops.
        settle_until = min(deadline, time.monotonic() + DRAIN_SETTLE_MAX_S)
        await self.calls.wait_quiet(DRAIN_QUIET_S, drain_started, settle_until)
        if self._server is not None:
            await self._server.stop(max(0.0, deadline - time.monotonic()))
        await self.shared_memory.close()  # every call has ended: no region is in use
        for handle in self.repository:
            await handle.scheduler.close()
        self._workers.shutdown(wait=False)
        if self._stop_metrics is not None:
            self._stop_metrics()
        self.calls.flush()
        self._stopped.set()
        if self._server is not None:  # it never listened otherwise: nothing to say
            logger.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def _labels(served: ServedModel) -> ModelLabels:
    manifest = served.model.manifest
    return ModelLabels(
        name=manifest.name, version=manifest.version, vocab_size=manifest.vocab_size,
        d_model=manifest.d_model, dtype=manifest.weight_dtype,
        execution_provider=served.backend.execution_provider, backend=served.backend.kind,
    )  # fmt: skip


def run(settings: Settings) -> int:
    """``tokembed serve`` in this process (``serve`` on a new event loop): its exit code.

    A load abandoned at the stop may still be running in its thread. Waiting for it would
    hold the process past its grace, and the interpreter's teardown cannot run beside it:
    the load's native code (onnxruntime) meets its runtime being torn down and aborts the
    process. A load writes nothing, so the process then ends at once, its logs flushed,
    without the teardown.
    """
    code = asyncio.run(serve(settings))
    if loads_under_way():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


async def serve(settings: Settings) -> int:
    """``tokembed serve``: run until SIGTERM/SIGINT, then drain and return 0."""
    server = TokembedServer(settings)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    try:
        await server.start()
    except BaseException:
        await server.stop(0)  # nothing left running for the loop's end to trip over
        raise
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
    signalled_at = time.monotonic()
    logger.info("signal received: draining (grace %.1fs)", settings.grace_s)
    await server.stop()
    if not ready.done():
        ready.cancel()
    # At most half of what is left of the grace, so that the process still ends within it.
    await let_tasks_end(max(0.0, signalled_at + settings.grace_s - time.monotonic()) / 2)
    return 0


async def let_tasks_end(timeout_s: float) -> None:
    """Wait for every other task on this loop to end by itself, for at most ``timeout_s``.

    gRPC's stop returns once its core holds no open call, while the Python side of calls it
    has just ended may still be finishing (grpc/grpc#37239). Ending the loop then (asyncio.run
    cancels what is left) makes gRPC log such a call as an unhandled CancelledError, with a
    traceback: an error in the log of a drain that went well.
    """
    deadline = time.monotonic() + timeout_s
    current = asyncio.current_task()
    while others := asyncio.all_tasks() - {current}:
        left = deadline - time.monotonic()
        if left <= 0:
            names = sorted(task.get_name() for task in others)
            logger.warning("%d tasks still running at the end: %s", len(names), names)
            return
        await asyncio.wait(others, timeout=left)
