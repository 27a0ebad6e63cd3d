"""The head's int8 first pass (``Int8Table``): candidates found in an int8 copy of the
table within a proven bound, which ``head.NearestHead`` rescores exactly."""

from __future__ import annotations

import numpy as np

from tokembed.server.backends.head_blocks import ROW_SLICE_BYTES, Blocks

# The int8 codes' range: symmetric, so that a code's negation is a code.
_CODE = 127
# q_h . q_v sums D products of at most 127**2 in int32.
MAX_INT8_WIDTH = (2**31 - 1) // _CODE**2


class Int8Table:
    """The int8 first pass: an int8 copy of ``W`` (a quarter of a float32 table's bytes)
    multiplied by onnxruntime's ``MatMulInteger`` (int32 accumulation, exact), with a
    proven bound on each score's error, so that ``NearestHead._bounded_top_k`` rescoring
    the candidates gives exactly the float32 pass's answer.

    Each row ``w_v`` is quantized at load with its own scale: ``s_v = max|w_v| / 127``,
    ``q_v = rint(w_v / s_v)`` in ``[-127, 127]``; its error ``d_v = w_v - s_v q_v`` (each
    component at most ``s_v / 2``) is kept as its norm ``|d_v|``. A query ``h`` is
    quantized in two int8 rows, ``h = s_1 q_1 + s_2 q_2 + d_h`` (``q_2`` the codes of the
    first rounding's remainder, so ``|d_h|`` is about 127 times smaller than one row's
    error), both multiplied in the same ``MatMulInteger`` call, which reads the codes
    once. ``q . q_v`` is exact in int32 (``D 127**2`` fits while D <= ``MAX_INT8_WIDTH``),
    and the approximate score ``a_v = s_v (s_1 (q_1 . q_v) + s_2 (q_2 . q_v))`` is
    ``(h - d_h) . (w_v - d_v)``, so

        h . w_v - a_v = h . d_v + d_h . w_v - d_h . d_v,
        |h . w_v - a_v| <= |h| |d_v| + |d_h| |w_v| + |d_h| |d_v|   (Cauchy-Schwarz).

    The brief's first-order bound, ``|h|_1 s_v / 2``, bounds the first term too; the
    Euclidean one is smaller (``|d_v| <= sqrt(D) s_v / 2``, and is about a third of
    ``|h|_1 s_v / 2`` for a row of rounding errors spread evenly), which decides how many
    candidates are rescored. ``a_v`` is computed in float64 (a few roundings of ``2**-53``
    of its terms: ``2**-50`` of them is added to the bound), the norms in float64 from
    float32 values (their roundings covered by a factor ``1 + 2**-40``).

    The codes ``[D, V]`` (``MatMulInteger``'s B) are handed to onnxruntime as an
    external initializer, not copied into the graph; onnxruntime may pack a copy of its
    own for its kernel.
    """

    def __init__(self, blocks: Blocks, row_norms: np.ndarray, threads: int) -> None:
        import onnxruntime as ort
        from onnx import TensorProto, helper

        table = blocks.table
        vocab, width = table.shape
        if width > MAX_INT8_WIDTH:
            raise ValueError(f"the int8 first pass takes D up to {MAX_INT8_WIDTH}, got {width}")
        codes = np.empty((width, vocab), dtype=np.int8)
        self.scales = np.empty(vocab, dtype=np.float64)
        self.errors = np.empty(vocab, dtype=np.float64)  # |d_v|
        self.norms = row_norms  # |w_v|
        step = max(1, ROW_SLICE_BYTES // (8 * max(1, width)))
        for start in range(0, vocab, step):
            rows = blocks.rows64(np.arange(start, min(start + step, vocab)))
            stop = start + len(rows)
            q, self.scales[start:stop], remainder = _quantized(rows)
            codes[:, start:stop] = q.T
            self.errors[start:stop] = _norms(remainder)
        self.codes = codes
        self.nbytes = int(codes.nbytes)
        placeholder = TensorProto(name="codes", data_type=TensorProto.INT8, dims=[width, vocab])
        placeholder.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "codes"), ("offset", "0"), ("length", str(codes.size))):
            entry = placeholder.external_data.add()
            entry.key, entry.value = key, value
        graph = helper.make_graph(
            [helper.make_node("MatMulInteger", ["h", "codes", "zero"], ["products"])],
            "tokembed-int8-first-pass",
            [helper.make_tensor_value_info("h", TensorProto.UINT8, ["n", width])],
            [helper.make_tensor_value_info("products", TensorProto.INT32, ["n", vocab])],
            initializer=[helper.make_tensor("zero", TensorProto.UINT8, [], [128]), placeholder],
        )
        opsets = [helper.make_opsetid("", 17)]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = helper.find_min_ir_version_for(opsets)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # onnxruntime reads the codes from this array (kept alive by ``self.codes``).
        options.add_external_initializers(["codes"], [ort.OrtValue.ortvalue_from_numpy(codes)])
        self._session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )

    def first_pass(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``h [n, D]`` float32: the approximate scores ``[n, V]`` float64 and their
        bounds (the class's docstring)."""
        h64 = h.astype(np.float64)
        first, first_scale, remainder = _quantized(h64)
        second, second_scale, left = _quantized(remainder)
        n = len(h)
        # uint8 with zero point 128: MatMulInteger's fast kernel is u8 x s8.
        shifted = (np.concatenate([first, second]).astype(np.int16) + 128).astype(np.uint8)
        products = self._session.run(["products"], {"h": shifted})[0]
        high = products[:n] * first_scale[:, None]
        low = products[n:] * second_scale[:, None]
        approx = (high + low) * self.scales
        h_norms = _norms(h64)
        d_h = _norms(left)
        bounds = (
            np.multiply.outer(h_norms, self.errors)
            + np.multiply.outer(d_h, self.norms + self.errors)
        ) * (1 + 2.0**-40) + (np.abs(high) + np.abs(low)) * self.scales * 2.0**-50
        return approx, bounds


def _quantized(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 rows ``[n, D]``: their int8 codes, scales, and what the codes leave,
    ``rows - scale * codes`` (in float64: each component within ``2**-52`` of the row's
    largest of the exact value, which ``_norms``' margin covers). A row of zeros: scale 0,
    codes 0, nothing left."""
    largest = np.abs(rows).max(axis=1) if rows.shape[1] else np.zeros(len(rows))
    scales = largest / _CODE
    safe = np.where(scales > 0, scales, 1.0)
    q = np.clip(np.rint(rows / safe[:, None]), -_CODE, _CODE)
    return q.astype(np.int8), scales, rows - q * scales[:, None]


def _norms(rows: np.ndarray) -> np.ndarray:
    """Each row's Euclidean norm in float64, with ``2**-40`` of its largest component on
    top (the roundings of the remainder it measures and of the norm itself)."""
    largest = np.abs(rows).max(axis=1) if rows.shape[1] else np.zeros(len(rows))
    norms = np.sqrt(np.einsum("nd,nd->n", rows, rows))
    return np.asarray(norms * (1 + 2.0**-40) + 2.0**-40 * largest, dtype=np.float64)
