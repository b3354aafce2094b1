"""Speculative decoding (`serving.draft`): one stream's tokens/s with drafting and without, on a repetitive prompt
(a code edit, whose answer repeats its prompt) and a free-form one, through jetshard and beside the engine it wraps:
upstream `llama-server` drafting with the same flags on the same GGUF, or with `--engine mlx` `mlx_lm.server` on the
same MLX directory (mlx-lm has no prompt lookup: drafting by ngram, its figure is without drafting).

Drafting is by prompt lookup (`"ngram"`) unless `--draft-gguf PATH` names a smaller GGUF of the demo's tokenizer:
jetshard then imports it (`POST /models/import`) and drafts with it (`"draft": "local/bench-draft"`), and so does
the engine's own server (mlx_lm.server `--draft-model` on the directory jetshard converted it into). Without such a
file here, `--draft-gguf` of the demo's own GGUF checks the path end to end (every draft is kept, but a draft as
large as its model cannot pay).

Four sides, each alone on the machine in turn, every request a fresh chat at temperature 0 (greedy: drafting must
give the same text, and the bench says where it does not):
  * llama-server, and llama-server drafting with the flags jetshard's own llama-server was started with (read from
    its command line): the build `jetshard engines status` names, one slot;
  * jetshard, and jetshard with the demo placed with `"serving": {"draft": ...}`: `jetshard up --offline
    --no-model` in a temporary directory, the demo placed on the engine with `POST /instances`.
With `--engine mlx`: jetshard's MLX runner without and with drafting, and `mlx_lm.server` on the directory jetshard
converted the demo into, without drafting and (with `--draft-gguf`) drafting with the same draft model.
Figure: completion tokens over the request's whole time (non-streamed), the best of `--rounds`.
Goals (issue 39): drafting >= 1.5x without on the code edit, >= 0.95x on the free-form prompt; jetshard's drafting
>= 0.9x the engine's own server's (by prompt lookup on MLX, >= 0.9x mlx_lm.server's, which does not draft by lookup).

    uv run --group dev python bench/drafting.py [--engine mlx] [--draft-gguf PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from _common import (
    DEMO,
    demo_gguf,
    free_port,
    jetshard_up,
    machine_line,
    mlx_lm_server,
    mlx_only_env,
    model_directory,
    table,
)
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
DRAFT_ID = "local/bench-draft"
DRAFTING_FLAGS = ("--spec", "--model-draft", "--device-draft", "--cache-type-k-draft", "--cache-type-v-draft")
"""The llama-server flags that say how it drafts, as jetshard's runner writes them."""


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
    name = "llama-server" + (" drafting" if drafting else "")
    with llama_server(build, arguments, root / f"{name}.log", name) as (side, _):
        return {kind: tokens_per_s(side.base_url, side.model, p, max_tokens, rounds) for kind, p in PROMPTS.items()}


def drafting_flags() -> list[str]:
    """The drafting flags (and their values) of the llama-server jetshard runs on this machine (one instance at a
    time here)."""
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if command and command[0].endswith("llama-server") and "--spec-type" in command:
            flags: list[str] = []
            for part in command[command.index("--spec-type") :]:
                if part.startswith("--") and not part.startswith(DRAFTING_FLAGS):
                    break
                flags.append(part)
            return flags
    raise SystemExit("jetshard's llama-server was not started with --spec-type")


def import_draft(api: str, path: Path) -> None:
    """`path` imported on this machine's node as DRAFT_ID, as a user imports a GGUF file."""
    (node,) = httpx.get(f"{api}/nodes", timeout=10).json()
    body = {"node_id": node["node_id"], "model_id": DRAFT_ID, "path": str(path.resolve())}
    imported = httpx.post(f"{api}/models/import", json=body, timeout=600)
    if imported.status_code != 201:
        raise SystemExit(f"jetshard cannot import {path}: {imported.status_code} {imported.text}")


