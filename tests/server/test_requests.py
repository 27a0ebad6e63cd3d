"""Request bytes -> the data plane's requests (``edge/v1/requests.py``, gRPC's
deserializers): every field, every enum value (unknown ones named), and bytes that do not
parse."""

from __future__ import annotations

import numpy as np
import pytest

from tokembed.server.core.dataplane import ModelQuery, Refused, Request
from tokembed.server.core.errors import InvalidInput, TooLarge
from tokembed.server.core.operations.embed import (
    BATCH_FIRST,
    FLAT,
    PADDED,
    SEQUENCE_FIRST,
    validate,
)
from tokembed.server.core.served import BatchLimits, Limits, ServedModel
from tokembed.server.edge.v1.requests import (
    EmbedCall,
    EmbedParser,
    parse_embed,
    parse_list_models,
    parse_model_query,
)
from tokembed.server.models.loading import LoadedModel
from tokembed.v1 import embedding_pb2 as pb


def parsed(message: pb.EmbedRequest) -> EmbedCall:
    call = parse_embed(message.SerializeToString())
    assert isinstance(call, Request)
    return call


def test_every_field_is_read() -> None:
    ids = np.array([5, 6, 7], dtype="<i8")
    message = pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[3], data=ids.tobytes()),
        lengths=[1, 2],
        output_dtype=pb.DTYPE_FLOAT16,
        ragged_layout=pb.RAGGED_LAYOUT_FLAT,
        model_name="small",
        model_version="2",
        request_id="abc",
        layout=pb.LAYOUT_SEQUENCE_FIRST,
    )
    call = parsed(message)
    got = call.body
    assert got.ids_dtype == "int64"
    assert got.shape == (3,)
    assert got.data == ids.tobytes()
    assert got.lengths == (1, 2)
    assert got.output_dtype == "float16"
    assert got.layout == FLAT
    assert got.order == SEQUENCE_FIRST
    assert (call.model_name, call.model_version, call.request_id) == ("small", "2", "abc")
    assert got.more_ids is None  # tokembed.v1 carries no other ids (yet)


@pytest.mark.parametrize(
    ("field", "value", "name"),
    [
        ("ids", pb.DTYPE_INT64, "int64"),
        ("ids", pb.DTYPE_INT32, "int32"),
        ("ids", pb.DTYPE_UNSPECIFIED, "DTYPE_UNSPECIFIED"),
        ("ids", pb.DTYPE_FLOAT32, "DTYPE_FLOAT32"),
        ("ids", 42, "42 (unknown DType value)"),
        ("output", pb.DTYPE_UNSPECIFIED, "float32"),
        ("output", pb.DTYPE_FLOAT32, "float32"),
        ("output", pb.DTYPE_FLOAT16, "float16"),
        ("output", pb.DTYPE_BFLOAT16, "bfloat16"),
        ("output", pb.DTYPE_INT32, "DTYPE_INT32"),
        ("output", 9, "9 (unknown DType value)"),
        ("layout", pb.RAGGED_LAYOUT_UNSPECIFIED, PADDED),
        ("layout", pb.RAGGED_LAYOUT_PADDED, PADDED),
        ("layout", pb.RAGGED_LAYOUT_FLAT, FLAT),
        ("layout", 7, "7 (unknown RaggedLayout value)"),
        ("order", pb.LAYOUT_UNSPECIFIED, BATCH_FIRST),
        ("order", pb.LAYOUT_BATCH_FIRST, BATCH_FIRST),
        ("order", pb.LAYOUT_SEQUENCE_FIRST, SEQUENCE_FIRST),
        ("order", 7, "7 (unknown Layout value)"),
    ],
)
def test_enums_are_mapped_and_unknown_values_named(field: str, value: int, name: str) -> None:
    message = pb.EmbedRequest(input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1, 1]))
    if field == "ids":
        message.input_ids.dtype = value  # type: ignore[assignment]
        assert parsed(message).body.ids_dtype == name
    elif field == "output":
        message.output_dtype = value  # type: ignore[assignment]
        assert parsed(message).body.output_dtype == name
    elif field == "order":
        message.layout = value  # type: ignore[assignment]
        assert parsed(message).body.order == name
    else:
        message.ragged_layout = value  # type: ignore[assignment]
        assert parsed(message).body.layout == name


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"input_ids": pb.Tensor(dtype=42, shape=[1, 1], data=bytes(8))}, "dtype 42 (unknown"),
        (
            {"input_ids": pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 1], data=bytes(8))},
            "dtype DTYPE_FLOAT32 is not supported",
        ),
        ({"output_dtype": 9}, "output_dtype 9 (unknown DType value)"),
        ({"lengths": [1], "ragged_layout": 7}, "ragged_layout 7 (unknown RaggedLayout value)"),
        ({"layout": 7}, "layout 7 (unknown Layout value) is not supported"),
    ],
)
def test_unknown_enum_values_are_named_in_the_validation_error(
    fields: dict[str, object], fragment: str, small_loaded: LoadedModel
) -> None:
    fields.setdefault(
        "input_ids",
        pb.Tensor(
            dtype=pb.DTYPE_INT64,
            shape=[1] if "lengths" in fields else [1, 1],
            data=bytes(8),
        ),
    )
    model = ServedModel(
        small_loaded.model, small_loaded.backend, Limits(10, 1 << 20),
        BatchLimits(16384, 0.002, 1, 1 << 20),
    )  # fmt: skip
    with pytest.raises(InvalidInput) as error:
        validate(parsed(pb.EmbedRequest(**fields)).body, model)  # type: ignore[arg-type]
    assert fragment in str(error.value)


def test_bytes_that_do_not_parse_are_refused_never_an_exception() -> None:
    for parse, what in (
        (parse_embed, "EmbedRequest"),
        (parse_model_query, "GetModelInfoRequest"),
        (parse_list_models, "ListModelsRequest"),
    ):
        result = parse(b"\xff\xff\xff")  # type: ignore[operator]
        assert isinstance(result, Refused) and isinstance(result.error, InvalidInput)
        assert what in str(result.error)


def test_a_request_over_the_largest_valid_one_is_refused_by_its_size_unread() -> None:
    parse = EmbedParser(max_bytes=100, max_tokens=7)
    ids = np.arange(12, dtype="<i8")
    message = pb.EmbedRequest(
        input_ids=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1, 12], data=ids.tobytes())
    ).SerializeToString()
    assert len(message) > 100
    refused = parse(message)
    assert isinstance(refused, Refused) and isinstance(refused.error, TooLarge)
    text = str(refused.error)
    assert f"the request is {len(message)} bytes, over the limit of 100 bytes" in text
    assert "max_tokens_per_request=7" in text and "--max-tokens-per-request" in text
    # Unread: even bytes that are no request at all are refused for their size.
    garbage = parse(b"\xff" * 101)
    assert isinstance(garbage, Refused) and isinstance(garbage.error, TooLarge)
    # At the limit and below, requests are parsed as ever.
    assert isinstance(EmbedParser(len(message), 7)(message), Request)


def test_model_queries_read_the_name_and_the_version() -> None:
    query = parse_model_query(pb.GetModelInfoRequest(model_name="dec").SerializeToString())
    assert query == ModelQuery("dec", "")
    versioned = pb.GetModelInfoRequest(model_name="dec", model_version="3").SerializeToString()
    assert parse_model_query(versioned) == ModelQuery("dec", "3")
    assert parse_model_query(b"") == ModelQuery("", "")
    assert parse_list_models(b"") is None
