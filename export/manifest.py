"""The manifest: what a model directory claims about itself.

This module is the contract between the exporter (which writes it) and the server
(which trusts it only after ``model_dir.load_model_dir`` has checked it against the
files and the graph). It imports neither torch nor onnx.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokembed.export.errors import ModelDirError

MANIFEST_NAME = "manifest.json"
MODEL_NAME = "model.onnx"
FORMAT = "tokembed-model/1"
INPUT_NAME = "input_ids"
OUTPUT_NAME = "hidden_states"
TOKENIZER_NAME = "tokenizer.json"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    # Symbolic dimensions are strings ("batch"), fixed ones ints.
    shape: list[str | int]


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Parity:
    max_abs_error: float
    tolerance: float
    ids_checked: int


@dataclass(frozen=True)
class Tie:
    """Weight tying: whether the exported table is also the model's output projection.

    Recorded when the export is told the projection's key (``--output-projection``), so
    that an operation from vectors back to ids can use this same table when ``tied``
    (the projection's logits are ``h @ E.T``, ``E`` the unscaled table) and knows that
    it may not when it is not.
    """

    output_projection: str  # the key of the model's output projection in the checkpoint
    tied: bool  # whether that projection is this table
    evidence: str  # how the exporter knows (shared storage, equal values, config.json...)
    # The checkpoint's keys that name this very table: the exported one first, then the
    # others stored as one tensor with it (torch files store tied weights once).
    keys: list[str]


@dataclass(frozen=True)
class TokenizerSpec:
    """The model's own tokenizer: a Hugging Face ``tokenizer.json`` in the directory
    (listed in ``files`` and hashed like the graph), what it is, and the longest text in
    tokens the model takes (``max_length``; None: only the server's per-request limit)."""

    file: str  # its name in the directory: TOKENIZER_NAME
    model: str  # the tokenizers library's model: "BPE", "WordPiece", "Unigram", ...
    vocab_size: int  # ids it gives, added tokens included, all below the manifest's V
    max_length: int | None = None


@dataclass(frozen=True)
class Pretrained:
    """What ``tokembed export --from-pretrained`` found in a Hugging Face model directory.

    The served vectors are what transformers' ``inputs_embeds`` takes for
    ``architecture``; ``engine_scales`` says, by engine ("transformers", "vllm",
    "sglang"), the scale that engine expects on the table's rows (the served vectors carry
    the manifest's ``scale``): a client multiplies by ``engine_scales[engine] / scale``
    before handing them over. An engine absent is one whose convention for this
    architecture tokembed does not record.
    """

    architecture: str  # config.json's model_type ("gemma2"; "gemma3_text" for Gemma 3)
    convention: str  # one line: what the served vectors are, where an engine differs
    engine_scales: dict[str, float]
    # The checkpoint's keys found (embedding_key, output_projection, output_key,
    # segment_key, projection_key, norm_key, norm_kind, norm_eps, ...), as found.
    keys: dict[str, Any]


@dataclass(frozen=True)
class Norm:
    """The model's final norm, applied before its head as transformers does
    (``lm_head(norm(h))``): RMSNorm ``h / sqrt(mean(h^2) + eps) * weight`` or LayerNorm
    ``(h - mean) / sqrt(var + eps) * weight + bias``, in float32."""

    kind: str  # "rmsnorm" or "layernorm"
    eps: float
    weight_key: str  # its weight's key in the checkpoint
    bias_key: str | None = None  # LayerNorm's bias, when the model has one


@dataclass(frozen=True)
class Head:
    """The way back from vectors to ids: ``logits = norm?(h) @ W.T``, ``W`` the model's
    output table, written as its own graph (``head.onnx``: MatMul and TopK) and checked
    against a reference at export (``tokembed.export.head``).

    ``table`` is ``"embedding"`` when ``W`` is the exported table itself (tied: the head
    graph reads the same bytes as the look-up, no second copy; a segment model's word
    table), ``"output"`` for an untied output projection read from the checkpoint by key
    (``head.onnx.data``), or ``"served"`` for a factorized model's served vectors
    ``E [V, D'] P + b`` of every id, computed at export (``head.onnx.data``, float32):
    docs/export.md, "The head of each kind", says why.
    """

    table: str  # "embedding" (tied), "output" or "served"
    output_key: str | None  # the output projection's key in the checkpoint, when known
    graph: str  # the head graph's file name in the model directory
    weight_dtype: str  # the dtype W is stored in
    parity: Parity
    norm: Norm | None = None


SERVED = "served"
HEAD_TABLES = ("embedding", "output", SERVED)
NORM_KINDS = ("rmsnorm", "layernorm")


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    vocab_size: int
    d_model: int
    scale: float
    padding_idx: int | None
    weight_dtype: str
    input: TensorSpec
    output: TensorSpec
    opset: int
    files: dict[str, FileEntry]
    producer: dict[str, str]
    parity: Parity
    source: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    # What the model is (``tokembed.export.kinds``); manifests from before kinds are "token".
    kind: str = "token"
    # The sizes only some kinds have (``kinds.ModelKind.check`` says which a kind needs):
    # a segment model's number of token types T, which its ``token_type_ids`` stay below,
    # and a factorized model's inner width D' (its table is [V, D'], projected to D).
    type_vocab_size: int | None = None
    factor_dim: int | None = None
    # Written only when known (``Tie``); manifests without it say nothing about a tie.
    tie: Tie | None = None
    # Written only when the model carries its tokenizer (``TokenizerSpec``).
    tokenizer: TokenizerSpec | None = None
    # Written only for a model exported with --from-pretrained.
    pretrained: Pretrained | None = None
    # Written only for a model with a head (``Head``): without one, it answers no
    # ``nearest``.
    head: Head | None = None

    def to_json(self) -> str:
        fields = asdict(self)
        # A size a kind does not have, or a tie not known, is left out, not written as
        # null: a token model's manifest stays what it was before these fields existed.
        for key in (*_KIND_SIZES, "tie", "tokenizer", "pretrained", "head"):
            if fields[key] is None:
                del fields[key]
        return json.dumps(fields, indent=2, sort_keys=True) + "\n"

    def write(self, directory: Path) -> Path:
        path = directory / MANIFEST_NAME
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST_NAME
        if not path.is_file():
            raise ModelDirError(f"{path}: manifest missing")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelDirError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, where=str(path))

    @classmethod
    def from_dict(cls, raw: object, where: str = "manifest") -> Manifest:
        reader = _Reader(raw, where)
        if (found := reader.text("format")) != FORMAT:
            raise ModelDirError(f"{where}: format is {found!r}, expected {FORMAT!r}")
        padding = reader.get("padding_idx")
        if padding is not None and not _is_int(padding):
            raise ModelDirError(f"{where}: padding_idx must be an integer or null, got {padding!r}")
        files_raw = reader.obj("files")
        files = {
            str(name): FileEntry(
                sha256=_Reader(entry, f"{where}: files[{name!r}]").text("sha256"),
                size_bytes=_Reader(entry, f"{where}: files[{name!r}]").integer("size_bytes"),
            )
            for name, entry in files_raw.items()
        }
        parity = _Reader(reader.obj("parity"), f"{where}: parity")
        return cls(
            name=reader.text("name"),
            version=reader.text("version"),
            vocab_size=reader.integer("vocab_size"),
            d_model=reader.integer("d_model"),
            scale=reader.number("scale"),
            padding_idx=padding,
            weight_dtype=reader.text("weight_dtype"),
            input=_tensor_spec(reader.obj("input"), f"{where}: input"),
            output=_tensor_spec(reader.obj("output"), f"{where}: output"),
            opset=reader.integer("opset"),
            files=files,
            producer={str(k): str(v) for k, v in reader.obj("producer").items()},
            parity=Parity(
                max_abs_error=parity.number("max_abs_error"),
                tolerance=parity.number("tolerance"),
                ids_checked=parity.integer("ids_checked"),
            ),
            source=reader.obj("source") if reader.get("source") is not None else {},
            kind=reader.text("kind") if reader.get("kind") is not None else "token",
            type_vocab_size=reader.optional_integer("type_vocab_size"),
            factor_dim=reader.optional_integer("factor_dim"),
            tie=_tie(reader.obj("tie"), f"{where}: tie") if reader.get("tie") is not None else None,
            tokenizer=(
                _tokenizer(reader.obj("tokenizer"), f"{where}: tokenizer")
                if reader.get("tokenizer") is not None
                else None
            ),
            pretrained=(
                _pretrained(reader.obj("pretrained"), f"{where}: pretrained")
                if reader.get("pretrained") is not None
                else None
            ),
            head=(
                _head(reader.obj("head"), f"{where}: head")
                if reader.get("head") is not None
                else None
            ),
        )


# The manifest's optional sizes, which only some kinds have.
_KIND_SIZES = ("type_vocab_size", "factor_dim")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tie(raw: dict[str, Any], where: str) -> Tie:
    reader = _Reader(raw, where)
    tied, keys = reader.get("tied"), reader.get("keys")
    if not isinstance(tied, bool):
        raise ModelDirError(f"{where}: field 'tied' must be true or false, got {tied!r}")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise ModelDirError(f"{where}: field 'keys' must be a non-empty list of keys, got {keys!r}")
    return Tie(
        output_projection=reader.text("output_projection"),
        tied=tied,
        evidence=reader.text("evidence"),
        keys=keys,
    )


def _tokenizer(raw: dict[str, Any], where: str) -> TokenizerSpec:
    reader = _Reader(raw, where)
    return TokenizerSpec(
        file=reader.text("file"),
        model=reader.text("model"),
        vocab_size=reader.integer("vocab_size"),
        max_length=reader.optional_integer("max_length"),
    )


def _pretrained(raw: dict[str, Any], where: str) -> Pretrained:
    reader = _Reader(raw, where)
    scales = reader.obj("engine_scales")
    for engine, value in scales.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ModelDirError(
                f"{where}: engine_scales[{engine!r}] must be a positive number, got {value!r}"
            )
    return Pretrained(
        architecture=reader.text("architecture"),
        convention=reader.text("convention"),
        engine_scales={str(k): float(v) for k, v in scales.items()},
        keys=reader.obj("keys"),
    )


def _head(raw: dict[str, Any], where: str) -> Head:
    reader = _Reader(raw, where)
    table = reader.text("table")
    if table not in HEAD_TABLES:
        raise ModelDirError(f"{where}: table must be one of {HEAD_TABLES}, got {table!r}")
    output_key = reader.get("output_key")
    if output_key is not None and not isinstance(output_key, str):
        raise ModelDirError(f"{where}: output_key must be a string or null, got {output_key!r}")
    parity = _Reader(reader.obj("parity"), f"{where}: parity")
    norm = None
    if reader.get("norm") is not None:
        norm_reader = _Reader(reader.obj("norm"), f"{where}: norm")
        kind = norm_reader.text("kind")
        if kind not in NORM_KINDS:
            raise ModelDirError(f"{where}: norm kind must be one of {NORM_KINDS}, got {kind!r}")
        bias_key = norm_reader.get("bias_key")
        if bias_key is not None and not isinstance(bias_key, str):
            raise ModelDirError(f"{where}: norm bias_key must be a string, got {bias_key!r}")
        eps = norm_reader.number("eps")
        if not eps > 0:
            raise ModelDirError(f"{where}: norm eps must be positive, got {eps!r}")
        norm = Norm(kind, eps, norm_reader.text("weight_key"), bias_key)
    return Head(
        table=table,
        output_key=output_key,
        graph=reader.text("graph"),
        weight_dtype=reader.text("weight_dtype"),
        parity=Parity(
            max_abs_error=parity.number("max_abs_error"),
            tolerance=parity.number("tolerance"),
            ids_checked=parity.integer("ids_checked"),
        ),
        norm=norm,
    )


def _tensor_spec(raw: dict[str, Any], where: str) -> TensorSpec:
    reader = _Reader(raw, where)
    shape = reader.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, (str, int)) for d in shape):
        raise ModelDirError(f"{where}: shape must be a list of names or sizes, got {shape!r}")
    return TensorSpec(name=reader.text("name"), dtype=reader.text("dtype"), shape=shape)


