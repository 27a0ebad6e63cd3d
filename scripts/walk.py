"""The modules one request enters on the server, in the order first entered.

    python scripts/walk.py MODEL_DIR [embed|stream|chunked|v2] [--onnxruntime]

Starts the real server in this process (port 0, no metrics port), sends a few warm-up
requests through the real client, then profiles the server's threads for one tiny
request ([1, 8] ids; [1, 64] for chunked; ``v2``: a ModelInfer through tritonclient)
and prints every ``tokembed.server`` module
whose code ran for it. docs/architecture.md quotes what it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from tokembed.client import EmbeddingClient
from tokembed.server.app import TokembedServer
from tokembed.server.process.settings import Settings

IDS = [[1, 2, 3, 4, 5, 6, 7, 8]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument(
        "rpc", nargs="?", default="embed", choices=("embed", "stream", "chunked", "v2")
    )
    parser.add_argument("--onnxruntime", action="store_true", help="the onnxruntime backend")
    args = parser.parse_args()
    overrides: dict[str, Any] = {"float32_table_max_bytes": 0} if args.onnxruntime else {}
    settings = Settings(model_dir=(args.model_dir,), port=0, metrics_port=-1, **overrides)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = TokembedServer(settings.validate())
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    asyncio.run_coroutine_threadsafe(server.wait_ready(), loop).result(60)
    threshold = 0 if args.rpc == "chunked" else None
    seen: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        module = str(frame.f_globals.get("__name__", ""))
        if event == "call" and module.startswith("tokembed.server") and module not in seen:
            seen.append(module)

    with EmbeddingClient(f"127.0.0.1:{server.port}", chunked_threshold_bytes=threshold) as client:
        client.info()  # the model's D: a chunked call goes chunked at once
        for _ in range(3):
            _one(client, args.rpc)
        time.sleep(0.2)  # the warm-up's own callbacks are over
        threading.setprofile(profile)  # worker threads started from now
        loop.call_soon_threadsafe(sys.setprofile, profile)
        time.sleep(0.1)
        _one(client, args.rpc)
        time.sleep(0.2)
        loop.call_soon_threadsafe(sys.setprofile, None)
        threading.setprofile(None)
    asyncio.run_coroutine_threadsafe(server.stop(1), loop).result(30)
    print(f"{args.rpc}: {len(seen)} modules")
    for module in seen:
        print("  ", module.removeprefix("tokembed.server."))
    return 0


def _one(client: EmbeddingClient, rpc: str) -> None:
    if rpc == "v2":
        import tritonclient.grpc as triton  # a dev dependency: the V2 protocol's own client

        with triton.InferenceServerClient(client.target) as v2:
            ids = np.array(IDS, dtype=np.int64)
            given = triton.InferInput("input_ids", list(ids.shape), "INT64")
            given.set_data_from_numpy(ids)
            v2.infer("", [given])
        return
    if rpc == "stream":
        list(client.embed_stream([IDS]))
    elif rpc == "chunked":
        client.embed(np.arange(64).reshape(1, 64))
    else:
        client.embed(IDS)


if __name__ == "__main__":
    sys.exit(main())
