"""`jetshard instances`: the instances a running API knows, with their status and serving settings."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from jetshard.models_cli import ApiClient, console, json_option
from jetshard.options import api_url_option


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


@click.command("instances", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@api_url_option
@json_option
def instances(api_url: str, as_json: bool) -> None:
    """List instances: status, nodes and layers, serving settings and tasks in flight (running or queued)."""
    _, listed = ApiClient(api_url).request("GET", "/instances")
    if as_json:
        click.echo(json.dumps(listed, indent=2))
    elif not listed:
        click.echo("no instances")
    else:
        console().print(instances_table(listed))
