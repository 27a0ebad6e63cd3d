"""Export a ``TokenEmbedding`` to a verified model directory.

The export is staged in a sibling temporary directory and moved into place only after
the ONNX model has been proved against torch, so a failed export never leaves a
half-written model directory where the server could find it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

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
)
from tokembed.export.module import StoredAs, TokenEmbedding
from tokembed.export.naming import model_name_for
from tokembed.export.out_dir import check_out_dir
from tokembed.export.parity import PARITY_PHASE, parity_ids
from tokembed.export.staging import (
    file_entries,
    make_staging_dir,
    move_into_place,
    producer_versions,
)

logger = logging.getLogger(__name__)

# The packages whose versions the manifest records.
_PRODUCERS = ("torch", "onnx", "onnxscript", "onnxruntime")


@dataclass(frozen=True)
class ExportOptions:
    out_dir: Path
    # None: named after out_dir (tokembed.export.naming).
    name: str | None = None
    version: str = "1"
    weight_dtype: str = "float32"
    force: bool = False
    seed: int = 0
    source: dict[str, Any] | None = None


def export_model(module: TokenEmbedding, options: ExportOptions) -> Manifest:
    """Export, verify against torch, write the manifest; return it."""
    if options.weight_dtype not in WEIGHT_DTYPES:
        raise ExportError(
            f"--dtype must be one of {sorted(WEIGHT_DTYPES)}, got {options.weight_dtype!r}"
        )
    out_dir = options.out_dir
    check_out_dir(out_dir, options.force)
    name = options.name if options.name is not None else model_name_for(out_dir)
    module = module.eval()
    if options.weight_dtype != "float32":
        _check_fits(module, options.weight_dtype)
    staging = make_staging_dir(out_dir)
    try:
        with phase(f"exporting the graph ({options.weight_dtype} table) with torch"):
            exported = _export_graph(module, options.weight_dtype, staging / MODEL_NAME)
        with phase(PARITY_PHASE):
            parity = _check_parity(module, staging / MODEL_NAME, options.weight_dtype, options.seed)
        files = file_entries(staging)
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
            opset=exported,
            files=files,
            producer=producer_versions(_PRODUCERS),
            parity=parity,
            source=options.source or {},
        )
        manifest.write(staging)
        move_into_place(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("exported %s to %s (max abs error %g)", name, out_dir, parity.max_abs_error)
    return manifest


def _check_fits(module: TokenEmbedding, weight_dtype: str) -> None:
    largest = float(module.embedding.weight.detach().abs().max())
    finfo = torch.finfo(WEIGHT_DTYPES[weight_dtype].torch_dtype())
    if largest > float(finfo.max):
        raise ExportError(
            f"the table's largest magnitude {largest:g} does not fit {weight_dtype} "
            f"(max {finfo.max:g}); export as float32"
        )


@contextlib.contextmanager
def _quiet_torch_exporter() -> Iterator[None]:
    """The dynamo exporter logs and warns about its own internals (missing torchvision
    ops, deprecated pytree classes) on every export; none of it concerns our one-op graph."""
    onnx_logger = logging.getLogger("torch.onnx")
    previous = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\..*")
            warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\..*")
            yield
    finally:
        onnx_logger.setLevel(previous)


def _export_graph(module: TokenEmbedding, weight_dtype: str, model_path: Path) -> int:
    """Write ``model.onnx`` with its weights as external data; return the opset used."""
    graph_module: torch.nn.Module = module
    if weight_dtype != "float32":
        graph_module = StoredAs(module, WEIGHT_DTYPES[weight_dtype].torch_dtype()).eval()
    # B and S >= 2 in the example, so the exporter cannot specialise either to a constant.
    example = torch.zeros((2, 3), dtype=torch.int64)
    batch = torch.export.Dim("batch")
    sequence = torch.export.Dim("sequence")
    with _quiet_torch_exporter(), torch.no_grad():
        program = torch.onnx.export(
            graph_module,
            (example,),
            str(model_path),
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch, 1: sequence},),
            dynamo=True,
            # Always external: one layout for every size, and tables past protobuf's
            # 2 GiB limit need it anyway.
            external_data=True,
            optimize=True,
            verbose=False,
        )
    if program is None:
        raise ExportError("torch.onnx.export returned no program; this is a bug")
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    return int(next(op.version for op in model.opset_import if op.domain in ("", "ai.onnx")))


def parity_tolerance(module: TokenEmbedding, weight_dtype: str) -> float:
    """float32 must match exactly: the graph does the same two IEEE operations as torch.

    float16 rounds each weight by at most 2**-11 of its magnitude (2**-25 absolute for
    subnormals), bfloat16 by at most 2**-8 (its subnormals are float32's, 2**-134 apart);
    the float32 scale then adds at most one ulp on each side.
    """
    if weight_dtype == "float32":
        return 0.0
    largest = float(module.embedding.weight.detach().abs().max())
    if weight_dtype == "bfloat16":
        return module.scale * (largest * (2**-8 + 2**-22) + 2**-133)
    return module.scale * (largest * (2**-11 + 2**-22) + 2**-24)


def _check_parity(module: TokenEmbedding, model_path: Path, weight_dtype: str, seed: int) -> Parity:
    """The graph against torch: its float32 answer within the table's rounding of the
    float32 module (0 for a float32 table), and every answer dtype bit for bit (see
    ``_check_answers``). Raises ``ParityError`` naming what differs."""
    import onnxruntime as ort

    ids = parity_ids(module.vocab_size, module.d_model, module.padding_idx, seed)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    got = session.run([OUTPUT_NAME], {INPUT_NAME: ids})[0]
    with torch.no_grad():
        want = module(torch.from_numpy(ids)).numpy()
    if got.shape != want.shape or got.dtype != np.float32:
        raise ParityError(
            f"ONNX output is {got.dtype}{list(got.shape)}, torch gives float32{list(want.shape)}"
        )
    error = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    tolerance = parity_tolerance(module, weight_dtype)
    if not error <= tolerance:  # written so that NaN fails too
        raise ParityError(
            f"ONNX output differs from torch by {error:g} (tolerance {tolerance:g} for "
            f"{weight_dtype} weights) over {ids.size} ids"
        )
    _check_answers(module, weight_dtype, ids, got)
    return Parity(max_abs_error=error, tolerance=tolerance, ids_checked=int(ids.size))


def _check_answers(
    module: TokenEmbedding, weight_dtype: str, ids: np.ndarray, got: np.ndarray
) -> None:
    """Each answer dtype, bit for bit: the graph's float32 rows, rounded to it as the
    server rounds them, against torch's answer in that dtype. torch's answer is the
    stored table's row (the float32 row rounded to the weight dtype, as ``StoredAs``
    stores it) widened exactly and times the scale in float32, cast to the dtype; and in
    the table's own dtype, also that row times the scale computed in that dtype, as
    ``embedding(ids) * scale`` on a table stored so computes it. Only the checked ids'
    rows are narrowed (rounding commutes with the gather): no second copy of the table.

    The server rounds the float32 rows into each answer dtype to nearest even, as numpy's
    float16 and ml_dtypes' bfloat16 do (tests/server/test_answer_casts.py proves the
    server's casts give these bits)."""
    torch_ids = torch.from_numpy(ids)
    with torch.no_grad():
        rows = torch.nn.functional.embedding(torch_ids, module.embedding.weight)
        stored = rows.to(WEIGHT_DTYPES[weight_dtype].torch_dtype())
        reference = stored.to(torch.float32) * module.scale
        for name, dtype in ANSWER_DTYPES.items():
            # A float32 answer past float16's largest rounds to infinity, in torch too.
            with np.errstate(over="ignore"):
                ours = bits(got.astype(dtype.numpy))
            theirs = [("the stored table's float32 answer", reference.to(dtype.torch_dtype()))]
            if name == weight_dtype:
                theirs.append((f"embedding(ids) * scale in {name}", stored * module.scale))
            for what, answer in theirs:
                expected = torch_bits(answer)
                if not np.array_equal(ours, expected):
                    differ = int(np.count_nonzero(ours != expected))
                    raise ParityError(
                        f"{name} answers differ from torch's ({what}) in {differ} of "
                        f"{ours.size} values over {ids.size} ids"
                    )
