"""``tokembed embed``, ``nearest`` (``cli.nearest``), ``info``, ``models``, ``health``: the
client on the command line (``models index|load|unload``: ``control``).

grpc and numpy are imported inside the run functions (and ``--dtype``'s choices when they
are first asked for), so that ``tokembed --help`` and the other subcommands do not pay for
them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy.typing as npt

    from tokembed.client.results import ModelInfo, ModelList
    from tokembed.client.sync import EmbeddingClient

DEFAULT_TARGET = "127.0.0.1:50051"
TARGET_ENV = "TOKEMBED_TARGET"


class _OutputDtypes:
    """``--dtype``'s choices: the output dtype names the client accepts
    (``tokembed.client.codec.OutputDType``), read from there when argparse first asks
    (a ``--dtype`` given, or ``embed --help``), since the codec imports numpy."""

    def _names(self) -> tuple[str, ...]:
        from tokembed.client.codec import OutputDType

        return typing.get_args(OutputDType)

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    connection = common.add_argument_group("connection")
    connection.add_argument(
        "--target",
        default=os.environ.get(TARGET_ENV, DEFAULT_TARGET),
        help=f"server address: HOST:PORT, dns:///HOST:PORT or ipv4:A:P1,B:P2 "
        f"(env {TARGET_ENV}; default {DEFAULT_TARGET})",
    )
    connection.add_argument(
        "--tls-ca", type=Path, default=None, help="CA certificate (PEM): connect with TLS"
    )
    connection.add_argument(
        "--tls-cert", type=Path, default=None, help="client certificate (PEM), for mutual TLS"
    )
    connection.add_argument(
        "--tls-key", type=Path, default=None, help="client private key (PEM), for mutual TLS"
    )
    connection.add_argument(
        "--tls", action="store_true", help="connect with TLS using the system's CA certificates"
    )
    connection.add_argument(
        "--tls-server-name",
        default=None,
        help="name to check the server's certificate against, if not the target's host",
    )
    connection.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file holding a bearer token, sent as 'authorization: Bearer <token>'",
    )

    embed = subparsers.add_parser(
        "embed",
        parents=[common],
        help="embed token ids with a running server and print the shape and a preview "
        "(or save the answer: --output)",
        description="Call Embed and print the answer's shape, a preview (or save the answer "
        "to a .npy file: --output) and the server timings.",
    )
    given = embed.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "--ids",
        help='token ids separated by spaces or commas; ";" separates sequences, which may '
        'differ in length (e.g. "5 6 7 8; 9 10")',
    )
    given.add_argument(
        "--text",
        action="append",
        metavar="TEXT",
        help="a text, tokenized by the model's own tokenizer on the server (EmbedText); "
        "repeat it for several. Prints the ids beside the answer [N,D] (each text's rows "
        "one after another)",
    )
    embed.add_argument(
        "--token-types",
        default=None,
        metavar="TYPES",
        help="token type (segment) ids, one per id and laid out as --ids, for a model that "
        'takes them (kind segment, BERT\'s; e.g. "0 0 1 1; 0 0"); default: all 0',
    )
    embed.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="the served model to embed with (default: the server's default model)",
    )
    embed.add_argument(
        "--dtype",
        choices=_OutputDtypes(),
        default="float32",
        metavar="DTYPE",
        help="dtype of the answer, one of: %(choices)s (default %(default)s; float16 and "
        "bfloat16 are half the bytes, rounded to nearest even from the float32 values)",
    )
    embed.add_argument(
        "--layout",
        choices=["padded", "flat", "sequence-first"],
        default="padded",
        help="the answer's axes: [B,S,D] (padded: ragged sequences padded to [B,S_max,D]), "
        "[N,D] (flat: ragged sequences one after another) or [S,B,D] (sequence-first: "
        "ragged ones padded to [S_max,B,D])",
    )
    embed.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="save the answer to FILE in numpy's .npy format (np.load reads it) instead of "
        "printing a preview; bfloat16 answers are saved as their uint16 bits: "
        "np.load(FILE).view(ml_dtypes.bfloat16)",
    )
    embed.add_argument(
        "--truncate",
        action="store_true",
        help="with --text: cut a text longer than the model's limit to it (default: refused)",
    )
    embed.add_argument("--timeout-s", type=float, default=30.0, help="per call (default 30)")
    embed.set_defaults(run=run_embed)

    from tokembed.cli import nearest

    nearest.add_parser(subparsers, common)

    tokenize = subparsers.add_parser(
        "tokenize",
        parents=[common],
        help="tokenize texts with a served model's own tokenizer and print the ids",
        description="Call Tokenize and print, for each text, its ids and their tokens' "
        "offsets in the text (characters: start-end); special tokens are marked with *.",
    )
    tokenize.add_argument("texts", nargs="+", metavar="TEXT", help="the texts to tokenize")
    tokenize.add_argument(
        "--model", default=None, metavar="NAME", help="the served model (default: the default)"
    )
    tokenize.add_argument(
        "--no-special-tokens",
        action="store_true",
        help="do not add the tokenizer's special tokens ([CLS], </s>...)",
    )
    tokenize.add_argument(
        "--truncate",
        action="store_true",
        help="cut a text longer than the model's limit to it (default: refused)",
    )
    tokenize.add_argument("--json", action="store_true", help="print JSON instead of text")
    tokenize.add_argument("--timeout-s", type=float, default=30.0, help="per call (default 30)")
    tokenize.set_defaults(run=run_tokenize)

    info = subparsers.add_parser(
        "info",
        parents=[common],
        help="print what a running server serves, and its limits",
        description="Call GetModelInfo and print one model, its backend, execution provider "
        "and limits; with --all, call ListModels and print every served model.",
    )
    which = info.add_mutually_exclusive_group()
    which.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="the served model to describe (default: the server's default model)",
    )
    which.add_argument(
        "--all", action="store_true", help="every served model, the default one marked"
    )
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.add_argument("--timeout-s", type=float, default=10.0, help="per call (default 10)")
    info.set_defaults(run=run_info)

    models = subparsers.add_parser(
        "models",
        parents=[common],
        help="list the models a running server serves; index, load and unload its repository's",
        description="Without an action: call ListModels and print one line per served "
        "model: its name, version, V, D, weight dtype and backend, the default one marked "
        "with *. `tokembed info --all` prints every model in full. index: every model of "
        "the server's repository, each version's state and the reason of a failure "
        "(RepositoryIndex); load NAME: load a model (RepositoryModelLoad), returning once "
        "it serves; unload NAME: unload one (RepositoryModelUnload).",
    )
    models.add_argument(
        "action", nargs="?", choices=("list", "index", "load", "unload"), default="list"
    )
    models.add_argument("name", nargs="?", help="the model to load or unload")
    models.add_argument(
        "--config",
        default=None,
        help="load: what the model's configuration may override, as JSON, e.g. "
        '\'{"version_policy": {"latest": {"num_versions": 2}}}\'',
    )
    models.add_argument("--force", action="store_true", help="load: even an unchanged model")
    models.add_argument(
        "--control-token-file",
        type=Path,
        default=None,
        help="index, load, unload: file holding the server's control token "
        "(its --control-token-file), sent instead of --token-file's",
    )
    models.add_argument("--json", action="store_true", help="index: print JSON")
    models.add_argument(
        "--timeout-s", type=float, default=None, help="per call (default 10; load 300)"
    )
    models.set_defaults(run=run_models)

    health = subparsers.add_parser(
        "health",
        parents=[common],
        help="exit 0 if the server reports SERVING, 1 otherwise (for container health checks)",
        description="Ask the standard gRPC health service once, without retries. Exit status: "
        "0 when SERVING; 1 when not serving, unknown or unreachable (one line says which).",
    )
    health.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="the service to ask about: a served model's name, or tokembed.v1.EmbeddingService "
        "(default: the whole server)",
    )
    health.add_argument("--timeout-s", type=float, default=5.0, help="per check (default 5)")
    health.set_defaults(run=run_health)


def _client(args: argparse.Namespace, *, retries: int | None = None) -> EmbeddingClient:
    from tokembed.client._retry import DEFAULT_RETRIES
    from tokembed.client.errors import EmbeddingError
    from tokembed.client.sync import EmbeddingClient

    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise EmbeddingError(f"cannot read --token-file {args.token_file}: {exc}") from exc
    return EmbeddingClient(
        args.target,
        timeout_s=args.timeout_s,
        tls=args.tls,
        root_certificates=args.tls_ca,
        client_certificate=args.tls_cert,
        client_key=args.tls_key,
        tls_server_name=args.tls_server_name,
        token=token,
        retries=DEFAULT_RETRIES if retries is None else retries,
    )


def parse_ids(text: str, flag: str = "--ids") -> list[list[int]]:
    """ "5 6 7; 8,9" -> [[5, 6, 7], [8, 9]]; a bad token raises InvalidInputError naming
    it. Whether an id is in the model's vocabulary is the server's to say (it knows V)."""
    from tokembed.client.errors import client_invalid_input

    sequences: list[list[int]] = []
    for i, part in enumerate(text.split(";")):
        tokens = part.replace(",", " ").split()
        if not tokens:
            raise client_invalid_input(f"{flag}: sequence {i} is empty")
        sequence = []
        for token in tokens:
            try:
                sequence.append(int(token))
            except ValueError:
                raise client_invalid_input(
                    f"{flag}: {token!r} (sequence {i}) is not a token id: ids are integers "
                    'separated by spaces or commas, sequences by ";"'
                ) from None
        sequences.append(sequence)
    return sequences


def run_embed(args: argparse.Namespace) -> int:
    if args.text is not None:
        return _run_embed_text(args)
    import numpy as np

    ids = parse_ids(args.ids)
    types = None if args.token_types is None else parse_ids(args.token_types, "--token-types")
    with _client(args) as client:
        sequence_first = args.layout == "sequence-first"
        result = client.embed_result(
            ids,
            args.dtype,
            layout="padded" if sequence_first else args.layout,
            sequence_first=sequence_first,
            model=args.model,
            token_types=types,
        )
    hs = result.hidden_states
    # Saved before anything is printed: a path that cannot be written is the one line.
    saved = None if args.output is None else save_npy(args.output, hs)
    print(
        f"hidden_states {list(hs.shape)} {hs.dtype}, "
        f"model {result.model_name or '?'} {result.model_version}".rstrip()
    )
    if result.lengths is not None:
        print(f"lengths {result.lengths.tolist()}")
    if saved is not None:
        print(saved)
    else:
        with np.printoptions(precision=4, suppress=True, threshold=24, edgeitems=2, linewidth=100):
            print(hs[:2] if hs.ndim == 3 else hs)
    t = result.timings
    print(
        f"server: queue {t.queue_seconds * 1e3:.3f} ms, compute {t.compute_seconds * 1e3:.3f} ms, "
        f"total {t.server_seconds * 1e3:.3f} ms; batch of {t.batch_requests} request(s), "
        f"{t.batch_tokens} token(s)"
    )
    return 0


def _run_embed_text(args: argparse.Namespace) -> int:
    import numpy as np

    from tokembed.client.errors import client_invalid_input

    for flag, given in (("--token-types", args.token_types), ("--layout", args.layout != "padded")):
        if given:
            raise client_invalid_input(f"{flag} goes with --ids, not --text")
    with _client(args) as client:
        result = client.embed_text(
            args.text, args.dtype, truncation=args.truncate, model=args.model
        )
    hs = result.hidden_states
    saved = None if args.output is None else save_npy(args.output, hs)
    print(
        f"hidden_states {list(hs.shape)} {hs.dtype}, "
        f"model {result.model_name or '?'} {result.model_version}".rstrip()
    )
    for index, ids in enumerate(_parts(result.input_ids, result.lengths)):
        print(f"text {index}: {len(ids)} tokens {ids.tolist()}")
    if saved is not None:
        print(saved)
    else:
        with np.printoptions(precision=4, suppress=True, threshold=24, edgeitems=2, linewidth=100):
            print(hs)
    return 0


def run_tokenize(args: argparse.Namespace) -> int:
    with _client(args) as client:
        result = client.tokenize(
            args.texts, add_special_tokens=not args.no_special_tokens,
            truncation=args.truncate, model=args.model,
        )  # fmt: skip
    ids, offsets = result.ids(), result.offset_pairs()
    special = [part.tolist() for part in _parts(result.special_tokens_mask, result.lengths)]
    if args.json:
        texts = [
            {"ids": each, "offsets": [list(pair) for pair in pairs], "special_tokens_mask": marks}
            for each, pairs, marks in zip(ids, offsets, special, strict=True)
        ]
        print(json.dumps({"model": result.model_name, "texts": texts}))
        return 0
    for index, (each, pairs, marks) in enumerate(zip(ids, offsets, special, strict=True)):
        tokens = " ".join(
            f"{token}{'*' if mark else ''}@{start}-{end}"
            for token, (start, end), mark in zip(each, pairs, marks, strict=True)
        )
        print(f"text {index}: {len(each)} tokens: {tokens}")
    return 0


def _parts(flat: Any, lengths: Any) -> list[Any]:
    import numpy as np

    return list(np.split(flat, np.cumsum(lengths)[:-1])) if len(lengths) else []


def save_npy(path: Path, answer: npt.NDArray[Any]) -> str:
    """Write ``answer`` to ``path`` (that name, as given) in the ``.npy`` format and say
    what was saved. The format has no bfloat16: numpy would write ml_dtypes' type as
    opaque 2-byte records, which load as bytes, so a bfloat16 answer is saved as its
    uint16 bits, loadable without pickle, and the line says how to view them again."""
    import numpy as np

    from tokembed.client.errors import EmbeddingError

    note = ""
    if answer.dtype.name == "bfloat16":
        answer = answer.view(np.uint16)
        note = f" as uint16, bfloat16's bits: np.load({str(path)!r}).view(ml_dtypes.bfloat16)"
    try:
        with path.open("wb") as file:
            np.save(file, answer, allow_pickle=False)
    except OSError as exc:
        raise EmbeddingError(f"cannot write --output {path}: {exc.strerror or exc}") from exc
    return f"saved to {path}{note}"


def run_info(args: argparse.Namespace) -> int:
    if args.all:
        return _run_info_all(args)
    with _client(args) as client:
        info = client.info(args.model)
    if args.json:
        print(json.dumps(asdict(info), indent=2))
        return 0
    print("\n".join(_info_lines(info)))
    return 0


def _run_info_all(args: argparse.Namespace) -> int:
    with _client(args) as client:
        served = client.models()
    if args.json:
        models = [asdict(info) for info in served]
        print(json.dumps({"default_model": served.default_model, "models": models}, indent=2))
        return 0
    blocks = []
    for info in served:
        lines = _info_lines(info)
        if info.name == served.default_model:
            lines[0] += " (default)"
        blocks.append("\n".join(lines))
    print("\n\n".join(blocks))
    return 0


def run_models(args: argparse.Namespace) -> int:
    if args.action != "list":
        from tokembed.cli.control import run_control

        return run_control(args, _client)
    if args.timeout_s is None:
        args.timeout_s = 10.0
    with _client(args) as client:
        served = client.models()
    print("\n".join(models_table(served)))
    return 0


def models_table(served: ModelList) -> list[str]:
    """One line per model, under a header; ``*`` marks the default model."""
    header = ("MODEL", "VERSION", "KIND", "V", "D", "WEIGHTS", "BACKEND", "MEMORY", "DEFAULT")
    rows = [
        (
            info.name,
            info.version,
            info.kind,
            str(info.vocab_size),
            str(info.d_model),
            info.weight_dtype,
            info.backend or "?",
            _size(sum(info.memory_bytes.values())) if info.memory_bytes else "?",
            "*" if info.name == served.default_model else "",
        )
        for info in served
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    # V, D and the memory are numbers: right-aligned; the rest left-aligned.
    numeric = (3, 4, 7)
    return [
        "  ".join(
            cell.rjust(width) if i in numeric else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in (header, *rows)
    ]


def _size(count: int) -> str:
    """Bytes as a person reads them: 1.5 MiB, 376.0 MiB, 2.3 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _info_lines(info: ModelInfo) -> list[str]:
    lim = info.limits
    padding = "none" if info.padding_id is None else str(info.padding_id)
    inputs = [
        f"{i.name} [0, {i.bound}) ({i.bound_field}{', optional: 0' if i.optional else ''})"
        for i in info.inputs
    ]
    tables = [f"{t.role} {list(t.shape)} {t.dtype}" for t in info.tables]
    held = [f"{what} {_size(count)}" for what, count in sorted(info.memory_bytes.items())]
    chosen = info.backend or "?"
    ways = [
        f"{way} {_size(count)}{' (chosen)' if way == chosen else ''}"
        for way, count in sorted(info.serving_memory_bytes.items())
    ]
    # A model exported with --from-pretrained: its architecture and what each engine expects.
    pretrained = [
        f"architecture       {info.architecture}",
        f"convention         {info.convention}",
        "engine scales      "
        + ", ".join(f"{engine} {scale:g}" for engine, scale in sorted(info.engine_scales.items())),
    ] if info.architecture else []  # fmt: skip
    return [
        f"model              {info.name} {info.version}",
        f"kind               {info.kind}",
        *pretrained,
        f"vocab_size (V)     {info.vocab_size}",
        f"d_model (D)        {info.d_model}",
        f"scale              {info.scale:g}",
        f"padding_id         {padding}",
        f"weight_dtype       {info.weight_dtype}",
        f"inputs             {'; '.join(inputs) or '?'}",
        f"tables             {'; '.join(tables) or '?'}",
        f"input_dtypes       {', '.join(info.input_dtypes)}",
        f"output_dtypes      {', '.join(info.output_dtypes)}",
        f"backend            {chosen}",
        f"memory             {', '.join(held) or '?'}",
        f"serving ways       {', '.join(ways) or '?'}",
        f"provider           {info.execution_provider}",
        f"model_sha256       {info.model_sha256}",
        f"max tokens/request {lim.max_tokens_per_request}",
        f"max output bytes   {lim.max_output_bytes_per_request}",
        f"max batch tokens   {lim.max_batch_tokens}",
        f"max message bytes  {lim.max_message_bytes}",
        f"max delay          {lim.max_delay_seconds * 1e3:g} ms",
        f"head (nearest)     {_head_line(info)}",
    ]


def _head_line(info: ModelInfo) -> str:
    head = info.head
    if head is None:
        return "none (the model answers no nearest)"
    norm = f", final norm {head.norm}" if head.norm else ""
    runs_on = f", multiplied by {head.runs_on}" if head.runs_on else ""
    return f"{head.table} table{norm}, k up to {head.max_k}{runs_on}"


def run_health(args: argparse.Namespace) -> int:
    from tokembed.client.errors import EmbeddingError

    # The whole server is the target alone; a named service is named after it.
    checked = args.target + (f" service {args.service!r}" if args.service else "")
    # Not retried: a health check reports the present, and the orchestrator asks again.
    with _client(args, retries=0) as client:
        try:
            status = client.health(args.service)
        except EmbeddingError as exc:
            if exc.code is None:
                raise  # not the server's answer (e.g. grpcio-health-checking missing)
            print(f"{checked}: unhealthy: {exc}", file=sys.stderr)
            return 1
    if status == "SERVING":
        print(f"{checked}: SERVING")
        return 0
    if status == "SERVICE_UNKNOWN":
        status += " (the server has no such service: each served model has one under its name)"
    print(f"{checked}: {status}", file=sys.stderr)
    return 1
