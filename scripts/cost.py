"""What one tiny request costs the server: allocations and CPU, per protocol.

    python scripts/cost.py [--model-dir DIR] [--requests N] [--runs R] [--profile]

Starts the real server in this process (port 0, no metrics port; the built-in default
model, V=32000 D=512, unless ``--model-dir``), and the clients in a child process, so that
everything this process does during a measurement is the server's. For a tiny Embed
([1, 8] ids, float32) through tokembed.v1 (tokembed's sync client) and through V2
``ModelInfer`` (tritonclient's grpc client), after a warm-up, it prints per request:

- allocations: the allocator calls of this process (every thread) while the child sends
  ``--alloc-requests`` requests, counted by memray: Python's allocators (objects and
  their buffers, pymalloc included) and the C allocator (malloc, mmap and the like,
  mostly gRPC's core); divided by the requests. The Python figure moves by about 1%
  from run to run: the event loop's own allocations depend on how events coincide, and
  the metrics are applied in bulk every so many updates (so a run holds one bulk more or
  less); the default run is long enough to keep that small.
- CPU: this process's user + system CPU (all its threads) over ``--requests`` requests,
  the lowest of ``--runs`` runs, divided by the requests. Wall time on a shared machine
  varies; the lowest run is the one least disturbed.
- CPU in process: the server's own Python for one such request with no gRPC around it:
  the protocol's deserializer and its handler (tokembed.v1 ``Embed``, V2 ``ModelInfer``),
  awaited on the server's event loop with a stand-in for gRPC's context, over
  ``--in-process-requests`` requests; the loop thread's CPU, the lowest of ``--runs``.

``--profile`` adds the top of a cProfile of the event loop's thread (where the server's
request path runs) over the CPU runs' requests.
docs/benchmarks/README.md ("What a tiny request costs the server") has its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

try:
    import memray
except ImportError:  # a dev tool: tokembed[dev] installs memray
    sys.exit("scripts/cost.py needs memray: pip install -e '.[dev]' (or pip install memray)")

IDS = [[1, 2, 3, 4, 5, 6, 7, 8]]
PROTOCOLS = ("v1", "v2")
PYTHON_ALLOCATORS = {
    memray.AllocatorType.PYMALLOC_MALLOC,
    memray.AllocatorType.PYMALLOC_CALLOC,
    memray.AllocatorType.PYMALLOC_REALLOC,
}
FREES = {
    memray.AllocatorType.FREE,
    memray.AllocatorType.MUNMAP,
    memray.AllocatorType.PYMALLOC_FREE,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="default: the built-in default model")
    parser.add_argument(
        "--default-model-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "tokembed-cost" / "default",
        help="where the built-in default model is built once (default: %(default)s)",
    )
    parser.add_argument("--requests", type=int, default=1000, help="per CPU run")
    parser.add_argument("--runs", type=int, default=5, help="CPU runs per protocol")
    parser.add_argument("--alloc-requests", type=int, default=2000, help="per allocation run")
    parser.add_argument("--alloc-runs", type=int, default=2, help="allocation runs per protocol")
    parser.add_argument("--warmup", type=int, default=300, help="requests before measuring")
    parser.add_argument(
        "--in-process-requests", type=int, default=20000, help="per in-process CPU run"
    )
    parser.add_argument("--protocol", choices=PROTOCOLS, action="append", help="default: both")
    parser.add_argument("--profile", action="store_true", help="cProfile the event loop")
    parser.add_argument("--client", metavar="TARGET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return _serve_requests(args.client, sys.stdin, sys.stdout)
    return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    from tokembed.server.app import TokembedServer
    from tokembed.server.core.errors import ServerConfigError
    from tokembed.server.process.settings import Settings

    models: dict[str, Any] = (
        {"model_dir": (args.model_dir,)}
        if args.model_dir
        else {"default_model_dir": args.default_model_dir}
    )
    settings = Settings(port=0, metrics_port=-1, **models).validate()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = TokembedServer(settings)
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(120)
    except ServerConfigError as exc:
        print(f"scripts/cost.py: {exc}", file=sys.stderr)
        return 2
    asyncio.run_coroutine_threadsafe(server.wait_ready(), loop).result(120)
    client = subprocess.Popen(
        [sys.executable, __file__, "--client", f"127.0.0.1:{server.port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    rows = []
    try:
        for protocol in args.protocol or PROTOCOLS:
            _ask(client, protocol, args.warmup)
            python, native = _allocations(client, protocol, args)
            # The loop thread's CPU clock: its waits in epoll are not the server's cost.
            profiler = cProfile.Profile(time.thread_time) if args.profile else None
            if profiler is not None:
                _on_loop(loop, profiler.enable)
            cpu = [_cpu_per_request(client, protocol, args.requests) for _ in range(args.runs)]
            if profiler is not None:
                _on_loop(loop, profiler.disable)
                print(
                    f"--- {protocol}: the event loop's thread, {args.runs * args.requests} requests"
                )
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            try:
                in_process = [
                    asyncio.run_coroutine_threadsafe(
                        _in_process_cpu(server, protocol, args.in_process_requests), loop
                    ).result(600)
                    for _ in range(args.runs)
                ]
            except (ImportError, TypeError) as exc:  # an older tree's front ends differ
                print(f"scripts/cost.py: no in-process figure for {protocol}: {exc}")
                in_process = []
            rows.append((protocol, python, native, cpu, in_process))
    finally:
        assert client.stdin is not None
        client.stdin.close()
        client.wait(30)
        asyncio.run_coroutine_threadsafe(server.stop(1), loop).result(30)
    print(
        f"tiny Embed [1,8] float32; allocations over {args.alloc_runs} x "
        f"{args.alloc_requests} requests, CPU the lowest of {args.runs} x {args.requests}"
    )
    print(
        "| protocol | Python allocations/req (runs) | C allocations/req (runs) "
        "| server CPU us/req, lowest (runs) | in process, lowest (runs) |"
    )
    print("|---|---|---|---|---|")
    for protocol, python, native, cpu, in_process in rows:
        runs = ", ".join(f"{c * 1e6:.0f}" for c in cpu)
        own = ", ".join(f"{c * 1e6:.1f}" for c in in_process)
        lowest = f"{min(in_process) * 1e6:.1f} ({own})" if in_process else "n/a"
        print(
            f"| {protocol} | {_spread(python)} | {_spread(native)} "
            f"| {min(cpu) * 1e6:.0f} ({runs}) | {lowest} |"
        )
    return 0


def _allocations(
    client: subprocess.Popen[str], protocol: str, args: argparse.Namespace
) -> tuple[list[float], list[float]]:
    """Python and C allocator calls per request, one figure per run."""
    python: list[float] = []
    native: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        for run in range(args.alloc_runs):
            capture = Path(scratch) / f"{protocol}-{run}.bin"
            with memray.Tracker(capture, trace_python_allocators=True):
                _ask(client, protocol, args.alloc_requests)
            counts = {True: 0, False: 0}
            with memray.FileReader(capture) as reader:
                for record in reader.get_allocation_records():
                    if record.allocator not in FREES:
                        counts[record.allocator in PYTHON_ALLOCATORS] += record.n_allocations
            python.append(counts[True] / args.alloc_requests)
            native.append(counts[False] / args.alloc_requests)
    return python, native


def _cpu_per_request(client: subprocess.Popen[str], protocol: str, requests: int) -> float:
    start = time.process_time()
    _ask(client, protocol, requests)
    return (time.process_time() - start) / requests


class _Context:
    """What a tiny request's handler asks of gRPC's servicer context, with nothing behind it."""

    def __init__(self) -> None:
        self._done: list[Any] = []

    def time_remaining(self) -> float:
        return 60.0

    def add_done_callback(self, callback: Any) -> None:
        self._done.append(callback)

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def end(self) -> None:
        for callback in self._done:
            callback(self)


async def _in_process_cpu(server: Any, protocol: str, requests: int) -> float:
    """The loop thread's CPU per request for the protocol's deserializer and handler, no
    gRPC; on the server's loop."""
    import numpy as np

    from tokembed.client import codec
    from tokembed.server.app import grpc_options
    from tokembed.server.edge.auth import Identities
    from tokembed.server.edge.v1.requests import EmbedParser
    from tokembed.server.edge.v1.servicer import EmbeddingServicer
    from tokembed.server.edge.v2.requests import InferParser
    from tokembed.server.edge.v2.servicer import InferenceServicer
    from tokembed.v2 import grpc_service_pb2 as pb

    options = grpc_options(server.settings)
    ids = np.array(IDS, dtype=np.int64)
    handler: Any
    if protocol == "v1":
        parse: Any = EmbedParser(options.max_request_bytes, options.max_tokens_per_request)
        servicer: Any = EmbeddingServicer(
            server.dataplane, chunk_bytes=options.stream_chunk_bytes,
            max_message_bytes=options.max_message_bytes, parse=parse,
        )  # fmt: skip
        handler = servicer.Embed
        data = codec.encode_request(codec.encode_ids(ids), dtype="float32", layout="padded")
    else:
        parse = InferParser(options.max_request_bytes, options.max_tokens_per_request)
        servicer = InferenceServicer(
            server.dataplane, parse=parse, max_message_bytes=options.max_message_bytes,
            version="cost", statistics=lambda name: None,
            identities=Identities(client_certificates=False, token=False),
        )  # fmt: skip
        handler = servicer.ModelInfer
        request = pb.ModelInferRequest()  # tritonclient's: raw contents, the default model
        request.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
        request.raw_input_contents.append(ids.tobytes())
        data = request.SerializeToString()
    for _ in range(100):  # warm
        context = _Context()
        await handler(parse(data), context)
        context.end()
    start = time.thread_time()
    for _ in range(requests):
        context = _Context()
        await handler(parse(data), context)
        context.end()
    return (time.thread_time() - start) / requests


