"""Measure llama.cpp's RPC backend (ggml-rpc-server + llama-server --rpc) on network-namespace hosts (root only).

Reproduces the figures in bench/RPC_FACTS.md:

    JETSHARD_LLAMA_CPP_CACHE=/root/.cache/jetshard/llama.cpp .venv/bin/python bench/rpc_probe.py [experiment ...]

Experiments: models, stranger, split, cache, decode, faults, throughput (default: all). It makes a lan of three
hosts (tests/helpers/netns.py): h1 runs llama-server (the leader), h2 and h3 run ggml-rpc-server bound to their own
address. The outer process builds the lan and re-runs itself inside h1 (`--inside`), so that its HTTP client, the
leader and the byte counters are all on the lan; every process and namespace is removed at the end. Results are
printed as JSON lines and collected in /tmp/rpcf/results.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

BUILD = Path(os.environ.get("JETSHARD_LLAMA_CPP_CACHE", "/root/.cache/jetshard/llama.cpp")) / (
    "llama-cpp-python-0.3.36-gcc-12.2.0-x86_64-avx2"
)
WORK = Path("/tmp/rpcf")
RPC_PORT = 50052
LEADER_PORT = 8090
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
OUTAGE_S = 90
EXPERIMENTS = ("models", "stranger", "split", "cache", "decode", "faults", "throughput")

results: dict[str, object] = {}


def report(key: str, value: object) -> None:
    results[key] = value
    print(json.dumps({key: value}), flush=True)


# ------------------------------------------------------------------------------------------------ models


def make_models() -> None:
    from helpers.gguf_models import Shape, quantize, write_gguf

    WORK.mkdir(exist_ok=True)
    # tiny: 4 layers, hidden 256 (31.7 MB, the 25 MB embedding on the leader): every tensor under 10 MiB.
    tiny = Shape("llama", 4, 256, 4, 2, 64, 512, 4096, 10000.0, 1e-5)
    # mid: 4 layers whose FFN matrices are 11.5 MB in F16 (over ggml-rpc's 10 MiB cache threshold), 197 MB.
    mid = Shape("llama", 4, 512, 8, 4, 64, 11264, 4096, 10000.0, 1e-5)
    for name, shape, seed in (("tiny4-f16", tiny, 1), ("mid4-f16", mid, 2)):
        if not (WORK / f"{name}.gguf").exists():
            write_gguf(WORK / f"{name}.gguf", shape, seed=seed)
    if not (WORK / "mid4-q4_0.gguf").exists():
        quantize(WORK / "mid4-f16.gguf", WORK / "mid4-q4_0.gguf", "Q4_0")


# -------------------------------------------------------------------------------------------- processes


def netns(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


def counters(ns: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of eth0 in namespace `ns`."""
    text = subprocess.run(netns(ns, "cat", "/proc/net/dev"), capture_output=True, text=True, check=True).stdout
    for line in text.splitlines():
        if line.strip().startswith("eth0:"):
            fields = line.split(":", 1)[1].split()
            return int(fields[0]), int(fields[8])
    raise RuntimeError(f"no eth0 in {ns}")


def listening(ns: str, port: int) -> bool:
    out = subprocess.run(netns(ns, "ss", "-Hltn", f"sport = :{port}"), capture_output=True, text=True).stdout
    return bool(out.strip())


def wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def rpc_server(
    ns: str, address: str, log: Path, cache_dir: Path | None = None, threads: int = 1
) -> Iterator[subprocess.Popen[bytes]]:
    args = ["./bin/ggml-rpc-server", "-H", address, "-p", str(RPC_PORT), "-t", str(threads)]
    env = dict(os.environ)
    if cache_dir is not None:
        args.append("-c")
        env["LLAMA_CACHE"] = str(cache_dir)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            netns(ns, "stdbuf", "-oL", *args),
            cwd=BUILD,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        wait(lambda: listening(ns, RPC_PORT), 20, f"rpc-server in {ns} not listening")
        yield proc
    finally:
        stop(proc)


@contextlib.contextmanager
def leader_command(model: Path, *args: str) -> list[str]:
    """llama-server on 127.0.0.1:LEADER_PORT, one thread, 1024 tokens of context, then `args`."""
    address = ["--host", "127.0.0.1", "--port", str(LEADER_PORT)]
    return ["./bin/llama-server", "-m", str(model), *address, "-c", "1024", "-t", "1", *args]


