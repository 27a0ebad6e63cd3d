"""An encoder's and a decoder's entrance served from one tied table hold it in memory once.

Both are exported from the same checkpoint key under two names: two model directories
whose files are byte for byte the same (their manifests record equal sha256 for every
file, which the server verifies at load). The server computes the table backend's row
tables for the first and shares them with the second; a model whose table differs by a
single value gets its own. Measured on the real server process: its resident memory
serving twins grows by a small fraction of one model's tables over serving one, and by
about a whole model's tables when the second model's table differs (the control: the
measurement can see a second copy).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tokembed.cli.main import main
from tokembed.client import EmbeddingClient

from support.server import ServerProcess, serve_args, wait_for

KEY = "shared.weight"


def _checkpoint(path: Path, table: torch.Tensor) -> Path:
    save_file({KEY: table, "lm_head.bias": torch.zeros(3)}, str(path))
    return path


def _export(weights: Path, out: Path, name: str, *flags: str) -> Path:
    argv = ["export", "--out", str(out), "--weights", str(weights), "--key", KEY]
    assert main([*argv, "--name", name, "--scale", "none", *flags]) == 0
    return out


def _files(model_dir: Path) -> dict[str, object]:
    files: dict[str, object] = json.loads((model_dir / "manifest.json").read_text())["files"]
    return files


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_twins_answer_from_one_table(tmp_path, start_server, caplog, dtype):
    """Functional: both names answer exactly, the load log says the second shares the
    first's tables, and a model that differs in one value is not taken for a twin. A
    bfloat16 model keeps its bfloat16 table alone and runs for its other answers: its
    twins share the table and that session."""
    table = torch.randn(500, 32, generator=torch.Generator().manual_seed(4))
    table = table.to(getattr(torch, dtype)).float()  # the values the table holds
    weights = _checkpoint(tmp_path / "model.safetensors", table)
    encoder = _export(weights, tmp_path / "encoder", "encoder", "--dtype", dtype)
    decoder = _export(weights, tmp_path / "decoder", "decoder", "--dtype", dtype)
    other_table = table.clone()
    other_table[123, 7] += 1.0
    other_weights = _checkpoint(tmp_path / "other.safetensors", other_table)
    other = _export(other_weights, tmp_path / "o", "o", "--dtype", dtype)
    assert _files(encoder) == _files(decoder) != _files(other)

    with caplog.at_level(logging.INFO, logger="tokembed.server.models.loading"):
        server = start_server((encoder, decoder, other))
    shared = [r.getMessage() for r in caplog.records if "row tables are shared" in r.getMessage()]
    assert len(shared) == 1, shared
    assert str(decoder) in shared[0] and f"the same files as {encoder}" in shared[0]

    ids = np.array([[0, 123, 499, 7], [3, 3, 123, 1]], dtype=np.int64)
    with EmbeddingClient(server.target) as client:
        for name in ("encoder", "decoder"):
            np.testing.assert_array_equal(client.embed(ids, model=name), table.numpy()[ids])
            half = client.embed(ids, "float16", model=name)
            np.testing.assert_array_equal(half, table.numpy()[ids].astype(np.float16))
        np.testing.assert_array_equal(client.embed(ids, model="o"), other_table.numpy()[ids])


# Large enough that one model's tables (float32 128 MiB, float16 64 MiB) stand well clear
# of the process's own variation between starts (a few MB).
BIG_V, BIG_D = 16384, 2048
_TABLE_BYTES = re.compile(r"(\w+) table (\d+) bytes")


def _resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


def _serve_and_measure(*model_dirs: Path) -> tuple[int, dict[str, int]]:
    """Start ``tokembed serve`` on the model directories, wait until it serves all of them
    (its "serving models" line comes after the loads and the release of what loading
    freed), and return its resident bytes and the first model's tables, by its load log."""
    args = serve_args(model_dirs[0])
    for directory in model_dirs[1:]:
        args += ["--model-dir", str(directory)]
    server = ServerProcess(args).start(timeout_s=240)
    try:
        assert wait_for(lambda: "serving model" in server.output, timeout_s=240), server.output
        assert server.process is not None
        resident = _resident_bytes(server.process.pid)
        loaded = next(line for line in server.lines if "loaded model" in line)
        tables = {what: int(size) for what, size in _TABLE_BYTES.findall(loaded)}
        with EmbeddingClient(server.target) as client:  # serving, not just up
            assert client.embed(np.array([[1, 2]], dtype=np.int64)).shape == (1, 2, BIG_D)
    finally:
        server.send_signal()
        server.wait(60)
    return resident, tables


@pytest.mark.timeout(600)
def test_twins_hold_their_table_once_in_resident_memory(tmp_path):
    generator = torch.Generator().manual_seed(9)
    table = torch.randn(BIG_V, BIG_D, generator=generator)
    weights = _checkpoint(tmp_path / "model.safetensors", table)
    encoder = _export(weights, tmp_path / "encoder", "encoder")
    decoder = _export(weights, tmp_path / "decoder", "decoder")
    table[0, 0] += 1.0  # one value apart: another model
    other = _export(_checkpoint(tmp_path / "other.safetensors", table), tmp_path / "o", "other")
    del table
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "other.safetensors").unlink()

    one, tables = _serve_and_measure(encoder)
    assert set(tables) >= {"float32", "float16"}, tables
    model_tables = sum(tables.values())
    assert model_tables >= BIG_V * BIG_D * 6  # float32 and float16 rows at least
    twins, _ = _serve_and_measure(encoder, decoder)
    pair, _ = _serve_and_measure(encoder, other)
    figures = (
        f"one model {one / 2**20:.0f} MiB, twins {twins / 2**20:.0f} MiB, "
        f"two different {pair / 2**20:.0f} MiB; one model's tables {model_tables / 2**20:.0f} MiB"
    )
    print(figures)
    assert twins - one < 0.25 * model_tables, figures
    assert pair - one > 0.75 * model_tables, figures
