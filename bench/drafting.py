"""Speculative decoding by prompt lookup (`serving.draft: "ngram"`) on the llama.cpp engine: one stream's tokens/s
with drafting and without, on a repetitive prompt (a code edit, whose answer repeats its prompt) and a free-form
one, through jetshard and beside upstream `llama-server` drafting with the same flags, on the same GGUF.

Four sides, each alone on the machine in turn, every request a fresh chat at temperature 0 (greedy: drafting must
give the same text, and the bench says where it does not):
  * llama-server, and llama-server drafting with the flags jetshard's own llama-server was started with (read from
    its command line): the build `jetshard engines status` names, one slot;
  * jetshard, and jetshard with the demo placed with `"serving": {"draft": "ngram"}`: `jetshard up --offline
    --no-model` in a temporary directory, the demo placed on llama.cpp with `POST /instances`.
Figure: completion tokens over the request's whole time (non-streamed), the best of `--rounds`.
Goals (issue 39): drafting >= 1.5x without on the code edit, >= 0.95x on the free-form prompt; jetshard's drafting
>= 0.9x llama-server's own.

    uv run --group dev python bench/drafting.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from _common import DEMO, demo_gguf, free_port, jetshard_up, machine_line, table
from llamacpp import SLOT_CONTEXT, llama_cpp_build, llama_server

CODE = "\n\n".join(
    f"def {name}(a, b):\n    total = a {sign} b\n    return total"
    for name, sign in (("add", "+"), ("subtract", "-"), ("multiply", "*"), ("divide", "/"), ("power", "**"))
)
PROMPTS = {
    "code edit": f"Repeat this code exactly, with `total` renamed to `result`:\n\n{CODE}\n",
    "free-form": "Write a story about a dragon who learns to cook.",
}
SPEEDUP_GOAL = {"code edit": 1.5, "free-form": 0.95}
UPSTREAM_GOAL = 0.9


def tokens_per_s(base_url: str, model: str, prompt: str, max_tokens: int, rounds: int) -> tuple[float, str]:
    """The best of `rounds` greedy answers' tokens/s, and the answer's text."""
    best, text = 0.0, ""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    for _ in range(rounds):
        started = time.monotonic()
        response = httpx.post(f"{base_url}/chat/completions", json={**body, "temperature": 0}, timeout=600)
        response.raise_for_status()
        answer = response.json()
        best = max(best, answer["usage"]["completion_tokens"] / (time.monotonic() - started))
        text = answer["choices"][0]["message"]["content"]
    return best, text


def upstream(root: Path, drafting: list[str], max_tokens: int, rounds: int) -> dict[str, tuple[float, str]]:
    build = llama_cpp_build()
    port = free_port()
    arguments = [str(build.llama_server), "--model", str(demo_gguf()), "--host", "127.0.0.1", "--port", str(port)]
    arguments += ["--parallel", "1", "--ctx-size", str(SLOT_CONTEXT), "--jinja", "--no-webui"]
    arguments += drafting
    name = "llama-server" + (" (ngram)" if drafting else "")
    with llama_server(build, arguments, root / f"{name}.log", name) as (side, _):
        return {kind: tokens_per_s(side.base_url, side.model, p, max_tokens, rounds) for kind, p in PROMPTS.items()}


def drafting_flags() -> list[str]:
    """The `--spec-*` flags of the llama-server jetshard runs on this machine (one instance at a time here)."""
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if command and command[0].endswith("llama-server") and "--spec-type" in command:
            start = command.index("--spec-type")
            return [part for part in command[start:] if part.startswith("--spec") or not part.startswith("--")]
    raise SystemExit("jetshard's llama-server was not started with --spec-type")


def jetshard(api: str, draft: bool, max_tokens: int, rounds: int) -> tuple[dict[str, tuple[float, str]], list[str]]:
    """Its figures, and the drafting flags its llama-server was started with (none without drafting)."""
    serving = {"draft": "ngram"} if draft else {}
    body = {"model_id": DEMO, "engine": "llama.cpp", "serving": serving}
    placed = httpx.post(f"{api}/instances", json=body, timeout=60)
    if placed.status_code != 201:
        raise SystemExit(f"jetshard cannot place {DEMO} on llama.cpp: {placed.status_code} {placed.text}")
    instance = f"{api}/instances/{placed.json()['instance_id']}"
    try:
        while httpx.get(instance, timeout=10).json()["status"] != "ready":
            time.sleep(0.2)
        flags = drafting_flags() if draft else []
        return {kind: tokens_per_s(f"{api}/v1", DEMO, p, max_tokens, rounds) for kind, p in PROMPTS.items()}, flags
    finally:
        httpx.delete(instance, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="jetshard-drafting-") as tmp:
        root = Path(tmp)
        with jetshard_up(root / "jetshard", None) as (api, _):
            plain, _ = jetshard(api, False, args.max_tokens, args.rounds)
            drafted, flags = jetshard(api, True, args.max_tokens, args.rounds)
        print(f"drafting flags: {' '.join(flags)}")
        results = {
            "llama-server": upstream(root, [], args.max_tokens, args.rounds),
            "llama-server ngram": upstream(root, flags, args.max_tokens, args.rounds),
            "jetshard": plain,
            "jetshard ngram": drafted,
        }
    rows = []
    for kind in PROMPTS:
        plain, drafted = results["jetshard"][kind], results["jetshard ngram"][kind]
        anchor = results["llama-server ngram"][kind]
        speedup, of_upstream = drafted[0] / plain[0], drafted[0] / anchor[0]
        rows.append(
            [
                kind,
                *(f"{results[side][kind][0]:.1f}" for side in results),
                f"{speedup:.2f}x (goal {SPEEDUP_GOAL[kind]}x)",
                f"{of_upstream:.2f}x (goal {UPSTREAM_GOAL}x)",
                "yes" if drafted[1] == plain[1] else "NO",
            ]
        )
    header = ["prompt", *(f"{side} tok/s" for side in results), "drafting / not", "of llama-server's", "same text"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
