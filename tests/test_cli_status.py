"""Seeing the cluster: one readable line per event, the view (`GET /view`, `/view/stream`, `jetshard status`),
the tasks in flight (`jetshard tasks ls|cancel`), `jetshard instances ls|rm`, `jetshard events` and
`jetshard chat`, the interactive ones driven in tmux as a person would. The live tests share the dialect
cluster (one node serving a tiny model)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from helpers.dialects import DialectCluster
from helpers.harness import free_port, until_sync, wait_for
from helpers.states import fold
from helpers.tiny_models import LONG_STORY, endless_model
from httpx_sse import connect_sse
from jetshard_schema import events
from jetshard_schema.catalogue import builtin_cards
from jetshard_schema.gist import REASON_CHARS, gist
from jetshard_schema.ids import InstanceId
from jetshard_schema.stats import RunnerStats
from jetshard_schema.types import (
    DownloadProgress,
    DownloadStatus,
    ImportProgress,
    ImportStatus,
    ModelDirInfo,
    NodeProfile,
    NodeStorage,
    Parallelism,
    RunnerReport,
    RunnerStatus,
    ServingCounters,
    ServingSettings,
    ShardAssignment,
    TaskKind,
    TaskRef,
)
from jetshard_schema.view import ClusterView, cluster_view, describe_instance, import_progress
from rich.console import Console

from jetshard.commands.instances import instances_table
from jetshard.commands.status import render

PROFILE = NodeProfile(
    hostname="desk", os="Linux", cpu_cores=8, memory_total_bytes=16 * 2**30, memory_available_bytes=10 * 2**30
)
SHARDS = (
    ShardAssignment(node_id="a", rank=0, start_layer=0, end_layer=10),
    ShardAssignment(node_id="b", rank=1, start_layer=10, end_layer=24),
)


def test_every_event_type_has_a_gist() -> None:
    every = {t.__name__ for t in events.Event.__args__}  # type: ignore[attr-defined]
    assert every == {t.__name__ for t in gist.registry if t is not object}


def test_a_gist_is_one_short_line_without_tensor_lists() -> None:
    tensors = tuple(f"model.layers.{i}.mlp.gate_proj.weight" for i in range(270))
    runner = RunnerReport(
        node_id="a", rank=0, worker_session="s", status=RunnerStatus.LOADING, layers_loaded=3, layers_total=10
    )
    loading = events.RunnerStatusChanged(
        instance_id="i1", generation=0, runner=msgspec.structs.replace(runner, loaded_tensors=tensors)
    )
    assert gist(loading) == "i1: a rank 0 loading (3/10 layers)"
    traceback = "Traceback (most recent call last):\n  File x\nRuntimeError: " + "boom " * 100
    failed = gist(events.InstanceFailed(instance_id="i1", reason=traceback))
    assert failed.startswith("i1: RuntimeError: boom") and len(failed) == len("i1: ") + REASON_CHARS
    placed = events.InstancePlaced(instance_id="i1", model_id="org/m", shards=SHARDS, serving=ServingSettings())
    assert gist(placed) == "i1 of org/m on a layers [0, 10), b layers [10, 24); mlx, max batch 8"
    failed_import = events.ModelImportProgressed(
        import_id="imp-1",
        node_id="a",
        model_id="org/m",
        progress=ImportProgress(status=ImportStatus.FAILED, reason="the file is truncated: " + "x" * 300),
    )
    assert (
        gist(failed_import).startswith("org/m on a: failed: the file is truncated") and len(gist(failed_import)) < 200
    )


def test_the_view_summarises_nodes_instances_and_tasks() -> None:
    task = TaskRef(task_id="t1", model_id="org/m", kind=TaskKind.CHAT)
    state = fold(
        events.NodeJoined(node_id="a", session_id="s", profile=PROFILE),
        events.NodeJoined(node_id="b", session_id="s", profile=PROFILE),
        events.InstancePlaced(instance_id="i1", model_id="org/m", shards=SHARDS),
        events.RunnerStatusChanged(
            instance_id="i1",
            generation=0,
            runner=RunnerReport(node_id="a", rank=0, worker_session="s", status=RunnerStatus.READY),
        ),
        events.TaskAssigned(task=task, instance_id="i1", generation=0),
    )
    view = cluster_view(state, 0)
    assert [n.node_id for n in view.nodes] == ["a", "b"]
    [instance] = view.instances
    # Rank 1 has no runner yet and no download: the instance waits for it.
    assert [(s.node_id, s.start_layer, s.end_layer, s.status) for s in instance.shards] == [
        ("a", 0, 10, "ready"),
        ("b", 10, 24, "downloading"),
    ]
    assert (instance.status, instance.tasks_in_flight, instance.tasks_running) == ("downloading", 1, 0)
    assert [(t.task_id, t.status) for t in view.tasks] == [("t1", "queued")]
    # Every built-in card is there, marked, beside the placed model that has no card.
    models = {m.model_id: m for m in view.models}
    assert set(builtin_cards()) < set(models)
    assert all(models[model_id].builtin and models[model_id].known for model_id in builtin_cards())
    assert (models["org/m"].builtin, models["org/m"].known, models["org/m"].num_layers) == (False, False, 0)
    assert [m.model_id for m in view.models if m.in_use] == ["org/m"]
    shown = render_text(view)
    assert "org/m" in shown and not any(model_id in shown for model_id in builtin_cards())
    # A task whose prompt is not counted yet (queued; llama.cpp counts it as it prefills) shows no count, not 0.
    (task_row,) = [line for line in shown.splitlines() if "t1" in line]
    assert "queued" in task_row and " 0 " not in task_row and "-" in task_row


def test_an_import_under_way_shows_how_far_it_is_and_leaves_once_done() -> None:
    """A GGUF file being imported has no card until it is done: the view lists it with its bytes so far, and the
    screen shows it among the models (the dashboard too, from the same view)."""
    requested = events.ModelImportRequested(import_id="im1", node_id="a", model_id="local/big", path="/data/big.gguf")

    def progressed(status: ImportStatus, done: int) -> events.ModelImportProgressed:
        progress = ImportProgress(status=status, bytes_done=done, bytes_total=4_900_000_000)
        return events.ModelImportProgressed(import_id="im1", node_id="a", model_id="local/big", progress=progress)

    state = fold(events.NodeJoined(node_id="a", session_id="s", profile=PROFILE), requested)
    (pending,) = cluster_view(state, 0).imports
    assert import_progress(pending) == "importing"
    state = fold(progressed(ImportStatus.ONGOING, 2_205_000_000), state=state)
    (ongoing,) = cluster_view(state, 0).imports
    assert (ongoing.model_id, ongoing.node_id, ongoing.path) == ("local/big", "a", "/data/big.gguf")
    assert import_progress(ongoing) == "importing 45% of 4.9 GB"
    assert "a: importing 45% of 4.9 GB from /data/big.gguf" in render_text(cluster_view(state, 0))
    assert cluster_view(fold(progressed(ImportStatus.FAILED, 0), state=state), 0).imports == []


def test_the_view_gives_an_instances_speed_and_the_share_of_drafted_tokens_it_kept() -> None:
    state = fold(
        events.NodeJoined(node_id="a", session_id="s", profile=PROFILE),
        events.InstancePlaced(instance_id="i1", model_id="org/m", shards=SHARDS[:1]),
        events.InstancePlaced(instance_id="i2", model_id="org/m", shards=SHARDS[:1]),
    )

    def stats(instance_id: str, drafted: int, accepted: int) -> RunnerStats:
        counters = ServingCounters(tokens=900, drafted_tokens=drafted, accepted_tokens=accepted)
        return RunnerStats(
            interval_s=2,
            node_id="a",
            instance_id=instance_id,
            model_id="org/m",
            counters=counters,
            tokens_per_s=41.25,
            batch_size=2,
            running_rows=2,
            queued_rows=0,
        )

    view = cluster_view(state, 0, {InstanceId("i1"): stats("i1", 40, 30), InstanceId("i2"): stats("i2", 0, 0)})
    drafting, plain = view.instances
    assert (drafting.tokens_per_s, drafting.batch_size, drafting.draft_acceptance) == (41.25, 2, 0.75)
    assert plain.draft_acceptance is None  # it drafts nothing: no share to give
    shown = render_text(view)
    assert "41.2 tok/s, batch 2, drafts kept 75%" in shown
    assert shown.count("drafts kept") == 1


def test_the_view_says_which_of_a_nodes_directories_holds_each_download() -> None:
    shared, own = "/mnt/shared/models", "/home/u/models"
    storage = NodeStorage(
        model_dirs=(
            ModelDirInfo(path=shared, read_only=True, free_bytes=0, total_bytes=10**12),
            ModelDirInfo(path=own, read_only=False, free_bytes=5 * 10**9, total_bytes=10**11),
        )
    )

    def completed(directory: str, read_only: bool) -> DownloadProgress:
        return DownloadProgress(status=DownloadStatus.COMPLETED, end_layer=24, directory=directory, read_only=read_only)

    state = fold(
        events.NodeJoined(node_id="a", session_id="s", profile=PROFILE),
        events.NodeStorageUpdated(node_id="a", storage=storage),
        events.DownloadRequested(node_id="a", model_id="org/m", start_layer=0, end_layer=24),
        events.DownloadCompleted(node_id="a", model_id="org/m", progress=completed(f"{shared}/org--m", True)),
        events.DownloadRequested(node_id="a", model_id="org/n", start_layer=0, end_layer=24),
        events.DownloadCompleted(node_id="a", model_id="org/n", progress=completed(f"{own}/org--n", False)),
    )
    view = cluster_view(state, 0)
    [node] = view.nodes
    assert node.model_dirs == storage.model_dirs
    assert (node.disk_free_bytes, node.disk_total_bytes) == (5 * 10**9, 10**11)  # the writable one only
    downloads = {m.model_id: m.downloads for m in view.models if m.downloads}
    assert [(d.directory, d.models_dir, d.read_only) for d in downloads["org/m"]] == [
        (f"{shared}/org--m", shared, True)
    ]
    assert [(d.directory, d.models_dir, d.read_only) for d in downloads["org/n"]] == [(f"{own}/org--n", own, False)]


def render_text(view: ClusterView) -> str:
    out = Console(record=True, width=200)
    out.print(render(view))
    return out.export_text()


def test_status_shows_each_shard_of_a_tensor_parallel_instance_with_its_tensor_rank() -> None:
    tensor_shards = tuple(
        ShardAssignment(node_id=node, rank=rank, start_layer=0, end_layer=24, tensor_rank=rank)
        for rank, node in enumerate("ab")
    )
    state = fold(
        events.NodeJoined(node_id="a", session_id="s", profile=PROFILE),
        events.NodeJoined(node_id="b", session_id="s", profile=PROFILE),
        events.InstancePlaced(
            instance_id="i1",
            model_id="org/m",
            shards=tensor_shards,
            serving=ServingSettings(parallelism=Parallelism.TENSOR),
        ),
    )
    placed = gist(events.InstancePlaced(instance_id="i1", model_id="org/m", shards=tensor_shards))
    assert "on a layers [0, 24) tensor rank 0, b layers [0, 24) tensor rank 1;" in placed
    out = Console(width=200, record=True)
    out.print(render(cluster_view(state, 0)))
    text = out.export_text()
    # The last rank leads on MLX: the one that takes the instance's requests.
    assert "a [0, 24) tensor rank 0 downloading" in text and "b [0, 24) tensor rank 1 (leader) downloading" in text
    out.print(instances_table(json.loads(msgspec.json.encode([describe_instance(state, state.instances["i1"], 0)]))))
    assert "a [0, 24) tensor rank 0, b [0, 24) tensor rank 1" in out.export_text()


# --- against a running cluster ------------------------------------------------------------------------------


def jetshard(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "jetshard", *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert not check or result.returncode == 0, result.stdout + result.stderr
    return result


ENDLESS_MODEL = "jetshard-test/tiny-endless"


@pytest.fixture(scope="module")
def endless(dialect_cluster: DialectCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A model that never ends a reply by itself, placed beside the dialect cluster's own, removed after."""
    with dialect_cluster.serving(ENDLESS_MODEL, endless_model(tmp_path_factory.mktemp("endless"))):
        yield ENDLESS_MODEL


