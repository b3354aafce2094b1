"""Placing a model from the CLI and following it to ready, with progress bars fed by the API."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text


def place_and_wait(
    console: Console,
    api_url: str,
    model_id: str,
    children: dict[str, subprocess.Popen[bytes]] | None = None,
    timeout_s: float = 1800,
) -> bool:
    """Place `model_id` unless an instance exists, show download and loading progress, print examples."""
    with httpx.Client(base_url=api_url, timeout=30) as http:
        if not _wait_for_nodes(http, children):
            console.print("[red]no node joined the cluster; see the worker's log[/]")
            return False
        existing = [i for i in http.get("/instances").json() if i["model_id"] == model_id and i["status"] != "failed"]
        if existing:
            instance = existing[0]
        else:
            response = http.post("/instances", json={"model_id": model_id})
            if response.status_code >= 400:
                console.print(f"[red]could not place {model_id}:[/] {_error_message(response)}")
                return False
            instance = response.json()
        console.print(f"placing [bold]{model_id}[/] as {instance['instance_id']}")
        deadline = time.monotonic() + timeout_s
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        ) as progress:
            bars: dict[str, TaskID] = {}
            while time.monotonic() < deadline:
                if children and any(child.poll() is not None for child in children.values()):
                    return False
                response = http.get(f"/instances/{instance['instance_id']}")
                if response.status_code == 404:
                    console.print(f"[red]the instance of {model_id} was removed[/]")
                    return False
                instance = response.json()
                _update(progress, bars, instance)
                if instance["status"] == "ready":
                    break
                if instance["status"] == "failed":
                    console.print(f"[red]{model_id} failed:[/] {instance['reason']}")
                    return False
                time.sleep(0.5)
            else:
                console.print(f"[red]{model_id} was not ready within {timeout_s:.0f} s[/]")
                return False
    console.print(f"[bold green]{model_id} is ready.[/] Try it:\n\n" + examples(api_url, model_id))
    return True


def _wait_for_nodes(
    http: httpx.Client, children: dict[str, subprocess.Popen[bytes]] | None, timeout_s: float = 120
) -> bool:
    """The API answers before this machine's worker has joined; placing needs at least one node."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http.get("/nodes").json():
            return True
        if children and any(child.poll() is not None for child in children.values()):
            return False
        time.sleep(0.25)
    return False


def _update(progress: Progress, bars: dict[str, TaskID], instance: dict[str, Any]) -> None:
    for shard in instance["shards"]:
        name = f"{shard['node_id']} layers {shard['start_layer']}-{shard['end_layer']}"
        status = shard["status"]
        if status == "downloading":
            key, done, total, label = (
                name + "/dl",
                shard.get("bytes_done", 0),
                shard.get("bytes_total") or None,
                f"downloading {name}",
            )
        elif status == "loading":
            key, done, total, label = (
                name + "/load",
                shard.get("layers_loaded", 0),
                shard.get("layers_total") or None,
                f"loading {name}",
            )
        else:
            continue
        if key not in bars:
            bars[key] = progress.add_task(label, total=total)
        progress.update(bars[key], completed=done, total=total)


def examples(api_url: str, model_id: str) -> str:
    return f"""  curl {api_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_id}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c 'from openai import OpenAI
  client = OpenAI(base_url="{api_url}/v1", api_key="unused")
  reply = client.chat.completions.create(model="{model_id}",
      messages=[{{"role": "user", "content": "What is the capital of France?"}}])
  print(reply.choices[0].message.content)'
"""
