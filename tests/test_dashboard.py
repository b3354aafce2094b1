"""The dashboard at `/` in a real headless Chromium (Debian's, driven by Playwright), on the dialect cluster (one
node serving a tiny random model): it shows the node and the instance, a chat answer streams in, and changes
made through the API (a download, an instance placed and deleted) show within 5 s without a reload. With an
API key set, the page asks for it and then works; when its API goes away it says so and reconnects by itself.

Screenshots are saved in a temporary directory whose path the tests print (`pytest -s` shows it).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.browser import SHOWN_MS, Troubles, chat, chromium, expect_streaming
from helpers.dialects import SHARED_MODEL, DialectCluster
from helpers.harness import wait_for
from helpers.tiny_models import ANSWER, THOUGHT, endless_model, make_tiny_model, thinking_model
from jetshard_schema.ids import ModelId, model_dir_name
from openai import OpenAI
from playwright.sync_api import Browser, Page, expect
from test_gguf_cards import QWEN3_TEMPLATE, write_gguf

SECOND_MODEL = "jetshard-test/tiny-dashboard"
PAGE_MODEL = "jetshard-test/tiny-from-the-page"
PAGE_GGUF = "jetshard-test/tiny-gguf-from-the-page"
HELD_MODEL = "jetshard-test/tiny-held"
GATED_MODEL = "jetshard-test/tiny-gated"
THINKING_MODEL = "jetshard-test/tiny-thinking-on-the-page"
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


@contextmanager
def dashboard(browser: Browser, api: str) -> Iterator[tuple[Page, Troubles]]:
    """The dashboard opened in a page of its own, watched for troubles: none may be seen by the end of the block
    but those a test took itself."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        troubles = Troubles(page)
        page.goto(f"{api}/")
        yield page, troubles
        assert troubles.seen == []
    finally:
        page.close()


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


def test_the_page_shows_the_cluster_answers_a_chat_and_follows_changes(
    browser: Browser, dialect_cluster: DialectCluster, screenshots: Path, tmp_path: Path
) -> None:
    cluster, api = dialect_cluster.cluster, dialect_cluster.api
    node_id = cluster.node_ids["node-a"]
    (instance,) = cluster.instances_of(dialect_cluster.model)
    assert not {"/", "/dashboard"} & {p.rstrip("/") or "/" for p in cluster.get("/openapi/openapi.json")["paths"]}
    with dashboard(browser, api) as (page, _):
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

        # A turn that waits: while the sequencer is paused its task is not assigned, and the answer says what it waits
        # for, as the stream's keep-alive comments tell, until it streams in.
        (sequencer,) = [p for p in cluster.processes.started if p.args[-1] == "sequencer"]
        answers = page.locator("#chat-log .message-assistant")
        os.killpg(sequencer.pid, signal.SIGSTOP)
        try:
            page.fill("#chat-input", "Still there?")
            page.press("#chat-input", "Enter")
            expect(answers.last.locator(".note.waiting")).to_have_text("submitting", timeout=30_000)
        finally:
            os.killpg(sequencer.pid, signal.SIGCONT)
        expect(page.locator("#chat-stop")).to_be_disabled(timeout=60_000)
        expect(answers.last.locator(".note")).to_have_count(0)
        expect(answers.last.locator(".text")).not_to_have_text("")

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
        expect(page.locator('#events li[data-type="InstanceDeleted"]', has_text=placed)).to_have_count(
            1, timeout=SHOWN_MS
        )
        api_call("DELETE", f"{api}/downloads/{node_id}/{SECOND_MODEL}")
        expect(model.locator(".download")).to_have_count(0, timeout=SHOWN_MS)  # its card stays, custom
        expect(model).to_contain_text("custom")
        expect(page.locator("#chat-model option")).to_have_text([dialect_cluster.model])
        expect(shown).to_have_attribute("data-status", "ready")
        page.screenshot(path=screenshots / "after-changes.png", full_page=True)
        page.emulate_media(color_scheme="dark")
        page.screenshot(path=screenshots / "dark.png", full_page=True)


