"""Export a segment or factorized model (``kind_modules``) to a verified model directory.

As the token kind's export (``onnx_export``): staged beside ``--out``, moved into place
only after onnxruntime's output has been proved against the torch module, the parity and
its bound recorded in the manifest. The graph is written by hand (``kind_graphs``).

The bounds, per output value, against torch on the float32 tables:

- segment, float32 tables: 0. The graph does torch's IEEE operations on the same operands
  (a gather, a multiply by the float32 scale, an add), each correctly rounded.
- factorized, float32 tables: ``2 * gamma(D' + 1) * (max_v |x_v| * max_j |W_j| + max |b|)``
  where ``x_v`` is a scaled row, ``W_j`` a row of the Linear's weight, ``|.|`` the
  Euclidean norm and ``gamma(n) = n u / (1 - n u)``, ``u = 2**-24``: each library's sum of
  D' products and a bias is within ``gamma(D'+1) * sum |w x| + |b|`` of the exact value
  whatever its order (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), and
  ``sum |w x| <= |w| |x|`` (Cauchy-Schwarz). It holds for every id, not only those checked.
- float16 tables add each stored value's rounding: at most ``2**-11`` of its magnitude, or
  ``2**-25`` for subnormals, carried through the same arithmetic (below).
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import numpy as np
import torch

from tokembed.export.dtypes import FLOAT16
from tokembed.export.errors import ExportError, ParityError
from tokembed.export.hashing import phase
from tokembed.export.kind_graphs import (
    TABLE_DTYPES,
    Table,
    write_factorized_graph,
    write_segment_graph,
)
from tokembed.export.kind_modules import FactorizedEmbedding, SegmentEmbedding
from tokembed.export.kinds import FACTORIZED, SEGMENT, TOKEN_TYPE_IDS
from tokembed.export.manifest import (
    INPUT_NAME,
    MODEL_NAME,
    OUTPUT_NAME,
    Manifest,
    Parity,
    TensorSpec,
)
from tokembed.export.naming import model_name_for
from tokembed.export.onnx_export import ExportOptions
from tokembed.export.out_dir import check_out_dir
from tokembed.export.parity import PARITY_PHASE, parity_ids
from tokembed.export.staging import (
    file_entries,
    make_staging_dir,
    move_into_place,
    producer_versions,
)

logger = logging.getLogger(__name__)

KindModule = SegmentEmbedding | FactorizedEmbedding

_STORAGE = {dtype.name: dtype for dtype in TABLE_DTYPES}
_PRODUCERS = ("torch", "onnx", "onnxruntime")
_U = 2.0**-24  # float32's unit roundoff
_HALF = 2.0**-11  # float16's, for normal values
_HALF_TINY = 2.0**-25  # float16's absolute rounding of subnormals
_HALF_MAX = 65504.0


def export_kind_model(module: KindModule, options: ExportOptions) -> Manifest:
    """Export, verify against torch, write the manifest; return it."""
    if options.weight_dtype not in _STORAGE:
        raise ExportError(
            f"--dtype must be one of {sorted(_STORAGE)} for a segment or factorized model, "
            f"got {options.weight_dtype!r}"
        )
    out_dir = options.out_dir
    check_out_dir(out_dir, options.force)
    name = options.name if options.name is not None else model_name_for(out_dir)
    module = module.eval()
    stored = _STORAGE[options.weight_dtype].numpy
    staging = make_staging_dir(out_dir)
    try:
        with torch.no_grad():
            with phase(f"writing the graph ({options.weight_dtype} tables)"):
                opset = _write_graph(module, stored, staging)
            with phase(PARITY_PHASE):
                parity = _check_parity(module, staging, options.weight_dtype, options.seed)
        manifest = Manifest(
            name=name,
            version=options.version,
            vocab_size=module.vocab_size,
            d_model=module.d_model,
            scale=module.scale,
            padding_idx=module.padding_idx,
            weight_dtype=options.weight_dtype,
            input=TensorSpec(INPUT_NAME, "int64", ["batch", "sequence"]),
            output=TensorSpec(OUTPUT_NAME, "float32", ["batch", "sequence", module.d_model]),
            opset=opset,
            files=file_entries(staging),
            producer=producer_versions(_PRODUCERS),
            parity=parity,
            source=options.source or {},
            kind=SEGMENT if isinstance(module, SegmentEmbedding) else FACTORIZED,
            type_vocab_size=module.type_vocab_size
            if isinstance(module, SegmentEmbedding)
            else None,
            factor_dim=module.factor_dim if isinstance(module, FactorizedEmbedding) else None,
        )
        manifest.write(staging)
        move_into_place(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "exported %s (%s) to %s (max abs error %g, bound %g)",
        name, manifest.kind, out_dir, parity.max_abs_error, parity.tolerance,
    )  # fmt: skip
    return manifest


def _stored(what: str, tensor: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    values = tensor.detach().numpy()
    if dtype == FLOAT16.numpy:
        largest = float(np.max(np.abs(values))) if values.size else 0.0
        if largest > _HALF_MAX:
            raise ExportError(
                f"{what}'s largest magnitude {largest:g} does not fit float16 (max "
                f"{_HALF_MAX:g}); export as float32"
            )
    return values.astype(dtype, copy=False)


def _write_graph(module: KindModule, dtype: np.dtype, staging: Path) -> int:
    words = Table("embedding.weight", _stored("the embedding table",
                                              module.word_embeddings.weight, dtype))  # fmt: skip
    if isinstance(module, SegmentEmbedding):
        types = _stored("the segment table", module.token_type_embeddings.weight, dtype)
        return write_segment_graph(words, Table("segment.weight", types), module.scale, staging)
    linear = module.embedding_hidden_mapping_in
    # The graph multiplies rows by P = W^T: [D', D].
    projection = _stored("the projection", linear.weight, dtype).T
    bias = None if linear.bias is None else linear.bias.detach().numpy()
    return write_factorized_graph(
        words, Table("projection.weight", projection), bias, module.scale, staging
    )


def parity_inputs(module: KindModule, seed: int) -> dict[str, np.ndarray]:
    """The ids the export check looks up (``parity.parity_ids``: every row of small models,
    else a sample), and for a segment model type ids, each type at least once."""
    ids = parity_ids(module.vocab_size, module.d_model, module.padding_idx, seed)
    inputs = {INPUT_NAME: ids}
    if isinstance(module, SegmentEmbedding):
        types = np.random.default_rng(seed + 1).integers(0, module.type_vocab_size, ids.shape)
        flat = types.reshape(-1)
        count = min(flat.size, module.type_vocab_size)
        flat[:count] = np.arange(count)
        inputs[TOKEN_TYPE_IDS] = types.astype(np.int64)
    return inputs


def _check_parity(module: KindModule, staging: Path, weight_dtype: str, seed: int) -> Parity:
    import onnxruntime as ort

    inputs = parity_inputs(module, seed)
    session = ort.InferenceSession(str(staging / MODEL_NAME), providers=["CPUExecutionProvider"])
    got = session.run([OUTPUT_NAME], inputs)[0]
    want = module(*(torch.from_numpy(values) for values in inputs.values())).numpy()
    if got.shape != want.shape or got.dtype != np.float32:
        raise ParityError(
            f"ONNX output is {got.dtype}{list(got.shape)}, torch gives float32{list(want.shape)}"
        )
    error = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    tolerance = parity_tolerance(module, weight_dtype)
    if not error <= tolerance:  # written so that NaN fails too
        raise ParityError(
            f"ONNX output differs from torch by {error:g} (bound {tolerance:g} for "
            f"{weight_dtype} tables) over {inputs[INPUT_NAME].size} ids"
        )
    return Parity(
        max_abs_error=error, tolerance=tolerance, ids_checked=int(inputs[INPUT_NAME].size)
    )


def parity_tolerance(module: KindModule, weight_dtype: str) -> float:
    """The bound on any output value's distance from torch's (see the module docstring)."""
    half = weight_dtype == "float16"
    scale = module.scale
    words = module.word_embeddings.weight.detach().double()
    if isinstance(module, SegmentEmbedding):
        if not half:
            return 0.0
        types = module.token_type_embeddings.weight.detach().double()
        largest_word, largest_type = float(words.abs().max()), float(types.abs().max())
        # A stored value's rounding, carried through the scale's multiply (one more
        # rounding each side), then the add's rounding on each side.
        word_error = scale * ((_HALF + 3 * _U) * largest_word + 2 * _HALF_TINY)
        type_error = _HALF * largest_type + _HALF_TINY
        largest_sum = scale * largest_word * (1 + _U) + largest_type
        return word_error + type_error + _U * (2 * largest_sum + word_error + type_error)
    linear = module.embedding_hidden_mapping_in
    weight = linear.weight.detach().double()
    inner = module.factor_dim
    rows = float((words * scale).norm(dim=1).max()) * (1 + _U)  # max |x_v|
    columns = float(weight.norm(dim=1).max())  # max |W_j|
    bias = 0.0 if linear.bias is None else float(linear.bias.detach().abs().max())
    gamma = (inner + 1) * _U / (1 - (inner + 1) * _U)
    if not half:
        return 2 * gamma * (rows * columns + bias)
    # The graph's operands differ from torch's by their float16 rounding: |dx_v| and
    # |dW_j| bound how far, and the sums are then bounded on each side.
    largest_words = float(words.norm(dim=1).max())
    row_error = scale * ((_HALF + 3 * _U) * largest_words + 2 * _HALF_TINY * math.sqrt(inner))
    column_error = _HALF * columns + _HALF_TINY * math.sqrt(inner)
    operands = column_error * (rows + row_error) + columns * row_error
    return (
        operands
        + gamma * (rows * columns + bias)
        + gamma * ((columns + column_error) * (rows + row_error) + bias)
    )
