"""Machines on one network form one cluster with `jetshard up --lan` and nothing else but the join token.

Real parts: hosts made of network namespaces on one bridge (tests/helpers/netns.py), each with its own data,
config and model directories, running the real `jetshard up --lan` (embedded nats-servers, every service,
zeroconf discovery); requests go from inside a host (tests/helpers/lan_probe.py: the official `openai`
client, NATS as the host's admin). The model is the packaged demo model, so no host needs the Hub.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers.gguf_models import write_tiny_gguf
from helpers.harness import until_sync
from helpers.lan_machines import (
    MONITOR_PORT,
    PROBE,
    LanCluster,
    Machine,
    caught_up,
    formed_cluster,
    place,
    wait_ready,
)
from helpers.netns import lan
from jetshard_schema.catalogue import DEMO_MODEL_ID


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LanCluster]:
    with lan(3) as net, formed_cluster(net, tmp_path_factory.mktemp("lan")) as formed:
        yield formed


def tokens_per_s(machine: Machine) -> float:
    machine.probe("chat", machine.api, DEMO_MODEL_ID, "8")  # warm: the first prompt compiles
    answer = machine.probe("chat", machine.api, DEMO_MODEL_ID, "48")
    assert answer["ok"], answer
    return answer["completion_tokens"] / answer["seconds"]


@pytest.mark.timeout(600)
def test_three_machines_form_one_cluster_and_serve_a_model_split_over_two(cluster: LanCluster) -> None:
    first, _, third = cluster.machines
    # One JetStream meta group of the three data servers, the witness gone, the history on three replicas.
    meta = first.probe("meta", "nats://127.0.0.1:4222", str(first.root / "data" / "creds" / "system.nk"))
    assert meta["known"] == meta["current"] == sorted(m.server_name for m in cluster.machines), meta
    nodes = third.get("/state")["nodes"]  # type: ignore[index]
    assert len(nodes) == 3, nodes
    for machine in cluster.machines:  # each syncs every write before acknowledging it
        varz = machine.get("/varz", MONITOR_PORT)
        assert varz["jetstream"]["config"]["sync_always"] is True, varz  # type: ignore[index]

    one_host = next(i for i in third.get("/instances") if i["model_id"] == DEMO_MODEL_ID)  # type: ignore[union-attr]
    one_host_tps = tokens_per_s(third)
    assert third.probe("http", "DELETE", f"{third.api}/instances/{one_host['instance_id']}")["status"] == 200

    body = {"model_id": DEMO_MODEL_ID, "min_nodes": 2, "engine": "mlx"}
    placed = third.probe("http", "POST", f"{third.api}/instances", json.dumps(body))
    assert placed["status"] == 201, placed
    instance = wait_ready(third, placed["body"]["instance_id"], 240)
    assert len({s["node_id"] for s in instance["shards"]}) == 2, instance
    answer = third.probe("chat", third.api, DEMO_MODEL_ID, "16")
    assert answer["ok"] and "Paris" in answer["text"], answer
    # A machine that is not the leader's, holding its own worker's keys, against the prompt just answered.
    leader = instance["shards"][-1]["node_id"]
    intruder = next(m for m in cluster.machines if m.server_name != leader)
    nkey = str(intruder.root / "data" / "creds" / f"worker-{intruder.server_name}.nk")
    got = intruder.probe("trespass", "nats://127.0.0.1:4222", nkey, leader)
    assert got == {
        "read by sequence": False,
        "read the victim's by subject": False,
        "report for the victim": False,
        "subscriptions refused": 1,
        "prompts heard": 0,
    }, got
    # A stranger at each rank's ring endpoint, in the clear or with a certificate of its own, is shut out by the
    # tunnel (only the left neighbour's certificate passes), and the pipeline keeps serving.
    outsider = next(m for m in cluster.machines if m.server_name not in {s["node_id"] for s in instance["shards"]})
    endpoints = third.get("/state")["instances"][instance["instance_id"]]["endpoints"]  # type: ignore[index]
    for rank, endpoint in endpoints.items():
        certificate = outsider.root / f"rank{rank}.pem"
        certificate.write_text(endpoint["certificate_pem"])
        knocked = outsider.probe("stranger", endpoint["host"], str(endpoint["port"]), str(certificate))
        assert knocked["tls"] in ("alert", "closed", "ConnectionResetError"), knocked
    answer = third.probe("chat", third.api, DEMO_MODEL_ID, "16")
    assert answer["ok"] and "Paris" in answer["text"], answer
    two_host_tps = tokens_per_s(third)
    print(
        f"\nthird up to one cluster: {cluster.formed_s:.1f} s; demo model {one_host_tps:.1f} tok/s on one host, "
        f"{two_host_tps:.1f} tok/s split over two (x{two_host_tps / one_host_tps:.2f})"
    )


@pytest.mark.timeout(600)
def test_three_machines_serve_the_demo_split_tensor_parallel(cluster: LanCluster) -> None:
    """Every layer of the demo split over the three hosts (its 9 attention and 3 key/value heads divide by 3), then
    the two-host pipeline placed back for the tests after this one."""
    third = cluster.machines[2]
    pipeline = [i for i in third.get("/instances") if i["model_id"] == DEMO_MODEL_ID]  # type: ignore[union-attr]
    for old in pipeline:
        assert third.probe("http", "DELETE", f"{third.api}/instances/{old['instance_id']}")["status"] == 200
    body = {"model_id": DEMO_MODEL_ID, "min_nodes": 3, "parallelism": "tensor"}
    placed = third.probe("http", "POST", f"{third.api}/instances", json.dumps(body))
    assert placed["status"] == 201, placed
    instance = wait_ready(third, placed["body"]["instance_id"], 240)
    assert sorted(s["tensor_rank"] for s in instance["shards"]) == [0, 1, 2], instance
    assert len({s["node_id"] for s in instance["shards"]}) == 3, instance
    # Three ranks on this machine's two cores decode slowly (see bench/RESULTS.md): a short answer.
    answer = third.probe("chat", third.api, DEMO_MODEL_ID, "6")
    assert answer["ok"] and "Paris" in answer["text"], answer

    body = {"model_id": DEMO_MODEL_ID, "min_nodes": 2, "engine": "mlx"}
    again = third.probe("http", "POST", f"{third.api}/instances", json.dumps(body))
    assert again["status"] == 201, again
    wait_ready(third, again["body"]["instance_id"], 240)
    assert third.probe("http", "DELETE", f"{third.api}/instances/{instance['instance_id']}")["status"] == 200


@pytest.mark.timeout(600)
def test_a_machine_that_goes_away_loses_nothing_acked_and_catches_up_when_it_returns(
    cluster: LanCluster, tmp_path: Path
) -> None:
    first, _, third = cluster.machines
    node_of = {m.server_name: m for m in cluster.machines}
    instance = next(i for i in third.get("/instances") if i["status"] == "ready")  # type: ignore[union-attr]
    hosting = [node_of[s["node_id"]] for s in instance["shards"] if node_of.get(s["node_id"]) is not third]
    victim = hosting[0] if hosting else first
    stop_file, out = tmp_path / "stop", tmp_path / "traffic.json"
    nkey = str(third.root / "data" / "creds" / "admin.nk")
    events_before = third.get("/state")["last_seq"]  # type: ignore[index]
    traffic = third.host.popen(
        [
            sys.executable,
            PROBE,
            "traffic",
            third.api,
            DEMO_MODEL_ID,
            "nats://127.0.0.1:4222",
            nkey,
            str(stop_file),
            str(out),
        ],
        tmp_path / "traffic.log",
        third.env,
    )
    try:
        # Traffic flows (its commands sequenced) before the link goes.
        until_sync(
            lambda: third.get("/state")["last_seq"] >= events_before + 20,  # type: ignore[index]
            120,
            lambda: f"traffic's commands sequenced: {(tmp_path / 'traffic.log').read_text(errors='replace')[-2000:]}",
        )
        victim.host.link_down()

        def replaced() -> bool:
            instances = third.get("/instances")
            return any(
                i["status"] == "ready" and victim.server_name not in {s["node_id"] for s in i["shards"]}
                for i in instances  # type: ignore[union-attr]
            )

        replaced_s = until_sync(
            replaced, 240, lambda: f"the instance re-placed without {victim.host.name}: {third.get('/instances')}"
        )
        answer = third.probe("chat", third.api, DEMO_MODEL_ID, "16")
        assert answer["ok"] and "Paris" in answer["text"], answer
    finally:
        stop_file.touch()
        traffic.wait(120)
        victim.host.link_up()
    record = json.loads(out.read_text())
    acked_file = tmp_path / "acked.json"
    acked_file.write_text(json.dumps([command for command, _ in record["acked"]]))
    outcomes = third.probe("outcomes", "nats://127.0.0.1:4222", nkey, str(acked_file), "60")
    assert record["acked"] and outcomes == {"missing": [], "kinds": [["CustomModelCardAdded"]]}, outcomes
    served_after = [c["at"] for c in record["chats"] if c["ok"]]
    assert served_after, record["chats"]

    # Back on the network: the machine catches up from the stream and its node is in State again.
    until_sync(lambda: caught_up(victim, third), 120, lambda: f"{victim.host.name} caught up")
    failed = [c for c in record["chats"] if not c["ok"]]
    ack_times = [at for _, at in record["acked"]]
    takeover_s = max(b - a for a, b in itertools.pairwise(ack_times))
    print(
        f"\n{len(record['acked'])} commands acked, all sequenced; commands waited at most {takeover_s:.1f} s for "
        f"an ack (the takeover); {len(record['chats'])} chats, {len(failed)} failed around the loss; instance "
        f"re-placed {replaced_s:.1f} s after {victim.host.name} went away"
    )


@pytest.mark.timeout(900)
def test_a_gguf_split_across_two_hosts_on_llama_cpp_shuts_out_strangers_and_heals_when_its_helper_is_cut_off(
    cluster: LanCluster, tmp_path: Path
) -> None:
    third = cluster.machines[2]
    node_of = {m.server_name: m for m in cluster.machines}
    for old in third.get("/instances"):  # type: ignore[union-attr]
        assert third.probe("http", "DELETE", f"{third.api}/instances/{old['instance_id']}")["status"] == 200
    # The reference: one llama.cpp process holding the whole model.
    one = place(
        third, {"model_id": DEMO_MODEL_ID, "engine": "llama.cpp", "node_ids": [cluster.machines[0].server_name]}
    )
    alone = third.probe("chat", third.api, DEMO_MODEL_ID, "16")
    assert alone["ok"] and "Paris" in alone["text"], alone
    assert third.probe("http", "DELETE", f"{third.api}/instances/{one['instance_id']}")["status"] == 200

    split = place(third, {"model_id": DEMO_MODEL_ID, "engine": "llama.cpp", "min_nodes": 2})
    leader, helper = (node_of[s["node_id"]] for s in split["shards"])
    outsider = next(m for m in cluster.machines if m not in (leader, helper))
    answer = leader.probe("chat", leader.api, DEMO_MODEL_ID, "16")
    assert answer["ok"] and answer["text"] == alone["text"], (answer, alone)  # the same greedy tokens

    # A stranger at the helper's endpoint, in the clear or with a certificate of its own, gets nothing of
    # llama.cpp's RPC (whose HELLO reply starts 1c00...): the tunnel lets in the leader's certificate only.
    endpoint = third.get("/state")["instances"][split["instance_id"]]["endpoints"]["1"]  # type: ignore[index]
    certificate = tmp_path / "helper.pem"
    certificate.write_text(endpoint["certificate_pem"])
    knocked = outsider.probe("stranger", endpoint["host"], str(endpoint["port"]), str(certificate))
    assert not any(got.startswith("1c00") for got in knocked.values()), knocked
    assert knocked["tls"] in ("alert", "closed", "ConnectionResetError"), knocked
    answer = leader.probe("chat", leader.api, DEMO_MODEL_ID, "16")
    assert answer["ok"] and answer["text"] == alone["text"], answer

    # The helper's cable pulled mid-stream: the stream ends with an error within seconds (llama.cpp alone would hang
    # for the kernel's ~15 minutes of retransmissions), and the instance is placed again without it.
    out = tmp_path / "stream.json"
    streaming = leader.host.popen(
        [sys.executable, PROBE, "stream", leader.api, DEMO_MODEL_ID, "3000", str(out)],
        tmp_path / "stream.log",
        leader.env,
    )
    try:
        until_sync(lambda: Path(f"{out}.first").exists(), 120, lambda: (tmp_path / "stream.log").read_text())
        helper.host.link_down()
        cut_at = time.monotonic()
        streaming.wait(180)
        ended = json.loads(out.read_text())
        assert not ended["ok"] and ended["at"] - cut_at < 60, ended

        def replaced() -> bool:  # as a new instance of the model (the lost node's instance is deleted)
            return any(
                i["status"] == "ready" and helper.server_name not in {s["node_id"] for s in i["shards"]}
                for i in leader.get("/instances")  # type: ignore[union-attr]
            )

        until_sync(replaced, 300, lambda: f"re-placed without {helper.host.name}: {leader.get('/instances')}")
        answer = leader.probe("chat", leader.api, DEMO_MODEL_ID, "16")
        assert answer["ok"] and answer["text"] == alone["text"], answer
    finally:
        if streaming.poll() is None:
            streaming.kill()
        helper.host.link_up()
    until_sync(lambda: caught_up(helper, leader), 180, lambda: f"{helper.host.name} caught up")
    # Back, the helper's worker finds its instance gone and stops what it ran for it.
    until_sync(
        lambda: not llama_cpp_processes(helper), 120, lambda: f"{helper.host.name}: {llama_cpp_processes(helper)}"
    )
    print(f"\nthe stream ended {ended['at'] - cut_at:.1f} s after the helper's cable was pulled: {ended['error']}")


@pytest.mark.timeout(600)
def test_a_model_on_one_machine_is_copied_to_another_over_the_lan_and_served_there(
    cluster: LanCluster, tmp_path: Path
) -> None:
    """A GGUF someone imported on the first machine, placed on the third alone: the third's downloader copies it
    from the first's over the LAN (mutual TLS between the downloaders; no Hub in these namespaces at all)."""
    first, _, third = cluster.machines
    for old in third.get("/instances"):  # type: ignore[union-attr]
        assert third.probe("http", "DELETE", f"{third.api}/instances/{old['instance_id']}")["status"] == 200
    gguf = write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama", seed=7)
    imported = first.jetshard("models", "import-gguf", str(gguf), "--id", "lan/tiny-copied")
    assert imported.returncode == 0, imported.stdout + imported.stderr
    # The first machine's API answered the import; the third's replica may be a moment behind it.
    card = f"{third.api}/models/lan/tiny-copied"
    until_sync(lambda: third.probe("http", "GET", card)["status"] == 200, 60, "the third machine to know the card")
    body = {"model_id": "lan/tiny-copied", "engine": "llama.cpp", "node_ids": [third.server_name]}
    instance = place(third, body)
    assert [s["node_id"] for s in instance["shards"]] == [third.server_name]
    downloads = third.get("/downloads")
    [copied] = [d for d in downloads if d["model_id"] == "lan/tiny-copied" and d["node_id"] == third.server_name]  # type: ignore[union-attr]
    assert copied["status"] == "completed" and copied["source"] == first.server_name, copied
    on_disk = third.root / "models" / "lan--tiny-copied" / "model.gguf"
    assert on_disk.resolve().read_bytes() == gguf.read_bytes()
    answer = third.probe("chat", third.api, "lan/tiny-copied", "4")
    assert answer["ok"], answer  # random weights: that it answers is the point
    assert third.probe("http", "DELETE", f"{third.api}/instances/{instance['instance_id']}")["status"] == 200


