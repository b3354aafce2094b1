"""`jetshard download MODEL`: ask the cluster to download a model to a node and show its progress live.

Progress comes from polling `GET /downloads` (the API's State replica) twice a second: simpler than following
`GET /events`, and it shows the same numbers the downloader reports (at most once a second per model).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click
import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from jetshard.client import ApiClient, api_headers
from jetshard.options import FiniteFloat, api_url_option

_FINAL = ("completed", "failed", "cancelled")


def _find(downloads: list[dict[str, Any]], node_id: str, model_id: str) -> dict[str, Any] | None:
    return next((d for d in downloads if d.get("node_id") == node_id and d.get("model_id") == model_id), None)


@click.command()
@click.argument("model_id")
@click.option(
    "--node",
    "node_id",
    envvar="JETSHARD_NODE",
    default=None,
    help="node to download to (default: the only node of the cluster)",
)
@api_url_option
@click.option("--start-layer", type=int, default=None, help="first layer of a shard to download")
@click.option("--end-layer", type=int, default=None, help="end (exclusive) of a shard's layer range")
@click.option("--timeout-s", type=FiniteFloat(min=0), default=None, help="give up after this many seconds")
def download(
    model_id: str,
    node_id: str | None,
    api_url: str,
    start_layer: int | None,
    end_layer: int | None,
    timeout_s: float | None,
) -> None:
    """Download MODEL (org/name) to a node, with a live progress bar; exits 1 with the reason on failure."""
    console = Console(stderr=True, highlight=False)
    body: dict[str, Any] = {
        "model_id": model_id,
        "node_id": node_id,
        "start_layer": start_layer,
        "end_layer": end_layer,
    }
    _, current = ApiClient(api_url).request("POST", "/downloads", body={k: v for k, v in body.items() if v is not None})
    node_id = current["node_id"]
    with httpx.Client(base_url=api_url.rstrip("/"), timeout=60, headers=api_headers()) as client:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task(f"{model_id} → {node_id}", total=None)
            while current.get("status") not in _FINAL:
                if deadline is not None and time.monotonic() > deadline:
                    raise click.ClickException(f"{model_id} did not finish within {timeout_s:.0f} s")
                total = current.get("bytes_total") or None
                progress.update(task, completed=current.get("bytes_done") or 0, total=total)
                time.sleep(0.5)
                try:
                    response = client.get("/downloads")
                    response.raise_for_status()
                except httpx.HTTPError as error:
                    console.print(f"[yellow]API unreachable ({error}); retrying[/]")
                    continue
                found = _find(response.json(), node_id, model_id)
                if found is None:
                    raise click.ClickException(
                        f"the download of {model_id} on {node_id} disappeared (deleted, or the node left the cluster)"
                    )
                current = found
            if current["status"] == "completed":
                done = current.get("bytes_total") or 0
                progress.update(task, completed=done, total=done or 1)
    status = current["status"]
    if status == "completed":
        where = current.get("directory", "")
        note = " (read-only directory)" if current.get("read_only") else ""
        console.print(f"[green]{model_id} is on {node_id}[/]: {where}{note}")
        return
    reason = current.get("reason") or status
    console.print(f"[red]{model_id} on {node_id}: {status}[/]\n{reason}")
    sys.exit(1)
