"""What the LAN test does inside a host (a network namespace only its own processes reach): HTTP requests,
chats with the official `openai` client, and command traffic on the host's NATS. Prints JSON.

    lan_probe.py http METHOD URL [JSON]
    lan_probe.py chat API_URL MODEL MAX_TOKENS
    lan_probe.py traffic API_URL MODEL NATS_URL NKEY_FILE STOP_FILE OUT_FILE
    lan_probe.py outcomes NATS_URL NKEY_FILE IDS_FILE TIMEOUT_S
    lan_probe.py meta NATS_URL SYSTEM_NKEY_FILE
    lan_probe.py trespass NATS_URL WORKER_NKEY_FILE VICTIM_NODE
    lan_probe.py stream API_URL MODEL MAX_TOKENS OUT_FILE
    lan_probe.py stranger HOST PORT PEER_CERTIFICATE_FILE
    lan_probe.py tick NATS_URL SUBJECT
    lan_probe.py listen NATS_URL SUBJECT OUT_FILE
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nats
import nats.errors
from nats.aio.msg import Msg

sys.path[:0] = [str(Path(__file__).parents[1])]

QUESTION = "What is the capital of France? Answer in one word."


def http(method: str, url: str, body: str | None = None) -> None:
    request = urllib.request.Request(url, method=method, data=body.encode() if body else None)
    request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            print(json.dumps({"status": response.status, "body": json.loads(response.read() or b"null")}))
    except urllib.error.HTTPError as error:
        print(json.dumps({"status": error.code, "body": error.read().decode(errors="replace")}))


def chat(api: str, model: str, max_tokens: int) -> dict[str, object]:
    import openai

    client = openai.OpenAI(base_url=f"{api}/v1", api_key="none", timeout=120, max_retries=0)
    started = time.monotonic()
    try:
        completion = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens, temperature=0
        )
    except openai.APIError as error:
        return {"ok": False, "error": str(error)[:300], "at": started}
    usage = completion.usage
    return {
        "ok": True,
        "at": started,
        "text": completion.choices[0].message.content,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "seconds": time.monotonic() - started,
    }


async def traffic(api: str, model: str, nats_url: str, nkey: str, stop_file: Path) -> dict[str, object]:
    """Commands and chats until `stop_file` exists; every acked command with the time its ack came."""
    from jetshard_bus.connect import connect
    from jetshard_bus.options import NatsOptions
    from test_supervision import publish_surely

    client, js = await connect(NatsOptions(servers=(nats_url,), nkey_file=nkey), "lan-probe", declare_streams=False)
    acked: list[tuple[str, float]] = []
    chats: list[dict[str, object]] = []

    async def stopped() -> bool:
        return await asyncio.to_thread(stop_file.exists)

    async def commands() -> None:
        n = 0
        while not await stopped():
            acked.append((await publish_surely(js, n, "lan"), time.monotonic()))
            n += 1
            await asyncio.sleep(0.05)  # deliberate pacing: a steady stream of commands, not a flood

    async def chat_loop() -> None:
        while not await stopped():
            chats.append(await asyncio.to_thread(chat, api, model, 8))
            await asyncio.sleep(0.2)

    try:
        await asyncio.gather(commands(), chat_loop())
    finally:
        await client.close()
    return {"acked": acked, "chats": chats}


async def tick(nats_url: str, subject: str) -> None:
    """A core NATS message on `subject` every 50 ms, until killed: what a runner's chunks are to the routes."""
    client = await nats.connect(nats_url, max_reconnect_attempts=-1)
    for number in itertools.count():
        await client.publish(subject, str(number).encode())
        await asyncio.sleep(0.05)


async def listen(nats_url: str, subject: str, out: Path) -> None:
    """A line in `out` for each message on `subject`, until killed."""
    client = await nats.connect(nats_url, max_reconnect_attempts=-1)
    with out.open("a", buffering=1) as heard:

        async def note(message: Msg) -> None:
            heard.write(message.data.decode() + "\n")

        await client.subscribe(subject, cb=note)
        await asyncio.Event().wait()


async def outcomes(nats_url: str, nkey: str, wanted: list[str], timeout_s: float) -> None:
    from jetshard_bus.connect import connect
    from jetshard_bus.options import NatsOptions
    from test_sequencer import all_events, assert_gapless, outcomes_per_command

    client, js = await connect(NatsOptions(servers=(nats_url,), nkey_file=nkey), "lan-probe", declare_streams=False)
    try:
        deadline = time.monotonic() + timeout_s
        per: dict = {}
        while True:
            try:
                per = outcomes_per_command(assert_gapless(await all_events(js)))
            except nats.errors.Error:  # a 503 while the returning machine's server rejoins the meta group
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)
                continue
            missing = [c for c in wanted if c not in per]
            if not missing or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        kinds = {c: [type(e.event).__name__ for e in per.get(c, [])] for c in wanted}
        print(json.dumps({"missing": missing, "kinds": sorted({tuple(k) for k in kinds.values()})}))
    finally:
        await client.close()