class _Reader:
    """Typed access to one JSON object, with errors that name the field."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, dict):
            raise ModelDirError(f"{where}: expected an object, got {type(raw).__name__}")
        self._raw: dict[str, Any] = raw
        self._where = where

    def get(self, key: str) -> Any:
        return self._raw.get(key)

    def _require(self, key: str) -> Any:
        if key not in self._raw:
            raise ModelDirError(f"{self._where}: field {key!r} missing")
        return self._raw[key]

    def text(self, key: str) -> str:
        value = self._require(key)
        if not isinstance(value, str):
            raise ModelDirError(f"{self._where}: field {key!r} must be a string, got {value!r}")
        return value

    def integer(self, key: str) -> int:
        value = self._require(key)
        if not _is_int(value):
            raise ModelDirError(f"{self._where}: field {key!r} must be an integer, got {value!r}")
        return int(value)

    def optional_integer(self, key: str) -> int | None:
        return None if self._raw.get(key) is None else self.integer(key)

    def number(self, key: str) -> float:
        value = self._require(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelDirError(f"{self._where}: field {key!r} must be a number, got {value!r}")
        return float(value)

    def obj(self, key: str) -> dict[str, Any]:
        value = self._require(key)
        if not isinstance(value, dict):
            raise ModelDirError(f"{self._where}: field {key!r} must be an object, got {value!r}")
        return value
