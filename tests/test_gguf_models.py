"""The tiny GGUF models the llama.cpp tests run on (helpers.gguf_models): each architecture loads in upstream
`llama-server` from the llama.cpp build and answers a completion, quantized with that build's `llama-quantize`; the
tiny llama sees through the tiny image projector."""

from __future__ import annotations

from pathlib import Path

import gguf
import httpx
import pytest
from helpers.gguf_fixtures import TinyGGUFs
from helpers.gguf_models import TINY_ARCHS, TINY_PROJECTOR, file_type_of, llama_server
from helpers.tiny_vlm import data_url, image_question, png

COMPLETION_TOKENS = 8


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_architecture_loads_and_answers_as_q4_k_m(
    arch: str, tiny_ggufs: TinyGGUFs, llama_cpp_bin: Path, tmp_path: Path
) -> None:
    model = tiny_ggufs.get(arch, "Q4_K_M")
    assert file_type_of(model) == "Q4_K_M"
    with llama_server(model, tmp_path / "llama-server.log", "-c", "512", "-np", "2") as (url, _):
        props = httpx.get(f"{url}/props", timeout=10).json()
        assert props["model_path"] == str(model)
        answer = httpx.post(
            f"{url}/completion",
            json={"prompt": "The river", "n_predict": COMPLETION_TOKENS, "temperature": 0, "ignore_eos": True},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        # Random weights answer gibberish, but exactly as many tokens as asked for.
        assert body["tokens_predicted"] == COMPLETION_TOKENS
        assert body["content"]


def test_qwen3_is_a_thinking_model(tiny_ggufs: TinyGGUFs, llama_cpp_bin: Path, tmp_path: Path) -> None:
    """Qwen3's chat template renders its thinking switch, and `<think>` is one token, as in Qwen3's vocabulary."""
    model = tiny_ggufs.get("qwen3")
    assert file_type_of(model) == "F16"
    with llama_server(model, tmp_path / "llama-server.log", "-c", "512", "-np", "2", "--jinja") as (url, _):
        messages = [{"role": "user", "content": "Hi"}]
        rendered = httpx.post(
            f"{url}/apply-template",
            json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
            timeout=10,
        ).json()["prompt"]
        assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        tokens = httpx.post(f"{url}/tokenize", json={"content": "<think>x</think>"}, timeout=10).json()["tokens"]
        assert len(tokens) == 3


@pytest.mark.parametrize("file_type", ["Q4_0", "Q8_0"])
def test_legacy_quants(file_type: str, tiny_ggufs: TinyGGUFs, llama_cpp_bin: Path) -> None:
    assert file_type_of(tiny_ggufs.get("llama", file_type)) == file_type


def test_q4_k_m_quantizes_every_matrix_to_a_k_quant(tiny_ggufs: TinyGGUFs, llama_cpp_bin: Path) -> None:
    """llama-quantize falls back to a legacy type, silently, for a matrix whose rows are not a multiple of 256 (a
    K-quant block): every matrix of the tiny models is, qwen3's attention output (4 heads x 128) included."""
    reader = gguf.GGUFReader(tiny_ggufs.get("qwen3", "Q4_K_M"))
    types = {t.name: t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    assert types and all(kind in ("Q4_K", "Q6_K") for kind in types.values()), types


def test_the_tiny_llama_sees_through_the_tiny_projector(
    tiny_ggufs: TinyGGUFs, llama_cpp_bin: Path, tmp_path: Path
) -> None:
    """llama-server loads the projector beside the model (`--mmproj`): an image becomes one embedding a patch in the
    prompt, and another image gives another answer."""
    model, projector = tiny_ggufs.get("llama"), tiny_ggufs.projector()
    log = tmp_path / "llama-server.log"
    with llama_server(model, log, "-c", "512", "-np", "1", "--mmproj", str(projector)) as (url, _):

        def ask(messages: list[dict[str, object]]) -> tuple[int, str]:
            body = {"messages": messages, "max_tokens": 8, "temperature": 0}
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["prompt_tokens"], reply.json()["choices"][0]["message"]["content"]

        text_only, _ = ask([{"role": "user", "content": "What is in this picture?"}])
        seen = [ask(image_question(data_url(png(48, 40, seed)), "What is in this picture?")) for seed in (1, 2)]
    assert [tokens for tokens, _ in seen] == [text_only + TINY_PROJECTOR.image_tokens] * 2
    assert seen[0][1] != seen[1][1]
