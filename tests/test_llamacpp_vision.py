"""Images in on llama.cpp: a GGUF model and its image projector (mmproj), imported as a user imports them
(`jetshard models import-gguf --mmproj`), served by llama-server with `--mmproj`, and asked about a picture through
each dialect's official client. The tiny llama and its tiny LLaVA-style projector have random weights: what a user
would notice is that the picture reached the model (the prompt grows by the projector's embeddings of it, another
picture gets another answer) and that a model served without a projector refuses a picture, in the dialect's
shape, naming what it lacks.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from helpers.gguf_fixtures import TinyGGUFs
from helpers.gguf_models import TINY_PROJECTOR
from helpers.llamacpp_cluster import LlamaCppCluster
from helpers.tiny_vlm import data_url, image_question, png, responses_answer, streamed_chat_answer
from PIL import Image

pytestmark = pytest.mark.timeout(300)

SEEING = "local/tiny-llava"
QUESTION = "What is in this picture?"
MAX_TOKENS = 8
PICTURES = (png(48, 40, seed=1), png(20, 30, seed=2))
IMAGE_TOKENS = TINY_PROJECTOR.image_tokens
"""What one picture adds to the prompt: the projector's embeddings of its patches."""


@pytest.fixture(scope="module")
def seeing(
    llamacpp_cluster: LlamaCppCluster, tiny_ggufs: TinyGGUFs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, object]]:
    """The tiny llama and its projector imported on the node with the CLI and placed by placement's own choice;
    the card the import answered with. Removed after."""
    api, cluster = llamacpp_cluster.api, llamacpp_cluster.cluster
    command = [sys.executable, "-m", "jetshard", "models", "--api", api, "import-gguf", str(tiny_ggufs.get("llama"))]
    command += ["--id", SEEING, "--mmproj", str(tiny_ggufs.projector()), "--node", cluster.node_ids["node-a"]]
    env = {**os.environ, "JETSHARD_CONFIG_DIR": str(tmp_path_factory.mktemp("cli"))}
    instance_id = None
    try:
        imported = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        assert imported.returncode == 0, imported.stdout + imported.stderr
        assert f"imported {SEEING} (F16, llama.cpp only)" in imported.stdout
        placed = httpx.post(f"{api}/instances", json={"model_id": SEEING}, timeout=60)
        assert placed.status_code == 201, placed.text
        instance_id = placed.json()["instance_id"]
        cluster.wait_instance(instance_id, timeout=240)
        yield cluster.get(f"/models/{SEEING}")
    finally:
        if instance_id is not None:
            httpx.delete(f"{api}/instances/{instance_id}", timeout=30)
        httpx.delete(f"{api}/models/{SEEING}", timeout=30)


