"""AnswerArrays: EmbedChunked's answer arrays, reused only once nobody holds them."""

from __future__ import annotations

import numpy as np

from tokembed.server.answer_arrays import KEEP_BELOW_BYTES, AnswerArrays


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_an_answer_has_the_shape_and_dtype_asked_for_and_can_be_written() -> None:
    arrays = AnswerArrays()
    answer = arrays.take((2, 3, 4), np.dtype(np.float16))
    assert answer.shape == (2, 3, 4) and answer.dtype == np.float16
    answer[...] = np.arange(24).reshape(2, 3, 4)
    assert answer[1, 2, 3] == 23
    assert arrays.held_bytes == 48


def test_a_free_array_is_filled_again_for_the_next_answer_of_its_size() -> None:
    arrays = AnswerArrays()
    first = arrays.take((4, 8), np.dtype(np.float32))
    address = _address(first)
    del first  # the answer was sent
    again = arrays.take((2, 16), np.dtype(np.float32))  # another shape, the same bytes
    assert _address(again) == address
    assert arrays.held_bytes == 128
    # Another dtype of the same size is the same bytes too.
    del again
    assert _address(arrays.take((8, 8), np.dtype(np.float16))) == address


def test_an_array_still_read_through_any_view_is_not_reused() -> None:
    arrays = AnswerArrays()
    answer = arrays.take((4, 8), np.dtype(np.float32))
    chunk = answer.data.cast("B")[0:64]  # a chunk being sent
    row = answer[1]  # a view into the answer
    address = _address(answer)
    del answer
    second = arrays.take((4, 8), np.dtype(np.float32))
    assert _address(second) != address  # the chunk still reads the first
    del chunk
    third = arrays.take((4, 8), np.dtype(np.float32))
    assert _address(third) != address  # and the row still does
    del row
    # Now the first is free: the next answer (the second and third still held) gets it.
    assert _address(arrays.take((4, 8), np.dtype(np.float32))) == address
    assert arrays.held_bytes == 3 * 128


def test_free_arrays_of_another_size_are_let_go_before_a_new_one_is_made() -> None:
    arrays = AnswerArrays()
    small_in_use = arrays.take((4,), np.dtype(np.float32))
    small_free = arrays.take((4,), np.dtype(np.float32))
    del small_free
    large = arrays.take((64,), np.dtype(np.float32))
    # The free small one went; the one in use stays (it cannot be taken from its reader).
    assert arrays.held_bytes == 16 + 256
    del small_in_use, large


def test_release_idle_lets_go_only_of_free_arrays_no_answer_took_since_the_last_call() -> None:
    arrays = AnswerArrays()
    in_use = arrays.take((8,), np.dtype(np.float32))
    free = arrays.take((8,), np.dtype(np.float32))
    del free
    arrays.release_idle()  # both were taken since the last call: both stay
    assert arrays.held_bytes == 64
    arrays.release_idle()  # the free one was not taken again: it goes; the other is in use
    assert arrays.held_bytes == 32
    in_use[...] = 1.0  # still ours to write
    del in_use
    arrays.release_idle()
    assert arrays.held_bytes == 0


def test_an_array_in_steady_use_stays_across_release_idle() -> None:
    arrays = AnswerArrays()
    address = _address(arrays.take((8,), np.dtype(np.float32)))
    for _ in range(3):
        arrays.release_idle()
        assert _address(arrays.take((8,), np.dtype(np.float32))) == address


def test_release_lets_go_of_free_arrays_and_keeps_those_in_use() -> None:
    arrays = AnswerArrays()
    in_use = arrays.take((8,), np.dtype(np.float32))
    arrays.take((8,), np.dtype(np.float32))  # dropped at once: free
    arrays.release()
    assert arrays.held_bytes == 32
    del in_use
    arrays.release()
    assert arrays.held_bytes == 0


def test_answers_of_the_mmap_threshold_and_up_are_neither_kept_nor_reused() -> None:
    arrays = AnswerArrays()
    large = arrays.take((KEEP_BELOW_BYTES // 4,), np.dtype(np.float32))
    assert large.shape == (KEEP_BELOW_BYTES // 4,) and arrays.held_bytes == 0
    below = arrays.take((KEEP_BELOW_BYTES // 4 - 1,), np.dtype(np.float32))
    assert arrays.held_bytes == KEEP_BELOW_BYTES - 4
    del large, below


def test_the_rules_hold_on_this_interpreter() -> None:
    # Checked once at import; where it fails, the server keeps no arrays (no reuse at all).
    assert AnswerArrays.reusable()
