"""The downloader's file server: the model files this node holds completely, for the cluster's other downloaders.

HTTP/1.1 over TLS 1.3 with mutual authentication, one request per connection, GET only:

* `GET /v1/models/<org>/<name>/manifest`: the model's `.jetshard-manifest.json` (name, size and sha256 of every
  file whole on disk, and the Hub commit they came from), for a model complete here by its manifest;
* `GET /v1/models/<org>/<name>/files/<repo file name>`: one file that manifest lists, whole (200) or from a
  `Range: bytes=N-` / `bytes=N-M` (206): how an interrupted copy resumes.

Who may ask: the server presents this downloader session's self-signed certificate (`PeerIdentity`), named in the
node's storage report, and requires a client certificate that some other node's storage report names (`admit`):
the TLS context trusts those certificates alone, so a stranger's own certificate, or none, fails the handshake, and
after it the certificate is checked again against the current set (one a node has replaced since is refused).
Plain HTTP fails the handshake too.

What it serves: only model ids that validate, only files the model's manifest lists (a manifest never names a file
that is not whole), with the size the manifest records, and only where the path, symlinks resolved, stays inside the
model's directory: `..`, absolute names, NUL, `.jetshard` bookkeeping or a link out are a 4xx, never a byte of
anything else. Models without a manifest (another tool's copy on a read-only disk) are not served: nothing would
vouch for their bytes.

Speed: a copy is one stream per file; the server reads 4 MiB at a time (in a thread) and lets a few MiB queue in the
transport, so the TLS record layer, not Python, bounds the throughput. `os.sendfile` cannot be used under TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from jetshard_bus.tls_identity import PeerIdentity, certificate_der, server_context_for_any, trust
from jetshard_schema.ids import ModelId, parse_model_id

from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.locate import find_model
from jetshard_downloader.manifest import Manifest, read_manifest
from jetshard_downloader.paths import MANIFEST_NAME, check_repo_filename, file_in

log = logging.getLogger(__name__)

READ_SIZE = 4 * 1024 * 1024
WRITE_BUFFER_HIGH = 8 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 10.0
MAX_HEADER_LINES = 64
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_REASONS = {
    200: "OK",
    206: "Partial Content",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    416: "Range Not Satisfiable",
    500: "Internal Server Error",
}


@dataclass(frozen=True)
class Served:
    """A file the server may send: its path and the size its manifest records."""

    path: Path
    size: int


def served_manifest(dirs: ModelDirs, model_id: ModelId) -> tuple[Path, Manifest]:
    """The directory and manifest of `model_id` complete on this node; _Refused 404 where there is none."""
    found = find_model(dirs, model_id)
    if found is None or found.layout != "jetshard":
        raise _Refused(404, f"{model_id} is not complete on this node")
    manifest = read_manifest(found.path)
    if manifest is None or manifest.model_id != model_id:
        raise _Refused(404, f"{model_id} has no manifest on this node")
    return found.path, manifest


def served_file(dirs: ModelDirs, model_id: ModelId, name: str) -> Served:
    """The file `name` of `model_id` this node may serve (see module doc); _Refused otherwise."""
    try:
        check_repo_filename(name)
    except ValueError as error:
        raise _Refused(400, str(error)) from None
    model_dir, manifest = served_manifest(dirs, model_id)
    size = manifest.sizes().get(name)
    if size is None:
        raise _Refused(404, f"{model_id} has no file {name!r} here")
    path = file_in(model_dir, name)
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(Path(os.path.realpath(model_dir))):
        raise _Refused(403, f"{name!r} leads outside the model's directory")
    try:
        if not real.is_file() or real.stat().st_size != size:
            raise _Refused(404, f"{name!r} is not whole here")
    except OSError:
        raise _Refused(404, f"{name!r} is not here") from None
    return Served(real, size)


def parse_target(target: str) -> tuple[ModelId, str | None]:
    """(model id, file name or None for the manifest) of a request target; _Refused 400/404 for anything else."""
    if not target.startswith("/v1/models/") or "?" in target or "#" in target:
        raise _Refused(404, "no such route")
    parts = target[len("/v1/models/") :].split("/")
    if len(parts) < 3:
        raise _Refused(404, "no such route")
    org, name = unquote(parts[0]), unquote(parts[1])
    try:
        model_id = parse_model_id(f"{org}/{name}")
    except ValueError as error:
        raise _Refused(400, f"invalid model id: {error}") from None
    if parts[2:] == ["manifest"]:
        return model_id, None
    if parts[2] == "files" and len(parts) > 3:
        return model_id, unquote("/".join(parts[3:]))
    raise _Refused(404, "no such route")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a `Range` header over a file of `size` bytes; None without one; _Refused 416 if unusable."""
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        raise _Refused(416, "only a single byte range is served")
    start = int(match[1])
    end = int(match[2]) + 1 if match[2] else size
    if start > size or (start >= end and size > 0):
        raise _Refused(416, f"range {header!r} is outside the file's {size} bytes")
    return start, min(end, size)


