"""One upstream `llama-server` for one instance: on loopback, behind a key only its runner knows, dying with its
runner. The runner streams from it; llama.cpp batches, samples, follows grammars and caches prompts."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import secrets
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from jetshard_bus.lifeline import lifeline_command
from jetshard_bus.procs import describe_exit
from jetshard_schema.types import Drafting, KvCacheType

HEALTH_POLL_S = 0.1
NGRAM_LOOKUP = ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "4", "--spec-ngram-map-k-size-m", "16")
"""Prompt lookup drafts up to 16 tokens after the last 4, as they most often followed them before (llama.cpp's
`ngram-map-k`). Measured with bench/drafting.py on the demo (2-core x86): 2.07x on a code edit and 0.96x on
free-form text; `ngram-simple` (the latest occurrence) kept too few drafts to pay (1.18x, and 0.99x with 3 and 8);
llama.cpp's default lengths (12 and 48) found almost nothing to draft in a code edit."""
STOP_GRACE_S = 5.0
UNRESPONSIVE_S = 30.0
"""A loaded llama-server that answers no health check for this long is hung or stopped (a frozen process, a
machine swapping it out): it is killed, so its instance restarts instead of its tasks waiting forever. Its HTTP
threads answer `/health` while its slots compute, so a busy server is not taken for a hung one."""
WATCH_INTERVAL_S = 5.0


class ServerDied(RuntimeError):
    """llama-server exited; the message says how and quotes the end of its output."""


TELLING_LINE = re.compile(r"error loading model|GGML_ASSERT|what\(\):|parsing error|error:", re.IGNORECASE)
"""llama.cpp's lines that say why it stopped: a model it could not load (the line after it only says that it
exits), a failed assertion, an uncaught exception (`std::bad_alloc`), a chat template it could not parse."""
FAILED_LINE = re.compile(r"error|failed", re.IGNORECASE)
LOG_PREFIX = re.compile(r"^[\d.]+ [A-Z] ")
"""llama.cpp's time and level before each line it logs."""


class OutputTail:
    """What a server writes (its stdout and stderr, through one pipe), passed on to the runner's own output (its
    log) line by line, the last lines kept, so that the reason of a server that stopped is quoted where the runner
    reports it. Read on a thread of its own: a runner busy elsewhere never holds the server up on a full pipe."""

    def __init__(self, keep_lines: int = 200) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=keep_lines)

    def open(self) -> int:
        """The pipe's writing end, for the server; `close_writer` once the server holds it."""
        read_fd, self._write_fd = os.pipe()
        threading.Thread(target=self._pass_on, args=(read_fd,), name="server output", daemon=True).start()
        return self._write_fd

    def _pass_on(self, read_fd: int) -> None:
        with open(read_fd, "rb") as pipe:
            for line in pipe:
                os.write(2, line)  # the runner's own output, its log, whatever Python's sys.stderr is meanwhile
                self._lines.append(" ".join(line.decode(errors="replace").split()))

    def close_writer(self) -> None:
        """The reading then ends where the server's output does."""
        os.close(self._write_fd)

    def reason(self) -> str:
        """The last two lines that say why the server stopped ("" where none does): a template that failed says
        where in one line and what in the next."""
        lines = [LOG_PREFIX.sub("", line) for line in self._lines]
        for pattern in (TELLING_LINE, FAILED_LINE):
            telling = list(dict.fromkeys(line for line in lines if pattern.search(line)))
            if telling:
                return " | ".join(telling[-2:])[:400]
        return ""

    def quoted(self, message: str) -> str:
        """`message`, with the reason the server gave where it gave one."""
        reason = self.reason()
        return f"{message}: {reason}" if reason else message


