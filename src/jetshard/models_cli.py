"""`jetshard models …`: list, add, show and delete model cards through a running API.

Every subcommand talks to the HTTP API (`--api URL`, env `JETSHARD_API`), never to NATS, so it works from
any machine that can reach an API. Errors come back in the OpenAI shape (`{"error": {"message": …}}`) and
are printed as one readable line on stderr, with a non-zero exit status.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn
from urllib.parse import quote

import click
import httpx
from jetshard_schema.gist import size
from rich.console import Console
from rich.table import Table

from jetshard.clusterfile import api_headers
from jetshard.options import api_url_option

ADD_TIMEOUT_S = 120.0
"""Adding a card fetches config.json and the safetensors index from the Hub, then waits for the sequencer."""
TIMEOUT_S = 30.0

# Exit statuses: 1 for an error the API reported, 2 is click's usage error, 3 when the API cannot be reached.
EXIT_API_ERROR = 1
EXIT_UNREACHABLE = 3


class ApiClient:
    """A thin HTTP client for the models routes, turning API errors into `click.ClickException`s."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def request(
        self, method: str, path: str, *, timeout: float = TIMEOUT_S, body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        url = self.base_url + path
        try:
            with httpx.Client(timeout=timeout, headers=api_headers()) as client:
                response = client.request(method, url, json=body)
        except httpx.TimeoutException:
            _fail(f"the API at {self.base_url} did not answer within {timeout:.0f} s", EXIT_UNREACHABLE)
        except httpx.HTTPError as error:
            _fail(
                f"cannot reach the jetshard API at {self.base_url} ({error}); is `jetshard up` or "
                "`jetshard api` running? (set --api or JETSHARD_API)",
                EXIT_UNREACHABLE,
            )
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.is_error:
            status = response.status_code
            _fail(f"{_error_message(status, data, response.text)} (HTTP {status})")
        return response.status_code, data


def _error_message(status: int, data: Any, text: str) -> str:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
        if data.get("detail"):
            return str(data["detail"])
    return text.strip()[:500] or f"the API answered HTTP {status}"