def test_a_thinking_model_shows_its_reasoning_apart_from_its_answer(
    browser: Browser, dialect_cluster: DialectCluster, tmp_path: Path
) -> None:
    """The reasoning streams into a fold of its own that closes when the answer starts; an answer cut off while the
    model still reasons keeps its reasoning and its turn."""
    with (
        dialect_cluster.serving(THINKING_MODEL, thinking_model(tmp_path / "thinking")),
        dashboard(browser, dialect_cluster.api) as (page, _),
    ):
        expect(page.locator("#chat-model option", has_text=THINKING_MODEL)).to_have_count(1, timeout=SHOWN_MS)
        page.select_option("#chat-model", THINKING_MODEL)
        page.fill("#chat-temperature", "0")
        assert chat(page, "Is it?") == ANSWER
        answer = page.locator("#chat-log .message-assistant").last
        expect(answer.locator(".reasoning .thought")).to_have_text(THOUGHT)
        expect(answer.locator(".reasoning")).not_to_have_attribute("open", "")  # folded once the answer came

        page.fill("#chat-max-tokens", "2")  # `<think>` and the thought's first token
        page.fill("#chat-input", "Is it?")
        page.press("#chat-input", "Enter")
        expect(page.locator("#chat-log .message-assistant")).to_have_count(2, timeout=SHOWN_MS)
        expect(page.locator("#chat-stop")).to_be_disabled(timeout=60_000)
        cut = page.locator("#chat-log .message-assistant").last
        expect(cut.locator(".reasoning .thought")).not_to_have_text("")
        begun = cut.locator(".reasoning .thought").text_content() or ""
        assert THOUGHT.startswith(begun) and begun != THOUGHT, begun
        expect(cut.locator(".reasoning")).to_have_attribute("open", "")
        expect(cut.locator(".text")).to_have_text("")
        expect(page.locator("#chat-log .message.dropped")).to_have_count(0)


