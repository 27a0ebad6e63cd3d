"""Server settings: one definition gives the flag, the TOKEMBED_* variable and the help.

Configuration enters here once (``Settings.from_args``) and is passed into the
constructors; nothing else in the server reads ``os.environ``. This module says what the
settings are and which combinations are valid; how a field becomes a flag and a variable
(precedence: flag, then variable, then default) is ``flags``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tokembed.server.core.dtypes import BFLOAT16, FLOAT16, FLOAT32, DType
from tokembed.server.core.errors import ServerConfigError
from tokembed.server.process import flags
from tokembed.server.process.flags import ENV_PREFIX, setting, shown

# ENV_PREFIX and shown: what the settings table's script and the tests name beside Settings.
__all__ = ["ENV_PREFIX", "MiB", "Settings", "shown"]

MiB = 1024 * 1024
# What a shared-memory prefix may be: the start of a POSIX shared-memory object's name,
# so no '/' (the name is one path component) and nothing a shell or a log would mangle.
SHM_PREFIX = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Settings:
    # --- model
    model_dir: tuple[Path, ...] = setting(
        (),
        "model directory to serve (model.onnx + manifest.json), each under its manifest's "
        "name; give the flag once per model (the variable: paths separated by commas). "
        "Unset: the built-in default model (V=32000, D=512, seed 0) in default_model_dir, "
        "built there on first start (no torch needed)",
        many=True,
    )
    default_model: str | None = setting(
        None,
        "name of the model that answers requests naming none (default: the first model_dir)",
    )
    default_model_dir: Path = setting(
        Path("models/default"),
        "where the built-in default model lives when model_dir is unset",
    )
    # --- model repository (Triton's layout and flags)
    model_repository: Path | None = setting(
        None,
        "a model repository: DIR/<model>/<version>/ each an exported model directory "
        "(versions positive integers); not with model_dir",
    )
    model_control_mode: str | None = setting(
        None,
        "none: the models given are fixed; explicit: models are loaded and unloaded by "
        "RepositoryModelLoad/Unload (tokembed models load|unload) and load_model at start; "
        "poll: every model in the repository is served, and changes on disk are loaded "
        "every repository_poll_secs (default: explicit with model_repository, else none)",
        choices=("none", "explicit", "poll"),
    )
    load_model: tuple[str, ...] = setting(
        (),
        "a model of the repository to load at start (explicit mode); repeat the flag for "
        "several (the variable: names separated by commas), '*' for every model",
        many=True,
    )
    repository_poll_secs: float = setting(
        15.0, "poll mode: how often the repository is read for new, changed and removed versions"
    )
    control_token_file: Path | None = setting(
        None,
        "file holding the bearer token that RepositoryIndex, RepositoryModelLoad and "
        "RepositoryModelUnload must present (distinct from auth_token_file's); unset, they "
        "are refused unless the server listens on loopback only",
    )
    max_model_memory_bytes: int = setting(
        0,
        "bound on the memory of every loaded model's tables (or weights) together; a load "
        "past it is refused with the figures (0: no bound)",
    )
    # --- network
    host: str = setting("127.0.0.1", "gRPC bind address (0.0.0.0 exposes it to the network)")
    port: int = setting(50051, "gRPC port (0 picks a free one)")
    metrics_host: str = setting("127.0.0.1", "Prometheus /metrics bind address")
    metrics_port: int = setting(9464, "Prometheus /metrics port (0 picks a free one, -1 disables)")
    # --- runtime
    device: str = setting(
        "cpu",
        "execution provider: cpu, cuda, or auto (cuda if it works, else cpu with a warning)",
        choices=("cpu", "cuda", "auto"),
    )
    # One thread: the look-up is a memory-bound Gather, and on a small machine a second
    # onnxruntime thread only takes a core from gRPC (a large look-up measured slower with
    # two threads than with one on a 2-core machine).
    intra_op_threads: int = setting(
        1, "onnxruntime intra-op threads (0: one per core, onnxruntime's default)"
    )
    # Measured (tests/server/test_sessions.py): onnxruntime runs tokembed's graphs in its
    # sequential execution mode, which has no inter-op pool; the value reaches the session
    # and changes nothing. Kept so that configurations setting it keep starting.
    inter_op_threads: int = setting(
        0,
        "onnxruntime inter-op threads (0: onnxruntime's default); no effect on today's "
        "models, whose graphs onnxruntime runs sequentially",
    )
    # --- batching
    max_batch_tokens: int = setting(16384, "a batch closes when it holds this many tokens")
    max_delay_ms: float = setting(
        2.0, "while the runtime is busy, a batch waits at most this long for company"
    )
    max_concurrent_batches: int = setting(1, "batches computing at the same time")
    inline_compute_max_tokens: int = setting(
        256,
        "look-ups (and batches) of up to this many tokens, under 1 MiB of answer, run on "
        "the event loop itself: a tiny look-up (~10 us) costs less than the hop to a worker "
        "thread (0: always off-loop)",
    )
    nearest_max_batch_rows: int = setting(
        256,
        "nearest: a batch closes when it holds this many vectors (their [rows, V] logits "
        "are computed together, the table read once per batch)",
    )
    nearest_head: str = setting(
        "auto",
        "nearest: what multiplies over the head's table: numpy (on the CPU), onnxruntime (the "
        "head graph, on --device's provider), or auto (onnxruntime where the model runs on "
        "CUDA, numpy on the CPU, where the graph's session would hold copies of the table)",
        choices=("auto", "numpy", "onnxruntime"),
    )
    nearest_first_pass: str = setting(
        "float32",
        "nearest: how the candidates are found before they are scored exactly: float32 (the "
        "multiply over the table as stored) or int8 (an int8 copy of the table made at load, "
        "a quarter of float32's bytes, multiplied by onnxruntime's MatMulInteger within a "
        "proven bound); the answers are the same",
        choices=("float32", "int8"),
    )
    # --- limits and admission
    max_nearest_k: int = setting(1024, "nearest: the largest k one request may ask for")
    max_nearest_flops_per_request: int = setting(
        2**40, "nearest: the work one request may cost, 2 x vectors x D x V flops"
    )
    max_queued_nearest_flops: int = setting(
        2**42,
        "nearest: the work (2 x vectors x D x V flops) waiting for a batch; past it new nearest "
        "requests get RESOURCE_EXHAUSTED at once",
    )
    max_tokens_per_request: int = setting(65536, "tokens one request may carry")
    max_output_bytes_per_request: int = setting(
        128 * MiB, "output bytes one request may ask for (sets the gRPC message limit too)"
    )
    max_queued_tokens: int = setting(
        262144, "tokens waiting for a batch; past it new requests get RESOURCE_EXHAUSTED at once"
    )
    max_inflight_output_bytes: int = setting(
        1024 * MiB, "output bytes of all admitted, unfinished requests; past it RESOURCE_EXHAUSTED"
    )
    stream_chunk_bytes: int = setting(MiB, "slice size of EmbedChunked answers")
    float32_table_max_bytes: int = setting(
        512 * MiB,
        "on CPU, serve a model from a table of its rows (V x D x 4 bytes, computed by the "
        "model at load: the table backend) if it is at most this big; else, and on CUDA, "
        "the model runs for every batch (the onnxruntime backend); 0: never a table",
    )
    float16_table_max_bytes: int = setting(
        512 * MiB,
        "with the table backend, keep a float16 table too (V x D x 2 bytes) for float16 "
        "answers if it is at most this big; else they are cast from the float32 rows",
    )
    bfloat16_table_max_bytes: int = setting(
        512 * MiB,
        "with the table backend, keep a bfloat16 table too (V x D x 2 bytes) for bfloat16 "
        "answers if it is at most this big; else they are cast from the float32 rows. A "
        "model stored in bfloat16 keeps this table alone, no float32 one: it is served by "
        "the table backend when this table fits (and --float32-table-max-bytes is not 0), "
        "its float32 and float16 answers computed by the model per answer",
    )
    table_cache_dir: Path | None = setting(
        None,
        "with the table backend, where each row table is written once and memory-mapped "
        "by every process serving a model with the same files (the workers, later starts, "
        "versions alike), so that they hold it once between them in the page cache. A "
        "cache: any file in it may be deleted. Created 0700; refused, with one log line, "
        "when it belongs to another user or group or others may write in it (each process "
        "then holds its own tables). Unset: tokembed-tables-UID in the system's temporary "
        "directory",
    )
    table_cache_max_bytes: int = setting(
        8 * 1024 * MiB,
        "bound on the table cache's files: after one is written, the least recently used "
        "others are removed down to it (a process serving a removed file keeps it mapped); "
        "a table larger than this is held in memory. 0: no cache, each process computes "
        "and holds its own tables",
    )
    memory_trim_interval_s: float = setting(
        1.0,
        "hand free heap memory back to the OS this often, so resident memory follows what "
        "is live rather than the highest peak seen (0: never)",
    )
    max_concurrent_streams: int = setting(
        # Not HTTP/2's usual 100: gRPC counts a call against it until the server has
        # finished with it, later than its client does when the server is busy, and
        # refuses calls past it (UNAVAILABLE); docs/security.md has what was measured.
        1000,
        "calls open at once on one client connection (HTTP/2 streams); further calls wait "
        "in the client until one ends. Bounds what one connection can make the server hold "
        "before its calls are authenticated",
    )
    # --- lifecycle and logs
    max_connection_age_s: float = setting(
        0.0,
        "close client connections after this long (0: never), so clients balancing over "
        "DNS re-resolve and find new replicas",
    )
    grace_s: float = setting(
        10.0,
        "on SIGTERM/SIGINT, the process is gone within this long; in-flight requests get "
        "all of it but the last second (at most a quarter), kept for closing down",
    )
    log_level: str = setting(
        "info", "debug, info, warning or error", choices=("debug", "info", "warning", "error")
    )
    log_format: str = setting(
        "text", "text or json (one object per line)", choices=("text", "json")
    )
    log_summary_interval_s: float = setting(
        10.0,
        "refused requests are logged per reason as the first one in full, then one line per "
        "interval this long saying how many more there were (each has its own line at debug)",
    )
    workers: int = setting(1, "server processes sharing the port through SO_REUSEPORT")
    # --- security
    tls_cert: Path | None = setting(None, "PEM certificate chain: serve TLS on the gRPC port")
    tls_key: Path | None = setting(None, "PEM private key for tls_cert")
    tls_client_ca: Path | None = setting(
        None, "PEM CA bundle: require client certificates signed by it (mutual TLS)"
    )
    auth_token_file: Path | None = setting(
        None, "file holding a bearer token; every RPC but health checks must present it"
    )
    # --- same-host transfer (the V2 protocol's system shared-memory extension)
    shared_memory: str = setting(
        "off",
        "system: V2 clients on this host may register POSIX shared-memory regions "
        "(Triton's system shared-memory extension) to send ids and receive answers through "
        "them; off: every registration is refused. A region is its registrant's (client "
        "certificate, else token); any caller may register any object under "
        "shared_memory_prefix owned by the server's user (docs/security.md). One process: "
        "not with workers > 1",
        choices=("off", "system"),
    )
    shared_memory_prefix: str = setting(
        "tokembed",
        "a region's key must name a POSIX shared-memory object whose name starts with this "
        "(after the leading /); letters, digits, '.', '_' and '-' only",
    )
    shared_memory_max_regions: int = setting(
        64,
        "regions registered at once (each holds an open file, one unregistered too until the "
        "requests using it end); past it registration fails",
    )

    @property
    def control_mode(self) -> str:
        """The model control mode in force (``model_control_mode``, or its default)."""
        if self.model_control_mode is not None:
            return self.model_control_mode
        return "explicit" if self.model_repository is not None else "none"

    @property
    def table_cache_path(self) -> Path | None:
        """The table cache's directory (``table_cache_dir`` or its default); None when
        there is no cache."""
        if self.table_cache_max_bytes == 0:
            return None
        if self.table_cache_dir is not None:
            return self.table_cache_dir
        # One per user: the directory must be the server's user's alone (models/table_cache).
        return Path(tempfile.gettempdir()) / f"tokembed-tables-{os.geteuid()}"

    @property
    def max_delay_s(self) -> float:
        return self.max_delay_ms / 1000.0

    @property
    def max_message_bytes(self) -> int:
        """gRPC message limit: the largest output plus room for the envelope."""
        return self.max_output_bytes_per_request + MiB

    def tables(
        self, vocab_size: int, d_model: int, weight_dtype: str, *, main_fits: bool = False
    ) -> dict[str, int]:
        """The row tables the table backend keeps on CPU for a model of this shape and
        weight dtype: their bytes by answer dtype; empty when it keeps none (the model is
        then served by the onnxruntime backend). The one place this is decided.

        A float32 or float16 model: its float32 table when it fits, then a float16 and a
        bfloat16 table each where it fits. A bfloat16 model: its bfloat16 table alone,
        when it fits (its float32 and float16 answers are runs of the model, whose
        weights onnxruntime maps from the file rather than copying them), so that it takes
        V x D x 2 bytes of memory rather than a float32 table's V x D x 4 besides.

        ``main_fits``: as if the model's own table (float32, or a bfloat16 model's
        bfloat16 one) fit whatever its budget: what serving from tables would take.
        """
        cells = vocab_size * d_model
        budgets = self.table_budgets
        if not main_fits and budgets[FLOAT32] == 0:
            return {}
        main = BFLOAT16 if weight_dtype == BFLOAT16.name else FLOAT32
        if not main_fits and cells * main.itemsize > budgets[main]:
            return {}
        kept = {main.name: cells * main.itemsize}
        if main is FLOAT32:
            for dtype, budget in budgets.items():
                if dtype is not FLOAT32 and cells * dtype.itemsize <= budget:
                    kept[dtype.name] = cells * dtype.itemsize
        return kept

    @property
    def table_budgets(self) -> dict[DType, int]:
        """Each answer dtype's table budget, in bytes (float32's 0: no tables at all)."""
        return {
            FLOAT32: self.float32_table_max_bytes,
            FLOAT16: self.float16_table_max_bytes,
            BFLOAT16: self.bfloat16_table_max_bytes,
        }

    @property
    def max_request_bytes(self) -> int:
        """The largest valid request plus room for the envelope: larger ones are refused
        before they are decoded (``edge.v1.requests.EmbedParser``).

        A request needs at most 8 bytes per id and a <= 10-byte varint per length (every
        sequence holds >= 1 id), so it is far smaller than an answer. Decoded whatever
        their size, one-byte lengths became 8-byte integers twice over before validation
        could refuse them.
        """
        return self.max_tokens_per_request * (8 + 10) + MiB

    @property
    def max_receive_bytes(self) -> int:
        """gRPC's receive limit: the largest valid request with a margin, so that a request
        a little over ``max_request_bytes`` still reaches our parser (refused with our
        message and counted) while anything larger is refused by gRPC before it is
        buffered. Not the answer limit: a caller, authenticated or not, may make the
        server hold this much per open call.
        """
        return self.max_request_bytes + MiB

    def __post_init__(self) -> None:
        # One directory may be given as it is (Settings(model_dir=path), as tests and
        # embedders write it): it is a tuple of one.
        if isinstance(self.model_dir, (str, os.PathLike)):
            object.__setattr__(self, "model_dir", (Path(self.model_dir),))
        else:
            object.__setattr__(self, "model_dir", tuple(Path(d) for d in self.model_dir))

    def validate(self) -> Settings:
        positive = (
            "max_batch_tokens",
            "max_tokens_per_request",
            "max_output_bytes_per_request",
            "max_queued_tokens",
            "max_inflight_output_bytes",
            "stream_chunk_bytes",
            "max_concurrent_batches",
            "workers",
            "log_summary_interval_s",
            "shared_memory_max_regions",
            "max_concurrent_streams",
            "nearest_max_batch_rows",
            "max_nearest_k",
            "max_nearest_flops_per_request",
            "max_queued_nearest_flops",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ServerConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "max_delay_ms",
            "grace_s",
            "intra_op_threads",
            "inter_op_threads",
            "inline_compute_max_tokens",
            "float16_table_max_bytes",
            "bfloat16_table_max_bytes",
            "float32_table_max_bytes",
            "max_connection_age_s",
            "memory_trim_interval_s",
            "max_model_memory_bytes",
            "table_cache_max_bytes",
        ):
            if getattr(self, name) < 0:
                raise ServerConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        # Fix: float("nan") parses from a flag or a variable and passes every "< 0" test
        # (a NaN max_delay made the batcher never wait); inf is no duration either.
        for name in ("max_delay_ms", "grace_s", "max_connection_age_s", "memory_trim_interval_s",
                     "log_summary_interval_s"):  # fmt: skip
            if not math.isfinite(getattr(self, name)):
                raise ServerConfigError(
                    f"{name} must be a finite number, got {getattr(self, name)}"
                )
        self._validate_repository()
        if not 0 <= self.port <= 65535:
            raise ServerConfigError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ServerConfigError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ServerConfigError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ServerConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.workers > 1 and self.port == 0:
            raise ServerConfigError("workers > 1 needs a fixed port to share")
        if self.workers > 1 and self.shared_memory == "system":
            # Each process would keep a registry of its own: N times the region cap, and
            # an unregistration that reaches one process of N.
            raise ServerConfigError(
                f"--shared-memory system needs one process; got --workers {self.workers} "
                "(each worker would keep regions of its own): use --workers 1, or run "
                "replicas with shared memory off"
            )
        if self.default_model is not None and not self.default_model:
            raise ServerConfigError("default_model must be a model's name, got ''")
        if not SHM_PREFIX.fullmatch(self.shared_memory_prefix) or ".." in (
            self.shared_memory_prefix
        ):
            raise ServerConfigError(
                "shared_memory_prefix must be 1-64 of letters, digits, '.', '_' and '-' "
                f"(no '..'), got {self.shared_memory_prefix!r}"
            )
        return self

    def _validate_repository(self) -> None:
        if self.model_repository is not None and self.model_dir:
            raise ServerConfigError(
                "model_dir and model_repository exclude each other: serve fixed model "
                "directories, or a repository's models"
            )
        if self.model_repository is None:
            if self.model_control_mode in ("explicit", "poll"):
                raise ServerConfigError(
                    f"--model-control-mode {self.model_control_mode} needs --model-repository"
                )
            if self.load_model:
                raise ServerConfigError("--load-model needs --model-repository")
        elif self.load_model and self.control_mode != "explicit":
            raise ServerConfigError(
                f"--load-model goes with --model-control-mode explicit; in mode "
                f"{self.control_mode} every model of the repository is loaded"
            )
        if not (math.isfinite(self.repository_poll_secs) and self.repository_poll_secs > 0):
            raise ServerConfigError(
                f"repository_poll_secs must be a positive number, got {self.repository_poll_secs}"
            )
        if self.workers > 1 and self.control_mode == "explicit":
            raise ServerConfigError(
                f"--model-control-mode explicit needs one process; got --workers "
                f"{self.workers} (a load would reach one worker of them): use poll mode "
                "with workers, or --workers 1"
            )

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes).validate()

    # --- construction from the command line and the environment (``flags``)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        flags.add_arguments(cls, parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
        return cls(**flags.values_from(cls, args, environ)).validate()

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> Settings:
        """For tests and embedding: the same parsing ``tokembed serve`` does."""
        parser = argparse.ArgumentParser()
        cls.add_arguments(parser)
        return cls.from_args(parser.parse_args(list(argv)), os.environ)

    def describe(self) -> dict[str, Any]:
        return {spec.name: getattr(self, spec.name) for spec in fields(self)}
