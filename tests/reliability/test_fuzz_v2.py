"""Fuzzing the Open Inference Protocol and system shared memory: thousands of generated
ModelInfer requests, ModelStreamInfer items and shared-memory calls (fuzz_v2_cases.py)
against a ``tokembed serve`` process started with ``--shared-memory system``, on
loopback, with regions the test made and registered; and, beside them, regions truncated
and grown back under the server, registered and unregistered, filled to the cap, and
unregistered with a short deadline while requests use them.

Holds when the server never crashes, every bad request gets its exact status (never
UNKNOWN, never INTERNAL), every valid one is answered exactly (the reference rows), and,
every region unregistered at the end, the server's RSS is back within 10% of what it was
before and it holds as many descriptors as before. "Before" is measured after a warm-up
of the same kinds of requests (its first calls allocate what a server keeps: threads,
caches, connections). Seeded (``TOKEMBED_FUZZ_V2_SEED``), counted
(``TOKEMBED_FUZZ_V2_COUNT``, default 3000 generated requests, and the scenarios' calls),
so a failure replays.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import re
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from fuzz_v2_cases import (
    INVALID,
    MAX_OUTPUT_BYTES,
    MAX_TOKENS,
    OK,
    REASONS,
    Answers,
    InferCase,
    Layout,
    ShmCase,
    infer_case,
    register_case,
    status_or_unregister_case,
    stream_slot_case,
)
from reliability_support import channel_options, peak_rss, rss

from tokembed.v2 import grpc_service_pb2 as pb

from support.requests import reason_of
from support.server import ServerProcess, serve_args

SEED = int(os.environ.get("TOKEMBED_FUZZ_V2_SEED", "20261203"))
COUNT = int(os.environ.get("TOKEMBED_FUZZ_V2_COUNT", "3000"))
WARM_UP = 300  # requests of every kind before "start" is measured
CONCURRENCY = 32  # calls in flight at once
WRITERS, WRITES = 8, 40  # writers into a region being unregistered, requests each at most
CHURNS = 8  # registrations of the churn in flight at once (the layout's stay under the cap)
SLOTS = 8  # output regions, one per call that answers into a region
CALL_TIMEOUT_S = 30.0  # a hung call would surface as DEADLINE_EXCEEDED, a wrong code
RSS_SLACK = 0.10
SETTLE_S = 10.0  # for RSS and descriptors to come back once the last call ended
MAX_REGIONS = 64

SHM_ROOT = Path("/dev/shm")
SERVICE = "/inference.GRPCInferenceService/"
INFER = SERVICE + "ModelInfer"
STREAM = SERVICE + "ModelStreamInfer"

# The objects: ids (int64 then int32), lengths, a large sparse one, output slots.
IDS64, IDS32, LENS = 4096, 4096, 256
BIG_BYTES = 2 << 20  # over the largest request (fuzz_v2_cases.MAX_REQUEST_BYTES)
OUT_BYTES = 64 << 10  # an output slot's window (the largest valid answer is 32 KiB)
OUT_OFFSET = 4096  # where each slot's window starts in its object
LARGE_IDS = np.arange(MAX_OUTPUT_BYTES // (64 * 4), dtype=np.int64).reshape(1, -1) % 997

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")


# --- the objects and the server


def _make_object(name: str, size: int, data: bytes = b"", at: int = 0) -> None:
    fd = os.open(SHM_ROOT / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        if data:
            os.pwrite(fd, data, at)
    finally:
        os.close(fd)


def _read(name: str, size: int, at: int) -> bytes:
    fd = os.open(SHM_ROOT / name, os.O_RDONLY)
    try:
        return os.pread(fd, size, at)
    finally:
        os.close(fd)


def _write(name: str, data: bytes, at: int) -> None:
    fd = os.open(SHM_ROOT / name, os.O_RDWR)
    try:
        os.pwrite(fd, data, at)
    finally:
        os.close(fd)


@dataclass
class Objects:
    prefix: str
    layout: Layout
    ids64: np.ndarray
    ids32: np.ndarray
    registrations: list[tuple[str, str, int, int]]  # name, key, offset, byte_size


@pytest.fixture(scope="module")
def objects() -> Iterator[Objects]:
    prefix = f"tokembedfz{secrets.token_hex(4)}"
    rng = np.random.default_rng(SEED)
    ids64 = rng.integers(0, 1000, IDS64).astype("<i8")
    ids32 = rng.integers(0, 1000, IDS32).astype("<i4")
    lens = rng.integers(1, 9, LENS).astype("<i8")
    try:
        _make_object(f"{prefix}ids", IDS64 * 8 + IDS32 * 4, ids64.tobytes() + ids32.tobytes())
        _make_object(f"{prefix}lens", LENS * 8, lens.tobytes())
        _make_object(f"{prefix}big", BIG_BYTES)  # sparse: zeros that cost nothing
        for slot in range(SLOTS):
            _make_object(f"{prefix}out{slot}", OUT_OFFSET + OUT_BYTES)
        for index in range(2):
            _make_object(f"{prefix}tin{index}", 8192, ids64[:1024].tobytes())
            _make_object(f"{prefix}tout{index}", OUT_OFFSET + OUT_BYTES)
        _make_object(f"{prefix}uout", MAX_OUTPUT_BYTES)
        (SHM_ROOT / f"{prefix}dir").mkdir()
        os.mkfifo(SHM_ROOT / f"{prefix}fifo")
        (SHM_ROOT / f"{prefix}link").symlink_to(SHM_ROOT / f"{prefix}ids")
        key = f"/{prefix}ids"
        registrations = [
            ("in64", key, 0, IDS64 * 8),
            ("in32", key, IDS64 * 8, IDS32 * 4),
            ("lens", f"/{prefix}lens", 0, LENS * 8),
            ("big", f"/{prefix}big", 0, BIG_BYTES),
            *((f"out{s}", f"/{prefix}out{s}", OUT_OFFSET, OUT_BYTES) for s in range(SLOTS)),
        ]
        layout = Layout(
            in64="in64", in32="in32", lens="lens", big="big", ids64=ids64, ids32=ids32,
            lens_values=lens, big_bytes=BIG_BYTES, out_bytes=OUT_BYTES, prefix=prefix,
            bad_keys=tuple(f"/{prefix}{n}" for n in ("missing", "dir", "fifo", "link")),
            object_key=key, object_bytes=IDS64 * 8 + IDS32 * 4,
        )  # fmt: skip
        yield Objects(prefix, layout, ids64, ids32, registrations)
    finally:
        for path in SHM_ROOT.glob(f"{prefix}*"):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()


@pytest.fixture(scope="module")
def fuzzed_server(small_model_dir: Path, objects: Objects) -> Iterator[ServerProcess]:
    args = serve_args(
        small_model_dir,
        "--max-tokens-per-request", str(MAX_TOKENS),
        "--max-output-bytes-per-request", str(MAX_OUTPUT_BYTES),
        "--shared-memory", "system",
        "--shared-memory-prefix", objects.prefix,
        "--shared-memory-max-regions", str(MAX_REGIONS),
    )  # fmt: skip
    server = ServerProcess(args).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def answers(small_rows: np.ndarray) -> Answers:
    import torch

    bf16 = torch.from_numpy(small_rows.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    return Answers(
        {"FP32": small_rows, "FP16": small_rows.astype(np.float16), "BF16": bf16.view("<u2")}
    )


# --- the tally


@dataclass
class Tally:
    sent: collections.Counter[str] = field(default_factory=collections.Counter)  # by kind
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    wrong: list[str] = field(default_factory=list)  # a wrong status, a wrong answer
    exact: int = 0  # valid requests answered exactly

    def check_code(
        self,
        where: str,
        got: grpc.StatusCode,
        reason: str | None,
        want: grpc.StatusCode,
        any_reason: bool = False,
    ) -> bool:
        self.codes[got.name] += 1
        reasons = (REASONS[want], None) if any_reason else (REASONS[want],)
        if got != want or (want != OK and reason not in reasons):
            self.wrong.append(f"{where}: got {got.name}/{reason}, want {want.name}")
            return False
        return True


async def _unary(
    channel: grpc.aio.Channel, path: str, raw: bytes, timeout: float = CALL_TIMEOUT_S
) -> tuple[grpc.StatusCode, str | None, bytes, str]:
    try:
        reply = await channel.unary_unary(path)(raw, timeout=timeout)
    except grpc.aio.AioRpcError as error:
        return error.code(), reason_of(error), b"", error.details() or ""
    return OK, None, reply, ""


def _check_response(case: InferCase, response: pb.ModelInferResponse, where: str) -> str:
    """'' when ``response`` is the case's exact answer, else what is wrong."""
    outputs = list(response.outputs)
    if len(outputs) != 1:
        return f"{where}: {len(outputs)} outputs"
    output = outputs[0]
    described = (output.name, output.datatype, tuple(output.shape))
    if described != ("hidden_states", case.datatype, case.shape):
        return f"{where}: output {described}, want {('hidden_states', case.datatype, case.shape)}"
    if response.id != case.request_id or response.model_name != "small":
        return f"{where}: id {response.id!r} model {response.model_name!r}"
    if case.slot:
        if list(response.raw_output_contents):
            return f"{where}: tensor bytes in the response of an answer in a region"
        return ""
    if list(response.raw_output_contents) != [case.want]:
        return f"{where}: wrong values"
    return ""


