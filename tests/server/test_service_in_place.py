"""The service writes large table answers where the caller asks (``answer_into``), and
only where it writes every row itself; the answers are the same either way."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from tokembed.server import gather as gather_module
from tokembed.server import service as service_module
from tokembed.server.app import LoadedModel
from tokembed.server.domain import FLAT, PADDED, EmbedInput, EmbedJob, Timings
from tokembed.server.errors import DeadlineExceeded
from tokembed.server.gather import GatherHelper, gather_into
from tokembed.server.service import OFFLOAD_MIN_BYTES, EmbeddingService, _answer_shape
from tokembed.server.settings import Settings
from tokembed.server.validation import Limits, validate

from support.fixtures import SMALL_D, SMALL_PAD, SMALL_V
from support.observers import BatchRecorder

LARGE_TOKENS = OFFLOAD_MIN_BYTES // (SMALL_D * 2) + 64  # over the in-place size, even as float16
LIMITS = Limits(
    vocab_size=SMALL_V, d_model=SMALL_D, model_name="small",
    max_tokens_per_request=1 << 20, max_output_bytes_per_request=1 << 30,
)  # fmt: skip


class Recorder:
    """An ``answer_into`` that hands out its own arrays and remembers what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], np.dtype, Any, Timings]] = []
        self.arrays: list[np.ndarray] = []

    def __call__(
        self, shape: tuple[int, ...], dtype: np.dtype, lengths: Any, timings: Timings
    ) -> np.ndarray:
        self.calls.append((shape, dtype, lengths, timings))
        self.arrays.append(np.full(shape, np.nan, dtype=dtype))  # no row may stay unwritten
        return self.arrays[-1]


def embed(
    small_loaded: LoadedModel,
    request: EmbedInput,
    answer_into: Recorder | None,
    observer: BatchRecorder | None = None,
    **tables: Any,
) -> Any:
    settings = Settings(model_dir=small_loaded.model.path)
    kept = {
        "float16_table": small_loaded.float16_table,
        "float32_table": small_loaded.float32_table,
        **tables,
    }
    service = EmbeddingService(
        small_loaded.model, small_loaded.runtime.run, small_loaded.runtime.provider, settings,
        pad_row=small_loaded.pad_row, rows_per_request=True, observer=observer, **kept,
    )  # fmt: skip

    async def go() -> Any:
        try:
            output, ticket = await service.embed(request, None, answer_into=answer_into)
            ticket.release()
            return output
        finally:
            await service.close()

    return asyncio.run(go())


