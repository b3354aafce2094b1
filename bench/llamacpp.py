"""jetshard on its llama.cpp engine against upstream `llama-server` from the same build: same GGUF, same load.

Two sides, both started for each model, loaded in turn (never both at once): every round runs on one side then the
other, the order swapped each round, so a drift in the machine's speed weighs on both alike:
  * llama-server: the `llama-server` of the build `jetshard engines status` names, on 127.0.0.1 and a free port,
    `--slots` slots over `--ctx-size` tokens of context (by default what jetshard gives its slots; its other
    settings its defaults: threads, batch sizes, samplers, the CPU variant ggml picks);
  * jetshard: `jetshard up --offline --no-model` in a temporary directory, the GGUF imported (`jetshard models
    import-gguf`; the demo is built in), then placed with `POST /instances` and `"engine": "llama.cpp"`; the
    bench stops with the API's answer if the cluster cannot place it on llama.cpp.
Load: 1, 4 and 8 concurrent streams (`--streams`), `--rounds` rounds each, every request a fresh chat (its own
random system line first, so no two requests share more than the chat template's first tokens: nothing for a
prompt cache), streamed through the official `openai` client at temperature 0 with `max_tokens` 32 and, on
llama-server, `ignore_eos` (jetshard's dialects have no such field: its tokens are counted from the usage it
sends). Figures: TTFT p50 (request sent -> first content chunk); output tok/s (every token of a round over the
round's whole time, first request sent to last token: vLLM's serving benchmark's output throughput), the goal's
tokens/s; and, beside it, the ratio of the decode rates (tokens after each stream's first, over the time from the
round's first first-token to its last token; bench/_common.py `figures`). The decode rate moves with the order the
streams got their first token in: a stream that gets its answer started alone, a moment before the others are
prefilled together, starts that span early and counts its head start as slowness.

Models: `demo` (SmolLM2-135M-Instruct Q4_1, the GGUF the demo ships), `1b-q4_0` and `1b-q4_k_m` (a
Llama-3.2-1B-shaped model with random weights, made by bench/gguf_models.py on first use and cached).
Goal (issue 36): jetshard >= 0.9x llama-server's tok/s and <= 1.2x its TTFT, at 1 and at 8 streams.
The load average before and after each side is printed: figures taken while something else ran mean little.

    uv run --group dev python bench/llamacpp.py                                      # both sides, all three models
    uv run --group dev python bench/llamacpp.py --sides llama-server --models demo   # the anchor alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from _common import (
    DEMO,
    WORDS,
    Figures,
    Messages,
    concurrent_streams,
    demo_gguf,
    figures,
    free_port,
    jetshard_env,
    jetshard_up,
    machine_line,
    ms,
    stop_group,
    table,
    wait,
)
from gguf_models import llama_1b_ggufs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.gguf_models import file_type_of

SIDES = ("llama-server", "jetshard")
TOK_S_GOAL = 0.9
TTFT_GOAL = 1.2
GOAL_STREAMS = (1, 8)
LLAMA_CPP = "llama.cpp"
SERVER_TIMEOUT_S = 600
SLOT_CONTEXT = 4096
"""The context jetshard gives one llama-server slot, for a model whose own is longer (README, the llama.cpp engine:
"at most 4096 tokens a slot"): the anchor's by default."""


@dataclass(frozen=True)
class BenchModel:
    name: str
    path: Callable[[], Path]
    """The GGUF file, made on first use."""
    jetshard_id: str
    """The model id jetshard serves it as: the demo's, or the id it is imported under."""
    built_in: bool = False


MODELS = {
    "demo": BenchModel("demo", demo_gguf, DEMO, built_in=True),
    "1b-q4_0": BenchModel("1b-q4_0", lambda: llama_1b_ggufs(["Q4_0"])["Q4_0"], "local/llama-3.2-1b-shape-Q4_0"),
    "1b-q4_k_m": BenchModel(
        "1b-q4_k_m", lambda: llama_1b_ggufs(["Q4_K_M"])["Q4_K_M"], "local/llama-3.2-1b-shape-Q4_K_M"
    ),
}