@pytest.mark.usefixtures("restores_the_dialect_cluster")
def test_a_model_is_added_placed_served_and_removed_from_the_page(
    browser: Browser, dialect_cluster: DialectCluster, screenshots: Path, tmp_path: Path
) -> None:
    cluster, api = dialect_cluster.cluster, dialect_cluster.api
    node_id = cluster.node_ids["node-a"]
    cluster.hub.add_repo(PAGE_MODEL, endless_model(tmp_path / "page-model"))
    with dashboard(browser, api) as (page, troubles):
        expect(page.locator("#connection")).to_have_text("live", timeout=SHOWN_MS)
        models = page.locator("#models")
        expect(models.locator('[data-kind="builtin"]').first).to_contain_text("built-in")
        expect(models.get_by_role("button", name=re.compile("^Delete card "))).to_have_count(
            len([m for m in cluster.get("/view")["models"] if m["known"] and not m["builtin"]])
        )  # only custom cards can be deleted

        # A repo the Hub does not have: the API's words, in the page.
        field = page.get_by_label("Hugging Face model id")
        field.fill("jetshard-test/no-such-repo")
        page.get_by_role("button", name="Add model").click()
        expect(page.locator("#add-model-message")).to_have_text(
            "jetshard-test/no-such-repo was not found on the Hub (or is private and HF_TOKEN is not set)",
            timeout=SHOWN_MS,
        )
        page.screenshot(path=screenshots / "add-unknown-repo.png", full_page=True)

        # Added by its id: on the page, marked custom, and in every node's card store.
        field.fill(PAGE_MODEL)
        field.press("Enter")
        expect(page.locator("#add-model-message")).to_have_text(f"Added {PAGE_MODEL}: its card is on every node")
        model = models.locator(f'[data-model-id="{PAGE_MODEL}"]')
        expect(model).to_contain_text("custom", timeout=SHOWN_MS)
        expect(model).to_contain_text("4 layers")
        expect(model).to_contain_text("completion · tools · embedding")
        card_file = f"{model_dir_name(ModelId(PAGE_MODEL))}.json"
        stores = [cluster.root / node / "config" / "cards" / card_file for node in cluster.workers]
        assert wait_for(lambda: all(store.exists() for store in stores), timeout=10), stores

        # One GGUF file of a repo, typed as `repo:file.gguf`: its card read from the file's header.
        gguf_repo = tmp_path / "page-gguf"
        gguf_repo.mkdir()
        write_gguf(gguf_repo / "Tiny-Q4_K_M.gguf", "qwen3", template=QWEN3_TEMPLATE)
        cluster.hub.add_repo(PAGE_GGUF, gguf_repo)
        field.fill(f"{PAGE_GGUF}:Tiny-Q4_K_M.gguf")
        field.press("Enter")
        expect(page.locator("#add-model-message")).to_have_text(f"Added {PAGE_GGUF}: its card is on every node")
        gguf_card = models.locator(f'[data-model-id="{PAGE_GGUF}"] .capabilities')
        expect(gguf_card).to_contain_text("completion · tools · thinking · embedding", timeout=SHOWN_MS)
        expect(gguf_card).to_contain_text("Q4_K_M")  # the type its header gives, as llama.cpp names it

        # The preview, in the page's own dialog, opened and closed from the keyboard.
        place = page.get_by_role("button", name=f"Place {PAGE_MODEL}")
        place.focus()
        page.keyboard.press("Enter")
        dialog = page.get_by_role("dialog", name=f"Place {PAGE_MODEL}")
        expect(dialog).to_be_visible()
        expect(dialog.locator(f'tr[data-node-id="{node_id}"]')).to_contain_text("[0, 4)")
        expect(dialog.locator(f'tr[data-node-id="{node_id}"]')).to_contain_text("cpu")
        chosen = cluster.get(f"/instances/preview?model_id={PAGE_MODEL}")
        expect(dialog).to_contain_text(f"on {chosen['engine']} (placement's choice)")
        expect(dialog).to_contain_text(f"weights {chosen['serving']['weights']}")
        # An engine chosen by hand: the card has no GGUF, so llama.cpp cannot serve it, and says why.
        dialog.get_by_label("Engine").select_option("llama.cpp")
        expect(dialog.locator(".impossible")).to_contain_text("has no gguf weights, which llama.cpp serves")
        expect(dialog.get_by_role("button", name="Place", exact=True)).to_be_disabled()
        dialog.get_by_label("Engine").select_option("")
        expect(dialog.locator(f'tr[data-node-id="{node_id}"]')).to_be_visible()
        expect(dialog).to_contain_text("KV cache auto")
        # This tiny model's heads are too narrow for MLX to quantize its KV cache, and it has no GGUF: the dialog says
        # why a cache in 8 bits cannot be.
        dialog.get_by_label("KV cache").select_option("q8_0")
        expect(dialog.locator(".impossible")).to_contain_text("heads are 16 wide")
        expect(dialog.get_by_role("button", name="Place", exact=True)).to_be_disabled()
        dialog.get_by_label("KV cache").select_option("")
        expect(dialog.locator(f'tr[data-node-id="{node_id}"]')).to_be_visible()
        expect(dialog.get_by_label("Drafting").locator("option")).to_have_count(2)  # its card pairs it with no draft
        page.keyboard.press("Escape")
        expect(dialog).to_be_hidden()
        expect(place).to_be_focused()

        # A catalogue model that its card pairs with a smaller one to draft: the dialog offers that one too, and shows
        # the preview with it as the API gives it (placeable where this node runs the suite's llama.cpp build, else
        # why not).
        paired, draft = "Qwen/Qwen3-8B-Q4_K_M", "unsloth/Qwen3-0.6B-Q4_K_M"
        asked = {"model_id": paired, "draft": draft}
        placeable = httpx.get(f"{api}/instances/preview", params=asked, timeout=30).status_code == 200
        page.get_by_role("button", name=f"Place {paired}").click()
        paired_dialog = page.get_by_role("dialog", name=f"Place {paired}")
        drafting = paired_dialog.get_by_label("Drafting")
        expect(drafting.locator("option")).to_have_text(
            ["the API's setting", "ngram (prompt lookup)", f"{draft} (its card's draft model)"]
        )
        with page.expect_request(lambda r: "/instances/preview" in r.url and "draft=unsloth%2FQwen3-0.6B" in r.url):
            drafting.select_option(draft)
        if placeable:
            expect(paired_dialog).to_contain_text(f"drafting {draft};")
        else:
            expect(paired_dialog.locator(".impossible")).to_contain_text("It cannot be placed now:")
        page.keyboard.press("Escape")
        expect(paired_dialog).to_be_hidden()

        # Two nodes asked of a one-node cluster: why not, and no Place.
        place.click()
        dialog.get_by_label("Nodes at least").fill("2")
        expect(dialog.locator(".impossible")).to_contain_text("It cannot be placed now:")
        expect(dialog.get_by_role("button", name="Place", exact=True)).to_be_disabled()
        page.screenshot(path=screenshots / "place-impossible.png", full_page=True)
        dialog.get_by_label("Nodes at least").fill("1")
        expect(dialog.locator(f'tr[data-node-id="{node_id}"]')).to_be_visible()
        page.screenshot(path=screenshots / "place-preview.png", full_page=True)
        dialog.get_by_role("button", name="Place", exact=True).click()
        expect(dialog).to_be_hidden()
        expect(page.locator("#notice")).to_contain_text(f"Placed {PAGE_MODEL} as instance ")
        (instance,) = cluster.instances_of(PAGE_MODEL)
        instance_id = instance["instance_id"]
        shown = page.locator(f'#instances [data-instance-id="{instance_id}"]')
        expect(shown).to_contain_text(instance_id)
        expect(shown.locator(".engine")).to_have_text(instance["engine"])
        expect(shown).to_have_attribute("data-status", "ready", timeout=60_000)

        # Ready, with the node's directory that holds its files.
        (download,) = [d for d in cluster.get("/downloads") if d["model_id"] == PAGE_MODEL]
        models_dir = cluster.root / "node-a" / "models"
        assert Path(download["directory"]).parent == models_dir
        row = model.locator(f'.download[data-node-id="{node_id}"]')
        expect(row.locator(".where")).to_contain_text(f"in {models_dir} ({Path(download['directory']).name})")
        expect(page.locator(f'#nodes [data-node-id="{node_id}"] .dirs li[data-path="{models_dir}"]')).to_contain_text(
            "free of"
        )
        page.screenshot(path=screenshots / "placed-ready.png", full_page=True)

        # A chat with it, as the API answers; then one that would run on until its task is cancelled, streaming in.
        page.select_option("#chat-model", PAGE_MODEL)
        page.fill("#chat-temperature", "0")
        page.fill("#chat-max-tokens", str(ANSWER_TOKENS))
        assert chat(page, "Hello there.") == greedy_answer(
            api, PAGE_MODEL, [{"role": "user", "content": "Hello there."}]
        )
        page.fill("#chat-max-tokens", "60000")  # minutes of tokens: it ends only when cancelled
        page.fill("#chat-input", "Go on for ever.")
        page.press("#chat-input", "Enter")
        expect_streaming(page)
        cancel = page.get_by_role("button", name=re.compile("^Cancel task "))
        expect(cancel).to_have_count(1, timeout=SHOWN_MS)
        page.screenshot(path=screenshots / "task-running.png", full_page=True)
        cancel.click()
        expect(page.locator("#chat-stop")).to_be_disabled(timeout=SHOWN_MS)
        expect(page.locator("#chat-log .message-assistant").last.locator(".note.error")).to_contain_text("cancel")
        expect(page.locator("#tasks")).to_have_text("none", timeout=SHOWN_MS)

        # The instance deleted, after the page's own confirmation.
        page.get_by_role("button", name=f"Delete instance {instance_id}").click()
        confirm = page.get_by_role("dialog", name=f"Delete instance {instance_id}?")
        expect(confirm).to_be_visible()
        page.screenshot(path=screenshots / "delete-instance.png", full_page=True)
        confirm.get_by_role("button", name="Delete", exact=True).click()
        expect(shown).to_have_count(0, timeout=SHOWN_MS)

        # Its files deleted from the node, then its card from every node.
        page.get_by_role("button", name=f"Delete files of {PAGE_MODEL} on {node_id}").click()
        page.get_by_role("dialog").get_by_role("button", name="Delete", exact=True).click()
        expect(row).to_have_count(0, timeout=SHOWN_MS)
        # As below: the row goes when the delete is asked for, the files when the downloader has deleted them.
        assert wait_for(lambda: not Path(download["directory"]).exists(), timeout=30), download
        expect(model.get_by_role("button", name=f"Download {PAGE_MODEL} to {node_id}")).to_be_visible()
        page.get_by_role("button", name=f"Delete card {PAGE_MODEL}").click()
        page.get_by_role("dialog").get_by_role("button", name="Delete", exact=True).click()
        expect(model).to_have_count(0, timeout=SHOWN_MS)
        assert wait_for(lambda: not any(store.exists() for store in stores), timeout=10), stores
        page.screenshot(path=screenshots / "removed.png", full_page=True)

        # What went wrong on purpose, and nothing else: the unknown repo, the engine and the KV cache that cannot serve
        # the model, the impossible placements.
        # (The page closes the cancelled answer's stream itself, which the browser counts as a failed request when
        # it is quicker than the API.)
        cancelled_chat = f"failed: POST {api}/v1/chat/completions: net::ERR_ABORTED"
        seen = [t for t in troubles.take() if t != cancelled_chat]
        refused = [t.split("?")[0] for t in seen if not t.startswith("console error: Failed to load resource")]
        preview = f"GET {api}/instances/preview"
        impossible = [f"409: {preview}"] * (1 if placeable else 3)  # two nodes (and the paired model, without and with)
        assert refused == [f"404: POST {api}/models", f"400: {preview}", f"400: {preview}", *impossible]
        assert len(seen) == 2 * len(refused)  # the browser's console says the same of each


