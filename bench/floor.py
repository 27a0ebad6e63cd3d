"""The floor: a bare gRPC endpoint that answers with a payload of the service's size
and does no work. Whatever the service costs above it is ours to shave.

It parses the request (so both sides pay the same request cost), then returns a cached,
pre-encoded ``EmbedResponse`` of the same shape and dtype the service would send.
Run as its own process: ``python -m tokembed.bench.floor --port 0`` prints its port.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import grpc
import numpy as np

from tokembed.server.core.dtypes import OUTPUT_DTYPES
from tokembed.server.core.types import Answer, Timings
from tokembed.server.edge.v1 import responses
from tokembed.server.edge.v1.requests import WIRE_OUTPUT_DTYPES
from tokembed.v1 import embedding_pb2 as pb

METHOD = "/tokembed.bench.Floor/Embed"
_MAX_MESSAGE = 1 << 30


class Floor:
    def __init__(self, d_model: int) -> None:
        self._d_model = d_model
        self._cache: dict[tuple[tuple[int, ...], str], bytes] = {}

    def _shape(self, request: pb.EmbedRequest) -> tuple[int, ...]:
        rows: tuple[int, ...]
        if request.lengths:
            rows = (len(request.lengths), max(request.lengths))
        else:
            rows = tuple(request.input_ids.shape)
        return (*rows, self._d_model)

    def payload(self, request: pb.EmbedRequest) -> bytes:
        dtype = WIRE_OUTPUT_DTYPES.get(request.output_dtype, "float32")
        key = (self._shape(request), dtype)
        if key not in self._cache:
            array = np.zeros(key[0], dtype=OUTPUT_DTYPES[dtype].numpy)
            answer = Answer(
                array.shape, OUTPUT_DTYPES[dtype], [array.view(np.uint8).data.cast("B")], None,
                Timings(0.0, 0.0, 1, 0), array.size // array.shape[-1], array.nbytes,
                "floor", "0",
            )  # fmt: skip
            self._cache[key] = responses.embed_response(answer, "", 0.0)
        return self._cache[key]

    async def embed(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return self.payload(pb.EmbedRequest.FromString(request))


async def serve(port: int, d_model: int) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ]
    )
    floor = Floor(d_model)
    handler = grpc.method_handlers_generic_handler(
        "tokembed.bench.Floor",
        {"Embed": grpc.unary_unary_rpc_method_handler(floor.embed)},
    )
    server.add_generic_rpc_handlers([handler])
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"floor listening on 127.0.0.1:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--d-model", type=int, required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.d_model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
