"""`jetshard instances ls|rm` and `jetshard tasks ls|cancel`: what a running API serves, and stopping it."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import click
from rich.table import Table

from jetshard.models_cli import ApiClient, console, json_option
from jetshard.options import api_url_option, checked_name

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


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
            ", ".join(f"{s['node_id']} [{s['start_layer']}, {s['end_layer']})" for s in instance["shards"]),
            str(serving["max_batch"]),
            str(serving["max_queued"]),
            str(instance["tasks_in_flight"]),
            instance["reason"] or "",
        )
    return table


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


def _listing(client: ApiClient, path: str, as_json: bool, table: Any, nothing: str) -> None:
    _, listed = client.request("GET", path)
    if as_json:
        click.echo(json.dumps(listed, indent=2))
    elif not listed:
        click.echo(nothing)
    else:
        console().print(table(listed))


@click.group("instances", context_settings=CONTEXT)
@api_url_option
@click.pass_context
def instances(ctx: click.Context, api_url: str) -> None:
    """List and remove instances (a model placed on nodes)."""
    ctx.obj = ApiClient(api_url)


@instances.command("ls")
@json_option
@click.pass_obj
def list_instances(client: ApiClient, as_json: bool) -> None:
    """Status, nodes and layers, serving settings and tasks in flight (running or queued)."""
    _listing(client, "/instances", as_json, instances_table, "no instances")


@instances.command("rm")
@click.argument("instance_id", callback=checked_name)
@click.pass_obj
def remove_instance(client: ApiClient, instance_id: str) -> None:
    """Stop an instance's runners; its tasks in flight end with an error."""
    client.request("DELETE", f"/instances/{quote(instance_id, safe='')}")
    click.echo(f"removed {instance_id}")


@click.group("tasks", context_settings=CONTEXT)
@api_url_option
@click.pass_context
def tasks(ctx: click.Context, api_url: str) -> None:
    """List and cancel the tasks in flight."""
    ctx.obj = ApiClient(api_url)


@tasks.command("ls")
@json_option
@click.pass_obj
def list_tasks(client: ApiClient, as_json: bool) -> None:
    """Tasks queued or running, oldest first."""
    _listing(client, "/tasks", as_json, tasks_table, "no tasks in flight")


@tasks.command("cancel")
@click.argument("task_id", callback=checked_name)
@click.pass_obj
def cancel_task(client: ApiClient, task_id: str) -> None:
    """Stop a task; its client gets what was generated so far, then an error saying it was cancelled."""
    client.request("DELETE", f"/tasks/{quote(task_id, safe='')}")
    click.echo(f"cancelled {task_id}")