@pytest.mark.usefixtures("restores_the_dialect_cluster")
def test_files_in_a_read_only_directory_are_shown_there_and_offer_no_delete(
    browser: Browser, dialect_cluster: DialectCluster, screenshots: Path
) -> None:
    cluster, api, shared = dialect_cluster.cluster, dialect_cluster.api, dialect_cluster.shared_dir
    node_id = cluster.node_ids["node-a"]
    with dashboard(browser, api) as (page, _):
        expect(page.locator(f'#nodes [data-node-id="{node_id}"] .dirs li[data-path="{shared}"]')).to_contain_text(
            "read-only", timeout=SHOWN_MS
        )

        # The card added elsewhere: the models are rebuilt with it, and a keyboard user's place stays.
        place = page.get_by_role("button", name=f"Place {dialect_cluster.model}")
        place.focus()
        api_call("POST", f"{api}/models", json={"model_id": SHARED_MODEL})
        download = page.get_by_role("button", name=f"Download {SHARED_MODEL} to {node_id}")
        expect(download).to_be_visible(timeout=SHOWN_MS)
        expect(place).to_be_focused()
        download.click()
        row = page.locator(f'#models [data-model-id="{SHARED_MODEL}"] .download[data-node-id="{node_id}"]')
        expect(row).to_have_attribute("data-status", "completed", timeout=30_000)
        expect(row.locator(".where")).to_contain_text(f"in {shared} ({model_dir_name(ModelId(SHARED_MODEL))})")
        expect(row.locator(".where .badge")).to_have_text("read-only")
        expect(row).to_contain_text("read-only directory: jetshard uses these files and never deletes them")
        expect(row.get_by_role("button")).to_have_count(0)  # no Delete files
        assert (shared / model_dir_name(ModelId(SHARED_MODEL)) / "config.json").exists()
        page.screenshot(path=screenshots / "read-only.png", full_page=True)


