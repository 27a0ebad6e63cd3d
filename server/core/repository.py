"""The models one process serves: name -> versions -> a handle with a state and leases.

Everything that asks "is this served, and by what?" asks here, and nowhere else: routing
(the data plane), health and readiness (the app's health service listens to the
changes), GetModelInfo and ListModels, the ``tokembed_model_info`` and queue series.

- A handle is ``LOADING`` once added, ``READY`` once activated (routable), ``DRAINING``
  once retired (no new requests; those admitted finish on it), ``UNLOADED`` when its last
  lease is returned and its scheduler closed.
- A lease is taken at admission and returned when the answer's bytes are gone (the
  ticket's release): it is how a version knows when it may be unloaded.
- A request names a model, or none (the default: the first model added, or the one named
  by ``--default-model``), and a version, or none (the newest activated). A name nobody
  serves is ``ModelNotFound`` listing the names served; while the server is starting, a
  model not yet loaded is ``Unavailable``; once the server drains, every request is.

Swapping a model's version while serving is two calls: ``add`` + ``activate`` the new
handle (new requests go to it at once), then ``await retire(old)`` (it returns once the
old version's last request is answered and the old version is unloaded).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from tokembed.server.core.admission import Ticket
from tokembed.server.core.errors import (
    ModelNotFound,
    ModelUnloaded,
    ServerConfigError,
    Unavailable,
)
from tokembed.server.core.operations.base import Job
from tokembed.server.core.scheduler import Scheduler
from tokembed.server.core.served import ServedModel

logger = logging.getLogger(__name__)


class ModelState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    UNLOADED = "unloaded"


class ModelHandle:
    """One version of one model, as served: its scheduler, state and leases."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.served: ServedModel = scheduler.served
        self.state = ModelState.LOADING
        self.leases = 0  # requests admitted whose answers are not yet sent
        self._drained: asyncio.Event | None = None  # made by retire(), in the running loop
        self._gone: asyncio.Event | None = None  # likewise: set once unloaded

    @property
    def name(self) -> str:
        return self.served.name

    @property
    def version(self) -> str:
        return self.served.version

    def admit(self, job: Job) -> Ticket:
        """Room for ``job`` and a lease on this version, returned with the ticket."""
        ticket = self.scheduler.admit(job, on_release=self._returned)
        self.leases += 1
        return ticket

    def _returned(self) -> None:
        self.leases -= 1
        if self.leases == 0 and self._drained is not None:
            self._drained.set()

    def __repr__(self) -> str:
        return f"<model {self.name} v{self.version} {self.state.value}, {self.leases} leases>"


# Told when a model name starts or stops being served (its health), with the name.
Listener = Callable[[str, bool], None]


class ModelSet:
    """The models given at start, by name, and their rules: each a model of its own name,
    and the default (the one named, else the first given) one of them. The one place they
    are decided: the loader checks the model directories by them before the port is bound,
    and the repository the models as they are added."""

    def __init__(self, default: str | None) -> None:
        self._named_default = default
        self._paths: dict[str, Path] = {}  # in the order given

    def add(self, name: str, path: Path) -> None:
        """The model ``name`` from ``path``, or ``ServerConfigError`` if a model given
        before has that name."""
        first = self._paths.get(name)
        if first is not None:
            raise ServerConfigError(
                f"two models are named {name!r}: {first} and {path}; give each model "
                "directory a distinct name (tokembed export --name)"
            )
        self._paths[name] = path

    def has(self, name: str) -> bool:
        return name in self._paths

    @property
    def default(self) -> str | None:
        """The name that answers requests naming none (None: no model given yet)."""
        if self._named_default is not None:
            return self._named_default
        return next(iter(self._paths), None)

    def check_default(self) -> None:
        """Every model is given: ``ServerConfigError`` unless the default is one of them."""
        if self.default not in self._paths:
            served = ", ".join(repr(name) for name in self._paths) or "no model"
            raise ServerConfigError(
                f"default_model {self.default!r} is not one of the models served ({served})"
            )


