"""tokembed as users install it: built into a wheel from a copy of the working tree, and
pip-installed into fresh virtual environments. Packages come from pip's index (its cache,
once warm); every step is bounded in time."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Never copied: VCS data, build output (the editable link tree lives in build/),
# virtual environments, caches, exported models and the tests.
_IGNORED_ANYWHERE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", ".*venv*", "venv", "__pycache__", ".*_cache",
    "*.onnx", "*.onnx.data", ".work", ".hypothesis",
)  # fmt: skip
# Only at the top: exported models (models/, as .gitignore says) and the tests; the
# server's own models/ room is a package.
_IGNORED_AT_TOP = {"models", "tests"}


def ignored(directory: str, names: list[str]) -> set[str]:
    """What ``shutil.copytree`` leaves out of a copy of the project."""
    ignored = set(_IGNORED_ANYWHERE(directory, names))
    if Path(directory).resolve() == ROOT:
        ignored |= _IGNORED_AT_TOP & set(names)
    return ignored


# A cold cache downloads onnxruntime, onnx, grpcio and numpy (tens of MB) once.
STEP_TIMEOUT_S = 600


def run(
    *args: object, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
        cwd=cwd, env=env, check=False,
    )  # fmt: skip


def copy_source(destination: Path) -> Path:
    return Path(shutil.copytree(ROOT, destination, ignore=ignored))


def build_wheel(directory: Path) -> Path:
    """tokembed's wheel, built offline from a copy of the working tree."""
    source = copy_source(directory / "src")
    wheels = directory / "wheels"
    proc = run(
        sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--no-index", "--disable-pip-version-check", "-w", wheels, source,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (wheel,) = wheels.glob("tokembed-*.whl")
    return wheel


def new_venv(directory: Path) -> Path:
    """A virtual environment without pip (this environment's pip installs into it);
    returns its bin directory."""
    venv.EnvBuilder(with_pip=False).create(directory)
    return directory / "bin"


def pip_install(bin_dir: Path, *requirements: object) -> None:
    """One ``pip install`` into the environment of ``bin_dir``: one resolution, as one
    command a user types."""
    proc = run(
        sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "--quiet",
        "--disable-pip-version-check", *requirements,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