class FileServer:
    """The server of one downloader session (see module doc)."""

    def __init__(self, dirs: ModelDirs, identity: PeerIdentity) -> None:
        self.dirs = dirs
        self.identity = identity
        self.context: ssl.SSLContext = server_context_for_any(identity, ())
        self._trusted: set[str] = set()
        self._allowed: set[bytes] = set()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.port = 0

    def admit(self, pems: set[str]) -> None:
        """Admit exactly the client certificates `pems` from now on (State's other nodes' storage reports)."""
        new = pems - self._trusted
        if new:
            trust(self.context, new)
            self._trusted |= new
        allowed = {der for der in (certificate_der(pem) for pem in pems) if der is not None}
        if allowed != self._allowed:
            log.info("the file server admits %d client certificates", len(allowed))
        self._allowed = allowed

    async def start(self, host: str, port: int = 0) -> int:
        self._server = await asyncio.start_server(
            self._accept, host or None, port, ssl=self.context, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await self._serve(reader, writer)
            # Everything written goes out before the connection closes (abort would drop what the transport holds).
            writer.close()
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                await writer.wait_closed()
        except (ConnectionError, TimeoutError, ssl.SSLError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except Exception:
            log.exception("the file server failed a request")
        finally:
            writer.transport.abort()  # nothing left to send by now, or a connection given up on
            if task is not None:
                self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if der is None or der not in self._allowed:
            log.warning("file server: refused a client whose certificate no node of the cluster names")
            return
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            request_line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
            headers: dict[str, str] = {}
            for _ in range(MAX_HEADER_LINES):
                line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
                if not line:
                    break
                key, _, value = line.partition(":")
                headers[key.strip().lower()] = value.strip()
        try:
            method, target, _version = request_line.split(" ")
            if method != "GET":
                raise _Refused(405, "only GET is served")
            model_id, name = parse_target(target)
            if name is None:
                model_dir, _ = await asyncio.to_thread(served_manifest, self.dirs, model_id)
                body = await asyncio.to_thread((model_dir / MANIFEST_NAME).read_bytes)
                await self._send_head(writer, 200, {"Content-Type": "application/json", "Content-Length": len(body)})
                writer.write(body)
                await writer.drain()
                return
            served = await asyncio.to_thread(served_file, self.dirs, model_id, name)
            span = parse_range(headers.get("range"), served.size)
        except _Refused as refused:
            await self._send_error(writer, refused)
            return
        except ValueError:
            await self._send_error(writer, _Refused(400, "malformed request"))
            return
        start, end = span if span is not None else (0, served.size)
        fields: dict[str, object] = {"Content-Type": "application/octet-stream", "Content-Length": end - start}
        if span is not None:
            fields["Content-Range"] = f"bytes {start}-{end - 1}/{served.size}"
        await self._send_head(writer, 206 if span is not None else 200, fields)
        log.info("sending %s/%s from byte %d of %d", model_id, name, start, served.size)
        await self._send_file(writer, served.path, start, end)

    async def _send_file(self, writer: asyncio.StreamWriter, path: Path, start: int, end: int) -> None:
        writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        f = await asyncio.to_thread(open, path, "rb")
        try:
            left = end - start
            while left > 0:
                chunk = await asyncio.to_thread(os.pread, f.fileno(), min(READ_SIZE, left), end - left)
                if not chunk:  # the file shrank under us: the client sees a short body and fails its size check
                    return
                writer.write(chunk)
                left -= len(chunk)
                await writer.drain()
        finally:
            f.close()

    async def _send_head(self, writer: asyncio.StreamWriter, status: int, fields: dict[str, object]) -> None:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "Connection: close"]
        lines += [f"{key}: {value}" for key, value in fields.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    async def _send_error(self, writer: asyncio.StreamWriter, refused: _Refused) -> None:
        body = str(refused).encode("utf-8", "replace")
        await self._send_head(writer, refused.status, {"Content-Type": "text/plain", "Content-Length": len(body)})
        writer.write(body)
        await writer.drain()