def ids_input(ids: np.ndarray, dtype: str, **extra: Any) -> EmbedInput:
    return EmbedInput(
        ids_dtype="int64", shape=tuple(ids.shape), data=ids.astype("<i8").tobytes(),
        output_dtype=dtype, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_large_rectangular_answer_is_written_where_the_caller_asked(
    small_loaded: LoadedModel, small_rows: np.ndarray, dtype: str
) -> None:
    ids = np.random.default_rng(1).integers(0, SMALL_V, (2, LARGE_TOKENS // 2 + 1))
    recorder, batches = Recorder(), BatchRecorder()
    output = embed(small_loaded, ids_input(ids, dtype), recorder, batches)
    [(shape, out_dtype, lengths, timings)] = recorder.calls
    assert (shape, out_dtype, lengths) == ((*ids.shape, SMALL_D), np.dtype(dtype), None)
    assert timings == Timings(0.0, 0.0, 1, ids.size)  # compute_s is measured afterwards
    assert output.hidden_states is recorder.arrays[0]
    np.testing.assert_array_equal(output.hidden_states, small_rows[ids].astype(dtype))
    assert output.timings.compute_s > 0
    assert (output.timings.batch_requests, output.timings.batch_tokens) == (1, ids.size)
    # As every float32 look-up, it counts as a batch (of one); float16 answers never do.
    want = [(1, ids.size, output.timings.compute_s)] if dtype == "float32" else []
    assert batches.done == want


def test_a_large_flat_ragged_answer_is_written_in_place_too(
    small_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    lengths = (LARGE_TOKENS - 5, 5)
    ids = np.random.default_rng(2).integers(0, SMALL_V, sum(lengths))
    recorder = Recorder()
    output = embed(small_loaded, ids_input(ids, "float32", lengths=lengths, layout=FLAT), recorder)
    assert [call[:3] for call in recorder.calls] == [((ids.size, SMALL_D), np.float32, lengths)]
    np.testing.assert_array_equal(output.hidden_states, small_rows[ids])
    assert output.lengths == lengths


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_large_padded_ragged_answer_is_written_in_place_rows_then_padding(
    small_loaded: LoadedModel, small_rows: np.ndarray, dtype: str
) -> None:
    lengths = (LARGE_TOKENS - 7, 7, 1)
    ids = np.random.default_rng(4).integers(0, SMALL_V, sum(lengths))
    recorder = Recorder()
    output = embed(small_loaded, ids_input(ids, dtype, lengths=lengths, layout=PADDED), recorder)
    assert [call[:3] for call in recorder.calls] == [
        ((3, lengths[0], SMALL_D), np.dtype(dtype), lengths)
    ]
    pad = small_rows[SMALL_PAD]
    offset = 0
    for index, length in enumerate(lengths):
        rows = output.hidden_states[index]
        np.testing.assert_array_equal(
            rows[:length], small_rows[ids[offset : offset + length]].astype(dtype)
        )
        np.testing.assert_array_equal(
            rows[length:], np.broadcast_to(pad.astype(dtype), rows[length:].shape)
        )
        offset += length


@pytest.mark.parametrize(
    ("why", "tokens", "tables"),
    [
        ("small answers are cheaper to copy", 64, {}),
        ("no table: onnxruntime computes", LARGE_TOKENS, {"float32_table": None}),
    ],
)
def test_other_answers_are_not_written_in_place_and_are_still_exact(
    small_loaded: LoadedModel, small_rows: np.ndarray, why: str, tokens: int, tables: Any
) -> None:
    ids = np.random.default_rng(3).integers(0, SMALL_V, (1, tokens))
    request = ids_input(ids, "float32")
    want = small_rows[ids]
    recorder = Recorder()
    output = embed(small_loaded, request, recorder, **tables)
    assert recorder.calls == [], why
    np.testing.assert_array_equal(output.hidden_states, want)


def test_no_look_up_once_the_deadline_has_passed(small_loaded: LoadedModel) -> None:
    ids = np.zeros((1, LARGE_TOKENS), dtype=np.int64)
    settings = Settings(model_dir=small_loaded.model.path)
    service = EmbeddingService(
        small_loaded.model, small_loaded.runtime.run, small_loaded.runtime.provider, settings,
        float32_table=small_loaded.float32_table,
    )  # fmt: skip
    recorder = Recorder()

    async def go() -> None:
        try:
            with pytest.raises(DeadlineExceeded, match="deadline passed before the look-up"):
                await service.embed(ids_input(ids, "float32"), 0.0, answer_into=recorder)
            # Nothing stays admitted.
            assert service.admission.inflight_output_bytes == 0
        finally:
            await service.close()

    asyncio.run(go())
    assert recorder.calls == []


class BrokenBatches(BatchRecorder):
    def batch_done(self, requests: int, tokens: int, compute_s: float) -> None:
        raise RuntimeError("metrics exploded")


def test_a_failing_batch_observer_does_not_fail_the_answer(
    small_loaded: LoadedModel, small_rows: np.ndarray, caplog: pytest.LogCaptureFixture
) -> None:
    ids = np.random.default_rng(5).integers(0, SMALL_V, (1, LARGE_TOKENS))
    output = embed(small_loaded, ids_input(ids, "float32"), Recorder(), BrokenBatches())
    np.testing.assert_array_equal(output.hidden_states, small_rows[ids])
    assert "batch observer failed; this is a bug" in caplog.text


class CountingHelper(GatherHelper):
    """A gather helper that counts the shares of work it took."""

    def __init__(self) -> None:
        super().__init__()
        self.shares = 0

    def try_submit(self, fn: Any, *args: object) -> Any:
        future = super().try_submit(fn, *args)
        self.shares += future is not None
        return future


class BusyHelper(GatherHelper):
    """A gather helper always busy with another gather."""

    def try_submit(self, fn: Any, *args: object) -> Any:
        return None


class FailingHelper(GatherHelper):
    """A gather helper whose share fails, after the caller's share had time to run."""

    def try_submit(self, fn: Any, *args: object) -> Any:
        def fail() -> None:
            time.sleep(0.05)
            raise RuntimeError("the helper's share failed")

        return super().try_submit(fail)


@pytest.mark.parametrize(
    ("lengths", "layout"),
    [
        (None, PADDED),  # rectangular: one piece, cut at its middle row
        ((300, 1, 77), FLAT),  # flat ragged: one piece too
        ((300, 1, 77, 5, 2), PADDED),  # padded: sequences dealt half and half, with pads
        ((9,), PADDED),  # a single sequence: cut in two, no pad rows
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_gather_shared_with_a_helper_writes_every_row_exactly(
    small_loaded: LoadedModel,
    small_rows: np.ndarray,
    lengths: tuple[int, ...] | None,
    layout: str,
    dtype: str,
) -> None:
    rng = np.random.default_rng(11)
    ids = rng.integers(0, SMALL_V, (2, 191) if lengths is None else sum(lengths))
    validated = validate(ids_input(ids, dtype, lengths=lengths, layout=layout), LIMITS)
    table = small_loaded.float32_table if dtype == "float32" else small_loaded.float16_table
    assert table is not None
    alone = np.full(_answer_shape(validated, SMALL_D), np.nan, dtype=dtype)
    shared = np.full_like(alone, np.nan)
    gather_into(table, validated, alone, small_loaded.pad_row)
    helper = CountingHelper()
    gather_into(table, validated, shared, small_loaded.pad_row, helper)
    helper.shutdown()
    assert helper.shares == 1
    assert not np.isnan(shared).any()  # every row was written
    np.testing.assert_array_equal(shared, alone)
    if lengths is None:
        np.testing.assert_array_equal(shared, small_rows[ids].astype(dtype))


def test_the_service_shares_large_gathers_and_they_stay_exact(
    small_loaded: LoadedModel, small_rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_module, "SPLIT_GATHER_MIN_BYTES", OFFLOAD_MIN_BYTES)
    shares: list[int] = []
    real = gather_module._split_in_two

    def counting(*args: Any) -> Any:
        shares.append(1)
        return real(*args)

    monkeypatch.setattr(gather_module, "_split_in_two", counting)
    ids = np.random.default_rng(12).integers(0, SMALL_V, (2, LARGE_TOKENS // 2 + 1))
    output = embed(small_loaded, ids_input(ids, "float32"), Recorder())
    np.testing.assert_array_equal(output.hidden_states, small_rows[ids])
    assert shares == [1]


def float32_answer_to_fill(ids: np.ndarray) -> tuple[EmbedJob, np.ndarray]:
    """The validated job for ``ids`` and a NaN-filled float32 answer to gather into."""
    validated = validate(ids_input(ids, "float32"), LIMITS)
    return validated, np.full(_answer_shape(validated, SMALL_D), np.nan, dtype=np.float32)


def test_a_busy_helper_leaves_the_whole_gather_to_the_caller(
    small_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    ids = np.random.default_rng(13).integers(0, SMALL_V, (3, 101))
    validated, out = float32_answer_to_fill(ids)
    assert small_loaded.float32_table is not None
    gather_into(small_loaded.float32_table, validated, out, small_loaded.pad_row, BusyHelper())
    np.testing.assert_array_equal(out, small_rows[ids])


def test_a_failing_helper_share_fails_the_gather_once_both_shares_are_over(
    small_loaded: LoadedModel, small_rows: np.ndarray
) -> None:
    ids = np.random.default_rng(14).integers(0, SMALL_V, (2, 100))
    validated, out = float32_answer_to_fill(ids)
    assert small_loaded.float32_table is not None
    helper = FailingHelper()
    with pytest.raises(RuntimeError, match="the helper's share failed"):
        gather_into(small_loaded.float32_table, validated, out, small_loaded.pad_row, helper)
    # The caller did its own share (the first half) before the failure reached it.
    np.testing.assert_array_equal(out[0], small_rows[ids[0]])
    helper.shutdown()


def test_the_helper_takes_one_share_at_a_time() -> None:
    helper = GatherHelper()
    release = threading.Event()
    first = helper.try_submit(release.wait)
    assert first is not None
    assert helper.try_submit(lambda: None) is None  # busy: the caller does it all
    release.set()
    first.result(timeout=5)
    again = helper.try_submit(lambda: None)  # free as soon as the first is done
    assert again is not None
    again.result(timeout=5)
    helper.shutdown()
