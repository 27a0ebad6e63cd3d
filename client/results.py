"""What the client returns besides plain arrays: results with metadata, and model info.

Plain frozen dataclasses, free of protobuf and gRPC, so callers never touch generated code.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from tokembed.client.dtypes import name_of
from tokembed.v1 import embedding_pb2 as pb


@dataclass(frozen=True)
class Timings:
    """Where the server spent the time of one request (seconds), and the batch it was in."""

    queue_seconds: float
    compute_seconds: float
    server_seconds: float
    batch_requests: int
    batch_tokens: int

    @classmethod
    def from_proto(cls, msg: pb.Timings) -> Timings:
        return cls(
            queue_seconds=msg.queue_seconds,
            compute_seconds=msg.compute_seconds,
            server_seconds=msg.server_seconds,
            batch_requests=msg.batch_requests,
            batch_tokens=msg.batch_tokens,
        )


@dataclass(frozen=True)
class EmbedResult:
    """One answer: the hidden states and what the server said about them.

    ``hidden_states`` is ``[B,S,D]`` (rectangular input, or ragged input with the padded
    layout) or ``[N,D]`` (the flat layout); ``[S,B,D]`` (``[S_max,B,D]``) when
    ``sequence_first``. Arrays decoded from a unary or stream answer are read-only views
    of the received bytes (no copy); call ``.copy()`` to modify one. ``lengths`` is the
    sequence lengths for ragged or flat answers, ``None`` otherwise.
    """

    hidden_states: npt.NDArray[np.floating]
    lengths: npt.NDArray[np.int64] | None
    timings: Timings
    model_name: str
    model_version: str
    request_id: str
    # The call asked for sequence-first ids and answer (``sequence_first=True``).
    sequence_first: bool = False

    def sequences(self) -> list[npt.NDArray[np.floating]]:
        """The rows of each sequence, ``[len_b, D]`` each, padding removed (views)."""
        hs = self.hidden_states
        if self.sequence_first and hs.ndim == 3:
            lengths = self.lengths if self.lengths is not None else [hs.shape[0]] * hs.shape[1]
            return [hs[: int(n), b] for b, n in enumerate(lengths)]
        if self.lengths is None:
            return list(hs) if hs.ndim == 3 else [hs]
        if hs.ndim == 3:
            return [hs[b, : int(n)] for b, n in enumerate(self.lengths)]
        bounds = np.cumsum(self.lengths)[:-1]
        return list(np.split(hs, bounds))


@dataclass(frozen=True)
class NearestResult:
    """A nearest answer: per vector, ``ids`` int64 ``[..., k]`` and ``scores`` float32
    ``[..., k]``, largest first (equal scores by the lower id), and ``logits`` float32
    ``[..., V]`` when asked (else None). Read-only views of the received bytes."""

    ids: npt.NDArray[np.int64]
    scores: npt.NDArray[np.float32]
    logits: npt.NDArray[np.float32] | None
    timings: Timings
    model_name: str
    model_version: str
    request_id: str


@dataclass(frozen=True)
class HeadInfo:
    """A model's way back (nearest): ``table`` "embedding" (tied), "output" or "served"
    (docs/export.md, "The head of each kind"), its final ``norm`` ("rmsnorm", "layernorm"
    or ""), the largest ``k``, and what multiplies over the table (``runs_on``: "numpy",
    or the onnxruntime provider running the head graph; "" from a server older than it)."""

    table: str
    norm: str
    max_k: int
    runs_on: str = ""


@dataclass(frozen=True)
class Limits:
    """The server's per-request and transport limits (see GetModelInfo)."""

    max_tokens_per_request: int
    max_output_bytes_per_request: int
    max_batch_tokens: int
    max_message_bytes: int
    max_delay_seconds: float


@dataclass(frozen=True)
class IdInputInfo:
    """An input of ids a model takes: its name (``input_ids``, ``token_type_ids``), the
    bound every id stays below (``[0, bound)``), the manifest field that bound comes from,
    and whether a request may leave it out (then every id is 0)."""

    name: str
    bound: int
    bound_field: str
    optional: bool


