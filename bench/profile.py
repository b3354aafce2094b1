"""Where a runner's time goes under load: py-spy samples the leader runner of `jetshard up` while `--streams`
concurrent chats keep it busy, and the functions that hold the most samples are printed, by their own time and
with what they call.

    uv run --group dev --with py-spy python bench/profile.py [--streams 8] [--seconds 30] [--max-tokens 64]

py-spy (on PyPI) samples from outside the process, so the runner runs as it always does; it needs ptrace (root,
or kernel.yama.ptrace_scope 0). Only threads holding the GIL or running native code count (idle waits do not).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from _common import DEMO, concurrent_streams, fresh_prompts, jetshard_up, runner_pids


def keep_busy(api: str, streams: int, max_tokens: int, stop: threading.Event) -> None:
    rng = random.Random(1)
    while not stop.is_set():
        asyncio.run(concurrent_streams(f"{api}/v1", DEMO, fresh_prompts(streams, rng), max_tokens))


def _short(frame: str) -> str:
    """`name (path/file.py:12)` as `name (file.py)`: one function, whichever line of it was running."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':', 1)[0].rstrip(')')})" if where else name


def top_frames(collapsed: str, limit: int) -> tuple[int, list[tuple[str, int, int]]]:
    """From py-spy's collapsed stacks: the total samples, and the `limit` functions with the most samples of
    their own, each with (own, inclusive) samples."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        total += samples
        frames = [_short(frame) for frame in stack.split(";")]
        if frames:
            own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    return total, [(frame, samples, inclusive[frame]) for frame, samples in own.most_common(limit)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit(
            "py-spy is not installed: run this with `uv run --group dev --with py-spy python bench/profile.py`"
        )

    root = Path(tempfile.mkdtemp(prefix="jetshard-profile-"))
    with jetshard_up(root, DEMO) as (api, up):
        [runner, *_] = runner_pids(up.pid)
        stop = threading.Event()
        load = threading.Thread(target=keep_busy, args=(api, args.streams, args.max_tokens, stop))
        load.start()
        time.sleep(5)  # the batch fills first
        out = root / "profile.txt"
        try:
            record = ["record", "--pid", str(runner), "--duration", str(args.seconds), "--rate", "100"]
            record += ["--format", "raw", "--output", str(out), "--nonblocking"]
            subprocess.run([py_spy, *record], check=True, capture_output=True)
        finally:
            stop.set()
            load.join()
    total, rows = top_frames(out.read_text(), args.top)
    print(f"runner pid {runner}, {args.streams} streams, {args.seconds} s: {total} samples (100 Hz, all threads)")
    print("| function | own % | with callees % |")
    print("| --- | ---: | ---: |")
    for frame, samples, inclusive in rows:
        print(f"| `{frame}` | {100 * samples / total:.1f} | {100 * inclusive / total:.1f} |")


if __name__ == "__main__":
    main()
