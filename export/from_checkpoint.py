"""Export a checkpoint's matrix as a token table without ever holding it in memory whole.

The matrix is streamed from the checkpoint (``weights.CheckpointMatrix``) into
``model.onnx.data`` a slice of rows at a time, widened to float32 and converted to the
stored dtype on the way (the same conversions ``TokenEmbedding`` and ``StoredAs`` make);
the graph, written with ``onnx.helper`` (``table_graph.write_graph``), points at that
file; the check against torch then runs a slice of ids at a time, each against the
checkpoint's own rows read for it. What stays resident is onnxruntime's mapping of the
stored table during the check and a few slices, where torch's exporter held five to
seven copies of the table (docs/export.md, "Time and memory", has the figures).
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokembed.export.checkpoint_files import CheckpointMatrix
from tokembed.export.dtypes import ANSWER_DTYPES, WEIGHT_DTYPES, bits, torch_bits
from tokembed.export.errors import ExportError, ParityError
from tokembed.export.hashing import phase
from tokembed.export.manifest import (
    INPUT_NAME,
    MODEL_NAME,
    OUTPUT_NAME,
    Manifest,
    Parity,
    TensorSpec,
    Tie,
)
from tokembed.export.module import check_table_sizes
from tokembed.export.naming import model_name_for
from tokembed.export.out_dir import check_out_dir
from tokembed.export.parity import (
    PARITY_PHASE,
    check_in_slices,
    parity_ids,
    storage_tolerance,
)
from tokembed.export.staging import (
    file_entries,
    make_staging_dir,
    move_into_place,
    producer_versions,
)
from tokembed.export.table_graph import DATA_NAME, write_graph

logger = logging.getLogger(__name__)

# The packages whose versions the manifest records.
_PRODUCERS = ("torch", "onnx", "onnxruntime")
# Rows are converted and written this many bytes (of float32) at a time.
CHUNK_BYTES = 32 * 1024 * 1024
# The check compares this many bytes of float32 answers at a time: each side is held
# again in float64 to be compared, so a slice costs about six times this.
PARITY_SLICE_BYTES = 8 * 1024 * 1024


def export_checkpoint(
    matrix: CheckpointMatrix,
    out_dir: Path,
    *,
    scale: float,
    padding_idx: int | None = None,
    weight_dtype: str = "float32",
    name: str | None = None,
    version: str = "1",
    force: bool = False,
    seed: int = 0,
    source: dict[str, Any] | None = None,
    tie: Tie | None = None,
) -> Manifest:
    """Export ``matrix`` times ``scale`` to ``out_dir``, verified against torch; return
    the manifest. ``scale`` is a number (``module.resolve_scale`` reads the flag)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ExportError(f"--dtype must be one of {list(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    vocab_size, d_model = matrix.shape
    check_table_sizes(vocab_size, d_model, padding_idx)
    check_out_dir(out_dir, force)
    name = name if name is not None else model_name_for(out_dir)
    staging = make_staging_dir(out_dir)
    try:
        with phase(f"reading {matrix.key} from {matrix.file.name} into a {weight_dtype} table"):
            largest = _write_table(matrix, staging / DATA_NAME, weight_dtype)
        opset = write_graph(staging, vocab_size, d_model, weight_dtype, scale)
        with phase(PARITY_PHASE):
            parity = _check_parity(
                matrix, staging / MODEL_NAME, weight_dtype, scale, largest, padding_idx, seed
            )
        manifest = Manifest(
            name=name,
            version=version,
            vocab_size=vocab_size,
            d_model=d_model,
            scale=scale,
            padding_idx=padding_idx,
            weight_dtype=weight_dtype,
            input=TensorSpec(INPUT_NAME, "int64", ["batch", "sequence"]),
            output=TensorSpec(OUTPUT_NAME, "float32", ["batch", "sequence", d_model]),
            opset=opset,
            files=file_entries(staging),
            producer=producer_versions(_PRODUCERS),
            parity=parity,
            source=source or {},
            tie=tie,
        )
        manifest.write(staging)
        move_into_place(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("exported %s to %s (max abs error %g)", name, out_dir, parity.max_abs_error)
    return manifest


def _write_table(matrix: CheckpointMatrix, path: Path, weight_dtype: str) -> float:
    """Stream the matrix into ``path`` as ``weight_dtype`` (little-endian, row after row);
    return its largest magnitude. Refuses non-finite values, and a table float16 cannot
    hold (naming its largest magnitude, so the whole matrix is scanned first)."""
    stored_as = WEIGHT_DTYPES[weight_dtype].torch_dtype()
    limit = float(torch.finfo(stored_as).max)
    largest = 0.0
    with path.open("wb") as out:
        for start, rows in matrix.slices(CHUNK_BYTES * matrix.dtype.itemsize // 4):
            # Widened exactly from float16 and bfloat16 (rounded from float64), as
            # TokenEmbedding widens a checkpoint's table.
            widened = rows.to(torch.float32)
            low, high = (float(v) for v in torch.aminmax(widened))
            if not (math.isfinite(low) and math.isfinite(high)):
                raise ExportError(
                    f"{matrix.key!r} holds a value that is not finite as float32 (NaN or "
                    f"infinity) in rows [{start}, {start + len(rows)}): no row of it can be "
                    "served as the model computes it"
                )
            largest = max(largest, -low, high)
            if largest > limit:
                continue  # refused below, once the largest magnitude is known
            # Rounded to nearest even, as StoredAs stores a float32 table.
            stored = widened.to(stored_as)
            out.write(stored.view(torch.uint8).numpy().data)
    if largest > limit:
        raise ExportError(
            f"the table's largest magnitude {largest:g} does not fit {weight_dtype} "
            f"(max {limit:g}); export as float32"
        )
    return largest


def _check_parity(
    matrix: CheckpointMatrix,
    model_path: Path,
    weight_dtype: str,
    scale: float,
    largest: float,
    padding_idx: int | None,
    seed: int,
) -> Parity:
    """onnxruntime on the written graph against torch on the checkpoint's rows: the same
    ids as every export checks (``parity_ids``), a slice at a time."""
    import onnxruntime as ort

    vocab_size, d_model = matrix.shape
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])

    def run(ids: np.ndarray) -> np.ndarray:
        got: np.ndarray = session.run([OUTPUT_NAME], {INPUT_NAME: ids})[0]
        return got

    taken: dict[str, Any] = {}

    def reference(ids: np.ndarray) -> np.ndarray:
        # TokenEmbedding's computation: the float32 row times the scale, in torch.
        rows = matrix.take(ids)
        # A mapped file's pages read for these rows (and mapped around them) go with the
        # slice, instead of adding up to the whole matrix over the check.
        matrix.release()
        taken.update(ids=ids, rows=rows)
        with torch.no_grad():
            want: np.ndarray = (rows.to(torch.float32) * scale).numpy()
        return want

    def answers(ids: np.ndarray, got: np.ndarray) -> None:
        assert taken["ids"] is ids, "This is a bug: answers follows reference, per slice."
        _check_answers(taken.pop("rows"), got, weight_dtype, scale, ids.size)

    # The session, and its mapping of the table, go with this call's frame: before the
    # files are hashed and moved.
    return check_in_slices(
        run,
        reference,
        parity_ids(vocab_size, d_model, padding_idx, seed),
        tolerance=storage_tolerance(weight_dtype, largest, scale),
        weight_dtype=weight_dtype,
        slice_bytes=PARITY_SLICE_BYTES,
        d_model=d_model,
        seed=seed,
        answers=answers,
    )


def _check_answers(
    rows: torch.Tensor, got: np.ndarray, weight_dtype: str, scale: float, ids_checked: int
) -> None:
    """Each answer dtype, bit for bit: the graph's float32 rows rounded to it as the
    server rounds them, against torch's answer in that dtype: the rows as stored (widened
    exactly, times the scale in float32, as ``StoredAs`` computes) cast to the dtype; and
    in the table's own dtype also ``embedding(ids) * scale`` computed in that dtype, as a
    model stored so computes it. ``rows``: the checkpoint's rows, as read. Each answer
    dtype is rounded to nearest even, as numpy's float16 and ml_dtypes' bfloat16 round
    (the server's casts); the same check as ``onnx_export._check_answers``, on the
    checkpoint's rows of one slice."""
    stored = rows.to(torch.float32).to(WEIGHT_DTYPES[weight_dtype].torch_dtype())
    with torch.no_grad():
        reference = stored.to(torch.float32) * scale
        for name, dtype in ANSWER_DTYPES.items():
            # A float32 answer past float16's largest rounds to infinity, in torch too.
            with np.errstate(over="ignore"):
                ours = bits(got.astype(dtype.numpy))
            theirs = [("the stored table's float32 answer", reference.to(dtype.torch_dtype()))]
            if name == weight_dtype:
                theirs.append((f"embedding(ids) * scale in {name}", stored * scale))
            for what, answer in theirs:
                expected = torch_bits(answer)
                if not np.array_equal(ours, expected):
                    raise ParityError(
                        f"{name} answers differ from torch's ({what}) in "
                        f"{int(np.count_nonzero(ours != expected))} of {ours.size} values over "
                        f"{ids_checked} ids"
                    )
