"""jetshard's llama.cpp engine split across two hosts against upstream `llama-server --rpc` with the same split.

Two hosts on one LAN made of network namespaces (tests/helpers/netns.py; root only): h1 and h2. The bench re-runs
itself inside h1 (`--inside`), so that its HTTP client, jetshard's API and every leader share h1, as a user's client
shares the leader's machine. Three sides, all started for each model, then loaded in turn (never two at once): every
round runs on each side, the order reversed every other round, so a drift in the machine's speed weighs on all alike
(bench/llamacpp.py `measure`):
  * jetshard split: `jetshard up --lan --no-model` on h1, `jetshard up --lan --join-token ... --no-model` on h2, the
    GGUF imported on h1 (`jetshard models import-gguf`) and placed with `POST /instances` on `"engine": "llama.cpp"`
    and `"node_ids": [h1, h2]`: h1 is the leader (rank 0: llama-server, the token embedding and the first layers),
    h2 the helper (ggml-rpc-server behind jetshard's TLS tunnel). The instance's layer ranges are printed.
  * llama-server split (the anchor): the same build's `ggml-rpc-server -H <h2's address> -p 50052 -c` on h2 (its
    file cache in a fresh directory, SIGPIPE ignored as jetshard starts it), and on h1 `llama-server --rpc
    <h2>:50052` with jetshard's own llama-server's command line (read from /proc: `--parallel`, `--ctx-size`,
    `--cache-ram`, ... and its split, `--n-gpu-layers`/`--tensor-split`), its `--rpc` pointed at h2 instead of
    jetshard's tunnel: upstream doing the same work over plain TCP.
  * llama-server on one host: the same llama-server on h1 alone, same flags without the split: what it costs.
Load: 1 and 4 concurrent streams (`--streams`), `--rounds` rounds each, every request a fresh chat (no prompt cache
helps), streamed through the official `openai` client at temperature 0, `max_tokens` 32 (and `ignore_eos` on
llama-server). Figures: output tok/s (a round's tokens over its whole time, first request sent to last token) and
TTFT p50 per side; ratios jetshard/anchor and split/one-host. See bench/llamacpp.py for what the figures mean.

Models: `1b-q4_0` (default; a Llama-3.2-1B-shaped Q4_0 with random weights, bench/gguf_models.py), `1b-q4_k_m`,
`demo` (the demo's SmolLM2-135M Q4_1). Goal (issue 37): jetshard >= 0.9x upstream's output tok/s with the same split.
The load average before and after each model is printed: figures taken while something else ran mean little.

    uv run --group dev python bench/llamacpp_split.py                      # 1b-q4_0, 1 and 4 streams, 3 rounds
    uv run --group dev python bench/llamacpp_split.py --models 1b-q4_0 demo --rounds 1 --streams 1 --max-tokens 8
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from _common import Figures, free_port, jetshard_env, machine_line, ms, stop_group, table, wait
from llamacpp import (
    LLAMA_CPP,
    MODELS,
    BenchModel,
    LlamaCppBuild,
    Side,
    flag,
    llama_cpp_build,
    llama_server,
    load_line,
    measure,
    place_on_llama_cpp,
    ratio,
    start,
    tail,
    unique_chats,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.gguf_models import file_type_of

JETSHARD = "jetshard split"
ANCHOR = "llama-server split"
ONE_HOST = "llama-server one host"
SIDES = (JETSHARD, ANCHOR, ONE_HOST)
TOK_S_GOAL = 0.9
RPC_PORT = 50052
SPLIT_FLAGS = ("--rpc", "--n-gpu-layers", "--tensor-split")
"""The flags of jetshard's leader that split the model over its helpers (`--rpc`: its tunnels to them)."""
JOIN_TOKEN = re.compile(r"jetshard up --lan --join-token (\S+)")
CLUSTER_TIMEOUT_S = 300
INSIDE = "--inside"
"""Marks the run inside h1; the environment names h2 and the working directory (`ENV_*`)."""
ENV_H1_ADDRESS, ENV_H2, ENV_H2_ADDRESS = "LLAMACPP_SPLIT_H1_ADDRESS", "LLAMACPP_SPLIT_H2", "LLAMACPP_SPLIT_H2_ADDRESS"
ENV_ROOT = "LLAMACPP_SPLIT_ROOT"