def endless_chat(api: str, outcome: dict[str, Any]) -> threading.Thread:
    """A streaming chat of the endless model, until it is stopped; `outcome` gets its text and how it ended."""
    body = {
        "model": ENDLESS_MODEL,
        "messages": LONG_STORY,
        "max_tokens": 2**40,
        "temperature": 0,
        "stream": True,
    }

    def run() -> None:
        pieces, ending = [], "no end"
        with (
            httpx.Client(timeout=120) as client,
            connect_sse(client, "POST", f"{api}/v1/chat/completions", json=body) as source,
        ):
            for message in source.iter_sse():
                if message.data == "[DONE]":
                    ending = "done"
                    break
                chunk = json.loads(message.data)
                if "error" in chunk:
                    ending = chunk["error"]["message"]
                    break
                pieces += [c["delta"].get("content") or "" for c in chunk["choices"]]
        outcome.update(text="".join(pieces), ending=ending)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def running_task(api: str) -> str:
    found: list[str] = []
    assert wait_for(
        lambda: (
            found.extend(t["task_id"] for t in httpx.get(f"{api}/tasks").json() if t["status"] == "running") or found
        ),
        timeout=60,
    )
    return found[0]


def test_status_shows_the_node_the_model_and_its_ready_instance(dialect_cluster: DialectCluster) -> None:
    view = msgspec.convert(httpx.get(f"{dialect_cluster.api}/view").json(), ClusterView)
    [node] = view.nodes
    [instance] = [i for i in view.instances if i.model_id == dialect_cluster.model]
    assert instance.status == "ready"
    printed = jetshard("status", "--api", dialect_cluster.api).stdout
    # The suite's runners keep the reference BLAS (JETSHARD_BLAS=0), so AUTO kept the checkpoint's weights.
    weights = f"{instance.shards[0].weights_dtype} weights"
    for shown in (node.node_id, node.hostname, dialect_cluster.model, instance.instance_id, "[0, 2) ready", weights):
        assert shown in printed, printed
    assert "reference BLAS" in printed
    assert json.loads(jetshard("status", "--api", dialect_cluster.api, "--json").stdout)["nodes"][0]["node_id"]


