# Sourced by scripts/serve and scripts/test (bash): sets up the project's virtual
# environment the first time, and puts it first on PATH.
#
#   tokembed_setup server   tokembed[server]: what `tokembed serve` needs (no torch)
#   tokembed_setup dev      tokembed[dev]: the CPU build of torch, the tests and the tools
#
# Idempotent and quick when done: a stamp in the environment records a hash of what was
# installed from (pyproject.toml, the list of package files, the Python version, the torch
# pin); while it matches, nothing is installed. The stamp cannot see what was installed
# into the environment since (a later `pip install` may downgrade a package under the
# server: protobuf under grpcio-health-checking's generated code), so the server's modules
# are imported too; when they fail, tokembed is installed again, and if they still fail the
# set-up stops with the error and how to start anew. One line per step, on stderr.
#
# Left alone, for people who manage their own environment: an active virtual environment
# other than ours ($VIRTUAL_ENV), or TOKEMBED_NO_SETUP=1. Then the commands run from PATH.
#
#   TOKEMBED_VENV   where ours lives (default: .venv in the checkout)
#   PYTHON          the interpreter that creates it (default: python3; 3.10 or newer)

TOKEMBED_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOKEMBED_VENV_DIR="${TOKEMBED_VENV:-$TOKEMBED_ROOT/.venv}"
# PyPI's torch wheels for Linux are CUDA builds of several GB; this index has the CPU build.
# An extra index, not the only one: where it cannot be reached pip warns (seconds) and goes
# on with PyPI and whatever else pip is configured with.
TOKEMBED_TORCH_PIN="torch==2.13.0"
TOKEMBED_TORCH_INDEX="https://download.pytorch.org/whl/cpu"

_say() { printf '[setup] %s\n' "$*" >&2; }
_fail() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# The stamp's key: what an install depends on. Package files count because the strict
# editable install links each file: a module added by `git pull` needs a reinstall.
_setup_key() {
    (cd "$TOKEMBED_ROOT" && "$1" - "$2" <<'PY'
import hashlib, pathlib, sys
digest = hashlib.sha256(sys.argv[1].encode())
digest.update(sys.version.encode())
digest.update(pathlib.Path("pyproject.toml").read_bytes())
for folder in ("protos", "cli", "export", "server", "client", "bench"):
    for path in sorted(pathlib.Path(folder).rglob("*")):
        if path.suffix in (".py", ".pyi", ".proto", ".typed"):
            digest.update(str(path).encode() + b"\0")
print(digest.hexdigest())
PY
    )
}

_pip() { "$TOKEMBED_VENV_DIR/bin/python" -m pip --disable-pip-version-check "$@"; }

# What `tokembed serve` imports before it serves (the server with its gRPC services,
# onnxruntime, the loader's onnx): prints nothing when they import, else the error's last
# line. Succeeds either way (scripts/serve runs under `set -e -o pipefail`).
_import_error() {
    "$TOKEMBED_VENV_DIR/bin/python" -c \
        'import tokembed.server.app, tokembed.server.backends.sessions, onnx' 2>&1 >/dev/null |
        tail -n 1 || true
}

tokembed_setup() {
    local extra="$1" venv="$TOKEMBED_VENV_DIR" python="${PYTHON:-python3}" started=$SECONDS
    if [ "${TOKEMBED_NO_SETUP:-0}" = 1 ]; then
        _say "TOKEMBED_NO_SETUP=1: no set-up, the commands run from PATH"
        return 0
    fi
    if [ -n "${VIRTUAL_ENV:-}" ] && [ "$(cd "$VIRTUAL_ENV" 2>/dev/null && pwd -P)" != \
        "$(cd "$venv" 2>/dev/null && pwd -P)" ]; then
        _say "using the active virtual environment $VIRTUAL_ENV as it is (no set-up)"
        return 0
    fi
    if [ -x "$venv/bin/python" ]; then
        python="$venv/bin/python"
    else
        command -v "$python" >/dev/null 2>&1 || _fail "$python not found (Python >= 3.10 needed)"
        "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
            _fail "$("$python" -V 2>&1) is too old: tokembed needs Python >= 3.10 (set PYTHON)"
    fi
    # Two first runs at once (serve and test in two shells) must not install into one
    # environment together: the second waits. Released before the command starts.
    if command -v flock >/dev/null 2>&1; then
        exec 9>"$venv.lock"
        flock 9
    fi
    local pin="" key stamp_dev="$venv/.tokembed-setup-dev" stamp="$venv/.tokembed-setup-$extra"
    local name="${venv#"$PWD/"}" ready=0 error
    [ "$extra" = dev ] && pin="$TOKEMBED_TORCH_PIN"
    key="$(_setup_key "$python" "$extra $pin")"
    # A dev set-up holds everything the server needs.
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] ||
        { [ "$extra" = server ] && [ -f "$stamp_dev" ] &&
            [ "$(cat "$stamp_dev")" = "$(_setup_key "$python" "dev $TOKEMBED_TORCH_PIN")" ]; }; then
        error="$(_import_error)"
        if [ -z "$error" ]; then
            ready=1
            _say "$name is set up for tokembed[$extra]"
        else
            _say "$name was set up for tokembed[$extra], but the server no longer imports" \
                "($error): installing it again"
        fi
    fi
    if [ "$ready" = 0 ]; then
        rm -f "$stamp"
        _install "$extra" "$python" "$venv" "$pin"
        error="$(_import_error)"
        [ -z "$error" ] || _fail "the server does not import in $name after installing" \
            "tokembed[$extra] ($error); start anew: rm -rf $name, then run this again"
        printf '%s\n' "$key" >"$stamp"
        _say "$name set up for tokembed[$extra] in $((SECONDS - started)) s"
    fi
    if command -v flock >/dev/null 2>&1; then
        exec 9>&-
    fi
    export VIRTUAL_ENV="$venv"
    export PATH="$venv/bin:$PATH"
}

_install() {
    local extra="$1" python="$2" venv="$3" pin="$4"
    if [ ! -x "$venv/bin/python" ]; then
        _say "creating the virtual environment ${venv#"$PWD/"} ($("$python" -V 2>&1))"
        "$python" -m venv "$venv" ||
            _fail "$python -m venv failed (Debian and Ubuntu: apt-get install python3-venv)"
        # Editable installs with --config-settings need pip >= 22.1 (Python 3.10 ships 21).
        if ! "$venv/bin/python" -c \
            'import sys, pip; sys.exit(int(pip.__version__.split(".")[0]) < 23)'; then
            _say "upgrading pip"
            _pip install --quiet --upgrade pip
        fi
    fi
    if [ -n "$pin" ]; then
        _say "installing $pin, the CPU build (extra index $TOKEMBED_TORCH_INDEX)"
        # torch alone: its dependencies come with the next step from the usual indexes, so
        # an unreachable extra index costs one look-up's retries, not one per package.
        _pip install --quiet --no-deps --extra-index-url "$TOKEMBED_TORCH_INDEX" "$pin"
    fi
    _say "installing tokembed[$extra] from this checkout (editable) and its dependencies"
    # Strict editable mode: a link tree that mypy can follow (see pyproject.toml).
    (cd "$TOKEMBED_ROOT" &&
        _pip install --quiet -e ".[$extra]" --config-settings editable_mode=strict)
}
