"""The console samples of the README and docs/client.md are what the commands print.

Every ```console block of those pages is read as a session: a line ``$ tokembed ...`` is a
command (a ``# comment`` after it is dropped), the lines up to the next ``$`` its output
(trailing blank lines dropped). Each ``tokembed`` command runs, through the real
dispatcher, against a real server on a free loopback port serving the models the block
names: an HTML comment ``<!-- served: enc dec -->`` on the line before the fence (the
first name is the default model), else the built-in default model alone, as
``tokembed serve`` serves it. Other commands (``. .venv/bin/activate``) are not run.

A sample's output must be the command's, line for line, but for what legitimately varies:

- the address: the pages show ``127.0.0.1:50051``; the commands reach the test's server
  (``$TOKEMBED_TARGET`` for those without ``--target``), whose address is written back
  as ``127.0.0.1:50051`` in what they print;
- timings: the numbers of the ``server: queue ... ms`` line;
- a line ``...`` alone in a sample stands for any number of lines the page leaves out.

A command shown without output must succeed (exit status 0); one whose sample is an
``error:`` line must fail with status 2, as the page says.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tokembed.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/client.md")
SHOWN_TARGET = "127.0.0.1:50051"
_SERVED = re.compile(r"<!-- served: ([\w.\- ]+) -->\n\Z")  # on the line before the fence
_BLOCK = re.compile(r"```console\n(.*?)```", re.DOTALL)
_TIMING = re.compile(r"\d+\.\d+ ms")


@dataclass(frozen=True)
class Sample:
    page: str
    line: int  # of the command, 1-based
    command: str
    output: tuple[str, ...]
    served: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def samples(page: str) -> list[Sample]:
    text = (ROOT / page).read_text(encoding="utf-8")
    found = []
    for block in _BLOCK.finditer(text):
        marker = _SERVED.search(text, 0, block.start())
        served = tuple(marker.group(1).split()) if marker else ("tokembed-default",)
        first_line = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("$ "):
                continue
            output: list[str] = []
            for following in lines[i + 1 :]:
                if following.startswith("$ "):
                    break
                output.append(following)
            while output and not output[-1].strip():
                output.pop()
            found.append(Sample(page, first_line + i, line[2:], tuple(output), served))
    return found


ALL = [sample for page in PAGES for sample in samples(page)]
RUN = [sample for sample in ALL if sample.command.startswith("tokembed ")]


def test_the_pages_have_samples_to_check() -> None:
    """The reader above finds the blocks (a page reformatted out of its reach fails here)."""
    for page in PAGES:
        assert any(sample.page == page for sample in RUN), f"no tokembed sample in {page}"
    assert {"embed", "info", "models", "health"} <= {s.command.split()[1] for s in RUN}
    assert any(len(sample.served) > 1 for sample in RUN), "no sample of several models"


# --- the models the samples name, built once


def _export(out: Path, *args: str) -> Path:
    assert main(["export", "--out", str(out), *args]) == 0
    return out


_BUILDERS: dict[str, Callable[[Path], Path]] = {
    # The built-in model, under the names the pages give it.
    "enc": lambda out: _builtin(out, "enc"),
    # A decoder's table stored in float16, and a BERT's (a segment model).
    "dec": lambda out: _export(out, "--name", "dec", "--vocab-size", "32000",
                               "--d-model", "256", "--dtype", "float16"),
    "bert": lambda out: _export(out, "--name", "bert", "--kind", "segment",
                                "--vocab-size", "30522", "--d-model", "32",
                                "--type-vocab-size", "2", "--padding-idx", "0"),
}  # fmt: skip


def _builtin(out: Path, name: str) -> Path:
    from tokembed.export.builtin import BuiltinSpec, build_builtin_model

    assert build_builtin_model(out, BuiltinSpec(name=name))
    return out


@pytest.fixture(scope="module")
def model_dirs(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[Callable[[str], Path]]:
    built: dict[str, Path] = {"tokembed-default": default_model_dir}

    def model_dir(name: str) -> Path:
        if name not in built:
            assert name in _BUILDERS, f"a page serves {name!r}, which this test cannot build"
            built[name] = _BUILDERS[name](tmp_path_factory.mktemp("docs-models") / name)
        return built[name]

    yield model_dir


# --- running a command


def _normalised(lines: list[str] | tuple[str, ...]) -> list[str]:
    return [
        _TIMING.sub("N ms", line) if line.startswith("server: queue ") else line.rstrip()
        for line in lines
    ]


def _matches(shown: tuple[str, ...], printed: list[str]) -> bool:
    """Whether ``printed`` is ``shown``, a line ``...`` of ``shown`` standing for any lines."""
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if line == "..." else re.escape(line) + "\n"
        for line in _normalised(shown)
    )
    return re.fullmatch(pattern, "".join(line + "\n" for line in _normalised(printed))) is not None


def _run(command: str, target: str) -> tuple[int, list[str]]:
    argv = shlex.split(command, comments=True)[1:]
    argv = [target if arg == SHOWN_TARGET else arg for arg in argv]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    printed = out.getvalue().replace(target, SHOWN_TARGET).splitlines()
    while printed and not printed[-1].strip():
        printed.pop()
    return code, printed


@pytest.fixture(scope="module")
def servers(model_dirs: Callable[[str], Path]) -> Iterator[Callable[[tuple[str, ...]], Any]]:
    """One server per set of models the pages name, started on first use."""
    from tokembed.server.process.settings import Settings

    from support.server import ServerThread

    started: dict[tuple[str, ...], ServerThread] = {}

    def server(served: tuple[str, ...]) -> ServerThread:
        if served not in started:
            directories = tuple(model_dirs(name) for name in served)
            settings = Settings(model_dir=directories, port=0, metrics_port=0).validate()
            started[served] = ServerThread(settings).start()
        return started[served]

    yield server
    for running in started.values():
        running.stop()


@pytest.mark.parametrize("sample", RUN, ids=[sample.id for sample in RUN])
def test_the_sample_is_what_the_command_prints(
    sample: Sample, servers: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    target = servers(sample.served).target
    monkeypatch.setenv("TOKEMBED_TARGET", target)
    monkeypatch.chdir(tmp_path)  # a file a command writes lands here
    code, printed = _run(sample.command, target)
    failing = bool(sample.output) and ": error: " in sample.output[0]
    assert code == (2 if failing else 0), f"{sample.id}: `{sample.command}` exited {code}:\n" + (
        "\n".join(printed)
    )
    if sample.output:
        shown = "\n".join(sample.output)
        assert _matches(sample.output, printed), (
            f"{sample.id} shows another output of `{sample.command}`.\n"
            f"--- the page shows:\n{shown}\n--- the command prints:\n" + "\n".join(printed)
        )
