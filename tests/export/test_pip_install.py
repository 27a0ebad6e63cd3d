"""A non-editable ``pip install .`` gives a working ``tokembed`` command.

The development install is editable (a link tree), which can hide a package missing from
``[tool.setuptools]`` or package data that never reaches a wheel. This builds the project
from a copy of the working tree into a fresh virtual environment and runs the command
from there. Offline and quick (~3 s): no dependencies are installed; the new
environment borrows this one's site-packages (numpy, onnx, setuptools...) through a
``.pth`` file. A ``.pth`` line only adds a path, and ``.pth`` files inside that path are
not processed, so this environment's editable tokembed stays invisible there.
"""

from __future__ import annotations

import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from support.install import copy_source, run


@pytest.mark.slow
def test_pip_install_non_editable(tmp_path):
    source = copy_source(tmp_path / "src")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(
        run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        .stdout.strip()
    )  # fmt: skip
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "borrowed-from-dev-env.pth").write_text("\n".join(sorted(here)) + "\n")

    # This environment's pip installs into the new one (`--python`).
    proc = run(
        sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
        "--no-deps", "--no-build-isolation", "--no-index", "--disable-pip-version-check",
        source,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr

    # The installed copy is the one imported: not the dev tree, not the copy's sources.
    proc = run(
        python, "-c",
        "import tokembed.export.model_dir as m, tokembed.cli.main as c; "
        "print(m.__file__); print(c.__file__)",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.splitlines():
        assert Path(line).is_relative_to(site), line
    # Typed packages ship their marker; the generated stubs ship their .pyi.
    for marker in ("py.typed", "export/py.typed", "cli/py.typed", "v1/embedding_pb2.pyi"):
        assert (site / "tokembed" / marker).is_file(), marker

    script = env_dir / "bin" / "tokembed"
    proc = run(script, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "export" in proc.stdout
    proc = run(script, "export", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--weights" in proc.stdout
