"""What each model kind brings to the export (``pipeline.export``): a ``Part``.

The pipeline does what every kind does the same way: it stages the model directory,
proves the graph against torch, writes the manifest and moves the directory into place.
A part holds only what differs: its graph and tables (``write``), the inputs the graph
takes beside the ids (``feeds``), torch's answer for a slice of ids (``reference``: its
module's computation, ``modules``), the bound the graph's answer must stay within
(``tolerance``) and any checks of its own (``answers``), and the manifest's sizes only
its kind has (``sizes``).

- ``TokenPart``: ``E[id] * scale``. Its table is streamed, a slice of rows at a time,
  from a checkpoint's matrix (``weights.open_matrix``) or a module's table into
  ``model.onnx.data``, widened to float32 and converted to the stored dtype on the way;
  the check reads the checked ids' rows back from the same source, a slice at a time.
  What stays resident is onnxruntime's mapping of the stored table during the check and
  a few slices, where torch's exporter held five to seven copies of the table
  (docs/export.md, "Time and memory", has the figures). Its bound is the stored dtype's
  rounding (``parity.storage_tolerance``), and every answer dtype is checked bit for bit.
- ``SegmentPart`` and ``FactorizedPart``: from their modules, whose tables are written
  whole. Their bounds, per output value, against torch on the float32 tables:

  - segment, float32 tables: 0. The graph does torch's IEEE operations on the same
    operands (a gather, a multiply by the float32 scale, an add), each correctly rounded.
  - factorized, float32 tables: ``2 * gamma(D' + 1) * (max_v |x_v| * max_j |W_j| + max |b|)``
    where ``x_v`` is a scaled row, ``W_j`` a row of the Linear's weight, ``|.|`` the
    Euclidean norm and ``gamma(n) = n u / (1 - n u)``, ``u = 2**-24``: each library's
    sum of D' products and a bias is within ``gamma(D'+1) * sum |w x| + |b|`` of the
    exact value whatever its order (Higham, Accuracy and Stability of Numerical
    Algorithms, 3.1), and ``sum |w x| <= |w| |x|`` (Cauchy-Schwarz). It holds for every
    id, not only those checked.
  - float16 tables add each stored value's rounding: at most ``2**-11`` of its
    magnitude, or ``2**-25`` for subnormals, carried through the same arithmetic.
"""

from __future__ import annotations

import abc
import math
from pathlib import Path

import numpy as np
import torch

from tokembed.export.checkpoint_files import CheckpointMatrix
from tokembed.export.dtypes import ANSWER_DTYPES, FLOAT16, WEIGHT_DTYPES, bits, torch_bits
from tokembed.export.errors import ExportError, ParityError
from tokembed.export.graphs import (
    DATA_NAME,
    TABLE_DTYPES,
    TABLE_NAME,
    Table,
    write_factorized_graph,
    write_segment_graph,
    write_token_graph,
)
from tokembed.export.kinds import FACTORIZED, SEGMENT, TOKEN, TOKEN_TYPE_IDS
from tokembed.export.manifest import INPUT_NAME
from tokembed.export.modules import (
    FactorizedEmbedding,
    SegmentEmbedding,
    TokenEmbedding,
    check_table_sizes,
)
from tokembed.export.parity import storage_tolerance

# A token table's rows are converted and written this many bytes (of float32) at a time.
CHUNK_BYTES = 32 * 1024 * 1024
_U = 2.0**-24  # float32's unit roundoff
_HALF = 2.0**-11  # float16's, for normal values
_HALF_TINY = 2.0**-25  # float16's absolute rounding of subnormals


