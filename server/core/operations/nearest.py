"""The nearest operation: vectors ``[N, D]`` or ``[B, S, D]`` in, per vector the ``k``
ids of the model's output table with the largest scores (``dot``: the head's logits;
``cosine``), their scores, and the full logits ``[..., V]`` when asked.

The table is the model's head (``manifest.Head``: the embedding table itself when tied,
else the exported output projection); a model without one refuses. Validation runs
before a request can join a batch, so a bad one fails alone with a message naming the
offending value: the width, a NaN or infinite component (and where), k, the dtype, the
metric. Equal scores are ordered by the lower id (``backends.head.top_k``).

Its compute multiplies over the whole table (``2 N D V`` flops, the table read once per
batch), so its jobs always batch (``heavy``): the rows of concurrent requests go into one
multiply, up to ``BatchLimits.nearest_max_batch_rows`` rows or ``max_delay_s``. A job's
``tokens`` are its vectors, what the row budget counts; its ``work`` (``2 N D V`` flops)
is what admission's queue bound counts (``BatchLimits.max_queued_nearest_flops``), and
is bounded per request by ``Limits.max_nearest_flops_per_request``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tokembed.server.backends.base import Backend
from tokembed.server.backends.head import METRICS, Found, NearestHead, Query
from tokembed.server.core.dtypes import BFLOAT16, FLOAT16, FLOAT32, INT64, DType
from tokembed.server.core.errors import Internal, InvalidInput, TooLarge
from tokembed.server.core.operations.base import Costed, Operation
from tokembed.server.core.operations.embed_request import Unread
from tokembed.server.core.served import ServedModel
from tokembed.server.core.types import Answer, NamedTensor, Timings

# The dtypes vectors may come in (a model's hidden states): widened to float32 exactly.
VECTOR_DTYPES: dict[str, DType] = {dtype.name: dtype for dtype in (FLOAT32, FLOAT16, BFLOAT16)}
IDS, SCORES, LOGITS = "ids", "scores", "logits"


@dataclass(slots=True)
class NearestInput:
    """A nearest request as a front end hands it over."""

    # The vectors' bytes, or where the request left them (a V2 shared-memory region):
    # read only once what the request declares fits the model (``Nearest.read``).
    data: bytes | Unread
    dtype: str  # "float32", "float16" or "bfloat16" ("" when the request named none)
    shape: tuple[int, ...]
    k: int
    metric: str = "dot"
    logits: bool = False
    norm: bool = False


@dataclass(slots=True)
class NearestJob(Costed):
    query: Query
    leading: tuple[int, ...]  # the vectors' shape without D
    tokens: int  # vectors: what the row budget counts
    output_bytes: int
    work: int  # 2 N D V flops: what the queue bound counts (``Costed``)


class Nearest(Operation[NearestInput, NearestJob, Found]):
    name = "nearest"
    heavy = True

    def validate(self, request: NearestInput, model: ServedModel) -> NearestJob:
        return validate(request, model)

    def unread(self, request: NearestInput) -> bool:
        return not isinstance(request.data, bytes)

    async def read(self, request: NearestInput, model: ServedModel) -> NearestInput:
        """The vectors read from where the request left them, once everything it declares
        (their size included) fits ``model``: a refused request reads nothing."""
        check_declared(request, model)
        data = request.data
        return request if isinstance(data, bytes) else replace(request, data=await data.read())

    def compute(self, backend: Backend, jobs: Sequence[NearestJob]) -> list[Found]:
        head = backend.head
        if head is None:
            raise Internal("this is a bug: a model without a head passed validation")
        return head.search([job.query for job in jobs])

    def answer(
        self, job: NearestJob, result: Found, timings: Timings, model: ServedModel
    ) -> Answer:
        k = job.query.k
        tensors = [
            _tensor(IDS, result.ids, (*job.leading, k), INT64),
            _tensor(SCORES, result.scores, (*job.leading, k), FLOAT32),
        ]
        if result.logits is not None:
            tensors.append(
                _tensor(LOGITS, result.logits, (*job.leading, model.vocab_size), FLOAT32)
            )
        return Answer.of_tensors(tensors, timings, job.tokens, model.name, model.version)


NEAREST = Nearest()


def _tensor(name: str, array: np.ndarray, shape: tuple[int, ...], dtype: DType) -> NamedTensor:
    data = np.ascontiguousarray(array, dtype=dtype.numpy)
    return NamedTensor(
        name, shape, dtype, [data.data.cast("B")] if data.size else [b""], data.nbytes
    )


def head_of(model: ServedModel) -> NearestHead:
    """The model's head, or ``InvalidInput`` saying why it has none."""
    head = model.backend.head
    if head is None:
        raise InvalidInput(
            f"model {model.name!r} cannot answer nearest: its manifest records neither a tied "
            "table nor an output projection (export it with --output-key or "
            "--output-projection, or --tied-head for a random table)"
        )
    return head


