"""Placing a model from the CLI and following it to ready, with progress bars fed by the API."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

NODE_JOIN_TIMEOUT_S = 120.0


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text


def place_and_wait(
    console: Console,
    api_url: str,
    model_id: str,
    worker_session: Callable[[], str],
    keep_waiting: Callable[[], bool],
    headers: dict[str, str],
    timeout_s: float = 1800,
) -> bool:
    """Place `model_id` unless an instance exists, show download and loading progress, print examples.

    Ready means served by the current start of the worker (`worker_session()`): after a restart State still
    shows the previous start's runners as ready until the new worker has replaced them.
    """
    with httpx.Client(base_url=api_url, timeout=30, headers=headers) as http:
        node_id = _wait_for_node(http, worker_session, keep_waiting)
        if node_id is None:
            console.print("[red]this machine's node did not join the cluster; see the worker's log[/]")
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
                if not keep_waiting():
                    return False
                response = http.get(f"/instances/{instance['instance_id']}")
                if response.status_code == 404:
                    console.print(f"[red]the instance of {model_id} was removed[/]")
                    return False
                instance = response.json()
                _update(progress, bars, instance)
                if _served_by(instance, node_id, worker_session()):
                    break
                if instance["status"] == "failed":
                    console.print(f"[red]{model_id} failed:[/] {instance['reason']}")
                    return False
                time.sleep(0.5)
            else:
                console.print(f"[red]{model_id} was not ready within {timeout_s:.0f} s[/]")
                return False
    console.print(f"[bold green]{model_id} is ready.[/] Try it:\n")
    # Not wrapped to the terminal (or to 80 columns when not a terminal): the commands must copy whole.
    console.print(examples(api_url, model_id), soft_wrap=True, markup=False)
    return True


def _wait_for_node(
    http: httpx.Client, worker_session: Callable[[], str], keep_waiting: Callable[[], bool]
) -> str | None:
    """The id of this machine's node once its worker of this start has joined (the API answers before)."""
    deadline = time.monotonic() + NODE_JOIN_TIMEOUT_S
    while time.monotonic() < deadline and keep_waiting():
        for node in http.get("/nodes").json():
            if node["session_id"] == worker_session():
                return str(node["node_id"])
        time.sleep(0.25)
    return None


def _served_by(instance: dict[str, Any], node_id: str, worker_session: str) -> bool:
    """Ready, with this node's runners started by this start of its worker."""
    return instance["status"] == "ready" and all(
        shard.get("worker_session") == worker_session for shard in instance["shards"] if shard["node_id"] == node_id
    )


_PROGRESS_FIELDS = {"downloading": ("bytes_done", "bytes_total"), "loading": ("layers_loaded", "layers_total")}
"""A shard's status that has a progress bar: the instance's fields holding how far it is, and of what."""


def _update(progress: Progress, bars: dict[str, TaskID], instance: dict[str, Any]) -> None:
    for shard in instance["shards"]:
        status = shard["status"]
        if status not in _PROGRESS_FIELDS:
            continue
        done_field, total_field = _PROGRESS_FIELDS[status]
        name = f"{shard['node_id']} layers {shard['start_layer']}-{shard['end_layer']}"
        key = f"{name}/{status}"
        total = shard.get(total_field) or None
        if key not in bars:
            bars[key] = progress.add_task(f"{status} {name}", total=total)
        progress.update(bars[key], completed=shard.get(done_field, 0), total=total)


README_QUESTION = "What is the capital of France? Answer in one sentence."


def examples(api_url: str, model_id: str) -> str:
    """The README's requests for this API and model, to paste into a shell: the Python code inside its quotes stands
    flush left, or Python refuses it as indented."""
    return f"""  curl {api_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_id}", "messages": [{{"role": "user", "content": "{README_QUESTION}"}}]}}'

  python3 -m uv run --no-project --with openai python -c 'from openai import OpenAI
client = OpenAI(base_url="{api_url}/v1", api_key="unused")
reply = client.chat.completions.create(model="{model_id}",
    messages=[{{"role": "user", "content": "{README_QUESTION}"}}])
print(reply.choices[0].message.content)'
"""