class Part(abc.ABC):
    """One model kind's share of an export, for one export (it keeps what ``write``
    learnt, such as a streamed table's largest value, for the check that follows)."""

    kind: str
    vocab_size: int
    d_model: int
    scale: float
    padding_idx: int | None
    # The dtypes its tables may be stored as (``--dtype``).
    weight_dtypes: tuple[str, ...]

    @abc.abstractmethod
    def writing(self, weight_dtype: str) -> str:
        """What a terminal shows while ``write`` runs (``hashing.phase``)."""

    @abc.abstractmethod
    def write(self, directory: Path, weight_dtype: str) -> int:
        """Write ``model.onnx`` and its data into ``directory``; return the opset."""

    def feeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """The graph's inputs for ``[2, n]`` ids."""
        return {INPUT_NAME: ids}

    @abc.abstractmethod
    def reference(self, ids: np.ndarray) -> np.ndarray:
        """torch's float32 ``[n, D]`` answer for flat ids, the inputs as ``feeds`` gives
        them to the graph."""

    @abc.abstractmethod
    def tolerance(self, weight_dtype: str) -> float:
        """The bound on any output value's distance from ``reference``'s."""

    def answers(self, ids: np.ndarray, got: np.ndarray, weight_dtype: str) -> None:
        """Checks beyond the bound, on a slice's flat ids and the graph's float32 answer
        for them, right after ``reference`` (``ParityError``). None unless a kind has some."""
        return None

    def sizes(self) -> dict[str, int]:
        """The manifest's sizes only this kind has (``manifest.Manifest``)."""
        return {}


def part_of(module: TokenEmbedding | SegmentEmbedding | FactorizedEmbedding) -> Part:
    """The part that exports a kind's torch module."""
    if isinstance(module, TokenEmbedding):
        return TokenPart.of_module(module)
    if isinstance(module, SegmentEmbedding):
        return SegmentPart(module)
    return FactorizedPart(module)


# --- the token kind --------------------------------------------------------------------


