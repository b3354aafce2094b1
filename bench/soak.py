"""A fault soak: `jetshard up` on this machine under 8 concurrent streaming chats while its processes are killed.

It starts a cluster with `jetshard up` (a temporary HOME, XDG, TMPDIR and data directory, free loopback ports,
the demo model from its PyPI package, offline) and waits for the model. Then, for a baseline and for each fault
in turn (`--faults`: the runner, the worker, the downloader, the sequencer, the API, nats-server), 8 clients
stream chats one after another (`/v1/chat/completions`, stream=true, `--max-tokens` 32, httpx); once every
chat has its first token the process is killed with SIGKILL (found by its command line in the process tree
of `jetshard up`, whose supervisor restarts what dies), and from then a probe sends short chats (4 tokens,
retrying every 0.25 s; the clients retry every 1 s; `jetshard up` runs with max_batch 9 so it never queues
behind them) until one is answered. Then the load pauses: the requests sent before the kill are waited for
(until they end or are hung); of those sent after it, one that had a token in the last 5 s is closed (the
API must cancel its task), the others are waited for too.

One row per fault, each request counted under the fault it was sent after:
  * answered (a finish reason came); ended with a clear error (an HTTP error status, an SSE error event, or
    the connection failing); hung (60 s without a token or an end, +5 s for the API's own 60 s limit on a
    silent runner to come first; or no end within 300 s); silently truncated (the stream ended cleanly with
    neither a finish reason nor an error); closed at the pause (counted in none of those);
  * served again: seconds from the kill to the first token of a chat sent after it and answered (the
    baseline's figure, measured the same way with no kill, is what the load alone costs); beside it, not a
    goal, ready again: when the API last turned to answering with every instance ready (what the cluster
    took, without the queue of retried chats the probe waits behind);
  * left behind, once the load has paused and State has had up to 30 s to settle: tasks in State (no
    client waits for any), instances not ready, services not running, runners beyond the instances' shards
    or outside the tree of `jetshard up`.
The anchor is the goals, printed beside the figures: 0 hung, 0 silently truncated, nothing left behind,
served again within 15 s (30 s for nats-server). It exits 1 if a goal is missed, and then prints the
instances' statuses after that fault and the cluster's log lines that look like trouble (and keeps its
directory, runners' logs included).

The run takes about `--duration-s` (startup included, split evenly between the rows; each fault's window
lasts at least its goal + 15 s); every wait has its own cap, so a cluster that never recovers still ends a
few minutes after it. Every process it started is killed on the way out, Ctrl-C included. On a 2-core
machine without a fast BLAS one round of 8 chats of 32 tokens takes about a minute, and a row (the load
starting, the window, the pause) at least about 100 s: all six faults take about 12 minutes even when
`--duration-s` is 600.

    python3 -m uv run --group dev python bench/soak.py --duration-s 600
    python3 -m uv run --group dev python bench/soak.py --duration-s 150 --faults runner,api   # while developing
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
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from _common import DEMO, fresh_prompts, jetshard_up, machine_line, table

FAULTS = ("runner", "worker", "downloader", "sequencer", "api", "nats-server")
SERVICES = ("sequencer", "api", "worker", "downloader")
"""The services `jetshard up` starts as `python -m jetshard NAME`."""
CLIENTS = 8
HUNG_S = 60.0
"""A request that has had no token (nor its end) for this long is hung: the API's own limit on a silent
runner is 60 s (`chunk_silence_s`), after which it must end the stream with an error."""
HUNG_GRACE_S = 5.0
"""Given over `HUNG_S`, so that the API's error for a silent runner is not taken for a hang."""
REQUEST_CAP_S = 300.0
"""No request is waited on longer than this, tokens or not (the API's own start timeout); past it, hung."""
SERVED_AGAIN_GOAL_S = {"nats-server": 30.0}
DEFAULT_SERVED_AGAIN_GOAL_S = 15.0
SETTLE_S = 30.0
"""After the load pauses: how long State may take to drop its tasks and have its instances ready."""
BASELINE_S = 30.0
"""The least the baseline's window lasts; a fault's lasts at least twice its goal + 15 s."""
ERROR_PAUSE_S = 1.0
"""A client that got an error waits this long before its next request (an API that is down refuses at once)."""
PROBE_PAUSE_S = 0.25
"""The probe retries sooner: the first chat through after a fault is its, not one of the clients' retries."""
PROBE_MAX_TOKENS = 4
PROGRESSING_S = 5.0
"""A pause closes a request that had a token this recently; it waits for the others to end or be hung."""
STEADY_S = 45.0
"""After the load starts, how long the first tokens of all its chats may take before the fault strikes anyway."""
PROGRESS_EVERY_S = 10.0
NOTABLE = re.compile(r"ERROR|CRITICAL|Traceback|Exception|error|exited|restart|failed|lost|WARNING", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------- load


@dataclass
class Outcome:
    phase: int
    kind: str
    """answered, error, hung, truncated, or cut (still going when the soak paused: counted in no column)."""
    started: float
    ended: float
    first_token: float | None
    detail: str = ""
    probe: bool = False


@dataclass
class Slot:
    """One client's request in flight, as a pause sees it."""

    in_flight: bool = False
    started: float = 0.0
    last_token: float | None = None


@dataclass
class Load:
    """`CLIENTS` clients streaming chats one after another between `start` and `pause`, and a probe on demand;
    each outcome is recorded under the phase current when its request was sent."""

    http: httpx.AsyncClient
    api: str
    model: str
    max_tokens: int
    phase: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    before_first_token: int = 0
    """Requests in flight that have not had a token yet."""
    all_tokens_flowing: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while `before_first_token` is 0."""
    clients: dict[asyncio.Task[None], Slot] = field(default_factory=dict)
    pausing: bool = False
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def start(self, phase: int, max_requests: int) -> None:
        self.phase = phase
        self.pausing = False
        self.all_tokens_flowing.clear()  # the clients, about to run, each wait for a first token
        for _ in range(CLIENTS):
            slot = Slot()
            self.clients[asyncio.create_task(self.client(max_requests, slot))] = slot

    async def pause(self, struck_at: float) -> None:
        """Send no more requests. Those in flight since before the fault (`struck_at`) are waited for: whether
        they end well is what the fault tells. Of the later ones, each is closed once it has had a token in the
        last `PROGRESSING_S` (so it is not hung, and its task is the API's to cancel); the others are waited
        for until they end or are found hung."""
        self.pausing = True
        deadline = time.monotonic() + REQUEST_CAP_S
        while self.clients and time.monotonic() < deadline:
            now = time.monotonic()
            for task, slot in self.clients.items():
                progressing = slot.last_token is not None and now - slot.last_token < PROGRESSING_S
                if not slot.in_flight or (slot.started >= struck_at and progressing):
                    task.cancel()
            done, _ = await asyncio.wait(self.clients, timeout=0.25)
            for task in done:
                del self.clients[task]
        await self.stop()

    async def stop(self) -> None:
        for task in self.clients:
            task.cancel()
        await asyncio.gather(*self.clients, return_exceptions=True)
        self.clients = {}

    async def steady(self, timeout_s: float) -> None:
        """Wait until every client's request has had its first token (none is waiting for its prefill)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_tokens_flowing.wait(), timeout_s)

    def _waiting_first_token(self, change: int) -> None:
        self.before_first_token += change
        if self.before_first_token:
            self.all_tokens_flowing.clear()
        else:
            self.all_tokens_flowing.set()

    async def client(self, max_requests: int, slot: Slot) -> None:
        for _ in range(max_requests):
            if self.pausing:
                return
            outcome = await self.chat(self.max_tokens, slot=slot)
            if outcome.kind != "answered":
                await asyncio.sleep(ERROR_PAUSE_S)

    async def probe(self, until: float) -> None:
        """Chats of `PROBE_MAX_TOKENS` one after another, from now until one is answered or `until` passes.
        `jetshard up` runs with one batch slot beyond the clients' for it; it retries sooner than they do."""
        while time.monotonic() < until:
            with contextlib.suppress(TimeoutError):
                outcome = await asyncio.wait_for(self.chat(PROBE_MAX_TOKENS, probe=True), until - time.monotonic())
                if outcome.kind == "answered":
                    return
            await asyncio.sleep(PROBE_PAUSE_S)

    async def chat(self, max_tokens: int, probe: bool = False, slot: Slot | None = None) -> Outcome:
        slot = slot or Slot()
        slot.in_flight, slot.started, slot.last_token = True, time.monotonic(), None
        try:
            return await self._chat(max_tokens, probe, slot)
        finally:
            slot.in_flight = False

    async def _chat(self, max_tokens: int, probe: bool, slot: Slot) -> Outcome:
        phase, started = self.phase, time.monotonic()
        first_token: float | None = None

        def done(kind: str, detail: str = "") -> Outcome:
            outcome = Outcome(phase, kind, started, time.monotonic(), first_token, detail, probe)
            self.outcomes.append(outcome)
            return outcome

        body = {
            "model": self.model,
            "messages": fresh_prompts(1, self.rng)[0],
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        loop = asyncio.get_running_loop()
        cap = loop.time() + REQUEST_CAP_S
        silent_since = started
        self._waiting_first_token(+1)
        try:
            async with asyncio.timeout(min(cap, loop.time() + HUNG_S + HUNG_GRACE_S)) as deadline:
                async with self.http.stream("POST", f"{self.api}/v1/chat/completions", json=body) as response:
                    if response.status_code >= 400:
                        text = (await response.aread()).decode(errors="replace")
                        return done("error", f"HTTP {response.status_code} {_error_code(text)}")
                    finish = None
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue  # keep-alive comments (no progress), blank separators
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            return done("error", "SSE not JSON")
                        if "error" in chunk:
                            return done("error", f"SSE {_error_code(data)}")
                        for choice in chunk.get("choices") or []:
                            finish = choice.get("finish_reason") or finish
                            if (choice.get("delta") or {}).get("content"):
                                silent_since = slot.last_token = time.monotonic()
                                if first_token is None:
                                    first_token = silent_since
                                    self._waiting_first_token(-1)
                                deadline.reschedule(min(cap, loop.time() + HUNG_S + HUNG_GRACE_S))
                    return done("answered") if finish else done("truncated", "no finish reason, no error")
        except TimeoutError:
            if time.monotonic() - started >= REQUEST_CAP_S:
                return done("hung", f"no end within {REQUEST_CAP_S:.0f} s")
            what = "first token" if first_token is None else "token"
            return done("hung", f"no {what} for {HUNG_S:.0f} s")
        except httpx.HTTPError as error:
            return done("error", type(error).__name__)
        except asyncio.CancelledError:
            if probe:
                done("cut", "probe closed at the window's end")
            else:
                done("cut", f"closed by the soak as it paused (a token in the last {PROGRESSING_S:.0f} s)")
            raise
        finally:
            if first_token is None:
                self._waiting_first_token(-1)

    def of(self, phase: int) -> list[Outcome]:
        return [o for o in self.outcomes if o.phase == phase]


def _error_code(text: str) -> str:
    try:
        error = json.loads(text)["error"]
        return str(error.get("code") or error.get("type") or "?")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "(no error body)"


# ------------------------------------------------------------------------------------------ processes


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def role_of(process: psutil.Process) -> str | None:
    """Which part of the cluster `process` is: a service's name, `runner` or `nats-server`."""
    cmdline = _cmdline(process)
    if "jetshard_worker.runner" in cmdline:
        return "runner"
    if cmdline and Path(cmdline[0]).name == "nats-server":
        return "nats-server"
    if len(cmdline) >= 4 and cmdline[1:3] == ["-m", "jetshard"] and cmdline[3] in SERVICES:
        return cmdline[3]
    return None


def cluster_tree(up: subprocess.Popen[bytes]) -> dict[str, list[psutil.Process]]:
    """The processes under `jetshard up`, by role."""
    roles: dict[str, list[psutil.Process]] = {}
    with contextlib.suppress(psutil.Error):
        for process in psutil.Process(up.pid).children(recursive=True):
            role = role_of(process)
            if role is not None:
                roles.setdefault(role, []).append(process)
    return roles


def ours(home: Path) -> list[psutil.Process]:
    """Every process started with this soak's HOME: the cluster, wherever in the process tree it ended up."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if process.environ().get("HOME") == str(home):
                found.append(process)
    return found


def kill_all(processes: list[psutil.Process]) -> int:
    killed = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()  # psutil checks the pid still names the process it found (its start time)
            killed += 1
    psutil.wait_procs(processes, timeout=5)
    return killed


@contextlib.contextmanager
def swept(home: Path) -> Iterator[None]:
    """On the way out (Ctrl-C and SIGTERM included), SIGKILL whatever of the cluster outlived `jetshard up`."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # Also when started with SIGINT ignored (a background job of a script): Ctrl-C must stop the soak.
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if left := ours(home):
            print(f"killing {kill_all(left)} process(es) of the cluster that outlived jetshard up", flush=True)


# --------------------------------------------------------------------------------------------- checks


@dataclass
class Row:
    fault: str
    pids: str = ""
    outcomes: list[Outcome] = field(default_factory=list)
    served_again_s: float | None = None
    left_behind: list[str] = field(default_factory=list)
    killed_at: float = 0.0
    ready_again_s: float | None = None
    """When the API last turned to answering with every instance ready, from the kill on."""
    timeline: list[str] = field(default_factory=list)
    """The instances' statuses as they changed, from the kill on."""
    log_from: dict[Path, int] = field(default_factory=dict)
    log_to: dict[Path, int] = field(default_factory=dict)
    """Sizes of the cluster's logs when the fault struck and when its checks were done."""

    @property
    def goal_s(self) -> float | None:
        return None if self.fault == "baseline" else SERVED_AGAIN_GOAL_S.get(self.fault, DEFAULT_SERVED_AGAIN_GOAL_S)

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)

    def missed(self) -> list[str]:
        missed = []
        if self.count("hung"):
            missed.append("hung")
        if self.count("truncated"):
            missed.append("truncated")
        if self.left_behind:
            missed.append("left behind")
        if self.goal_s is not None and (self.served_again_s is None or self.served_again_s > self.goal_s):
            missed.append("served again")
        if self.fault == "baseline" and not self.count("answered"):
            missed.append("nothing answered")
        return missed


async def leftovers(
    http: httpx.AsyncClient, api: str, up: subprocess.Popen[bytes], home: Path, seen_tasks: set[str]
) -> list[str]:
    """What State and the process table hold that nothing will finish, once `SETTLE_S` has passed with no
    client waiting (or as soon as State holds no task and every instance is ready)."""
    deadline = time.monotonic() + SETTLE_S
    state: dict[str, Any] = {}
    instances: list[dict[str, Any]] = []
    while True:
        try:
            state = (await http.get(f"{api}/state", timeout=10)).json()
            instances = (await http.get(f"{api}/instances", timeout=10)).json()
        except (httpx.HTTPError, ValueError):
            state, instances = {}, []
        settled = state and not (set(state.get("tasks", {})) - seen_tasks)
        if settled and instances and all(i["status"] == "ready" for i in instances):
            break
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(1.0)
    found = []
    if not state:
        return ["no answer from GET /state"]
    tasks = {k: v for k, v in state.get("tasks", {}).items() if k not in seen_tasks}
    seen_tasks |= set(tasks)
    if tasks:
        shown = [
            f"{task_id} ({'started' if t.get('started') else 'queued'}, {t['instance_id']} "
            f"gen {t.get('generation', 0)})"
            for task_id, t in sorted(tasks.items())[:3]
        ]
        found.append(f"{len(tasks)} task(s) in State: {', '.join(shown)}{', …' if len(tasks) > 3 else ''}")
    if not instances:
        found.append("no instance")
    for instance in instances:
        if instance["status"] != "ready":
            reason = f": {instance['reason']}" if instance.get("reason") else ""
            found.append(f"instance {instance['instance_id']} {instance['status']}{reason}")
    tree = cluster_tree(up)
    missing = [role for role in ("nats-server", *SERVICES) if not tree.get(role)]
    if missing:
        found.append(f"not running: {', '.join(missing)}")
    shards = sum(len(i["shards"]) for i in instances)
    runners_in_tree = {p.pid for p in tree.get("runner", [])}
    runners = [p for p in ours(home) if role_of(p) == "runner"]
    outside = [p.pid for p in runners if p.pid not in runners_in_tree]
    if outside:
        found.append(f"runner pid(s) {outside} outside jetshard up's tree")
    if len(runners_in_tree) > shards:
        found.append(f"{len(runners_in_tree)} runners for {shards} shard(s)")
    return found


def log_files(root: Path) -> list[Path]:
    """The cluster's logs: the services', `jetshard up`'s, and the copies of the runners' (`save_runner_logs`)."""
    return sorted([*root.glob("data/logs/*.log"), *root.glob("runner-logs/*/*.log"), root / "up.log"])


def save_runner_logs(root: Path) -> None:
    """Copy the runners' logs out of the worker's scratch directory, which a worker removes when it stops."""
    for log in root.glob("tmp/jetshard-runners-*/*.log"):
        copy = root / "runner-logs" / log.parent.name / log.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copyfile(log, copy)


def log_marks(root: Path) -> dict[Path, int]:
    save_runner_logs(root)
    return {path: path.stat().st_size for path in log_files(root) if path.exists()}


def notable_lines(root: Path, marks: dict[Path, int], until: dict[Path, int], per_file: int = 12) -> list[str]:
    """The lines of the cluster's logs written between `marks` and `until` that look like trouble."""
    out = []
    for path in log_files(root):
        if not path.exists() or path not in until:
            continue  # not there yet when the row's checks ended
        with open(path, "rb") as file:
            file.seek(marks.get(path, 0))
            text = file.read(max(0, until[path] - marks.get(path, 0)))
        lines = [line for line in text.decode(errors="replace").splitlines() if NOTABLE.search(line)]
        if lines:
            out.append(f"  {path.relative_to(root)} ({len(lines)} such lines; the last {min(per_file, len(lines))}):")
            out += [f"    {line[:300]}" for line in lines[-per_file:]]
    return out


# ------------------------------------------------------------------------------------------------ soak


def elapsed(start: float) -> str:
    return f"[{time.monotonic() - start:5.0f} s]"


def summary(outcomes: list[Outcome]) -> str:
    counts = Counter(o.kind for o in outcomes)
    return ", ".join(f"{counts[k]} {k}" for k in ("answered", "error", "hung", "truncated", "cut"))


async def watch_instances(http: httpx.AsyncClient, api: str, row: Row, start: float) -> None:
    """Print (and keep in `row.timeline`) each change of the instances' statuses, and of the API's answering."""
    last = ""
    while True:
        ready = False
        try:
            instances = (await http.get(f"{api}/instances", timeout=5)).json()
            now = ", ".join(f"{i['instance_id']} gen {i['generation']} {i['status']}" for i in instances) or "none"
            ready = bool(instances) and all(i["status"] == "ready" for i in instances)
        except (httpx.HTTPError, ValueError) as error:
            now = f"API: {type(error).__name__}"
        if now != last:
            if ready:
                row.ready_again_s = time.monotonic() - row.killed_at
            line = f"+{time.monotonic() - row.killed_at:.1f} s {now}"
            row.timeline.append(line)
            print(f"{elapsed(start)} {row.fault}: {line}", flush=True)
            last = now
        await asyncio.sleep(0.5)


def served_again(outcomes: list[Outcome], since: float) -> float | None:
    """Seconds from `since` to the first token of a chat sent after it and answered."""
    answered = [o.first_token for o in outcomes if o.kind == "answered" and o.started >= since and o.first_token]
    return min(answered) - since if answered else None


async def soak(
    api: str,
    up: subprocess.Popen[bytes],
    root: Path,
    home: Path,
    args: argparse.Namespace,
    faults: list[str],
    end: float,
) -> list[Row]:
    """The baseline, then each fault in turn; `end` (monotonic) is when the last fault's checks should end."""
    start = time.monotonic()
    rows: list[Row] = []
    seen_tasks: set[str] = set()
    limits = httpx.Limits(max_connections=CLIENTS + 4, max_keepalive_connections=CLIENTS + 4)
    timeout = httpx.Timeout(HUNG_S + HUNG_GRACE_S, connect=5.0)
    # trust_env=False: no proxy from the environment; everything goes to the loopback API.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http:
        load = Load(http, api, args.model, args.max_tokens)
        probe: asyncio.Task[None] | None = None
        checks_s = 20.0
        """What the last pause and checks took."""
        try:
            for number, fault in enumerate(["baseline", *faults]):
                row = Row(fault)
                rows.append(row)
                began = time.monotonic()
                load.start(number, max_requests=int(args.duration_s))
                await load.steady(STEADY_S)
                # This row's share of the time left, less what the steady start took and the checks will take.
                share = (end - began) / (len(faults) + 1 - number) - (time.monotonic() - began) - checks_s
                window_s = max(share, 2 * row.goal_s + 15.0 if row.goal_s else BASELINE_S)
                row.log_from = log_marks(root)
                if number:
                    targets = cluster_tree(up).get(fault, [])
                    row.pids = ",".join(str(p.pid) for p in targets) or "none found"
                    if targets:
                        kill_all(targets)
                        at = time.strftime("%H:%M:%S")
                        print(f"{elapsed(start)} {fault}: killed pid {row.pids} (SIGKILL) at {at}", flush=True)
                    else:
                        print(f"{elapsed(start)} {fault}: no such process under jetshard up", flush=True)
                        row.left_behind.append(f"no {fault} process found to kill")
                else:
                    print(f"{elapsed(start)} baseline: the load is steady; probing as after a fault", flush=True)
                row.killed_at = time.monotonic()
                slot_end = row.killed_at + window_s
                probe = asyncio.create_task(load.probe(until=slot_end))
                watcher = asyncio.create_task(watch_instances(http, api, row, start))
                next_progress = time.monotonic() + PROGRESS_EVERY_S
                while time.monotonic() < slot_end:
                    await asyncio.sleep(0.5)
                    if row.served_again_s is None:
                        row.served_again_s = served_again(load.of(number), row.killed_at)
                        if row.served_again_s is not None:
                            print(f"{elapsed(start)} {fault}: served again {row.served_again_s:.1f} s after the kill")
                    if time.monotonic() >= next_progress:
                        next_progress += PROGRESS_EVERY_S
                        waiting = "" if row.served_again_s is not None else "; no chat answered since the kill yet"
                        print(f"{elapsed(start)} {fault}: {summary(load.of(number))}{waiting}", flush=True)
                print(f"{elapsed(start)} {fault}: pausing the load; State settles", flush=True)
                checks_began = time.monotonic()
                await load.pause(row.killed_at)
                await probe
                watcher.cancel()
                row.outcomes = load.of(number)
                row.served_again_s = served_again(row.outcomes, row.killed_at)
                row.left_behind += await leftovers(http, api, up, home, seen_tasks)
                row.log_to = log_marks(root)
                checks_s = time.monotonic() - checks_began
                print(
                    f"{elapsed(start)} {fault}: {summary(row.outcomes)}; left behind: "
                    f"{'; '.join(row.left_behind) or 'nothing'}",
                    flush=True,
                )
        finally:
            if probe is not None:
                probe.cancel()
            await load.stop()
            save_runner_logs(root)
    return rows


def report(rows: list[Row], root: Path) -> int:
    def seconds(row: Row) -> str:
        return "never" if row.served_again_s is None else f"{row.served_again_s:.1f}"

    header = [
        "fault",
        "requests",
        "answered",
        "error",
        "hung",
        "truncated",
        "closed at pause",
        "served again s",
        "goal s",
        "ready again s",
        "left behind",
        "goals",
    ]
    body = [
        [
            row.fault,
            str(len(row.outcomes)),
            str(row.count("answered")),
            str(row.count("error")),
            str(row.count("hung")),
            str(row.count("truncated")),
            str(row.count("cut")),
            seconds(row),
            "-" if row.goal_s is None else f"<= {row.goal_s:.0f}",
            "never" if row.ready_again_s is None else f"{row.ready_again_s:.1f}",
            "; ".join(row.left_behind) or "nothing",
            "MISSED: " + ", ".join(row.missed()) if row.missed() else "met",
        ]
        for row in rows
    ]
    print()
    print(table(header, body))
    print(
        f"goals: 0 hung (no token for {HUNG_S:.0f} s), 0 silently truncated, nothing left behind, served again "
        f"within {DEFAULT_SERVED_AGAIN_GOAL_S:.0f} s ({SERVED_AGAIN_GOAL_S['nats-server']:.0f} s for nats-server)"
    )
    faults = [r for r in rows if r.fault != "baseline"]
    met = sum(1 for r in faults if not r.missed())
    print(f"anchor: goals met for {met}/{len(faults)} faults" + ("" if not rows[0].missed() else "; baseline missed"))
    for row in rows:
        errors = Counter(o.detail for o in row.outcomes if o.kind != "answered")
        if errors:
            shown = ", ".join(f"{detail} x{n}" for detail, n in errors.most_common())
            print(f"  {row.fault} (pid {row.pids or '-'}): {shown}")
    missed = [r for r in rows if r.missed()]
    for row in missed:
        print(f"\n{row.fault}: {', '.join(row.missed())}; instances: {' -> '.join(row.timeline) or '?'}")
        print("notable log lines from the fault to its checks:")
        print("\n".join(notable_lines(root, row.log_from, row.log_to)) or "  (none)")
    return 1 if missed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=600.0, help="the whole run, startup included")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, in order, of {','.join(FAULTS)}")
    parser.add_argument("--model", default=DEMO, help="offline, so the demo or a model on disk")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every chat")
    parser.add_argument("--work-dir", type=Path, help="keep everything here (default: a temporary directory)")
    args = parser.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if unknown := [f for f in faults if f not in FAULTS]:
        parser.error(f"unknown fault(s) {unknown}; choose from {','.join(FAULTS)}")
    if not faults:
        parser.error("no fault chosen")

    print(machine_line())
    print(f"soak: {args.duration_s:.0f} s, {CLIENTS} streaming clients, max_tokens {args.max_tokens}, faults {faults}")
    began = time.monotonic()
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="jetshard-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    home = (root / "home").resolve()
    for sub in ("home", "xdg/data", "xdg/config", "xdg/cache", "xdg/state", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env = {
        "HOME": str(home),
        "XDG_DATA_HOME": str(root / "xdg/data"),
        "XDG_CONFIG_HOME": str(root / "xdg/config"),
        "XDG_CACHE_HOME": str(root / "xdg/cache"),
        "XDG_STATE_HOME": str(root / "xdg/state"),
        # A batch slot beyond the clients' for the probe, so that it never queues behind them.
        "JETSHARD_MAX_BATCH": str(CLIENTS + 1),
        "TMPDIR": str(root / "tmp"),  # the worker's runner scratch (and logs) land here, removed with the rest
    }
    code = 1
    try:
        with swept(home):
            print(f"starting jetshard up in {root} (the demo model is converted on first use)…", flush=True)
            with jetshard_up(root, args.model, ready_timeout_s=900.0, env=env) as (api, up):
                print(
                    f"{args.model} ready at {api} after {time.monotonic() - began:.0f} s; logs in {root / 'data/logs'}"
                )
                rows = asyncio.run(soak(api, up, root, home, args, faults, began + args.duration_s))
                code = report(rows, root)
    except KeyboardInterrupt:
        print("interrupted; stopped the cluster", flush=True)
        code = 130
    finally:
        if code == 0 and args.work_dir is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")
    print(f"soak took {time.monotonic() - began:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