@dataclass(frozen=True)
class TableInfo:
    """One of a model's tables: its role ("embedding", "segment", "projection"), its
    ``(rows, columns)`` and its stored dtype."""

    role: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TokenizerInfo:
    """A model's own tokenizer: the tokenizers library's model ("BPE", "WordPiece",
    "Unigram"...), the ids it gives, the longest text in tokens the model takes, and the
    sha256 of its tokenizer.json."""

    model: str
    vocab_size: int
    max_length: int
    sha256: str


@dataclass(frozen=True)
class ModelInfo:
    """One served model: the table's size, scale, dtypes, provider, backend and limits.

    ``backend`` is how the server answers look-ups, chosen at load: "table" or
    "onnxruntime" ("" from a server older than several models per process).
    ``kind`` is what the model computes: "token" (``E[id] * scale``), "segment"
    (``+ S[type]``, BERT's: it takes ``token_type_ids``) or "factorized" (``E [V, D']``
    projected to D, ALBERT's); ``inputs`` are the ids a request carries and their bounds,
    ``tables`` its weights. ``memory_bytes`` is what the chosen backend holds, by what
    it is; ``serving_memory_bytes`` what each way of serving the model would hold, by
    backend (the table is chosen when it fits the server's budget). A model exported
    with ``--from-pretrained`` has its ``architecture`` (config.json's model_type), the
    ``convention`` of its vectors in one line, and ``engine_scales``: by engine
    ("transformers", "vllm", "sglang"), the scale that engine expects on the table's rows
    (the served vectors carry ``scale``); empty for other models.
    """

    name: str
    version: str
    vocab_size: int
    d_model: int
    scale: float
    padding_id: int | None
    weight_dtype: str
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    execution_provider: str
    limits: Limits
    model_sha256: str
    backend: str = ""  # with a default: code that builds a ModelInfo keeps working
    kind: str = "token"
    inputs: tuple[IdInputInfo, ...] = ()
    tables: tuple[TableInfo, ...] = ()
    memory_bytes: dict[str, int] = field(default_factory=dict)
    serving_memory_bytes: dict[str, int] = field(default_factory=dict)
    # The model's own tokenizer; None: it has none (text calls are refused).
    tokenizer: TokenizerInfo | None = None
    architecture: str = ""
    convention: str = ""
    engine_scales: dict[str, float] = field(default_factory=dict)
    # None: the model has no head, and answers no nearest.
    head: HeadInfo | None = None

    @classmethod
    def from_proto(cls, msg: pb.ModelInfo) -> ModelInfo:
        lim = msg.limits
        return cls(
            name=msg.name,
            version=msg.version,
            vocab_size=msg.vocab_size,
            d_model=msg.d_model,
            scale=msg.scale,
            padding_id=msg.padding_id if msg.HasField("padding_id") else None,
            weight_dtype=msg.weight_dtype,
            input_dtypes=tuple(name_of(d) for d in msg.input_dtypes),
            output_dtypes=tuple(name_of(d) for d in msg.output_dtypes),
            execution_provider=msg.execution_provider,
            limits=Limits(
                max_tokens_per_request=lim.max_tokens_per_request,
                max_output_bytes_per_request=lim.max_output_bytes_per_request,
                max_batch_tokens=lim.max_batch_tokens,
                max_message_bytes=lim.max_message_bytes,
                max_delay_seconds=lim.max_delay_seconds,
            ),
            model_sha256=msg.model_sha256,
            backend=msg.backend,
            kind=msg.kind or "token",
            inputs=tuple(
                IdInputInfo(i.name, i.bound, i.bound_field, i.optional) for i in msg.inputs
            ),
            tables=tuple(TableInfo(t.role, tuple(t.shape), t.dtype) for t in msg.tables),
            memory_bytes=dict(msg.memory_bytes),
            serving_memory_bytes=dict(msg.serving_memory_bytes),
            tokenizer=(
                TokenizerInfo(
                    msg.tokenizer.model,
                    msg.tokenizer.vocab_size,
                    msg.tokenizer.max_length,
                    msg.tokenizer.sha256,
                )
                if msg.HasField("tokenizer")
                else None
            ),
            architecture=msg.architecture,
            convention=msg.convention,
            engine_scales=dict(msg.engine_scales),
            head=(
                HeadInfo(msg.head.table, msg.head.norm, msg.head.max_k, msg.head.runs_on)
                if msg.HasField("head")
                else None
            ),
        )


