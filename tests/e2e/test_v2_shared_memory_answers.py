"""End to end, answers written into a V2 system shared-memory region, exact: each
datatype (FP32, FP16, BF16), rectangular and padded ragged input, both backends, answers of
more rows than one vectored write takes (so written in several calls), straight from the
table's rows on the table backend. The region's defences: test_v2_shared_memory.py and
tests/server/test_shm_registry.py."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as tc
import tritonclient.utils.shared_memory as shm

from support.fixtures import EVERY_BACKEND, SMALL_D, SMALL_PAD, SMALL_V

MODEL = "small"
SHM_ROOT = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")

# Wider than one vectored write (IOV_MAX, 1024 on Linux) in rows, and the table backend's
# rows are one piece each.
SEQUENCES = (700, 3, 451)
OFFSET = 64  # the output window starts here in its region: the bytes before stay untouched


def reference(rows: np.ndarray, datatype: str) -> np.ndarray:
    """The answer's bits, as an integer array (FP16 and BF16: the float32 rows cast)."""
    if datatype == "FP32":
        return rows.view(np.int32)
    if datatype == "FP16":
        return rows.astype(np.float16).view(np.int16)
    return torch.from_numpy(np.ascontiguousarray(rows)).to(torch.bfloat16).view(torch.int16).numpy()


ITEM = {"FP32": (np.float32, 4), "FP16": (np.float16, 2), "BF16": (ml_dtypes.bfloat16, 2)}


@pytest.fixture
def regions() -> Iterator[Any]:
    prefix = f"tokembedt{secrets.token_hex(4)}"
    made: list[Any] = []

    def make(suffix: str, byte_size: int) -> tuple[str, str, Any]:
        name = f"{prefix}_{suffix}"
        handle = shm.create_shared_memory_region(name, f"/{name}", byte_size, create_only=True)
        made.append(handle)
        return name, f"/{name}", handle

    make.prefix = prefix  # type: ignore[attr-defined]
    yield make
    for handle in made:
        with contextlib.suppress(Exception):
            shm.destroy_shared_memory_region(handle)
    for path in SHM_ROOT.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _input(name: str, values: np.ndarray) -> tc.InferInput:
    tensor = tc.InferInput(name, list(values.shape), "INT64")
    tensor.set_data_from_numpy(values.astype(np.int64))
    return tensor


@EVERY_BACKEND
def test_answers_into_a_region_are_the_reference_rows_exactly(
    start_server: Any, small_model_dir: Path, small_rows: np.ndarray, regions: Any, backend: Any
) -> None:
    server = start_server(
        small_model_dir, shared_memory="system", shared_memory_prefix=regions.prefix, **backend
    )
    rng = np.random.default_rng(31)
    rectangular = rng.integers(0, SMALL_V, size=(3, 700), dtype=np.int64)
    rectangular[0, :6] = [SMALL_V - 1, 0, 1, 2, 3, 2]  # the last id, a run, a repeat
    flat = rng.integers(0, SMALL_V, size=sum(SEQUENCES), dtype=np.int64)
    lengths = np.array(SEQUENCES, dtype=np.int64)
    pad = small_rows[SMALL_PAD]
    padded = np.stack([
        np.concatenate([small_rows[part], np.tile(pad, (max(SEQUENCES) - len(part), 1))])
        for part in np.split(flat, np.cumsum(SEQUENCES)[:-1])
    ])  # fmt: skip
    cases = {
        "rectangular": ([_input("input_ids", rectangular)], small_rows[rectangular]),
        "padded": ([_input("input_ids", flat), _input("lengths", lengths)], padded),
    }
    out_bytes = 3 * max(SEQUENCES) * SMALL_D * 4
    name, key, handle = regions("out", OFFSET + out_bytes + 4096)
    with tc.InferenceServerClient(server.target) as client:
        client.register_system_shared_memory(name, key, out_bytes, offset=OFFSET)
        for datatype, (numpy_type, itemsize) in ITEM.items():
            for case, (inputs, rows) in cases.items():
                # Every byte of the region 0xff first: each the answer holds was written.
                shm.set_shared_memory_region(
                    handle, [np.full(OFFSET + out_bytes + 4096, 0xFF, dtype=np.uint8)]
                )
                wanted = tc.InferRequestedOutput("hidden_states")
                nbytes = rows.size * itemsize
                wanted.set_shared_memory(name, nbytes)
                result = client.infer(
                    MODEL, inputs, outputs=[wanted], parameters={"datatype": datatype}
                )
                output = result.get_output("hidden_states")
                assert (output.datatype, list(output.shape)) == (datatype, list(rows.shape))
                assert list(result.get_response().raw_output_contents) == []
                got = shm.get_contents_as_numpy(handle, numpy_type, output.shape, offset=OFFSET)
                np.testing.assert_array_equal(
                    got.view(np.int32 if itemsize == 4 else np.int16), reference(rows, datatype),
                    err_msg=f"{datatype} {case}",
                )  # fmt: skip
                rest = shm.get_contents_as_numpy(handle, np.uint8, [OFFSET + out_bytes + 4096])
                assert (rest[:OFFSET] == 0xFF).all(), f"{datatype} {case}: before the window"
                assert (rest[OFFSET + nbytes :] == 0xFF).all(), f"{datatype} {case}: after it"
        client.unregister_system_shared_memory(name)