def mlx_upstream(
    model_dir: Path, draft_dir: Path | None, root: Path, max_tokens: int, rounds: int
) -> dict[str, tuple[float, str]]:
    """mlx_lm.server's figures, drafting with the model in `draft_dir` where one is given (as many tokens a step as
    jetshard's MLX runner: mlx_lm.server's default, 3)."""
    drafting = [] if draft_dir is None else ["--draft-model", str(draft_dir)]
    name = "mlx_lm_server" + ("_drafting" if drafting else "")
    with mlx_lm_server(model_dir, {}, root / f"{name}.log", *drafting) as (url, _):
        return {kind: tokens_per_s(f"{url}/v1", "default_model", p, max_tokens, rounds) for kind, p in PROMPTS.items()}


def jetshard(
    api: str, engine: str, draft: str | None, max_tokens: int, rounds: int
) -> tuple[dict[str, tuple[float, str]], list[str]]:
    """Its figures on `engine` with `serving.draft` set to `draft`, and the drafting flags its llama-server was
    started with (none without drafting, or on MLX)."""
    serving = {"draft": draft} if draft else {}
    body = {"model_id": DEMO, "engine": engine, "serving": serving}
    placed = httpx.post(f"{api}/instances", json=body, timeout=60)
    if placed.status_code != 201:
        raise SystemExit(f"jetshard cannot place {DEMO} on {engine}: {placed.status_code} {placed.text}")
    instance = f"{api}/instances/{placed.json()['instance_id']}"
    try:
        while httpx.get(instance, timeout=10).json()["status"] != "ready":
            time.sleep(0.2)
        flags = drafting_flags() if draft and engine == "llama.cpp" else []
        return {kind: tokens_per_s(f"{api}/v1", DEMO, p, max_tokens, rounds) for kind, p in PROMPTS.items()}, flags
    finally:
        httpx.delete(instance, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft-gguf", type=Path, help="draft with this GGUF (the demo's tokenizer), not by ngram")
    parser.add_argument("--engine", choices=("llama.cpp", "mlx"), default="llama.cpp")
    args = parser.parse_args()
    print(machine_line())
    mode = "ngram" if args.draft_gguf is None else "draft model"
    with tempfile.TemporaryDirectory(prefix="jetshard-drafting-") as tmp:
        root = Path(tmp)
        env = mlx_only_env(root) if args.engine == "mlx" else None
        with jetshard_up(root / "jetshard", None, env=env) as (api, _):
            if args.draft_gguf is not None:
                import_draft(api, args.draft_gguf)
            plain, _ = jetshard(api, args.engine, None, args.max_tokens, args.rounds)
            draft = "ngram" if mode == "ngram" else DRAFT_ID
            drafted, flags = jetshard(api, args.engine, draft, args.max_tokens, args.rounds)
        if args.engine == "mlx":
            models = root / "jetshard" / "models"
            mlx_dir = model_directory(models, DEMO)
            results = {"mlx_lm.server": mlx_upstream(mlx_dir, None, root, args.max_tokens, args.rounds)}
            anchor_side = "mlx_lm.server"
            if args.draft_gguf is not None:
                draft_dir = model_directory(models, DRAFT_ID)  # as jetshard converted it for MLX
                anchor_side = "mlx_lm.server draft model"
                results[anchor_side] = mlx_upstream(mlx_dir, draft_dir, root, args.max_tokens, args.rounds)
        else:
            print(f"drafting flags: {' '.join(flags)}")
            results = {
                "llama-server": upstream(root, [], args.max_tokens, args.rounds),
                f"llama-server {mode}": upstream(root, flags, args.max_tokens, args.rounds),
            }
            anchor_side = f"llama-server {mode}"
        results.update({"jetshard": plain, f"jetshard {mode}": drafted})
    rows = []
    for kind in PROMPTS:
        without, drafting = results["jetshard"][kind], results[f"jetshard {mode}"][kind]
        anchor = results[anchor_side][kind]
        speedup, of_upstream = drafting[0] / without[0], drafting[0] / anchor[0]
        rows.append(
            [
                kind,
                *(f"{results[side][kind][0]:.1f}" for side in results),
                f"{speedup:.2f}x (goal {SPEEDUP_GOAL[kind]}x)",
                f"{of_upstream:.2f}x (goal {UPSTREAM_GOAL}x)",
                "yes" if drafting[1] == without[1] else "NO",
            ]
        )
    header = ["prompt", *(f"{side} tok/s" for side in results), "drafting / not", f"of {anchor_side}'s", "same text"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
