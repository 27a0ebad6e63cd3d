"""System shared memory (Triton's extension of the V2 protocol): the registry of regions.

A region itself, and the copies into and out of it: shm_region.py.

A client on this host creates a POSIX shared-memory object, registers a window of it
under a name (``SystemSharedMemoryRegister``: name, key, offset, byte_size), and then
names the region in a request's input or output parameters (``shared_memory_region``,
``shared_memory_byte_size``, ``shared_memory_offset``): the server reads that input's
bytes from the window, or writes that output into it and sends no tensor bytes back.
``SystemSharedMemoryStatus`` lists regions and ``SystemSharedMemoryUnregister`` lets one
(or all) go. The semantics are Triton's, so ``tritonclient.utils.shared_memory`` works
unchanged. No grpc here: the V2 front end translates its messages into these calls.

Security. A region is another process's memory, and Triton's own record shows how that
goes wrong (the 2025 chain CVE-2025-23319/23320/23334: an error message leaked the name
of a region the server had made for itself, and registering that name mapped it; an
offset added twice at registration, triton#8330; a size sum unguarded against overflow).
What this module does about each:

- Off unless the server was started with ``--shared-memory system``.
- A key must name a POSIX shared-memory object (``/NAME``, one path component) whose name
  starts with ``--shared-memory-prefix``: no other ``/``, no ``..``, only letters, digits,
  ``.``, ``_``, ``-``. It is opened with ``O_NOFOLLOW`` (a symbolic link planted under
  the prefix is refused), never ``O_CREAT``, and must be a regular file with one name
  (a hard link under the prefix to another object is refused: ``O_NOFOLLOW`` does not
  stop those) owned by the server's user (the server opens it with its own rights): the
  server creates no object of its own, under the prefix or anywhere, so there is no
  internal region whose name could leak.
- Every offset and size is a Python int (no fixed width, so no sum can wrap), checked
  non-negative, and checked against the object's real size (``fstat``) at registration
  and again before every copy.
- Memory is never mapped. Reading a page of a mapping whose file was truncated under it
  raises SIGBUS, which kills the process, and checking the size before touching the
  mapping leaves a window in which the client can truncate it anyway. So every copy is a
  ``pread``, ``pwrite`` or ``pwritev`` on the object's descriptor: the kernel does the
  copy, a read past the end is short (reported as an error), and no signal can come of
  it. What is
  left of the race: a client that shrinks its object after the size check and before the
  write sees the write grow it back, up to the end of the window it registered (checked
  against the object's size at registration, and at most the request's answer); the
  memory is the client's own object's, and the server goes on.
- No region is read while a request is parsed. An input is read only after the request's
  inputs (at most 16) are checked against the model it is routed to, and the size it
  declares is exactly what its shape needs (within the request's token limit): a refused
  request reads nothing, an accepted one at most what its shapes need, one input at a
  time (core/operations/embed_request.py; a large read on a worker thread:
  shm_service.py). So a region of a terabyte cannot make the server allocate one.
- Unregistering waits for the requests using the region; the descriptor is closed only
  once the last copy into it has returned (a request whose caller left may still be
  writing on a worker thread). The close is the region's own, made by the last request
  to let it go, so an unregistering call cancelled or timed out while it waits leaks
  nothing; until closed, the region counts against the cap below, and shutdown closes
  it. Everything is unregistered when the server stops.
- Error messages name only what the request itself named: never another region's name
  or key.
- A region is its owner's: the identity that registered it (edge/auth.py's
  ``Identities``: the client certificate, else the bearer token, else one for everyone).
  ``SystemSharedMemoryStatus`` lists, and requests and unregistrations reach, the
  caller's regions alone; each owner has names of its own, so another's region is
  neither replaced nor revealed (the answer is the one for a name never registered).
  Triton's regions are server-wide: this is beyond it.
- At most ``--shared-memory-max-regions`` regions at once, every owner's together: each
  holds a descriptor.
- One process: ``--workers N`` is refused with it (settings.py), as each process would
  keep a registry of its own.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from tokembed.server.edge.v2.shm_region import Region, RegionStatus, SharedMemoryError, Window

logger = logging.getLogger(__name__)

# Where Linux keeps POSIX shared-memory objects: shm_open("/NAME") opens /dev/shm/NAME.
SHM_ROOT = Path("/dev/shm")
# A region's name is the client's label for it; bounded so a registration stays small.
MAX_NAME_CHARS = 256
# What may follow the prefix in an object's name (the prefix obeys the same rule).
_NAME_CHARS = re.compile(r"[A-Za-z0-9._-]+")
# POSIX: an object's name is one path component of at most NAME_MAX (255) bytes.
_NAME_MAX = 255


class SharedMemoryOff(SharedMemoryError):
    """The server was started without ``--shared-memory system``."""


class RegionExists(SharedMemoryError):
    """A region of that name is registered already."""


class RegionNotFound(SharedMemoryError):
    """No region of that name is registered."""


class SharedMemoryRegistry:
    """The regions registered with this server, by owner and name.

    ``owner``: who calls, an opaque key from the front end's authentication (edge/auth.py's
    ``Identities``). Each owner has names of its own: another owner's regions are neither
    listed, used, unregistered nor replaced by it, and every answer about them is the
    answer about a name never registered (the registry does not say they exist)."""

    def __init__(
        self,
        *,
        enabled: bool,
        prefix: str,
        max_regions: int,
        root: Path = SHM_ROOT,
    ) -> None:
        self.enabled = enabled
        self.prefix = prefix
        self.max_regions = max_regions
        self._root = root
        self._regions: dict[str, dict[str, Region]] = {}  # owner -> name -> region
        # Unregistered, and still used by a request: each holds its descriptor, so it
        # counts against max_regions, and shutdown closes it, until it is closed.
        self._leaving: set[Region] = set()
        self._closed = False

    # --- the RPCs

    def register(self, name: str, key: str, offset: int, byte_size: int, *, owner: str) -> None:
        """``SystemSharedMemoryRegister``: the window ``[offset, offset + byte_size)`` of the
        object ``key``, under ``name``, for ``owner``."""
        self._check_on()
        if not name or len(name) > MAX_NAME_CHARS:
            raise SharedMemoryError(f"a region needs a name of 1 to {MAX_NAME_CHARS} characters")
        if name in self._regions.get(owner, {}):
            raise RegionExists(f"a region named {name!r} is registered already")
        if self._descriptors_held() >= self.max_regions:
            raise SharedMemoryError(
                f"{self.max_regions} regions are registered, the most this server takes "
                "(--shared-memory-max-regions); unregister one first (one unregistered "
                "counts until the requests using it end)"
            )
        object_name = self._object_name(key)
        if offset < 0 or byte_size <= 0:
            raise SharedMemoryError(
                f"region {name!r}: offset {offset} must be >= 0 and byte_size {byte_size} > 0"
            )
        fd = self._open(key, object_name)
        try:
            size = os.fstat(fd).st_size
            # Python ints: offset + byte_size cannot wrap, whatever the client sent.
            if offset + byte_size > size:
                raise SharedMemoryError(
                    f"region {name!r}: offset {offset} + byte_size {byte_size} is past the end "
                    f"of {key!r} ({size} bytes)"
                )
        except BaseException:
            os.close(fd)
            raise
        self._regions.setdefault(owner, {})[name] = Region(name, key, offset, byte_size, fd)
        logger.info(
            "registered shared-memory region %r: %s, %d bytes at offset %d",
            name, key, byte_size, offset,
        )  # fmt: skip

    def status(self, name: str = "", *, owner: str) -> list[RegionStatus]:
        """``SystemSharedMemoryStatus``: ``owner``'s region ``name``, or every region of
        ``owner``'s for ``""``."""
        self._check_on()
        owned = self._regions.get(owner, {})
        if not name:
            return [region.status for region in owned.values()]
        region = owned.get(name)
        if region is None:
            raise RegionNotFound(f"no region named {name!r} is registered")
        return [region.status]

    async def unregister(self, name: str = "", *, owner: str) -> None:
        """``SystemSharedMemoryUnregister``: let ``owner``'s region ``name`` go (every region
        of ``owner``'s for ``""``) once no request uses it. A name not registered is not an
        error (Triton's behaviour: unregistering is idempotent)."""
        self._check_on()
        owned = self._regions.get(owner, {})
        if name:
            region = owned.pop(name, None)
            gone = [] if region is None else [region]
        else:
            gone = list(owned.values())
            owned.clear()
        if not owned:
            self._regions.pop(owner, None)
        for region in gone:
            # Closed by the request that lets it go last, should this call be cancelled
            # while it waits for that.
            region.retire()
            if region.holds_descriptor:
                self._leaving.add(region)
            logger.info("unregistered shared-memory region %r", region.name)
        for region in gone:
            await region.wait_unused()

    async def close(self) -> None:
        """The server stops: every region closed, those still leaving too (their requests
        are over by now)."""
        self._closed = True
        gone = [region for owned in self._regions.values() for region in owned.values()]
        gone += self._leaving
        self._regions.clear()
        self._leaving.clear()
        for region in gone:
            region.close()
        if gone:
            logger.info("unregistered %d shared-memory region(s) at shutdown", len(gone))

    # --- requests

    def use(self, name: str, offset: int, byte_size: int, *, owner: str) -> Window:
        """``byte_size`` bytes at ``offset`` of ``owner``'s region ``name``'s window, for one
        tensor of a request (checked against the window); the region is held, and cannot
        go, until ``Window.release``."""
        self._check_on()
        region = self._regions.get(owner, {}).get(name)
        if region is None:
            raise RegionNotFound(f"no shared-memory region named {name!r} is registered")
        if offset < 0 or byte_size <= 0 or offset + byte_size > region.byte_size:
            raise SharedMemoryError(
                f"shared_memory_offset {offset} + shared_memory_byte_size {byte_size} is "
                f"outside region {name!r} ({region.byte_size} bytes)"
            )
        region.hold()
        return Window(region, offset, byte_size)

    def _descriptors_held(self) -> int:
        self._leaving = {region for region in self._leaving if region.holds_descriptor}
        return sum(len(owned) for owned in self._regions.values()) + len(self._leaving)

    # --- keys

    def _check_on(self) -> None:
        if not self.enabled:
            raise SharedMemoryOff(
                "shared memory is off on this server (start it with --shared-memory system)"
            )
        if self._closed:
            raise SharedMemoryOff("the server is stopping")

    def _object_name(self, key: str) -> str:
        """The object's name in ``SHM_ROOT`` for a key ``/NAME`` this server may open."""
        name = key[1:] if key.startswith("/") else ""
        if (
            not name
            or len(name.encode()) > _NAME_MAX
            or not _NAME_CHARS.fullmatch(name)
            or ".." in name
            or not name.startswith(self.prefix)
        ):
            raise SharedMemoryError(
                f"key {key[:300]!r} must be '/' and then a name starting with "
                f"{self.prefix!r}, of letters, digits, '.', '_' and '-' only (no other '/', "
                "no '..')"
            )
        return name

    def _open(self, key: str, object_name: str) -> int:
        # O_NOFOLLOW: a link planted under the prefix is refused, not followed. O_NONBLOCK:
        # a FIFO under the prefix does not hang the open (it is refused below). Never
        # O_CREAT: the server makes no object of its own.
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
        try:
            fd = os.open(self._root / object_name, flags)
        except OSError as exc:
            raise SharedMemoryError(
                f"cannot open shared-memory object {key!r}: {exc.strerror or exc}"
            ) from None
        try:
            _check_opened(key, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd


def _check_opened(key: str, opened: os.stat_result) -> None:
    """Refuse what was opened unless it is a client's object of the server's own user,
    known by one name. Checked on the descriptor, so it is what the copies will use."""
    if not stat.S_ISREG(opened.st_mode):
        raise SharedMemoryError(f"{key!r} is not a shared-memory object")
    # O_NOFOLLOW stops symbolic links only: a hard link under the prefix to an object
    # elsewhere in SHM_ROOT would be opened with the server's rights.
    if opened.st_nlink != 1:
        raise SharedMemoryError(
            f"{key!r} has {opened.st_nlink} names (hard links); register an object that has "
            "one name only"
        )
    # The server opens objects read-write with its own rights: one of another user's that
    # it can open (a mode too open) is not the caller's to hand it.
    if opened.st_uid != os.geteuid():
        raise SharedMemoryError(
            f"{key!r} belongs to uid {opened.st_uid}, not to the server's user "
            f"({os.geteuid()}); register objects made by the server's user"
        )
