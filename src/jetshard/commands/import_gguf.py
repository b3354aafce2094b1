"""`jetshard models import-gguf PATH [--id ID] [--replace]`: serve a llama-family GGUF file you already have.

The file's header is checked first (mlx would crash on one that lies about its size), then the id: one whose
card in the catalogue is another model's (a Hub model, the built-in demo, an import of another file) is
refused, and so is one already stored on this machine unless `--replace` asks to convert over it. The file
is then converted on this machine into the first writable models directory with room for it (all or
nothing, with a manifest, exactly as the demo model is; a copy it replaces stays until the new one is
complete), then its card is added to the cluster through the API. This node's downloader then finds the
model complete, like any download.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click
import msgspec
from jetshard_schema.card_from_config import card_from_hub_metadata
from jetshard_schema.cards import ModelSource
from jetshard_schema.ids import parse_model_id
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from jetshard.client import ApiClient
from jetshard.commands.models import ADD_TIMEOUT_S, card_table


def default_id(path: Path) -> str:
    """`local/<file name without .gguf>`, with characters the Hub does not allow replaced."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)
    name = re.sub(r"-{2,}|\.{2,}", "-", name).strip("-.")[:80] or "model"
    return f"local/{name}"


def _not_this_import(model_id: str, card: dict[str, Any], source: Path) -> str | None:
    """Why the catalogue's card of `model_id` cannot describe an import of `source`; None when it does."""
    if card.get("source") != ModelSource.LOCAL_GGUF:
        origin = card.get("source_ref") or "the Hugging Face Hub"
        return f"{model_id} is already in the catalogue as a {card.get('source')} model ({origin}); choose another --id"
    if card.get("source_ref") != str(source):
        return (
            f"{model_id} was imported from {card.get('source_ref')}, not {source}; remove its card first "
            f"(jetshard models rm {model_id}) or choose another --id"
        )
    return None


@click.command("import-gguf")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--id", "model_id", default=None, help="model id to serve it as [default: local/<file name>]")
@click.option(
    "--replace",
    is_flag=True,
    help="convert over a copy already stored under this id; the old copy stays until the new one is complete",
)
@click.pass_obj
def import_gguf(api: ApiClient, path: Path, model_id: str | None, replace: bool) -> None:
    """Convert a llama-family GGUF file on this machine and add it to the cluster's catalogue."""
    from jetshard_downloader.convert import NotEnoughSpace, install_gguf  # imports mlx: only when converting
    from jetshard_downloader.dirs import ModelDirs
    from jetshard_downloader.gguf_header import check_gguf_header
    from jetshard_downloader.locate import find_model

    try:
        model_id = parse_model_id(model_id or default_id(path))
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--id") from error
    source = path.resolve()  # a link (the Hugging Face cache's layout) names the file it points to
    try:
        check_gguf_header(source)
    except ValueError as error:
        raise click.ClickException(f"{path} is not a readable GGUF file: {error}") from error
    except OSError as error:
        raise click.ClickException(f"cannot read {path}: {error.strerror}") from error
    # Checked before anything is written: files converted under another model's id would be served as it.
    _, cards = api.request("GET", "/models")
    known = next((card for card in cards if card.get("model_id") == model_id), None)
    if known is not None and (why := _not_this_import(model_id, known, source)) is not None:
        raise click.ClickException(why)
    dirs = ModelDirs.from_env()
    stored = find_model(dirs, model_id)
    if stored is not None and stored.read_only:
        raise click.ClickException(
            f"{model_id} is already stored in {stored.path}, a read-only directory jetshard never writes to; "
            "choose another --id"
        )
    if stored is not None and not replace:
        raise click.ClickException(
            f"{model_id} is already stored in {stored.path}; pass --replace to convert {path} over it"
        )
    console = Console(stderr=True)
    with Progress(
        TextColumn("converting {task.description}"), BarColumn(), console=console, transient=True
    ) as progress:
        task = progress.add_task(path.name, total=None)
        try:
            directory, _ = install_gguf(
                source,
                dirs,
                model_id,
                on_progress=lambda done, total: progress.update(task, completed=done, total=total),
                replace=replace,
            )
        except ValueError as error:
            raise click.ClickException(f"{path} cannot be converted: {error}") from error
        except NotEnoughSpace as error:
            raise click.ClickException(str(error)) from error
    config = json.loads((directory / "config.json").read_text())
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    sizes = {p.name: p.stat().st_size for p in directory.glob("*.safetensors")}
    # The conversion rebuilt tokenizer_config.json from the GGUF's vocabulary: its added tokens say whether the
    # model thinks.
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    card = msgspec.structs.replace(
        card_from_hub_metadata(model_id, config, index, sizes, None, tokenizer_config),
        source=ModelSource.LOCAL_GGUF,
        source_ref=str(source),
    )
    status, result = api.request(
        "POST", "/models", timeout=ADD_TIMEOUT_S, body={"model_id": model_id, "card": msgspec.to_builtins(card)}
    )
    click.echo(f"{'imported' if status == 201 else 'already known:'} {model_id} (files in {directory})")
    Console().print(card_table(result))
