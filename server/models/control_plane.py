"""The control plane: the one owner of the set of models and their lifecycle.

Start-up and every front end go through it: ``tokembed serve --model-dir`` loads its
directories here (``load_directory``), a model repository's models are loaded here at
start (``--load-model``, or every model in poll mode), by RepositoryModelLoad and
RepositoryModelUnload (``load``, ``unload``: ``core.control.ModelControl``), and by the
poller (``model_repository_poll``). The data plane only routes to what the repository
(``core.repository``) says is ready; health, readiness and the model series listen to
the repository's changes.

A load, for a model name, one at a time (a lock per name; two models load side by side):
1. the versions its policy chooses among those on disk whose files are all there;
2. each one not served yet, or whose files changed, or every one when forced, is loaded
   and warmed in a thread beside what serves (``LOADING``), within
   ``--max-model-memory-bytes``;
3. only when all of them loaded are they activated together, in the order of their
   numbers (a request naming no version gets the highest): requests go to them;
4. the versions no longer chosen, and those replaced, are retired: admitted requests
   finish on them (within the grace), then they are let go.
A failure at 1 or 2 undoes 2 and leaves what served serving; its reason is the load's
error (``LoadFailed``) and the index's. A version served with the same files (same
signature) is not loaded again unless forced: loading an unchanged model is a no-op.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tokembed.export.errors import ModelDirError
from tokembed.export.manifest import Manifest
from tokembed.export.model_dir import ModelDir
from tokembed.server.core.control import (
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    IndexEntry,
)
from tokembed.server.core.errors import (
    ControlRefused,
    EmbedError,
    LoadFailed,
    ModelNotFound,
    ServerConfigError,
    Unavailable,
)
from tokembed.server.core.repository import ModelHandle, ModelState, Repository
from tokembed.server.core.scheduler import Scheduler
from tokembed.server.models.default_model import ensure_default_model
from tokembed.server.models.load_threads import drop, in_load_thread
from tokembed.server.models.loading import LoadedModel, ModelLoader, check_model_dirs
from tokembed.server.models.model_repository import (
    ModelRepositoryDir,
    VersionOnDisk,
    VersionPolicy,
    check_config,
)
from tokembed.server.process.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")
NONE, EXPLICIT, POLL = "none", "explicit", "poll"
EVERY_MODEL = "*"


class ControlObserver(Protocol):
    """Told of each load and unload of a model version (the metrics)."""

    def model_added(self, name: str, version: str) -> None: ...

    def version_loaded(self, name: str, version: str, outcome: str, duration_s: float) -> None: ...

    def version_unloaded(
        self, name: str, version: str, outcome: str, duration_s: float
    ) -> None: ...


class ControlPlane:
    def __init__(
        self,
        settings: Settings,
        repository: Repository,
        *,
        loader: ModelLoader,
        scheduler_for: Callable[[LoadedModel], Scheduler],
        observer: ControlObserver,
    ) -> None:
        self.settings = settings
        self.repository = repository
        self.mode = settings.control_mode
        self.disk = (
            None if settings.model_repository is None
            else ModelRepositoryDir(settings.model_repository)
        )  # fmt: skip
        self._loader = loader
        self._scheduler_for = scheduler_for
        self._observer = observer
        self._locks: dict[str, asyncio.Lock] = {}
        # Why a model version (name, version) is not served, for the index: a load that
        # failed, an unload, a version still being copied; and LOADING while it loads.
        self._status: dict[tuple[str, str], tuple[str, str]] = {}
        # The files each served handle was loaded from (VersionOnDisk.signature).
        self._signatures: dict[ModelHandle, tuple[object, ...]] = {}
        # Version policies a load's config set, by model name (they last until the
        # next load that sets another).
        self._policies: dict[str, VersionPolicy] = {}
        # Poll mode: the files each version failed to load with (tried again once they
        # change).
        self._failed_with: dict[tuple[str, str], tuple[object, ...]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._closed = False
        self._stop_event: asyncio.Event | None = None

    # --- start-up

    def check(self) -> None:
        """What can be known before the port is bound (blocking): the model directories
        given, or the repository and the models named to load. ``ServerConfigError``."""
        settings = self.settings
        if self.disk is None:
            check_model_dirs(settings.model_dir, settings.default_model)
            return
        if not self.disk.root.is_dir():
            raise ServerConfigError(
                f"model_repository {self.disk.root} is not a directory (it holds "
                "<model>/<version>/ model directories)"
            )
        on_disk = self.disk.models()
        for name in settings.load_model:
            if name != EVERY_MODEL and name not in on_disk:
                raise ServerConfigError(
                    f"--load-model {name!r}: no such model in {self.disk.root} (models there: "
                    f"{', '.join(repr(n) for n in on_disk) or 'none'})"
                )

    async def start(self) -> None:
        """Load what the server starts with; raise ``ServerConfigError`` if a model named
        (or a --model-dir) cannot be served. In poll mode a model that fails is logged and
        its reason kept in the index: the poller tries it again when its files change."""
        if self.disk is None:
            directories = self.settings.model_dir
            if not directories:
                loop = asyncio.get_running_loop()
                built = await loop.run_in_executor(  # it writes files: exit waits for it
                    None, ensure_default_model, self.settings.default_model_dir
                )
                directories = (built,)
            for directory in directories:
                await self.load_directory(directory)
            self.repository.started()
            return
        names = list(self.settings.load_model)
        if self.mode != EXPLICIT or EVERY_MODEL in names:
            names = self.disk.models()
        for name in dict.fromkeys(names):
            try:
                await self.load(name, _control=False)
            except EmbedError as exc:
                if self.mode == EXPLICIT:
                    raise ServerConfigError(f"cannot load model {name!r}: {exc}") from exc
                logger.error("model %r not loaded at start: %s", name, exc)
        self.repository.started(models_required=False)
        if self.mode == POLL:
            self._poller = asyncio.ensure_future(self._poll_forever())

    async def load_directory(self, directory: Path) -> ModelHandle:
        """Serve the model directory ``directory`` beside those served: a new model, or a
        new version of one (requests naming no version go to it from now on). Raises
        ``ServerConfigError`` for a directory that cannot be served."""
        started = time.monotonic()
        try:
            loaded = await in_load_thread(self._loader, directory, self.settings)
        except ServerConfigError:
            self._observer.version_loaded("", "", "failed", time.monotonic() - started)
            raise
        handle = self._add(loaded)
        self.repository.activate(handle)
        self._observer.version_loaded(
            handle.name, handle.version, "loaded", time.monotonic() - started
        )
        _log_loaded(loaded, directory)
        return handle

    async def unload_version(self, name: str, version: str) -> None:
        """Stop routing to ``version`` of ``name``; return once its last admitted request
        is answered and it is let go."""
        for handle in self.repository:
            if handle.name == name and handle.version == version:
                await self._retire(handle)
                return
        raise ServerConfigError(f"version {version} of model {name!r} is not served")

    # --- control (core.control.ModelControl)

    async def load(
        self,
        name: str,
        *,
        config: Mapping[str, Any] | None = None,
        force: bool = False,
        _control: bool = True,
    ) -> None:
        disk = self._disk_for("load", _control)
        if not disk.has(name):
            raise ModelNotFound(
                f"no model {name!r} in the repository {disk.root} (models there: "
                f"{', '.join(repr(n) for n in disk.models()) or 'none'})"
            )
        async with self._lock(name):
            if self._closed:
                raise ControlRefused("the server is stopping; no model is loaded now")
            policy = self._policy(disk, name, config)
            await self._load_versions(disk, name, policy, force, wait_for_copies=self.mode == POLL)

    async def unload(self, name: str) -> None:
        self._disk_for("unload", True)
        async with self._lock(name):
            handles = [h for h in self.repository
                       if h.name == name and h.state is not ModelState.UNLOADED]  # fmt: skip
            if not handles:
                raise ModelNotFound(f"model {name!r} is not loaded; nothing to unload")
            self.repository.unloaded(
                name, "RepositoryModelUnload; load it again to serve it (tokembed models load)"
            )
            for handle in handles:
                self._retire_later(handle, reason="unloaded")
            logger.info("unloading model %r (%d versions)", name, len(handles))

    def index(self, *, ready_only: bool = False) -> list[IndexEntry]:
        on_disk: dict[str, set[str]] = {}
        if self.disk is not None:
            for name in self.disk.models():
                on_disk[name] = {str(v.number) for v in self.disk.versions(name)}
        for handle in self.repository:
            on_disk.setdefault(handle.name, set()).add(handle.version)
        entries = []
        for name in sorted(on_disk):
            versions = sorted(on_disk[name], key=_version_order) or [""]
            for version in versions:
                entry = self._entry(name, version)
                if not ready_only or entry.state == READY:
                    entries.append(entry)
        return entries

    # --- stop

    async def close(self) -> None:
        """The server stops: no further load, those under way are abandoned (their
        callers answered UNAVAILABLE, not left to the end of the grace); the poller ends."""
        self._closed = True
        self._stopping().set()
        if self._poller is not None:
            self._poller.cancel()

    def _stopping(self) -> asyncio.Event:
        if self._stop_event is None:  # made in the running loop
            self._stop_event = asyncio.Event()
        return self._stop_event

    async def _unless_stopping(self, work: asyncio.Future[T], what: str) -> T:
        """``work``'s result, or ``Unavailable`` as soon as the server stops (the thread
        doing it finishes by itself; its result is dropped)."""
        stopping: asyncio.Future[Any] = asyncio.ensure_future(self._stopping().wait())
        waited: set[asyncio.Future[Any]] = {work, stopping}
        try:
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not work.done():
            work.add_done_callback(drop)
            raise Unavailable(f"the server is stopping: {what} was abandoned")
        return work.result()

    # --- the steps

    def _disk_for(self, what: str, control: bool) -> ModelRepositoryDir:
        if self.disk is None:
            raise ControlRefused(
                f"cannot {what} models: the server serves fixed model directories "
                "(--model-dir); start it with --model-repository DIR to load and unload"
            )
        if control and self.mode != EXPLICIT:
            raise ControlRefused(
                f"cannot {what} models: model control mode is {self.mode!r}; "
                + ("the repository is polled and its changes are loaded"
                   if self.mode == POLL else "models are fixed at start")
                + " (--model-control-mode explicit allows load and unload)"
            )  # fmt: skip
        return self.disk

    def _policy(
        self, disk: ModelRepositoryDir, name: str, config: Mapping[str, Any] | None
    ) -> VersionPolicy:
        if config:
            policy = check_config(name, config, f"model {name!r}: config")
            if policy is not None:
                self._policies[name] = policy
        if name in self._policies:
            return self._policies[name]
        return disk.policy(name)

    async def _load_versions(
        self,
        disk: ModelRepositoryDir,
        name: str,
        policy: VersionPolicy,
        force: bool,
        *,
        wait_for_copies: bool,
    ) -> None:
        """``wait_for_copies`` (poll mode): a version whose files are not all there yet
        is passed over (it is chosen once complete), and so is one that failed to load
        with the very files it has now; else either fails the load."""
        on_disk = disk.versions(name)
        for version in on_disk:
            if version.incomplete and self._served(name, str(version.number)) is None:
                self._status[(name, str(version.number))] = (UNAVAILABLE, version.incomplete)
        ready = [
            v for v in on_disk
            if not (wait_for_copies and (v.incomplete or self._failed_before(name, v)))
        ]  # fmt: skip
        chosen_numbers = policy.choose([v.number for v in ready])
        if not chosen_numbers:
            incomplete = "; ".join(v.incomplete for v in on_disk if v.incomplete)
            raise LoadFailed(
                f"model {name!r}: no version to load in {disk.root / name} by its policy "
                f"({policy.describe()})" + (f"; not complete: {incomplete}" if incomplete else "")
            )
        chosen = [v for v in ready if v.number in chosen_numbers]
        for version in chosen:
            if version.incomplete:
                self._observer.version_loaded(name, str(version.number), "failed", 0.0)
                raise LoadFailed(f"model {name!r} version {version.number}: {version.incomplete}")
        added: list[ModelHandle] = []
        replaced: list[ModelHandle] = []
        try:
            for version in chosen:
                serving = self._served(name, str(version.number))
                unchanged = serving is not None and (
                    self._signatures.get(serving) == version.signature
                )
                if unchanged and not force:
                    continue  # nothing to do
                added.append(await self._load_version(name, version, replacing=serving))
                if serving is not None:
                    replaced.append(serving)
        except BaseException:
            for handle in added:  # never activated: no request ever reached them
                self._retire_later(handle, reason="")
            raise
        # Activated in the order of their numbers, those served already too: a request
        # naming no version gets the highest one chosen (the newest activated).
        for version in chosen:
            number = str(version.number)
            new = next((h for h in added if h.version == number), None)
            activated = new or self._served(name, number)
            if activated is not None:
                self.repository.activate(activated)
        keep = {str(v.number) for v in chosen}
        for handle in list(self.repository):
            if handle.name != name or handle.state is not ModelState.READY:
                continue
            if handle in replaced or handle.version not in keep:
                reason = (
                    "replaced by a new copy"
                    if handle in replaced
                    else (f"not among the versions served ({policy.describe()})")
                )
                self._retire_later(handle, reason=reason)
        if added:
            logger.info(
                "model %r serves versions %s (%s)", name,
                ", ".join(h.version for h in self.repository
                          if h.name == name and h.state is ModelState.READY),
                policy.describe(),
            )  # fmt: skip

    async def _load_version(
        self, name: str, version: VersionOnDisk, *, replacing: ModelHandle | None
    ) -> ModelHandle:
        key = (name, str(version.number))
        self._status[key] = (LOADING, "")
        started = time.monotonic()
        try:
            self._check_memory(name, version)
            try:
                loaded = await self._unless_stopping(
                    in_load_thread(self._loader, version.path, self.settings),
                    f"the load of model {name!r} version {version.number}",
                )
            except ServerConfigError as exc:
                raise LoadFailed(f"model {name!r} version {version.number}: {exc}") from exc
            loaded = _as_version(loaded, name, str(version.number))
            handle = self._add(loaded, replacing=replacing)
        except BaseException as exc:
            reason = str(exc) if isinstance(exc, EmbedError) else "the load was cancelled"
            self._status[key] = (UNAVAILABLE, reason)
            if isinstance(exc, EmbedError):  # poll mode tries it again once its files change
                self._failed_with[key] = version.signature
            self._observer.version_loaded(name, key[1], "failed", time.monotonic() - started)
            if isinstance(exc, EmbedError):
                logger.error("%s", reason)
            raise
        self._status.pop(key, None)
        self._failed_with.pop(key, None)
        self._signatures[handle] = version.signature
        self._observer.version_loaded(name, key[1], "loaded", time.monotonic() - started)
        _log_loaded(loaded, version.path)
        return handle

    def _add(self, loaded: LoadedModel, *, replacing: ModelHandle | None = None) -> ModelHandle:
        handle = self.repository.add(
            self._scheduler_for(loaded), versioned=self.disk is not None, replacing=replacing
        )
        self._observer.model_added(handle.name, handle.version)
        return handle

    def _served(self, name: str, version: str) -> ModelHandle | None:
        for handle in self.repository:
            if (handle.name, handle.version, handle.state) == (name, version, ModelState.READY):
                return handle
        return None

    def _check_memory(self, name: str, version: VersionOnDisk) -> None:
        """Refuse a version whose tables would take the loaded models' past
        ``--max-model-memory-bytes``, with the figures."""
        bound = self.settings.max_model_memory_bytes
        if bound <= 0:
            return
        try:
            manifest = Manifest.read(version.path)
        except ModelDirError as exc:
            raise LoadFailed(f"model {name!r} version {version.number}: {exc}") from exc
        files = _files_key(manifest)
        held: dict[tuple[object, ...], int] = {}
        for handle in self.repository:
            if handle.state is not ModelState.UNLOADED:
                held[_files_key(handle.served.model.manifest)] = sum(
                    handle.served.backend.memory_bytes.values()
                )
        if files in held:
            return  # the same files as a version loaded: its tables are shared
        needed = _memory_needed(self.settings, manifest)
        in_use = sum(held.values())
        if in_use + needed > bound:
            raise LoadFailed(
                f"model {name!r} version {version.number} needs {needed} bytes of tables; "
                f"{in_use} are held by the models loaded, and --max-model-memory-bytes is "
                f"{bound} ({in_use + needed - bound} bytes over): unload a model first"
            )

    def _retire_later(self, handle: ModelHandle, *, reason: str) -> None:
        """Retire ``handle`` in a task (its admitted requests may take a while); the
        index says UNLOADING meanwhile."""
        key = (handle.name, handle.version)

        async def retire() -> None:
            started = time.monotonic()
            outcome = "unloaded"
            try:
                await self._retire(handle)
            except Exception:
                outcome = "failed"
                logger.exception("unloading model %s v%s failed", handle.name, handle.version)
            finally:
                self._signatures.pop(handle, None)
                if reason and self._served(*key) is None and key not in self._status:
                    self._status[key] = (UNAVAILABLE, reason)
                self._observer.version_unloaded(
                    handle.name, handle.version, outcome, time.monotonic() - started
                )

        task = asyncio.ensure_future(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, handle: ModelHandle) -> None:
        await self.repository.retire(handle, grace_s=self.settings.grace_s)

    def _entry(self, name: str, version: str) -> IndexEntry:
        states = [h.state for h in self.repository if h.name == name and h.version == version]
        if ModelState.READY in states:
            return IndexEntry(name, version, READY)
        status = self._status.get((name, version))
        if status is not None and status[0] == LOADING:
            return IndexEntry(name, version, LOADING)
        if ModelState.DRAINING in states:
            return IndexEntry(name, version, UNLOADING)
        if status is not None:
            return IndexEntry(name, version, status[0], status[1])
        return IndexEntry(name, version, UNAVAILABLE)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.repository_poll_secs)
            try:
                await self.poll_once()
            except Exception:  # one failed poll must not end polling for good
                logger.exception("polling the model repository failed; trying again")

    async def poll_once(self) -> None:
        """Bring what serves in line with the repository on disk (poll mode): load new
        and changed versions (once their files are complete; a failed one is tried again
        when its files change), unload the removed ones and the removed models."""
        disk = self.disk
        assert disk is not None, "This is a bug: polling without a repository."
        on_disk = set(disk.models())
        for name in sorted(on_disk):
            async with self._lock(name):
                if self._closed:
                    return
                try:
                    await self._poll_model(disk, name)
                except EmbedError as exc:
                    logger.debug("poll: model %r: %s", name, exc)
        for name in sorted({h.name for h in self.repository} - on_disk):
            async with self._lock(name):
                self.repository.unloaded(name, f"removed from the repository {disk.root}")
                for handle in [h for h in self.repository if h.name == name]:
                    self._retire_later(handle, reason="removed from the repository")

    def _failed_before(self, name: str, version: VersionOnDisk) -> bool:
        """Whether ``version`` failed to load with the very files it has now."""
        return self._failed_with.get((name, str(version.number))) == version.signature

    async def _poll_model(self, disk: ModelRepositoryDir, name: str) -> None:
        policy = self._policy(disk, name, None)
        versions = disk.versions(name)
        candidates = [v for v in versions if not v.incomplete and not self._failed_before(name, v)]
        wanted = policy.choose([v.number for v in candidates])
        served = {h.version: h for h in self.repository
                  if h.name == name and h.state is ModelState.READY}  # fmt: skip
        for version in versions:
            if version.incomplete and str(version.number) not in served:
                self._status[(name, str(version.number))] = (UNAVAILABLE, version.incomplete)
        changed = set(served) != {str(n) for n in wanted} or any(
            self._signatures.get(served[str(v.number)]) != v.signature
            for v in candidates if v.number in wanted and str(v.number) in served
        )  # fmt: skip
        if not changed:
            return
        await self._load_versions(disk, name, policy, force=False, wait_for_copies=True)


def _as_version(loaded: LoadedModel, name: str, version: str) -> LoadedModel:
    """``loaded`` served as the repository's layout names it (the directories decide)."""
    manifest = loaded.model.manifest
    if manifest.name == name and manifest.version == version:
        return loaded
    logger.info(
        "%s: its manifest says %s v%s; served as %s v%s, as the repository lays it out",
        loaded.model.path, manifest.name, manifest.version, name, version,
    )  # fmt: skip
    model = ModelDir(
        path=loaded.model.path,
        manifest=dataclasses.replace(manifest, name=name, version=version),
        kind=loaded.model.kind,
    )
    return dataclasses.replace(loaded, model=model)