# ------------------------------------------------------------------------------------------------- hosts


@dataclass(frozen=True)
class Peer:
    """h2 as seen from inside h1: its namespace and its address on the LAN, and h1's address."""

    namespace: str
    address: str
    leader_address: str

    def command(self, args: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *args]


# ------------------------------------------------------------------------------------------- jetshard split


@dataclass
class Cluster:
    """`jetshard up --lan` on h1 and h2; the API on h1."""

    api: str
    """On h1's loopback; h2 reaches it at `lan_api`."""
    lan_api: str
    ups: list[tuple[subprocess.Popen, Path]]
    node_ids: tuple[str, str]
    homes: tuple[Path, Path]


def _node_id(home: Path) -> str:
    return (home / "config" / "node_id").read_text().strip()


def _both_nodes_run_llama_cpp(api: str, node_ids: Sequence[str]) -> bool:
    answer = httpx.get(f"{api}/nodes", timeout=5)
    if answer.status_code != 200:
        return False  # 503 while h1's NATS server rejoins the meta group as the cluster forms
    engines = {n["node_id"]: n["profile"]["engines"] for n in answer.json()}
    return all(LLAMA_CPP in engines.get(node, ()) for node in node_ids)


@contextlib.contextmanager
def jetshard_cluster(peer: Peer, root: Path) -> Iterator[Cluster]:
    """h1 first (it prints the join token), then h2 joins; yields once both nodes run llama.cpp."""
    port = free_port()  # a port free in h1; h2 is a namespace of its own where every port is free
    homes = [root / "jetshard-h1", root / "jetshard-h2"]
    for home in homes:
        home.mkdir(parents=True, exist_ok=True)
    up = [sys.executable, "-m", "jetshard", "up", "--lan", "--offline", "--no-model", "--port", str(port)]
    # A 2-core machine running flat out can starve a worker's liveness beat (bench/_common.py jetshard_up).
    env = {"JETSHARD_LOG_LEVEL": "INFO", "JETSHARD_LIVENESS_TTL_S": "60"}
    ups: list[tuple[subprocess.Popen, Path]] = []
    try:
        log1 = homes[0] / "up.log"
        ups.append((start(up, log1, {**jetshard_env(homes[0]), **env}), log1))
        token = ""

        def printed_token() -> bool:
            nonlocal token
            if ups[0][0].poll() is not None:
                raise RuntimeError(f"jetshard up on h1 exited:\n{tail(log1)}")
            match = JOIN_TOKEN.search(log1.read_text(errors="replace"))
            token = match[1] if match else ""
            return bool(token) and (homes[0] / "config" / "node_id").is_file()

        wait(printed_token, CLUSTER_TIMEOUT_S, "jetshard up on h1 printing its join token", interval=0.5)
        log2 = homes[1] / "up.log"
        joined = peer.command([*up, "--join-token", token])
        ups.append((start(joined, log2, {**jetshard_env(homes[1]), **env}), log2))
        api = f"http://127.0.0.1:{port}"

        def formed() -> bool:
            for process, log in ups:
                if process.poll() is not None:
                    raise RuntimeError(f"jetshard up exited:\n{tail(log)}")
            if not (homes[1] / "config" / "node_id").is_file():
                return False
            return _both_nodes_run_llama_cpp(api, [_node_id(home) for home in homes])

        wait(formed, CLUSTER_TIMEOUT_S, "h1 and h2 in one cluster, both running llama.cpp", interval=0.5)
        lan_api = f"http://{peer.leader_address}:{port}"  # `up --lan` serves its API on every interface
        yield Cluster(api, lan_api, ups, (_node_id(homes[0]), _node_id(homes[1])), (homes[0], homes[1]))
    finally:
        for process, _ in reversed(ups):
            stop_group(process)


