"""Fixtures shared by every test package (loaded with ``-p support.fixtures``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from support.models import (
    build_default_model_dir,
    default_model_rows,
    export_model_dir,
    reference_rows,
)
from support.server import ServerThread

SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD = 1000, 64, 1, 0
# A second model, as a decoder's entrance beside the small "encoder": another V and D, no
# padding id.
DECODER_V, DECODER_D, DECODER_SEED = 400, 24, 2
# A model whose padding row is not zeros (a checkpoint may hold any row there), so that an
# answer padded with zeros, or with row 0, instead of the padding id's row shows. The small
# model's padding row is zeros, as nn.Embedding initialises it, and its padding id is 0:
# it cannot tell.
PAD_V, PAD_D, PAD_SEED, PAD_ID = 50, 16, 3, 7
# The server's settings for each backend: the table (the default on CPU) and onnxruntime.
# ``@EVERY_BACKEND`` runs a test with each, as its ``backend`` argument.
EVERY_BACKEND = pytest.mark.parametrize(
    "backend", [{}, {"float32_table_max_bytes": 0}], ids=["table", "onnxruntime"]
)
DEFAULT_V, DEFAULT_D, DEFAULT_SEED = 32000, 512, 0

# Every Hypothesis test here checks correctness, not speed: an example that merely ran slowly
# (a busy core, as in CI or on the shared development machine) is no failure. So no example
# has a deadline (the default, 200 ms, failed loaded runs) and generating them slowly is no
# failed health check either. Loaded here, at import of the plugin every test run loads
# (addopts), so it holds in every run, CI's included.
hypothesis_settings.register_profile(
    "tokembed", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
hypothesis_settings.load_profile("tokembed")


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V=1000, D=64, seed 1, padding id 0: quick to export and to serve."""
    return export_model_dir(
        tmp_path_factory.mktemp("small-model") / "model",
        vocab_size=SMALL_V,
        d_model=SMALL_D,
        seed=SMALL_SEED,
        padding_idx=SMALL_PAD,
        name="small",
    )


@pytest.fixture(scope="session")
def decoder_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V=400, D=24, seed 2, no padding id, named "decoder"."""
    return export_model_dir(
        tmp_path_factory.mktemp("decoder-model") / "model",
        vocab_size=DECODER_V,
        d_model=DECODER_D,
        seed=DECODER_SEED,
        name="decoder",
    )


@pytest.fixture(scope="session")
def pad_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V=50, D=16, seed 3, padding id 7 whose row is the seeded random row, not zeros;
    named "padded"."""
    from tokembed.export.modules import TokenEmbedding, random_table
    from tokembed.export.pipeline import ExportOptions, export_model

    out_dir = tmp_path_factory.mktemp("pad-model") / "model"
    table = random_table(PAD_V, PAD_D, PAD_SEED, padding_idx=None)  # row 7 left as drawn
    module = TokenEmbedding(PAD_V, PAD_D, padding_idx=PAD_ID, weight=table)
    export_model(module, ExportOptions(out_dir=out_dir, name="padded", seed=PAD_SEED))
    return out_dir


# A model with its own tokenizer (support.text_models): the WordPiece one trained by the
# tests, texts of at most TEXT_MAX_LENGTH tokens.
TEXT_V, TEXT_D, TEXT_MAX_LENGTH = 1000, 32, 64