def llama_cpp_processes(machine: Machine) -> list[str]:
    """llama.cpp's servers among what the machine's `jetshard up` runs."""
    assert machine.up is not None
    children = psutil.Process(machine.up.pid).children(recursive=True)
    names = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            names.append(child.name())
    return [name for name in names if "rpc-server" in name or "llama-server" in name]


@pytest.mark.timeout(300)
def test_clusters_keep_apart_by_name_a_machine_without_the_token_cannot_join_and_one_gone_is_forgotten(
    cluster: LanCluster, tmp_path: Path
) -> None:
    first = cluster.machines[0]
    other = Machine(cluster.net.add_host(), tmp_path / "other")
    stranger = Machine(cluster.net.add_host(), tmp_path / "stranger")
    try:
        other.start("--cluster", "other", "--no-model")
        other.wait_for("Press Ctrl-C to stop.", 180)
        assert other.route_names() == {f"{other.server_name}-witness"}
        assert not {other.server_name} & first.route_names()

        # The name is taken on this network: a new cluster may not take it, and a forged token is refused.
        stranger.start("--no-model")
        assert stranger.up is not None and stranger.up.wait(60) != 0
        assert "already runs on this network" in stranger.output(), stranger.output()
        forged = re.sub(r"\.[^.]+$", ".forged-secret-of-forty-three-characters-xxxx", cluster.token)
        # Found by mDNS, the members' announcements do not verify under a forged secret: no route is even tried,
        # so the forged machine learns nothing either.
        stranger.start("--join-token", forged, "--no-model", "--data-dir", str(tmp_path / "stranger" / "data2"))
        assert stranger.up.wait(120) != 0
        assert "do not know this machine's join token" in stranger.output(), stranger.output()
        # Named with --join, the member's route refuses the forged secret.
        join = f"--join={first.host.address}:6222"
        stranger.start("--join-token", forged, join, "--no-model", "--data-dir", str(tmp_path / "stranger" / "data4"))
        assert stranger.up.wait(120) != 0
        assert "refused this machine's join token" in stranger.output(), stranger.output()
        assert not {n for n in first.route_names() if n.startswith("node-")} - {m.server_name for m in cluster.machines}

        # With the token it joins; once it has left for good, the others forget it and count a majority without it.
        stranger.start("--join-token", cluster.token, "--no-model", "--data-dir", str(tmp_path / "stranger" / "data3"))
        stranger.wait_for("Press Ctrl-C to stop.", 180)
        members = {m.server_name for m in cluster.machines}
        assert {s["server"] for s in first.lan_servers()} == members | {stranger.server_name}
        stranger.stop()
        until_sync(
            lambda: not next(s for s in first.lan_servers() if s["server"] == stranger.server_name)["current"],
            60,
            lambda: f"{stranger.server_name} away: {first.lan_servers()}",
        )
        refused = first.jetshard("lan", "forget", cluster.machines[1].server_name)
        assert refused.returncode != 0 and "stop its `jetshard up` first" in refused.stderr, refused
        forgotten = first.jetshard("lan", "forget", stranger.server_name)
        assert forgotten.returncode == 0, forgotten
        assert {s["server"] for s in first.lan_servers()} == members
    finally:
        for machine in (other, stranger):
            machine.stop()
