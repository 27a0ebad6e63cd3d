"""A seeded generator of Open Inference Protocol requests for the V2 fuzzer
(test_fuzz_v2.py): ModelInfer requests (for unary calls and for ModelStreamInfer items)
and system shared-memory calls, each valid with its exact answer, or with one defect and
the status it must get.

Each request starts from a valid one (ids inline, as typed contents, or read from a
registered region; rectangular or ragged; an answer datatype; sometimes the answer into a
region) and, for a bad one, has exactly one thing changed: a datatype, a shape, a
parameter, the number of inputs, a region's name, offset or size, the model, the size, or
its bytes. One defect a case makes the expected status exact. The regions the generator
names are the fuzzer's (``Layout``): it knows what each holds.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
from reliability_support import varint

from tokembed.v2 import grpc_service_pb2 as pb

from support.fixtures import SMALL_PAD, SMALL_V

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
OK = grpc.StatusCode.OK
REASONS = {INVALID: "invalid_input", NOT_FOUND: "not_found", EXHAUSTED: "too_large", OK: ""}

MODEL = "small"
# The fuzzed server's limits (test_fuzz_v2.py starts it so): 4096 tokens, 256 KiB of
# answer a request, and so this many bytes of request (Settings.max_request_bytes).
MAX_TOKENS = 4096
MAX_OUTPUT_BYTES = 256 * 1024
MAX_REQUEST_BYTES = MAX_TOKENS * (8 + 10) + (1 << 20)
D_MODEL = 64
FP32_TOKEN_LIMIT = MAX_OUTPUT_BYTES // (D_MODEL * 4)

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
ITEMSIZE = {"INT64": 8, "INT32": 4}
NUMPY = {"INT64": "<i8", "INT32": "<i4"}
ANSWER_ITEMSIZE = {"FP32": 4, "FP16": 2, "BF16": 2}
HUGE = [2**31, 2**32 + 1, 2**40, 2**53 + 1, 2**62, 2**63 - 1]


@dataclass(frozen=True)
class Layout:
    """The regions the fuzzer registers, and what they hold (the generator reads only
    these facts; the test makes the objects).

    ``in64``/``in32``: windows of int64 and int32 ids (``ids64``, ``ids32``: their
    contents, all within the vocabulary); ``lens``: a window of int64 lengths 1..8;
    ``big``: a window of ``big_bytes`` of zeros (a sparse object); an output slot's
    window is ``out_bytes`` (the test names the slot when it sends)."""

    in64: str
    in32: str
    lens: str
    big: str
    ids64: np.ndarray
    ids32: np.ndarray
    lens_values: np.ndarray
    big_bytes: int
    out_bytes: int
    prefix: str
    bad_keys: tuple[str, ...]  # keys under the prefix that name no usable object
    object_key: str  # a real object's key (registering a window of it is valid)
    object_bytes: int  # its size


@dataclass
class InferCase:
    """One ModelInferRequest: valid (``code`` OK: ``want`` is the answer's bytes, of
    ``shape`` and ``datatype``) or with one defect (``code``). ``message`` is sent
    serialized (``raw`` instead when the bytes themselves are the defect); ``slot``: the
    answer goes into an output slot the test names (``out_offset`` into its window)."""

    category: str
    code: grpc.StatusCode
    message: pb.ModelInferRequest | None = None
    raw: bytes | None = None
    want: bytes = b""
    shape: tuple[int, ...] = ()
    datatype: str = ""
    slot: bool = False
    out_offset: int = 0
    out_size: int = 0
    any_reason: bool = False  # the status without the server's reason is right too

    def wire(self, slot: str = "") -> bytes:
        if self.raw is not None:
            return self.raw
        assert self.message is not None
        if self.slot:
            output = self.message.outputs[0]
            output.parameters[REGION].string_param = slot
        return self.message.SerializeToString()

    @property
    def request_id(self) -> str:
        return self.message.id if self.message is not None else ""


@dataclass
class ShmCase:
    """One shared-memory call (``method``: SystemSharedMemoryRegister, Status or
    Unregister) as bytes, and the status it must get."""

    category: str
    method: str
    raw: bytes
    code: grpc.StatusCode


@dataclass
class Answers:
    """The model's answers: its reference rows in each V2 answer datatype (BF16 as the
    bits of torch's cast), ``[V, D]``."""

    rows: dict[str, np.ndarray]

    def of(self, datatype: str, ids: np.ndarray, lengths: list[int] | None, flat: bool) -> bytes:
        table = self.rows[datatype]
        if lengths is None or flat:
            return table[ids.reshape(-1)].tobytes()
        longest = max(lengths)
        out = np.empty((len(lengths), longest, table.shape[1]), table.dtype)
        start = 0
        for index, length in enumerate(lengths):
            out[index, :length] = table[ids[start : start + length]]
            out[index, length:] = table[SMALL_PAD]
            start += length
        return out.tobytes()