def leader(model: Path, log: Path, *args: str, ready_timeout_s: float = 120) -> Iterator[subprocess.Popen[bytes]]:
    """llama-server in this namespace (h1) on 127.0.0.1:LEADER_PORT."""
    import httpx

    command = leader_command(model, "-np", "1", "--no-webui", *args)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=BUILD, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{LEADER_PORT}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not ready: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield proc
    finally:
        stop(proc)


def complete(n_predict: int = 16, prompt: str = PROMPT) -> dict:
    import httpx

    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "cache_prompt": False,
        "ignore_eos": True,
        "return_tokens": True,
    }
    response = httpx.post(f"http://127.0.0.1:{LEADER_PORT}/completion", json=body, timeout=300)
    response.raise_for_status()
    return response.json()


def buffer_lines(log: Path) -> list[str]:
    return [
        line.strip()
        for line in log.read_text(errors="replace").splitlines()
        if "buffer size" in line or "offloaded" in line or ("layer" in line and "assigned" in line)
    ]


# ------------------------------------------------------------------------------------------ experiments


STRANGER = r"""
import socket, struct, sys, time
host, port, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t0 = time.monotonic()
s = socket.create_connection((host, port), timeout=5)
print("connected", round(time.monotonic() - t0, 3), flush=True)
s.settimeout(hold)
s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
try:
    data = s.recv(64)
    print("hello-reply", round(time.monotonic() - t0, 3), data[:12].hex(), flush=True)
    time.sleep(hold)  # keep the connection (and with it the server) for the rest of `hold`
except socket.timeout:
    print("no-reply-within", hold, flush=True)
"""


