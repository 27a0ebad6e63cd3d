"""Engine-ready answers in the client (client/engines.py, the clients' ``embed_torch``,
``vllm_prompt_embeds``, ``sglang_input_embeds``), through the real server serving tiny
models that transformers made and ``tokembed export --from-pretrained`` exported.

vLLM cannot run here (it needs a GPU), so its payload is decoded as vLLM decodes it,
step by step: ``safe_load_prompt_embeds`` in vLLM's ``vllm/renderers/embed_utils.py``
(``vllm/entrypoints/renderer.py``'s ``load_prompt_embeds`` before it): strict base64,
``torch.load(weights_only=True)`` on the CPU under sparse-invariant checks, a float32,
bfloat16 or float16 tensor, ``to_dense()``, a leading batch dimension squeezed, 2-D and
the model's hidden size wide (vLLM 0.34.0), then cast to the model's dtype.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from tokembed.cli.main import main as cli_main
from tokembed.client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    InvalidInputError,
    UnknownConventionError,
    engines,
)
from tokembed.server.process.settings import Settings

from support.no_torch import env_without_torch
from support.server import ServerThread

V, D = 128, 48
LAYERS = dict(num_hidden_layers=1, num_attention_heads=4, intermediate_size=32)
DECODER = dict(vocab_size=V, hidden_size=D, num_key_value_heads=2, **LAYERS)
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IDS = [5, 0, 17, 127, 3, 3, 64]


def _models() -> dict[str, Any]:
    t = transformers
    return {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**DECODER)),
        "gemma2": lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**DECODER, head_dim=12)),
        "bert": lambda: t.BertForMaskedLM(t.BertConfig(vocab_size=V, hidden_size=D, **LAYERS)),
    }


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each model's own embedding table (float32), and the exported model directories."""
    root = tmp_path_factory.mktemp("engines")
    found: dict[str, Any] = {"dirs": []}
    for seed, (name, build) in enumerate(_models().items()):
        torch.manual_seed(seed)
        model = build()
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_()
        model.save_pretrained(root / "saved" / name)
        out = root / name
        assert cli_main(["export", "--from-pretrained", str(root / "saved" / name),
                         "--out", str(out)]) == 0  # fmt: skip
        found[name] = model.get_input_embeddings().weight.detach().numpy().copy()
        found["dirs"].append(out)
    found["saved"] = root / "saved"
    return found


@pytest.fixture(scope="module")
def server(tables: dict[str, Any]) -> Iterator[ServerThread]:
    settings = Settings(model_dir=tuple(tables["dirs"]), port=0, metrics_port=0)
    started = ServerThread(settings.validate()).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[EmbeddingClient]:
    with EmbeddingClient(server.target) as connected:
        yield connected


def vllm_decode(embed: str | bytes) -> torch.Tensor:
    """What vLLM makes of a ``prompt_embeds`` payload, step by step as its
    ``safe_load_prompt_embeds`` (vllm/renderers/embed_utils.py, as in vLLM 0.34.0) does;
    ``pybase64``'s ``b64decode(..., validate=True)`` is the standard library's (strict: no
    character outside the alphabet, right padding). vLLM then casts the tensor to the
    model's dtype (any floating dtype; tokembed sends float32, bfloat16 or float16): the
    tests compare the tensor that cast starts from."""
    with torch.sparse.check_sparse_tensor_invariants():
        tensor = torch.load(
            io.BytesIO(base64.b64decode(embed, validate=True)),
            weights_only=True,
            map_location=torch.device("cpu"),
        )
        assert isinstance(tensor, torch.Tensor) and tensor.dtype in (
            torch.float32,
            torch.bfloat16,
            torch.float16,
        )
        tensor = tensor.to_dense()
    if tensor.dim() > 2:
        tensor = tensor.squeeze(0)
    # vLLM 0.34.0 refuses any other shape than [S, the model's hidden size].
    assert tensor.dim() == 2 and tensor.shape[1] == D
    return tensor


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32 if tensor.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", list(TORCH))
def test_the_vllm_payload_decodes_to_the_served_tensor_bit_for_bit(
    dtype: str, client: EmbeddingClient
) -> None:
    payload = client.vllm_prompt_embeds(IDS, dtype, model="llama")
    assert isinstance(payload, str) and payload.isascii()
    decoded = vllm_decode(payload)
    served = client.embed([IDS], dtype, model="llama")[0]
    want = engines.as_torch(served)
    assert decoded.shape == (len(IDS), D)
    assert decoded.dtype == TORCH[dtype]
    assert decoded.is_contiguous()
    assert torch.equal(_bits(decoded), _bits(want))
    # The payload holds these S rows and nothing else (torch.save writes whole storages).
    assert decoded.untyped_storage().nbytes() == len(IDS) * D * decoded.element_size()