def test_the_view_stream_and_the_task_commands_follow_a_chat_and_its_cancel(
    dialect_cluster: DialectCluster, endless: str
) -> None:
    api = dialect_cluster.api
    views: list[ClusterView] = []
    lines: list[dict[str, Any]] = []
    stop = threading.Event()

    def follow() -> None:
        with httpx.Client(timeout=60) as client, connect_sse(client, "GET", f"{api}/view/stream") as source:
            for message in source.iter_sse():
                if message.event == "view":
                    views.append(msgspec.json.decode(message.data, type=ClusterView))
                elif message.event == "event":
                    lines.append(json.loads(message.data))
                if stop.is_set():
                    return

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    assert wait_for(lambda: views, timeout=15)
    # The stream starts with the latest events, each one line.
    assert lines and all(set(line) == {"seq", "at_ms", "type", "gist"} for line in lines)

    outcome: dict[str, Any] = {}
    chat = endless_chat(api, outcome)
    task_id = running_task(api)
    assert wait_for(lambda: any(t.task_id == task_id and t.status == "running" for t in views[-1].tasks), 15)
    listed = jetshard("tasks", "--api", api, "ls").stdout
    assert task_id in listed and "running" in listed

    assert f"cancelled {task_id}" in jetshard("tasks", "--api", api, "cancel", task_id).stdout
    chat.join(30)
    assert "cancelled" in outcome["ending"] and outcome["text"], outcome
    assert wait_for(lambda: not views[-1].tasks and any(line["type"] == "TaskCancelled" for line in lines), 15)
    stop.set()

    # Ids that are not a task in flight, or no id at all: a clear error, a non-zero exit, nothing published.
    finished = jetshard("tasks", "--api", api, "cancel", task_id, check=False)
    assert finished.returncode == 1 and f"no task {task_id} in flight" in finished.stderr, finished.stderr
    for hostile in ("../../etc", "task.>"):
        refused = jetshard("tasks", "--api", api, "cancel", hostile, check=False)
        assert refused.returncode == 2 and "use letters, digits" in refused.stderr, refused.stderr