@dataclass(frozen=True, slots=True)
class _Declared:
    """What a request declares, checked against the model before its vectors are read."""

    dtype: DType
    leading: tuple[int, ...]
    count: int
    output_bytes: int
    work: int


def check_declared(request: NearestInput, model: ServedModel) -> _Declared:
    """Everything but the vectors' values: the head, dtype, metric, norm, shape, k, the
    vectors' size (the bytes in hand, or the size a region's window declares) and the
    request's costs; raises ``InvalidInput`` or ``TooLarge``."""
    head = head_of(model)
    dtype = VECTOR_DTYPES.get(request.dtype)
    if dtype is None:
        raise InvalidInput(
            f"vectors dtype {request.dtype or 'unspecified'!r} is not supported; send float32, "
            "float16 or bfloat16"
        )
    if request.metric not in METRICS:
        raise InvalidInput(f"metric {request.metric!r} is not supported; use 'dot' or 'cosine'")
    if request.norm and head.norm is None:
        raise InvalidInput(
            f"model {model.name!r} has no final norm to apply (export it with --norm-key)"
        )
    shape = request.shape
    d_model = model.d_model
    if len(shape) not in (2, 3) or min(shape) < 0:
        raise InvalidInput(f"vectors shape {list(shape)} must be [N, D] or [B, S, D]")
    if shape[-1] != d_model:
        raise InvalidInput(
            f"vectors shape {list(shape)} has D = {shape[-1]}, but model {model.name!r} has "
            f"d_model {d_model}"
        )
    leading = shape[:-1]
    count = 1
    for size in leading:
        count *= size
    if count == 0:
        raise InvalidInput(f"vectors shape {list(shape)} is empty; send at least one vector")
    limits = model.limits
    if count > limits.max_tokens_per_request:
        raise TooLarge(f"{count} vectors in one request, over the limit of "
                       f"{limits.max_tokens_per_request}")  # fmt: skip
    vocab_size = model.vocab_size
    top = min(limits.max_nearest_k, vocab_size)
    if not 1 <= request.k <= top:
        raise InvalidInput(
            f"k = {request.k} is outside [1, {top}] (the limit is min(max_nearest_k "
            f"{limits.max_nearest_k}, V {vocab_size}))"
        )
    expected = count * d_model * dtype.itemsize
    data = request.data
    nbytes = len(data) if isinstance(data, bytes) else data.nbytes
    if nbytes is not None and nbytes != expected:
        told = "data is" if isinstance(data, bytes) or not data.declared else "is declared as"
        raise InvalidInput(
            f"vectors {told} {nbytes} bytes, but shape {list(shape)} of {dtype.name} needs "
            f"{expected}"
        )
    work = 2 * count * d_model * vocab_size
    if work > limits.max_nearest_flops_per_request:
        raise TooLarge(
            f"nearest over {count} vectors costs {work} flops (2 N D V), over the limit of "
            f"{limits.max_nearest_flops_per_request} per request; split it"
        )
    output_bytes = count * request.k * (INT64.itemsize + FLOAT32.itemsize)
    if request.logits:
        output_bytes += count * vocab_size * FLOAT32.itemsize
    if output_bytes > limits.max_output_bytes_per_request:
        raise TooLarge(
            f"response would be {output_bytes} bytes, over the limit of "
            f"{limits.max_output_bytes_per_request} bytes per request"
            + ("; the logits are [N, V] float32: leave them out or split" if request.logits else "")
        )
    return _Declared(dtype, leading, count, output_bytes, work)


def validate(request: NearestInput, model: ServedModel) -> NearestJob:
    declared = check_declared(request, model)
    data = request.data
    if not isinstance(data, bytes):
        raise Internal("this is a bug: nearest's vectors were validated before they were read")
    expected = declared.count * model.d_model * declared.dtype.itemsize
    if len(data) != expected:  # a region's read gave other than its declared size
        raise InvalidInput(
            f"vectors data is {len(data)} bytes, but shape {list(request.shape)} of "
            f"{declared.dtype.name} needs {expected}"
        )
    shape, leading, count, d_model = request.shape, declared.leading, declared.count, model.d_model
    vectors = np.frombuffer(data, dtype=declared.dtype.numpy).reshape(count, d_model)
    vectors = vectors.astype(np.float32)  # exact for every dtype here
    finite = np.isfinite(vectors)
    if not finite.all():
        first = int(np.flatnonzero(~finite.reshape(-1))[0])
        where = ",".join(str(int(i)) for i in np.unravel_index(first, shape))
        raise InvalidInput(f"vectors[{where}] = {vectors.reshape(-1)[first]} is not finite")
    if request.metric == "cosine":
        zero = np.flatnonzero(~vectors.any(axis=1))
        if zero.size:
            where = ",".join(str(int(i)) for i in np.unravel_index(int(zero[0]), leading))
            raise InvalidInput(f"vectors[{where}] is all zeros: its cosine is undefined")
    query = Query(vectors, request.k, request.metric, request.logits, request.norm)
    return NearestJob(query, leading, count, declared.output_bytes, declared.work)