def test_the_vllm_payload_for_a_leading_batch_of_one_and_the_async_client(
    server: ServerThread, client: EmbeddingClient
) -> None:
    async def payload() -> str:
        async with AsyncEmbeddingClient(server.target) as aio:
            return await aio.vllm_prompt_embeds([IDS], "float32", model="llama")

    from_async = asyncio.run(payload())
    assert from_async == client.vllm_prompt_embeds(np.array(IDS), "float32", model="llama")
    served = torch.from_numpy(client.embed([IDS], model="llama")[0].copy())
    assert torch.equal(_bits(vllm_decode(from_async)), _bits(served))


def test_gemma2_payloads_scaled_for_vllm_and_unscaled_for_sglang(
    client: EmbeddingClient, tables: dict[str, Any]
) -> None:
    """Gemma 2's served vectors are E[id] * sqrt(hidden) (transformers' scaled embedding
    module). vLLM 0.34.0's Gemma2Model scales in ``embed_input_ids`` and takes
    ``inputs_embeds`` as they come, so its payload is the served tensor; SGLang 0.5.23's
    Gemma2Model multiplies ``input_embeds`` by the normalizer itself, so its payload carries
    E[id]: the table's rows, to within the one rounding of the served product."""
    info = client.info("gemma2")
    assert info.scale == pytest.approx(D**0.5, rel=1e-6)
    assert info.engine_scales["vllm"] == info.scale
    assert info.engine_scales["sglang"] == 1.0
    served = client.embed([IDS], model="gemma2")[0]
    decoded = vllm_decode(client.vllm_prompt_embeds(IDS, "float32", model="gemma2"))
    assert torch.equal(_bits(decoded), _bits(torch.from_numpy(served.copy())))
    rows = tables["gemma2"][IDS]
    sglang = np.array(client.sglang_input_embeds(IDS, model="gemma2"), dtype=np.float32)
    ulps = np.abs(sglang.view(np.int32).astype(np.int64) - rows.view(np.int32)).max()
    assert ulps <= 1
    # Without the engine's difference, the served vectors are sqrt(48) times these.
    assert np.abs(served).max() > 5 * np.abs(rows).max()


def test_the_sglang_payload_is_json_ready_floats_of_the_served_tensor(
    client: EmbeddingClient,
) -> None:
    embeds = client.sglang_input_embeds(IDS, model="llama")
    assert len(embeds) == len(IDS) and all(len(row) == D for row in embeds)
    assert all(type(value) is float for row in embeds for value in row)
    # Through JSON (SGLang's HTTP API) and back: the served float32 values exactly.
    back = np.array(json.loads(json.dumps({"input_embeds": embeds}))["input_embeds"])
    served = client.embed([IDS], model="llama")[0]
    assert np.array_equal(back.astype(np.float32).view(np.int32), served.view(np.int32))


@pytest.mark.parametrize("dtype", list(TORCH))
def test_a_torch_tensor_without_a_copy(dtype: str, client: EmbeddingClient) -> None:
    served = client.embed([IDS, IDS[::-1]], dtype, model="llama")
    tensor = engines.as_torch(served)
    assert tensor.dtype == TORCH[dtype]
    assert tuple(tensor.shape) == served.shape
    assert tensor.data_ptr() == served.ctypes.data  # the same bytes, not a copy
    numpy_bits = served.view(np.int32 if dtype == "float32" else np.int16)
    assert np.array_equal(_bits(tensor).numpy(), numpy_bits)
    through_client = client.embed_torch([IDS, IDS[::-1]], dtype, model="llama")
    assert torch.equal(_bits(through_client), _bits(tensor))


def test_an_architecture_without_an_engine_convention_is_one_clear_error(
    client: EmbeddingClient,
) -> None:
    for make in (lambda: client.vllm_prompt_embeds(IDS, model="bert"),
                 lambda: client.sglang_input_embeds(IDS, model="bert")):  # fmt: skip
        with pytest.raises(UnknownConventionError) as caught:
            make()
        message = str(caught.value)
        assert "\n" not in message
        assert "model 'bert' (bert) records no" in message
        assert "engines recorded: transformers" in message
    # The served vectors themselves stay available.
    assert client.embed_torch([IDS], model="bert").shape == (1, len(IDS), D)


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        ([IDS, IDS], "non-empty 1-D sequence of integers, got int64 of shape [2, 7]"),
        ([], "non-empty 1-D sequence"),
        ([1.5, 2.0], "got float64"),
    ],
)
def test_ids_that_are_not_one_prompt_are_refused(
    ids: Any, fragment: str, client: EmbeddingClient
) -> None:
    with pytest.raises(InvalidInputError, match=None) as caught:
        client.vllm_prompt_embeds(ids, model="llama")
    assert fragment in str(caught.value)
    with pytest.raises(InvalidInputError, match="vLLM takes prompt_embeds in"):
        client.vllm_prompt_embeds(IDS, "int8", model="llama")