@pytest.fixture(scope="module")
def client(llamacpp_cluster: LlamaCppCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


def test_the_imported_projector_makes_the_card_see_and_llama_cpp_serve_it(
    seeing: dict[str, object], llamacpp_cluster: LlamaCppCluster
) -> None:
    assert "vision" in seeing["capabilities"]  # type: ignore[operator]
    assert seeing["formats"] == ["gguf"]
    (instance,) = llamacpp_cluster.cluster.instances_of(SEEING)
    assert instance["engine"] == "llama.cpp", instance
    (runner,) = llamacpp_cluster.cluster.runners_of(instance["instance_id"])
    (server,) = [p for p in runner.children(recursive=True) if "llama-server" in " ".join(p.cmdline())]
    arguments = server.cmdline()
    assert Path(arguments[arguments.index("--mmproj") + 1]).name == "mmproj.gguf"


@pytest.mark.usefixtures("seeing")
def test_openai_image_url_parts_reach_the_model(client: openai.OpenAI) -> None:
    def ask(messages: list[dict[str, object]]) -> tuple[int, str]:
        reply = client.chat.completions.create(
            model=SEEING,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert reply.usage is not None and reply.choices[0].message.content
        return reply.usage.prompt_tokens, reply.choices[0].message.content

    text_only, _ = ask([{"role": "user", "content": QUESTION}])
    seen = [ask(image_question(data_url(picture), QUESTION)) for picture in PICTURES]
    assert [tokens for tokens, _ in seen] == [text_only + IMAGE_TOKENS] * 2
    assert seen[0][1] != seen[1][1]  # the model saw the picture, not only a placeholder

    assert streamed_chat_answer(client, SEEING, PICTURES[1], QUESTION, MAX_TOKENS) == seen[1][1]
    assert responses_answer(client, SEEING, PICTURES[0], QUESTION, MAX_TOKENS) == seen[0][1]


@pytest.mark.usefixtures("seeing")
def test_a_picture_llama_cpp_cannot_read_is_a_400_naming_why(client: openai.OpenAI) -> None:
    """llama.cpp decodes PNG, JPEG and GIF; the API takes WebP too, for MLX. A file cut short passes the API's
    check of its first bytes; llama-server refuses it."""
    webp = io.BytesIO()
    Image.open(io.BytesIO(PICTURES[0])).save(webp, format="WEBP")
    for picture, why in (
        (webp.getvalue(), "image 0 is WebP, which llama.cpp does not read: send it as PNG, JPEG or GIF"),
        (PICTURES[0][:60], "llama.cpp: Failed to load image"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=SEEING,
                messages=image_question(data_url(picture), QUESTION),  # type: ignore[arg-type]
                max_tokens=5,
            )
        assert why in refused.value.message
    reply = client.chat.completions.create(
        model=SEEING,
        messages=image_question(data_url(PICTURES[0]), QUESTION),  # type: ignore[arg-type]
        max_tokens=5,
    )
    assert reply.choices[0].message.content  # the instance serves on


def anthropic_question(picture: bytes | None) -> list[dict[str, object]]:
    content: list[dict[str, object]] = [{"type": "text", "text": QUESTION}]
    if picture is not None:
        data = base64.b64encode(picture).decode()
        content.insert(0, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}})
    return [{"role": "user", "content": content}]


@pytest.mark.usefixtures("seeing")
def test_anthropic_image_blocks_reach_the_model(llamacpp_cluster: LlamaCppCluster) -> None:
    client = anthropic.Anthropic(base_url=llamacpp_cluster.api, api_key="unused", timeout=120, max_retries=0)

    def input_tokens(picture: bytes | None) -> int:
        reply = client.messages.create(
            model=SEEING,
            messages=anthropic_question(picture),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},
        )
        assert [block.text for block in reply.content if block.type == "text"] != [""]
        return reply.usage.input_tokens

    assert input_tokens(PICTURES[0]) == input_tokens(None) + IMAGE_TOKENS


@pytest.mark.usefixtures("seeing")
def test_ollama_images_reach_the_model(llamacpp_cluster: LlamaCppCluster) -> None:
    client = ollama.Client(host=llamacpp_cluster.api, timeout=120)
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    text_only = client.chat(model=SEEING, messages=[{"role": "user", "content": QUESTION}], options=options)
    seen = client.chat(
        model=SEEING, messages=[{"role": "user", "content": QUESTION, "images": [PICTURES[1]]}], options=options
    )
    assert seen.message.content
    assert seen.prompt_eval_count == (text_only.prompt_eval_count or 0) + IMAGE_TOKENS
    # /api/generate's prompt is the user's turn, its images shown before it: the same prompt, the same answer.
    generated = client.generate(model=SEEING, prompt=QUESTION, images=[PICTURES[1]], options=options)
    assert generated.response == seen.message.content


def test_a_model_served_without_a_projector_refuses_a_picture_in_each_dialect(
    client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster
) -> None:
    """The demo GGUF on llama.cpp has no projector: each dialect's 400 says that llama.cpp sees through one."""
    api, model = llamacpp_cluster.api, llamacpp_cluster.model
    why = "no image projector (mmproj), through which llama.cpp sees images"

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model,
            messages=image_question(data_url(PICTURES[0]), QUESTION),  # type: ignore[arg-type]
            max_tokens=5,
        )
    assert (refused.value.code, refused.value.param) == ("model_takes_no_images", "messages")
    assert why in refused.value.message

    messages = anthropic.Anthropic(base_url=api, api_key="unused", max_retries=0).messages
    with pytest.raises(anthropic.BadRequestError) as refused_anthropic:
        messages.create(model=model, messages=anthropic_question(PICTURES[0]), max_tokens=5)  # type: ignore[arg-type]
    body = refused_anthropic.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert why in body["error"]["message"]  # type: ignore[index]

    with pytest.raises(ollama.ResponseError) as refused_ollama:
        ollama.Client(host=api).chat(
            model=model, messages=[{"role": "user", "content": QUESTION, "images": [PICTURES[0]]}]
        )
    assert refused_ollama.value.status_code == 400 and why in refused_ollama.value.error
