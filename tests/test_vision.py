"""Images in, for vision models, end to end through the API with each dialect's official client: a tiny generated
SmolVLM-shaped model (random weights, a real Idefics3 processor) served beside the dialects' text model in the
session's `dialect_cluster`, and removed after. Its answer to a picture is mlx-vlm's own; another picture gets
another answer; a bad image, or an image for a text model, is a 400 in the dialect's error shape.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from helpers.dialects import DialectCluster
from helpers.tiny_vlm import (
    data_url,
    image_question,
    make_tiny_vlm,
    mlx_vlm_greedy,
    png,
    responses_answer,
    streamed_chat_answer,
)

pytestmark = pytest.mark.timeout(240)

TINY_VLM = "jetshard-test/tiny-vlm"
QUESTION = "What is in this picture?"
MAX_TOKENS = 12
PICTURES = (png(48, 40, seed=1), png(20, 30, seed=2))


@pytest.fixture(scope="module")
def vision_model(dialect_cluster: DialectCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny vision model, added through the local Hub server as a user would and placed beside the dialects'
    text model; its directory. Its instance is deleted after."""
    model_dir = make_tiny_vlm(tmp_path_factory.mktemp("vision") / "tiny-vlm")
    with dialect_cluster.serving(TINY_VLM, model_dir):
        yield model_dir


@pytest.fixture(scope="module")
def client(dialect_cluster: DialectCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dialect_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def expected(vision_model: Path) -> list[str]:
    """mlx-vlm's greedy answer to each picture, as text."""
    from mlx_vlm.utils import load_processor

    tokenizer = load_processor(vision_model, add_detokenizer=False).tokenizer
    return [tokenizer.decode(mlx_vlm_greedy(vision_model, QUESTION, p, MAX_TOKENS)) for p in PICTURES]


def test_openai_image_url_parts_are_answered_as_mlx_vlm_answers_them(
    client: openai.OpenAI, expected: list[str]
) -> None:
    answers = []
    for picture in PICTURES:
        reply = client.chat.completions.create(
            model=TINY_VLM,
            messages=image_question(data_url(picture), QUESTION),
            max_tokens=MAX_TOKENS,
            temperature=0,  # type: ignore[arg-type]
        )
        answers.append(reply.choices[0].message.content)
    assert answers == expected
    assert answers[0] != answers[1]

    assert streamed_chat_answer(client, TINY_VLM, PICTURES[1], QUESTION, MAX_TOKENS) == expected[1]


@pytest.mark.usefixtures("vision_model")
def test_responses_input_image_parts_are_answered_as_mlx_vlm_answers_them(
    client: openai.OpenAI, expected: list[str]
) -> None:
    assert responses_answer(client, TINY_VLM, PICTURES[0], QUESTION, MAX_TOKENS) == expected[0]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=TINY_VLM,
            input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],  # type: ignore[list-item]
            max_output_tokens=5,
        )
    assert refused.value.param == "input[0].content[0].file_id"


@pytest.mark.usefixtures("vision_model")
def test_an_image_for_a_text_model_is_refused(client: openai.OpenAI, dialect_cluster: DialectCluster) -> None:
    cluster = dialect_cluster.cluster
    assert "vision" in cluster.get(f"/models/{TINY_VLM}")["capabilities"]
    assert "vision" not in cluster.get(f"/models/{dialect_cluster.model}")["capabilities"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=dialect_cluster.model,
            messages=image_question(data_url(PICTURES[0]), QUESTION),
            max_tokens=5,  # type: ignore[arg-type]
        )
    assert "takes no images" in refused.value.message
    assert refused.value.code == "model_takes_no_images"


