"""Loads on daemon threads of their own: a load in native code cannot be interrupted, and
a stop must not wait for it (``app.run`` ends a process whose abandoned load still runs:
``loads_under_way``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# The threads of the loads under way (``loads_under_way``).
_LOAD_THREADS: set[threading.Thread] = set()


def loads_under_way() -> bool:
    """Whether a load's thread is still running (one abandoned at a stop, say)."""
    return any(thread.is_alive() for thread in list(_LOAD_THREADS))


def in_load_thread(work: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``work(*args)`` in a daemon thread of its own, as a future of the running loop:
    neither asyncio.run's end nor the interpreter's exit waits for it, as they wait for
    the default executor's threads (``app.run`` ends the process past one still
    running)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = work(*args)
        except BaseException as exc:
            error = exc
        finally:
            _LOAD_THREADS.discard(threading.current_thread())
        # RuntimeError: the loop is closed (the server stopped while this was under way).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, error)

    name = getattr(work, "__name__", type(work).__name__)
    thread = threading.Thread(target=run, name=f"tokembed-load-{name}", daemon=True)
    _LOAD_THREADS.add(thread)
    thread.start()
    return future


def drop(work: asyncio.Future[Any]) -> None:
    """An abandoned load's outcome: nobody waits for it (its exception, if any, is not
    logged as never retrieved)."""
    if not work.cancelled():
        work.exception()
