"""`jetshard up`'s own promises: one cluster per data directory, and every serving flag of `jetshard api`,
passed on to the API it starts.

Real parts: `jetshard up --offline --no-model` with its embedded nats-server and every service, started as a
user starts it; the data directory's lock taken by real processes and dropped by the kernel when they die.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import httpx
import psutil
import pytest
from helpers.harness import free_port, wait_for
from jetshard_schema.catalogue import DEMO_MODEL_ID
from test_demo_model import ctrl_c, start_in_own_group

from jetshard.commands.services import api
from jetshard.up.command import up
from jetshard.up.lock import Holder, lock_data_dir

UP = [sys.executable, "-m", "jetshard", "up", "--offline", "--no-model"]
SERVING = "Press Ctrl-C to stop."
"""What `up` prints once its API answers."""


@dataclass
class RunningUp:
    process: subprocess.Popen[bytes]
    log: Path
    data: Path
    env: dict[str, str]
    port: int
    nats_port: int
    args: list[str]
    """What `jetshard up` was started with."""

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def up_env(tmp_path: Path) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if k not in ("JETSHARD_API", "JETSHARD_NATS")},
        "JETSHARD_DATA_DIR": str(tmp_path / "data"),
        "JETSHARD_CONFIG_DIR": str(tmp_path / "config"),
        "JETSHARD_DEFAULT_MODELS_DIR": str(tmp_path / "models"),
    }


def start_up(tmp_path: Path, name: str, *args: str, env_extra: dict[str, str] | None = None) -> RunningUp:
    """`jetshard up` on `tmp_path`'s data directory, on ports of its own, once it serves."""
    port, nats_port = free_port(), free_port()
    log = tmp_path / f"{name}.log"
    env = up_env(tmp_path) | (env_extra or {})
    command = [*UP, "--port", str(port), "--nats-port", str(nats_port), *args]
    process = start_in_own_group(command, log, env)
    running = RunningUp(process, log, tmp_path / "data", env, port, nats_port, command[4:])

    def serving() -> bool:
        assert running.process.poll() is None, running.output()
        return SERVING in running.output()

    assert wait_for(serving, timeout=120, interval=0.2), running.output()
    return running


NATS_FLAGS = {
    *("nats_urls", "nats_user", "nats_password", "nats_token", "nats_creds", "nats_nkey"),
    *("nats_tls_ca", "nats_tls_cert", "nats_tls_key", "replicas", "lease_ttl_s", "liveness_ttl_s", "task_retention_s"),
}
"""`jetshard api`'s flags for the NATS it joins: `up` gives its API the NATS it runs."""
API_ONLY = {*NATS_FLAGS, "port_file"}


def serving_args(image_dirs: tuple[Path, Path]) -> list[str]:
    """Every serving flag of `jetshard api`, each at a value other than its default."""
    return [
        *("--command-timeout-s", "31", "--no-auto-place", "--chunk-silence-s", "61", "--start-timeout-s", "301"),
        *("--first-chunk-timeout-s", "302", "--stream-ping-s", "6", "--model-keep-alive-s", "-1"),
        *("--fetch-image-urls", "--image-fetch-timeout-s"),
        *("11", "--image-dir", str(image_dirs[0]), "--image-dir", str(image_dirs[1]), "--max-batch", "3"),
        *("--max-queued", "5", "--prefix-cache-bytes", "1000", "--allowed-host", "jetshard.test"),
        *("--cors-origin", "https://app.example", "--kv-cache-type", "q8_0"),
        *("--draft", "ngram"),
    ]


@pytest.fixture(scope="module")
def first_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningUp]:
    tmp_path = tmp_path_factory.mktemp("up")
    image_dirs = (tmp_path / "pictures", tmp_path / "more pictures")
    for directory in image_dirs:
        directory.mkdir()
    running = start_up(tmp_path, "first", *serving_args(image_dirs))
    yield running
    ctrl_c(running.process)


def test_up_takes_every_flag_of_the_api_but_those_for_the_nats_it_joins() -> None:
    up_options = {param.name: param for param in up.params if isinstance(param, click.Option)}
    for param in api.params:
        assert isinstance(param, click.Option)
        if param.name in API_ONLY:
            continue
        assert param.name in up_options, f"`jetshard up` lacks the API's {param.opts}"
        taken = up_options[param.name]
        assert (taken.opts, taken.secondary_opts, taken.multiple, taken.type.name) == (
            param.opts,
            param.secondary_opts,
            param.multiple,
            param.type.name,
        )


def test_a_stopped_up_comes_back_with_the_instances_placed_by_hand(tmp_path: Path) -> None:
    """Ctrl-C stops the sequencer before the worker, whose stop deletes its liveness key. The other way round, a
    sequencer that looked at the key in that moment recorded the node as lost and deleted every instance on it:
    with liveness looked at every half second (a TTL of 2 s), it always did."""
    first = start_up(tmp_path, "first", env_extra={"JETSHARD_LIVENESS_TTL_S": "2"})
    body = {"model_id": DEMO_MODEL_ID, "serving": {"max_batch": 3}}
    placed = httpx.post(f"{first.api}/instances", json=body, timeout=60)
    assert placed.status_code == 201, placed.text
    instance_id = placed.json()["instance_id"]
    ctrl_c(first.process)
    again = start_up(tmp_path, "again")
    try:
        instances = {i["instance_id"]: i for i in httpx.get(f"{again.api}/instances", timeout=30).json()}
        assert instance_id in instances, (instances, first.output())
        assert instances[instance_id]["serving"]["max_batch"] == 3
    finally:
        ctrl_c(again.process)