# --- parameters


def _string(value: str) -> pb.InferParameter:
    return pb.InferParameter(string_param=value)


def _int(value: int) -> pb.InferParameter:
    return pb.InferParameter(int64_param=value)


def _region_params(name: str, byte_size: int, offset: int | None) -> dict[str, pb.InferParameter]:
    params = {REGION: _string(name), BYTE_SIZE: _int(byte_size)}
    if offset is not None:
        params[OFFSET] = _int(offset)
    return params


def _ignored_parameters(rng: random.Random) -> dict[str, pb.InferParameter]:
    """Parameters no V2 server need understand (tritonclient sends some: priority,
    timeout); they change nothing."""
    if rng.random() < 0.7:
        return {}
    return {
        "priority": _int(rng.randint(0, 10)),
        "note": _string("".join(rng.choice("ab é漢") for _ in range(rng.randint(0, 8)))),
        "flag": pb.InferParameter(bool_param=rng.random() < 0.5),
    }


# --- valid requests


@dataclass
class _Good:
    message: pb.ModelInferRequest
    ids: np.ndarray  # flat
    lengths: list[int] | None
    datatype: str
    flat: bool
    shape: tuple[int, ...]
    ids_index: int  # input_ids' position among the inputs


def _good(rng: random.Random, layout: Layout, *, source: str = "", to_slot: bool = False) -> _Good:
    """A valid request: ids inline (``raw``), typed (``contents``) or from a region
    (``region``), rectangular or ragged, in any answer datatype."""
    source = source or rng.choices(["raw", "contents", "region"], [6, 2, 2])[0]
    ragged = rng.random() < 0.35
    id_type = rng.choice(["INT64", "INT32"])
    np_rng = np.random.default_rng(rng.getrandbits(32))
    message = pb.ModelInferRequest(
        model_name=rng.choice([MODEL, MODEL, ""]),
        model_version=rng.choice(["", "", "1"]),
        id=rng.choice(["", f"fz-{rng.getrandbits(32):x}", "漢字-é"]),
    )
    lengths: list[int] | None = None
    lengths_from_region = False
    if ragged:
        if source == "region" and rng.random() < 0.5:
            start = rng.randrange(len(layout.lens_values) - 8)
            lengths = layout.lens_values[start : start + rng.randint(1, 8)].tolist()
            lengths_from_region = True
            lens_offset = start * 8
        else:
            lengths = [rng.randint(1, 16) for _ in range(rng.randint(1, 8))]
        count = sum(lengths)
        shape: tuple[int, ...] = (count,)
    else:
        batch, seq = rng.randint(1, 4), rng.randint(1, 32)
        count = batch * seq
        shape = (batch, seq)
    ids_tensor = message.inputs.add(name="input_ids", datatype=id_type, shape=list(shape))
    raw_contents: list[bytes] = []
    if source == "region":
        pool = layout.ids64 if id_type == "INT64" else layout.ids32
        start = rng.randrange(len(pool) - count)
        ids = pool[start : start + count].astype(np.int64)
        name = layout.in64 if id_type == "INT64" else layout.in32
        itemsize = ITEMSIZE[id_type]
        offset = start * itemsize
        for key, value in _region_params(
            name, count * itemsize, offset if offset or rng.random() < 0.5 else None
        ).items():
            ids_tensor.parameters[key].CopyFrom(value)
    else:
        ids = np_rng.integers(0, SMALL_V, size=count).astype(np.int64)
        if rng.random() < 0.05:
            ids[rng.randrange(count)] = SMALL_V - 1  # the last row, and 0, the first
            ids[rng.randrange(count)] = 0
        if source == "contents":
            _set_contents(ids_tensor, ids.tolist())
        else:
            raw_contents.append(ids.astype(NUMPY[id_type]).tobytes())
    if lengths is not None:
        length_type = rng.choice(["INT64", "INT32"]) if not lengths_from_region else "INT64"
        lengths_tensor = message.inputs.add(
            name="lengths", datatype=length_type, shape=[len(lengths)]
        )
        if lengths_from_region:
            for key, value in _region_params(layout.lens, len(lengths) * 8, lens_offset).items():
                lengths_tensor.parameters[key].CopyFrom(value)
        elif source == "raw":
            raw_contents.append(np.asarray(lengths, dtype=NUMPY[length_type]).tobytes())
        else:  # typed; beside ids from a region too (raw contents would need one per input)
            _set_contents(lengths_tensor, lengths)
    ids_index = 0
    if lengths is not None and rng.random() < 0.5:  # the inputs in either order
        ids_copy, lengths_copy = (pb.ModelInferRequest.InferInputTensor() for _ in range(2))
        ids_copy.CopyFrom(message.inputs[0])
        lengths_copy.CopyFrom(message.inputs[1])
        del message.inputs[:]
        message.inputs.extend([lengths_copy, ids_copy])
        raw_contents.reverse()
        ids_index = 1
    message.raw_input_contents.extend(raw_contents)

    datatype = rng.choice(["", "FP32", "FP16", "BF16"])
    where = rng.choice(["request", "output"])
    flat = False
    if lengths is not None:
        flat = rng.random() < 0.4
        if flat or rng.random() < 0.3:
            spelled = rng.choice(["flat", "FLAT", "Flat"] if flat else ["padded", "PADDED"])
            message.parameters["ragged_layout"].CopyFrom(_string(spelled))
    elif rng.random() < 0.1:  # the layout only shapes ragged answers: ignored here
        message.parameters["ragged_layout"].CopyFrom(_string(rng.choice(["flat", "padded"])))
    for key, value in _ignored_parameters(rng).items():
        message.parameters[key].CopyFrom(value)
    if to_slot or (datatype and where == "output") or rng.random() < 0.2:
        output = message.outputs.add(name="hidden_states")
        if datatype and where == "output":
            output.parameters["datatype"].CopyFrom(_string(datatype))
    if datatype and (where == "request" or not message.outputs):
        message.parameters["datatype"].CopyFrom(_string(datatype))
    answer_type = datatype or "FP32"
    if lengths is None:
        answer_shape: tuple[int, ...] = (*shape, D_MODEL)
    elif flat:
        answer_shape = (count, D_MODEL)
    else:
        answer_shape = (len(lengths), max(lengths), D_MODEL)
    return _Good(message, ids, lengths, answer_type, flat, answer_shape, ids_index)