def _files_key(manifest: Manifest) -> tuple[object, ...]:
    return tuple(sorted((n, e.sha256) for n, e in manifest.files.items()))


def _memory_needed(settings: Settings, manifest: Manifest) -> int:
    """What loading ``manifest``'s model will hold: its tables when the table backend
    keeps them, else its weights."""
    rows = manifest.vocab_size * (manifest.type_vocab_size or 1)
    kept = settings.tables(rows, manifest.d_model, manifest.weight_dtype)
    weights = sum(entry.size_bytes for entry in manifest.files.values())
    return sum(kept.values()) if kept else weights


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (0, version)


def _log_loaded(loaded: LoadedModel, directory: Path) -> None:
    manifest = loaded.model.manifest
    backend = loaded.backend
    logger.info(
        "loaded model %s v%s (V=%d D=%d scale=%g %s, sha256 %s) from %s: %s backend "
        "on %s%s, in %.2fs",
        manifest.name, manifest.version, manifest.vocab_size, manifest.d_model,
        manifest.scale, manifest.weight_dtype, loaded.model.model_sha256, directory,
        backend.kind, backend.execution_provider,
        "".join(f", {what} {size} bytes" for what, size in backend.memory_bytes.items()),
        loaded.load_s,
        extra={"model": manifest.name, "version": manifest.version,
               "backend": backend.kind},
    )  # fmt: skip
