"""End to end, what a V2 request's inputs may cost the server before it is refused: the
real server (``--shared-memory system``), tritonclient, regions made as its users make
them.

Proved here:
- inputs are checked against the model's declared inputs (count, names, datatypes,
  shapes, declared sizes) before a byte is read from any region: 200 inputs ``x0..x199``
  naming one 2 MiB region, 15 of them (with or without ``input_ids``), and an
  ``input_ids`` whose window is larger than its shape needs, are refused INVALID_ARGUMENT
  having read nothing (the process's ``rchar``, bytes read by ``read``/``pread``) and
  with the peak resident memory flat (``VmHWM``, wide margin);
- an unknown input name is refused naming it and the inputs the model takes, in a region
  or in the request, and inside a stream alone (the stream goes on, its inputs read from
  a region);
- the largest request the limits allow, its ids and its answer in regions, does not hold
  the event loop: no loop step costs more than a few milliseconds of the loop thread's
  CPU (CPU time, not wall time: a busy machine does not move it).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from support.fixtures import SMALL_D, SMALL_V
from support.shared_memory import SHM_ROOT, MakeRegion, made_regions, serve

MODEL = "small"
MiB = 1 << 20
pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")


@pytest.fixture
def prefix() -> str:
    return f"tokembedl{secrets.token_hex(4)}"


@pytest.fixture
def regions(prefix: str) -> Iterator[MakeRegion]:
    with made_regions(prefix) as make:
        yield make


def bytes_read() -> int:
    """Bytes this process (the server runs in its thread) has read with read/pread."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def reset_peak_rss() -> int:
    """Start a new peak of resident memory; the resident memory now (bytes)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def region_input(name: str, shape: list[int], region: str, byte_size: int) -> Any:
    tensor = tc.InferInput(name, shape, "INT64")
    tensor.set_shared_memory(region, byte_size)
    return tensor


IDS = np.array([[0, 1, SMALL_V - 1, 17, 5]], dtype=np.int64)


def test_many_inputs_at_one_region_are_refused_before_a_byte_is_read(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    size = 2 * MiB
    name, key, _ = regions("big", size)
    ids_name, ids_key, ids_handle = regions("ids", IDS.nbytes)
    shm.set_shared_memory_region(ids_handle, [IDS])
    with tc.InferenceServerClient(server.target) as client:
        client.register_system_shared_memory(name, key, size)
        client.register_system_shared_memory(ids_name, ids_key, IDS.nbytes)
        many = [region_input(f"x{i}", [1, size // 8], name, size) for i in range(200)]
        ids = region_input("input_ids", list(IDS.shape), ids_name, IDS.nbytes)
        cases = [
            # More inputs than any model takes: refused before one is looked at.
            (many, "the request has 200 inputs; an embed request takes at most 16"),
            # Inputs the model does not take: refused naming the first, before any read.
            (many[:15], "unexpected input 'x0': model 'small' (token kind) takes input_ids"),
            ([ids, *many[:15]], "unexpected input 'x0'"),
        ]
        for inputs, words in cases:
            read_before, rss_before = bytes_read(), reset_peak_rss()
            with pytest.raises(InferenceServerException) as refused:
                client.infer(MODEL, inputs)
            read, grown = bytes_read() - read_before, peak_rss() - rss_before
            # Before: 200 x 2 MiB read (400 MiB) and the peak grew by as much.
            assert read < 1 * MiB, f"{read} bytes read for a refused request"
            assert grown < 64 * MiB, f"peak resident memory grew by {grown} bytes"
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert words in refused.value.message(), refused.value.message()
        # The server goes on, its inputs from the region.
        given = region_input("input_ids", list(IDS.shape), ids_name, IDS.nbytes)
        result = client.infer(MODEL, [given])
        np.testing.assert_array_equal(result.as_numpy("hidden_states"), small_rows[IDS])


def test_a_window_larger_than_its_shape_needs_is_refused_unread(
    start_server: Any, small_model_dir: Path, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    size = 2 * MiB
    name, key, _ = regions("big", size)
    with tc.InferenceServerClient(server.target) as client:
        client.register_system_shared_memory(name, key, size)
        for shape in ([1, 4], [1, size // 8 + 1], [1, 1 << 40]):
            read_before = bytes_read()
            with pytest.raises(InferenceServerException) as refused:
                client.infer(MODEL, [region_input("input_ids", shape, name, size)])
            assert bytes_read() - read_before < 1 * MiB
            assert refused.value.status() in (
                "StatusCode.INVALID_ARGUMENT", "StatusCode.RESOURCE_EXHAUSTED"
            )  # fmt: skip
        assert "declared as 2097152 bytes" in _message(client, name, size, [1, 4])
        assert "shape [1, 4] of int64 needs 32" in _message(client, name, size, [1, 4])


def _message(client: Any, region: str, size: int, shape: list[int]) -> str:
    with pytest.raises(InferenceServerException) as refused:
        client.infer(MODEL, [region_input("input_ids", shape, region, size)])
    return str(refused.value.message())


def test_an_unknown_input_name_is_named_with_the_inputs_the_model_takes(
    start_server: Any, small_model_dir: Path
) -> None:
    server = start_server(small_model_dir)
    with tc.InferenceServerClient(server.target) as client:
        for inputs in (["input_id"], ["input_ids", "token_type_ids"]):
            tensors = []
            for input_name in inputs:
                tensor = tc.InferInput(input_name, list(IDS.shape), "INT64")
                tensor.set_data_from_numpy(IDS)
                tensors.append(tensor)
            with pytest.raises(InferenceServerException) as refused:
                client.infer(MODEL, tensors)
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
            message = refused.value.message()
            assert f"unexpected input {inputs[-1]!r}" in message, message
            assert "model 'small' (token kind) takes input_ids" in message, message


class LoopProbe:
    """On the server's loop, a task that wakes every millisecond and records how much of
    the loop thread's CPU went by between two wake-ups: the longest step some other
    callback held the loop for."""

    def __init__(self) -> None:
        self.longest_cpu_s = 0.0
        self.longest_wall_s = 0.0
        self.ticks = 0
        self.stop = threading.Event()

    async def run(self) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        while not self.stop.is_set():
            await asyncio.sleep(0.001)
            now_cpu, now_wall = time.thread_time(), time.perf_counter()
            self.longest_cpu_s = max(self.longest_cpu_s, now_cpu - cpu)
            self.longest_wall_s = max(self.longest_wall_s, now_wall - wall)
            cpu, wall = now_cpu, now_wall
            self.ticks += 1


def test_the_largest_legal_shared_memory_request_does_not_hold_the_loop(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    tokens = server.settings.max_tokens_per_request
    ids = (np.arange(tokens, dtype=np.int64) % SMALL_V).reshape(1, tokens)
    out_bytes = tokens * SMALL_D * 4
    in_name, in_key, in_handle = regions("in", ids.nbytes)
    out_name, out_key, out_handle = regions("out", out_bytes)
    shm.set_shared_memory_region(in_handle, [ids])
    with tc.InferenceServerClient(server.target) as client:
        client.register_system_shared_memory(in_name, in_key, ids.nbytes)
        client.register_system_shared_memory(out_name, out_key, out_bytes)
        given = region_input("input_ids", list(ids.shape), in_name, ids.nbytes)
        wanted = tc.InferRequestedOutput("hidden_states")
        wanted.set_shared_memory(out_name, out_bytes)
        client.infer(MODEL, [given], outputs=[wanted])  # warm: first-use costs aside
        probe = LoopProbe()
        probing = server.submit(probe.run())
        try:
            for _ in range(10):
                client.infer(MODEL, [given], outputs=[wanted])
        finally:
            probe.stop.set()
            probing.result(30)
        answer = shm.get_contents_as_numpy(out_handle, np.float32, (1, tokens, SMALL_D))
        np.testing.assert_array_equal(answer, small_rows[ids])
    print(
        f"largest legal shared-memory request ({tokens} ids, {ids.nbytes} bytes in, "
        f"{out_bytes} out): longest loop step {probe.longest_cpu_s * 1e3:.2f} ms of CPU, "
        f"{probe.longest_wall_s * 1e3:.2f} ms of wall time, over {probe.ticks} ticks"
    )
    assert probe.ticks > 0
    # A loop step's CPU: a busy machine stretches wall time, not this.
    assert probe.longest_cpu_s < 0.010, probe.longest_cpu_s


def test_a_stream_reads_inputs_from_regions_and_refuses_unknown_ones_alone(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, prefix: str, regions: Any
) -> None:
    server = serve(start_server, small_model_dir, prefix)
    ids_name, ids_key, ids_handle = regions("ids", IDS.nbytes)
    shm.set_shared_memory_region(ids_handle, [IDS])
    answers: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        answers.append(error if error is not None else result)
        if len(answers) == 2:
            done.set()

    with tc.InferenceServerClient(server.target) as client:
        client.register_system_shared_memory(ids_name, ids_key, IDS.nbytes)
        given = region_input("input_ids", list(IDS.shape), ids_name, IDS.nbytes)
        stray = region_input("x", list(IDS.shape), ids_name, IDS.nbytes)
        client.start_stream(callback)
        client.async_stream_infer(MODEL, [given, stray], request_id="a")
        client.async_stream_infer(MODEL, [given], request_id="b")
        assert done.wait(30)
        client.stop_stream()
    refused, served = answers
    assert isinstance(refused, InferenceServerException)
    assert "unexpected input 'x'" in refused.message()
    np.testing.assert_array_equal(served.as_numpy("hidden_states"), small_rows[IDS])
