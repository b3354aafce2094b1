"""Faster tokens and more contexts on llama.cpp: the demo GGUF imported under other names, placed as it ships
(`PLAIN_MODEL`) and with one serving setting each, then asked the same (the same card, so the same sampling).

* A quantized KV cache (`serving.kv_cache_type`): placement counts the smaller cache, llama-server stores it so, and
  greedy answers begin as the demo's do: their first `SAME_START` tokens at least. The same on MLX, whose runner
  stores it in as many bits (`engines.mlx.quantized_cache`).
* Prompt-lookup drafting on MLX too: greedy answers token for token as without it, drafts counted.
* Prompt-lookup drafting (`serving.draft: ngram`): greedy answers are the demo's token for token, and the instance
  counts what it drafted and what its model kept (`/metrics`).

A draft model asked of MLX, or either setting with a value llama.cpp's names do not have, is a clear 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from helpers.harness import wait_for
from helpers.llamacpp_cluster import LlamaCppCluster
from jetshard_downloader.convert import packaged_gguf_path
from jetshard_schema.catalogue import DEMO_MODEL_ID, builtin_cards
from jetshard_schema.ids import ModelId, model_dir_name

pytestmark = pytest.mark.timeout(300)

PLAIN_MODEL = "local/demo-plain"
Q8_MODEL = "local/demo-kv-q8"
MLX_PLAIN_MODEL = "local/demo-mlx-plain"
MLX_Q8_MODEL = "local/demo-mlx-kv-q8"
MLX_NGRAM_MODEL = "local/demo-mlx-ngram"
MLX_DRAFTED_MODEL = "local/demo-mlx-drafted"
SAME_START = 8
"""Greedy answers begin with at least this many tokens as with the 16-bit cache. Measured on these prompts with the
demo (a 135M model in 4 bits): the first answer whole, the others part after 10 to 30 tokens; rounding differs a
little at every step, and one near-tie then picks another word."""
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain in two sentences what a CPU does.",
    "List three fruits and their colours.",
]


NGRAM_MODEL = "local/demo-ngram"
DRAFTED_MODEL = "local/demo-drafted"
DRAFT_MODEL = "jetshard-test/demo-draft"
CODE_EDIT = (
    "Repeat this code exactly, with `total` renamed to `result`:\n\n"
    "def add(a, b):\n    total = a + b\n    return total\n\n\n"
    "def subtract(a, b):\n    total = a - b\n    return total\n"
)


@contextmanager
def demo_placed_as(
    llamacpp_cluster: LlamaCppCluster, model_id: str, serving: dict[str, str], fields: dict[str, str] | None = None
) -> Iterator[dict[str, object]]:
    """The demo GGUF imported as `model_id` and placed with `serving` (and the placement's other `fields`, on
    llama.cpp by default): the instance, once ready."""
    cluster = llamacpp_cluster.cluster
    gguf, _ = packaged_gguf_path(builtin_cards()[DEMO_MODEL_ID])
    body = {"node_id": cluster.node_ids["node-a"], "model_id": model_id, "path": str(gguf), "replace": True}
    response = httpx.post(f"{llamacpp_cluster.api}/models/import", json=body, timeout=120)
    assert response.status_code == 201, response.text
    instance_id = ""
    try:
        instance_id = llamacpp_cluster.place(model_id, serving=serving, **(fields or {}))
        yield cluster.wait_instance(instance_id, timeout=240)
    finally:
        if instance_id:
            httpx.delete(f"{llamacpp_cluster.api}/instances/{instance_id}", timeout=30)
        httpx.delete(f"{llamacpp_cluster.api}/models/{model_id}", timeout=30)


@pytest.fixture
def plain_instance(llamacpp_cluster: LlamaCppCluster) -> Iterator[dict[str, object]]:
    """Fresh for each test: llama.cpp's prompt cache serves a prompt that starts as an earlier one did (a chat
    template's head) from its cache, and a prefill split so rounds a little differently; the instance it is held
    against has seen the same prompts in the same order."""
    with demo_placed_as(llamacpp_cluster, PLAIN_MODEL, {}) as instance:
        yield instance


@pytest.fixture(scope="module")
def client(llamacpp_cluster: LlamaCppCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


def reserved_bytes(instance: dict[str, object]) -> int:
    """What placement reserved for the instance on its nodes."""
    return sum(shard["memory_bytes"] for shard in instance["shards"])  # type: ignore[attr-defined,index,misc]


def serves(cmdline: list[str] | None, model_id: str) -> bool:
    """Whether `cmdline` is a llama-server's on `model_id`'s model directory."""
    directory = model_dir_name(ModelId(model_id))
    return (
        bool(cmdline)
        and cmdline is not None
        and cmdline[0].endswith("llama-server")
        and any(directory in part for part in cmdline)
    )


def greedy_text(client: openai.OpenAI, model: str, prompt: str, temperature: float = 0, seed: int | None = None) -> str:
    """The answer to `prompt` (greedy, or drawn at `temperature` from `seed`)."""
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=64, temperature=temperature, seed=seed
    )
    return reply.choices[0].message.content or ""


def greedy_tokens(client: openai.OpenAI, model: str, prompt: str) -> list[str]:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0, logprobs=True
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    return [entry.token for entry in logprobs.content]


def test_an_8_bit_kv_cache_takes_less_memory_and_answers_as_16_bits_do(
    plain_instance: dict[str, object], llamacpp_cluster: LlamaCppCluster, client: openai.OpenAI
) -> None:
    with demo_placed_as(llamacpp_cluster, Q8_MODEL, {"kv_cache_type": "q8_0"}) as q8_instance:
        assert q8_instance["serving"]["kv_cache_type"] == "q8_0"  # type: ignore[index]
        assert plain_instance["serving"]["kv_cache_type"] == "auto"  # type: ignore[index]
        assert q8_instance["serving"]["max_batch"] == plain_instance["serving"]["max_batch"]  # type: ignore[index]
        assert reserved_bytes(q8_instance) < reserved_bytes(plain_instance)
        servers = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if serves(p.info["cmdline"], Q8_MODEL)]
        (server,) = servers
        assert server[server.index("--cache-type-k") + 1] == server[server.index("--cache-type-v") + 1] == "q8_0"
        assert_greedy_answers_begin_alike(client, PLAIN_MODEL, Q8_MODEL, PROMPTS)


@pytest.fixture(scope="module")
def mlx_plain(llamacpp_cluster: LlamaCppCluster) -> Iterator[dict[str, object]]:
    """The demo on MLX, as it ships: its prefix cache gives the same answers as a cold start (`test_engine`)."""
    with demo_placed_as(llamacpp_cluster, MLX_PLAIN_MODEL, {}, {"engine": "mlx"}) as instance:
        yield instance


def test_an_8_bit_kv_cache_on_mlx_takes_less_memory_and_answers_as_computed_does(
    mlx_plain: dict[str, object], llamacpp_cluster: LlamaCppCluster, client: openai.OpenAI
) -> None:
    """MLX on this CPU computes in float32: 8 bits and a float32 scale and bias a group of 64 take 9 bits a value of
    its 32. Placement reserves less for the same slots, and the prompts' caches the runner saves (the same prompts,
    so the same entries) take 9/32 of the bytes."""
    plain = mlx_plain
    with demo_placed_as(llamacpp_cluster, MLX_Q8_MODEL, {"kv_cache_type": "q8_0"}, {"engine": "mlx"}) as q8:
        assert (plain["serving"]["engine"], q8["serving"]["engine"]) == ("mlx", "mlx")  # type: ignore[index]
        assert q8["serving"]["kv_cache_type"] == "q8_0"  # type: ignore[index]
        assert reserved_bytes(q8) < reserved_bytes(plain)
        assert_greedy_answers_begin_alike(client, MLX_PLAIN_MODEL, MLX_Q8_MODEL, PROMPTS[:2])

        def saved_bytes(instance: dict[str, object]) -> float:
            return instance_metrics(llamacpp_cluster.api, str(instance["instance_id"])).get(
                "jetshard_prefix_cache_bytes", 0
            )

        assert wait_for(lambda: saved_bytes(plain) > 0 and saved_bytes(q8) > 0, timeout=30)
        assert saved_bytes(q8) == pytest.approx(saved_bytes(plain) * 9 / 32, rel=0.01)


@pytest.mark.timeout(600)  # four greedy answers on MLX, which computes a drafted position as dearly as a token here
def test_prompt_lookup_on_mlx_answers_token_for_token_as_without_it(
    mlx_plain: dict[str, object], llamacpp_cluster: LlamaCppCluster, client: openai.OpenAI
) -> None:
    with demo_placed_as(llamacpp_cluster, MLX_NGRAM_MODEL, {"draft": "ngram"}, {"engine": "mlx"}) as drafting:
        assert (drafting["serving"]["engine"], drafting["serving"]["draft"]) == ("mlx", "ngram")  # type: ignore[index]
        for prompt in (CODE_EDIT, PROMPTS[0]):
            assert greedy_text(client, MLX_NGRAM_MODEL, prompt) == greedy_text(client, MLX_PLAIN_MODEL, prompt), prompt
        # A sampled answer drafts too, and keeps what it draws: with the same seed, the same text.
        drawn = {"temperature": 0.2, "seed": 7}
        assert greedy_text(client, MLX_NGRAM_MODEL, CODE_EDIT, **drawn) == greedy_text(
            client, MLX_PLAIN_MODEL, CODE_EDIT, **drawn
        )
        assert_drafts_counted(llamacpp_cluster.api, str(drafting["instance_id"]))


def assert_greedy_answers_begin_alike(client: openai.OpenAI, plain: str, quantized: str, prompts: list[str]) -> None:
    """Each prompt's greedy answer from `quantized` begins with the first `SAME_START` tokens of `plain`'s."""
    for prompt in prompts:
        as_computed = greedy_tokens(client, plain, prompt)
        in_8_bits = greedy_tokens(client, quantized, prompt)
        pairs = zip(as_computed, in_8_bits, strict=False)
        alike = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        assert alike is None or alike >= SAME_START, (prompt, as_computed, in_8_bits)


@pytest.mark.timeout(600)  # ten greedy answers of two instances: on a busy machine, minutes
def test_ngram_drafting_answers_token_for_token_as_without_it_and_counts_what_it_kept(
    plain_instance: dict[str, object], llamacpp_cluster: LlamaCppCluster, client: openai.OpenAI
) -> None:
    with demo_placed_as(llamacpp_cluster, NGRAM_MODEL, {"draft": "ngram"}) as instance:
        assert instance["serving"]["draft"] == "ngram"  # type: ignore[index]
        for prompt in [CODE_EDIT, *PROMPTS]:
            assert greedy_text(client, NGRAM_MODEL, prompt) == greedy_text(client, PLAIN_MODEL, prompt), prompt
        # llama.cpp streams no logprobs for the drafted tokens it keeps: asked for, they are refused, not given
        # with holes.
        with pytest.raises(openai.BadRequestError, match="logprobs are not available from an instance that drafts"):
            greedy_tokens(client, NGRAM_MODEL, CODE_EDIT)

        # The code edit repeats its prompt: drafts were made there, and some of them kept.
        assert_drafts_counted(llamacpp_cluster.api, str(instance["instance_id"]))


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "maximum": 10**8}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def structured(client: openai.OpenAI, model: str) -> list[dict[str, object]]:
    """Two greedy choices of a JSON document for CITY, parsed."""
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give the capital of France and its population as JSON."}],
        max_tokens=60,
        temperature=0,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
    )
    assert len(reply.choices) == 2
    return [json.loads(choice.message.content or "") for choice in reply.choices]


def instance_metrics(api: str, instance_id: str) -> dict[str, float]:
    """The instance's figures in `/metrics`, by name."""
    lines = httpx.get(f"{api}/metrics", timeout=10).text.splitlines()
    mine = [line for line in lines if f'instance="{instance_id}"' in line]
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in mine}