@pytest.mark.usefixtures("restores_the_dialect_cluster")
def test_instances_ls_and_rm(dialect_cluster: DialectCluster) -> None:
    api = dialect_cluster.api
    model = dialect_cluster.model
    place = ("instances", "--api", api, "place", model)
    placed = json.loads(jetshard(*place, "--engine", "mlx", "--max-batch", "2", "--json").stdout)
    second = placed["instance_id"]
    assert (placed["engine"], placed["engine_chosen"], placed["serving"]["max_batch"]) == ("mlx", False, 2)
    refused = jetshard(*place, "--engine", "llama.cpp", check=False)
    assert refused.returncode == 1 and "has no gguf weights, which llama.cpp serves" in refused.stderr
    listing = jetshard("instances", "--api", api, "ls").stdout
    assert second in listing and "mlx (asked)" in listing
    assert f"removed {second}" in jetshard("instances", "--api", api, "rm", second).stdout
    listed = json.loads(jetshard("instances", "--api", api, "ls", "--json").stdout)
    assert second not in [i["instance_id"] for i in listed] and listed
    missing = jetshard("instances", "--api", api, "rm", second, check=False)
    assert missing.returncode == 1 and second in missing.stderr


def test_events_prints_one_line_per_event_and_json_on_request(dialect_cluster: DialectCluster, tmp_path: Path) -> None:
    nats = dialect_cluster.cluster.nats.url

    def placed(lines: list[str]) -> bool:
        return any(" NodeJoined " in line for line in lines) and any(" InstancePlaced " in line for line in lines)

    readable = follow_until(["events", "--nats", nats, "--since", "1"], placed, tmp_path / "readable")
    assert placed(readable)
    assert all(len(line) < 400 for line in readable), max(readable, key=len)
    raw = follow_until(["events", "--nats", nats, "--since", "1", "--json"], bool, tmp_path / "raw")
    first = json.loads(raw[0])
    assert first["seq"] == 1 and "type" in first["event"]


