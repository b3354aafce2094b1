"""`jetshard models import-gguf PATH [--id ID] [--mmproj FILE] [--replace]`: serve a GGUF file you already have.

This machine's downloader does the import (it is the one owner of its model directories): the CLI names the file
and the node, the API hands the command to the cluster, and the downloader reads the card from the file's header
(architecture, layers, heads, context, size, quantization, chat template: any model llama.cpp loads), links or
copies the file into a model directory all or nothing, and the card joins the catalogue. A file that cannot be
imported (truncated, not GGUF, an architecture llama.cpp does not know, a split model with parts missing) is
refused with the problem named, and whatever was stored under the id before stays as it was; `--replace` swaps a
stored copy for the new one in one step. The CLI converts nothing and writes nothing itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path
from typing import TypeVar

import click
import msgspec
from jetshard_bus.node import config_dir
from jetshard_schema.ids import import_model_id
from jetshard_schema.state import ModelImport
from jetshard_schema.view import import_progress
from rich.console import Console

from jetshard.client import ApiClient
from jetshard.commands.models import card_table

IMPORT_TIMEOUT_S = 3660.0
"""Beyond the API's own wait for the import (an hour): it answers first."""
PROGRESS_INTERVAL_S = 1.0
T = TypeVar("T")


def _in_background(call: Callable[[], T]) -> Future[T]:
    """`call`'s outcome, in a daemon thread: Ctrl-C ends the command at once (the import goes on on its node)."""
    outcome: Future[T] = Future()

    def run() -> None:
        try:
            outcome.set_result(call())
        except BaseException as error:  # the command's own errors (CliError) reach it through the future
            outcome.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return outcome


def _progress(api: ApiClient, model_id: str, node: str) -> str:
    """How far the import of `model_id` on `node` is, as the cluster's view says; empty when it does not say."""
    try:
        _, view = api.request("GET", "/view")
        records = msgspec.convert(view.get("imports", []), list[ModelImport])
    except (click.ClickException, AttributeError, msgspec.ValidationError):  # the import's answer says what failed
        return ""
    return next((import_progress(r) for r in records if (r.model_id, r.node_id) == (model_id, node)), "")


def _this_node(api: ApiClient) -> str:
    """The node of this machine (its worker's and downloader's id file), else the cluster's only node."""
    id_file = config_dir() / "node_id"
    if id_file.is_file():
        return id_file.read_text().strip()
    _, nodes = api.request("GET", "/nodes")
    ids = [node.get("node_id") for node in nodes] if isinstance(nodes, list) else []
    if len(ids) == 1 and isinstance(ids[0], str):
        return ids[0]
    raise click.ClickException(
        "this machine runs no jetshard node (no node id in its config directory); name the node that has the "
        "file with --node"
    )


@click.command("import-gguf")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--id", "model_id", default=None, help="model id to serve it as [default: local/<file name>]")
@click.option(
    "--mmproj",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="the model's projector (mmproj) GGUF file: the model then takes images",
)
@click.option("--node", "node_id", default=None, help="the node that has the file [default: this machine's]")
@click.option(
    "--replace",
    is_flag=True,
    help="import over a copy already stored under this id; the old copy stays until the new one is complete",
)
@click.pass_obj
def import_gguf(
    api: ApiClient, path: Path, model_id: str | None, mmproj: Path | None, node_id: str | None, replace: bool
) -> None:
    """Import a GGUF file on this machine into the cluster's catalogue (any model llama.cpp loads)."""
    try:
        # By default from the name given: a link's (the Hugging Face cache's layout), not its target's.
        model_id = import_model_id(model_id, path.name)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--id") from error
    node = node_id or _this_node(api)
    body = {
        "node_id": node,
        "model_id": model_id,
        # A link (the Hugging Face cache's layout) names the file it points to.
        "path": str(path.resolve()),
        "mmproj_path": str(mmproj.resolve()) if mmproj else "",
        "replace": replace,
    }
    console = Console(stderr=True)
    with console.status(f"importing {path.name} on {node}") as status:
        answer = _in_background(lambda: api.request("POST", "/models/import", timeout=IMPORT_TIMEOUT_S, body=body))
        while not wait([answer], timeout=PROGRESS_INTERVAL_S).done:
            progress = _progress(api, model_id, node)
            if progress:
                status.update(f"{progress} of {path.name} on {node}")
        _, result = answer.result()
    formats = result.get("formats", [])
    engines = "llama.cpp and MLX" if "mlx" in formats else "llama.cpp only"
    click.echo(f"imported {model_id} ({result.get('file_type') or 'gguf'}, {engines}) on {node}")
    Console().print(card_table(result))