class CliError(click.ClickException):
    """A ClickException with the exit status this module documents."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]


def _fail(message: str, code: int = EXIT_API_ERROR) -> NoReturn:
    raise CliError(message, code)


def _model_path(model_id: str) -> str:
    """`org/name` → `/models/org/name`, each part percent-encoded so a hostile id cannot reach another route.

    The API validates ids; this only keeps the request's shape intact (an id without exactly one '/' is
    sent as one segment, and the API answers 400 or 404 for it).
    """
    parts = model_id.split("/")
    if len(parts) == 2 and all(parts):
        return "/models/" + "/".join(quote(part, safe="") for part in parts)
    return "/models/" + quote(model_id, safe="")


def format_size(n_bytes: int | None) -> str:
    return size(n_bytes) if n_bytes else "-"


def format_quantization(card: dict[str, Any]) -> str:
    quantization = card.get("quantization")
    if not quantization:
        return "-"
    return f"{quantization.get('bits')}-bit/g{quantization.get('group_size')}"


def format_download(download: dict[str, Any]) -> str:
    status = str(download.get("status", "?"))
    done, total = download.get("bytes_done") or 0, download.get("bytes_total") or 0
    if status == "ongoing" and total:
        return f"ongoing {100 * done / total:.0f}%"
    if status == "failed" and download.get("reason"):
        return f"failed: {download['reason']}"
    return status


def format_downloads(card: dict[str, Any]) -> str:
    downloads = card.get("downloads") or {}
    if not downloads:
        return "-"
    return "\n".join(f"{node}: {format_download(d)}" for node, d in sorted(downloads.items()))


def console() -> Console:
    # Wide enough that ids and node names are not cut when the output is piped or captured.
    return Console(width=None if sys.stdout.isatty() else 200)


def _size_text(card: dict[str, Any]) -> str:
    text = format_size(card.get("storage_size_bytes"))
    return f"~{text}" if card.get("storage_size_estimated") else text


def models_table(cards: list[dict[str, Any]]) -> Table:
    table = Table(title="models", title_justify="left", show_lines=False)
    table.add_column("id", no_wrap=True, overflow="fold")
    table.add_column("layers", justify="right")
    table.add_column("size", justify="right")
    table.add_column("quantization")
    table.add_column("custom")
    table.add_column("downloads")
    for card in cards:
        table.add_row(
            str(card.get("model_id")),
            str(card.get("num_layers", "-")),
            _size_text(card),
            format_quantization(card),
            "yes" if card.get("is_custom") else "no",
            format_downloads(card),
        )
    return table


def card_table(card: dict[str, Any]) -> Table:
    table = Table(title=str(card.get("model_id")), title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows: list[tuple[str, str]] = [
        ("id", str(card.get("model_id"))),
        ("display name", str(card.get("display_name") or "-")),
        ("architecture", str(card.get("architecture", "-"))),
        ("layers", str(card.get("num_layers", "-"))),
        ("hidden size", str(card.get("hidden_size", "-"))),
        (
            "attention heads",
            f"{card.get('num_attention_heads', '-')} ({card.get('num_key_value_heads', '-')} key/value)",
        ),
        ("vocabulary", str(card.get("vocab_size", "-"))),
        ("context length", str(card.get("context_length", "-"))),
        ("size", _size_text(card)),
        ("quantization", format_quantization(card)),
        ("tasks", ", ".join(card.get("tasks") or []) or "-"),
        ("custom", "yes" if card.get("is_custom") else "no (built-in)"),
        ("source", str(card.get("source", "-")) + (f" ({card['source_ref']})" if card.get("source_ref") else "")),
    ]
    for name, value in rows:
        table.add_row(name, value)
    downloads = card.get("downloads") or {}
    if downloads:
        for node, download in sorted(downloads.items()):
            table.add_row(f"download on {node}", format_download(download))
    else:
        table.add_row("downloads", "-")
    return table


json_option = click.option("--json", "as_json", is_flag=True, help="print the API's JSON instead of a table")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@api_url_option
@click.pass_context
def models(ctx: click.Context, api_url: str) -> None:
    """List, add, show and delete model cards (built-in and custom)."""
    ctx.obj = ApiClient(api_url)


@models.command("ls")
@click.option("--custom", "only_custom", is_flag=True, help="only custom cards")
@json_option
@click.pass_obj
def list_models(api: ApiClient, only_custom: bool, as_json: bool) -> None:
    """List every model card with its download status on each node."""
    _, cards = api.request("GET", "/models")
    cards = [card for card in cards or [] if card.get("is_custom") or not only_custom]
    if as_json:
        click.echo(json.dumps(cards, indent=2))
        return
    if not cards:
        click.echo("no custom model cards" if only_custom else "no model cards")
        return
    console().print(models_table(cards))


@models.command("add")
@click.argument("model_id")
@json_option
@click.pass_obj
def add_model(api: ApiClient, model_id: str, as_json: bool) -> None:
    """Fetch MODEL_ID's card (org/name) from the Hugging Face Hub and add it to every node."""
    status, card = api.request("POST", "/models", body={"model_id": model_id}, timeout=ADD_TIMEOUT_S)
    if as_json:
        click.echo(json.dumps(card, indent=2))
        return
    verb = "added" if status == 201 else "already known:"
    click.echo(f"{verb} {card.get('model_id', model_id)}")
    console().print(card_table(card))


@models.command("show")
@click.argument("model_id")
@json_option
@click.pass_obj
def show_model(api: ApiClient, model_id: str, as_json: bool) -> None:
    """Show one model card and its download status on each node."""
    _, card = api.request("GET", _model_path(model_id))
    if as_json:
        click.echo(json.dumps(card, indent=2))
        return
    console().print(card_table(card))


@models.command("rm")
@click.argument("model_id")
@click.pass_obj
def remove_model(api: ApiClient, model_id: str) -> None:
    """Delete a custom card from every node (downloaded files stay; built-in cards cannot be deleted)."""
    _, result = api.request("DELETE", _model_path(model_id))
    click.echo(f"deleted {(result or {}).get('deleted', model_id)}")