class TokenPart(Part):
    """``E[id] * scale`` for the ``[V, D]`` matrix ``rows``, streamed (see the module)."""

    kind = TOKEN
    weight_dtypes = tuple(WEIGHT_DTYPES)

    def __init__(
        self, rows: CheckpointMatrix, scale: float, padding_idx: int | None, source: str
    ) -> None:
        self.vocab_size, self.d_model = rows.shape
        check_table_sizes(self.vocab_size, self.d_model, padding_idx)
        self.scale, self.padding_idx = scale, padding_idx
        self._rows, self._source = rows, source
        self._largest: float | None = None
        self._taken: tuple[np.ndarray, torch.Tensor] | None = None

    @classmethod
    def of_checkpoint(
        cls, matrix: CheckpointMatrix, scale: float, padding_idx: int | None
    ) -> TokenPart:
        """The matrix at a checkpoint's key, open for as long as the export runs;
        ``scale`` is a number (``modules.resolve_scale`` reads the flag)."""
        return cls(matrix, scale, padding_idx, f"reading {matrix.key} from {matrix.file.name}")

    @classmethod
    def of_module(cls, module: TokenEmbedding) -> TokenPart:
        table = _Table(module.embedding.weight.detach())
        return cls(table, module.scale, module.padding_idx, "exporting the module's table")

    def writing(self, weight_dtype: str) -> str:
        return f"{self._source} into a {weight_dtype} table"

    def write(self, directory: Path, weight_dtype: str) -> int:
        self._largest = self._write_table(directory / DATA_NAME, weight_dtype)
        return write_token_graph(directory, self.vocab_size, self.d_model, weight_dtype, self.scale)

    def _write_table(self, path: Path, weight_dtype: str) -> float:
        """Stream the matrix into ``path`` as ``weight_dtype`` (little-endian, row after
        row); return its largest magnitude. Refuses non-finite values, and a table the
        dtype cannot hold (naming its largest magnitude, so the whole matrix is scanned)."""
        matrix = self._rows
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
                        f"infinity) in rows [{start}, {start + len(rows)}): no row of it can "
                        "be served as the model computes it"
                    )
                largest = max(largest, -low, high)
                if largest > limit:
                    continue  # refused below, once the largest magnitude is known
                # Rounded to nearest even, as torch rounds a float32 table to the dtype.
                stored = widened.to(stored_as).contiguous()
                out.write(stored.view(torch.uint8).numpy().data)
        if largest > limit:
            raise ExportError(
                f"the table's largest magnitude {largest:g} does not fit {weight_dtype} "
                f"(max {limit:g}); export as float32"
            )
        return largest

    def reference(self, ids: np.ndarray) -> np.ndarray:
        # TokenEmbedding's computation: the float32 row times the scale, in torch.
        rows = self._rows.take(ids)
        # A mapped file's pages read for these rows (and mapped around them) go with the
        # slice, instead of adding up to the whole matrix over the check.
        self._rows.release()
        self._taken = (ids, rows)
        with torch.no_grad():
            want: np.ndarray = (rows.to(torch.float32) * self.scale).numpy()
        return want

    def tolerance(self, weight_dtype: str) -> float:
        assert self._largest is not None, "This is a bug: the table is written first."
        return storage_tolerance(weight_dtype, self._largest, self.scale)

    def answers(self, ids: np.ndarray, got: np.ndarray, weight_dtype: str) -> None:
        """Each answer dtype, bit for bit: the graph's float32 rows rounded to it as the
        server rounds them, against torch's answer in that dtype: the rows as stored
        (widened exactly, times the scale in float32) cast to the dtype; and in the
        table's own dtype also ``embedding(ids) * scale`` computed in that dtype, as a
        model stored so computes it (torch multiplies a half or bfloat16 tensor by a
        Python float in float32, then rounds). Only the checked ids' rows are narrowed
        (rounding commutes with the gather): no second copy of the table.

        The server rounds the float32 rows into each answer dtype to nearest even, as
        numpy's float16 and ml_dtypes' bfloat16 do (tests/server/test_answer_casts.py
        proves the server's casts give these bits)."""
        assert self._taken is not None and self._taken[0] is ids, (
            "This is a bug: answers follows reference, per slice."
        )
        rows, self._taken = self._taken[1], None
        stored = rows.to(torch.float32).to(WEIGHT_DTYPES[weight_dtype].torch_dtype())
        with torch.no_grad():
            reference = stored.to(torch.float32) * self.scale
            for name, dtype in ANSWER_DTYPES.items():
                # A float32 answer past float16's largest rounds to infinity, in torch too.
                with np.errstate(over="ignore"):
                    ours = bits(got.astype(dtype.numpy))
                theirs = [("the stored table's float32 answer", reference.to(dtype.torch_dtype()))]
                if name == weight_dtype:
                    theirs.append((f"embedding(ids) * scale in {name}", stored * self.scale))
                for what, answer in theirs:
                    expected = torch_bits(answer)
                    if not np.array_equal(ours, expected):
                        raise ParityError(
                            f"{name} answers differ from torch's ({what}) in "
                            f"{int(np.count_nonzero(ours != expected))} of {ours.size} values "
                            f"over {ids.size} ids"
                        )


class _Table(CheckpointMatrix):
    """A module's table in memory, read as a checkpoint's matrix is (its slices are views:
    the export only reads them)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.key = TABLE_NAME
        self.shape = (int(table.shape[0]), int(table.shape[1]))
        self.dtype = table.dtype
        self._table = table

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self._table[start:stop]

    def take(self, ids: np.ndarray) -> torch.Tensor:
        return self._table[torch.from_numpy(ids)]


# --- the segment and factorized kinds ----------------------------------------------------


class _ModulePart(Part):
    """A kind whose tables are a torch module's, written whole."""

    weight_dtypes = tuple(dtype.name for dtype in TABLE_DTYPES)

    def __init__(self, module: SegmentEmbedding | FactorizedEmbedding) -> None:
        self.module = module.eval()
        self.vocab_size, self.d_model = module.vocab_size, module.d_model
        self.scale, self.padding_idx = module.scale, module.padding_idx

    def writing(self, weight_dtype: str) -> str:
        return f"writing the graph ({weight_dtype} tables)"


def _stored(what: str, tensor: torch.Tensor, weight_dtype: str) -> np.ndarray:
    """A float32 table as ``weight_dtype`` stores it; refused when float16 cannot hold it."""
    values = tensor.detach().numpy()
    if weight_dtype == FLOAT16.name:
        largest = float(np.max(np.abs(values))) if values.size else 0.0
        limit = float(np.finfo(np.float16).max)
        if largest > limit:
            raise ExportError(
                f"{what}'s largest magnitude {largest:g} does not fit float16 (max "
                f"{limit:g}); export as float32"
            )
    return values.astype(WEIGHT_DTYPES[weight_dtype].numpy, copy=False)


