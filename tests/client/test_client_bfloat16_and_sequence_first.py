"""The client's bfloat16 answers and its sequence-first requests: the codec's encoding,
the decoder's arrays, the import kept light, and ``tokembed embed --dtype bfloat16
--layout sequence-first`` against the real server."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tokembed.cli.main import main
from tokembed.client import InvalidInputError
from tokembed.client.codec import embed_call, encode_ids, output_dtype
from tokembed.client.decode import decode_response
from tokembed.v1 import embedding_pb2 as pb

from support.fixtures import SMALL_D
from support.server import ServerThread


def sent(request: bytes) -> pb.EmbedRequest:
    return pb.EmbedRequest.FromString(request)


@pytest.mark.parametrize("dtype", ["bfloat16", ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)])
def test_bfloat16_is_asked_for_by_name_or_numpy_type(dtype: Any) -> None:
    assert output_dtype(dtype).wire == pb.DTYPE_BFLOAT16
    call = embed_call([[1, 2]], dtype, "padded")
    assert sent(call.request).output_dtype == pb.DTYPE_BFLOAT16
    assert call.output_itemsize == 2


def test_a_bfloat16_answer_decodes_to_an_ml_dtypes_array() -> None:
    values = np.array([[[1.5, -2.0, 3.140625]]], dtype=ml_dtypes.bfloat16)
    response = pb.EmbedResponse(
        hidden_states=pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[1, 1, 3], data=values.tobytes())
    )
    # Both decoders: protobuf's (small answers) and the zero-copy one (raw bytes).
    for raw in (response, response.SerializeToString()):
        hidden = decode_response(raw).hidden_states
        assert hidden.dtype == np.dtype(ml_dtypes.bfloat16)
        assert np.array_equal(hidden.view(np.uint16), values.view(np.uint16))


def test_importing_the_client_does_not_import_ml_dtypes() -> None:
    """ml_dtypes takes about a second to import here: only a bfloat16 answer pays it."""
    code = (
        "import sys\n"
        "import tokembed.client\n"
        "from tokembed.client import codec, decode, dtypes\n"
        "codec.embed_call([[1, 2]], 'float16', 'padded')\n"
        "before = 'ml_dtypes' in sys.modules\n"
        "dtypes.BFLOAT16.numpy\n"
        "print(before, 'ml_dtypes' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.split() == ["False", "True"]


def test_sequence_first_arrays_are_sent_as_they_are() -> None:
    ids = np.arange(12).reshape(4, 3)  # [S=4, B=3]
    call = embed_call(ids, "float32", "padded", sequence_first=True)
    request = sent(call.request)
    assert request.layout == pb.LAYOUT_SEQUENCE_FIRST
    assert list(request.input_ids.shape) == [4, 3]
    assert np.frombuffer(request.input_ids.data, dtype="<i8").tolist() == list(range(12))
    assert call.leading_shape == (4, 3) and call.output_rows == 12
    # Batch-first, the default, leaves the field unset.
    assert sent(embed_call(ids, "float32", "padded").request).layout == pb.LAYOUT_UNSPECIFIED


def test_sequence_first_lists_are_lists_of_sequences() -> None:
    # Equal sequences: sent [S, B] (transposed), answered [S, B, D].
    encoded = encode_ids([[1, 2, 3], [4, 5, 6]], sequence_first=True)
    assert encoded.ids.tolist() == [[1, 4], [2, 5], [3, 6]]
    assert encoded.leading_shape("padded") == (3, 2)
    # One sequence: [S, 1].
    assert encode_ids([7, 8, 9], sequence_first=True).ids.shape == (3, 1)
    assert encode_ids(np.array([7, 8, 9]), sequence_first=True).ids.shape == (3, 1)
    # Ragged: flat ids and lengths as ever, answered [S_max, B, D].
    call = embed_call([[1, 2, 3], [4]], "float32", "padded", sequence_first=True)
    request = sent(call.request)
    assert list(request.lengths) == [3, 1] and request.layout == pb.LAYOUT_SEQUENCE_FIRST
    assert call.leading_shape == (3, 2) and call.output_rows == 6


def test_a_flat_sequence_first_answer_is_refused_before_sending() -> None:
    for ids in ([[1, 2], [3]], [[1, 2], [3, 4]]):
        with pytest.raises(InvalidInputError, match="no batch axis"):
            embed_call(ids, "float32", "flat", sequence_first=True)


def test_cli_embeds_bfloat16_sequence_first(
    real_server: ServerThread, small_rows: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["embed", "--target", real_server.target, "--ids", "5 6 7; 8"]
    assert main([*args, "--dtype", "bfloat16", "--layout", "sequence-first"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"hidden_states [3, 2, {SMALL_D}] bfloat16")
    assert "lengths [3, 1]" in out
    # The preview's first value: position 0 of sequence 0, E[5][0] * 8 in bfloat16.
    first = float(out.splitlines()[2].strip("[ ").split()[0])
    assert first == pytest.approx(float(small_rows[5, 0].astype(ml_dtypes.bfloat16)), abs=5e-5)