def good_case(rng: random.Random, layout: Layout, answers: Answers, *, unary: bool) -> InferCase:
    """A valid request and its exact answer; unary ones sometimes answered into a slot."""
    to_slot = unary and rng.random() < 0.2
    good = _good(rng, layout, to_slot=to_slot)
    want = answers.of(good.datatype, good.ids, good.lengths, good.flat)
    case = InferCase("valid", OK, good.message, want=want, shape=good.shape, datatype=good.datatype)
    if to_slot:
        case.slot = True
        case.out_size = len(want) + rng.choice([0, 0, 8, 1000])
        room = layout.out_bytes - case.out_size
        case.out_offset = rng.choice([0, 0, rng.randrange(0, room + 1) // 8 * 8])
        output = good.message.outputs[0]
        output.parameters[BYTE_SIZE].CopyFrom(_int(case.out_size))
        if case.out_offset or rng.random() < 0.5:
            output.parameters[OFFSET].CopyFrom(_int(case.out_offset))
    return case


# --- one defect each


def _bad(category: str, message: pb.ModelInferRequest, code: grpc.StatusCode) -> InferCase:
    return InferCase(category, code, message)


def _set_contents(tensor: pb.ModelInferRequest.InferInputTensor, values: list[int]) -> None:
    """The tensor's typed contents: int64_contents for INT64, int_contents for INT32."""
    contents = tensor.contents
    (contents.int64_contents if tensor.datatype == "INT64" else contents.int_contents).extend(
        values
    )


def _ids_tensor(good: _Good) -> pb.ModelInferRequest.InferInputTensor:
    return good.message.inputs[good.ids_index]


def _inline(rng: random.Random, layout: Layout) -> _Good:
    return _good(rng, layout, source=rng.choice(["raw", "contents"]))


def bad_datatype(rng: random.Random, layout: Layout) -> InferCase:
    good = _good(rng, layout)
    wrong = ["FP32", "FP16", "BF16", "BYTES", "INT8", "INT16", "UINT64", "UINT32", "BOOL", "",
             "int64", "Int32", "INT 64", "INT64\x00", "漢"]  # fmt: skip
    tensor = good.message.inputs[rng.randrange(len(good.message.inputs))]
    tensor.datatype = rng.choice(wrong)
    return _bad("datatype", good.message, INVALID)


def bad_shape(rng: random.Random, layout: Layout) -> InferCase:
    good = _inline(rng, layout)
    tensor = _ids_tensor(good)
    shape = list(tensor.shape)
    choice = rng.randrange(6)
    if choice == 0:  # a shape whose product is not the number of ids
        shape[rng.randrange(len(shape))] += rng.choice([1, 2, 7])
    elif choice == 1:  # a negative dimension
        shape[rng.randrange(len(shape))] = rng.choice([-1, -(2**31), -(2**63)])
    elif choice == 2:  # huge dimensions, tiny data
        shape = [rng.choice(HUGE) for _ in shape]
    elif choice == 3 and good.lengths is None:  # not [B, S]
        shape = rng.choice([[int(np.prod(shape))], [1, *shape], [*shape, 1], []])
    elif choice == 4 and good.lengths is None:  # empty
        shape = rng.choice([[0, shape[1]], [shape[0], 0], [0, 0]])
        del tensor.contents.int64_contents[:]
        del tensor.contents.int_contents[:]
        if good.message.raw_input_contents:
            good.message.raw_input_contents[good.ids_index] = b""
    elif good.lengths is not None:  # ragged ids declared [B, S]
        shape = [1, shape[0]]
    else:  # data a few bytes long or short
        data = bytes(good.message.raw_input_contents[0]) if good.message.raw_input_contents else b""
        if not data:
            shape[0] += 1
        else:
            cut = rng.randint(1, 7)
            grown = data + rng.randbytes(cut)
            good.message.raw_input_contents[0] = grown if rng.random() < 0.5 else data[:-cut]
    del tensor.shape[:]
    tensor.shape.extend(shape)
    return _bad("shape", good.message, INVALID)


def bad_ids(rng: random.Random, layout: Layout) -> InferCase:
    good = _good(rng, layout, source="raw")
    tensor = _ids_tensor(good)
    outside = [-1, SMALL_V, SMALL_V + 1, -rng.randint(2, 10**6), SMALL_V + rng.randint(2, 10**6)]
    if tensor.datatype == "INT64":
        outside += [2**63 - 1, -(2**63)]
    else:
        outside += [2**31 - 1, -(2**31)]
    ids = good.ids.copy()
    for _ in range(rng.randint(1, 3)):
        ids[rng.randrange(ids.size)] = rng.choice(outside)
    good.message.raw_input_contents[good.ids_index] = ids.astype(NUMPY[tensor.datatype]).tobytes()
    return _bad("ids", good.message, INVALID)


def bad_lengths(rng: random.Random, layout: Layout) -> InferCase:
    good = _good(rng, layout, source="raw")
    while good.lengths is None:
        good = _good(rng, layout, source="raw")
    tensor = good.message.inputs[1 - good.ids_index]
    lengths = list(good.lengths)
    itemsize = ITEMSIZE[tensor.datatype]
    choice = rng.randrange(5)
    if choice == 0:  # lengths that do not sum to the ids
        lengths[rng.randrange(len(lengths))] += rng.choice([1, 3])
    elif choice == 1:  # a length of zero or less
        lengths[rng.randrange(len(lengths))] = rng.choice([0, -1, -5])
    elif choice == 2:  # a [B] that is not 1-D, or empty
        del tensor.shape[:]
        tensor.shape.extend(rng.choice([[1, len(lengths)], [], [0]]))
        if list(tensor.shape) == [0]:
            lengths = []
    elif choice == 3:  # data that does not fill the shape
        raw = np.asarray(lengths, dtype=NUMPY[tensor.datatype]).tobytes()
        good.message.raw_input_contents[1 - good.ids_index] = raw[: -rng.randint(1, itemsize)]
        return _bad("lengths", good.message, INVALID)
    else:
        tensor.datatype = rng.choice(["FP32", "UINT8", "BYTES"])
    raw = np.asarray(lengths, dtype=NUMPY.get(tensor.datatype, "<i8")).tobytes()
    good.message.raw_input_contents[1 - good.ids_index] = raw
    return _bad("lengths", good.message, INVALID)


def bad_parameters(rng: random.Random, layout: Layout) -> InferCase:
    good = _good(rng, layout)
    message = good.message
    choice = rng.randrange(6)
    if choice == 0:  # an answer datatype not served
        value = _string(rng.choice(["FP64", "INT64", "fp32", "FP8", "BYTES", "float32", "漢"]))
    elif choice == 1:  # the datatype not a string
        value = rng.choice([_int(1), pb.InferParameter(bool_param=True),
                            pb.InferParameter(double_param=1.5)])  # fmt: skip
    else:
        value = None
    if value is not None:
        del message.outputs[:]
        if rng.random() < 0.5:
            message.parameters["datatype"].CopyFrom(value)
        else:
            message.outputs.add(name="hidden_states").parameters["datatype"].CopyFrom(value)
            if "datatype" in message.parameters:
                del message.parameters["datatype"]
    elif choice == 2:  # a ragged layout that does not exist (read for every request)
        message.parameters["ragged_layout"].CopyFrom(
            _string(rng.choice(["diagonal", "", " flat", "padded\n", "sparse"]))
            if rng.random() < 0.7 else _int(1)
        )  # fmt: skip
        if message.parameters["ragged_layout"].string_param == "":
            message.parameters["ragged_layout"].CopyFrom(_string("none"))
    elif choice == 3:  # an output the model does not have
        message.outputs.add(name=rng.choice(["logits", "", "hidden_state", "HIDDEN_STATES"]))
    elif choice == 4:  # a datatype parameter on an output of another name
        message.outputs.add(name="embeddings").parameters["datatype"].CopyFrom(_string("FP16"))
    else:  # the region parameter that is not a string
        tensor = message.inputs[rng.randrange(len(message.inputs))]
        tensor.parameters[REGION].CopyFrom(_int(rng.randint(0, 9)))
        tensor.parameters[BYTE_SIZE].CopyFrom(_int(8))
    return _bad("parameters", message, INVALID)


def bad_input_count(rng: random.Random, layout: Layout) -> InferCase:
    good = _inline(rng, layout)
    message = good.message
    choice = rng.randrange(6)
    if choice == 0:  # no input_ids (renamed), or no input at all
        if rng.random() < 0.3:
            del message.inputs[:]
            del message.raw_input_contents[:]
        else:
            _ids_tensor(good).name = rng.choice(["input_id", "INPUT_IDS", "", "ids", " input_ids"])
    elif choice == 1:  # input_ids twice
        twin = message.inputs.add()
        twin.CopyFrom(_ids_tensor(good))
        if message.raw_input_contents:
            message.raw_input_contents.append(message.raw_input_contents[good.ids_index])
    elif choice == 2:  # raw contents for some inputs only, or one too many
        if message.raw_input_contents and rng.random() < 0.5:
            message.raw_input_contents.append(rng.randbytes(8))
        elif message.raw_input_contents:
            del message.raw_input_contents[-1]
            if not message.raw_input_contents:
                message.raw_input_contents.append(b"")
                message.inputs.add(name="x", datatype="INT64", shape=[0])
        else:
            message.raw_input_contents.append(good.ids.astype("<i8").tobytes())
            message.raw_input_contents.append(b"")
    elif choice == 3:  # both typed and raw contents
        tensor = _ids_tensor(good)
        if message.raw_input_contents:
            tensor.contents.int64_contents.append(1)
            tensor.contents.int_contents.append(1)
        else:
            for tensor in message.inputs:
                data = np.zeros(1, dtype=NUMPY[tensor.datatype]).tobytes()
                message.raw_input_contents.append(data)
    elif choice == 4:  # inputs the model does not take, inline
        for index in range(rng.randint(1, 6)):
            extra = message.inputs.add(
                name=rng.choice([f"x{index}", "token_type_ids", "attention_mask", f"漢{index}"]),
                datatype="INT64",
                shape=list(_ids_tensor(good).shape),
            )
            data = np.zeros(good.ids.size, dtype="<i8").tobytes()
            if message.raw_input_contents:
                message.raw_input_contents.append(data)
            else:
                extra.contents.int64_contents.extend([0] * good.ids.size)
    else:  # many inputs the model does not take, each read from a large region
        for index in range(rng.randint(2, 12)):
            extra = message.inputs.add(name=f"x{index}", datatype="INT64", shape=[1, 1])
            size = rng.randrange(8, MAX_REQUEST_BYTES + 1, 8)
            for key, value in _region_params(layout.big, size, 0).items():
                extra.parameters[key].CopyFrom(value)
        if message.raw_input_contents:  # one raw content per input, or none: move them
            for tensor, data in zip(message.inputs, list(message.raw_input_contents), strict=False):
                _set_contents(tensor, np.frombuffer(data, dtype=NUMPY[tensor.datatype]).tolist())
            del message.raw_input_contents[:]
    return _bad("input_count", message, INVALID)


def bad_region_input(rng: random.Random, layout: Layout) -> InferCase:
    good = _good(rng, layout, source="region")
    tensor = _ids_tensor(good)
    params = tensor.parameters
    size = params[BYTE_SIZE].int64_param
    window = (len(layout.ids64) * 8) if tensor.datatype == "INT64" else len(layout.ids32) * 4
    choice = rng.randrange(8)
    if choice == 0:  # a region not registered
        params[REGION].CopyFrom(_string(rng.choice(
            ["nope", "", layout.in64 + "x", layout.in64.upper(), "漢字", "a" * 300, "../in"]
        )))  # fmt: skip
    elif choice == 1:  # the byte size missing
        del params[BYTE_SIZE]
    elif choice == 2:  # a size or offset that is not an integer
        name = rng.choice([BYTE_SIZE, OFFSET])
        params[name].CopyFrom(rng.choice([_string("8"), pb.InferParameter(bool_param=True),
                                          pb.InferParameter(double_param=8.0)]))  # fmt: skip
    elif choice == 3:  # outside the window
        offset = rng.choice([window - size + rng.randint(1, 64), window, 2**62, 2**63 - 1])
        params[OFFSET].CopyFrom(
            pb.InferParameter(uint64_param=2**64 - 1) if rng.random() < 0.2 else _int(offset)
        )
    elif choice == 4:  # a negative offset, a size of zero or less
        if rng.random() < 0.5:
            params[OFFSET].CopyFrom(_int(rng.choice([-1, -8, -(2**63)])))
        else:
            params[BYTE_SIZE].CopyFrom(_int(rng.choice([0, -1, -(2**63)])))
    elif choice == 5:  # a size the shape does not need (within the window)
        delta = rng.choice([-8, 8, 16]) if size > 8 else 8
        offset = params[OFFSET].int64_param if OFFSET in params else 0
        if offset + size + delta > window:
            delta = -4 if size > 4 else 4
            params[OFFSET].CopyFrom(_int(0))
        params[BYTE_SIZE].CopyFrom(_int(size + delta))
    elif choice == 6:  # more than a request may carry
        params[REGION].CopyFrom(_string(layout.big))
        params[BYTE_SIZE].CopyFrom(_int(rng.randint(MAX_REQUEST_BYTES + 1, layout.big_bytes)))
        params[OFFSET].CopyFrom(_int(0))
    else:  # a region and raw contents too
        data = good.ids.astype(NUMPY[tensor.datatype]).tobytes()
        del good.message.raw_input_contents[:]
        for index, other in enumerate(good.message.inputs):
            if index == good.ids_index:
                good.message.raw_input_contents.append(data)
            else:
                values = list(other.contents.int64_contents or other.contents.int_contents)
                other.ClearField("contents")
                other.ClearField("parameters")
                good.message.raw_input_contents.append(
                    np.asarray(values or [1], dtype=NUMPY[other.datatype]).tobytes()
                )
    return _bad("region_input", good.message, INVALID)


def bad_region_output(rng: random.Random, layout: Layout) -> InferCase:
    """Unary only: an output window that cannot be had, or that the answer does not fit."""
    good = _inline(rng, layout)
    message = good.message
    del message.outputs[:]
    output = message.outputs.add(name="hidden_states")
    answer_bytes = int(np.prod(good.shape)) * ANSWER_ITEMSIZE[good.datatype]
    if good.datatype != "FP32" and "datatype" not in message.parameters:
        message.parameters["datatype"].CopyFrom(_string(good.datatype))
    choice = rng.randrange(4)
    case = InferCase("region_output", INVALID, message, slot=True)
    if choice == 0:  # too small for the answer
        output.parameters[BYTE_SIZE].CopyFrom(_int(rng.randint(1, answer_bytes - 1)))
    elif choice == 1:  # outside the window
        output.parameters[BYTE_SIZE].CopyFrom(_int(answer_bytes))
        output.parameters[OFFSET].CopyFrom(
            _int(rng.choice([layout.out_bytes, layout.out_bytes - answer_bytes + 8, -8, 2**63 - 1]))
        )
    elif choice == 2:  # a region not registered (no slot)
        case.slot = False
        output.parameters[REGION].CopyFrom(_string(rng.choice(["nope", "", "out", "漢"])))
        output.parameters[BYTE_SIZE].CopyFrom(_int(answer_bytes))
    else:  # the size not an integer, or missing
        if rng.random() < 0.5:
            output.parameters[BYTE_SIZE].CopyFrom(_string(str(answer_bytes)))
    return case


def unknown_model(rng: random.Random, layout: Layout) -> InferCase:
    good = _good(rng, layout)
    if rng.random() < 0.5:
        alphabet = string.ascii_letters + string.digits + "-_./ :é漢\u200b"
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        good.message.model_name = name if name != MODEL else name + "x"
    else:
        good.message.model_name = MODEL
        good.message.model_version = rng.choice(["2", "0", "latest", "-1", "1 ", "9" * 30])
    return _bad("unknown_model", good.message, NOT_FOUND)


def oversized(rng: random.Random) -> InferCase:
    """A request of more bytes than the largest valid one (unary only: gRPC may refuse it
    itself, on its receive limit, which would end a whole stream; then the status has no
    tokembed-error-reason)."""
    data = rng.randbytes(64) * ((MAX_REQUEST_BYTES + rng.randint(1, 4096)) // 64 + 1)
    message = pb.ModelInferRequest(model_name=MODEL)
    message.inputs.add(name="input_ids", datatype="INT64", shape=[1, len(data) // 8])
    message.raw_input_contents.append(data)
    return InferCase("oversized", EXHAUSTED, message, any_reason=True)


def too_large(rng: random.Random, layout: Layout) -> InferCase:
    """Over a limit: tokens, or answer bytes (in float32)."""
    if rng.random() < 0.5:
        tokens = rng.randint(MAX_TOKENS + 1, MAX_TOKENS + 1000)
    else:
        tokens = rng.randint(FP32_TOKEN_LIMIT + 1, MAX_TOKENS)
    message = pb.ModelInferRequest(model_name=MODEL)
    message.inputs.add(name="input_ids", datatype="INT64", shape=[1, tokens])
    message.raw_input_contents.append(np.ones(tokens, dtype="<i8").tobytes())
    return InferCase("too_large", EXHAUSTED, message)


def _corrupt(rng: random.Random) -> bytes:
    field_number = rng.randint(1, 8)
    choice = rng.randrange(7)
    if choice == 0:  # wire types 6 and 7 do not exist
        return bytes([field_number << 3 | rng.choice([6, 7])]) + rng.randbytes(rng.randint(0, 4))
    if choice == 1:  # a length that runs past the end
        body = rng.randbytes(rng.randint(0, 16))
        return bytes([field_number << 3 | 2]) + varint(len(body) + rng.randint(1, 2**20)) + body
    if choice == 2:  # a varint cut short, or of more than 10 bytes
        return bytes([field_number << 3]) + b"\xff" * rng.choice([1, 5, 12, 20])
    if choice == 3:  # a string (model_name, model_version, id) that is not UTF-8
        junk = rng.choice([b"\xc3\x28", b"\xed\xa0\x80", b"\xff\xfe", b"a\x80b"])
        return bytes([rng.choice([1, 2, 3]) << 3 | 2]) + varint(len(junk)) + junk
    if choice == 4:  # the same inside an input tensor (its name)
        junk = b"\xff\xfe\xfd"
        inner = b"\x0a" + varint(len(junk)) + junk
        return b"\x2a" + varint(len(inner)) + inner
    if choice == 5:  # a group opened and never closed
        return bytes([field_number << 3 | 3])
    return bytes([0, 1])  # field number 0


def _parses(raw: bytes, message: type) -> bool:
    try:
        message.FromString(raw)
    except Exception:
        return False
    return True


def malformed(rng: random.Random, layout: Layout) -> InferCase:
    for _ in range(100):
        if rng.random() < 0.3:
            raw = rng.randbytes(rng.randint(1, 256))
        else:
            prefix = _good(rng, layout, source="raw").message.SerializeToString()
            raw = prefix[: rng.randrange(len(prefix) + 1)] if rng.random() < 0.3 else prefix
            raw += _corrupt(rng)
        if not _parses(raw, pb.ModelInferRequest):
            return InferCase("malformed", INVALID, raw=raw)
    raise AssertionError("the generator made no malformed bytes in 100 tries")


BAD_INFER: dict[str, Callable[[random.Random, Layout], InferCase]] = {
    "datatype": bad_datatype,
    "shape": bad_shape,
    "ids": bad_ids,
    "lengths": bad_lengths,
    "parameters": bad_parameters,
    "input_count": bad_input_count,
    "region_input": bad_region_input,
    "region_output": bad_region_output,
    "unknown_model": unknown_model,
    "too_large": too_large,
    "malformed": malformed,
}


def infer_case(rng: random.Random, layout: Layout, answers: Answers, *, unary: bool) -> InferCase:
    """A valid request half the time, else one of the bad categories in equal shares (a
    stream's output into a region is refused: a bad case there)."""
    if rng.random() < 0.5:
        return good_case(rng, layout, answers, unary=unary)
    category = rng.choice(list(BAD_INFER))
    if unary and category == "too_large" and rng.random() < 0.1:  # a megabyte each: rare
        return oversized(rng)
    case = BAD_INFER[category](rng, layout)
    if not unary and case.slot:  # a stream never names an output slot: name a region
        case.slot = False
        assert case.message is not None
        case.message.outputs[0].parameters[REGION].CopyFrom(_string(layout.lens))
    return case


def stream_slot_case(rng: random.Random, layout: Layout, answers: Answers) -> InferCase:
    """A valid request asking for its answer in a region, sent in a stream: refused there
    (a stream answers in its messages), with no write into the region."""
    case = good_case(rng, layout, answers, unary=False)
    assert case.message is not None
    del case.message.outputs[:]
    output = case.message.outputs.add(name="hidden_states")
    output.parameters[REGION].CopyFrom(_string(layout.lens))
    output.parameters[BYTE_SIZE].CopyFrom(_int(8))
    return InferCase("stream_region_output", INVALID, case.message)


# --- shared-memory calls


def _register(name: str, key: str, offset: int, byte_size: int) -> bytes:
    return pb.SystemSharedMemoryRegisterRequest(
        name=name, key=key, offset=offset, byte_size=byte_size
    ).SerializeToString()


def register_case(rng: random.Random, layout: Layout) -> ShmCase:
    """A registration with one defect (the valid ones are the test's, named fresh)."""
    key, name = layout.object_key, f"bad{rng.getrandbits(32):x}"
    offset, size = 0, layout.object_bytes
    choice = rng.randrange(7)
    if choice == 0:  # a name empty, too long, or registered already
        name = rng.choice(["", "n" * 257, layout.in64, layout.lens])
    elif choice == 1:  # a key outside the prefix, or not a POSIX object name
        key = rng.choice([
            "", "noslash", "/", "/other", f"{layout.prefix}x", f"/{layout.prefix}/x",
            f"/{layout.prefix}..x", f"/{layout.prefix} x", f"/{layout.prefix}é",
            f"/{layout.prefix}" + "a" * 300, f"//{layout.prefix}x", f"/../{layout.prefix}",
            "/dev/shm/" + layout.prefix, f"/{layout.prefix}\x00x", f"/{layout.prefix}\nx",
        ])  # fmt: skip
    elif choice == 2:  # under the prefix, but no object, a directory, a FIFO, a link
        key = rng.choice(layout.bad_keys)
    elif choice == 3:  # past the end of the object
        offset = rng.choice([1, 8, layout.object_bytes])
    elif choice == 4:  # a size of zero, or sizes that would wrap a 64-bit sum
        offset, size = rng.choice([(0, 0), (2**63, 2**63), (2**64 - 1, 1), (1, 2**64 - 1)])
    elif choice == 5:  # larger than the object
        size = layout.object_bytes + rng.choice([1, 4096, 2**40])
    else:
        raw = _malformed_of(rng, pb.SystemSharedMemoryRegisterRequest)
        return ShmCase("register", "SystemSharedMemoryRegister", raw, INVALID)
    return ShmCase(
        "register", "SystemSharedMemoryRegister", _register(name, key, offset, size), INVALID
    )


def status_or_unregister_case(rng: random.Random, layout: Layout) -> ShmCase:
    """Status of a region not registered (INVALID_ARGUMENT), unregistering one (OK: it
    is idempotent), or either's malformed bytes. Never an unregistration of every region
    (the name "") while the fuzz runs."""
    name = rng.choice(["nope", f"gone{rng.getrandbits(16)}", "漢字", "a" * 300, " ", "\x00"])
    choice = rng.randrange(4)
    if choice == 0:
        raw = pb.SystemSharedMemoryStatusRequest(name=name).SerializeToString()
        return ShmCase("status", "SystemSharedMemoryStatus", raw, INVALID)
    if choice == 1:
        raw = pb.SystemSharedMemoryUnregisterRequest(name=name).SerializeToString()
        return ShmCase("unregister", "SystemSharedMemoryUnregister", raw, OK)
    if choice == 2:
        raw = _malformed_of(rng, pb.SystemSharedMemoryStatusRequest)
        return ShmCase("status", "SystemSharedMemoryStatus", raw, INVALID)
    raw = _malformed_of(rng, pb.SystemSharedMemoryUnregisterRequest)
    return ShmCase("unregister", "SystemSharedMemoryUnregister", raw, INVALID)


def _malformed_of(rng: random.Random, message: type) -> bytes:
    for _ in range(100):
        raw = rng.choice([b"", b"\x0a\x03ab"]) + _corrupt(rng)
        if not _parses(raw, message):
            return raw
    raise AssertionError("the generator made no malformed bytes in 100 tries")
