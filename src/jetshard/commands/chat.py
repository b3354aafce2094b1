"""`jetshard chat [MODEL]`: talk to a model in the terminal, answers streamed as they are generated.

The conversation is kept (each turn sends it whole, and the prefix cache keeps the earlier turns'
prefill). Ctrl-C while a reply streams stops it (the API cancels the task when the client leaves) and
keeps what came; Ctrl-C or Ctrl-D at the prompt, or `/bye`, leaves; `/clear` starts a new conversation.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import click
import httpx
from httpx_sse import connect_sse
from jetshard_schema.ids import parse_model_id
from rich.console import Console
from rich.status import Status

from jetshard.client import EXIT_API_ERROR, ApiClient, CliError, api_headers
from jetshard.options import COMMAND_CONTEXT, FiniteFloat, api_url_option

FIRST_TOKEN_TIMEOUT_S = 600.0
"""A first reply may wait for the model to be placed, downloaded and loaded."""
PROMPT = ">>> "


def known_model(client: ApiClient, model: str) -> str:
    """`model`, once the API says it has its card (a model without an instance is placed by the first reply)."""
    try:
        model_id = parse_model_id(model)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="MODEL") from None
    client.request("GET", f"/v1/models/{model_id}")
    return model_id


def ready_model(client: ApiClient) -> str:
    """The model to talk to when none is named: the one that is ready, else the first of several."""
    _, listed = client.request("GET", "/v1/models")
    ready = [m["id"] for m in listed["data"] if m.get("ready")]
    if not ready:
        raise CliError("no model is ready; name one to place it: jetshard chat org/name", 1)
    return str(ready[0])


class Conversation:
    def __init__(self, api_url: str, model: str, system: str | None, options: dict[str, Any]) -> None:
        self.url = f"{api_url.rstrip('/')}/v1/chat/completions"
        self.model = model
        self.system = system
        self.options = options
        self.messages: list[dict[str, str]] = []
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str, out: Console) -> bool:
        """Stream the answer to `text`; on Ctrl-C stop, keeping what came. Errors are printed, not raised: returns
        False after one."""
        self.messages.append({"role": "user", "content": text})
        body = {"model": self.model, "messages": self.messages, "stream": True, **self.options}
        answer: list[str] = []
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(30, read=FIRST_TOKEN_TIMEOUT_S), headers=api_headers()) as http,
                connect_sse(http, "POST", self.url, json=body) as source,
            ):
                if source.response.is_error:
                    source.response.read()
                    raise CliError(_error_text(source.response), 1)
                with _Waiting(out) as waiting:
                    for comment, data in _sse_lines(source.response):
                        if comment is not None:
                            waiting.say(comment)  # "queued; 2 queued before this one", "processing the prompt: …"
                            continue
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            raise CliError(str(chunk["error"].get("message", chunk["error"])), 1)
                        for choice in chunk.get("choices", []):
                            piece = choice.get("delta", {}).get("content") or ""
                            if piece:
                                waiting.stop()
                            answer.append(piece)
                            out.print(piece, end="", markup=False, highlight=False)
            out.print()
        except KeyboardInterrupt:
            out.print("\n[dim]stopped[/]")
        except CliError as error:
            out.print(f"\n[red]{error.message}[/]")
            self.messages.pop()
            return False
        except httpx.HTTPError as error:
            out.print(f"\n[red]lost the API at {self.url} ({error})[/]")
            self.messages.pop()
            return False
        self.messages.append({"role": "assistant", "content": "".join(answer)})
        return True


def _sse_lines(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """The stream's comments (what the answer waits for) and its events' data, one line each as the API sends
    them: httpx-sse, which reads the events, passes comments over."""
    for line in response.iter_lines():
        if line.startswith(":"):
            yield line[1:].strip(), ""
        elif line.startswith("data:"):
            yield None, line[len("data:") :].strip()


class _Waiting:
    """What a reply waits for, on one transient line of the terminal until its first text comes."""

    def __init__(self, out: Console) -> None:
        self._status: Status | None = out.status("waiting", spinner="dots") if out.is_terminal else None

    def __enter__(self) -> _Waiting:
        if self._status is not None:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def say(self, what: str) -> None:
        if self._status is not None:
            self._status.update(what)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def _error_text(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except ValueError:
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return f"{message or response.text.strip()[:300]} (HTTP {response.status_code})"


@click.command("chat", context_settings=COMMAND_CONTEXT)
@api_url_option
@click.argument("model", required=False)
@click.option("--system", default=None, help="a system prompt for the conversation")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="longest reply [the model's default]")
@click.option("--temperature", type=FiniteFloat(min=0, max=2), default=None, help="[the model's default]")
def chat(
    api_url: str, model: str | None, system: str | None, max_tokens: int | None, temperature: float | None
) -> None:
    """Chat with MODEL (default: the model that is ready) in the terminal. Read from a pipe, it exits with status 1
    if a reply failed."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    client = ApiClient(api_url)
    model = known_model(client, model) if model else ready_model(client)
    options = {k: v for k, v in {"max_tokens": max_tokens, "temperature": temperature}.items() if v is not None}
    conversation = Conversation(api_url, model, system, options)
    out = Console(highlight=False)
    out.print(f"[dim]chatting with {model}; Ctrl-C stops a reply, /clear forgets, /bye or Ctrl-D leaves[/]")
    failed = False
    while True:
        try:
            text = input(PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            out.print()
            break
        if text in ("/bye", "/exit"):
            break
        if text == "/clear":
            conversation.clear()
            out.print("[dim]new conversation[/]")
        elif text:
            failed = not conversation.reply(text, out) or failed
    if failed and not sys.stdin.isatty():
        raise SystemExit(EXIT_API_ERROR)
