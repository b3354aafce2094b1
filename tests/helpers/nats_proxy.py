"""A NATS server that fails, from outside the product: a TCP proxy between one node's clients and the nats-server
that reads the client protocol's publishes (`PUB`, `HPUB`) and, for those a test names, either drops them, as a
server that fails drops messages in flight, or refuses them as a server does a payload past its limit (`-ERR
'Maximum Payload Violation'`, then the connection is closed; the NATS client then closes for good). Everything
else passes through untouched, both ways."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from collections.abc import Callable
from types import TracebackType
from urllib.parse import urlsplit


class Fault(enum.Enum):
    DROP = "drop"
    REFUSE = "refuse"


Faults = Callable[[str, bytes], Fault | None]
"""What befalls a publish, given its subject and payload (without headers): None, it passes."""

PAYLOAD_REFUSED = b"-ERR 'Maximum Payload Violation'\r\n"
"""What nats-server answers a publish past its max_payload, before it closes the connection."""


class FaultyNatsProxy:
    """Listens on `url`, forwards each connection to `upstream` (a nats:// URL), and has `faults` befall the
    publishes it names; runs its own event loop in a thread, so that blocking tests can use it. A context manager."""

    def __init__(self, upstream: str, faults: Faults) -> None:
        address = urlsplit(upstream)
        self._upstream = (address.hostname or "127.0.0.1", address.port or 4222)
        self._faults = faults
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._proxy, "127.0.0.1", 0), self._loop
        ).result(10)
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def __enter__(self) -> FaultyNatsProxy:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _proxy(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_writer.close()
            return
        pumps = [
            asyncio.create_task(self._client_to_server(client_reader, server_writer, client_writer)),
            asyncio.create_task(_copy(server_reader, client_writer)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            client_writer.close()
            server_writer.close()

    async def _client_to_server(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: asyncio.StreamWriter
    ) -> None:
        """One protocol line at a time; a publish's payload (its byte count last on its line, then CRLF) with it.
        Returns once a publish is refused: the connection is closed."""
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                line = await reader.readuntil(b"\r\n")
                operation = line.split(b" ", 1)[0].upper()
                if operation in (b"PUB", b"HPUB"):
                    fields = line.split()
                    size = int(fields[-1])
                    body = await reader.readexactly(size + 2)
                    headers = int(fields[-2]) if operation == b"HPUB" else 0
                    fault = self._faults(fields[1].decode(), body[headers:size])
                    if fault is Fault.DROP:
                        continue
                    if fault is Fault.REFUSE:
                        client.write(PAYLOAD_REFUSED)
                        await client.drain()
                        return
                    line += body
                writer.write(line)
                await writer.drain()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(64 * 1024):
            writer.write(data)
            await writer.drain()