def import_gguf(host: Sequence[str], home: Path, api: str, path: Path, model_id: str) -> None:
    """`jetshard models import-gguf` run in a host (`host`: the command prefix that enters it) as that host's user
    runs it: its downloader links the file into its own model directory."""
    command = [*host, sys.executable, "-m", "jetshard", "models", "--api", api, "import-gguf", str(path)]
    command += ["--id", model_id]
    done = subprocess.run(command, env=jetshard_env(home), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def layer_ranges(instance: dict) -> list[tuple[int, int]]:
    return [(s["start_layer"], s["end_layer"]) for s in sorted(instance["shards"], key=lambda s: s["rank"])]


def leader_command_line(cluster: Cluster) -> list[str]:
    """The command line of the llama-server jetshard started on h1: what the anchor copies its flags from."""
    up = psutil.Process(cluster.ups[0][0].pid)
    servers = [p for p in up.children(recursive=True) if p.name() == "llama-server"]
    if len(servers) != 1:
        raise RuntimeError(f"expected one llama-server under jetshard up on h1, found {len(servers)}")
    return servers[0].cmdline()


@contextlib.contextmanager
def jetshard_split_side(
    cluster: Cluster, peer: Peer, model: BenchModel, path: Path, timeout_s: float
) -> Iterator[list[str]]:
    """The model placed over h1 and h2; yields its leader's llama-server command line. Deleted afterwards, so that
    the next model has the nodes' memory."""
    if not model.built_in:
        # On both hosts, as a user with the file on both machines does: an offline cluster copies no model between
        # nodes (and a copy over the LAN is not what this bench measures).
        import_gguf([], cluster.homes[0], cluster.api, path, model.jetshard_id)
        import_gguf(peer.command([]), cluster.homes[1], cluster.lan_api, path, model.jetshard_id)
    instance = place_on_llama_cpp(cluster.api, model.jetshard_id, timeout_s, cluster.node_ids)
    try:
        ranges = layer_ranges(instance)
        print(f"  {JETSHARD}: layers {ranges} on h1, h2 (rank order); {instance.get('serving')}", flush=True)
        yield leader_command_line(cluster)
    finally:
        httpx.delete(f"{cluster.api}/instances/{instance['instance_id']}", timeout=60)


# ------------------------------------------------------------------------------------------- llama-server


@contextlib.contextmanager
def rpc_server(build: LlamaCppBuild, peer: Peer, root: Path, name: str) -> Iterator[str]:
    """Upstream's helper on h2: `ggml-rpc-server -H <h2> -p RPC_PORT -c`, its file cache in a fresh directory;
    yields `host:port` once it listens."""
    cache = root / f"rpc-cache-{name}"
    cache.mkdir(parents=True, exist_ok=True)
    log = root / f"rpc-server-{name}.log"
    command = peer.command([str(build.rpc_server), "-H", peer.address, "-p", str(RPC_PORT), "-c"])
    # restore_signals=False: it inherits Python's ignored SIGPIPE, as jetshard starts it (bench/RPC_FACTS.md, 1):
    # a client that leaves while it writes would kill it otherwise.
    process = start(command, log, {**os.environ, "LLAMA_CACHE": str(cache)}, cwd=build.root, restore_signals=False)

    def listening() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"ggml-rpc-server on h2 exited:\n{tail(log)}")
        # Judged by its listening socket, never by a connection: it serves one client at a time.
        ss = subprocess.run(peer.command(["ss", "-Hltn", f"sport = :{RPC_PORT}"]), capture_output=True, text=True)
        return bool(ss.stdout.strip())

    try:
        wait(listening, 60, "ggml-rpc-server on h2 listening")
        yield f"{peer.address}:{RPC_PORT}"
    finally:
        stop_group(process, sig=signal.SIGTERM, grace_s=10)


