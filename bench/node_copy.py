"""Node-to-node model copy throughput: the downloader's file server and copy client vs curl (issue 38; root only).

    uv run --group dev python bench/node_copy.py [--size-mb N] [--rounds 3] [--no-raw]

Two network-namespace hosts on one bridge (`tests/helpers/netns.py`), every veth end (each host's `eth0` and its
port in the switch namespace) limited to 1 Gbit/s on egress with `tc qdisc ... tbf rate 1gbit burst 1mb latency
50ms`, so the file crosses two shaped hops in each direction, as through a gigabit switch.

* **jetshard copy**: host A runs the real `file_server.FileServer` (mutual TLS 1.3, fresh `PeerIdentity` for A and
  for B, each admitting only the other's certificate) over a model directory holding one `model.gguf` of
  `--size-mb` random bytes and its `.jetshard-manifest.json`; host B runs the real copy client
  (`peer_copy.fetch_manifest` + `peer_copy.copy_files`): the manifest, the file into a partial file, fsync, sha256
  against the manifest, the rename into the model directory and B's manifest. Timed from before the manifest request
  to `copy_files` returning (the file verified and in place on B); the wire phase (until the last byte) and the
  verification (hash, fsyncs, rename) are also printed.
* **anchor**: `curl -o <file on B's disk>` of the same file from a plain HTTP/1.1 server on A: a small Python server
  in this file that sends the body with `os.sendfile` (no busybox or nginx on the machine; `python -m http.server`
  copies through Python). It is not the bottleneck: the unshaped run shows it far above the link rate.

Best of `--rounds` runs each (the order alternates each round), rates in MB/s (10^6 bytes/s), and the ratio
jetshard/curl; the goal is >= 0.9x on the shaped link. Then the same without the shaper (the raw veth), as
information: there the CPU (TLS and Python on either side) is the limit, not the link. CPU seconds of the server and
of the client per copy are printed as well. The namespaces, processes and temporary files (about 3x the file size
at most, under $TMPDIR) are removed at the end, on error and on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jetshard_bus.tls_identity import PeerIdentity

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MODEL_ID = "bench/node-copy"
FILE_NAME = "model.gguf"
JETSHARD_PORT = 8471
PLAIN_PORT = 8472
SHAPE = ("tbf", "rate", "1gbit", "burst", "1mb", "latency", "50ms")
MB = 1_000_000


# ------------------------------------------------------------------------------------------ inside the hosts


def identity(work: Path, name: str) -> PeerIdentity:
    from jetshard_bus.tls_identity import PeerIdentity

    certificate = work / "ids" / f"{name}.crt"
    return PeerIdentity(certificate.read_text(), certificate, work / "ids" / f"{name}.key")


def serve_jetshard(work: Path, address: str) -> None:
    """Host A: the downloader's file server over A's models directory, admitting B's certificate alone."""
    from jetshard_downloader.dirs import ModelDirs
    from jetshard_downloader.file_server import FileServer

    models = work / "a"
    server = FileServer(ModelDirs(default_dir=models, writable=(models,), read_only=()), identity(work, "node-a"))
    server.admit({identity(work, "node-b").certificate_pem})

    async def run() -> None:
        await server.start(address, JETSHARD_PORT)
        await asyncio.Event().wait()

    asyncio.run(run())


def serve_plain(path: Path, address: str) -> None:
    """Host A: the anchor's HTTP/1.1 server: any GET gets `path` whole, the body sent by `os.sendfile`."""
    size = path.stat().st_size
    listener = socket.create_server((address, PLAIN_PORT), backlog=16)

    def handle(conn: socket.socket) -> None:
        with conn, open(path, "rb") as f:
            request = b""
            while b"\r\n\r\n" not in request:
                data = conn.recv(4096)
                if not data:
                    return
                request += data
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n"
            conn.sendall(head.encode("ascii"))
            sent = 0
            while sent < size:
                n = os.sendfile(conn.fileno(), f.fileno(), sent, size - sent)
                if n == 0:
                    return
                sent += n

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def copy(work: Path, address: str) -> None:
    """Host B: one copy by the downloader's copy client into a fresh model directory; prints its timings as JSON."""
    from jetshard_bus.tls_identity import client_context
    from jetshard_downloader.peer_copy import copy_files, fetch_manifest
    from jetshard_downloader.peers import PeerSource
    from jetshard_schema.ids import ModelId, NodeId

    target = work / "b" / "bench--node-copy"
    shutil.rmtree(target, ignore_errors=True)
    node_a = identity(work, "node-a")
    context = client_context(identity(work, "node-b"), node_a.certificate_pem)
    source = PeerSource(NodeId("node-a"), address, JETSHARD_PORT, node_a.certificate_pem)
    wire_done = 0.0

    def on_progress(done: int, total: int) -> None:
        nonlocal wire_done
        if done == total and not wire_done:
            wire_done = time.perf_counter()

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    manifest = fetch_manifest(source, context, ModelId(MODEL_ID))
    written = copy_files(source, context, manifest, target, [FILE_NAME], on_progress=on_progress)
    end = time.perf_counter()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    assert written.files[0].sha256 == manifest.files[0].sha256
    assert (target / FILE_NAME).stat().st_size == manifest.files[0].size
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    timing = {"total_s": end - start, "wire_s": wire_done - start, "client_cpu_s": cpu}
    print(json.dumps(timing), flush=True)
    shutil.rmtree(target)