class SegmentPart(_ModulePart):
    """``E[id] * scale + S[t]`` (``modules.SegmentEmbedding``)."""

    kind = SEGMENT
    module: SegmentEmbedding

    def __init__(self, module: SegmentEmbedding) -> None:
        super().__init__(module)
        self.type_vocab_size = module.type_vocab_size

    def write(self, directory: Path, weight_dtype: str) -> int:
        module = self.module
        words = _stored("the embedding table", module.word_embeddings.weight, weight_dtype)
        types = _stored("the segment table", module.token_type_embeddings.weight, weight_dtype)
        return write_segment_graph(
            Table(TABLE_NAME, words), Table("segment.weight", types), self.scale, directory
        )

    def _types(self, shape: tuple[int, ...]) -> np.ndarray:
        """The token type ids checked with ids of ``shape``: by position, so that each
        type is checked with the first T ids of every slice (and the ids, shuffled, meet
        every type)."""
        count = math.prod(shape)
        return (np.arange(count, dtype=np.int64) % self.type_vocab_size).reshape(shape)

    def feeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {INPUT_NAME: ids, TOKEN_TYPE_IDS: self._types(ids.shape)}

    def reference(self, ids: np.ndarray) -> np.ndarray:
        types = self._types(ids.shape)
        with torch.no_grad():
            want: np.ndarray = self.module(torch.from_numpy(ids), torch.from_numpy(types)).numpy()
        return want

    def tolerance(self, weight_dtype: str) -> float:
        if weight_dtype != FLOAT16.name:
            return 0.0
        scale = self.scale
        words = self.module.word_embeddings.weight.detach().double()
        types = self.module.token_type_embeddings.weight.detach().double()
        largest_word, largest_type = float(words.abs().max()), float(types.abs().max())
        # A stored value's rounding, carried through the scale's multiply (one more
        # rounding each side), then the add's rounding on each side.
        word_error = scale * ((_HALF + 3 * _U) * largest_word + 2 * _HALF_TINY)
        type_error = _HALF * largest_type + _HALF_TINY
        largest_sum = scale * largest_word * (1 + _U) + largest_type
        return word_error + type_error + _U * (2 * largest_sum + word_error + type_error)

    def sizes(self) -> dict[str, int]:
        return {"type_vocab_size": self.type_vocab_size}


class FactorizedPart(_ModulePart):
    """``P(E[id] * scale)`` (``modules.FactorizedEmbedding``)."""

    kind = FACTORIZED
    module: FactorizedEmbedding

    def __init__(self, module: FactorizedEmbedding) -> None:
        super().__init__(module)
        self.factor_dim = module.factor_dim

    def write(self, directory: Path, weight_dtype: str) -> int:
        module = self.module
        words = _stored("the embedding table", module.word_embeddings.weight, weight_dtype)
        linear = module.embedding_hidden_mapping_in
        # The graph multiplies rows by P = W^T: [D', D].
        projection = _stored("the projection", linear.weight, weight_dtype).T
        bias = None if linear.bias is None else linear.bias.detach().numpy()
        return write_factorized_graph(
            Table(TABLE_NAME, words),
            Table("projection.weight", projection),
            bias,
            self.scale,
            directory,
        )

    def reference(self, ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            want: np.ndarray = self.module(torch.from_numpy(ids)).numpy()
        return want

    def tolerance(self, weight_dtype: str) -> float:
        half = weight_dtype == FLOAT16.name
        scale = self.scale
        words = self.module.word_embeddings.weight.detach().double()
        linear = self.module.embedding_hidden_mapping_in
        weight = linear.weight.detach().double()
        inner = self.factor_dim
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

    def sizes(self) -> dict[str, int]:
        return {"factor_dim": self.factor_dim}