async def trespass(nats_url: str, nkey: str, victim: str) -> dict[str, object]:
    """As this host's worker, try to read the last prompt stored for `victim` and to speak for it: what the
    server let through (each attempt: True if it succeeded)."""
    from jetshard_bus.inbox import inbox_prefix, public_key_of
    from jetshard_schema import subjects
    from jetshard_schema.codec import encode
    from jetshard_schema.commands import ReportNodeStorage
    from jetshard_schema.ids import NodeId
    from jetshard_schema.types import NodeStorage

    refusals: list[str] = []

    async def on_error(error: Exception) -> None:
        refusals.append(str(error))

    client = await nats.connect(
        nats_url, nkeys_seed=nkey, inbox_prefix=inbox_prefix(public_key_of(Path(nkey))), error_cb=on_error
    )
    js = client.jetstream()
    got: dict[str, object] = {}

    async def attempt(name: str, action: object) -> None:
        try:
            await asyncio.wait_for(action, 3)  # type: ignore[arg-type]
            got[name] = True
        except (nats.errors.Error, TimeoutError):
            got[name] = False

    info = await js.stream_info(subjects.TASKS_STREAM)
    last = info.state.last_seq
    await attempt("read by sequence", js.get_msg(subjects.TASKS_STREAM, last))
    await attempt(
        "read the victim's by subject",
        js.get_msg(subjects.TASKS_STREAM, subject=subjects.node_tasks(victim), direct=True),
    )
    report = ReportNodeStorage(node_id=NodeId(victim), storage=NodeStorage())
    await attempt("report for the victim", js.publish(report.subject, encode(report)))
    heard = await client.subscribe(f"{subjects.TASK_PREFIX}.>")
    await client.flush()
    await asyncio.sleep(1)
    got["subscriptions refused"] = sum("subscription" in r.lower() for r in refusals)
    got["prompts heard"] = heard.pending_msgs
    await client.close()
    return got


def stream(api: str, model: str, max_tokens: int, out: Path) -> None:
    """A long streamed chat: `out` + ".first" appears with the first chunk; `out` holds how the stream ended (its
    error, if any) and when, by the machine's monotonic clock (one clock for every namespace)."""
    import openai

    client = openai.OpenAI(base_url=f"{api}/v1", api_key="none", timeout=600, max_retries=0)
    chunks, ended = 0, {"ok": True, "error": ""}
    try:
        for _ in client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me a very long story about a dragon and a knight."}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        ):
            chunks += 1
            if chunks == 1:
                Path(f"{out}.first").write_text(json.dumps({"at": time.monotonic()}))
    except openai.APIError as error:
        ended = {"ok": False, "error": str(error)[:500]}
    out.write_text(json.dumps({**ended, "chunks": chunks, "at": time.monotonic()}))


def stranger(host: str, port: int, peer_certificate: str) -> dict[str, str]:
    """Knock on a rank's endpoint as a stranger: in the clear with llama.cpp RPC's greeting (its HELLO command), and
    over TLS with a certificate of its own. What came back each way: "closed" (nothing), "alert" (a TLS refusal) or
    the bytes it got."""
    import socket
    import ssl
    import tempfile

    from jetshard_worker.peer_tunnel import PeerIdentity, client_context

    hello = bytes([14]) + (0).to_bytes(8, "little")

    def knock(connection: socket.socket) -> str:
        try:
            connection.sendall(hello)
            answer = connection.recv(64)
        except ssl.SSLError:
            return "alert"
        except OSError as error:
            return type(error).__name__
        return answer.hex() if answer else "closed"

    got = {}
    with socket.create_connection((host, port), timeout=10) as plain:
        got["plain"] = knock(plain)
    with tempfile.TemporaryDirectory() as directory:
        own = PeerIdentity.create(Path(directory), "stranger")
        context = client_context(own, Path(peer_certificate).read_text())
        with socket.create_connection((host, port), timeout=10) as raw:
            try:
                tls = context.wrap_socket(raw)
            except ssl.SSLError:
                got["tls"] = "alert"
            else:
                got["tls"] = knock(tls)
    return got


def main(args: list[str]) -> None:
    match args:
        case ["http", method, url, *body]:
            http(method, url, body[0] if body else None)
        case ["chat", api, model, max_tokens]:
            print(json.dumps(chat(api, model, int(max_tokens))))
        case ["traffic", api, model, nats_url, nkey, stop_file, out]:
            Path(out).write_text(json.dumps(asyncio.run(traffic(api, model, nats_url, nkey, Path(stop_file)))))
        case ["meta", nats_url, nkey]:
            from jetshard_bus.options import NatsOptions

            from jetshard.lan.jetstream import meta_group

            group = asyncio.run(meta_group(NatsOptions(servers=(nats_url,), nkey_file=nkey)))
            print(json.dumps({"leader": group.leader, "current": sorted(group.current), "known": sorted(group.known)}))
        case ["outcomes", nats_url, nkey, ids_file, timeout_s]:
            asyncio.run(outcomes(nats_url, nkey, json.loads(Path(ids_file).read_text()), float(timeout_s)))
        case ["trespass", nats_url, nkey, victim]:
            print(json.dumps(asyncio.run(trespass(nats_url, nkey, victim))))
        case ["stream", api, model, max_tokens, out]:
            stream(api, model, int(max_tokens), Path(out))
        case ["stranger", host, port, peer_certificate]:
            print(json.dumps(stranger(host, int(port), peer_certificate)))
        case ["tick", nats_url, subject]:
            asyncio.run(tick(nats_url, subject))
        case ["listen", nats_url, subject, out]:
            asyncio.run(listen(nats_url, subject, Path(out)))
        case _:
            raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
