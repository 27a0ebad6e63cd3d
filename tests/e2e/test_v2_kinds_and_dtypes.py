"""The model kinds and bfloat16 through the Open Inference Protocol, with tritonclient: a
segment model's metadata and configuration describe its second input, its answers carry
the token types (absent: 0); a BF16 answer is torch's bfloat16 of the float32 answer,
bit for bit. Built beside each other (issues 25 and 26), so checked here together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as tc

from tokembed.cli.main import main

V, D, T, PAD = 500, 16, 3, 1


def _tables(model_dir: Path) -> dict[str, np.ndarray]:
    """The graph's tables by name, read from the model's own files."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_dir / "model.onnx"))
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


@pytest.fixture(scope="module")
def segment_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v2-segment") / "bert"
    assert main(["export", "--out", str(out), "--vocab-size", str(V), "--d-model", str(D),
                 "--padding-idx", str(PAD), "--scale", "sqrt", "--kind", "segment",
                 "--type-vocab-size", str(T)]) == 0  # fmt: skip
    return out


def _input(name: str, values: np.ndarray) -> tc.InferInput:
    tensor = tc.InferInput(name, list(values.shape), "INT64")
    tensor.set_data_from_numpy(values.astype(np.int64))
    return tensor


@pytest.mark.parametrize("backend", [{}, {"float32_table_max_bytes": 0}], ids=["table", "ort"])
def test_a_segment_model_through_v2(segment_dir: Path, start_server: Any, backend: Any) -> None:
    server = start_server(segment_dir, **backend)
    tables = _tables(segment_dir)
    words, kinds, scale = tables["embedding.weight"], tables["segment.weight"], tables["scale"]
    rng = np.random.default_rng(3)
    ids, types = rng.integers(0, V, (2, 5)), rng.integers(0, T, (2, 5))
    with tc.InferenceServerClient(server.target) as client:
        metadata = client.get_model_metadata("bert", as_json=True)
        assert [i["name"] for i in metadata["inputs"]] == ["input_ids", "token_type_ids"]
        config = client.get_model_config("bert").config
        assert [(i.name, i.optional) for i in config.input] == [
            ("input_ids", False),
            ("token_type_ids", True),
        ]
        typed = client.infer("bert", [_input("input_ids", ids), _input("token_type_ids", types)])
        untyped = client.infer("bert", [_input("input_ids", ids)])
        bad = _input("token_type_ids", np.full_like(types, T))
        with pytest.raises(tc.InferenceServerException, match=rf"outside its range \[0, {T}\)"):
            client.infer("bert", [_input("input_ids", ids), bad])
    np.testing.assert_array_equal(
        typed.as_numpy("hidden_states"), words[ids] * scale + kinds[types]
    )
    np.testing.assert_array_equal(untyped.as_numpy("hidden_states"), words[ids] * scale + kinds[0])


def test_bf16_answers_through_v2_are_torch_s(
    small_model_dir: Path, start_server: Any, small_rows: np.ndarray
) -> None:
    server = start_server(small_model_dir)
    ids = np.arange(40, dtype=np.int64).reshape(2, 20)
    with tc.InferenceServerClient(server.target) as client:
        answer = client.infer("small", [_input("input_ids", ids)], parameters={"datatype": "BF16"})
    output = answer.get_output("hidden_states")
    assert output.datatype == "BF16"
    raw = answer.get_response().raw_output_contents[0]
    got = np.frombuffer(raw, dtype=ml_dtypes.bfloat16).reshape(2, 20, -1)
    want = torch.from_numpy(small_rows[ids]).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(got.view(np.int16), want)
