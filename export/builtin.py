"""The built-in default model, made with the server's own install: numpy, onnx and
onnxruntime, never torch.

``tokembed serve`` with no model creates it on first start. It is a model directory like
any export: ``model.onnx`` + ``model.onnx.data`` + a manifest with the sha256 of each file,
and a parity check, recorded in the manifest, that onnxruntime reproduces a numpy
reference bit for bit (the exporter checks against torch; here numpy made the table).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokembed.export.errors import ExportError, ParityError
from tokembed.export.graphs import write_table_graph
from tokembed.export.manifest import (
    INPUT_NAME,
    MANIFEST_NAME,
    MODEL_NAME,
    OUTPUT_NAME,
    Manifest,
    Parity,
    TensorSpec,
)
from tokembed.export.parity import parity_ids
from tokembed.export.staging import file_entries, make_staging_dir, producer_versions, publish_new

if TYPE_CHECKING:
    from tokembed.export.pipeline import Addition

logger = logging.getLogger(__name__)

# How the manifest's source describes the table (seeded_table's docstring says why).
INIT = "uniform(-sqrt(3), sqrt(3)) from PCG64's raw stream"
_CHUNK_VALUES = 1 << 20
_TOP_BITS = 24
# (2k + 1 - 2**24) / 2**24 * sqrt(3) for a 24-bit k: one multiply by this constant.
_SPREAD = math.sqrt(3) * 2.0**-_TOP_BITS


@dataclass(frozen=True)
class BuiltinSpec:
    """The built-in model: V=32000, D=512, seed 0, scale sqrt(D), no padding id."""

    vocab_size: int = 32000
    d_model: int = 512
    seed: int = 0
    name: str = "tokembed-default"
    version: str = "1"

    @property
    def scale(self) -> float:
        return math.sqrt(self.d_model)


DEFAULT = BuiltinSpec()


def seeded_table(vocab_size: int, d_model: int, seed: int) -> np.ndarray:
    """A float32 ``[V, D]`` table, uniform on (-sqrt(3), sqrt(3)): mean 0 and variance 1,
    like ``nn.Embedding``'s N(0, 1) initialisation.

    The same bits from a seed on every machine and numpy version: numpy guarantees the
    raw integer stream of ``PCG64`` for a seed, but not the values of ``Generator``'s
    distributions (``standard_normal`` included) across versions, builds or machines. Each
    value takes the top 24 bits ``k`` of one raw draw, and only correctly rounded IEEE
    operations follow: ``(2k + 1 - 2**24)`` is exact, one float64 multiply, one rounding to
    float32. The values are symmetric around 0 and never 0.
    """
    bits = np.random.PCG64(seed)
    table = np.empty((vocab_size, d_model), dtype=np.float32)
    flat = table.reshape(-1)
    for start in range(0, flat.size, _CHUNK_VALUES):
        count = min(_CHUNK_VALUES, flat.size - start)
        top = (bits.random_raw(count) >> np.uint64(64 - _TOP_BITS)).astype(np.int64)
        odd = 2 * top + (1 - 2**_TOP_BITS)
        flat[start : start + count] = (odd * _SPREAD).astype(np.float32)
    return table


def build_builtin_model(
    out_dir: Path, spec: BuiltinSpec = DEFAULT, additions: tuple[Addition, ...] = ()
) -> bool:
    """Build the model into ``out_dir`` if it is missing or empty; ``additions`` (the
    exporter's, ``pipeline.Addition``: ``--builtin --tied-head``'s head) are staged with
    it, before its one manifest.

    Returns True when this call put it there, False when another process did first (two
    servers starting at once on an empty directory): the model is built in a directory
    beside ``out_dir`` and renamed to it in one step, so neither sees a half-written one.
    Raises ``ExportError`` when ``out_dir`` holds something else, or the build fails.
    """
    if _holds_other_files(out_dir):
        raise ExportError(f"{out_dir} exists and is not empty, but holds no {MANIFEST_NAME}")
    staging = make_staging_dir(out_dir, label=str(out_dir))
    try:
        manifest = _build(staging, spec, additions)
        if publish_new(staging, out_dir):
            logger.info(
                "built %s v%s (V=%d D=%d seed %d) in %s",
                manifest.name, manifest.version, spec.vocab_size, spec.d_model, spec.seed, out_dir,
            )  # fmt: skip
            return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not (out_dir / MANIFEST_NAME).is_file():
        raise ExportError(f"{out_dir} exists and is not empty, but holds no {MANIFEST_NAME}")
    logger.info("%s was built by another process meanwhile; using that one", out_dir)
    return False


def _holds_other_files(out_dir: Path) -> bool:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory")
    if not out_dir.is_dir() or (out_dir / MANIFEST_NAME).is_file():
        return False
    return any(out_dir.iterdir())


def _build(staging: Path, spec: BuiltinSpec, additions: tuple[Addition, ...]) -> Manifest:
    table = seeded_table(spec.vocab_size, spec.d_model, spec.seed)
    opset = write_table_graph(table, spec.scale, staging)
    parity = _check_parity(staging / MODEL_NAME, table, spec)
    manifest = Manifest(
        name=spec.name,
        version=spec.version,
        vocab_size=spec.vocab_size,
        d_model=spec.d_model,
        scale=spec.scale,
        padding_idx=None,
        weight_dtype="float32",
        input=TensorSpec(INPUT_NAME, "int64", ["batch", "sequence"]),
        output=TensorSpec(OUTPUT_NAME, "float32", ["batch", "sequence", spec.d_model]),
        opset=opset,
        files={},
        producer=producer_versions(("numpy", "onnx", "onnxruntime")),
        parity=parity,
        source={"kind": "builtin", "seed": spec.seed, "init": INIT, "parity_reference": "numpy"},
    )
    for addition in additions:
        manifest = addition(staging, manifest)
    manifest = dataclasses.replace(manifest, files=file_entries(staging))
    manifest.write(staging)
    return manifest


def _check_parity(model_path: Path, table: np.ndarray, spec: BuiltinSpec) -> Parity:
    """onnxruntime must give ``table[id] * float32(scale)`` exactly, bit for bit."""
    import onnxruntime as ort

    ids = parity_ids(spec.vocab_size, spec.d_model, None, spec.seed)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    got = session.run([OUTPUT_NAME], {INPUT_NAME: ids})[0]
    want = table[ids] * np.float32(spec.scale)
    if got.shape != want.shape or got.dtype != np.float32:
        raise ParityError(
            f"ONNX output is {got.dtype}{list(got.shape)}, the reference float32{list(want.shape)}"
        )
    differ = int(np.count_nonzero(got.view(np.uint32) != want.view(np.uint32)))
    error = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    if differ:
        raise ParityError(
            f"ONNX output differs from the numpy reference in {differ} of {got.size} values "
            f"(max abs error {error:g}) over {ids.size} ids"
        )
    return Parity(max_abs_error=error, tolerance=0.0, ids_checked=int(ids.size))