def test_an_image_for_a_text_model_names_the_field_that_carries_it(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    """Chat Completions carries images in `messages`, the Responses API in `input`."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=dialect_cluster.model, messages=image_question(data_url(PICTURES[0]), QUESTION), max_tokens=5
        )  # type: ignore[arg-type]
    assert (refused.value.code, refused.value.param) == ("model_takes_no_images", "messages")
    image = {"type": "input_image", "image_url": data_url(PICTURES[0]), "detail": "auto"}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(
                model=dialect_cluster.model,
                input=[{"role": "user", "content": [image, {"type": "input_text", "text": QUESTION}]}],  # type: ignore[list-item]
                max_output_tokens=5,
                stream=stream,
            )
        assert (refused.value.code, refused.value.param) == ("model_takes_no_images", "input")


@pytest.mark.usefixtures("vision_model")
@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "not a PNG, JPEG, GIF or WebP"),
        ("data:image/png;base64,%%%", "not valid base64"),
        ("file:///etc/passwd", "the API reads no local image files"),
        ("http://127.0.0.1:9/picture.png", "fetches no image URLs"),
        ("ftp://example.com/picture.png", "must be a data:, file:// or http(s):// URL"),
    ],
    ids=["not-an-image", "bad-base64", "local-file", "web-address", "other-scheme"],
)
def test_a_bad_image_url_is_a_400_naming_the_part(client: openai.OpenAI, url: str, why: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=TINY_VLM, messages=image_question(url, QUESTION), max_tokens=5)  # type: ignore[arg-type]
    assert why in refused.value.message
    assert refused.value.param == "messages[0].content[0].image_url"


@pytest.mark.usefixtures("vision_model")
def test_a_broken_image_file_is_a_400_from_the_runner(client: openai.OpenAI) -> None:
    """A file that starts like a PNG but is cut short passes the API's check; the processor refuses it."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=TINY_VLM,
            messages=image_question(data_url(PICTURES[0][:60]), QUESTION),
            max_tokens=5,  # type: ignore[arg-type]
        )
    assert "image 0 is not a readable PNG, JPEG, GIF or WebP file" in refused.value.message


def anthropic_question(picture: str) -> list[dict[str, object]]:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": picture}}
    return [{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}]


def test_anthropic_image_blocks_are_answered_and_refused_in_anthropics_shape(
    dialect_cluster: DialectCluster, expected: list[str]
) -> None:
    client = anthropic.Anthropic(base_url=dialect_cluster.api, api_key="unused", timeout=120, max_retries=0)
    picture = base64.b64encode(PICTURES[0]).decode()
    reply = client.messages.create(
        model=TINY_VLM,
        messages=anthropic_question(picture),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},  # this client has no sampling arguments left
    )
    assert [block.text for block in reply.content if block.type == "text"] == [expected[0]]

    for model, data, why in [
        (dialect_cluster.model, picture, "takes no images"),
        (TINY_VLM, base64.b64encode(b"GIF8").decode(), "not a PNG, JPEG, GIF or WebP"),
    ]:
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model=model, messages=anthropic_question(data), max_tokens=5)  # type: ignore[arg-type]
        assert refused.value.body["type"] == "error"  # type: ignore[index]
        assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert why in refused.value.body["error"]["message"]  # type: ignore[index]


def test_ollama_images_are_answered_and_refused_in_ollamas_shape(
    dialect_cluster: DialectCluster, expected: list[str]
) -> None:
    client = ollama.Client(host=dialect_cluster.api, timeout=120)
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    chat = client.chat(
        model=TINY_VLM, messages=[{"role": "user", "content": QUESTION, "images": [PICTURES[1]]}], options=options
    )
    assert chat.message.content == expected[1]
    # /api/generate's prompt is the user's turn, its images shown before it: the same prompt.
    generated = client.generate(model=TINY_VLM, prompt=QUESTION, images=[PICTURES[1]], options=options)
    assert generated.response == expected[1]

    for model, image, why in [
        (dialect_cluster.model, base64.b64encode(PICTURES[0]).decode(), "takes no images"),
        (TINY_VLM, "not base64!", "not valid base64"),
    ]:
        body = {"model": model, "prompt": QUESTION, "images": [image], "stream": False}
        response = httpx.post(f"{dialect_cluster.api}/api/generate", json=body, timeout=60)
        assert response.status_code == 400
        assert list(response.json()) == ["error"] and why in response.json()["error"]


@pytest.mark.usefixtures("vision_model")
def test_a_request_carries_at_most_eight_images(client: openai.OpenAI) -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(png(4, 4, seed=0))}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=TINY_VLM,
            messages=[{"role": "user", "content": [part] * 9}],  # type: ignore[list-item]
            max_tokens=5,
        )
    assert "up to 8 images" in refused.value.message