def anchor_arguments(jetshard_leader: Sequence[str], path: Path, port: int) -> list[str]:
    """The command line of jetshard's leader (its slots, context, prompt cache and every other flag) on this GGUF
    and `port`, without its split."""
    arguments = list(jetshard_leader)
    for name in SPLIT_FLAGS:
        if name in arguments:
            del arguments[arguments.index(name) : arguments.index(name) + 2]
    arguments[arguments.index("--model") + 1] = str(path)
    arguments[arguments.index("--port") + 1] = str(port)
    return arguments


def split_arguments(helpers: Sequence[str], jetshard_leader: Sequence[str]) -> list[str]:
    """`--rpc` to `helpers` and the offload flags jetshard's leader got: each helper takes the range of layers it
    takes in jetshard's instance."""
    return [
        "--rpc",
        ",".join(helpers),
        *(part for name in SPLIT_FLAGS[1:] for part in (name, flag(jetshard_leader, name))),
    ]


# ---------------------------------------------------------------------------------------------- report


def report(results: dict[tuple[str, str], dict[int, Figures]], models: Sequence[str], streams: Sequence[int]) -> None:
    rows = []
    verdicts = []
    for name in models:
        for n in streams:
            j, a, o = ((results.get((name, side)) or {}).get(n) for side in SIDES)
            rows.append(
                [
                    name,
                    str(n),
                    *(f"{f.output_tok_s:.1f}" if f else "-" for f in (j, a, o)),
                    ratio(j.output_tok_s, a.output_tok_s) if j and a else "-",
                    ratio(a.output_tok_s, o.output_tok_s) if a and o else "-",
                    *(ms(f.ttft_p50) if f else "-" for f in (j, a, o)),
                ]
            )
            if j and a:
                met = j.output_tok_s >= TOK_S_GOAL * a.output_tok_s
                verdicts.append(f"{name} at {n} stream(s): {'met' if met else 'NOT met'}")
    header = [
        "model",
        "streams",
        "jetshard split tok/s",
        "llama-server split tok/s",
        "one host tok/s",
        f"jetshard/anchor (goal >= {TOK_S_GOAL})",
        "split/one host",
        "jetshard TTFT p50 ms",
        "anchor TTFT p50 ms",
        "one host TTFT p50 ms",
    ]
    print()
    print(table(header, rows))
    if verdicts:
        print()
        print(f"goal (issue 37: jetshard split >= {TOK_S_GOAL}x llama-server's output tok/s with the same split):")
        for line in verdicts:
            print(f"  {line}")


# ---------------------------------------------------------------------------------------------- driving


def bench_model(
    model: BenchModel, cluster: Cluster, build: LlamaCppBuild, peer: Peer, args: argparse.Namespace, root: Path
) -> dict[str, dict[int, Figures]]:
    """All three sides up for `model`, measured in turn; their figures by side."""
    path = model.path()
    print(f"\n{model.name}: {path} ({file_type_of(path)}, {path.stat().st_size / 2**20:.0f} MiB); {load_line()}")
    rng = random.Random(time.time_ns())
    # The same fresh prompts for every side: none has seen them.
    cases = {n: [unique_chats(n, rng) for _ in range(args.rounds)] for n in args.streams}
    with contextlib.ExitStack() as sides:
        leader = sides.enter_context(jetshard_split_side(cluster, peer, model, path, args.ready_timeout))
        jetshard = Side(JETSHARD, f"{cluster.api}/v1", model.jetshard_id, None)
        helper = sides.enter_context(rpc_server(build, peer, root, model.name))
        split = anchor_arguments(leader, path, free_port()) + split_arguments([helper], leader)
        print(f"  {ANCHOR}: {' '.join(split[1:])}", flush=True)
        anchor, _ = sides.enter_context(llama_server(build, split, root / f"anchor-{model.name}.log", ANCHOR))
        alone = anchor_arguments(leader, path, free_port())
        one_host, _ = sides.enter_context(llama_server(build, alone, root / f"one-host-{model.name}.log", ONE_HOST))
        measured = measure([jetshard, anchor, one_host], cases, args.max_tokens)
    # jetshard's dialects take no `ignore_eos`: an answer that ended early shows here, and weighs on its tok/s.
    answered = ", ".join(f"{side} {sum(f.tokens for f in per.values())}" for side, per in measured.items())
    print(f"  measured; tokens answered: {answered}; {load_line()}", flush=True)
    return measured


