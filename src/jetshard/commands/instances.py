"""`jetshard instances ls|rm` and `jetshard tasks ls|cancel`: what a running API serves, and stopping it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import click
import msgspec
from jetshard_schema.gist import shard_layers
from jetshard_schema.types import ShardAssignment
from rich.table import Table

from jetshard.client import ApiClient
from jetshard.options import api_group, checked_name, json_option
from jetshard.output import print_answer


def instances_table(instances: list[dict[str, Any]]) -> Table:
    table = Table(title="instances", title_justify="left")
    table.add_column("id", no_wrap=True)
    table.add_column("model", overflow="fold")
    table.add_column("status")
    table.add_column("nodes", overflow="fold")
    table.add_column("max batch", justify="right")
    table.add_column("max queued", justify="right")
    table.add_column("tasks", justify="right")
    table.add_column("reason", overflow="fold")
    for instance in instances:
        serving = instance["serving"]
        table.add_row(
            instance["instance_id"],
            instance["model_id"],
            instance["status"],
            ", ".join(_shard(s) for s in instance["shards"]),
            str(serving["max_batch"]),
            str(serving["max_queued"]),
            str(instance["tasks_in_flight"]),
            instance["reason"] or "",
        )
    return table


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


instances = api_group("instances", "List and remove instances (a model placed on nodes).")
add_listing(
    instances,
    path="/instances",
    table=instances_table,
    nothing="no instances",
    help="Status, nodes and layers, serving settings and tasks in flight (running or queued).",
)
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