@dataclass(frozen=True)
class ServerSettings:
    """How the runner starts llama-server for its instance."""

    binary: Path
    working_dir: Path
    """Where it runs: ggml loads CPU variant libraries from the working directory too, so never one that holds
    some (the build's root holds none; its `bin/` holds them all, probed or not)."""
    model: Path
    slots: int
    """Tasks decoding together (`serving.max_batch`): llama.cpp's parallel slots."""
    context_per_slot: int
    prompt_cache_bytes: int = 0
    """Prompts llama.cpp keeps beyond its slots for later requests that start alike (`serving.prefix_cache_bytes`,
    as placement counts it); 0 keeps none."""
    kv_cache_type: KvCacheType = KvCacheType.AUTO
    """What llama.cpp stores keys and values as (`serving.kv_cache_type`; auto: its f16)."""
    draft: str | None = None
    """How it drafts tokens (`serving.draft`): ngram, or with the model in `draft_model`."""
    draft_model: Path | None = None
    """The GGUF of the model that drafts, when `draft` names one."""
    threads: int | None = None
    """None: llama.cpp's own choice (the machine's physical cores)."""
    mmproj: Path | None = None
    embeddings: bool = False
    """Serve embeddings only (`--embeddings`: llama-server then serves nothing else): the mean of the final norm's
    outputs over the prompt, L2-normalised, as the MLX engine makes them. A prompt's embedding is made in one
    physical batch, so the batch is a whole slot's context."""

    memory_limit_bytes: int | None = None
    """The heap and other private memory it may grow to (`lifeline_command`'s `data_limit_bytes`; the model's weights,
    mapped read-only, do not count): what placement counted for the instance and some room, so that a runaway
    (a model's chat template that builds gigabytes as it is loaded) fails its own start instead of the machine."""

    rpc_servers: tuple[str, ...] = ()
    """Across nodes: where this node reaches each other rank's `ggml-rpc-server`, in rank order (`host:port`, the
    local ends of the instance's tunnels)."""
    helper_layers: tuple[int, ...] = ()
    """How many layers each of those ranks holds, in the same order; this node holds the first layers."""

    def arguments(self, port: int) -> list[str]:
        arguments = [
            str(self.binary),
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--parallel",
            str(self.slots),
            "--ctx-size",
            str(self.context_per_slot * self.slots),
            "--cache-ram",
            str(self.prompt_cache_bytes // 2**20),
            "--jinja",
            "--no-webui",
            "--metrics",
        ]
        if self.kv_cache_type is not KvCacheType.AUTO:
            # A quantized V cache needs flash attention, which llama.cpp's "auto" may leave off.
            arguments += ["--cache-type-k", self.kv_cache_type, "--cache-type-v", self.kv_cache_type]
            arguments += ["--flash-attn", "on"]
        if self.draft == Drafting.NGRAM:
            arguments += list(NGRAM_LOOKUP)
        if self.draft_model is not None:
            # The draft runs here, on this node's CPU, never on the other ranks' (RPC) devices: each of its steps
            # would cross the network. Its KV cache is stored as the model's.
            arguments += [
                "--spec-type",
                "draft-simple",
                "--model-draft",
                str(self.draft_model),
                "--device-draft",
                "none",
            ]
            if self.kv_cache_type is not KvCacheType.AUTO:
                arguments += ["--cache-type-k-draft", self.kv_cache_type, "--cache-type-v-draft", self.kv_cache_type]
        if self.rpc_servers:
            arguments += ["--rpc", ",".join(self.rpc_servers), *offload_arguments(self.helper_layers)]
        if self.threads is not None:
            arguments += ["--threads", str(self.threads)]
        if self.mmproj is not None:
            arguments += ["--mmproj", str(self.mmproj)]
        if self.embeddings:
            batch = str(self.context_per_slot)
            arguments += ["--embeddings", "--pooling", "mean", "--embd-normalize", "2"]
            arguments += ["--batch-size", batch, "--ubatch-size", batch]
        return arguments


def offload_arguments(helper_layers: Sequence[int]) -> list[str]:
    """llama-server's flags that put exactly `helper_layers[i]` layers on the i-th `--rpc` server, the rest on this
    node. llama.cpp offloads the *last* `--n-gpu-layers` of its layers plus the output layer, to its offload
    devices in `--rpc` order, each taking a `--tensor-split` share: with the counts themselves as shares (the last
    helper's one more, for the output layer) every helper gets exactly its count, and the token embedding and the
    first layers stay here (measured in bench/RPC_FACTS.md, section 2)."""
    if not helper_layers or min(helper_layers) < 1:
        raise ValueError(f"each helper must hold at least one layer, got {list(helper_layers)}")
    shares = [*helper_layers[:-1], helper_layers[-1] + 1]
    return ["--n-gpu-layers", str(sum(shares)), "--tensor-split", ",".join(map(str, shares))]


class LlamaServer:
    """A running llama-server: `start`, stream from `url` with `headers`, `stop`."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._key = secrets.token_urlsafe(32)
        self.port = 0
        self._process: asyncio.subprocess.Process | None = None
        self._output = OutputTail()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}"}

    def client(self) -> httpx.AsyncClient:
        """A client for its requests: streams wait as long as generation takes; connecting does not.

        It keeps no idle connection. llama-server closes the connection after every streamed answer (its stream ends
        by telling cpp-httplib there is nothing more, which cpp-httplib takes for a cancelled write), so a kept one
        is one the server is closing: the next request, sent as a slot frees, went out on it and failed with "Server
        disconnected without sending a response" (24 of 300 back-to-back streams here). A new loopback connection
        costs about 0.1 ms."""
        return httpx.AsyncClient(
            base_url=self.url,
            headers=self.headers,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    async def start(self, timeout_s: float) -> None:
        """Start it and wait until it has loaded the model (`/health` answers 200; 503 while loading)."""
        self.port = free_port()
        command = self.settings.arguments(self.port)
        # The kernel kills it when the runner dies, however the runner dies: a llama-server of a dead runner would
        # hold the model's memory with no one to serve.
        command = lifeline_command(command, signal.SIGKILL, data_limit_bytes=self.settings.memory_limit_bytes)
        # The key goes in the environment, never on a command line that `ps` shows to every user.
        environment = {**os.environ, "LLAMA_API_KEY": self._key}
        output = self._output.open()
        try:
            self._process = await asyncio.create_subprocess_exec(
                *command,
                env=environment,
                cwd=self.settings.working_dir,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=output,
                stderr=output,
            )
        finally:
            self._output.close_writer()
        async with httpx.AsyncClient(timeout=2.0) as client:

            async def healthy() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.get(f"{self.url}/health", headers=self.headers)
                    return response.status_code == 200
                return False

            try:
                await wait_until_ready(
                    self._process,
                    healthy,
                    timeout_s,
                    name="llama-server",
                    stage="while loading the model",
                    late=f"llama-server did not load the model within {timeout_s:.0f} s",
                )
            except ServerDied as died:
                raise ServerDied(self._output.quoted(str(died))) from None

    async def template_takes_tools(self) -> bool:
        """Whether the model's chat template renders tools, as llama-server read it from the GGUF."""
        async with httpx.AsyncClient(timeout=10.0) as client:
            response = await client.get(f"{self.url}/props", headers=self.headers)
            response.raise_for_status()
            return bool(response.json().get("chat_template_caps", {}).get("supports_tools"))

    async def vocabulary_size(self) -> int:
        """The model's token ids, 0 to this less one, as llama-server read them from the GGUF."""
        async with httpx.AsyncClient(timeout=10.0) as client:
            response = await client.get(f"{self.url}/v1/models", headers=self.headers)
            response.raise_for_status()
            return int(response.json()["data"][0]["meta"]["n_vocab"])

    @property
    def exited(self) -> bool:
        return self._process is None or self._process.returncode is not None

    async def watch(self, unresponsive_s: float = UNRESPONSIVE_S) -> str:
        """Return how the loaded server ended: it exited, or it answered no `/health` for `unresponsive_s`
        (then it is killed first)."""
        process = self._process
        assert process is not None
        interval_s = min(WATCH_INTERVAL_S, unresponsive_s / 3)
        answered_at = time.monotonic()
        async with httpx.AsyncClient(timeout=interval_s, headers=self.headers) as client:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), interval_s)
                if process.returncode is not None:
                    return self._output.quoted(f"llama-server {describe_exit(process.returncode)}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        answered_at = time.monotonic()
                if time.monotonic() - answered_at > unresponsive_s:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
                    return f"llama-server answered no health check for {unresponsive_s:g} s (hung or stopped): killed"

    async def stop(self) -> None:
        await stop_process(self._process)


async def wait_until_ready(
    process: asyncio.subprocess.Process,
    ready: Callable[[], Awaitable[bool]],
    timeout_s: float,
    *,
    name: str,
    stage: str,
    late: str,
) -> None:
    """Ask `ready` every `HEALTH_POLL_S` until it says yes. Raises `ServerDied` saying how `name` ended `stage`
    ("while loading the model"), where the process exits first, or `late`, where `timeout_s` pass first (the
    process stopped)."""
    deadline = time.monotonic() + timeout_s
    while not await ready():
        if process.returncode is not None:
            raise ServerDied(f"{name} {describe_exit(process.returncode)} {stage}")
        if time.monotonic() > deadline:
            await stop_process(process)
            raise ServerDied(late)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), HEALTH_POLL_S)


async def stop_process(process: asyncio.subprocess.Process | None) -> None:
    """Ask a server to stop (SIGTERM), and kill it if it has not within `STOP_GRACE_S`."""
    if process is None or process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), STOP_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


def free_port() -> int:
    """A loopback port free now, for a llama-server to bind. It binds the port itself: the window in which another
    process could take it is the few milliseconds before it starts, and a port taken meanwhile fails the start,
    which its caller retries (an instance restarts; a probe is run again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