# ---------------------------------------------------------------------------------------------- outside


def make_source(work: Path, size_mb: int) -> int:
    """A's model directory: `model.gguf` of random bytes and the manifest naming its size and sha256."""
    from jetshard_downloader.manifest import Manifest, ManifestFile, write_manifest

    model_dir = work / "a" / "bench--node-copy"
    model_dir.mkdir(parents=True)
    digest = hashlib.sha256()
    block = os.urandom(4 * 1024 * 1024)
    size = size_mb * MB
    with open(model_dir / FILE_NAME, "wb") as f:
        written = 0
        while written < size:
            chunk = block[: size - written]
            # Every block differs (a counter in front), so nothing along the way could compress or dedupe it.
            chunk = written.to_bytes(8, "little") + chunk[8:] if len(chunk) > 8 else chunk
            f.write(chunk)
            digest.update(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    manifest = Manifest(model_id=MODEL_ID, revision="bench", files=(ManifestFile(FILE_NAME, size, digest.hexdigest()),))
    write_manifest(model_dir, manifest)
    return size


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_listening(host, port: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if host.run(["ss", "-Hltn", f"sport = :{port}"]).stdout.strip():
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {host.name}:{port}")


def shape(network, on: bool) -> None:
    """Every veth end (both directions of each host's link) limited to 1 Gbit/s, or the limit removed."""
    for host in network.hosts:
        for namespace, device in ((host.name, "eth0"), (network.switch, host.veth)):
            verb = ["replace", "dev", device, "root", *SHAPE] if on else ["del", "dev", device, "root"]
            result = subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", *verb], capture_output=True)
            if on and result.returncode != 0:
                raise RuntimeError(f"tc on {namespace}/{device}: {result.stderr.decode().strip()}")


def measure(network, work: Path, size: int, rounds: int, server_pid: int, label: str) -> dict[str, float]:
    a, b = network.hosts
    best: dict[str, float] = {}
    curl_file = work / "b" / "curl.bin"
    for round_number in range(rounds):
        order = ("jetshard", "curl") if round_number % 2 == 0 else ("curl", "jetshard")
        for what in order:
            if what == "jetshard":
                cpu0 = cpu_seconds(server_pid)
                result = b.run([sys.executable, __file__, "--copy", str(work), a.address], timeout_s=600)
                if result.returncode != 0:
                    raise RuntimeError(f"the copy failed: {result.stdout}{result.stderr}")
                timing = json.loads(result.stdout.strip().splitlines()[-1])
                server_cpu = cpu_seconds(server_pid) - cpu0
                rate = size / timing["total_s"] / MB
                print(
                    f"  [{label}] round {round_number + 1} jetshard: {rate:7.1f} MB/s  ({timing['total_s']:.2f} s: "
                    f"wire {timing['wire_s']:.2f} s = {size / timing['wire_s'] / MB:.1f} MB/s, verify and place "
                    f"{timing['total_s'] - timing['wire_s']:.2f} s (the sha256 is taken as the bytes arrive); "
                    f"CPU server {server_cpu:.2f} s, client "
                    f"{timing['client_cpu_s']:.2f} s)",
                    flush=True,
                )
                if rate > best.get("jetshard", 0):
                    best.update(
                        jetshard=rate,
                        wire=size / timing["wire_s"] / MB,
                        verify_s=timing["total_s"] - timing["wire_s"],
                        server_cpu=server_cpu / timing["wire_s"],
                        client_cpu=timing["client_cpu_s"] / timing["total_s"],
                    )
            else:
                url = f"http://{a.address}:{PLAIN_PORT}/{FILE_NAME}"
                args = ["curl", "-sS", "-o", str(curl_file), "-w", "%{time_total} %{size_download}", url]
                result = b.run(args, timeout_s=600)
                if result.returncode != 0:
                    raise RuntimeError(f"curl failed: {result.stderr}")
                seconds, got = result.stdout.split()
                if int(got) != size:
                    raise RuntimeError(f"curl got {got} bytes of {size}")
                fsync_start = time.perf_counter()  # what jetshard's fsync costs on top, for comparison (not timed)
                with open(curl_file, "rb") as f:
                    os.fsync(f.fileno())
                fsync_s = time.perf_counter() - fsync_start
                curl_file.unlink()
                rate = size / float(seconds) / MB
                print(
                    f"  [{label}] round {round_number + 1} curl:     {rate:7.1f} MB/s  ({float(seconds):.2f} s; "
                    f"an fsync of its file after it: {fsync_s:.2f} s)",
                    flush=True,
                )
                best["curl"] = max(best.get("curl", 0), rate)
    print(
        f"{label}: jetshard {best['jetshard']:.1f} MB/s (wire {best['wire']:.1f} MB/s, verify and place "
        f"{best['verify_s']:.2f} s), curl {best['curl']:.1f} MB/s, ratio jetshard/curl "
        f"{best['jetshard'] / best['curl']:.2f}x (wire only {best['wire'] / best['curl']:.2f}x); "
        f"CPU: server {100 * best['server_cpu']:.0f} %, client {100 * best['client_cpu']:.0f} % of one core",
        flush=True,
    )
    return best


def run(args: argparse.Namespace) -> None:
    from helpers.netns import lan
    from jetshard_bus.tls_identity import PeerIdentity

    if shutil.which("tc") is None:
        raise SystemExit("`tc` is missing: apt-get install -y iproute2")
    load = os.getloadavg()
    busy = subprocess.run(["pgrep", "-fa", "pytest"], capture_output=True, text=True).stdout.strip()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; pytest running: {'yes' if busy else 'no'}")
    work = Path(tempfile.mkdtemp(prefix="jetshard-node-copy-"))
    try:
        started = time.perf_counter()
        size = make_source(work, args.size_mb)
        (work / "b").mkdir()
        for name in ("node-a", "node-b"):  # fresh identities, as each downloader session makes
            PeerIdentity.create(work / "ids", name)
        print(f"source: {size / MB:.0f} MB of random bytes in {time.perf_counter() - started:.1f} s", flush=True)
        source = work / "a" / "bench--node-copy" / FILE_NAME
        with lan(2, prefix="ncp") as network:
            a, _ = network.hosts
            jetshard = a.popen([sys.executable, __file__, "--serve-jetshard", str(work), a.address], work / "fs.log")
            plain = a.popen([sys.executable, __file__, "--serve-plain", str(source), a.address], work / "plain.log")
            wait_listening(a, JETSHARD_PORT)
            wait_listening(a, PLAIN_PORT)
            shape(network, True)
            shaped = measure(network, work, size, args.rounds, jetshard.pid, "1 Gbit/s")
            raw = None
            if not args.no_raw:
                shape(network, False)
                raw = measure(network, work, size, args.rounds, jetshard.pid, "raw veth")
            for proc in (jetshard, plain):
                if proc.poll() is not None:
                    raise RuntimeError(f"a server died: see {work}/*.log")
        print(
            f"ratio jetshard/curl at 1 Gbit/s: {shaped['jetshard'] / shaped['curl']:.2f}x (goal >= 0.90x)"
            + (f"; raw veth: {raw['jetshard'] / raw['curl']:.2f}x" if raw else "")
            + f"; elapsed {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="the file's size in MB (10^6 bytes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-raw", action="store_true", help="skip the unshaped run")
    parser.add_argument("--serve-jetshard", nargs=2, metavar=("WORK", "ADDRESS"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-plain", nargs=2, metavar=("FILE", "ADDRESS"), help=argparse.SUPPRESS)
    parser.add_argument("--copy", nargs=2, metavar=("WORK", "ADDRESS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_jetshard:
        serve_jetshard(Path(args.serve_jetshard[0]), args.serve_jetshard[1])
    elif args.serve_plain:
        serve_plain(Path(args.serve_plain[0]), args.serve_plain[1])
    elif args.copy:
        copy(Path(args.copy[0]), args.copy[1])
    else:
        if os.geteuid() != 0:
            raise SystemExit("root only: it makes network namespaces")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind (and clean up) on SIGTERM as on Ctrl-C
        run(args)


if __name__ == "__main__":
    main()