@pytest.mark.usefixtures("restores_the_dialect_cluster")
def test_a_gguf_file_a_node_has_is_imported_from_the_page(
    browser: Browser, dialect_cluster: DialectCluster, tmp_path: Path
) -> None:
    """A file the user downloaded, named by its path on the node: a wrong path gets the downloader's words, the
    right one is served as `local/<file name>` (the card read from its header), and its files can go again."""
    cluster, api = dialect_cluster.cluster, dialect_cluster.api
    node_id = cluster.node_ids["node-a"]
    (tmp_path / "Downloads").mkdir()
    gguf = write_gguf(tmp_path / "Downloads" / "page import.Q4_K_M.gguf", "qwen3", template=QWEN3_TEMPLATE)
    with dashboard(browser, api) as (page, troubles):
        expect(page.locator("#connection")).to_have_text("live", timeout=SHOWN_MS)
        expect(page.get_by_label("on", exact=True)).to_have_value(node_id)  # the only node
        page.get_by_label("GGUF file").fill(str(gguf.with_name("missing.gguf")))
        page.get_by_role("button", name="Import", exact=True).click()
        expect(page.locator("#import-message")).to_have_text(
            f"{gguf.with_name('missing.gguf')} does not exist on this node", timeout=SHOWN_MS
        )

        page.get_by_label("GGUF file").fill(str(gguf))
        page.get_by_role("button", name="Import", exact=True).click()
        imported = "local/page-import.Q4_K_M"
        expect(page.locator("#import-message")).to_have_text(
            f"Imported {imported} (Q4_K_M) on {node_id}", timeout=SHOWN_MS
        )
        model = page.locator(f'#models [data-model-id="{imported}"]')
        expect(model.locator(".capabilities")).to_contain_text("Q4_K_M, completion · tools · thinking")
        expect(model.locator(f'.download[data-node-id="{node_id}"]')).to_have_attribute("data-status", "completed")
        page.get_by_role("button", name=f"Delete files of {imported} on {node_id}").click()
        page.get_by_role("dialog").get_by_role("button", name="Delete", exact=True).click()
        expect(model.locator(".download")).to_have_count(0, timeout=SHOWN_MS)
        assert gguf.exists()  # the user's own file stays where it was
        seen = troubles.take()
        assert [t for t in seen if not t.startswith("console error")] == [f"400: POST {api}/models/import"], seen