def test_up_refuses_a_bad_serving_setting_before_it_starts_anything(tmp_path: Path) -> None:
    refused = subprocess.run(
        [*UP, "--max-batch", "0"], env=up_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "--max-batch" in refused.stderr, refused.stderr
    assert not (tmp_path / "data" / "nats").exists()


def test_up_says_what_is_wrong_with_its_port_or_its_data_dir_before_it_starts_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        refused = subprocess.run(
            [*UP, "--port", port], env=up_env(tmp_path), capture_output=True, text=True, timeout=60
        )
    assert refused.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in refused.stderr, refused.stderr
    assert "--port" in refused.stderr and not (tmp_path / "data" / "nats").exists()
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    refused = subprocess.run(
        [*UP, "--data-dir", str(not_a_dir / "data")], env=up_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1 and "cannot keep the cluster's data in" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.timeout(120)
def test_up_passes_every_serving_flag_on_to_its_api(first_up: RunningUp) -> None:
    (api_process,) = [
        child
        for child in psutil.Process(first_up.process.pid).children(recursive=True)
        if child.cmdline()[1:4] == ["-m", "jetshard", "api"]
    ]
    given = up.make_context("up", first_up.args).params
    started_with = api.make_context("api", api_process.cmdline()[4:]).params
    defaults = api.make_context("api", []).params
    for name in started_with.keys() - API_ONLY - {"api_key", "host"}:  # the key travels in the environment
        assert started_with[name] == given[name] != defaults[name], name
    # And the API acts on them: it answers the Host and the web page's origin it was told to.
    assert httpx.get(f"{first_up.api}/healthz", headers={"Host": "jetshard.test"}, timeout=10).status_code == 200
    assert httpx.get(f"{first_up.api}/healthz", headers={"Host": "elsewhere.test"}, timeout=10).status_code == 400
    preflight = httpx.options(
        f"{first_up.api}/v1/models",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "GET"},
        timeout=10,
    )
    assert preflight.headers.get("access-control-allow-origin") == "https://app.example", preflight.headers


@pytest.mark.timeout(120)
def test_a_second_up_on_the_same_data_dir_is_refused_at_once_and_the_first_keeps_serving(
    first_up: RunningUp,
) -> None:
    other_port, other_nats_port = free_port(), free_port()
    second = subprocess.run(
        [*UP, "--port", str(other_port), "--nats-port", str(other_nats_port)],
        env=first_up.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    refusal = second.stdout + second.stderr
    assert second.returncode != 0, refusal
    # It names the first one: its process and its addresses.
    assert f"pid {first_up.process.pid}" in refusal, refusal
    assert f"API {first_up.api}" in refusal and f"NATS nats://127.0.0.1:{first_up.nats_port}" in refusal, refusal
    assert str(first_up.data) in refusal, refusal
    # It started no nats-server on the first one's store, and left the first one's files alone.
    assert (first_up.data / "logs" / "nats-server.log").read_text().count("Starting nats-server") == 1
    assert f"{other_nats_port}" not in (first_up.data / "nats" / "nats-server.conf").read_text()
    assert first_up.api in (first_up.data / "cluster.json").read_text()
    # The first one still answers, commands included (its sequencer kept its lease: no 504).
    assert httpx.get(f"{first_up.api}/healthz", timeout=10).status_code == 200
    assert wait_for(lambda: httpx.get(f"{first_up.api}/nodes", timeout=10).json(), timeout=60)
    cancel = httpx.post(f"{first_up.api}/downloads/cancel", json={"model_id": DEMO_MODEL_ID}, timeout=60)
    assert cancel.status_code < 500, cancel.text
    assert first_up.process.poll() is None, first_up.output()


def hold_lock(root: Path) -> subprocess.Popen[str]:
    """Another process that takes `root`'s lock as `up` does, says so, and sleeps."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from jetshard.up.lock import Holder, lock_data_dir\n"
        "import os\n"
        f"lock_data_dir(Path({str(root)!r}), Holder(os.getpid(), 'http://127.0.0.1:1', 'nats://127.0.0.1:2'))\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(click.ClickException, match=f"pid {holder.pid}, API http://127.0.0.1:1"):
            lock_data_dir(tmp_path, Holder(os.getpid(), "http://127.0.0.1:3", "nats://127.0.0.1:4"))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # At once: the holder's record names a process that is gone, but the kernel already dropped its lock.
    os.close(lock_data_dir(tmp_path, Holder(os.getpid(), "http://127.0.0.1:3", "nats://127.0.0.1:4")))


def test_the_store_stays_locked_while_a_nats_server_of_a_dead_up_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no parent-death signal stops it (macOS), the nats-server of a killed `up` runs on: no other `up`
    may start a second server on its store until it exits."""
    from jetshard.up.natsserver import start_nats_server

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid: an `up` that is no more
    descriptor = lock_data_dir(tmp_path, Holder(gone.pid, "http://127.0.0.1:1", "nats://127.0.0.1:2"))
    server = start_nats_server(tmp_path / "nats", port=-1, store_lock_fd=descriptor)
    os.close(descriptor)  # as the kernel closes it for a killed `up`: only the server holds the lock now
    monkeypatch.setattr("jetshard.up.lock.HOLDER_GONE_WAIT_S", 0.5)
    try:
        with pytest.raises(click.ClickException, match=r"nats-server of a `jetshard up` that exited \(pid \d+, NATS"):
            lock_data_dir(tmp_path, Holder(os.getpid(), "http://127.0.0.1:3", "nats://127.0.0.1:4"))
    finally:
        server.stop()
    os.close(lock_data_dir(tmp_path, Holder(os.getpid(), "http://127.0.0.1:3", "nats://127.0.0.1:4")))
