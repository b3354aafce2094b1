"""`jetshard models import-gguf PATH [--id ID]`: serve a llama-family GGUF file you already have.

The file is converted on this machine into the first writable models directory with room for it (all or
nothing, with a manifest, exactly as the demo model is), then its card is added to the cluster through the
API. This node's downloader then finds the model complete, like any download.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import msgspec
from jetshard_schema.card_from_config import card_from_hub_metadata
from jetshard_schema.cards import ModelSource
from jetshard_schema.ids import parse_model_id
from msgspec.structs import replace
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from jetshard.client import ApiClient
from jetshard.commands.models import ADD_TIMEOUT_S, card_table


def default_id(path: Path) -> str:
    """`local/<file name without .gguf>`, with characters the Hub does not allow replaced."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)
    name = re.sub(r"-{2,}|\.{2,}", "-", name).strip("-.")[:80] or "model"
    return f"local/{name}"


@click.command("import-gguf")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--id", "model_id", default=None, help="model id to serve it as [default: local/<file name>]")
@click.pass_obj
def import_gguf(api: ApiClient, path: Path, model_id: str | None) -> None:
    """Convert a llama-family GGUF file on this machine and add it to the cluster's catalogue."""
    from jetshard_downloader.convert import NotEnoughSpace, install_gguf  # imports mlx: only when converting
    from jetshard_downloader.dirs import ModelDirs

    try:
        model_id = parse_model_id(model_id or default_id(path))
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--id") from error
    console = Console(stderr=True)
    with Progress(
        TextColumn("converting {task.description}"), BarColumn(), console=console, transient=True
    ) as progress:
        task = progress.add_task(path.name, total=None)
        try:
            directory, _ = install_gguf(
                path.resolve(),
                ModelDirs.from_env(),
                model_id,
                on_progress=lambda done, total: progress.update(task, completed=done, total=total),
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
    card = replace(
        card_from_hub_metadata(model_id, config, index, sizes, None, tokenizer_config),
        source=ModelSource.LOCAL_GGUF,
        source_ref=str(path.resolve()),
    )
    status, result = api.request(
        "POST", "/models", timeout=ADD_TIMEOUT_S, body={"model_id": model_id, "card": msgspec.to_builtins(card)}
    )
    click.echo(f"{'imported' if status == 201 else 'already known:'} {model_id} (files in {directory})")
    Console().print(card_table(result))
