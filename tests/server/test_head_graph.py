"""The head graph (``head.onnx``) in onnxruntime as the way back's multiply
(``backends/head_session.HeadSession`` under ``backends/head.NearestHead``): on the same
vectors its answers are the numpy head's, ids identical and scores equal bit for bit,
whatever the stored dtype, the metric, the final norm, k, near ties (rows repeated past
what the graph's widened TopK holds, so that rows fall back to whole logits) or the
batch. The loader picks it by ``nearest_head`` (``auto``: where the model runs on CUDA);
a GPU test runs it on the CUDA provider where there is one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from tokembed.export.head import HEAD_NAME, NormArrays, add_head, head_table
from tokembed.export.manifest import Manifest, Norm
from tokembed.server.backends.head import FinalNorm, NearestHead, Query
from tokembed.server.backends.head_session import HeadGraph, HeadSession
from tokembed.server.backends.sessions import CPU, CUDA, SessionOptions
from tokembed.server.core.errors import ServerConfigError
from tokembed.server.models.loading import load_model
from tokembed.server.process.settings import Settings

from support.models import export_model_dir

V, D = 600, 24
HAS_CUDA = CUDA in ort.get_available_providers()


def _model(root: Path, dtype: str, *, norm: str | None = None, ties: bool = False) -> Path:
    directory = export_model_dir(root / f"{dtype}-{norm}-{ties}", vocab_size=V, d_model=D,
                                 seed=8, dtype=dtype, name="m")  # fmt: skip
    output = None
    if ties:
        # An untied output table whose rows 100..199 are one row, 100 times over: its ids
        # score equal, past what the graph's TopK holds for a small k.
        output = np.random.default_rng(2).standard_normal((V, D)).astype(np.float32)
        output[100:200] = output[100]
    arrays = None
    if norm is not None:
        rng = np.random.default_rng(3)
        arrays = NormArrays(
            Norm(norm, 1e-5, "norm.weight", "norm.bias" if norm == "layernorm" else None),
            (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
            (0.1 * rng.standard_normal(D)).astype(np.float32) if norm == "layernorm" else None,
        )
    add_head(directory, output_table=output, output_key="lm_head.weight" if ties else None,
             norm=arrays)  # fmt: skip
    return directory


class _Counted:
    """A head graph run, its calls counted by kind."""

    def __init__(self, graph: HeadSession) -> None:
        self._graph = graph
        self.provider = graph.provider
        self.calls = {"logits": 0, "top": 0}

    def logits(self, h: np.ndarray) -> np.ndarray:
        self.calls["logits"] += 1
        return self._graph.logits(h)

    def top(self, h: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        self.calls["top"] += 1
        return self._graph.top(h, k)


def _heads(directory: Path, device: str = "cpu") -> tuple[NearestHead, NearestHead, _Counted]:
    manifest = Manifest.read(directory)
    table = head_table(directory, manifest)
    from tokembed.export.head import norm_arrays

    arrays = norm_arrays(directory, manifest)
    norm = None
    if arrays is not None:
        norm = FinalNorm(arrays.record.kind, arrays.record.eps, arrays.weight, arrays.bias)
    session = HeadSession(HeadGraph(directory / HEAD_NAME), table, SessionOptions(device=device))
    counted = _Counted(session)
    role = "embedding" if manifest.head is None else manifest.head.table
    return (
        NearestHead(table, norm, role, shared=False),
        NearestHead(table, norm, role, shared=False, graph=counted),
        counted,
    )


def _queries(rng: np.random.Generator, *, norm: bool, metric: str, logits: bool) -> list[Query]:
    return [
        Query(rng.standard_normal((rows, D)).astype(np.float32), k, metric, logits, norm)
        for rows, k in ((1, 1), (7, 5), (16, 8), (3, 40), (2, V))
    ]


def _assert_same(numpy_found: list[Any], graph_found: list[Any]) -> None:
    for want, got in zip(numpy_found, graph_found, strict=True):
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.scores, want.scores)  # bit for bit
        assert (got.logits is None) == (want.logits is None)
        if want.logits is not None:  # two float32 multiplies: within the error bound
            np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("metric", ["dot", "cosine"])
@pytest.mark.parametrize("logits", [False, True])
def test_the_graph_answers_as_numpy(tmp_path: Path, dtype: str, metric: str, logits: bool) -> None:
    numpy_head, graph_head, counted = _heads(_model(tmp_path, dtype))
    queries = _queries(np.random.default_rng(5), norm=False, metric=metric, logits=logits)
    _assert_same(numpy_head.search(queries), graph_head.search(queries))
    # dot without logits takes the graph's widened top-k; the rest its whole logits.
    if metric == "dot" and not logits:
        assert counted.calls == {"logits": 0, "top": 1}
    else:
        assert counted.calls == {"logits": 1, "top": 0}
    assert graph_head.runs_on == CPU and numpy_head.runs_on == "numpy"


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_the_norm_is_the_heads_not_the_graphs(tmp_path: Path, norm: str) -> None:
    numpy_head, graph_head, _ = _heads(_model(tmp_path, "float32", norm=norm))
    rng = np.random.default_rng(6)
    for metric in ("dot", "cosine"):
        normed = _queries(rng, norm=True, metric=metric, logits=False)
        plain = _queries(rng, norm=False, metric=metric, logits=False)
        queries = [q for pair in zip(normed, plain, strict=True) for q in pair]
        _assert_same(numpy_head.search(queries), graph_head.search(queries))


def test_near_ties_past_the_widened_top_k_fall_back_to_whole_logits(tmp_path: Path) -> None:
    numpy_head, graph_head, counted = _heads(_model(tmp_path, "float32", ties=True))
    table = np.asarray(numpy_head.table, dtype=np.float32)
    # Vectors along the repeated row: its 100 ids lead, equal, and k = 3 asks for 38.
    vectors = table[100] + 0.01 * np.random.default_rng(7).standard_normal((5, D))
    query = Query(vectors.astype(np.float32), 3, "dot", False, False)
    want, got = numpy_head.search([query]), graph_head.search([query])
    _assert_same(want, got)
    np.testing.assert_array_equal(got[0].ids, np.tile([100, 101, 102], (5, 1)))  # lower ids
    assert counted.calls == {"logits": 5, "top": 1}  # every row fell back


def test_the_loader_picks_the_graph_by_nearest_head(tmp_path: Path) -> None:
    directory = _model(tmp_path, "bfloat16")
    runs = {}
    for choice in ("auto", "numpy", "onnxruntime"):
        loaded = load_model(directory, Settings(model_dir=directory, nearest_head=choice))
        assert loaded.backend.head is not None
        runs[choice] = loaded.backend.head.runs_on
    # auto: numpy on the CPU (no copy of the table: docs/benchmarks/README.md#nearest).
    assert runs == {"auto": "numpy", "numpy": "numpy", "onnxruntime": CPU}


def test_a_head_graph_without_its_multiply_is_refused(tmp_path: Path) -> None:
    import onnx

    directory = _model(tmp_path, "float32")
    path = directory / HEAD_NAME
    model = onnx.load(str(path), load_external_data=False)
    next(node for node in model.graph.node if node.op_type == "Gemm").name = "renamed"
    onnx.save(model, str(path))
    table = head_table(directory, Manifest.read(directory))
    with pytest.raises(ServerConfigError, match="no Gemm named 'head'; export the head again"):
        HeadSession(HeadGraph(path), table, SessionOptions())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_provider_runs_the_head_exactly(tmp_path: Path, dtype: str) -> None:
    if not HAS_CUDA:
        pytest.skip(
            f"needs onnxruntime-gpu and a GPU: onnxruntime {ort.__version__} offers "
            f"{ort.get_available_providers()}"
        )
    numpy_head, graph_head, counted = _heads(_model(tmp_path, dtype), device="cuda")
    assert graph_head.runs_on == CUDA
    rng = np.random.default_rng(9)
    for metric in ("dot", "cosine"):
        for logits in (False, True):
            queries = _queries(rng, norm=False, metric=metric, logits=logits)
            _assert_same(numpy_head.search(queries), graph_head.search(queries))
    assert counted.calls["top"] > 0 and counted.calls["logits"] > 0
    # And the loader picks it on CUDA by default.
    directory = _model(tmp_path / "loaded", dtype)
    loaded = load_model(directory, Settings(model_dir=directory, device="cuda"))
    assert loaded.backend.head is not None and loaded.backend.head.runs_on == CUDA


def test_a_head_graph_asked_for_on_cuda_without_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An onnxruntime without the CUDA provider, as on this machine, whatever the machine.
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CPU])
    directory = _model(tmp_path, "float32")
    table = head_table(directory, Manifest.read(directory))
    with pytest.raises(ServerConfigError, match="CUDA execution provider not available"):
        HeadSession(HeadGraph(directory / HEAD_NAME), table, SessionOptions(device="cuda"))
    # auto: the CPU's, as the model's own sessions fall back.
    graph = HeadSession(HeadGraph(directory / HEAD_NAME), table, SessionOptions(device="auto"))
    assert graph.provider == CPU
