# Generated from client/shared_memory_aio.py by `python scripts/gen_sync_client.py`: edit that
# file and run the script; tests/test_generated_code.py checks this one is current.
"""Answers through system shared memory, for a client on the server's host: the session
``AsyncSharedMemorySession`` (client/shared_memory_aio.py, the source) and
``SharedMemorySession`` (client/shared_memory.py, generated from it by
``python scripts/gen_sync_client.py``).

    with EmbeddingClient("127.0.0.1:50051") as client:
        with client.shared_memory(capacity_bytes=64 << 20) as shm:
            hidden = shm.embed(ids)      # a read-only view of the region: no socket, no copy
            keep = hidden.copy()         # ...valid until the next shm.embed: copy to keep

    async with AsyncEmbeddingClient("127.0.0.1:50051") as client:
        async with await client.shared_memory(capacity_bytes=64 << 20) as shm:
            hidden = await shm.embed(ids)

The session makes a POSIX shared-memory object of its own (``/dev/shm/<prefix>_<pid>_<random>``,
mode 0600 unless told otherwise), maps it, and registers it with the server over the Open
Inference Protocol (``SystemSharedMemoryRegister``, Triton's extension: the same RPCs
tritonclient uses). Each ``embed`` writes the ids (and a segment model's token types, after
them) into the start of the region, asks ``ModelInfer`` for the answer to be written after
them, in any answer dtype the client takes (bfloat16: ``ml_dtypes.bfloat16``), and returns
the answer as a numpy array over the region itself. When the session ends it unregisters
the region and removes the object; arrays still held keep their pages until they are
dropped.

The contract: an array from ``embed`` is valid until the session's next ``embed``, which
writes its answer into the same bytes (copy an answer to keep it). Calls on one session
take turns (a lock); open one session per thread (or task) for concurrency.

It needs the server to run with ``--shared-memory system`` on this host, as the user
that runs the session (the server takes only objects of its own user), and its
``--shared-memory-prefix`` to be the session's ``prefix``. Otherwise opening the session
raises ``SharedMemoryUnavailableError``, with the server's reason. Linux only (the
objects live in /dev/shm).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from tokembed.client import codec, dtypes
from tokembed.client._sync_backend import Lock
from tokembed.client.errors import (
    EmbeddingError,
    SharedMemoryUnavailableError,
    client_invalid_input,
    from_rpc_error,
)

SHM_ROOT = Path("/dev/shm")
SERVICE = "/inference.GRPCInferenceService/"
DEFAULT_CAPACITY_BYTES = 64 << 20
DEFAULT_PREFIX = "tokembed"
# Each input after the first, and the answer, starts at the first multiple of this after
# what precedes it (whole cache lines, and every dtype's alignment).
_ALIGN = 64
# The inputs' names in V2 (a segment model's second input is its token types).
INPUT_IDS = "input_ids"
TOKEN_TYPE_IDS = "token_type_ids"
# The codec encodes ids as int64 or int32: their rows, by width.
_ID_DTYPES = {dtypes.INT64.itemsize: dtypes.INT64, dtypes.INT32.itemsize: dtypes.INT32}
# A registration refused with these says that the server cannot use the region (its shared
# memory off, another prefix, an object it cannot open): SharedMemoryUnavailableError.
_UNUSABLE = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


class SharedMemorySession:
    """A region of a client's, registered with the server; see the module docstring.

    Made by the client's ``shared_memory()``, which registers it.
    """

    def __init__(
        self,
        channel: Any,
        *,
        target: str,
        metadata: tuple[tuple[str, str], ...] = (),
        timeout_s: float | None = None,
        model_name: str = "",
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        prefix: str = DEFAULT_PREFIX,
        mode: int = 0o600,
    ) -> None:
        if capacity_bytes <= 0:
            raise client_invalid_input(f"capacity_bytes must be positive, got {capacity_bytes}")
        from tokembed.v2 import grpc_service_pb2 as pb

        self._pb = pb
        self._target = target
        self._model_name = model_name
        self._metadata = metadata
        self._timeout_s = timeout_s
        self._lock = Lock()
        self.name = f"{prefix}_{os.getpid()}_{secrets.token_hex(8)}"
        self.key = f"/{self.name}"
        self.capacity_bytes = capacity_bytes
        self._path = SHM_ROOT / self.name
        self._calls = {
            method: channel.unary_unary(
                SERVICE + method,
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
            for method, request, response in (
                ("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest,
                 pb.SystemSharedMemoryRegisterResponse),
                ("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest,
                 pb.SystemSharedMemoryUnregisterResponse),
                ("ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse),
            )
        }  # fmt: skip
        fd = os.open(
            self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, mode
        )
        self._closed = False
        try:
            os.ftruncate(fd, capacity_bytes)
            self._map = mmap.mmap(fd, capacity_bytes)
        except BaseException:
            os.close(fd)
            self._path.unlink()
            raise
        os.close(fd)  # the mapping keeps the object

    def _register(self) -> None:
        """Register the region with the server (the client's ``shared_memory()`` does,
        before it hands the session over); a refusal removes the object again."""
        pb = self._pb
        try:
            self._rpc(
                "SystemSharedMemoryRegister",
                pb.SystemSharedMemoryRegisterRequest(
                    name=self.name, key=self.key, offset=0, byte_size=self.capacity_bytes
                ),
            )
        except BaseException as exc:
            self._release_local()
            if isinstance(exc, EmbeddingError) and exc.code in _UNUSABLE:
                raise SharedMemoryUnavailableError(
                    f"the server at {self._target} cannot use this client's shared memory: "
                    f"{exc.details}",
                    code=exc.code, reason=exc.reason, details=exc.details,
                ) from exc  # fmt: skip
            raise

    # --- calls

    def embed(
        self,
        ids: Any,
        dtype: Any = "float32",
        *,
        token_types: Any = None,
        model: str | None = None,
        timeout_s: float | None = None,
    ) -> npt.NDArray[Any]:
        """``[B, S, D]`` for rectangular ``ids``, as a read-only array over the region:
        valid until this session's next ``embed`` (copy it to keep it). ``dtype`` and
        ``token_types`` (a segment model's, one per id) as the client's ``embed`` takes
        them."""
        answer_dtype = codec.output_dtype(dtype)
        encoded = codec.encode_ids(ids)
        if encoded.lengths is not None:
            raise client_invalid_input("shared memory takes rectangular [B, S] ids only")
        inputs = [(INPUT_IDS, encoded.ids)]
        if token_types is not None:
            inputs.append((TOKEN_TYPE_IDS, codec.encode_token_types(token_types, encoded).ids))
        # Each input at the next aligned offset, the answer after the last.
        placed: list[tuple[str, npt.NDArray[Any], int]] = []
        end = 0
        for name, array in inputs:
            placed.append((name, array, end))
            end = _aligned(end + array.nbytes)
        out_offset = end
        if out_offset >= self.capacity_bytes:
            what = "ids and token types" if token_types is not None else "ids"
            sent = sum(array.nbytes for _, array, _ in placed)
            raise client_invalid_input(
                f"the {what} ({sent} bytes) do not fit the region "
                f"({self.capacity_bytes} bytes); open the session with a larger capacity_bytes"
            )
        out_size = self.capacity_bytes - out_offset
        pb = self._pb
        request = pb.ModelInferRequest(
            model_name=self._model_name if model is None else model,
            inputs=[pb.ModelInferRequest.InferInputTensor(
                name=name, datatype=_ID_DTYPES[array.itemsize].v2, shape=list(array.shape),
                parameters=self._window(offset, array.nbytes),
            ) for name, array, offset in placed],
            outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(
                name="hidden_states",
                parameters={**self._window(out_offset, out_size),
                            "datatype": pb.InferParameter(string_param=answer_dtype.v2)},
            )],
        )  # fmt: skip
        numpy_dtype = answer_dtype.numpy
        with self._lock:
            self._check_open()
            for _, array, offset in placed:
                self._map[offset : offset + array.nbytes] = array.tobytes()
            response = self._rpc("ModelInfer", request, timeout_s)
            (output,) = response.outputs
            shape = tuple(int(n) for n in output.shape)
            count = int(np.prod(shape, dtype=np.int64))
            if output.datatype != answer_dtype.v2 or count * numpy_dtype.itemsize > out_size:
                raise EmbeddingError(
                    f"malformed reply from the server: {output.datatype} {list(shape)} "
                    f"for a {answer_dtype.v2} answer in {out_size} bytes"
                )
            answer: npt.NDArray[Any] = np.frombuffer(
                self._map, numpy_dtype, count, out_offset
            ).reshape(shape)
        answer.flags.writeable = False
        return answer

    # --- lifetime

    def close(self) -> None:
        """Unregister the region and remove the object (idempotent). Arrays still held
        keep their pages (the mapping goes when the last of them is dropped)."""
        if self._closed:
            return
        try:
            self._rpc(
                "SystemSharedMemoryUnregister",
                self._pb.SystemSharedMemoryUnregisterRequest(name=self.name),
            )
        finally:
            self._release_local()

    def __enter__(self) -> SharedMemorySession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _release_local(self) -> None:
        self._closed = True
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()
        # Arrays over the mapping are alive (BufferError): it goes with the last of them.
        with contextlib.suppress(BufferError):
            self._map.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EmbeddingError(f"the shared-memory session {self.name} is closed")

    def _window(self, offset: int, size: int) -> dict[str, Any]:
        parameter = self._pb.InferParameter
        return {
            "shared_memory_region": parameter(string_param=self.name),
            "shared_memory_offset": parameter(int64_param=offset),
            "shared_memory_byte_size": parameter(int64_param=size),
        }

    def _rpc(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        timeout = self._timeout_s if timeout_s is None else timeout_s
        try:
            return self._calls[method](request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
