"""Faults: SIGTERM under load, callers that leave mid-batch, broken model directories,
and onnxruntime failing on a batch of several callers."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from h2_relay import H2Relay
from reliability_support import (
    EMBED,
    EMBED_CHUNKED,
    EMBED_STREAM,
    channel_options,
    decode_response,
)

from support.backends import HOLDABLE, HookedLoader, poisoned_by
from support.fixtures import DEFAULT_V
from support.requests import encode, reason_of
from support.server import ServerProcess, ServerThread, serve_args, wait_for

# --- SIGTERM during load


@dataclass
class Outcome:
    sent_at: float
    request_id: str
    code: grpc.StatusCode
    reason: str | None = None
    details: str = ""


@dataclass
class LoadLog:
    outcomes: list[Outcome] = field(default_factory=list)
    wrong_values: int = 0


async def _sigterm_worker(
    channel: grpc.aio.Channel, seed: int, big: bool, until: float, rows: np.ndarray, log: LoadLog
) -> None:
    rng = np.random.default_rng(seed)
    count = 0
    while time.monotonic() < until:
        shape = (16, 512) if big else (int(rng.integers(1, 8)), int(rng.integers(1, 256)))
        ids = rng.integers(0, DEFAULT_V, size=shape, dtype=np.int64)
        request_id = f"w{seed}-{count}"
        count += 1
        sent_at = time.monotonic()
        try:
            raw = await channel.unary_unary(EMBED)(encode(ids, request_id=request_id), timeout=60)
            got = decode_response(raw)
        except grpc.aio.AioRpcError as error:
            log.outcomes.append(
                Outcome(sent_at, request_id, error.code(), reason_of(error), error.details() or "")
            )
            await asyncio.sleep(0.05)  # back off, as a client retry policy would
            continue
        log.outcomes.append(Outcome(sent_at, request_id, grpc.StatusCode.OK))
        if not np.array_equal(got, rows[ids]):
            log.wrong_values += 1


def _handled(output: str) -> dict[str, str]:
    """{request id: status code} of every call the server's handlers saw, from its JSON
    log: one debug line per answer served, one warning per call refused or cancelled."""
    handled: dict[str, str] = {}
    for line in output.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("request_id"):
            handled[entry["request_id"]] = entry["code"]
    return handled


def test_sigterm_under_load_loses_no_accepted_request_and_exits_0(
    default_model_dir: Path, default_rows: np.ndarray
) -> None:
    """Every call a handler took is answered, whatever the timing: the server's own log
    (each call's request id and how it ended) says which calls it took, and the clients
    say what they got. A call refused or cut short was never taken."""
    grace_s = 15.0
    server = ServerProcess(
        serve_args(default_model_dir, "--grace-s", str(grace_s), "--log-level", "debug",
                   "--log-format", "json")
    ).start()  # fmt: skip
    rows = default_rows
    log = LoadLog()
    sigterm_at = exited_at = 0.0
    code: int | None = None
    # The signal comes once this many calls were answered, not after a fixed time: the load
    # is real however slowly it starts (about a second here; several on a busy core).
    loaded_ok = 100

    async def scenario() -> None:
        nonlocal sigterm_at, exited_at, code
        channels = [
            grpc.aio.insecure_channel(server.target, options=channel_options()) for _ in range(6)
        ]
        until = time.monotonic() + 60 + grace_s + 5  # a bound: the workers are cancelled below
        workers = [
            asyncio.ensure_future(_sigterm_worker(channels[i % 6], i, i < 4, until, rows, log))
            for i in range(28)
        ]
        loading_until = time.monotonic() + 60
        while sum(o.code == grpc.StatusCode.OK for o in log.outcomes) < loaded_ok:
            assert time.monotonic() < loading_until, f"not {loaded_ok} answers in 60 s"
            await asyncio.sleep(0.01)
        sigterm_at = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = await asyncio.get_running_loop().run_in_executor(None, server.wait, grace_s + 10)
        exited_at = server.exited_at
        await asyncio.sleep(0.5)  # the workers see the closed port, then stop
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        for channel in channels:
            await channel.close()

    try:
        asyncio.run(scenario())
    finally:
        server.kill()
    handled = _handled(server.output)
    codes = Counter(o.code.name for o in log.outcomes)
    before = [o for o in log.outcomes if o.sent_at < sigterm_at]
    refused = [o for o in log.outcomes if o.reason == "unavailable"]
    untaken = [o for o in log.outcomes if o.request_id not in handled]
    print(
        f"\nSIGTERM under load: {len(log.outcomes)} requests, {dict(codes)}; {len(before)} sent "
        f"before the signal, {sum(o.code == grpc.StatusCode.OK for o in before)} of them OK; "
        f"{len(refused)} refused while draining; {len(untaken)} never reached a handler "
        f"({Counter(o.code.name for o in untaken)}); exit {code} after "
        f"{exited_at - sigterm_at:.2f}s"
    )
    assert code == 0
    assert exited_at - sigterm_at < grace_s
    assert log.wrong_values == 0
    # No accepted call lost: every call a handler took ended as the server logged it,
    # and every one it answered reached its caller; and no call was taken and then cut
    # short (cancelled in flight by a stop that did not wait for it).
    for outcome in log.outcomes:
        logged = handled.get(outcome.request_id)
        if logged is not None:
            assert logged == outcome.code.name, (outcome, logged)
    assert "CANCELLED" not in handled.values(), "a call was cut short in flight"
    assert "grace period" not in server.output and "Traceback" not in server.output
    # The rest never reached a handler: refused as the server went (UNAVAILABLE: no
    # connection), or CANCELLED by gRPC core as it stopped before handing them over
    # (grpc/grpc#41785; the next test shows the drain leaves none waiting before that).
    assert all(o.code.name in ("UNAVAILABLE", "CANCELLED") for o in untaken), untaken[:5]
    # Calls that met the drain were refused, saying why (how many meet it depends on
    # timing: tests/e2e/test_lifecycle.py holds requests at the drain deterministically).
    assert all("draining" in o.details for o in refused)
    assert "signal received: draining" in server.output


def test_calls_waiting_inside_grpc_at_the_drain_are_refused_not_cancelled(
    small_model_dir: Path, start_server: Callable[..., ServerThread]
) -> None:
    """Calls that reached gRPC while the event loop was busy wait there, not yet handed to
    a handler. Stopping gRPC at once would CANCEL them (grpc/grpc#41785); the drain lets
    them in first, so they are refused with UNAVAILABLE like any call meeting the drain.

    The loop stays blocked until the server's transport has read all ten calls (a PING sent
    after them through ``H2Relay`` is answered), so each of them is inside gRPC when the
    drain begins, however slowly they came."""
    server = start_server(small_model_dir)
    assert server.server is not None
    tokembed = server.server

    loop_blocked = threading.Event()
    calls_inside = threading.Event()

    async def busy_then_stop() -> None:
        loop_blocked.set()
        # Blocks the server's event loop, as a long step would: arriving calls wait in gRPC.
        if not calls_inside.wait(30):
            raise RuntimeError("the test never let the server's loop go")
        await tokembed.stop(5)

    with H2Relay(server.port) as relay, grpc.insecure_channel(relay.target) as channel:
        embed = channel.unary_unary(EMBED)
        embed(encode(np.array([[1]])), timeout=10)  # connected and warm
        stopping = server.submit(busy_then_stop())
        try:
            assert loop_blocked.wait(10)
            waiting = [embed.future(encode(np.array([[i]])), timeout=30) for i in range(10)]
            assert relay.wait_requests(1 + len(waiting), 10), "the calls were never sent"
            assert relay.server_has_read_all(10), "the server's transport never read them"
        finally:
            calls_inside.set()
        stopping.result(30)
        outcomes = []
        for future in waiting:
            error = future.exception()
            outcomes.append((error.code(), reason_of(error)) if error is not None else "OK")
    assert outcomes == [(grpc.StatusCode.UNAVAILABLE, "unavailable")] * 10, outcomes


# --- callers that cancel or time out mid-batch


def test_callers_leaving_mid_batch_disturb_nobody_and_leak_no_room(
    default_model_dir: Path, start_server: Callable[..., ServerThread], default_rows: np.ndarray
) -> None:
    """Under real load, callers cancel at random moments (queued, computing, encoding,
    streaming) or set deadlines that expire in flight. Everyone else gets exact answers,
    and afterwards admission holds no bytes and the queue no tokens: every path that
    ends a call early gave its room back."""
    server = start_server(default_model_dir, max_batch_tokens=4096)
    rows = default_rows
    stats: Counter[str] = Counter()
    problems: list[str] = []

    async def good(channel: grpc.aio.Channel, seed: int, until: float) -> None:
        rng = np.random.default_rng(seed)
        while time.monotonic() < until:
            ids = rng.integers(0, DEFAULT_V, size=(int(rng.integers(1, 8)), 256), dtype=np.int64)
            try:
                got = decode_response(await channel.unary_unary(EMBED)(encode(ids), timeout=30))
            except grpc.aio.AioRpcError as error:
                problems.append(f"good: {error.code().name} {error.details()}")
                continue
            stats["good ok"] += 1
            if not np.array_equal(got, rows[ids]):
                problems.append("good: wrong values")

    async def leaver(channel: grpc.aio.Channel, seed: int, until: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            ids = np.random.default_rng(seed).integers(0, DEFAULT_V, size=(4, 512), dtype=np.int64)
            raw = encode(ids)
            kind = rng.choice(["cancel", "deadline", "chunked", "stream"])
            try:
                if kind == "deadline":
                    await channel.unary_unary(EMBED)(raw, timeout=rng.uniform(0.001, 0.05))
                elif kind == "cancel":
                    call = channel.unary_unary(EMBED)(raw, timeout=30)
                    await asyncio.sleep(rng.uniform(0, 0.05))
                    call.cancel()
                    await call
                elif kind == "chunked":  # read the header, then walk away
                    call = channel.unary_stream(EMBED_CHUNKED)(raw, timeout=30)
                    await call.read()
                    call.cancel()
                    await call.read()
                else:  # send three, read one, walk away with two answers unread
                    call = channel.stream_stream(EMBED_STREAM)(iter([raw] * 3), timeout=30)
                    await call.read()
                    call.cancel()
                    await call.read()
                stats[f"{kind} finished first"] += 1
            except asyncio.CancelledError:
                stats[f"{kind} cancelled"] += 1
            except grpc.aio.AioRpcError as error:
                if error.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                    stats[f"{kind} {error.code().name}"] += 1
                else:
                    problems.append(f"{kind}: {error.code().name} {error.details()}")

    async def scenario() -> None:
        channels = [
            grpc.aio.insecure_channel(server.target, options=channel_options()) for _ in range(4)
        ]
        until = time.monotonic() + 8.0
        try:
            await asyncio.gather(
                *(good(channels[i % 4], i, until) for i in range(8)),
                *(leaver(channels[i % 4], 100 + i, until) for i in range(16)),
            )
        finally:
            for channel in channels:
                await channel.close()

    asyncio.run(scenario())
    print(f"\ncallers leaving mid-batch: {dict(stats)}")
    assert not problems, problems[:10]
    assert stats["good ok"] >= 20
    left = sum(v for k, v in stats.items() if k != "good ok" and "finished" not in k)
    assert left >= 20  # callers really did leave early, many times
    # No room leaked: whatever path a call ended by, its ticket came back.
    assert wait_for(lambda: server.metric("tokembed_inflight_output_bytes") == 0, 10), (
        server.metric("tokembed_inflight_output_bytes")
    )
    # Fix: waited for, as the room is. A caller who leaves while queued gives its room
    # back at once, but its queue entry is dropped when the dispatcher next takes a
    # batch: right after the batch computing now. Read at once, this saw 8192 tokens of
    # such entries in one CI run; a leaked entry never goes, and still fails here.
    assert wait_for(lambda: server.metric("tokembed_queued_tokens") == 0, 10), server.metric(
        "tokembed_queued_tokens"
    )
    assert wait_for(lambda: server.metric("tokembed_inflight_requests") == 0, 10)
    ids = np.array([[1, 2, 3]])
    with grpc.insecure_channel(server.target) as channel:
        got = decode_response(channel.unary_unary(EMBED)(encode(ids), timeout=10))
    np.testing.assert_array_equal(got, rows[ids])


def test_a_stream_left_with_more_requests_than_its_window_leaves_nothing_behind(
    small_model_dir: Path,
    start_server: Callable[..., ServerThread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A caller sends more requests than the stream works ahead on (STREAM_WINDOW), reads
    one answer and leaves: the answers waiting in the server are dropped with their room,
    and no server task is left waiting on the abandoned stream."""
    from tokembed.server.core.dataplane import STREAM_WINDOW

    server = start_server(small_model_dir)
    raw = encode(np.arange(4096, dtype=np.int64).reshape(1, 4096) % 1000)  # 1 MiB answers

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            for _ in range(3):
                call = channel.stream_stream(EMBED_STREAM)(
                    iter([raw] * (STREAM_WINDOW + 8)), timeout=30
                )
                await call.read()
                await asyncio.sleep(0.5)  # the server fills its window, then waits
                call.cancel()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
        assert wait_for(lambda: server.metric("tokembed_inflight_requests") == 0, 10)
        gc.collect()  # a task stuck on the abandoned stream would be destroyed here
        server.call(asyncio.sleep(0.2))
    assert "Task was destroyed but it is pending" not in caplog.text
    assert wait_for(lambda: server.metric("tokembed_inflight_output_bytes") == 0, 10)


# --- onnxruntime failing on a batch of several callers


def test_a_failing_batch_fails_all_its_callers_with_internal_and_the_next_batch_succeeds(
    small_model_dir: Path, start_server: Callable[..., ServerThread], small_rows: np.ndarray
) -> None:
    poison = 999
    loader = HookedLoader(fail_when=poisoned_by(poison))
    server = start_server(small_model_dir, loader=loader, **HOLDABLE)
    backend = loader.backend
    assert backend is not None
    mates = [np.array([[10 + i, 20 + i]]) for i in range(5)]
    mates[2] = np.array([[12, poison]])  # one caller's ids make the look-up fail

    async def scenario() -> tuple[Any, list[Any], list[Any]]:
        async with grpc.aio.insecure_channel(server.target) as channel:
            embed = channel.unary_unary(EMBED)
            loader.look_up_gate.close()
            backend.entered.clear()
            blocker = asyncio.ensure_future(embed(encode(np.array([[1]])), timeout=30))
            await asyncio.get_running_loop().run_in_executor(None, backend.entered.wait, 10)
            # The runtime is busy: these five queue up, and go as one batch next. Each is
            # sent once the one before is queued, so the arrival order is the list's order
            # (five calls started together may reach the server in any order).
            batch = []
            for queued, ids in enumerate(mates, start=1):
                batch.append(asyncio.ensure_future(embed(encode(ids), timeout=30)))
                assert await asyncio.get_running_loop().run_in_executor(
                    None,
                    wait_for,
                    lambda tokens=2 * queued: server.metric("tokembed_queued_tokens") == tokens,
                    10,
                )
            loader.look_up_gate.open()
            first = await blocker
            failed = await asyncio.gather(*batch, return_exceptions=True)
            after = [
                await embed(encode(np.array(ids)), timeout=30)
                for ids in ([[5, 6]], [[7]], [[8, 9, 10]])
            ]
            return first, failed, after

    first, failed, after = asyncio.run(scenario())
    np.testing.assert_array_equal(decode_response(first), small_rows[[[1]]])
    assert all(isinstance(e, grpc.aio.AioRpcError) for e in failed), failed
    assert [e.code() for e in failed] == [grpc.StatusCode.INTERNAL] * 5
    assert all(reason_of(e) == "internal" for e in failed)
    # They really were one batch: one look-up of all ten ids, in arrival order.
    computed = [call.ids.tolist() for call in backend.calls]
    assert computed[1] == np.concatenate([ids.ravel() for ids in mates]).tolist()
    for ids, raw in zip(AFTER, after, strict=True):
        np.testing.assert_array_equal(decode_response(raw), small_rows[np.array(ids)])
    assert server.metric("tokembed_requests_total", {"method": "Embed", "code": "INTERNAL"}) == 5
    # Each answer's bytes are given back once gRPC has sent it (a done callback, which may
    # run just after the client has its answer).
    assert wait_for(lambda: server.metric("tokembed_inflight_output_bytes") == 0, 10)


AFTER = ([[5, 6]], [[7]], [[8, 9, 10]])  # the next batches, after the failing one


# --- broken model directories


def _rewrite_manifest(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _rehash(directory: Path, name: str) -> None:
    """Record a file's current size and sha256, as an exporter that wrote it would have."""
    data = (directory / name).read_bytes()

    def change(manifest: dict[str, Any]) -> None:
        manifest["files"][name] = {
            "sha256": hashlib.sha256(data).hexdigest(),
            "size_bytes": len(data),
        }

    _rewrite_manifest(directory, change)


def _truncate(directory: Path, name: str, rehash: bool) -> None:
    path = directory / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    if rehash:
        _rehash(directory, name)


def _replace(directory: Path, payload: bytes) -> None:
    (directory / "model.onnx").write_bytes(payload)
    _rehash(directory, "model.onnx")


def _flip_a_weight_bit(directory: Path) -> None:
    path = directory / "model.onnx.data"
    data = bytearray(path.read_bytes())
    data[1000] ^= 0x01
    path.write_bytes(bytes(data))


def _set(key: str, value: Any) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        def change(manifest: dict[str, Any]) -> None:
            node = manifest
            *parents, last = key.split(".")
            for parent in parents:
                node = node[parent]
            node[last] = value

        _rewrite_manifest(directory, change)

    return apply


BROKEN_DIRECTORIES: dict[str, tuple[Callable[[Path], None], str]] = {
    "bad checksum": (_flip_a_weight_bit, "sha256 is"),
    "truncated model.onnx": (lambda d: _truncate(d, "model.onnx", rehash=False), "size is"),
    "truncated model.onnx, manifest rewritten": (
        lambda d: _truncate(d, "model.onnx", rehash=True), "not a readable ONNX model"),
    "truncated weights, manifest rewritten": (
        lambda d: _truncate(d, "model.onnx.data", rehash=True), "onnxruntime cannot load"),
    "vocab_size disagrees with the graph": (_set("vocab_size", 1001), "[vocab_size, d_model]"),
    "scale disagrees with the graph": (_set("scale", 1.0), "scale"),
    "input name disagrees with the graph": (_set("input.name", "ids"), "input.name"),
    "opset disagrees with the graph": (_set("opset", 11), "opset"),
    "weight dtype disagrees with the graph": (_set("weight_dtype", "float16"), "weight_dtype"),
    "model.onnx empty": (lambda d: _replace(d, b""), "invalid model directory"),
    "model.onnx not ONNX": (lambda d: _replace(d, b"not a model\n"), "not a readable ONNX model"),
}  # fmt: skip


def test_broken_model_directories_are_refused_with_one_clear_line(
    small_model_dir: Path, tmp_path: Path
) -> None:
    """Each started at once (they are independent), then each checked: exit status 2, the
    last line of stderr is one line naming the problem, no traceback."""
    running: dict[str, subprocess.Popen[str]] = {}
    for index, (name, (breaks, _)) in enumerate(BROKEN_DIRECTORIES.items()):
        directory = tmp_path / f"broken-{index}"
        shutil.copytree(small_model_dir, directory)
        breaks(directory)
        running[name] = subprocess.Popen(
            [sys.executable, "-m", "tokembed.cli", "serve", *serve_args(directory)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    failures = []
    for name, process in running.items():
        try:
            _, stderr = process.communicate(timeout=120)
        finally:
            process.kill()
        expected = BROKEN_DIRECTORIES[name][1]
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        if (
            process.returncode != 2
            or "Traceback" in stderr
            or not last.startswith("tokembed serve: error: ")
            or expected not in last
        ):
            failures.append(f"{name}: exit {process.returncode}, stderr ends {stderr[-600:]!r}")
    assert not failures, "\n".join(failures)
