"""`jetshard instances ls|place|rm` and `jetshard tasks ls|cancel`: what a running API serves, placing a model, and
stopping it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import click
import msgspec
from jetshard_schema.gist import shard_layers
from jetshard_schema.types import Engine, ShardAssignment
from rich.table import Table

from jetshard.client import ApiClient
from jetshard.options import FiniteFloat, api_group, checked_name, json_option
from jetshard.output import print_answer


def instances_table(instances: list[dict[str, Any]]) -> Table:
    table = Table(title="instances", title_justify="left")
    table.add_column("id", no_wrap=True)
    table.add_column("model", overflow="fold")
    table.add_column("status")
    table.add_column("engine")
    table.add_column("nodes", overflow="fold")
    table.add_column("max batch", justify="right")
    table.add_column("max queued", justify="right")
    table.add_column("tasks", justify="right")
    table.add_column("unloads")
    table.add_column("reason", overflow="fold")
    for instance in instances:
        serving = instance["serving"]
        table.add_row(
            instance["instance_id"],
            instance["model_id"],
            instance["status"],
            instance["engine"] + ("" if instance["engine_chosen"] else " (asked)"),
            ", ".join(_shard(s) for s in instance["shards"]),
            str(serving["max_batch"]),
            str(serving["max_queued"]),
            str(instance["tasks_in_flight"]),
            _unloads(instance),
            instance["reason"] or "",
        )
    return table


def _unloads(instance: dict[str, Any]) -> str:
    """When it unloads if nothing more comes ("in 4m 10s"), or that it stays until removed."""
    at_ms = instance.get("unloads_at_ms")
    if at_ms is None:
        return "when removed"
    left_s = max(0, round(at_ms / 1000 - time.time()))
    minutes, seconds = divmod(left_s, 60)
    return f"in {minutes}m {seconds:02d}s" if minutes else f"in {seconds}s"


def _shard(shard: dict[str, Any]) -> str:
    return f"{shard['node_id']} {shard_layers(msgspec.convert(shard, ShardAssignment))}"


def tasks_table(tasks: list[dict[str, Any]]) -> Table:
    table = Table(title="tasks", title_justify="left")
    for column in ("id", "model", "kind", "instance", "status", "prompt tokens"):
        table.add_column(column, overflow="fold", no_wrap=column == "id")
    for task in tasks:
        table.add_row(
            task["task_id"],
            task["model_id"],
            task["kind"],
            task["instance_id"],
            task["status"],
            str(task["prompt_tokens"]),
        )
    return table


def add_listing(group: click.Group, *, path: str, table: Callable[[Any], Table], nothing: str, help: str) -> None:
    """`<group> ls`: what `GET path` lists, as `table` (`nothing` when empty) or JSON."""

    @group.command("ls", help=help)
    @json_option
    @click.pass_obj
    def listing(client: ApiClient, as_json: bool) -> None:
        _, listed = client.request("GET", path)
        print_answer(listed, as_json, table, nothing)


def add_removal(group: click.Group, name: str, *, argument: str, path: str, done: str, help: str) -> None:
    """`<group> <name> ID`: `DELETE path/ID`, then `<done> ID`."""

    @group.command(name, help=help)
    @click.argument(argument, callback=checked_name)
    @click.pass_obj
    def removal(client: ApiClient, **arguments: str) -> None:
        removed = arguments[argument]
        client.request("DELETE", f"{path}/{quote(removed, safe='')}")
        click.echo(f"{done} {removed}")


instances = api_group("instances", "List, place and remove instances (a model placed on nodes).")
add_listing(
    instances,
    path="/instances",
    table=instances_table,
    nothing="no instances",
    help="Status, nodes and layers, serving settings and tasks in flight (running or queued).",
)


@instances.command(
    "place",
    help="Place MODEL_ID: an instance of it on the cluster's nodes, which download it if needed and load it. "
    "Placement chooses the engine and the nodes unless told.",
)
@click.argument("model_id")
@click.option(
    "--engine",
    type=click.Choice([str(engine) for engine in Engine]),
    help="what serves it (default: the fastest engine its nodes run for a format the model has: llama.cpp for a "
    "GGUF on CPUs, MLX on Apple silicon and NVIDIA)",
)
@click.option(
    "--node",
    "node_ids",
    multiple=True,
    callback=lambda context, parameter, values: tuple(checked_name(context, parameter, v) for v in values),
    help="a node to place it on, in rank order; repeat for several (default: placement chooses)",
)
@click.option("--max-batch", type=click.IntRange(1, 256), help="tasks that decode together (default: the API's)")
@click.option(
    "--keep-alive-s",
    type=FiniteFloat(),
    help="unload it after this many seconds with nothing to do (0: as soon as it is idle) [default: it stays "
    "until removed]",
)
@json_option
@click.pass_obj
def place(
    client: ApiClient,
    model_id: str,
    engine: str | None,
    node_ids: tuple[str, ...],
    max_batch: int | None,
    keep_alive_s: float | None,
    as_json: bool,
) -> None:
    body: dict[str, Any] = {"model_id": model_id}
    if keep_alive_s is not None:
        body["keep_alive_s"] = keep_alive_s
    if engine is not None:
        body["engine"] = engine
    if node_ids:
        body["node_ids"] = list(node_ids)
    if max_batch is not None:
        body["serving"] = {"max_batch": max_batch}
    _, placed = client.request("POST", "/instances", body=body)
    print_answer(placed, as_json, lambda instance: instances_table([instance]))


add_removal(
    instances,
    "rm",
    argument="instance_id",
    path="/instances",
    done="removed",
    help="Stop an instance's runners; its tasks in flight end with an error.",
)

tasks = api_group("tasks", "List and cancel the tasks in flight.")
add_listing(
    tasks, path="/tasks", table=tasks_table, nothing="no tasks in flight", help="Tasks queued or running, oldest first."
)
add_removal(
    tasks,
    "cancel",
    argument="task_id",
    path="/tasks",
    done="cancelled",
    help="Stop a task; its client gets what was generated so far, then an error saying it was cancelled.",
)