def _spread(values: list[float]) -> str:
    """The mean, and each run's figure."""
    mean = sum(values) / len(values)
    return f"{mean:.1f} ({', '.join(f'{value:.1f}' for value in values)})"


def _on_loop(loop: asyncio.AbstractEventLoop, call: Any) -> None:
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    loop.call_soon_threadsafe(run)
    done.wait(10)


def _ask(client: subprocess.Popen[str], protocol: str, requests: int) -> None:
    assert client.stdin is not None and client.stdout is not None
    client.stdin.write(f"{protocol} {requests}\n")
    client.stdin.flush()
    answer = client.stdout.readline()
    if answer != "done\n":
        raise RuntimeError(f"the client process answered {answer!r}")


def _serve_requests(target: str, orders: TextIO, answers: TextIO) -> int:
    """The child: one client per protocol, ``PROTOCOL N`` sends N tiny requests."""
    import numpy as np
    import tritonclient.grpc as triton

    from tokembed.client import EmbeddingClient

    ids = np.array(IDS, dtype=np.int64)
    given = triton.InferInput("input_ids", list(ids.shape), "INT64")
    given.set_data_from_numpy(ids)
    with EmbeddingClient(target) as v1, triton.InferenceServerClient(target) as v2:
        send = {"v1": lambda: v1.embed(IDS), "v2": lambda: v2.infer("", [given])}
        for order in orders:
            protocol, count = order.split()
            one = send[protocol]
            for _ in range(int(count)):
                one()
            answers.write("done\n")
            answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
