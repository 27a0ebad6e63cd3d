"""Generate the blocking client from the asyncio one: `python scripts/gen_sync_client.py`.

The one recipe for the client's generated code. Each operation is written once, awaited,
in client/aio.py (the client) and client/shared_memory_aio.py (its shared-memory session);
unasync (as httpcore uses it) writes their blocking twins, client/sync.py and
client/shared_memory.py: `async`/`await` dropped, the asyncio names replaced by their
blocking ones (below), then ruff's fixes and format with the project's settings. What the
two do differently lives in client/_async_backend.py and client/_sync_backend.py, the same
names in each. tests/test_generated_code.py runs this into a temporary folder and fails
if the committed files differ.

Run it with the unasync and ruff that the dev extra pins.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import unasync

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "client"
# The asyncio source -> its generated blocking twin, both in client/.
SOURCES = {"aio.py": "sync.py", "shared_memory_aio.py": "shared_memory.py"}
# Beyond unasync's own (async def, await, async for/with, __aenter__, AsyncIterator...).
REPLACEMENTS = {
    "AsyncEmbeddingClient": "EmbeddingClient",
    "AsyncSharedMemorySession": "SharedMemorySession",
    "shared_memory_aio": "shared_memory",
    "_async_backend": "_sync_backend",
}


def header(source: str) -> str:
    return (
        f"# Generated from client/{source} by `python scripts/gen_sync_client.py`: edit that\n"
        "# file and run the script; tests/test_generated_code.py checks this one is current.\n"
    )


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src_dir, dst_dir = Path(tmp, "_async"), Path(tmp, "_sync")
        src_dir.mkdir()
        for source, target in SOURCES.items():
            (src_dir / target).write_bytes((CLIENT / source).read_bytes())
        rule = unasync.Rule("/_async/", "/_sync/", additional_replacements=REPLACEMENTS)
        unasync.unasync_files([str(src_dir / target) for target in SOURCES.values()], [rule])
        written = []
        for source, target in SOURCES.items():
            path = out_dir / target
            path.write_text(header(source) + (dst_dir / target).read_text())
            written.append(str(path))
    config = f"--config={ROOT / 'pyproject.toml'}"
    ruff = [sys.executable, "-m", "ruff"]
    # Imports renamed out of order, lines that fit once `await` is gone: ruff settles them
    # as it would a hand-written file, so that the generated one passes the same checks.
    subprocess.run([*ruff, "check", "--quiet", "--fix-only", config, *written], check=True)
    subprocess.run([*ruff, "format", "--quiet", config, *written], check=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=CLIENT, help="default: client/")
    generate(parser.parse_args().out)
