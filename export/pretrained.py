"""``tokembed export --from-pretrained DIR``: what a Hugging Face model directory holds,
found from its ``config.json`` and its checkpoint's keys (``pretrained_table``).

``find_pretrained`` reads the config and the checkpoint's key list (a sharded
checkpoint's index, or the one file's header) and gives ``Findings``: the keys of the
table, of the output projection and of the final norm, the padding id, the tie as the
config declares it, BERT's segment table, ALBERT's factorization, and what each engine
expects of ``inputs_embeds``. An architecture it does not know is refused in one line
naming the embedding-like keys it found and the manual flags that export them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokembed.export.architecture import CONFIG_NAME
from tokembed.export.checkpoint_dir import checkpoint_in
from tokembed.export.errors import ExportError
from tokembed.export.pretrained_table import ENGINE_VERSIONS, ROWS, UNSCALED, NormRule, Row

FLAG = "--from-pretrained"
# The flags the findings fill in; given beside --from-pretrained they would contradict it.
MANUAL_FLAGS = ("--weights", "--key", "--output-projection", "--segment-key",
                "--projection-key", "--projection-bias-key", "--kind")  # fmt: skip


@dataclass(frozen=True)
class Norm:
    """The final norm before the output projection, for a reverse look-up (vectors to
    ids through the output projection): ``kind`` "rmsnorm" or "layernorm"."""

    key: str
    kind: str
    eps: float
    weight_offset: float  # Gemma's RMSNorm multiplies by (1 + weight): 1.0
    bias_key: str | None


@dataclass(frozen=True)
class Findings:
    """What ``--from-pretrained`` found in a model directory."""

    architecture: str  # config.json's model_type (gemma3_text for the multimodal Gemma 3)
    checkpoint: Path  # the file or sharded index the keys are read from
    embedding_key: str
    vocab_size: int
    width: int  # the table's width (ALBERT: embedding_size, not hidden_size)
    padding_idx: int | None
    # The output projection's key as the checkpoint holds it or, tied and saved once, as
    # the model names it; None when the model has none (a bare encoder).
    output_projection: str | None
    tied: bool | None  # as config.json declares it (the exporter then checks the values)
    # The untied output projection, for ``--output-key``; None when tied or absent.
    output_key: str | None
    # The final norm, for ``--norm-key/--norm-kind/--norm-eps``; None when the model
    # has none between its last layer and the output projection.
    norm: Norm | None
    segment_key: str | None  # BERT's and ALBERT's token type table
    projection_key: str | None  # ALBERT's [hidden, embedding_size] factorization
    projection_bias_key: str | None
    output_scale: str | None  # T5, tied: its decoder output is scaled before the head
    after: str  # what the model does to inputs_embeds, in words
    engines: dict[str, str] = field(default_factory=dict)

    def manifest_record(self) -> dict[str, Any]:
        """The keys and conventions the manifest keeps (``manifest.Pretrained.keys``)."""
        record: dict[str, Any] = {
            "embedding_key": self.embedding_key,
            "output_projection": self.output_projection,
            "output_key": self.output_key,
            "segment_key": self.segment_key,
            "projection_key": self.projection_key,
            "projection_bias_key": self.projection_bias_key,
            "output_scale": self.output_scale,
        }
        if self.norm is not None:
            record.update(
                norm_key=self.norm.key, norm_kind=self.norm.kind, norm_eps=self.norm.eps,
                norm_weight_offset=self.norm.weight_offset, norm_bias_key=self.norm.bias_key,
            )  # fmt: skip
        return {key: value for key, value in record.items() if value is not None}


def find_pretrained(directory: Path) -> Findings:
    """The findings for the model saved in ``directory`` (``ExportError`` in one line when
    it is not a model directory or its architecture is not one tokembed knows)."""
    if not directory.is_dir():
        raise ExportError(f"{FLAG} {directory}: not a directory")
    config = _config(directory)
    checkpoint = checkpoint_in(directory)
    shapes = _key_shapes(checkpoint)
    model_type = config.get("model_type")
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):
        # The multimodal Gemma 3: its language model's table, as gemma3_text.
        heads = config.get("architectures")
        config = {**config["text_config"], "architectures": heads}
        model_type = "gemma3_text"
    if not isinstance(model_type, str) or model_type not in ROWS:
        raise _unknown(model_type, directory, shapes, config.get("vocab_size"))
    row = ROWS[model_type]
    vocab_size, width = _size(config, row, model_type)
    embedding = _key(shapes, row.embedding, [vocab_size, width])
    if embedding is None:
        raise ExportError(
            f"{FLAG} {directory}: a {model_type} model whose checkpoint has no "
            f"[{vocab_size}, {width}] table at a key ending in {' or '.join(row.embedding)}; "
            f"{_manual(shapes, vocab_size)}"
        )
    pad = config.get("pad_token_id")
    output, tied = _output(config, row, shapes, [vocab_size, width])
    return Findings(
        architecture=model_type,
        checkpoint=checkpoint,
        embedding_key=embedding,
        vocab_size=vocab_size,
        width=width,
        padding_idx=pad if isinstance(pad, int) and 0 <= pad < vocab_size else None,
        output_projection=output,
        tied=tied,
        output_key=output if tied is False else None,
        norm=_norm(config, row.norm, shapes),
        segment_key=_key(shapes, (row.segment,), None) if row.segment else None,
        projection_key=_key(shapes, (row.projection,), None) if row.projection else None,
        projection_bias_key=(
            _key(shapes, (row.projection_bias,), None) if row.projection_bias else None
        ),
        output_scale=row.output_scale_when_tied if tied else None,
        after=row.after,
        engines=dict(row.engines),
    )


def engine_scales(findings: Findings, served_scale: float) -> dict[str, float]:
    """The scale each engine expects on the table's rows (the served vectors carry
    ``served_scale``, the one transformers' embedding module applies)."""
    return {
        engine: 1.0 if expects == UNSCALED else served_scale
        for engine, expects in findings.engines.items()
    }