# --- the runs


class Fuzz:
    def __init__(
        self,
        channels: list[grpc.aio.Channel],
        objects: Objects,
        answers: Answers,
        tally: Tally,
    ) -> None:
        self.channels = channels
        self.objects = objects
        self.layout = objects.layout
        self.answers = answers
        self.tally = tally
        self.gate = asyncio.Semaphore(CONCURRENCY)
        self.churns = asyncio.Semaphore(CHURNS)
        self.slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(SLOTS):
            self.slots.put_nowait(slot)
        self.fresh = 0

    def channel(self, index: int) -> grpc.aio.Channel:
        return self.channels[index % len(self.channels)]

    def name(self, stem: str) -> str:
        self.fresh += 1
        return f"{stem}{self.fresh}"

    # shared-memory calls

    async def shm(
        self, method: str, raw: bytes, want: grpc.StatusCode, where: str
    ) -> tuple[bool, bytes]:
        self.tally.sent["shm " + method.removeprefix("SystemSharedMemory")] += 1
        async with self.gate:
            code, reason, reply, details = await _unary(self.channels[0], SERVICE + method, raw)
        fine = self.tally.check_code(f"{where} {method}", code, reason, want)
        if not fine:
            self.tally.wrong[-1] += f" ({details!r}, bytes {raw[:48]!r})"
        return fine, reply

    async def register(self, name: str, key: str, offset: int, size: int, where: str) -> None:
        raw = pb.SystemSharedMemoryRegisterRequest(
            name=name, key=key, offset=offset, byte_size=size
        ).SerializeToString()
        await self.shm("SystemSharedMemoryRegister", raw, OK, where)

    async def unregister(self, name: str, where: str) -> None:
        raw = pb.SystemSharedMemoryUnregisterRequest(name=name).SerializeToString()
        await self.shm("SystemSharedMemoryUnregister", raw, OK, where)

    async def registered(self) -> dict[str, pb.SystemSharedMemoryStatusResponse.RegionStatus]:
        raw = pb.SystemSharedMemoryStatusRequest().SerializeToString()
        fine, reply = await self.shm("SystemSharedMemoryStatus", raw, OK, "status of all")
        if not fine:
            return {}
        return dict(pb.SystemSharedMemoryStatusResponse.FromString(reply).regions)

    async def register_layout(self) -> None:
        for name, key, offset, size in self.objects.registrations:
            await self.register(name, key, offset, size, "layout")

    # ModelInfer

    async def infer(self, case: InferCase, index: int, kind: str = "ModelInfer") -> None:
        async with self.gate:
            self.tally.sent[kind] += 1
            slot = await self.slots.get() if case.slot else -1
            try:
                await self._infer(case, index, slot)
            finally:
                if slot >= 0:
                    self.slots.put_nowait(slot)

    async def _infer(self, case: InferCase, index: int, slot: int) -> None:
        where = f"ModelInfer {case.category}"
        slot_object = f"{self.objects.prefix}out{slot}"
        marker = b"\xee" * OUT_BYTES
        if slot >= 0:
            _write(slot_object, marker, OUT_OFFSET)
        raw = case.wire(f"out{slot}")
        code, reason, reply, details = await _unary(self.channel(index), INFER, raw)
        if not self.tally.check_code(where, code, reason, case.code, case.any_reason):
            self.tally.wrong[-1] += f" ({details!r}, bytes {raw[:48]!r})"
            return
        refused_into_slot = slot >= 0 and code != OK
        if refused_into_slot and _read(slot_object, OUT_BYTES, OUT_OFFSET) != marker:
            self.tally.wrong.append(f"{where}: refused, yet wrote into its region")
        if code != OK:
            return
        problem = _check_response(case, pb.ModelInferResponse.FromString(reply), where)
        if not problem and slot >= 0:
            got = _read(slot_object, len(case.want), OUT_OFFSET + case.out_offset)
            problem = "" if got == case.want else f"{where}: wrong values in the region"
        if problem:
            self.tally.wrong.append(problem)
        else:
            self.tally.exact += 1

    # ModelStreamInfer

    async def stream(self, cases: list[InferCase], index: int) -> None:
        async with self.gate:
            self.tally.sent["ModelStreamInfer streams"] += 1
            self.tally.sent["ModelStreamInfer items"] += len(cases)
            call = self.channel(index).stream_stream(STREAM)(
                iter([case.wire() for case in cases]), timeout=CALL_TIMEOUT_S
            )
            try:
                replies = [pb.ModelStreamInferResponse.FromString(raw) async for raw in call]
            except grpc.aio.AioRpcError as error:
                self.tally.codes[error.code().name] += 1
                self.tally.wrong.append(f"ModelStreamInfer ended {error.code().name}")
                return
        self.tally.codes["OK"] += 1
        if len(replies) != len(cases):
            self.tally.wrong.append(f"ModelStreamInfer: {len(replies)} answers, {len(cases)} asked")
            return
        for case, reply in zip(cases, replies, strict=True):
            where = f"ModelStreamInfer {case.category}"
            if case.code != OK:
                message = reply.error_message
                if not message or message.startswith("internal error"):
                    self.tally.wrong.append(f"{where}: answered {message or 'OK'!r}")
            elif reply.error_message:
                self.tally.wrong.append(f"{where}: refused {reply.error_message!r}")
            elif problem := _check_response(case, reply.infer_response, where):
                self.tally.wrong.append(problem)
            else:
                self.tally.exact += 1

    # scenarios, each on regions of its own, each step awaited

    async def churn(self, rng: random.Random) -> None:
        """Register a window of the ids under a fresh name, read it, see its status,
        unregister it, and see it gone."""
        async with self.churns:
            await self._churn(rng)

    async def _churn(self, rng: random.Random) -> None:
        name = self.name("churn")
        start, count = rng.randrange(IDS64 - 64), rng.randint(1, 64)
        await self.register(name, self.layout.object_key, start * 8, count * 8, "churn")
        raw = pb.SystemSharedMemoryStatusRequest(name=name).SerializeToString()
        fine, reply = await self.shm("SystemSharedMemoryStatus", raw, OK, "churn")
        if fine:
            entry = pb.SystemSharedMemoryStatusResponse.FromString(reply).regions[name]
            got = (entry.name, entry.key, entry.offset, entry.byte_size)
            if got != (name, self.layout.object_key, start * 8, count * 8):
                self.tally.wrong.append(f"churn: status {got}")
        request = pb.ModelInferRequest(model_name="small")
        tensor = request.inputs.add(name="input_ids", datatype="INT64", shape=[1, count])
        tensor.parameters["shared_memory_region"].string_param = name
        tensor.parameters["shared_memory_byte_size"].int64_param = count * 8
        ids = self.objects.ids64[start : start + count]
        want = self.answers.of("FP32", ids.astype(np.int64), None, False)
        await self.infer(
            InferCase("churn", OK, request, want=want, shape=(1, count, 64), datatype="FP32"),
            0, "ModelInfer (scenarios)",
        )  # fmt: skip
        await self.unregister(name, "churn")
        await self.shm("SystemSharedMemoryStatus", raw, INVALID, "churn, unregistered")

    async def truncate_and_regrow(self, rng: random.Random, index: int, rounds: int) -> None:
        """An input region and an output region whose objects shrink under the server
        (a clear refusal, nothing written) and grow back (exact answers again)."""
        tin, tout = f"{self.objects.prefix}tin{index}", f"{self.objects.prefix}tout{index}"
        names = (f"tin{index}", f"tout{index}")
        await self.register(names[0], f"/{tin}", 0, 8192, "truncate")
        await self.register(names[1], f"/{tout}", OUT_OFFSET, OUT_BYTES, "truncate")
        ids = self.objects.ids64[:1024].astype(np.int64)
        for _ in range(rounds):
            count = rng.randint(1, 256)
            start = rng.randrange(1024 - count)
            request = pb.ModelInferRequest(model_name="small", id="trunc")
            tensor = request.inputs.add(name="input_ids", datatype="INT64", shape=[1, count])
            tensor.parameters["shared_memory_region"].string_param = names[0]
            tensor.parameters["shared_memory_byte_size"].int64_param = count * 8
            tensor.parameters["shared_memory_offset"].int64_param = start * 8
            output = request.outputs.add(name="hidden_states")
            output.parameters["shared_memory_region"].string_param = names[1]
            output.parameters["shared_memory_byte_size"].int64_param = count * 256
            want = self.answers.of("FP32", ids[start : start + count], None, False)
            shrink = rng.choice(["input", "output"])
            victim = tin if shrink == "input" else tout
            full = 8192 if shrink == "input" else OUT_OFFSET + OUT_BYTES
            os.truncate(SHM_ROOT / victim, rng.choice([0, 1, full // 2, full - 1]))
            await self._scenario_infer(request, INVALID, b"", "truncated", tout, count)
            os.truncate(SHM_ROOT / victim, full + rng.choice([0, 0, 4096]))  # back, or larger
            if shrink == "input":
                _write(tin, ids.astype("<i8").tobytes(), 0)
            await self._scenario_infer(request, OK, want, "regrown", tout, count)
        for name in names:
            await self.unregister(name, "truncate")

    async def _scenario_infer(
        self,
        request: pb.ModelInferRequest,
        want_code: grpc.StatusCode,
        want: bytes,
        what: str,
        out_object: str,
        count: int,
    ) -> None:
        self.tally.sent["ModelInfer (scenarios)"] += 1
        where = f"ModelInfer {what}"
        marker = b"\xee" * (count * 256)
        if want_code != OK:
            with contextlib.suppress(OSError):
                _write(out_object, marker, OUT_OFFSET)
        code, reason, reply, details = await _unary(
            self.channels[1], INFER, request.SerializeToString()
        )
        if not self.tally.check_code(where, code, reason, want_code):
            self.tally.wrong[-1] += f" ({details!r})"
            return
        if code != OK:
            return
        response = pb.ModelInferResponse.FromString(reply)
        if list(response.raw_output_contents) or _read(out_object, len(want), OUT_OFFSET) != want:
            self.tally.wrong.append(f"{where}: wrong answer in the region")
        else:
            self.tally.exact += 1

    async def unregister_while_used(self, rng: random.Random, rounds: int) -> None:
        """Writers send request after request answering into a region while it is
        unregistered with a deadline of a few milliseconds: each request is answered
        (exactly) or refused (the region was gone when it came; its writer stops), and the
        region goes either way (the descriptor count at the end shows it)."""
        uout = f"{self.objects.prefix}uout"
        want = self.answers.of("FP32", LARGE_IDS.reshape(-1), None, False)
        for _ in range(rounds):
            name = self.name("busy")
            await self.register(name, f"/{uout}", 0, MAX_OUTPUT_BYTES, "unregister while used")
            request = pb.ModelInferRequest(model_name="small")
            request.inputs.add(name="input_ids", datatype="INT64", shape=list(LARGE_IDS.shape))
            request.raw_input_contents.append(LARGE_IDS.astype("<i8").tobytes())
            output = request.outputs.add(name="hidden_states")
            output.parameters["shared_memory_region"].string_param = name
            output.parameters["shared_memory_byte_size"].int64_param = MAX_OUTPUT_BYTES
            raw = request.SerializeToString()
            writers = [asyncio.ensure_future(self._writer(i, raw)) for i in range(WRITERS)]
            await asyncio.sleep(rng.choice([0.002, 0.005, 0.01]))
            unregister = pb.SystemSharedMemoryUnregisterRequest(name=name).SerializeToString()
            timeout = rng.choice([0.002, 0.003, 0.004, 0.006])
            code, _, _, _ = await _unary(
                self.channels[0], SERVICE + "SystemSharedMemoryUnregister", unregister, timeout
            )
            self.tally.sent["shm Unregister"] += 1
            self.tally.codes[code.name] += 1
            if code not in (OK, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.tally.wrong.append(f"unregister while used: {code.name}")
            await self.unregister(name, "unregister while used")  # idempotent: gone already
            answered = sum(await asyncio.gather(*writers))
            if answered and _read(uout, len(want), 0) != want:
                self.tally.wrong.append("unregister while used: wrong answer in the region")

    async def _writer(self, index: int, raw: bytes) -> int:
        """Requests one after the other until one is refused (or WRITES): how many were
        answered."""
        answered = 0
        for _ in range(WRITES):
            code, _, reply, details = await _unary(self.channel(index), INFER, raw)
            self.tally.sent["ModelInfer (scenarios)"] += 1
            self.tally.codes[code.name] += 1
            if code != OK:
                if code != INVALID or "no shared-memory region" not in details:
                    self.tally.wrong.append(f"unregister while used: {code.name} {details!r}")
                break
            answered += 1
            if list(pb.ModelInferResponse.FromString(reply).raw_output_contents):
                self.tally.wrong.append("unregister while used: tensor bytes sent")
        self.tally.exact += answered
        return answered

    async def fill_to_the_cap(self) -> None:
        """Registrations up to --shared-memory-max-regions, then one refused."""
        held = len(await self.registered())
        names = [self.name("cap") for _ in range(MAX_REGIONS - held)]
        for name in names:
            await self.register(name, self.layout.object_key, 0, 8, "fill to the cap")
        raw = pb.SystemSharedMemoryRegisterRequest(
            name=self.name("over"), key=self.layout.object_key, offset=0, byte_size=8
        ).SerializeToString()
        await self.shm("SystemSharedMemoryRegister", raw, INVALID, "one past the cap")
        for name in names:
            await self.unregister(name, "fill to the cap")

    async def run(self, seed: int, count: int) -> None:
        """``count`` generated requests: about 45% ModelInfer, 30% stream items, 20%
        shared-memory calls, 5% registration churn; with the scenarios beside them."""
        rng = random.Random(seed)
        jobs = []
        pending: list[InferCase] = []
        made = 0
        while made < count:
            draw = rng.random()
            if draw < 0.45:
                case = infer_case(rng, self.layout, self.answers, unary=True)
                jobs.append(self.infer(case, made))
                made += 1
            elif draw < 0.75:
                pending.append(
                    stream_slot_case(rng, self.layout, self.answers)
                    if rng.random() < 0.03
                    else infer_case(rng, self.layout, self.answers, unary=False)
                )
                made += 1
                if len(pending) >= rng.randint(1, 16):
                    jobs.append(self.stream(pending, made))
                    pending = []
            elif draw < 0.95:
                make = register_case if rng.random() < 0.6 else status_or_unregister_case
                shm_case: ShmCase = make(rng, self.layout)
                call = self.shm(shm_case.method, shm_case.raw, shm_case.code, shm_case.category)
                jobs.append(call)
                made += 1
            else:
                jobs.append(self.churn(random.Random(rng.getrandbits(32))))
                made += 5
        if pending:
            jobs.append(self.stream(pending, made))
        rounds = max(2, count // 300)
        jobs += [
            self.truncate_and_regrow(random.Random(seed + 1), 0, rounds),
            self.truncate_and_regrow(random.Random(seed + 2), 1, rounds),
            self.unregister_while_used(random.Random(seed + 3), 4 * rounds),
        ]
        rng.shuffle(jobs)
        await asyncio.gather(*jobs)


def _descriptors(pid: int) -> collections.Counter[str]:
    """What the process's descriptors are open on, counted: a file by its path, a socket
    or a pipe by its kind (a connection made again is the same count, another inode)."""
    held: collections.Counter[str] = collections.Counter()
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while listed
            held[re.sub(r":\[\d+\]$", "", os.readlink(entry))] += 1
    return held


async def _fuzz(
    server: ServerProcess, objects: Objects, answers: Answers
) -> tuple[Tally, dict[str, float]]:
    assert server.process is not None
    pid = server.process.pid
    channels = [grpc.aio.insecure_channel(server.target, options=channel_options())
                for _ in range(4)]  # fmt: skip
    figures: dict[str, float] = {}
    try:
        warm = Fuzz(channels, objects, answers, Tally())
        await warm.register_layout()
        await warm.run(SEED - 1, WARM_UP)
        await warm.unregister("", "after the warm-up")
        assert not warm.tally.wrong, warm.tally.wrong[:10]
        figures["rss_start"], fds_start = rss(pid), _descriptors(pid)

        tally = Tally()
        fuzz = Fuzz(channels, objects, answers, tally)
        started = time.monotonic()
        await fuzz.register_layout()
        await fuzz.run(SEED, COUNT)
        await fuzz.fill_to_the_cap()
        await fuzz.unregister("", "at the end")
        if await fuzz.registered():
            tally.wrong.append("regions left after unregistering every one")
        figures["duration_s"] = time.monotonic() - started
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and (
            rss(pid) > figures["rss_start"] * (1 + RSS_SLACK) or _descriptors(pid) != fds_start
        ):
            await asyncio.sleep(0.2)
        figures["rss_end"], fds_end = rss(pid), _descriptors(pid)
        figures["rss_peak"] = peak_rss(pid)
        figures["fds_start"], figures["fds_end"] = fds_start.total(), fds_end.total()
        left = fds_end - fds_start
        if left:
            tally.wrong.append(f"descriptors left open: {dict(left)}")
    finally:
        for channel in channels:
            await channel.close()
    return tally, figures


def test_fuzzed_v2_and_shared_memory_requests(
    fuzzed_server: ServerProcess, objects: Objects, answers: Answers
) -> None:
    tally, figures = asyncio.run(_fuzz(fuzzed_server, objects, answers))
    sent = sum(n for kind, n in tally.sent.items() if kind != "ModelStreamInfer streams")
    print(
        f"\nv2 fuzz seed={SEED}: {sent} requests in {figures['duration_s']:.1f}s "
        f"({dict(tally.sent)}); codes {dict(tally.codes)}; {tally.exact} valid answered "
        f"exactly; {len(tally.wrong)} wrong; RSS {figures['rss_start'] / 2**20:.1f} -> "
        f"{figures['rss_end'] / 2**20:.1f} MiB (peak {figures['rss_peak'] / 2**20:.1f}); "
        f"descriptors {figures['fds_start']:.0f} -> {figures['fds_end']:.0f}"
    )
    assert fuzzed_server.process is not None and fuzzed_server.process.poll() is None, (
        "the server died:\n" + fuzzed_server.output[-5000:]
    )
    assert sent >= COUNT
    assert not tally.wrong, f"{len(tally.wrong)} wrong:\n" + "\n".join(tally.wrong[:20])
    assert "UNKNOWN" not in tally.codes and "INTERNAL" not in tally.codes
    assert tally.exact >= COUNT // 5  # the valid share really ran
    assert "Traceback" not in fuzzed_server.output, fuzzed_server.output[-5000:]
    assert figures["fds_end"] == figures["fds_start"], "descriptors left open"
    assert figures["rss_end"] <= figures["rss_start"] * (1 + RSS_SLACK), (
        f"RSS {figures['rss_start'] / 2**20:.1f} -> {figures['rss_end'] / 2**20:.1f} MiB"
    )
    fuzzed_server.send_signal(signal.SIGTERM)
    assert fuzzed_server.wait(30) == 0
