"""tokembed.client: sync and asyncio clients of the tokembed embedding service.

    from tokembed.client import EmbeddingClient

    with EmbeddingClient("127.0.0.1:50051") as client:
        hidden = client.embed([[5, 6, 7, 8, 9, 10, 11, 12]])   # [1, 8, 512] float32

Names are imported on first use, so that ``import tokembed.client`` (the errors alone,
say) does not pay for grpc and numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below, for type checkers ("X as X" marks a re-export)
    from tokembed.client.aio import AsyncEmbeddingClient as AsyncEmbeddingClient
    from tokembed.client.errors import AuthenticationError as AuthenticationError
    from tokembed.client.errors import DeadlineExceededError as DeadlineExceededError
    from tokembed.client.errors import EmbeddingError as EmbeddingError
    from tokembed.client.errors import InvalidInputError as InvalidInputError
    from tokembed.client.errors import ModelLoadError as ModelLoadError
    from tokembed.client.errors import ModelNotFoundError as ModelNotFoundError
    from tokembed.client.errors import OverloadedError as OverloadedError
    from tokembed.client.errors import RequestCancelledError as RequestCancelledError
    from tokembed.client.errors import RequestTooLargeError as RequestTooLargeError
    from tokembed.client.errors import ServerError as ServerError
    from tokembed.client.errors import (
        SharedMemoryUnavailableError as SharedMemoryUnavailableError,
    )
    from tokembed.client.errors import UnavailableError as UnavailableError
    from tokembed.client.errors import UnknownConventionError as UnknownConventionError
    from tokembed.client.errors import from_rpc_error as from_rpc_error
    from tokembed.client.results import EmbedResult as EmbedResult
    from tokembed.client.results import IdInputInfo as IdInputInfo
    from tokembed.client.results import Limits as Limits
    from tokembed.client.results import ModelInfo as ModelInfo
    from tokembed.client.results import ModelList as ModelList
    from tokembed.client.results import RepositoryModel as RepositoryModel
    from tokembed.client.results import TableInfo as TableInfo
    from tokembed.client.results import TextEmbedResult as TextEmbedResult
    from tokembed.client.results import Timings as Timings
    from tokembed.client.results import TokenizeResult as TokenizeResult
    from tokembed.client.results import TokenizerInfo as TokenizerInfo
    from tokembed.client.shared_memory import SharedMemorySession as SharedMemorySession
    from tokembed.client.shared_memory_aio import (
        AsyncSharedMemorySession as AsyncSharedMemorySession,
    )
    from tokembed.client.sync import EmbeddingClient as EmbeddingClient

_EXPORTS = {
    "EmbeddingClient": "tokembed.client.sync",
    "AsyncEmbeddingClient": "tokembed.client.aio",
    "EmbedResult": "tokembed.client.results",
    "ModelInfo": "tokembed.client.results",
    "ModelList": "tokembed.client.results",
    "RepositoryModel": "tokembed.client.results",
    "Limits": "tokembed.client.results",
    "IdInputInfo": "tokembed.client.results",
    "TableInfo": "tokembed.client.results",
    "Timings": "tokembed.client.results",
    "TokenizeResult": "tokembed.client.results",
    "TextEmbedResult": "tokembed.client.results",
    "TokenizerInfo": "tokembed.client.results",
    "EmbeddingError": "tokembed.client.errors",
    "InvalidInputError": "tokembed.client.errors",
    "RequestTooLargeError": "tokembed.client.errors",
    "OverloadedError": "tokembed.client.errors",
    "ModelNotFoundError": "tokembed.client.errors",
    "ModelLoadError": "tokembed.client.errors",
    "UnavailableError": "tokembed.client.errors",
    "DeadlineExceededError": "tokembed.client.errors",
    "RequestCancelledError": "tokembed.client.errors",
    "AuthenticationError": "tokembed.client.errors",
    "ServerError": "tokembed.client.errors",
    "from_rpc_error": "tokembed.client.errors",
    "SharedMemorySession": "tokembed.client.shared_memory",
    "AsyncSharedMemorySession": "tokembed.client.shared_memory_aio",
    "SharedMemoryUnavailableError": "tokembed.client.errors",
    "UnknownConventionError": "tokembed.client.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokembed.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