def convention(findings: Findings, served_scale: float) -> str:
    """One line: what the served vectors are, where an engine differs, and the engines'
    releases that holds for (an engine's convention can change between its releases)."""
    scaled = "E[id]" if served_scale == 1.0 else f"E[id] * {served_scale!r}"
    line = (
        f"{findings.architecture}: served vectors are {scaled}, what transformers' "
        f"inputs_embeds takes (then {findings.after})"
    )
    unscaled = [engine for engine, expects in findings.engines.items() if expects == UNSCALED]
    if unscaled and served_scale != 1.0:
        one = len(unscaled) == 1
        takes, multiplies = ("takes", "multiplies") if one else ("take", "multiply")
        line += f"; {' and '.join(unscaled)} {takes} E[id] unscaled and {multiplies} after"
    read = [f"{name} {ver}" for name, ver in ENGINE_VERSIONS.items() if name in findings.engines]
    if read:
        line += f" (as read in {', '.join(read)})"
    return line


# --- reading the directory -----------------------------------------------------------------


def _config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(
            f"{FLAG} {directory}: no {CONFIG_NAME} (a directory transformers' save_pretrained "
            "wrote has one); without it, give --weights and --key"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ExportError(f"{path}: not a JSON object")
    return config


def _key_shapes(checkpoint: Path) -> dict[str, list[int]]:
    """Every key of the checkpoint and its shape: a sharded one's from each shard's header
    (safetensors) or file (torch), never its tensors' data."""
    from tokembed.export.checkpoint_files import INDEX_SUFFIX, tensor_shapes
    from tokembed.export.weights import shard_files

    if not checkpoint.name.endswith(INDEX_SUFFIX):
        return tensor_shapes(checkpoint)
    shapes: dict[str, list[int]] = {}
    for shard in shard_files(checkpoint):
        shapes.update(tensor_shapes(shard))
    return shapes


def _size(config: dict[str, Any], row: Row, model_type: str) -> tuple[int, int]:
    vocab_size, width = config.get("vocab_size"), config.get(row.width_field)
    for name, value in (("vocab_size", vocab_size), (row.width_field, width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ExportError(
                f"{CONFIG_NAME}: a {model_type} model needs a positive integer {name}, "
                f"got {value!r}"
            )
    assert isinstance(vocab_size, int) and isinstance(width, int)
    return vocab_size, width


def _matches(key: str, tail: str) -> bool:
    return key == tail or key.endswith(f".{tail}")


def _key(
    shapes: dict[str, list[int]], tails: tuple[str, ...], shape: list[int] | None
) -> str | None:
    """The key ending in the first of ``tails`` that any key ends in (and of ``shape``
    when given); of several, the shortest (the model's own, not a copy deeper in)."""
    for tail in tails:
        found = [k for k, s in shapes.items() if _matches(k, tail) and shape in (None, s)]
        if found:
            return min(found, key=lambda k: (len(k), k))
    return None


def _output(
    config: dict[str, Any], row: Row, shapes: dict[str, list[int]], shape: list[int]
) -> tuple[str | None, bool | None]:
    """The output projection's key and whether the config declares it tied."""
    if row.output is None:
        return None, None
    declared = config.get("tie_word_embeddings")
    tied = declared if isinstance(declared, bool) else None
    present = _key(shapes, (row.output,), shape)
    if present is not None:
        return present, tied
    # Saved once (transformers writes a tied matrix under one name): the model has the
    # projection only if the config's class has a head and declares the tie.
    heads = config.get("architectures")
    has_head = isinstance(heads, list) and any(h in row.heads for h in heads)
    if has_head and tied:
        return row.output, True
    return None, None


def _norm(
    config: dict[str, Any], rule: NormRule | None, shapes: dict[str, list[int]]
) -> Norm | None:
    if rule is None:
        return None
    key = _key(shapes, (rule.key,), None)
    eps = config.get(rule.eps_field)
    if key is None or not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return None
    bias = _key(shapes, (rule.bias_key,), None) if rule.bias_key else None
    return Norm(key, rule.kind, float(eps), rule.weight_offset, bias)


# --- an architecture tokembed does not know ------------------------------------------------


def _unknown(
    model_type: object, directory: Path, shapes: dict[str, list[int]], vocab_size: object
) -> ExportError:
    known = ", ".join(sorted(ROWS))
    return ExportError(
        f"{FLAG} {directory}: config.json's model_type {model_type!r} is not one tokembed "
        f"knows ({known}); {_manual(shapes, vocab_size)}"
    )


def _manual(shapes: dict[str, list[int]], vocab_size: object) -> str:
    """The embedding-like keys and the flags that export one of them: the 2-D matrices
    with ``vocab_size`` rows when the config gives it, else those with more rows than
    columns; largest first."""
    like = sorted(
        (
            (k, s)
            for k, s in shapes.items()
            if len(s) == 2 and (s[0] == vocab_size if isinstance(vocab_size, int) else s[0] > s[1])
        ),
        key=lambda item: (-item[1][0] * item[1][1], item[0]),
    )
    if not like:
        return "its checkpoint holds no [V, D] matrix with more rows than columns"
    shown = ", ".join(f"{k} {s}" for k, s in like[:4]) + (
        f" and {len(like) - 4} more" if len(like) > 4 else ""
    )
    return (
        f"embedding-like keys: {shown}; export one with --weights DIR --key KEY "
        "(and --scale, --padding-idx, --output-projection as the model computes them)"
    )