def assert_drafts_counted(api: str, instance_id: str) -> None:
    """The instance counted tokens drafted and some kept (`/metrics`), and the cluster's view (the dashboard's and
    `jetshard status`'s) gives the share kept."""

    def counted() -> dict[str, float]:
        return instance_metrics(api, instance_id)

    assert wait_for(lambda: counted().get("jetshard_draft_tokens_total", 0) > 0, timeout=30), counted()
    figures = counted()
    assert 0 < figures["jetshard_draft_accepted_tokens_total"] <= figures["jetshard_draft_tokens_total"]

    def acceptance() -> float | None:
        view = httpx.get(f"{api}/view", timeout=10).json()
        (shown,) = [i for i in view["instances"] if i["instance_id"] == instance_id]
        return shown["draft_acceptance"]  # type: ignore[no-any-return]

    assert wait_for(lambda: acceptance() is not None, timeout=30)
    assert 0 < (acceptance() or 0) <= 1


@pytest.mark.timeout(600)  # a draft as large as its model halves its speed: on a busy machine, minutes
@pytest.mark.parametrize("engine", ["llama.cpp", "mlx"])
def test_a_draft_model_is_fetched_for_the_leader_and_answers_token_for_token_as_without_it(
    engine: str,
    request: pytest.FixtureRequest,
    llamacpp_cluster: LlamaCppCluster,
    client: openai.OpenAI,
    tmp_path: Path,
) -> None:
    # The draft is the demo's GGUF in a Hub repo of its own: it shares the tokenizer, and most of its drafts are
    # kept. Its card is added, its files are on no node: placing the model that it drafts for fetches them, in the
    # form the engine loads (MLX: converted).
    plain = request.getfixturevalue("plain_instance" if engine == "llama.cpp" else "mlx_plain")
    plain_model, drafted_model = (
        (PLAIN_MODEL, DRAFTED_MODEL) if engine == "llama.cpp" else (MLX_PLAIN_MODEL, MLX_DRAFTED_MODEL)
    )
    api, cluster = llamacpp_cluster.api, llamacpp_cluster.cluster
    gguf, _ = packaged_gguf_path(builtin_cards()[DEMO_MODEL_ID])
    repo = tmp_path / "draft-repo"
    repo.mkdir()
    (repo / "draft.gguf").symlink_to(gguf)
    cluster.hub.add_repo(DRAFT_MODEL, repo)
    added = httpx.post(f"{api}/models", json={"model_id": DRAFT_MODEL, "gguf_file": "draft.gguf"}, timeout=60)
    assert added.status_code == 201, added.text
    try:
        with demo_placed_as(llamacpp_cluster, drafted_model, {"draft": DRAFT_MODEL}, {"engine": engine}) as instance:
            assert instance["serving"]["draft"] == DRAFT_MODEL  # type: ignore[index]
            # The model that drafts takes its room on the leader.
            assert reserved_bytes(instance) > reserved_bytes(plain) + gguf.stat().st_size
            if engine == "llama.cpp":  # it runs in the model's llama-server
                servers = [
                    p.info["cmdline"]
                    for p in psutil.process_iter(["cmdline"])
                    if serves(p.info["cmdline"], drafted_model)
                ]
                (server,) = servers
                assert model_dir_name(ModelId(DRAFT_MODEL)) in server[server.index("--model-draft") + 1]
            for prompt in [CODE_EDIT, PROMPTS[0]]:
                assert greedy_text(client, drafted_model, prompt) == greedy_text(client, plain_model, prompt), prompt
            # With n choices and a grammar too: the same as without drafting.
            assert structured(client, drafted_model) == structured(client, plain_model)
            assert_drafts_counted(api, str(instance["instance_id"]))
    finally:
        httpx.delete(f"{api}/models/{DRAFT_MODEL}", timeout=30)


@pytest.mark.parametrize(
    ("asked", "says"),
    [
        ({"serving": {"kv_cache_type": "q3_k"}}, "kv_cache_type"),
        ({"serving": {"draft": "eagle"}}, "draft"),
        ({"serving": {"draft": "nobody/nothing"}}, "draft nobody/nothing is not a known model"),
        ({"serving": {"draft": DEMO_MODEL_ID}}, "is the model itself"),
    ],
)
def test_a_kv_cache_type_that_cannot_be_is_a_clear_400(
    llamacpp_cluster: LlamaCppCluster, asked: dict[str, object], says: str
) -> None:
    body = {"model_id": DEMO_MODEL_ID, "min_nodes": 1, **asked}
    response = httpx.post(f"{llamacpp_cluster.api}/instances", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert says in response.text
