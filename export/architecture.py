"""What a Hugging Face model's own input embedding computes, read from the ``config.json``
that transformers writes beside its checkpoint: the scale its rows are multiplied by and
its padding id, for the architectures docs/export.md names (each rule below is read from
that architecture's modeling code in transformers).

``architecture_of`` reads the config; ``settle`` decides the export's scale and padding id
from it and the flags: a flag left out takes the architecture's value, a flag that
contradicts it is refused unless ``--override-config`` is given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tokembed.export.dtypes import WEIGHT_DTYPES
from tokembed.export.errors import ExportError

CONFIG_NAME = "config.json"
OVERRIDE_FLAG = "--override-config"

# The models that multiply rows by nothing: nn.Embedding as it is.
_UNSCALED = ("llama", "mistral", "qwen2", "gpt2", "bert", "albert", "t5")
# Gemma's ScaledWordEmbedding: rows * torch.tensor(hidden_size**0.5).to(weight.dtype).
_GEMMA = ("gemma", "gemma2", "gemma3_text")
# The config's names of the table's rows and width, by architecture.
_WIDTH = {"gpt2": "n_embd", "t5": "d_model", "bart": "d_model", "albert": "embedding_size"}


@dataclass(frozen=True)
class Architecture:
    """What the model's input embedding computes, as its config.json says."""

    model_type: str
    scale: float  # what the model multiplies its rows by (in the table's dtype, for Gemma)
    agreeing: tuple[float, ...]  # every scale that computes what the model may compute
    rule: str  # how the scale follows from the config, for messages
    padding_idx: int | None  # pad_token_id


@dataclass(frozen=True)
class Unknown:
    """A config.json whose ``model_type`` is none of those above."""

    model_type: str


def architecture_of(
    weights: Path, shape: tuple[int, int], table_dtype: str
) -> Architecture | Unknown | None:
    """The architecture the ``config.json`` beside ``weights`` describes, for the ``[V, D]``
    table in ``table_dtype`` (a torch dtype's name); None without a config.json, or when
    its vocabulary and width are not this table's (the key is another matrix)."""
    path = weights.parent / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ExportError(f"{path}: not a JSON object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None  # not a transformers model's config: nothing it says about the scale
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):
        # The multimodal Gemma 3: its language model's table, as gemma3_text.
        config, model_type = config["text_config"], "gemma3_text"
    if model_type not in (*_UNSCALED, *_GEMMA, "bart"):
        return Unknown(model_type)
    vocab_size, d_model = shape
    if (
        config.get("vocab_size") != vocab_size
        or config.get(_WIDTH.get(model_type, "hidden_size")) != d_model
    ):
        return None
    pad = config.get("pad_token_id")
    padding_idx = pad if isinstance(pad, int) and 0 <= pad < vocab_size else None
    if model_type in _GEMMA:
        # torch.tensor(hidden_size**0.5) is float32, then cast to the weight's dtype:
        # rounded twice.
        import numpy as np  # only once a config is read: `tokembed --help` stays light

        in_float32 = np.float32(d_model**0.5)
        rounded = {name: float(in_float32.astype(d.numpy)) for name, d in WEIGHT_DTYPES.items()}
        scale = rounded.get(table_dtype, float(in_float32))
        rule = (
            f"scales by sqrt(hidden_size {d_model}) rounded to float32, then to the table's "
            f"{table_dtype}: {scale!r}"
        )
        return Architecture(model_type, scale, tuple(rounded.values()), rule, padding_idx)
    if model_type == "bart" and config.get("scale_embedding") is True:
        scale = math.sqrt(d_model)
        rule = f"with scale_embedding true scales by sqrt(d_model {d_model}): {scale!r}"
        return Architecture(model_type, scale, (scale,), rule, padding_idx)
    rule = "with scale_embedding false " if model_type == "bart" else ""
    return Architecture(model_type, 1.0, (1.0,), f"{rule}does not scale (scale 1)", padding_idx)


def settle(
    found: Architecture | Unknown | None,
    scale: str | None,
    padding_idx: int | None,
    *,
    override: bool,
    d_model: int,
    default_scale: str,
) -> tuple[float | str, int | None]:
    """The export's scale and padding id: the flags' where given (refused when they
    contradict ``found``, unless ``override``), else the architecture's, else the kind's
    default (``default_scale``)."""
    import numpy as np

    from tokembed.export.modules import resolve_scale  # torch: only once an export runs

    if not isinstance(found, Architecture):
        return (scale if scale is not None else default_scale), padding_idx
    where = f"{CONFIG_NAME}: a {found.model_type} model"
    if scale is not None:
        value = resolve_scale(scale, d_model)
        # The graph multiplies in float32: scales equal there compute the same.
        if not override and np.float32(value) not in {np.float32(s) for s in found.agreeing}:
            raise ExportError(
                f"--scale {scale} ({value:g}) contradicts {where} {found.rule}; leave "
                f"--scale out, or pass {OVERRIDE_FLAG} to export it anyway"
            )
    if padding_idx is not None and found.padding_idx not in (None, padding_idx) and not override:
        raise ExportError(
            f"--padding-idx {padding_idx} contradicts {CONFIG_NAME}'s pad_token_id "
            f"{found.padding_idx} (the {found.model_type} model's padding id); leave "
            f"--padding-idx out, or pass {OVERRIDE_FLAG} to export it anyway"
        )
    return (
        scale if scale is not None else found.scale,
        padding_idx if padding_idx is not None else found.padding_idx,
    )