@dataclass(frozen=True)
class LlamaCppBuild:
    """The llama.cpp build jetshard's workers run on this machine, as `jetshard engines status` names it; its
    executables run from `root`, as jetshard runs them (ggml looks for its CPU variants in the current directory
    too)."""

    llama_server: Path

    @property
    def root(self) -> Path:
        return self.llama_server.parent.parent

    @property
    def rpc_server(self) -> Path:
        return self.llama_server.parent / "ggml-rpc-server"


def llama_cpp_build() -> LlamaCppBuild:
    done = subprocess.run(
        [sys.executable, "-m", "jetshard", "engines", "status", "--json"], capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"`jetshard engines status` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    [engine] = [e for e in json.loads(done.stdout) if e["engine"] == LLAMA_CPP]
    if not engine["ready"]:
        sys.exit("no llama.cpp build passed its probe here: run `jetshard engines build llama.cpp` first")
    return LlamaCppBuild(Path(engine["llama_server"]))


def start(command: Sequence[str], log: Path, env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen:
    """`command` in a process group of its own (so that `stop_group` ends it and all it started), output to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(  # type: ignore[call-overload]
            list(command), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, **popen
        )


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def flag(command: Sequence[str], name: str) -> str:
    return command[command.index(name) + 1]


@contextlib.contextmanager
def llama_server(
    build: LlamaCppBuild, arguments: list[str], log: Path, name: str
) -> Iterator[tuple[Side, subprocess.Popen]]:
    """`arguments` (a llama-server command line on 127.0.0.1) run from the build's root; yields its side and
    process once it has loaded its model."""
    port = int(flag(arguments, "--port"))
    process = start(arguments, log, cwd=build.root)

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{tail(log)}")
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200

    try:
        wait(healthy, SERVER_TIMEOUT_S, f"{name} loading its model")
        yield Side(name, f"http://127.0.0.1:{port}/v1", "default", {"ignore_eos": True}), process
    finally:
        stop_group(process, sig=signal.SIGTERM, grace_s=10)


Cases = dict[int, list[list[Messages]]]
"""Per number of concurrent streams, its rounds, each the prompts sent at once."""


def unique_chats(n: int, rng: random.Random) -> list[Messages]:
    """`n` chats that differ from their first token on: a random system line, then a story to write."""
    chats = []
    for _ in range(n):
        system = f"{rng.randrange(10**9)} {' '.join(rng.choices(WORDS, k=6))}: you are a storyteller."
        topic = " ".join(rng.choices(WORDS, k=rng.randint(6, 12)))
        chats.append(
            [{"role": "system", "content": system}, {"role": "user", "content": f"Write a story about {topic}."}]
        )
    return chats


@dataclass(frozen=True)
class Side:
    """One server under load: where its OpenAI routes are, the model name it takes, what every request adds."""

    name: str
    base_url: str
    model: str
    extra_body: dict | None


def measure(sides: Sequence[Side], cases: Cases, max_tokens: int) -> dict[str, dict[int, Figures]]:
    """Every round of `cases` on each side in turn, the order swapped every round: both sides see the machine as it
    is at that moment, so a drift in its speed (another job, the CPU's clock) weighs on both alike."""
    warm = [{"role": "user", "content": "Say hello."}]
    for side in sides:
        asyncio.run(concurrent_streams(side.base_url, side.model, [warm], 4, 0.0, side.extra_body))
    runs: dict[str, dict[int, list]] = {side.name: {n: [] for n in cases} for side in sides}
    for streams, rounds in cases.items():
        for i, prompts in enumerate(rounds):
            for side in sides if i % 2 == 0 else list(reversed(sides)):
                run = asyncio.run(
                    concurrent_streams(side.base_url, side.model, prompts, max_tokens, 0.0, side.extra_body)
                )
                runs[side.name][streams].append(run)
    return {name: {n: figures(r) for n, r in per.items()} for name, per in runs.items()}


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def _server_facts(pid: int, log: Path) -> str:
    """The CPU variant llama-server mapped (ggml picks one of the build's at start) and its threads (its log)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        maps = ""
    variants = sorted({Path(line.split()[-1]).name for line in maps.splitlines() if "libggml-cpu" in line})
    threads = re.findall(r"n_threads = (\d+)", log.read_text(errors="replace"))
    return f"CPU backend {', '.join(variants) or '?'}, threads {threads[-1] if threads else '?'}"


@contextlib.contextmanager
def anchor_side(model: BenchModel, path: Path, args: argparse.Namespace, root: Path) -> Iterator[Side]:
    log = root / f"llama-server-{model.name}.log"
    server_args = ["-c", str(args.ctx_size), "-np", str(args.slots)]
    print(f"llama-server {' '.join(server_args)} on {path.name}; {load_line()}", flush=True)
    build = llama_cpp_build()
    command = [str(build.llama_server), "--model", str(path), "--host", "127.0.0.1", "--port", str(free_port())]
    with llama_server(build, [*command, *server_args], log, "llama-server") as (side, server):
        yield side
        print(f"  llama-server: {_server_facts(server.pid, log)}", flush=True)


def _cli(root: Path, api: str, group: str, *arguments: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "jetshard", group, "--api", api, *arguments],
        env=jetshard_env(root),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"`jetshard {group} {' '.join(arguments)}` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )


def place_on_llama_cpp(api: str, model_id: str, timeout_s: float, node_ids: Sequence[str] | None = None) -> dict:
    """Place `model_id` with `"engine": "llama.cpp"` (over exactly `node_ids` in that order, the first the leader,
    when given), wait until ready; the instance. Raises with the API's answer when it cannot be placed so."""
    body: dict[str, object] = {"model_id": model_id, "engine": LLAMA_CPP}
    if node_ids is not None:
        body["node_ids"] = list(node_ids)
    placed = httpx.post(f"{api}/instances", json=body, timeout=60)
    if placed.status_code >= 400:
        raise RuntimeError(
            f"jetshard cannot place {model_id} on the {LLAMA_CPP} engine: POST /instances {body} answered "
            f"{placed.status_code} {placed.text}"
        )
    instance = placed.json()
    url = f"{api}/instances/{instance['instance_id']}"

    def ready() -> bool:
        nonlocal instance
        instance = httpx.get(url, timeout=10).json()
        if instance["status"] == "failed":
            raise RuntimeError(f"{model_id} failed on the {LLAMA_CPP} engine: {instance.get('reason')}")
        return bool(instance["status"] == "ready")

    wait(ready, timeout_s, f"{model_id} ready on {LLAMA_CPP}", interval=0.5)
    engine = instance.get("serving", {}).get("engine")
    shards = [s["node_id"] for s in instance["shards"]]
    if engine != LLAMA_CPP or (node_ids is not None and shards != list(node_ids)):
        raise RuntimeError(f"jetshard placed {model_id} on engine {engine!r} over {shards}, not as {body}")
    return instance


@contextlib.contextmanager
def jetshard_side(model: BenchModel, path: Path, args: argparse.Namespace, root: Path) -> Iterator[Side]:
    home = root / f"jetshard-{model.name}"
    print(f"jetshard: `jetshard up --no-model`, {model.jetshard_id} on {LLAMA_CPP}; {load_line()}", flush=True)
    with jetshard_up(home, None) as (api, _):
        if not model.built_in:
            _cli(home, api, "models", "import-gguf", str(path), "--id", model.jetshard_id)
        instance = place_on_llama_cpp(api, model.jetshard_id, args.ready_timeout)
        print(f"  placed: serving {instance['serving']}", flush=True)
        yield Side("jetshard", f"{api}/v1", model.jetshard_id, None)


def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs and ours == ours and theirs == theirs else "-"


def report(results: dict[tuple[str, str], dict[int, Figures]], models: Sequence[str], streams: Sequence[int]) -> None:
    rows = []
    verdicts = []
    for name in models:
        anchor, ours = results.get((name, "llama-server")), results.get((name, "jetshard"))
        for n in streams:
            a, j = (anchor or {}).get(n), (ours or {}).get(n)
            rows.append(
                [
                    name,
                    str(n),
                    f"{a.output_tok_s:.1f}" if a else "-",
                    f"{j.output_tok_s:.1f}" if j else "-",
                    ratio(j.output_tok_s, a.output_tok_s) if a and j else "-",
                    ratio(j.decode_tok_s, a.decode_tok_s) if a and j else "-",
                    ms(a.ttft_p50) if a else "-",
                    ms(j.ttft_p50) if j else "-",
                    ratio(j.ttft_p50, a.ttft_p50) if a and j else "-",
                ]
            )
            if a and j and n in GOAL_STREAMS:
                met = j.output_tok_s >= TOK_S_GOAL * a.output_tok_s and j.ttft_p50 <= TTFT_GOAL * a.ttft_p50
                verdicts.append(f"{name} at {n} stream(s): {'met' if met else 'NOT met'}")
    header = [
        "model",
        "streams",
        "llama-server output tok/s",
        "jetshard output tok/s",
        f"ratio (goal >= {TOK_S_GOAL})",
        "decode tok/s ratio",
        "llama-server TTFT p50 ms",
        "jetshard TTFT p50 ms",
        f"TTFT ratio (goal <= {TTFT_GOAL})",
    ]
    print()
    print(table(header, rows))
    if verdicts:
        print()
        print("goal (jetshard >= 0.9x tok/s and <= 1.2x TTFT of llama-server):")
        for line in verdicts:
            print(f"  {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--streams", default="1,4,8", help="comma-separated numbers of concurrent streams")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each number of streams")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each answer has")
    parser.add_argument("--slots", type=int, default=8, help="llama-server's slots (-np)")
    parser.add_argument(
        "--ctx-size",
        type=int,
        help="llama-server's context over all slots (-c) [default: what jetshard gives its slots, "
        f"--slots x {SLOT_CONTEXT}]",
    )
    parser.add_argument("--ready-timeout", type=float, default=1800, help="seconds jetshard's instance may take")
    parser.add_argument("--work-dir", type=Path, help="keep logs and jetshard's directories here")
    args = parser.parse_args()
    args.ctx_size = args.ctx_size or args.slots * SLOT_CONTEXT
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    streams = [int(s) for s in args.streams.split(",")]
    if unknown := [m for m in models if m not in MODELS] + [s for s in sides if s not in SIDES]:
        parser.error(f"unknown model(s) or side(s): {', '.join(unknown)}")

    root = args.work_dir or Path(tempfile.mkdtemp(prefix="jetshard-llamacpp-"))
    root.mkdir(parents=True, exist_ok=True)
    print(machine_line())
    print(
        f"llama.cpp build: {llama_cpp_build().root}; max_tokens {args.max_tokens}, temperature 0, rounds {args.rounds}"
    )
    rng = random.Random(time.time_ns())
    results: dict[tuple[str, str], dict[int, Figures]] = {}
    started = time.monotonic()
    failed: str | None = None
    for name in models:
        model = MODELS[name]
        path = model.path()
        print(f"\n{name}: {path} ({file_type_of(path)}, {path.stat().st_size / 2**20:.0f} MiB)", flush=True)
        # The same fresh prompts for both sides: neither has seen them.
        cases = {n: [unique_chats(n, rng) for _ in range(args.rounds)] for n in streams}
        with contextlib.ExitStack() as servers:
            started_sides = []
            for side in sides:
                if side == "jetshard" and failed is not None:
                    continue
                start = anchor_side if side == "llama-server" else jetshard_side
                try:
                    started_sides.append(servers.enter_context(start(model, path, args, root)))
                except RuntimeError as error:
                    if side != "jetshard":
                        raise
                    # The anchor's figures still print; the other models are not tried on a cluster that cannot.
                    failed = f"{error}\n(the jetshard side was not run from {name} on; its logs are in {root})"
                    print(f"  jetshard FAILED: {error}", flush=True)
            for side_name, measured in measure(started_sides, cases, args.max_tokens).items():
                results[name, side_name] = measured
            print(f"  measured; {load_line()}", flush=True)
    report(results, models, streams)
    print(f"\nelapsed {time.monotonic() - started:.0f} s")
    if failed is not None:
        sys.exit(f"\njetshard side: {failed}")
    if not args.work_dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