@dataclass(frozen=True)
class ModelList:
    """Every model a server serves (ListModels), in the order the server was given them.

    Iterating gives the :class:`ModelInfo` of each; ``len()`` counts them; ``names`` lists
    their names; ``models_list["dec"]`` (or ``.get("dec")``) finds one by name, and
    ``"dec" in models_list`` asks whether it is served. ``default_model`` names the model
    that answers calls naming none.
    """

    models: tuple[ModelInfo, ...]
    default_model: str

    @classmethod
    def from_proto(cls, msg: pb.ListModelsResponse) -> ModelList:
        return cls(
            models=tuple(ModelInfo.from_proto(m) for m in msg.models),
            default_model=msg.default_model,
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.models)

    def get(self, name: str) -> ModelInfo | None:
        """The info of the model called ``name``, or None if it is not served."""
        for info in self.models:
            if info.name == name:
                return info
        return None

    def __getitem__(self, name: str) -> ModelInfo:
        info = self.get(name)
        if info is None:
            raise KeyError(f"no model {name!r} among {list(self.names)}")
        return info

    def __contains__(self, name: object) -> bool:
        # By name: without this, ``"dec" in models`` would compare "dec" with each
        # ModelInfo that iteration yields, and always be False.
        return any(info.name == name for info in self.models)

    def __iter__(self) -> Iterator[ModelInfo]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)


@dataclass(frozen=True)
class RepositoryModel:
    """One model version of a server's model repository (its index): ``state`` is
    ``UNAVAILABLE`` (on disk, not served; ``reason`` says why: unloaded, a failed load),
    ``LOADING``, ``READY`` or ``UNLOADING``. ``version`` is "" for a model with none."""

    name: str
    version: str
    state: str
    reason: str


def _split(flat: npt.NDArray[np.generic], lengths: npt.NDArray[np.int64]) -> list[Any]:
    """``flat``'s rows, one part per length (views)."""
    return list(np.split(flat, np.cumsum(lengths)[:-1])) if len(lengths) else []


@dataclass(frozen=True)
class TokenizeResult:
    """Texts tokenized by the model's own tokenizer: every text's tokens one after another
    (``input_ids [N]``, ``offsets [N, 2]``: each token's start and end in characters of
    its text, ``special_tokens_mask [N]``: True for a token the tokenizer added), and
    ``lengths [B]``, the tokens of each text."""

    input_ids: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]
    special_tokens_mask: npt.NDArray[np.bool_]
    timings: Timings
    model_name: str
    model_version: str
    request_id: str

    def ids(self) -> list[list[int]]:
        """Each text's ids, as lists."""
        return [part.tolist() for part in _split(self.input_ids, self.lengths)]

    def sequences(self) -> list[npt.NDArray[np.int64]]:
        """Each text's ids (views)."""
        return _split(self.input_ids, self.lengths)

    def offset_pairs(self) -> list[list[tuple[int, int]]]:
        """Each text's offsets, as (start, end) pairs."""
        return [[(int(a), int(b)) for a, b in part] for part in _split(self.offsets, self.lengths)]


@dataclass(frozen=True)
class TextEmbedResult:
    """Texts as vectors: every text's rows one after another (``hidden_states [N, D]``,
    in the dtype asked), the ids they are the rows of (``input_ids [N]``), and the
    tokens of each text (``lengths [B]``)."""

    hidden_states: npt.NDArray[np.floating]
    input_ids: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    timings: Timings
    model_name: str
    model_version: str
    request_id: str

    def sequences(self) -> list[npt.NDArray[np.floating]]:
        """Each text's rows, ``[len_b, D]`` (views): what ``generate(inputs_embeds=...)``
        takes for one prompt, with a batch axis added."""
        return _split(self.hidden_states, self.lengths)
