"""A tiny but real vision model generated on disk: SmolVLM's architecture (mlx-vlm's `idefics3`: a SigLIP vision
tower, a pixel-shuffle projector and a Llama language model) with random weights, in the layout of an MLX
checkpoint (`language_model.*`, `vision_model.*`, `connector.*`), and a real Idefics3 processor: its image
processor splits an image into 32x32 tiles plus a global view, four image tokens each, and SmolVLM's chat template.
`mlx_vlm.load()` accepts the directory, so its own generate is the reference the engine is held to.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from helpers.tiny_models import SPECIAL_TOKENS, _model_config, _write_json, _write_tokenizer, layer_of, seeded_weights

if TYPE_CHECKING:
    import openai

IMAGE_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)),
)
VOCAB_SIZE = 552
TILE = 32
"""The vision tower's image size: 4x4 patches of 8 pixels, shuffled into 4 tokens (image_seq_len)."""

# SmolVLM-256M-Instruct's chat template: content is a list of parts, an image part renders as `<image>`, which
# the processor expands into the image's tiles' tokens.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def make_tiny_vlm(out_dir: Path, num_layers: int = 4, seed: int = 0, split: bool = False) -> Path:
    """Write the tiny vision model into `out_dir` and return it; deterministic for a given set of arguments.
    `split`: three safetensors files and an index, as a larger checkpoint: the embedding and the first half of the
    layers, the other half and the head, the vision tower and projector."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3 import Idefics3ImageProcessor, Idefics3Processor

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    token_ids = _write_tokenizer(out_dir, VOCAB_SIZE, (*SPECIAL_TOKENS, *IMAGE_TOKENS))
    # SmolVLM's turns end with <end_of_utterance>; mlx-vlm also stops at the tokenizer's own EOS.
    eos = [token_ids["<end_of_utterance>"], token_ids["<|im_end|>"]]
    text_config = {**_model_config("llama", num_layers, 64, VOCAB_SIZE, token_ids), "eos_token_id": eos}
    config: dict[str, Any] = {
        "model_type": "idefics3",
        "architectures": ["Idefics3ForConditionalGeneration"],
        "image_token_id": token_ids["<image>"],
        "scale_factor": 2,
        "vocab_size": VOCAB_SIZE,
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "text_config": text_config,
        "vision_config": {
            "model_type": "idefics3_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "patch_size": 8,
            "image_size": TILE,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
        },
    }
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {"eos_token_id": eos, "do_sample": False})

    module, _ = get_model_and_args(config)
    model_config = update_module_configs(module.ModelConfig.from_dict(config), module, config, ["text", "vision"])
    shapes = {name: tuple(value.shape) for name, value in tree_flatten(module.Model(model_config).parameters())}
    weights = seeded_weights(shapes, f"{seed}:idefics3")
    _write_weights(out_dir, {name: mx.array(value) for name, value in weights.items()}, num_layers, split)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(out_dir / "tokenizer.json"),
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
    )
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE}, do_image_splitting=True
    )
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=SMOLVLM_TEMPLATE)
    processor.save_pretrained(str(out_dir))
    return out_dir


def quantized_vlm(model_dir: Path, out_dir: Path) -> Path:
    """`model_dir` converted to 4 bits by mlx-vlm's own converter, as mlx-community's checkpoints are (it leaves the
    vision tower unquantized and quantizes the projector and the language model)."""
    from mlx_vlm.convert import convert

    convert(str(model_dir), str(out_dir), quantize=True, q_group_size=32, q_bits=4)
    return out_dir


def _write_weights(out_dir: Path, tensors: dict[str, mx.array], num_layers: int, split: bool) -> None:
    metadata = {"format": "mlx"}
    if not split:
        mx.save_safetensors(str(out_dir / "model.safetensors"), tensors, metadata=metadata)
        return

    def file_of(name: str) -> int:
        if not name.startswith("language_model."):
            return 3
        layer = layer_of(name.removeprefix("language_model.").replace("layers.", "model.layers.", 1))
        if layer is None:
            return 1 if "embed_tokens" in name else 2
        return 1 if layer < num_layers // 2 else 2

    weight_map = {name: f"model-0000{file_of(name)}-of-00003.safetensors" for name in sorted(tensors)}
    for file in sorted(set(weight_map.values())):
        part = {name: value for name, value in tensors.items() if weight_map[name] == file}
        mx.save_safetensors(str(out_dir / file), part, metadata=metadata)
    total = sum(value.nbytes for value in tensors.values())
    _write_json(out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels."""
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(picture: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(picture).decode()


def image_question(url: str, question: str) -> list[dict[str, Any]]:
    """One OpenAI user turn: the picture at `url`, then `question`."""
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]


def streamed_chat_answer(client: openai.OpenAI, model: str, picture: bytes, question: str, max_tokens: int) -> str:
    """`model`'s greedy answer to `question` about `picture`, streamed through chat completions, as one text."""
    stream = client.chat.completions.create(
        model=model,
        messages=image_question(data_url(picture), question),  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def responses_answer(client: openai.OpenAI, model: str, picture: bytes, question: str, max_tokens: int) -> str:
    """`model`'s greedy answer to `question` about `picture` through the Responses API (an `input_image` part)."""
    image = {"type": "input_image", "image_url": data_url(picture), "detail": "auto"}
    response = client.responses.create(
        model=model,
        input=[{"role": "user", "content": [image, {"type": "input_text", "text": question}]}],  # type: ignore[list-item]
        max_output_tokens=max_tokens,
        temperature=0,
    )
    return response.output_text


def mlx_vlm_greedy(
    model_dir: Path, question: str, image: bytes, max_tokens: int, history: tuple[tuple[str, str], ...] = ()
) -> list[int]:
    """mlx-vlm's own greedy output, without a final EOS, for a conversation that opens with `image` and goes on
    with `history`'s (question, answer) turns, then `question`."""
    from mlx_vlm import load, stream_generate
    from PIL import Image

    model, processor = load(str(model_dir))
    turns = [*history, (question, None)]
    messages: list[dict[str, Any]] = []
    for i, (asked, answered) in enumerate(turns):
        parts = [{"type": "image"}] if i == 0 else []
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": asked}]})
        if answered is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answered}]})
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    eos = set(json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"])
    tokens = []
    for response in stream_generate(
        model, processor, prompt, image=[Image.open(io.BytesIO(image))], max_tokens=max_tokens, temperature=0.0
    ):
        if response.token in eos:
            break
        tokens.append(int(response.token))
    return tokens[:max_tokens]