def inside(args: argparse.Namespace) -> None:
    """In h1: the cluster once, then every model's three sides; the report."""
    build = llama_cpp_build()
    peer = Peer(os.environ[ENV_H2], os.environ[ENV_H2_ADDRESS], os.environ[ENV_H1_ADDRESS])
    root = Path(os.environ[ENV_ROOT])
    print(f"llama.cpp build: {build.root}; max_tokens {args.max_tokens}, temperature 0, rounds {args.rounds}")
    results: dict[tuple[str, str], dict[int, Figures]] = {}
    started = time.monotonic()
    with jetshard_cluster(peer, root) as cluster:
        print(f"jetshard: `jetshard up --lan` on h1 and h2 in {time.monotonic() - started:.0f} s", flush=True)
        for name in args.models:
            for side, measured in bench_model(MODELS[name], cluster, build, peer, args, root).items():
                results[name, side] = measured
    report(results, args.models, args.streams)
    print(f"\nelapsed {time.monotonic() - started:.0f} s")


def outside(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Make the GGUFs and a LAN of two hosts, run the bench inside h1, remove the LAN (and everything in it)."""
    if os.geteuid() != 0:
        sys.exit("this bench makes network namespaces: run it as root")
    from helpers.netns import lan

    print(machine_line())
    for name in args.models:
        MODELS[name].path()  # made here, once, before any host exists
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="jetshard-llamacpp-split-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        with lan(2, prefix="lcs") as network:
            h1, h2 = network.hosts
            env = {**os.environ, ENV_H2: h2.name, ENV_H2_ADDRESS: h2.address, ENV_H1_ADDRESS: h1.address}
            env[ENV_ROOT] = str(root)
            print(f"lan: h1 {h1.address}, h2 {h2.address}; logs in {root}", flush=True)
            run = subprocess.Popen(h1.command([sys.executable, __file__, INSIDE, *argv]), env=env)
            try:
                return run.wait()
            except KeyboardInterrupt:
                # Ctrl-C reached the run inside h1 too: let it stop what it started, then remove the hosts.
                try:
                    return run.wait(60)
                except subprocess.TimeoutExpired:
                    run.kill()
                    return 130
    finally:
        if not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    # SIGTERM stops it as Ctrl-C does: every context manager stops what it started, and the hosts are removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    argv = sys.argv[1:]
    run_inside = INSIDE in argv
    argv = [a for a in argv if a != INSIDE]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["1b-q4_0"], help=f"of {', '.join(MODELS)}")
    parser.add_argument("--streams", nargs="+", default=["1", "4"], help="numbers of concurrent streams")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each number of streams")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each answer has")
    parser.add_argument("--ready-timeout", type=float, default=1800, help="seconds jetshard's instance may take")
    parser.add_argument("--work-dir", type=Path, help="keep logs and jetshard's directories here")
    args = parser.parse_args(argv)
    # Space- or comma-separated: `--models 1b-q4_0 demo` or `--models 1b-q4_0,demo`.
    args.models = [m for given in args.models for m in given.split(",") if m]
    args.streams = [int(s) for given in args.streams for s in given.split(",") if s]
    if unknown := [m for m in args.models if m not in MODELS]:
        parser.error(f"unknown model(s): {', '.join(unknown)}")
    if run_inside:
        inside(args)
    else:
        sys.exit(outside(args, argv))


if __name__ == "__main__":
    main()