def exp_stranger(h2: str, h3: str, a2: str) -> None:
    import httpx

    def stranger(hold_s: float) -> list[str]:
        done = subprocess.run(
            netns(h3, sys.executable, "-c", STRANGER, a2, str(RPC_PORT), str(hold_s)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        return [line for line in (done.stdout + done.stderr).splitlines() if line][-2:]

    log = WORK / "stranger-rpc.log"
    with rpc_server(h2, a2, log) as server:
        # A stranger alone gets the full protocol: HELLO answered with the version (7.0.0).
        report("stranger_alone", stranger(3))
        accepted_before = log.read_text().count("Accepted client connection")
        rss_idle = rss_kib(server.pid)
        with leader(WORK / "tiny4-f16.gguf", WORK / "stranger-leader.log", "--rpc", f"{a2}:{RPC_PORT}", "-ngl", "99"):
            rss_loaded = rss_kib(server.pid)
            connections = log.read_text().count("Accepted client connection") - accepted_before
            # While the leader is connected: the stranger's TCP connect succeeds (listen backlog) but nothing answers.
            report("stranger_while_leader_connected", stranger(5))
            report("leader_still_serves", complete(8)["content"])
        time.sleep(1.5)
        report("leader_connections_during_start_and_serve", connections)
        report(
            "rpc_server_after_leader_left",
            {
                "rss_kib": {
                    "idle": rss_idle,
                    "leader_loaded_tiny4": rss_loaded,
                    "after_disconnect": rss_kib(server.pid) if server.poll() is None else None,
                },
                "exit_code": server.poll(),
                "log_tail": log.read_text().splitlines()[-3:],
            },
        )
    # A stranger holding the port BEFORE the leader starts: the leader blocks in its HELLO.
    with rpc_server(h2, a2, WORK / "stranger-first-rpc.log") as server:
        rss = {"idle": rss_kib(server.pid)}
        with leader(WORK / "tiny4-f16.gguf", WORK / "rss-leader.log", "--rpc", f"{a2}:{RPC_PORT}", "-ngl", "99"):
            complete(8)
            rss["leader_loaded_tiny4"] = rss_kib(server.pid)
        time.sleep(1)
        rss["after_leader_left"] = rss_kib(server.pid)
        report("rpc_server_rss_kib_without_strangers", rss)
        held = subprocess.Popen(
            netns(h3, sys.executable, "-c", STRANGER, a2, str(RPC_PORT), "15"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(0.5)
        t0 = time.monotonic()
        log2 = WORK / "stranger-first-leader.log"
        with open(log2, "wb") as out2:
            lead = subprocess.Popen(
                leader_command(WORK / "tiny4-f16.gguf", "--rpc", f"{a2}:{RPC_PORT}", "-ngl", "99"),
                cwd=BUILD,
                stdout=out2,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        ready_at = None
        while time.monotonic() - t0 < 40 and lead.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{LEADER_PORT}/health", timeout=1).status_code == 200:
                    ready_at = round(time.monotonic() - t0, 2)
                    break
            time.sleep(0.2)
        stranger_out, _ = held.communicate(timeout=30)
        report(
            "stranger_first_then_leader",
            {
                "leader_ready_after_s": ready_at,
                "stranger": stranger_out.splitlines(),
                "leader_exit": lead.poll(),
                "rpc_server_exit": server.poll(),
            },
        )
        stop(lead)


def exp_split(h2: str, h3: str, a2: str, a3: str) -> None:
    tiny = WORK / "tiny4-f16.gguf"
    with leader(tiny, WORK / "single.log"):
        single = complete(16)
    report("single_tokens", {"tokens": single["tokens"], "content": single["content"]})
    rpc = f"{a2}:{RPC_PORT},{a3}:{RPC_PORT}"
    variants = {
        "default_ngl_auto": [],
        "ngl99": ["-ngl", "99"],
        "ngl5_ts_2_3": ["-ngl", "5", "-ts", "2,3"],
        "ngl5_ts_1_4": ["-ngl", "5", "-ts", "1,4"],
        "ngl3_ts_1_1": ["-ngl", "3", "-ts", "1,1"],
    }
    for name, args in variants.items():
        with rpc_server(h2, a2, WORK / f"split-{name}-h2.log"), rpc_server(h3, a3, WORK / f"split-{name}-h3.log"):
            log = WORK / f"split-{name}.log"
            with leader(tiny, log, "--rpc", rpc, "-v", *args):
                got = complete(16)
            report(
                f"split_{name}",
                {
                    "args": args,
                    "buffers": [
                        line
                        for line in buffer_lines(log)
                        if "assigned" in line or "buffer" in line or "offloaded" in line
                    ][:20],
                    "tokens_equal_single": got["tokens"] == single["tokens"],
                    "tokens": got["tokens"],
                },
            )


def exp_cache(h2: str, h3: str, a2: str, a3: str) -> None:
    import shutil

    rpc = f"{a2}:{RPC_PORT},{a3}:{RPC_PORT}"
    for model in ("mid4-f16", "mid4-q4_0"):
        caches = {h2: WORK / f"cache-{model}-h2", h3: WORK / f"cache-{model}-h3"}
        for path in caches.values():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
        runs = []
        for start in (1, 2):
            with (
                rpc_server(h2, a2, WORK / f"cache-{model}-{start}-h2.log", caches[h2]),
                rpc_server(h3, a3, WORK / f"cache-{model}-{start}-h3.log", caches[h3]),
            ):
                before = {ns: counters(ns) for ns in caches}
                t0 = time.monotonic()
                log = WORK / f"cache-{model}-{start}.log"
                with leader(WORK / f"{model}.gguf", log, "--rpc", rpc, "-ngl", "99", "--no-warmup"):
                    load_s = round(time.monotonic() - t0, 2)
                    after = {ns: counters(ns) for ns in caches}
            runs.append(
                {
                    "start": start,
                    "load_s": load_s,
                    "to_helper_bytes": {ns[-2:]: after[ns][0] - before[ns][0] for ns in caches},
                    "from_helper_bytes": {ns[-2:]: after[ns][1] - before[ns][1] for ns in caches},
                    "cache_files": {
                        ns[-2:]: sorted((p.name, p.stat().st_size) for p in caches[ns].iterdir()) for ns in caches
                    },
                    "buffers": [line for line in buffer_lines(log) if "buffer size" in line],
                }
            )
        report(f"cache_{model}", runs)
    # The cache key: FNV-1a 64 over the tensor's bytes as stored in the GGUF file.
    report("cache_key_check", prefill_names(WORK / "mid4-f16.gguf"))


def prefill_names(model: Path, threshold: int = 10 * 1024 * 1024) -> dict[str, str]:
    """{tensor name: the cache file name a helper's rpc-server -c would look up for it} for every tensor over the
    threshold, computed from the GGUF alone."""
    import gguf

    fnv = _fnv_fast()
    reader = gguf.GGUFReader(model)
    names = {}
    for tensor in reader.tensors:
        data = bytes(tensor.data.tobytes())
        if len(data) > threshold:
            names[tensor.name] = f"{fnv(data):016x}"
    return names


def _fnv_fast():
    """FNV-1a 64 through a tiny C function compiled with cc (Python is too slow for 100 MB)."""
    import ctypes
    import tempfile

    src = (
        "#include <stdint.h>\n#include <stddef.h>\n"
        "uint64_t fnv(const uint8_t*d,size_t n){uint64_t h=0xcbf29ce484222325ULL;"
        "for(size_t i=0;i<n;i++){h^=d[i];h*=0x100000001b3ULL;}return h;}\n"
    )
    tmp = Path(tempfile.mkdtemp())
    (tmp / "fnv.c").write_text(src)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp / "fnv.so"), str(tmp / "fnv.c")], check=True)
    lib = ctypes.CDLL(str(tmp / "fnv.so"))
    lib.fnv.restype = ctypes.c_uint64
    lib.fnv.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return lambda data: lib.fnv(data, len(data))


def exp_decode(h2: str, h3: str, a2: str, a3: str) -> None:
    rpc = f"{a2}:{RPC_PORT},{a3}:{RPC_PORT}"
    for model in ("tiny4-f16", "mid4-f16"):
        with rpc_server(h2, a2, WORK / f"decode-{model}-h2.log"), rpc_server(h3, a3, WORK / f"decode-{model}-h3.log"):
            with leader(WORK / f"{model}.gguf", WORK / f"decode-{model}.log", "--rpc", rpc, "-ngl", "99"):
                complete(4)
                per = {}
                for n in (16, 80):
                    before = {ns: counters(ns) for ns in (h2, h3)}
                    out = complete(n)
                    after = {ns: counters(ns) for ns in (h2, h3)}
                    per[n] = {ns[-2:]: (after[ns][0] - before[ns][0], after[ns][1] - before[ns][1]) for ns in (h2, h3)}
                    per[n]["predicted"] = out["timings"]["predicted_n"]
                    per[n]["prompt_n"] = out["timings"]["prompt_n"]
        per_token = {
            ns: {
                "to_helper_bytes_per_token": round((per[80][ns][0] - per[16][ns][0]) / 64),
                "from_helper_bytes_per_token": round((per[80][ns][1] - per[16][ns][1]) / 64),
            }
            for ns in ("h2", "h3")
        }
        report(f"decode_traffic_{model}", {"raw": per, "per_token": per_token})


def stream_until_fault(fault, n_predict: int = 200, give_up_s: float = 90) -> dict:
    """Stream a /completion; after 5 tokens run `fault()`; report when the client saw what."""
    import httpx

    body = {
        "prompt": PROMPT,
        "n_predict": n_predict,
        "temperature": 0,
        "cache_prompt": False,
        "ignore_eos": True,
        "stream": True,
    }
    events = 0
    t_fault = None
    outcome = "stream ended normally"
    last = ""
    try:
        with httpx.stream(
            "POST", f"http://127.0.0.1:{LEADER_PORT}/completion", json=body, timeout=httpx.Timeout(give_up_s)
        ) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    if line.strip():
                        last = line[:300]
                    continue
                events += 1
                last = line[:300]
                if events == 5 and t_fault is None:
                    fault()
                    t_fault = time.monotonic()
    except httpx.ReadTimeout:
        outcome = f"no byte for {give_up_s} s (read timeout)"
    except httpx.HTTPError as error:
        outcome = f"{type(error).__name__}: {error}"
    seen_after = round(time.monotonic() - t_fault, 2) if t_fault else None
    return {"events": events, "outcome": outcome, "client_saw_end_after_fault_s": seen_after, "last_line": last}


def exp_faults(h2: str, h3: str, a2: str, a3: str, switch: str) -> None:
    import httpx

    rpc = f"{a2}:{RPC_PORT},{a3}:{RPC_PORT}"
    model = WORK / "mid4-f16.gguf"
    # 1. kill -9 the helper h3 mid-stream.
    with rpc_server(h2, a2, WORK / "fault-kill-h2.log"), rpc_server(h3, a3, WORK / "fault-kill-h3.log") as victim:
        log = WORK / "fault-kill-leader.log"
        with leader(model, log, "--rpc", rpc, "-ngl", "99") as lead:
            result = stream_until_fault(lambda: os.kill(victim.pid, signal.SIGKILL))
            t0 = time.monotonic()
            with contextlib.suppress(subprocess.TimeoutExpired):
                lead.wait(20)
            result["leader_exit_code"] = lead.poll()
            result["leader_exit_after_client_end_s"] = (
                round(time.monotonic() - t0, 2) if lead.poll() is not None else None
            )
            result["leader_log_tail"] = log.read_text(errors="replace").splitlines()[-6:]
    report("fault_kill9_helper", result)
    # 2. unplug h3's cable mid-stream (its veth on the bridge down) for OUTAGE_S, then plug it back. llama-server's
    # SSE ping (every 30 s) keeps the client's read timeout from firing, so the outage is ended by a timer.
    outage: dict[str, object] = {}

    def link(state: str) -> None:
        subprocess.run(["ip", "-n", switch, "link", "set", "h3", state], check=True)

    def plug_back() -> None:
        with contextlib.suppress(httpx.HTTPError):
            outage["health_during_outage"] = httpx.get(f"http://127.0.0.1:{LEADER_PORT}/health", timeout=3).status_code
        conns = subprocess.run(["ss", "-tnoi", "dst", f"{a3}:{RPC_PORT}"], capture_output=True, text=True).stdout
        outage["leader_socket_to_h3_during_outage"] = " ".join(conns.split())[:300]
        link("up")
        outage["link_up_at"] = time.monotonic()

    def unplug() -> None:
        link("down")
        outage["down_at"] = time.monotonic()
        threading.Timer(OUTAGE_S, plug_back).start()

    with rpc_server(h2, a2, WORK / "fault-down-h2.log"), rpc_server(h3, a3, WORK / "fault-down-h3.log"):
        log = WORK / "fault-down-leader.log"
        with leader(model, log, "--rpc", rpc, "-ngl", "99") as lead:
            result = stream_until_fault(unplug, give_up_s=OUTAGE_S + 60)
            ended = time.monotonic()
            result["outage_s"] = OUTAGE_S
            result.update({k: v for k, v in outage.items() if not k.endswith("_at")})
            if "link_up_at" in outage:
                result["stream_end_after_link_up_s"] = round(ended - float(outage["link_up_at"]), 2)  # type: ignore[arg-type]
            result["leader_exit_code"] = lead.poll()
            result["leader_log_tail"] = log.read_text(errors="replace").splitlines()[-3:]
    report("fault_veth_down_helper", result)


def exp_throughput(h2: str, h3: str, a2: str, a3: str) -> None:
    rpc = f"{a2}:{RPC_PORT},{a3}:{RPC_PORT}"
    demo = None
    with contextlib.suppress(Exception):
        from _common import demo_gguf

        demo = demo_gguf()
    models = [WORK / "tiny4-f16.gguf", WORK / "mid4-f16.gguf"] + ([demo] if demo else [])
    for model in models:
        row = {}
        for threads in ("1", "2"):
            with leader(model, WORK / f"tp-single-{model.stem}.log", "-t", threads):
                complete(8)
                runs = [complete(64)["timings"]["predicted_per_second"] for _ in range(3)]
            row[f"single_t{threads}"] = round(max(runs), 1)
        with rpc_server(h2, a2, WORK / "tp-h2.log"), rpc_server(h3, a3, WORK / "tp-h3.log"):
            with leader(model, WORK / f"tp-split-{model.stem}.log", "--rpc", rpc, "-ngl", "99"):
                complete(8)
                runs = [complete(64)["timings"]["predicted_per_second"] for _ in range(3)]
            row["split_2_helpers_t1_each"] = round(max(runs), 1)
        report(f"throughput_{model.stem}", row)


# ---------------------------------------------------------------------------------------------- driver


def inside(args: list[str]) -> None:
    h2, h3, a2, a3, switch = (os.environ[k] for k in ("RP_H2", "RP_H3", "RP_A2", "RP_A3", "RP_SWITCH"))
    chosen = args or list(EXPERIMENTS)
    for name in chosen:
        try:
            if name == "stranger":
                exp_stranger(h2, h3, a2)
            elif name == "split":
                exp_split(h2, h3, a2, a3)
            elif name == "cache":
                exp_cache(h2, h3, a2, a3)
            elif name == "decode":
                exp_decode(h2, h3, a2, a3)
            elif name == "faults":
                exp_faults(h2, h3, a2, a3, switch)
            elif name == "throughput":
                exp_throughput(h2, h3, a2, a3)
        except Exception as error:  # keep going: one experiment's failure should not hide the others'
            report(f"{name}_error", f"{type(error).__name__}: {error}")
    out = WORK / "results.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    old.update(results)
    out.write_text(json.dumps(old, indent=1))


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--inside":
        inside(args[1:])
        return
    if "models" in args or not args:
        make_models()
    args = [a for a in args if a != "models"]
    if not args and len(sys.argv) > 1:
        return
    from helpers.netns import lan

    with lan(3, prefix="rpcp") as network:
        h1, h2, h3 = network.hosts
        env = dict(
            os.environ, RP_H2=h2.name, RP_H3=h3.name, RP_A2=h2.address, RP_A3=h3.address, RP_SWITCH=network.switch
        )
        subprocess.run(["ip", "netns", "exec", h1.name, sys.executable, __file__, "--inside", *args], env=env)


if __name__ == "__main__":
    main()
