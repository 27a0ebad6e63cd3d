"""The export: one pipeline for every model kind, from a kind's ``parts.Part`` to a
verified model directory.

``export`` stages the directory beside ``--out``, has the part write its graph and tables
there, proves the graph in onnxruntime against torch (the part's reference, within its
bound, a slice of ids at a time), writes the manifest with the sha256 of every file
staged, and only then moves the files into place: a failed export never leaves a
half-written model directory where the server could find it. ``export_model`` does the
same for a kind's torch module (``modules``).

One more file in the model directory (a tokenizer, a second graph) or one more field of
the manifest (the head, ``--from-pretrained``'s record) is an ``Addition``
(``ExportOptions.additions``): run on the staging directory once the graph is proven and
before the manifest, it writes its files there and returns the manifest with its field.
``staging.file_entries`` then lists and hashes every file there, the manifest is written
once, and ``staging.move_into_place`` moves the whole into place: a reader (a server
polling its model repository) never sees the model without what the export added, and an
export that fails in an addition leaves nothing (or the model it would have replaced).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokembed.export.errors import ExportError
from tokembed.export.hashing import phase
from tokembed.export.manifest import (
    INPUT_NAME,
    MANIFEST_NAME,
    MODEL_NAME,
    OUTPUT_NAME,
    Manifest,
    Parity,
    TensorSpec,
    Tie,
)
from tokembed.export.modules import FactorizedEmbedding, SegmentEmbedding, TokenEmbedding
from tokembed.export.naming import model_name_for
from tokembed.export.out_dir import check_out_dir
from tokembed.export.parity import PARITY_PHASE, check_in_slices, parity_ids
from tokembed.export.parts import Part, part_of
from tokembed.export.staging import (
    file_entries,
    make_staging_dir,
    move_into_place,
    producer_versions,
)

logger = logging.getLogger(__name__)

# The packages whose versions the manifest records.
_PRODUCERS = ("torch", "onnx", "onnxruntime")
# The check compares this many bytes of float32 answers at a time: each side is held
# again in float64 to be compared, so a slice costs about six times this.
PARITY_SLICE_BYTES = 8 * 1024 * 1024

# What an export adds beside the kind's graph: given the staging directory (the proven
# graph is there) and the manifest so far (its ``files`` not yet listed), it writes its
# files into the directory and returns the manifest with its field.
Addition = Callable[[Path, Manifest], Manifest]


@dataclass(frozen=True)
class ExportOptions:
    """What the manifest says beside the model itself, and where it goes."""

    out_dir: Path
    # None: named after out_dir (tokembed.export.naming).
    name: str | None = None
    version: str = "1"
    weight_dtype: str = "float32"
    force: bool = False
    # Of the parity check's sample (and of its order).
    seed: int = 0
    # Where the weights came from (a checkpoint's file, keys and sha256, or a seed).
    source: dict[str, Any] | None = None
    # Whether the table is also the model's output projection, when asked.
    tie: Tie | None = None
    # Run in order before the manifest is written (``Addition``).
    additions: tuple[Addition, ...] = ()


def export_model(
    module: TokenEmbedding | SegmentEmbedding | FactorizedEmbedding, options: ExportOptions
) -> Manifest:
    """Export a kind's torch module, verified against it; return the manifest."""
    return export(part_of(module), options)


def export(part: Part, options: ExportOptions) -> Manifest:
    """Export ``part`` to ``options.out_dir``, verified against torch; return the manifest."""
    weight_dtype = options.weight_dtype
    if weight_dtype not in part.weight_dtypes:
        raise ExportError(
            f"--dtype must be one of {sorted(part.weight_dtypes)} for a {part.kind} model, "
            f"got {weight_dtype!r}"
        )
    out_dir = options.out_dir
    check_out_dir(out_dir, options.force)
    name = options.name if options.name is not None else model_name_for(out_dir)
    staging = make_staging_dir(out_dir)
    try:
        with phase(part.writing(weight_dtype)):
            opset = part.write(staging, weight_dtype)
        with phase(PARITY_PHASE):
            parity = _prove(part, staging / MODEL_NAME, weight_dtype, options.seed)
        # The manifest's fields named as the part names them (``Manifest``'s own).
        sizes: dict[str, Any] = part.sizes()
        manifest = Manifest(
            name=name,
            version=options.version,
            vocab_size=part.vocab_size,
            d_model=part.d_model,
            scale=part.scale,
            padding_idx=part.padding_idx,
            weight_dtype=weight_dtype,
            input=TensorSpec(INPUT_NAME, "int64", ["batch", "sequence"]),
            output=TensorSpec(OUTPUT_NAME, "float32", ["batch", "sequence", part.d_model]),
            opset=opset,
            files={},
            producer=producer_versions(_PRODUCERS),
            parity=parity,
            source=options.source or {},
            kind=part.kind,
            tie=options.tie,
            **sizes,
        )
        for addition in options.additions:
            manifest = addition(staging, manifest)
        manifest = dataclasses.replace(manifest, files=file_entries(staging))
        # Checked through the reader first: what is written reads back.
        Manifest.from_dict(json.loads(manifest.to_json()), where=str(out_dir / MANIFEST_NAME))
        manifest.write(staging)
        move_into_place(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "exported %s (%s) to %s (max abs error %g, bound %g)",
        name, part.kind, out_dir, parity.max_abs_error, parity.tolerance,
    )  # fmt: skip
    return manifest


def _prove(part: Part, model_path: Path, weight_dtype: str, seed: int) -> Parity:
    """onnxruntime on the written graph against the part's torch reference: the same ids
    as every export checks (``parity_ids``), a slice at a time. The session, and its
    mapping of the tables, go with this call's frame: before the files are hashed and
    moved."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])

    def run(ids: np.ndarray) -> np.ndarray:
        got: np.ndarray = session.run([OUTPUT_NAME], part.feeds(ids))[0]
        return got

    def answers(ids: np.ndarray, got: np.ndarray) -> None:
        part.answers(ids, got, weight_dtype)

    return check_in_slices(
        run,
        part.reference,
        parity_ids(part.vocab_size, part.d_model, part.padding_idx, seed),
        tolerance=part.tolerance(weight_dtype),
        weight_dtype=weight_dtype,
        slice_bytes=PARITY_SLICE_BYTES,
        d_model=part.d_model,
        seed=seed,
        answers=answers,
    )
