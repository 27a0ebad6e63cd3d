"""Answers in the forms the LLM engines take, written once for both clients.

- ``as_torch``: the answer as a torch tensor over the same bytes (no copy), for
  transformers' ``inputs_embeds``; bfloat16 answers become ``torch.bfloat16`` tensors.
- ``vllm_prompt_embeds``: vLLM's ``prompt_embeds`` (``--enable-prompt-embeds``; its
  completions API): base64 of ``torch.save`` of a ``[S, hidden]`` tensor in the dtype
  asked (float32, bfloat16 or float16), as vLLM's ``safe_load_prompt_embeds``
  (``vllm/renderers/embed_utils.py``) decodes it.
- ``sglang_input_embeds``: SGLang's ``input_embeds`` (``GenerateReqInput`` in
  ``python/sglang/srt/managers/io_struct.py``: ``List[List[float]]`` for one prompt),
  JSON-ready nested lists of ``[S, hidden]`` floats.

``scale_for`` says what to multiply the served vectors by for an engine: a model exported
with ``--from-pretrained`` records, by engine, the scale its ``inputs_embeds`` expects on
the table's rows (``ModelInfo.engine_scales``; SGLang's Gemma and Gemma 2 multiply by
sqrt(hidden) after taking it, transformers' and vLLM 0.34.0's before).

torch is the client's optional extra: imported in the functions that need it, never
with this module.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from tokembed.client.errors import UnknownConventionError, client_invalid_input
from tokembed.client.results import ModelInfo

if TYPE_CHECKING:
    # The one name of torch the client's signatures use (``embed_torch``'s answer); at run
    # time torch is imported by ``_torch`` alone, when a torch answer is asked for.
    from typing import TypeAlias

    import torch

    TorchTensor: TypeAlias = torch.Tensor

VLLM, SGLANG = "vllm", "sglang"
# The dtypes vLLM accepts in a prompt_embeds tensor (its safe_load_prompt_embeds).
VLLM_DTYPES = ("float32", "bfloat16", "float16")


def _torch() -> Any:
    """torch, or a ModuleNotFoundError that says how to install it (the client runs
    without it; only torch answers need it)."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "torch answers (embed_torch, vllm_prompt_embeds) need torch, which is not "
            "installed: pip install torch --extra-index-url https://download.pytorch.org/whl/cpu",
            name="torch",
        ) from exc
    return torch


def as_torch(array: npt.NDArray[Any]) -> TorchTensor:
    """``array`` (float32, float16 or bfloat16) as a torch tensor over the same memory.

    The client's answers are read-only views of the received bytes: so is the tensor
    (torch does not mark tensors read-only; writing to it is undefined). ``.clone()`` it to
    write. DLPack carries the read-only flag that ``torch.from_numpy`` would warn about.
    """
    torch = _torch()
    from_dlpack: Callable[[Any], TorchTensor] = torch.from_dlpack
    if array.dtype == ml_dtypes.bfloat16:
        # numpy knows no bfloat16 of its own: its 16 bits, viewed as torch's bfloat16.
        return from_dlpack(array.view(np.int16)).view(torch.bfloat16)
    if array.dtype not in (np.float32, np.float16):
        raise client_invalid_input(
            f"expected a float32, float16 or bfloat16 answer, got {array.dtype}"
        )
    return from_dlpack(array)


def scale_for(info: ModelInfo, engine: str) -> float:
    """What to multiply ``info``'s served vectors by for ``engine`` ("vllm", "sglang",
    "transformers"): 1.0 for a model exported without ``--from-pretrained`` (its vectors
    are what its export was told to compute); ``UnknownConventionError`` for an
    architecture that records no convention for ``engine``."""
    if not info.architecture:
        return 1.0
    expected = info.engine_scales.get(engine)
    if expected is None:
        known = ", ".join(sorted(info.engine_scales)) or "none"
        raise UnknownConventionError(
            f"model {info.name!r} ({info.architecture}) records no {engine} convention for "
            f"its inputs_embeds (engines recorded: {known}); tokembed makes no {engine} "
            "payload for it"
        )
    return expected / info.scale


def one_prompt(ids: Any) -> list[int]:
    """One prompt's ids (a 1-D sequence, or ``[1, S]``), as a list."""
    array = np.asarray(ids)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise client_invalid_input(
            f"one prompt's ids are a non-empty 1-D sequence of integers, got "
            f"{array.dtype} of shape {list(array.shape)}"
        )
    return [int(i) for i in array]


def vllm_prompt_embeds(
    vectors: npt.NDArray[Any], dtype: str = "bfloat16", *, scale: float = 1.0
) -> str:
    """vLLM's ``prompt_embeds`` for one prompt: ``vectors`` (``[S, hidden]``, or
    ``[1, S, hidden]``) times ``scale``, as a ``dtype`` tensor, ``torch.save``-d and
    base64-encoded (standard alphabet, padded: what ``b64decode(validate=True)`` takes)."""
    torch = _torch()

    if dtype not in VLLM_DTYPES:
        raise client_invalid_input(f"vLLM takes prompt_embeds in {VLLM_DTYPES}, not {dtype!r}")
    matrix = _matrix(vectors)
    if scale != 1.0:
        # In float64, rounded once to float32: the served float32 vector times the scale.
        matrix = (matrix.astype(np.float64) * scale).astype(np.float32)
    # A tensor of its own: torch.save writes a tensor's whole storage, and a view of the
    # answer would carry every other row of it.
    tensor = as_torch(matrix).to(getattr(torch, dtype), copy=True).contiguous()
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def sglang_input_embeds(vectors: npt.NDArray[Any], *, scale: float = 1.0) -> list[list[float]]:
    """SGLang's ``input_embeds`` for one prompt: ``[S, hidden]`` nested lists of Python
    floats (each a float32 value, exactly), ``vectors`` times ``scale``."""
    matrix = _matrix(vectors).astype(np.float32)
    if scale != 1.0:
        matrix = (matrix.astype(np.float64) * scale).astype(np.float32)
    rows: list[list[float]] = matrix.tolist()
    return rows


def _matrix(vectors: npt.NDArray[Any]) -> npt.NDArray[Any]:
    shape: Sequence[int] = vectors.shape
    if vectors.ndim == 3 and shape[0] == 1:
        vectors = vectors[0]
    if vectors.ndim != 2:
        raise client_invalid_input(
            f"one prompt's vectors are [S, hidden] (or [1, S, hidden]), got {list(shape)}"
        )
    return vectors