def test_engines_need_no_torch_until_asked(tmp_path: Path) -> None:
    """torch stays the client's optional extra: the clients and this module import
    without it; only a torch answer asks for it."""
    script = (
        "import sys\n"
        "from tokembed.client import EmbeddingClient, AsyncEmbeddingClient, engines\n"
        "import numpy as np, ml_dtypes\n"
        "assert 'torch' not in sys.modules\n"
        "rows = engines.sglang_input_embeds(np.ones((2, 3), dtype=ml_dtypes.bfloat16))\n"
        "assert rows == [[1.0] * 3] * 2\n"
        "try:\n"
        "    engines.as_torch(np.ones(3, dtype=np.float32))\n"
        "except ModuleNotFoundError as exc:\n"
        "    print('no', exc.name)\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env_without_torch(tmp_path), capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert said[0] == "no torch"
    assert said[1].startswith("torch answers (embed_torch, vllm_prompt_embeds) need torch")


def test_a_bfloat16_array_becomes_a_bfloat16_tensor_over_its_bytes() -> None:
    array = np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    array.flags.writeable = False  # as the client's answers are
    tensor = engines.as_torch(array)
    assert tensor.dtype == torch.bfloat16 and tensor.data_ptr() == array.ctypes.data
    assert torch.equal(tensor.float(), torch.arange(12, dtype=torch.float32).reshape(3, 4))


DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"


def _engine_examples() -> list[str]:
    """The python blocks of docs/client.md's "Engine-ready answers" section."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## Engine-ready answers")
    section = text[start : text.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_the_docs_examples_run_and_say_what_they_do(
    server: ServerThread, client: EmbeddingClient, tables: dict[str, Any]
) -> None:
    transformers_example, vllm_example, sglang_example = _engine_examples()
    run = {}
    for name, code in (("transformers", transformers_example), ("vllm", vllm_example),
                       ("sglang", sglang_example)):  # fmt: skip
        code = code.replace("127.0.0.1:50051", server.target)
        code = code.replace("path/to/llama", str(tables["saved"] / "llama"))
        assert len(code.strip().splitlines()) <= 12, name  # about ten lines each
        namespace: dict[str, Any] = {}
        exec(compile(code, f"docs/client.md ({name})", "exec"), namespace)
        run[name] = namespace
    # transformers: the new tokens are those generate(input_ids=...) gives after the prompt.
    done = run["transformers"]
    ids = torch.tensor([done["ids"]])
    from_ids = done["model"].generate(input_ids=ids, attention_mask=done["mask"], max_new_tokens=16)
    assert torch.equal(done["out"], from_ids[:, ids.shape[1] :])
    # vLLM: the payload decodes as vLLM decodes it, the Gemma 2 vectors as served.
    decoded = vllm_decode(run["vllm"]["payload"])
    assert decoded.dtype == torch.bfloat16 and decoded.shape == (5, D)
    served = engines.as_torch(client.embed([run["vllm"]["ids"]], "bfloat16", model="gemma2")[0])
    assert torch.equal(_bits(decoded), _bits(served))
    assert json.loads(run["vllm"]["request"])["prompt_embeds"] == run["vllm"]["payload"]
    # SGLang: the Gemma 2 rows unscaled, float32 through JSON.
    body = json.loads(run["sglang"]["request"])
    embeds = np.array(body["input_embeds"], dtype=np.float32)
    rows = tables["gemma2"][run["sglang"]["ids"]]
    assert embeds.shape == (5, D)
    assert np.abs(embeds.view(np.int32).astype(np.int64) - rows.view(np.int32)).max() <= 1


def test_tokembed_info_prints_the_architecture_and_what_each_engine_expects(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(["info", "--target", server.target, "--model", "gemma2"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert "architecture       gemma2" in lines
    assert any(line.startswith("convention         gemma2: served vectors are E[id] * 6.9282")
               for line in lines)  # fmt: skip
    assert "engine scales      sglang 1, transformers 6.9282, vllm 6.9282" in lines
