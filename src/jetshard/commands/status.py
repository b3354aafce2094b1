"""`jetshard status`: the cluster on one screen (nodes, models and downloads, instances, tasks), from the
API's `/view`; `--watch` follows `/view/stream` and redraws on every change."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

import click
import httpx
import msgspec
from httpx_sse import connect_sse
from jetshard_schema.gist import shard_layers, size
from jetshard_schema.view import (
    ClusterView,
    DownloadView,
    InstanceView,
    NodeView,
    ShardDescription,
    import_progress,
)
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from jetshard.client import EXIT_UNREACHABLE, ApiClient, CliError, api_headers
from jetshard.options import COMMAND_CONTEXT, api_url_option, json_option
from jetshard.output import console

RECONNECT_S = 2.0


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", expand=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _percent(done: int, total: int) -> str:
    return f"{100 * done / total:.0f}%" if total else "-"


def _download(download: DownloadView) -> str:
    text = f"{download.status} {_percent(download.bytes_done, download.bytes_total)}"
    text += f" of {size(download.bytes_total)}" if download.bytes_total else ""
    if download.status == "ongoing" and download.speed_bytes_per_s:
        text += f", {size(download.speed_bytes_per_s)}/s"
    if download.status == "ongoing" and download.source:
        text += " from the Hub" if download.source == "hub" else f" from {download.source}"
    return text + (f": {download.reason}" if download.reason else "")


def _slow_cpu(node: NodeView) -> bool:
    return node.accelerator == "cpu" and not node.fast_blas


def _accelerator(node: NodeView) -> str:
    text = f"{node.accelerator}, {node.cpu_cores} cores" + (", reference BLAS" if _slow_cpu(node) else "")
    if node.gpus:
        gpu = node.gpus[0]
        text += f", {gpu.name} {size(gpu.memory_free_bytes)} free of {size(gpu.memory_total_bytes)}"
    return text


def _shard(shard: ShardDescription, shards: Sequence[ShardDescription]) -> str:
    text = (
        f"{shard.node_id} {shard_layers(shard)}{' (leader)' if shard.leader and len(shards) > 1 else ''} {shard.status}"
    )
    if shard.status == "ready" and isinstance(shard.weights_dtype, str):
        text += f", {shard.weights_dtype} weights"
    if shard.status == "loading" and shard.layers_total:
        text += f" {shard.layers_loaded}/{shard.layers_total}"
    if shard.status == "downloading" and shard.bytes_total:
        text += f" {_percent(shard.bytes_done or 0, shard.bytes_total)}"
    return text


def _load(instance: InstanceView) -> str:
    running, queued = instance.tasks_running, instance.tasks_in_flight - instance.tasks_running
    text = f"{running} running, {queued} queued"
    if instance.tokens_per_s is not None:
        text += f"; {instance.tokens_per_s:.1f} tok/s, batch {instance.batch_size}"
    if instance.draft_acceptance is not None:
        text += f", drafts kept {instance.draft_acceptance:.0%}"
    return text


def render(view: ClusterView) -> Group:
    """The view as tables, each section saying so when it is empty."""
    nodes = _table("nodes", "node", "host", "accelerator", "memory free", "disk free", "models on disk")
    for node in view.nodes:
        nodes.add_row(
            node.node_id,
            node.hostname,
            _accelerator(node),
            f"{size(node.memory_available_bytes)} of {size(node.memory_total_bytes)}",
            f"{size(node.disk_free_bytes)} of {size(node.disk_total_bytes)}" + (" (offline)" if node.offline else ""),
            str(node.models_on_disk),
        )
    models = _table("models", "model", "layers", "size", "downloads")
    # Every card is in the view; the screen keeps to those in use (`jetshard models` lists the whole catalogue).
    for model in (m for m in view.models if m.in_use):
        downloads = "\n".join(f"{d.node_id}: {_download(d)}" for d in model.downloads) or "-"
        models.add_row(model.model_id, str(model.num_layers), size(model.storage_size_bytes), downloads)
    for record in view.imports:
        progress = f"{record.node_id}: {import_progress(record)} from {record.path}"
        total = record.progress.bytes_total
        models.add_row(record.model_id, "-", size(total) if total else "-", progress)
    instances = _table("instances", "instance", "model", "status", "shards (layers, runner)", "tasks")
    for instance in view.instances:
        status = str(instance.status) + (f": {instance.reason}" if instance.reason else "")
        shards = "\n".join(_shard(s, instance.shards) for s in instance.shards)
        instances.add_row(instance.instance_id, instance.model_id, status, shards, _load(instance))
    tasks = _table("tasks", "task", "model", "kind", "instance", "status", "prompt tokens")
    for task in view.tasks:
        prompt_tokens = str(task.prompt_tokens or "-")
        tasks.add_row(task.task_id, task.model_id, task.kind, task.instance_id, task.status, prompt_tokens)
    parts: list[Table | Text] = []
    for table, empty in ((nodes, "no nodes"), (models, "no models"), (instances, "no instances"), (tasks, "")):
        if table.row_count:
            parts.append(table)
        elif empty:
            parts.append(Text(empty, style="dim"))
    parts.append(Text(f"at event {view.last_seq}; {len(view.tasks)} tasks in flight", style="dim"))
    return Group(*parts)


def _watch(api_url: str) -> None:
    """Redraw on every view the stream sends; reconnect (saying so) when the API goes away. Piped, every view is
    printed in turn: rich's Live shows only the last one on leaving."""
    out = console()
    if not out.is_terminal:
        _follow(api_url, out.print)
        return
    with Live(Text("connecting…"), console=out, auto_refresh=False) as live:
        _follow(api_url, lambda shown: live.update(shown, refresh=True))


def _follow(api_url: str, show: Callable[[RenderableType], None]) -> None:
    while True:
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10, read=None), headers=api_headers()) as client,
                connect_sse(client, "GET", f"{api_url.rstrip('/')}/view/stream") as source,
            ):
                source.response.raise_for_status()
                for message in source.iter_sse():
                    if message.event == "view":
                        show(render(msgspec.json.decode(message.data, type=ClusterView)))
        except httpx.HTTPStatusError as error:
            raise CliError(f"the API at {api_url} answered {error.response.status_code}", 1) from None
        except httpx.HTTPError as error:
            show(Text(f"lost the API at {api_url} ({error}); retrying…", style="yellow"))
            time.sleep(RECONNECT_S)


@click.command("status", context_settings=COMMAND_CONTEXT)
@api_url_option
@json_option
@click.option("--watch", "-w", is_flag=True, help="keep the screen up to date until Ctrl-C")
def status(api_url: str, as_json: bool, watch: bool) -> None:
    """The cluster on one screen: nodes, models and downloads, instances and their shards, tasks."""
    if watch:
        try:
            _watch(api_url)
        except KeyboardInterrupt:
            pass
        return
    _, body = ApiClient(api_url).request("GET", "/view")
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    try:
        view = msgspec.convert(body, ClusterView)
    except msgspec.ValidationError as error:
        unreadable = f"the API at {api_url} sent a view this jetshard cannot read: {error}"
        raise CliError(unreadable, EXIT_UNREACHABLE) from None
    console().print(render(view))
