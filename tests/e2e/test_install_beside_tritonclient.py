"""``pip install tokembed[server]`` and ``pip install tritonclient[grpc]`` in one
environment, in either order or in one command, give a server that starts and answers,
with tritonclient working beside it; and tokembed alone (the client) says which extra each
command that needs one lacks.

pip resolves only what a command asks for: installing tritonclient (protobuf below 7) after
a server whose grpcio-health-checking was generated for protobuf 7 downgraded protobuf under
it, and the server no longer started (pyproject.toml caps the two packages for this).
Each environment is new and installed by pip as a user would, from pip's index and
tokembed's wheel; the server first is installed the way the issue found it, by
``scripts/serve``'s own set-up (an editable install of a copy of the checkout), which is
checked on the same breakage too: it notices it, installs again, and stops with one line
when that is not enough. Each server is checked with its environment's own ``tokembed
health`` and with tritonclient's V2 ``ModelInfer``, against the model's rows.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.extras import CASES, arguments, assert_names_the_extra
from support.install import build_wheel, copy_source, new_venv, pip_install, run
from support.server import ServerProcess, serve_args

TRITONCLIENT = "tritonclient[grpc]"

V2_ROUND_TRIP = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tritonclient.grpc as tc

    target, expected_path = sys.argv[1:]
    ids = np.array([[1, 2, 3], [997, 998, 999]], dtype=np.int64)
    tensor = tc.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    client = tc.InferenceServerClient(target)
    got = client.infer("small", [tensor]).as_numpy("hidden_states")
    np.testing.assert_array_equal(got, np.load(expected_path))
    print("tritonclient round trip ok")
    """
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def assert_serves_beside_tritonclient(
    bin_dir: Path, tmp_path: Path, model_dir: Path, rows: Any
) -> None:
    """The environment's own ``tokembed serve`` starts and reports SERVING to its own
    ``tokembed health``; its tritonclient gets the model's rows over V2."""
    server = ServerProcess(serve_args(model_dir), tokembed=[str(bin_dir / "tokembed")])
    try:
        server.start(timeout_s=120)
        proc = run(bin_dir / "tokembed", "health", "--target", server.target, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        expected = tmp_path / "expected.npy"
        np.save(expected, rows[np.array([[1, 2, 3], [997, 998, 999]])])
        script = tmp_path / "v2_round_trip.py"
        script.write_text(V2_ROUND_TRIP)
        proc = run(bin_dir / "python", script, server.target, expected, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "tritonclient round trip ok" in proc.stdout
    finally:
        server.kill()
    assert "Traceback" not in server.output, server.output


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_base_install_names_the_extra_each_command_needs(
    wheel: Path, tmp_path: Path, small_model_dir: Path
) -> None:
    bin_dir = new_venv(tmp_path / "venv")
    pip_install(bin_dir, wheel)
    for command in CASES:
        args = arguments(command, small_model_dir, tmp_path)
        assert_names_the_extra(run(bin_dir / "tokembed", *args, cwd=tmp_path), command)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("order", ["tritonclient-then-server", "one-command"])
def test_server_beside_tritonclient(
    order: str, wheel: Path, tmp_path: Path, small_model_dir: Path, small_rows: Any
) -> None:
    bin_dir = new_venv(tmp_path / "venv")
    if order == "one-command":
        pip_install(bin_dir, f"{wheel}[server]", TRITONCLIENT)
    else:
        pip_install(bin_dir, TRITONCLIENT)
        pip_install(bin_dir, f"{wheel}[server]")
    assert_serves_beside_tritonclient(bin_dir, tmp_path, small_model_dir, small_rows)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_serve_set_up_then_tritonclient_serves_and_a_broken_server_is_noticed(
    tmp_path: Path, small_model_dir: Path, small_rows: Any
) -> None:
    """The issue's path: scripts/serve sets up its environment (tokembed[server]), then
    tritonclient is installed into it; it still serves. Broken anyway (the packages the
    issue found, put back by hand), the set-up notices, installs again, and stops with one
    line when that is not enough."""
    source = copy_source(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "TOKEMBED_NO_SETUP")}
    venv_dir = tmp_path / "venv"
    env["TOKEMBED_VENV"] = str(venv_dir)
    python = venv_dir / "bin" / "python"

    def serve_help() -> list[str]:
        proc = run(source / "scripts" / "serve", "--help", cwd=source, env=env)
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert "usage: tokembed serve" in proc.stdout
        return [line for line in proc.stderr.splitlines() if line.startswith("[setup]")]

    assert serve_help()[-1].startswith(f"[setup] {venv_dir} set up for tokembed[server] in ")
    # What a user does next, as the issue found: tritonclient into the server's environment.
    pip_install(venv_dir / "bin", TRITONCLIENT)
    assert serve_help() == [f"[setup] {venv_dir} is set up for tokembed[server]"]
    assert_serves_beside_tritonclient(venv_dir / "bin", tmp_path, small_model_dir, small_rows)

    # The breakage itself: grpcio-health-checking generated for protobuf 7, on protobuf 6.
    pip_install(venv_dir / "bin", "--no-deps", "grpcio-health-checking==1.85.1")
    broken = run(python, "-c", "import tokembed.server.app", cwd=tmp_path)
    assert "VersionError" in broken.stderr, broken.stderr
    lines = serve_help()
    assert lines[0].startswith(
        f"[setup] {venv_dir} was set up for tokembed[server], but the server no longer "
        "imports (google.protobuf.runtime_version.VersionError: "
    ), lines
    assert lines[0].endswith("): installing it again"), lines
    assert lines[-1].startswith(f"[setup] {venv_dir} set up for tokembed[server] in "), lines
    repaired = run(python, "-c", "import tokembed.server.app, tritonclient.grpc", cwd=tmp_path)
    assert repaired.returncode == 0, repaired.stderr

    # Damage a new install does not repair: one line, naming the way to start anew.
    (health,) = (venv_dir / "lib").glob("python3*/site-packages/grpc_health/v1/health.py")
    health.write_text("raise ImportError('damaged by the test')\n")
    proc = run(source / "scripts" / "serve", "--help", cwd=source, env=env)
    assert proc.returncode == 1
    assert "usage:" not in proc.stdout
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"[setup] error: the server does not import in {venv_dir} after installing "
        f"tokembed[server] (ImportError: damaged by the test); start anew: rm -rf {venv_dir}, "
        "then run this again"
    )