def test_values_no_request_can_carry_are_usage_errors_not_tracebacks(tmp_path: Path) -> None:
    """Refused before anything is sent: numbers JSON has none of, a sequence past JetStream's, a file that holds
    no nkey seed."""
    garbage = tmp_path / "not-a-seed"
    garbage.write_text("root:x:0:0:root:/root:/bin/bash\n")
    nowhere = f"nats://127.0.0.1:{free_port()}"
    for args, says in [
        (["instances", "place", "org/m", "--keep-alive-s", "nan"], "not a finite number"),
        (["chat", "org/m", "--temperature", "nan"], "not a finite number"),
        (["events", "--nats", nowhere, "--since", str(2**64)], "--since"),
        (["state", "--nats", nowhere, "--nats-nkey", str(garbage)], "does not hold an nkey seed"),
    ]:
        result = jetshard(*args, check=False)
        assert result.returncode in (1, 2) and says in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def follow_until(args: list[str], enough: Callable[[list[str]], bool], output: Path) -> list[str]:
    """The whole lines a command that follows the cluster printed (to `output`.out, its stderr to `output`.err)
    once they are `enough`; then it is stopped."""
    out, err = output.with_suffix(".out"), output.with_suffix(".err")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "jetshard", *args],
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, "COLUMNS": "300"},
        )

    def printed() -> list[str]:
        text = out.read_text()
        return text[: text.rfind("\n") + 1].splitlines()

    try:
        until_sync(
            lambda: enough(printed()), 60, lambda: f"{args} to print enough: {printed()[-5:]}\n{err.read_text()}"
        )
    finally:
        process.terminate()
        process.wait(10)
    return printed()


# --- in a terminal ------------------------------------------------------------------------------------------


