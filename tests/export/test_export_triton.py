"""``tokembed export-triton``: a Triton model repository entry for a model directory.

Validated as far as this environment allows: config.pbtxt is parsed by Triton's own
``ModelConfig`` message (``tritonclient.grpc.model_config_pb2``, which tritonclient ships),
and the copied model answers through onnxruntime exactly as the model directory does and
as the model's table says. Triton Inference Server itself cannot be started here (no
image, no network to fetch one): loading the repository into Triton is the one step these
tests do not take.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tokembed.cli.main import main

V, D = 1000, 64  # the small model (support.fixtures)


def export_triton(capsys: pytest.CaptureFixture[str], *args: object) -> str:
    code = main(["export-triton", *(str(a) for a in args)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def parse_config(path: Path) -> mc.ModelConfig:
    config = mc.ModelConfig()
    text_format.Parse(path.read_text(), config)  # unknown fields or bad values raise
    return config


def answer(model_file: Path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    out: np.ndarray = session.run(None, {"input_ids": ids})[0]
    return out


def test_the_repository_parses_as_triton_s_model_config_and_answers_exactly(
    capsys: pytest.CaptureFixture[str],
    small_model_dir: Path,
    small_rows: np.ndarray,
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    printed = export_triton(capsys, small_model_dir, repo)
    entry = repo / "small"
    assert str(entry / "config.pbtxt") in printed
    # Every file of the model, external data included, in the version directory.
    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    assert sorted(p.name for p in (entry / "1").iterdir()) == sorted(manifest["files"])
    assert "model.onnx.data" in manifest["files"]
    for name in manifest["files"]:
        assert (entry / "1" / name).read_bytes() == (small_model_dir / name).read_bytes()

    config = parse_config(entry / "config.pbtxt")
    assert config.name == "small"
    assert config.backend == "onnxruntime"
    assert config.max_batch_size == 64
    (ids_input,) = config.input
    assert (ids_input.name, ids_input.data_type, list(ids_input.dims)) == (
        "input_ids", mc.TYPE_INT64, [-1],
    )  # fmt: skip
    (output,) = config.output
    assert (output.name, output.data_type, list(output.dims)) == (
        "hidden_states", mc.TYPE_FP32, [-1, D],
    )  # fmt: skip
    (group,) = config.instance_group
    assert (group.kind, group.count) == (mc.ModelInstanceGroup.KIND_CPU, 1)
    assert config.HasField("dynamic_batching")
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert list(config.version_policy.specific.versions) == [1]
    assert config.parameters["intra_op_thread_count"].string_value == "1"

    # The copy answers exactly as the model directory, and as the table says, at the
    # edges of the vocabulary too; [B, S] in, [B, S, D] out as the config declares.
    ids = np.array([[0, 1, V - 1, 17], [5, 999, 3, 0]], dtype=np.int64)
    copied = answer(entry / "1" / "model.onnx", ids)
    assert copied.shape == (2, 4, D) and copied.dtype == np.float32
    np.testing.assert_array_equal(copied, answer(small_model_dir / "model.onnx", ids))
    np.testing.assert_array_equal(copied, small_rows[ids])


def test_gpu_instances_batching_and_version_flags(
    capsys: pytest.CaptureFixture[str], small_model_dir: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    export_triton(
        capsys, small_model_dir, repo, "--instance-kind", "gpu", "--instances", 2,
        "--max-batch-size", 8, "--max-queue-delay-us", 500, "--version", 7, "--name", "emb",
        "--intra-op-threads", 0,
    )  # fmt: skip
    config = parse_config(repo / "emb" / "config.pbtxt")
    assert config.name == "emb"
    (group,) = config.instance_group
    assert (group.kind, group.count) == (mc.ModelInstanceGroup.KIND_GPU, 2)
    assert config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert list(config.version_policy.specific.versions) == [7]
    assert (repo / "emb" / "7" / "model.onnx").is_file()
    assert "intra_op_thread_count" not in config.parameters


def test_a_repository_holds_several_models_and_replaces_one_only_when_forced(
    capsys: pytest.CaptureFixture[str], small_model_dir: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    export_triton(capsys, small_model_dir, repo)
    export_triton(capsys, small_model_dir, repo, "--name", "second")
    assert sorted(p.name for p in repo.iterdir()) == ["second", "small"]
    code = main(["export-triton", str(small_model_dir), str(repo)])
    assert code == 2
    assert "exists; pass --force" in capsys.readouterr().err
    export_triton(capsys, small_model_dir, repo, "--force", "--max-batch-size", 4)
    assert parse_config(repo / "small" / "config.pbtxt").max_batch_size == 4
    # Nothing staged is left behind.
    assert sorted(p.name for p in repo.iterdir()) == ["second", "small"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--instances", "0"], "--instances must be at least 1"),
        (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
        (["--max-queue-delay-us", "-1"], "--max-queue-delay-us must be at least 0"),
        (["--version", "0"], "--version must be a positive integer"),
        (["--name", "a/b"], "cannot name a directory"),
    ],
)
def test_bad_flags_are_one_line_and_write_nothing(
    capsys: pytest.CaptureFixture[str],
    small_model_dir: Path,
    tmp_path: Path,
    flags: list[str],
    message: str,
) -> None:
    repo = tmp_path / "repo"
    assert main(["export-triton", str(small_model_dir), str(repo), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not repo.exists() or not any(repo.iterdir())


def test_a_damaged_model_directory_is_refused_before_anything_is_written(
    capsys: pytest.CaptureFixture[str], small_model_dir: Path, tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(small_model_dir, damaged)
    data = damaged / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    repo = tmp_path / "repo"
    assert main(["export-triton", str(damaged), str(repo)]) == 2
    assert "sha256" in capsys.readouterr().err
    assert not repo.exists() or not any(repo.iterdir())


def test_a_version_triton_cannot_use_needs_the_flag(
    capsys: pytest.CaptureFixture[str], small_model_dir: Path, tmp_path: Path
) -> None:
    renamed = tmp_path / "model"
    shutil.copytree(small_model_dir, renamed)
    manifest = json.loads((renamed / "manifest.json").read_text())
    manifest["version"] = "2026-12-01"
    (renamed / "manifest.json").write_text(json.dumps(manifest))
    repo = tmp_path / "repo"
    assert main(["export-triton", str(renamed), str(repo)]) == 2
    assert "is not a positive integer" in capsys.readouterr().err
    export_triton(capsys, renamed, repo, "--version", 3)
    assert (repo / "small" / "3" / "model.onnx").is_file()