class Repository:
    def __init__(self, default_model: str | None = None) -> None:
        """``default_model``: the name that answers requests naming none (None: the first
        model added)."""
        self._models: dict[str, list[ModelHandle]] = {}  # by name, in the order activated
        self._given = ModelSet(default_model)
        self.starting = True  # until every model given at start is in (``started``)
        self.draining = False
        self._listeners: list[Listener] = []
        # Names unloaded on purpose, and why: their requests are told so, not "not served".
        self._unloaded: dict[str, str] = {}
        self._first_added = ""

    # --- changes

    def add(
        self,
        scheduler: Scheduler,
        *,
        versioned: bool = False,
        replacing: ModelHandle | None = None,
    ) -> ModelHandle:
        """A new version, not yet routable (``activate`` it once ready). While starting,
        each model directory given must be a model of its own name, unless ``versioned``
        (a repository's versions of one name); once started, a model of a name served
        already is a new version of it. ``replacing``: the handle of the same version
        this one replaces (its files changed), retired once this one serves."""
        served = scheduler.served
        if self.starting and not (versioned and self._given.has(served.name)):
            self._given.add(served.name, served.model.path)
        for handle in self._models.get(served.name, []):
            if (
                handle.version == served.version
                and handle.state is not ModelState.UNLOADED
                and handle is not replacing
                and handle.state is not ModelState.DRAINING
            ):
                raise ServerConfigError(
                    f"version {served.version} of model {served.name!r} is served already, "
                    f"from {handle.served.model.path}; cannot add {served.model.path} beside it"
                )
        handle = ModelHandle(scheduler)
        self._models.setdefault(served.name, []).append(handle)
        self._first_added = self._first_added or served.name
        self._unloaded.pop(served.name, None)
        return handle

    def activate(self, handle: ModelHandle) -> None:
        """From now on requests for its name (naming no version) go to ``handle``."""
        versions = self._models[handle.name]
        versions.remove(handle)
        versions.append(handle)  # the newest activated is the last
        handle.state = ModelState.READY
        self._tell(handle.name, True)

    def started(self, *, models_required: bool = True) -> None:
        """Every model given at start is in: an unknown name is now not found, not loading.
        ``models_required=False`` (a model repository): no model at all may be served yet,
        as long as no default is named that is not."""
        if models_required or self._given.default is not None:
            self._given.check_default()
        self.starting = False

    def unloaded(self, name: str, reason: str) -> None:
        """``name`` was unloaded on purpose: until it is loaded again, its requests are
        refused with ``reason``."""
        self._unloaded[name] = reason

    async def retire(self, handle: ModelHandle, grace_s: float | None = None) -> None:
        """Stop routing to ``handle``; return once its last lease is back and it is
        unloaded (its batches done, its backend let go). ``grace_s``: how long its
        admitted requests may take to finish (None: as long as they take); past it, what
        is still queued fails and the version is let go all the same."""
        if handle.state in (ModelState.DRAINING, ModelState.UNLOADED):
            if handle._gone is not None:
                await handle._gone.wait()
            return
        handle.state = ModelState.DRAINING
        handle._drained, handle._gone = asyncio.Event(), asyncio.Event()
        if not self._routable(handle.name):
            self._tell(handle.name, False)
        if handle.leases:
            try:
                await asyncio.wait_for(asyncio.shield(handle._drained.wait()), grace_s)
            except TimeoutError:
                logger.warning(
                    "model %s v%s: %d requests still in flight after the grace of %.1fs; "
                    "letting it go", handle.name, handle.version, handle.leases, grace_s,
                )  # fmt: skip
        await handle.scheduler.close()
        handle.state = ModelState.UNLOADED
        handle._gone.set()  # anyone else waiting for this version to go
        versions = self._models[handle.name]
        versions.remove(handle)
        if not versions:
            del self._models[handle.name]
        logger.info(
            "unloaded model %s v%s", handle.name, handle.version,
            extra={"model": handle.name, "version": handle.version},
        )  # fmt: skip

    def drain(self) -> None:
        """The server drains: every request is refused from now on."""
        self.draining = True
        for name in list(self._models):
            self._tell(name, False)

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # --- per request

    def route(self, name: str = "", version: str = "") -> ModelHandle:
        """The handle that answers a request for ``name`` ("": the default model) and
        ``version`` ("": the newest activated)."""
        if self.draining:
            raise Unavailable("the server is draining; retry on another replica")
        wanted = name or self.default_name
        versions = self._models.get(wanted)
        if not versions or (wanted in self._unloaded and not self._routable(wanted)):
            if wanted in self._unloaded:
                raise ModelUnloaded(f"model {wanted!r} is unloaded: {self._unloaded[wanted]}")
            if self.starting:
                raise Unavailable("the model is still loading; retry shortly")
            raise ModelNotFound(
                f"model {name!r} is not served here (this server serves {self._names()})"
            )
        if not version:
            for handle in reversed(versions):
                if handle.state is ModelState.READY:
                    return handle
            raise Unavailable(f"model {wanted!r} has no version ready; retry shortly")
        named = [handle for handle in versions if handle.version == version]
        for handle in reversed(named):  # a version reloaded: its newest copy
            if handle.state is ModelState.READY:
                return handle
        if named:
            raise Unavailable(
                f"version {version} of model {wanted!r} is {named[-1].state.value}; "
                "ask for another version, or none"
            )
        served = ", ".join(h.version for h in versions if h.state is ModelState.READY)
        raise ModelNotFound(
            f"model {wanted!r} has no version {version!r} (versions served: {served or 'none'})"
        )

    def check_serving(self) -> None:
        """Raise ``Unavailable`` unless the server has started and is not draining (for
        answers about every model at once)."""
        if self.draining:
            raise Unavailable("the server is draining; retry on another replica")
        if self.starting:
            raise Unavailable("the models are still loading; retry shortly")

    # --- for listings, health, metrics and shutdown

    @property
    def default_name(self) -> str:
        # No model given at start (a repository's explicit mode): the first loaded since.
        return self._given.default or self._first_added

    @property
    def ready(self) -> bool:
        """Serving: started, not draining."""
        return not self.starting and not self.draining

    def serving(self) -> list[ServedModel]:
        """For each name, the version a request naming no version gets, in the order the
        names were first added."""
        served = []
        for versions in list(self._models.values()):
            ready = [h for h in versions if h.state is ModelState.READY]
            if ready:
                served.append(ready[-1].served)
        return served

    def __iter__(self) -> Iterator[ModelHandle]:
        """Every handle not yet unloaded (every version), names in the order added."""
        # Snapshots: the metrics thread iterates here while the loop may add a version.
        return iter(
            [handle for versions in list(self._models.values()) for handle in list(versions)]
        )

    def __len__(self) -> int:
        return len(self._models)

    def _routable(self, name: str) -> bool:
        return any(h.state is ModelState.READY for h in self._models.get(name, []))

    def _tell(self, name: str, serving: bool) -> None:
        for listener in self._listeners:
            try:
                listener(name, serving)
            except Exception:
                logger.exception("a repository listener failed; this is a bug")

    def _names(self) -> str:
        return ", ".join(repr(name) for name in self._models) or "no model"
