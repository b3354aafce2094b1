"""`jetshard models …`: list, add, show and delete model cards through a running API."""

from __future__ import annotations

from typing import Any

import click
import msgspec
from jetshard_schema.gist import size
from jetshard_schema.ids import ModelId, parse_model_id
from jetshard_schema.state import Download
from jetshard_schema.types import DownloadStatus
from rich.table import Table

from jetshard.client import ApiClient
from jetshard.options import api_group, json_option
from jetshard.output import print_answer

ADD_TIMEOUT_S = 120.0
"""Adding a card fetches config.json and the safetensors index from the Hub, then waits for the sequencer."""


def _model_id(ctx: click.Context, param: click.Parameter, value: str) -> ModelId:
    """The argument as a model id, checked here as the API checks it: it becomes the request's path, where a
    hostile one (`..`, an empty part) would name another route."""
    try:
        return parse_model_id(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


def format_size(n_bytes: int | None) -> str:
    return size(n_bytes) if n_bytes else "-"


def format_quantization(card: dict[str, Any]) -> str:
    """A GGUF's type as llama.cpp names it (Q4_K_M), and the MLX form's bits and group size where MLX holds it."""
    quantization = card.get("quantization")
    mlx = f"{quantization.get('bits')}-bit/g{quantization.get('group_size')}" if quantization else ""
    file_type = card.get("file_type") or ""
    if file_type and mlx:
        return f"{file_type} (MLX {mlx})"
    return file_type or mlx or "-"


def format_download(download: Download) -> str:
    progress = download.progress
    if download.deleting:
        return "deleting"
    if progress.status is DownloadStatus.ONGOING and progress.bytes_total:
        return f"ongoing {100 * progress.bytes_done / progress.bytes_total:.0f}%"
    if progress.status is DownloadStatus.FAILED and progress.reason:
        return f"failed: {progress.reason}"
    return progress.status


def card_downloads(card: dict[str, Any]) -> list[tuple[str, Download]]:
    """The card's download records per node, as the API's `Download` structs (a change of their shape fails here,
    not as a '?' in a table)."""
    return sorted(msgspec.convert(card.get("downloads") or {}, dict[str, Download]).items())


def format_downloads(card: dict[str, Any]) -> str:
    return "\n".join(f"{node}: {format_download(d)}" for node, d in card_downloads(card)) or "-"


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
        ("capabilities", ", ".join(card.get("capabilities") or []) or "-"),
        ("custom", "yes" if card.get("is_custom") else "no (built-in)"),
        ("source", str(card.get("source", "-")) + (f" ({card['source_ref']})" if card.get("source_ref") else "")),
    ]
    for name, value in rows:
        table.add_row(name, value)
    downloads = card_downloads(card)
    for node, download in downloads:
        table.add_row(f"download on {node}", format_download(download))
    if not downloads:
        table.add_row("downloads", "-")
    return table


models = api_group("models", "List, add, show and delete model cards (built-in and custom).")


@models.command("ls")
@click.option("--custom", "only_custom", is_flag=True, help="only custom cards")
@json_option
@click.pass_obj
def list_models(api: ApiClient, only_custom: bool, as_json: bool) -> None:
    """List every model card with its download status on each node."""
    _, cards = api.request("GET", "/models")
    cards = [card for card in cards or [] if card.get("is_custom") or not only_custom]
    print_answer(cards, as_json, models_table, "no custom model cards" if only_custom else "no model cards")


@models.command("add")
@click.argument("model_id")
@click.option("--gguf", "gguf_file", default="", help="one GGUF file of the repo: the card is read from its header")
@click.option("--repo", default="", help="the Hub repo of --gguf, where MODEL_ID is another id (a second quant)")
@click.option("--mmproj", "mmproj_file", default="", help="with --gguf: the repo's projector file, for vision")
@json_option
@click.pass_obj
def add_model(api: ApiClient, model_id: str, gguf_file: str, repo: str, mmproj_file: str, as_json: bool) -> None:
    """Fetch MODEL_ID's card (org/name) from the Hugging Face Hub and add it to every node."""
    body = {"model_id": model_id, "gguf_file": gguf_file, "repo": repo, "mmproj_file": mmproj_file}
    body = {name: value for name, value in body.items() if value}
    status, card = api.request("POST", "/models", body=body, timeout=ADD_TIMEOUT_S)
    if not as_json:
        verb = "added" if status == 201 else "already known:"
        click.echo(f"{verb} {card.get('model_id', model_id)}")
    print_answer(card, as_json, card_table)


@models.command("show")
@click.argument("model_id", callback=_model_id)
@json_option
@click.pass_obj
def show_model(api: ApiClient, model_id: str, as_json: bool) -> None:
    """Show one model card and its download status on each node."""
    _, card = api.request("GET", f"/models/{model_id}")
    print_answer(card, as_json, card_table)


@models.command("rm")
@click.argument("model_id", callback=_model_id)
@click.pass_obj
def remove_model(api: ApiClient, model_id: str) -> None:
    """Delete a custom card from every node (downloaded files stay; built-in cards cannot be deleted)."""
    _, result = api.request("DELETE", f"/models/{model_id}")
    click.echo(f"deleted {(result or {}).get('deleted', model_id)}")
