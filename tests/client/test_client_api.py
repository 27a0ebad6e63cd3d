"""The two clients are one API: the asyncio client and the blocking one expose the same
public methods with the same signatures (the blocking one is generated from the asyncio
one: tests/test_generated_code.py), and so do their shared-memory sessions. And the
library does not carry the command line."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from tokembed.client.aio import AsyncEmbeddingClient
from tokembed.client.shared_memory import SharedMemorySession
from tokembed.client.shared_memory_aio import AsyncSharedMemorySession
from tokembed.client.sync import EmbeddingClient

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"
# A name of the asyncio API and its blocking counterpart, as the generator maps them.
_SYNC_NAMES = {
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "AsyncIterator": "Iterator",
    "AsyncEmbeddingClient": "EmbeddingClient",
    "AsyncSharedMemorySession": "SharedMemorySession",
}


def _public(cls: type) -> dict[str, Any]:
    """Public attributes (methods, properties) and the constructor and context-manager
    methods, by name."""
    return {
        name: getattr(cls, name)
        for name in dir(cls)
        if not name.startswith("_") or name in ("__init__", *_SYNC_NAMES, *_SYNC_NAMES.values())
    }


def _blocking_name(name: str) -> str:
    return _SYNC_NAMES.get(name, name)


def _blocking_signature(method: Any) -> str:
    """The method's signature with the asyncio names written as their blocking ones."""
    text = str(inspect.signature(method))
    for asyncio_text, blocking_text in _SYNC_NAMES.items():
        text = text.replace(asyncio_text, blocking_text)
    return text


@pytest.mark.parametrize(
    ("asyncio_cls", "blocking_cls"),
    [(AsyncEmbeddingClient, EmbeddingClient), (AsyncSharedMemorySession, SharedMemorySession)],
)
def test_both_shells_expose_the_same_methods_and_signatures(
    asyncio_cls: type, blocking_cls: type
) -> None:
    asyncio_api = {_blocking_name(n): m for n, m in _public(asyncio_cls).items()}
    blocking_api = _public(blocking_cls)
    assert sorted(asyncio_api) == sorted(blocking_api)
    for name, method in asyncio_api.items():
        if not callable(method):
            continue
        assert _blocking_signature(method) == str(inspect.signature(blocking_api[name])), name
    # Every method but the constructor does I/O: awaited in the asyncio shell, plain calls
    # in the blocking one.
    awaited = {
        n
        for n, m in asyncio_api.items()
        if inspect.iscoroutinefunction(m) or inspect.isasyncgenfunction(m)
    }
    assert awaited == {n for n, m in asyncio_api.items() if callable(m)} - {"__init__"}
    assert not any(
        inspect.iscoroutinefunction(m) or inspect.isasyncgenfunction(m)
        for m in blocking_api.values()
    )


def test_the_clients_methods_are_the_documented_ones() -> None:
    # docs/client.md's API summary lists these for both clients.
    assert sorted(n for n in _public(EmbeddingClient) if not n.startswith("_")) == [
        "close",
        "detokenize",
        "embed",
        "embed_result",
        "embed_stream",
        "embed_stream_results",
        "embed_text",
        "embed_torch",
        "health",
        "info",
        "load_model",
        "model_info",
        "models",
        "nearest",
        "repository_index",
        "sglang_input_embeds",
        "shared_memory",
        "target",
        "tokenize",
        "unload_model",
        "vllm_prompt_embeds",
    ]


def test_the_library_does_not_import_the_command_line() -> None:
    """A library user never needs the CLI: no module of tokembed.client imports
    tokembed.cli (the client's subcommands live there)."""
    offenders = []
    for path in sorted(CLIENT_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.name}: {n}"
                for n in names
                if n == "tokembed.cli" or n.startswith("tokembed.cli.")
            ]
    assert offenders == []
    assert not (CLIENT_DIR / "cli.py").exists()