@pytest.mark.usefixtures("restores_the_dialect_cluster")
def test_a_download_is_started_cancelled_and_its_files_deleted_from_the_page(
    browser: Browser, dialect_cluster: DialectCluster, screenshots: Path, tmp_path: Path
) -> None:
    cluster, api, hub = dialect_cluster.cluster, dialect_cluster.api, dialect_cluster.cluster.hub
    node_id = cluster.node_ids["node-a"]
    held = "model-00002-of-00002.safetensors"  # fetched last: the first file is on disk when it is cancelled
    hub.add_repo(HELD_MODEL, make_tiny_model(tmp_path / "held", num_layers=2, num_files=2, hidden_size=256))
    hub.hold_after(HELD_MODEL, held, 2**20)
    try:
        api_call("POST", f"{api}/models", json={"model_id": HELD_MODEL})
        with dashboard(browser, api) as (page, _):
            page.get_by_role("button", name=f"Download {HELD_MODEL} to {node_id}").click()
            assert hub.wait_held(HELD_MODEL, held, 30)
            row = page.locator(f'#models [data-model-id="{HELD_MODEL}"] .download[data-node-id="{node_id}"]')
            cancel = row.get_by_role("button", name=f"Cancel download of {HELD_MODEL} on {node_id}")
            expect(cancel).to_be_visible(timeout=SHOWN_MS)
            page.screenshot(path=screenshots / "downloading.png", full_page=True)
            cancel.click()
            expect(row).to_have_attribute("data-status", "cancelled", timeout=SHOWN_MS)
            hub.release()  # the next chunk reaches the downloader, which stops there and says so
            expect(row.locator(".reason")).to_contain_text("stopped", timeout=20_000)
            expect(row.get_by_role("button", name=f"Download {HELD_MODEL} to {node_id}")).to_have_text("Download")
            (download,) = [d for d in cluster.get("/downloads") if d["model_id"] == HELD_MODEL]
            kept = Path(download["directory"])
            assert kept.parent == cluster.root / "node-a" / "models" and kept.is_dir()  # kept for the next attempt
            expect(row.locator(".where")).to_contain_text(f"in {kept.parent} ({kept.name})")

            row.get_by_role("button", name=f"Delete files of {HELD_MODEL} on {node_id}").click()
            page.get_by_role("dialog").get_by_role("button", name="Delete", exact=True).click()
            expect(row).to_have_count(0, timeout=SHOWN_MS)
            # The row goes once the delete is asked for; the files, once the node's downloader has deleted them.
            assert wait_for(lambda: not kept.exists(), timeout=30), kept
    finally:
        hub.release()


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
    # The page's actions send the key too: a preview, and the Hub's answer for a repo it does not have.
    page.get_by_role("button", name=f"Place {dialect_cluster.model}").click()
    dialog = page.get_by_role("dialog", name=f"Place {dialect_cluster.model}")
    expect(dialog.locator(f'tr[data-node-id="{cluster.node_ids["node-a"]}"]')).to_be_visible()
    dialog.get_by_role("button", name="Cancel").click()
    page.get_by_label("Hugging Face model id").fill("jetshard-test/not-on-the-hub")
    page.get_by_role("button", name="Add model").click()
    expect(page.locator("#add-model-message")).to_contain_text("jetshard-test/not-on-the-hub was not found on the Hub")
    cluster.hub.add_repo(GATED_MODEL, dialect_cluster.model_dir, gated=True)
    page.get_by_label("Hugging Face model id").fill(GATED_MODEL)
    page.get_by_role("button", name="Add model").click()
    expect(page.locator("#add-model-message")).to_have_text(
        f"{GATED_MODEL} is gated or private: accept its terms on the Hub and set HF_TOKEN"
    )
    # A hostile id comes back in the API's refusal as text, never as markup.
    page.get_by_label("Hugging Face model id").fill("<img src=x onerror=alert(1)>/y")
    page.get_by_role("button", name="Add model").click()
    expect(page.locator("#add-model-message")).to_contain_text("model id '<img src=x onerror=alert(1)>/y'")
    expect(page.locator("#add-model-message img")).to_have_count(0)
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


def test_the_keep_alive_of_models_placed_for_requests_is_set_from_the_page(
    browser: Browser, dialect_cluster: DialectCluster
) -> None:
    api = dialect_cluster.api
    with dashboard(browser, api) as (page, _):
        expect(page.locator("#connection")).to_have_text("live", timeout=SHOWN_MS)
        field = page.get_by_label("Unload a model placed for requests after this many idle seconds")
        expect(field).to_have_value("300")  # the API's default: 5 minutes
        try:
            field.fill("600")
            page.get_by_role("button", name="Save").click()
            expect(page.locator("#keep-alive-message")).to_have_text(
                "Models placed for requests from now on unload after 600 s idle, on every API"
            )
            assert api_call("GET", f"{api}/settings") == {"model_keep_alive_s": 600, "cluster_wide": True}
        finally:
            api_call("PUT", f"{api}/settings", json={"model_keep_alive_s": None})
