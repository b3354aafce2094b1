"""A real headless Chromium (Debian's, driven by Playwright; never `playwright install`, which downloads a
browser of its own) and what a person would notice on the dashboard: trouble, and a chat answer streaming in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, Response, expect, sync_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
SHOWN_MS = 5000
"""A change made through the API is on the page within this, without a reload."""


@contextmanager
def chromium() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"the dashboard tests need Debian's Chromium at {CHROMIUM}: "
            "apt-get install chromium, as tests/run does (never `playwright install`)"
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Troubles:
    """What a user would see go wrong: console errors, uncaught exceptions, requests that failed or were refused."""

    def __init__(self, page: Page) -> None:
        self.seen: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.seen.append(f"uncaught: {error}"))
        page.on("requestfailed", self._failed)
        page.on("response", self._response)

    def take(self) -> list[str]:
        """The troubles seen so far, for a test that caused them on purpose: from now on they are no longer seen."""
        taken, self.seen = self.seen, []
        return taken

    def _console(self, message: ConsoleMessage) -> None:
        if message.type in ("error", "warning"):
            self.seen.append(f"console {message.type}: {message.text}")

    def _failed(self, request: Request) -> None:
        self.seen.append(f"failed: {request.method} {request.url}: {request.failure}")

    def _response(self, response: Response) -> None:
        if response.status >= 400:
            self.seen.append(f"{response.status}: {response.request.method} {response.url}")


def chat(page: Page, text: str) -> str:
    """Send `text` from the chat box; the answer once it has come in whole. A short answer may come in one chunk
    (the runner sends together what a fast engine made meanwhile): `expect_streaming` shows a long one growing."""
    answers = page.locator("#chat-log .message-assistant")
    before = answers.count()
    page.fill("#chat-input", text)
    page.press("#chat-input", "Enter")
    expect(answers).to_have_count(before + 1, timeout=SHOWN_MS)
    expect(page.locator("#chat-stop")).to_be_disabled(timeout=60_000)  # the answer is complete
    answer = answers.nth(before)
    expect(answer.locator(".note")).to_have_count(0)
    final = answer.locator(".text").text_content() or ""
    assert final, "the answer is empty"
    return final


def expect_streaming(page: Page) -> None:
    """The newest answer, still being generated, is on the page in part and grows: it streams in."""
    answer = page.locator("#chat-log .message-assistant .text").last
    expect(answer).not_to_have_text("", timeout=SHOWN_MS)
    expect(answer).not_to_have_text(answer.text_content() or "", timeout=SHOWN_MS)  # text is only ever appended
    expect(page.locator("#chat-stop")).to_be_enabled()  # the answer was still coming in
