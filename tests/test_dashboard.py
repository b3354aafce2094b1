"""The dashboard at `/` in a real headless Chromium (Debian's, driven by Playwright), on the dialect cluster (one
node serving a tiny random model): it shows the node and the instance, a chat answer streams in, and changes
made through the API (a download, an instance placed and deleted) show within 5 s without a reload. With an
API key set, the page asks for it and then works; when its API goes away it says so and reconnects by itself.

Screenshots are saved in a temporary directory whose path the tests print (`pytest -s` shows it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.browser import SHOWN_MS, Troubles, chat, chromium
from helpers.dialects import DialectCluster
from helpers.harness import wait_for
from helpers.tiny_models import make_tiny_model
from openai import OpenAI
from playwright.sync_api import Browser, expect

SECOND_MODEL = "jetshard-test/tiny-dashboard"
KEY = "dashboard-key-0123456789"
ANSWER_TOKENS = 24

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as launched:
        yield launched


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dashboard-screenshots")
    print(f"\ndashboard screenshots in {folder}")
    return folder


def greedy_answer(api: str, model: str, messages: list[dict[str, str]]) -> str:
    client = OpenAI(base_url=f"{api}/v1", api_key="unused", timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=ANSWER_TOKENS,
    )
    return reply.choices[0].message.content or ""


def api_call(method: str, url: str, **kwargs: Any) -> Any:
    response = httpx.request(method, url, timeout=60, **kwargs)
    assert response.status_code < 300, response.text
    return response.json()


def test_the_page_shows_the_cluster_streams_a_chat_and_follows_changes(
    browser: Browser, dialect_cluster: DialectCluster, screenshots: Path, tmp_path: Path
) -> None:
    cluster, api = dialect_cluster.cluster, dialect_cluster.api
    node_id = cluster.node_ids["node-a"]
    (instance,) = cluster.instances_of(dialect_cluster.model)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    troubles = Troubles(page)
    assert not {"/", "/dashboard"} & {p.rstrip("/") or "/" for p in cluster.get("/openapi/openapi.json")["paths"]}
    page.goto(f"{api}/")

    expect(page.locator("#connection")).to_have_text("live", timeout=SHOWN_MS)
    node = page.locator(f'#nodes [data-node-id="{node_id}"]')
    expect(node).to_contain_text("alive")
    expect(node).to_contain_text("memory")
    shown = page.locator(f'#instances [data-instance-id="{instance["instance_id"]}"]')
    expect(shown).to_contain_text(dialect_cluster.model)
    expect(shown.locator(".shard .layers")).to_have_text(["layers [0, 2)"])
    expect(shown.locator(".shard .badge")).to_have_text(["ready"])
    expect(shown.locator(".shard")).to_contain_text(node_id)
    expect(page.locator("#events li").first).to_be_visible()

    # Two turns, each the same as the greedy answer through the API to the same conversation.
    expect(page.locator("#chat-model")).to_have_value(dialect_cluster.model)
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", str(ANSWER_TOKENS))
    conversation = [{"role": "user", "content": "Say something."}]
    first = chat(page, conversation[0]["content"])
    assert first == greedy_answer(api, dialect_cluster.model, conversation)
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "And more?"}]
    second = chat(page, "And more?")
    assert second == greedy_answer(api, dialect_cluster.model, conversation)
    page.screenshot(path=screenshots / "chat.png", full_page=True)

    # A download started through the API: the model appears with its node's progress, then completes.
    cluster.hub.add_repo(
        SECOND_MODEL, make_tiny_model(tmp_path / "second", arch="llama", num_layers=2, num_files=2, seed=9)
    )
    api_call("POST", f"{api}/models", json={"model_id": SECOND_MODEL})
    api_call("POST", f"{api}/downloads", json={"model_id": SECOND_MODEL, "node_id": node_id})
    model = page.locator(f'#models [data-model-id="{SECOND_MODEL}"]')
    expect(model.locator(f'.download[data-node-id="{node_id}"]')).to_be_visible(timeout=SHOWN_MS)
    expect(model.locator(".download")).to_have_attribute("data-status", "completed", timeout=60_000)
    expect(model).to_contain_text("100%")
    expect(page.locator('#events li[data-type="DownloadRequested"]', has_text=SECOND_MODEL)).to_have_count(
        1, timeout=SHOWN_MS
    )

    # A second instance placed, tensor-parallel (on its one node, tensor rank 0 of 1): it shows up and comes ready,
    # its shard's tensor rank beside its layers; deleted, it goes.
    body = {"model_id": SECOND_MODEL, "min_nodes": 1, "parallelism": "tensor"}
    placed = api_call("POST", f"{api}/instances", json=body)["instance_id"]
    second_instance = page.locator(f'#instances [data-instance-id="{placed}"]')
    expect(second_instance).to_be_visible(timeout=SHOWN_MS)
    expect(second_instance).to_have_attribute("data-status", "ready", timeout=60_000)
    expect(second_instance.locator(".shard .layers")).to_have_text("layers [0, 2)")
    expect(second_instance.locator(".shard .tensor-rank")).to_have_text("tensor rank 0")
    expect(shown.locator(".shard .tensor-rank")).to_have_count(0)  # a pipeline's shards hold whole layers
    expect(page.locator("#chat-model option")).to_have_text(sorted([dialect_cluster.model, SECOND_MODEL]))
    page.screenshot(path=screenshots / "two-instances.png", full_page=True)

    api_call("DELETE", f"{api}/instances/{placed}")
    expect(second_instance).to_have_count(0, timeout=SHOWN_MS)
    expect(page.locator('#events li[data-type="InstanceDeleted"]', has_text=placed)).to_have_count(1, timeout=SHOWN_MS)
    api_call("DELETE", f"{api}/downloads/{node_id}/{SECOND_MODEL}")
    expect(model).to_have_count(0, timeout=SHOWN_MS)
    expect(page.locator("#chat-model option")).to_have_text([dialect_cluster.model])
    expect(shown).to_have_attribute("data-status", "ready")
    page.screenshot(path=screenshots / "after-changes.png", full_page=True)
    page.emulate_media(color_scheme="dark")
    page.screenshot(path=screenshots / "dark.png", full_page=True)

    assert troubles.seen == []
    page.close()


def test_with_an_api_key_the_page_asks_for_it_and_reconnects_after_the_api_restarts(
    browser: Browser, dialect_cluster: DialectCluster, screenshots: Path
) -> None:
    cluster = dialect_cluster.cluster
    keyed = cluster.start_api(["--api-key", KEY], name="api-keyed")
    port = keyed.rsplit(":", 1)[1]
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(f"{keyed}/")
    expect(page.locator("#connection")).to_have_text("API key needed", timeout=SHOWN_MS)
    expect(page.locator("#api-key")).to_be_focused()
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    expect(page.locator("#connection")).to_have_text("live", timeout=SHOWN_MS)
    expect(page.locator(f'#nodes [data-node-id="{cluster.node_ids["node-a"]}"]')).to_be_visible()
    page.fill("#chat-max-tokens", "4")
    page.fill("#chat-input", "Hello?")
    page.click("#chat-send")
    expect(page.locator("#chat-stop")).to_be_disabled(timeout=60_000)
    expect(page.locator("#chat-log .message-assistant .text")).not_to_have_text("")

    # The API goes away: the page says so; it comes back on the same port: the page is live again, unreloaded.
    (process,) = [p for p in cluster.processes.started if any("api-keyed.port" in str(a) for a in p.args)]
    cluster.processes.kill(process)
    expect(page.locator("#connection")).to_have_text("disconnected", timeout=SHOWN_MS)
    page.screenshot(path=screenshots / "disconnected.png", full_page=True)
    again = cluster.processes.start("api-keyed", "api", "--port", port, "--api-key", KEY, env=cluster.base_env)
    try:
        assert wait_for(lambda: answers(f"{keyed}/healthz"), timeout=60), cluster.processes.log("api-keyed")
        expect(page.locator("#connection")).to_have_text("live", timeout=SHOWN_MS)
        expect(page.locator("#chat-log .message-assistant")).to_have_count(1)  # the same page, not reloaded
    finally:
        context.close()
        cluster.processes.kill(again)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