@pytest.fixture(scope="session")
def trained_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tokenizer.json of each kind ("bpe", "wordpiece", "unigram"), trained once."""
    from support.text_models import train

    directory = tmp_path_factory.mktemp("tokenizers")
    return {kind: train(kind, directory / kind / "tokenizer.json")
            for kind in ("bpe", "wordpiece", "unigram")}  # fmt: skip


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory, trained_tokenizers: Any) -> Path:
    """V=1000, D=32, seed 5, named "text", with the WordPiece tokenizer and
    --tokenizer-max-length TEXT_MAX_LENGTH, exported by the command line."""
    from support.text_models import export_with_tokenizer

    return export_with_tokenizer(
        tmp_path_factory.mktemp("text-model") / "text", trained_tokenizers["wordpiece"],
        vocab_size=TEXT_V, d_model=TEXT_D,
        extra=("--tokenizer-max-length", str(TEXT_MAX_LENGTH)),
    )  # fmt: skip


@pytest.fixture(scope="session")
def small_loaded(small_model_dir: Path) -> Any:
    """The small model loaded as the server loads it (its tables too), once: tests build
    services around it and change nothing in it."""
    from tokembed.server.models.loading import load_model
    from tokembed.server.process.settings import Settings

    return load_model(small_model_dir, Settings())


# The reference rows: each model's answer for each id, computed independently of its
# export (support.models), once a session; read-only, every test shares them.


@pytest.fixture(scope="session")
def small_rows() -> Any:
    """The small model's answer for each id (E[id] * sqrt(D), the reference)."""
    return _read_only(reference_rows(SMALL_V, SMALL_D, SMALL_SEED, SMALL_PAD))


@pytest.fixture(scope="session")
def decoder_rows() -> Any:
    """The decoder model's answer for each id (E[id] * sqrt(D), no padding id)."""
    return _read_only(reference_rows(DECODER_V, DECODER_D, DECODER_SEED))


@pytest.fixture(scope="session")
def pad_rows() -> Any:
    """The padded model's answer for each id, computed independently of its export."""
    rows = reference_rows(PAD_V, PAD_D, PAD_SEED)
    assert (rows[PAD_ID] != 0).all() and (rows[PAD_ID] != rows[0]).any()  # what it is for
    return _read_only(rows)


@pytest.fixture(scope="session")
def default_rows() -> Any:
    """The built-in default model's answer for each id (``default_model_dir``)."""
    return default_model_rows()


def _read_only(rows: Any) -> Any:
    rows.setflags(write=False)
    return rows


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in default: V=32000, D=512, seed 0 (the design document's figures), built
    as ``tokembed serve`` builds it; the ``default_rows`` fixture holds its answers."""
    return build_default_model_dir(tmp_path_factory.mktemp("default-model") / "model")


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Throw-away certificates (``support.certs``), as PEM files: ``ca`` and the ``server``
    (127.0.0.1 and localhost) and ``client`` certificates it signed; ``other_ca`` and the
    ``foreign_client`` it signed; a ``self_signed_client``. Each issued one has ``cert``
    and ``key``."""
    from support.certs import Authority, self_signed

    directory = tmp_path_factory.mktemp("pki")
    ca = Authority(directory, "tokembed-test-ca")
    other = Authority(directory, "some-other-ca")
    return SimpleNamespace(
        ca=ca.cert,
        other_ca=other.cert,
        server=ca.server("server", dns=["localhost"], ips=["127.0.0.1"]),
        client=ca.client("client"),
        foreign_client=other.client("foreign-client"),
        self_signed_client=self_signed(directory, "self-signed-client"),
    )


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerThread]]:
    """Start real servers (in threads, port 0); all are stopped after the test."""
    from tokembed.server.process.settings import Settings

    started: list[ServerThread] = []

    def start(
        model_dir: Path | tuple[Path, ...],
        *,
        wait_ready: bool = True,
        loader: Any = None,
        **overrides: Any,
    ) -> ServerThread:
        """``model_dir``: one directory, or several (served side by side)."""
        directories = model_dir if isinstance(model_dir, tuple) else (model_dir,)
        settings = Settings(model_dir=directories, port=0, metrics_port=0, **overrides)
        settings = settings.validate()
        server = ServerThread(settings) if loader is None else ServerThread(settings, loader=loader)
        started.append(server)
        return server.start(wait_ready=wait_ready)

    yield start
    for server in started:
        server.stop()