class Tmux:
    """A tmux session of its own (own socket), 200 columns wide, running one command."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.socket = f"jetshard-test-{name}-{uuid.uuid4().hex[:8]}"
        # The program sizes itself to the pane, as in a terminal, not to a COLUMNS this process may carry.
        shell = " ".join(subprocess.list2cmdline([part]) for part in ["env", "-u", "COLUMNS", "-u", "LINES", *command])
        self._tmux("new-session", "-d", "-x", "200", "-y", "60", "-s", "t", shell)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True, timeout=10
        ).stdout

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "t", "-S", "-200")

    def wait_for_text(self, text: str, timeout: float = 60) -> str:
        wait_for(lambda: text in self.screen(), timeout=timeout, interval=0.2)
        screen = self.screen()
        assert text in screen, screen
        return screen

    def running(self) -> bool:
        alive = subprocess.run(["tmux", "-L", self.socket, "has-session", "-t", "t"], capture_output=True, timeout=10)
        return alive.returncode == 0

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def terminal(request: pytest.FixtureRequest) -> Iterator[Any]:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is needed for the terminal tests (apt-get install tmux; tests/run installs it)")
    opened: list[Tmux] = []

    def open_terminal(*args: str) -> Tmux:
        opened.append(Tmux(request.node.name[:20], [sys.executable, "-m", "jetshard", *args]))
        return opened[-1]

    yield open_terminal
    for session in opened:
        session.close()


def test_chat_streams_keeps_the_conversation_and_ctrl_c_stops_a_reply(
    dialect_cluster: DialectCluster, endless: str, terminal: Any
) -> None:
    api = dialect_cluster.api
    chat = terminal("chat", "--api", api, dialect_cluster.model, "--max-tokens", "8")
    chat.wait_for_text(f"chatting with {dialect_cluster.model}")
    chat.send("Hello there", "Enter")
    # A reply of 8 tokens, then the prompt again (tmux drops the space after it).
    wait_for(lambda: chat.screen().count(">>>") >= 2, timeout=60, interval=0.2)
    assert chat.screen().count(">>>") >= 2, chat.screen()
    chat.send("/bye", "Enter")

    # The reply Ctrl-C stops is the second turn of a conversation: the first is sent again with it.
    story = terminal("chat", "--api", api, endless)
    story.wait_for_text("chatting with")
    story.send("Tell me a story", "Enter")
    task_id = running_task(api)
    story.send("C-c")
    story.wait_for_text("stopped")
    assert wait_for(lambda: task_id not in [t["task_id"] for t in httpx.get(f"{api}/tasks").json()], timeout=30)
    # The conversation goes on after a stopped reply.
    story.send("Go on", "Enter")
    running_task(api)
    story.send("C-c")
    wait_for(lambda: story.screen().count("stopped") == 2, timeout=30, interval=0.2)
    assert story.screen().count("stopped") == 2, story.screen()
    story.send("/bye", "Enter")
    assert wait_for(lambda: not story.running(), timeout=10)


def test_chat_names_an_unknown_model_before_its_prompt_and_a_piped_chat_exits_with_its_failure(
    dialect_cluster: DialectCluster,
) -> None:
    api = dialect_cluster.api
    unknown = subprocess.run(
        [sys.executable, "-m", "jetshard", "chat", "--api", api, "nosuch/model"],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode == 1 and "unknown model nosuch/model" in unknown.stderr, unknown.stderr
    assert "chatting with" not in unknown.stdout
    # A reply that fails (a prompt past the model's context) is said, and a piped chat's status says so too.
    failing = subprocess.run(
        [sys.executable, "-m", "jetshard", "chat", "--api", api, dialect_cluster.model],
        input="hello " * 100_000 + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failing.returncode == 1 and "context" in failing.stdout, failing.stdout + failing.stderr


def test_status_watch_piped_prints_each_view_as_it_comes(dialect_cluster: DialectCluster, tmp_path: Path) -> None:
    model = dialect_cluster.model
    shown = follow_until(
        ["status", "--api", dialect_cluster.api, "--watch"], lambda lines: model in "".join(lines), tmp_path / "w"
    )
    assert any(model in line for line in shown)


def test_status_watch_redraws_when_the_cluster_changes(
    dialect_cluster: DialectCluster, endless: str, terminal: Any
) -> None:
    api = dialect_cluster.api
    watch = terminal("status", "--api", api, "--watch")
    watch.wait_for_text(dialect_cluster.model)
    assert "no tasks" not in watch.screen()
    outcome: dict[str, Any] = {}
    chat = endless_chat(api, outcome)
    task_id = running_task(api)
    watch.wait_for_text(task_id, timeout=15)
    httpx.delete(f"{api}/tasks/{task_id}", timeout=30)
    chat.join(30)
    assert wait_for(lambda: task_id not in watch.screen(), timeout=15, interval=0.2), watch.screen()
    watch.send("C-c")
    assert wait_for(lambda: not watch.running(), timeout=10), "Ctrl-C did not end `jetshard status --watch`"
